package layered_test

import (
	"context"
	"fmt"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/layered"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/window"
)

// An in-process window in front of a durable store: the durable store
// decides every new key, and a redelivery of a key just completed is
// answered by the window without a round trip. (memstore stands in for
// the durable store here; in production it is sqlitestore or pgstore,
// with redisstore as WithFast between them.)
func Example() {
	ctx := context.Background()
	durable, _ := memstore.New()
	defer durable.Close()
	w, err := window.New(window.WithCapacity(10_000))
	if err != nil {
		panic(err)
	}
	store, err := layered.New(layered.WithWindow(w), layered.WithDurable(durable, "memory"))
	if err != nil {
		panic(err)
	}
	defer store.Close()

	key, _ := dedup.NewKey("orders", "evt-9")
	fp := dedup.FingerprintOf([]byte("ship order 9"))
	for delivery := 1; delivery <= 3; delivery++ {
		c, err := store.Claim(ctx, key, fp, 30*time.Second)
		if err != nil {
			panic(err)
		}
		if c.Outcome == dedup.Acquired {
			if err := store.Complete(ctx, c, []byte("shipped"), time.Hour); err != nil {
				panic(err)
			}
		}
		fmt.Println("delivery", delivery, c.Outcome)
	}
	st := store.Stats()
	fmt.Println("duplicates stopped by the window:", st.Window, "by the durable store:", st.Durable)
	// Output:
	// delivery 1 acquired
	// delivery 2 duplicate
	// delivery 3 duplicate
	// duplicates stopped by the window: 2 by the durable store: 0
}
