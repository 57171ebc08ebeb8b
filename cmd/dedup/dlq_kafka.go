package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/dedupkafka"
)

const dlqKafkaAbout = `Usage: dedup dlq <list|inspect|replay> --broker kafka [flags] [id]

Works on a dead-letter topic written by package dedupkafka (its DLQ): the
records a consumer gave up on, each kept whole (value, record key,
headers, Dedup-Msg-Id) with the failure in Dedup-DL-* headers. A record's
ID is <partition>-<offset> in the dead-letter topic. Kafka cannot delete
one record: a replayed record is deleted by a tombstone record that list
and inspect then skip.

  list     one line per record (no payloads)
  inspect  one record by ID; --payload also prints the payload
  replay   produce records again to the topic they were consumed from,
           under their original message IDs and record keys, so the
           consumer's dedup decides again. With --store, keys completed
           meanwhile are not replayed (their records are deleted) and keys
           held right now are skipped. --dry-run changes nothing.
           Replayed records are deleted unless --keep.

Exit status: 0 on success, 1 on failure (a replay with any failed record
included), 2 on bad usage.

Flags:
`

type dlqKafkaFlags struct {
	brokers relayKafkaFlags
	topic   string
	dlqCommon
}

func newDLQKafkaFlagSet(sub string, f *dlqKafkaFlags) *flag.FlagSet {
	fs := flag.NewFlagSet("dedup dlq "+sub+" --broker kafka", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	f.brokers.define(fs)
	fs.StringVar(&f.topic, "topic", "dlq", "dead-letter `topic`")
	fs.BoolVar(&f.json, "json", false, "print JSON instead of text")
	fs.DurationVar(&f.timeout, "timeout", 5*time.Minute, "bound on the whole command")
	if sub != "inspect" {
		fs.StringVar(&f.consumer, "consumer", "", "only records of this consumer `name`")
		fs.IntVar(&f.limit, "limit", 0, "at most `N` records (0: all)")
	}
	switch sub {
	case "inspect":
		fs.BoolVar(&f.payload, "payload", false, "print the payload too (it may hold personal or secret data)")
	case "replay":
		fs.BoolVar(&f.dryRun, "dry-run", false, "report what a replay would do; change nothing")
		fs.Float64Var(&f.rate, "rate", 10, "records produced per second at most (negative: no limit)")
		fs.StringVar(&f.ids, "id", "", "only these record `IDs`, comma-separated")
		fs.BoolVar(&f.keep, "keep", false, "keep replayed records (write no tombstone)")
		fs.StringVar(&f.store, "store", "", "the consumer's dedup store, to skip keys that completed meanwhile: sqlite, redis or postgres (default: none)")
		fs.StringVar(&f.path, "path", "", "SQLite database `file` for --store sqlite")
		fs.StringVar(&f.addr, "addr", "", "server `address` for --store redis or postgres (default: $DEDUP_REDIS_ADDR / $DEDUP_POSTGRES_URL or loopback)")
	}
	return fs
}

func (f *dlqKafkaFlags) check(sub string) error { return f.dlqCommon.check(sub) }

// runDLQKafka is `dedup dlq` over a Kafka dead-letter topic; args follow
// the subcommand, --broker taken out.
func runDLQKafka(sub string, args []string, stdout, stderr io.Writer) int {
	var f dlqKafkaFlags
	fs := newDLQKafkaFlagSet(sub, &f)
	if err := parseInterspersed(fs, args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printUsage(stdout, dlqKafkaAbout, fs)
			return exitOK
		}
		fmt.Fprintf(stderr, "dedup dlq %s: %s\n", sub, flagError(fs, err))
		return exitUsage
	}
	rest, id := fs.Args(), ""
	if sub == "inspect" {
		if len(rest) != 1 {
			fmt.Fprintln(stderr, "dedup dlq inspect: give exactly one record ID (see 'dedup dlq list --broker kafka')")
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
	q, err := dedupkafka.OpenDLQ(ctx, f.brokers.seeds(), f.topic)
	if err != nil {
		fmt.Fprintf(stderr, "dedup dlq %s: %v\nSet --brokers or DEDUP_KAFKA_BROKERS to the cluster, --topic to the dead-letter topic\n", sub, err)
		return exitFail
	}
	defer q.Close()
	switch sub {
	case "list":
		return dlqKafkaList(ctx, &f, q, stdout, stderr)
	case "inspect":
		return dlqKafkaInspect(ctx, &f, q, id, stdout, stderr)
	}
	return dlqKafkaReplay(ctx, &f, q, stdout, stderr)
}

func dlqKafkaList(ctx context.Context, f *dlqKafkaFlags, q consumer.DeadLetterStore, stdout, stderr io.Writer) int {
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
		if f.limit > 0 && len(lines) == f.limit {
			break
		}
		lines = append(lines, lineOf(&recs[i]))
	}
	if f.json {
		return writeJSON(stdout, stderr, "dlq list", lines)
	}
	if len(lines) == 0 {
		fmt.Fprintf(stdout, "no dead letters in topic %s\n", f.topic)
		return exitOK
	}
	fmt.Fprintf(stdout, "%-24s %-16s %-28s %-10s %-8s %-20s %s\n", "ID", "CONSUMER", "MESSAGE ID", "CLASS", "ATTEMPTS", "LAST FAILURE", "REASON")
	for _, l := range lines {
		fmt.Fprintf(stdout, "%-24s %-16s %-28s %-10s %-8d %-20s %s\n", l.ID, cut(l.Consumer, 16), cut(l.MessageID, 28), l.Class,
			l.Attempts, l.LastFailure.UTC().Format("2006-01-02T15:04:05Z"), cut(l.Reason, 60))
	}
	fmt.Fprintf(stdout, "%d records\n", len(lines))
	return exitOK
}

func dlqKafkaInspect(ctx context.Context, f *dlqKafkaFlags, q consumer.DeadLetterStore, id string, stdout, stderr io.Writer) int {
	dl, err := q.Get(ctx, id)
	switch {
	case errors.Is(err, consumer.ErrNotFound):
		fmt.Fprintf(stderr, "dedup dlq inspect: no record %s in topic %s\n", id, f.topic)
		return exitFail
	case err != nil:
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
	l := out.dlqLine
	for _, kv := range [][2]string{{"id", l.ID}, {"consumer", l.Consumer}, {"key", l.Key}, {"message id", l.MessageID},
		{"topic", l.Subject}, {"class", l.Class}, {"reason", l.Reason}, {"attempts", strconv.Itoa(l.Attempts)},
		{"first failure", l.FirstFailure.UTC().Format(time.RFC3339Nano)}, {"last failure", l.LastFailure.UTC().Format(time.RFC3339Nano)}} {
		fmt.Fprintf(stdout, "%-15s %s\n", kv[0], kv[1])
	}
	for k, v := range dl.Message.Headers {
		fmt.Fprintf(stdout, "%-15s %s\n", "header", k+": "+strconv.Quote(v))
	}
	if f.payload {
		fmt.Fprintf(stdout, "%-15s %s\n", "payload", strconv.Quote(string(dl.Message.Payload)))
	} else {
		fmt.Fprintf(stdout, "%-15s %d bytes (--payload to print)\n", "payload", l.PayloadBytes)
	}
	return exitOK
}

func dlqKafkaReplay(ctx context.Context, f *dlqKafkaFlags, q consumer.DeadLetterStore, stdout, stderr io.Writer) int {
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
	pub, err := dedupkafka.NewPublisher(f.brokers.seeds())
	if err != nil {
		fmt.Fprintf(stderr, "dedup dlq replay: %v\n", err)
		return exitFail
	}
	defer pub.Close()
	opts := consumer.ReplayOptions{DryRun: f.dryRun, Rate: f.rate, Limit: f.limit, Store: store, Keep: f.keep}
	for _, s := range strings.Split(f.ids, ",") {
		if s = strings.TrimSpace(s); s != "" {
			opts.IDs = append(opts.IDs, s)
		}
	}
	if f.consumer != "" {
		opts.Match = func(dl consumer.DeadLetter) bool { return dl.Consumer == f.consumer }
	}
	opts.Progress = func(it consumer.ReplayItem) {
		if !f.json {
			line := fmt.Sprintf("%-24s %-28s %s", it.Record.ID, cut(it.Record.Message.ID, 28), it.Status)
			if it.Err != nil {
				line += ": " + it.Err.Error()
			}
			fmt.Fprintln(stdout, line)
		}
	}
	rep, err := consumer.Replay(ctx, q, pub, opts)
	return reportReplay(stdout, stderr, f.json, f.dryRun, store != nil, rep, err)
}
