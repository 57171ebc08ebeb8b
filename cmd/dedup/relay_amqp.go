package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"

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
	return runRelayLoop(ctx, f, src, pub.Outbox(f.ackWait), "RabbitMQ "+url+" exchange "+strconv.Quote(f.amqp.exchange), stdout, stderr)
}
