package dedupprom_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/dedupotel"
	"github.com/dedupkit/dedup/dedupprom"
	"github.com/dedupkit/dedup/memstore"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
)

// adapters are the cases of every benchmark, in one process and in this
// order in each of rounds rounds, so that the machine's load falls on
// every case alike (benchstat reads the #NN runs as samples): no hooks, dedupprom, dedupotel
// on the SDK's meter (a manual reader: nothing exported during the run)
// with tracing off (the API's no-op tracer provider), and dedupotel with an SDK tracer that
// records every span (in memory).
type adapter struct {
	name string
	// hooks returns the root hooks and the consumer observer and handler
	// wrapper of the case.
	make func(b *testing.B) (hooks []dedup.Hook, observe func(*consumer.Message, consumer.Decision), wrap func(consumer.Handler) consumer.Handler)
}

const rounds = 5

var adapters = []adapter{
	{"none", func(*testing.B) ([]dedup.Hook, func(*consumer.Message, consumer.Decision), func(consumer.Handler) consumer.Handler) {
		return nil, nil, nil
	}},
	{"dedupprom", func(b *testing.B) ([]dedup.Hook, func(*consumer.Message, consumer.Decision), func(consumer.Handler) consumer.Handler) {
		m, err := dedupprom.New()
		if err != nil {
			b.Fatal(err)
		}
		prometheus.NewRegistry().MustRegister(m)
		return []dedup.Hook{m}, m.Observer("orders"), nil
	}},
	{"dedupotel", func(b *testing.B) ([]dedup.Hook, func(*consumer.Message, consumer.Decision), func(consumer.Handler) consumer.Handler) {
		mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
		b.Cleanup(func() { mp.Shutdown(context.Background()) })
		tel, err := dedupotel.New(dedupotel.WithMeterProvider(mp), dedupotel.WithTracerProvider(tracenoop.NewTracerProvider()))
		if err != nil {
			b.Fatal(err)
		}
		return []dedup.Hook{tel}, tel.Observer("orders"), func(h consumer.Handler) consumer.Handler { return tel.Handler("orders", h) }
	}},
	{"dedupotel+spans", func(b *testing.B) ([]dedup.Hook, func(*consumer.Message, consumer.Decision), func(consumer.Handler) consumer.Handler) {
		mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
		tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(tracetest.NewNoopExporter()))
		b.Cleanup(func() { mp.Shutdown(context.Background()); tp.Shutdown(context.Background()) })
		tel, err := dedupotel.New(dedupotel.WithMeterProvider(mp), dedupotel.WithTracerProvider(tp))
		if err != nil {
			b.Fatal(err)
		}
		return []dedup.Hook{tel}, tel.Observer("orders"), func(h consumer.Handler) consumer.Handler { return tel.Handler("orders", h) }
	}},
}

func keys(n int) []dedup.Key {
	ks := make([]dedup.Key, n)
	for i := range ks {
		ks[i] = dedup.Key{Scope: "payments", ID: "k-" + strconv.Itoa(i)}
	}
	return ks
}

// BenchmarkRunner: Runner.Do of a new key on memstore (claim, handler,
// complete): one claim and one finish event per message.
func BenchmarkRunner(b *testing.B) {
	for range rounds {
		for _, a := range adapters {
			if a.name == "dedupotel+spans" {
				continue // the Runner starts no span
			}
			b.Run(a.name, func(b *testing.B) {
				hooks, _, _ := a.make(b)
				store, err := memstore.New()
				if err != nil {
					b.Fatal(err)
				}
				r, err := dedup.NewRunner(store, dedup.WithHooks(hooks...))
				if err != nil {
					b.Fatal(err)
				}
				ks := keys(b.N)
				ctx := context.Background()
				h := func(context.Context) ([]byte, error) { return nil, nil }
				b.ReportAllocs()
				b.ResetTimer()
				for i := range b.N {
					if _, err := r.Do(ctx, ks[i], "", h); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// BenchmarkRunnerDuplicate: Runner.Do of a completed key (a duplicate):
// a claim and a duplicate event per message, the hot path of a storm of
// redeliveries.
func BenchmarkRunnerDuplicate(b *testing.B) {
	for range rounds {
		for _, a := range adapters {
			if a.name == "dedupotel+spans" {
				continue
			}
			b.Run(a.name, func(b *testing.B) {
				hooks, _, _ := a.make(b)
				store, err := memstore.New()
				if err != nil {
					b.Fatal(err)
				}
				r, err := dedup.NewRunner(store, dedup.WithHooks(hooks...))
				if err != nil {
					b.Fatal(err)
				}
				ctx := context.Background()
				k := dedup.Key{Scope: "payments", ID: "k"}
				h := func(context.Context) ([]byte, error) { return nil, nil }
				if _, err := r.Do(ctx, k, "", h); err != nil {
					b.Fatal(err)
				}
				b.ReportAllocs()
				b.ResetTimer()
				for range b.N {
					if res, err := r.Do(ctx, k, "", h); err != nil || !res.Duplicate {
						b.Fatal(res, err)
					}
				}
			})
		}
	}
}

// BenchmarkConsumer: consumer.Processor.Process of a new message on
// memstore, with the adapter's runner hooks, decision observer and (for
// dedupotel) handler wrapper.
func BenchmarkConsumer(b *testing.B) {
	for range rounds {
		for _, a := range adapters {
			b.Run(a.name, func(b *testing.B) {
				hooks, observe, wrap := a.make(b)
				store, err := memstore.New()
				if err != nil {
					b.Fatal(err)
				}
				var h consumer.Handler = func(context.Context, *consumer.Message, consumer.Delivery) ([]byte, error) { return nil, nil }
				if wrap != nil {
					h = wrap(h)
				}
				opts := []consumer.Option{consumer.WithDeadLetter(&consumer.MemoryDLQ{}), consumer.WithScope("orders"),
					consumer.WithRunnerOptions(dedup.WithHooks(hooks...))}
				if observe != nil {
					opts = append(opts, consumer.WithObserver(observe))
				}
				p, err := consumer.New("orders", store, h, opts...)
				if err != nil {
					b.Fatal(err)
				}
				msgs := make([]consumer.Message, b.N)
				for i := range msgs {
					msgs[i] = consumer.Message{ID: "m-" + strconv.Itoa(i), Subject: "orders.placed", Delivery: 1}
				}
				ctx := context.Background()
				b.ReportAllocs()
				b.ResetTimer()
				for i := range b.N {
					if d := p.Process(ctx, &msgs[i]); d.Action != consumer.Ack {
						b.Fatal(d)
					}
				}
			})
		}
	}
}

// BenchmarkAdapterPerMessage is the adapters' own work for one message
// through a consumer in store mode, without the store: a claim event
// (acquired, with a latency), a finish event (complete) and the decision
// observer; "none" emits the same events to no hook. cpu-ns/op is the
// process's CPU time per message (run with -cpu 1): on a loaded machine it
// is the work, where ns/op also counts waiting for a core.
//
// Two floors of the OpenTelemetry SDK run in the same rounds: "sdk-add",
// one bare counter Add with a pre-built attribute set (the cheapest SDK
// measurement), and "sdk-floor", the SDK calls dedupotel still makes per
// message, bare: the claim latency (one attribute) and the finish latency
// (three) recorded on histograms with pre-built attribute sets.
func BenchmarkAdapterPerMessage(b *testing.B) {
	for range rounds {
		for _, a := range adapters[:3] {
			b.Run(a.name, func(b *testing.B) {
				hs, observe, _ := a.make(b)
				hooks := dedup.NewHooks(hs...)
				ctx := context.Background()
				k := dedup.Key{Scope: "orders", ID: "m-1"}
				msg := &consumer.Message{ID: "m-1", Subject: "orders.placed", Delivery: 1}
				d := consumer.Decision{Action: consumer.Ack, Key: k}
				b.ReportAllocs()
				b.ResetTimer()
				cpu := cpuNanos()
				defer func() { b.ReportMetric(float64(cpuNanos()-cpu)/float64(b.N), "cpu-ns/op") }()
				for range b.N {
					hooks.Claimed(ctx, dedup.ClaimEvent{Store: "memory", Key: k, Outcome: dedup.Acquired, Attempt: 1, Duration: 1000})
					hooks.Finished(ctx, dedup.FinishEvent{Store: "memory", Key: k, Op: "complete", Duration: 1000})
					if observe != nil {
						observe(msg, d)
					}
				}
			})
		}
		b.Run("sdk-add", func(b *testing.B) {
			mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
			b.Cleanup(func() { mp.Shutdown(context.Background()) })
			c, err := mp.Meter("floor").Int64Counter("floor.adds")
			if err != nil {
				b.Fatal(err)
			}
			opt := []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(attribute.String("dedup.store", "memory")))}
			ctx := context.Background()
			b.ReportAllocs()
			b.ResetTimer()
			cpu := cpuNanos()
			defer func() { b.ReportMetric(float64(cpuNanos()-cpu)/float64(b.N), "cpu-ns/op") }()
			for range b.N {
				c.Add(ctx, 1, opt...)
			}
		})
		b.Run("sdk-floor", func(b *testing.B) {
			mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
			b.Cleanup(func() { mp.Shutdown(context.Background()) })
			bounds := metric.WithExplicitBucketBoundaries(.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)
			claim, err := mp.Meter("floor").Float64Histogram("floor.claim", bounds)
			if err != nil {
				b.Fatal(err)
			}
			finish, err := mp.Meter("floor").Float64Histogram("floor.finish", bounds)
			if err != nil {
				b.Fatal(err)
			}
			store := attribute.String("dedup.store", "memory")
			claimOpt := []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(store))}
			finishOpt := []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(store,
				attribute.String("dedup.operation", "complete"), attribute.String("dedup.result", "ok")))}
			ctx := context.Background()
			b.ReportAllocs()
			b.ResetTimer()
			cpu := cpuNanos()
			defer func() { b.ReportMetric(float64(cpuNanos()-cpu)/float64(b.N), "cpu-ns/op") }()
			for range b.N {
				claim.Record(ctx, 1e-6, claimOpt...)
				finish.Record(ctx, 1e-6, finishOpt...)
			}
		})
	}
}
