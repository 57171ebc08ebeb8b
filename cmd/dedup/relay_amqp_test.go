package main

import (
	"bytes"
	"context"
	"io"
	"math/rand/v2"
	"net/http"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/sqlitestore"
	amqp "github.com/rabbitmq/amqp091-go"
)

// TestRelayAMQP runs `dedup relay --broker rabbitmq` over a SQLite
// outbox: every row reaches the queue under its own ID as message_id, in
// commit order per key; a row to a routing key no queue is bound to is
// quarantined (the broker returned it), not counted as published.
func TestRelayAMQP(t *testing.T) {
	url := testenv.AMQPURL(t)
	ctx := t.Context()
	queue := "relaytest-" + strconv.FormatUint(rand.Uint64()>>20, 36)
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(queue, false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = ch.QueueDelete(queue, false, false, false) })

	path := filepath.Join(t.TempDir(), "outbox.db")
	s, err := sqlitestore.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.MigrateOutbox(ctx); err != nil {
		t.Fatal(err)
	}
	tx, err := s.DB().BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	for i := range 20 {
		id := "evt-" + strconv.Itoa(i)
		want = append(want, id)
		if err := s.WriteOutbox(ctx, tx, outbox.Message{ID: id, Topic: queue, Key: "order/1", Payload: []byte(id)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.WriteOutbox(ctx, tx, outbox.Message{ID: "lost-1", Topic: queue + "-nowhere", Key: "order/2", Payload: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}

	f := relayFlags{store: "sqlite", sqlitePath: path, broker: "rabbitmq", parts: 4, batch: 50, lease: 2 * time.Second,
		poll: 50 * time.Millisecond, attempts: 3, policy: "block", ackWait: 10 * time.Second, amqp: relayAMQPFlags{url: url},
		metricsListen: "127.0.0.1:" + testenv.FreePort(t)}
	if err := f.check(); err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	src, closeSrc, err := openOutboxSource(rctx, &f)
	if err != nil {
		t.Fatal(err)
	}
	defer closeSrc()
	var stdout, stderr bytes.Buffer
	code := make(chan int, 1)
	go func() { code <- runRelayAMQP(rctx, &f, src, &stdout, &stderr) }()

	deadline := time.Now().Add(90 * time.Second)
	for {
		q, err := ch.QueueDeclarePassive(queue, false, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		if q.Messages == len(want) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d messages arrived", q.Messages, len(want))
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The relay's /metrics counts what it published (marking follows the
	// broker's acknowledgement: wait for it).
	for {
		resp, err := http.Get("http://" + f.metricsListen + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if regexp.MustCompile(`(?m)^dedup_outbox_published_total\{[^}]*\} 20$`).Match(body) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/metrics never showed 20 published:\n%s", body)
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	if c := <-code; c != exitOK {
		t.Fatalf("relay exit %d: %s %s", c, stdout.String(), stderr.String())
	}
	var got []string
	for {
		d, ok, err := ch.Get(queue, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			break
		}
		got = append(got, d.MessageId)
	}
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("got %v, want %v in order", got, want)
	}
	if !strings.Contains(stdout.String(), "20 published") || !strings.Contains(stdout.String(), "1 quarantined") {
		t.Errorf("summary %q: want 20 published, 1 quarantined", stdout.String())
	}
}
