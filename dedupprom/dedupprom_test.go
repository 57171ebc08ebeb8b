package dedupprom_test

import (
	"context"
	"errors"
	"fmt"
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
	"github.com/dedupkit/dedup/dedupprom"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/layered"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/redisstore"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/dedupkit/dedup/storetest"
	"github.com/dedupkit/dedup/window"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/rueidis"
)

func newMetrics(t testing.TB, opts ...dedupprom.Option) (*dedupprom.Metrics, *prometheus.Registry) {
	t.Helper()
	m, err := dedupprom.New(opts...)
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(m); err != nil {
		t.Fatal(err)
	}
	return m, reg
}

// value reads one series of a vector.
func value(t *testing.T, c prometheus.Collector, want float64, labels ...string) {
	t.Helper()
	var got float64
	switch v := c.(type) {
	case *prometheus.CounterVec:
		got = testutil.ToFloat64(v.WithLabelValues(labels...))
	default:
		t.Fatalf("unexpected collector %T", c)
	}
	if got != want {
		t.Errorf("%v = %v, want %v", labels, got, want)
	}
}

// scrape returns the registry's exposition, for assertions by line.
func scrape(t *testing.T, g prometheus.Gatherer) string {
	t.Helper()
	rec := httptest.NewRecorder()
	dedupprom.Handler(g).ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	if rec.Code != 200 {
		t.Fatalf("/metrics: %d %s", rec.Code, rec.Body)
	}
	return rec.Body.String()
}

// hasLine fails unless the exposition has exactly the sample line.
func hasLine(t *testing.T, body, line string) {
	t.Helper()
	for l := range strings.SplitSeq(body, "\n") {
		if l == line {
			return
		}
	}
	t.Errorf("no line %q in the exposition", line)
}

func redisFast(t *testing.T) *redisstore.Store {
	t.Helper()
	addrs := testenv.Addrs(t, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
	s, err := redisstore.Open(rueidis.ClientOption{InitAddress: addrs, DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// TestScriptedStores runs a scripted sequence through a Runner over
// layered stores (a window, the real Redis as the fast store, a memstore
// as the durable one) and asserts every counter: a duplicate caught by
// the window, one by Redis, one by the durable store, a take-over, a
// release, and store latencies observed.
func TestScriptedStores(t *testing.T) {
	m, reg := newMetrics(t)
	fast := redisFast(t)
	clock := storetest.NewClock()
	durable, err := memstore.New(memstore.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	pod := func(withFast bool) *layered.Store {
		w, err := window.New()
		if err != nil {
			t.Fatal(err)
		}
		opts := []layered.Option{layered.WithWindow(w), layered.WithDurable(durable, "memory"), layered.WithHooks(m)}
		if withFast {
			opts = append(opts, layered.WithFast(fast, "redis"))
		}
		s, err := layered.New(opts...)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	a, b, c := pod(true), pod(true), pod(false)
	runner := func(s dedup.Store) *dedup.Runner {
		r, err := dedup.NewRunner(s, dedup.WithName("runner"), dedup.WithHooks(m), dedup.WithLease(time.Minute))
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	ra, rb, rc := runner(a), runner(b), runner(c)
	ctx := context.Background()
	run := dedup.NewToken().String() // fresh IDs: the Redis server is shared
	key := func(id string) dedup.Key { return dedup.Key{Scope: "payments", ID: run + "-" + id} }
	effects := 0
	h := func(context.Context) ([]byte, error) { effects++; return []byte("ok"), nil }
	do := func(r *dedup.Runner, id string, wantDup bool) {
		t.Helper()
		res, err := r.Do(ctx, key(id), "", h)
		if err != nil || res.Duplicate != wantDup {
			t.Fatalf("%s: %+v %v, want duplicate %v", id, res, err, wantDup)
		}
	}
	do(ra, "k1", false) // acquired everywhere, completed
	do(ra, "k1", true)  // the window of pod a
	do(rb, "k1", true)  // pod b's window is empty: Redis
	do(ra, "k2", false)
	do(rc, "k2", true) // pod c has no fast store: the durable store
	// A crash mid-effect: pod a claims k3 and never finishes; after the
	// lease pod c takes it over.
	if _, err := a.Claim(ctx, key("k3"), "", time.Minute); err != nil {
		t.Fatal(err)
	}
	clock.Advance(2 * time.Minute)
	res, err := rc.Do(ctx, key("k3"), "", h)
	if err != nil || !res.TakenOver {
		t.Fatalf("k3: %+v %v, want a take-over", res, err)
	}
	// A failed handler releases its claim.
	if _, err := ra.Do(ctx, key("k4"), "", func(context.Context) ([]byte, error) { return nil, errors.New("boom") }); err == nil {
		t.Fatal("k4 succeeded")
	}
	if effects != 3 {
		t.Fatalf("%d effects, want 3", effects)
	}

	value(t, dedupprom.Collectors(m).Duplicates, 1, "window", "payments")
	value(t, dedupprom.Collectors(m).Duplicates, 1, "redis", "payments")
	value(t, dedupprom.Collectors(m).Duplicates, 1, "memory", "payments")
	value(t, dedupprom.Collectors(m).Duplicates, 3, "runner", "payments")
	value(t, dedupprom.Collectors(m).Takeovers, 1, "memory", "payments")
	value(t, dedupprom.Collectors(m).Takeovers, 1, "runner", "payments")
	value(t, dedupprom.Collectors(m).Claims, 4, "runner", "payments", "acquired") // k1, k2, k3, k4
	value(t, dedupprom.Collectors(m).Claims, 3, "runner", "payments", "duplicate")
	value(t, dedupprom.Collectors(m).Claims, 5, "memory", "payments", "acquired") // k1 k2 k3(crash) k3(take-over) k4
	value(t, dedupprom.Collectors(m).Finishes, 3, "runner", "complete", "ok")
	value(t, dedupprom.Collectors(m).Finishes, 1, "runner", "release", "ok")
	body := scrape(t, reg)
	hasLine(t, body, `dedup_claim_duration_seconds_count{store="runner"} 7`)
	hasLine(t, body, `dedup_finish_duration_seconds_count{op="complete",store="runner"} 3`)
	if err := lint(reg); err != nil {
		t.Error(err)
	}
}

func lint(g prometheus.Gatherer) error {
	probs, err := testutil.GatherAndLint(g)
	if err != nil {
		return err
	}
	if len(probs) > 0 {
		return fmt.Errorf("lint: %v", probs)
	}
	return nil
}

// TestLeaseLost: a handler outlives its lease and another owner takes
// the key over; the Runner's completion is refused and counted as
// lease_lost.
func TestLeaseLost(t *testing.T) {
	m, _ := newMetrics(t)
	clock := storetest.NewClock()
	store, err := memstore.New(memstore.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	r, err := dedup.NewRunner(store, dedup.WithName("memory"), dedup.WithHooks(m), dedup.WithLease(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	key := dedup.Key{Scope: "payments", ID: "slow"}
	_, err = r.Do(ctx, key, "", func(ctx context.Context) ([]byte, error) {
		clock.Advance(2 * time.Minute)
		if c, err := store.Claim(ctx, key, "", time.Minute); err != nil || !c.TakenOver {
			t.Errorf("take-over: %+v %v", c, err)
		}
		return []byte("ok"), nil
	})
	if !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("Do: %v, want ErrLeaseLost", err)
	}
	value(t, dedupprom.Collectors(m).Finishes, 1, "memory", "complete", "lease_lost")
	value(t, dedupprom.Collectors(m).Finishes, 0, "memory", "complete", "ok")
}

type sink struct {
	mu  sync.Mutex
	got []consumer.DeadLetter
}

func (s *sink) DeadLetter(_ context.Context, dl consumer.DeadLetter) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.got = append(s.got, dl)
	return nil
}

// TestScriptedConsumer: an applied message, its redelivered duplicate, a
// poison message dead-lettered, a business rejection and a transient
// retry, through a consumer processor observed by Metrics.
func TestScriptedConsumer(t *testing.T) {
	m, reg := newMetrics(t)
	store, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	dl := &sink{}
	h := func(_ context.Context, msg *consumer.Message, _ consumer.Delivery) ([]byte, error) {
		switch msg.ID {
		case "poison":
			return nil, consumer.Permanent(errors.New("bad schema"))
		case "broke":
			return nil, consumer.Reject(errors.New("insufficient funds"), []byte("rejected"))
		case "flaky":
			return nil, consumer.Transient(errors.New("timeout"))
		}
		return []byte("ok"), nil
	}
	p, err := consumer.New("orders", store, h, consumer.WithScope("orders"), consumer.WithDeadLetter(dl),
		consumer.WithLimits(consumer.Limits{Permanent: 1}), consumer.WithObserver(m.Observer("orders")),
		consumer.WithRunnerOptions(dedup.WithHooks(m), dedup.WithName("memory")))
	if err != nil {
		t.Fatal(err)
	}
	if err := reg.Register(m.ProcessorCollector("orders", p.Stats)); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	want := map[string]consumer.Action{"m1": consumer.Ack, "poison": consumer.DeadLettered, "broke": consumer.Rejected, "flaky": consumer.Retry}
	for _, id := range []string{"m1", "poison", "broke", "flaky"} {
		if d := p.Process(ctx, &consumer.Message{ID: id, Subject: "orders", Delivery: 1}); d.Action != want[id] {
			t.Fatalf("%s: %v, want %v", id, d.Action, want[id])
		}
	}
	if d := p.Process(ctx, &consumer.Message{ID: "m1", Subject: "orders", Delivery: 2}); !d.Duplicate {
		t.Fatalf("redelivery: %+v", d)
	}
	if len(dl.got) != 1 {
		t.Fatalf("%d dead letters", len(dl.got))
	}
	c := dedupprom.Collectors(m)
	value(t, c.Decisions, 1, "orders", "orders", "applied")
	value(t, c.Decisions, 1, "orders", "orders", "duplicate")
	value(t, c.Decisions, 1, "orders", "orders", "dead_lettered")
	value(t, c.Decisions, 1, "orders", "orders", "rejected")
	value(t, c.Decisions, 1, "orders", "orders", "retry")
	value(t, c.Failures, 1, "orders", "permanent")
	value(t, c.Failures, 1, "orders", "business")
	value(t, c.Failures, 1, "orders", "transient")
	value(t, c.Redeliveries, 1, "orders")
	value(t, c.Duplicates, 1, "memory", "orders")
	body := scrape(t, reg)
	hasLine(t, body, `dedup_consumer_store_errors_total{consumer="orders"} 0`)
	if err := lint(reg); err != nil {
		t.Error(err)
	}
}

// TestScriptedHTTP: a keyed request stored, replayed, reused with another
// payload (422); a malformed key and a missing key on a Required route
// are both counted as rejected with 400.
func TestScriptedHTTP(t *testing.T) {
	m, reg := newMetrics(t)
	store, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	mw, err := deduphttp.New(store, deduphttp.WithSingleTenant(), deduphttp.WithOnDone(m.HTTPObserver("payments")))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw.Required(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(201)
	})))
	defer srv.Close()
	send := func(key, body string) int {
		req, _ := http.NewRequest("POST", srv.URL+"/charges", strings.NewReader(body))
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, c := range []struct {
		key, body string
		want      int
	}{{"k1", "a", 201}, {"k1", "a", 201}, {"k1", "b", 422}, {"", "a", 400}, {`"unterminated`, "a", 400}, {strings.Repeat("k", 300), "a", 400}} {
		if got := send(c.key, c.body); got != c.want {
			t.Fatalf("%+v: %d", c, got)
		}
	}
	c := dedupprom.Collectors(m)
	value(t, c.HTTPRequests, 1, "payments", "stored", "201")
	value(t, c.HTTPRequests, 1, "payments", "replayed", "201")
	value(t, c.HTTPRequests, 1, "payments", "key_reused", "422")
	// The missing key, the unterminated quote and the oversized key.
	value(t, c.HTTPRequests, 3, "payments", "rejected", "400")
	if err := lint(reg); err != nil {
		t.Error(err)
	}
}

type pub struct{}

func (pub) Publish(_ context.Context, batch []outbox.Message, results []error) {
	for i, msg := range batch {
		if msg.ID == "poison" {
			results[i] = outbox.Permanent(errors.New("unroutable"))
		}
	}
}

// TestScriptedRelay: a relay over a SQLite outbox publishes one message
// and quarantines another; the collector reports both and the backlog.
func TestScriptedRelay(t *testing.T) {
	m, reg := newMetrics(t)
	s, err := sqlitestore.Open(filepath.Join(t.TempDir(), "outbox.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	src, err := s.OutboxSource(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := s.DB().BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.WriteOutbox(ctx, tx, outbox.Message{ID: "good", Topic: "orders", Key: "a"}, outbox.Message{ID: "poison", Topic: "orders", Key: "b"}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	rl, err := outbox.NewRelay(src, pub{}, outbox.WithPollInterval(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	backlog := func() (dedupprom.Backlog, error) {
		var n int64
		err := s.DB().QueryRow(`SELECT count(*) FROM dedup_records_outbox WHERE published_at IS NULL AND quarantined_at IS NULL`).Scan(&n)
		return dedupprom.Backlog{Messages: n}, err
	}
	if err := reg.Register(m.RelayCollector("relay-1", rl.Stats, backlog)); err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { errc <- rl.Run(ctx) }()
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(5 * time.Millisecond) {
		if st := rl.Stats(); st.Published == 1 && st.Quarantined == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("relay never settled: %+v", rl.Stats())
		}
	}
	rl.Close()
	<-errc
	body := scrape(t, reg)
	hasLine(t, body, `dedup_outbox_published_total{relay="relay-1"} 1`)
	hasLine(t, body, `dedup_outbox_quarantined_total{relay="relay-1"} 1`)
	hasLine(t, body, `dedup_outbox_backlog{relay="relay-1"} 0`)
}

// TestScopeCap: 100,000 distinct scopes never make more than the cap of
// series plus one "other"; every event is counted.
func TestScopeCap(t *testing.T) {
	m, reg := newMetrics(t, dedupprom.WithMaxScopes(50))
	ctx := context.Background()
	const n = 100_000
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := g; i < n; i += 4 {
				m.OnClaim(ctx, dedup.ClaimEvent{Store: "s", Key: dedup.Key{Scope: fmt.Sprint("tenant-", i), ID: "x"}, Outcome: dedup.Acquired})
			}
		})
	}
	wg.Wait()
	c := dedupprom.Collectors(m)
	if got := testutil.CollectAndCount(c.Claims); got != 50*5+5 {
		t.Errorf("%d claim series, want %d (50 scopes + other, 5 outcomes each)", got, 50*5+5)
	}
	value(t, c.Claims, n-50, "s", dedupprom.Other, "acquired")
	total := 0.0
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "dedup_claims_total" {
			for _, s := range mf.GetMetric() {
				total += s.GetCounter().GetValue()
			}
		}
	}
	if total != n {
		t.Errorf("%v claims counted, want %d", total, n)
	}
}

// TestScopeAllowlist and TestScopeRewrite: only the listed scopes keep
// their name; a rewrite runs first.
func TestScopeAllowlist(t *testing.T) {
	m, _ := newMetrics(t, dedupprom.WithScopes("payments"), dedupprom.WithScopeLabel(func(s string) string {
		_, op, _ := strings.Cut(s, "/")
		return op
	}))
	for _, s := range []string{"t1/payments", "t2/payments", "t1/emails"} {
		if got, want := m.ScopeLabel(s), map[bool]string{true: "payments", false: dedupprom.Other}[strings.HasSuffix(s, "payments")]; got != want {
			t.Errorf("%s -> %s, want %s", s, got, want)
		}
	}
}

func TestOptionErrors(t *testing.T) {
	for name, opt := range map[string]dedupprom.Option{
		"namespace": dedupprom.WithNamespace(""),
		"cap":       dedupprom.WithMaxScopes(-1),
		"buckets":   dedupprom.WithBuckets(1, 0.5),
	} {
		if _, err := dedupprom.New(opt); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("%s: %v, want an invalid argument", name, err)
		}
	}
}
