package dedupotel_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestNoMetricsLibraryInOtherPackages: a program that imports any other
// package of the module compiles neither Prometheus nor OpenTelemetry
// (only imported packages are built; see docs/DESIGN.md, Observability).
func TestNoMetricsLibraryInOtherPackages(t *testing.T) {
	if testing.Short() {
		t.Skip("runs go list")
	}
	pkgs := []string{"github.com/dedupkit/dedup", "github.com/dedupkit/dedup/sqlitestore", "github.com/dedupkit/dedup/pgstore",
		"github.com/dedupkit/dedup/redisstore", "github.com/dedupkit/dedup/memstore", "github.com/dedupkit/dedup/layered",
		"github.com/dedupkit/dedup/consumer", "github.com/dedupkit/dedup/outbox", "github.com/dedupkit/dedup/dedupnats",
		"github.com/dedupkit/dedup/deduphttp", "github.com/dedupkit/dedup/window"}
	for _, p := range pkgs {
		out, err := exec.Command("go", "list", "-deps", p).CombinedOutput()
		if err != nil {
			t.Fatalf("go list %s: %v\n%s", p, err, out)
		}
		for dep := range strings.SplitSeq(string(out), "\n") {
			if strings.Contains(dep, "prometheus") || strings.Contains(dep, "opentelemetry") {
				t.Errorf("%s depends on %s", p, dep)
			}
		}
	}
	out, err := exec.Command("go", "list", "-deps", "github.com/dedupkit/dedup/dedupotel").CombinedOutput()
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(out), "otel/sdk") || strings.Contains(string(out), "prometheus") {
		t.Errorf("dedupotel depends on the SDK or Prometheus:\n%s", out)
	}
}
