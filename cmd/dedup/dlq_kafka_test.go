package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/dedupkafka"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

// dedup dlq list, inspect and replay over a dead-letter topic on the
// in-process kfake cluster: the replay produces the records back to their
// topic under their original IDs and keys, and tombstones them.
func TestDLQKafka(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	seeds := strings.Join(c.ListenAddrs(), ",")
	ctx := context.Background()
	q, err := dedupkafka.NewDLQ(ctx, c.ListenAddrs(), "orders.dlq")
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	for _, id := range []string{"m1", "m2"} {
		err := q.DeadLetter(ctx, consumer.DeadLetter{Consumer: "billing", Key: dedup.Key{Scope: "billing", ID: id},
			Message: consumer.Message{ID: id, Subject: "orders", Payload: []byte("p-" + id),
				Headers: map[string]string{dedupkafka.HeaderKafkaKey: "k-" + id, "trace": "t"}},
			Class: consumer.ClassPermanent, Reason: "bad", Attempts: 3, LastFailure: time.Now()})
		if err != nil {
			t.Fatal(err)
		}
	}
	base := []string{"--broker", "kafka", "--brokers", seeds, "--topic", "orders.dlq"}
	code, out, errOut := runArgs(t, append([]string{"dlq", "list"}, base...)...)
	if code != exitOK || !strings.Contains(out, "2 records") || !strings.Contains(out, "m1") {
		t.Fatalf("list: %d %s %s", code, out, errOut)
	}
	recs, _ := q.List(ctx, "", 0)
	code, out, errOut = runArgs(t, append([]string{"dlq", "inspect", recs[0].ID, "--payload"}, base...)...)
	if code != exitOK || !strings.Contains(out, `"p-m1"`) || !strings.Contains(out, "billing") {
		t.Fatalf("inspect: %d %s %s", code, out, errOut)
	}
	code, out, errOut = runArgs(t, append([]string{"dlq", "replay", "--rate", "-1"}, base...)...)
	if code != exitOK || !strings.Contains(out, "replayed 2") {
		t.Fatalf("replay: %d %s %s", code, out, errOut)
	}
	if left, err := q.List(ctx, "", 0); err != nil || len(left) != 0 {
		t.Fatalf("left after replay: %v %v", left, err)
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(c.ListenAddrs()...), kgo.ConsumeTopics("orders"))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	got := map[string]string{}
	for len(got) < 2 {
		fs := cl.PollFetches(ctx)
		fs.EachRecord(func(r *kgo.Record) {
			for _, h := range r.Headers {
				if h.Key == dedupkafka.HeaderMsgID {
					got[string(h.Value)] = string(r.Key)
				}
			}
		})
	}
	if got["m1"] != "k-m1" || got["m2"] != "k-m2" {
		t.Fatalf("replayed records (ID -> key) %v", got)
	}
	if code, _, _ := runArgs(t, "dlq", "list", "--broker", "kafka", "--brokers", seeds, "--topic", "nope"); code != exitFail {
		t.Errorf("missing topic: exit %d", code)
	}
	if code, _, _ := runArgs(t, "dlq", "list", "--broker", "kafka", "--limit", "-1"); code != exitUsage {
		t.Errorf("bad limit: exit %d", code)
	}
}
