package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strings"
	"testing"

	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/jackc/pgx/v5/pgconn"
)

func TestParseInterspersed(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args    []string
		payload bool
		stream  string
		pos     []string
	}{
		{[]string{"42"}, false, "DLQ", []string{"42"}},
		{[]string{"--payload", "42"}, true, "DLQ", []string{"42"}},
		{[]string{"42", "--payload"}, true, "DLQ", []string{"42"}},
		{[]string{"--stream", "X", "42", "--payload"}, true, "X", []string{"42"}},
		{[]string{"42", "--stream=X", "43", "-payload"}, true, "X", []string{"42", "43"}},
		{[]string{"42", "--", "--payload"}, false, "DLQ", []string{"42", "--payload"}},
		{[]string{"--", "-1", "--stream", "X"}, false, "DLQ", []string{"-1", "--stream", "X"}},
		{[]string{"-", "--payload"}, true, "DLQ", []string{"-"}},
		{nil, false, "DLQ", nil},
	} {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		payload := fs.Bool("payload", false, "")
		stream := fs.String("stream", "DLQ", "")
		if err := parseInterspersed(fs, tc.args); err != nil {
			t.Errorf("%q: %v", tc.args, err)
			continue
		}
		if *payload != tc.payload || *stream != tc.stream || !slices.Equal(fs.Args(), tc.pos) {
			t.Errorf("%q: payload %v stream %q args %q; want %v %q %q", tc.args, *payload, *stream, fs.Args(), tc.payload, tc.stream, tc.pos)
		}
	}
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(nopWriter{})
	fs.Bool("payload", false, "")
	if err := parseInterspersed(fs, []string{"42", "--bogus"}); err == nil || !strings.Contains(err.Error(), "bogus") {
		t.Errorf("an unknown flag after an argument: %v, want it refused", err)
	}
}

type nopWriter struct{}

func (nopWriter) Write(p []byte) (int, error) { return len(p), nil }

// deadNATS is a NATS URL where nothing listens: a command that gets as far
// as connecting has parsed its command line.
func deadNATS(t *testing.T) string { return "nats://127.0.0.1:" + testenv.FreePort(t) }

// TestDLQFlagsAfterID: the README's `dedup dlq inspect --stream DLQ 42
// --payload` parses (it fails on the connection, exit 1, not on usage).
func TestDLQFlagsAfterID(t *testing.T) {
	t.Parallel()
	url := deadNATS(t)
	for _, args := range [][]string{
		{"dlq", "inspect", "--stream", "DLQ", "42", "--payload", "--nats-url", url},
		{"dlq", "inspect", "42", "--nats-url", url, "--payload"},
		{"dlq", "list", "--nats-url", url, "--limit", "3"},
	} {
		code, _, stderr := runArgs(t, args...)
		if code != exitFail || !strings.Contains(stderr, "connect to NATS at "+url) {
			t.Errorf("%q: exit %d, stderr %q; want exit 1 on the connection", args, code, stderr)
		}
	}
	code, _, stderr := runArgs(t, "dlq", "inspect", "42", "43", "--nats-url", url)
	if code != exitUsage || !strings.Contains(stderr, "exactly one record ID") {
		t.Errorf("two IDs: exit %d, stderr %q", code, stderr)
	}
}

// TestNumericBounds: values past a flag's bound are refused with exit 2
// before any I/O, naming the flag and the bound.
func TestNumericBounds(t *testing.T) {
	t.Parallel()
	url := deadNATS(t)
	dead := "postgres://postgres@127.0.0.1:" + testenv.FreePort(t) + "/test?sslmode=disable"
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"verify", "--timeout", "1000h"}, "--timeout must be positive and at most"},
		{[]string{"verify", "--timeout", "-1s"}, "--timeout"},
		{[]string{"verify", "--lease", "48h"}, "--lease must be at most"},
		{[]string{"dlq", "list", "--limit", "-1", "--nats-url", url}, "--limit must be between 0"},
		{[]string{"dlq", "list", "--limit", "1000000000", "--nats-url", url}, "--limit must be between 0"},
		{[]string{"dlq", "replay", "--rate", "1e9", "--nats-url", url}, "--rate"},
		{[]string{"dlq", "replay", "--rate", "NaN", "--nats-url", url}, "--rate"},
		{[]string{"dlq", "list", "--timeout", "0s", "--nats-url", url}, "--timeout"},
		{[]string{"sweep", "--batch", "2000000", "--addr", dead}, "--batch must be between 1 and"},
		{[]string{"sweep", "--batch", "0", "--addr", dead}, "--batch must be between 1 and"},
		{[]string{"sweep", "--until-empty", "--pause", "2h", "--addr", dead}, "--pause must be between 0 and"},
		{[]string{"migrate", "--timeout", "9999h", "--addr", dead}, "--timeout"},
		{[]string{"migrate", "--prefix", "", "--addr", dead}, "--prefix must not be empty"},
		{[]string{"sweep", "--prefix=", "--addr", dead}, "--prefix must not be empty"},
	} {
		code, _, stderr := runArgs(t, tc.args...)
		if code != exitUsage || !strings.Contains(stderr, tc.want) {
			t.Errorf("%q: exit %d, stderr %q; want exit 2 and %q", tc.args, code, stderr, tc.want)
		}
	}
}

func TestVersion(t *testing.T) {
	t.Parallel()
	code, stdout, stderr := runArgs(t, "version")
	if code != exitOK || !strings.HasPrefix(stdout, "dedup ") || !strings.Contains(stdout, "go1.") || stderr != "" {
		t.Errorf("version: exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}
	code, stdout, _ = runArgs(t, "version", "--json")
	var v buildVersion
	if code != exitOK || json.Unmarshal([]byte(stdout), &v) != nil || v.Module == "" || v.Go == "" {
		t.Errorf("version --json: exit %d, %q", code, stdout)
	}
	if code, _, _ := runArgs(t, "version", "extra"); code != exitUsage {
		t.Errorf("version extra: exit %d, want 2", code)
	}
	info := &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Path: "github.com/dedupkit/dedup", Version: "v1.2.3"},
		Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "abc123"}, {Key: "vcs.time", Value: "2026-11-24T00:00:00Z"}, {Key: "vcs.modified", Value: "true"}}}
	got := readVersion(info, true).String()
	if want := "dedup v1.2.3 (github.com/dedupkit/dedup) revision abc123+dirty of 2026-11-24T00:00:00Z, built with go1.26.8"; got != want {
		t.Errorf("String = %q, want %q", got, want)
	}
	if got := readVersion(nil, false); got.Version != "unknown" {
		t.Errorf("without build info: %+v", got)
	}
}

// TestSpecificErrors: each names what failed and what answered.
func TestSpecificErrors(t *testing.T) {
	t.Parallel()
	missing := filepath.Join(t.TempDir(), "no-such-dir", "keys.db")
	code, _, stderr := runArgs(t, "verify", "--quiet", "--messages", "10", "--path", missing)
	if code != exitFail || !strings.Contains(stderr, missing) || !strings.Contains(stderr, "does not exist") {
		t.Errorf("--path in a missing directory: exit %d, stderr %q", code, stderr)
	}
	url := deadNATS(t)
	code, _, stderr = runArgs(t, "verify", "--quiet", "--messages", "10", "--store", "memory", "--broker", "nats", "--nats-url", url)
	if code != exitFail || strings.Contains(stderr, "verify: verify:") || !strings.Contains(stderr, "dedup verify: connect to NATS at "+url) {
		t.Errorf("--broker nats on a dead server: exit %d, stderr %q", code, stderr)
	}
}

// TestWrongDatabaseSaysServerAnswered: a database that does not exist on
// a running server is reported as the server's answer, not as "is
// PostgreSQL running?".
func TestWrongDatabaseSaysServerAnswered(t *testing.T) {
	t.Parallel()
	cfg, err := pgconn.ParseConfig(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	conn := fmt.Sprintf("host=%s port=%d user=%s dbname=dedup_no_such_db sslmode=disable", cfg.Host, cfg.Port, cfg.User)
	for _, args := range [][]string{
		{"migrate", "--addr", conn},
		{"verify", "--quiet", "--store", "postgres", "--messages", "10", "--addr", conn},
	} {
		code, _, stderr := runArgs(t, args...)
		if code != exitFail || !strings.Contains(stderr, "answered") || !strings.Contains(stderr, `"dedup_no_such_db" does not exist`) ||
			!strings.Contains(stderr, "createdb") || strings.Contains(stderr, "is PostgreSQL running") {
			t.Errorf("%s: exit %d, stderr %q", args[0], code, stderr)
		}
	}
}
