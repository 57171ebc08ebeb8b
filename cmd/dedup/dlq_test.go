package main

import (
	"context"
	"encoding/json"
	"math/rand/v2"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/dedupnats"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestDLQListInspectReplay dead-letters three messages into a real
// dead-letter stream, marks one key completed in the consumer's SQLite
// store, and drives the command: list and inspect show the records
// without payloads unless asked; a dry run changes nothing; the replay
// republishes exactly the two that never completed, under their original
// message IDs, and deletes their records.
func TestDLQListInspectReplay(t *testing.T) {
	url := testenv.NATSURL(t)
	t.Setenv("DEDUP_NATS_URL", url)
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ctx := t.Context()
	suffix := strconv.FormatUint(rand.Uint64()>>20, 36)
	dlqName, target := "DLQTEST_"+suffix, "orders-"+suffix
	q, err := dedupnats.NewDLQ(ctx, js, dlqName, dedupnats.WithMemoryStorage())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), dlqName) })
	// The consumer's own stream, to see what a replay publishes.
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS_" + suffix, Subjects: []string{target + ".>"}, Storage: jetstream.MemoryStorage}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), "ORDERS_"+suffix) })

	dbPath := filepath.Join(t.TempDir(), "consumer.db")
	store, err := sqlitestore.Open(dbPath)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	for i, id := range []string{"m1", "m2", "m3"} {
		key := dedup.Key{Scope: "billing", ID: id}
		err := q.DeadLetter(ctx, consumer.DeadLetter{
			Consumer: "billing", Key: key, Class: consumer.ClassPermanent, Reason: "schema v9 unknown", Attempts: 3,
			FirstFailure: now.Add(-time.Minute), LastFailure: now,
			Message: consumer.Message{ID: id, BusinessKey: "order-" + strconv.Itoa(i), Subject: target + ".created",
				Payload: []byte(`{"card":"4242"}`), Headers: map[string]string{"Trace": "t" + id}},
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	// m2 was completed by a later redelivery before anyone replayed it.
	c, err := store.Claim(ctx, dedup.Key{Scope: "billing", ID: "m2"}, "", time.Minute)
	if err != nil || c.Outcome != dedup.Acquired {
		t.Fatal(c.Outcome, err)
	}
	if err := store.Complete(ctx, c, nil, time.Hour); err != nil {
		t.Fatal(err)
	}
	store.Close()

	code, out, errs := runArgs(t, "dlq", "list", "--stream", dlqName)
	if code != exitOK || strings.Count(out, "billing") != 3 || !strings.Contains(out, "3 records") || strings.Contains(out, "4242") {
		t.Fatalf("list: exit %d\n%s%s", code, out, errs)
	}
	code, out, _ = runArgs(t, "dlq", "list", "--stream", dlqName, "--json", "--limit", "2")
	var lines []map[string]any
	if code != exitOK || json.Unmarshal([]byte(out), &lines) != nil || len(lines) != 2 || lines[0]["message_id"] != "m1" {
		t.Fatalf("list --json --limit 2: exit %d\n%s", code, out)
	}
	id := lines[1]["id"].(string)

	code, out, _ = runArgs(t, "dlq", "inspect", "--stream", dlqName, id)
	if code != exitOK || !strings.Contains(out, "m2") || !strings.Contains(out, "order-1") || !strings.Contains(out, "Trace: tm2") ||
		strings.Contains(out, "4242") || !strings.Contains(out, "--payload") {
		t.Fatalf("inspect: exit %d\n%s", code, out)
	}
	code, out, _ = runArgs(t, "dlq", "inspect", "--stream", dlqName, "--payload", id)
	if code != exitOK || !strings.Contains(out, "4242") {
		t.Fatalf("inspect --payload: exit %d\n%s", code, out)
	}
	if code, _, errs := runArgs(t, "dlq", "inspect", "--stream", dlqName, "999999"); code != exitFail || !strings.Contains(errs, "no record") {
		t.Fatalf("inspect of a missing record: exit %d %s", code, errs)
	}

	code, out, errs = runArgs(t, "dlq", "replay", "--stream", dlqName, "--dry-run", "--store", "sqlite", "--path", dbPath)
	if code != exitOK || !strings.Contains(out, "would replay 2, already completed 1") {
		t.Fatalf("dry run: exit %d\n%s%s", code, out, errs)
	}
	if n, _ := q.Count(ctx); n != 3 {
		t.Fatalf("the dry run changed the dead-letter stream: %d records", n)
	}
	orders, _ := js.Stream(ctx, "ORDERS_"+suffix)
	if info, _ := orders.Info(ctx); info.State.Msgs != 0 {
		t.Fatalf("the dry run published %d messages", info.State.Msgs)
	}

	code, out, errs = runArgs(t, "dlq", "replay", "--stream", dlqName, "--store", "sqlite", "--path", dbPath, "--rate", "-1", "--json")
	var rep struct {
		R int `json:"replayed"`
		A int `json:"already_completed"`
		F int `json:"failed"`
	}
	if code != exitOK || json.Unmarshal([]byte(out), &rep) != nil || rep.R != 2 || rep.A != 1 || rep.F != 0 {
		t.Fatalf("replay: exit %d\n%s%s", code, out, errs)
	}
	if n, _ := q.Count(ctx); n != 0 {
		t.Fatalf("%d records left after the replay", n)
	}
	info, _ := orders.Info(ctx)
	if info.State.Msgs != 2 {
		t.Fatalf("replay published %d messages, want 2", info.State.Msgs)
	}
	got := map[string]bool{}
	for seq := uint64(1); seq <= 2; seq++ {
		m, err := orders.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		got[m.Header.Get("Dedup-Msg-Id")] = true
		if m.Subject != target+".created" || string(m.Data) != `{"card":"4242"}` {
			t.Fatalf("republished %s %q", m.Subject, m.Data)
		}
	}
	if !got["m1"] || !got["m3"] {
		t.Fatalf("republished IDs %v, want the original m1 and m3", got)
	}
}

func TestDLQBadUsage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"dlq", "purge"}, "unknown subcommand"},
		{[]string{"dlq", "inspect"}, "exactly one record ID"},
		{[]string{"dlq", "replay", "--rate", "0"}, "--rate"},
		{[]string{"dlq", "replay", "--store", "memory"}, "--store"},
		{[]string{"dlq", "replay", "--store", "sqlite"}, "--path"},
		{[]string{"dlq", "replay", "--id", "x7"}, "--id"},
		{[]string{"dlq", "list", "--limit", "-1"}, "--limit"},
		{[]string{"dlq", "list", "extra"}, "unexpected argument"},
	} {
		code, _, errs := runArgs(t, tc.args...)
		if code != exitUsage || !strings.Contains(errs, tc.want) {
			t.Errorf("%v: exit %d, stderr %q, want exit 2 and %q", tc.args, code, errs, tc.want)
		}
	}
}
