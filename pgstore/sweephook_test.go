package pgstore_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
)

// TestSweepJobHooks: every pass of a job reaches its hooks as a
// dedup.SweepEvent with the job's name, the rows the pass deleted and its
// duration, the same pass OnPass sees.
func TestSweepJobHooks(t *testing.T) {
	s := openStore(t)
	seed(t, s, "hooked-", 700, time.Minute)
	var mu sync.Mutex
	var events []dedup.SweepEvent
	var results []pgstore.SweepResult
	hook := dedup.HookFunc(func(_ context.Context, e any) {
		if ev, ok := e.(dedup.SweepEvent); ok {
			mu.Lock()
			events = append(events, ev)
			mu.Unlock()
		}
	})
	done := make(chan struct{})
	var once sync.Once
	j, err := s.StartSweeping(pgstore.SweepOptions{Interval: 5 * time.Millisecond, BatchSize: 300, Name: "pg-hooked",
		Hooks: []dedup.Hook{hook},
		OnPass: func(r pgstore.SweepResult, err error) {
			if err != nil {
				t.Errorf("sweep pass: %v", err)
			}
			mu.Lock()
			results = append(results, r)
			sum := 0
			for _, r := range results {
				sum += r.Deleted
			}
			mu.Unlock()
			if sum >= 700 {
				once.Do(func() { close(done) })
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	<-done
	if err := j.Close(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	// The hooks run after OnPass on the job's goroutine, which Close
	// waits for.
	if len(events) != len(results) {
		t.Fatalf("%d sweep events for %d passes", len(events), len(results))
	}
	var deleted int64
	for i, e := range events {
		r := results[i]
		if e.Store != "pg-hooked" || e.Deleted != int64(r.Deleted) || e.Batches != r.Batches || e.Duration != r.Elapsed || e.Err != nil {
			t.Errorf("event %d = %+v, pass %+v", i, e, r)
		}
		deleted += e.Deleted
	}
	if deleted != 700 {
		t.Errorf("events say %d deleted, want 700", deleted)
	}
	if len(events) == 0 || events[0].Deleted == 0 || events[0].Batches < 2 {
		t.Errorf("first event %+v: want the 700 rows in batches of 300", events)
	}
}
