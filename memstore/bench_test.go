package memstore_test

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/memstore"
)

// The benchmarks cycle through a fixed ring of keys whose records expire
// at once (retention 1ns), so every op is a full claim + complete on a
// fresh or expired record and the maps stop growing after the first lap.
const ring = 1 << 16

var benchKeys = func() []dedup.Key {
	ks := make([]dedup.Key, ring)
	for i := range ks {
		ks[i] = dedup.Key{Scope: "bench/consumer", ID: "msg-" + strconv.Itoa(i)}
	}
	return ks
}()

// naive is the usual first attempt: a mutex map with check-then-set and no
// lease, token or fingerprint. It is here only as the baseline.
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

func BenchmarkClaimComplete(b *testing.B) {
	ctx := context.Background()
	b.Run("naive-mutex-map", func(b *testing.B) {
		n := &naive{m: map[dedup.Key]time.Time{}}
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			n.seen(benchKeys[i&(ring-1)], time.Nanosecond)
			i++
		}
	})
	b.Run("memstore", func(b *testing.B) {
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
	b.Run("naive-mutex-map-parallel", func(b *testing.B) {
		n := &naive{m: map[dedup.Key]time.Time{}}
		var next atomic.Uint64
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				n.seen(benchKeys[next.Add(1)&(ring-1)], time.Nanosecond)
			}
		})
	})
	b.Run("memstore-parallel", func(b *testing.B) {
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
	b.Run("memstore-duplicate-hit", func(b *testing.B) {
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
}
