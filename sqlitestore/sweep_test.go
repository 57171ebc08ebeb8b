package sqlitestore_test

import (
	"context"
	"errors"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/dedupkit/dedup/storetest"
)

func countRows(t *testing.T, s *sqlitestore.Store) int {
	t.Helper()
	var n int
	if err := s.DB().QueryRow(`SELECT count(*) FROM dedup_records`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// fill completes n keys with retention and holds one in progress.
func fill(t *testing.T, s *sqlitestore.Store, prefix string, n int, retention time.Duration) {
	t.Helper()
	for i := range n {
		c := mustClaim(t, s, prefix+strconv.Itoa(i), fpA, time.Minute, dedup.Acquired)
		if err := s.Complete(context.Background(), c, []byte("r"), retention); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSweepExpiredRemovesExpiredRows: the library call deletes every
// expired row in batches and keeps live ones.
func TestSweepExpiredRemovesExpiredRows(t *testing.T) {
	clock := storetest.NewClock()
	s, err := sqlitestore.Open(filepath.Join(t.TempDir(), "sweep.db"), sqlitestore.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	fill(t, s, "old-", 250, time.Hour)
	fill(t, s, "live-", 10, 48*time.Hour)
	held := mustClaim(t, s, "held", fpA, 72*time.Hour, dedup.Acquired)
	clock.Advance(2 * time.Hour)
	n, err := s.SweepExpired(context.Background(), 100, 0)
	if err != nil || n != 250 {
		t.Fatalf("SweepExpired = %d, %v; want 250", n, err)
	}
	if rows := countRows(t, s); rows != 11 {
		t.Fatalf("%d rows left, want 11 (10 live, 1 held)", rows)
	}
	mustClaim(t, s, "live-3", fpA, time.Minute, dedup.Duplicate)
	mustClaim(t, s, "old-3", fpA, time.Minute, dedup.Acquired)
	if err := s.Complete(context.Background(), held, nil, time.Hour); err != nil {
		t.Fatalf("the held claim was swept: %v", err)
	}
	if _, err := s.SweepExpired(context.Background(), 0, 0); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("batch 0: %v", err)
	}
}

// TestBackgroundSweeper: WithSweepInterval deletes expired rows without
// being asked, and Close stops it.
func TestBackgroundSweeper(t *testing.T) {
	clock := storetest.NewClock()
	s, err := sqlitestore.Open(filepath.Join(t.TempDir(), "bg.db"), sqlitestore.WithClock(clock), sqlitestore.WithSweepInterval(5*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	fill(t, s, "old-", 30, time.Hour)
	clock.Advance(2 * time.Hour)
	for range 2000 {
		if d, _ := s.SweepStats(); d == 30 {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if d, err := s.SweepStats(); d != 30 || err != nil {
		t.Fatalf("background sweeper deleted %d (%v), want 30", d, err)
	}
	if rows := countRows(t, s); rows != 0 {
		t.Fatalf("%d rows left", rows)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := sqlitestore.Open(filepath.Join(t.TempDir(), "x.db"), sqlitestore.WithSweepInterval(-time.Second)); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("negative interval: %v", err)
	}
}
