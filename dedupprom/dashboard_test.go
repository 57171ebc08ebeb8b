package dedupprom_test

import (
	"context"
	"encoding/json"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/dedupprom"
	"github.com/dedupkit/dedup/layered"
	"github.com/dedupkit/dedup/outbox"
	"github.com/prometheus/client_golang/prometheus"
)

// exported returns the name of every metric a Metrics and all its
// collectors can export, read from their descriptors.
func exported(t *testing.T) map[string]bool {
	t.Helper()
	m, err := dedupprom.New()
	if err != nil {
		t.Fatal(err)
	}
	cs := []prometheus.Collector{m,
		m.LayeredCollector("l", func() layered.Stats { return layered.Stats{} }),
		m.ProcessorCollector("p", func() consumer.Stats { return consumer.Stats{} }),
		m.RelayCollector("r", func() outbox.Stats { return outbox.Stats{} }, func() (dedupprom.Backlog, error) { return dedupprom.Backlog{}, nil }),
		m.BrokerCollector("nats", "c", func() dedupprom.BrokerStats { return dedupprom.BrokerStats{} }),
		m.SweepCollector("s", func() dedupprom.SweepStats { return dedupprom.SweepStats{} }),
		m.LagCollector("nats", "c", func(context.Context) (dedupprom.BrokerLag, error) { return dedupprom.BrokerLag{}, nil }),
	}
	names := map[string]bool{}
	fq := regexp.MustCompile(`fqName: "([^"]+)"`)
	for _, c := range cs {
		ch := make(chan *prometheus.Desc, 64)
		c.Describe(ch)
		close(ch)
		for d := range ch {
			mm := fq.FindStringSubmatch(d.String())
			if mm == nil {
				t.Fatalf("no name in %s", d)
			}
			names[mm[1]] = true
		}
	}
	return names
}

// TestDashboardQueries parses docs/grafana-dashboard.json and checks that
// every metric each panel's queries name is one this package exports (a
// histogram's _bucket, _sum and _count series included), and that every
// panel has a query.
func TestDashboardQueries(t *testing.T) {
	raw, err := os.ReadFile("../docs/grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatal(err)
	}
	names := exported(t)
	if len(dash.Panels) < 10 {
		t.Fatalf("%d panels", len(dash.Panels))
	}
	ident := regexp.MustCompile(`\bdedup_[a-z0-9_]+`)
	used := map[string]bool{}
	for _, p := range dash.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, q := range p.Targets {
			found := ident.FindAllString(q.Expr, -1)
			if len(found) == 0 {
				t.Errorf("panel %q: query %q names no dedup metric", p.Title, q.Expr)
			}
			for _, n := range found {
				base := n
				for _, suf := range []string{"_bucket", "_sum", "_count"} {
					if b, ok := strings.CutSuffix(n, suf); ok && names[b] {
						base = b
					}
				}
				if !names[base] {
					t.Errorf("panel %q: %s is not exported by dedupprom", p.Title, n)
				}
				used[base] = true
			}
		}
	}
	for _, must := range []string{"dedup_duplicates_total", "dedup_layered_duplicates_total", "dedup_consumer_decisions_total",
		"dedup_outbox_backlog", "dedup_outbox_oldest_unpublished_seconds", "dedup_takeovers_total", "dedup_claim_duration_seconds"} {
		if !used[must] {
			t.Errorf("no panel shows %s", must)
		}
	}
}
