package dedupkafka

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup/consumer"
)

// TestShutdownMidDrainCommitsOnlyWhatIsFinal: a shutdown between two
// records of a partition's backlog (record mode) stops the drain there:
// the records after it do not run, the commit is one past the last final
// record (never past the unfinished ones, which drain cuts off the
// backlog only on its way out), and the next consumer runs the rest, each
// record once. The handler of record at cancels the run itself, so the
// shutdown lands exactly between at and at+1.
func TestShutdownMidDrainCommitsOnlyWhatIsFinal(t *testing.T) {
	for _, tc := range []struct {
		name string
		// failAt fails once (transient: the partition is held and the
		// record runs again) before the shutdown; -1 for none.
		failAt, at int
		// retryAt: the handler of at fails (transient) after the cancel.
		retryAt    bool
		wantCommit int64
	}{
		{name: "after a success", failAt: -1, at: 5, wantCommit: 6},
		{name: "after a failure", failAt: -1, at: 5, retryAt: true, wantCommit: 5},
		{name: "after a hold and a success", failAt: 3, at: 8, wantCommit: 9},
		{name: "on the held record", failAt: 4, at: 4, wantCommit: 5},
		{name: "at the first record", failAt: -1, at: 0, retryAt: true, wantCommit: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, seeds := cluster(t, 1, "orders")
			const n = 20
			produce(t, seeds, "orders", n, 3, nil)
			eff := newEffects()
			runCtx, cancelRun := context.WithCancel(context.Background())
			defer cancelRun()
			var (
				mu        sync.Mutex
				failed    = map[string]bool{}
				cancelled bool
			)
			h := func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
				mu.Lock()
				defer mu.Unlock()
				if m.ID == fmt.Sprint("m", tc.failAt) && !failed[m.ID] {
					failed[m.ID] = true
					return nil, consumer.Transient(errors.New("busy"))
				}
				if m.ID == fmt.Sprint("m", tc.at) && !cancelled {
					cancelled = true
					cancelRun() // the shutdown begins while this record runs
					if tc.retryAt {
						return nil, consumer.Transient(errors.New("cut short"))
					}
				}
				return nil, nil
			}
			p := processor(t, nil, eff, h)
			c := newConsumer(t, seeds, "g", "orders", p)
			errc := make(chan error, 1)
			go func() { errc <- c.Run(runCtx) }()
			select {
			case err := <-errc:
				if err != nil {
					t.Fatalf("Run: %v", err)
				}
			case <-time.After(time.Minute): // a bound against a hung test
				t.Fatalf("record m%d never ran again: Run did not stop", tc.at)
			}
			if got := committed(t, seeds, "g", "orders")[0]; got != tc.wantCommit {
				t.Fatalf("committed %d after the shutdown, want %d", got, tc.wantCommit)
			}
			if got, want := eff.distinct(), int(tc.wantCommit); got != want {
				t.Fatalf("%d records took effect before the shutdown, want %d (none after the shutdown)", got, want)
			}
			st := c.Stats()
			if st.Final != uint64(tc.wantCommit) || (st.Commits == 0) != (tc.wantCommit == 0) || st.CommitErrors != 0 {
				t.Fatalf("stats %+v, want %d final, and a commit unless none", st, tc.wantCommit)
			}
			// The next consumer of the group runs the rest.
			c2 := newConsumer(t, seeds, "g", "orders", p)
			stop := run(t, c2)
			allCommitted(t, seeds, "g", "orders")
			stop()
			eff.check(t, n)
		})
	}
}
