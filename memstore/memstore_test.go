package memstore_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/storetest"
)

func newStore(t testing.TB, clock *storetest.Clock) dedup.Store {
	s, err := memstore.New(memstore.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func TestConformance(t *testing.T) {
	storetest.Run(t, newStore, storetest.Features{ManualClock: true, Extend: true, BatchClaim: true, BatchComplete: true, Sweep: true})
}

func TestBadOptions(t *testing.T) {
	for name, opts := range map[string][]memstore.Option{
		"nil clock":         {memstore.WithClock(nil)},
		"zero shards":       {memstore.WithShards(0)},
		"capacity < shards": {memstore.WithCapacity(3), memstore.WithShards(4)},
	} {
		if _, err := memstore.New(opts...); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("%s: error %v, want ErrInvalidArgument", name, err)
		}
	}
}

func fill(t *testing.T, s *memstore.Store, n int, ret time.Duration) {
	t.Helper()
	ctx := context.Background()
	for i := range n {
		c, err := s.Claim(ctx, dedup.Key{Scope: "s", ID: fmt.Sprint(i)}, "", time.Minute)
		if err != nil || c.Outcome != dedup.Acquired {
			t.Fatalf("claim %d: %v %v", i, c.Outcome, err)
		}
		if err := s.Complete(ctx, c, nil, ret); err != nil {
			t.Fatal(err)
		}
	}
}

// TestCapacityEvictsExpiredFirst: a full store drops expired records
// before it evicts any live one.
func TestCapacityEvictsExpiredFirst(t *testing.T) {
	clock := storetest.NewClock()
	s, _ := memstore.New(memstore.WithClock(clock), memstore.WithCapacity(8), memstore.WithShards(1))
	fill(t, s, 8, time.Second)
	clock.Advance(2 * time.Second)
	fill(t, s, 8, time.Hour) // reuses the expired slots: nothing live is evicted
	if st := s.Stats(); st.Evicted != 0 || st.Records > 8 {
		t.Fatalf("stats %+v: want no live eviction and at most 8 records", st)
	}
}

// TestCapacityEvictsLiveWhenFull: past capacity with nothing expired, the
// default evicts a live completed record and counts it; strict mode fails
// closed instead. In-progress records are never evicted.
func TestCapacityEvictsLiveWhenFull(t *testing.T) {
	ctx := context.Background()
	s, _ := memstore.New(memstore.WithCapacity(4), memstore.WithShards(1))
	fill(t, s, 5, time.Hour)
	if st := s.Stats(); st.Evicted != 1 || st.Records != 4 {
		t.Fatalf("stats %+v: want 1 eviction, 4 records", st)
	}

	strict, _ := memstore.New(memstore.WithCapacity(4), memstore.WithShards(1), memstore.WithStrictCapacity())
	fill(t, strict, 4, time.Hour)
	_, err := strict.Claim(ctx, dedup.Key{Scope: "s", ID: "overflow"}, "", time.Minute)
	if !errors.Is(err, dedup.ErrFull) || !dedup.IsStoreError(err) {
		t.Fatalf("strict full store: %v, want a store error wrapping ErrFull", err)
	}

	busy, _ := memstore.New(memstore.WithCapacity(2), memstore.WithShards(1))
	for i := range 2 {
		if _, err := busy.Claim(ctx, dedup.Key{Scope: "s", ID: fmt.Sprint(i)}, "", time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := busy.Claim(ctx, dedup.Key{Scope: "s", ID: "x"}, "", time.Hour); !errors.Is(err, dedup.ErrFull) {
		t.Fatalf("store full of in-progress records: %v, want ErrFull (never evict a lease)", err)
	}
	for i := range 2 {
		c, _ := busy.Claim(ctx, dedup.Key{Scope: "s", ID: fmt.Sprint(i)}, "", time.Hour)
		if c.Outcome != dedup.InProgress {
			t.Fatalf("in-progress record %d was evicted: %v", i, c.Outcome)
		}
	}
}
