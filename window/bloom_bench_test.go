package window

import (
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	bnb "github.com/bits-and-blooms/bloom/v3"

	"github.com/dedupkit/dedup"
)

// The ageing Bloom filter against bits-and-blooms/bloom, in one run, at the
// default size: 10M keys at a false-positive rate of 0.1%.
//
//   - impl=window: this package's filter, 4 interleaved generations,
//     lock-free.
//   - impl=bitsandblooms-gen4-locked: the alternative design, 4
//     bits-and-blooms filters of 2.5M keys each (same per-generation
//     bound) behind a sync.RWMutex, rotated the same way.
//   - impl=bitsandblooms-single: one bits-and-blooms filter of 10M keys
//     at 0.1%, no lock and no ageing (it fills up), the baseline of
//     BASELINES.md.
//
// Every filter is first filled with 5M keys (half its capacity), and every
// operation hashes its key (maphash here, murmur3 in bits-and-blooms).

const (
	bloomKeys  = 10_000_000
	bloomRate0 = 0.001
	bloomGens  = 4
	bloomFill  = bloomKeys / 2
)

func bloomKey(i int) dedup.Key {
	return dedup.Key{Scope: "analytics/page-views", ID: "0f3c9a7e-" + strconv.Itoa(1_000_000_000+i)}
}

// filter is one implementation under test.
type filter struct {
	name       string
	test       func(dedup.Key) bool
	testAndAdd func(dedup.Key) bool
	concurrent bool
	bytes      int
}

// lockedGens is the rejected alternative: generations of bits-and-blooms
// filters behind one lock.
type lockedGens struct {
	mu     sync.RWMutex
	gens   []*bnb.BloomFilter
	cur    int
	n      int
	perGen int
}

func newLockedGens(keys int, p float64, g int) *lockedGens {
	perGen := keys / g
	pg := -math.Expm1(math.Log1p(-p) / float64(g))
	l := &lockedGens{perGen: perGen}
	for range g {
		l.gens = append(l.gens, bnb.NewWithEstimates(uint(perGen), pg))
	}
	return l
}

func (l *lockedGens) test(s string) bool {
	l.mu.RLock()
	defer l.mu.RUnlock()
	for _, f := range l.gens {
		if f.TestString(s) {
			return true
		}
	}
	return false
}

func (l *lockedGens) add(s string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.gens[l.cur].AddString(s)
	if l.n++; l.n >= l.perGen {
		l.cur = (l.cur + 1) % len(l.gens)
		l.gens[l.cur].ClearAll()
		l.n = 0
	}
}

func (l *lockedGens) bytes() int {
	n := 0
	for _, f := range l.gens {
		n += int(f.Cap() / 8)
	}
	return n
}

var filters struct {
	once sync.Once
	all  []filter
}

func benchFilters(b *testing.B) []filter {
	filters.once.Do(func() {
		w, err := New(WithCapacity(1)) // for its hash function
		if err != nil {
			b.Fatal(err)
		}
		ours := newBloom(bloomKeys, bloomRate0, bloomGens, 0)
		locked := newLockedGens(bloomKeys, bloomRate0, bloomGens)
		single := bnb.NewWithEstimates(bloomKeys, bloomRate0)
		for i := range bloomFill {
			k := bloomKey(i)
			h1, h2 := w.hash(k)
			ours.add(h1, h2, maxExpiry, 0)
			locked.add(k.ID)
			single.AddString(k.ID)
		}
		filters.all = []filter{
			{
				name: "window",
				test: func(k dedup.Key) bool { h1, h2 := w.hash(k); return ours.test(h1, h2, 0) },
				testAndAdd: func(k dedup.Key) bool {
					h1, h2 := w.hash(k)
					found := ours.test(h1, h2, 0)
					ours.add(h1, h2, maxExpiry, 0)
					return found
				},
				concurrent: true,
				bytes:      len(ours.words) * 8,
			},
			{
				name: "bitsandblooms-gen4-locked",
				test: func(k dedup.Key) bool { return locked.test(k.ID) },
				testAndAdd: func(k dedup.Key) bool {
					found := locked.test(k.ID)
					locked.add(k.ID)
					return found
				},
				concurrent: true,
				bytes:      locked.bytes(),
			},
			{
				name:       "bitsandblooms-single",
				test:       func(k dedup.Key) bool { return single.TestString(k.ID) },
				testAndAdd: func(k dedup.Key) bool { return single.TestAndAddString(k.ID) },
				bytes:      int(single.Cap() / 8),
			},
		}
	})
	return filters.all
}

var bloomSink atomic.Int64

func BenchmarkBloom(b *testing.B) {
	fs := benchFilters(b)
	const nkeys = 1 << 21
	fresh := make([]dedup.Key, nkeys) // never added before the benchmark
	for i := range fresh {
		fresh[i] = bloomKey(bloomKeys + i)
	}
	next := 0 // keys for TestAndAdd, new to every filter
	for _, f := range fs {
		b.Run("op=Test/impl="+f.name, func(b *testing.B) {
			for i := 0; b.Loop(); i++ {
				if f.test(fresh[i&(nkeys-1)]) {
					bloomSink.Add(1)
				}
			}
			b.ReportMetric(float64(f.bytes)/(1<<20), "MiB")
		})
		if f.concurrent {
			b.Run("op=Test/impl="+f.name+"/parallel", func(b *testing.B) {
				var start atomic.Int64
				b.RunParallel(func(pb *testing.PB) {
					i := int(start.Add(7919))
					for pb.Next() {
						f.test(fresh[i&(nkeys-1)])
						i++
					}
				})
			})
		}
		b.Run("op=TestAndAdd/impl="+f.name, func(b *testing.B) {
			keys := make([]dedup.Key, 1<<16)
			for b.Loop() {
				b.StopTimer()
				for j := range keys {
					keys[j] = bloomKey(2*bloomKeys + next)
					next++
				}
				b.StartTimer()
				for _, k := range keys {
					f.testAndAdd(k)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(keys)), "ns/key")
		})
	}
}

// BenchmarkBloomRotate reports how long retiring one generation takes at
// the default size: the Add that triggers it pays this once per
// keys/generations insertions.
func BenchmarkBloomRotate(b *testing.B) {
	f := newBloom(bloomKeys, bloomRate0, bloomGens, 0)
	for b.Loop() {
		f.rotate(f.state.Load()&0xff, 0, false)
	}
	b.ReportMetric(float64(len(f.words)*8/bloomGens)/(1<<20), "MiB-cleared")
}

// BenchmarkLossyFalsePositiveRate measures, at the default size, the
// false-positive rate on fresh keys at the worst moment, just before a
// rotation when every live generation is full, at three successive
// rotations once all generations have filled; it reports the worst and
// mean rates against the bound. (TestLossyFalsePositiveRateStaysBounded
// does the same at a small size over three turns of the generations.)
func BenchmarkLossyFalsePositiveRate(b *testing.B) {
	w, err := New(WithCapacity(1))
	if err != nil {
		b.Fatal(err)
	}
	const probes = 200_000
	var worst, sum float64
	var points int
	for b.Loop() {
		f := newBloom(bloomKeys, bloomRate0, bloomGens, 0)
		next, fresh := 0, 1<<40
		worst, sum, points = 0, 0, 0
		for rot := range bloomGens + 2 {
			cur := f.state.Load() & 0xff
			for f.gens[cur].keys.Load() < f.perGen-1 {
				h1, h2 := w.hash(bloomKey(next))
				f.add(h1, h2, maxExpiry, 0)
				next++
			}
			if rot >= bloomGens-1 { // every generation is full from here on
				maybes := 0
				for range probes {
					h1, h2 := w.hash(bloomKey(fresh))
					if f.test(h1, h2, 0) {
						maybes++
					}
					fresh++
				}
				rate := float64(maybes) / probes
				worst = max(worst, rate)
				sum += rate
				points++
			}
			for f.state.Load()&0xff == cur {
				h1, h2 := w.hash(bloomKey(next))
				f.add(h1, h2, maxExpiry, 0)
				next++
			}
		}
	}
	b.ReportMetric(worst, "fp-worst")
	b.ReportMetric(sum/float64(points), "fp-mean")
	b.ReportMetric(bloomRate0, "fp-bound")
	b.ReportMetric(worst/bloomRate0, "worst/bound")
}
