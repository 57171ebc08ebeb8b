package window_test

import (
	"math/rand/v2"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	lru "github.com/hashicorp/golang-lru/v2"
	"github.com/maypok86/otter/v2"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/window"
)

// The exact record against golang-lru and otter used directly, with the
// same keys, in one run. Run with:
//
//	go test -run '^$' -bench . -benchmem ./window/
//
// Each implementation holds 1<<20 keys, with a capacity of 1.25 times that
// (the window's capacity is split over its shards, and a shard that gets
// more than its share of keys evicts). "keys=64K" checks a 64K subset of
// them (what they touch fits in the L3 cache), "keys=1M" all of them in
// random order (most checks miss the caches and the TLB), and "keys=4K" a
// subset that stays in the L2 cache, like a redelivered batch checked soon
// after it completed: this tier shows the CPU cost of a check.

const benchCapacity = 1 << 20

// benchKeys returns n keys shaped like real ones: a scope and a 36-byte ID.
func benchKeys(seed uint64, n int) []dedup.Key {
	r := rand.New(rand.NewPCG(seed, seed))
	ks := make([]dedup.Key, n)
	for i := range ks {
		a, b := r.Uint64(), r.Uint64()
		ks[i] = dedup.Key{Scope: "payments/charge-consumer", ID: strconv.FormatUint(a, 16) + "-" + strconv.FormatUint(b, 16)}
	}
	return ks
}

// impl is one implementation of "record a completed key, check a key".
type impl struct {
	name  string
	add   func(dedup.Key)
	check func(dedup.Key) bool
}

func newImpls(tb testing.TB, capacity int) []impl {
	w, err := window.New(window.WithCapacity(capacity))
	if err != nil {
		tb.Fatal(err)
	}
	exp := time.Now().Add(time.Hour)
	l, err := lru.New[dedup.Key, []byte](capacity)
	if err != nil {
		tb.Fatal(err)
	}
	o := otter.Must(&otter.Options[dedup.Key, []byte]{MaximumSize: capacity})
	return []impl{
		{"window", func(k dedup.Key) { w.Add(k, nil, exp) }, func(k dedup.Key) bool { v, _, _ := w.Check(k); return v == window.Hit }},
		{"golang-lru-Get", func(k dedup.Key) { l.Add(k, nil) }, func(k dedup.Key) bool { _, ok := l.Get(k); return ok }},
		{"golang-lru-Contains", func(k dedup.Key) { l.Add(k, nil) }, func(k dedup.Key) bool { return l.Contains(k) }},
		{"otter", func(k dedup.Key) { o.Set(k, nil) }, func(k dedup.Key) bool { _, ok := o.GetIfPresent(k); return ok }},
	}
}

var filled struct {
	once  sync.Once
	keys  []dedup.Key // held by every implementation
	fresh []dedup.Key // held by none
	impls []impl
}

func filledImpls(b *testing.B) ([]impl, []dedup.Key, []dedup.Key) {
	filled.once.Do(func() {
		filled.keys = benchKeys(1, benchCapacity)
		filled.fresh = benchKeys(2, benchCapacity)
		filled.impls = newImpls(b, benchCapacity+benchCapacity/4)
		for _, im := range filled.impls {
			for _, k := range filled.keys {
				im.add(k)
			}
		}
		// Check in an order unrelated to the order of insertion.
		r := rand.New(rand.NewPCG(3, 3))
		r.Shuffle(len(filled.keys), func(i, j int) { filled.keys[i], filled.keys[j] = filled.keys[j], filled.keys[i] })
	})
	return filled.impls, filled.keys, filled.fresh
}

var sink atomic.Int64

func BenchmarkCheck(b *testing.B) {
	impls, keys, fresh := filledImpls(b)
	for _, size := range []struct {
		name string
		n    int
	}{{"4K", 1 << 12}, {"64K", 1 << 16}, {"1M", benchCapacity}} {
		for _, kind := range []struct {
			name string
			keys []dedup.Key
			want bool
		}{{"hit", keys[:size.n], true}, {"miss", fresh[:size.n], false}} {
			for _, im := range impls {
				if im.name == "golang-lru-Contains" && !kind.want {
					continue // same as Get on a miss
				}
				ks := kind.keys
				mask := len(ks) - 1
				b.Run("keys="+size.name+"/"+kind.name+"/impl="+im.name, func(b *testing.B) {
					n := 0
					for i := 0; b.Loop(); i++ {
						if im.check(ks[i&mask]) {
							n++
						}
					}
					if kind.want && n != b.N || !kind.want && n != 0 {
						b.Fatalf("%d of %d checks found the key", n, b.N)
					}
				})
				b.Run("keys="+size.name+"/"+kind.name+"/impl="+im.name+"/parallel", func(b *testing.B) {
					var start atomic.Int64
					b.RunParallel(func(pb *testing.PB) {
						i := int(start.Add(7919))
						n := 0
						for pb.Next() {
							if im.check(ks[i&mask]) {
								n++
							}
							i++
						}
						sink.Add(int64(n))
					})
				})
			}
		}
	}
}

// BenchmarkCheckRedeliveredBatch is the case the window is for: a batch of
// 512 keys completes (Add, not timed) and comes back (Check, timed), in a
// full structure of 64K keys. The entries were just written, so they are
// in the caches; this shows the CPU cost of a hit.
func BenchmarkCheckRedeliveredBatch(b *testing.B) {
	const batch = 512
	stream := benchKeys(8, 1<<20)
	for _, im := range newImpls(b, 1<<16) {
		for _, k := range stream[:1<<16] {
			im.add(k)
		}
		next := 1 << 16
		b.Run("impl="+im.name, func(b *testing.B) {
			var ks []dedup.Key
			missing := 0
			for i := 0; b.Loop(); i++ {
				if i%batch == 0 {
					b.StopTimer()
					ks = stream[next%len(stream):][:batch]
					next += batch
					for _, k := range ks {
						im.add(k)
					}
					b.StartTimer()
				}
				if !im.check(ks[i%batch]) {
					missing++
				}
			}
			// otter's admission policy (W-TinyLFU) may refuse a new key.
			b.ReportMetric(100*float64(missing)/float64(b.N), "%missing")
			if im.name == "window" && missing > 0 {
				b.Fatalf("%d keys of batches just added are missing", missing)
			}
		})
	}
}

// BenchmarkAdd records always-new keys in a full structure of 64K keys, so
// that every Add evicts one.
func BenchmarkAdd(b *testing.B) {
	stream := benchKeys(4, 1<<20)
	mask := len(stream) - 1
	for _, im := range newImpls(b, 1<<16) {
		if im.name == "golang-lru-Contains" {
			continue
		}
		b.Run("impl="+im.name, func(b *testing.B) {
			for i := 0; b.Loop(); i++ {
				im.add(stream[i&mask])
			}
		})
	}
}

// BenchmarkMemoryPerKey reports the heap used per key held, with 1M keys
// in a structure of capacity 1M. The keys themselves are allocated before
// and not counted; golang-lru and otter keep them alive, the window keeps
// only a 128-bit hash of each.
func BenchmarkMemoryPerKey(b *testing.B) {
	keys := benchKeys(5, benchCapacity)
	for _, name := range []string{"window", "golang-lru-Get", "otter"} {
		b.Run("impl="+name, func(b *testing.B) {
			var perKey float64
			for b.Loop() {
				before := heapAlloc()
				var im impl
				for _, x := range newImpls(b, benchCapacity) {
					if x.name == name {
						im = x
					}
				}
				for _, k := range keys {
					im.add(k)
				}
				after := heapAlloc()
				perKey = float64(after-before) / float64(len(keys))
				if !im.check(keys[0]) {
					b.Fatal("first key not held")
				}
				runtime.KeepAlive(im)
			}
			b.ReportMetric(perKey, "bytes/key")
		})
	}
}

func heapAlloc() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// BenchmarkRedeliveryHitRatio measures the eviction policy, not speed: a
// stream of new messages of which 30% are redelivered later (the delay in
// messages is exponential with a mean of half the capacity), through
// structures of capacity 64K. It reports the share of redeliveries caught.
func BenchmarkRedeliveryHitRatio(b *testing.B) {
	const capacity, messages = 1 << 16, 1 << 20
	r := rand.New(rand.NewPCG(6, 6))
	// trace is the keys in the order delivered: each new key, and the
	// redeliveries due at that step.
	var trace []int
	pending := map[int][]int{}
	for i := range messages {
		trace = append(trace, i)
		if r.Float64() < 0.3 {
			at := i + 1 + int(r.ExpFloat64()*capacity/2)
			pending[at] = append(pending[at], i)
		}
		trace = append(trace, pending[i]...)
		delete(pending, i)
	}
	keys := benchKeys(7, messages)
	for _, name := range []string{"window", "golang-lru-Get", "otter"} {
		b.Run("impl="+name, func(b *testing.B) {
			var ratio float64
			for b.Loop() {
				var im impl
				for _, x := range newImpls(b, capacity) {
					if x.name == name {
						im = x
					}
				}
				seen := make([]bool, messages)
				redeliveries, caught := 0, 0
				for _, i := range trace {
					hit := im.check(keys[i])
					if seen[i] {
						redeliveries++
						if hit {
							caught++
						}
						continue
					}
					seen[i] = true
					im.add(keys[i])
				}
				ratio = float64(caught) / float64(redeliveries)
			}
			b.ReportMetric(100*ratio, "%caught")
		})
	}
}
