package verify_test

import (
	"context"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/dedupkit/dedup/dedupprom"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/internal/verify"
)

// scrapingTarget scrapes the metrics endpoint from inside the run: when
// the consumers start the at-th delivery, that delivery's consumer reads
// /metrics before it applies it, so the scrape happens while the run goes
// on by construction. The deliveries after it wait for the scrape (those
// already in flight finish first): a scrape slower than the rest of the
// run would otherwise see every count final.
type scrapingTarget struct {
	verify.Target
	t    *testing.T
	url  string
	at   int64
	n    atomic.Int64
	gate sync.RWMutex
	body string
}

func (s *scrapingTarget) Apply(ctx context.Context, d verify.Delivery) verify.Result {
	if s.n.Add(1) == s.at {
		s.gate.Lock()
		s.body = get(s.t, s.url)
		s.gate.Unlock()
	} else {
		s.gate.RLock()
		s.gate.RUnlock()
	}
	return s.Target.Apply(ctx, d)
}

func get(t *testing.T, url string) string {
	resp, err := http.Get(url)
	if err != nil {
		t.Errorf("scrape: %v", err)
		return ""
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		t.Errorf("scrape: %d %v", resp.StatusCode, err)
	}
	return string(b)
}

// sample returns the value of the sample line that starts with series
// (a name with its labels, in the exposition's order), or -1.
func sample(body, series string) float64 {
	for l := range strings.SplitSeq(body, "\n") {
		if v, ok := strings.CutPrefix(l, series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err == nil {
				return f
			}
		}
	}
	return -1
}

// TestMetricsServedDuringRun: dedup verify --metrics-addr's parts. A
// lease-mode run on the memory store with its metrics on a real listener
// is scraped at its 400th delivery: the counts are there and partial.
// After the run they agree with the report.
func TestMetricsServedDuringRun(t *testing.T) {
	cfg := verify.DefaultConfig()
	cfg.Messages = 1500
	tg := open(t, "memory", "", cfg)
	m, url := serveMetrics(t, "simulated")
	st := &scrapingTarget{Target: m.Instrument(tg), t: t, url: url, at: 400}
	rep := run(t, cfg, st)
	if !rep.OK {
		t.Fatalf("the run failed: %+v", rep)
	}

	const fetched = `dedup_broker_fetched_total{consumer="verify",system="simulated"}`
	const acquired = `dedup_claims_total{outcome="acquired",scope="dedup-verify",store="memory"}`
	mid := st.body
	if mid == "" {
		t.Fatal("no scrape during the run")
	}
	// When the 400th delivery starts, at most Consumers-1 others are in
	// flight: at least 400-Consumers have been reported.
	if n := sample(mid, fetched); n < float64(400-cfg.Consumers) || n >= float64(rep.Deliveries) {
		t.Errorf("mid-run %s = %v, want between %d and %d", fetched, n, 400-cfg.Consumers, rep.Deliveries)
	}
	if n := sample(mid, acquired); n <= 0 || n >= float64(rep.Messages) {
		t.Errorf("mid-run %s = %v, want some and not all of %d", acquired, n, rep.Messages)
	}

	end := get(t, url)
	for _, c := range []struct {
		series string
		want   int
	}{
		{fetched, rep.Deliveries},
		{`dedup_claims_total{outcome="duplicate",scope="dedup-verify",store="memory"}`, rep.DuplicatesSkipped},
		{`dedup_claims_total{outcome="in_progress",scope="dedup-verify",store="memory"}`, rep.InProgressNacks},
		{`dedup_duplicates_total{scope="dedup-verify",store="memory"}`, rep.DuplicatesSkipped},
		{`dedup_takeovers_total{scope="dedup-verify",store="memory"}`, rep.Takeovers},
		// A crash after the commit applied the effect and decided nothing.
		{`dedup_consumer_decisions_total{action="applied",consumer="verify",scope="dedup-verify"}`, rep.Effects - rep.CrashesAfterCommit},
		{`dedup_finishes_total{op="complete",result="ok",store="memory"}`, rep.Effects},
		{`dedup_finishes_total{op="keep",result="ok",store="memory"}`, rep.CrashesBeforeCommit},
	} {
		if got := sample(end, c.series); got != float64(c.want) {
			t.Errorf("%s = %v, want %d (the report's)", c.series, got, c.want)
		}
	}
	if sample(end, "go_goroutines") <= 0 {
		t.Error("no Go runtime metrics")
	}
}

// TestMetricsLayered: on the layered store (window, Redis flushed every
// 300 deliveries, SQLite inbox) the metrics export what each layer caught,
// equal to the report's layer counts.
func TestMetricsLayered(t *testing.T) {
	testenv.Addrs(t, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
	cfg := verify.DefaultConfig()
	cfg.Messages = 700
	tg := open(t, "layered", "", cfg)
	m, url := serveMetrics(t, "")
	rep := run(t, cfg, m.Instrument(tg))
	if !rep.OK {
		t.Fatalf("the run failed: %+v", rep)
	}
	end := get(t, url)
	for layer, want := range map[string]int64{"window": rep.Layers["window"], "fast": rep.Layers["redis"], "durable": rep.Layers["durable"]} {
		series := `dedup_layered_duplicates_total{layer="` + layer + `",store="layered"}`
		if got := sample(end, series); got != float64(want) {
			t.Errorf("%s = %v, want %d (the report's)", series, got, want)
		}
	}
	if rep.Layers["durable"] == 0 {
		t.Error("no duplicate reached the durable store: the flushes did not happen")
	}
	if got := sample(end, `dedup_claims_total{outcome="duplicate",scope="dedup-verify",store="layered"}`); got != float64(rep.DuplicatesSkipped) {
		t.Errorf("duplicate claims %v, want %d", got, rep.DuplicatesSkipped)
	}
}

// serveMetrics returns verify's metrics for a broker system ("" for none)
// and the address of a real listener serving them until the test ends.
func serveMetrics(t *testing.T, system string) (*verify.Metrics, string) {
	t.Helper()
	m, err := verify.NewMetrics(system)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := dedupprom.Listen("127.0.0.1:0", m.Registry)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return m, "http://" + srv.Addr() + "/metrics"
}
