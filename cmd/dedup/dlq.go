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
	"github.com/dedupkit/dedup/dedupnats"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

const dlqAbout = `Usage: dedup dlq <list|inspect|replay> [flags] [id]

Works on a dead-letter stream written by package dedupnats: the messages
a consumer gave up on (poison, out of attempts, an invalid key), each kept
whole with its message and business IDs, failure class, reason, attempts
and first and last failure times. With --broker rabbitmq it works on a
dead-letter queue written by package dedupamqp instead ('dedup dlq list
--broker rabbitmq -h' for its flags).

  list     one line per record (no payloads)
  inspect  one record by ID; --payload also prints the payload
  replay   republish records to their original subjects under their
           original message IDs, so the consumer's dedup decides again:
           what completed meanwhile is a duplicate there, what never
           completed is applied. With --store, each key is first checked
           in the consumer's dedup store: completed keys are not
           republished (and their records are deleted), keys held right
           now are skipped. --dry-run reports and changes nothing.
           Replayed records are deleted unless --keep.

Exit status: 0 on success, 1 on failure (a replay with any failed record
included), 2 on bad usage.

Flags:
`

type dlqFlags struct {
	natsURL string
	stream  string
	dlqCommon
}

func newDLQFlagSet(sub string, f *dlqFlags) *flag.FlagSet {
	fs := flag.NewFlagSet("dedup dlq "+sub, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&f.natsURL, "nats-url", "", "NATS server `URL` (default: $DEDUP_NATS_URL or nats://127.0.0.1:4222)")
	fs.StringVar(&f.stream, "stream", "DLQ", "dead-letter stream `name`")
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
		fs.BoolVar(&f.keep, "keep", false, "keep replayed records in the dead-letter stream")
		fs.StringVar(&f.store, "store", "", "the consumer's dedup store, to skip keys that completed meanwhile: sqlite, redis or postgres (default: none, every record is republished and the consumer's dedup decides)")
		fs.StringVar(&f.path, "path", "", "SQLite database `file` for --store sqlite")
		fs.StringVar(&f.addr, "addr", "", "server `address` for --store redis or postgres (default: $DEDUP_REDIS_ADDR / $DEDUP_POSTGRES_URL or loopback)")
	}
	return fs
}

func runDLQ(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "-help" || args[0] == "--help" {
		w := stderr
		status := exitUsage
		if len(args) > 0 {
			w, status = stdout, exitOK
		}
		fmt.Fprint(w, strings.TrimSuffix(dlqAbout, "Flags:\n"))
		fmt.Fprintln(w, "Run 'dedup dlq <list|inspect|replay> -h' for each one's flags.")
		return status
	}
	sub := args[0]
	switch sub {
	case "list", "inspect", "replay":
	default:
		fmt.Fprintf(stderr, "dedup dlq: unknown subcommand %q: use list, inspect or replay\n", sub)
		return exitUsage
	}
	if rest, broker, err := splitBroker(args[1:]); err != nil {
		fmt.Fprintf(stderr, "dedup dlq %s: %v\n", sub, err)
		return exitUsage
	} else if broker == "rabbitmq" {
		return runDLQAMQP(sub, rest, stdout, stderr)
	} else if broker == "kafka" {
		return runDLQKafka(sub, rest, stdout, stderr)
	} else {
		args = append(args[:1:1], rest...)
	}
	var f dlqFlags
	fs := newDLQFlagSet(sub, &f)
	id := ""
	if err := parseInterspersed(fs, args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printUsage(stdout, dlqAbout, fs)
			return exitOK
		}
		fmt.Fprintf(stderr, "dedup dlq %s: %s\n", sub, flagError(fs, err))
		return exitUsage
	}
	rest := fs.Args()
	if sub == "inspect" {
		if len(rest) != 1 {
			fmt.Fprintln(stderr, "dedup dlq inspect: give exactly one record ID (see 'dedup dlq list')")
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
	nc, q, err := f.open(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "dedup dlq %s: %v\n", sub, err)
		return exitFail
	}
	defer nc.Close()
	switch sub {
	case "list":
		return dlqList(ctx, &f, q, stdout, stderr)
	case "inspect":
		return dlqInspect(ctx, &f, q, id, stdout, stderr)
	}
	return dlqReplay(ctx, &f, nc, q, stdout, stderr)
}

// dlqCommon holds the flags of `dedup dlq` that every broker shares.
type dlqCommon struct {
	consumer string
	limit    int
	json     bool
	payload  bool
	dryRun   bool
	rate     float64
	ids      string
	keep     bool
	store    string
	path     string
	addr     string
	timeout  time.Duration
}

// check validates the shared flags of subcommand sub: the limit and the
// timeout always; for replay, the rate and the dedup store to consult.
func (c *dlqCommon) check(sub string) error {
	if c.limit < 0 || c.limit > maxLimit {
		return badUsage("--limit must be between 0 (all) and %d, got %d", maxLimit, c.limit)
	}
	if err := checkTimeout(c.timeout); err != nil {
		return err
	}
	if sub != "replay" {
		return nil
	}
	if c.rate == 0 || c.rate > maxRate || c.rate != c.rate {
		return badUsage("--rate must be a number of records per second up to %d (negative: no limit), got %v", maxRate, c.rate)
	}
	switch c.store {
	case "":
		if c.path != "" || c.addr != "" {
			return badUsage("--path and --addr need --store")
		}
	case "sqlite":
		if c.path == "" {
			return badUsage("--store sqlite needs --path, the consumer's database file")
		}
	case "redis", "postgres":
		if c.path != "" {
			return badUsage("--path applies only to --store sqlite")
		}
	default:
		return badUsage("--store must be sqlite, redis or postgres, got %q", c.store)
	}
	return nil
}

func (f *dlqFlags) check(sub string) error {
	if f.natsURL == "" {
		f.natsURL = os.Getenv("DEDUP_NATS_URL")
	}
	if f.natsURL == "" {
		f.natsURL = "nats://127.0.0.1:4222"
	}
	if err := f.dlqCommon.check(sub); err != nil || sub != "replay" {
		return err
	}
	for _, id := range f.idList() {
		if _, err := strconv.ParseUint(id, 10, 64); err != nil {
			return badUsage("--id takes record IDs (stream sequences) separated by commas, got %q", id)
		}
	}
	return nil
}

func (f *dlqFlags) idList() []string {
	if f.ids == "" {
		return nil
	}
	var out []string
	for _, s := range strings.Split(f.ids, ",") {
		out = append(out, strings.TrimSpace(s))
	}
	return out
}

// open connects and opens the dead-letter stream, which must exist: the
// command never creates one.
func (f *dlqFlags) open(ctx context.Context) (*nats.Conn, *dedupnats.DLQ, error) {
	nc, err := nats.Connect(f.natsURL, nats.Name("dedup dlq"), nats.Timeout(5*time.Second))
	if err != nil {
		return nil, nil, fmt.Errorf("connect to NATS at %s: %w\nSet --nats-url or DEDUP_NATS_URL to the server", f.natsURL, err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	s, err := js.Stream(ctx, f.stream)
	if err != nil {
		nc.Close()
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			return nil, nil, fmt.Errorf("no dead-letter stream %q on %s; name it with --stream", f.stream, f.natsURL)
		}
		return nil, nil, fmt.Errorf("dead-letter stream %s: %w", f.stream, err)
	}
	var prefix string
	for _, subj := range s.CachedInfo().Config.Subjects {
		if p, ok := strings.CutSuffix(subj, ".>"); ok {
			prefix = p
			break
		}
	}
	if prefix == "" {
		nc.Close()
		return nil, nil, fmt.Errorf("stream %s has subjects %v: it is not a dead-letter stream written by dedupnats", f.stream, s.CachedInfo().Config.Subjects)
	}
	q, err := dedupnats.NewDLQ(ctx, js, f.stream, dedupnats.WithSubjectPrefix(prefix))
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	return nc, q, nil
}

// dlqLine is one record in `dedup dlq list --json`: everything but the
// payload.
type dlqLine struct {
	ID           string    `json:"id"`
	Consumer     string    `json:"consumer"`
	Key          string    `json:"key"`
	MessageID    string    `json:"message_id"`
	BusinessKey  string    `json:"business_key,omitempty"`
	Subject      string    `json:"subject"`
	Class        string    `json:"class"`
	Reason       string    `json:"reason"`
	Attempts     int       `json:"attempts"`
	FirstFailure time.Time `json:"first_failure"`
	LastFailure  time.Time `json:"last_failure"`
	PayloadBytes int       `json:"payload_bytes"`
}

func lineOf(dl *consumer.DeadLetter) dlqLine {
	return dlqLine{
		ID: dl.ID, Consumer: dl.Consumer, Key: dl.Key.String(), MessageID: dl.Message.ID,
		BusinessKey: dl.Message.BusinessKey, Subject: dl.Message.Subject, Class: dl.Class.String(),
		Reason: dl.Reason, Attempts: dl.Attempts, FirstFailure: dl.FirstFailure, LastFailure: dl.LastFailure,
		PayloadBytes: len(dl.Message.Payload),
	}
}

// each calls fn for every record the flags select, oldest first.
func (f *dlqFlags) each(ctx context.Context, q consumer.DeadLetterStore, fn func(*consumer.DeadLetter)) error {
	n := 0
	after := ""
	for {
		page, err := q.List(ctx, after, 200)
		if err != nil {
			return err
		}
		if len(page) == 0 {
			return nil
		}
		for i := range page {
			after = page[i].ID
			if f.consumer != "" && page[i].Consumer != f.consumer {
				continue
			}
			if f.limit > 0 && n >= f.limit {
				return nil
			}
			n++
			fn(&page[i])
		}
	}
}

func dlqList(ctx context.Context, f *dlqFlags, q consumer.DeadLetterStore, stdout, stderr io.Writer) int {
	lines := []dlqLine{}
	err := f.each(ctx, q, func(dl *consumer.DeadLetter) { lines = append(lines, lineOf(dl)) })
	if err != nil {
		fmt.Fprintf(stderr, "dedup dlq list: %v\n", err)
		return exitFail
	}
	if f.json {
		return writeJSON(stdout, stderr, "dlq list", lines)
	}
	if len(lines) == 0 {
		fmt.Fprintf(stdout, "no dead letters in %s\n", f.stream)
		return exitOK
	}
	fmt.Fprintf(stdout, "%-8s %-16s %-28s %-10s %-8s %-20s %s\n", "ID", "CONSUMER", "MESSAGE ID", "CLASS", "ATTEMPTS", "LAST FAILURE", "REASON")
	for _, l := range lines {
		fmt.Fprintf(stdout, "%-8s %-16s %-28s %-10s %-8d %-20s %s\n", l.ID, cut(l.Consumer, 16), cut(l.MessageID, 28), l.Class,
			l.Attempts, l.LastFailure.UTC().Format("2006-01-02T15:04:05Z"), cut(l.Reason, 60))
	}
	fmt.Fprintf(stdout, "%d records\n", len(lines))
	return exitOK
}

func cut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 1 && s[n-1]&0xC0 == 0x80 {
		n--
	}
	return s[:n-1] + "~"
}

func dlqInspect(ctx context.Context, f *dlqFlags, q consumer.DeadLetterStore, id string, stdout, stderr io.Writer) int {
	if _, err := strconv.ParseUint(id, 10, 64); err != nil {
		fmt.Fprintf(stderr, "dedup dlq inspect: %q is not a record ID (a stream sequence, see 'dedup dlq list')\n", id)
		return exitUsage
	}
	dl, err := q.Get(ctx, id)
	if errors.Is(err, consumer.ErrNotFound) {
		fmt.Fprintf(stderr, "dedup dlq inspect: no record %s in %s\n", id, f.stream)
		return exitFail
	}
	if err != nil {
		fmt.Fprintf(stderr, "dedup dlq inspect: %v\n", err)
		return exitFail
	}
	if f.json {
		out := struct {
			dlqLine
			Headers map[string]string `json:"headers,omitempty"`
			Payload []byte            `json:"payload,omitempty"`
		}{dlqLine: lineOf(&dl), Headers: dl.Message.Headers}
		if f.payload {
			out.Payload = dl.Message.Payload
		}
		return writeJSON(stdout, stderr, "dlq inspect", out)
	}
	l := lineOf(&dl)
	p := func(k, v string) { fmt.Fprintf(stdout, "%-15s %s\n", k, v) }
	p("id", l.ID)
	p("consumer", l.Consumer)
	p("key", l.Key)
	p("message id", l.MessageID)
	if l.BusinessKey != "" {
		p("business key", l.BusinessKey)
	}
	if dl.Message.Aggregate != "" {
		p("aggregate", dl.Message.Aggregate+" v"+strconv.FormatUint(dl.Message.Version, 10))
	}
	p("subject", l.Subject)
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

func dlqReplay(ctx context.Context, f *dlqFlags, nc *nats.Conn, q *dedupnats.DLQ, stdout, stderr io.Writer) int {
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
	js, err := jetstream.New(nc)
	if err != nil {
		fmt.Fprintf(stderr, "dedup dlq replay: %v\n", err)
		return exitFail
	}
	pub, err := dedupnats.NewPublisher(js)
	if err != nil {
		fmt.Fprintf(stderr, "dedup dlq replay: %v\n", err)
		return exitFail
	}
	opts := consumer.ReplayOptions{
		DryRun: f.dryRun, Rate: f.rate, Limit: f.limit, IDs: f.idList(), Store: store, Keep: f.keep,
	}
	if f.consumer != "" {
		opts.Match = func(dl consumer.DeadLetter) bool { return dl.Consumer == f.consumer }
	}
	if !f.json {
		opts.Progress = func(it consumer.ReplayItem) {
			line := fmt.Sprintf("%-8s %-28s %s", it.Record.ID, cut(it.Record.Message.ID, 28), it.Status)
			if it.Err != nil {
				line += ": " + it.Err.Error()
			}
			fmt.Fprintln(stdout, line)
		}
	}
	rep, err := consumer.Replay(ctx, q, pub, opts)
	if f.json {
		type item struct {
			ID        string `json:"id"`
			MessageID string `json:"message_id"`
			Status    string `json:"status"`
			Error     string `json:"error,omitempty"`
		}
		out := struct {
			DryRun           bool   `json:"dry_run"`
			Checked          bool   `json:"checked_store"`
			Seen             int    `json:"seen"`
			WouldReplay      int    `json:"would_replay"`
			Replayed         int    `json:"replayed"`
			AlreadyCompleted int    `json:"already_completed"`
			InProgress       int    `json:"in_progress"`
			Failed           int    `json:"failed"`
			Items            []item `json:"items"`
			Error            string `json:"error,omitempty"`
		}{DryRun: f.dryRun, Checked: store != nil, Seen: rep.Seen, WouldReplay: rep.WouldReplay, Replayed: rep.Replayed,
			AlreadyCompleted: rep.AlreadyCompleted, InProgress: rep.InProgress, Failed: rep.Failed, Items: []item{}}
		for _, it := range rep.Items {
			i := item{ID: it.Record.ID, MessageID: it.Record.Message.ID, Status: it.Status.String()}
			if it.Err != nil {
				i.Error = it.Err.Error()
			}
			out.Items = append(out.Items, i)
		}
		if err != nil {
			out.Error = err.Error()
		}
		if st := writeJSON(stdout, stderr, "dlq replay", out); st != exitOK {
			return st
		}
	} else {
		verb := "replayed"
		if f.dryRun {
			verb = "would replay"
		}
		n := rep.Replayed
		if f.dryRun {
			n = rep.WouldReplay
		}
		fmt.Fprintf(stdout, "%d records: %s %d, already completed %d, in progress %d, failed %d\n",
			rep.Seen, verb, n, rep.AlreadyCompleted, rep.InProgress, rep.Failed)
		if store == nil {
			fmt.Fprintln(stdout, "(no --store: completion was not checked; the consumer's dedup decides each republished message)")
		}
	}
	if err != nil {
		fmt.Fprintf(stderr, "dedup dlq replay: %v\n", err)
		return exitFail
	}
	if rep.Failed > 0 {
		return exitFail
	}
	return exitOK
}

// reportReplay prints the summary of a dead-letter replay, as text or as
// one JSON object, with the replay's error on stderr, and returns the exit
// status: a failure when the replay failed or any record did. The RabbitMQ
// and Kafka replays use it; the NATS replay also lists every item.
func reportReplay(stdout, stderr io.Writer, asJSON, dryRun, checked bool, rep consumer.ReplayReport, err error) int {
	if asJSON {
		out := struct {
			DryRun           bool   `json:"dry_run"`
			Checked          bool   `json:"checked_store"`
			Seen             int    `json:"seen"`
			WouldReplay      int    `json:"would_replay"`
			Replayed         int    `json:"replayed"`
			AlreadyCompleted int    `json:"already_completed"`
			InProgress       int    `json:"in_progress"`
			Failed           int    `json:"failed"`
			Error            string `json:"error,omitempty"`
		}{dryRun, checked, rep.Seen, rep.WouldReplay, rep.Replayed, rep.AlreadyCompleted, rep.InProgress, rep.Failed, ""}
		if err != nil {
			out.Error = err.Error()
		}
		if st := writeJSON(stdout, stderr, "dlq replay", out); st != exitOK {
			return st
		}
	} else {
		n, verb := rep.Replayed, "replayed"
		if dryRun {
			n, verb = rep.WouldReplay, "would replay"
		}
		fmt.Fprintf(stdout, "%d records: %s %d, already completed %d, in progress %d, failed %d\n",
			rep.Seen, verb, n, rep.AlreadyCompleted, rep.InProgress, rep.Failed)
	}
	if err != nil {
		fmt.Fprintf(stderr, "dedup dlq replay: %v\n", err)
		return exitFail
	}
	if rep.Failed > 0 {
		return exitFail
	}
	return exitOK
}
