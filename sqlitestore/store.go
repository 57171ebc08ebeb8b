package sqlitestore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"net/url"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup"
	_ "modernc.org/sqlite" // registers the "sqlite" driver
)

// storeName is the Store field of every [dedup.StoreError] from this package.
const storeName = "sqlite"

// Record states in the state column.
const (
	stateInProgress = 1
	stateCompleted  = 2
)

// InProgressGrace is how long after its lease ended an in-progress record
// is kept before [Store.Sweep] may delete it. Until it is swept, the next
// claim takes it over and learns that an earlier attempt may have applied
// part of the effect (Claim.TakenOver, attempt + 1); after it is swept, the
// next claim starts again at attempt 1. An owner that comes back after the
// record was swept gets [dedup.ErrLeaseLost].
const InProgressGrace = 24 * time.Hour

// Store is a [dedup.Store] in one SQLite file. It is safe for concurrent use
// by many goroutines, and several processes on one machine may open the
// same file. It implements [dedup.Extender], [dedup.BatchClaimer],
// [dedup.Sweeper] and [dedup.Pinger], and offers a transactional inbox
// ([Store.Inbox], [Store.RunInbox]) for business writes in the same file.
type Store struct {
	db     *sql.DB
	clock  dedup.Clock
	table  string
	closed atomic.Bool

	// writers lets one write of this store at a time ask SQLite for the
	// write lock; see enter.
	writers     chan struct{}
	busyTimeout time.Duration
	sweeper     *sweeper // with WithSweepInterval; see sweep.go
	scopes      scopeIDs // scope names to their ids; see schema.go

	claimStmt     *sql.Stmt
	completeStmt  *sql.Stmt
	releaseStmt   *sql.Stmt
	extendStmt    *sql.Stmt
	sweepStmt     *sql.Stmt
	inboxStmt     *sql.Stmt
	inboxDoneStmt *sql.Stmt
}

var (
	_ dedup.Store        = (*Store)(nil)
	_ dedup.Extender     = (*Store)(nil)
	_ dedup.BatchClaimer = (*Store)(nil)
	_ dedup.Sweeper      = (*Store)(nil)
	_ dedup.Pinger       = (*Store)(nil)
)

// Open opens the SQLite database at path, creating the file if it does not
// exist, switches it to WAL mode, creates the records table, its scopes
// table and its index if they are missing, and prepares the statements the
// store uses.
//
// A records table in an older layout (see [SchemaVersion]) is converted
// first: it is renamed aside, and its records move to the new table in
// batches of [MigrateBatch], each one short transaction, so that other
// processes on the file get the write lock in between. Open returns once
// all are moved. Stop processes running the older code before upgrading:
// during the conversion they do not see the records already moved, and
// after it their statements fail (closed, as any store error). A
// conversion cut short (a crash) goes on at the next Open.
//
// A bad option or an empty path gives an [*dedup.ArgumentError]; a file that
// cannot be opened, cannot use WAL, or holds a table of that name with
// another layout gives a [*dedup.StoreError].
func Open(path string, opts ...Option) (*Store, error) {
	cfg := defaultConfig()
	for _, o := range opts {
		if o != nil {
			o.apply(&cfg)
		}
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if path == "" {
		return nil, &dedup.ArgumentError{Arg: "path", Reason: "is empty"}
	}
	dsn, err := buildDSN(path, &cfg)
	if err != nil {
		return nil, err
	}
	db, err := sql.Open("sqlite", dsn)
	if err != nil {
		return nil, openError(err)
	}
	// database/sql keeps two idle connections by default; under parallel
	// load every further connection would be opened (and its pragmas run)
	// and closed again for each call.
	db.SetMaxIdleConns(max(4, runtime.GOMAXPROCS(0)))

	s := &Store{db: db, clock: cfg.clock, table: cfg.table,
		writers: make(chan struct{}, 1), busyTimeout: cfg.busyTimeout}
	if err := s.init(context.Background(), &cfg); err != nil {
		db.Close()
		return nil, openError(err)
	}
	s.startSweeper(cfg.sweepEvery, dedup.NewHooks(cfg.sweepHooks...))
	return s, nil
}

func openError(err error) error {
	return &dedup.StoreError{Store: storeName, Op: "open", Err: err, NotApplied: true}
}

// buildDSN returns a file: URI for path with the connection settings as
// query parameters; modernc.org/sqlite applies them to every connection it
// opens.
func buildDSN(path string, cfg *config) (string, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", &dedup.ArgumentError{Arg: "path", Reason: err.Error()}
	}
	p := filepath.ToSlash(abs)
	if !strings.HasPrefix(p, "/") {
		p = "/" + p // a Windows drive letter: file:///C:/dir/db
	}
	// EscapedPath escapes '?', '#', '%' and spaces and keeps the slashes;
	// SQLite decodes %HH in the path of a file: URI. The empty authority
	// ("file://" then the path) keeps a path that starts with two slashes
	// from being read as a host name.
	u := url.URL{Path: p}
	ms := (cfg.busyTimeout + time.Millisecond - 1) / time.Millisecond
	q := url.Values{}
	q.Add("_pragma", "busy_timeout("+strconv.FormatInt(int64(ms), 10)+")")
	q.Add("_pragma", "journal_mode(WAL)")
	q.Add("_pragma", "synchronous("+cfg.synchronous+")")
	q.Add("_pragma", "foreign_keys(1)")
	// Every transaction on the pool starts with BEGIN IMMEDIATE: it takes
	// the write lock (waiting up to the busy timeout) before its first
	// read, so two writers never both read and then deadlock upgrading.
	q.Set("_txlock", "immediate")
	return "file://" + u.EscapedPath() + "?" + q.Encode(), nil
}

// init checks WAL mode, creates the schema and prepares the statements.
func (s *Store) init(ctx context.Context, cfg *config) error {
	var mode string
	if err := s.db.QueryRowContext(ctx, "PRAGMA journal_mode").Scan(&mode); err != nil {
		return err
	}
	if !strings.EqualFold(mode, "wal") {
		return fmt.Errorf("the database is in journal mode %q, not WAL (is the file on a network file system?)", mode)
	}
	if err := s.migrate(ctx); err != nil {
		return err
	}
	t := tableNames(s.table).records
	stmts := []struct {
		dst **sql.Stmt
		sql string
	}{
		{&s.claimStmt, upsertSQL(t, stateInProgress)},
		{&s.inboxStmt, upsertSQL(t, stateCompleted)},
		// Complete: fenced by the token. A second Complete with the same
		// token matches the row (no error) and changes nothing, because
		// the CASEs only write while the row is still in progress. All
		// right-hand sides see the row as it was before the update.
		{&s.completeStmt, `UPDATE ` + t + ` SET
	result   = CASE WHEN state = 1 THEN ?1 ELSE result END,
	deadline = CASE WHEN state = 1 THEN ?2 ELSE deadline END,
	state    = 2
WHERE scope_id = ?3 AND id = ?4 AND token = ?5`},
		{&s.releaseStmt, `DELETE FROM ` + t + ` WHERE scope_id = ?1 AND id = ?2 AND token = ?3 AND state = 1`},
		{&s.extendStmt, `UPDATE ` + t + ` SET deadline = ?1
WHERE scope_id = ?2 AND id = ?3 AND token = ?4 AND state = 1`},
		{&s.inboxDoneStmt, `UPDATE ` + t + ` SET result = ?1
WHERE scope_id = ?2 AND id = ?3 AND token = ?4 AND state = 2`},
		// One bounded statement: the subquery walks the deadline index
		// and stops after limit rows. A completed record goes at its
		// expiry (?1, now), an in-progress one InProgressGrace after its
		// lease (?2).
		{&s.sweepStmt, `DELETE FROM ` + t + ` WHERE (scope_id, id) IN (
	SELECT scope_id, id FROM ` + t + ` WHERE deadline <= ?1 AND (state = 2 OR deadline <= ?2)
	ORDER BY deadline LIMIT ?3)`},
	}
	for _, st := range stmts {
		p, err := s.db.PrepareContext(ctx, st.sql)
		if err != nil {
			s.closeStmts()
			return fmt.Errorf("prepare statement on table %s: %w", t, err)
		}
		*st.dst = p
	}
	return nil
}

// upsertSQL returns the one statement of a claim. It inserts a record in
// state newState with the caller's new token or, when the key exists,
// overwrites it only if it is acquirable:
//
//   - completed and expired (deadline <= now), whatever its fingerprint:
//     a fresh record, attempt 1, the new fingerprint;
//   - in progress with an expired lease (deadline <= now) and a matching
//     fingerprint (either is NULL, or they are equal): a take-over,
//     attempt + 1, keeping the stored fingerprint unless it was NULL.
//
// Otherwise every column keeps its value. Every CASE tests the row as it
// was before the statement: SQLite evaluates all right-hand sides of an
// UPDATE before it assigns any. RETURNING gives the row as it is
// after the statement; the caller owns the key if and only if the returned
// token is its own. Parameters: ?1 scope id, ?2 id, ?3 token, ?4
// fingerprint (encodeFingerprint), ?5 now, ?6 the new deadline: the lease's
// end, or the expiry of an inbox record (times in unix nanoseconds).
//
// ON CONFLICT never raises, so inside a caller's transaction a conflict
// does not abort it.
func upsertSQL(table string, newState int) string {
	const acquirable = `(deadline <= ?5 AND (state = 2 OR fp IS NULL OR ?4 IS NULL OR fp = ?4))`
	st := strconv.Itoa(newState)
	return `INSERT INTO ` + table + ` (scope_id, id, state, token, fp, result, deadline, attempts)
VALUES (?1, ?2, ` + st + `, ?3, ?4, NULL, ?6, 1)
ON CONFLICT (scope_id, id) DO UPDATE SET
	state    = CASE WHEN ` + acquirable + ` THEN ` + st + ` ELSE state END,
	token    = CASE WHEN ` + acquirable + ` THEN excluded.token ELSE token END,
	fp       = CASE WHEN ` + acquirable + ` AND (state = 2 OR fp IS NULL) THEN excluded.fp ELSE fp END,
	result   = CASE WHEN ` + acquirable + ` THEN NULL ELSE result END,
	deadline = CASE WHEN ` + acquirable + ` THEN excluded.deadline ELSE deadline END,
	attempts = CASE WHEN ` + acquirable + ` THEN
			CASE WHEN state = 1 THEN attempts + 1 ELSE 1 END
		ELSE attempts END
RETURNING state, token, attempts, fp, result, deadline`
}

func (s *Store) closeStmts() {
	for _, st := range []*sql.Stmt{s.claimStmt, s.completeStmt, s.releaseStmt, s.extendStmt, s.sweepStmt, s.inboxStmt, s.inboxDoneStmt} {
		if st != nil {
			st.Close()
		}
	}
}

// DB returns the store's database handle, for the caller's own tables in
// the same file (the transactional inbox needs them there). Its
// transactions begin with BEGIN IMMEDIATE, so two writers never deadlock
// on a lock upgrade; keep them short, since SQLite has one writer at a
// time. Do not close it; [Store.Close] does.
func (s *Store) DB() *sql.DB { return s.db }

// Ping checks that the database answers.
func (s *Store) Ping(ctx context.Context) error {
	if s.closed.Load() {
		return dedup.ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return s.fail(ctx, "ping", err, true)
	}
	if err := s.db.PingContext(ctx); err != nil {
		return s.fail(ctx, "ping", err, true)
	}
	return nil
}

// Close closes the prepared statements and the database, and with it the
// handle returned by [Store.DB]. Calls that are running finish first; later
// calls return [dedup.ErrClosed]. Closing again does nothing and returns
// nil.
func (s *Store) Close() error {
	if !s.closed.CompareAndSwap(false, true) {
		return nil
	}
	s.stopSweeper()
	s.closeStmts()
	if err := s.db.Close(); err != nil {
		return &dedup.StoreError{Store: storeName, Op: "close", Err: err}
	}
	return nil
}

// enter waits until no other write of this store is running, for at most
// the busy timeout, and leave ends the write. SQLite admits one writer at
// a time and makes the others poll with growing sleeps (1 ms, 2 ms, 5 ms,
// ... 100 ms), so writers of one process that queue here instead are
// woken the moment the previous one finishes. It changes no outcome: every
// transition is still one statement, and writers in other processes and
// the caller's own transactions on DB() still wait on SQLite's lock.
func (s *Store) enter(ctx context.Context) error {
	select {
	case s.writers <- struct{}{}:
		return nil
	default:
	}
	t := time.NewTimer(s.busyTimeout)
	defer t.Stop()
	select {
	case s.writers <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return errors.New("timed out after " + s.busyTimeout.String() + " waiting for another write of this store")
	}
}

func (s *Store) leave() { <-s.writers }

// now returns the store clock's time in unix nanoseconds.
func (s *Store) now() int64 { return s.clock.Now().UnixNano() }

// fail wraps a failure of op in a [*dedup.StoreError]. A context that is
// done is named as the cause even when the driver reports it differently,
// and a store closed under a running call says so.
func (s *Store) fail(ctx context.Context, op string, err error, notApplied bool) *dedup.StoreError {
	if cerr := ctx.Err(); cerr != nil && !errors.Is(err, cerr) {
		err = fmt.Errorf("%w: %w", cerr, err)
	}
	if s.closed.Load() && !errors.Is(err, dedup.ErrClosed) {
		err = fmt.Errorf("%w: %w", dedup.ErrClosed, err)
	}
	return &dedup.StoreError{Store: storeName, Op: op, Err: err, NotApplied: notApplied}
}

// addNanos returns t + d, saturating at dedup.MaxTime instead of
// overflowing for a very long lease or retention.
func addNanos(t int64, d time.Duration) int64 { return dedup.DeadlineNanos(t, d) }

// subNanos returns t - d, saturating at the smallest int64.
func subNanos(t int64, d time.Duration) int64 {
	if t < math.MinInt64+int64(d) {
		return math.MinInt64
	}
	return t - int64(d)
}

func fromNanos(n int64) time.Time { return time.Unix(0, n).UTC() }
