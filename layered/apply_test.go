package layered_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/layered"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TestApplyBehindWindowAndRedis: PostgreSQL's one-round-trip inbox
// (pgstore.Store.Apply) as the durable step behind a window and Redis.
// Every message is delivered three times by 8 goroutines at once, Redis
// is flushed and the window emptied between rounds, and the ledger ends
// with exactly one row per message; the window, Redis and PostgreSQL each
// catch duplicates.
func TestApplyBehindWindowAndRedis(t *testing.T) {
	testenv.Addrs(t, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
	pg, pool, ledger := pgLedger(t)
	ctx := context.Background()
	srv := testenv.StartRedis(t, "")
	w := win(t)
	lay := newLayered(t, layered.WithWindow(w), layered.WithFast(redisFast(t, srv), "redis"))
	deliver := func(id string) error {
		key := dedup.Key{Scope: "ledger", ID: id}
		fp := dedup.FingerprintOf([]byte("body-" + id))
		c, err := lay.RunInbox(ctx, key, fp, time.Hour, func(ctx context.Context) (dedup.Claim, error) {
			var b pgx.Batch
			b.Queue(`INSERT INTO `+ledger+` (msg_id) VALUES ($1)`, id)
			return pg.Apply(ctx, key, fp, time.Hour, []byte("ok"), &b)
		})
		switch {
		case err != nil:
			return err
		case c.Outcome == dedup.Acquired, c.Outcome == dedup.Duplicate, c.Outcome == dedup.InProgress:
			return nil // in progress: a racing copy holds the fast claim; the broker redelivers
		}
		return fmt.Errorf("%s: outcome %v", id, c.Outcome)
	}
	const n = 100
	for round := range 3 {
		var wg sync.WaitGroup
		for g := range 8 {
			wg.Go(func() {
				for i := range n {
					if err := deliver(fmt.Sprint("m", (i+g*13)%n)); err != nil {
						t.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
		if round == 0 {
			// Copies that saw a racing copy in progress are redelivered.
			for i := range n {
				if err := deliver(fmt.Sprint("m", i)); err != nil {
					t.Fatal(err)
				}
			}
		}
		srv.CLI("flushall")
		w.Reset()
	}
	var rows, distinct int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT msg_id) FROM `+ledger).Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	if rows != n || distinct != n {
		t.Fatalf("ledger has %d rows for %d messages; want exactly %d, one each", rows, distinct, n)
	}
	if st := lay.Stats(); st.Window == 0 || st.Fast == 0 || st.Durable == 0 {
		t.Fatalf("stats %+v: want duplicates caught by the window, Redis and PostgreSQL", st)
	}
}

// pgLedger returns a migrated pgstore in a schema of its own, its pool and
// the name of an empty ledger table (one row per applied message) beside
// its records.
func pgLedger(t *testing.T) (*pgstore.Store, *pgxpool.Pool, string) {
	t.Helper()
	pool := testenv.PostgresPool(t)
	pg, err := pgstore.New(pool, pgstore.WithSchema(testenv.PostgresSchema(t, pool)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pg.Close() })
	if _, err := pg.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	ledger := pg.Tables().Schema + ".ledger"
	if _, err := pool.Exec(context.Background(), `CREATE TABLE `+ledger+` (msg_id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return pg, pool, ledger
}
