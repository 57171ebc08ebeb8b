package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/dedupamqp"
)

// splitBroker takes --broker out of args (a subcommand's arguments) and
// returns the rest with the broker named: nats (the default) or rabbitmq.
func splitBroker(args []string) ([]string, string, error) {
	broker := "nats"
	out := make([]string, 0, len(args))
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			out = append(out, args[i:]...)
			break
		}
		name, val, hasVal := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if !strings.HasPrefix(a, "-") || name != "broker" {
			out = append(out, a)
			continue
		}
		if !hasVal {
			if i+1 == len(args) {
				return nil, "", badUsage("flag --broker needs a value: nats, rabbitmq or kafka")
			}
			i++
			val = args[i]
		}
		broker = val
	}
	if broker != "nats" && broker != "rabbitmq" && broker != "kafka" {
		return nil, "", badUsage("--broker must be nats, rabbitmq or kafka, got %q", broker)
	}
	return out, broker, nil
}

const dlqAMQPAbout = `Usage: dedup dlq <list|inspect|replay> --broker rabbitmq [flags] [id]

Works on a dead-letter queue written by package dedupamqp (its DLQ): the
messages a consumer gave up on, each kept whole under its original
message_id and headers with the failure (consumer, key, class, reason,
attempts, failure times) in Dedup-DL-* headers, and the messages the
broker dead-lettered by itself to the same exchange (a quorum queue's
delivery limit), whose reason comes from x-death. Reading takes every
record off the queue unacknowledged and puts it back: fine for dead
letters, slow for a queue of millions.

  list     one line per record (no payloads)
  inspect  one record by ID; --payload also prints the payload
  replay   republish records to the queue they were consumed from, under
           their original message IDs, so the consumer's dedup decides
           again. With --store, keys completed meanwhile are not
           republished (their records are deleted) and keys held right
           now are skipped. --dry-run changes nothing. Replayed records
           are deleted unless --keep.

Exit status: 0 on success, 1 on failure (a replay with any failed record
included), 2 on bad usage.

Flags:
`

type dlqAMQPFlags struct {
	url   string
	queue string
	scope string
	dlqCommon
}

func newDLQAMQPFlagSet(sub string, f *dlqAMQPFlags) *flag.FlagSet {
	fs := flag.NewFlagSet("dedup dlq "+sub+" --broker rabbitmq", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&f.url, "amqp-url", "", "RabbitMQ server `URL` (default: $DEDUP_AMQP_URL or amqp://guest:guest@127.0.0.1:5672/)")
	fs.StringVar(&f.queue, "queue", "dlq", "dead-letter exchange and queue `name`")
	fs.StringVar(&f.scope, "scope", "", "dedup key `scope` of records the broker dead-lettered by itself (the consumer's scope; default: their key is left empty)")
	fs.BoolVar(&f.json, "json", false, "print JSON instead of text")
	fs.DurationVar(&f.timeout, "timeout", 5*time.Minute, "bound on the whole command")
	switch sub {
	case "list", "replay":
		fs.StringVar(&f.consumer, "consumer", "", "only records of this consumer `name`")
		fs.IntVar(&f.limit, "limit", 0, "at most `N` records (0: all)")
	}
	switch sub {
	case "inspect":
		fs.BoolVar(&f.payload, "payload", false, "print the payload too (it may hold personal or secret data)")
	case "replay":
		fs.BoolVar(&f.dryRun, "dry-run", false, "report what a replay would do; change nothing")
		fs.Float64Var(&f.rate, "rate", 10, "records republished per second at most (negative: no limit)")
		fs.StringVar(&f.ids, "id", "", "only these record `IDs`, comma-separated")
		fs.BoolVar(&f.keep, "keep", false, "keep replayed records in the dead-letter queue")
		fs.StringVar(&f.store, "store", "", "the consumer's dedup store, to skip keys that completed meanwhile: sqlite, redis or postgres (default: none)")
		fs.StringVar(&f.path, "path", "", "SQLite database `file` for --store sqlite")
		fs.StringVar(&f.addr, "addr", "", "server `address` for --store redis or postgres (default: $DEDUP_REDIS_ADDR / $DEDUP_POSTGRES_URL or loopback)")
	}
	return fs
}

func (f *dlqAMQPFlags) check(sub string) error {
	if f.url == "" {
		f.url = os.Getenv("DEDUP_AMQP_URL")
	}
	if f.url == "" {
		f.url = "amqp://guest:guest@127.0.0.1:5672/"
	}
	return f.dlqCommon.check(sub)
}

// runDLQAMQP is `dedup dlq` over a RabbitMQ dead-letter queue; args follow
// the subcommand, --broker taken out.
func runDLQAMQP(sub string, args []string, stdout, stderr io.Writer) int {
	var f dlqAMQPFlags
	fs := newDLQAMQPFlagSet(sub, &f)
	if err := parseInterspersed(fs, args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printUsage(stdout, dlqAMQPAbout, fs)
			return exitOK
		}
		fmt.Fprintf(stderr, "dedup dlq %s: %s\n", sub, flagError(fs, err))
		return exitUsage
	}
	rest := fs.Args()
	id := ""
	if sub == "inspect" {
		if len(rest) != 1 {
			fmt.Fprintln(stderr, "dedup dlq inspect: give exactly one record ID (see 'dedup dlq list --broker rabbitmq')")
			return exitUsage
		}
		id, rest = rest[0], nil
	}
	if len(rest) > 0 {
		fmt.Fprintf(stderr, "dedup dlq %s: unexpected argument %q\n", sub, rest[0])
		return exitUsage
	}
	if err := f.check(sub); err != nil {
		fmt.Fprintf(stderr, "dedup dlq %s: %v\n", sub, err)
		return exitUsage
	}
	ctx, cancel := commandContext(f.timeout)
	defer cancel()
	q, err := dedupamqp.OpenDLQ(ctx, f.url, f.queue, f.scope)
	if err != nil {
		fmt.Fprintf(stderr, "dedup dlq %s: %v\nSet --amqp-url or DEDUP_AMQP_URL to the server, --queue to the dead-letter queue\n", sub, err)
		return exitFail
	}
	defer q.Close()
	switch sub {
	case "list":
		return dlqAMQPList(ctx, &f, q, stdout, stderr)
	case "inspect":
		return dlqAMQPInspect(ctx, &f, q, id, stdout, stderr)
	}
	return dlqAMQPReplay(ctx, &f, q, stdout, stderr)
}

func dlqAMQPList(ctx context.Context, f *dlqAMQPFlags, q *dedupamqp.DLQ, stdout, stderr io.Writer) int {
	recs, err := q.List(ctx, "", 0)
	if err != nil {
		fmt.Fprintf(stderr, "dedup dlq list: %v\n", err)
		return exitFail
	}
	lines := []dlqLine{}
	for i := range recs {
		if f.consumer != "" && recs[i].Consumer != f.consumer {
			continue
		}
		if f.limit > 0 && len(lines) >= f.limit {
			break
		}
		lines = append(lines, lineOf(&recs[i]))
	}
	if f.json {
		return writeJSON(stdout, stderr, "dlq list", lines)
	}
	if len(lines) == 0 {
		fmt.Fprintf(stdout, "no dead letters in %s\n", f.queue)
		return exitOK
	}
	fmt.Fprintf(stdout, "%-27s %-16s %-28s %-10s %-8s %-20s %s\n", "ID", "CONSUMER", "MESSAGE ID", "CLASS", "ATTEMPTS", "LAST FAILURE", "REASON")
	for _, l := range lines {
		fmt.Fprintf(stdout, "%-27s %-16s %-28s %-10s %-8d %-20s %s\n", l.ID, cut(l.Consumer, 16), cut(l.MessageID, 28), l.Class,
			l.Attempts, l.LastFailure.UTC().Format("2006-01-02T15:04:05Z"), cut(l.Reason, 60))
	}
	fmt.Fprintf(stdout, "%d records\n", len(lines))
	return exitOK
}

func dlqAMQPInspect(ctx context.Context, f *dlqAMQPFlags, q *dedupamqp.DLQ, id string, stdout, stderr io.Writer) int {
	dl, err := q.Get(ctx, id)
	if errors.Is(err, consumer.ErrNotFound) {
		fmt.Fprintf(stderr, "dedup dlq inspect: no record %s in %s\n", id, f.queue)
		return exitFail
	}
	if err != nil {
		fmt.Fprintf(stderr, "dedup dlq inspect: %v\n", err)
		return exitFail
	}
	out := struct {
		dlqLine
		Headers map[string]string `json:"headers,omitempty"`
		Payload []byte            `json:"payload,omitempty"`
	}{dlqLine: lineOf(&dl), Headers: dl.Message.Headers}
	if f.payload {
		out.Payload = dl.Message.Payload
	}
	if f.json {
		return writeJSON(stdout, stderr, "dlq inspect", out)
	}
	p := func(k, v string) { fmt.Fprintf(stdout, "%-15s %s\n", k, v) }
	l := out.dlqLine
	p("id", l.ID)
	p("consumer", l.Consumer)
	p("key", l.Key)
	p("message id", l.MessageID)
	p("queue", l.Subject)
	p("class", l.Class)
	p("reason", l.Reason)
	p("attempts", strconv.Itoa(l.Attempts))
	p("first failure", l.FirstFailure.UTC().Format(time.RFC3339Nano))
	p("last failure", l.LastFailure.UTC().Format(time.RFC3339Nano))
	for k, v := range dl.Message.Headers {
		p("header", k+": "+v)
	}
	if f.payload {
		p("payload", strconv.Quote(string(dl.Message.Payload)))
	} else {
		p("payload", strconv.Itoa(l.PayloadBytes)+" bytes (--payload to print)")
	}
	return exitOK
}

func dlqAMQPReplay(ctx context.Context, f *dlqAMQPFlags, q *dedupamqp.DLQ, stdout, stderr io.Writer) int {
	var store dedup.Store
	if f.store != "" {
		s, err := openStore(ctx, f.store, f.path, f.addr)
		if err != nil {
			fmt.Fprintf(stderr, "dedup dlq replay: open the %s store: %v\n", f.store, explainOpen(err, f.path, f.addr))
			return exitFail
		}
		defer s.Close()
		store = s
	}
	pub, err := dedupamqp.NewPublisher(f.url)
	if err != nil {
		fmt.Fprintf(stderr, "dedup dlq replay: %v\n", err)
		return exitFail
	}
	defer pub.Close()
	opts := consumer.ReplayOptions{DryRun: f.dryRun, Rate: f.rate, Limit: f.limit, Store: store, Keep: f.keep}
	if f.ids != "" {
		for _, s := range strings.Split(f.ids, ",") {
			opts.IDs = append(opts.IDs, strings.TrimSpace(s))
		}
	}
	if f.consumer != "" {
		opts.Match = func(dl consumer.DeadLetter) bool { return dl.Consumer == f.consumer }
	}
	opts.Progress = func(it consumer.ReplayItem) {
		if f.json {
			return
		}
		line := fmt.Sprintf("%-27s %-28s %s", it.Record.ID, cut(it.Record.Message.ID, 28), it.Status)
		if it.Err != nil {
			line += ": " + it.Err.Error()
		}
		fmt.Fprintln(stdout, line)
	}
	rep, err := consumer.Replay(ctx, q, pub, opts)
	return reportReplay(stdout, stderr, f.json, f.dryRun, store != nil, rep, err)
}
