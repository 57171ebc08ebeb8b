package pgstore

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
)

// storeName is the Store field of every [dedup.StoreError] from this package.
const storeName = "postgres"

// Record states in the state column.
const (
	stateInProgress = 1
	stateCompleted  = 2
)

// Store is a [dedup.Store] on PostgreSQL. It is safe for concurrent use. It
// implements [dedup.Extender], [dedup.BatchClaimer], [dedup.Sweeper] and
// [dedup.Pinger], and offers a transactional inbox in the caller's
// transaction ([Store.Inbox], [Store.InboxSQL], [Store.RunInbox]) with an
// outbox ([Store.EnqueueOutbox]).
type Store struct {
	pool    *pgxpool.Pool
	ownPool bool
	cfg     config
	names   names
	sql     statements
	salt    uint64 // mixed into advisory lock keys, per schema and prefix
	closed  atomic.Bool
	// caseInbox makes RunInbox claim with the one-statement upsert of
	// Inbox (a CASE per column, no second read for duplicates) instead of
	// the acquire-only statement: set by tests and benchmarks to compare.
	caseInbox bool

	mu   sync.Mutex
	jobs map[*SweepJob]struct{}

	scopes scopeCache
	// converted is set once a claim learned that the old records tables
	// of migrations 0001-0005 are gone (Convert dropped them): claims
	// then stop moving old records first.
	converted atomic.Bool
	// guess decides when a plain ClaimBatch tries the insert of new keys
	// first (see claimNew and guessGate).
	guess guessGate
	// vac vacuums the plain records table as completions accumulate
	// (WithVacuum).
	vac vacuumer
}

// guessGate decides when ClaimBatch guesses that a batch's keys are all
// new and tries claimNew's plain INSERT before the full statement. A wrong
// guess is not free: the failed INSERT wastes the rows it wrote before the
// stored key (dead versions), logs a unique violation in the server's log
// and costs a second round trip. So the store guesses only after the full
// statement has seen a run of batches of new keys in a row, and each
// wrong guess doubles the run it waits for (1, 2, 4, ... up to
// maxGuessRun). A stream where stored keys turn up in batches often (a
// consumer taking redeliveries, or a low duplicate rate over large
// batches: 1% duplicates make 63% of batches of 100 hold one) soon stops
// guessing and claims as it did before the fast path; a stream of new keys
// guesses nearly always; and wrong guesses, with their log lines, number
// at most about log2(maxGuessRun) plus one per maxGuessRun batches.
type guessGate struct {
	mu   sync.Mutex
	run  int // batches of new keys in a row wanted after a wrong guess
	wait int // of those, still to see before the next guess
}

const maxGuessRun = 1024

// try reports whether the next batch may guess.
func (g *guessGate) try() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.wait == 0
}

// wrong records a guess that found a stored key. Guesses made at once
// by several callers, before any of them was found wrong, are one wrong
// guess: only the first doubles the run (wait is then set), or a burst of
// N concurrent batches would make it 2^N.
func (g *guessGate) wrong() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.wait > 0 {
		return
	}
	g.run = min(max(2*g.run, 1), maxGuessRun)
	g.wait = g.run
}

// full records a batch the full statement claimed: new reports whether
// every key in it was new.
func (g *guessGate) full(new bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	switch {
	case !new:
		g.wait = g.run
	case g.wait > 0:
		g.wait--
	}
}

var (
	_ dedup.Store        = (*Store)(nil)
	_ dedup.Extender     = (*Store)(nil)
	_ dedup.BatchClaimer = (*Store)(nil)
	_ dedup.Sweeper      = (*Store)(nil)
	_ dedup.Pinger       = (*Store)(nil)
)

// Open connects to the database named by connString (a URL such as
// postgres://user@host:5432/db?sslmode=disable or key=value pairs; pool
// settings such as pool_max_conns are read from it), checks that it
// answers, and returns a store that owns the pool: Close closes it.
//
// Open does not touch the schema: run [Store.Migrate] (or `dedup
// migrate`) to create it and [Store.Check] at start-up to verify it and
// hear about retention windows that are too short.
//
// A bad option gives a [*dedup.ArgumentError]; a connection string that
// does not parse or a server that does not answer gives a
// [*dedup.StoreError].
func Open(ctx context.Context, connString string, opts ...Option) (*Store, error) {
	cfg, err := buildConfig(opts)
	if err != nil {
		return nil, err
	}
	pcfg, err := ParsePoolConfig(connString)
	if err != nil {
		return nil, &dedup.StoreError{Store: storeName, Op: "open", Err: err, NotApplied: true}
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, &dedup.StoreError{Store: storeName, Op: "open", Err: err, NotApplied: true}
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, &dedup.StoreError{Store: storeName, Op: "open", NotApplied: true,
			Err: fmt.Errorf("%w (is PostgreSQL running at %s:%d?)", err, pcfg.ConnConfig.Host, pcfg.ConnConfig.Port)}
	}
	s := newStore(pool, cfg)
	s.ownPool = true
	return s, nil
}

// ParsePoolConfig parses connString as pgxpool.ParseConfig does and makes
// a cancelled context cancel the running statement on the server (a
// PostgreSQL cancel request) instead of only closing the connection, which
// is what [Open] uses. With pgx's default a claim cancelled while it waits
// for a lock is abandoned by the client but still runs on the server when
// the lock frees: the outcome is unknown and an orphaned lease holds the
// key until it expires. With a cancel request the server rolls the
// statement back and reports it, so the store error says NotApplied; the
// connection survives. Use it to build the pool you pass to [New].
func ParsePoolConfig(connString string) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.BuildContextWatcherHandler = func(c *pgconn.PgConn) ctxwatch.Handler {
		// The deadline is the fallback when the cancel request does not
		// get through: then the connection is closed and the outcome is
		// unknown, as with the default.
		return &pgconn.CancelRequestContextWatcherHandler{Conn: c, DeadlineDelay: 5 * time.Second}
	}
	return cfg, nil
}

// New returns a store on a pool the caller owns: Close leaves it open. It
// does no I/O.
func New(pool *pgxpool.Pool, opts ...Option) (*Store, error) {
	cfg, err := buildConfig(opts)
	if err != nil {
		return nil, err
	}
	if pool == nil {
		return nil, &dedup.ArgumentError{Arg: "pool", Reason: "is nil"}
	}
	return newStore(pool, cfg), nil
}

func buildConfig(opts []Option) (config, error) {
	cfg := defaultConfig()
	for _, o := range opts {
		if o != nil {
			o.apply(&cfg)
		}
	}
	return cfg, cfg.validate()
}

func newStore(pool *pgxpool.Pool, cfg config) *Store {
	s := &Store{pool: pool, cfg: cfg, names: newNames(cfg.schema, cfg.prefix), jobs: map[*SweepJob]struct{}{}}
	h := fnv.New64a()
	h.Write([]byte(cfg.schema + "." + cfg.prefix))
	s.salt = h.Sum64()
	s.sql = buildStatements(&s.names, &cfg)
	if cfg.vacuumMin > 0 && cfg.partition == 0 && pool.Config().MaxConns >= 2 {
		s.vac.min, s.vac.fraction = int64(cfg.vacuumMin), cfg.vacuumFraction
		s.vac.ctx, s.vac.cancel = context.WithCancel(context.Background())
	}
	return s
}

// Pool returns the store's connection pool, for the caller's own
// transactions (the inbox joins them). Do not close it if the store owns
// it; [Store.Close] does.
func (s *Store) Pool() *pgxpool.Pool { return s.pool }

// Tables names the store's tables, schema-qualified and quoted as SQL
// needs them.
type Tables struct {
	Schema                                                     string
	Records, RecordsPartitioned, Retention, Outbox, Migrations string
	// Scopes maps each scope to the integer the records store.
	Scopes string
}

// Tables returns the names of the store's tables.
func (s *Store) Tables() Tables {
	return Tables{Schema: s.names.schema, Records: s.names.records, RecordsPartitioned: s.names.recordsP, Retention: s.names.retention,
		Outbox: s.names.outbox, Migrations: s.names.migrations, Scopes: s.names.scopes}
}

// Partitioned reports whether the store uses the time-partitioned records
// table ([WithPartitions]).
func (s *Store) Partitioned() bool { return s.cfg.partition > 0 }

// Ping checks that the database answers.
func (s *Store) Ping(ctx context.Context) error {
	if err := s.begin(ctx, "ping"); err != nil {
		return err
	}
	if err := s.pool.Ping(ctx); err != nil {
		return s.fail(ctx, "ping", err, true)
	}
	return nil
}

// Close stops the store's sweep jobs and waits for them, then closes the
// pool if the store opened it. Later calls return [dedup.ErrClosed].
// Closing again does nothing and returns nil.
func (s *Store) Close() error {
	if !s.closed.CompareAndSwap(false, true) {
		return nil
	}
	s.mu.Lock()
	jobs := make([]*SweepJob, 0, len(s.jobs))
	for j := range s.jobs {
		jobs = append(jobs, j)
	}
	s.mu.Unlock()
	for _, j := range jobs {
		j.Close()
	}
	s.closeVacuum()
	if s.ownPool {
		s.pool.Close()
	}
	return nil
}

// begin is the common start of every call: closed store, done context.
func (s *Store) begin(ctx context.Context, op string) error {
	if s.closed.Load() {
		return dedup.ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return s.fail(ctx, op, err, true)
	}
	return nil
}

// fail wraps a failure of op in a [*dedup.StoreError]. notApplied says the
// caller knows nothing was applied; otherwise the error itself may show it
// (see notApplied). A context that is done is named as the cause even when
// the driver reports it differently.
func (s *Store) fail(ctx context.Context, op string, err error, known bool) *dedup.StoreError {
	if cerr := ctx.Err(); cerr != nil && !errors.Is(err, cerr) {
		err = fmt.Errorf("%w: %w", cerr, err)
	}
	if s.closed.Load() && !errors.Is(err, dedup.ErrClosed) {
		err = fmt.Errorf("%w: %w", dedup.ErrClosed, err)
	}
	transient := known && retryable(err)
	return &dedup.StoreError{Store: storeName, Op: op, Err: err, NotApplied: known || notApplied(err), Transient: transient}
}

// retryable reports whether err is a server condition between concurrent
// transactions that rolled the statement back and passes if tried again:
// SQLSTATE class 40 (serialization_failure, deadlock_detected, ...).
func retryable(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && strings.HasPrefix(pe.Code, "40")
}

// failAuto is fail for one statement in autocommit: an error the server
// reported for it (severity ERROR) means its implicit transaction rolled
// back, so nothing was applied.
func (s *Store) failAuto(ctx context.Context, op string, err error) *dedup.StoreError {
	return s.fail(ctx, op, err, statementFailed(err))
}

// notApplied reports whether err proves that nothing reached the server:
// pgconn says it is safe to retry (never sent), or no connection could be
// made.
func notApplied(err error) bool {
	if pgconn.SafeToRetry(err) {
		return true
	}
	var ce *pgconn.ConnectError
	return errors.As(err, &ce)
}

// statementFailed reports whether err is an error the server reported for
// a statement (severity ERROR), which rolls back its transaction. FATAL and
// PANIC end the session and say nothing certain about a commit.
func statementFailed(err error) bool {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		return false
	}
	sev := pe.SeverityUnlocalized
	if sev == "" {
		sev = pe.Severity
	}
	return sev == "ERROR"
}

// logger returns the configured logger or slog.Default().
func (s *Store) logger() *slog.Logger {
	if s.cfg.logger != nil {
		return s.cfg.logger
	}
	return slog.Default()
}

// lockKey returns the advisory lock key of a name in this store's schema
// and prefix.
func (s *Store) lockKey(name string) int64 {
	h := fnv.New64a()
	var b [8]byte
	for i := range b {
		b[i] = byte(s.salt >> (8 * i))
	}
	h.Write(b[:])
	h.Write([]byte(name))
	return int64(h.Sum64())
}

// keyLock returns the transaction-scoped advisory lock key of a dedup key
// (partitioned mode). Two keys that hash alike only wait for each other.
func (s *Store) keyLock(k dedup.Key) int64 {
	// FNV-1a, inlined to avoid allocating a hash.Hash per claim.
	const offset, prime = 14695981039346656037, 1099511628211
	h := uint64(offset) ^ s.salt
	for i := 0; i < len(k.Scope); i++ {
		h = (h ^ uint64(k.Scope[i])) * prime
	}
	h = (h ^ 0) * prime // keys have no NUL: an unambiguous separator
	for i := 0; i < len(k.ID); i++ {
		h = (h ^ uint64(k.ID[i])) * prime
	}
	return int64(h)
}

// micros returns d in whole microseconds, rounded up, for SQL intervals.
func micros(d time.Duration) int64 {
	us := int64(d / time.Microsecond)
	if d%time.Microsecond > 0 {
		us++ // round up, without the overflow of (d + 999ns) / 1us near the maximum
	}
	return min(us, maxMicros)
}

// maxMicros caps a duration sent to the server at the longest Duration
// (about 292 years): now plus it stays inside timestamptz's range, the
// statements then cap the deadline at dedup.MaxTime (see deadline), so
// "forever" stays forever, and an interval read back (a retention window)
// still fits a Duration.
const maxMicros = math.MaxInt64 / int64(time.Microsecond)

// fpBytes returns the fingerprint as a non-nil byte slice (pgx sends a nil
// slice as NULL).
func fpBytes(fp dedup.Fingerprint) []byte {
	if fp == "" {
		return []byte{}
	}
	return []byte(fp)
}
