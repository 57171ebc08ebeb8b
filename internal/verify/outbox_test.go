package verify_test

import (
	"context"
	"testing"
	"time"

	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/internal/verify"
)

// TestOutboxEndToEnd runs `dedup verify --outbox` small on both stores:
// relays die after the acks and mid-batch, transactions roll back and
// are held open, and the ledger must show every committed event applied
// once, in order per aggregate, and no rolled-back one.
func TestOutboxEndToEnd(t *testing.T) {
	for _, store := range []string{"postgres", "sqlite"} {
		t.Run(store, func(t *testing.T) {
			cfg := verify.DefaultOutboxConfig()
			cfg.Store, cfg.NATSURL = store, testenv.NATSURL(t)
			if store == "postgres" {
				cfg.PostgresURL = testenv.PostgresURL(t)
			} else {
				// One writer: every heartbeat, lease renewal and mark is a
				// write transaction, so fewer relays and longer leases.
				// Two partitions of 300 events made about four batches of
				// 100, and the relay deaths are drawn per batch: half the
				// runs drew none (CI once drew none three times running).
				// Batches of 10 make about thirty draws a run.
				cfg.Relays, cfg.Partitions, cfg.Lease, cfg.Batch = 2, 2, 2*time.Second, 10
			}
			cfg.Events, cfg.Aggregates, cfg.Hold, cfg.HoldRate = 300, 20, 300*time.Millisecond, 0.02
			cfg.CrashRate, cfg.KillRate = 0.1, 0.1
			rep := runOutboxInjected(t, cfg, func(rep verify.OutboxReport) bool { return true })
			if rep.Committed == 0 {
				t.Fatalf("nothing committed: %+v", rep)
			}
		})
	}
}

// TestOutboxBrokers runs `dedup verify --outbox` small over the Kafka
// adapter's publisher (an in-process kfake cluster that loses produce
// responses) and the RabbitMQ adapter's (a real server), with the same
// relay deaths and the same checks as over NATS.
func TestOutboxBrokers(t *testing.T) {
	for _, broker := range []string{"kafka", "rabbitmq"} {
		t.Run(broker, func(t *testing.T) {
			cfg := verify.DefaultOutboxConfig()
			cfg.Broker, cfg.Store, cfg.PostgresURL = broker, "postgres", testenv.PostgresURL(t)
			if broker == "rabbitmq" {
				cfg.AMQPURL = testenv.AMQPURL(t)
			}
			cfg.Events, cfg.Aggregates, cfg.Hold, cfg.HoldRate = 300, 20, 300*time.Millisecond, 0.02
			cfg.CrashRate, cfg.KillRate = 0.1, 0.1
			rep := runOutboxInjected(t, cfg, func(rep verify.OutboxReport) bool { return rep.DuplicatesSkipped > 0 })
			if rep.Broker != broker || rep.Committed == 0 {
				t.Fatalf("broker %q, %d committed: %+v", rep.Broker, rep.Committed, rep)
			}
			if rep.DuplicatesSkipped == 0 {
				t.Fatalf("no relay re-send reached the consumers, so their dedup was not exercised: %+v", rep)
			}
		})
	}
}

// runOutboxInjected runs cfg until a run has injected its faults (a
// rollback and a relay death, and whatever more says): the faults are
// drawn per batch and per transaction, so a small run can draw none. Every
// run must be clean; at most three are made.
func runOutboxInjected(t *testing.T, cfg verify.OutboxConfig, more func(verify.OutboxReport) bool) verify.OutboxReport {
	t.Helper()
	var rep verify.OutboxReport
	for range 3 {
		ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
		r, err := verify.RunOutbox(ctx, cfg)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%+v", r)
		if !r.OK {
			t.Fatalf("violations: %v (%v)", r.Violations(), r.ViolationSamples)
		}
		rep = r
		if r.RolledBack > 0 && r.RelayCrashes+r.RelayKills > 0 && more(r) {
			return rep
		}
		t.Log("the run drew no rollback or relay death: again")
	}
	t.Fatalf("three runs injected nothing: %+v", rep)
	return rep
}

func TestOutboxConfigValidate(t *testing.T) {
	for name, f := range map[string]func(*verify.OutboxConfig){
		"store":    func(c *verify.OutboxConfig) { c.Store = "redis" },
		"broker":   func(c *verify.OutboxConfig) { c.Broker = "pulsar" },
		"relays":   func(c *verify.OutboxConfig) { c.Relays = 0 },
		"rollback": func(c *verify.OutboxConfig) { c.RollbackRate = 1 },
		"lease":    func(c *verify.OutboxConfig) { c.Lease = time.Millisecond },
		"batch":    func(c *verify.OutboxConfig) { c.Batch = 0 },
	} {
		c := verify.DefaultOutboxConfig()
		f(&c)
		if err := c.Validate(); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	c := verify.DefaultOutboxConfig()
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
}
