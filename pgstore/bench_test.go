package pgstore_test

// Benchmarks put the naive shapes beside the store's in one run, on the
// same server and the same table layout, and report throughput with
// b.ReportMetric. Run them briefly on a shared machine:
//
//	go test -run '^$' -bench . -benchtime 2s ./pgstore/
//
// The baselines: one INSERT ... ON CONFLICT DO NOTHING per message in
// autocommit (the naive shape), the raw unnest ... ON CONFLICT DO NOTHING
// ceiling at the batch sizes the store uses, CopyFrom (no conflict check
// at all: the upper bound), and a bare business transaction without the
// inbox.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
)

// benchStore opens a migrated store in a fresh schema, with a copy of the
// records table (same columns and indexes) for the baselines.
func benchStore(b *testing.B, opts ...pgstore.Option) (*pgstore.Store, string) {
	b.Helper()
	pool := newPool(b, 20)
	s := openStoreOn(b, pool, freshSchema(b, pool), opts...)
	raw := s.Tables().Schema + ".raw"
	if _, err := pool.Exec(context.Background(), `CREATE TABLE `+raw+` (LIKE `+s.Tables().Records+` INCLUDING ALL)`); err != nil {
		b.Fatal(err)
	}
	return s, raw
}

// ids hands out distinct key IDs.
type ids struct {
	prefix string
	n      atomic.Int64
}

func newIDs() *ids { return &ids{prefix: fmt.Sprintf("%08x-", rand.Uint32())} }

func (g *ids) next() string { return g.prefix + fmt.Sprint(g.n.Add(1)) }

const benchScope = "bench/consumer"

func perSecond(b *testing.B, n int, unit string) {
	b.ReportMetric(float64(n)/b.Elapsed().Seconds(), unit)
}

// BenchmarkClaimOne compares one claim per message: the naive INSERT ...
// ON CONFLICT DO NOTHING in autocommit against Store.Claim (plain and
// partitioned), from one goroutine and from 16.
func BenchmarkClaimOne(b *testing.B) {
	s, raw := benchStore(b)
	sp, _ := benchStore(b, pgstore.WithPartitions(24*time.Hour))
	ctx := context.Background()
	naive := `INSERT INTO ` + raw + ` (scope, id, state, token, lease_until, expires_at, attempts)
VALUES ($1, $2, 1, $3, now() + interval '30 seconds', now() + interval '1 day', 1) ON CONFLICT DO NOTHING`
	run := func(name string, f func(id string) error) {
		for _, par := range []int{1, 16} {
			b.Run(fmt.Sprintf("%s/goroutines=%d", name, par), func(b *testing.B) {
				g := newIDs()
				if par == 1 {
					for b.Loop() {
						if err := f(g.next()); err != nil {
							b.Fatal(err)
						}
					}
				} else {
					b.SetParallelism(max(1, par/runtime.GOMAXPROCS(0)))
					b.RunParallel(func(pb *testing.PB) {
						for pb.Next() {
							if err := f(g.next()); err != nil {
								b.Error(err)
								return
							}
						}
					})
				}
				perSecond(b, b.N, "claims/s")
			})
		}
	}
	tok := dedup.NewToken()
	run("naive-insert-autocommit", func(id string) error {
		_, err := s.Pool().Exec(ctx, naive, benchScope, id, tok[:])
		return err
	})
	run("store-claim", func(id string) error {
		_, err := s.Claim(ctx, dedup.Key{Scope: benchScope, ID: id}, fpA, 30*time.Second)
		return err
	})
	run("store-claim-partitioned", func(id string) error {
		_, err := sp.Claim(ctx, dedup.Key{Scope: benchScope, ID: id}, fpA, 30*time.Second)
		return err
	})
	// A duplicate claim pays the no-op update of ON CONFLICT DO UPDATE.
	dup := dedup.Key{Scope: benchScope, ID: "the-duplicate"}
	if c, err := s.Claim(ctx, dup, fpA, time.Minute); err != nil || s.Complete(ctx, c, []byte("r"), time.Hour) != nil {
		b.Fatal(err)
	}
	b.Run("store-claim-duplicate/goroutines=1", func(b *testing.B) {
		for b.Loop() {
			if c, err := s.Claim(ctx, dup, fpA, time.Minute); err != nil || c.Outcome != dedup.Duplicate {
				b.Fatal(c.Outcome, err)
			}
		}
		perSecond(b, b.N, "claims/s")
	})
}

// BenchmarkClaimBatch compares batches of new keys: the raw unnest ...
// ON CONFLICT DO NOTHING ceiling (same table layout, no RETURNING),
// Store.ClaimBatch (plain and partitioned), and CopyFrom, at 100 and 1000
// keys per round trip, from one goroutine.
func BenchmarkClaimBatch(b *testing.B) {
	s, raw := benchStore(b)
	sp, _ := benchStore(b, pgstore.WithPartitions(24*time.Hour))
	ctx := context.Background()
	unnest := `INSERT INTO ` + raw + ` (scope, id, state, token, fingerprint, lease_until, expires_at, attempts)
SELECT u.scope, u.id, 1, u.token, u.fp, now() + interval '30 seconds', now() + interval '1 day', 1
FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bytea[]) AS u(scope, id, token, fp)
ON CONFLICT DO NOTHING`
	for _, size := range []int{100, 1000} {
		g := newIDs()
		batch := func() ([]string, []string, [][]byte, [][]byte, []dedup.ClaimRequest) {
			scopes, idv, toks, fps := make([]string, size), make([]string, size), make([][]byte, size), make([][]byte, size)
			reqs := make([]dedup.ClaimRequest, size)
			for i := range size {
				t := dedup.NewToken()
				scopes[i], idv[i], toks[i], fps[i] = benchScope, g.next(), t[:], []byte(fpA)
				reqs[i] = dedup.ClaimRequest{Key: dedup.Key{Scope: benchScope, ID: idv[i]}, Fingerprint: fpA}
			}
			return scopes, idv, toks, fps, reqs
		}
		b.Run(fmt.Sprintf("raw-unnest-do-nothing/size=%d", size), func(b *testing.B) {
			for b.Loop() {
				b.StopTimer()
				sc, id, tk, fp, _ := batch()
				b.StartTimer()
				if _, err := s.Pool().Exec(ctx, unnest, sc, id, tk, fp); err != nil {
					b.Fatal(err)
				}
			}
			perSecond(b, b.N*size, "ids/s")
		})
		for name, st := range map[string]*pgstore.Store{"store-claim-batch": s, "store-claim-batch-partitioned": sp} {
			b.Run(fmt.Sprintf("%s/size=%d", name, size), func(b *testing.B) {
				for b.Loop() {
					b.StopTimer()
					_, _, _, _, reqs := batch()
					b.StartTimer()
					cs, err := st.ClaimBatch(ctx, reqs, 30*time.Second)
					if err != nil || cs[size-1].Outcome != dedup.Acquired {
						b.Fatal(err)
					}
				}
				perSecond(b, b.N*size, "ids/s")
			})
		}
		b.Run(fmt.Sprintf("copyfrom/size=%d", size), func(b *testing.B) {
			for b.Loop() {
				b.StopTimer()
				sc, id, tk, fp, _ := batch()
				rows := make([][]any, size)
				now := time.Now()
				for i := range rows {
					rows[i] = []any{sc[i], id[i], int16(1), tk[i], fp[i], now, now.Add(24 * time.Hour), int32(1)}
				}
				b.StartTimer()
				_, err := s.Pool().CopyFrom(ctx, pgx.Identifier{schemaOf(s), "raw"},
					[]string{"scope", "id", "state", "token", "fingerprint", "lease_until", "expires_at", "attempts"}, pgx.CopyFromRows(rows))
				if err != nil {
					b.Fatal(err)
				}
			}
			perSecond(b, b.N*size, "ids/s")
		})
	}
}

// schemaOf returns the bare schema name of s.
func schemaOf(s *pgstore.Store) string {
	q := s.Tables().Schema
	return q[1 : len(q)-1]
}

// BenchmarkInbox compares a business transaction that inserts one ledger
// row (BEGIN, INSERT, COMMIT; the ledger has a serial primary key, as
// ledgers do) with the same transaction through RunInbox,
// which adds the dedup record in the same transaction, from one goroutine
// and from 16.
func BenchmarkInbox(b *testing.B) {
	s, raw := benchStore(b)
	sp, _ := benchStore(b, pgstore.WithPartitions(24*time.Hour))
	ctx := context.Background()
	for _, st := range []*pgstore.Store{s, sp} {
		if _, err := st.Pool().Exec(ctx, `CREATE TABLE `+st.Tables().Schema+`.ledger (entry bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, msg_id text NOT NULL, amount bigint NOT NULL)`); err != nil {
			b.Fatal(err)
		}
	}
	naiveDedup := `INSERT INTO ` + raw + ` (scope, id, state, token, lease_until, expires_at, attempts)
VALUES ($1, $2, 2, '\x01', now(), now() + interval '1 hour', 1) ON CONFLICT DO NOTHING`
	write := func(st *pgstore.Store) string {
		return `INSERT INTO ` + st.Tables().Schema + `.ledger (msg_id, amount) VALUES ($1, 100)`
	}
	cases := []struct {
		name string
		f    func(id string) error
	}{
		{"bare-business-tx", func(id string) error {
			return pgx.BeginFunc(ctx, s.Pool(), func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, write(s), id)
				return err
			})
		}},
		// The floor of any inbox: the same transaction plus a naive
		// dedup insert (ON CONFLICT DO NOTHING, no RETURNING) into a
		// table laid out like the records table.
		{"bare-tx-plus-naive-dedup-insert", func(id string) error {
			return pgx.BeginFunc(ctx, s.Pool(), func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, naiveDedup, benchScope, id); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, write(s), id)
				return err
			})
		}},
		{"store-run-inbox", func(id string) error {
			_, err := s.RunInbox(ctx, dedup.Key{Scope: benchScope, ID: id}, fpA, time.Hour, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				_, err := tx.Exec(ctx, write(s), id)
				return nil, err
			})
			return err
		}},
		{"store-run-inbox-partitioned", func(id string) error {
			_, err := sp.RunInbox(ctx, dedup.Key{Scope: benchScope, ID: id}, fpA, time.Hour, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				_, err := tx.Exec(ctx, write(sp), id)
				return nil, err
			})
			return err
		}},
	}
	for _, par := range []int{1, 16} {
		for _, c := range cases {
			b.Run(fmt.Sprintf("%s/goroutines=%d", c.name, par), func(b *testing.B) {
				g := newIDs()
				if par == 1 {
					for b.Loop() {
						if err := c.f(g.next()); err != nil {
							b.Fatal(err)
						}
					}
				} else {
					b.SetParallelism(max(1, par/runtime.GOMAXPROCS(0)))
					b.RunParallel(func(pb *testing.PB) {
						for pb.Next() {
							if err := c.f(g.next()); err != nil {
								b.Error(err)
								return
							}
						}
					})
				}
				perSecond(b, b.N, "tx/s")
			})
		}
	}
}

// BenchmarkSweep measures the sweeper deleting expired rows from a table
// that also holds live rows (one op: 50,000 expired rows), alone and under
// claim load, and the same rows removed by dropping their partition.
func BenchmarkSweep(b *testing.B) {
	const rows = 50_000
	s, _ := benchStore(b)
	ctx := context.Background()
	seed(b, s, "live-", rows, -time.Hour)
	b.Run("sweeper/batch=5000", func(b *testing.B) {
		for b.Loop() {
			b.StopTimer()
			seed(b, s, fmt.Sprintf("old-%08x-", rand.Uint32()), rows, time.Minute)
			b.StartTimer()
			r, err := s.SweepUntilEmpty(ctx, 5000, 0, 0)
			if err != nil || r.Deleted != rows {
				b.Fatal(r.Deleted, err)
			}
		}
		perSecond(b, b.N*rows, "rows/s")
	})
	// Claims from 4 goroutines run while the sweeper works, and for as long
	// before it with no sweeper; the p99 of each set is reported. Smaller
	// batches and a pause between them trade sweep speed for claim
	// latency: every batch is one transaction whose commit flushes its WAL.
	g := newIDs()
	claims := func(stop <-chan struct{}) []time.Duration {
		var mu sync.Mutex
		var lat []time.Duration
		var wg sync.WaitGroup
		for range 4 {
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
					}
					t0 := time.Now()
					if _, err := s.Claim(ctx, dedup.Key{Scope: benchScope, ID: g.next()}, fpA, time.Minute); err != nil {
						b.Error(err)
						return
					}
					d := time.Since(t0)
					mu.Lock()
					lat = append(lat, d)
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		return lat
	}
	p99 := func(lat []time.Duration) time.Duration {
		slices.Sort(lat)
		if len(lat) == 0 {
			return 0
		}
		return lat[len(lat)*99/100]
	}
	for _, tc := range []struct {
		batch int
		pause time.Duration
	}{{5000, 0}, {1000, 0}, {1000, 4 * time.Millisecond}, {500, 2 * time.Millisecond}, {250, time.Millisecond}} {
		b.Run(fmt.Sprintf("sweeper-under-claim-load/batch=%d/pause=%s", tc.batch, tc.pause), func(b *testing.B) {
			var idle, busy []time.Duration
			for b.Loop() {
				b.StopTimer()
				seed(b, s, fmt.Sprintf("old-%08x-", rand.Uint32()), rows, time.Minute)
				stop := make(chan struct{})
				res := make(chan []time.Duration)
				go func() { res <- claims(stop) }()
				b.StartTimer()
				start := time.Now()
				r, err := s.SweepUntilEmpty(ctx, tc.batch, 0, tc.pause)
				took := time.Since(start)
				b.StopTimer()
				close(stop)
				busy = append(busy, <-res...)
				if err != nil || r.Deleted != rows {
					b.Fatal(r.Deleted, err)
				}
				stop = make(chan struct{})
				go func() { res <- claims(stop) }()
				time.Sleep(took)
				close(stop)
				idle = append(idle, <-res...)
				b.StartTimer()
			}
			perSecond(b, b.N*rows, "rows/s")
			pi, pb := p99(idle), p99(busy)
			b.ReportMetric(float64(pi.Microseconds()), "claim-p99-idle-us")
			b.ReportMetric(float64(pb.Microseconds()), "claim-p99-sweeping-us")
			b.ReportMetric(float64(pb)/float64(pi), "p99-ratio")
		})
	}
	sp, _ := benchStore(b, pgstore.WithPartitions(time.Hour))
	b.Run("partition-drop", func(b *testing.B) {
		ago := 2
		for b.Loop() {
			b.StopTimer()
			pastPartition(b, sp, ago)
			seedPartition(b, sp, ago, "old-", rows, -time.Minute)
			ago++
			b.StartTimer()
			d, err := sp.DropExpiredPartitions(ctx)
			if err != nil || len(d) != 1 {
				b.Fatal(d, err)
			}
		}
		perSecond(b, b.N*rows, "rows/s")
	})
}
