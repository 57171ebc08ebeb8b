package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/dedupkit/dedup/dedupamqp"
	"github.com/dedupkit/dedup/outbox"
)

// relayAMQPFlags are the flags of `dedup relay --broker rabbitmq`.
type relayAMQPFlags struct {
	url      string
	exchange string
}

func (a *relayAMQPFlags) define(fs *flag.FlagSet) {
	fs.StringVar(&a.url, "amqp-url", "", "for --broker rabbitmq: the server `URL` (default: $DEDUP_AMQP_URL or amqp://guest:guest@127.0.0.1:5672/)")
	fs.StringVar(&a.exchange, "exchange", "", "for --broker rabbitmq: the `exchange` to publish to, each message's topic as routing key (default: the default exchange, the topic naming a queue)")
}

func (a *relayAMQPFlags) urlOrDefault() string {
	if a.url != "" {
		return a.url
	}
	if v := os.Getenv("DEDUP_AMQP_URL"); v != "" {
		return v
	}
	return "amqp://guest:guest@127.0.0.1:5672/"
}

// runRelayAMQP is runRelay publishing to RabbitMQ: confirm mode,
// mandatory (an unroutable message is quarantined, not lost), message_id =
// the outbox row's ID on every attempt.
func runRelayAMQP(ctx context.Context, f *relayFlags, src outbox.Source, stdout, stderr io.Writer) int {
	url := f.amqp.urlOrDefault()
	pub, err := dedupamqp.NewPublisher(url, dedupamqp.WithExchange(f.amqp.exchange))
	if err != nil {
		fmt.Fprintf(stderr, "dedup relay: %v\n", err)
		return exitUsage
	}
	defer pub.Close()
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	rl, err := outbox.NewRelay(src, pub.Outbox(f.ackWait), f.options(log)...)
	if err != nil {
		fmt.Fprintf(stderr, "dedup relay: %v\n", err)
		return exitFail
	}
	fmt.Fprintf(stderr, "dedup relay %s: %s outbox -> RabbitMQ %s exchange %q, %d partitions\n", rl.ID(), f.store, url, f.amqp.exchange, f.parts)
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
