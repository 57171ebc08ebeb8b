package verify_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/internal/verify"
	"github.com/jackc/pgx/v5"
)

// postgresLeaseConfig gives lease mode on PostgreSQL a lease far above the
// slowest claim-to-complete time of a busy machine under the race
// detector, for the reason sqliteLeaseConfig gives.
func postgresLeaseConfig() verify.Config {
	cfg := smallConfig()
	cfg.Consumers = 8
	cfg.Lease = 2 * time.Second
	return cfg
}

// schemaExists reports whether the run's schema named in the target's
// Path is in the database.
func schemaExists(t *testing.T, path string) (string, bool) {
	t.Helper()
	_, rest, ok := strings.Cut(path, "PostgreSQL schema ")
	schema, _, _ := strings.Cut(rest, " ")
	if !ok || schema == "" {
		t.Fatalf("Path %q names no schema", path)
	}
	conn, err := pgx.Connect(context.Background(), testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var n int
	if err := conn.QueryRow(context.Background(), `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename IN ('ledger', 'dedup_rec')`, schema).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n == 1 || n > 2 {
		t.Fatalf("schema %s has %d of the ledger and records tables", schema, n)
	}
	return schema, n == 2
}

// Each run works in a schema of its own; Close drops it unless --keep,
// which leaves the ledger and the dedup tables for inspection.
func TestPostgresKeep(t *testing.T) {
	t.Parallel()
	testenv.PostgresURL(t)
	b, ok := verify.LookupBackend("postgres")
	if !ok {
		t.Fatal("no postgres backend")
	}
	for _, keep := range []bool{false, true} {
		tg, err := b.Open(t.Context(), verify.OpenOptions{Mode: verify.InboxMode, Keep: keep, Lease: time.Second, Messages: 10})
		if err != nil {
			t.Fatal(err)
		}
		cfg := smallConfig()
		cfg.Messages = 20
		rep := run(t, cfg, tg)
		if !rep.OK || rep.Effects != 20 {
			t.Fatalf("keep=%v: run not clean: %+v", keep, rep)
		}
		path := verify.PathOf(tg)
		if _, exists := schemaExists(t, path); !exists {
			t.Fatalf("keep=%v: the run's tables are missing before Close", keep)
		}
		if err := tg.Close(); err != nil {
			t.Fatal(err)
		}
		schema, exists := schemaExists(t, path)
		if exists != keep {
			t.Fatalf("keep=%v: schema %s exists after Close: %v", keep, schema, exists)
		}
		if keep {
			conn, err := pgx.Connect(context.Background(), testenv.PostgresURL(t))
			if err != nil {
				t.Fatal(err)
			}
			var ledger int
			if err := conn.QueryRow(context.Background(), `SELECT count(*) FROM `+schema+`.ledger`).Scan(&ledger); err != nil || ledger != 20 {
				t.Errorf("kept ledger has %d rows (%v), want 20", ledger, err)
			}
			conn.Exec(context.Background(), `DROP SCHEMA `+schema+` CASCADE`)
			conn.Close(context.Background())
		}
	}
}
