package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/sqlitestore"
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
	dropAndRetryPoison(t, base)
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
		{"verify", "--outbox", "--broker", "pulsar"},
	} {
		if code, _, stderr := runArgs(t, args...); code != exitUsage {
			t.Errorf("%v: exit %d (%s), want %d", args, code, stderr, exitUsage)
		}
	}
	if code, stdout, _ := runArgs(t, "relay", "-h"); code != exitOK || !strings.Contains(stdout, "Usage: dedup relay") {
		t.Errorf("relay -h: %d", code)
	}
}

// dedup outbox --store sqlite on a real SQLite file: status counts the
// backlog, the quarantine, the lease and the relay; list shows the poison
// row; drop --dry-run keeps it; drop refuses a row in line; retry puts it
// back in line; a missing file is an error, not a new database.
func TestOutboxCommandSQLite(t *testing.T) {
	path := filepath.Join(t.TempDir(), "outbox.db")
	s, err := sqlitestore.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	src, err := s.OutboxSource(ctx, 4)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := s.DB().BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.WriteOutbox(ctx, tx, outbox.Message{ID: "in-line", Key: "a", Topic: "t"}, outbox.Message{ID: "poison", Key: "b", Topic: "t"}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if _, err := src.Join(ctx, "relay-x", time.Hour); err != nil {
		t.Fatal(err)
	}
	var part int
	if err := s.DB().QueryRow(`SELECT khash % 4 FROM dedup_records_outbox WHERE message_key = 'poison'`).Scan(&part); err != nil {
		t.Fatal(err)
	}
	l, ok, err := src.Acquire(ctx, "relay-x", part, time.Hour)
	if err != nil || !ok {
		t.Fatal(ok, err)
	}
	var seq int64
	s.DB().QueryRow(`SELECT id FROM dedup_records_outbox WHERE message_key = 'poison'`).Scan(&seq)
	if err := src.Fail(ctx, l, []outbox.Failure{{Seq: seq, Err: "too large", Quarantine: true}}); err != nil {
		t.Fatal(err)
	}
	base := []string{"--store", "sqlite", "--sqlite-path", path, "--outbox-partitions", "4"}
	code, stdout, stderr := runArgs(t, append([]string{"outbox", "status"}, base...)...)
	if code != exitOK || !strings.Contains(stdout, "backlog 1,") || !strings.Contains(stdout, "quarantined 1,") || strings.Count(stdout, "partition ") != 4 ||
		!strings.Contains(stdout, "relay-x (epoch 1,") || !strings.Contains(stdout, "relay relay-x: alive, 4 partitions") || strings.Contains(stdout, "transaction") {
		t.Fatalf("status: %d\n%s%s", code, stdout, stderr)
	}
	code, stdout, _ = runArgs(t, append([]string{"outbox", "list", "--quarantined"}, base...)...)
	if code != exitOK || !strings.Contains(stdout, "poison") || !strings.Contains(stdout, "too large") || !strings.Contains(stdout, "attempts=1") || strings.Contains(stdout, "in-line") {
		t.Fatalf("list --quarantined: %d\n%s", code, stdout)
	}
	code, stdout, _ = runArgs(t, append([]string{"outbox", "list"}, base...)...)
	if code != exitOK || !strings.Contains(stdout, "in-line") || strings.Contains(stdout, "poison") {
		t.Fatalf("list: %d\n%s", code, stdout)
	}
	dropAndRetryPoison(t, base)
	var attempts int
	s.DB().QueryRow(`SELECT attempts FROM dedup_records_outbox WHERE message_key = 'poison'`).Scan(&attempts)
	if attempts != 0 {
		t.Fatalf("retried row has %d attempts, want 0", attempts)
	}
	// Quarantine it again and drop it for real.
	if err := src.Fail(ctx, l, []outbox.Failure{{Seq: seq, Err: "again", Quarantine: true}}); err != nil {
		t.Fatal(err)
	}
	code, stdout, _ = runArgs(t, append([]string{"outbox", "drop", "poison"}, base...)...)
	if code != exitOK || !strings.Contains(stdout, "dropped") {
		t.Fatalf("drop: %d %s", code, stdout)
	}
	var left int
	s.DB().QueryRow(`SELECT count(*) FROM dedup_records_outbox`).Scan(&left)
	if left != 1 {
		t.Fatalf("%d rows left after the drop, want the row in line", left)
	}
	missing := filepath.Join(t.TempDir(), "nope.db")
	if code, _, _ := runArgs(t, "outbox", "status", "--store", "sqlite", "--sqlite-path", missing); code != exitFail {
		t.Fatalf("missing file: exit %d, want %d", code, exitFail)
	}
	if _, err := os.Stat(missing); err == nil {
		t.Fatal("dedup outbox created a database at a wrong path")
	}
	for _, args := range [][]string{{"outbox", "status", "--store", "sqlite"}, {"outbox", "status", "--store", "redis"}} {
		if code, _, _ := runArgs(t, args...); code != exitUsage {
			t.Errorf("%v: exit %d, want %d", args, code, exitUsage)
		}
	}
}

// dropAndRetryPoison runs the admin commands both engines share on a table
// holding one quarantined row, "poison", and one row in line, "in-line":
// a dry-run drop, a refused drop of the row in line, a retry, and the status
// that follows it.
func dropAndRetryPoison(t *testing.T, base []string) {
	t.Helper()
	code, stdout, _ := runArgs(t, append([]string{"outbox", "drop", "poison", "--dry-run"}, base...)...)
	if code != exitOK || !strings.Contains(stdout, "dry run") {
		t.Fatalf("drop --dry-run: %d %s", code, stdout)
	}
	code, _, stderr := runArgs(t, append([]string{"outbox", "drop", "in-line"}, base...)...)
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
}
