package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// vacuumCount returns how many times table was vacuumed by hand (the
// store's runs; autovacuum is counted apart).
func vacuumCount(t *testing.T, pool *pgxpool.Pool, table string) int64 {
	t.Helper()
	var n int64
	if err := pool.QueryRow(context.Background(), `SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = $1::regclass`, table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// claimComplete claims n new keys and completes them in one batch.
func claimComplete(t *testing.T, s *pgstore.Store, prefix string, n int) {
	t.Helper()
	ctx := context.Background()
	reqs := make([]dedup.ClaimRequest, n)
	for i := range reqs {
		reqs[i] = dedup.ClaimRequest{Key: dedup.Key{Scope: "vacuum", ID: fmt.Sprintf("%s-%d", prefix, i)}}
	}
	cs, err := s.ClaimBatch(ctx, reqs, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	items := make([]dedup.Completion, n)
	for i, c := range cs {
		if c.Outcome != dedup.Acquired {
			t.Fatalf("claim %d: %v", i, c.Outcome)
		}
		items[i] = dedup.Completion{Claim: c, Result: []byte("r")}
	}
	errs, err := s.CompleteBatch(ctx, items, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
}

// TestVacuumAfterCompletions: the store vacuums its records table once
// the minimum of completions is reached and they are the fraction of the
// table's rows, not before. (Whether the vacuum can remove the dead
// versions depends on the oldest snapshot on the server, which other
// tests hold on the shared one; BenchmarkBytesPerRow measures that.)
func TestVacuumAfterCompletions(t *testing.T) {
	pool := testPool(t)
	s := openStoreOn(t, pool, freshSchema(t, pool), pgstore.WithVacuum(50, 0.5))
	table := s.Tables().Records
	ctx := context.Background()

	claimComplete(t, s, "a", 49)
	pgstore.WaitVacuum(s)
	if n := pgstore.VacuumRuns(s); n != 0 {
		t.Fatalf("%d vacuums after 49 completions, minimum 50", n)
	}
	claimComplete(t, s, "b", 1)
	pgstore.WaitVacuum(s)
	if n := pgstore.VacuumRuns(s); n != 1 {
		t.Fatalf("%d vacuums after 50 completions, want 1", n)
	}
	if n := vacuumCount(t, pool, table); n != 1 {
		t.Fatalf("the server counted %d vacuums of %s, want 1", n, table)
	}
	// The table now has about 50 rows: the next run waits for 50
	// completions (the minimum), then for half the rows once there are
	// more than 100.
	if _, err := pool.Exec(ctx, `INSERT INTO `+table+` (deadline, scope, attempts, state, token, id, result)
SELECT now() + interval '1 hour', 0, 1, 2, '\x00', convert_to('x' || i, 'UTF8'), '' FROM generate_series(1, 950) i`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `ANALYZE `+table); err != nil {
		t.Fatal(err)
	}
	claimComplete(t, s, "c", 300) // 300 of about 1,000 rows: under half
	pgstore.WaitVacuum(s)
	claimComplete(t, s, "d", 100)
	pgstore.WaitVacuum(s)
	if n := pgstore.VacuumRuns(s); n != 1 {
		t.Fatalf("%d vacuums after 400 completions in a table of about 1,000 rows, fraction 0.5: want 1 (the first)", n)
	}
	claimComplete(t, s, "e", 200) // 600 pending
	pgstore.WaitVacuum(s)
	if n := pgstore.VacuumRuns(s); n != 2 {
		t.Fatalf("%d vacuums after 600 completions in a table of about 1,000 rows, fraction 0.5: want 2", n)
	}
}

// TestVacuumOff: WithVacuum(0, 0) and the partitioned layout never vacuum.
func TestVacuumOff(t *testing.T) {
	for _, m := range []mode{{"off", []pgstore.Option{pgstore.WithVacuum(0, 0)}}, {"partitioned", append([]pgstore.Option{pgstore.WithVacuum(1, 0)}, modes[1].opts...)}} {
		t.Run(m.name, func(t *testing.T) {
			pool := testPool(t)
			s := openStoreOn(t, pool, freshSchema(t, pool), m.opts...)
			claimComplete(t, s, "a", 100)
			pgstore.WaitVacuum(s)
			if n := pgstore.VacuumRuns(s); n != 0 {
				t.Fatalf("%d vacuums", n)
			}
		})
	}
}

// TestVacuumOptionValidated: a negative minimum and a fraction that is
// negative or not a number are refused.
func TestVacuumOptionValidated(t *testing.T) {
	for _, o := range []pgstore.Option{pgstore.WithVacuum(-1, 0.1), pgstore.WithVacuum(1, -0.1), pgstore.WithVacuum(1, math.NaN()), pgstore.WithVacuum(1, math.Inf(1))} {
		if _, err := pgstore.New(testPool(t), o); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("got %v, want an invalid argument", err)
		}
	}
}

// TestVacuumCloseWaits: Close returns with no run in flight.
func TestVacuumCloseWaits(t *testing.T) {
	pool := testPool(t)
	s := openStoreOn(t, pool, freshSchema(t, pool), pgstore.WithVacuum(10, 0))
	claimComplete(t, s, "a", 10) // starts a run
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	pgstore.WaitVacuum(s) // returns at once: Close waited
	if n := pgstore.VacuumRuns(s); n > 1 {
		t.Fatalf("%d vacuums", n)
	}
}

// sqlLog records the statements a pool's connections send.
type sqlLog struct {
	mu   sync.Mutex
	sqls []string
}

func (l *sqlLog) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	l.mu.Lock()
	l.sqls = append(l.sqls, d.SQL)
	l.mu.Unlock()
	return ctx
}

func (l *sqlLog) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestVacuumNeverTruncates: the store's VACUUM keeps the table's length
// (TRUNCATE false): cutting empty pages off the end takes an exclusive
// lock on the table, which would stall every claim (and cancel queries on
// a hot standby) as often as the store vacuums. The statement is checked,
// not the table's size: whether a run could truncate depends on the
// oldest snapshot on the shared server.
func TestVacuumNeverTruncates(t *testing.T) {
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	log := &sqlLog{}
	cfg.ConnConfig.Tracer = log
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	s := openStoreOn(t, pool, freshSchema(t, pool), pgstore.WithVacuum(20, 0))
	claimComplete(t, s, "t", 20)
	pgstore.WaitVacuum(s)
	if n := pgstore.VacuumRuns(s); n != 1 {
		t.Fatalf("%d vacuum runs after 20 completions, minimum 20: want 1", n)
	}
	log.mu.Lock()
	defer log.mu.Unlock()
	var vacuums []string
	for _, q := range log.sqls {
		if strings.HasPrefix(strings.ToUpper(strings.TrimSpace(q)), "VACUUM") {
			vacuums = append(vacuums, q)
		}
	}
	if len(vacuums) != 1 {
		t.Fatalf("the store sent %d VACUUM statements, want 1: %q", len(vacuums), vacuums)
	}
	if !strings.Contains(vacuums[0], "TRUNCATE false") {
		t.Fatalf("the store's VACUUM may truncate the table (an exclusive lock): %q", vacuums[0])
	}
}
