package dedupkafka

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/memstore"
	"github.com/twmb/franz-go/pkg/kgo"
)

// BenchmarkDrain measures the adapter's per-record work without a broker:
// the records of BenchmarkFloors (4 partitions, 500 records a round, a
// message-ID header, a 128-byte value) run through Consumer.round on
// memstore (mem: per record; mem-batch100: WithBatch(100)) against the
// floor's work on the same records (each read into the envelope and
// passed to the no-op handler, four partitions at once) and against
// direct: the floor plus the cheapest correct dedup a record, memstore
// Claim and Complete called directly with the processor's key (scope and
// message ID), fingerprint (none), lease and retention, no processor: the
// construction floor of mem. The cases rotate in each round (-benchtime
// Nx = N rounds of memBenchRecords records a case); the metrics are median
// records/s, the median ratio to the floor in the same round, and each
// case's median CPU time a record (user + system of the whole process,
// getrusage, so the GC's work is counted). It isolates what
// BenchmarkFloors' processing phase costs from the poll and commit, which
// no dedup change touches.
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
	// cpu[case] is the CPU time a record of each run of the case.
	cpu := map[string][]float64{}
	// timed makes the case's records (fresh IDs each run, so that memstore
	// sees new keys) and runs f, counting the CPU time of f only.
	timed := func(name string, f func(b *testing.B) float64) benchCase {
		return benchCase{name, func(b *testing.B) float64 {
			runs++
			fill(fmt.Sprint("r", runs))
			runtime.GC() // the making's garbage is not the case's to collect
			before := cpuTime(b)
			rate := f(b)
			cpu[name] = append(cpu[name], float64(cpuTime(b)-before)/float64(n))
			return rate
		}}
	}
	ours := func(batch int) func(b *testing.B) float64 {
		return func(b *testing.B) float64 {
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
				// Under c.mu, as Consumer.take: in batch mode the decisions
				// of the batches still in flight cut the backlog meanwhile.
				c.mu.Lock()
				for i, rs := range byPart {
					if len(rs) > 0 {
						pts[i].backlog = append(pts[i].backlog, rs...)
						work = append(work, pts[i])
					}
				}
				c.mu.Unlock()
				c.round(context.Background(), context.Background(), work)
			})
			c.batches.Wait() // in batch mode the last batches are decided after round
			took := time.Since(start)
			if s := c.Stats(); s.Final != uint64(n) || s.Duplicates != 0 {
				b.Fatalf("stats %+v: want %d records final, none duplicate", s, n)
			}
			return float64(n) / took.Seconds()
		}
	}
	// floor is the floor's loop; with direct, each record is also claimed
	// and completed in memstore directly.
	floor := func(direct bool) func(b *testing.B) float64 {
		return func(b *testing.B) float64 {
			var d *directMem
			if direct {
				d = newDirectMem(b, "bench-drain")
				defer d.s.Close()
			}
			ctx := context.Background()
			var failed atomic.Value
			start := time.Now()
			rounds(func(byPart [][]*kgo.Record) {
				var wg sync.WaitGroup
				for _, rs := range byPart {
					wg.Go(func() {
						for _, r := range rs {
							m, _ := newMessage(r, 1)
							if d == nil {
								_, _ = benchHandler(ctx, m, consumer.Delivery{})
								continue
							}
							if err := d.run(ctx, m); err != nil {
								failed.Store(err)
								return
							}
						}
					})
				}
				wg.Wait()
			})
			took := time.Since(start)
			if err, _ := failed.Load().(error); err != nil {
				b.Fatal(err)
			}
			return float64(n) / took.Seconds()
		}
	}
	// directBatch is the floor's loop with memstore's ClaimBatch and
	// CompleteBatch of each chunk of batch records called directly (the
	// processor's key, lease and retention): mem-batch100's construction
	// floor, as redis-direct is the redis case's in BenchmarkFloors.
	directBatch := func(batch int) func(b *testing.B) float64 {
		return func(b *testing.B) float64 {
			d := newDirectMem(b, "bench-drain")
			defer d.s.Close()
			ctx := context.Background()
			var failed atomic.Value
			start := time.Now()
			rounds(func(byPart [][]*kgo.Record) {
				var wg sync.WaitGroup
				for _, rs := range byPart {
					wg.Go(func() {
						ms := make([]*consumer.Message, batch)
						for len(rs) > 0 {
							k := min(batch, len(rs))
							ids := make([]string, k)
							for i, r := range rs[:k] {
								ms[i], _ = newMessage(r, 1)
								ids[i] = ms[i].ID
							}
							if err := d.batch(ctx, ids, ms[:k]); err != nil {
								failed.Store(err)
								return
							}
							rs = rs[k:]
						}
					})
				}
				wg.Wait()
			})
			took := time.Since(start)
			if err, _ := failed.Load().(error); err != nil {
				b.Fatal(err)
			}
			return float64(n) / took.Seconds()
		}
	}
	cases := []benchCase{
		timed("floor", floor(false)),
		timed("direct", floor(true)),
		timed("direct-batch100", directBatch(100)),
		timed("mem", ours(1)),
		timed("mem-batch100", ours(100)),
	}
	benchRotate(b, cases, map[string]string{"direct": "floor", "mem": "floor,direct", "direct-batch100": "floor", "mem-batch100": "floor,direct-batch100"})
	for _, c := range cases {
		if len(cpu[c.name]) > 0 {
			b.ReportMetric(benchMedian(cpu[c.name]), c.name+"-cpu-ns/rec")
		}
	}
}

// cpuTime is the process's CPU time so far (user and system), in ns.
func cpuTime(b *testing.B) int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return ru.Utime.Nano() + ru.Stime.Nano()
}

// directMem is the cheapest correct dedup of a record on memstore, the
// construction floor of the mem cases: Claim with the key the processor
// derives (its scope, the message ID), no fingerprint and the processor's
// default lease, the no-op handler, then Complete with the default
// retention. Every key is new: anything but Acquired is an error.
type directMem struct {
	s     *memstore.Store
	scope string
}

// newDirectMem returns a directMem on a new memstore; the caller closes it.
func newDirectMem(b *testing.B, scope string) *directMem {
	s, err := memstore.New()
	if err != nil {
		b.Fatal(err)
	}
	return &directMem{s: s, scope: scope}
}

// The consumer package's defaults, which the processors of the mem cases
// run with.
const (
	directLease     = 30 * time.Second
	directRetention = 24 * time.Hour
)

func (d *directMem) run(ctx context.Context, m *consumer.Message) error {
	c, err := d.s.Claim(ctx, dedup.Key{Scope: d.scope, ID: m.ID}, "", directLease)
	if err != nil {
		return err
	}
	if c.Outcome != dedup.Acquired {
		return fmt.Errorf("direct floor: %s claimed %s, want acquired", m.ID, c.Outcome)
	}
	out, err := benchHandler(ctx, m, consumer.Delivery{Key: c.Key, Attempt: 1})
	if err != nil {
		return err
	}
	return d.s.Complete(ctx, c, out, directRetention)
}

// batch claims the chunk ids in one ClaimBatch, runs the no-op handler
// of each of ms, and completes the claims in one CompleteBatch.
func (d *directMem) batch(ctx context.Context, ids []string, ms []*consumer.Message) error {
	reqs := make([]dedup.ClaimRequest, len(ids))
	for i, id := range ids {
		reqs[i] = dedup.ClaimRequest{Key: dedup.Key{Scope: d.scope, ID: id}}
	}
	cs, err := d.s.ClaimBatch(ctx, reqs, directLease)
	if err != nil {
		return err
	}
	items := make([]dedup.Completion, len(cs))
	for i, c := range cs {
		if c.Outcome != dedup.Acquired {
			return fmt.Errorf("direct floor: %s claimed %s, want acquired", ids[i], c.Outcome)
		}
		out, err := benchHandler(ctx, ms[i], consumer.Delivery{Key: c.Key, Attempt: 1})
		if err != nil {
			return err
		}
		items[i] = dedup.Completion{Claim: c, Result: out}
	}
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
}

// worker is run as floorConsumeWith's claim and complete, for chunks of
// one record: the claim of the chunk's record is kept for its completion.
func (d *directMem) worker() (claim, complete func(ctx context.Context, ids []string) error) {
	var c dedup.Claim
	claim = func(ctx context.Context, ids []string) error {
		var err error
		if c, err = d.s.Claim(ctx, dedup.Key{Scope: d.scope, ID: ids[0]}, "", directLease); err != nil {
			return err
		}
		if c.Outcome != dedup.Acquired {
			return fmt.Errorf("direct floor: %s claimed %s, want acquired", ids[0], c.Outcome)
		}
		return nil
	}
	complete = func(ctx context.Context, ids []string) error {
		return d.s.Complete(ctx, c, nil, directRetention)
	}
	return claim, complete
}
