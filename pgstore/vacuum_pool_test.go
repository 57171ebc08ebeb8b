package pgstore_test

import (
	"context"
	"testing"

	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5/pgxpool"
)

// vacuumPool returns a pool of at most max connections on the test server.
func vacuumPool(t *testing.T, max int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = max
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestVacuumLeavesPoolToClaims: a run holds its pool connection until the
// VACUUM ends (minutes on a large table). A store on a pool of one
// connection (pool_max_conns=1) gave it to the VACUUM and every claim
// waited in the pool for it; a store whose pool has one connection left
// took that one. The store must leave the callers a connection: no runs on
// a pool of one, and none started while the pool has only one to give.
func TestVacuumLeavesPoolToClaims(t *testing.T) {
	t.Run("pool of one", func(t *testing.T) {
		pool := vacuumPool(t, 1)
		s := openStoreOn(t, pool, freshSchema(t, testPool(t)), pgstore.WithVacuum(1, 0))
		claimComplete(t, s, "a", 5)
		pgstore.WaitVacuum(s)
		if n := pgstore.VacuumRuns(s); n != 0 {
			t.Fatalf("%d vacuums on a pool of one connection", n)
		}
	})
	t.Run("last connection", func(t *testing.T) {
		pool := vacuumPool(t, 2)
		s := openStoreOn(t, pool, freshSchema(t, testPool(t)), pgstore.WithVacuum(1, 0))
		held, err := pool.Acquire(context.Background()) // a caller's
		if err != nil {
			t.Fatal(err)
		}
		claimComplete(t, s, "a", 5)
		pgstore.WaitVacuum(s)
		n := pgstore.VacuumRuns(s)
		held.Release() // before any Fatal: the pool's Close waits for it
		if n != 0 {
			t.Fatalf("%d vacuums started on the pool's last free connection", n)
		}
		claimComplete(t, s, "b", 5) // the earlier completions are still pending
		pgstore.WaitVacuum(s)
		if n := pgstore.VacuumRuns(s); n != 1 {
			t.Fatalf("%d vacuums once the pool had a connection to spare, want 1", n)
		}
	})
	t.Run("taken while it starts", func(t *testing.T) {
		// The pool had a connection to spare when the completion looked,
		// and a caller took one before the run took its own: the run
		// took the last one, and claims waited for the whole VACUUM.
		pool := vacuumPool(t, 2)
		s := openStoreOn(t, pool, freshSchema(t, testPool(t)), pgstore.WithVacuum(1, 0))
		var held *pgxpool.Conn
		pgstore.SetVacuumStarted(s, func() {
			if held != nil {
				return
			}
			var err error
			if held, err = pool.Acquire(context.Background()); err != nil { // a caller's
				t.Error(err)
			}
		})
		claimComplete(t, s, "a", 5)
		pgstore.WaitVacuum(s)
		n := pgstore.VacuumRuns(s)
		if held == nil {
			t.Fatal("no run started")
		}
		held.Release()
		if n != 0 {
			t.Fatalf("%d vacuums ran on the last connection a caller left while the run started", n)
		}
		claimComplete(t, s, "b", 5) // the earlier completions are still pending
		pgstore.WaitVacuum(s)
		if n := pgstore.VacuumRuns(s); n != 1 {
			t.Fatalf("%d vacuums once the pool had a connection to spare, want 1", n)
		}
	})
}
