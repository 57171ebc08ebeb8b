package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup/internal/verify"
)

func runArgs(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = run(args, &out, &errb)
	return code, out.String(), errb.String()
}

func TestBadFlags(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		want []string // in stderr
	}{
		{[]string{"--bogus"}, []string{"--bogus"}},
		{[]string{"--messages", "0"}, []string{"--messages", "between 1 and"}},
		{[]string{"--messages", "many"}, []string{"--messages", `"many"`}},
		{[]string{"--consumers", "0"}, []string{"--consumers"}},
		{[]string{"--consumers", "-3"}, []string{"--consumers"}},
		{[]string{"--dup-rate", "1.5"}, []string{"--dup-rate", "between 0 and 1"}},
		{[]string{"--dup-rate", "NaN"}, []string{"--dup-rate"}},
		{[]string{"--crash-rate", "-0.1"}, []string{"--crash-rate", "between 0 and 1"}},
		{[]string{"--fail-rate", "2"}, []string{"--fail-rate", "between 0 and 1"}},
		{[]string{"--crash-rate", "0.5", "--fail-rate", "0.5"}, []string{"--crash-rate plus --fail-rate"}},
		{[]string{"--store", "cassandra"}, []string{"--store", "sqlite", "memory", "redis", `"cassandra"`}},
		{[]string{"--store"}, []string{"--store", "needs a value"}},
		{[]string{"--store", "memory", "--flush-every", "5"}, []string{"--flush-every", "layered"}},
		{[]string{"--store", "layered", "--flush-every", "-1"}, []string{"--flush-every"}},
		{[]string{"--broker", "pulsar"}, []string{"--broker", "simulated", "nats", "kafka", `"pulsar"`}},
		{[]string{"--nats-url", "nats://x:1"}, []string{"--nats-url", "--broker nats"}},
		{[]string{"--store", "memory", "--addr", "127.0.0.1:1"}, []string{"--addr", "redis"}},
		{[]string{"--mode", "magic"}, []string{"--mode", "inbox, apply or lease"}},
		{[]string{"--store", "memory", "--mode", "inbox"}, []string{"--mode inbox", "--store memory"}},
		{[]string{"--store", "memory", "--path", "x.db"}, []string{"--path"}},
		{[]string{"--lease", "0s"}, []string{"--lease"}},
		{[]string{"--lease", "soon"}, []string{"--lease"}},
		{[]string{"--timeout", "-1s"}, []string{"--timeout"}},
		{[]string{"leftover"}, []string{`"leftover"`}},
		{[]string{"--processes", "2", "--store", "memory"}, []string{"--processes", "--store memory"}},
		{[]string{"--processes", "-1"}, []string{"--processes", "between 1 and"}},
		{[]string{"--processes", "2", "--broker", "nats"}, []string{"--processes", "simulated"}},
		{[]string{"--processes", "2", "--kill-every", "-5"}, []string{"--kill-every"}},
		{[]string{"--kill-every", "5"}, []string{"--kill-every", "--processes"}},
		{[]string{"--durable", "postgres"}, []string{"--durable", "layered"}},
		{[]string{"--store", "layered", "--durable", "mysql"}, []string{"--durable", "sqlite or postgres", `"mysql"`}},
		{[]string{"--store", "layered", "--durable", "postgres", "--path", "x.db"}, []string{"--path", "PostgreSQL"}},
		{[]string{"--store", "postgres", "--failover-every", "10"}, []string{"--failover-every", "redis or layered"}},
		{[]string{"--store", "redis", "--failover-every", "10"}, []string{"--failover-every", "--addr", "replicas"}},
		{[]string{"--store", "redis", "--addr", "a:1,b:2", "--failover-every", "-1"}, []string{"--failover-every"}},
		{[]string{"--store", "redis", "--addr", "a:1,b:2", "--failover-every", "10", "--broker", "nats"}, []string{"--failover-every", "simulated"}},
	} {
		args := append([]string{"verify"}, tc.args...)
		code, stdout, stderr := runArgs(t, args...)
		if code != exitUsage {
			t.Errorf("%q: exit %d, want %d; stderr %q", args, code, exitUsage, stderr)
		}
		if stdout != "" {
			t.Errorf("%q: wrote to stdout: %q", args, stdout)
		}
		for _, w := range tc.want {
			if !strings.Contains(stderr, w) {
				t.Errorf("%q: stderr %q does not contain %q", args, stderr, w)
			}
		}
	}
}

// jsonFields are the fields `dedup verify --json` promises, with the JSON
// type of each.
var jsonFields = map[string]string{
	"store": "string", "mode": "string",
	"messages": "number", "deliveries": "number", "effects": "number",
	"duplicates_skipped": "number", "lost": "number", "double_applied": "number",
	"seconds": "number", "throughput": "number",
	"crashes_before_commit": "number", "crashes_after_commit": "number",
	"takeovers": "number", "handler_failures": "number", "in_progress_nacks": "number",
	"store_errors": "number", "seed": "number", "timed_out": "bool", "ok": "bool",
}

func decodeReport(t *testing.T, stdout string) map[string]any {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(stdout))
	var m map[string]any
	if err := dec.Decode(&m); err != nil {
		t.Fatalf("stdout is not a JSON object: %v\n%s", err, stdout)
	}
	if dec.More() {
		t.Fatalf("stdout holds more than one JSON value:\n%s", stdout)
	}
	for name, typ := range jsonFields {
		v, ok := m[name]
		if !ok {
			t.Errorf("JSON lacks %q", name)
			continue
		}
		got := "?"
		switch v.(type) {
		case string:
			got = "string"
		case float64:
			got = "number"
		case bool:
			got = "bool"
		}
		if got != typ {
			t.Errorf("JSON %q = %v, a %s, want a %s", name, v, got, typ)
		}
	}
	return m
}

func TestVerifyJSONMemory(t *testing.T) {
	t.Parallel()
	code, stdout, stderr := runArgs(t, "verify", "--json", "--messages", "200", "--store", "memory", "--seed", "7")
	if code != exitOK {
		t.Fatalf("exit %d, stderr %q, stdout %s", code, stderr, stdout)
	}
	m := decodeReport(t, stdout)
	if m["ok"] != true || m["lost"] != 0.0 || m["double_applied"] != 0.0 || m["timed_out"] != false {
		t.Errorf("report not clean: %s", stdout)
	}
	if m["store"] != "memory" || m["mode"] != "lease" || m["messages"] != 200.0 || m["effects"] != 200.0 || m["seed"] != 7.0 {
		t.Errorf("report describes another run: %s", stdout)
	}
	if d := m["deliveries"].(float64); d < 200 {
		t.Errorf("deliveries = %v, fewer than messages", d)
	}
}

// `dedup verify --processes` re-runs this binary as its consumer
// processes (the test binary's TestMain serves as the worker) and kills
// them mid-run.
func TestVerifyProcessesSummary(t *testing.T) {
	t.Parallel()
	code, stdout, stderr := runArgs(t, "verify", "--processes", "2", "--consumers", "4", "--messages", "400", "--kill-every", "80", "--quiet")
	if code != exitOK {
		t.Fatalf("exit %d, stderr %q, stdout %s", code, stderr, stdout)
	}
	for _, w := range []string{"sqlite store, inbox mode", "processes              2 x 4 consumers", "SIGKILLed mid-run", "PASS: all 400 messages applied exactly once"} {
		if !strings.Contains(stdout, w) {
			t.Errorf("summary lacks %q:\n%s", w, stdout)
		}
	}
	if strings.Contains(stdout, " 0 SIGKILLed") {
		t.Errorf("no process was killed:\n%s", stdout)
	}
}

func TestVerifySQLiteSummary(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "v.db")
	code, stdout, stderr := runArgs(t, "verify", "--messages", "300", "--path", path, "--quiet")
	if code != exitOK {
		t.Fatalf("exit %d, stderr %q, stdout %s", code, stderr, stdout)
	}
	if stderr != "" {
		t.Errorf("--quiet wrote to stderr: %q", stderr)
	}
	for _, w := range []string{"sqlite store, inbox mode", "lost", "double applied", "msgs/s", path, "PASS: all 300 messages applied exactly once"} {
		if !strings.Contains(stdout, w) {
			t.Errorf("summary lacks %q:\n%s", w, stdout)
		}
	}
	if _, err := os.Stat(path); err != nil {
		t.Errorf("--path database not kept: %v", err)
	}
}

func TestVerifyTimeoutFails(t *testing.T) {
	t.Parallel()
	// What proves the timeout is the report (timed out, messages left
	// unfinished), not a wall-clock bound on the run: a run that ignored
	// it would finish its million messages and pass, or hang until the
	// test binary's own timeout.
	code, stdout, stderr := runArgs(t, "verify", "--json", "--store", "memory", "--messages", "1000000", "--timeout", "100ms", "--quiet")
	if code != exitFail {
		t.Fatalf("exit %d, want %d; stderr %q", code, exitFail, stderr)
	}
	if !strings.Contains(stderr, "timed out after 100ms") || !strings.Contains(stderr, "--timeout") {
		t.Errorf("stderr does not explain the timeout: %q", stderr)
	}
	m := decodeReport(t, stdout)
	if n, _ := m["unfinished"].(float64); m["timed_out"] != true || m["ok"] != false || n <= 0 {
		t.Errorf("report does not fail the timeout with messages unfinished: %s", stdout)
	}
}

func TestHelp(t *testing.T) {
	t.Parallel()
	code, stdout, _ := runArgs(t, "help")
	if code != exitOK {
		t.Errorf("help: exit %d", code)
	}
	for _, w := range []string{"verify", "proxy", "migrate", "sweep", "dlq"} {
		if !strings.Contains(stdout, w) {
			t.Errorf("help lacks %q:\n%s", w, stdout)
		}
	}
	if strings.Contains(stdout, "not yet") {
		t.Errorf("help says a command is not implemented:\n%s", stdout)
	}

	code, stdout, stderr := runArgs(t)
	if code != exitUsage || stdout != "" || !strings.Contains(stderr, "Commands:") {
		t.Errorf("no arguments: exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}

	code, _, stderr = runArgs(t, "dlq")
	if code != exitUsage || !strings.Contains(stderr, "list, inspect or replay") && !strings.Contains(stderr, "list|inspect|replay") {
		t.Errorf("dlq without a subcommand: exit %d, stderr %q", code, stderr)
	}
	code, _, stderr = runArgs(t, "frobnicate")
	if code != exitUsage || !strings.Contains(stderr, `unknown command "frobnicate"`) {
		t.Errorf("unknown command: exit %d, stderr %q", code, stderr)
	}

	for _, args := range [][]string{{"verify", "-h"}, {"verify", "--help"}, {"help", "verify"}} {
		code, stdout, _ := runArgs(t, args...)
		if code != exitOK {
			t.Errorf("%q: exit %d", args, code)
		}
		for _, w := range []string{"--store", "--messages", "--consumers", "--dup-rate", "--crash-rate", "--fail-rate",
			"--lease", "--seed", "--json", "--quiet", "--keep", "--path", "--timeout", "Not injected"} {
			if !strings.Contains(stdout, w) {
				t.Errorf("%q lacks %q", args, w)
			}
		}
	}
}

func TestProgressBar(t *testing.T) {
	var b bytes.Buffer
	p := &progressBar{w: &b, tty: true}
	p.update(verify.Progress{Done: 50, Messages: 100, Deliveries: 70, Elapsed: time.Second})
	if s := b.String(); !strings.HasPrefix(s, "\r[###############...............]  50%") || strings.Contains(s, "\n") {
		t.Errorf("terminal bar = %q", s)
	}
	p.finish()
	if s := b.String(); !strings.HasSuffix(s, "\r") || strings.Count(s, "\r") != 3 {
		t.Errorf("bar not cleared: %q", s)
	}

	b.Reset()
	p = &progressBar{w: &b, every: 2 * time.Second}
	for i := range 50 {
		p.update(verify.Progress{Done: i, Messages: 100, Elapsed: time.Duration(i) * 100 * time.Millisecond})
	}
	if n := strings.Count(b.String(), "\n"); n != 2 || strings.Contains(b.String(), "\r") {
		t.Errorf("plain progress wrote %d lines in 5s, want 2 (one every 2s):\n%q", n, b.String())
	}
}
