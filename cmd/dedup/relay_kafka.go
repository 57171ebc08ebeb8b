package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

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
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	rl, err := outbox.NewRelay(src, pub.Outbox(), f.options(log)...)
	if err != nil {
		fmt.Fprintf(stderr, "dedup relay: %v\n", err)
		return exitFail
	}
	fmt.Fprintf(stderr, "dedup relay %s: %s outbox -> Kafka %s, %d partitions\n", rl.ID(), f.store, strings.Join(seeds, ","), f.parts)
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		if f.progress <= 0 {
			return
		}
		t := time.NewTicker(f.progress)
		defer t.Stop()
		var last int64
		for {
			select {
			case <-done:
				return
			case <-t.C:
				st := rl.Stats()
				fmt.Fprintf(stderr, "relay %s: %d published (%.0f/s), %d failed, %d quarantined, %d partitions held\n",
					rl.ID(), st.Published, float64(st.Published-last)/f.progress.Seconds(), st.Failed, st.Quarantined, st.Partitions)
				last = st.Published
			}
		}
	}()
	err = rl.Run(ctx)
	close(done)
	<-stopped
	st := rl.Stats()
	fmt.Fprintf(stdout, "relay %s stopped: %d published, %d failed, %d quarantined, %d batches\n", rl.ID(), st.Published, st.Failed, st.Quarantined, st.Batches)
	if err != nil {
		fmt.Fprintf(stderr, "dedup relay: %v\n", err)
		return exitFail
	}
	return exitOK
}
