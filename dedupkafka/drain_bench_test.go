package dedupkafka

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/memstore"
	"github.com/twmb/franz-go/pkg/kgo"
)

// BenchmarkDrain measures the adapter's per-record work without a broker:
// the records of BenchmarkFloors (4 partitions, 500 records a round, a
// message-ID header, a 128-byte value) run through Consumer.round on
// memstore (mem: per record; mem-batch100: WithBatch(100)) against the
// floor's work on the same records (each read into the envelope and
// passed to the no-op handler, four partitions at once). The cases rotate
// in each round (-benchtime Nx = N rounds of memBenchRecords records a
// case); the metrics are median records/s and the median ratio to the
// floor in the same round. It isolates what BenchmarkFloors' processing
// phase costs from the poll and commit, which no dedup change touches.
func BenchmarkDrain(b *testing.B) {
	const parts, perRound = 4, 500
	n := memBenchRecords
	recs := make([]*kgo.Record, n)
	// The records are made once per case run (fresh IDs each run, so that
	// memstore sees new keys), outside the timing.
	fill := func(run string) {
		for i := range recs {
			recs[i] = &kgo.Record{Topic: "drain", Partition: int32(i % parts), Offset: int64(i / parts),
				Key: fmt.Appendf(nil, "k%d", i%64), Value: make([]byte, 128), Timestamp: time.Now(),
				Headers: []kgo.RecordHeader{{Key: HeaderMsgID, Value: fmt.Appendf(nil, "%s-%d", run, i)}}}
		}
	}
	// rounds calls f with each round's records grouped by partition.
	rounds := func(f func(byPart [][]*kgo.Record)) {
		for off := 0; off < n; off += perRound {
			byPart := make([][]*kgo.Record, parts)
			for _, r := range recs[off:min(off+perRound, n)] {
				byPart[r.Partition] = append(byPart[r.Partition], r)
			}
			f(byPart)
		}
	}
	runs := 0
	ours := func(batch int) func(b *testing.B) float64 {
		return func(b *testing.B) float64 {
			runs++
			fill(fmt.Sprint("r", runs))
			s, err := memstore.New()
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			p, err := consumer.New("bench-drain", s, benchHandler, consumer.WithLogger(quiet), consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
			if err != nil {
				b.Fatal(err)
			}
			cfg := defaultConsumerConfig()
			cfg.batch, cfg.logger = batch, quiet
			c := &Consumer{p: p, cfg: cfg, parts: map[tp]*part{}}
			pts := make([]*part, parts)
			for i := range pts {
				pts[i] = &part{tp: tp{"drain", int32(i)}, committed: -1}
			}
			start := time.Now()
			rounds(func(byPart [][]*kgo.Record) {
				work := make([]*part, 0, parts)
				for i, rs := range byPart {
					if len(rs) > 0 {
						pts[i].backlog = append(pts[i].backlog, rs...)
						work = append(work, pts[i])
					}
				}
				c.round(context.Background(), context.Background(), work)
			})
			took := time.Since(start)
			if s := c.Stats(); s.Final != uint64(n) || s.Duplicates != 0 {
				b.Fatalf("stats %+v: want %d records final, none duplicate", s, n)
			}
			return float64(n) / took.Seconds()
		}
	}
	cases := []benchCase{
		{"floor", func(b *testing.B) float64 {
			runs++
			fill(fmt.Sprint("r", runs))
			ctx := context.Background()
			start := time.Now()
			rounds(func(byPart [][]*kgo.Record) {
				var wg sync.WaitGroup
				for _, rs := range byPart {
					wg.Go(func() {
						for _, r := range rs {
							m, _ := newMessage(r, 1)
							_, _ = benchHandler(ctx, m, consumer.Delivery{})
						}
					})
				}
				wg.Wait()
			})
			return float64(n) / time.Since(start).Seconds()
		}},
		{"mem", ours(1)},
		{"mem-batch100", ours(100)},
	}
	benchRotate(b, cases, map[string]string{"mem": "floor", "mem-batch100": "floor"})
}
