package consumer_test

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/memstore"
)

// The processor's own cost per message: one run through Process on
// memstore, beside the same claim-run-complete through a bare dedup.Runner
// and the store calls alone, in one run; and ProcessBatch, whose op is one
// message of a batch (processor-batch64: b.N messages in batches of 64):
//
//	go test -run XXX -bench Processor -benchmem ./consumer/

func benchIDs(n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = "msg-" + strconv.Itoa(i)
	}
	return ids
}

func benchStore(b *testing.B) *memstore.Store {
	s, err := memstore.New(memstore.WithCapacity(b.N + 1024))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { s.Close() })
	return s
}

// noopProcessor is a processor on s whose handler does nothing.
func noopProcessor(b *testing.B, s dedup.Store) *consumer.Processor {
	p, err := consumer.New("orders", s, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		return nil, nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		b.Fatal(err)
	}
	return p
}

func BenchmarkProcessor(b *testing.B) {
	ctx := context.Background()
	noop := func(ctx context.Context) ([]byte, error) { return nil, nil }
	b.Run("store-calls", func(b *testing.B) {
		s, ids := benchStore(b), benchIDs(b.N)
		b.ReportAllocs()
		b.ResetTimer()
		for i := range b.N {
			c, err := s.Claim(ctx, dedup.Key{Scope: "orders", ID: ids[i]}, "", 30*time.Second)
			if err != nil || c.Outcome != dedup.Acquired {
				b.Fatal(err)
			}
			if err := s.Complete(ctx, c, nil, 24*time.Hour); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("runner", func(b *testing.B) {
		s, ids := benchStore(b), benchIDs(b.N)
		r, _ := dedup.NewRunner(s)
		b.ReportAllocs()
		b.ResetTimer()
		for i := range b.N {
			if _, err := r.Do(ctx, dedup.Key{Scope: "orders", ID: ids[i]}, "", noop); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("processor", func(b *testing.B) {
		s, ids := benchStore(b), benchIDs(b.N)
		p := noopProcessor(b, s)
		m := &consumer.Message{Subject: "orders", Payload: []byte("{}")}
		b.ReportAllocs()
		b.ResetTimer()
		for i := range b.N {
			m.ID = ids[i]
			if d := p.Process(ctx, m); d.Action != consumer.Ack {
				b.Fatal(d.Err)
			}
		}
	})
	for _, size := range []int{16, 64, 256} {
		b.Run(fmt.Sprint("processor-batch", size), func(b *testing.B) {
			s, ids := benchStore(b), benchIDs(b.N)
			p := noopProcessor(b, s)
			ms := make([]consumer.Message, size)
			batch := make([]*consumer.Message, size)
			for i := range ms {
				ms[i] = consumer.Message{Subject: "orders", Payload: []byte("{}")}
				batch[i] = &ms[i]
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i += size {
				n := min(size, b.N-i)
				for j := range n {
					ms[j].ID = ids[i+j]
				}
				for _, d := range p.ProcessBatch(ctx, batch[:n]) {
					if d.Action != consumer.Ack {
						b.Fatal(d.Err)
					}
				}
			}
		})
	}
	b.Run("processor-duplicate", func(b *testing.B) {
		p := noopProcessor(b, benchStore(b))
		m := &consumer.Message{ID: "same", Payload: []byte("{}")}
		p.Process(ctx, m)
		b.ReportAllocs()
		b.ResetTimer()
		for range b.N {
			if d := p.Process(ctx, m); !d.Duplicate {
				b.Fatal(d.Err)
			}
		}
	})
}
