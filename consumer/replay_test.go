package consumer_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
)

// TestReplayAppliesExactlyWhatNeverCompleted dead-letters three messages,
// completes one of them by another route, and replays: the dry run changes
// nothing; the replay applies the two that never completed, under their
// original IDs, and skips the completed one.
func TestReplayAppliesExactlyWhatNeverCompleted(t *testing.T) {
	f := newFixture(t)
	var fx effects
	var broken atomic.Bool
	broken.Store(true)
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if broken.Load() {
			return nil, consumer.Permanent(errors.New("bad deploy"))
		}
		fx.add(m.ID)
		return nil, nil
	}, consumer.WithLimits(consumer.Limits{Permanent: 1}))
	ctx := context.Background()
	for _, id := range []string{"r1", "r2", "r3"} {
		want(t, p.Process(ctx, msg(id)), consumer.DeadLettered)
	}
	broken.Store(false)
	// r2 is redelivered by the broker and applied before the replay.
	want(t, p.Process(ctx, msg("r2")), consumer.Ack)

	dry, err := consumer.Replay(ctx, f.dlq, nil, consumer.ReplayOptions{DryRun: true, Store: f.store})
	if err != nil {
		t.Fatal(err)
	}
	if dry.WouldReplay != 2 || dry.AlreadyCompleted != 1 || f.dlq.Len() != 3 || fx.get("r1") != 0 {
		t.Fatalf("dry run %+v, %d records left, r1 applied %d times; want 2 to replay, 1 completed, nothing changed", dry, f.dlq.Len(), fx.get("r1"))
	}
	// The dry run's probe must not leave the keys held.
	c, err := f.store.Claim(ctx, dedup.Key{Scope: "orders", ID: "r1"}, "", 1)
	if err != nil || c.Outcome != dedup.Acquired {
		t.Fatalf("after the dry run r1 is %v (%v)", c.Outcome, err)
	}
	_ = f.store.Release(ctx, c)

	var progress int
	rep, err := consumer.Replay(ctx, f.dlq, consumer.ToProcessor(p), consumer.ReplayOptions{Store: f.store, Rate: -1,
		Progress: func(consumer.ReplayItem) { progress++ }})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Replayed != 2 || rep.AlreadyCompleted != 1 || rep.Failed != 0 || progress != 3 {
		t.Fatalf("replay %+v (progress %d)", rep, progress)
	}
	for _, id := range []string{"r1", "r2", "r3"} {
		if n := fx.get(id); n != 1 {
			t.Fatalf("%s applied %d times, want 1", id, n)
		}
	}
	if f.dlq.Len() != 0 {
		t.Fatalf("%d records left after a full replay", f.dlq.Len())
	}
}

func TestReplayFailureKeepsTheRecord(t *testing.T) {
	f := newFixture(t)
	_ = f.dlq.DeadLetter(context.Background(), consumer.DeadLetter{Consumer: "orders", Key: dedup.Key{Scope: "orders", ID: "k"}, Message: *msg("k")})
	rep, err := consumer.Replay(context.Background(), f.dlq, consumer.RepublishFunc(func(ctx context.Context, m *consumer.Message) error {
		return errors.New("broker down")
	}), consumer.ReplayOptions{Rate: -1})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Failed != 1 || f.dlq.Len() != 1 {
		t.Fatalf("report %+v, %d records; want the failure reported and the record kept", rep, f.dlq.Len())
	}
}

func TestReplaySelectsByIDAndLimit(t *testing.T) {
	f := newFixture(t)
	for _, id := range []string{"a", "b", "c", "d"} {
		_ = f.dlq.DeadLetter(context.Background(), consumer.DeadLetter{Key: dedup.Key{Scope: "s", ID: id}, Message: *msg(id)})
	}
	var sent []string
	pub := consumer.RepublishFunc(func(ctx context.Context, m *consumer.Message) error {
		sent = append(sent, m.ID)
		return nil
	})
	if _, err := consumer.Replay(context.Background(), f.dlq, pub, consumer.ReplayOptions{IDs: []string{"2", "4"}, Keep: true, Rate: -1}); err != nil {
		t.Fatal(err)
	}
	if len(sent) != 2 || sent[0] != "b" || sent[1] != "d" || f.dlq.Len() != 4 {
		t.Fatalf("sent %v, %d kept", sent, f.dlq.Len())
	}
	sent = nil
	if _, err := consumer.Replay(context.Background(), f.dlq, pub, consumer.ReplayOptions{Limit: 3, Rate: -1}); err != nil {
		t.Fatal(err)
	}
	if len(sent) != 3 || f.dlq.Len() != 1 {
		t.Fatalf("limit 3: sent %v, %d left", sent, f.dlq.Len())
	}
}

func TestReplayStopsOnCancel(t *testing.T) {
	f := newFixture(t)
	for _, id := range []string{"a", "b", "c"} {
		_ = f.dlq.DeadLetter(context.Background(), consumer.DeadLetter{Key: dedup.Key{Scope: "s", ID: id}, Message: *msg(id)})
	}
	ctx, cancel := context.WithCancel(context.Background())
	n := 0
	_, err := consumer.Replay(ctx, f.dlq, consumer.RepublishFunc(func(context.Context, *consumer.Message) error {
		n++
		cancel()
		return nil
	}), consumer.ReplayOptions{Rate: 1000})
	if !errors.Is(err, context.Canceled) || n != 1 {
		t.Fatalf("err %v after %d republishes, want context.Canceled after 1", err, n)
	}
}

func TestClassOfSeesThroughWrapping(t *testing.T) {
	base := errors.New("x")
	for _, c := range []struct {
		err  error
		want consumer.Class
	}{
		{consumer.Transient(base), consumer.ClassTransient},
		{consumer.Permanent(base), consumer.ClassPermanent},
		{consumer.Reject(base, nil), consumer.ClassBusiness},
		{consumer.Unknown(base), consumer.ClassUnknown},
		{errors.Join(errors.New("ctx"), consumer.Permanent(base)), consumer.ClassPermanent},
		{base, consumer.Unclassified},
		{nil, consumer.Unclassified},
	} {
		if got := consumer.ClassOf(c.err); got != c.want {
			t.Errorf("ClassOf(%v) = %v, want %v", c.err, got, c.want)
		}
		if c.err != nil && !errors.Is(c.err, base) {
			t.Errorf("%v lost its cause", c.err)
		}
	}
}
