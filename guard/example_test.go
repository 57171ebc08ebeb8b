package guard_test

import (
	"fmt"

	"github.com/dedupkit/dedup/guard"
)

// A projection that applies every version in order parks what arrives
// ahead of a gap and re-drives it when the gap fills.
func Example() {
	parked, _ := guard.NewParked[string](100)
	var stored uint64 // the projection's version; 0 = nothing applied
	handle := func(version uint64, body string) {
		switch guard.Decide(stored, version, guard.GapPark) {
		case guard.ActionApply:
			stored = version
			fmt.Println("applied", body)
			for _, next := range parked.Ready("order-1", version) {
				stored++
				fmt.Println("applied parked", next)
			}
		case guard.ActionPark:
			_ = parked.Park("order-1", version, body)
			fmt.Println("parked", body)
		case guard.ActionSkip:
			fmt.Println("skipped", body, guard.CompareVersion(stored, version))
		}
	}
	handle(1, "v1")
	handle(3, "v3")
	handle(1, "v1 again")
	handle(2, "v2")
	handle(2, "v2 again")
	// Output:
	// applied v1
	// parked v3
	// skipped v1 again duplicate
	// applied v2
	// applied parked v3
	// skipped v2 again stale
}
