package dedupkafka

import (
	"context"
	"testing"

	"github.com/dedupkit/dedup/consumer"
)

// TestLag: 40 records on 2 partitions; while the handler holds them the
// group's lag is the records not committed (at least one is held on
// each partition that got records); once they are all final and
// committed, the lag is 0.
func TestLag(t *testing.T) {
	_, seeds := cluster(t, 2, "lagtopic")
	produce(t, seeds, "lagtopic", 40, 8, nil)
	eff := newEffects()
	release := make(chan struct{})
	p := processor(t, nil, eff, func(ctx context.Context, _ *consumer.Message, _ consumer.Delivery) ([]byte, error) {
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil, nil
	})
	c := newConsumer(t, seeds, "lag-group", "lagtopic", p)
	stop := run(t, c)
	var held Lag
	waitFor(t, "the group's lag while every record is held", func() bool {
		l, err := c.Lag(context.Background())
		if err != nil || len(l.Partitions["lagtopic"]) != 2 {
			return false
		}
		held = l
		return l.Total == 40 && c.Stats().Records > 0
	})
	t.Logf("held: %+v", held)
	close(release)
	waitFor(t, "a lag of 0 after every record is final", func() bool {
		l, err := c.Lag(context.Background())
		return err == nil && l.Total == 0 && eff.distinct() == 40
	})
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	eff.check(t, 40)
}
