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
				cfg.Relays, cfg.Partitions, cfg.Lease = 2, 2, 2*time.Second
			}
			cfg.Events, cfg.Aggregates, cfg.Hold, cfg.HoldRate = 300, 20, 300*time.Millisecond, 0.02
			cfg.CrashRate, cfg.KillRate = 0.1, 0.1
			ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
			defer cancel()
			rep, err := verify.RunOutbox(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%+v", rep)
			if !rep.OK {
				t.Fatalf("violations: %v (%v)", rep.Violations(), rep.ViolationSamples)
			}
			if rep.Committed == 0 || rep.RolledBack == 0 || rep.RelayCrashes+rep.RelayKills == 0 {
				t.Fatalf("the run injected nothing: %+v", rep)
			}
		})
	}
}

func TestOutboxConfigValidate(t *testing.T) {
	for name, f := range map[string]func(*verify.OutboxConfig){
		"store":    func(c *verify.OutboxConfig) { c.Store = "redis" },
		"relays":   func(c *verify.OutboxConfig) { c.Relays = 0 },
		"rollback": func(c *verify.OutboxConfig) { c.RollbackRate = 1 },
		"lease":    func(c *verify.OutboxConfig) { c.Lease = time.Millisecond },
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
