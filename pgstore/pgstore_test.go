package pgstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/dedupkit/dedup/storetest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

const (
	fpA = dedup.Fingerprint("sha256:aaaa")
	fpB = dedup.Fingerprint("sha256:bbbb")
	day = 24 * time.Hour
)

// testPool returns the shared pool on DEDUP_POSTGRES_URL, skipping the
// test when the server does not answer.
func testPool(t testing.TB) *pgxpool.Pool { return testenv.PostgresPool(t) }

// newPool returns a pool of its own with at most maxConns connections,
// closed at the end of the test, its config changed by configure.
func newPool(t testing.TB, maxConns int32, configure ...func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	url := testenv.PostgresURL(t)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = maxConns
	for _, f := range configure {
		f(cfg)
	}
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// queryModes are pgx's query modes, in each of which the outbox's
// statements must run.
var queryModes = []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
	pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol}

// inMode makes a pool's connections send queries in mode qm (newPool).
func inMode(qm pgx.QueryExecMode) func(*pgxpool.Config) {
	return func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = qm }
}

// sessionKept returns a check that the one session of pool still has the
// planner settings the relay's statements set for themselves as it had
// them when sessionKept was called, and no transaction open.
func sessionKept(t *testing.T, pool *pgxpool.Pool) func(after string) {
	t.Helper()
	ctx := context.Background()
	const show = `SELECT current_setting('enable_seqscan') || '/' || current_setting('enable_bitmapscan') || '/' || current_setting('enable_sort') || '/' || current_setting('jit') || '/' || current_setting('plan_cache_mode')`
	session := func() (settings string, tx byte) {
		t.Helper()
		c, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Release()
		tx = c.Conn().PgConn().TxStatus()
		if err := c.QueryRow(ctx, show).Scan(&settings); err != nil {
			t.Fatal(err)
		}
		return settings, tx
	}
	want, _ := session()
	return func(after string) {
		t.Helper()
		if got, tx := session(); got != want || tx != 'I' {
			t.Fatalf("%s: the session has %s, transaction status %q; want %s, 'I'", after, got, tx, want)
		}
	}
}

// freshSchema returns a schema name of the test's own, dropped at its end.
func freshSchema(t testing.TB, pool *pgxpool.Pool) string { return testenv.PostgresSchema(t, pool) }

// mode is one layout of the records table.
type mode struct {
	name string
	opts []pgstore.Option
}

var modes = []mode{
	{"plain", nil},
	{"partitioned", []pgstore.Option{pgstore.WithPartitions(time.Hour), pgstore.WithPartitionsAhead(3 * time.Hour)}},
}

// forModes runs f as a parallel subtest for each layout.
func forModes(t *testing.T, f func(t *testing.T, m mode)) {
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			f(t, m)
		})
	}
}

// openStore returns a migrated store in a fresh schema on the shared pool.
func openStore(t testing.TB, opts ...pgstore.Option) *pgstore.Store {
	t.Helper()
	pool := testPool(t)
	return openStoreOn(t, pool, freshSchema(t, pool), opts...)
}

// openStoreOn returns a migrated store in schema on pool.
func openStoreOn(t testing.TB, pool *pgxpool.Pool, schema string, opts ...pgstore.Option) *pgstore.Store {
	t.Helper()
	s, err := pgstore.New(pool, append([]pgstore.Option{pgstore.WithSchema(schema)}, opts...)...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	if _, err := s.Migrate(context.Background()); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	return s
}

// records returns the table that holds s's records.
func records(s *pgstore.Store) string {
	if s.Partitioned() {
		return s.Tables().RecordsPartitioned
	}
	return s.Tables().Records
}

func key(id string) dedup.Key { return dedup.Key{Scope: "payments/consumer", ID: id} }

func mustClaim(t testing.TB, s *pgstore.Store, id string, fp dedup.Fingerprint, lease time.Duration, want dedup.Outcome) dedup.Claim {
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

func queryInt(t testing.TB, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := q.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// countRecords counts the rows of key id in s's records table.
func countRecords(t testing.TB, s *pgstore.Store, id string) int {
	t.Helper()
	return queryInt(t, s.Pool(), `SELECT count(*) FROM `+records(s)+` WHERE `+keyIs(s, "$1", "$2"), key(id).Scope, id)
}

// keyIs is the SQL condition that a record of s's tables has the key of
// scope and id (SQL expressions of type text): the tables store the scope
// as an integer and the ID as bytes.
func keyIs(s *pgstore.Store, scope, id string) string {
	return `scope = (SELECT id FROM ` + s.Tables().Scopes + ` WHERE scope = ` + scope + `) AND id = ` + fn(s, "key_id") + `(` + id + `)`
}

// fn returns the qualified name of one of s's SQL functions.
func fn(s *pgstore.Store, name string) string { return s.Tables().Schema + `."dedup_` + name + `"` }

// TestConformance runs the store contract's suite against both layouts,
// each in a schema of its own shared by the suite's parallel tests (each
// of which works in a scope of its own). Leases are real: the server's
// clock rules, so the suite sleeps past its 200ms leases.
func TestConformance(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		pool := testPool(t)
		schema := freshSchema(t, pool)
		openStoreOn(t, pool, schema, m.opts...) // migrates
		storetest.Run(t, func(t testing.TB, _ *storetest.Clock) dedup.Store {
			s, err := pgstore.New(pool, append([]pgstore.Option{pgstore.WithSchema(schema)}, m.opts...)...)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			return s
		}, storetest.Features{Extend: true, BatchClaim: true, BatchComplete: true, Sweep: true})
	})
}

// failMidBatch makes op (a read or a mark, named what) fail mid-batch on
// pool's one session twice, calling check after each: by a lock timeout
// while shared holds the outbox's ACCESS EXCLUSIVE lock (the settings
// statement ran before op waited), then by a cancel while op waits on the
// lock (seen in pg_stat_activity). The lock is released at the end.
func failMidBatch(t *testing.T, s *pgstore.Store, pool, shared *pgxpool.Pool, what string, op func(context.Context) error, check func(after string)) {
	t.Helper()
	ctx := context.Background()
	lock, err := shared.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Rollback(ctx)
	if _, err := lock.Exec(ctx, `LOCK TABLE `+s.Tables().Outbox+` IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	var pid int32
	if err := pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `SET lock_timeout = '100ms'`); err != nil {
		t.Fatal(err)
	}
	if err := op(ctx); pgCode(err) != "55P03" {
		t.Fatalf("%s under the lock = %v, want a lock timeout", what, err)
	}
	check("after a " + what + " failed mid-batch")
	if _, err := pool.Exec(ctx, `SET lock_timeout = 0`); err != nil {
		t.Fatal(err)
	}

	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- op(cctx) }()
	for waiting := false; !waiting; {
		if err := shared.QueryRow(ctx, `SELECT count(*) > 0 FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'`, pid).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if !waiting {
			time.Sleep(5 * time.Millisecond)
		}
	}
	cancel()
	if err := <-errc; err == nil {
		t.Fatalf("%s cancelled mid-batch returned no error", what)
	}
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	check("after a " + what + " cancelled mid-batch")
}
