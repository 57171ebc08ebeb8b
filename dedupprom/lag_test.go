package dedupprom_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/dedupkit/dedup/dedupprom"
)

// TestLagCollector: the backlog a broker reports becomes broker_lag and,
// where the broker says, broker_unacked; a failed request fails those
// gauges only, and the function gets a context with a deadline.
func TestLagCollector(t *testing.T) {
	m, reg := newMetrics(t)
	fail := false
	reg.MustRegister(
		m.LagCollector("nats", "billing", func(ctx context.Context) (dedupprom.BrokerLag, error) {
			if _, ok := ctx.Deadline(); !ok {
				t.Error("no deadline on the lag request")
			}
			if fail {
				return dedupprom.BrokerLag{}, errors.New("nats: timeout")
			}
			return dedupprom.BrokerLag{Pending: 7, Unacked: 2}, nil
		}),
		m.LagCollector("kafka", "billing", func(context.Context) (dedupprom.BrokerLag, error) {
			return dedupprom.BrokerLag{Pending: 40, Unacked: -1}, nil
		}))
	body := scrape(t, reg)
	hasLine(t, body, `dedup_broker_lag{consumer="billing",system="nats"} 7`)
	hasLine(t, body, `dedup_broker_unacked{consumer="billing",system="nats"} 2`)
	hasLine(t, body, `dedup_broker_lag{consumer="billing",system="kafka"} 40`)
	if strings.Contains(body, `dedup_broker_unacked{consumer="billing",system="kafka"}`) {
		t.Error("broker_unacked exported for a broker that does not say")
	}
	if err := lint(reg); err != nil {
		t.Error(err)
	}
	fail = true
	if _, err := reg.Gather(); err == nil || !strings.Contains(err.Error(), "nats: timeout") {
		t.Errorf("gather with a failing lag request: %v", err)
	}
	body = scrape(t, reg) // ContinueOnError: the rest is served
	hasLine(t, body, `dedup_broker_lag{consumer="billing",system="kafka"} 40`)
}
