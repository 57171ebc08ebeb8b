package sqlitestore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
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
// exist, switches it to WAL mode, creates the records table and its index
// if they are missing, and prepares the statements the store uses.
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
	s.startSweeper(cfg.sweepEvery)
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
	t := `"` + s.table + `"`
	schema := []string{
		`CREATE TABLE IF NOT EXISTS ` + t + ` (
	scope       TEXT    NOT NULL,
	id          TEXT    NOT NULL,
	state       INTEGER NOT NULL,         -- 1 in progress, 2 completed
	token       BLOB    NOT NULL,         -- owner token, 16 bytes
	fingerprint TEXT    NOT NULL DEFAULT '',
	result      BLOB,
	lease_until INTEGER NOT NULL,         -- unix nanoseconds
	expires_at  INTEGER NOT NULL,         -- unix nanoseconds; Sweep deletes rows past it
	attempts    INTEGER NOT NULL,
	created_at  INTEGER NOT NULL,         -- unix nanoseconds
	PRIMARY KEY (scope, id)
) STRICT, WITHOUT ROWID`,
		`CREATE INDEX IF NOT EXISTS "` + s.table + `_expires_at" ON ` + t + ` (expires_at)`,
	}
	for _, q := range schema {
		if _, err := s.db.ExecContext(ctx, q); err != nil {
			return err
		}
	}
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
	result     = CASE WHEN state = 1 THEN ?1 ELSE result END,
	expires_at = CASE WHEN state = 1 THEN ?2 ELSE expires_at END,
	state      = 2
WHERE scope = ?3 AND id = ?4 AND token = ?5`},
		{&s.releaseStmt, `DELETE FROM ` + t + ` WHERE scope = ?1 AND id = ?2 AND token = ?3 AND state = 1`},
		{&s.extendStmt, `UPDATE ` + t + ` SET lease_until = ?1, expires_at = ?2
WHERE scope = ?3 AND id = ?4 AND token = ?5 AND state = 1`},
		{&s.inboxDoneStmt, `UPDATE ` + t + ` SET result = ?1
WHERE scope = ?2 AND id = ?3 AND token = ?4 AND state = 2`},
		// One bounded statement: the subquery walks the expires_at index
		// and stops after limit rows.
		{&s.sweepStmt, `DELETE FROM ` + t + ` WHERE (scope, id) IN (
	SELECT scope, id FROM ` + t + ` WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2)`},
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
//   - completed and expired (expires_at <= now), whatever its fingerprint:
//     a fresh record, attempt 1, the new fingerprint;
//   - in progress with an expired lease and a matching fingerprint (either
//     is empty, or they are equal): a take-over, attempt + 1, keeping the
//     stored fingerprint unless it was empty.
//
// Otherwise every column keeps its value. Every CASE tests the row as it
// was before the statement: SQLite evaluates all right-hand sides of an
// UPDATE before it assigns any. RETURNING gives the row as it is
// after the statement; the caller owns the key if and only if the returned
// token is its own. Parameters: ?1 scope, ?2 id, ?3 token, ?4 fingerprint,
// ?5 now, ?6 lease_until, ?7 expires_at (all times unix nanoseconds).
//
// ON CONFLICT never raises, so inside a caller's transaction a conflict
// does not abort it.
func upsertSQL(table string, newState int) string {
	const acquirable = `((state = 2 AND expires_at <= ?5)
		OR (state = 1 AND lease_until <= ?5 AND (fingerprint = '' OR ?4 = '' OR fingerprint = ?4)))`
	st := strconv.Itoa(newState)
	return `INSERT INTO ` + table + ` (scope, id, state, token, fingerprint, result, lease_until, expires_at, attempts, created_at)
VALUES (?1, ?2, ` + st + `, ?3, ?4, NULL, ?6, ?7, 1, ?5)
ON CONFLICT (scope, id) DO UPDATE SET
	state       = CASE WHEN ` + acquirable + ` THEN ` + st + ` ELSE state END,
	token       = CASE WHEN ` + acquirable + ` THEN excluded.token ELSE token END,
	fingerprint = CASE WHEN ` + acquirable + ` THEN
			CASE WHEN state = 2 OR fingerprint = '' THEN excluded.fingerprint ELSE fingerprint END
		ELSE fingerprint END,
	result      = CASE WHEN ` + acquirable + ` THEN NULL ELSE result END,
	lease_until = CASE WHEN ` + acquirable + ` THEN excluded.lease_until ELSE lease_until END,
	expires_at  = CASE WHEN ` + acquirable + ` THEN excluded.expires_at ELSE expires_at END,
	attempts    = CASE WHEN ` + acquirable + ` THEN
			CASE WHEN state = 1 THEN attempts + 1 ELSE 1 END
		ELSE attempts END,
	created_at  = CASE WHEN ` + acquirable + ` AND state = 2 THEN excluded.created_at ELSE created_at END
RETURNING state, token, attempts, fingerprint, result, lease_until, expires_at`
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

func fromNanos(n int64) time.Time { return time.Unix(0, n).UTC() }
