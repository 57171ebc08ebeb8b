// Package storetest is the conformance suite of the [dedup.Store]
// contract. Every store runs it against a real engine (the package
// Example, compiled by go test, is this test for the in-memory store):
//
//	func TestConformance(t *testing.T) {
//		storetest.Run(t, func(t testing.TB, clock *storetest.Clock) dedup.Store {
//			s, err := memstore.New(memstore.WithClock(clock))
//			if err != nil {
//				t.Fatal(err)
//			}
//			t.Cleanup(func() { s.Close() })
//			return s
//		}, storetest.Features{ManualClock: true, Extend: true, BatchClaim: true, BatchComplete: true, Sweep: true})
//	}
//
// Each test in [Tests] checks one row of the claim state table or one
// shared error rule, runs in parallel with the others, gets a store of its
// own from the factory and a key scope of its own, and asserts the
// property it is named for. A capability the store lacks is skipped by
// name, never silently passed. Stores that keep time themselves take the
// manual [Clock] and the suite moves it; stores on a server's clock are
// tested with short real leases and sleeps.
package storetest
