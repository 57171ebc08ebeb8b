package verify

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/dedupprom"
	"github.com/dedupkit/dedup/layered"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Metrics is the Prometheus view of one run (dedup verify --metrics-addr):
// a [dedupprom.Metrics] fed by every delivery the run's consumers handle,
// plus collectors for the run's broker counts and, on a layered store, what
// each layer caught. Serve Registry with [dedupprom.Listen] while the run
// goes on.
//
// The events come from the outside of the [Target] (see [Metrics.Instrument]):
// each delivery is one claim event of the target's store with the outcome
// the target reported and, as its latency, the whole Apply (claim, effect
// and commit); a consumer decision under the consumer name "verify"; and
// the broker's fetched, acked and nacked counts under the system label of
// the broker (simulated, nats, rabbitmq, kafka).
type Metrics struct {
	// Registry holds every collector of the run.
	Registry *prometheus.Registry
	prom     *dedupprom.Metrics
	broker   string
	counts   brokerCounts
}

// brokerCounts are the deliveries the instrumented target has seen.
type brokerCounts struct {
	fetched, acked, nacked atomic.Uint64
}

// NewMetrics returns the metrics of a run over the named broker, with the
// Go runtime and process collectors, nothing registered for a target yet.
func NewMetrics(broker string) (*Metrics, error) {
	if broker == "" {
		broker = "simulated"
	}
	p, err := dedupprom.New()
	if err != nil {
		return nil, err
	}
	m := &Metrics{Registry: prometheus.NewRegistry(), prom: p, broker: broker}
	m.Registry.MustRegister(p, collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		p.BrokerCollector(broker, "verify", func() dedupprom.BrokerStats {
			return dedupprom.BrokerStats{Fetched: m.counts.fetched.Load(), Acked: m.counts.acked.Load(), Nacked: m.counts.nacked.Load()}
		}))
	return m, nil
}

// Instrument returns t with every Apply reported to m. The result keeps
// t's database path and layer counts, and on a layered target registers
// the layered collector. Call it once per run.
func (m *Metrics) Instrument(t Target) Target {
	it := &instrumented{Target: t, m: m, hooks: dedup.NewHooks(m.prom), observe: m.prom.Observer("verify")}
	if lr, ok := t.(LayerReporter); ok {
		if l, _ := lr.LayerStats(); l != nil {
			m.Registry.MustRegister(m.prom.LayeredCollector(t.Store(), func() layered.Stats { return layerStats(lr) }))
		}
	}
	return it
}

// layerStats maps verify's layer counts (window, bloom, durable, the fast
// store's name and its name with "_errors") onto layered.Stats.
func layerStats(lr LayerReporter) layered.Stats {
	l, _ := lr.LayerStats()
	var s layered.Stats
	for k, v := range l {
		switch {
		case k == "window":
			s.Window = v
		case k == "bloom":
			s.Bloom = v
		case k == "durable":
			s.Durable = v
		case strings.HasSuffix(k, "_errors"):
			s.FastErrors = v
		default:
			s.Fast = v
		}
	}
	return s
}

// instrumented is a Target that reports each delivery to the metrics.
type instrumented struct {
	Target
	m       *Metrics
	hooks   dedup.Hooks
	observe func(*consumer.Message, consumer.Decision)
}

// Apply runs the target and reports what came of the delivery.
func (it *instrumented) Apply(ctx context.Context, d Delivery) Result {
	start := time.Now()
	res := it.Target.Apply(ctx, d)
	took := time.Since(start)
	store := it.Target.Store()
	it.m.counts.fetched.Add(1)
	if res.Outcome.acked() {
		it.m.counts.acked.Add(1)
	} else if res.Outcome != CrashedBeforeCommit && res.Outcome != CrashedAfterCommit {
		it.m.counts.nacked.Add(1) // a crashed consumer sends nothing
	}

	ev := dedup.ClaimEvent{Store: store, Key: d.Key, Attempt: d.Redelivered + 1, TakenOver: res.TakenOver, Duration: took}
	switch res.Outcome {
	case Duplicate:
		ev.Outcome = dedup.Duplicate
	case InProgress:
		ev.Outcome = dedup.InProgress
	case Conflict:
		ev.Outcome = dedup.Mismatch
	case StoreFailed:
		ev.Err = res.Err
		if ev.Err == nil {
			ev.Err = errors.New("verify: store failed")
		}
	default:
		ev.Outcome = dedup.Acquired
	}
	it.hooks.Claimed(ctx, ev)
	fin := dedup.FinishEvent{Store: store, Key: d.Key}
	switch res.Outcome {
	case Applied, CrashedAfterCommit:
		fin.Op = "complete"
	case HandlerFailed:
		fin.Op = "release"
	case LeaseLost:
		fin.Op, fin.Err = "complete", dedup.ErrLeaseLost
	case CrashedBeforeCommit:
		fin.Op = "keep"
	}
	if fin.Op != "" {
		it.hooks.Finished(ctx, fin)
	}

	dec := consumer.Decision{Key: d.Key}
	switch res.Outcome {
	case Applied:
		dec.Action = consumer.Ack
	case Duplicate:
		dec.Action, dec.Duplicate = consumer.Ack, true
	case HandlerFailed:
		dec.Action, dec.Class = consumer.Retry, consumer.ClassTransient
	case InProgress, StoreFailed, LeaseLost:
		dec.Action = consumer.Retry
	case Conflict:
		dec.Action, dec.Class = consumer.DeadLettered, consumer.ClassPermanent
	default:
		return res // a crash: the consumer died and decided nothing
	}
	it.observe(&consumer.Message{ID: d.MsgID, Delivery: d.Redelivered + 1}, dec)
	return res
}

// Path passes on the database file of the target, if it has one.
func (it *instrumented) Path() string { return PathOf(it.Target) }

// LayerStats passes on the layer counts of a layered target.
func (it *instrumented) LayerStats() (map[string]int64, int) {
	if lr, ok := it.Target.(LayerReporter); ok {
		return lr.LayerStats()
	}
	return nil, 0
}
