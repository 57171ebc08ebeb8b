package pgstore_test

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
)

// A new store does not yet know whether old records wait to be converted:
// its first claims queue the move of the key's old record before the
// claim, and the first answer tells every later claim there is none.
// While that flag flips (as it does under the first claims of a busy
// store), a claim must still read the statements it queued. A claim that
// checked the flag twice, queued no move on the second look and then read
// one, scanned the claim's row as the move's answer: it failed with
// "number of field descriptions must equal number of destinations" after
// taking the key, which then stayed claimed by nobody until its lease
// ended (CI at 60fe741, the layered conformance suite's 64 claims of one
// key).
func TestClaimWhileConversionFlagFlips(t *testing.T) {
	s := openStore(t)
	ctx := context.Background()
	var stop atomic.Bool
	var flips sync.WaitGroup
	flips.Go(func() {
		for v := false; !stop.Load(); v = !v {
			pgstore.SetConverted(s, v)
			runtime.Gosched()
		}
	})
	var wg sync.WaitGroup
	var failed atomic.Int64
	for w := range 4 {
		wg.Go(func() {
			for i := range 150 {
				key := dedup.Key{Scope: "flip", ID: fmt.Sprintf("w%d-%d", w, i)}
				c, err := s.Claim(ctx, key, "", time.Minute)
				if err != nil {
					if failed.Add(1) <= 3 {
						t.Errorf("claim %v: %v", key, err)
					}
					continue
				}
				if c.Outcome != dedup.Acquired {
					t.Errorf("claim %v of a new key: %+v, want acquired", key, c)
				}
			}
		})
	}
	wg.Wait()
	stop.Store(true)
	flips.Wait()
	if n := failed.Load(); n > 0 {
		t.Fatalf("%d of 600 claims of new keys failed while the conversion flag flipped", n)
	}
}
