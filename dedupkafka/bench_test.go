package dedupkafka

import (
	"context"
	"fmt"
	"maps"
	"os"
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
	"github.com/jackc/pgx/v5/pgconn"
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

// storeBenchRecords is the records per case of the store cases of
// BenchmarkFloors and the rows per case of BenchmarkRelay;
// memBenchRecords the records per case of its memstore cases.
const (
	storeBenchRecords = 20000
	memBenchRecords   = 50000
)

// benchMedian is the median of xs (xs is sorted in place).
func benchMedian(xs []float64) float64 {
	slices.Sort(xs)
	return xs[len(xs)/2]
}

// benchRotate runs cases in rounds, each round in a different order (the
// round's start rotated by one), and reports each case's median rate and
// each case's median ratio to its baseline (cases[name] -> baseline name,
// or several names comma-separated) in the same round. With -v it logs
// every round's figures; DEDUP_BENCH_CASES (names, comma-separated) runs only those cases.
func benchRotate(b *testing.B, cases []benchCase, baseline map[string]string) {
	if only := os.Getenv("DEDUP_BENCH_CASES"); only != "" { // a comma-separated list of case names
		cases = slices.DeleteFunc(slices.Clone(cases), func(c benchCase) bool { return !slices.Contains(strings.Split(only, ","), c.name) })
	}
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
		line := fmt.Sprintf("round %d:", round+1)
		for _, c := range cases {
			line += fmt.Sprintf(" %s %.0f", c.name, got[c.name])
			bases := strings.Split(baseline[c.name], ",")
			for _, base := range bases {
				if got[base] <= 0 {
					continue
				}
				r := got[c.name] / got[base]
				name := c.name // one baseline: "<case>-x"; several: "<case>/<baseline>-x"
				if len(bases) > 1 {
					name += "/" + base
					line += fmt.Sprintf(" (%.2fx %s)", r, base)
				} else {
					line += fmt.Sprintf(" (%.2fx)", r)
				}
				ratios[name] = append(ratios[name], r)
			}
		}
		b.Log(line)
		b.StartTimer()
	}
	for _, c := range cases {
		b.ReportMetric(benchMedian(rates[c.name]), c.name+"-rec/s")
	}
	for _, name := range slices.Sorted(maps.Keys(ratios)) {
		b.ReportMetric(benchMedian(ratios[name]), name+"-x")
	}
}

type benchCase struct {
	name string
	run  func(b *testing.B) float64 // records/s
}

// dropTopic deletes a benchmark's topic, so that kfake does not keep
// every round's records in memory.
func dropTopic(b *testing.B, seeds []string, topic string) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(seeds...))
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	if _, err := kadm.NewClient(cl).DeleteTopics(context.Background(), topic); err != nil {
		b.Fatal(err)
	}
}

// floorConsume is the floor of a dedupkafka consumer case: the bare
// franz-go group consumer (PollRecords(500), CommitUncommittedOffsets,
// AllowRebalance, as benchBare) doing the adapter's per-record work
// without the dedup processor, with the adapter's concurrency. It groups
// each poll's records by partition and runs up to four partitions at once
// (the consumer's default); per chunk of batch records of a partition it
// reads each into the envelope, calls claim with the chunk's message IDs,
// calls the no-op handler per record and then complete with the IDs. With
// claim and complete nil it makes no store writes (the memstore floor);
// otherwise they are the plain writes of the store case. Its scratch
// slices are reused as the consumer's are. It returns records/s from the
// first records to the last commit.
func floorConsume(b *testing.B, seeds []string, groupOpts []kgo.Opt, n, batch int, claim, complete func(ctx context.Context, ids []string) error) float64 {
	// The worker's results are unnamed: named claim and complete, they
	// shadowed these and it returned nil, nil (no store writes at all).
	type write = func(ctx context.Context, ids []string) error
	return floorConsumeWith(b, seeds, groupOpts, n, batch, func() (write, write) { return claim, complete })
}

// floorConsumeWith is floorConsume where each partition's goroutine takes
// its own claim and complete from worker, so that they may keep state
// between the two calls of a chunk (mem-direct keeps the claim).
func floorConsumeWith(b *testing.B, seeds []string, groupOpts []kgo.Opt, n, batch int, worker func() (claim, complete func(ctx context.Context, ids []string) error)) float64 {
	topic := benchTopic(b, seeds, n)
	defer dropTopic(b, seeds, topic)
	cl, err := kgo.NewClient(append(slices.Clone(groupOpts), kgo.SeedBrokers(seeds...), kgo.ConsumerGroup("g-"+topic),
		kgo.ConsumeTopics(topic), kgo.DisableAutoCommit(), kgo.BlockRebalanceOnPoll())...)
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	ctx := context.Background()
	var start time.Time
	sem := make(chan struct{}, 4)
	for got := 0; got < n; {
		fs := cl.PollRecords(ctx, 500)
		if got == 0 && fs.NumRecords() > 0 {
			start = time.Now()
		}
		var wg sync.WaitGroup
		var failed atomic.Value
		fs.EachPartition(func(p kgo.FetchTopicPartition) {
			rs := p.Records
			if len(rs) == 0 {
				return
			}
			got += len(rs)
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				claim, complete := worker()
				ms, ids := make([]*consumer.Message, batch), make([]string, batch)
				for len(rs) > 0 {
					k := min(batch, len(rs))
					for i, r := range rs[:k] {
						ms[i], _ = newMessage(r, 1)
						ids[i] = ms[i].ID
					}
					if claim != nil {
						if err := claim(ctx, ids[:k]); err != nil {
							failed.Store(err)
							return
						}
					}
					for _, m := range ms[:k] {
						_, _ = benchHandler(ctx, m, consumer.Delivery{})
					}
					if complete != nil {
						if err := complete(ctx, ids[:k]); err != nil {
							failed.Store(err)
							return
						}
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
	return float64(n) / time.Since(start).Seconds()
}

// floorConsumeOverlap is floorConsume with the overlap ours has in batch
// mode: a chunk's completion (complete) is sent on a goroutine of its own
// while the partition goes on with its next chunk's claim and handlers,
// at most two completions of a partition in flight (a chunk waits for the
// completion of the chunk two before it, as a batch waits for its
// pipeline slot), across polls too; each poll's offsets are committed
// (CommitOffsetsSync of the poll's last offsets, one commit at a time, in
// poll order) once the poll's completions returned, while the next poll
// runs. It returns records/s from the first records to the last commit.
func floorConsumeOverlap(b *testing.B, seeds []string, groupOpts []kgo.Opt, n, batch int, claim, complete func(ctx context.Context, ids []string) error) float64 {
	return floorConsumeOverlapWith(b, seeds, groupOpts, n, batch, func(ctx context.Context, ids []string) (func(ctx context.Context) error, error) {
		if err := claim(ctx, ids); err != nil {
			return nil, err
		}
		return func(ctx context.Context) error { return complete(ctx, ids) }, nil
	})
}

// floorConsumeOverlapWith is floorConsumeOverlap where claim returns the
// chunk's completion, so that it may keep what the claim returned (the
// claims' tokens, for redis-direct-overlap) while the next chunk claims.
func floorConsumeOverlapWith(b *testing.B, seeds []string, groupOpts []kgo.Opt, n, batch int, claim func(ctx context.Context, ids []string) (complete func(ctx context.Context) error, err error)) float64 {
	topic := benchTopic(b, seeds, n)
	defer dropTopic(b, seeds, topic)
	cl, err := kgo.NewClient(append(slices.Clone(groupOpts), kgo.SeedBrokers(seeds...), kgo.ConsumerGroup("g-"+topic),
		kgo.ConsumeTopics(topic), kgo.DisableAutoCommit(), kgo.BlockRebalanceOnPoll())...)
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	ctx := context.Background()
	var start time.Time
	sem := make(chan struct{}, 4)
	type lane struct{ flight []chan struct{} } // a partition's completions in flight, oldest first
	lanes := map[int32]*lane{}
	var failed atomic.Value
	var committing chan struct{} // closed when the last poll's commit is done
	for got := 0; got < n; {
		fs := cl.PollRecords(ctx, 500)
		if got == 0 && fs.NumRecords() > 0 {
			start = time.Now()
		}
		var wg sync.WaitGroup
		var mu sync.Mutex
		var sent []chan struct{} // this poll's completions
		offs := map[string]map[int32]kgo.EpochOffset{}
		fs.EachPartition(func(p kgo.FetchTopicPartition) {
			rs := p.Records
			if len(rs) == 0 {
				return
			}
			got += len(rs)
			last := rs[len(rs)-1]
			if offs[p.Topic] == nil {
				offs[p.Topic] = map[int32]kgo.EpochOffset{}
			}
			offs[p.Topic][p.Partition] = kgo.EpochOffset{Epoch: last.LeaderEpoch, Offset: last.Offset + 1}
			ln := lanes[p.Partition]
			if ln == nil {
				ln = &lane{}
				lanes[p.Partition] = ln
			}
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				ms := make([]*consumer.Message, batch)
				for len(rs) > 0 {
					if len(ln.flight) >= 2 {
						<-ln.flight[0]
						ln.flight = ln.flight[1:]
					}
					k := min(batch, len(rs))
					ids := make([]string, k) // the completion keeps them
					for i, r := range rs[:k] {
						ms[i], _ = newMessage(r, 1)
						ids[i] = ms[i].ID
					}
					complete, err := claim(ctx, ids)
					if err != nil {
						failed.Store(err)
						return
					}
					for _, m := range ms[:k] {
						_, _ = benchHandler(ctx, m, consumer.Delivery{})
					}
					done := make(chan struct{})
					go func() {
						defer close(done)
						if err := complete(ctx); err != nil {
							failed.Store(err)
						}
					}()
					ln.flight = append(ln.flight, done)
					mu.Lock()
					sent = append(sent, done)
					mu.Unlock()
					rs = rs[k:]
				}
			})
		})
		wg.Wait()
		if err, _ := failed.Load().(error); err != nil {
			b.Fatal(err)
		}
		// As benchBare after each poll: a rebalance waiting (the group's
		// join settling at the start) would otherwise hold the commits,
		// which wait for it. The group has one member, so nothing moves.
		cl.AllowRebalance()
		prev, mine := committing, make(chan struct{})
		committing = mine
		go func() {
			defer close(mine)
			for _, d := range sent {
				<-d
			}
			if prev != nil {
				<-prev
			}
			if len(offs) > 0 {
				cl.CommitOffsetsSync(ctx, offs, nil)
			}
		}()
	}
	if committing != nil {
		<-committing
	}
	if err, _ := failed.Load().(error); err != nil {
		b.Fatal(err)
	}
	return float64(n) / time.Since(start).Seconds()
}

// oursConsume runs the dedupkafka consumer with a processor on store and
// returns records/s from the first records until all n are final.
func oursConsume(b *testing.B, seeds []string, groupOpts []kgo.Opt, n, batch int, store dedup.Store) float64 {
	return oursConsumeDepth(b, seeds, groupOpts, n, batch, store, 0)
}

// oursConsumeDepth is oursConsume with depth batches of a partition in
// flight in batch mode (0: the default, 2).
func oursConsumeDepth(b *testing.B, seeds []string, groupOpts []kgo.Opt, n, batch int, store dedup.Store, depth int) float64 {
	topic := benchTopic(b, seeds, n)
	defer dropTopic(b, seeds, topic)
	p, err := consumer.New("bench-"+topic, store, benchHandler, consumer.WithLogger(quiet), consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		b.Fatal(err)
	}
	cons, err := NewConsumer(seeds, "g-"+topic, []string{topic}, p, WithLogger(quiet), WithBatch(batch), WithClientOptions(groupOpts...))
	if err != nil {
		b.Fatal(err)
	}
	defer cons.Close()
	cons.pipeDepth = depth
	go cons.Run(context.Background())
	for cons.Stats().Records == 0 {
		time.Sleep(100 * time.Microsecond)
	}
	start := time.Now()
	for cons.Stats().Final < uint64(n) {
		time.Sleep(200 * time.Microsecond)
	}
	took := time.Since(start)
	if s := cons.Stats(); s.Duplicates != 0 || s.DeadLettered != 0 {
		b.Fatalf("stats %+v: want every record applied once", s)
	}
	return float64(n) / took.Seconds()
}

// directRedis is the cheapest correct dedup of a chunk on redisstore, the
// construction floor of the redis cases: redisstore's own ClaimBatch of
// the chunk's keys as the processor derives them (a scope, the message
// IDs), no fingerprint and the processor's default lease, the no-op
// handlers, then CompleteBatch of the chunk's claims with no result and
// the default retention, each completion fenced by its claim's token as
// the contract requires. No processor, no runner, no pipeline. Every key
// is new: anything but Acquired is an error.
type directRedis struct {
	s     *redisstore.Store
	scope string
}

// claim claims the chunk ids and returns its completion.
func (d directRedis) claim(ctx context.Context, ids []string) (complete func(ctx context.Context) error, err error) {
	reqs := make([]dedup.ClaimRequest, len(ids))
	for i, id := range ids {
		reqs[i] = dedup.ClaimRequest{Key: dedup.Key{Scope: d.scope, ID: id}}
	}
	cs, err := d.s.ClaimBatch(ctx, reqs, directLease)
	if err != nil {
		return nil, err
	}
	items := make([]dedup.Completion, len(cs))
	for i, c := range cs {
		if c.Outcome != dedup.Acquired {
			return nil, fmt.Errorf("direct floor: %s claimed %s, want acquired", ids[i], c.Outcome)
		}
		items[i] = dedup.Completion{Claim: c}
	}
	return func(ctx context.Context) error {
		errs, err := d.s.CompleteBatch(ctx, items, directRetention)
		if err != nil {
			return err
		}
		for _, err := range errs {
			if err != nil {
				return err
			}
		}
		return nil
	}, nil
}

// worker is run as floorConsumeWith's claim and complete: the chunk's
// claims are kept for its completion.
func (d directRedis) worker() (claim, complete func(ctx context.Context, ids []string) error) {
	var fin func(ctx context.Context) error
	claim = func(ctx context.Context, ids []string) (err error) {
		fin, err = d.claim(ctx, ids)
		return err
	}
	complete = func(ctx context.Context, _ []string) error { return fin(ctx) }
	return claim, complete
}

// BenchmarkFloors compares, in one process on one in-process kfake
// cluster, records/s through the dedupkafka consumer against the floor of
// each case (floorConsume: the same consumer loop, envelope, handler and
// concurrency, and for a store the same plain writes, without the
// processor):
//
//   - mem: per record (Process) on memstore, against mem-floor (no store
//     writes: the goal's "bare consumer", on an equal footing) and
//     against mem-direct: mem-floor plus the cheapest correct dedup a
//     record, memstore Claim and Complete called directly around the
//     handler with the processor's key, fingerprint, lease and retention
//     (directMem): mem's construction floor. mem-batch100 is mem in
//     WithBatch(100) (ProcessBatch).
//   - redis: WithBatch(100) on redisstore (one pipelined SET NX GET PX
//     claim round trip and one completion script round trip per batch of a
//     partition), against redis-floor: per chunk of 100 a pipelined
//     SET NX PX and a pipelined SET PX per key. redis-depth1: ours with
//     one batch of a partition in flight (each batch waits for the
//     previous one's completion: the drain before consumer.Pipeline).
//     redis-floor-overlap: the redis floor's writes with ours' overlap
//     (floorConsumeOverlap: a chunk's SET pipeline in flight while the
//     next chunk's SET NX runs, across polls too, each poll committed
//     once its SETs returned). redis-direct is redis's construction
//     floor: redis-floor's loop with redisstore's own ClaimBatch and
//     CompleteBatch called directly per chunk instead of the plain writes
//     (directRedis: the processor's lease and retention, no processor, no
//     pipeline), the cheapest correct dedup on Redis, whose completion is
//     fenced by each claim's token; redis-direct-overlap is the same
//     with redis-floor-overlap's overlap (ours pipelines across polls).
//     Ours is measured against all four.
//   - pg: WithBatch(100) on pgstore (one ClaimBatch and one CompleteBatch
//     statement per batch), against pg-floor: per chunk of 100 one
//     INSERT ... SELECT unnest ON CONFLICT DO NOTHING (the claim rows) and
//     one UPDATE ... WHERE key = ANY that marks them done and sets their
//     expiry (the completion), on a table with a one-column text key.
//
// memBenchRecords records a memstore case and storeBenchRecords a store
// case, each on a fresh 4-partition topic and group (dropped after it);
// the store's keys are deleted after each case, so that every round
// starts from the same table and key count. The cases rotate in each round
// (-benchtime Nx = N rounds); the metrics are each case's median records/s
// and its median ratio to its floor in the same round (-v logs each
// round). Redis is DEDUP_REDIS_ADDR and PostgreSQL DEDUP_POSTGRES_URL:
// point them at a private server and database, since a run writes
// hundreds of thousands of keys.
func BenchmarkFloors(b *testing.B) {
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
	redisClean := func(b *testing.B, prefix string) {
		var cursor uint64
		for {
			e, err := rc.Do(ctx, rc.B().Scan().Cursor(cursor).Match(prefix+"*").Count(1000).Build()).AsScanEntry()
			if err != nil {
				b.Fatal(err)
			}
			if len(e.Elements) > 0 {
				if err := rc.Do(ctx, rc.B().Unlink().Key(e.Elements...).Build()).Error(); err != nil {
					b.Fatal(err)
				}
			}
			if cursor = e.Cursor; cursor == 0 {
				return
			}
		}
	}
	defer redisClean(b, "kbench-"+suffix+":")
	defer redisClean(b, "kfloor-"+suffix+":")

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
	// The PostgreSQL floor's table: b5dccf7's (a one-column key), the
	// cheaper of the two floors 3b8822d measured side by side.
	floorTable := pgx.Identifier{schema, "floor"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+floorTable+` (key text PRIMARY KEY, state text NOT NULL, expires_at timestamptz NOT NULL)`); err != nil {
		b.Fatal(err)
	}
	pgClean := func(b *testing.B, table string) {
		if _, err := pool.Exec(ctx, `TRUNCATE `+table); err != nil {
			b.Fatal(err)
		}
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
	// arguments (QueryExecModeExec: an unnamed statement), as b5dccf7 found:
	// under the pool's statement cache the old floor's cached completion
	// plan cost time in proportion to the table (867 records/s). The
	// completion is an UPDATE ... WHERE key = ANY, an index scan over the
	// keys: the records-shaped floor's UPDATE ... FROM unnest was planned
	// as a hash join over a sequential scan of the table, the plan that
	// also slowed pgstore's CompleteBatch (issue 16), 2.9 ms a chunk
	// against 0.9 in pg_stat_statements. The completion sets the expiry
	// too, as the contract's Complete must (b5dccf7's set the state only).
	pgClaim := func(ctx context.Context, ids []string) error {
		_, err := pool.Exec(ctx, `INSERT INTO `+floorTable+` (key, state, expires_at) SELECT k, 'pending', now() + interval '1 hour' FROM unnest($1::text[]) k ON CONFLICT DO NOTHING`, pgx.QueryExecModeExec, ids)
		return err
	}
	pgComplete := func(ctx context.Context, ids []string) error {
		_, err := pool.Exec(ctx, `UPDATE `+floorTable+` SET state = 'done', expires_at = now() + interval '1 day' WHERE key = ANY($1::text[])`, pgx.QueryExecModeExec, ids)
		return err
	}
	mem := func(b *testing.B) dedup.Store {
		s, err := memstore.New()
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { s.Close() })
		return s
	}

	cases := []benchCase{
		{"mem-floor", func(b *testing.B) float64 {
			return floorConsume(b, seeds, groupOpts, memBenchRecords, 1, nil, nil)
		}},
		{"mem-direct", func(b *testing.B) float64 {
			d := newDirectMem(b, "bench-direct")
			defer d.s.Close()
			return floorConsumeWith(b, seeds, groupOpts, memBenchRecords, 1, d.worker)
		}},
		{"mem", func(b *testing.B) float64 {
			s := mem(b)
			defer s.Close()
			return oursConsume(b, seeds, groupOpts, memBenchRecords, 1, s)
		}},
		{"mem-batch100", func(b *testing.B) float64 {
			s := mem(b)
			defer s.Close()
			return oursConsume(b, seeds, groupOpts, memBenchRecords, batch, s)
		}},
		{"redis-floor", func(b *testing.B) float64 {
			defer redisClean(b, "kfloor-"+suffix+":")
			return floorConsume(b, seeds, groupOpts, storeBenchRecords, batch, redisWrite(true, "pending"), redisWrite(false, "done"))
		}},
		{"redis-floor-overlap", func(b *testing.B) float64 {
			defer redisClean(b, "kfloor-"+suffix+":")
			return floorConsumeOverlap(b, seeds, groupOpts, storeBenchRecords, batch, redisWrite(true, "pending"), redisWrite(false, "done"))
		}},
		{"redis-direct", func(b *testing.B) float64 {
			defer redisClean(b, "kbench-"+suffix+":")
			return floorConsumeWith(b, seeds, groupOpts, storeBenchRecords, batch, directRedis{rs, "bench-direct"}.worker)
		}},
		{"redis-direct-overlap", func(b *testing.B) float64 {
			defer redisClean(b, "kbench-"+suffix+":")
			return floorConsumeOverlapWith(b, seeds, groupOpts, storeBenchRecords, batch, directRedis{rs, "bench-direct"}.claim)
		}},
		{"redis", func(b *testing.B) float64 {
			defer redisClean(b, "kbench-"+suffix+":")
			return oursConsume(b, seeds, groupOpts, storeBenchRecords, batch, rs)
		}},
		{"redis-depth1", func(b *testing.B) float64 {
			defer redisClean(b, "kbench-"+suffix+":")
			return oursConsumeDepth(b, seeds, groupOpts, storeBenchRecords, batch, rs, 1)
		}},
		{"pg-floor", func(b *testing.B) float64 {
			defer pgClean(b, floorTable)
			return floorConsume(b, seeds, groupOpts, storeBenchRecords, batch, pgClaim, pgComplete)
		}},
		{"pg", func(b *testing.B) float64 {
			defer pgClean(b, ps.Tables().Records)
			return oursConsume(b, seeds, groupOpts, storeBenchRecords, batch, ps)
		}},
	}
	benchRotate(b, cases, map[string]string{"mem-direct": "mem-floor", "mem": "mem-floor,mem-direct", "mem-batch100": "mem-floor", "redis": "redis-floor,redis-direct,redis-floor-overlap,redis-direct-overlap", "redis-depth1": "redis-floor,redis-direct",
		"redis-floor-overlap": "redis-floor", "redis-direct": "redis-floor", "redis-direct-overlap": "redis-floor-overlap,redis-direct", "pg": "pg-floor"})
}

// relayBenchRows is the outbox rows per case of BenchmarkRelay.
const relayBenchRows = 50000

// BenchmarkRelay publishes 50,000 PostgreSQL outbox rows (200-byte
// payloads over 1,000 aggregates, a 16-partition outbox that deletes
// published rows) to a 16-partition topic on an in-process kfake cluster:
// one outbox relay through the Publisher (its Outbox() adapter) against
// bare franz-go loops with the relay's concurrency: each reads the same
// rows 500 at a time by id and produces them asynchronously with the same
// headers on a client with the same durability (idempotent, acks=all),
// reading the next 500 while up to 16 batches (the relay's 16 partition
// workers, one batch of up to 500 each) await their responses.
//
//   - bare-async-produce: franz-go's default client (10ms linger); no
//     leases, no marks, one timed DELETE of all rows at the end.
//   - bare-linger0: the same on a client with linger 0 (the Publisher's
//     default).
//   - bare-mark: bare-linger0 plus the relay's required mark: once a
//     batch's records are all acknowledged, one DELETE of its ids (the
//     batch's slot frees after it), no final DELETE. Still no leases, no
//     partitioned reads, no fencing.
//   - relay: the relay with a user's default options (poll interval 1s,
//     lease TTL 10s), listening to the outbox's notifications.
//   - relay-poll5ms: the relay as this benchmark ran it until hrelay4
//     (poll interval 5ms, lease TTL 2s): drained partitions read again
//     after 5ms, backing off, until the window ends.
//   - relay-linger10ms: the relay through a Publisher given franz-go's
//     default linger back (kgo.ProducerLinger(10ms)), as before linger 0
//     became the Publisher's default.
//   - floor: the construction floor, what any relay of this outbox must
//     do, written plainly: per-partition reads in id order from the
//     start of the partition's range (a row committed late below a batch
//     already sent is found only so), one goroutine per partition under
//     its lease, and per batch, after its acks, one DELETE fenced by the
//     lease's epoch (see floor below). The relay is reported against it
//     beside the bare loops, which read by an id bound no relay may use.
//   - floor-bits: floor with the batch's ids sent as a bitmap over its id
//     range, as pgstore's mark sends a dense batch (floor's generic plan
//     tests = ANY of an array parameter by a linear search per row).
//
// With -v each case logs its timed window's CPU: this process's, the
// machine's and, with DEDUP_BENCH_PG_PID set to a private server's
// postmaster, PostgreSQL's; with DEDUP_BENCH_PSS=1 (pg_stat_statements on
// that server) the window's statements. DEDUP_BENCH_CASES runs a subset.
//
// The cases rotate in each round (-benchtime Nx = N rounds); the metrics
// are each case's median rows/s and the relay's median ratio to each loop
// in the same round.
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
SELECT 'evt-' || gen_random_uuid(), 'agg-' || (g % $2), $3, convert_to(repeat('x', 200), 'UTF8') FROM generate_series(1, $1) g`, relayBenchRows, keys, topic)
		if err != nil {
			b.Fatal(err)
		}
	}
	pub, err := NewPublisher(seeds)
	if err != nil {
		b.Fatal(err)
	}
	defer pub.Close()
	bareDefault, err := kgo.NewClient(kgo.SeedBrokers(seeds...), kgo.RecordDeliveryTimeout(30*time.Second))
	if err != nil {
		b.Fatal(err)
	}
	defer bareDefault.Close()
	bareLinger0, err := kgo.NewClient(kgo.SeedBrokers(seeds...), kgo.RecordDeliveryTimeout(30*time.Second), kgo.ProducerLinger(0))
	if err != nil {
		b.Fatal(err)
	}
	defer bareLinger0.Close()

	// bare is the bare loop on cl; with mark, each batch's ids are
	// deleted once its records are acknowledged, else all rows at the end.
	bare := func(b *testing.B, cl *kgo.Client, mark bool) float64 {
		fill(b)
		start := time.Now()
		cpu := cpuWindow()
		pss := pssWindow(b, pool)
		inflight := make(chan struct{}, src.Partitions())
		var wg sync.WaitGroup
		var failed atomic.Value
		var last int64
		for done := 0; done < relayBenchRows; {
			rows, err := pool.Query(ctx, `SELECT id, message_key, aggregate, topic, payload FROM `+table+` WHERE id > $1 ORDER BY id LIMIT 500`, last)
			if err != nil {
				b.Fatal(err)
			}
			var batch []*kgo.Record
			var ids []int64
			for rows.Next() {
				var key, agg, tp string
				var payload []byte
				if err := rows.Scan(&last, &key, &agg, &tp, &payload); err != nil {
					b.Fatal(err)
				}
				ids = append(ids, last)
				batch = append(batch, &kgo.Record{Topic: tp, Key: []byte(agg), Value: payload, Headers: []kgo.RecordHeader{
					{Key: HeaderMsgID, Value: []byte(key)}, {Key: HeaderAggregate, Value: []byte(agg)}}})
			}
			rows.Close()
			if err := rows.Err(); err != nil {
				b.Fatal(err)
			}
			done += len(batch)
			inflight <- struct{}{} // a batch slot, as a relay partition worker
			var left atomic.Int64
			left.Store(int64(len(batch)))
			wg.Add(1)
			for _, r := range batch {
				cl.Produce(ctx, r, func(_ *kgo.Record, err error) {
					if err != nil {
						failed.Store(err)
					}
					if left.Add(-1) != 0 {
						return
					}
					if !mark {
						<-inflight
						wg.Done()
						return
					}
					go func() { // not on franz-go's callback goroutine
						defer wg.Done()
						if _, err := pool.Exec(ctx, `DELETE FROM `+table+` WHERE id = ANY($1::int8[])`, ids); err != nil {
							failed.Store(err)
						}
						<-inflight
					}()
				})
			}
		}
		wg.Wait()
		if err, _ := failed.Load().(error); err != nil {
			b.Fatal(err)
		}
		if !mark {
			if _, err := pool.Exec(ctx, `DELETE FROM `+table); err != nil {
				b.Fatal(err)
			}
		}
		b.Logf("bare (mark %v): %s%s", mark, cpu(), pss())
		return relayBenchRows / time.Since(start).Seconds()
	}
	// floor is the construction floor: what any relay of this outbox
	// must do, written plainly. One goroutine per partition, each under
	// its lease (taken before the window, released after): read the
	// partition's first 500 unpublished rows in id order from the start
	// of its range (rows committed late below a batch already sent are
	// picked up only so; an id bound would skip them), produce them
	// asynchronously (Publisher's client, linger 0), wait for every
	// acknowledgement, then delete the batch's ids in one statement fenced
	// by the lease's epoch, locked FOR SHARE, and read again; a short read
	// ends the partition (the whole backlog was committed before the
	// window). No quarantine check, no retry or failure bookkeeping, no
	// heartbeat, no read transaction settings.
	// The partition expression as pgstore's partition index has it
	// (OutboxSource: hashtextextended(aggregate, 0) mod N), and the lease
	// table beside the outbox table.
	part := `((hashtextextended(o.aggregate, 0) & 9223372036854775807) % ` + strconv.Itoa(src.Partitions()) + `)`
	leaseTable := strings.TrimSuffix(table, `"`) + `_leases"`
	floorRead := `SELECT o.id, o.message_key, o.aggregate, o.topic, o.payload FROM ` + table + ` o
WHERE o.published_at IS NULL AND o.quarantined_at IS NULL AND ` + part + ` = $1::int8 ORDER BY o.id LIMIT 500`
	floorMark := `WITH held AS (SELECT 1 FROM ` + leaseTable + ` WHERE part = $1::int AND owner = $2::text AND epoch = $3::int8 FOR SHARE)
DELETE FROM ` + table + ` o WHERE ` + part + ` = ($1::int)::int8 AND o.id >= $5::int8 AND o.id <= $6::int8
	AND o.id = ANY($4::int8[]) AND o.published_at IS NULL AND o.quarantined_at IS NULL AND EXISTS (SELECT 1 FROM held)`
	// floorMarkBits is floorMark with the batch's ids as a bitmap over
	// [$5, $6] (bit k of byte k/8, least significant first, for id $5+k),
	// as pgstore's mark sends a dense batch: under a generic plan
	// floorMark's = ANY($4) is a linear search per row.
	floorMarkBits := `WITH held AS (SELECT 1 FROM ` + leaseTable + ` WHERE part = $1::int AND owner = $2::text AND epoch = $3::int8 FOR SHARE)
DELETE FROM ` + table + ` o WHERE ` + part + ` = ($1::int)::int8 AND o.id >= $5::int8 AND o.id <= $6::int8
	AND CASE WHEN o.id >= $5::int8 AND o.id <= $6::int8 THEN get_bit($4::bytea, (o.id - $5::int8)::int) = 1 ELSE false END
	AND o.published_at IS NULL AND o.quarantined_at IS NULL AND EXISTS (SELECT 1 FROM held)`
	floor := func(b *testing.B, bitmap bool) float64 {
		leases := make([]outbox.Lease, src.Partitions())
		for p := range leases {
			l, ok, err := src.Acquire(ctx, "kfloor", p, 10*time.Second)
			for err == nil && !ok { // the relay case's lease, until released or expired
				time.Sleep(10 * time.Millisecond)
				l, ok, err = src.Acquire(ctx, "kfloor", p, 10*time.Second)
			}
			if err != nil {
				b.Fatal(err)
			}
			leases[p] = l
		}
		defer func() {
			for _, l := range leases {
				if err := src.Release(ctx, l); err != nil {
					b.Fatal(err)
				}
			}
		}()
		fill(b)
		start := time.Now()
		cpu := cpuWindow()
		pss := pssWindow(b, pool)
		var wg sync.WaitGroup
		var failed atomic.Value
		var total atomic.Int64
		for _, l := range leases {
			wg.Go(func() {
				cl := pub.Client()
				for {
					rows, err := pool.Query(ctx, floorRead, l.Partition)
					if err != nil {
						failed.Store(err)
						return
					}
					var batch []*kgo.Record
					var ids []int64
					for rows.Next() {
						var id int64
						var key, agg, tp string
						var payload []byte
						if err := rows.Scan(&id, &key, &agg, &tp, &payload); err != nil {
							failed.Store(err)
							rows.Close()
							return
						}
						ids = append(ids, id)
						batch = append(batch, &kgo.Record{Topic: tp, Key: []byte(agg), Value: payload, Headers: []kgo.RecordHeader{
							{Key: HeaderMsgID, Value: []byte(key)}, {Key: HeaderAggregate, Value: []byte(agg)}}})
					}
					rows.Close()
					if err := rows.Err(); err != nil {
						failed.Store(err)
						return
					}
					if len(batch) == 0 {
						return
					}
					var acks sync.WaitGroup
					acks.Add(len(batch))
					for _, r := range batch {
						cl.Produce(ctx, r, func(_ *kgo.Record, err error) {
							if err != nil {
								failed.Store(err)
							}
							acks.Done()
						})
					}
					acks.Wait()
					var tag pgconn.CommandTag
					lo, hi := ids[0], ids[len(ids)-1]
					if bitmap {
						bits := make([]byte, (hi-lo)/8+1)
						for _, id := range ids {
							bits[(id-lo)/8] |= 1 << ((id - lo) % 8)
						}
						tag, err = pool.Exec(ctx, floorMarkBits, l.Partition, l.Owner, l.Epoch, bits, lo, hi)
					} else {
						tag, err = pool.Exec(ctx, floorMark, l.Partition, l.Owner, l.Epoch, ids, lo, hi)
					}
					if err != nil {
						failed.Store(err)
						return
					}
					if tag.RowsAffected() != int64(len(ids)) {
						failed.Store(fmt.Errorf("floor: partition %d marked %d of %d rows", l.Partition, tag.RowsAffected(), len(ids)))
						return
					}
					total.Add(int64(len(ids)))
					if len(batch) < 500 {
						return
					}
				}
			})
		}
		wg.Wait()
		if err, _ := failed.Load().(error); err != nil {
			b.Fatal(err)
		}
		if n := total.Load(); n != relayBenchRows {
			b.Fatalf("floor: %d rows marked, want %d", n, relayBenchRows)
		}
		took := time.Since(start)
		b.Logf("floor: %s%s", cpu(), pss())
		return relayBenchRows / took.Seconds()
	}
	pub10, err := NewPublisher(seeds, WithProducerOptions(kgo.ProducerLinger(10*time.Millisecond)))
	if err != nil {
		b.Fatal(err)
	}
	defer pub10.Close()
	// relay runs the relay with the options a user gets by default (poll
	// interval 1s, lease TTL 10s) plus opts: it listens to the outbox's
	// notifications, so the fill's commit wakes its partitions, and a
	// drained partition waits for the next notification or poll.
	relay := func(b *testing.B, pub *Publisher, opts ...outbox.Option) float64 {
		rl, err := outbox.NewRelay(src, pub.Outbox(), append([]outbox.Option{outbox.WithRelayID("kbench")}, opts...)...)
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
		cpu := cpuWindow()
		pss := pssWindow(b, pool)
		st0 := rl.Stats()
		for rl.Stats().Published-before < relayBenchRows {
			time.Sleep(time.Millisecond)
		}
		took := time.Since(start)
		st1 := rl.Stats()
		b.Logf("relay: %s; fetches %d, batches %d%s", cpu(), st1.Fetches-st0.Fetches, st1.Batches-st0.Batches, pss())
		cancel()
		wg.Wait()
		return relayBenchRows / took.Seconds()
	}
	cases := []benchCase{
		{"bare-async-produce", func(b *testing.B) float64 { return bare(b, bareDefault, false) }},
		{"bare-linger0", func(b *testing.B) float64 { return bare(b, bareLinger0, false) }},
		{"bare-mark", func(b *testing.B) float64 { return bare(b, bareLinger0, true) }},
		{"relay", func(b *testing.B) float64 { return relay(b, pub) }},
		{"relay-linger10ms", func(b *testing.B) float64 { return relay(b, pub10) }},
		// The relay as this benchmark ran it before hrelay4: drained
		// partitions poll from 5ms (backing off while listening) and the
		// leases are renewed every 667ms.
		{"relay-poll5ms", func(b *testing.B) float64 {
			return relay(b, pub, outbox.WithPollInterval(5*time.Millisecond), outbox.WithLeaseTTL(2*time.Second))
		}},
		{"floor", func(b *testing.B) float64 { return floor(b, false) }},
		{"floor-bits", func(b *testing.B) float64 { return floor(b, true) }},
	}
	benchRotate(b, cases, map[string]string{"relay": "bare-async-produce,bare-linger0,bare-mark,floor,floor-bits", "relay-poll5ms": "bare-mark,floor-bits,relay", "relay-linger10ms": "bare-async-produce", "floor": "bare-linger0,bare-mark", "floor-bits": "floor"})
}
