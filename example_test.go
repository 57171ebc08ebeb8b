package dedup_test

import (
	"context"
	"fmt"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/memstore"
)

// A payment consumer applies each message once, however often the broker
// delivers it.
func ExampleRunner() {
	store, _ := memstore.New()
	defer store.Close()
	r, _ := dedup.NewRunner(store, dedup.WithLease(30*time.Second), dedup.WithRetention(24*time.Hour))

	charges := 0
	deliver := func(msgID, body string) {
		key, err := dedup.NewKey("payments/charge-consumer", msgID)
		if err != nil {
			fmt.Println("bad message id:", err)
			return
		}
		res, err := r.Do(context.Background(), key, dedup.FingerprintOf([]byte(body)), func(ctx context.Context) ([]byte, error) {
			charges++
			return []byte("receipt-" + msgID), nil
		})
		switch {
		case err != nil:
			fmt.Println("nack:", err)
		case res.Duplicate:
			fmt.Println("ack duplicate, replay", string(res.Result))
		default:
			fmt.Println("ack applied", string(res.Result))
		}
	}
	deliver("evt-1", `{"amount":100}`)
	deliver("evt-1", `{"amount":100}`) // redelivered
	deliver("evt-1", `{"amount":999}`) // same id, other payload
	deliver("", `{}`)
	fmt.Println("charges:", charges)
	// Output:
	// ack applied receipt-evt-1
	// ack duplicate, replay receipt-evt-1
	// nack: dedup: key reused with a different fingerprint
	// bad message id: dedup: invalid key id: is empty
	// charges: 1
}

// Two messages with different IDs that carry one intent collide on a
// business key.
func ExampleBusinessKey() {
	a, _ := dedup.BusinessKey("payments", "invoice", "inv-42", "capture")
	b, _ := dedup.BusinessKey("payments", "invoice", "inv-42", "capture")
	fmt.Println(a.ID, a == b)
	// Output: bk:invoice/inv-42/capture true
}

// The snippet of the package documentation, as a function: it compiles
// with the names the documentation uses.
func Example_packageDoc() {
	store, _ := memstore.New()
	defer store.Close()
	chargeCard := func(ctx context.Context, payload []byte) error { return nil }
	handle := func(ctx context.Context, msgID string, payload []byte) (string, error) {
		r, err := dedup.NewRunner(store, dedup.WithLease(30*time.Second), dedup.WithRetention(24*time.Hour))
		if err != nil {
			return "", err // a bad option: nothing ran
		}
		key, err := dedup.NewKey("payments/charge-consumer", msgID)
		if err != nil {
			return "", err // a bad message ID: dead-letter it, do not retry
		}
		res, err := r.Do(ctx, key, dedup.FingerprintOf(payload), func(ctx context.Context) ([]byte, error) {
			return nil, chargeCard(ctx, payload)
		})
		switch {
		case err == nil && res.Duplicate: // ack silently: it was applied before
			return "ack duplicate", nil
		case err == nil: // ack: applied now
			return "ack", nil
		default: // nack or retry later: nothing was recorded as done
			return "nack", err
		}
	}
	for range 2 {
		fmt.Println(handle(context.Background(), "evt-7", []byte(`{"amount":5}`)))
	}
	// Output:
	// ack <nil>
	// ack duplicate <nil>
}

// A caller that runs batch after batch copies what Finish returned and
// then releases the batch, so that the next batch is made in its memory
// instead of new slices. Release is deferred: after a Finish cut short by
// a panic it does nothing.
func ExamplePendingBatch_Release() {
	store, _ := memstore.New()
	defer store.Close()
	r, _ := dedup.NewRunner(store)
	ctx := context.Background()
	receipts := map[string]string{} // copied out of each batch's results
	runBatch := func(ids ...string) {
		reqs := make([]dedup.ClaimRequest, len(ids))
		for i, id := range ids {
			reqs[i].Key, _ = dedup.NewKey("payments", id)
		}
		pb := r.StartBatch(ctx, reqs, func(ctx context.Context, i int, c dedup.Claim) ([]byte, error) {
			return []byte("receipt-" + ids[i]), nil
		})
		defer pb.Release() // after this, res and errs belong to a later batch
		res, errs := pb.Finish()
		for i, id := range ids {
			if errs[i] == nil {
				receipts[id] = fmt.Sprint(string(res[i].Result), " duplicate=", res[i].Duplicate)
			}
		}
	}
	runBatch("evt-1", "evt-2")
	runBatch("evt-2", "evt-3") // made in the first batch's memory
	for _, id := range []string{"evt-1", "evt-2", "evt-3"} {
		fmt.Println(id, receipts[id])
	}
	// Output:
	// evt-1 receipt-evt-1 duplicate=false
	// evt-2 receipt-evt-2 duplicate=true
	// evt-3 receipt-evt-3 duplicate=false
}
