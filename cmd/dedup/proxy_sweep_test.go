package main

import (
	"context"
	"io"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/memstore"
)

// advClock is a dedup.Clock moved by hand.
type advClock struct{ ns atomic.Int64 }

func (c *advClock) Now() time.Time { return time.Unix(0, c.ns.Load()) }

// TestProxySweeperReportsPasses: the proxy's background sweeper deletes
// expired records and reports each pass to its hook (the /metrics sweep
// series), with the store's name and the rows the pass deleted.
func TestProxySweeperReportsPasses(t *testing.T) {
	clock := &advClock{}
	clock.ns.Store(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC).UnixNano())
	s, err := memstore.New(memstore.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	const n = 2500 // more than two sweep batches
	for i := range n {
		c, err := s.Claim(ctx, dedup.Key{Scope: "proxy", ID: "k" + strconv.Itoa(i)}, "", time.Minute)
		if err != nil || c.Outcome != dedup.Acquired {
			t.Fatalf("claim %d: %v %v", i, c.Outcome, err)
		}
		if err := s.Complete(ctx, c, nil, time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	clock.ns.Add(int64(2 * time.Hour)) // every record has expired

	var mu sync.Mutex
	var events []dedup.SweepEvent
	hook := dedup.HookFunc(func(_ context.Context, e any) {
		if ev, ok := e.(dedup.SweepEvent); ok {
			mu.Lock()
			events = append(events, ev)
			mu.Unlock()
		}
	})
	stop := startProxySweeper(s, time.Millisecond, slog.New(slog.NewTextHandler(io.Discard, nil)), "memory", hook)
	deadline := time.Now().Add(30 * time.Second)
	for {
		mu.Lock()
		var deleted int64
		for _, e := range events {
			deleted += e.Deleted
		}
		got := len(events)
		mu.Unlock()
		if deleted == n && got >= 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 30s: %d passes reported %d deleted, want %d", got, deleted, n)
		}
		time.Sleep(time.Millisecond)
	}
	stop()
	mu.Lock()
	defer mu.Unlock()
	first := events[0]
	if first.Store != "memory" || first.Deleted != n || first.Batches != 3 || first.Err != nil {
		t.Errorf("first pass %+v, want %d deleted by 3 batches on memory", first, n)
	}
	for _, e := range events[1:] {
		if e.Deleted != 0 || e.Batches != 1 || e.Err != nil {
			t.Errorf("a later pass %+v, want nothing left to delete", e)
		}
	}
}
