package pgstore_test

import (
	"context"
	"database/sql"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
)

// business creates, in s's schema, the effects table: no unique
// constraint, so every effect that commits is one more row.
func business(t testing.TB, s *pgstore.Store) string {
	t.Helper()
	table := s.Tables().Schema + `.effects`
	if _, err := s.Pool().Exec(context.Background(), `CREATE TABLE `+table+` (msg_id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return table
}

// apply is the business handler: it writes one effect row.
func apply(table, msgID string, runs *atomic.Int32) pgstore.InboxHandler {
	return func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		if runs != nil {
			runs.Add(1)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+table+` (msg_id) VALUES ($1)`, msgID); err != nil {
			return nil, err
		}
		return []byte("applied:" + msgID), nil
	}
}

func effects(t testing.TB, s *pgstore.Store, table, msgID string) int {
	t.Helper()
	return queryInt(t, s.Pool(), `SELECT count(*) FROM `+table+` WHERE msg_id = $1`, msgID)
}

func runInbox(t testing.TB, s *pgstore.Store, id string, h pgstore.InboxHandler, want dedup.Outcome) dedup.Claim {
	t.Helper()
	c, err := s.RunInbox(context.Background(), key(id), fpA, day, h)
	if err != nil {
		t.Fatalf("RunInbox(%s): %v", id, err)
	}
	if c.Outcome != want {
		t.Fatalf("RunInbox(%s) = %v, want %v", id, c.Outcome, want)
	}
	return c
}

// A message is applied once; every replay is a duplicate that neither runs
// the handler nor commits a second effect, and carries the stored result.
func TestInboxAppliesOnce(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		fx := business(t, s)
		var runs atomic.Int32
		c := runInbox(t, s, "m1", apply(fx, "m1", &runs), dedup.Acquired)
		if c.Attempt != 1 || c.TakenOver || c.Token.IsZero() || string(c.Result) != "applied:m1" || c.ExpiresAt.IsZero() {
			t.Fatalf("first delivery = %+v", c)
		}
		for i := range 3 {
			d := runInbox(t, s, "m1", apply(fx, "m1", &runs), dedup.Duplicate)
			if string(d.Result) != "applied:m1" {
				t.Fatalf("replay %d result = %q, want the stored one", i, d.Result)
			}
		}
		if runs.Load() != 1 || effects(t, s, fx, "m1") != 1 {
			t.Fatalf("after 4 deliveries: %d handler runs, %d effects; want 1 and 1", runs.Load(), effects(t, s, fx, "m1"))
		}
		// A lease-mode claim sees the inbox record as a duplicate too.
		mustClaim(t, s, "m1", fpA, time.Minute, dedup.Duplicate)
		// Another payload under the same key is a conflict, not a duplicate.
		if c, err := s.RunInbox(context.Background(), key("m1"), fpB, day, apply(fx, "m1", &runs)); err != nil || c.Outcome != dedup.Mismatch || c.Result != nil {
			t.Fatalf("RunInbox with another fingerprint = %+v, %v; want a mismatch without the result", c, err)
		}
	})
}

// The record and the business write commit together in the caller's
// transaction; a conflict inside it does not abort it.
func TestInboxCommitsWithBusinessWrite(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		fx := business(t, s)
		ctx := context.Background()
		tx, err := s.Pool().Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		c, err := s.Inbox(ctx, tx, key("m1"), fpA, day, apply(fx, "m1", nil))
		if err != nil || c.Outcome != dedup.Acquired {
			t.Fatalf("Inbox = %v, %v", c.Outcome, err)
		}
		if effects(t, s, fx, "m1") != 0 || countRecords(t, s, "m1") != 0 {
			t.Fatal("the record or the effect is visible before the commit")
		}
		// Inside the transaction a second delivery is already a duplicate,
		// and the transaction goes on.
		var runs atomic.Int32
		d, err := s.Inbox(ctx, tx, key("m1"), fpA, day, apply(fx, "m1", &runs))
		if err != nil || d.Outcome != dedup.Duplicate || runs.Load() != 0 {
			t.Fatalf("second Inbox in the same transaction = %v, %v, %d runs", d.Outcome, err, runs.Load())
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+fx+` (msg_id) VALUES ('after-conflict')`); err != nil {
			t.Fatalf("the conflict aborted the transaction: %v", err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if effects(t, s, fx, "m1") != 1 || effects(t, s, fx, "after-conflict") != 1 || countRecords(t, s, "m1") != 1 {
			t.Fatal("the commit did not make the record and the writes durable together")
		}
		runInbox(t, s, "m1", apply(fx, "m1", &runs), dedup.Duplicate)
		if runs.Load() != 0 {
			t.Fatal("the handler ran for a committed message")
		}
	})
}

// A duplicate found in the caller's transaction leaves it usable: the
// transaction commits its other writes. CAMEL-24048 is the bug where a
// plain unique violation aborts the consumer's transaction.
func TestInboxConflictDoesNotAbortTransaction(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		fx := business(t, s)
		ctx := context.Background()
		runInbox(t, s, "m1", apply(fx, "m1", nil), dedup.Acquired)
		mustClaim(t, s, "held", fpA, time.Hour, dedup.Acquired)
		err := pgx.BeginFunc(ctx, s.Pool(), func(tx pgx.Tx) error {
			for _, tc := range []struct {
				id   string
				fp   dedup.Fingerprint
				want dedup.Outcome
			}{{"m1", fpA, dedup.Duplicate}, {"m1", fpB, dedup.Mismatch}, {"held", fpA, dedup.InProgress}} {
				c, err := s.Inbox(ctx, tx, key(tc.id), tc.fp, day, apply(fx, tc.id, nil))
				if err != nil || c.Outcome != tc.want {
					t.Errorf("Inbox(%s, %s) = %v, %v; want %v", tc.id, tc.fp, c.Outcome, err, tc.want)
				}
			}
			_, err := tx.Exec(ctx, `INSERT INTO `+fx+` (msg_id) VALUES ('other-work')`)
			return err
		})
		if err != nil {
			t.Fatalf("the transaction did not commit after conflicts: %v", err)
		}
		if effects(t, s, fx, "other-work") != 1 || effects(t, s, fx, "m1") != 1 || effects(t, s, fx, "held") != 0 {
			t.Fatal("wrong effects after the conflicts")
		}
	})
}

// The control for the test above: a plain INSERT that hits the unique key
// aborts the whole transaction, which is what the inbox avoids.
func TestPlainInsertAbortsTransaction(t *testing.T) {
	s := openStore(t)
	ctx := context.Background()
	runInbox(t, s, "m1", func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }, dedup.Acquired)
	tx, err := s.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	_, err = tx.Exec(ctx, `INSERT INTO `+s.Tables().Records+` (scope, id, state, token, deadline, attempts)
VALUES (`+fn(s, "scope_id")+`($1), 'm1', 2, '\x00', now(), 1)`, key("m1").Scope)
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "23505" {
		t.Fatalf("plain INSERT of a taken key: %v, want a unique violation", err)
	}
	_, err = tx.Exec(ctx, `SELECT 1`)
	if !errors.As(err, &pe) || pe.Code != "25P02" {
		t.Fatalf("statement after the unique violation: %v, want 25P02 (transaction aborted)", err)
	}
}

// A rolled-back transaction leaves no record and no effect, and the
// redelivery applies the message.
func TestInboxRollbackLeavesNoRecord(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		fx := business(t, s)
		ctx := context.Background()
		tx, err := s.Pool().Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if c, err := s.Inbox(ctx, tx, key("m1"), fpA, day, apply(fx, "m1", nil)); err != nil || c.Outcome != dedup.Acquired {
			t.Fatalf("Inbox = %v, %v", c.Outcome, err)
		}
		if err := tx.Rollback(ctx); err != nil { // the consumer crashed before its commit
			t.Fatal(err)
		}
		if effects(t, s, fx, "m1") != 0 || countRecords(t, s, "m1") != 0 {
			t.Fatal("a rolled-back record or effect is visible")
		}
		var runs atomic.Int32
		r := runInbox(t, s, "m1", apply(fx, "m1", &runs), dedup.Acquired)
		if r.Attempt != 1 || runs.Load() != 1 || effects(t, s, fx, "m1") != 1 {
			t.Fatalf("redelivery after rollback: attempt %d, %d runs, %d effects; want 1, 1, 1", r.Attempt, runs.Load(), effects(t, s, fx, "m1"))
		}
	})
}

// A handler error is returned unchanged, and nothing commits: neither the
// record nor the effect written before the error. A panic rolls back too.
func TestInboxHandlerFailureLeavesNothing(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		fx := business(t, s)
		boom := errors.New("card declined by a flaky gateway")
		c, err := s.RunInbox(context.Background(), key("m1"), fpA, day, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO `+fx+` (msg_id) VALUES ('m1')`); err != nil {
				return nil, err
			}
			return nil, boom
		})
		if err != boom || c.Outcome != 0 {
			t.Fatalf("RunInbox with a failing handler = %v, %v; want the handler's error itself", c.Outcome, err)
		}
		func() {
			defer func() {
				if recover() == nil {
					t.Fatal("the handler's panic did not reach the caller")
				}
			}()
			s.RunInbox(context.Background(), key("m1"), fpA, day, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				tx.Exec(ctx, `INSERT INTO `+fx+` (msg_id) VALUES ('m1')`)
				panic("handler bug")
			})
		}()
		if effects(t, s, fx, "m1") != 0 || countRecords(t, s, "m1") != 0 {
			t.Fatal("the effect or record of a failed handler was committed")
		}
		n := mustClaim(t, s, "m1", fpA, time.Minute, dedup.Acquired)
		if n.Attempt != 1 {
			t.Fatalf("Claim after failed inbox runs: attempt %d, want 1 (no record left)", n.Attempt)
		}
	})
}

// waitForLockWait polls until the backend pid waits for a lock: the
// deterministic sign that a transaction is blocked on another.
func waitForLockWait(t testing.TB, s *pgstore.Store, pid uint32) {
	t.Helper()
	for i := 0; ; i++ {
		var waiting bool
		err := s.Pool().QueryRow(context.Background(),
			`SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock')`, int32(pid)).Scan(&waiting)
		if err != nil {
			t.Fatal(err)
		}
		if waiting {
			return
		}
		if i > 3000 {
			t.Fatalf("backend %d never waited for a lock", pid)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Two transactions with one key: the second blocks until the first ends,
// then sees a duplicate if the first committed, or applies if it rolled
// back.
func TestInboxConcurrentTransactionWaits(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		for _, commit := range []bool{true, false} {
			s := openStore(t, m.opts...)
			fx := business(t, s)
			ctx := context.Background()
			tx1, err := s.Pool().Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if c, err := s.Inbox(ctx, tx1, key("m1"), fpA, day, apply(fx, "m1", nil)); err != nil || c.Outcome != dedup.Acquired {
				t.Fatalf("first Inbox = %v, %v", c.Outcome, err)
			}
			conn, err := s.Pool().Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			pid := conn.Conn().PgConn().PID()
			type answer struct {
				c   dedup.Claim
				err error
			}
			done := make(chan answer, 1)
			var runs atomic.Int32
			go func() {
				defer conn.Release()
				var a answer
				a.err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
					var err error
					a.c, err = s.Inbox(ctx, tx, key("m1"), fpA, day, apply(fx, "m1", &runs))
					return err
				})
				done <- a
			}()
			waitForLockWait(t, s, pid)
			select {
			case a := <-done:
				t.Fatalf("the second transaction did not wait: %+v", a)
			default:
			}
			if commit {
				err = tx1.Commit(ctx)
			} else {
				err = tx1.Rollback(ctx)
			}
			if err != nil {
				t.Fatal(err)
			}
			a := <-done
			want, wantRuns := dedup.Duplicate, int32(0)
			if !commit {
				want, wantRuns = dedup.Acquired, 1
			}
			if a.err != nil || a.c.Outcome != want || runs.Load() != wantRuns {
				t.Fatalf("commit=%v: second transaction = %v, %v, %d runs; want %v, %d runs", commit, a.c.Outcome, a.err, runs.Load(), want, wantRuns)
			}
			if n := effects(t, s, fx, "m1"); n != 1 {
				t.Fatalf("commit=%v: %d effects, want 1", commit, n)
			}
		}
	})
}

// 64 concurrent transactions deliver one message: exactly one business
// effect commits, the others are duplicates with its result.
func TestInbox64ConcurrentTransactionsOneEffect(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		pool := newPool(t, 20)
		s := openStoreOn(t, pool, freshSchema(t, pool), m.opts...)
		fx := business(t, s)
		const n = 64
		var applied, dups, runs atomic.Int32
		var start, wg sync.WaitGroup
		start.Add(1)
		for range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				start.Wait()
				c, err := s.RunInbox(context.Background(), key("pay-1"), fpA, day, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
					runs.Add(1)
					time.Sleep(10 * time.Millisecond) // hold the key while the others arrive
					return apply(fx, "pay-1", nil)(ctx, tx)
				})
				switch {
				case err != nil:
					t.Errorf("RunInbox: %v", err)
				case c.Outcome == dedup.Acquired:
					applied.Add(1)
				case c.Outcome == dedup.Duplicate && string(c.Result) == "applied:pay-1":
					dups.Add(1)
				default:
					t.Errorf("RunInbox = %+v", c)
				}
			}()
		}
		start.Done()
		wg.Wait()
		if got := effects(t, s, fx, "pay-1"); got != 1 || applied.Load() != 1 || dups.Load() != n-1 || runs.Load() != 1 {
			t.Fatalf("%d transactions on one key: %d effects, %d applied, %d duplicates, %d handler runs; want 1, 1, %d, 1",
				n, got, applied.Load(), dups.Load(), runs.Load(), n-1)
		}
	})
}

// The inbox takes over the expired lease of a lease-mode owner that
// crashed (attempt 2), and reports a live lease as in progress.
func TestInboxAndLeaseModeShareRecords(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		fx := business(t, s)
		mustClaim(t, s, "live", fpA, time.Hour, dedup.Acquired)
		c, err := s.RunInbox(context.Background(), key("live"), fpA, day, apply(fx, "live", nil))
		if err != nil || c.Outcome != dedup.InProgress || c.LeaseUntil.IsZero() {
			t.Fatalf("RunInbox on a live lease = %+v, %v; want in progress with its lease end", c, err)
		}
		old := mustClaim(t, s, "crashed", fpA, 100*time.Millisecond, dedup.Acquired)
		time.Sleep(300 * time.Millisecond)
		c = runInbox(t, s, "crashed", apply(fx, "crashed", nil), dedup.Acquired)
		if c.Attempt != 2 || !c.TakenOver {
			t.Fatalf("inbox take-over = %+v, want attempt 2, TakenOver", c)
		}
		if err := s.Complete(context.Background(), old, nil, day); !errors.Is(err, dedup.ErrLeaseLost) {
			t.Fatalf("the crashed owner's Complete after the take-over: %v, want ErrLeaseLost", err)
		}
	})
}

// InboxSQL works on a database/sql transaction from pgx's stdlib adapter,
// with the same guarantees.
func TestInboxSQL(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		fx := business(t, s)
		db := stdlib.OpenDBFromPool(s.Pool())
		defer db.Close()
		ctx := context.Background()
		var runs atomic.Int32
		h := func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
			runs.Add(1)
			if _, err := tx.ExecContext(ctx, `INSERT INTO `+fx+` (msg_id) VALUES ('m1')`); err != nil {
				return nil, err
			}
			if err := s.EnqueueOutboxSQL(ctx, tx, pgstore.OutboxMessage{Topic: "orders", Key: "evt-1", Payload: []byte("x")}); err != nil {
				return nil, err
			}
			return []byte("ok"), nil
		}
		deliver := func(commit bool) dedup.Claim {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback()
			c, err := s.InboxSQL(ctx, tx, key("m1"), fpA, day, h)
			if err != nil {
				t.Fatalf("InboxSQL: %v", err)
			}
			if commit {
				if err := tx.Commit(); err != nil {
					t.Fatal(err)
				}
			}
			return c
		}
		if c := deliver(false); c.Outcome != dedup.Acquired {
			t.Fatalf("first delivery = %v", c.Outcome)
		}
		if c := deliver(true); c.Outcome != dedup.Acquired || string(c.Result) != "ok" {
			t.Fatalf("redelivery after rollback = %+v", c)
		}
		if c := deliver(true); c.Outcome != dedup.Duplicate || string(c.Result) != "ok" {
			t.Fatalf("replay = %+v, want a duplicate with the result", c)
		}
		outbox := queryInt(t, s.Pool(), `SELECT count(*) FROM `+s.Tables().Outbox+` WHERE message_key = 'evt-1'`)
		if runs.Load() != 2 || effects(t, s, fx, "m1") != 1 || outbox != 1 {
			t.Fatalf("%d runs, %d effects, %d outbox rows; want 2, 1, 1", runs.Load(), effects(t, s, fx, "m1"), outbox)
		}
	})
}

// Outgoing messages written in the inbox step commit with it, or not at
// all, and a duplicate writes none.
func TestOutboxInInboxStep(t *testing.T) {
	s := openStore(t)
	ctx := context.Background()
	h := func(fail bool) pgstore.InboxHandler {
		return func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			err := s.EnqueueOutbox(ctx, tx,
				pgstore.OutboxMessage{Topic: "payments.captured", Key: "evt-9", Aggregate: "order/9", Payload: []byte(`{"amount":100}`),
					Headers: map[string]string{"trace": "abc"}},
				pgstore.OutboxMessage{Topic: "emails", Payload: []byte("receipt")})
			if err != nil || fail {
				return nil, errors.Join(err, errors.New("fail after enqueue"))
			}
			return nil, nil
		}
	}
	if _, err := s.RunInbox(ctx, key("m9"), fpA, day, h(true)); err == nil {
		t.Fatal("the failing handler succeeded")
	}
	count := func() int { return queryInt(t, s.Pool(), `SELECT count(*) FROM `+s.Tables().Outbox) }
	if count() != 0 {
		t.Fatal("outbox rows of a rolled-back step were committed")
	}
	runInbox(t, s, "m9", h(false), dedup.Acquired)
	runInbox(t, s, "m9", h(false), dedup.Duplicate)
	if n := count(); n != 2 {
		t.Fatalf("%d outbox rows, want the 2 of the one applied delivery", n)
	}
	var hdr, agg, generated string
	if err := s.Pool().QueryRow(ctx, `SELECT headers->>'trace', aggregate FROM `+s.Tables().Outbox+` WHERE message_key = 'evt-9'`).Scan(&hdr, &agg); err != nil || hdr != "abc" || agg != "order/9" {
		t.Fatalf("outbox row: header %q aggregate %q, %v", hdr, agg, err)
	}
	if err := s.Pool().QueryRow(ctx, `SELECT message_key FROM `+s.Tables().Outbox+` WHERE topic = 'emails'`).Scan(&generated); err != nil || generated == "" {
		t.Fatalf("a message without a key got key %q, %v; want one generated once and stored", generated, err)
	}
	err := pgx.BeginFunc(ctx, s.Pool(), func(tx pgx.Tx) error {
		return s.EnqueueOutbox(ctx, tx, pgstore.OutboxMessage{Key: "k"})
	})
	if !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Fatalf("outbox message without a topic: %v, want ErrInvalidArgument", err)
	}
}
