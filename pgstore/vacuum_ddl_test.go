package pgstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TestVacuumYieldsToDDL: autovacuum gives way to a lock request it
// blocks (the server cancels it after deadlock_timeout); a VACUUM sent by
// a client does not. DDL on the records table (a migration's ALTER, an
// operator's CREATE INDEX) queues behind the store's VACUUM, and every
// claim queues behind the DDL: claims stall for the rest of the VACUUM,
// which on a large table is minutes. The store's run must give way as
// autovacuum does: a claim made while DDL waits on the run must not wait
// for the run to end.
func TestVacuumYieldsToDDL(t *testing.T) {
	owner := testPool(t)
	ctx := context.Background()
	schema := freshSchema(t, owner)
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	cfg.ConnConfig.RuntimeParams["vacuum_cost_delay"] = "100"
	cfg.ConnConfig.RuntimeParams["vacuum_cost_limit"] = "1"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	s := openStoreOn(t, pool, schema, pgstore.WithVacuum(1, 0))
	other := openStoreOn(t, owner, schema, pgstore.WithVacuum(0, 0)) // another instance
	table := s.Tables().Records
	t.Cleanup(func() {
		owner.Exec(context.Background(), `SELECT pg_cancel_backend(pid) FROM pg_stat_progress_vacuum WHERE relid = $1::regclass`, table)
	})
	if _, err := owner.Exec(ctx, `INSERT INTO `+table+` (deadline, scope, attempts, state, token, id, result)
SELECT now() + interval '1 hour', 0, 1, 2, '\x00', convert_to('x' || i, 'UTF8'), convert_to(repeat('r', 500), 'UTF8') FROM generate_series(1, 1000) i`); err != nil {
		t.Fatal(err)
	}
	claimComplete(t, s, "a", 1) // starts a run
	running := func() bool {
		var n int
		if err := owner.QueryRow(ctx, `SELECT count(*) FROM pg_stat_progress_vacuum WHERE relid = $1::regclass`, table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n > 0
	}
	for i := 0; !running(); i++ {
		if i == 1000 {
			t.Fatal("the store's VACUUM never showed on the server")
		}
		time.Sleep(10 * time.Millisecond)
	}
	ddl := make(chan error, 1)
	go func() {
		_, err := owner.Exec(ctx, `ALTER TABLE `+table+` ADD COLUMN rv_extra int`)
		ddl <- err
	}()
	claimed := make(chan error, 1)
	go func() {
		time.Sleep(100 * time.Millisecond) // behind the DDL in the lock queue
		cctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		_, err := other.Claim(cctx, dedup.Key{Scope: "vacuum", ID: "late"}, "", time.Minute)
		claimed <- err
	}()
	if err := <-claimed; err != nil {
		t.Fatalf("claim: %v", err)
	}
	if err := <-ddl; err != nil {
		t.Fatalf("DDL: %v", err)
	}
	// The claim got through: either the store's VACUUM gave way, or the
	// claim waited for it to finish (the server counts it then).
	if n := vacuumCount(t, owner, table); n != 0 {
		t.Fatalf("the claim waited for the store's whole VACUUM of %s (DDL queued behind it): the VACUUM finished (%d)", table, n)
	}
}
