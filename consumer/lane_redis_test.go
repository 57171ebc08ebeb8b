package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/internal/redistest"
)

// Review of a9d4886 (consumer.Lane), on Redis: lanes of two processors on
// one store, used at once, closed halfway through their goroutines' work
// (twice) and used on after Close, while a reader takes both processors'
// Stats. Every count a lane keeps (applied, duplicate, rejected, in
// progress) goes to its own processor exactly once, none to the other, and
// no count read by the reader ever goes back (a Prometheus counter must
// not).
func TestLanesOfTwoProcessorsOnRedis(t *testing.T) {
	s := redistest.Store(t, uniquePrefix(t))
	ctx := context.Background()
	h := func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if strings.HasSuffix(m.ID, "bad") {
			return nil, consumer.Reject(errors.New("no such order"), []byte("rejected"))
		}
		return []byte("ok"), nil
	}
	procs := make([]*consumer.Processor, 2)
	for i, name := range []string{"orders", "refunds"} {
		p, err := consumer.New(name, s, h, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
		if err != nil {
			t.Fatal(err)
		}
		procs[i] = p
		// A key another owner holds: processing it finds it in progress.
		if c, err := s.Claim(ctx, dedup.Key{Scope: name, ID: "held"}, "", time.Minute); err != nil || c.Outcome != dedup.Acquired {
			t.Fatalf("claim of the held key: %v %v", c.Outcome, err)
		}
	}
	get := func(st consumer.Stats) []uint64 {
		return []uint64{st.Applied, st.Duplicates, st.Retries, st.DeadLettered, st.Rejected, st.InProgress, st.StoreErrors, st.Reconciled}
	}
	stop := make(chan struct{})
	var reader sync.WaitGroup
	reader.Go(func() {
		last := make([][]uint64, len(procs))
		for {
			for i, p := range procs {
				now := get(p.Stats())
				for j := range now {
					if last[i] != nil && now[j] < last[i][j] {
						t.Errorf("processor %d: stats went back, field %d: %v after %v", i, j, now, last[i])
						return
					}
				}
				last[i] = now
			}
			select {
			case <-stop:
				return
			default:
			}
		}
	})
	const lanes, each = 3, 40
	var wg sync.WaitGroup
	for pi, p := range procs {
		for li := range lanes {
			wg.Go(func() {
				l := p.NewLane()
				for j := range each {
					if j == each/2 {
						l.Close()
						l.Close()
					}
					id := fmt.Sprintf("p%d-l%d-%d", pi, li, j)
					if j%10 == 0 {
						id += "bad"
					}
					m := msg(id)
					for range 2 {
						if d := l.Process(ctx, m); d.Action == consumer.Retry {
							t.Errorf("%s: %+v", id, d)
						}
					}
					if j%20 == 0 {
						if d := l.Process(ctx, msg("held")); d.Action != consumer.Retry {
							t.Errorf("held key: %+v, want a retry", d)
						}
					}
				}
			})
		}
	}
	wg.Wait()
	close(stop)
	reader.Wait()
	const bad, held = lanes * each / 10, lanes * each / 20
	for i, p := range procs {
		st := p.Stats()
		// A rejection is recorded: its redelivery is a duplicate with the
		// recorded result (counted as a duplicate, not a second rejection).
		if st.Applied != lanes*each-bad || st.Rejected != bad || st.Duplicates != lanes*each ||
			st.InProgress != held || st.Retries != held || st.StoreErrors != 0 || st.DeadLettered != 0 {
			t.Errorf("processor %d: stats %+v, want %d applied, %d rejected, %d duplicates, %d in progress and retries",
				i, st, lanes*each-bad, bad, lanes*each, held)
		}
	}
}
