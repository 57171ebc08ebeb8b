package main

import (
	"encoding/json"
	"math/rand/v2"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/dedupamqp"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/sqlitestore"
	amqp "github.com/rabbitmq/amqp091-go"
)

// TestDLQAMQPListInspectReplay dead-letters three messages into a real
// RabbitMQ dead-letter queue, marks one key completed in the consumer's
// SQLite store, and drives `dedup dlq --broker rabbitmq`: list and
// inspect show the records; the replay republishes exactly the two that
// never completed, to the consumer's queue under their original message
// IDs, and deletes their records.
func TestDLQAMQPListInspectReplay(t *testing.T) {
	url := testenv.AMQPURL(t)
	t.Setenv("DEDUP_AMQP_URL", url)
	ctx := t.Context()
	suffix := strconv.FormatUint(rand.Uint64()>>20, 36)
	dlqName, work := "dlqtest-"+suffix, "orders-"+suffix
	q, err := dedupamqp.NewDLQ(ctx, url, dlqName, "")
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(work, false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = ch.QueueDelete(work, false, false, false)
		_, _ = ch.QueueDelete(dlqName, false, false, false)
		_ = ch.ExchangeDelete(dlqName, false, false)
	})

	dbPath := filepath.Join(t.TempDir(), "consumer.db")
	store, err := sqlitestore.Open(dbPath)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	for i, id := range []string{"m1", "m2", "m3"} {
		err := q.DeadLetter(ctx, consumer.DeadLetter{
			Consumer: "billing", Key: dedup.Key{Scope: "billing", ID: id}, Class: consumer.ClassPermanent,
			Reason: "schema v9 unknown", Attempts: 3, FirstFailure: now, LastFailure: now.Add(time.Duration(i) * time.Second),
			Message: consumer.Message{ID: id, Subject: work, Payload: []byte("secret " + id), Headers: map[string]string{"X-Trace": "t-" + id}},
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	// m1 completed meanwhile.
	c, err := store.Claim(ctx, dedup.Key{Scope: "billing", ID: "m1"}, "", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Complete(ctx, c, nil, time.Hour); err != nil {
		t.Fatal(err)
	}
	store.Close()

	code, out, errOut := runArgs(t, "dlq", "list", "--broker", "rabbitmq", "--queue", dlqName, "--json")
	if code != exitOK {
		t.Fatalf("list: %d %s", code, errOut)
	}
	var lines []dlqLine
	if err := json.Unmarshal([]byte(out), &lines); err != nil || len(lines) != 3 {
		t.Fatalf("list: %v %s", err, out)
	}
	if lines[0].MessageID != "m1" || lines[0].Consumer != "billing" || lines[0].Key != "billing/m1" || strings.Contains(out, "secret") {
		t.Errorf("list line %+v", lines[0])
	}
	code, out, errOut = runArgs(t, "dlq", "inspect", lines[1].ID, "--broker=rabbitmq", "--queue", dlqName)
	if code != exitOK || !strings.Contains(out, "m2") || !strings.Contains(out, "X-Trace: t-m2") || strings.Contains(out, "secret") {
		t.Fatalf("inspect: %d %s %s", code, out, errOut)
	}
	code, out, errOut = runArgs(t, "dlq", "replay", "--broker", "rabbitmq", "--queue", dlqName, "--store", "sqlite", "--path", dbPath, "--rate", "-1")
	if code != exitOK || !strings.Contains(out, "replayed 2, already completed 1") {
		t.Fatalf("replay: %d %s %s", code, out, errOut)
	}
	var got []string
	for {
		d, ok, err := ch.Get(work, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			break
		}
		got = append(got, d.MessageId)
		if string(d.Body) != "secret "+d.MessageId || d.Headers["X-Trace"] != "t-"+d.MessageId {
			t.Errorf("replayed %s lost its body or headers: %q %v", d.MessageId, d.Body, d.Headers)
		}
	}
	if strings.Join(got, ",") != "m2,m3" {
		t.Errorf("replayed %v, want m2,m3", got)
	}
	if recs, err := q.List(ctx, "", 0); err != nil || len(recs) != 0 {
		t.Errorf("records left: %d %v", len(recs), err)
	}
}

func TestDLQAMQPBadUsage(t *testing.T) {
	for _, args := range [][]string{
		{"dlq", "list", "--broker", "pulsar"},
		{"dlq", "list", "--broker"},
		{"dlq", "inspect", "--broker", "rabbitmq"},
		{"dlq", "replay", "--broker", "rabbitmq", "--rate", "0"},
		{"dlq", "replay", "--broker", "rabbitmq", "--store", "sqlite"},
		{"dlq", "list", "--broker", "rabbitmq", "--limit", "-1"},
	} {
		if code, _, _ := runArgs(t, args...); code != exitUsage {
			t.Errorf("%v: exit %d, want %d", args, code, exitUsage)
		}
	}
}
