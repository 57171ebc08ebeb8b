package storetest_test

import (
	"testing"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/storetest"
)

// A store's conformance test, as it appears in the store's own _test.go
// file (here for the in-memory store): the factory opens a fresh store for
// each test on the suite's manual clock and closes it in t.Cleanup, and
// Features names the optional interfaces the store implements, so a
// missing capability is skipped by name instead of silently passed.
//
// The test needs a *testing.T, so this example compiles but does not run;
// `go test ./memstore/` runs the real one.
func Example() {
	testConformance := func(t *testing.T) { // func TestConformance(t *testing.T) in your package
		storetest.Run(t, func(t testing.TB, clock *storetest.Clock) dedup.Store {
			s, err := memstore.New(memstore.WithClock(clock))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			return s
		}, storetest.Features{ManualClock: true, Extend: true, BatchClaim: true, BatchComplete: true, Sweep: true})
	}
	_ = testConformance
}
