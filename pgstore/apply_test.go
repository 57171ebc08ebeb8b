package pgstore_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// writesFor queues the business writes of message id: one effect row,
// then a running total that a CHECK keeps at most max.
func writesFor(fx, id string, amount int) *pgx.Batch {
	var b pgx.Batch
	b.Queue(`INSERT INTO `+fx+` (msg_id) VALUES ($1)`, id)
	b.Queue(`UPDATE `+fx+`_total SET total = total + $1`, amount)
	return &b
}

// applyTables creates the effects table and a one-row total with a CHECK.
func applyTables(t testing.TB, s *pgstore.Store) string {
	t.Helper()
	fx := business(t, s)
	if _, err := s.Pool().Exec(context.Background(), `CREATE TABLE `+fx+`_total (total int NOT NULL CHECK (total <= 1000)); INSERT INTO `+fx+`_total VALUES (0)`); err != nil {
		t.Fatal(err)
	}
	return fx
}

// lockTable begins a transaction that locks table against writes until it
// ends.
func lockTable(t testing.TB, table string) pgx.Tx {
	t.Helper()
	tx, err := testPool(t).Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(context.Background(), `LOCK TABLE `+table+` IN EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	return tx
}

func total(t testing.TB, s *pgstore.Store, fx string) int {
	t.Helper()
	return queryInt(t, s.Pool(), `SELECT total FROM `+fx+`_total`)
}

func mustApply(t testing.TB, s *pgstore.Store, id string, fp dedup.Fingerprint, result []byte, w *pgx.Batch, want dedup.Outcome) dedup.Claim {
	t.Helper()
	c, err := s.Apply(context.Background(), key(id), fp, day, result, w)
	if err != nil {
		t.Fatalf("Apply(%s): %v", id, err)
	}
	if c.Outcome != want {
		t.Fatalf("Apply(%s) = %v, want %v", id, c.Outcome, want)
	}
	return c
}

// TestApplyOnce: a new message's writes commit with its record; a
// redelivery is a duplicate with the stored result and writes nothing;
// another payload under the same key is a mismatch and writes nothing.
func TestApplyOnce(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		fx := applyTables(t, s)
		c := mustApply(t, s, "m1", fpA, []byte("receipt-1"), writesFor(fx, "m1", 10), dedup.Acquired)
		if string(c.Result) != "receipt-1" || c.Attempt != 1 || time.Until(c.ExpiresAt) < day-time.Hour || c.Token.IsZero() {
			t.Fatalf("acquired claim %+v", c)
		}
		for range 3 {
			d := mustApply(t, s, "m1", fpA, []byte("other"), writesFor(fx, "m1", 10), dedup.Duplicate)
			if string(d.Result) != "receipt-1" {
				t.Fatalf("duplicate result %q, want receipt-1", d.Result)
			}
		}
		mustApply(t, s, "m1", fpB, nil, writesFor(fx, "m1", 10), dedup.Mismatch)
		if n, tot := effects(t, s, fx, "m1"), total(t, s, fx); n != 1 || tot != 10 {
			t.Fatalf("%d effects, total %d; want 1 and 10", n, tot)
		}
		// The record is the inbox's: RunInbox and Claim see it as done.
		runInbox(t, s, "m1", apply(fx, "m1", nil), dedup.Duplicate)
		mustClaim(t, s, "m1", fpA, time.Minute, dedup.Duplicate)
		// No writes at all: the key alone is recorded.
		mustApply(t, s, "m2", "", nil, nil, dedup.Acquired)
		mustApply(t, s, "m2", fpA, nil, &pgx.Batch{}, dedup.Duplicate)
	})
}

// TestApplyFailedWriteLeavesNothing: a write that fails (here the second,
// on a CHECK) rolls back the record and the first write; the error is the
// statement's, unchanged; the redelivery with a good payload applies.
func TestApplyFailedWriteLeavesNothing(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		fx := applyTables(t, s)
		_, err := s.Apply(context.Background(), key("big"), fpA, day, nil, writesFor(fx, "big", 5000))
		var pe *pgconn.PgError
		if !errors.As(err, &pe) || pe.Code != "23514" || dedup.IsStoreError(err) {
			t.Fatalf("Apply with a write that breaks a CHECK = %v; want the check violation, unchanged", err)
		}
		if n, r, tot := effects(t, s, fx, "big"), countRecords(t, s, "big"), total(t, s, fx); n != 0 || r != 0 || tot != 0 {
			t.Fatalf("after the failed write: %d effects, %d records, total %d; want nothing", n, r, tot)
		}
		mustApply(t, s, "big", fpA, nil, writesFor(fx, "big", 500), dedup.Acquired)
		if tot := total(t, s, fx); tot != 500 {
			t.Fatalf("total %d after the redelivery, want 500", tot)
		}
	})
}

// TestApply64ConcurrentOneEffect: 64 goroutines apply one message at
// once: exactly one commits its writes, every other sees a duplicate.
func TestApply64ConcurrentOneEffect(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		fx := applyTables(t, s)
		var wg sync.WaitGroup
		var mu sync.Mutex
		got := map[dedup.Outcome]int{}
		for range 64 {
			wg.Go(func() {
				c, err := s.Apply(context.Background(), key("hot"), fpA, day, []byte("r"), writesFor(fx, "hot", 1))
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				got[c.Outcome]++
				mu.Unlock()
			})
		}
		wg.Wait()
		if got[dedup.Acquired] != 1 || got[dedup.Duplicate] != 63 {
			t.Fatalf("outcomes %v, want 1 acquired and 63 duplicates", got)
		}
		if n, tot := effects(t, s, fx, "hot"), total(t, s, fx); n != 1 || tot != 1 {
			t.Fatalf("%d effects, total %d; want exactly one", n, tot)
		}
	})
}

// TestApplyWaitsForInboxTransaction: an Apply of a key that an open inbox
// transaction holds waits for it, then sees a duplicate if it commits or
// applies if it rolls back.
func TestApplyWaitsForInboxTransaction(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		for _, commit := range []bool{true, false} {
			s := openStore(t, m.opts...)
			fx := applyTables(t, s)
			ctx := context.Background()
			holder, err := s.Pool().Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if c, err := s.Inbox(ctx, holder, key("w"), fpA, day, apply(fx, "w", nil)); err != nil || c.Outcome != dedup.Acquired {
				t.Fatalf("Inbox = %v, %v", c.Outcome, err)
			}
			done := make(chan dedup.Claim, 1)
			go func() {
				c, err := s.Apply(ctx, key("w"), fpA, day, nil, writesFor(fx, "w", 1))
				if err != nil {
					t.Error(err)
				}
				done <- c
			}()
			select {
			case c := <-done:
				t.Fatalf("Apply returned %v while the inbox transaction held the key", c.Outcome)
			case <-time.After(200 * time.Millisecond):
			}
			want := dedup.Duplicate
			if commit {
				err = holder.Commit(ctx)
			} else {
				err, want = holder.Rollback(ctx), dedup.Acquired
			}
			if err != nil {
				t.Fatal(err)
			}
			if c := <-done; c.Outcome != want {
				t.Fatalf("commit %v: Apply = %v, want %v", commit, c.Outcome, want)
			}
			if n := effects(t, s, fx, "w"); n != 1 {
				t.Fatalf("commit %v: %d effects, want 1", commit, n)
			}
		}
	})
}

// TestApplyLeaseRecords: a live lease-mode claim makes Apply report in
// progress; once the lease has run out Apply takes the key over (attempt
// 2) and the old owner's completion is fenced out; an expired completed
// record is applied again from attempt 1.
func TestApplyLeaseRecords(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		fx := applyTables(t, s)
		ctx := context.Background()
		old := mustClaim(t, s, "l", fpA, 300*time.Millisecond, dedup.Acquired)
		if c := mustApply(t, s, "l", fpA, nil, writesFor(fx, "l", 1), dedup.InProgress); c.LeaseUntil.IsZero() {
			t.Fatal("in progress without the lease's end")
		}
		time.Sleep(400 * time.Millisecond)
		if c := mustApply(t, s, "l", fpA, nil, writesFor(fx, "l", 1), dedup.Acquired); c.Attempt != 2 || !c.TakenOver {
			t.Fatalf("take-over claim %+v, want attempt 2", c)
		}
		if err := s.Complete(ctx, old, nil, day); !errors.Is(err, dedup.ErrLeaseLost) {
			t.Fatalf("the old owner's Complete = %v, want ErrLeaseLost", err)
		}
		e := mustClaim(t, s, "e", fpA, time.Minute, dedup.Acquired)
		if err := s.Complete(ctx, e, nil, 100*time.Millisecond); err != nil {
			t.Fatal(err)
		}
		time.Sleep(200 * time.Millisecond)
		if c := mustApply(t, s, "e", fpB, nil, writesFor(fx, "e", 1), dedup.Acquired); c.Attempt != 1 {
			t.Fatalf("claim over an expired record %+v, want attempt 1", c)
		}
		if n := effects(t, s, fx, "l") + effects(t, s, fx, "e"); n != 2 {
			t.Fatalf("%d effects, want 2", n)
		}
	})
}

// TestApplyRefusesBadInput: bad keys, retention, callbacks and
// transaction control fail before any I/O and write nothing.
func TestApplyRefusesBadInput(t *testing.T) {
	s := openStore(t)
	fx := applyTables(t, s)
	ctx := context.Background()
	withCallback := writesFor(fx, "x", 1)
	withCallback.Queue(`SELECT 1`).Exec(func(pgconn.CommandTag) error { return nil })
	for name, tc := range map[string]struct {
		key       dedup.Key
		retention time.Duration
		w         *pgx.Batch
	}{
		"empty id":           {dedup.Key{Scope: "s"}, day, writesFor(fx, "x", 1)},
		"zero retention":     {key("x"), 0, writesFor(fx, "x", 1)},
		"a result callback":  {key("x"), day, withCallback},
		"COMMIT":             {key("x"), day, func() *pgx.Batch { b := writesFor(fx, "x", 1); b.Queue(" commit"); return b }()},
		"BEGIN after a note": {key("x"), day, func() *pgx.Batch { var b pgx.Batch; b.Queue("/* x */ -- y\n BEGIN"); return &b }()},
		"SAVEPOINT":          {key("x"), day, func() *pgx.Batch { var b pgx.Batch; b.Queue("savepoint a"); return &b }()},
		"CALL behind nested comments": {key("x"), day, func() *pgx.Batch {
			b := writesFor(fx, "x", 1)
			b.Queue("/* /* */ INSERT */ CALL p()")
			return b
		}()},
		"a nil query": {key("x"), day, &pgx.Batch{QueuedQueries: []*pgx.QueuedQuery{nil}}},
	} {
		if _, err := s.Apply(ctx, tc.key, fpA, tc.retention, nil, tc.w); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("%s: Apply = %v, want ErrInvalidArgument", name, err)
		}
	}
	if n, r := effects(t, s, fx, "x"), countRecords(t, s, "x"); n != 0 || r != 0 {
		t.Fatalf("%d effects, %d records after refused calls", n, r)
	}
}

// TestApplyCancelled: a context cancelled while a write waits on a lock
// gives a store error wrapping the cancellation, and the record and the
// writes are both absent (they commit together or not at all); the
// redelivery applies.
func TestApplyCancelled(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		fx := applyTables(t, s)
		bg := context.Background()
		holder := lockTable(t, fx)
		ctx, cancel := context.WithTimeout(bg, 300*time.Millisecond)
		defer cancel()
		_, err := s.Apply(ctx, key("c"), fpA, day, nil, writesFor(fx, "c", 1))
		if !errors.Is(err, context.DeadlineExceeded) && pgCode(err) != "57014" {
			t.Fatalf("Apply cancelled mid-call = %v, want the cancellation", err)
		}
		if err := holder.Rollback(bg); err != nil {
			t.Fatal(err)
		}
		if n, r, tot := effects(t, s, fx, "c"), countRecords(t, s, "c"), total(t, s, fx); n != 0 || r != 0 || tot != 0 {
			t.Fatalf("after the cancelled call: %d effects, %d records, total %d", n, r, tot)
		}
		mustApply(t, s, "c", fpA, nil, writesFor(fx, "c", 1), dedup.Acquired)
	})
}

// TestApplyKillBackend: the backend is terminated while the pipeline
// waits on a lock: a store error, nothing committed, the redelivery
// applies once.
func TestApplyKillBackend(t *testing.T) {
	s, pid := onePool(t, false)
	fx := applyTables(t, s)
	bg := context.Background()
	holder := lockTable(t, fx)
	defer holder.Rollback(bg)
	done := make(chan error, 1)
	go func() {
		_, err := s.Apply(bg, key("k"), fpA, day, nil, writesFor(fx, "k", 1))
		done <- err
	}()
	watcher, err := pgstore.New(testPool(t))
	if err != nil {
		t.Fatal(err)
	}
	waitForLockWait(t, watcher, pid)
	if _, err := testPool(t).Exec(bg, `SELECT pg_terminate_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	if err := <-done; !dedup.IsStoreError(err) {
		t.Fatalf("Apply on a killed backend = %v, want a store error", err)
	}
	if err := holder.Rollback(bg); err != nil {
		t.Fatal(err)
	}
	if n, r := effects(t, s, fx, "k"), countRecords(t, s, "k"); n != 0 || r != 0 {
		t.Fatalf("after the kill: %d effects, %d records", n, r)
	}
	mustApply(t, s, "k", fpA, nil, writesFor(fx, "k", 1), dedup.Acquired)
	mustApply(t, s, "k", fpA, nil, writesFor(fx, "k", 1), dedup.Duplicate)
	if n := effects(t, s, fx, "k"); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
}

// TestApplyUnderRepeatableReadDefault: on a server whose default isolation
// is REPEATABLE READ, Apply still runs (it begins READ COMMITTED itself,
// which the partitioned store needs), on both layouts; a pool on the
// simple protocol is refused before any I/O.
func TestApplyUnderRepeatableReadDefault(t *testing.T) {
	for _, m := range modes {
		cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
		if err != nil {
			t.Fatal(err)
		}
		cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = "repeatable read"
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		s := openStoreOn(t, pool, freshSchema(t, testPool(t)), m.opts...)
		fx := applyTables(t, s)
		mustApply(t, s, "rr", fpA, nil, writesFor(fx, "rr", 1), dedup.Acquired)
		mustApply(t, s, "rr", fpA, nil, writesFor(fx, "rr", 1), dedup.Duplicate)
		if n := effects(t, s, fx, "rr"); n != 1 {
			t.Fatalf("%s: %d effects", m.name, n)
		}
	}
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	s := openStoreOn(t, pool, freshSchema(t, testPool(t)))
	if _, err := s.Apply(context.Background(), key("sp"), fpA, day, nil, nil); !errors.Is(err, dedup.ErrInvalidArgument) || !strings.Contains(err.Error(), "simple protocol") {
		t.Fatalf("Apply on a simple-protocol pool = %v, want ErrInvalidArgument naming the simple protocol", err)
	}
}

// TestApplyWriteCannotCommitEarly: writes that could commit in the middle
// of the pipeline (a procedure or a DO block that commits, VACUUM) are
// refused before any I/O, and DML calling a function that tries to commit
// fails: either way nothing is applied, not even the claim or the writes
// before them, and the redelivery applies everything once.
func TestApplyWriteCannotCommitEarly(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		fx := applyTables(t, s)
		ctx := context.Background()
		proc := s.Tables().Schema + ".commits"
		if _, err := s.Pool().Exec(ctx, `CREATE PROCEDURE `+proc+`() LANGUAGE plpgsql AS $$BEGIN COMMIT; END$$;
CREATE FUNCTION `+proc+`_fn() RETURNS int LANGUAGE plpgsql AS $$BEGIN COMMIT; RETURN 1; END$$`); err != nil {
			t.Fatal(err)
		}
		for name, stmt := range map[string]string{
			"a procedure that commits":        `CALL ` + proc + `()`,
			"a DO block that commits":         `DO $$BEGIN COMMIT; END$$`,
			"VACUUM":                          `VACUUM ` + fx,
			"a function that tries to commit": `SELECT ` + proc + `_fn()`,
		} {
			w := writesFor(fx, "early", 1)
			last := w.QueuedQueries[1]
			w.QueuedQueries[1] = &pgx.QueuedQuery{SQL: stmt}
			w.QueuedQueries = append(w.QueuedQueries, last)
			_, err := s.Apply(ctx, key("early"), fpA, day, nil, w)
			if refused := errors.Is(err, dedup.ErrInvalidArgument); err == nil || refused != (name != "a function that tries to commit") {
				t.Fatalf("%s: Apply = %v", name, err)
			}
			if n, r, tot := effects(t, s, fx, "early"), countRecords(t, s, "early"), total(t, s, fx); n != 0 || r != 0 || tot != 0 {
				t.Fatalf("%s: %d effects, %d records, total %d after the failed Apply: part of it committed", name, n, r, tot)
			}
		}
		mustApply(t, s, "early", fpA, nil, writesFor(fx, "early", 1), dedup.Acquired)
		mustApply(t, s, "early", fpA, nil, writesFor(fx, "early", 1), dedup.Duplicate)
		if n, tot := effects(t, s, fx, "early"), total(t, s, fx); n != 1 || tot != 1 {
			t.Fatalf("%d effects, total %d; want one", n, tot)
		}
	})
}

// TestApplyLockTimeoutIsStoreError: a write that times out on a lock
// (SQLSTATE 55P03), while being prepared or while running, is the
// server's condition, not the write's fault: a store error that says
// nothing was applied, to be retried; the retry applies once the lock is
// gone.
func TestApplyLockTimeoutIsStoreError(t *testing.T) {
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["lock_timeout"] = "100ms"
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	s := openStoreOn(t, pool, freshSchema(t, testPool(t)))
	fx := applyTables(t, s)
	mustApply(t, s, "warm", fpA, nil, writesFor(fx, "warm", 1), dedup.Acquired) // the writes are prepared now
	ctx := context.Background()
	for _, when := range []string{"running", "preparing"} {
		w := writesFor(fx, "lt", 1)
		if when == "preparing" {
			w.QueuedQueries[0].SQL += ` RETURNING msg_id` // a statement not prepared yet
		}
		holder, err := testPool(t).Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := holder.Exec(ctx, `LOCK TABLE `+fx+` IN ACCESS EXCLUSIVE MODE`); err != nil {
			t.Fatal(err)
		}
		_, err = s.Apply(ctx, key("lt"), fpA, day, nil, w)
		var se *dedup.StoreError
		if !errors.As(err, &se) || !se.SafeToRetry() || pgCode(err) != "55P03" {
			t.Fatalf("%s: Apply under a lock timeout = %v, want a NotApplied store error with 55P03", when, err)
		}
		if err := holder.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		if n, r := effects(t, s, fx, "lt"), countRecords(t, s, "lt"); n != 0 || r != 0 {
			t.Fatalf("%s: %d effects, %d records", when, n, r)
		}
	}
	mustApply(t, s, "lt", fpA, nil, writesFor(fx, "lt", 1), dedup.Acquired)
}

// TestApplyReusedBatch: one *pgx.Batch sent again after a call whose
// pipeline failed (a duplicate, a failed write), as a caller retrying with
// the same writes does, still runs: pgx forgets the prepared statements of
// a failed batch, and Apply never sends a query object pgx has prepared.
func TestApplyReusedBatch(t *testing.T) {
	s := openStore(t)
	fx := applyTables(t, s)
	w := writesFor(fx, "same", 400)
	mustApply(t, s, "r1", fpA, nil, w, dedup.Acquired)
	mustApply(t, s, "r1", fpA, nil, w, dedup.Duplicate)
	mustApply(t, s, "r2", fpA, nil, w, dedup.Acquired)
	if _, err := s.Apply(context.Background(), key("r3"), fpA, day, nil, w); pgCode(err) != "23514" {
		t.Fatalf("third apply of 400 = %v, want the CHECK violation", err)
	}
	if _, err := s.Pool().Exec(context.Background(), `UPDATE `+fx+`_total SET total = 0`); err != nil {
		t.Fatal(err)
	}
	mustApply(t, s, "r3", fpA, nil, w, dedup.Acquired)
	if n := effects(t, s, fx, "same"); n != 3 {
		t.Fatalf("%d effects, want 3", n)
	}
}

// TestApplyBadWrite: a write the server cannot prepare, or whose argument
// pgx cannot encode, fails as the write's error (not as a store failure,
// which a consumer would retry forever), and nothing is recorded.
func TestApplyBadWrite(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		fx := applyTables(t, s)
		if _, err := s.Pool().Exec(context.Background(), `CREATE SEQUENCE `+fx+`_seq`); err != nil {
			t.Fatal(err)
		}
		for name, w := range map[string]func() *pgx.Batch{
			"a syntax error": func() *pgx.Batch { b := writesFor(fx, "w", 1); b.Queue(`INSERT INTO nowhere VALUES (`); return b },
			"a missing table": func() *pgx.Batch {
				b := writesFor(fx, "w", 1)
				b.Queue(`INSERT INTO no_such_table VALUES (1)`)
				return b
			},
			"currval before nextval (55000)": func() *pgx.Batch {
				b := writesFor(fx, "w", 1)
				b.Queue(`SELECT currval('` + fx + `_seq')`)
				return b
			},
			"an unencodable argument": func() *pgx.Batch {
				var b pgx.Batch
				b.Queue(`INSERT INTO `+fx+` (msg_id) VALUES ($1)`, make(chan int))
				return &b
			},
		} {
			_, err := s.Apply(context.Background(), key("w"), fpA, day, nil, w())
			if err == nil || dedup.IsStoreError(err) {
				t.Errorf("%s: Apply = %v, want the write's error, not a store error", name, err)
			}
			if n, r := effects(t, s, fx, "w"), countRecords(t, s, "w"); n != 0 || r != 0 {
				t.Fatalf("%s: %d effects, %d records", name, n, r)
			}
		}
		mustApply(t, s, "w", fpA, nil, writesFor(fx, "w", 1), dedup.Acquired)
	})
}

// TestApplyOtherQueryModes: on pools in pgx's other extended-protocol
// modes (no named prepared statements, as for a transaction pooler),
// Apply applies once, reads a duplicate, and reports a failing write.
func TestApplyOtherQueryModes(t *testing.T) {
	for _, qm := range []pgx.QueryExecMode{pgx.QueryExecModeExec, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeDescribeExec} {
		cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
		if err != nil {
			t.Fatal(err)
		}
		cfg.ConnConfig.DefaultQueryExecMode = qm
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		s := openStoreOn(t, pool, freshSchema(t, testPool(t)))
		fx := applyTables(t, s)
		mustApply(t, s, "q", fpA, []byte("r"), writesFor(fx, "q", 1), dedup.Acquired)
		if d := mustApply(t, s, "q", fpA, nil, writesFor(fx, "q", 1), dedup.Duplicate); string(d.Result) != "r" {
			t.Fatalf("mode %v: duplicate result %q", qm, d.Result)
		}
		if _, err := s.Apply(context.Background(), key("q2"), fpA, day, nil, writesFor(fx, "q2", 5000)); pgCode(err) != "23514" {
			t.Fatalf("mode %v: failing write = %v, want the CHECK violation", qm, err)
		}
		unencodable := writesFor(fx, "q2", 1)
		unencodable.Queue(`INSERT INTO `+fx+` (msg_id) VALUES ($1)`, make(chan int))
		if _, err := s.Apply(context.Background(), key("q2"), fpA, day, nil, unencodable); err == nil || dedup.IsStoreError(err) {
			t.Fatalf("mode %v: an unencodable argument = %v, want the write's error, not a store error", qm, err)
		}
		mustApply(t, s, "q2", fpA, nil, writesFor(fx, "q2", 1), dedup.Acquired)
		if n, tot := effects(t, s, fx, "q")+effects(t, s, fx, "q2"), total(t, s, fx); n != 2 || tot != 2 {
			t.Fatalf("mode %v: %d effects, total %d", qm, n, tot)
		}
	}
}
