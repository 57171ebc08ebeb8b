package verify_test

import (
	"context"
	"testing"
	"time"

	"github.com/dedupkit/dedup/internal/brokenstore"
	"github.com/dedupkit/dedup/internal/verify"
)

func runKafka(t *testing.T, cfg verify.Config, tg verify.Target, opts verify.KafkaOptions) verify.Report {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	rep, err := verify.RunKafka(ctx, cfg, tg, opts)
	if err != nil {
		t.Fatalf("RunKafka: %v", err)
	}
	t.Logf("kafka %s/%s: %d messages, %d deliveries, %d redeliveries, %d effects, %d duplicates skipped, crashes %d + %d, %d takeovers, %d failures, %d in-progress, lost %d, double %d, %.2fs",
		rep.Store, rep.Mode, rep.Messages, rep.Deliveries, rep.Redeliveries, rep.Effects, rep.DuplicatesSkipped,
		rep.CrashesBeforeCommit, rep.CrashesAfterCommit, rep.Takeovers, rep.HandlerFailures, rep.InProgressNacks,
		rep.Lost, rep.DoubleApplied, rep.Seconds)
	if rep.Broker != "kafka" || rep.Stream == "" {
		t.Errorf("report broker %q topic %q", rep.Broker, rep.Stream)
	}
	return rep
}

// TestKafkaExactlyOnce runs the fault-injecting pipeline over the
// in-process kfake cluster: crashes restart members from their committed
// offsets or kill them (a rebalance), members leave and join, produce
// responses and offset commits fail.
func TestKafkaExactlyOnce(t *testing.T) {
	for _, store := range []string{"memory", "sqlite"} {
		t.Run(store, func(t *testing.T) {
			cfg := stressConfig()
			cfg.Messages = 1000
			cfg.Lease = 200 * time.Millisecond
			rep := runKafka(t, cfg, open(t, store, "", cfg), verify.KafkaOptions{HardCrashEvery: 4, LeaveEvery: 500})
			if !rep.OK || rep.Lost != 0 || rep.DoubleApplied != 0 || rep.Unfinished != 0 || rep.Effects != cfg.Messages {
				t.Fatalf("want exactly once, got ok=%v lost=%d double=%d unfinished=%d effects=%d first error %q",
					rep.OK, rep.Lost, rep.DoubleApplied, rep.Unfinished, rep.Effects, rep.FirstError)
			}
			if rep.DuplicatesSkipped < rep.CrashesAfterCommit || rep.CrashesBeforeCommit == 0 || rep.HandlerFailures == 0 {
				t.Fatalf("faults not exercised: %+v", rep)
			}
			if rep.Redeliveries == 0 || rep.DuplicatesSkipped == 0 || rep.CrashesAfterCommit == 0 {
				t.Fatalf("no redelivery (%d), duplicate (%d) or crash after commit (%d): the faults did not happen",
					rep.Redeliveries, rep.DuplicatesSkipped, rep.CrashesAfterCommit)
			}
		})
	}
}

// TestKafkaCatchesACheckThenSetStore: the Kafka path must report a store
// whose claim is not atomic.
func TestKafkaCatchesACheckThenSetStore(t *testing.T) {
	cfg := verify.DefaultConfig()
	cfg.Messages = 1000
	cfg.Consumers = 8
	cfg.DupRate = 1
	cfg.CrashRate = 0.05
	cfg.FailRate = 0
	cfg.Seed = 3
	tg, err := verify.NewLease("check-then-set", brokenstore.NewCheckThenSet().WithWindow(2*time.Millisecond), cfg.Lease)
	if err != nil {
		t.Fatal(err)
	}
	defer tg.Close()
	rep := runKafka(t, cfg, tg, verify.KafkaOptions{})
	if rep.DoubleApplied == 0 || rep.OK {
		t.Fatalf("check-then-set store passed over Kafka: double applied %d, ok %v", rep.DoubleApplied, rep.OK)
	}
}
