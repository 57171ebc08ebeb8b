package memstore_test

import (
	"context"
	"fmt"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/memstore"
)

// Claim a key, apply the effect, complete it with a result; the
// redelivery is a duplicate that gets the stored result back.
func Example() {
	ctx := context.Background()
	store, err := memstore.New(memstore.WithCapacity(100_000))
	if err != nil {
		panic(err)
	}
	defer store.Close()

	key, _ := dedup.NewKey("payments", "msg-1")
	fp := dedup.FingerprintOf([]byte(`{"amount":100}`))
	for delivery := 1; delivery <= 2; delivery++ {
		c, err := store.Claim(ctx, key, fp, 30*time.Second)
		if err != nil {
			panic(err)
		}
		switch c.Outcome {
		case dedup.Acquired:
			// Apply the effect here, then record it.
			if err := store.Complete(ctx, c, []byte("pay_1"), 24*time.Hour); err != nil {
				panic(err)
			}
			fmt.Println("delivery", delivery, "applied")
		case dedup.Duplicate:
			fmt.Println("delivery", delivery, "duplicate of", string(c.Result))
		default:
			fmt.Println("delivery", delivery, c.Outcome)
		}
	}
	// Output:
	// delivery 1 applied
	// delivery 2 duplicate of pay_1
}
