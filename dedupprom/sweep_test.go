package dedupprom_test

import (
	"context"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/dedupkit/dedup/storetest"
)

// TestSweepHook: a SQLite store's background sweeper deletes 7 expired
// records; its events reach the metrics as sweep_rows_deleted_total and
// one sweep_pass_duration_seconds observation per pass.
func TestSweepHook(t *testing.T) {
	m, reg := newMetrics(t)
	clock := storetest.NewClock()
	var mu sync.Mutex
	var deleted int64
	passes := 0
	swept := make(chan struct{})
	var once sync.Once
	count := dedup.HookFunc(func(_ context.Context, e any) {
		if ev, ok := e.(dedup.SweepEvent); ok {
			mu.Lock()
			deleted += ev.Deleted
			passes++
			if deleted >= 7 {
				once.Do(func() { close(swept) })
			}
			mu.Unlock()
		}
	})
	s, err := sqlitestore.Open(filepath.Join(t.TempDir(), "sweep.db"), sqlitestore.WithClock(clock),
		sqlitestore.WithSweepInterval(2*time.Millisecond), sqlitestore.WithSweepHooks(m, count))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, id := range []string{"a", "b", "c", "d", "e", "f", "g"} {
		c, err := s.Claim(ctx, dedup.Key{Scope: "sweep", ID: id}, "", time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Complete(ctx, c, nil, time.Second); err != nil {
			t.Fatal(err)
		}
	}
	clock.Advance(time.Hour)
	<-swept
	if err := s.Close(); err != nil { // stops the sweeper: no event after this
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if deleted != 7 {
		t.Errorf("the events say %d deleted, want 7", deleted)
	}
	body := scrape(t, reg)
	hasLine(t, body, `dedup_sweep_rows_deleted_total{store="sqlite"} 7`)
	hasLine(t, body, `dedup_sweep_pass_duration_seconds_count{result="ok",store="sqlite"} `+strconv.Itoa(passes))
	if err := lint(reg); err != nil {
		t.Error(err)
	}
}
