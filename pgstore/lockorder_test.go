package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5/pgconn"
)

// lockOrderRound claims n keys one at a time in reverse key order (so the
// heap holds them against key order, as a fresh table's sequential scan
// will visit them), then races one CompleteBatch of those claims against
// three ClaimBatch calls of the same keys. A statement that locked rows in
// plan order instead of key order deadlocks here within a few rounds
// (SQLSTATE 40P01). It returns the number of deadlocks seen.
func lockOrderRound(t *testing.T, s *pgstore.Store, round, n int) (deadlocks int) {
	t.Helper()
	ctx := context.Background()
	reqs := make([]dedup.ClaimRequest, n)
	for i := range reqs {
		reqs[i] = dedup.ClaimRequest{Key: key(fmt.Sprintf("r%04d-k%03d", round, i))}
	}
	items := make([]dedup.Completion, n)
	for j := n - 1; j >= 0; j-- {
		c, err := s.Claim(ctx, reqs[j].Key, "", time.Minute)
		if err != nil || c.Outcome != dedup.Acquired {
			t.Fatalf("round %d: Claim(%v) = %v, %v", round, reqs[j].Key, c.Outcome, err)
		}
		items[j] = dedup.Completion{Claim: c, Result: []byte("r")}
	}
	var (
		wg sync.WaitGroup
		mu sync.Mutex
	)
	note := func(what string, err error) {
		var pe *pgconn.PgError
		mu.Lock()
		defer mu.Unlock()
		if errors.As(err, &pe) && pe.Code == "40P01" {
			deadlocks++
			return
		}
		t.Errorf("round %d: %s: %v", round, what, err)
	}
	start := make(chan struct{})
	wg.Go(func() {
		<-start
		errs, err := s.CompleteBatch(ctx, items, time.Hour)
		if err != nil {
			note("CompleteBatch", err)
			return
		}
		for i, err := range errs {
			if err != nil {
				t.Errorf("round %d: item %d: %v", round, i, err)
			}
		}
	})
	for range 3 {
		wg.Go(func() {
			<-start
			if _, err := s.ClaimBatch(ctx, reqs, time.Minute); err != nil {
				note("ClaimBatch", err)
			}
		})
	}
	close(start)
	wg.Wait()
	return deadlocks
}

// TestBatchLockOrderFreshTables is issue 12's reproduction: batch claims
// and batch completions of the same keys on tables with no statistics
// (every new deployment, every new daily partition) must not deadlock
// each other, on either layout, in 200 rounds. The table is emptied
// between rounds, which also forgets its size (TRUNCATE resets relpages
// and reltuples, as on a table never vacuumed or analyzed).
func TestBatchLockOrderFreshTables(t *testing.T) {
	if testing.Short() {
		t.Skip("200 rounds per layout")
	}
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		total := 0
		for round := range 200 {
			if _, err := s.Pool().Exec(context.Background(), `TRUNCATE `+records(s)); err != nil {
				t.Fatal(err)
			}
			total += lockOrderRound(t, s, round, 40)
			if t.Failed() {
				return
			}
		}
		if total > 0 {
			t.Fatalf("%d deadlocks in 200 rounds; batches must lock rows in key order whatever the plan", total)
		}
	})
}

// TestBatchLockOrderLargeTable runs the same race on a table with 50,000
// analyzed rows, where the planner picks index scans instead.
func TestBatchLockOrderLargeTable(t *testing.T) {
	if testing.Short() {
		t.Skip("loads 50,000 rows per layout")
	}
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		ctx := context.Background()
		bulk := make([]dedup.ClaimRequest, 1000)
		for b := range 50 {
			for i := range bulk {
				bulk[i] = dedup.ClaimRequest{Key: key(fmt.Sprintf("bulk-%02d-%04d", b, i))}
			}
			if _, err := s.ClaimBatch(ctx, bulk, time.Hour); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := s.Pool().Exec(ctx, `ANALYZE `+records(s)); err != nil {
			t.Fatal(err)
		}
		total := 0
		for round := range 40 {
			total += lockOrderRound(t, s, round, 40)
		}
		if total > 0 {
			t.Fatalf("%d deadlocks in 40 rounds on a large table", total)
		}
	})
}
