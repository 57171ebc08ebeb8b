package pgstore_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// terminate kills the backend serving tx from another connection and
// waits until it is gone, as when the database restarts, a failover
// happens or an operator kills the session mid-transaction.
func terminate(t testing.TB, s *pgstore.Store, tx pgx.Tx) {
	t.Helper()
	pid := tx.Conn().PgConn().PID()
	var ok bool
	if err := s.Pool().QueryRow(context.Background(), `SELECT pg_terminate_backend($1, 10000)`, int32(pid)).Scan(&ok); err != nil || !ok {
		t.Fatalf("pg_terminate_backend(%d) = %v, %v", pid, ok, err)
	}
}

// The backend dies mid-transaction, after the record and the business
// write were sent but before the commit: nothing remains, and the
// redelivery applies the message once.
func TestKillBackendMidTransaction(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		pool := newPool(t, 4)
		s := openStoreOn(t, pool, freshSchema(t, pool), m.opts...)
		fx := business(t, s)
		for _, when := range []string{"inside the handler", "before the commit", "before the commit of a result"} {
			id := "kill/" + when
			var runs atomic.Int32
			c, err := s.RunInbox(context.Background(), key(id), fpA, day, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				runs.Add(1)
				if _, err := tx.Exec(ctx, `INSERT INTO `+fx+` (msg_id) VALUES ($1)`, id); err != nil {
					return nil, err
				}
				terminate(t, s, tx)
				if when == "inside the handler" {
					// The handler's next statement fails; it returns that
					// error and RunInbox returns it unchanged.
					_, err := tx.Exec(ctx, `INSERT INTO `+fx+` (msg_id) VALUES ($1)`, id)
					return nil, err
				}
				if when == "before the commit of a result" {
					// The result's UPDATE and the COMMIT, in one batch,
					// meet the dead connection.
					return []byte("r"), nil
				}
				return nil, nil // the commit meets the dead connection
			})
			if err == nil || c.Outcome == dedup.Acquired {
				t.Fatalf("%s: RunInbox on a killed backend = %+v, %v; want an error", when, c, err)
			}
			if when != "inside the handler" && !dedup.IsStoreError(err) {
				t.Fatalf("%s: error %v, want a *dedup.StoreError", when, err)
			}
			if n, r := effects(t, s, fx, id), countRecords(t, s, id); n != 0 || r != 0 {
				t.Fatalf("%s: %d effects and %d records after the kill; want none", when, n, r)
			}
			redelivered := runInbox(t, s, id, apply(fx, id, &runs), dedup.Acquired)
			if redelivered.Attempt != 1 || effects(t, s, fx, id) != 1 {
				t.Fatalf("%s: redelivery = %+v with %d effects; want attempt 1 and one effect", when, redelivered, effects(t, s, fx, id))
			}
			runInbox(t, s, id, apply(fx, id, &runs), dedup.Duplicate)
			if effects(t, s, fx, id) != 1 {
				t.Fatalf("%s: a second redelivery applied again", when)
			}
		}
	})
}

// The consumer commits and dies before it acknowledges: the broker
// redelivers, and the redelivery is a duplicate, in both modes.
func TestCrashAfterCommitBeforeAck(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		fx := business(t, s)
		var runs atomic.Int32
		runInbox(t, s, "inbox-1", apply(fx, "inbox-1", &runs), dedup.Acquired)
		// ... crash here, no ack; the broker redelivers:
		d := runInbox(t, s, "inbox-1", apply(fx, "inbox-1", &runs), dedup.Duplicate)
		if runs.Load() != 1 || effects(t, s, fx, "inbox-1") != 1 || string(d.Result) != "applied:inbox-1" {
			t.Fatalf("inbox: %d runs, %d effects, result %q after the redelivery", runs.Load(), effects(t, s, fx, "inbox-1"), d.Result)
		}

		c := mustClaim(t, s, "lease-1", fpA, time.Minute, dedup.Acquired)
		if err := s.Complete(context.Background(), c, []byte("receipt"), day); err != nil {
			t.Fatal(err)
		}
		// ... crash here, no ack.
		if d := mustClaim(t, s, "lease-1", fpA, time.Minute, dedup.Duplicate); string(d.Result) != "receipt" {
			t.Fatalf("lease mode: redelivery result %q", d.Result)
		}
	})
}

// unreachable returns a store on a pool whose server is a closed port.
func unreachable(t testing.TB, opts ...pgstore.Option) (*pgstore.Store, string) {
	t.Helper()
	url := "postgres://postgres@127.0.0.1:" + testenv.FreePort(t) + "/test?sslmode=disable&connect_timeout=5"
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg) // connects lazily
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	s, err := pgstore.New(pool, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return s, url
}

// With the database unreachable every call fails closed: a typed store
// error that says nothing was applied, never an outcome.
func TestUnreachableFailsClosed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, url := unreachable(t)
	o, err := pgstore.Open(ctx, url)
	var se *dedup.StoreError
	if o != nil || !errors.As(err, &se) || !se.SafeToRetry() || !strings.Contains(err.Error(), "is PostgreSQL running") {
		t.Fatalf("Open on a closed port = %v, %v; want a NotApplied *dedup.StoreError saying what to check", o, err)
	}

	c, err := s.Claim(ctx, key("m1"), fpA, time.Minute)
	if !errors.As(err, &se) || !se.SafeToRetry() || c.Outcome != 0 {
		t.Fatalf("Claim = %+v, %v; want no outcome and a NotApplied store error", c, err)
	}
	var runs atomic.Int32
	c, err = s.RunInbox(ctx, key("m1"), fpA, day, func(context.Context, pgx.Tx) ([]byte, error) { runs.Add(1); return nil, nil })
	if !errors.As(err, &se) || !se.SafeToRetry() || c.Outcome != 0 || runs.Load() != 0 {
		t.Fatalf("RunInbox = %+v, %v, %d runs; want a NotApplied store error and no run", c, err, runs.Load())
	}
	cs, err := s.ClaimBatch(ctx, []dedup.ClaimRequest{{Key: key("a")}, {Key: key("b")}}, time.Minute)
	if !errors.As(err, &se) || cs != nil {
		t.Fatalf("ClaimBatch = %v, %v; want a store error", cs, err)
	}
	owned := dedup.Claim{Key: key("m1"), Outcome: dedup.Acquired, Token: dedup.NewToken(), Attempt: 1}
	for name, err := range map[string]error{
		"Complete": s.Complete(ctx, owned, nil, day),
		"Release":  s.Release(ctx, owned),
		"Ping":     s.Ping(ctx),
	} {
		if !errors.As(err, &se) || errors.Is(err, dedup.ErrLeaseLost) {
			t.Errorf("%s = %v; want a store error, not lease lost", name, err)
		}
	}
	if _, err := s.Sweep(ctx, 10); !dedup.IsStoreError(err) {
		t.Errorf("Sweep = %v, want a store error", err)
	}
	if _, err := s.Migrate(ctx); !dedup.IsStoreError(err) {
		t.Errorf("Migrate = %v, want a store error", err)
	}

	// Bad arguments are reported before any I/O, so as argument errors
	// even with no database.
	if _, err := s.Claim(ctx, dedup.Key{Scope: "s", ID: "a\nb"}, fpA, time.Minute); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("Claim with a bad key = %v, want ErrInvalidArgument", err)
	}
	if _, err := s.RunInbox(ctx, key("m1"), fpA, 0, func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("RunInbox with zero retention = %v, want ErrInvalidArgument", err)
	}
	if _, err := s.ClaimBatch(ctx, []dedup.ClaimRequest{{Key: key("ok")}, {Key: dedup.Key{}}}, time.Minute); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("ClaimBatch with a bad key = %v, want ErrInvalidArgument", err)
	}
}

// A claim that waits on a lock is cancelled mid-call. It returns a store
// error wrapping the cancellation and fails closed. On a pool from
// ParsePoolConfig (as Open makes) the server rolls the statement back, so
// the error says NotApplied and nothing is written; with pgx's default the
// client only drops the connection, the statement may still run, and the
// error must not claim otherwise.
func TestCancelledMidCall(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		for _, cancelRequest := range []bool{true, false} {
			pool := testPool(t)
			schema := freshSchema(t, pool)
			s := openStoreOn(t, pool, schema, m.opts...)
			// The claim runs on a pool of one connection, so that its
			// backend is known.
			cfg, err := pgstore.ParsePoolConfig(testenv.PostgresURL(t))
			if err != nil {
				t.Fatal(err)
			}
			if !cancelRequest {
				if cfg, err = pgxpool.ParseConfig(testenv.PostgresURL(t)); err != nil {
					t.Fatal(err)
				}
			}
			cfg.MaxConns = 1
			one, err := pgxpool.NewWithConfig(context.Background(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer one.Close()
			claimer, err := pgstore.New(one, append([]pgstore.Option{pgstore.WithSchema(schema)}, m.opts...)...)
			if err != nil {
				t.Fatal(err)
			}
			bg := context.Background()
			conn, err := one.Acquire(bg)
			if err != nil {
				t.Fatal(err)
			}
			pid := conn.Conn().PgConn().PID()
			conn.Release()
			// An open inbox transaction holds the key.
			tx, err := s.Pool().Begin(bg)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(bg)
			if c, err := s.Inbox(bg, tx, key("m1"), fpA, day, func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }); err != nil || c.Outcome != dedup.Acquired {
				t.Fatalf("Inbox = %v, %v", c.Outcome, err)
			}
			ctx, cancel := context.WithCancel(bg)
			done := make(chan error, 1)
			var got dedup.Claim
			go func() {
				var err error
				got, err = claimer.Claim(ctx, key("m1"), fpA, time.Minute)
				done <- err
			}()
			waitForLockWait(t, s, pid) // blocked on the open transaction
			cancel()
			err = <-done
			var se *dedup.StoreError
			if !errors.As(err, &se) || !errors.Is(err, context.Canceled) || got.Outcome != 0 {
				t.Fatalf("cancel request %v: cancelled Claim = %+v, %v; want a store error wrapping context.Canceled and no outcome", cancelRequest, got, err)
			}
			if se.SafeToRetry() != cancelRequest {
				t.Fatalf("cancel request %v: SafeToRetry = %v (%v)", cancelRequest, se.SafeToRetry(), err)
			}
			if err := tx.Rollback(bg); err != nil {
				t.Fatal(err)
			}
			if cancelRequest {
				if c := mustClaim(t, s, "m1", fpA, time.Minute, dedup.Acquired); c.Attempt != 1 {
					t.Fatalf("claim after the cancelled one: attempt %d, want 1 (the cancelled claim wrote nothing)", c.Attempt)
				}
				// The connection survived and serves the next call.
				if _, err := claimer.Claim(bg, key("m2"), fpA, time.Minute); err != nil {
					t.Fatalf("claim on the same connection after the cancel: %v", err)
				}
			}
		}
	})
}

// A closed store refuses every call with ErrClosed, and closing a store
// made with New leaves the caller's pool open.
func TestClosed(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := context.Background()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	h := func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }
	_, e1 := s.RunInbox(ctx, key("m"), fpA, day, h)
	_, e2 := s.Sweep(ctx, 1)
	_, e3 := s.Migrate(ctx)
	_, e4 := s.ClaimBatch(ctx, []dedup.ClaimRequest{{Key: key("m")}}, time.Minute)
	_, e5 := s.StartSweeping(pgstore.SweepOptions{})
	for i, err := range []error{e1, e2, e3, e4, e5, s.Ping(ctx), s.SetRetention(ctx, "s", time.Hour, 0)} {
		if !errors.Is(err, dedup.ErrClosed) {
			t.Errorf("call %d after Close: %v, want ErrClosed", i, err)
		}
	}
	if err := s.Pool().Ping(ctx); err != nil {
		t.Fatalf("Close of a store made with New closed the caller's pool: %v", err)
	}
}
