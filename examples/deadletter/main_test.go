package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/dedupkit/dedup/dedupnats"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestDeadLetterOne: a run leaves exactly one new record in the
// dead-letter stream, the message it published, with its attempts, and a
// second run adds one more (not the first run's message again).
func TestDeadLetterOne(t *testing.T) {
	url := testenv.NATSURL(t)
	// Streams of the test's own: another run of this test beside it
	// (go test -count, a second go test) must not purge its message.
	suffix := rand.Uint32()
	name, stream := fmt.Sprintf("T_DLQ_DEMO_%08x", suffix), fmt.Sprintf("T_DEMO_PAYMENTS_%08x", suffix)
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		js.DeleteStream(ctx, name)
		js.DeleteStream(ctx, stream)
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var ids []string
	for range 2 {
		id, err := deadLetterOne(ctx, url, name, stream)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := strconv.ParseUint(id, 10, 64); err != nil {
			t.Fatalf("record ID %q is not a stream sequence", id)
		}
		ids = append(ids, id)
	}
	dlq, err := dedupnats.NewDLQ(ctx, js, name)
	if err != nil {
		t.Fatal(err)
	}
	all, err := dlq.List(ctx, "", 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 2 || all[0].ID != ids[0] || all[1].ID != ids[1] || all[0].Message.ID == all[1].Message.ID || all[0].Attempts != 3 {
		t.Fatalf("dead letters %+v, want the two runs' own messages with 3 attempts each", all)
	}
}
