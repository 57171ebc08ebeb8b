package main

import (
	"strings"
	"testing"
)

// TestVerifyMetricsAddr: --metrics-addr takes host:port (exit 2
// otherwise), and a run with it says where it serves and still passes.
// Scraping during a run is tested in internal/verify
// (TestMetricsServedDuringRun).
func TestVerifyMetricsAddr(t *testing.T) {
	t.Parallel()
	code, _, stderr := runArgs(t, "verify", "--quiet", "--store", "memory", "--metrics-addr", "9090")
	if code != exitUsage || !strings.Contains(stderr, "--metrics-addr must be host:port") {
		t.Errorf("--metrics-addr 9090: exit %d, %q", code, stderr)
	}
	code, stdout, stderr := runArgs(t, "verify", "--quiet", "--store", "memory", "--messages", "200", "--metrics-addr", "127.0.0.1:0")
	if code != exitOK || !strings.Contains(stderr, "dedup verify: metrics on http://127.0.0.1:") {
		t.Errorf("exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}
}
