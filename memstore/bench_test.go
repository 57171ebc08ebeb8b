package memstore_test

import (
	"context"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/memstore"
)

// The ring benchmarks cycle through a fixed ring of keys whose records
// expire at once (retention 1ns), so every op is a full claim + complete
// on a fresh or expired record and the tables stop growing after the first
// lap: a working set larger than the CPU caches, as a real consumer's is.
const ring = 1 << 16

var benchKeys = func() []dedup.Key {
	ks := make([]dedup.Key, ring)
	for i := range ks {
		ks[i] = dedup.Key{Scope: "bench/consumer", ID: "msg-" + strconv.Itoa(i)}
	}
	return ks
}()

// freshKeys is a stream of distinct keys, each claimed once: a real
// consumer's stream. Built on first use (48 MB).
var freshKeys = sync.OnceValue(func() []dedup.Key {
	ks := make([]dedup.Key, 1<<20)
	for i := range ks {
		ks[i] = dedup.Key{Scope: "bench/consumer", ID: "evt-" + strconv.Itoa(i)}
	}
	return ks
})

// naive is the usual first attempt: a mutex map with check-then-set and no
// lease, token or fingerprint. It is here only as the baseline (the design
// the contract forbids: a failed first delivery is lost).
type naive struct {
	mu sync.Mutex
	m  map[dedup.Key]time.Time
}

func (n *naive) seen(k dedup.Key, ttl time.Duration) bool {
	now := time.Now()
	n.mu.Lock()
	defer n.mu.Unlock()
	if exp, ok := n.m[k]; ok && now.Before(exp) {
		return true
	}
	n.m[k] = now.Add(ttl)
	return false
}

// benchRounds is how many times BenchmarkClaimComplete runs all its cases
// in turn in one process, so that the machine's load drifts over every
// case alike (run it with -count=1; a repeated name gets a #01 suffix).
const benchRounds = 3

// BenchmarkClaimComplete: the naive map beside memstore, rotated.
//
//   - ring: keys of the ring, one goroutine (naive: one check-then-set;
//     memstore: Claim and Complete);
//   - ring-parallel: the same under RunParallel;
//   - duplicate: Claim of a completed key (memstore only);
//   - fresh: 1M distinct keys each claimed once, into a store whose
//     capacity (one ring) makes new keys replace expired records, and the
//     naive map fed the same keys (it grows without bound).
func BenchmarkClaimComplete(b *testing.B) {
	ctx := context.Background()
	for range benchRounds {
		b.Run("ring/naive-mutex-map", func(b *testing.B) {
			n := &naive{m: map[dedup.Key]time.Time{}}
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				n.seen(benchKeys[i&(ring-1)], time.Nanosecond)
				i++
			}
		})
		b.Run("ring/memstore", func(b *testing.B) {
			s, _ := memstore.New()
			defer s.Close()
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				c, err := s.Claim(ctx, benchKeys[i&(ring-1)], "", time.Minute)
				if err != nil || c.Outcome != dedup.Acquired {
					b.Fatal(c.Outcome, err)
				}
				if err := s.Complete(ctx, c, nil, time.Nanosecond); err != nil {
					b.Fatal(err)
				}
				i++
			}
		})
		b.Run("ring-parallel/naive-mutex-map", func(b *testing.B) {
			n := &naive{m: map[dedup.Key]time.Time{}}
			var next atomic.Uint64
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					n.seen(benchKeys[next.Add(1)&(ring-1)], time.Nanosecond)
				}
			})
		})
		b.Run("ring-parallel/memstore", func(b *testing.B) {
			s, _ := memstore.New()
			defer s.Close()
			var next atomic.Uint64
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					c, err := s.Claim(ctx, benchKeys[next.Add(1)&(ring-1)], "", time.Minute)
					if err != nil {
						b.Error(err)
						return
					}
					if c.Outcome != dedup.Acquired { // another goroutine holds this ring slot
						continue
					}
					if err := s.Complete(ctx, c, nil, time.Nanosecond); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
		b.Run("duplicate/memstore", func(b *testing.B) {
			s, _ := memstore.New()
			defer s.Close()
			for _, k := range benchKeys {
				c, _ := s.Claim(ctx, k, "", time.Minute)
				_ = s.Complete(ctx, c, nil, time.Hour)
			}
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				if c, _ := s.Claim(ctx, benchKeys[i&(ring-1)], "", time.Minute); c.Outcome != dedup.Duplicate {
					b.Fatal(c.Outcome)
				}
				i++
			}
		})
		keys := freshKeys()
		b.Run("fresh/naive-mutex-map", func(b *testing.B) {
			n := &naive{m: map[dedup.Key]time.Time{}}
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				if i == len(keys) {
					i, n.m = 0, map[dedup.Key]time.Time{}
				}
				n.seen(keys[i], time.Hour)
				i++
			}
		})
		b.Run("fresh/memstore", func(b *testing.B) {
			s, _ := memstore.New(memstore.WithCapacity(ring))
			defer s.Close()
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				if i == len(keys) {
					i = 0
					b.StopTimer()
					s.Close()
					s, _ = memstore.New(memstore.WithCapacity(ring))
					b.StartTimer()
				}
				c, err := s.Claim(ctx, keys[i], "", time.Minute)
				if err != nil || c.Outcome != dedup.Acquired {
					b.Fatal(c.Outcome, err)
				}
				if err := s.Complete(ctx, c, nil, time.Nanosecond); err != nil {
					b.Fatal(err)
				}
				i++
			}
		})
	}
}

// BenchmarkHeld measures the heap a completed key holds at steady state:
// 200,000 keys claimed and completed (retention an hour, the SHA-256
// fingerprint of a payload each, made as the claim is, no result), then
// the heap after two GCs, against the same keys in a map[Key]time.Time
// (the naive store) and in a map[string]time.Time keyed by the ID alone
// (Watermill's in-memory Deduplicator repository). held-B/key excludes the
// key strings, which every design keeps (they are allocated before the
// first measurement). Run with -benchtime 1x.
func BenchmarkHeld(b *testing.B) {
	const n = 200_000
	ctx := context.Background()
	keys := make([]dedup.Key, n)
	for i := range keys {
		keys[i] = dedup.Key{Scope: "held", ID: "01JDG5" + strconv.Itoa(1e9+i)}
	}
	for range benchRounds {
		b.Run("naive-map-key", func(b *testing.B) {
			held(b, n, func() any {
				m := map[dedup.Key]time.Time{}
				for _, k := range keys {
					m[k] = time.Now().Add(time.Hour)
				}
				return m
			})
		})
		b.Run("watermill-map-id", func(b *testing.B) {
			held(b, n, func() any {
				m := map[string]time.Time{}
				for _, k := range keys {
					m[k.ID] = time.Now().Add(time.Hour)
				}
				return m
			})
		})
		b.Run("memstore", func(b *testing.B) {
			held(b, n, func() any {
				s, _ := memstore.New()
				for _, k := range keys {
					c, err := s.Claim(ctx, k, dedup.FingerprintOf([]byte(k.ID)), time.Minute)
					if err != nil {
						b.Fatal(err)
					}
					if err := s.Complete(ctx, c, nil, time.Hour); err != nil {
						b.Fatal(err)
					}
				}
				return s
			})
		})
	}
}

// held reports the heap that build's result holds per key, after GC.
func held(b *testing.B, n int, build func() any) {
	for b.Loop() {
		before := heapAfterGC()
		v := build()
		after := heapAfterGC()
		runtime.KeepAlive(v)
		b.ReportMetric(float64(after-before)/float64(n), "held-B/key")
	}
}

func heapAfterGC() uint64 {
	var ms runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}
