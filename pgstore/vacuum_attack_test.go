package pgstore_test

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// countingHandler counts the records logged at warning level or above.
type countingHandler struct {
	mu   sync.Mutex
	msgs []string
}

func (h *countingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *countingHandler) Handle(_ context.Context, r slog.Record) error {
	if r.Level >= slog.LevelWarn {
		h.mu.Lock()
		h.msgs = append(h.msgs, r.Message)
		h.mu.Unlock()
	}
	return nil
}
func (h *countingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *countingHandler) WithGroup(string) slog.Handler      { return h }

func (h *countingHandler) vacuumWarnings() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, m := range h.msgs {
		if strings.Contains(m, "vacuum") {
			n++
		}
	}
	return n
}

// TestVacuumNotOwnerDetectedOnce: a store whose role may read and write
// the records table but does not own it (the usual split of a migration
// role and an application role) cannot vacuum it; the server then answers
// every VACUUM with a WARNING in its log. The store must find that out
// once, say so once in its own log, and send no VACUUM after it, rather
// than fill the server's log with a warning every run for ever.
func TestVacuumNotOwnerDetectedOnce(t *testing.T) {
	owner := testPool(t)
	ctx := context.Background()
	schema := freshSchema(t, owner)
	openStoreOn(t, owner, schema) // migrated by the owner
	role := fmt.Sprintf("rv_pgvac_%d", rand.Uint32())
	for _, q := range []string{
		`CREATE ROLE ` + role + ` NOLOGIN`,
		`GRANT USAGE ON SCHEMA ` + pgx.Identifier{schema}.Sanitize() + ` TO ` + role,
		`GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA ` + pgx.Identifier{schema}.Sanitize() + ` TO ` + role,
		`GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA ` + pgx.Identifier{schema}.Sanitize() + ` TO ` + role,
	} {
		if _, err := owner.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	t.Cleanup(func() {
		// After the schema's cleanup (registered before): drop what the
		// role was granted, then the role.
		owner.Exec(context.Background(), `DROP OWNED BY `+role)
		owner.Exec(context.Background(), `DROP ROLE `+role)
	})

	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	var notices atomic.Int64
	cfg.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		if strings.Contains(strings.ToLower(n.Message), "vacuum") {
			notices.Add(1)
		}
	}
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, `SET ROLE `+role)
		return err
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	// Closed after the store (cleanups run last registered first).
	t.Cleanup(pool.Close)
	h := &countingHandler{}
	s, err := pgstore.New(pool, pgstore.WithSchema(schema), pgstore.WithVacuum(10, 0), pgstore.WithLogger(slog.New(h)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	for i := range 5 {
		claimComplete(t, s, fmt.Sprint("n", i), 10) // each batch reaches the minimum
		pgstore.WaitVacuum(s)
	}
	if n := notices.Load(); n > 1 {
		t.Errorf("the server warned %d times that it could not vacuum the table: the store kept sending VACUUM", n)
	}
	if n := h.vacuumWarnings(); n != 1 {
		t.Errorf("the store logged %d warnings about vacuum (%q), want exactly 1 saying it cannot vacuum the table", n, h.msgs)
	}
}

// TestVacuumCloseStopsServerRun: Close cancels a run in flight and waits
// for it; the VACUUM on the server must be over when Close returns, not go
// on holding its lock on the table (which blocks DDL, a migration, and
// autovacuum) after the store, and maybe the process, is gone. The run is
// slowed by the session's vacuum cost settings so that Close finds it at
// work.
func TestVacuumCloseStopsServerRun(t *testing.T) {
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
	table := s.Tables().Records
	t.Cleanup(func() {
		// Whatever the outcome, leave no VACUUM to hold up the schema's drop.
		owner.Exec(context.Background(), `SELECT pg_cancel_backend(pid) FROM pg_stat_progress_vacuum WHERE relid = $1::regclass`, table)
	})
	if _, err := owner.Exec(ctx, `INSERT INTO `+table+` (deadline, scope, attempts, state, token, id, result)
SELECT now() + interval '1 hour', 0, 1, 2, '\x00', convert_to('x' || i, 'UTF8'), convert_to(repeat('r', 500), 'UTF8') FROM generate_series(1, 3000) i`); err != nil {
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
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if running() {
		t.Fatalf("Close returned while the store's VACUUM of %s still runs on the server", table)
	}
	// The pool the store was given still works, and its connections are
	// not left with a cancel request aimed at them.
	for range 8 {
		if _, err := pool.Exec(ctx, `SELECT pg_sleep(0.01)`); err != nil {
			t.Fatalf("the pool after Close: %v", err)
		}
	}
}
