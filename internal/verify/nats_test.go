package verify_test

import (
	"context"
	"testing"
	"time"

	"github.com/dedupkit/dedup/internal/brokenstore"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/internal/verify"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

func runNATS(t *testing.T, cfg verify.Config, tg verify.Target, keep bool) verify.Report {
	t.Helper()
	url := testenv.NATSURL(t)
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	rep, err := verify.RunNATS(ctx, cfg, tg, verify.NATSOptions{URL: url, Keep: keep})
	if err != nil {
		t.Fatalf("RunNATS: %v", err)
	}
	t.Logf("nats %s/%s: %d messages, %d deliveries, %d effects, %d duplicates skipped, crashes %d + %d, %d takeovers, %d failures, %d in-progress, lost %d, double %d, %.2fs",
		rep.Store, rep.Mode, rep.Messages, rep.Deliveries, rep.Effects, rep.DuplicatesSkipped,
		rep.CrashesBeforeCommit, rep.CrashesAfterCommit, rep.Takeovers, rep.HandlerFailures, rep.InProgressNacks,
		rep.Lost, rep.DoubleApplied, rep.Seconds)
	if rep.Broker != "nats" || rep.Stream == "" {
		t.Errorf("report broker %q stream %q", rep.Broker, rep.Stream)
	}
	return rep
}

// TestNATSExactlyOnce runs the fault-injecting pipeline over the real
// JetStream server: crashes leave messages unacked for JetStream to
// redeliver after AckWait, and the extra copies are published under
// another Nats-Msg-Id so the broker delivers them.
func TestNATSExactlyOnce(t *testing.T) {
	for _, tc := range []struct{ store string }{{"memory"}, {"sqlite"}} {
		t.Run(tc.store, func(t *testing.T) {
			cfg := stressConfig()
			cfg.Messages = 600
			cfg.Lease = time.Second
			if tc.store == "sqlite" {
				cfg.Consumers = 8
			}
			rep := runNATS(t, cfg, open(t, tc.store, "", cfg), false)
			requireExactlyOnce(t, cfg, rep)
			if rep.Redeliveries == 0 || rep.DuplicatesSkipped == 0 {
				t.Fatalf("no JetStream redelivery (%d) or duplicate (%d): the faults did not reach the broker", rep.Redeliveries, rep.DuplicatesSkipped)
			}
		})
	}
}

// TestNATSCatchesACheckThenSetStore: the real broker path must report a
// store whose claim is not atomic.
func TestNATSCatchesACheckThenSetStore(t *testing.T) {
	cfg := verify.DefaultConfig()
	cfg.Messages = 1000
	cfg.Consumers = 32
	cfg.DupRate = 1
	cfg.CrashRate = 0
	cfg.FailRate = 0
	cfg.Seed = 3
	tg, err := verify.NewLease("check-then-set", brokenstore.NewCheckThenSet().WithWindow(2*time.Millisecond), cfg.Lease)
	if err != nil {
		t.Fatal(err)
	}
	defer tg.Close()
	rep := runNATS(t, cfg, tg, false)
	if rep.DoubleApplied == 0 || rep.OK {
		t.Fatalf("check-then-set store passed over NATS: double applied %d, ok %v", rep.DoubleApplied, rep.OK)
	}
}

// TestNATSStreamKeptOnlyOnRequest: the run's stream is deleted at the end
// unless Keep.
func TestNATSStreamKeptOnlyOnRequest(t *testing.T) {
	cfg := smallConfig()
	cfg.Messages = 50
	for _, keep := range []bool{false, true} {
		rep := runNATS(t, cfg, open(t, "memory", "", cfg), keep)
		nc, err := nats.Connect(testenv.NATSURL(t))
		if err != nil {
			t.Fatal(err)
		}
		js, _ := jetstream.New(nc)
		_, err = js.Stream(t.Context(), rep.Stream)
		if keep {
			if err != nil {
				t.Errorf("kept stream %s: %v", rep.Stream, err)
			}
			_ = js.DeleteStream(t.Context(), rep.Stream)
		} else if err == nil {
			t.Errorf("stream %s still exists after the run", rep.Stream)
		}
		nc.Close()
	}
}
