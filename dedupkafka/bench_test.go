package dedupkafka

import (
	"context"
	"flag"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/dedupkit/dedup/redisstore"
	"github.com/jackc/pgx/v5"
	"github.com/redis/rueidis"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

var benchTopics atomic.Int64

// benchTopic creates a fresh 4-partition topic holding n records with
// message IDs.
func benchTopic(b *testing.B, seeds []string, n int) string {
	b.Helper()
	topic := fmt.Sprintf("bench-%d", benchTopics.Add(1))
	cl, err := kgo.NewClient(kgo.SeedBrokers(seeds...), kgo.ProducerLinger(0))
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	if _, err := kadm.NewClient(cl).CreateTopic(context.Background(), 4, 1, nil, topic); err != nil {
		b.Fatal(err)
	}
	rs := make([]*kgo.Record, n)
	for i := range rs {
		rs[i] = &kgo.Record{Topic: topic, Key: fmt.Appendf(nil, "k%d", i%64), Value: make([]byte, 128),
			Headers: []kgo.RecordHeader{{Key: HeaderMsgID, Value: fmt.Appendf(nil, "%s-%d", topic, i)}}}
	}
	if err := cl.ProduceSync(context.Background(), rs...).FirstErr(); err != nil {
		b.Fatal(err)
	}
	return topic
}

// BenchmarkConsume compares, on one in-process kfake cluster, records/s
// through the dedupkafka consumer with memstore against a bare franz-go
// group consumer that commits each poll's offsets without dedup (the
// baseline). The timer starts at the first records, after the group join.
// Run with -count to rotate the cases within one process.
func BenchmarkConsume(b *testing.B) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	seeds := c.ListenAddrs()
	groupOpts := []kgo.Opt{kgo.HeartbeatInterval(100 * time.Millisecond), kgo.FetchMaxWait(20 * time.Millisecond)}

	for _, work := range []bool{false, true} {
		name := "bare"
		if work {
			name = "bare-envelope"
		}
		b.Run(name, func(b *testing.B) { benchBare(b, seeds, groupOpts, work) })
	}

	for _, batch := range []int{1, 100} {
		name := "dedupkafka-memstore"
		if batch > 1 {
			name += fmt.Sprintf("-batch%d", batch)
		}
		b.Run(name, func(b *testing.B) {
			topic := benchTopic(b, seeds, b.N)
			store, err := memstore.New()
			if err != nil {
				b.Fatal(err)
			}
			defer store.Close()
			p, err := consumer.New("bench", store, func(context.Context, *consumer.Message, consumer.Delivery) ([]byte, error) { return nil, nil },
				consumer.WithLogger(quiet), consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
			if err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			cons, err := NewConsumer(seeds, "g-"+topic, []string{topic}, p, WithLogger(quiet), WithBatch(batch), WithClientOptions(groupOpts...))
			if err != nil {
				b.Fatal(err)
			}
			go cons.Run(context.Background())
			for cons.Stats().Records == 0 {
				time.Sleep(100 * time.Microsecond)
			}
			b.ResetTimer() // the group is joined: time the consumption only
			for cons.Stats().Final < uint64(b.N) {
				time.Sleep(time.Millisecond)
			}
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "records/s")
			cons.Close()
		})
	}
}

// benchHandler is the no-op handler of the floors, called through a
// variable so that the call is not inlined away.
var benchHandler = func(context.Context, *consumer.Message, consumer.Delivery) ([]byte, error) { return nil, nil }

// benchBare is the bare franz-go group consumer: PollRecords(500), each
// record counted (work: read into the envelope, as the adapter does, and
// passed to a no-op handler: the adapter's per-record work minus dedup),
// CommitUncommittedOffsets, AllowRebalance.
func benchBare(b *testing.B, seeds []string, groupOpts []kgo.Opt, work bool) {
	{
		topic := benchTopic(b, seeds, b.N)
		b.ResetTimer()
		cl, err := kgo.NewClient(append(groupOpts, kgo.SeedBrokers(seeds...), kgo.ConsumerGroup("g-"+topic),
			kgo.ConsumeTopics(topic), kgo.DisableAutoCommit(), kgo.BlockRebalanceOnPoll())...)
		if err != nil {
			b.Fatal(err)
		}
		defer cl.Close()
		n := 0
		for n < b.N {
			fs := cl.PollRecords(context.Background(), 500)
			if n == 0 && fs.NumRecords() > 0 {
				b.ResetTimer() // the group is joined: time the consumption only
			}
			fs.EachRecord(func(r *kgo.Record) {
				n++
				if work {
					m, _ := newMessage(r, 1)
					benchHandler(context.Background(), m, consumer.Delivery{})
				}
			})
			if err := cl.CommitUncommittedOffsets(context.Background()); err != nil {
				b.Fatal(err)
			}
			cl.AllowRebalance()
		}
		b.StopTimer()
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "records/s")
	}
}

// storeBenchRecords is the records per case of BenchmarkStores and the
// rows per case of BenchmarkRelay.
const storeBenchRecords = 20000

// benchMedian is the median of xs (xs is sorted in place).
func benchMedian(xs []float64) float64 {
	slices.Sort(xs)
	return xs[len(xs)/2]
}

// benchRotate runs cases in rounds, each round in a different order (the
// round's start rotated by one), and reports each case's median rate and
// each case's median ratio to its baseline (cases[name] -> baseline name)
// in the same round.
func benchRotate(b *testing.B, cases []benchCase, baseline map[string]string) {
	rates := map[string][]float64{}
	ratios := map[string][]float64{}
	for round := 0; b.Loop(); round++ {
		b.StopTimer()
		got := map[string]float64{}
		for i := range cases {
			c := cases[(i+round)%len(cases)]
			got[c.name] = c.run(b)
			rates[c.name] = append(rates[c.name], got[c.name])
		}
		for name, base := range baseline {
			if got[name] == 0 || got[base] == 0 {
				continue
			}
			ratios[name] = append(ratios[name], got[name]/got[base])
		}
		b.StartTimer()
	}
	for _, c := range cases {
		b.ReportMetric(benchMedian(rates[c.name]), c.name+"-rec/s")
		if r := ratios[c.name]; len(r) > 0 {
			b.ReportMetric(benchMedian(r), c.name+"-x")
		}
	}
}

// kbenchCases names the cases of BenchmarkStores to run.
var kbenchCases = flag.String("kbench.cases", "", "comma-separated names of the BenchmarkStores cases to run (empty: all)")

// pickCases returns the cases -kbench.cases names, or all.
func pickCases(cases []benchCase) []benchCase {
	if *kbenchCases == "" {
		return cases
	}
	want := strings.Split(*kbenchCases, ",")
	return slices.DeleteFunc(cases, func(c benchCase) bool { return !slices.Contains(want, c.name) })
}

// noWrite is the memstore floor's store write: none.
func noWrite(context.Context, []string) error { return nil }

type benchCase struct {
	name string
	run  func(b *testing.B) float64 // records/s
}

// floorConsume is the plain-write floor: the bare franz-go group consumer
// (PollRecords(500), CommitUncommittedOffsets, AllowRebalance, as
// benchBare) that groups each poll's records by partition, runs up to four
// partitions at once (the consumer's default concurrency) and, per chunk
// of batch records of a partition, reads each into the envelope, calls
// claim with the chunk's message IDs, calls the no-op handler per record
// and then complete with the IDs: the store writes of the dedupkafka
// consumer in batch mode, without the processor. It returns records/s
// from the first records.
func floorConsume(b *testing.B, seeds []string, groupOpts []kgo.Opt, batch int, claim, complete func(ctx context.Context, ids []string) error) float64 {
	topic := benchTopic(b, seeds, storeBenchRecords)
	cl, err := kgo.NewClient(append(groupOpts, kgo.SeedBrokers(seeds...), kgo.ConsumerGroup("g-"+topic),
		kgo.ConsumeTopics(topic), kgo.DisableAutoCommit(), kgo.BlockRebalanceOnPoll())...)
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	ctx := context.Background()
	var start time.Time
	var chunks, claimNS, completeNS atomic.Int64
	for n := 0; n < storeBenchRecords; {
		fs := cl.PollRecords(ctx, 500)
		if n == 0 && fs.NumRecords() > 0 {
			start = time.Now()
		}
		var wg sync.WaitGroup
		sem := make(chan struct{}, 4)
		var failed atomic.Value
		fs.EachPartition(func(p kgo.FetchTopicPartition) {
			rs := p.Records
			n += len(rs)
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				ids := make([]string, 0, batch)
				for len(rs) > 0 {
					k := min(batch, len(rs))
					ids = ids[:0]
					ms := make([]*consumer.Message, k)
					for i, r := range rs[:k] {
						ms[i], _ = newMessage(r, 1)
						ids = append(ids, ms[i].ID)
					}
					t0 := time.Now()
					err := claim(ctx, ids)
					claimNS.Add(int64(time.Since(t0)))
					chunks.Add(1)
					if err != nil {
						failed.Store(err)
						return
					}
					for _, m := range ms {
						_, _ = benchHandler(ctx, m, consumer.Delivery{})
					}
					t0 = time.Now()
					err = complete(ctx, ids)
					completeNS.Add(int64(time.Since(t0)))
					if err != nil {
						failed.Store(err)
						return
					}
					rs = rs[k:]
				}
			})
		})
		wg.Wait()
		if err, _ := failed.Load().(error); err != nil {
			b.Fatal(err)
		}
		if err := cl.CommitUncommittedOffsets(ctx); err != nil {
			b.Fatal(err)
		}
		cl.AllowRebalance()
	}
	took := time.Since(start)
	// Where the floor's time goes: its two writes per chunk, timed.
	b.Logf("floor: %d chunks, claim write %v and completion write %v a chunk on average, %v in all",
		chunks.Load(), time.Duration(claimNS.Load()/max(chunks.Load(), 1)), time.Duration(completeNS.Load()/max(chunks.Load(), 1)), took)
	return storeBenchRecords / took.Seconds()
}

// oursConsume runs the dedupkafka consumer with a processor on store and
// returns records/s from the first records until all are final.
func oursConsume(b *testing.B, seeds []string, groupOpts []kgo.Opt, batch int, store dedup.Store) float64 {
	topic := benchTopic(b, seeds, storeBenchRecords)
	p, err := consumer.New("bench-"+topic, store, benchHandler, consumer.WithLogger(quiet), consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		b.Fatal(err)
	}
	cons, err := NewConsumer(seeds, "g-"+topic, []string{topic}, p, WithLogger(quiet), WithBatch(batch), WithClientOptions(groupOpts...))
	if err != nil {
		b.Fatal(err)
	}
	defer cons.Close()
	go cons.Run(context.Background())
	for cons.Stats().Records == 0 {
		time.Sleep(100 * time.Microsecond)
	}
	start := time.Now()
	for cons.Stats().Final < storeBenchRecords {
		time.Sleep(200 * time.Microsecond)
	}
	took := time.Since(start)
	if s := cons.Stats(); s.Duplicates != 0 || s.DeadLettered != 0 {
		b.Fatalf("stats %+v: want every record applied once", s)
	}
	return storeBenchRecords / took.Seconds()
}

// BenchmarkStores compares, on one in-process kfake cluster and the real
// Redis and PostgreSQL servers, records/s through the dedupkafka consumer
// in batch mode (WithBatch(100): a claim round trip and a completion round
// trip per batch of a partition) with redisstore and pgstore against their
// plain-write floors (floorConsume): for Redis a pipelined SET NX PX claim
// and a pipelined SET PX completion per record; for PostgreSQL one
// INSERT ... ON CONFLICT DO NOTHING of the batch's keys and one UPDATE of
// them. 20,000 records a case on a fresh 4-partition topic and group; the
// cases rotate in each round (-benchtime Nx = N rounds); the metrics are
// each case's median records/s and median ratio to its floor in the same
// round.
func BenchmarkStores(b *testing.B) {
	const batch = 100
	c, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	seeds := c.ListenAddrs()
	groupOpts := []kgo.Opt{kgo.HeartbeatInterval(100 * time.Millisecond), kgo.FetchMaxWait(20 * time.Millisecond)}
	ctx := context.Background()
	suffix := strconv.FormatInt(time.Now().UnixNano(), 36)

	redisAddrs := testenv.Addrs(b, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
	rc, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: redisAddrs})
	if err != nil {
		b.Fatal(err)
	}
	defer rc.Close()
	rs, err := redisstore.Open(rueidis.ClientOption{InitAddress: redisAddrs}, redisstore.WithPrefix("kbench-"+suffix+":"))
	if err != nil {
		b.Fatal(err)
	}
	defer rs.Close()

	pool := testenv.PostgresPool(b)
	schema := testenv.PostgresSchema(b, pool)
	ps, err := pgstore.New(pool, pgstore.WithSchema(schema))
	if err != nil {
		b.Fatal(err)
	}
	defer ps.Close()
	if _, err := ps.Migrate(ctx); err != nil {
		b.Fatal(err)
	}
	floorTable := pgx.Identifier{schema, "floor"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+floorTable+` (key text PRIMARY KEY, state text NOT NULL, expires_at timestamptz NOT NULL)`); err != nil {
		b.Fatal(err)
	}

	redisWrite := func(nx bool, value string) func(ctx context.Context, ids []string) error {
		return func(ctx context.Context, ids []string) error {
			cmds := make(rueidis.Commands, len(ids))
			for i, id := range ids {
				if nx {
					cmds[i] = rc.B().Set().Key("kfloor-" + suffix + ":" + id).Value(value).Nx().Px(time.Hour).Build()
				} else {
					cmds[i] = rc.B().Set().Key("kfloor-" + suffix + ":" + id).Value(value).Px(time.Hour).Build()
				}
			}
			for _, r := range rc.DoMulti(ctx, cmds...) {
				if err := r.Error(); err != nil && !rueidis.IsRedisNil(err) {
					return err
				}
			}
			return nil
		}
	}
	// The floor's statements are planned at each execution with their
	// arguments (QueryExecModeExec: an unnamed statement). Under the pool's
	// default statement cache, the completion's cached plan cost time in
	// proportion to the table: 18, 48 and 83 ms a chunk in rounds 1-3 of one
	// run (the claim stayed at 1.1 ms), which made the floor 867-1,979
	// records/s, far below the store it is the floor of.
	pgClaim := func(ctx context.Context, ids []string) error {
		_, err := pool.Exec(ctx, `INSERT INTO `+floorTable+` (key, state, expires_at) SELECT k, 'pending', now() + interval '1 hour' FROM unnest($1::text[]) k ON CONFLICT DO NOTHING`, pgx.QueryExecModeExec, ids)
		return err
	}
	pgComplete := func(ctx context.Context, ids []string) error {
		_, err := pool.Exec(ctx, `UPDATE `+floorTable+` SET state = 'done' WHERE key = ANY($1::text[])`, pgx.QueryExecModeExec, ids)
		return err
	}

	cases := []benchCase{
		{"mem-floor", func(b *testing.B) float64 {
			return floorConsume(b, seeds, groupOpts, batch, noWrite, noWrite)
		}},
		{"mem", func(b *testing.B) float64 {
			ms, err := memstore.New()
			if err != nil {
				b.Fatal(err)
			}
			defer ms.Close()
			return oursConsume(b, seeds, groupOpts, batch, ms)
		}},
		{"redis-floor", func(b *testing.B) float64 {
			return floorConsume(b, seeds, groupOpts, batch, redisWrite(true, "pending"), redisWrite(false, "done"))
		}},
		{"redis", func(b *testing.B) float64 { return oursConsume(b, seeds, groupOpts, batch, rs) }},
		{"pg-floor", func(b *testing.B) float64 { return floorConsume(b, seeds, groupOpts, batch, pgClaim, pgComplete) }},
		{"pg", func(b *testing.B) float64 { return oursConsume(b, seeds, groupOpts, batch, ps) }},
	}
	benchRotate(b, pickCases(cases), map[string]string{"mem": "mem-floor", "redis": "redis-floor", "pg": "pg-floor"})
}

// BenchmarkRelay publishes 20,000 PostgreSQL outbox rows (200-byte
// payloads over 1,000 aggregates, a 16-partition outbox that deletes
// published rows) to a 16-partition topic on an in-process kfake cluster:
// one outbox relay through the Publisher (its Outbox() adapter) against a
// bare franz-go loop that reads the same rows 500 at a time and produces
// them with the same headers on a client with the same producer defaults
// (idempotent, acks=all), awaiting every response before the next read;
// no leases, no marks (one timed DELETE of all rows at the end, where the
// relay deletes each batch it published). The cases rotate
// in each round; the metrics are each case's median rows/s and the
// relay's median ratio to the loop in the same round.
func BenchmarkRelay(b *testing.B) {
	const keys = 1000
	c, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	seeds := c.ListenAddrs()
	ctx := context.Background()
	topic := "relay-bench"
	{
		cl, err := kgo.NewClient(kgo.SeedBrokers(seeds...))
		if err != nil {
			b.Fatal(err)
		}
		if _, err := kadm.NewClient(cl).CreateTopic(ctx, 16, 1, nil, topic); err != nil {
			b.Fatal(err)
		}
		cl.Close()
	}
	pool := testenv.PostgresPool(b)
	s, err := pgstore.New(pool, pgstore.WithSchema(testenv.PostgresSchema(b, pool)))
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	if _, err := s.Migrate(ctx); err != nil {
		b.Fatal(err)
	}
	src, err := s.OutboxSource(pgstore.WithOutboxPartitions(16), pgstore.WithOutboxDeletePublished())
	if err != nil {
		b.Fatal(err)
	}
	if err := src.CreateIndex(ctx); err != nil {
		b.Fatal(err)
	}
	table := s.Tables().Outbox
	fill := func(b *testing.B) {
		if _, err := pool.Exec(ctx, `VACUUM `+table); err != nil {
			b.Fatal(err)
		}
		_, err := pool.Exec(ctx, `INSERT INTO `+table+` (message_key, aggregate, topic, payload)
SELECT 'evt-' || gen_random_uuid(), 'agg-' || (g % $2), $3, convert_to(repeat('x', 200), 'UTF8') FROM generate_series(1, $1) g`, storeBenchRecords, keys, topic)
		if err != nil {
			b.Fatal(err)
		}
	}
	pub, err := NewPublisher(seeds)
	if err != nil {
		b.Fatal(err)
	}
	defer pub.Close()
	bare, err := kgo.NewClient(kgo.SeedBrokers(seeds...), kgo.RecordDeliveryTimeout(30*time.Second))
	if err != nil {
		b.Fatal(err)
	}
	defer bare.Close()

	cases := []benchCase{
		{"bare-produce-loop", func(b *testing.B) float64 {
			fill(b)
			start := time.Now()
			var last int64
			for done := 0; done < storeBenchRecords; {
				rows, err := pool.Query(ctx, `SELECT id, message_key, aggregate, topic, payload FROM `+table+` WHERE id > $1 ORDER BY id LIMIT 500`, last)
				if err != nil {
					b.Fatal(err)
				}
				var wg sync.WaitGroup
				var failed atomic.Value
				for rows.Next() {
					var key, agg, tp string
					var payload []byte
					if err := rows.Scan(&last, &key, &agg, &tp, &payload); err != nil {
						b.Fatal(err)
					}
					wg.Add(1)
					done++
					bare.Produce(ctx, &kgo.Record{Topic: tp, Key: []byte(agg), Value: payload, Headers: []kgo.RecordHeader{
						{Key: HeaderMsgID, Value: []byte(key)}, {Key: HeaderAggregate, Value: []byte(agg)}}},
						func(_ *kgo.Record, err error) {
							if err != nil {
								failed.Store(err)
							}
							wg.Done()
						})
				}
				rows.Close()
				wg.Wait()
				if err := rows.Err(); err != nil {
					b.Fatal(err)
				}
				if err, _ := failed.Load().(error); err != nil {
					b.Fatal(err)
				}
			}
			if _, err := pool.Exec(ctx, `DELETE FROM `+table); err != nil {
				b.Fatal(err)
			}
			return storeBenchRecords / time.Since(start).Seconds()
		}},
		{"relay", func(b *testing.B) float64 {
			rl, err := outbox.NewRelay(src, pub.Outbox(), outbox.WithRelayID("kbench"), outbox.WithPollInterval(5*time.Millisecond),
				outbox.WithLeaseTTL(2*time.Second))
			if err != nil {
				b.Fatal(err)
			}
			rctx, cancel := context.WithCancel(ctx)
			var wg sync.WaitGroup
			wg.Go(func() { _ = rl.Run(rctx) })
			for rl.Stats().Partitions < src.Partitions() {
				time.Sleep(time.Millisecond)
			}
			before := rl.Stats().Published
			fill(b)
			start := time.Now()
			for rl.Stats().Published-before < storeBenchRecords {
				time.Sleep(time.Millisecond)
			}
			took := time.Since(start)
			cancel()
			wg.Wait()
			return storeBenchRecords / took.Seconds()
		}},
	}
	benchRotate(b, cases, map[string]string{"relay": "bare-produce-loop"})
}
