package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/dedupkit/dedup/dedupkafka"
	"github.com/dedupkit/dedup/outbox"
)

// relayKafkaFlags are the flags of `dedup relay --broker kafka`.
type relayKafkaFlags struct {
	brokers string
}

func (k *relayKafkaFlags) define(fs *flag.FlagSet) {
	fs.StringVar(&k.brokers, "brokers", "", "for --broker kafka: comma-separated seed `brokers` host:port (default: $DEDUP_KAFKA_BROKERS or 127.0.0.1:9092)")
}

func (k *relayKafkaFlags) seeds() []string {
	v := k.brokers
	if v == "" {
		v = os.Getenv("DEDUP_KAFKA_BROKERS")
	}
	if v == "" {
		v = "127.0.0.1:9092"
	}
	var out []string
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}

// runRelayKafka is runRelay publishing to Kafka: the idempotent producer
// with acks=all, each row's ID as the Dedup-Msg-Id header on every
// attempt, its aggregate key as the record key.
func runRelayKafka(ctx context.Context, f *relayFlags, src outbox.Source, stdout, stderr io.Writer) int {
	seeds := f.kafka.seeds()
	pub, err := dedupkafka.NewPublisher(seeds, dedupkafka.WithDeliveryTimeout(f.ackWait))
	if err != nil {
		fmt.Fprintf(stderr, "dedup relay: %v\n", err)
		return exitUsage
	}
	defer pub.Close()
	return runRelayLoop(ctx, f, src, pub.Outbox(), "Kafka "+strings.Join(seeds, ","), stdout, stderr)
}
