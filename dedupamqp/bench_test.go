package dedupamqp

import (
	"context"
	"fmt"
	"log/slog"
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
	"github.com/dedupkit/dedup/redisstore"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/rueidis"
)

var quiet = slog.New(slog.DiscardHandler)

// BenchmarkConsume measures messages per second out of a classic queue:
// b.N messages, each with its own message_id, are published first (not
// timed); the timer covers consuming and acknowledging them all. cN runs
// N workers with prefetch max(64, 2N); every case of one cN uses the same
// prefetch and concurrency:
//
//   - bare: a plain amqp091-go consumer, manual acks, N goroutines on the
//     deliveries channel, no envelope, no dedup: the baseline.
//   - memstore, redis: a Consumer with a processor on that store (claim,
//     no-op handler, complete, ack).
//   - redis-floor1: the bare consumer plus one plain SET NX PX of the
//     message ID per message before the ack (the unsafe "SET NX then
//     process" shape: the least any Redis dedup writes).
//   - redis-floor2: floor1 plus a second plain SET after the handler: the
//     two writes every crash-safe design makes (claim, completion),
//     unfenced.
//   - redis-batch32: the redis case with WithBatch(32): the deliveries
//     already waiting, up to 32, claimed and completed in one script call
//     each.
//
// x_bare is a case's rate over bare's in the same run, x_floor2 (redis)
// over redis-floor2's. Cases run in the order listed, each in the same
// process; BenchmarkConsumeRotated runs the headline cases in rotated
// rounds and reports the medians of the per-round ratios.
//
//	go test -run '^$' -bench BenchmarkConsume -benchtime 20000x -count 3 ./dedupamqp/
func BenchmarkConsume(b *testing.B) {
	for _, conc := range []int{1, 32} {
		b.Run(fmt.Sprintf("c%d", conc), func(b *testing.B) { benchConsume(b, max(64, 2*conc), conc) })
	}
}

func benchConsume(b *testing.B, prefetch, conc int) {
	url := testenv.AMQPURL(b)
	var bareRate, floor2Rate float64
	report := func(b *testing.B, elapsed time.Duration) float64 {
		rate := float64(b.N) / elapsed.Seconds()
		b.ReportMetric(rate, "msgs/s")
		if bareRate > 0 {
			b.ReportMetric(rate/bareRate, "x_bare")
		}
		return rate
	}
	redisClient := func(b *testing.B) rueidis.Client {
		addrs := testenv.Addrs(b, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
		c, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: addrs})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(c.Close)
		return c
	}
	floor := func(writes int) func(b *testing.B) {
		return func(b *testing.B) {
			rc := redisClient(b)
			prefix := unique("bench") + ":"
			q := benchQueue(b, url)
			elapsed := bareConsume(b, url, q, prefetch, conc, func(ctx context.Context, d *amqp.Delivery) {
				key := prefix + d.MessageId
				_ = rc.Do(ctx, rc.B().Set().Key(key).Value("1").Nx().Px(time.Minute).Build()).Error()
				if writes > 1 {
					_ = rc.Do(ctx, rc.B().Set().Key(key).Value("done").Px(time.Minute).Build()).Error()
				}
			})
			r := report(b, elapsed)
			if writes == 2 {
				floor2Rate = r
			}
		}
	}

	b.Run("bare", func(b *testing.B) {
		q := benchQueue(b, url)
		elapsed := bareConsume(b, url, q, prefetch, conc, nil)
		bareRate = 0
		bareRate = report(b, elapsed)
	})
	b.Run("memstore", func(b *testing.B) {
		s, err := memstore.New()
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { s.Close() })
		report(b, adapterConsume(b, url, s, prefetch, conc))
	})
	b.Run("redis-floor1", floor(1))
	b.Run("redis-floor2", floor(2))
	b.Run("redis", func(b *testing.B) {
		addrs := testenv.Addrs(b, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
		s, err := redisstore.Open(rueidis.ClientOption{InitAddress: addrs}, redisstore.WithPrefix(unique("bench")+":"))
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { s.Close() })
		elapsed := adapterConsume(b, url, s, prefetch, conc)
		rate := report(b, elapsed)
		if floor2Rate > 0 {
			b.ReportMetric(rate/floor2Rate, "x_floor2")
		}
	})
	b.Run("redis-batch32", func(b *testing.B) {
		addrs := testenv.Addrs(b, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
		s, err := redisstore.Open(rueidis.ClientOption{InitAddress: addrs}, redisstore.WithPrefix(unique("bench")+":"))
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { s.Close() })
		elapsed := adapterConsume(b, url, s, prefetch, conc, WithBatch(32))
		rate := report(b, elapsed)
		if floor2Rate > 0 {
			b.ReportMetric(rate/floor2Rate, "x_floor2")
		}
	})
}

// BenchmarkConsumeRotated runs BenchmarkConsume's cases bare, memstore,
// redis-floor2 and redis, and the construction floor redis-direct, in one
// process, in rounds (one round per b.N), each round in another order (its
// start rotated by one), each case on a fresh queue of DEDUP_BENCH_MSGS
// messages (default 20,000) published before its clock starts, after one
// uncounted warm-up pass of every case on up to 2,000 messages.
//
//   - redis-direct: the bare consumer (same prefetch, concurrency and
//     manual acks) calling redisstore's own Claim before a no-op handler
//     and Complete after it, then the ack: the cheapest correct Redis
//     dedup (a completion fenced by the claim's token), on the key, lease
//     and retention the adapter's processor uses, with no Processor, no
//     envelope and no adapter. What the redis case pays above it is the
//     adapter's and the processor's own cost.
//
// It reports each case's median rate and the medians (with the minimum
// and maximum) of the ratios taken within each round: memstore / bare,
// redis-direct / redis-floor2, redis / redis-floor2 and redis /
// redis-direct (metrics named case/baseline-x), twice: over the whole
// consume (the adapter's includes Run's dial, channels, queue
// declarations and QoS, the bare consumer's only its Consume call: a
// fixed cost counted against the adapter alone) and, with the suffix
// -steady, from the first delivery in hand to the last ack, which leaves
// that start-up out of both; -v logs every round. DEDUP_BENCH_CASES
// (comma-separated names) runs only those cases; DEDUP_REDIS_ADDR points
// the Redis cases at a private server.
//
//	go test -c -o /tmp/a.test ./dedupamqp/
//	/tmp/a.test -test.run '^$' -test.bench BenchmarkConsumeRotated -test.benchtime 6x -test.v
func BenchmarkConsumeRotated(b *testing.B) {
	n := 20000
	if v := os.Getenv("DEDUP_BENCH_MSGS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 1 {
			b.Fatalf("DEDUP_BENCH_MSGS=%q: want a positive count", v)
		}
	}
	for _, conc := range []int{1, 32} {
		b.Run(fmt.Sprintf("c%d", conc), func(b *testing.B) { benchConsumeRotated(b, n, max(64, 2*conc), conc) })
	}
}

func benchConsumeRotated(b *testing.B, n, prefetch, conc int) {
	url := testenv.AMQPURL(b)
	addrs := testenv.Addrs(b, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
	// run fills a queue, consumes it with consume and returns msgs/s
	// over the whole consume (Run's connect and declarations included
	// for the adapter) and from the first delivery in hand to the last
	// ack (see consumeSpan).
	run := func(consume func(q string) consumeSpan) [2]float64 {
		q, drop := fillQueue(b, url, n)
		defer drop()
		sp := consume(q)
		return [2]float64{float64(n) / sp.total.Seconds(), float64(n) / sp.steady.Seconds()}
	}
	type benchCase struct {
		name string
		run  func() [2]float64
	}
	cases := []benchCase{
		{"bare", func() [2]float64 {
			return run(func(q string) consumeSpan { return bareConsumeN(b, url, q, n, false, prefetch, conc, nil) })
		}},
		{"memstore", func() [2]float64 {
			s, err := memstore.New()
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			return run(func(q string) consumeSpan { return adapterConsumeN(b, url, q, n, false, s, prefetch, conc) })
		}},
		{"redis-floor2", func() [2]float64 {
			rc, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: addrs})
			if err != nil {
				b.Fatal(err)
			}
			defer rc.Close()
			prefix := unique("bench") + ":"
			return run(func(q string) consumeSpan {
				return bareConsumeN(b, url, q, n, false, prefetch, conc, func(ctx context.Context, d *amqp.Delivery) {
					key := prefix + d.MessageId
					_ = rc.Do(ctx, rc.B().Set().Key(key).Value("1").Nx().Px(time.Minute).Build()).Error()
					_ = rc.Do(ctx, rc.B().Set().Key(key).Value("done").Px(time.Minute).Build()).Error()
				})
			})
		}},
		{"redis-direct", func() [2]float64 {
			s, err := redisstore.Open(rueidis.ClientOption{InitAddress: addrs}, redisstore.WithPrefix(unique("bench")+":"))
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			return run(func(q string) consumeSpan {
				return bareConsumeN(b, url, q, n, false, prefetch, conc, directWork(b, s))
			})
		}},
		{"redis", func() [2]float64 {
			s, err := redisstore.Open(rueidis.ClientOption{InitAddress: addrs}, redisstore.WithPrefix(unique("bench")+":"))
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			return run(func(q string) consumeSpan { return adapterConsumeN(b, url, q, n, false, s, prefetch, conc) })
		}},
	}
	if only := os.Getenv("DEDUP_BENCH_CASES"); only != "" {
		cases = slices.DeleteFunc(cases, func(c benchCase) bool { return !slices.Contains(strings.Split(only, ","), c.name) })
	}
	// Each case's baselines: its ratios are over each of them, within a
	// round.
	baseline := map[string][]string{"memstore": {"bare"}, "redis-direct": {"redis-floor2"}, "redis": {"redis-floor2", "redis-direct"}}
	// A warm-up: each case once on a short queue, not counted, so that
	// the process's first connections and allocations fall on no round.
	full := n
	n = min(n, 2000)
	for _, c := range cases {
		c.run()
	}
	n = full
	// Per case, [0] over the whole consume, [1] from the first delivery;
	// ratios per "case/baseline".
	rates := [2]map[string][]float64{{}, {}}
	ratios := [2]map[string][]float64{{}, {}}
	for round := 0; b.Loop(); round++ {
		b.StopTimer()
		got := map[string][2]float64{}
		for i := range cases {
			c := cases[(i+round)%len(cases)]
			got[c.name] = c.run()
		}
		for w, what := range []string{"whole", "from first delivery"} {
			line := fmt.Sprintf("round %d (%s):", round+1, what)
			for _, c := range cases {
				rates[w][c.name] = append(rates[w][c.name], got[c.name][w])
				line += fmt.Sprintf(" %s %.0f", c.name, got[c.name][w])
				for _, base := range baseline[c.name] {
					if got[base][w] > 0 {
						r := got[c.name][w] / got[base][w]
						ratios[w][c.name+"/"+base] = append(ratios[w][c.name+"/"+base], r)
						line += fmt.Sprintf(" (%.2fx %s)", r, base)
					}
				}
			}
			b.Log(line)
		}
		b.StartTimer()
	}
	median := func(xs []float64) float64 {
		xs = slices.Clone(xs)
		slices.Sort(xs)
		if len(xs)%2 == 0 {
			return (xs[len(xs)/2-1] + xs[len(xs)/2]) / 2
		}
		return xs[len(xs)/2]
	}
	for w, suffix := range []string{"", "-steady"} {
		for _, c := range cases {
			b.ReportMetric(median(rates[w][c.name]), c.name+suffix+"-msgs/s")
			for _, base := range baseline[c.name] {
				if r := ratios[w][c.name+"/"+base]; len(r) > 0 {
					name := c.name + "/" + base + suffix
					b.ReportMetric(median(r), name+"-x")
					b.ReportMetric(slices.Min(r), name+"-x-min")
					b.ReportMetric(slices.Max(r), name+"-x-max")
				}
			}
		}
	}
}

// directWork is the redis-direct case's work for one delivery: the
// cheapest correct Redis dedup, with nothing of the adapter or the
// processor around it. It claims the key the adapter's processor claims
// (scope "bench", the message ID, no fingerprint, the processor's default
// 30 s lease) with redisstore's own Claim, runs a no-op handler, and
// completes the claim (fenced by its token) with the retention
// adapterConsumeN gives the processor; the bare loop acks after it.
func directWork(b *testing.B, s *redisstore.Store) func(context.Context, *amqp.Delivery) {
	return func(ctx context.Context, d *amqp.Delivery) {
		c, err := s.Claim(ctx, dedup.Key{Scope: "bench", ID: d.MessageId}, "", 30*time.Second)
		if err != nil || c.Outcome != dedup.Acquired {
			b.Errorf("redis-direct: claim of a new message: %v %v", c.Outcome, err)
			return
		}
		if err := s.Complete(ctx, c, nil, benchRetention); err != nil {
			b.Errorf("redis-direct: complete: %v", err)
		}
	}
}

// benchRetention is how long the benchmarks' processors keep keys.
const benchRetention = 10 * time.Minute

// benchQueue declares a queue of b.N messages and deletes it at the end.
func benchQueue(b *testing.B, url string) string {
	b.Helper()
	q, drop := fillQueue(b, url, b.N)
	b.Cleanup(drop)
	return q
}

// fillQueue declares a queue of n messages; drop deletes it (and the
// retry queues a consumer of it declared).
func fillQueue(b *testing.B, url string, n int) (q string, drop func()) {
	b.Helper()
	q = unique("dedupamqp-bench")
	conn, err := amqp.Dial(url)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		b.Fatal(err)
	}
	if _, err := ch.QueueDeclare(q, true, false, false, false, amqp.Table{amqp.QueueTypeArg: Classic}); err != nil {
		b.Fatal(err)
	}
	drop = func() {
		if c, err := amqp.Dial(url); err == nil {
			if ch, err := c.Channel(); err == nil {
				_, _ = ch.QueueDelete(q, false, false, false)
				for _, d := range []time.Duration{250 * time.Millisecond, time.Second, 5 * time.Second, 30 * time.Second} {
					_, _ = ch.QueueDelete(q+".retry."+d.String(), false, false, false)
				}
			}
			c.Close()
		}
	}
	if err := ch.Confirm(false); err != nil {
		drop()
		b.Fatal(err)
	}
	var pending []*amqp.DeferredConfirmation
	for i := range n {
		dc, err := ch.PublishWithDeferredConfirm("", q, false, false, amqp.Publishing{
			MessageId: "m-" + strconv.Itoa(i), DeliveryMode: amqp.Persistent, Body: []byte(`{"amount_cents":4200}`),
		})
		if err != nil {
			drop()
			b.Fatal(err)
		}
		pending = append(pending, dc)
		if len(pending) == 1000 || i == n-1 {
			for _, dc := range pending {
				if !dc.Wait() {
					drop()
					b.Fatal("publish nacked")
				}
			}
			pending = pending[:0]
		}
	}
	return q, drop
}

// bareConsume consumes b.N messages of q with a plain amqp091-go consumer,
// running work (if any) before each ack, and returns the time taken.
func bareConsume(b *testing.B, url, q string, prefetch, conc int, work func(context.Context, *amqp.Delivery)) time.Duration {
	b.Helper()
	return bareConsumeN(b, url, q, b.N, true, prefetch, conc, work).total
}

// consumeSpan is how long a consume took: total from its start (for the
// adapter, Run's dial, channels, declarations and QoS included; for the
// bare consumer, which dials before, from the Consume call) to the last
// ack, steady from the first delivery in hand (received by a bare worker;
// in the adapter's handler, so after its first claim) to the last ack.
type consumeSpan struct{ total, steady time.Duration }

// bareConsumeN consumes n messages of q as bareConsume does; timed resets
// and stops b's timer around the consuming.
func bareConsumeN(b *testing.B, url, q string, n int, timed bool, prefetch, conc int, work func(context.Context, *amqp.Delivery)) consumeSpan {
	b.Helper()
	conn, err := amqp.Dial(url)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		b.Fatal(err)
	}
	if err := ch.Qos(prefetch, 0, false); err != nil {
		b.Fatal(err)
	}
	if timed {
		b.ResetTimer()
	}
	start := time.Now()
	msgs, err := ch.Consume(q, "", false, false, false, false, nil)
	if err != nil {
		b.Fatal(err)
	}
	var done atomic.Int64
	all := make(chan struct{})
	var once, firstOnce sync.Once
	var first time.Time
	var wg sync.WaitGroup
	ctx := context.Background()
	for range conc {
		wg.Go(func() {
			for d := range msgs {
				firstOnce.Do(func() { first = time.Now() })
				if work != nil {
					work(ctx, &d)
				}
				if d.Ack(false) == nil && done.Add(1) == int64(n) {
					once.Do(func() { close(all) })
				}
			}
		})
	}
	<-all
	end := time.Now()
	if timed {
		b.StopTimer()
	}
	ch.Close()
	wg.Wait()
	return consumeSpan{end.Sub(start), end.Sub(first)}
}

// adapterConsume consumes b.N messages through a Consumer with a
// processor on s and returns the time taken.
func adapterConsume(b *testing.B, url string, s dedup.Store, prefetch, conc int, opts ...ConsumerOption) time.Duration {
	b.Helper()
	return adapterConsumeN(b, url, benchQueue(b, url), b.N, true, s, prefetch, conc, opts...).total
}

// adapterConsumeN consumes the n messages of q as adapterConsume does;
// timed resets and stops b's timer around the consuming.
func adapterConsumeN(b *testing.B, url, q string, n int, timed bool, s dedup.Store, prefetch, conc int, opts ...ConsumerOption) consumeSpan {
	b.Helper()
	var done atomic.Int64
	all := make(chan struct{})
	var once, firstOnce sync.Once
	var first time.Time
	p, err := consumer.New("bench", s, func(context.Context, *consumer.Message, consumer.Delivery) ([]byte, error) {
		firstOnce.Do(func() { first = time.Now() })
		return nil, nil
	},
		consumer.WithDeadLetter(&consumer.MemoryDLQ{}), consumer.WithRetention(benchRetention),
		consumer.WithObserver(func(_ *consumer.Message, d consumer.Decision) {
			if d.Action == consumer.Ack && done.Add(1) == int64(n) {
				once.Do(func() { close(all) })
			}
		}))
	if err != nil {
		b.Fatal(err)
	}
	c, err := NewConsumer(url, q, p, append([]ConsumerOption{WithPrefetch(prefetch), WithConcurrency(conc), WithLogger(quiet), WithoutDeclare()}, opts...)...)
	if err != nil {
		b.Fatal(err)
	}
	if timed {
		b.ResetTimer()
	}
	start := time.Now()
	errc := make(chan error, 1)
	go func() { errc <- c.Run(context.Background()) }()
	<-all
	end := time.Now()
	if timed {
		b.StopTimer()
	}
	c.Close()
	if err := <-errc; err != nil {
		b.Fatal(err)
	}
	if st := c.Stats(); st.Acked < uint64(n) {
		b.Fatalf("acked %d of %d", st.Acked, n)
	}
	return consumeSpan{end.Sub(start), end.Sub(first)}
}

// BenchmarkPublish measures confirmed publishes per second, one at a
// time per goroutine (pN: N goroutines, one connection):
//
//   - bare: amqp091-go PublishWithDeferredConfirm then Wait, on one
//     confirm-mode channel shared under a mutex for the publish.
//
//   - publisher: Publisher.Publish (mandatory, persistent, message_id,
//     the return check, the retry loop).
//
//     go test -run '^$' -bench BenchmarkPublish -benchtime 5000x -count 3 ./dedupamqp/
func BenchmarkPublish(b *testing.B) {
	for _, par := range []int{1, 16} {
		b.Run(fmt.Sprintf("p%d", par), func(b *testing.B) { benchPublish(b, par) })
	}
}

func benchPublish(b *testing.B, par int) {
	url := testenv.AMQPURL(b)
	var bareRate float64
	run := func(b *testing.B, one func(i int) error) float64 {
		var next atomic.Int64
		var wg sync.WaitGroup
		b.ResetTimer()
		start := time.Now()
		for range par {
			wg.Go(func() {
				for {
					i := next.Add(1) - 1
					if i >= int64(b.N) {
						return
					}
					if err := one(int(i)); err != nil {
						b.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
		elapsed := time.Since(start)
		b.StopTimer()
		rate := float64(b.N) / elapsed.Seconds()
		b.ReportMetric(rate, "msgs/s")
		if bareRate > 0 {
			b.ReportMetric(rate/bareRate, "x_bare")
		}
		return rate
	}
	declare := func(b *testing.B) string {
		q := unique("dedupamqp-bench-pub")
		conn, err := amqp.Dial(url)
		if err != nil {
			b.Fatal(err)
		}
		defer conn.Close()
		ch, _ := conn.Channel()
		if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() {
			if c, err := amqp.Dial(url); err == nil {
				if ch, err := c.Channel(); err == nil {
					_, _ = ch.QueueDelete(q, false, false, false)
				}
				c.Close()
			}
		})
		return q
	}
	body := []byte(`{"amount_cents":4200}`)
	b.Run("bare", func(b *testing.B) {
		q := declare(b)
		conn, err := amqp.Dial(url)
		if err != nil {
			b.Fatal(err)
		}
		defer conn.Close()
		ch, _ := conn.Channel()
		if err := ch.Confirm(false); err != nil {
			b.Fatal(err)
		}
		var mu sync.Mutex
		bareRate = 0
		bareRate = run(b, func(i int) error {
			mu.Lock()
			dc, err := ch.PublishWithDeferredConfirm("", q, false, false, amqp.Publishing{MessageId: "m-" + strconv.Itoa(i), DeliveryMode: amqp.Persistent, Body: body})
			mu.Unlock()
			if err != nil {
				return err
			}
			if !dc.Wait() {
				return fmt.Errorf("nacked")
			}
			return nil
		})
	})
	b.Run("publisher", func(b *testing.B) {
		q := declare(b)
		pub, err := NewPublisher(url)
		if err != nil {
			b.Fatal(err)
		}
		defer pub.Close()
		ctx := context.Background()
		run(b, func(i int) error {
			return pub.Publish(ctx, q, &consumer.Message{ID: "m-" + strconv.Itoa(i), Payload: body})
		})
	})
}
