package pgstore_test

// Benchmarks put the naive shapes beside the store's in one run, on the
// same server and the same table layout, and report throughput with
// b.ReportMetric. Run them briefly on a shared machine:
//
//	go test -run '^$' -bench . -benchtime 2s ./pgstore/
//
// BenchmarkInbox and BenchmarkSweep count ops as rounds and passes; give
// them a count, as docs/benchmarks.md does:
//
//	go test -run '^$' -bench 'Inbox' -benchtime 40x ./pgstore/
//	go test -run '^$' -bench 'Sweep' -benchtime 10x ./pgstore/
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
	// The baselines write the compact layout (scope as its integer, the
	// ID as bytes): the same table the store writes.
	naive := `INSERT INTO ` + raw + ` (scope, id, state, token, deadline, attempts)
VALUES (length($1::text), convert_to($2::text, 'UTF8'), 1, $3, now() + interval '30 seconds', 1) ON CONFLICT DO NOTHING`
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
	unnest := `INSERT INTO ` + raw + ` (scope, id, state, token, fingerprint, deadline, attempts)
SELECT length(u.scope), convert_to(u.id, 'UTF8'), 1, u.token, u.fp, now() + interval '30 seconds', 1
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
					rows[i] = []any{int32(len(sc[i])), []byte(id[i]), int16(1), tk[i], fp[i], now.Add(30 * time.Second), int32(1)}
				}
				b.StartTimer()
				_, err := s.Pool().CopyFrom(ctx, pgx.Identifier{schemaOf(s), "raw"},
					[]string{"scope", "id", "state", "token", "fingerprint", "deadline", "attempts"}, pgx.CopyFromRows(rows))
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

// interleave runs cases side by side, so that the drift of a noisy
// machine hits them alike: every op of b is one round in which each case
// runs a block of transactions from par goroutines in turn, in an order
// that rotates from round to round. It returns each case's transactions
// per second over its own time.
func interleave(b *testing.B, par, block int, cases []func(id string) error) []float64 {
	g := newIDs()
	run := func(f func(id string) error) time.Duration {
		var left atomic.Int64
		left.Store(int64(block))
		start := time.Now()
		var wg sync.WaitGroup
		for range par {
			wg.Go(func() {
				for left.Add(-1) >= 0 {
					if err := f(g.next()); err != nil {
						b.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
		if b.Failed() {
			b.FailNow()
		}
		return time.Since(start)
	}
	for _, f := range cases {
		run(f) // the pool dials its connections, statements get prepared
	}
	took := make([]time.Duration, len(cases))
	rounds := 0
	b.ResetTimer()
	for b.Loop() {
		for k := range cases {
			i := (k + rounds) % len(cases)
			took[i] += run(cases[i])
		}
		rounds++
	}
	tps := make([]float64, len(cases))
	for i := range cases {
		tps[i] = float64(rounds*block) / took[i].Seconds()
	}
	return tps
}

// BenchmarkCompleteBatch completes 100 claims acquired by one ClaimBatch
// (outside the timer): one Complete each (100 commits, the fallback
// dedup.CompleteBatch uses for a store without batch completions), or one
// Store.CompleteBatch (one UPDATE over unnest, one commit), on both
// layouts, from one goroutine.
func BenchmarkCompleteBatch(b *testing.B) {
	s, _ := benchStore(b)
	sp, _ := benchStore(b, pgstore.WithPartitions(24*time.Hour))
	ctx := context.Background()
	const size = 100
	g := newIDs()
	claim := func(b *testing.B, st *pgstore.Store) []dedup.Completion {
		reqs := make([]dedup.ClaimRequest, size)
		for i := range reqs {
			reqs[i] = dedup.ClaimRequest{Key: dedup.Key{Scope: benchScope, ID: g.next()}, Fingerprint: fpA}
		}
		cs, err := st.ClaimBatch(ctx, reqs, time.Minute)
		if err != nil {
			b.Fatal(err)
		}
		items := make([]dedup.Completion, size)
		for i, c := range cs {
			items[i] = dedup.Completion{Claim: c, Result: []byte("ok")}
		}
		return items
	}
	for _, l := range []struct {
		name string
		st   *pgstore.Store
	}{{"plain", s}, {"partitioned", sp}} {
		b.Run("one-complete-each/"+l.name, func(b *testing.B) {
			for b.Loop() {
				b.StopTimer()
				items := claim(b, l.st)
				b.StartTimer()
				for _, it := range items {
					if err := l.st.Complete(ctx, it.Claim, it.Result, time.Hour); err != nil {
						b.Fatal(err)
					}
				}
			}
			perSecond(b, b.N*size, "completions/s")
		})
		b.Run("complete-batch/"+l.name, func(b *testing.B) {
			for b.Loop() {
				b.StopTimer()
				items := claim(b, l.st)
				b.StartTimer()
				errs, err := l.st.CompleteBatch(ctx, items, time.Hour)
				if err != nil || errs[size-1] != nil {
					b.Fatal(err, errs[size-1])
				}
			}
			perSecond(b, b.N*size, "completions/s")
		})
	}
}

// BenchmarkCompleteBatchLockOrder measures what locking a batch
// completion's rows in key order costs (issue 12): the statement as it is
// (a LATERAL FOR UPDATE probe per item, then the UPDATE) against the old
// single UPDATE ... FROM unnest, whose locks follow the plan. Each round
// claims a batch for each case (untimed) and then times one CompleteBatch
// per case, in an order that rotates from round to round, on both
// layouts. It reports completions per second for each case and their
// ratio (ordered over unordered).
func BenchmarkCompleteBatchLockOrder(b *testing.B) {
	for _, size := range []int{100, 1000} {
		for _, l := range []struct {
			name string
			opts []pgstore.Option
		}{{"plain", nil}, {"partitioned", []pgstore.Option{pgstore.WithPartitions(24 * time.Hour)}}} {
			b.Run(fmt.Sprintf("%s/%d", l.name, size), func(b *testing.B) {
				ordered, _ := benchStore(b, l.opts...)
				unordered, err := pgstore.New(ordered.Pool(), append([]pgstore.Option{pgstore.WithSchema(schemaOf(ordered))}, l.opts...)...)
				if err != nil {
					b.Fatal(err)
				}
				defer unordered.Close()
				pgstore.UseUnorderedCompleteBatch(unordered)
				ctx := context.Background()
				g := newIDs()
				stores := []*pgstore.Store{ordered, unordered}
				took := make([]time.Duration, len(stores))
				round := 0
				for b.Loop() {
					for k := range stores {
						i := (k + round) % len(stores)
						b.StopTimer()
						reqs := make([]dedup.ClaimRequest, size)
						for j := range reqs {
							reqs[j] = dedup.ClaimRequest{Key: dedup.Key{Scope: benchScope, ID: g.next()}, Fingerprint: fpA}
						}
						cs, err := stores[i].ClaimBatch(ctx, reqs, time.Minute)
						if err != nil {
							b.Fatal(err)
						}
						items := make([]dedup.Completion, size)
						for j, c := range cs {
							items[j] = dedup.Completion{Claim: c, Result: []byte("ok")}
						}
						b.StartTimer()
						start := time.Now()
						errs, err := stores[i].CompleteBatch(ctx, items, time.Hour)
						took[i] += time.Since(start)
						if err != nil || errs[size-1] != nil {
							b.Fatal(err, errs[size-1])
						}
					}
					round++
				}
				rate := func(i int) float64 { return float64(round*size) / took[i].Seconds() }
				b.ReportMetric(rate(0), "ordered-completions/s")
				b.ReportMetric(rate(1), "unordered-completions/s")
				b.ReportMetric(rate(0)/rate(1), "ordered/unordered")
			})
		}
	}
}

// BenchmarkInbox compares a business transaction that inserts one ledger
// row (BEGIN, INSERT, COMMIT; the ledger has a serial primary key, as
// ledgers do) with the same transaction through RunInbox, which adds the
// dedup record in the same transaction, from one goroutine and from 16.
// The cases run interleaved (see interleave) and each reports tx/s; the
// ratios are the bare transaction's rate over the inbox's (how many times
// slower):
//
//   - bare: the business transaction alone (3 round trips).
//   - floor: the same plus a naive INSERT ... ON CONFLICT DO NOTHING of
//     the key into a table laid out like the records table (4 round
//     trips): the WAL and index writes of any inbox.
//   - floor-pipelined: that insert sent in one batch with the BEGIN (3
//     round trips): the least an inbox can cost in round trips and rows.
//   - inbox: RunInbox with the same write (3 round trips).
//   - inbox-with-result: the handler also returns a result, stored by an
//     UPDATE sent with the COMMIT (3 round trips).
//   - inbox-partitioned: RunInbox on the partitioned store.
//   - inbox-caller-tx: Inbox in a transaction the caller begins and
//     commits (4 round trips), as RunInbox did before it pipelined.
//   - bare-pipelined: the business write alone in one pipeline, which
//     PostgreSQL runs as an implicit transaction (1 round trip): the
//     bare transaction written as Apply writes it.
//   - apply, apply-partitioned: Apply with the same write queued (1 round
//     trip).
//
// Besides each case's tx/s, it reports each case's time over bare's
// (NAME-x-bare) and apply's over bare-pipelined's.
func BenchmarkInbox(b *testing.B) {
	s, raw := benchStore(b)
	sp, _ := benchStore(b, pgstore.WithPartitions(24*time.Hour))
	sc, _ := benchStore(b)
	pgstore.UseCaseInbox(sc)
	ctx := context.Background()
	for _, st := range []*pgstore.Store{s, sp, sc} {
		if _, err := st.Pool().Exec(ctx, `CREATE TABLE `+st.Tables().Schema+`.ledger (entry bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, msg_id text NOT NULL, amount bigint NOT NULL)`); err != nil {
			b.Fatal(err)
		}
	}
	naiveDedup := `INSERT INTO ` + raw + ` (scope, id, state, token, deadline, attempts)
VALUES (length($1::text), convert_to($2::text, 'UTF8'), 2, '\x01', now() + interval '1 hour', 1) ON CONFLICT DO NOTHING`
	write := func(st *pgstore.Store) string {
		return `INSERT INTO ` + st.Tables().Schema + `.ledger (msg_id, amount) VALUES ($1, 100)`
	}
	runInbox := func(st *pgstore.Store, result []byte) func(id string) error {
		return func(id string) error {
			_, err := st.RunInbox(ctx, dedup.Key{Scope: benchScope, ID: id}, fpA, time.Hour, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				_, err := tx.Exec(ctx, write(st), id)
				return result, err
			})
			return err
		}
	}
	applyWrite := func(st *pgstore.Store) func(id string) error {
		return func(id string) error {
			var w pgx.Batch
			w.Queue(write(st), id)
			_, err := st.Apply(ctx, dedup.Key{Scope: benchScope, ID: id}, fpA, time.Hour, nil, &w)
			return err
		}
	}
	names := []string{"bare", "floor", "floor-pipelined", "inbox", "inbox-with-result", "inbox-partitioned", "inbox-caller-tx", "inbox-case-upsert",
		"bare-pipelined", "apply", "apply-partitioned"}
	cases := []func(id string) error{
		func(id string) error {
			return pgx.BeginFunc(ctx, s.Pool(), func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, write(s), id)
				return err
			})
		},
		func(id string) error {
			return pgx.BeginFunc(ctx, s.Pool(), func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, naiveDedup, benchScope, id); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, write(s), id)
				return err
			})
		},
		func(id string) error {
			var batch pgx.Batch
			batch.BeginTx(pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
			batch.Queue(naiveDedup, benchScope, id)
			br := s.Pool().SendBatch(ctx, &batch)
			tx := br.Tx()
			defer tx.Rollback(ctx)
			if err := br.Close(); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, write(s), id); err != nil {
				return err
			}
			return tx.Commit(ctx)
		},
		runInbox(s, nil),
		runInbox(s, []byte("receipt")),
		runInbox(sp, nil),
		func(id string) error {
			return pgx.BeginTxFunc(ctx, s.Pool(), pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
				_, err := s.Inbox(ctx, tx, dedup.Key{Scope: benchScope, ID: id}, fpA, time.Hour, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
					_, err := tx.Exec(ctx, write(s), id)
					return nil, err
				})
				return err
			})
		},
		runInbox(sc, nil),
		func(id string) error {
			var w pgx.Batch
			w.Queue(write(s), id)
			return s.Pool().SendBatch(ctx, &w).Close()
		},
		applyWrite(s),
		applyWrite(sp),
	}
	for _, par := range []int{1, 16} {
		b.Run(fmt.Sprintf("goroutines=%d", par), func(b *testing.B) {
			tps := interleave(b, par, 20*par, cases)
			for i, name := range names {
				b.ReportMetric(tps[i], name+"-tx/s")
			}
			for i, name := range names[1:] {
				b.ReportMetric(tps[0]/tps[i+1], name+"-x-bare")
			}
			b.ReportMetric(tps[2]/tps[3], "inbox-x-floor-pipelined")
			b.ReportMetric(tps[8]/tps[9], "apply-x-bare-pipelined")
		})
	}
}

// vacuum vacuums s's records table, as autovacuum would between passes
// (it is off on the test server): the dead index entries of the last op
// go, so that they do not slow the next, and the rows just seeded get
// the hint bits that rows long in the table have.
func vacuum(b *testing.B, s *pgstore.Store) {
	b.Helper()
	if _, err := s.Pool().Exec(context.Background(), `VACUUM `+records(s)); err != nil {
		b.Fatal(err)
	}
}

// settle writes out the pages that seeding and vacuuming dirtied, so that
// the background writer does not flush them during the next window and
// stall whichever window comes first. (Checkpoints come every few
// minutes in production anyway.) CHECKPOINT needs superuser or
// pg_checkpoint.
func settle(b *testing.B, s *pgstore.Store) {
	b.Helper()
	if _, err := s.Pool().Exec(context.Background(), `CHECKPOINT`); err != nil {
		b.Fatalf("CHECKPOINT (the benchmark needs superuser or pg_checkpoint): %v", err)
	}
}

// BenchmarkSweep measures the sweeper deleting expired rows from a table
// that also holds live rows (one op: 50,000 expired rows, with distinct
// expiries), alone and under claim load, and the same rows removed by
// dropping their partition. The table is vacuumed after each seeding, and
// under claim load checkpointed, with the timer stopped.
//
// Under claim load, one op is a pass of a [pgstore.SweepJob] with the
// sub-benchmark's options while 4 goroutines claim new keys, and a window
// as long with the same claims and no sweeper, in alternating order so
// that drift hits both. It reports the pass's rows/s, the p99 claim
// latency of each window over all ops, and their ratio. Every batch is a
// transaction whose commit flushes its WAL; smaller batches and pauses
// trade sweep speed for claim latency.
func BenchmarkSweep(b *testing.B) {
	const rows = 50_000
	s, _ := benchStore(b)
	ctx := context.Background()
	seed(b, s, "live-", rows, -time.Hour)
	b.Run("sweeper/batch=5000", func(b *testing.B) {
		for b.Loop() {
			b.StopTimer()
			seed(b, s, fmt.Sprintf("old-%08x-", rand.Uint32()), rows, time.Minute)
			vacuum(b, s)
			b.StartTimer()
			r, err := s.SweepUntilEmpty(ctx, 5000, 0, 0)
			if err != nil || r.Deleted != rows {
				b.Fatal(r.Deleted, err)
			}
		}
		perSecond(b, b.N*rows, "rows/s")
	})
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
	// window runs claims while f runs (or for d if f is nil).
	window := func(d time.Duration, f func()) []time.Duration {
		stop := make(chan struct{})
		res := make(chan []time.Duration)
		go func() { res <- claims(stop) }()
		if f != nil {
			f()
		} else {
			time.Sleep(d)
		}
		close(stop)
		return <-res
	}
	pass := func(opts pgstore.SweepOptions) pgstore.SweepResult {
		done := make(chan pgstore.SweepResult, 1)
		opts.Interval = time.Hour // one pass
		opts.OnPass = func(r pgstore.SweepResult, err error) {
			if err != nil {
				b.Error(err)
			}
			done <- r
		}
		j, err := s.StartSweeping(opts)
		if err != nil {
			b.Fatal(err)
		}
		defer j.Close()
		return <-done
	}
	window(300*time.Millisecond, nil) // the pool dials its connections
	p99 := func(lat []time.Duration) time.Duration {
		slices.Sort(lat)
		if len(lat) == 0 {
			return 0
		}
		return lat[len(lat)*99/100]
	}
	for _, tc := range []struct {
		name string
		opts pgstore.SweepOptions
	}{
		{"batch=5000/no-pause", pgstore.SweepOptions{BatchSize: 5000, Pause: -1, PauseRatio: -1}},
		{"batch=1000/no-pause", pgstore.SweepOptions{BatchSize: 1000, Pause: -1, PauseRatio: -1}},
		{"batch=1000/pause=2ms", pgstore.SweepOptions{BatchSize: 1000, Pause: 2 * time.Millisecond, PauseRatio: -1}},
		{"batch=1000/pause-ratio=1", pgstore.SweepOptions{BatchSize: 1000}},
		{"default/batch=500/pause-ratio=1", pgstore.SweepOptions{}},
	} {
		b.Run("sweeper-under-claim-load/"+tc.name, func(b *testing.B) {
			var idle, busy []time.Duration
			var took time.Duration
			i := 0
			for b.Loop() {
				b.StopTimer()
				seed(b, s, fmt.Sprintf("old-%08x-", rand.Uint32()), rows, time.Minute)
				vacuum(b, s)
				settle(b, s)
				var r pgstore.SweepResult
				sweep := func() {
					b.StartTimer() // b's time is the passes'
					r = pass(tc.opts)
					b.StopTimer()
				}
				if i%2 == 0 {
					busy = append(busy, window(0, sweep)...)
					idle = append(idle, window(r.Elapsed, nil)...)
				} else {
					// As long as the last pass, or 0.5s at first.
					d := 500 * time.Millisecond
					if i > 0 {
						d = took / time.Duration(i)
					}
					idle = append(idle, window(d, nil)...)
					busy = append(busy, window(0, sweep)...)
				}
				if r.Deleted != rows {
					b.Fatalf("a pass deleted %d rows, want %d", r.Deleted, rows)
				}
				took += r.Elapsed
				i++
				b.StartTimer()
			}
			b.ReportMetric(float64(i*rows)/took.Seconds(), "rows/s")
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
