package outbox_test

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
)

// Under Block, with the partition index, two relays sharing 4 partitions
// (read ahead and pipelined marks: each holds fewer than 4), small full
// batches and quarantines that appear and are then dropped or retried by
// the operator while the relays run: every message not dropped is
// published, each key's messages are first published in write order, and
// no row stays unpublished.
func TestRelayBlockQuarantineDroppedAndRetried(t *testing.T) {
	t.Parallel()
	for _, del := range []bool{false, true} {
		t.Run(fmt.Sprint("delete=", del), func(t *testing.T) {
			t.Parallel()
			opts := []pgstore.OutboxOption{pgstore.WithOutboxPartitions(4)}
			if del {
				opts = append(opts, pgstore.WithOutboxDeletePublished())
			}
			r := newRig(t, opts...)
			if err := r.src.CreateIndex(context.Background()); err != nil {
				t.Fatal(err)
			}
			pub := newFakePub()
			const keys, per = 20, 30
			pub.permanent["k3-5"] = true
			pub.permanent["k11-2"] = true
			pub.permanent["k17-20"] = true
			var all []outbox.Message
			for i := range per {
				for k := range keys {
					all = append(all, msg(fmt.Sprintf("k%d-%d", k, i), fmt.Sprintf("k%d", k)))
				}
			}
			r.write(all[:len(all)/2]...)
			ropts := []outbox.Option{outbox.WithPoisonPolicy(outbox.Block), outbox.WithBatchSize(7), outbox.WithMaxAttempts(2)}
			r.run(pub, append(ropts, outbox.WithRelayID("a"))...)
			r.run(pub, append(ropts, outbox.WithRelayID("b"))...)
			r.write(all[len(all)/2:]...)
			eventually(t, "three rows quarantined", func() bool { return r.count(`quarantined_at IS NOT NULL AND published_at IS NULL`) == 3 })
			// Everything but the blocked keys' tails.
			blocked := (per - 5) + (per - 2) + (per - 20)
			eventually(t, "the other rows published", func() bool { return r.count(`published_at IS NULL`) == blocked })
			p := pub.published()
			for _, id := range []string{"k3-6", "k11-3", "k17-21"} {
				if p[id] != 0 {
					t.Fatalf("%s published behind its quarantined row", id)
				}
			}
			ctx := context.Background()
			if _, err := r.s.OutboxDrop(ctx, "k3-5", false); err != nil {
				t.Fatal(err)
			}
			pub.mu.Lock()
			delete(pub.permanent, "k11-2")
			pub.mu.Unlock()
			if _, err := r.s.OutboxRetry(ctx, "k11-2"); err != nil {
				t.Fatal(err)
			}
			eventually(t, "all but k17's tail published", func() bool { return r.count(`published_at IS NULL`) == per-20 })
			pub.mu.Lock()
			delete(pub.permanent, "k17-20")
			pub.mu.Unlock()
			if _, err := r.s.OutboxRetry(ctx, "k17-20"); err != nil {
				t.Fatal(err)
			}
			eventually(t, "everything published", func() bool { return r.count(`published_at IS NULL`) == 0 })
			first := pub.firstOrder()
			p = pub.published()
			for k := range keys {
				var want []string
				for i := range per {
					id := fmt.Sprintf("k%d-%d", k, i)
					if id != "k3-5" {
						want = append(want, id)
					}
					if p[id] == 0 && id != "k3-5" {
						t.Errorf("%s never published", id)
					}
				}
				if got := first[fmt.Sprintf("k%d", k)]; !slices.Equal(got, want) {
					t.Errorf("key k%d first published in order %v, want %v", k, got, want)
				}
			}
		})
	}
}
