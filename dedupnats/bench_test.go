package dedupnats

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/dedupkit/dedup/redisstore"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/rueidis"
)

// BenchmarkConsume measures messages per second through a durable pull
// consumer: b.N messages, each with its own logical ID, are published
// first (not timed); the timer covers consuming them all. cN runs N
// workers with a batch of max(256, 2N); inside it every sub-benchmark
// uses the same batch and concurrency:
//
//   - bare: the adapter's pull loop with the processor replaced by a
//     plain Ack (no envelope, no dedup): the baseline.
//   - memstore, sqlite, redis, postgres: the adapter with a processor on
//     that store (claim, no-op handler, complete, Ack).
//   - memstore-batch, redis-batch, postgres-batch: the same with
//     WithBatchProcessing (one worker whatever N; ProcessBatch over the
//     messages queued, up to half the batch: one batch claim, one batch
//     complete).
//   - postgres-apply: pgstore.Store.Apply through consumer.NewApply, the
//     inbox in one round trip, recording the key with no write of its own.
//   - redis-floor1, redis-floor2: what any Redis dedup costs at least, in
//     the same batch mode with the processor replaced: one pipeline per
//     batch of plain SET NX PX of each message ID, then the acks (floor1:
//     the unsafe "SET NX then process" shape, one write per message);
//     floor2 adds a second pipeline of plain SETs after the handlers
//     (the claim and the completion every crash-safe design writes, but
//     unfenced and without envelope, processor or result).
//
// Each store's x_bare metric is its rate over bare's rate in the same run
// (with -count, over the last bare run's).
// Redis needs DEDUP_REDIS_ADDR (default 127.0.0.1:6379), PostgreSQL
// DEDUP_POSTGRES_URL; a missing server skips its sub-benchmark.
//
//	go test -run '^$' -bench BenchmarkConsume -benchtime 20000x -count 3 ./dedupnats/
func BenchmarkConsume(b *testing.B) {
	for _, conc := range []int{1, 32} {
		b.Run(fmt.Sprintf("c%d", conc), func(b *testing.B) { benchConsume(b, max(256, 2*conc), conc) })
	}
}

func benchConsume(b *testing.B, batch, conc int) {
	var bareRate float64
	report := func(b *testing.B, elapsed time.Duration) {
		rate := float64(b.N) / elapsed.Seconds()
		b.ReportMetric(rate, "msgs/s")
		if bareRate > 0 {
			b.ReportMetric(rate/bareRate, "x_bare")
		}
	}

	b.Run("bare", func(b *testing.B) {
		_, js := connect(b)
		stream := benchStream(b, js)
		p := benchProcessor(b, "bare", mustMem(b))
		c, err := NewConsumer(js, stream, "bench", p, WithBatch(batch), WithConcurrency(conc), WithLogger(quiet))
		if err != nil {
			b.Fatal(err)
		}
		var done atomic.Int64
		c.process = func(ctx context.Context, msg jetstream.Msg) {
			c.held.remove(msg)
			if msg.Ack() == nil {
				done.Add(1)
			}
		}
		elapsed := runBench(b, c, func() int64 { return done.Load() })
		bareRate = float64(b.N) / elapsed.Seconds()
		report(b, elapsed)
	})

	stores := []struct {
		name string
		open func(b *testing.B) dedup.Store
	}{
		{"memstore", func(b *testing.B) dedup.Store { return mustMem(b) }},
		{"sqlite", func(b *testing.B) dedup.Store {
			s, err := sqlitestore.Open(filepath.Join(b.TempDir(), "bench.db"))
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { s.Close() })
			return s
		}},
		{"redis", func(b *testing.B) dedup.Store {
			addrs := testenv.Addrs(b, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
			prefix := uniqueName(b, "") + ":"
			s, err := redisstore.Open(rueidis.ClientOption{InitAddress: addrs}, redisstore.WithPrefix(prefix))
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() {
				deleteRedisPrefix(b, s.Client(), prefix)
				s.Close()
			})
			return s
		}},
		{"postgres", func(b *testing.B) dedup.Store {
			pool := testenv.PostgresPool(b)
			s, err := pgstore.New(pool, pgstore.WithSchema(testenv.PostgresSchema(b, pool)))
			if err != nil {
				b.Fatal(err)
			}
			if _, err := s.Migrate(context.Background()); err != nil {
				b.Fatal(err)
			}
			return s
		}},
	}
	// runWith runs the adapter with the processor mk makes, observing
	// with obs.
	runWith := func(name string, mk func(b *testing.B, obs consumer.Option) *consumer.Processor, opts ...ConsumerOption) {
		b.Run(name, func(b *testing.B) {
			_, js := connect(b)
			stream := benchStream(b, js)
			var done atomic.Int64
			p := mk(b, consumer.WithObserver(func(m *consumer.Message, d consumer.Decision) {
				if d.Action == consumer.Ack {
					done.Add(1)
				}
			}))
			c, err := NewConsumer(js, stream, "bench", p, append([]ConsumerOption{WithBatch(batch), WithLogger(quiet)}, opts...)...)
			if err != nil {
				b.Fatal(err)
			}
			elapsed := runBench(b, c, func() int64 { return done.Load() })
			if s := p.Stats(); s.Applied != uint64(b.N) {
				b.Fatalf("applied %d of %d (stats %+v)", s.Applied, b.N, s)
			}
			report(b, elapsed)
		})
	}
	run := func(name string, open func(b *testing.B) dedup.Store, opts ...ConsumerOption) {
		runWith(name, func(b *testing.B, obs consumer.Option) *consumer.Processor {
			return benchProcessor(b, "bench", open(b), obs)
		}, opts...)
	}
	for _, st := range stores {
		run(st.name, st.open, WithConcurrency(conc))
	}
	// postgres-apply: the inbox in one round trip (pgstore.Apply through
	// consumer.NewApply), recording the key with no business write, like
	// the no-op handler of the other rows.
	runWith("postgres-apply", func(b *testing.B, obs consumer.Option) *consumer.Processor {
		s := stores[3].open(b).(*pgstore.Store)
		p, err := consumer.NewApply("bench", s, func(context.Context, *consumer.Message, consumer.Delivery) (*pgx.Batch, []byte, error) {
			return nil, nil, nil
		}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}), consumer.WithRetention(time.Hour), obs)
		if err != nil {
			b.Fatal(err)
		}
		return p
	}, WithConcurrency(conc))
	// WithBatchProcessing: one worker, batches of up to half the batch,
	// one batch claim and one batch complete each.
	for _, st := range stores {
		if st.name != "sqlite" {
			run(st.name+"-batch", st.open, WithBatchProcessing())
		}
	}
	for writes := 1; writes <= 2; writes++ {
		b.Run(fmt.Sprintf("redis-floor%d", writes), func(b *testing.B) {
			_, js := connect(b)
			stream := benchStream(b, js)
			rc := benchRedis(b)
			prefix := uniqueName(b, "") + ":"
			b.Cleanup(func() { deleteRedisPrefix(b, rc, prefix) })
			c, err := NewConsumer(js, stream, "bench", benchProcessor(b, "floor", mustMem(b)),
				WithBatch(batch), WithBatchProcessing(), WithLogger(quiet))
			if err != nil {
				b.Fatal(err)
			}
			var done atomic.Int64
			c.processBatch = func(ctx context.Context, msgs []jetstream.Msg, settled func()) {
				defer settled()
				for w := range writes {
					cmds := make(rueidis.Commands, len(msgs))
					for i, msg := range msgs {
						k := rc.B().Set().Key(prefix + msg.Headers().Get(HeaderMsgID)).Value("x")
						if w == 0 {
							cmds[i] = k.Nx().PxMilliseconds(3600_000).Build()
						} else {
							cmds[i] = k.PxMilliseconds(3600_000).Build()
						}
					}
					for _, res := range rc.DoMulti(ctx, cmds...) {
						if err := res.Error(); err != nil {
							b.Error(err)
							return
						}
					}
				}
				for _, msg := range msgs {
					c.held.remove(msg)
					if msg.Ack() == nil {
						done.Add(1)
					}
				}
			}
			elapsed := runBench(b, c, func() int64 { return done.Load() })
			report(b, elapsed)
		})
	}
}

// BenchmarkConsumeRotated runs the batch cases of BenchmarkConsume/c32
// (batch 256: one worker, batches of up to 128 queued messages) in one
// process, rotated: each round runs every case once on a fresh stream of
// 20,000 messages, the round's first case moving by one each round, so
// that ours and its floors share the machine's state minute by minute.
// -benchtime Nx runs N rounds. The metrics are each case's median msgs/s
// and its median ratio, round by round, to redis-floor2; -v logs every
// round. DEDUP_BENCH_CASES (names, comma-separated) runs only those.
//
//   - memstore-batch, redis-batch: the adapter with WithBatchProcessing
//     on that store (a pipelined batch: its completion overlaps the next
//     batch's claim, see consumer.Pipeline; two batches in flight).
//   - redis-batch-depth1: one batch in flight (each batch waits for the
//     previous one's completion: ProcessBatch's behaviour before the
//     pipeline); redis-batch-depth3: three.
//   - redis-floor2: BenchmarkConsume's floor: per batch, a pipeline of
//     plain SET NX PX, the no-op handlers' place, a pipeline of plain SET
//     PX, then the acks, each batch after the one before.
//   - redis-floor2-overlap: the same writes with the same overlap as ours
//     (the next batch's SET NX pipeline is sent while the previous batch's
//     SET pipeline and acks are in flight, one batch at a time), to show
//     what the overlap alone gains a bare client.
//   - redis-direct: floor2's loop with redisstore's ClaimBatch and
//     CompleteBatch called directly instead of the plain writes: the
//     cheapest correct Redis dedup (a completion fenced by the claim's
//     token), no processor, no pipeline.
//
// Redis is DEDUP_REDIS_ADDR: use a private server.
func BenchmarkConsumeRotated(b *testing.B) {
	const n, batch = 20000, 256
	_, js := connect(b)
	rc := benchRedis(b)
	addrs := testenv.Addrs(b, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
	// consume runs c until n messages are acknowledged (done counts them)
	// and returns msgs/s.
	consume := func(b *testing.B, c *Consumer, done *atomic.Int64) float64 {
		start := time.Now()
		errc := make(chan error, 1)
		go func() { errc <- c.Run(context.Background()) }()
		deadline := start.Add(5 * time.Minute)
		for done.Load() < n {
			if time.Now().After(deadline) {
				b.Fatalf("%d of %d messages after 5 minutes", done.Load(), n)
			}
			time.Sleep(time.Millisecond)
		}
		rate := n / time.Since(start).Seconds()
		c.Close()
		if err := <-errc; err != nil {
			b.Fatal(err)
		}
		return rate
	}
	stream := func(b *testing.B) (string, func()) {
		name := newStream(b, js)
		payload := make([]byte, 128)
		for i := range n {
			msg := nats.NewMsg(name + ".events")
			id := "evt-" + strconv.Itoa(i)
			msg.Header.Set(HeaderMsgID, id)
			msg.Header.Set(jetstream.MsgIDHeader, id)
			msg.Data = payload
			if _, err := js.PublishMsgAsync(msg); err != nil {
				b.Fatal(err)
			}
		}
		select {
		case <-js.PublishAsyncComplete():
		case <-time.After(5 * time.Minute):
			b.Fatal("publishing timed out")
		}
		return name, func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_ = js.DeleteStream(ctx, name)
		}
	}
	ours := func(open func(b *testing.B) (dedup.Store, func()), depth int) func(b *testing.B) float64 {
		return func(b *testing.B) float64 {
			name, drop := stream(b)
			defer drop()
			store, closeStore := open(b)
			defer closeStore()
			var done atomic.Int64
			p := benchProcessor(b, "bench", store, consumer.WithObserver(func(m *consumer.Message, d consumer.Decision) {
				if d.Action == consumer.Ack {
					done.Add(1)
				}
			}))
			c, err := NewConsumer(js, name, "bench", p, WithBatch(batch), WithBatchProcessing(), WithLogger(quiet))
			if err != nil {
				b.Fatal(err)
			}
			c.pipeDepth = depth
			rate := consume(b, c, &done)
			if s := p.Stats(); s.Applied != n {
				b.Fatalf("applied %d of %d (stats %+v)", s.Applied, n, s)
			}
			return rate
		}
	}
	floor := func(overlap bool) func(b *testing.B) float64 {
		return func(b *testing.B) float64 {
			name, drop := stream(b)
			defer drop()
			prefix := uniqueName(b, "") + ":"
			defer deleteRedisPrefix(b, rc, prefix)
			c, err := NewConsumer(js, name, "bench", benchProcessor(b, "floor", mustMem(b)),
				WithBatch(batch), WithBatchProcessing(), WithLogger(quiet))
			if err != nil {
				b.Fatal(err)
			}
			var done atomic.Int64
			write := func(ctx context.Context, msgs []jetstream.Msg, nx bool) bool {
				cmds := make(rueidis.Commands, len(msgs))
				for i, msg := range msgs {
					k := rc.B().Set().Key(prefix + msg.Headers().Get(HeaderMsgID)).Value("x")
					if nx {
						cmds[i] = k.Nx().PxMilliseconds(3600_000).Build()
					} else {
						cmds[i] = k.PxMilliseconds(3600_000).Build()
					}
				}
				for _, res := range rc.DoMulti(ctx, cmds...) {
					if err := res.Error(); err != nil {
						b.Error(err)
						return false
					}
				}
				return true
			}
			finish := func(ctx context.Context, msgs []jetstream.Msg, settled func()) {
				defer settled()
				if !write(ctx, msgs, false) {
					return
				}
				for _, msg := range msgs {
					c.held.remove(msg)
					if msg.Ack() == nil {
						done.Add(1)
					}
				}
			}
			var prev chan struct{} // the previous batch's completion, when overlapping
			c.processBatch = func(ctx context.Context, msgs []jetstream.Msg, settled func()) {
				if !write(ctx, msgs, true) {
					settled()
					return
				}
				if !overlap {
					finish(ctx, msgs, settled)
					return
				}
				if prev != nil {
					<-prev // one batch's completion in flight at a time
				}
				mine := make(chan struct{})
				prev = mine
				go func() {
					defer close(mine)
					finish(ctx, msgs, settled)
				}()
			}
			rate := consume(b, c, &done)
			if prev != nil {
				<-prev
			}
			return rate
		}
	}
	redisOpen := func(b *testing.B) (dedup.Store, func()) {
		prefix := uniqueName(b, "") + ":"
		s, err := redisstore.Open(rueidis.ClientOption{InitAddress: addrs}, redisstore.WithPrefix(prefix))
		if err != nil {
			b.Fatal(err)
		}
		return s, func() {
			deleteRedisPrefix(b, s.Client(), prefix)
			s.Close()
		}
	}
	memOpen := func(b *testing.B) (dedup.Store, func()) {
		s, err := memstore.New()
		if err != nil {
			b.Fatal(err)
		}
		return s, func() { s.Close() }
	}
	// direct: floor2's loop with redisstore's own ClaimBatch and
	// CompleteBatch in place of the plain writes (no processor, no
	// pipeline): the cheapest correct Redis dedup, whose completion is
	// fenced by the claim's token as the contract requires.
	direct := func(b *testing.B) float64 {
		name, drop := stream(b)
		defer drop()
		store, closeStore := redisOpen(b)
		defer closeStore()
		rs := store.(*redisstore.Store)
		c, err := NewConsumer(js, name, "bench", benchProcessor(b, "direct", mustMem(b)),
			WithBatch(batch), WithBatchProcessing(), WithLogger(quiet))
		if err != nil {
			b.Fatal(err)
		}
		var done atomic.Int64
		c.processBatch = func(ctx context.Context, msgs []jetstream.Msg, settled func()) {
			defer settled()
			reqs := make([]dedup.ClaimRequest, len(msgs))
			for i, msg := range msgs {
				reqs[i] = dedup.ClaimRequest{Key: dedup.Key{Scope: "direct", ID: msg.Headers().Get(HeaderMsgID)}}
			}
			claims, err := rs.ClaimBatch(ctx, reqs, 30*time.Second)
			if err != nil {
				b.Error(err)
				return
			}
			items := make([]dedup.Completion, len(claims))
			for i, cl := range claims {
				if cl.Outcome != dedup.Acquired {
					b.Errorf("direct floor: %v for a new message", cl.Outcome)
					return
				}
				items[i] = dedup.Completion{Claim: cl}
			}
			errs, err := rs.CompleteBatch(ctx, items, time.Hour)
			if err != nil {
				b.Error(err)
				return
			}
			for i, msg := range msgs {
				if errs[i] != nil {
					b.Error(errs[i])
					return
				}
				c.held.remove(msg)
				if msg.Ack() == nil {
					done.Add(1)
				}
			}
		}
		return consume(b, c, &done)
	}
	cases := []struct {
		name string
		run  func(b *testing.B) float64
	}{
		{"memstore-batch", ours(memOpen, 0)},
		{"redis-batch", ours(redisOpen, 0)},
		{"redis-batch-depth1", ours(redisOpen, 1)},
		{"redis-batch-depth3", ours(redisOpen, 3)},
		{"redis-floor2", floor(false)},
		{"redis-floor2-overlap", floor(true)},
		{"redis-direct", direct},
	}
	if only := os.Getenv("DEDUP_BENCH_CASES"); only != "" {
		keep := strings.Split(only, ",")
		cases = slices.DeleteFunc(cases, func(c struct {
			name string
			run  func(b *testing.B) float64
		}) bool {
			return !slices.Contains(keep, c.name)
		})
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
			if f := got["redis-floor2"]; f > 0 && c.name != "redis-floor2" {
				ratios[c.name] = append(ratios[c.name], got[c.name]/f)
				line += fmt.Sprintf(" (%.2fx)", got[c.name]/f)
			}
		}
		b.Log(line)
		b.StartTimer()
	}
	median := func(xs []float64) float64 {
		xs = slices.Clone(xs)
		slices.Sort(xs)
		return xs[len(xs)/2]
	}
	for _, c := range cases {
		b.ReportMetric(median(rates[c.name]), c.name+"-msgs/s")
		if r := ratios[c.name]; len(r) > 0 {
			b.ReportMetric(median(r), c.name+"-x")
		}
	}
}

// benchRedis returns a client of the Redis under test.
func benchRedis(b *testing.B) rueidis.Client {
	addrs := testenv.Addrs(b, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
	rc, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: addrs})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(rc.Close)
	return rc
}

var quiet = slog.New(slog.DiscardHandler)

// benchStream creates a stream holding b.N messages with distinct IDs.
func benchStream(b *testing.B, js jetstream.JetStream) string {
	b.Helper()
	stream := newStream(b, js)
	payload := make([]byte, 128)
	for i := range b.N {
		msg := nats.NewMsg(stream + ".events")
		id := "evt-" + strconv.Itoa(i)
		msg.Header.Set(HeaderMsgID, id)
		msg.Header.Set(jetstream.MsgIDHeader, id)
		msg.Data = payload
		if _, err := js.PublishMsgAsync(msg); err != nil {
			b.Fatal(err)
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-time.After(5 * time.Minute):
		b.Fatal("publishing timed out")
	}
	return stream
}

func benchProcessor(b *testing.B, name string, s dedup.Store, opts ...consumer.Option) *consumer.Processor {
	b.Helper()
	base := []consumer.Option{consumer.WithDeadLetter(&consumer.MemoryDLQ{}), consumer.WithRetention(time.Hour)}
	p, err := consumer.New(name, s, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		return nil, nil
	}, append(base, opts...)...)
	if err != nil {
		b.Fatal(err)
	}
	return p
}

func mustMem(b *testing.B) *memstore.Store {
	s, err := memstore.New()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { s.Close() })
	return s
}

// runBench runs c until done reports b.N messages and returns the time
// that took.
func runBench(b *testing.B, c *Consumer, done func() int64) time.Duration {
	b.Helper()
	b.ResetTimer()
	start := time.Now()
	errc := make(chan error, 1)
	go func() { errc <- c.Run(context.Background()) }()
	waitDone(b, done)
	elapsed := time.Since(start)
	b.StopTimer()
	c.Close()
	if err := <-errc; err != nil {
		b.Fatal(err)
	}
	return elapsed
}

func waitDone(b *testing.B, done func() int64) {
	deadline := time.Now().Add(5 * time.Minute)
	for done() < int64(b.N) {
		if time.Now().After(deadline) {
			b.Fatalf("%d of %d messages after 5 minutes", done(), b.N)
		}
		time.Sleep(time.Millisecond)
	}
}

func deleteRedisPrefix(b *testing.B, c rueidis.Client, prefix string) {
	ctx := context.Background()
	var cursor uint64
	for {
		e, err := c.Do(ctx, c.B().Scan().Cursor(cursor).Match(prefix+"*").Count(1000).Build()).AsScanEntry()
		if err != nil {
			b.Errorf("scan %s*: %v", prefix, err)
			return
		}
		if len(e.Elements) > 0 {
			if err := c.Do(ctx, c.B().Unlink().Key(e.Elements...).Build()).Error(); err != nil {
				b.Errorf("unlink: %v", err)
				return
			}
		}
		if cursor = e.Cursor; cursor == 0 {
			return
		}
	}
}
