package sqlitestore_test

import (
	"context"
	"database/sql"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/dedupkit/dedup/storetest"
)

func mustClaim(t testing.TB, s *sqlitestore.Store, id string, fp dedup.Fingerprint, lease time.Duration, want dedup.Outcome) dedup.Claim {
	t.Helper()
	c, err := s.Claim(context.Background(), key(id), fp, lease)
	if err != nil {
		t.Fatalf("Claim(%s): %v", id, err)
	}
	if c.Outcome != want {
		t.Fatalf("Claim(%s) = %v, want %v", id, c.Outcome, want)
	}
	return c
}

// A completed key is still a duplicate, and a held key still in progress,
// after the store is closed and the file opened again.
func TestPersistsAcrossReopen(t *testing.T) {
	path := filepath.Join(t.TempDir(), "persist.db")
	clock := storetest.NewClock()
	s, err := sqlitestore.Open(path, sqlitestore.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	done := mustClaim(t, s, "done", fpA, time.Minute, dedup.Acquired)
	if err := s.Complete(context.Background(), done, []byte("receipt"), day); err != nil {
		t.Fatal(err)
	}
	held := mustClaim(t, s, "held", fpA, time.Hour, dedup.Acquired)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	s, err = sqlitestore.Open(path, sqlitestore.WithClock(clock))
	if err != nil {
		t.Fatalf("reopen: %v", err)
	}
	defer s.Close()
	if d := mustClaim(t, s, "done", fpA, time.Minute, dedup.Duplicate); string(d.Result) != "receipt" {
		t.Fatalf("result after reopen = %q", d.Result)
	}
	mustClaim(t, s, "held", fpA, time.Minute, dedup.InProgress)
	if err := s.Complete(context.Background(), held, nil, day); err != nil {
		t.Fatalf("the owner from before the reopen cannot complete: %v", err)
	}
}

// Bad options and an empty path are argument errors, and create no file.
func TestOpenRejectsBadOptions(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "never.db")
	cases := map[string]struct {
		path string
		opts []sqlitestore.Option
	}{
		"empty path":         {"", nil},
		"empty table":        {path, []sqlitestore.Option{sqlitestore.WithTable("")}},
		"table with dash":    {path, []sqlitestore.Option{sqlitestore.WithTable("dedup-records")}},
		"table with quote":   {path, []sqlitestore.Option{sqlitestore.WithTable(`x"; DROP TABLE y; --`)}},
		"table with space":   {path, []sqlitestore.Option{sqlitestore.WithTable("a b")}},
		"table digit first":  {path, []sqlitestore.Option{sqlitestore.WithTable("1records")}},
		"table sqlite_":      {path, []sqlitestore.Option{sqlitestore.WithTable("SQLite_master")}},
		"table too long":     {path, []sqlitestore.Option{sqlitestore.WithTable(strings.Repeat("t", 65))}},
		"table non-ASCII":    {path, []sqlitestore.Option{sqlitestore.WithTable("tablé")}},
		"sync OFF":           {path, []sqlitestore.Option{sqlitestore.WithSynchronous("OFF")}},
		"sync empty":         {path, []sqlitestore.Option{sqlitestore.WithSynchronous("")}},
		"sync injection":     {path, []sqlitestore.Option{sqlitestore.WithSynchronous("FULL);(")}},
		"zero busy timeout":  {path, []sqlitestore.Option{sqlitestore.WithBusyTimeout(0)}},
		"negative busy time": {path, []sqlitestore.Option{sqlitestore.WithBusyTimeout(-time.Second)}},
		"nil clock":          {path, []sqlitestore.Option{sqlitestore.WithClock(nil)}},
	}
	for name, tc := range cases {
		s, err := sqlitestore.Open(tc.path, tc.opts...)
		if !errors.Is(err, dedup.ErrInvalidArgument) || s != nil {
			t.Errorf("%s: Open = %v, %v; want ErrInvalidArgument", name, s, err)
			if s != nil {
				s.Close()
			}
		}
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("a rejected Open touched the file: %v", err)
	}
}

// The options reach the database: table name, synchronous mode, WAL, the
// busy timeout and foreign keys.
func TestOpenAppliesOptions(t *testing.T) {
	for _, tc := range []struct {
		mode string
		want int // PRAGMA synchronous: 1 NORMAL, 2 FULL
	}{{"", 2}, {"FULL", 2}, {"normal", 1}, {"NORMAL", 1}} {
		opts := []sqlitestore.Option{sqlitestore.WithTable("custom_records_1"), sqlitestore.WithBusyTimeout(1500*time.Millisecond + 1)}
		if tc.mode != "" {
			opts = append(opts, sqlitestore.WithSynchronous(tc.mode))
		}
		s, err := sqlitestore.Open(filepath.Join(t.TempDir(), "opts.db"), opts...)
		if err != nil {
			t.Fatalf("Open with synchronous %q: %v", tc.mode, err)
		}
		var sync, busy, fk int
		var journal string
		// One connection, so the pragmas are read where they were set.
		conn, err := s.DB().Conn(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		for q, dst := range map[string]any{
			"PRAGMA synchronous":  &sync,
			"PRAGMA busy_timeout": &busy,
			"PRAGMA foreign_keys": &fk,
			"PRAGMA journal_mode": &journal,
		} {
			if err := conn.QueryRowContext(context.Background(), q).Scan(dst); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
		}
		var n int
		if err := conn.QueryRowContext(context.Background(), `SELECT count(*) FROM custom_records_1`).Scan(&n); err != nil {
			t.Fatalf("the custom table was not created: %v", err)
		}
		conn.Close()
		if sync != tc.want || busy != 1501 || fk != 1 || journal != "wal" {
			t.Errorf("synchronous %q: got synchronous=%d busy_timeout=%d foreign_keys=%d journal_mode=%s; want %d, 1501, 1, wal",
				tc.mode, sync, busy, fk, journal, tc.want)
		}
		mustClaim(t, s, "m1", fpA, time.Minute, dedup.Acquired)
		s.Close()
	}
}

// Two stores with different tables in one file do not see each other's
// keys.
func TestTablesAreIndependent(t *testing.T) {
	path := filepath.Join(t.TempDir(), "shared.db")
	a, err := sqlitestore.Open(path, sqlitestore.WithTable("records_a"))
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := sqlitestore.Open(path, sqlitestore.WithTable("records_b"))
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	ca := mustClaim(t, a, "m1", fpA, time.Minute, dedup.Acquired)
	if err := a.Complete(context.Background(), ca, []byte("a"), day); err != nil {
		t.Fatal(err)
	}
	mustClaim(t, b, "m1", fpB, time.Minute, dedup.Acquired)
}

// A table of the same name with another layout is refused, not written.
func TestOpenRefusesForeignTable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "foreign.db")
	s, err := sqlitestore.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.DB().Exec(`CREATE TABLE orders (id INTEGER PRIMARY KEY, total INTEGER)`); err != nil {
		t.Fatal(err)
	}
	s.Close()
	s, err = sqlitestore.Open(path, sqlitestore.WithTable("orders"))
	if err == nil || !dedup.IsStoreError(err) {
		if s != nil {
			s.Close()
		}
		t.Fatalf("Open on a business table = %v; want a store error", err)
	}
}

// Characters that mean something in a URI (space, ?, #, %) are escaped:
// the file lands at exactly the path given.
func TestOpenEscapesPath(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "a dir?x=1#frag%41")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "my db?.sqlite")
	s, err := sqlitestore.Open(path)
	if err != nil {
		t.Fatalf("Open(%q): %v", path, err)
	}
	mustClaim(t, s, "m1", fpA, time.Minute, dedup.Acquired)
	s.Close()
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("the database is not at %q: %v", path, err)
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), "my db?.sqlite") {
			t.Errorf("unexpected file %q in %q", e.Name(), dir)
		}
	}
}

// Transactions on DB() begin with BEGIN IMMEDIATE: an open transaction that
// has not written anything yet already holds the write lock, so a writer
// in another process (here another store on the file) waits for it.
func TestDBTransactionsAreImmediate(t *testing.T) {
	path := filepath.Join(t.TempDir(), "lock.db")
	a, err := sqlitestore.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := sqlitestore.Open(path, sqlitestore.WithBusyTimeout(time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	tx, err := a.DB().BeginTx(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	_, err = b.Claim(context.Background(), key("m1"), fpA, time.Minute)
	var se *dedup.StoreError
	if !errors.As(err, &se) || se.Store != "sqlite" || se.Op != "claim" {
		t.Fatalf("Claim while another connection's transaction is open = %v; want a busy store error", err)
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	// The failed claim wrote nothing.
	mustClaim(t, b, "m1", fpA, time.Minute, dedup.Acquired)
}

// A cancelled context fails every call with a store error that wraps
// context.Canceled and says nothing was applied, and writes nothing.
func TestCancelledContext(t *testing.T) {
	s, _ := open(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	own := mustClaim(t, s, "own", fpA, time.Minute, dedup.Acquired)
	h := apply("m1", nil)
	calls := map[string]func() error{
		"Claim": func() error { _, err := s.Claim(ctx, key("m1"), fpA, time.Minute); return err },
		"ClaimBatch": func() error {
			_, err := s.ClaimBatch(ctx, []dedup.ClaimRequest{{Key: key("m1")}}, time.Minute)
			return err
		},
		"Complete": func() error { return s.Complete(ctx, own, nil, day) },
		"Release":  func() error { return s.Release(ctx, own) },
		"Extend":   func() error { _, err := s.Extend(ctx, own, time.Hour); return err },
		"Sweep":    func() error { _, err := s.Sweep(ctx, 10); return err },
		"Ping":     func() error { return s.Ping(ctx) },
		"RunInbox": func() error { _, err := s.RunInbox(ctx, key("m1"), fpA, day, h); return err },
		"Inbox": func() error {
			tx, err := s.DB().Begin()
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback()
			_, err = s.Inbox(ctx, tx, key("m1"), fpA, day, h)
			return err
		},
	}
	for name, call := range calls {
		err := call()
		var se *dedup.StoreError
		if !errors.As(err, &se) || !errors.Is(err, context.Canceled) || !se.SafeToRetry() || se.Store != "sqlite" {
			t.Errorf("%s with a cancelled context: %v; want a *dedup.StoreError wrapping context.Canceled, safe to retry", name, err)
		}
	}
	mustClaim(t, s, "m1", fpA, time.Minute, dedup.Acquired)
	mustClaim(t, s, "own", fpA, time.Minute, dedup.InProgress)
	if c := mustClaim(t, s, "own", fpA, time.Minute, dedup.InProgress); !c.LeaseUntil.Equal(own.LeaseUntil) {
		t.Fatal("the cancelled Extend moved the lease")
	}
	if count(t, s, "effects", "m1") != 0 {
		t.Fatal("a cancelled inbox call ran the handler")
	}
}

// Every call after Close returns ErrClosed; closing again returns nil, and
// nothing panics.
func TestClosed(t *testing.T) {
	s, _ := open(t)
	ctx := context.Background()
	own := mustClaim(t, s, "own", fpA, time.Minute, dedup.Acquired)
	tx, err := s.DB().Begin()
	if err != nil {
		t.Fatal(err)
	}
	tx.Rollback()
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v, want nil", err)
	}
	h := apply("m1", nil)
	calls := map[string]func() error{
		"Claim": func() error { _, err := s.Claim(ctx, key("m1"), fpA, time.Minute); return err },
		"ClaimBatch": func() error {
			_, err := s.ClaimBatch(ctx, []dedup.ClaimRequest{{Key: key("m1")}}, time.Minute)
			return err
		},
		"Complete": func() error { return s.Complete(ctx, own, nil, day) },
		"Release":  func() error { return s.Release(ctx, own) },
		"Extend":   func() error { _, err := s.Extend(ctx, own, time.Hour); return err },
		"Sweep":    func() error { _, err := s.Sweep(ctx, 10); return err },
		"Ping":     func() error { return s.Ping(ctx) },
		"RunInbox": func() error { _, err := s.RunInbox(ctx, key("m1"), fpA, day, h); return err },
		"Inbox":    func() error { _, err := s.Inbox(ctx, tx, key("m1"), fpA, day, h); return err },
	}
	for name, call := range calls {
		if err := call(); !errors.Is(err, dedup.ErrClosed) {
			t.Errorf("%s after Close: %v, want ErrClosed", name, err)
		}
	}
	if err := s.DB().Ping(); err == nil {
		t.Error("DB() still answers after Close")
	}
}

// Sweep keeps an in-progress record until InProgressGrace after its lease
// ended, so a take-over still sees the earlier attempt; then deletes it.
func TestSweepInProgressGrace(t *testing.T) {
	s, clock := open(t)
	ctx := context.Background()
	mustClaim(t, s, "crashed", fpA, time.Minute, dedup.Acquired)
	clock.Advance(time.Minute + sqlitestore.InProgressGrace - time.Nanosecond)
	if n, err := s.Sweep(ctx, 100); err != nil || n != 0 {
		t.Fatalf("Sweep before the grace ended = %d, %v; want 0", n, err)
	}
	clock.Advance(time.Nanosecond)
	if n, err := s.Sweep(ctx, 100); err != nil || n != 1 {
		t.Fatalf("Sweep after the grace = %d, %v; want 1", n, err)
	}
	c := mustClaim(t, s, "crashed", fpA, time.Minute, dedup.Acquired)
	if c.Attempt != 1 || c.TakenOver {
		t.Fatalf("claim after the sweep = %+v; want a fresh attempt 1", c)
	}
	if err := s.Release(ctx, c); err != nil {
		t.Fatal(err)
	}
	// An extended lease moves the sweep time with it.
	held := mustClaim(t, s, "held", fpA, time.Minute, dedup.Acquired)
	if _, err := s.Extend(ctx, held, 48*time.Hour); err != nil {
		t.Fatal(err)
	}
	clock.Advance(sqlitestore.InProgressGrace + 2*time.Minute)
	if n, err := s.Sweep(ctx, 100); err != nil || n != 0 {
		t.Fatalf("Sweep of an extended lease = %d, %v; want 0", n, err)
	}
	mustClaim(t, s, "held", fpA, time.Minute, dedup.InProgress)
}

// Leases and retentions that overflow int64 nanoseconds saturate instead
// of wrapping into the past.
func TestHugeDurationsSaturate(t *testing.T) {
	s, clock := open(t)
	c := mustClaim(t, s, "m1", fpA, math.MaxInt64, dedup.Acquired)
	clock.Advance(100 * 365 * day)
	mustClaim(t, s, "m1", fpA, time.Minute, dedup.InProgress)
	if err := s.Complete(context.Background(), c, nil, math.MaxInt64); err != nil {
		t.Fatal(err)
	}
	clock.Advance(100 * 365 * day)
	mustClaim(t, s, "m1", fpA, time.Minute, dedup.Duplicate)
	if n, err := s.Sweep(context.Background(), 10); err != nil || n != 0 {
		t.Fatalf("Sweep = %d, %v; want nothing expired", n, err)
	}
}

// The times a claim reports are the store clock's, to the nanosecond.
func TestTimesComeFromTheClock(t *testing.T) {
	s, clock := open(t)
	clock.Advance(123456789 * time.Nanosecond)
	now := clock.Now()
	c := mustClaim(t, s, "m1", fpA, 90*time.Second, dedup.Acquired)
	if !c.LeaseUntil.Equal(now.Add(90 * time.Second)) {
		t.Fatalf("LeaseUntil = %v, want %v", c.LeaseUntil, now.Add(90*time.Second))
	}
	ext, err := s.Extend(context.Background(), c, time.Hour)
	if err != nil || !ext.LeaseUntil.Equal(now.Add(time.Hour)) || ext.Token != c.Token {
		t.Fatalf("Extend = %+v, %v; want lease until %v", ext, err, now.Add(time.Hour))
	}
	if err := s.Complete(context.Background(), c, []byte{}, 2*time.Hour); err != nil {
		t.Fatal(err)
	}
	d := mustClaim(t, s, "m1", fpA, time.Minute, dedup.Duplicate)
	if !d.ExpiresAt.Equal(now.Add(2 * time.Hour)) {
		t.Fatalf("ExpiresAt = %v, want %v", d.ExpiresAt, now.Add(2*time.Hour))
	}
	if d.Result != nil || d.Attempt != 1 {
		t.Fatalf("duplicate of an empty result = %+v; want a nil result (as memstore) and attempt 1", d)
	}
}

// A batch is one transaction: a failure part-way leaves none of its claims.
func TestClaimBatchIsAtomic(t *testing.T) {
	s, _ := open(t)
	// A trigger makes the third insert fail, after two have succeeded.
	if _, err := s.DB().Exec(`CREATE TRIGGER fail_third BEFORE INSERT ON dedup_records
		WHEN NEW.id = 'm3' BEGIN SELECT RAISE(ABORT, 'injected failure'); END`); err != nil {
		t.Fatal(err)
	}
	reqs := []dedup.ClaimRequest{{Key: key("m1"), Fingerprint: fpA}, {Key: key("m2"), Fingerprint: fpA}, {Key: key("m3"), Fingerprint: fpA}}
	_, err := s.ClaimBatch(context.Background(), reqs, time.Minute)
	var se *dedup.StoreError
	if !errors.As(err, &se) || !se.SafeToRetry() || !strings.Contains(err.Error(), "injected failure") {
		t.Fatalf("ClaimBatch with a failing item = %v; want a store error, safe to retry", err)
	}
	mustClaim(t, s, "m1", fpA, time.Minute, dedup.Acquired)
	mustClaim(t, s, "m2", fpA, time.Minute, dedup.Acquired)
}

// RunInbox reports a failed transaction as a store error; with the trigger
// the record insert fails and nothing is committed.
func TestRunInboxStoreError(t *testing.T) {
	s, _ := open(t)
	if _, err := s.DB().Exec(`CREATE TRIGGER fail_all BEFORE INSERT ON dedup_records
		BEGIN SELECT RAISE(ABORT, 'injected failure'); END`); err != nil {
		t.Fatal(err)
	}
	var runs int
	_, err := s.RunInbox(context.Background(), key("m1"), fpA, day, func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
		runs++
		return nil, nil
	})
	var se *dedup.StoreError
	if !errors.As(err, &se) || !se.SafeToRetry() || runs != 0 {
		t.Fatalf("RunInbox with a failing insert = %v, %d runs; want a store error, safe to retry, no run", err, runs)
	}
}

// hold starts a RunInbox whose handler blocks, so the store's writes
// queue behind it, and returns the function that lets it finish.
func hold(t *testing.T, s *sqlitestore.Store) (release func()) {
	inside, unblock := make(chan struct{}), make(chan struct{})
	done := make(chan error)
	go func() {
		_, err := s.RunInbox(context.Background(), key("slow"), fpA, day, func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
			close(inside)
			<-unblock
			return nil, nil
		})
		done <- err
	}()
	<-inside
	return func() {
		close(unblock)
		if err := <-done; err != nil {
			t.Errorf("the holding RunInbox: %v", err)
		}
	}
}

// A write that queues behind another write of the same store gives up
// after the busy timeout with a store error that says nothing was applied.
func TestQueuedWriteHonoursBusyTimeout(t *testing.T) {
	s, _ := open(t, sqlitestore.WithBusyTimeout(time.Millisecond))
	release := hold(t, s)
	_, err := s.Claim(context.Background(), key("m1"), fpA, time.Minute)
	release()
	var se *dedup.StoreError
	if !errors.As(err, &se) || !se.SafeToRetry() {
		t.Fatalf("Claim while another write holds the store = %v; want a store error, safe to retry", err)
	}
	mustClaim(t, s, "m1", fpA, time.Minute, dedup.Acquired)
}

// A write that queues behind another write of the same store gives up when
// its context is cancelled (the busy timeout here is far away).
func TestQueuedWriteHonoursContext(t *testing.T) {
	s, _ := open(t, sqlitestore.WithBusyTimeout(time.Hour))
	release := hold(t, s)
	defer release()
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error)
	go func() {
		_, err := s.Claim(ctx, key("m1"), fpA, time.Minute)
		errc <- err
	}()
	cancel()
	err := <-errc
	var se *dedup.StoreError
	if !errors.As(err, &se) || !se.SafeToRetry() || !errors.Is(err, context.Canceled) {
		t.Fatalf("Claim cancelled while queued = %v; want a store error wrapping context.Canceled, safe to retry", err)
	}
}
