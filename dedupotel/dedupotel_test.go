package dedupotel_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/deduphttp"
	"github.com/dedupkit/dedup/dedupnats"
	"github.com/dedupkit/dedup/dedupotel"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

type rig struct {
	tel    *dedupotel.Telemetry
	reader *sdkmetric.ManualReader
	spans  *tracetest.InMemoryExporter
	tp     *sdktrace.TracerProvider
}

func newRig(t testing.TB, opts ...dedupotel.Option) *rig {
	t.Helper()
	r := &rig{reader: sdkmetric.NewManualReader(), spans: tracetest.NewInMemoryExporter()}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(r.reader))
	r.tp = sdktrace.NewTracerProvider(sdktrace.WithSyncer(r.spans))
	t.Cleanup(func() { mp.Shutdown(context.Background()); r.tp.Shutdown(context.Background()) })
	tel, err := dedupotel.New(append([]dedupotel.Option{dedupotel.WithMeterProvider(mp), dedupotel.WithTracerProvider(r.tp)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	r.tel = tel
	return r
}

// sum returns the value of the int64 sum name (the count of a histogram)
// summed over the data points whose attributes include every one of want.
func (r *rig) sum(t *testing.T, name string, want ...attribute.KeyValue) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var total int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			match := func(set attribute.Set) bool {
				for _, kv := range want {
					if v, ok := set.Value(kv.Key); !ok || v != kv.Value {
						return false
					}
				}
				return true
			}
			switch s := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, dp := range s.DataPoints {
					if match(dp.Attributes) {
						total += dp.Value
					}
				}
			case metricdata.Histogram[float64]: // the count
				for _, dp := range s.DataPoints {
					if match(dp.Attributes) {
						total += int64(dp.Count)
					}
				}
			default:
				t.Fatalf("%s is %T", name, m.Data)
			}
		}
	}
	return total
}

// TestMetrics: a Runner's claims, a duplicate, a release and a consumer's
// decisions, read back from the SDK's manual reader.
func TestMetrics(t *testing.T) {
	r := newRig(t)
	store, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	run, err := dedup.NewRunner(store, dedup.WithName("memory"), dedup.WithHooks(r.tel))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	key := dedup.Key{Scope: "payments", ID: "c1"}
	ok := func(context.Context) ([]byte, error) { return nil, nil }
	for range 3 {
		if _, err := run.Do(ctx, key, "", ok); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := run.Do(ctx, dedup.Key{Scope: "payments", ID: "c2"}, "", func(context.Context) ([]byte, error) { return nil, errors.New("x") }); err == nil {
		t.Fatal("no error")
	}
	p, err := consumer.New("orders", store, r.tel.Handler("orders", func(context.Context, *consumer.Message, consumer.Delivery) ([]byte, error) {
		return nil, nil
	}), consumer.WithScope("orders"), consumer.WithDeadLetter(&consumer.MemoryDLQ{}), consumer.WithObserver(r.tel.Observer("orders")))
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		p.Process(ctx, &consumer.Message{ID: "m1", Subject: "orders.placed"})
	}
	store1, scope := dedupotel.AttrStore.String("memory"), dedupotel.AttrScope.String("payments")
	for _, c := range []struct {
		name string
		want int64
		kv   []attribute.KeyValue
	}{
		{"dedup.claims", 2, []attribute.KeyValue{store1, scope, dedupotel.AttrOutcome.String("acquired")}},
		{"dedup.claims", 2, []attribute.KeyValue{store1, scope, dedupotel.AttrOutcome.String("duplicate")}},
		{"dedup.duplicates", 2, []attribute.KeyValue{store1, scope}},
		{"dedup.finish.duration", 1, []attribute.KeyValue{store1, dedupotel.AttrOp.String("complete"), dedupotel.AttrResult.String("ok")}},
		{"dedup.finish.duration", 1, []attribute.KeyValue{store1, dedupotel.AttrOp.String("release"), dedupotel.AttrResult.String("ok")}},
		{"dedup.consumer.decisions", 1, []attribute.KeyValue{dedupotel.AttrConsumerGroup.String("orders"), dedupotel.AttrAction.String("applied")}},
		{"dedup.consumer.decisions", 1, []attribute.KeyValue{dedupotel.AttrConsumerGroup.String("orders"), dedupotel.AttrAction.String("duplicate")}},
		{"dedup.consumer.decisions", 2, []attribute.KeyValue{dedupotel.AttrMessagingSystem.String("nats")}},
		{"messaging.process.duration", 1, []attribute.KeyValue{dedupotel.AttrConsumerGroup.String("orders"), dedupotel.AttrOperationName.String("process")}},
	} {
		if got := r.sum(t, c.name, c.kv...); got != c.want {
			t.Errorf("%s%v = %d, want %d", c.name, c.kv, got, c.want)
		}
	}
}

// TestScopeCap: 100,000 distinct scopes give at most the cap plus one
// "other" data points.
func TestScopeCap(t *testing.T) {
	r := newRig(t, dedupotel.WithMaxScopes(10))
	ctx := context.Background()
	const n = 100_000
	for i := range n {
		r.tel.OnDuplicate(ctx, dedup.DuplicateEvent{Store: "s", Key: dedup.Key{Scope: fmt.Sprint("t", i), ID: "x"}})
	}
	var rm metricdata.ResourceMetrics
	if err := r.reader.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	points := 0
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == "dedup.duplicates" {
				points = len(m.Data.(metricdata.Sum[int64]).DataPoints)
			}
		}
	}
	if points != 11 {
		t.Errorf("%d data points, want 11", points)
	}
	if got := r.sum(t, "dedup.duplicates", dedupotel.AttrScope.String(dedupotel.Other)); got != n-10 {
		t.Errorf("other = %d, want %d", got, n-10)
	}
}

func TestInjectExtract(t *testing.T) {
	r := newRig(t)
	if h := r.tel.Inject(context.Background(), nil); h != nil {
		t.Errorf("no span, yet headers %v", h)
	}
	ctx, sp := r.tp.Tracer("t").Start(context.Background(), "business")
	defer sp.End()
	h := dedupotel.Inject(ctx, nil)
	if h["traceparent"] == "" {
		t.Fatalf("no traceparent in %v", h)
	}
	got := trace.SpanContextFromContext(dedupotel.Extract(context.Background(), h))
	if got.TraceID() != sp.SpanContext().TraceID() || got.SpanID() != sp.SpanContext().SpanID() || !got.IsRemote() {
		t.Errorf("extracted %v, want %v", got, sp.SpanContext())
	}
}

// jetStream connects to the real NATS server and makes a memory stream of
// the test's own, deleted when the test ends.
func jetStream(t testing.TB) (jetstream.JetStream, string) {
	t.Helper()
	url := testenv.NATSURL(t)
	nc, err := nats.Connect(url, nats.Timeout(3*time.Second))
	if err != nil {
		if testenv.Required() {
			t.Fatalf("NATS at DEDUP_NATS_URL=%s: %v", url, err)
		}
		t.Skipf("NATS not reachable at %s (set DEDUP_NATS_URL): %v", url, err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	name := fmt.Sprintf("OTEL_%08x", rand.Uint32())
	if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: name, Subjects: []string{name + ".>"}, Storage: jetstream.MemoryStorage}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { js.DeleteStream(context.Background(), name) })
	return js, name
}

// TestTraceOutboxNATSConsumer follows one message: a business span writes
// it to a SQLite outbox with its traceparent; the relay publishes it to
// the real NATS server (a "send" span in the same trace); the NATS
// consumer runs the handler in a "process" span that is a child of the
// business span and links to it; a redelivery is a duplicate that shows
// as a linked "process" span that did not run the handler.
func TestTraceOutboxNATSConsumer(t *testing.T) {
	r := newRig(t)
	js, stream := jetStream(t)
	subject := stream + ".orders"
	ctx := context.Background()

	db, err := sqlitestore.Open(filepath.Join(t.TempDir(), "app.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	src, err := db.OutboxSource(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	bctx, business := r.tp.Tracer("app").Start(ctx, "place order")
	tx, err := db.DB().BeginTx(bctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	msg := outbox.Message{ID: "order-1-placed", Topic: subject, Key: "order/1", Payload: []byte(`{"order":1}`)}
	msg.Headers = r.tel.Inject(bctx, msg.Headers)
	if err := db.WriteOutbox(bctx, tx, msg); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	business.End()

	pub, err := dedupnats.NewOutboxPublisher(js, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	rl, err := outbox.NewRelay(src, pub, outbox.WithPollInterval(10*time.Millisecond), outbox.WithPublishedHook(r.tel.PublishedHook("relay-1")))
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() { rl.Run(ctx) })
	defer rl.Close()

	store, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu      sync.Mutex
		ran     int
		handled consumer.Message
	)
	h := func(_ context.Context, m *consumer.Message, _ consumer.Delivery) ([]byte, error) {
		mu.Lock()
		defer mu.Unlock()
		ran++
		handled = m.Clone()
		return nil, nil
	}
	p, err := consumer.New("billing", store, r.tel.Handler("billing", h), consumer.WithDeadLetter(&consumer.MemoryDLQ{}),
		consumer.WithObserver(r.tel.Observer("billing")))
	if err != nil {
		t.Fatal(err)
	}
	c, err := dedupnats.NewConsumer(js, stream, "billing", p)
	if err != nil {
		t.Fatal(err)
	}
	wg.Go(func() { c.Run(ctx) })
	defer c.Close()
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(5 * time.Millisecond) {
		mu.Lock()
		n := ran
		mu.Unlock()
		if n == 1 && c.Stats().Acked == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("never consumed: ran %d, %+v", n, c.Stats())
		}
	}
	// The redelivery of the same message (a lost ack): a duplicate.
	if d := p.Process(ctx, &handled); !d.Duplicate {
		t.Fatalf("redelivery: %+v", d)
	}
	if ran != 1 {
		t.Fatalf("handler ran %d times", ran)
	}
	c.Close()
	rl.Close()
	wg.Wait()

	bsc := business.SpanContext()
	var send, process, dup, batch *tracetest.SpanStub
	for _, s := range r.spans.GetSpans() {
		switch {
		case s.Name == "send "+subject:
			send = &s
		case s.Name == "publish":
			batch = &s
		case s.Name == "process "+subject && attr(s, dedupotel.AttrHandlerRan) == attribute.BoolValue(true):
			process = &s
		case s.Name == "process "+subject:
			dup = &s
		}
	}
	if send == nil || process == nil || dup == nil || batch == nil {
		t.Fatalf("spans: send %v process %v duplicate %v batch %v", send != nil, process != nil, dup != nil, batch != nil)
	}
	for name, s := range map[string]*tracetest.SpanStub{"send": send, "process": process, "duplicate": dup} {
		if s.SpanContext.TraceID() != bsc.TraceID() || s.Parent.SpanID() != bsc.SpanID() {
			t.Errorf("%s: trace %s parent %s, want the business span %s/%s", name, s.SpanContext.TraceID(), s.Parent.SpanID(), bsc.TraceID(), bsc.SpanID())
		}
	}
	for name, s := range map[string]*tracetest.SpanStub{"process": process, "duplicate": dup, "publish": batch} {
		if len(s.Links) != 1 || s.Links[0].SpanContext.SpanID() != bsc.SpanID() {
			t.Errorf("%s: links %v, want one to the business span", name, s.Links)
		}
	}
	if process.SpanKind != trace.SpanKindConsumer || send.SpanKind != trace.SpanKindProducer {
		t.Errorf("kinds: process %v send %v", process.SpanKind, send.SpanKind)
	}
	for k, want := range map[attribute.Key]attribute.Value{
		dedupotel.AttrMessagingSystem: attribute.StringValue("nats"),
		dedupotel.AttrDestinationName: attribute.StringValue(subject),
		dedupotel.AttrConsumerGroup:   attribute.StringValue("billing"),
		dedupotel.AttrMessageID:       attribute.StringValue("order-1-placed"),
		dedupotel.AttrOperationName:   attribute.StringValue("process"),
		dedupotel.AttrDuplicate:       attribute.BoolValue(false),
		dedupotel.AttrAttempt:         attribute.IntValue(1),
	} {
		if got := attr(*process, k); got != want {
			t.Errorf("process %s = %v, want %v", k, got.Emit(), want.Emit())
		}
	}
	if attr(*dup, dedupotel.AttrDuplicate) != attribute.BoolValue(true) || attr(*dup, dedupotel.AttrHandlerRan) != attribute.BoolValue(false) {
		t.Errorf("duplicate span attributes %v", dup.Attributes)
	}
}

func attr(s tracetest.SpanStub, k attribute.Key) attribute.Value {
	for _, kv := range s.Attributes {
		if kv.Key == k {
			return kv.Value
		}
	}
	return attribute.Value{}
}

func TestOptionErrors(t *testing.T) {
	for name, opt := range map[string]dedupotel.Option{"system": dedupotel.WithSystem(""), "cap": dedupotel.WithMaxScopes(-1)} {
		if _, err := dedupotel.New(opt); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// TestHTTP: a keyed request stored, replayed and reused with another
// payload (422) under an instrumentation span around the middleware; the
// 422 shows on the request's own span and every request is counted.
func TestHTTP(t *testing.T) {
	r := newRig(t)
	store, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	mw, err := deduphttp.New(store, deduphttp.WithSingleTenant(), deduphttp.WithOnDone(r.tel.HTTPObserver("POST /charges")))
	if err != nil {
		t.Fatal(err)
	}
	inner := mw.Required(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(201) }))
	tracer := r.tp.Tracer("server")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		ctx, sp := tracer.Start(req.Context(), "POST /charges", trace.WithSpanKind(trace.SpanKindServer))
		defer sp.End()
		inner.ServeHTTP(w, req.WithContext(ctx))
	}))
	defer srv.Close()
	for _, c := range []struct {
		body string
		want int
	}{{"a", 201}, {"a", 201}, {"b", 422}} {
		req, _ := http.NewRequest("POST", srv.URL+"/charges", strings.NewReader(c.body))
		req.Header.Set("Idempotency-Key", "k1")
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != c.want {
			t.Fatalf("%s: %d, want %d", c.body, resp.StatusCode, c.want)
		}
	}
	srv.Close()
	var classes []string
	for _, s := range r.spans.GetSpans() {
		if s.Name == "POST /charges" {
			classes = append(classes, attr(s, dedupotel.AttrHTTPClass).AsString())
		}
	}
	if strings.Join(classes, ",") != "stored,replayed,key_reused" {
		t.Errorf("span classes %v", classes)
	}
	route := dedupotel.AttrHTTPRoute.String("POST /charges")
	for class, want := range map[string]int64{"stored": 1, "replayed": 1, "key_reused": 1} {
		if got := r.sum(t, "dedup.http.requests", route, dedupotel.AttrHTTPClass.String(class)); got != want {
			t.Errorf("%s: %d", class, got)
		}
	}
	if got := r.sum(t, "dedup.http.requests", route, dedupotel.AttrHTTPStatus.Int(422)); got != 1 {
		t.Errorf("422: %d", got)
	}
}
