package main

import (
	"context"
	"strings"
	"testing"
)

// dedup outbox on a migrated schema: status counts the backlog and the
// quarantine, list shows the poison row, drop --dry-run keeps it, retry
// puts it back in line, drop refuses a row in line; usage errors are 2.
func TestOutboxCommand(t *testing.T) {
	url, schema, conn := pgSchema(t)
	if code, _, stderr := runArgs(t, "migrate", "--addr", url, "--schema", schema); code != exitOK {
		t.Fatalf("migrate: %d %s", code, stderr)
	}
	ctx := context.Background()
	if _, err := conn.Exec(ctx, `INSERT INTO `+schema+`.dedup_outbox (message_key, aggregate, topic, payload) VALUES ('in-line', 'a', 't', ''), ('poison', 'b', 't', '');
UPDATE `+schema+`.dedup_outbox SET quarantined_at = now(), attempts = 3, last_error = 'too large' WHERE message_key = 'poison'`); err != nil {
		t.Fatal(err)
	}
	base := []string{"--addr", url, "--schema", schema, "--outbox-partitions", "4"}
	code, stdout, stderr := runArgs(t, append([]string{"outbox", "status"}, base...)...)
	if code != exitOK || !strings.Contains(stdout, "backlog 1,") || !strings.Contains(stdout, "quarantined 1,") || strings.Count(stdout, "partition ") != 4 {
		t.Fatalf("status: %d\n%s%s", code, stdout, stderr)
	}
	code, stdout, _ = runArgs(t, append([]string{"outbox", "list", "--quarantined"}, base...)...)
	if code != exitOK || !strings.Contains(stdout, "poison") || !strings.Contains(stdout, "too large") || strings.Contains(stdout, "in-line") {
		t.Fatalf("list --quarantined: %d\n%s", code, stdout)
	}
	code, stdout, _ = runArgs(t, append([]string{"outbox", "drop", "poison", "--dry-run"}, base...)...)
	if code != exitOK || !strings.Contains(stdout, "dry run") {
		t.Fatalf("drop --dry-run: %d %s", code, stdout)
	}
	code, _, stderr = runArgs(t, append([]string{"outbox", "drop", "in-line"}, base...)...)
	if code != exitFail || !strings.Contains(stderr, "no quarantined outbox row") {
		t.Fatalf("drop of a row in line: %d %s", code, stderr)
	}
	code, stdout, _ = runArgs(t, append([]string{"outbox", "retry", "poison"}, base...)...)
	if code != exitOK || !strings.Contains(stdout, "back in line") {
		t.Fatalf("retry: %d %s", code, stdout)
	}
	code, stdout, _ = runArgs(t, append([]string{"outbox", "status", "--json"}, base...)...)
	if code != exitOK || !strings.Contains(stdout, `"backlog": 2`) || !strings.Contains(stdout, `"quarantined": 0`) {
		t.Fatalf("status after retry: %d %s", code, stdout)
	}
	for _, args := range [][]string{{"outbox"}, {"outbox", "nope"}, {"outbox", "retry"}, {"outbox", "list", "--dry-run"}, {"outbox", "status", "--outbox-partitions", "0"}} {
		if code, _, _ := runArgs(t, args...); code != exitUsage {
			t.Errorf("%v: exit %d, want %d", args, code, exitUsage)
		}
	}
}

// dedup relay and verify --outbox refuse bad flags before any I/O.
func TestRelayUsage(t *testing.T) {
	for _, args := range [][]string{
		{"relay", "--store", "redis"},
		{"relay", "--store", "sqlite"},
		{"relay", "--broker", "pulsar"},
		{"relay", "--policy", "drop"},
		{"relay", "--batch", "0"},
		{"relay", "--lease", "1ms"},
		{"verify", "--outbox", "--store", "memory"},
		{"verify", "--outbox", "--relays", "0"},
	} {
		if code, _, stderr := runArgs(t, args...); code != exitUsage {
			t.Errorf("%v: exit %d (%s), want %d", args, code, stderr, exitUsage)
		}
	}
	if code, stdout, _ := runArgs(t, "relay", "-h"); code != exitOK || !strings.Contains(stdout, "Usage: dedup relay") {
		t.Errorf("relay -h: %d", code)
	}
}
