package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// onePool returns a store in a fresh schema on a pool of one connection of
// its own (from ParsePoolConfig, as Open makes, or pgx's default), and the
// pid of that connection's backend: a test can then see whether RunInbox
// gave the connection back idle, or destroyed it.
func onePool(t *testing.T, cancelRequest bool, opts ...pgstore.Option) (*pgstore.Store, uint32) {
	t.Helper()
	var cfg *pgxpool.Config
	var err error
	if cancelRequest {
		cfg, err = pgstore.ParsePoolConfig(testenv.PostgresURL(t))
	} else {
		cfg, err = pgxpool.ParseConfig(testenv.PostgresURL(t))
	}
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	s := openStoreOn(t, pool, freshSchema(t, testPool(t)), opts...)
	return s, idleConn(t, s)
}

// idleConn checks that s's pool holds no acquired connection (s must have
// a pool of its own) and that the
// connection it hands out next is outside any transaction, and returns
// that connection's backend pid.
func idleConn(t testing.TB, s *pgstore.Store) uint32 {
	t.Helper()
	// A destroyed connection leaves the pool's count asynchronously.
	for i := 0; s.Pool().Stat().AcquiredConns() != 0; i++ {
		if i == 500 {
			t.Fatalf("%d connections still acquired", s.Pool().Stat().AcquiredConns())
		}
		time.Sleep(10 * time.Millisecond)
	}
	c, err := s.Pool().Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release()
	if st := c.Conn().PgConn().TxStatus(); st != 'I' {
		t.Fatalf("the pool handed out a connection in transaction status %q, want idle", st)
	}
	return c.Conn().PgConn().PID()
}

// sameConn checks that the pool of one connection still holds the
// connection with backend pid: it was given back idle, not destroyed.
func sameConn(t testing.TB, s *pgstore.Store, pid uint32) {
	t.Helper()
	if got := idleConn(t, s); got != pid {
		t.Fatalf("the connection was replaced (backend %d, was %d); want it given back idle", got, pid)
	}
}

// The handler's transaction nests on savepoints, as pgx's does: a nested
// commit keeps its writes, a nested rollback drops them, and both commit
// or not with the inbox record.
func TestRunInboxNestedTransactions(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		fx := business(t, s)
		insert := func(ctx context.Context, tx pgx.Tx, id string) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+fx+` (msg_id) VALUES ($1)`, id)
			return err
		}
		for _, result := range [][]byte{nil, []byte("r")} {
			id := "nested-" + string(result)
			c, err := s.RunInbox(context.Background(), key(id), fpA, day, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				kept, err := tx.Begin(ctx)
				if err != nil {
					return nil, err
				}
				if err := insert(ctx, kept, id+"/kept"); err != nil {
					return nil, err
				}
				inner, err := kept.Begin(ctx)
				if err != nil {
					return nil, err
				}
				if err := insert(ctx, inner, id+"/inner-dropped"); err != nil {
					return nil, err
				}
				if err := inner.Rollback(ctx); err != nil {
					return nil, err
				}
				if err := kept.Commit(ctx); err != nil {
					return nil, err
				}
				dropped, err := tx.Begin(ctx)
				if err != nil {
					return nil, err
				}
				if err := insert(ctx, dropped, id+"/dropped"); err != nil {
					return nil, err
				}
				if err := dropped.Rollback(ctx); err != nil {
					return nil, err
				}
				if err := dropped.Commit(ctx); !errors.Is(err, pgx.ErrTxClosed) {
					return nil, errors.New("commit of a rolled-back savepoint: " + errString(err))
				}
				return result, insert(ctx, tx, id)
			})
			if err != nil || c.Outcome != dedup.Acquired || string(c.Result) != string(result) {
				t.Fatalf("RunInbox with nested transactions = %+v, %v", c, err)
			}
			for suffix, want := range map[string]int{"": 1, "/kept": 1, "/inner-dropped": 0, "/dropped": 0} {
				if n := effects(t, s, fx, id+suffix); n != want {
					t.Errorf("%s%s: %d effects, want %d", id, suffix, n, want)
				}
			}
			if d := runInbox(t, s, id, apply(fx, id, nil), dedup.Duplicate); string(d.Result) != string(result) {
				t.Fatalf("stored result %q, want %q", d.Result, result)
			}
		}
	})
}

func errString(err error) string {
	if err == nil {
		return "nil"
	}
	return err.Error()
}

// After RunInbox returns, however the transaction ended, every method of
// the transaction the handler got (and of a nested one, and of its large
// objects) reports pgx.ErrTxClosed, and nothing runs on the connection,
// which is back in the pool.
func TestRunInboxTxClosedAfterReturn(t *testing.T) {
	for _, tc := range []struct {
		name   string
		result []byte
		nest   bool
		fail   bool
	}{
		{"committed", nil, false, false},
		{"committed with a result", []byte("r"), false, false},
		{"committed with a result after a nested transaction", []byte("r"), true, false},
		{"rolled back", nil, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s, pid := onePool(t, true)
			fx := business(t, s)
			var kept, nested pgx.Tx
			_, err := s.RunInbox(context.Background(), key("m1"), fpA, day, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				kept = tx
				if tc.nest {
					var err error
					if nested, err = tx.Begin(ctx); err != nil {
						return nil, err
					}
				}
				if tc.fail {
					return nil, io.ErrUnexpectedEOF
				}
				return tc.result, nil
			})
			if (err != nil) != tc.fail {
				t.Fatalf("RunInbox: %v", err)
			}
			ctx := context.Background()
			for _, tx := range []pgx.Tx{kept, nested} {
				if tx == nil {
					continue
				}
				_, e1 := tx.Exec(ctx, `INSERT INTO `+fx+` (msg_id) VALUES ('late')`)
				_, e2 := tx.Query(ctx, `SELECT 1`)
				var one int
				e3 := tx.QueryRow(ctx, `SELECT 1`).Scan(&one)
				_, e4 := tx.Begin(ctx)
				e5 := tx.SendBatch(ctx, &pgx.Batch{QueuedQueries: []*pgx.QueuedQuery{{SQL: `SELECT 1`}}}).Close()
				_, e6 := tx.Prepare(ctx, "late", `SELECT 1`)
				_, e7 := tx.CopyFrom(ctx, pgx.Identifier{"x"}, []string{"msg_id"}, pgx.CopyFromRows(nil))
				lo := tx.LargeObjects()
				_, e8 := lo.Create(ctx, 0)
				e9, e10 := tx.Commit(ctx), tx.Rollback(ctx)
				for i, err := range []error{e1, e2, e3, e4, e5, e6, e7, e8, e9, e10} {
					if !errors.Is(err, pgx.ErrTxClosed) {
						t.Errorf("call %d after RunInbox returned: %v, want pgx.ErrTxClosed", i+1, err)
					}
				}
			}
			if kept.Conn() == nil {
				t.Error("Conn() after the end is nil; pgx's transactions keep returning their connection")
			}
			if effects(t, s, fx, "late") != 0 {
				t.Fatal("a statement ran after the end")
			}
			sameConn(t, s, pid)
		})
	}
}

// Large objects work in the handler's transaction (it is pgx's own
// underneath) and commit with the record.
func TestRunInboxLargeObjects(t *testing.T) {
	s := openStore(t)
	ctx := context.Background()
	var oid uint32
	c, err := s.RunInbox(ctx, key("lo"), fpA, day, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		los := tx.LargeObjects()
		var err error
		if oid, err = los.Create(ctx, 0); err != nil {
			return nil, err
		}
		obj, err := los.Open(ctx, oid, pgx.LargeObjectModeWrite)
		if err != nil {
			return nil, err
		}
		if _, err := obj.Write([]byte("scanned invoice")); err != nil {
			return nil, err
		}
		return []byte("stored"), obj.Close()
	})
	if err != nil || c.Outcome != dedup.Acquired || string(c.Result) != "stored" {
		t.Fatalf("RunInbox writing a large object = %+v, %v", c, err)
	}
	t.Cleanup(func() {
		pgx.BeginFunc(ctx, s.Pool(), func(tx pgx.Tx) error { los := tx.LargeObjects(); return los.Unlink(ctx, oid) })
	})
	err = pgx.BeginFunc(ctx, s.Pool(), func(tx pgx.Tx) error {
		los := tx.LargeObjects()
		obj, err := los.Open(ctx, oid, pgx.LargeObjectModeRead)
		if err != nil {
			return err
		}
		b, err := io.ReadAll(obj)
		if err == nil && string(b) != "scanned invoice" {
			err = errors.New("read back " + string(b))
		}
		return err
	})
	if err != nil {
		t.Fatalf("the large object did not commit: %v", err)
	}
}

// A handler that panics or fails, a duplicate, and a store error all give
// the connection back to the pool idle: the same connection, outside any
// transaction, not a destroyed one.
func TestRunInboxGivesBackIdleConnection(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s, pid := onePool(t, true, m.opts...)
		fx := business(t, s)
		ctx := context.Background()
		func() {
			defer func() {
				if recover() == nil {
					t.Fatal("the handler's panic did not reach the caller")
				}
			}()
			s.RunInbox(ctx, key("m1"), fpA, day, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				if _, err := tx.Exec(ctx, `INSERT INTO `+fx+` (msg_id) VALUES ('m1')`); err != nil {
					t.Error(err)
				}
				panic("handler bug")
			})
		}()
		sameConn(t, s, pid)
		boom := errors.New("declined")
		if _, err := s.RunInbox(ctx, key("m1"), fpA, day, func(context.Context, pgx.Tx) ([]byte, error) { return nil, boom }); err != boom {
			t.Fatalf("RunInbox with a failing handler: %v", err)
		}
		sameConn(t, s, pid)
		runInbox(t, s, "m1", apply(fx, "m1", nil), dedup.Acquired)
		sameConn(t, s, pid)
		runInbox(t, s, "m1", apply(fx, "m1", nil), dedup.Duplicate)
		sameConn(t, s, pid)
		// A statement error in the first batch, the claim's.
		if _, err := s.Pool().Exec(ctx, `ALTER TABLE `+records(s)+` ADD CONSTRAINT refuse_m2 CHECK (id <> 'm2')`); err != nil {
			t.Fatal(err)
		}
		_, err := s.RunInbox(ctx, key("m2"), fpA, day, apply(fx, "m2", nil))
		var se *dedup.StoreError
		if !errors.As(err, &se) || !se.SafeToRetry() {
			t.Fatalf("RunInbox with an out-of-range expiry = %v; want a NotApplied store error", err)
		}
		sameConn(t, s, pid)
		if effects(t, s, fx, "m1") != 1 || effects(t, s, fx, "m2") != 0 {
			t.Fatal("wrong effects")
		}
	})
}

// A commit that fails is NotApplied when PostgreSQL reported the rollback,
// with and without a result (whose UPDATE goes in one batch with the
// COMMIT), and nothing of the message remains.
func TestRunInboxCommitFails(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s, pid := onePool(t, true, m.opts...)
		fx := business(t, s)
		ctx := context.Background()
		// A deferred unique constraint is checked at COMMIT.
		uniq := s.Tables().Schema + `.uniq`
		if _, err := s.Pool().Exec(ctx, `CREATE TABLE `+uniq+` (v int UNIQUE DEFERRABLE INITIALLY DEFERRED)`); err != nil {
			t.Fatal(err)
		}
		for _, tc := range []struct {
			name string
			h    pgstore.InboxHandler
			want func(error) bool
		}{
			{"aborted transaction", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				_, _ = tx.Exec(ctx, `SELECT 1/0`) // error swallowed: the transaction is aborted
				return nil, nil
			}, func(err error) bool { return errors.Is(err, pgx.ErrTxCommitRollback) }},
			{"aborted transaction with a result", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				_, _ = tx.Exec(ctx, `SELECT 1/0`)
				return []byte("r"), nil
			}, func(err error) bool { return pgCode(err) == "25P02" }},
			{"deferred constraint", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				_, err := tx.Exec(ctx, `INSERT INTO `+uniq+` VALUES (1), (1)`)
				return nil, err
			}, func(err error) bool { return pgCode(err) == "23505" }},
			{"deferred constraint with a result", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				_, err := tx.Exec(ctx, `INSERT INTO `+uniq+` VALUES (2), (2)`)
				return []byte("r"), err
			}, func(err error) bool { return pgCode(err) == "23505" }},
			{"record deleted by the handler", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				_, err := tx.Exec(ctx, `DELETE FROM `+records(s))
				return []byte("r"), err
			}, func(err error) bool { return strings.Contains(err.Error(), "removed or changed the inbox record") }},
		} {
			id := tc.name
			c, err := s.RunInbox(ctx, key(id), fpA, day, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				if _, err := tx.Exec(ctx, `INSERT INTO `+fx+` (msg_id) VALUES ($1)`, id); err != nil {
					return nil, err
				}
				return tc.h(ctx, tx)
			})
			var se *dedup.StoreError
			if !errors.As(err, &se) || !se.SafeToRetry() || se.Op != "inbox commit" || !tc.want(err) || c.Outcome != 0 {
				t.Errorf("%s: RunInbox = %+v, %v; want a NotApplied store error of the commit", tc.name, c, err)
			}
			if n, r := effects(t, s, fx, id), countRecords(t, s, id); n != 0 || r != 0 {
				t.Errorf("%s: %d effects and %d records after the failed commit", tc.name, n, r)
			}
			sameConn(t, s, pid)
		}
	})
}

func pgCode(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

// A handler must not end RunInbox's transaction itself; if it does,
// RunInbox says so, NotApplied only when the handler rolled back.
func TestRunInboxHandlerEndsTransaction(t *testing.T) {
	s := openStore(t)
	fx := business(t, s)
	ctx := context.Background()
	for _, commit := range []bool{false, true} {
		id := "ended-" + map[bool]string{false: "rollback", true: "commit"}[commit]
		_, err := s.RunInbox(ctx, key(id), fpA, day, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			if _, err := apply(fx, id, nil)(ctx, tx); err != nil {
				return nil, err
			}
			if commit {
				return []byte("r"), tx.Commit(ctx)
			}
			return []byte("r"), tx.Rollback(ctx)
		})
		var se *dedup.StoreError
		if !errors.As(err, &se) || se.SafeToRetry() == commit || !strings.Contains(err.Error(), "ended RunInbox's transaction") {
			t.Fatalf("commit=%v: RunInbox = %v", commit, err)
		}
		want := 0
		if commit {
			want = 1
		}
		if n := effects(t, s, fx, id); n != want {
			t.Fatalf("commit=%v: %d effects, want %d", commit, n, want)
		}
		idleConn(t, s)
	}
}

// A context cancelled while the first batch waits for the key, or while
// the handler waits for a lock, fails the call and never leaves the
// connection in a transaction: with a cancel request (ParsePoolConfig) the
// server rolls back and the connection comes back idle; with pgx's default
// the connection is closed and the pool replaces it.
func TestRunInboxCancelled(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		for _, cancelRequest := range []bool{true, false} {
			for _, where := range []string{"claim", "handler"} {
				s, pid := onePool(t, cancelRequest, m.opts...)
				fx := business(t, s)
				bg := context.Background()
				// Another transaction holds the key (claim) or a row
				// the handler wants (handler).
				holder, err := testPool(t).Begin(bg)
				if err != nil {
					t.Fatal(err)
				}
				if where == "claim" {
					if c, err := s.Inbox(bg, holder, key("m1"), fpA, day, func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }); err != nil || c.Outcome != dedup.Acquired {
						t.Fatalf("Inbox = %v, %v", c.Outcome, err)
					}
				} else {
					if _, err := holder.Exec(bg, `INSERT INTO `+fx+` (msg_id) VALUES ('lock')`); err != nil {
						t.Fatal(err)
					}
					if _, err := holder.Exec(bg, `LOCK TABLE `+fx+` IN EXCLUSIVE MODE`); err != nil {
						t.Fatal(err)
					}
				}
				ctx, cancel := context.WithCancel(bg)
				done := make(chan error, 1)
				var ran bool
				go func() {
					_, err := s.RunInbox(ctx, key("m1"), fpA, day, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
						ran = true
						return apply(fx, "m1", nil)(ctx, tx)
					})
					done <- err
				}()
				watcher, err := pgstore.New(testPool(t)) // s's one connection is busy
				if err != nil {
					t.Fatal(err)
				}
				waitForLockWait(t, watcher, pid)
				cancel()
				err = <-done
				if where == "handler" {
					// The handler's error, returned unchanged: the
					// server's report of the cancelled statement, or
					// pgx's of the closed connection.
					if !errors.Is(err, context.Canceled) && pgCode(err) != "57014" {
						t.Fatalf("cancel request %v, handler: RunInbox = %v; want the cancelled statement's error", cancelRequest, err)
					}
				} else {
					if !errors.Is(err, context.Canceled) {
						t.Fatalf("cancel request %v, claim: RunInbox = %v; want an error wrapping context.Canceled", cancelRequest, err)
					}
					var se *dedup.StoreError
					// NotApplied either way: nothing commits without
					// the COMMIT, which was never sent.
					if !errors.As(err, &se) || ran || !se.SafeToRetry() {
						t.Fatalf("cancel request %v: cancelled in the claim = %v (ran %v); want a NotApplied store error", cancelRequest, err, ran)
					}
				}
				if err := holder.Rollback(bg); err != nil {
					t.Fatal(err)
				}
				if cancelRequest {
					sameConn(t, s, pid)
				} else {
					idleConn(t, s)
				}
				if n, r := effects(t, s, fx, "m1"), countRecords(t, s, "m1"); n != 0 || r != 0 {
					t.Fatalf("cancel request %v, %s: %d effects, %d records after the cancelled call", cancelRequest, where, n, r)
				}
				runInbox(t, s, "m1", apply(fx, "m1", nil), dedup.Acquired)
			}
		}
	})
}

// A call whose deadline passes while the handler runs fails with the
// handler's error, gives the connection back idle, and the redelivery
// applies the message.
func TestRunInboxDeadlineInHandler(t *testing.T) {
	s, pid := onePool(t, true)
	fx := business(t, s)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err := s.RunInbox(ctx, key("slow"), fpA, day, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		_, err := tx.Exec(ctx, `SELECT pg_sleep(10)`)
		return nil, err
	})
	if pgCode(err) != "57014" {
		t.Fatalf("RunInbox past its deadline = %v; want the handler's error, the cancelled statement", err)
	}
	sameConn(t, s, pid)
	runInbox(t, s, "slow", apply(fx, "slow", nil), dedup.Acquired)
}

// TestRunInboxClaimStatementsAgree runs RunInbox's acquire-only claim
// (with its read of a row it could not take) and the CASE-per-column
// upsert through every outcome and checks they answer alike: new,
// duplicate with its result, mismatch, a live lease (in progress), a
// take-over of an expired lease, and a mismatched fingerprint on one.
func TestRunInboxClaimStatementsAgree(t *testing.T) {
	t.Parallel()
	type answer struct {
		outcome   dedup.Outcome
		attempt   int
		takenOver bool
		result    string
		leaseSet  bool
	}
	run := func(t *testing.T, s *pgstore.Store) []answer {
		fx := business(t, s)
		ctx := context.Background()
		var out []answer
		rec := func(id string, fp dedup.Fingerprint) {
			t.Helper()
			c, err := s.RunInbox(ctx, key(id), fp, day, apply(fx, id, nil))
			if err != nil {
				t.Fatalf("RunInbox(%s): %v", id, err)
			}
			out = append(out, answer{c.Outcome, c.Attempt, c.TakenOver, string(c.Result), !c.LeaseUntil.IsZero()})
		}
		rec("new", fpA)
		rec("new", fpA) // duplicate, with the stored result
		rec("new", fpB) // mismatch
		mustClaim(t, s, "live", fpA, time.Hour, dedup.Acquired)
		rec("live", fpA) // in progress
		mustClaim(t, s, "crashed", fpA, 50*time.Millisecond, dedup.Acquired)
		mustClaim(t, s, "crashed-other", fpA, 50*time.Millisecond, dedup.Acquired)
		time.Sleep(200 * time.Millisecond)
		rec("crashed", fpA)       // take-over, attempt 2
		rec("crashed-other", fpB) // expired lease, other payload: mismatch
		return out
	}
	fast := run(t, openStore(t))
	cs := openStore(t)
	pgstore.UseCaseInbox(cs)
	slow := run(t, cs)
	if fmt.Sprint(fast) != fmt.Sprint(slow) {
		t.Fatalf("acquire-only claim %v\nCASE upsert        %v", fast, slow)
	}
	want := []dedup.Outcome{dedup.Acquired, dedup.Duplicate, dedup.Mismatch, dedup.InProgress, dedup.Acquired, dedup.Mismatch}
	for i, a := range fast {
		if a.outcome != want[i] {
			t.Fatalf("answer %d = %+v, want %v", i, a, want[i])
		}
	}
	if fast[1].result != "applied:new" || fast[4].attempt != 2 || !fast[4].takenOver {
		t.Fatalf("answers %+v", fast)
	}
}
