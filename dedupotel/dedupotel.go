package dedupotel

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/internal/scopelabel"
	"github.com/dedupkit/dedup/outbox"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of the meter and the tracer.
const ScopeName = "github.com/dedupkit/dedup/dedupotel"

// Other is the dedup.scope attribute of every scope past the cap or
// outside the allowlist, on metrics (spans carry the scope as it is).
const Other = scopelabel.Other

// Attribute keys. The messaging ones are OpenTelemetry's semantic
// conventions; the dedup ones are this package's.
const (
	AttrMessagingSystem      = attribute.Key("messaging.system")
	AttrDestinationName      = attribute.Key("messaging.destination.name")
	AttrConsumerGroup        = attribute.Key("messaging.consumer.group.name")
	AttrOperationName        = attribute.Key("messaging.operation.name")
	AttrOperationType        = attribute.Key("messaging.operation.type")
	AttrMessageID            = attribute.Key("messaging.message.id")
	AttrBatchCount           = attribute.Key("messaging.batch.message_count")
	AttrErrorType            = attribute.Key("error.type")
	AttrStore                = attribute.Key("dedup.store")
	AttrScope                = attribute.Key("dedup.scope")
	AttrOutcome              = attribute.Key("dedup.outcome")
	AttrOp                   = attribute.Key("dedup.operation")
	AttrResult               = attribute.Key("dedup.result")
	AttrAction               = attribute.Key("dedup.action")
	AttrDuplicate            = attribute.Key("dedup.duplicate")
	AttrHandlerRan           = attribute.Key("dedup.handler_ran")
	AttrAttempt              = attribute.Key("dedup.attempt")
	AttrTakenOver            = attribute.Key("dedup.taken_over")
	AttrRelay                = attribute.Key("dedup.relay")
	AttrOutboxPartition      = attribute.Key("dedup.outbox.partition")
	AttrDestinationPartition = attribute.Key("messaging.destination.partition.id")
)

// An Option configures [New].
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	mp        metric.MeterProvider
	tp        trace.TracerProvider
	prop      propagation.TextMapPropagator
	system    string
	maxScopes int
	allow     []string
	scopeFn   func(string) string
}

// WithMeterProvider sets where measurements go. Default: the global
// provider (otel.GetMeterProvider).
func WithMeterProvider(mp metric.MeterProvider) Option {
	return optionFunc(func(c *config) { c.mp = mp })
}

// WithTracerProvider sets where spans go. Default: the global provider
// (otel.GetTracerProvider).
func WithTracerProvider(tp trace.TracerProvider) Option {
	return optionFunc(func(c *config) { c.tp = tp })
}

// WithPropagator sets how trace context is written into and read from
// message headers. Default: W3C Trace Context (traceparent, tracestate).
func WithPropagator(p propagation.TextMapPropagator) Option {
	return optionFunc(func(c *config) { c.prop = p })
}

// WithSystem sets the messaging.system attribute of consumer spans and
// metrics ("nats", "rabbitmq", "kafka"). Default "nats".
func WithSystem(s string) Option { return optionFunc(func(c *config) { c.system = s }) }

// WithMaxScopes sets how many distinct key scopes get a dedup.scope value
// of their own on metrics; later ones are counted under [Other]. Default
// 100, at most 10,000.
func WithMaxScopes(n int) Option { return optionFunc(func(c *config) { c.maxScopes = n }) }

// WithScopes sets the exact scopes that keep their name on metrics.
// Default: no allowlist (the cap applies).
func WithScopes(scopes ...string) Option {
	return optionFunc(func(c *config) { c.allow = append(c.allow, scopes...) })
}

// WithScopeLabel rewrites a scope before it becomes a metric attribute.
// Default: the scope as it is.
func WithScopeLabel(f func(string) string) Option {
	return optionFunc(func(c *config) { c.scopeFn = f })
}

// Telemetry records the events of dedup as OpenTelemetry metrics and
// spans, on the API only: the application chooses the SDK. It implements
// the root hook interfaces; give it to dedup.WithHooks and
// layered.WithHooks, wrap consumer handlers with [Telemetry.Handler] and
// observe decisions with [Telemetry.Observer]. Safe for concurrent use.
type Telemetry struct {
	cfg    config
	tracer trace.Tracer
	scopes *scopelabel.Limiter

	claims, duplicates, takeovers, decisions       metric.Int64ObservableCounter
	storeErrors, httpRequests                      metric.Int64Counter
	claimDuration, finishDuration, processDuration metric.Float64Histogram
	sweepDeleted                                   metric.Int64Counter
	sweepDuration                                  metric.Float64Histogram

	byScope   *scopelabel.Cache[scopeSets]
	byStore   *scopelabel.Cache[storeSets]
	byMessage *scopelabel.Cache[decisionSets]
	byHTTP    *scopelabel.Cache[httpSets]

	// Every series of the counters observed at collection; appended to
	// by the caches' constructors (under their locks) and read by the
	// callback.
	mu        sync.Mutex
	scopeAll  []*scopeSets
	actionAll []*decisionSets
	reg       metric.Registration
}

// The counters of one (store, scope label) are atomic counts that the
// meter observes at collection (asynchronous counters): an event costs
// an atomic add instead of a measurement through the SDK, whose per-call
// attribute handling costs more than the rest of the event. Histograms
// have no asynchronous form and are recorded per event with pre-built
// attribute options, so an event allocates nothing to describe itself.
type scopeSets struct {
	claims              [5]atomic.Int64 // by Outcome; [0] = error
	duplicate, takeover atomic.Int64
	claimSets           [5]metric.ObserveOption
	base                metric.ObserveOption // store and scope
}

type storeSets struct {
	claim  []metric.RecordOption
	finish [3][3][]metric.RecordOption // op x result
}

type decisionSets struct {
	action     [5]atomic.Int64
	actionSets [5]metric.ObserveOption
	process    [6][]metric.RecordOption // [0] ok, [1+class] error
}

var (
	ops          = [3]string{"complete", "release", "keep"}
	finishResult = [3]string{"ok", "lease_lost", "error"}
	actions      = [5]string{"applied", "duplicate", "retry", "dead_lettered", "rejected"}
)

// New returns the telemetry, or an [*dedup.ArgumentError] for a bad
// option or an instrument the meter refused.
func New(opts ...Option) (*Telemetry, error) {
	cfg := config{system: "nats", maxScopes: 100}
	for _, o := range opts {
		if o != nil {
			o.apply(&cfg)
		}
	}
	if cfg.mp == nil {
		cfg.mp = otel.GetMeterProvider()
	}
	if cfg.tp == nil {
		cfg.tp = otel.GetTracerProvider()
	}
	if cfg.prop == nil {
		cfg.prop = propagation.TraceContext{}
	}
	switch {
	case cfg.system == "":
		return nil, &dedup.ArgumentError{Arg: "messaging system", Reason: "is empty"}
	case cfg.maxScopes < 0 || cfg.maxScopes > 10000:
		return nil, &dedup.ArgumentError{Arg: "max scopes", Reason: "must be between 0 and 10000, got " + strconv.Itoa(cfg.maxScopes)}
	}
	t := &Telemetry{cfg: cfg, tracer: cfg.tp.Tracer(ScopeName), scopes: scopelabel.New(cfg.maxScopes, cfg.allow, cfg.scopeFn)}
	mt := cfg.mp.Meter(ScopeName)
	var errs []error
	counter := func(name, unit, desc string) metric.Int64Counter {
		c, err := mt.Int64Counter(name, metric.WithUnit(unit), metric.WithDescription(desc))
		errs = append(errs, err)
		return c
	}
	observed := func(name, unit, desc string) metric.Int64ObservableCounter {
		c, err := mt.Int64ObservableCounter(name, metric.WithUnit(unit), metric.WithDescription(desc))
		errs = append(errs, err)
		return c
	}
	hist := func(name, desc string) metric.Float64Histogram {
		h, err := mt.Float64Histogram(name, metric.WithUnit("s"), metric.WithDescription(desc),
			metric.WithExplicitBucketBoundaries(.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
		errs = append(errs, err)
		return h
	}
	t.claims = observed("dedup.claims", "{claim}", "Claims by store, scope and outcome.")
	t.duplicates = observed("dedup.duplicates", "{message}", "Duplicates by the store or layer that caught them.")
	t.takeovers = observed("dedup.takeovers", "{claim}", "Expired leases taken over.")
	t.storeErrors = counter("dedup.store.errors", "{error}", "Failed store calls (fail closed).")
	t.decisions = observed("dedup.consumer.decisions", "{message}", "Consumer decisions by action.")
	t.httpRequests = counter("dedup.http.requests", "{request}", "Keyed HTTP requests by route, class and status code.")
	t.claimDuration = hist("dedup.claim.duration", "Store latency of a claim.")
	t.finishDuration = hist("dedup.finish.duration", "Ends of claims (complete, release, keep) by result, with the store latency.")
	t.processDuration = hist("messaging.process.duration", "Duration of a handler run on a message.")
	t.sweepDeleted = counter("dedup.sweep.deleted", "{record}", "Expired records deleted by sweeper passes.")
	t.sweepDuration = hist("dedup.sweep.duration", "Duration of sweeper passes by store and result (ok, error).")
	if err := errors.Join(errs...); err == nil {
		t.reg, err = mt.RegisterCallback(t.observe, t.claims, t.duplicates, t.takeovers, t.decisions)
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, &dedup.ArgumentError{Arg: "meter provider", Reason: "refused an instrument: " + err.Error()}
	}
	set := func(kv ...attribute.KeyValue) metric.MeasurementOption {
		return metric.WithAttributeSet(attribute.NewSet(kv...))
	}
	t.byScope = scopelabel.NewCache(func(p scopelabel.Pair) *scopeSets {
		base := []attribute.KeyValue{AttrStore.String(p.A), AttrScope.String(p.B)}
		s := &scopeSets{base: set(base...)}
		s.claimSets[0] = set(append(base, AttrOutcome.String("error"))...)
		for o := dedup.Acquired; o <= dedup.Mismatch; o++ {
			s.claimSets[o] = set(append(base, AttrOutcome.String(o.String()))...)
		}
		t.mu.Lock()
		t.scopeAll = append(t.scopeAll, s)
		t.mu.Unlock()
		return s
	})
	t.byStore = scopelabel.NewCache(func(p scopelabel.Pair) *storeSets {
		s := &storeSets{claim: []metric.RecordOption{set(AttrStore.String(p.A))}}
		for i, op := range ops {
			for j, r := range finishResult {
				s.finish[i][j] = []metric.RecordOption{set(AttrStore.String(p.A), AttrOp.String(op), AttrResult.String(r))}
			}
		}
		return s
	})
	t.byMessage = scopelabel.NewCache(func(p scopelabel.Pair) *decisionSets {
		sys, group := AttrMessagingSystem.String(cfg.system), AttrConsumerGroup.String(p.A)
		s := &decisionSets{}
		for i, a := range actions {
			s.actionSets[i] = set(sys, group, AttrScope.String(p.B), AttrAction.String(a))
		}
		s.process[0] = []metric.RecordOption{set(sys, group, AttrOperationName.String("process"))}
		for c := range 5 {
			s.process[c+1] = []metric.RecordOption{set(sys, group, AttrOperationName.String("process"), AttrErrorType.String(consumer.Class(c).String()))}
		}
		t.mu.Lock()
		t.actionAll = append(t.actionAll, s)
		t.mu.Unlock()
		return s
	})
	t.byHTTP = scopelabel.NewCache(func(p scopelabel.Pair) *httpSets {
		class, code, _ := strings.Cut(p.B, " ")
		n, _ := strconv.Atoi(code)
		return &httpSets{add: []metric.AddOption{set(AttrHTTPRoute.String(p.A), AttrHTTPClass.String(class), AttrHTTPStatus.Int(n))}}
	})
	return t, nil
}

// observe reports the asynchronous counters at collection: every series
// counted so far (a series appears once its first event is counted).
func (t *Telemetry) observe(_ context.Context, o metric.Observer) error {
	t.mu.Lock()
	scopes, acts := t.scopeAll, t.actionAll
	t.mu.Unlock()
	for _, s := range scopes {
		for i := range s.claims {
			if v := s.claims[i].Load(); v > 0 {
				o.ObserveInt64(t.claims, v, s.claimSets[i])
			}
		}
		if v := s.duplicate.Load(); v > 0 {
			o.ObserveInt64(t.duplicates, v, s.base)
		}
		if v := s.takeover.Load(); v > 0 {
			o.ObserveInt64(t.takeovers, v, s.base)
		}
	}
	for _, s := range acts {
		for i := range s.action {
			if v := s.action[i].Load(); v > 0 {
				o.ObserveInt64(t.decisions, v, s.actionSets[i])
			}
		}
	}
	return nil
}

func (t *Telemetry) scope(store, scope string) *scopeSets {
	return t.byScope.Scoped(store, scope, t.scopes)
}

// OnClaim implements [dedup.ClaimHook]: dedup.claims and
// dedup.claim.duration.
func (t *Telemetry) OnClaim(ctx context.Context, e dedup.ClaimEvent) {
	s := t.scope(e.Store, e.Key.Scope)
	o := int(e.Outcome)
	if e.Err != nil || o >= len(s.claims) {
		o = 0
	}
	s.claims[o].Add(1)
	if e.Duration > 0 {
		t.claimDuration.Record(ctx, e.Duration.Seconds(), t.byStore.Get(scopelabel.Pair{A: e.Store}).claim...)
	}
}

// OnDuplicate implements [dedup.DuplicateHook]: dedup.duplicates.
func (t *Telemetry) OnDuplicate(ctx context.Context, e dedup.DuplicateEvent) {
	t.scope(e.Store, e.Key.Scope).duplicate.Add(1)
}

// OnTakeover implements [dedup.TakeoverHook]: dedup.takeovers, and an
// event on the current span.
func (t *Telemetry) OnTakeover(ctx context.Context, e dedup.TakeoverEvent) {
	t.scope(e.Store, e.Key.Scope).takeover.Add(1)
	if sp := trace.SpanFromContext(ctx); sp.IsRecording() {
		sp.AddEvent("dedup.takeover", trace.WithAttributes(AttrStore.String(e.Store), AttrAttempt.Int(e.Attempt)))
	}
}

// OnFinish implements [dedup.FinishHook]: dedup.finish.duration, whose
// count by dedup.operation and dedup.result counts the ends of claims (a
// keep has no store call: its duration is 0).
func (t *Telemetry) OnFinish(ctx context.Context, e dedup.FinishEvent) {
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
	t.finishDuration.Record(ctx, e.Duration.Seconds(), t.byStore.Get(scopelabel.Pair{A: e.Store}).finish[op][r]...)
}

// OnStoreError implements [dedup.StoreErrorHook]: dedup.store.errors.
func (t *Telemetry) OnStoreError(ctx context.Context, e dedup.StoreErrorEvent) {
	t.storeErrors.Add(ctx, 1, metric.WithAttributes(AttrStore.String(e.Store), AttrOp.String(e.Op)))
}

// OnSweep implements [dedup.SweepHook]: dedup.sweep.deleted and
// dedup.sweep.duration (by dedup.result ok or error). A pass runs about
// once a minute, so its attributes are built per call.
func (t *Telemetry) OnSweep(ctx context.Context, e dedup.SweepEvent) {
	result := "ok"
	if e.Err != nil {
		result = "error"
	}
	t.sweepDeleted.Add(ctx, e.Deleted, metric.WithAttributes(AttrStore.String(e.Store)))
	t.sweepDuration.Record(ctx, e.Duration.Seconds(), metric.WithAttributes(AttrStore.String(e.Store), AttrResult.String(result)))
}

// Observer returns a decision observer for [consumer.WithObserver] under
// the consumer group name: dedup.consumer.decisions, and for a duplicate (the handler did
// not run) a "process" span linked to the producer's span, with
// dedup.duplicate=true and dedup.handler_ran=false.
func (t *Telemetry) Observer(group string) func(*consumer.Message, consumer.Decision) {
	return func(m *consumer.Message, d consumer.Decision) {
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
		ctx := context.Background()
		s := t.byMessage.Scoped(group, d.Key.Scope, t.scopes)
		if a >= 0 {
			s.action[a].Add(1)
		}
		if d.Duplicate && m != nil {
			_, sp := t.startProcess(ctx, group, m, d.Key)
			sp.SetAttributes(AttrDuplicate.Bool(true), AttrHandlerRan.Bool(false))
			sp.End()
		}
	}
}

// Handler wraps h so that each run on a message is a "process" span of
// kind consumer: a child of the producer's span carried in the message
// headers (or of the span already in ctx, with a link to the producer's),
// with the messaging semantic-convention attributes, the dedup key's
// scope, attempt and take-over, and error.type set to the failure class
// when h fails. The run's duration is recorded as
// messaging.process.duration.
func (t *Telemetry) Handler(group string, h consumer.Handler) consumer.Handler {
	return func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		ctx, sp := t.startProcess(ctx, group, m, d.Key)
		rec := sp.IsRecording()
		if rec {
			sp.SetAttributes(AttrDuplicate.Bool(false), AttrHandlerRan.Bool(true), AttrAttempt.Int(d.Attempt), AttrTakenOver.Bool(d.TakenOver))
		}
		start := time.Now()
		out, err := h(ctx, m, d)
		s := t.byMessage.Scoped(group, d.Key.Scope, t.scopes)
		idx := 0
		if err != nil {
			c := consumer.ClassOf(err)
			if int(c) < 5 {
				idx = int(c) + 1
			}
			if rec {
				sp.SetAttributes(AttrErrorType.String(c.String()))
				sp.SetStatus(codes.Error, c.String())
			}
		}
		t.processDuration.Record(ctx, time.Since(start).Seconds(), s.process[idx]...)
		sp.End()
		return out, err
	}
}

var consumerKind = []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer)}

// startProcess starts the span of processing m. The name, link and
// attributes are set only on a recording span, so that a non-recording
// tracer (the API's default) costs no allocation; a sampler therefore sees
// the parent and the kind, not the attributes.
func (t *Telemetry) startProcess(ctx context.Context, group string, m *consumer.Message, key dedup.Key) (context.Context, trace.Span) {
	producer := trace.SpanContextFromContext(t.cfg.prop.Extract(context.Background(), propagation.MapCarrier(m.Headers)))
	if producer.IsValid() && !trace.SpanContextFromContext(ctx).IsValid() {
		ctx = trace.ContextWithRemoteSpanContext(ctx, producer)
	}
	ctx, sp := t.tracer.Start(ctx, "process", consumerKind...)
	if !sp.IsRecording() {
		return ctx, sp
	}
	sp.SetName("process " + m.Subject)
	if producer.IsValid() {
		sp.AddLink(trace.Link{SpanContext: producer})
	}
	sp.SetAttributes(
		AttrMessagingSystem.String(t.cfg.system), AttrOperationName.String("process"), AttrOperationType.String("process"),
		AttrDestinationName.String(m.Subject), AttrConsumerGroup.String(group), AttrMessageID.String(m.ID),
		AttrScope.String(key.Scope))
	return ctx, sp
}

// Inject writes the trace context of ctx into headers (traceparent and
// tracestate with the default propagator) and returns them, making the
// map when headers is nil. Call it on an outbox message's Headers inside
// the business transaction, so the relay and every consumer continue the
// trace.
func (t *Telemetry) Inject(ctx context.Context, headers map[string]string) map[string]string {
	return inject(t.cfg.prop, ctx, headers)
}

// Extract returns ctx with the remote span context carried in headers.
func (t *Telemetry) Extract(ctx context.Context, headers map[string]string) context.Context {
	return t.cfg.prop.Extract(ctx, propagation.MapCarrier(headers))
}

// Inject writes the trace context of ctx into headers with the W3C Trace
// Context propagator; see [Telemetry.Inject].
func Inject(ctx context.Context, headers map[string]string) map[string]string {
	return inject(propagation.TraceContext{}, ctx, headers)
}

// Extract returns ctx with the remote span context that headers carry in
// W3C Trace Context form.
func Extract(ctx context.Context, headers map[string]string) context.Context {
	return propagation.TraceContext{}.Extract(ctx, propagation.MapCarrier(headers))
}

func inject(p propagation.TextMapPropagator, ctx context.Context, headers map[string]string) map[string]string {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return headers
	}
	if headers == nil {
		headers = make(map[string]string, 2)
	}
	p.Inject(ctx, propagation.MapCarrier(headers))
	return headers
}

// PublishedHook returns a function for [outbox.WithPublishedHook] that
// records what relay published: a "publish" span of kind producer per
// batch, linked to each message's trace, and a "send <topic>" span per
// message, a child of the trace its headers carry, so the business
// transaction's trace shows the publish. The hook runs after the broker
// acknowledged the batch, so the spans mark that moment rather than
// measure the publish.
func (t *Telemetry) PublishedHook(relay string) func(partition int, msgs []outbox.Message) {
	return func(partition int, msgs []outbox.Message) {
		ctx := context.Background()
		links := make([]trace.Link, 0, len(msgs))
		for i := range msgs {
			if sc := trace.SpanContextFromContext(t.Extract(ctx, msgs[i].Headers)); sc.IsValid() {
				links = append(links, trace.Link{SpanContext: sc})
			}
		}
		_, batch := t.tracer.Start(ctx, "publish", trace.WithSpanKind(trace.SpanKindProducer), trace.WithLinks(links...),
			trace.WithAttributes(AttrMessagingSystem.String(t.cfg.system), AttrOperationName.String("publish"), AttrOperationType.String("send"),
				AttrRelay.String(relay), AttrOutboxPartition.Int(partition), AttrBatchCount.Int(len(msgs))))
		for i := range msgs {
			m := &msgs[i]
			mctx := t.Extract(ctx, m.Headers)
			if !trace.SpanContextFromContext(mctx).IsValid() {
				continue
			}
			_, sp := t.tracer.Start(mctx, "send "+m.Topic, trace.WithSpanKind(trace.SpanKindProducer),
				trace.WithLinks(trace.Link{SpanContext: batch.SpanContext()}),
				trace.WithAttributes(AttrMessagingSystem.String(t.cfg.system), AttrOperationName.String("send"), AttrOperationType.String("send"),
					AttrDestinationName.String(m.Topic), AttrMessageID.String(m.ID), AttrRelay.String(relay)))
			sp.End()
		}
		batch.End()
	}
}
