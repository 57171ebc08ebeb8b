package verify_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup/internal/brokenstore"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/internal/verify"
	amqp "github.com/rabbitmq/amqp091-go"
)

func runAMQP(t *testing.T, cfg verify.Config, tg verify.Target, opts verify.AMQPOptions) verify.Report {
	t.Helper()
	opts.URL = testenv.AMQPURL(t)
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	rep, err := verify.RunAMQP(ctx, cfg, tg, opts)
	if err != nil {
		t.Fatalf("RunAMQP: %v", err)
	}
	t.Logf("rabbitmq %s/%s: %d messages, %d deliveries, %d effects, %d duplicates skipped, crashes %d + %d, %d takeovers, %d failures, %d in-progress, %d drops, lost %d, double %d, %.2fs",
		rep.Store, rep.Mode, rep.Messages, rep.Deliveries, rep.Effects, rep.DuplicatesSkipped,
		rep.CrashesBeforeCommit, rep.CrashesAfterCommit, rep.Takeovers, rep.HandlerFailures, rep.InProgressNacks,
		rep.ConnectionDrops, rep.Lost, rep.DoubleApplied, rep.Seconds)
	if rep.Broker != "rabbitmq" || rep.Stream == "" {
		t.Errorf("report broker %q queue %q", rep.Broker, rep.Stream)
	}
	return rep
}

// TestAMQPExactlyOnce runs the fault-injecting pipeline over the real
// RabbitMQ server with crashes (a closed channel returns the message) and
// connection drops (every channel dies at once).
func TestAMQPExactlyOnce(t *testing.T) {
	for _, tc := range []struct{ store string }{{"memory"}, {"sqlite"}} {
		t.Run(tc.store, func(t *testing.T) {
			cfg := stressConfig()
			cfg.Messages = 600
			cfg.Lease = time.Second
			if tc.store == "sqlite" {
				cfg.Consumers = 8
			}
			rep := runAMQP(t, cfg, open(t, tc.store, "", cfg), verify.AMQPOptions{DropEvery: 150})
			requireExactlyOnce(t, cfg, rep)
			if rep.Redeliveries == 0 || rep.DuplicatesSkipped == 0 || rep.ConnectionDrops == 0 {
				t.Fatalf("no redelivery (%d), duplicate (%d) or drop (%d): the faults did not reach the broker",
					rep.Redeliveries, rep.DuplicatesSkipped, rep.ConnectionDrops)
			}
		})
	}
}

// TestAMQPCatchesACheckThenSetStore: the real broker path must report a
// store whose claim is not atomic.
func TestAMQPCatchesACheckThenSetStore(t *testing.T) {
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
	rep := runAMQP(t, cfg, tg, verify.AMQPOptions{})
	if rep.DoubleApplied == 0 || rep.OK {
		t.Fatalf("check-then-set store passed over RabbitMQ: double applied %d, ok %v", rep.DoubleApplied, rep.OK)
	}
}

// TestAMQPQueueKeptOnlyOnRequest: the run's queue is deleted at the end
// unless Keep.
func TestAMQPQueueKeptOnlyOnRequest(t *testing.T) {
	cfg := smallConfig()
	cfg.Messages = 50
	for _, keep := range []bool{false, true} {
		rep := runAMQP(t, cfg, open(t, "memory", "", cfg), verify.AMQPOptions{Keep: keep})
		conn, err := amqp.Dial(testenv.AMQPURL(t))
		if err != nil {
			t.Fatal(err)
		}
		ch, _ := conn.Channel()
		_, err = ch.QueueDeclarePassive(rep.Stream, true, false, false, false, nil)
		if keep {
			if err != nil {
				t.Errorf("kept queue %s: %v", rep.Stream, err)
			}
			ch, _ = conn.Channel()
			_, _ = ch.QueueDelete(rep.Stream, false, false, false)
		} else if err == nil {
			t.Errorf("queue %s still exists after the run", rep.Stream)
		}
		conn.Close()
	}
}

// TestAMQPAckLandedThenChannelClosed: an ack written just before the
// channel dies may already have been processed by the broker, which then
// never redelivers that copy. The checker must count the copy as done
// once its ack is written (a redelivery, if the ack did not land, is a
// duplicate that counts nothing), not only when the channel still looks
// alive after the write: otherwise the run waits forever for a message
// the broker has settled (CI: "timed out with 1 messages unfinished"
// under --drop-every). The hook closes the channel gracefully after one
// ack, so the broker surely processed that ack before the channel died.
func TestAMQPAckLandedThenChannelClosed(t *testing.T) {
	cfg := smallConfig()
	cfg.Messages = 100
	cfg.Consumers = 4
	cfg.DupRate = 0
	cfg.CrashRate = 0
	cfg.FailRate = 0
	var once sync.Once
	closed := false
	defer verify.SetAMQPAfterAck(func(ch *amqp.Channel) {
		once.Do(func() {
			_ = ch.Close() // waits for close-ok: the ack before it was processed
			closed = true
		})
	})()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	rep, err := verify.RunAMQP(ctx, cfg, open(t, "memory", "", cfg), verify.AMQPOptions{URL: testenv.AMQPURL(t)})
	if err != nil {
		t.Fatalf("RunAMQP: %v", err)
	}
	if !closed {
		t.Fatal("the hook never ran")
	}
	requireExactlyOnce(t, cfg, rep)
}
