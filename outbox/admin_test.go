package outbox_test

import (
	"context"
	"errors"
	"testing"

	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
)

// The operator's view: status counts the backlog, the quarantine, the
// leases and a long-open transaction; list shows the poison row; drop
// with a dry run keeps it; retry puts it back in line and its key flows.
func TestOperatorStatusListRetryDrop(t *testing.T) {
	t.Parallel()
	r := newRig(t, pgstore.WithOutboxPartitions(4))
	ctx := context.Background()
	r.write(msg("poison", "p"), msg("behind", "p"), msg("other", "o"), msg("doomed", "d"))
	pub := newFakePub()
	pub.mu.Lock()
	pub.permanent["poison"], pub.permanent["doomed"] = true, true
	pub.mu.Unlock()
	rl, _ := r.run(pub, outbox.WithRelayID("ops"))
	eventually(t, "poison rows quarantined, the other key published", func() bool {
		return r.count(`quarantined_at IS NOT NULL`) == 2 && r.count(`published_at IS NOT NULL`) == 1
	})
	eventually(t, "the relay holds its partitions", func() bool { return rl.Stats().Partitions == 4 })
	open, err := r.s.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer open.Rollback(ctx)
	if err := r.s.WriteOutbox(ctx, open, msg("pending", "x")); err != nil {
		t.Fatal(err)
	}
	st, err := r.s.OutboxStatus(ctx, 4)
	if err != nil {
		t.Fatal(err)
	}
	owned := 0
	for _, p := range st.Partitions {
		if p.Owner == "ops" && p.Epoch > 0 && p.LeaseLeft > 0 {
			owned++
		}
	}
	if st.Backlog != 1 || st.Quarantined != 2 || st.Published != 1 || owned != 4 || len(st.Relays) != 1 || !st.Relays[0].Alive || st.OldestTransaction <= 0 {
		t.Fatalf("status %+v", st)
	}
	rows, err := r.s.OutboxList(ctx, true, 10)
	if err != nil || len(rows) != 2 || rows[0].ID != "poison" || rows[0].LastError == "" || rows[0].Attempts != 1 {
		t.Fatalf("list = %+v, %v", rows, err)
	}
	if _, err := r.s.OutboxDrop(ctx, "doomed", true); err != nil || r.count(`message_key = 'doomed'`) != 1 {
		t.Fatalf("dry-run drop: %v", err)
	}
	if _, err := r.s.OutboxDrop(ctx, "doomed", false); err != nil || r.count(`message_key = 'doomed'`) != 0 {
		t.Fatalf("drop: %v", err)
	}
	if _, err := r.s.OutboxDrop(ctx, "behind", false); !errors.Is(err, pgstore.ErrOutboxRowNotFound) {
		t.Fatalf("dropping a row in line: %v, want ErrOutboxRowNotFound", err)
	}
	pub.mu.Lock()
	delete(pub.permanent, "poison")
	pub.mu.Unlock()
	if _, err := r.s.OutboxRetry(ctx, "poison"); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the retried row and the one behind it published", func() bool {
		p := pub.published()
		return p["poison"] == 1 && p["behind"] == 1
	})
	if pub.firstOrder()["p"][0] != "poison" {
		t.Fatalf("order of key p: %v", pub.firstOrder()["p"])
	}
}
