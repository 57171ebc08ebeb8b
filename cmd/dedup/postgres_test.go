package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/jackc/pgx/v5"
)

// pgSchema returns a fresh schema name on the test database, dropped at the
// end of the test, and a connection to it.
func pgSchema(t *testing.T) (url, schema string, conn *pgx.Conn) {
	t.Helper()
	url = testenv.PostgresURL(t)
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	schema = fmt.Sprintf("dedup_t_cli_%08x", rand.Uint32())
	t.Cleanup(func() {
		conn.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+schema+` CASCADE`)
		conn.Close(context.Background())
	})
	return url, schema, conn
}

func TestMigrateAndSweep(t *testing.T) {
	t.Parallel()
	url, schema, conn := pgSchema(t)
	ctx := context.Background()

	code, stdout, stderr := runArgs(t, "sweep", "--addr", url, "--schema", schema)
	if code != exitFail || !strings.Contains(stderr, "dedup migrate") {
		t.Fatalf("sweep before migrate: exit %d, stderr %q; want 1 and advice to migrate", code, stderr)
	}

	code, stdout, stderr = runArgs(t, "migrate", "--addr", url, "--schema", schema)
	if code != exitOK || !strings.Contains(stdout, "applied 0001_records") || !strings.Contains(stdout, "now at version") {
		t.Fatalf("migrate: exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}
	code, stdout, _ = runArgs(t, "migrate", "--addr", url, "--schema", schema)
	if code != exitOK || !strings.Contains(stdout, "nothing to do") {
		t.Fatalf("second migrate: exit %d, stdout %q", code, stdout)
	}

	// 250 records that expired a minute ago, 5 live ones, and a retention
	// window shorter than its replay horizon.
	if _, err := conn.Exec(ctx, `INSERT INTO `+schema+`.dedup_rec (scope, id, state, token, deadline, attempts)
SELECT `+schema+`.dedup_scope_id('s'), convert_to('old-' || g, 'UTF8'), 2, '\x01', now() - interval '1 minute', 1 FROM generate_series(1, 250) g;
INSERT INTO `+schema+`.dedup_rec (scope, id, state, token, deadline, attempts)
SELECT `+schema+`.dedup_scope_id('s'), convert_to('live-' || g, 'UTF8'), 2, '\x01', now() + interval '1 hour', 1 FROM generate_series(1, 5) g;
INSERT INTO `+schema+`.dedup_retention (scope, retention, replay_horizon) VALUES ('payments', '1 hour', '1 day')`); err != nil {
		t.Fatal(err)
	}
	code, stdout, _ = runArgs(t, "migrate", "--addr", url, "--schema", schema)
	if code != exitOK || !strings.Contains(stdout, "warning: scope payments: retention 1h0m0s is shorter than the replay horizon 24h0m0s") {
		t.Fatalf("migrate with a short retention: exit %d, stdout %q; want a warning", code, stdout)
	}

	code, stdout, stderr = runArgs(t, "sweep", "--addr", url, "--schema", schema, "--batch", "100")
	if code != exitOK || !strings.Contains(stdout, "deleted 100 expired records in 1 batch") ||
		!strings.Contains(stdout, "lag behind expiry: max 1m") || !strings.Contains(stdout, "more expired records remain") {
		t.Fatalf("one sweep batch: exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}
	code, stdout, stderr = runArgs(t, "sweep", "--addr", url, "--schema", schema, "--batch", "100", "--until-empty", "--json")
	if code != exitOK {
		t.Fatalf("sweep --until-empty: exit %d, stderr %q", code, stderr)
	}
	var rep sweepReport
	if err := json.Unmarshal([]byte(stdout), &rep); err != nil {
		t.Fatalf("sweep --json: %v\n%s", err, stdout)
	}
	if rep.Deleted != 150 || rep.Batches != 2 || rep.MoreRemain || rep.MaxLagSeconds < 60 {
		t.Fatalf("sweep --until-empty --json = %+v; want the 150 left in 2 batches", rep)
	}
	var left int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM `+schema+`.dedup_rec`).Scan(&left); err != nil || left != 5 {
		t.Fatalf("%d records left, want the 5 live ones (%v)", left, err)
	}
}

func TestMigrateAndSweepPartitions(t *testing.T) {
	t.Parallel()
	url, schema, _ := pgSchema(t)
	code, stdout, stderr := runArgs(t, "migrate", "--addr", url, "--schema", schema, "--prefix", "p_", "--partitions", "24h", "--ahead", "48h", "--json")
	if code != exitOK {
		t.Fatalf("migrate --partitions: exit %d, stderr %q", code, stderr)
	}
	var rep migrateReport
	if err := json.Unmarshal([]byte(stdout), &rep); err != nil {
		t.Fatalf("migrate --json: %v\n%s", err, stdout)
	}
	if len(rep.Applied) == 0 || len(rep.PartitionsCreated) != 3 || !strings.HasPrefix(rep.PartitionsCreated[0], "p_rec_p_") || rep.Prefix != "p_" {
		t.Fatalf("migrate --partitions 24h --ahead 48h = %+v; want 3 daily partitions", rep)
	}
	code, stdout, stderr = runArgs(t, "sweep", "--addr", url, "--schema", schema, "--prefix", "p_")
	if code != exitOK || !strings.Contains(stdout, "has 3 partitions; pass --partitions") {
		t.Fatalf("sweep without --partitions on a partitioned schema: exit %d, stdout %q, stderr %q; want a hint", code, stdout, stderr)
	}
	code, stdout, stderr = runArgs(t, "sweep", "--addr", url, "--schema", schema, "--prefix", "p_", "--partitions", "24h", "--ahead", "72h")
	if code != exitOK || !strings.Contains(stdout, "partitions dropped: none") || !strings.Contains(stdout, "partitions created: p_rec_p_") {
		t.Fatalf("sweep --partitions: exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}
}

func TestMigrateUnreachable(t *testing.T) {
	t.Parallel()
	url := "postgres://postgres@127.0.0.1:" + testenv.FreePort(t) + "/test?sslmode=disable&connect_timeout=5"
	for _, cmd := range []string{"migrate", "sweep"} {
		code, stdout, stderr := runArgs(t, cmd, "--addr", url)
		if code != exitFail || stdout != "" || !strings.Contains(stderr, "--addr") || !strings.Contains(stderr, "DEDUP_POSTGRES_URL") {
			t.Errorf("%s on a closed port: exit %d, stdout %q, stderr %q; want 1 and how to point it at the database", cmd, code, stdout, stderr)
		}
	}
}

func TestMigrateSweepBadFlags(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"migrate", "--bogus"}, []string{"--bogus"}},
		{[]string{"migrate", "--schema", "Bad-Name"}, []string{"--schema", "lower-case"}},
		{[]string{"migrate", "--prefix", "x y"}, []string{"--prefix"}},
		{[]string{"migrate", "--partitions", "30m"}, []string{"--partitions", "whole number of hours"}},
		{[]string{"migrate", "--partitions", "24h", "--ahead", "1h"}, []string{"--ahead"}},
		{[]string{"migrate", "--timeout", "0s"}, []string{"--timeout"}},
		{[]string{"migrate", "leftover"}, []string{`"leftover"`}},
		{[]string{"sweep", "--batch", "0"}, []string{"--batch", "between 1 and"}},
		{[]string{"sweep", "--batch", "many"}, []string{"--batch", `"many"`}},
		{[]string{"sweep", "--max-batches", "3"}, []string{"--max-batches", "--until-empty"}},
		{[]string{"sweep", "--until-empty", "--pause", "-1s"}, []string{"--pause"}},
		{[]string{"sweep", "--addr"}, []string{"--addr", "needs a value"}},
	} {
		code, stdout, stderr := runArgs(t, tc.args...)
		if code != exitUsage || stdout != "" {
			t.Errorf("%q: exit %d, stdout %q; want %d and nothing on stdout", tc.args, code, stdout, exitUsage)
		}
		for _, w := range tc.want {
			if !strings.Contains(stderr, w) {
				t.Errorf("%q: stderr %q does not contain %q", tc.args, stderr, w)
			}
		}
	}
	for _, args := range [][]string{{"migrate", "-h"}, {"help", "sweep"}} {
		code, stdout, _ := runArgs(t, args...)
		if code != exitOK || !strings.Contains(stdout, "--addr") || !strings.Contains(stdout, "--schema") || !strings.Contains(stdout, "DEDUP_POSTGRES_URL") {
			t.Errorf("%q: exit %d, help %q", args, code, stdout)
		}
	}
}
