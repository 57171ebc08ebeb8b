package consumer_test

import (
	"context"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
)

// nullStore acquires every claim and completes every item without doing
// anything, so that a benchmark on it measures the caller's own work.
type nullStore struct{}

func (nullStore) Claim(_ context.Context, key dedup.Key, _ dedup.Fingerprint, lease time.Duration) (dedup.Claim, error) {
	return dedup.Claim{Key: key, Outcome: dedup.Acquired, Token: dedup.NewToken(), Attempt: 1, LeaseUntil: time.Now().Add(lease)}, nil
}
func (nullStore) Complete(context.Context, dedup.Claim, []byte, time.Duration) error { return nil }
func (nullStore) Release(context.Context, dedup.Claim) error                         { return nil }
func (nullStore) Close() error                                                       { return nil }
func (nullStore) Extend(_ context.Context, c dedup.Claim, _ time.Duration) (dedup.Claim, error) {
	return c, nil
}

func (s nullStore) ClaimBatch(ctx context.Context, reqs []dedup.ClaimRequest, lease time.Duration) ([]dedup.Claim, error) {
	out := make([]dedup.Claim, len(reqs))
	now := time.Now()
	for i, r := range reqs {
		out[i] = dedup.Claim{Key: r.Key, Outcome: dedup.Acquired, Token: dedup.NewToken(), Attempt: 1, LeaseUntil: now.Add(lease)}
	}
	return out, nil
}

func (nullStore) CompleteBatch(_ context.Context, items []dedup.Completion, _ time.Duration) ([]error, error) {
	return make([]error, len(items)), nil
}

// BenchmarkPipelineNoIO measures, per message, what a consumer.Pipeline
// adds to a batch's store calls: batches of 100 messages through a
// Pipeline of depth 2 on a store whose calls do nothing (pipeline),
// beside the same calls made directly (direct: ClaimBatch of the
// batch's keys, the no-op handlers, CompleteBatch of the claims), one
// batch after the other on one goroutine. The pipeline's done recycles
// the decisions, as the dedupkafka consumer's does:
//
//	go test -run XXX -bench PipelineNoIO -benchmem ./consumer/
func BenchmarkPipelineNoIO(b *testing.B) {
	const batch = 100
	ctx := context.Background()
	msgs := func(n int) []*consumer.Message {
		ms := make([]*consumer.Message, n)
		for i := range ms {
			ms[i] = &consumer.Message{ID: "msg-" + strconv.Itoa(i), Delivery: 1}
		}
		return ms
	}
	b.Run("direct", func(b *testing.B) {
		var s nullStore
		ms := msgs(b.N)
		b.ReportAllocs()
		b.ResetTimer()
		defer cpuPerOp(b)()
		for off := 0; off < len(ms); off += batch {
			chunk := ms[off:min(off+batch, len(ms))]
			reqs := make([]dedup.ClaimRequest, len(chunk))
			for i, m := range chunk {
				reqs[i] = dedup.ClaimRequest{Key: dedup.Key{Scope: "orders", ID: m.ID}}
			}
			cs, err := s.ClaimBatch(ctx, reqs, 30*time.Second)
			if err != nil {
				b.Fatal(err)
			}
			items := make([]dedup.Completion, len(cs))
			for i, c := range cs {
				items[i] = dedup.Completion{Claim: c}
			}
			if _, err := s.CompleteBatch(ctx, items, 24*time.Hour); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("pipeline", func(b *testing.B) {
		p := noopProcessor(b, nullStore{})
		pl := p.NewPipeline(2)
		ms := msgs(b.N)
		acked := 0
		b.ReportAllocs()
		b.ResetTimer()
		report := cpuPerOp(b)
		for off := 0; off < len(ms); off += batch {
			pl.Submit(ctx, ms[off:min(off+batch, len(ms))], func(ds []consumer.Decision) {
				for _, d := range ds {
					if d.Acknowledge() {
						acked++
					}
				}
				pl.Recycle(ds) // as dedupkafka's consumer does
			})
		}
		pl.Wait()
		b.StopTimer()
		report()
		if acked != len(ms) {
			b.Fatalf("%d of %d messages acknowledged", acked, len(ms))
		}
	})
}

// cpuPerOp starts counting the process's CPU time (user and system, the
// GC's included) and returns the function that reports it per op: the
// wall time of a run on two goroutines says less on a shared machine.
func cpuPerOp(b *testing.B) func() {
	cpu := func() int64 {
		var ru syscall.Rusage
		if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
			b.Fatal(err)
		}
		return ru.Utime.Nano() + ru.Stime.Nano()
	}
	start := cpu()
	return func() { b.ReportMetric(float64(cpu()-start)/float64(b.N), "cpu-ns/op") }
}
