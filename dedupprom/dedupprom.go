package dedupprom

import (
	"context"
	"errors"
	"net/http"
	"strconv"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/deduphttp"
	"github.com/dedupkit/dedup/internal/scopelabel"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Other is the scope label of every scope past the cap or outside the
// allowlist.
const Other = scopelabel.Other

// An Option configures [New].
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	namespace string
	maxScopes int
	allow     []string
	scopeFn   func(string) string
	buckets   []float64
	constant  prometheus.Labels
}

func defaultConfig() config {
	return config{
		namespace: "dedup",
		maxScopes: 100,
		buckets:   []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5},
	}
}

func (c *config) validate() error {
	if c.namespace == "" {
		return &dedup.ArgumentError{Arg: "namespace", Reason: "is empty"}
	}
	if c.maxScopes < 0 || c.maxScopes > 10000 {
		return &dedup.ArgumentError{Arg: "max scopes", Reason: "must be between 0 and 10000, got " + strconv.Itoa(c.maxScopes)}
	}
	if len(c.buckets) == 0 {
		return &dedup.ArgumentError{Arg: "buckets", Reason: "is empty"}
	}
	for i := 1; i < len(c.buckets); i++ {
		if c.buckets[i] <= c.buckets[i-1] {
			return &dedup.ArgumentError{Arg: "buckets", Reason: "must be strictly increasing"}
		}
	}
	return nil
}

// WithNamespace sets the prefix of every metric name. Default "dedup".
func WithNamespace(ns string) Option { return optionFunc(func(c *config) { c.namespace = ns }) }

// WithMaxScopes sets how many distinct key scopes get a label value of
// their own: the first n seen; every later scope is counted under
// [Other]. 0 counts every scope as Other. Default 100, at most 10,000.
func WithMaxScopes(n int) Option { return optionFunc(func(c *config) { c.maxScopes = n }) }

// WithScopes sets the exact scopes that keep their name; every other scope
// is counted under [Other] (the cap of [WithMaxScopes] no longer applies).
// Default: no allowlist.
func WithScopes(scopes ...string) Option {
	return optionFunc(func(c *config) { c.allow = append(c.allow, scopes...) })
}

// WithScopeLabel rewrites a key scope before it becomes a label value, for
// scopes that embed a tenant or another unbounded part
// ("tenant-42/payments" -> "payments"). The allowlist or cap applies to
// the rewritten value. Default: the scope as it is.
func WithScopeLabel(f func(scope string) string) Option {
	return optionFunc(func(c *config) { c.scopeFn = f })
}

// WithBuckets sets the latency histogram buckets, in seconds. Default from
// 100 us to 2.5 s.
func WithBuckets(b ...float64) Option {
	return optionFunc(func(c *config) { c.buckets = append([]float64(nil), b...) })
}

// WithConstLabels adds labels with fixed values to every metric (an
// instance or a service name). Default none.
func WithConstLabels(l prometheus.Labels) Option {
	return optionFunc(func(c *config) { c.constant = l })
}

// Metrics is a Prometheus collector fed by the root hooks and the
// consumer's observer. Register it once (prometheus.Registerer.Register)
// and pass it to every part: dedup.WithHooks(m), layered.WithHooks(m),
// consumer.WithObserver(m.Observer("orders")). It is safe for concurrent
// use; an event costs one map lookup (two for a scope past the cap or
// with a rewrite) and atomic adds, and no allocation once its series
// exist.
type Metrics struct {
	namespace string
	constant  prometheus.Labels
	scopes    *scopelabel.Limiter

	claims, duplicates, takeovers     *prometheus.CounterVec
	finishes, storeErrors             *prometheus.CounterVec
	claimSeconds, finishSeconds       *prometheus.HistogramVec
	decisions, failures, redeliveries *prometheus.CounterVec
	httpRequests                      *prometheus.CounterVec
	httpSeconds                       *prometheus.HistogramVec
	sweepDeleted                      *prometheus.CounterVec
	sweepSeconds                      *prometheus.HistogramVec
	collectors                        []prometheus.Collector

	byScope   *scopelabel.Cache[scopeSeries]
	byStore   *scopelabel.Cache[storeSeries]
	byMessage *scopelabel.Cache[decisionSeries]
	byGroup   *scopelabel.Cache[groupSeries]
}

// scopeSeries are the counters of one (store, scope label).
type scopeSeries struct {
	claims              [5]prometheus.Counter // by Outcome; [0] = error
	duplicate, takeover prometheus.Counter
	claimSeconds        prometheus.Observer // the store's
}

// storeSeries are the series of one store (no scope: histograms and
// errors are per store).
type storeSeries struct {
	claimSeconds prometheus.Observer
	finish       [3][3]prometheus.Counter // op x result
	finishSecs   [3]prometheus.Observer
}

// decisionSeries are the decision counters of one (consumer, scope label).
type decisionSeries struct{ action [5]prometheus.Counter }

// groupSeries are the per-consumer series.
type groupSeries struct {
	class      [5]prometheus.Counter
	redelivery prometheus.Counter
}

var (
	ops          = [3]string{"complete", "release", "keep"}
	finishResult = [3]string{"ok", "lease_lost", "error"}
	actions      = [5]string{"applied", "duplicate", "retry", "dead_lettered", "rejected"}
	classes      = [5]string{"unclassified", "transient", "permanent", "business", "unknown"}
)

// New returns the metrics, or an [*dedup.ArgumentError] for a bad option.
// Nothing is registered: register the result.
func New(opts ...Option) (*Metrics, error) {
	cfg := defaultConfig()
	for _, o := range opts {
		if o != nil {
			o.apply(&cfg)
		}
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	ns, cl := cfg.namespace, cfg.constant
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: name, Help: help, ConstLabels: cl}, labels)
	}
	hist := func(name, help string, labels ...string) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: name, Help: help, ConstLabels: cl, Buckets: cfg.buckets}, labels)
	}
	m := &Metrics{
		namespace:     ns,
		constant:      cl,
		scopes:        scopelabel.New(cfg.maxScopes, cfg.allow, cfg.scopeFn),
		claims:        counter("claims_total", "Claims by store, scope and outcome (acquired, duplicate, in_progress, fingerprint_mismatch, error).", "store", "scope", "outcome"),
		duplicates:    counter("duplicates_total", "Duplicates by the store or layer that caught them and scope.", "store", "scope"),
		takeovers:     counter("takeovers_total", "Expired leases taken over (the previous owner probably crashed mid-effect).", "store", "scope"),
		finishes:      counter("finishes_total", "Ends of claims by store, op (complete, release, keep) and result (ok, lease_lost, error).", "store", "op", "result"),
		storeErrors:   counter("store_errors_total", "Failed store calls (fail-closed events) by store and op.", "store", "op"),
		claimSeconds:  hist("claim_duration_seconds", "Store latency of a claim.", "store"),
		finishSeconds: hist("finish_duration_seconds", "Store latency of a complete or release.", "store", "op"),
		decisions:     counter("consumer_decisions_total", "Consumer decisions by consumer, scope and action (applied, duplicate, retry, dead_lettered, rejected).", "consumer", "scope", "action"),
		failures:      counter("consumer_failures_total", "Failed handler runs by consumer and failure class (unclassified, transient, permanent, business, unknown).", "consumer", "class"),
		redeliveries:  counter("consumer_redeliveries_total", "Messages the broker delivered more than once.", "consumer"),
		httpRequests:  counter("http_requests_total", "Keyed HTTP requests by handler, class (rejected, store_unavailable, in_progress, key_reused, replayed, stored, released, held) and status code.", "handler", "class", "code"),
		httpSeconds:   hist("http_request_duration_seconds", "Time from a keyed request's arrival to its key stored, released or held.", "handler", "class"),
		sweepDeleted:  counter("sweep_rows_deleted_total", "Expired records deleted by sweeper passes (sweep hook).", "store"),
		sweepSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "sweep_pass_duration_seconds",
			Help: "Duration of sweeper passes by store and result (ok, error); the count is the passes (sweep hook).", ConstLabels: cl,
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 10)}, []string{"store", "result"}),
	}
	m.collectors = []prometheus.Collector{m.claims, m.duplicates, m.takeovers, m.finishes, m.storeErrors,
		m.claimSeconds, m.finishSeconds, m.decisions, m.failures, m.redeliveries, m.httpRequests, m.httpSeconds, m.sweepDeleted, m.sweepSeconds}
	m.byScope = scopelabel.NewCache(func(p scopelabel.Pair) *scopeSeries {
		s := &scopeSeries{duplicate: m.duplicates.WithLabelValues(p.A, p.B), takeover: m.takeovers.WithLabelValues(p.A, p.B),
			claimSeconds: m.claimSeconds.WithLabelValues(p.A)}
		s.claims[0] = m.claims.WithLabelValues(p.A, p.B, "error")
		for o := dedup.Acquired; o <= dedup.Mismatch; o++ {
			s.claims[o] = m.claims.WithLabelValues(p.A, p.B, o.String())
		}
		return s
	})
	m.byStore = scopelabel.NewCache(func(p scopelabel.Pair) *storeSeries {
		s := &storeSeries{claimSeconds: m.claimSeconds.WithLabelValues(p.A)}
		for i, op := range ops {
			s.finishSecs[i] = m.finishSeconds.WithLabelValues(p.A, op)
			for j, r := range finishResult {
				s.finish[i][j] = m.finishes.WithLabelValues(p.A, op, r)
			}
		}
		return s
	})
	m.byMessage = scopelabel.NewCache(func(p scopelabel.Pair) *decisionSeries {
		s := &decisionSeries{}
		for i, a := range actions {
			s.action[i] = m.decisions.WithLabelValues(p.A, p.B, a)
		}
		return s
	})
	m.byGroup = scopelabel.NewCache(func(p scopelabel.Pair) *groupSeries {
		s := &groupSeries{redelivery: m.redeliveries.WithLabelValues(p.A)}
		for i, c := range classes {
			s.class[i] = m.failures.WithLabelValues(p.A, c)
		}
		return s
	})
	return m, nil
}

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range m.collectors {
		c.Describe(ch)
	}
}

// Collect implements prometheus.Collector.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	for _, c := range m.collectors {
		c.Collect(ch)
	}
}

// ScopeLabel returns the label value events of scope are counted under.
func (m *Metrics) ScopeLabel(scope string) string { return m.scopes.Label(scope) }

func (m *Metrics) scope(store, scope string) *scopeSeries {
	return m.byScope.Scoped(store, scope, m.scopes)
}

// OnClaim implements [dedup.ClaimHook]: claims_total and
// claim_duration_seconds.
func (m *Metrics) OnClaim(_ context.Context, e dedup.ClaimEvent) {
	s := m.scope(e.Store, e.Key.Scope)
	o := int(e.Outcome)
	if e.Err != nil || o >= len(s.claims) {
		o = 0
	}
	s.claims[o].Inc()
	if e.Duration > 0 {
		s.claimSeconds.Observe(e.Duration.Seconds())
	}
}

// OnDuplicate implements [dedup.DuplicateHook]: duplicates_total by the
// layer that caught it.
func (m *Metrics) OnDuplicate(_ context.Context, e dedup.DuplicateEvent) {
	m.scope(e.Store, e.Key.Scope).duplicate.Inc()
}

// OnTakeover implements [dedup.TakeoverHook]: takeovers_total.
func (m *Metrics) OnTakeover(_ context.Context, e dedup.TakeoverEvent) {
	m.scope(e.Store, e.Key.Scope).takeover.Inc()
}

// OnFinish implements [dedup.FinishHook]: finishes_total and
// finish_duration_seconds.
func (m *Metrics) OnFinish(_ context.Context, e dedup.FinishEvent) {
	var op int
	switch e.Op {
	case "complete":
		op = 0
	case "release":
		op = 1
	case "keep":
		op = 2
	default:
		return
	}
	r := 0
	switch {
	case e.Err == nil:
	case errors.Is(e.Err, dedup.ErrLeaseLost):
		r = 1
	default:
		r = 2
	}
	s := m.byStore.Get(scopelabel.Pair{A: e.Store})
	s.finish[op][r].Inc()
	if op != 2 {
		s.finishSecs[op].Observe(e.Duration.Seconds())
	}
}

// OnStoreError implements [dedup.StoreErrorHook]: store_errors_total.
func (m *Metrics) OnStoreError(_ context.Context, e dedup.StoreErrorEvent) {
	m.storeErrors.WithLabelValues(e.Store, e.Op).Inc()
}

// OnSweep implements [dedup.SweepHook]: sweep_rows_deleted_total and
// sweep_pass_duration_seconds (by result ok or error).
func (m *Metrics) OnSweep(_ context.Context, e dedup.SweepEvent) {
	result := "ok"
	if e.Err != nil {
		result = "error"
	}
	if e.Deleted > 0 {
		m.sweepDeleted.WithLabelValues(e.Store).Add(float64(e.Deleted))
	} else {
		m.sweepDeleted.WithLabelValues(e.Store) // the series exists from the first pass
	}
	m.sweepSeconds.WithLabelValues(e.Store, result).Observe(e.Duration.Seconds())
}

// Observer returns a decision observer for [consumer.WithObserver] that
// counts consumer_decisions_total, consumer_failures_total and
// consumer_redeliveries_total under the consumer label name (a consumer
// group: a bounded name the user chooses).
func (m *Metrics) Observer(name string) func(*consumer.Message, consumer.Decision) {
	g := m.byGroup.Get(scopelabel.Pair{A: name})
	return func(msg *consumer.Message, d consumer.Decision) {
		m.observe(g, name, msg, d)
	}
}

// observe counts one decision; Observer binds g and name.
func (m *Metrics) observe(g *groupSeries, name string, msg *consumer.Message, d consumer.Decision) {
	a := -1
	switch d.Action {
	case consumer.Ack:
		a = 0
		if d.Duplicate {
			a = 1
		}
	case consumer.Retry:
		a = 2
	case consumer.DeadLettered:
		a = 3
	case consumer.Rejected:
		a = 4
	}
	if a >= 0 {
		m.byMessage.Scoped(name, d.Key.Scope, m.scopes).action[a].Inc()
	}
	if a >= 2 && int(d.Class) < len(g.class) {
		g.class[d.Class].Inc()
	}
	if msg != nil && msg.Delivery > 1 {
		g.redelivery.Inc()
	}
}

// Handler serves g's metrics in the Prometheus text format: mount it on
// an admin listener's /metrics.
func Handler(g prometheus.Gatherer) http.Handler {
	return promhttp.HandlerFor(g, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError})
}

// HTTPObserver returns a function for [deduphttp.WithOnDone] that counts
// http_requests_total and observes http_request_duration_seconds under
// the handler label name (the route or service: a bounded name the user
// chooses). The tenant and the key are never labels.
func (m *Metrics) HTTPObserver(name string) func(*http.Request, deduphttp.Event) {
	return func(_ *http.Request, e deduphttp.Event) {
		m.httpRequests.WithLabelValues(name, string(e.Class), statusLabel(e.Status)).Inc()
		m.httpSeconds.WithLabelValues(name, string(e.Class)).Observe(e.Duration.Seconds())
	}
}

// statusLabel bounds a status code label to the valid codes.
func statusLabel(code int) string {
	if code < 100 || code > 599 {
		return "other"
	}
	return strconv.Itoa(code)
}
