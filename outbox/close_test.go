package outbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/outbox"
)

// Close looked for a Run to stop and found none when it came before Run
// had registered its cancel (a Close right after `go relay.Run(ctx)`, as
// the tests' own rig does, or at any time before): it returned, and the
// Run that started next ran on, taking partitions, until its context
// ended, which a caller that relied on Close never does. Close now marks
// the relay closed under the lock Run registers under, so a Run either
// registered first (and Close stops it and waits) or sees the mark and
// returns at once.
func TestCloseBeforeRunStopsRun(t *testing.T) {
	r := newRig(t)
	rl, err := outbox.NewRelay(r.src, newFakePub(), outbox.WithPollInterval(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	if err := rl.Close(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- rl.Run(ctx) }()
	// Either Run returns, or it takes a partition (then it runs after
	// Close and only the cancel below ends it).
	eventually(t, "Run returned or took a partition", func() bool {
		select {
		case err := <-errc:
			errc <- err
			return true
		default:
			return rl.Stats().Partitions > 0
		}
	})
	if n := rl.Stats().Partitions; n > 0 {
		cancel()
		<-errc
		t.Fatalf("a Run after Close took %d partitions", n)
	}
	if err := <-errc; !errors.Is(err, dedup.ErrClosed) {
		t.Fatalf("Run after Close: %v, want ErrClosed", err)
	}
}
