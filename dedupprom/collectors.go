package dedupprom

import (
	"context"
	"time"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/layered"
	"github.com/dedupkit/dedup/outbox"
	"github.com/prometheus/client_golang/prometheus"
)

// statsCollector turns a Stats() snapshot into const metrics at each
// scrape: the parts keep their own atomic counters, and nothing is
// counted twice.
type statsCollector struct {
	descs []*prometheus.Desc
	read  func(ch chan<- prometheus.Metric, descs []*prometheus.Desc)
}

func (c *statsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.descs {
		ch <- d
	}
}

func (c *statsCollector) Collect(ch chan<- prometheus.Metric) { c.read(ch, c.descs) }

func desc(ns, name, help string, variable []string, constant prometheus.Labels) *prometheus.Desc {
	return prometheus.NewDesc(prometheus.BuildFQName(ns, "", name), help, variable, constant)
}

func counterOf(d *prometheus.Desc, v float64, lv ...string) prometheus.Metric {
	return prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, lv...)
}

func gaugeOf(d *prometheus.Desc, v float64, lv ...string) prometheus.Metric {
	return prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, lv...)
}

// LayeredCollector exports a layered store's [layered.Stats] under the
// store label name: layered_duplicates_total{layer} (window, bloom, fast,
// durable), layered_suspected_total, layered_fast_errors_total and
// layered_fast_unsure_total. Pass s.Stats.
func (m *Metrics) LayeredCollector(name string, stats func() layered.Stats) prometheus.Collector {
	ns, cl := m.namespace, m.labels("store", name)
	return &statsCollector{
		descs: []*prometheus.Desc{
			desc(ns, "layered_duplicates_total", "Duplicates caught by each layer of a layered store.", []string{"layer"}, cl),
			desc(ns, "layered_suspected_total", "Bloom 'maybe' answers passed on to the stores (Confirm mode).", nil, cl),
			desc(ns, "layered_fast_errors_total", "Fast-store failures passed over (the durable store decided alone).", nil, cl),
			desc(ns, "layered_fast_unsure_total", "Fast-store 'in progress' or 'mismatch' answers confirmed by the durable store.", nil, cl),
		},
		read: func(ch chan<- prometheus.Metric, d []*prometheus.Desc) {
			s := stats()
			ch <- counterOf(d[0], float64(s.Window), "window")
			ch <- counterOf(d[0], float64(s.Bloom), "bloom")
			ch <- counterOf(d[0], float64(s.Fast), "fast")
			ch <- counterOf(d[0], float64(s.Durable), "durable")
			ch <- counterOf(d[1], float64(s.Suspected))
			ch <- counterOf(d[2], float64(s.FastErrors))
			ch <- counterOf(d[3], float64(s.FastUnsure))
		},
	}
}

// ProcessorCollector exports the counts of a consumer processor's
// [consumer.Stats] that no decision carries, under the consumer label
// name: consumer_reconciled_total (unknown outcomes the reconciler
// settled as applied), consumer_in_progress_total (retries because
// another consumer held the key) and consumer_store_errors_total (retries
// because the store failed: fail closed). Pass p.Stats.
func (m *Metrics) ProcessorCollector(name string, stats func() consumer.Stats) prometheus.Collector {
	ns, cl := m.namespace, m.labels("consumer", name)
	return &statsCollector{
		descs: []*prometheus.Desc{
			desc(ns, "consumer_reconciled_total", "Unknown outcomes the reconciler settled as applied.", nil, cl),
			desc(ns, "consumer_in_progress_total", "Retries because another consumer held the key.", nil, cl),
			desc(ns, "consumer_store_errors_total", "Retries because the dedup store failed (fail closed).", nil, cl),
		},
		read: func(ch chan<- prometheus.Metric, d []*prometheus.Desc) {
			s := stats()
			ch <- counterOf(d[0], float64(s.Reconciled))
			ch <- counterOf(d[1], float64(s.InProgress))
			ch <- counterOf(d[2], float64(s.StoreErrors))
		},
	}
}

// Backlog is what an outbox holds that is not published yet.
type Backlog struct {
	Messages  int64   // rows not yet published
	OldestAge float64 // seconds since the oldest of them was written; 0 when none
}

// RelayCollector exports an outbox relay's [outbox.Stats] under the relay
// label name: outbox_published_total, outbox_failed_total,
// outbox_quarantined_total, outbox_batches_total, outbox_lease_lost_total,
// outbox_fetches_total and the gauge outbox_partitions_held. backlog,
// when not nil, is read at each scrape for the gauges outbox_backlog and
// outbox_oldest_unpublished_seconds (a query of the outbox table; keep it
// cheap, and give it its own timeout). Pass r.Stats.
func (m *Metrics) RelayCollector(name string, stats func() outbox.Stats, backlog func() (Backlog, error)) prometheus.Collector {
	ns, cl := m.namespace, m.labels("relay", name)
	descs := []*prometheus.Desc{
		desc(ns, "outbox_published_total", "Outbox messages acknowledged by the broker and marked published.", nil, cl),
		desc(ns, "outbox_failed_total", "Failed publish attempts recorded.", nil, cl),
		desc(ns, "outbox_quarantined_total", "Outbox messages quarantined after their attempts ran out.", nil, cl),
		desc(ns, "outbox_batches_total", "Batches published.", nil, cl),
		desc(ns, "outbox_lease_lost_total", "Marks refused because another relay took the partition lease over.", nil, cl),
		desc(ns, "outbox_fetches_total", "Reads of a partition, empty ones included.", nil, cl),
		desc(ns, "outbox_partitions_held", "Partitions this relay holds now.", nil, cl),
		desc(ns, "outbox_backlog", "Outbox messages not published yet.", nil, cl),
		desc(ns, "outbox_oldest_unpublished_seconds", "Age of the oldest unpublished outbox message.", nil, cl),
	}
	return &statsCollector{
		descs: descs,
		read: func(ch chan<- prometheus.Metric, d []*prometheus.Desc) {
			s := stats()
			ch <- counterOf(d[0], float64(s.Published))
			ch <- counterOf(d[1], float64(s.Failed))
			ch <- counterOf(d[2], float64(s.Quarantined))
			ch <- counterOf(d[3], float64(s.Batches))
			ch <- counterOf(d[4], float64(s.LeaseLost))
			ch <- counterOf(d[5], float64(s.Fetches))
			ch <- gaugeOf(d[6], float64(s.Partitions))
			if backlog == nil {
				return
			}
			if b, err := backlog(); err != nil {
				ch <- prometheus.NewInvalidMetric(d[7], err)
			} else {
				ch <- gaugeOf(d[7], float64(b.Messages))
				ch <- gaugeOf(d[8], b.OldestAge)
			}
		},
	}
}

// BrokerStats are a broker adapter's counts, in a broker-neutral form, so
// that this package imports no broker client. Map an adapter's Stats into
// it (see the BrokerCollector example for dedupnats).
type BrokerStats struct {
	Fetched     uint64 // messages received
	Acked       uint64 // acknowledged (applied, duplicate, rejected)
	Nacked      uint64 // negatively acknowledged (retry, released on shutdown)
	DeadLetters uint64 // terminated on the broker after a dead letter
	AckErrors   uint64 // acknowledgements that could not be sent
}

// BrokerCollector exports a broker adapter's counts under the labels
// system ("nats", "rabbitmq", "kafka") and consumer name:
// broker_fetched_total, broker_acked_total, broker_nacked_total,
// broker_dead_letters_total and broker_ack_errors_total. The backlog the
// broker reports is [Metrics.LagCollector]'s.
func (m *Metrics) BrokerCollector(system, name string, stats func() BrokerStats) prometheus.Collector {
	ns, cl := m.namespace, m.labels("system", system, "consumer", name)
	return &statsCollector{
		descs: []*prometheus.Desc{
			desc(ns, "broker_fetched_total", "Messages received from the broker.", nil, cl),
			desc(ns, "broker_acked_total", "Messages acknowledged.", nil, cl),
			desc(ns, "broker_nacked_total", "Messages negatively acknowledged (redelivered later).", nil, cl),
			desc(ns, "broker_dead_letters_total", "Messages terminated on the broker after a dead letter.", nil, cl),
			desc(ns, "broker_ack_errors_total", "Acknowledgements that could not be sent (the redelivery will be a duplicate).", nil, cl),
		},
		read: func(ch chan<- prometheus.Metric, d []*prometheus.Desc) {
			s := stats()
			ch <- counterOf(d[0], float64(s.Fetched))
			ch <- counterOf(d[1], float64(s.Acked))
			ch <- counterOf(d[2], float64(s.Nacked))
			ch <- counterOf(d[3], float64(s.DeadLetters))
			ch <- counterOf(d[4], float64(s.AckErrors))
		},
	}
}

// BrokerLag is a consumer's backlog as its broker reports it, in a
// broker-neutral form.
type BrokerLag struct {
	// Pending counts messages not delivered to this consumer yet: NATS
	// JetStream's num_pending (dedupnats Consumer.Lag), Kafka's group lag
	// past its committed offsets (dedupkafka Consumer.Lag: records being
	// processed count too), RabbitMQ's ready messages (dedupamqp
	// Consumer.Depth).
	Pending int64
	// Unacked counts messages delivered and not acknowledged yet (NATS's
	// num_ack_pending), or -1 where the broker does not say (Kafka,
	// RabbitMQ's passive declare).
	Unacked int64
}

// LagTimeout bounds each call of a [Metrics.LagCollector]'s function.
const LagTimeout = 5 * time.Second

// LagCollector exports the backlog the broker reports under the labels
// system and consumer name: the gauges broker_lag and, when Unacked is not
// negative, broker_unacked. lag is called at each scrape (a request to
// the broker) with a context bounded by [LagTimeout]; its error makes the
// scrape report the two gauges as failed and the rest as usual.
func (m *Metrics) LagCollector(system, name string, lag func(ctx context.Context) (BrokerLag, error)) prometheus.Collector {
	ns, cl := m.namespace, m.labels("system", system, "consumer", name)
	return &statsCollector{
		descs: []*prometheus.Desc{
			desc(ns, "broker_lag", "Messages the broker has not delivered to this consumer yet (Kafka: past the committed offsets).", nil, cl),
			desc(ns, "broker_unacked", "Messages delivered to this consumer and not acknowledged yet, where the broker says.", nil, cl),
		},
		read: func(ch chan<- prometheus.Metric, d []*prometheus.Desc) {
			ctx, cancel := context.WithTimeout(context.Background(), LagTimeout)
			defer cancel()
			l, err := lag(ctx)
			if err != nil {
				ch <- prometheus.NewInvalidMetric(d[0], err)
				return
			}
			ch <- gaugeOf(d[0], float64(l.Pending))
			if l.Unacked >= 0 {
				ch <- gaugeOf(d[1], float64(l.Unacked))
			}
		},
	}
}

// SweepStats are a sweeper's totals (pgstore.SweepJob.Stats, mapped).
type SweepStats struct {
	Deleted int64 // rows deleted
	Passes  int   // passes run
	Failed  bool  // the last pass failed
}

// SweepCollector exports a sweeper's totals under the store label name:
// sweep_deleted_total, sweep_passes_total and the gauge
// sweep_last_failed (1 when the last pass failed).
func (m *Metrics) SweepCollector(name string, stats func() SweepStats) prometheus.Collector {
	ns, cl := m.namespace, m.labels("store", name)
	return &statsCollector{
		descs: []*prometheus.Desc{
			desc(ns, "sweep_deleted_total", "Expired records deleted by the sweeper.", nil, cl),
			desc(ns, "sweep_passes_total", "Sweeper passes run.", nil, cl),
			desc(ns, "sweep_last_failed", "1 when the sweeper's last pass failed.", nil, cl),
		},
		read: func(ch chan<- prometheus.Metric, d []*prometheus.Desc) {
			s := stats()
			failed := 0.0
			if s.Failed {
				failed = 1
			}
			ch <- counterOf(d[0], float64(s.Deleted))
			ch <- counterOf(d[1], float64(s.Passes))
			ch <- gaugeOf(d[2], failed)
		},
	}
}

// labels returns the constant labels plus the pairs kv.
func (m *Metrics) labels(kv ...string) prometheus.Labels {
	l := prometheus.Labels{}
	for k, v := range m.constant {
		l[k] = v
	}
	for i := 0; i+1 < len(kv); i += 2 {
		l[kv[i]] = kv[i+1]
	}
	return l
}
