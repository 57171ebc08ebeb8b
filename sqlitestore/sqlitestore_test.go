package sqlitestore_test

import (
	"path/filepath"
	"testing"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/dedupkit/dedup/storetest"
)

// TestConformance runs the shared claim contract suite on a fresh file per
// test.
func TestConformance(t *testing.T) {
	storetest.Run(t, func(t testing.TB, clock *storetest.Clock) dedup.Store {
		s, err := sqlitestore.Open(filepath.Join(t.TempDir(), "dedup.db"), sqlitestore.WithClock(clock))
		if err != nil {
			t.Fatalf("Open: %v", err)
		}
		t.Cleanup(func() { _ = s.Close() }) // a test may have closed it already
		return s
	}, storetest.Features{ManualClock: true, Extend: true, BatchClaim: true, Sweep: true})
}
