package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"github.com/jackc/pgx/v5/pgconn"
	"io"
	"net"
	"os"
	"os/signal"
	"sort"
	"strings"
	"time"

	"github.com/dedupkit/dedup/dedupprom"
	"github.com/dedupkit/dedup/internal/verify"
)

// verifyFlags are the parsed flags of `dedup verify`.
type verifyFlags struct {
	cfg     verify.Config
	store   string
	mode    string
	path    string
	addr    string
	flush   int
	keep    bool
	broker  string
	natsURL string
	amqpURL string
	kafka   string
	drops   int
	timeout time.Duration
	json    bool
	quiet   bool
	metrics string // --metrics-addr
	procs   int
	kills   int
	durable string // --durable
	fover   int    // --failover-every
}

const verifyAbout = `Usage: dedup verify [flags]

Drives an at-least-once pipeline against a store and checks that every
message took effect exactly once. A simulated broker publishes messages
with stable IDs to --consumers goroutines and injects faults: duplicate
deliveries queued back to back (so two consumers race on one key),
consumer crashes before the commit and after the commit but before the
ack, handler failures, and redelivery after a visibility timeout or after
a crashed owner's lease expires. Every effect is a row in a ledger table
with no unique constraint; at the end each message must have exactly one
row. A message with none is lost; one with two or more was applied twice.

Modes:
  inbox  (sqlite, postgres) the ledger row is written inside the store's inbox
         transaction: the dedup record and the effect commit together.
  apply  (postgres) the inbox in one round trip: the ledger insert is
         queued and sent with the claim, and the database runs both as
         one transaction (pgstore.Store.Apply).
  lease  (memory, or --store sqlite --mode lease) claim with a lease,
         append to an in-memory ledger, complete, ack. A crash while
         holding the claim is recovered when a redelivery takes over the
         expired lease. Not injected in lease mode: a crash between the
         effect and Complete, or an owner stalled longer than --lease.
         Either would apply the effect twice; closing that window takes
         the transactional inbox or an idempotent effect, so verify does
         not claim lease mode closes it.

Brokers:
  simulated  (default) an in-process broker that injects every fault above.
  nats       a real NATS JetStream server (--nats-url): messages are
             published with Nats-Msg-Id, consumed by a durable pull consumer,
             acked only after the commit; a crash acks nothing and JetStream
             redelivers after its AckWait; failures are NakWithDelay.
  rabbitmq   a real RabbitMQ server (--amqp-url): messages are published in
             confirm mode with message_id (copies under the same ID),
             consumed on one channel per consumer with prefetch 1, acked
             after the commit; a crash closes the channel and the broker
             requeues; the TCP connection is cut every --drop-every
             deliveries, killing every channel at once.
  kafka      an in-process kfake cluster (or a real one with --brokers):
             one consumer group, partitions in offset order, offsets
             committed only past acknowledged records; a crash restarts
             a member from its committed offsets or kills it (rebalance),
             members leave and join mid-run, and kfake loses produce
             responses and fails offset commits.

Processes:
  --processes N runs the consumers as N separate OS processes of this
  binary (--consumers goroutines each) on one shared store: the SQLite
  file, Redis or a Redis Cluster, the PostgreSQL schema, or layered.
  Every --kill-every deliveries a worker process is SIGKILLed, as a pod
  is, and a new one starts; its deliveries in flight are redelivered
  after the visibility timeout. The ledger is shared too: the SQL table
  of the inbox, or in lease mode a file every process appends to. In
  lease mode a process killed after its effect and before Complete
  applies that message twice: counted and reported, and it fails the run.

Failover:
  --failover-every N, for --store redis or layered on a Redis Cluster with
  replicas (scripts/redis-cluster.sh start --replicas; --addr its nodes),
  fails a master over every N deliveries, alternately by CLUSTER FAILOVER on
  its replica (no acknowledged write lost) and by SIGKILL (the cluster
  promotes the replica, which lacks what the master had not replicated
  yet; the killed node is restarted and rejoins as a replica). The layered
  store (--durable postgres: the PostgreSQL inbox decides) must still apply
  every message exactly once. Redis alone may apply a message twice when
  a killed master took its record along: counted, and it fails the run.

Exit status: 0 when every message was applied exactly once, 1 on any
violation (lost, applied twice, timeout) or failure, 2 on bad usage.

Flags:
`

func newVerifyFlagSet(f *verifyFlags) *flag.FlagSet {
	fs := flag.NewFlagSet("dedup verify", flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors and help are printed by runVerify
	d := verify.DefaultConfig()
	f.cfg = d
	fs.StringVar(&f.store, "store", "sqlite", "store to verify: "+strings.Join(verify.BackendNames(), ", "))
	fs.StringVar(&f.mode, "mode", "", "inbox, apply (postgres) or lease (default: inbox for sqlite and postgres, lease for memory and redis)")
	fs.StringVar(&f.path, "path", "", "SQLite database `file` to use and keep (default: a temporary file, removed at exit)")
	fs.StringVar(&f.addr, "addr", "", "server `address` of a networked store: host:port, comma-separated for a Redis cluster (default: $DEDUP_REDIS_ADDR or 127.0.0.1:6379), or a PostgreSQL connection string (default: $DEDUP_POSTGRES_URL or postgres://postgres@127.0.0.1:5432/test?sslmode=disable)")
	fs.StringVar(&f.broker, "broker", "simulated", "broker to run the pipeline over: simulated (in process), nats (a real JetStream server), rabbitmq (a real RabbitMQ server) or kafka (in process on kfake, or --brokers)")
	fs.StringVar(&f.amqpURL, "amqp-url", "", "for --broker rabbitmq: the server `URL` (default: $DEDUP_AMQP_URL or amqp://guest:guest@127.0.0.1:5672/)")
	fs.StringVar(&f.kafka, "brokers", "", "for --broker kafka: comma-separated seed `brokers` of a real cluster (default: an in-process kfake cluster with broker faults)")
	fs.IntVar(&f.drops, "drop-every", 2000, "for --broker rabbitmq: cut the consumers' connection every `N` deliveries (0: never)")
	fs.StringVar(&f.natsURL, "nats-url", "", "for --broker nats: the server `URL` (default: $DEDUP_NATS_URL or nats://127.0.0.1:4222)")
	fs.IntVar(&f.flush, "flush-every", 0, "for --store layered: flush Redis and empty the window every `N` deliveries (0: never)")
	fs.BoolVar(&f.keep, "keep", false, "keep the temporary database (SQLite file, or the run's PostgreSQL schema with its dedup and ledger tables) and print where it is")
	fs.IntVar(&f.cfg.Messages, "messages", d.Messages, "distinct messages to publish (at least 1)")
	fs.IntVar(&f.cfg.Consumers, "consumers", d.Consumers, "concurrent consumers (at least 1)")
	fs.Float64Var(&f.cfg.DupRate, "dup-rate", d.DupRate, "probability in [0,1] that the broker delivers a message twice, back to back")
	fs.Float64Var(&f.cfg.CrashRate, "crash-rate", d.CrashRate, "probability in [0,1] that a delivery crashes its consumer (half before the commit, half after it and before the ack)")
	fs.Float64Var(&f.cfg.FailRate, "fail-rate", d.FailRate, "probability in [0,1] that the handler fails before its effect (released, retried)")
	fs.DurationVar(&f.cfg.Lease, "lease", d.Lease, "claim lease in lease mode; redelivery delays scale with it")
	fs.Uint64Var(&f.cfg.Seed, "seed", 0, "seed of the broker's choices (0: random; the summary prints it)")
	fs.DurationVar(&f.timeout, "timeout", 2*time.Minute, "bound on the whole run; running out of time is a failure")
	fs.BoolVar(&f.json, "json", false, "print the report as one JSON object instead of a summary")
	fs.BoolVar(&f.quiet, "quiet", false, "no progress on stderr")
	fs.StringVar(&f.metrics, "metrics-addr", "", "serve the run's Prometheus metrics (dedupprom: claims, duplicates, decisions, broker and layer counts) on `host:port` at /metrics while it runs; port 0 picks one, printed on stderr")
	fs.IntVar(&f.procs, "processes", 0, "run the consumers in `N` separate processes on one shared store (0: goroutines of this process); simulated broker only, not --store memory")
	fs.StringVar(&f.durable, "durable", "sqlite", "for --store layered: the durable layer, sqlite (the inbox in --path or a temporary file) or postgres (pgstore's inbox on $DEDUP_POSTGRES_URL or "+verify.DefaultPostgresURL+"; --addr still names Redis)")
	fs.IntVar(&f.fover, "failover-every", 0, "for --store redis or layered on a Redis Cluster with replicas (--addr): every `N` deliveries fail a master over, alternately by CLUSTER FAILOVER on its replica and by SIGKILL (the cluster promotes the replica; the killed node is restarted as a replica); 0: never")
	fs.IntVar(&f.kills, "kill-every", 0, "with --processes: SIGKILL a worker process every `N` deliveries and start another (default: messages/5; 0: never)")
	return fs
}

// wrap breaks s into lines of at most width columns, indenting every line
// after the first by indent spaces.
func wrap(s string, indent, width int) string {
	var b strings.Builder
	col := indent
	for i, word := range strings.Fields(s) {
		if i > 0 && col+1+len(word) > width {
			b.WriteString("\n" + strings.Repeat(" ", indent))
			col = indent
		} else if i > 0 {
			b.WriteByte(' ')
			col++
		}
		b.WriteString(word)
		col += len(word)
	}
	return b.String()
}

// usageError is a bad command line, reported with exit status 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func badUsage(format string, args ...any) error {
	return &usageError{fmt.Sprintf(format, args...)}
}

// parseVerify parses and checks the flags of `dedup verify`.
func parseVerify(args []string, stdout io.Writer) (verifyFlags, verify.Backend, error) {
	var f verifyFlags
	fs := newVerifyFlagSet(&f)
	if err := parseInterspersed(fs, args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printUsage(stdout, verifyAbout, fs)
			return f, verify.Backend{}, err
		}
		return f, verify.Backend{}, badUsage("%s", flagError(fs, err))
	}
	if fs.NArg() > 0 {
		return f, verify.Backend{}, badUsage("unexpected argument %q: verify takes only flags", fs.Arg(0))
	}
	b, ok := verify.LookupBackend(f.store)
	if !ok {
		return f, b, badUsage("--store must be one of %s, got %q", strings.Join(verify.BackendNames(), ", "), f.store)
	}
	mode := b.Modes[0]
	if f.mode != "" {
		m, ok := verify.ParseMode(f.mode)
		if !ok {
			return f, b, badUsage("--mode must be inbox, apply or lease, got %q", f.mode)
		}
		if !hasMode(b, m) {
			return f, b, badUsage("--mode %s is not available for --store %s (it supports %s)", m, b.Name, joinModes(b.Modes))
		}
		mode = m
	}
	f.mode = string(mode)
	if f.path != "" && !b.UsesPath {
		return f, b, badUsage("--path applies only to a store kept in a file (sqlite), not to --store %s", b.Name)
	}
	if f.addr != "" && !b.UsesAddr {
		return f, b, badUsage("--addr applies only to a store on a server (redis, postgres), not to --store %s", b.Name)
	}
	if f.flush < 0 || (f.flush > 0 && b.Name != "layered") {
		return f, b, badUsage("--flush-every applies only to --store layered and takes a count of deliveries >= 0, got %d", f.flush)
	}
	durableSet := false
	fs.Visit(func(fl *flag.Flag) { durableSet = durableSet || fl.Name == "durable" })
	if durableSet && b.Name != "layered" {
		return f, b, badUsage("--durable applies only to --store layered")
	}
	if f.durable != "sqlite" && f.durable != "postgres" {
		return f, b, badUsage("--durable must be sqlite or postgres, got %q", f.durable)
	}
	if f.durable == "postgres" && f.path != "" {
		return f, b, badUsage("--path names a SQLite file; --durable postgres keeps its tables in PostgreSQL")
	}
	if err := checkFailover(&f, b); err != nil {
		return f, b, err
	}
	if err := checkTimeout(f.timeout); err != nil {
		return f, b, err
	}
	if f.cfg.Lease > maxLease {
		return f, b, badUsage("--lease must be at most %v, got %v", maxLease, f.cfg.Lease)
	}
	switch f.broker {
	case "simulated":
		if f.natsURL != "" {
			return f, b, badUsage("--nats-url applies only to --broker nats")
		}
	case "rabbitmq":
		if f.natsURL != "" {
			return f, b, badUsage("--nats-url applies only to --broker nats")
		}
		if f.drops < 0 {
			return f, b, badUsage("--drop-every must be 0 (never) or a count of deliveries, got %d", f.drops)
		}
		if f.amqpURL == "" {
			f.amqpURL = os.Getenv("DEDUP_AMQP_URL")
		}
		if f.amqpURL == "" {
			f.amqpURL = "amqp://guest:guest@127.0.0.1:5672/"
		}
	case "nats":
		if f.natsURL == "" {
			f.natsURL = os.Getenv("DEDUP_NATS_URL")
		}
		if f.natsURL == "" {
			f.natsURL = "nats://127.0.0.1:4222"
		}
	case "kafka":
		if f.natsURL != "" {
			return f, b, badUsage("--nats-url applies only to --broker nats")
		}
	default:
		return f, b, badUsage("--broker must be simulated, nats, rabbitmq or kafka, got %q", f.broker)
	}
	if f.metrics != "" {
		if _, _, err := net.SplitHostPort(f.metrics); err != nil {
			return f, b, badUsage("--metrics-addr must be host:port, got %q", f.metrics)
		}
	}
	if err := f.cfg.Validate(); err != nil {
		return f, b, badUsage("%v", err)
	}
	if err := checkProcesses(fs, &f, b); err != nil {
		return f, b, err
	}
	return f, b, nil
}

// checkFailover checks --failover-every: a Redis Cluster (several --addr
// addresses) under the redis or layered store, with the simulated broker.
func checkFailover(f *verifyFlags, b verify.Backend) error {
	switch {
	case f.fover == 0:
		return nil
	case f.fover < 0:
		return badUsage("--failover-every must be 0 (never) or a count of deliveries, got %d", f.fover)
	case b.Name != "redis" && b.Name != "layered":
		return badUsage("--failover-every applies only to --store redis or layered (on a Redis Cluster), not --store %s", b.Name)
	case f.broker != "simulated":
		return badUsage("--failover-every runs with the simulated broker only, not --broker %s", f.broker)
	case len(strings.Split(f.addr, ",")) < 2:
		return badUsage("--failover-every needs a Redis Cluster with replicas: --addr with its nodes, comma-separated (scripts/redis-cluster.sh start --replicas: 127.0.0.1:7100,...,127.0.0.1:7105)")
	}
	return nil
}

// checkProcesses checks --processes and --kill-every and fills in the
// default of --kill-every.
func checkProcesses(fs *flag.FlagSet, f *verifyFlags, b verify.Backend) error {
	killSet := false
	fs.Visit(func(fl *flag.Flag) { killSet = killSet || fl.Name == "kill-every" })
	switch {
	case f.procs == 0:
		if killSet {
			return badUsage("--kill-every applies only with --processes")
		}
		return nil
	case f.procs < 0 || f.procs > verify.MaxProcesses:
		return badUsage("--processes must be between 1 and %d, got %d", verify.MaxProcesses, f.procs)
	case f.broker != "simulated":
		return badUsage("--processes runs with the simulated broker only, not --broker %s", f.broker)
	case f.metrics != "":
		return badUsage("--metrics-addr does not combine with --processes: the claims happen in the worker processes")
	case b.Name == "memory":
		return badUsage("--processes needs a store several processes can share (sqlite, redis, postgres, layered), not --store memory")
	case f.kills < 0:
		return badUsage("--kill-every must be 0 (never) or a count of deliveries, got %d", f.kills)
	}
	if !killSet {
		f.kills = max(f.cfg.Messages/5, 1)
	}
	return nil
}

// flagError rewrites an error of the flag package in the --flag spelling of
// the help text and, for a bad value, says what the flag takes.
func flagError(fs *flag.FlagSet, err error) string {
	msg := err.Error()
	if name, ok := strings.CutPrefix(msg, "flag provided but not defined: "); ok {
		return "unknown flag --" + strings.TrimLeft(name, "-")
	}
	if name, ok := strings.CutPrefix(msg, "flag needs an argument: "); ok {
		return "flag --" + strings.TrimLeft(name, "-") + " needs a value"
	}
	if i := strings.Index(msg, " for flag -"); i >= 0 {
		rest := msg[i+len(" for flag -"):]
		name, _, _ := strings.Cut(rest, ":")
		msg = msg[:i] + " for --" + rest
		if fl := fs.Lookup(name); fl != nil {
			_, use := flag.UnquoteUsage(fl)
			msg += " (--" + name + ": " + use + ")"
		}
	}
	return msg
}

func hasMode(b verify.Backend, m verify.Mode) bool {
	for _, x := range b.Modes {
		if x == m {
			return true
		}
	}
	return false
}

func joinModes(ms []verify.Mode) string {
	s := make([]string, len(ms))
	for i, m := range ms {
		s[i] = string(m)
	}
	return strings.Join(s, " and ")
}

func runVerify(args []string, stdout, stderr io.Writer) int {
	// A consumer process of `dedup verify --processes` re-executes this
	// binary as `dedup verify` with its orders in the environment.
	if code, ok := verify.WorkerMain(os.Stdin, stdout, stderr); ok {
		return code
	}
	if wantsOutbox(args) {
		return runVerifyOutbox(args, stdout, stderr)
	}
	f, b, err := parseVerify(args, stdout)
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "dedup verify: %v\nRun 'dedup verify -h' for the flags.\n", err)
		return exitUsage
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	// After the first interrupt the run winds down and reports; a second
	// one kills the process as usual.
	context.AfterFunc(ctx, stop)
	ctx, cancel := context.WithTimeout(ctx, f.timeout)
	defer cancel()

	opts := verify.OpenOptions{
		Mode: verify.Mode(f.mode), Path: f.path, Addr: f.addr, FlushEvery: f.flush, Keep: f.keep,
		Lease: f.cfg.Lease, Messages: f.cfg.Messages, Durable: f.durable,
	}
	if f.fover > 0 {
		fo, err := verify.NewClusterFailover(ctx, strings.Split(f.addr, ","))
		if err != nil {
			fmt.Fprintf(stderr, "dedup verify: --failover-every: %v\n", err)
			return exitFail
		}
		f.cfg.Failover, f.cfg.FailoverEvery = fo.Step, f.fover
	}
	if f.procs > 0 {
		return runVerifyProcesses(ctx, f, b, opts, stdout, stderr)
	}
	t, err := b.Open(ctx, opts)
	if err != nil {
		fmt.Fprintf(stderr, "dedup verify: open the %s store: %v\n", b.Name, explainOpen(err, f.path, f.addr))
		return exitFail
	}
	path := verify.PathOf(t)
	keptPath := ""
	if path != "" && (f.keep || f.path != "") {
		keptPath = path
	}

	if f.metrics != "" {
		m, err := verify.NewMetrics(f.broker)
		if err == nil {
			t = m.Instrument(t)
			var srv *dedupprom.Server
			if srv, err = dedupprom.Listen(f.metrics, m.Registry); err == nil {
				defer srv.Close()
				fmt.Fprintf(stderr, "dedup verify: metrics on http://%s/metrics\n", srv.Addr())
			}
		}
		if err != nil {
			fmt.Fprintf(stderr, "dedup verify: --metrics-addr: %v\n", err)
			t.Close()
			return exitFail
		}
	}
	var bar *progressBar
	if !f.quiet {
		bar = newProgressBar(stderr)
		f.cfg.Progress = bar.update
	}
	var rep verify.Report
	var runErr error
	if f.broker == "nats" {
		rep, runErr = verify.RunNATS(ctx, f.cfg, t, verify.NATSOptions{URL: f.natsURL, Keep: f.keep})
	} else if f.broker == "kafka" {
		var seeds []string
		for _, s := range strings.Split(f.kafka, ",") {
			if s = strings.TrimSpace(s); s != "" {
				seeds = append(seeds, s)
			}
		}
		rep, runErr = verify.RunKafka(ctx, f.cfg, t, verify.KafkaOptions{Brokers: seeds})
	} else if f.broker == "rabbitmq" {
		rep, runErr = verify.RunAMQP(ctx, f.cfg, t, verify.AMQPOptions{URL: f.amqpURL, Keep: f.keep, DropEvery: f.drops})
	} else {
		rep, runErr = verify.Run(ctx, f.cfg, t)
	}
	if bar != nil {
		bar.finish()
	}
	if cerr := t.Close(); cerr != nil {
		fmt.Fprintf(stderr, "dedup verify: close the %s store: %v\n", b.Name, cerr)
	}
	if runErr != nil {
		// The verify package prefixes its errors with "verify: " as a
		// library does; the command's own prefix already says it.
		fmt.Fprintf(stderr, "dedup verify: %s\n", strings.TrimPrefix(runErr.Error(), "verify: "))
		return exitFail
	}
	rep.Path = keptPath
	return reportVerify(f, &rep, stdout, stderr)
}

// runVerifyProcesses is `dedup verify --processes N`: this binary re-run
// as the consumer processes.
func runVerifyProcesses(ctx context.Context, f verifyFlags, b verify.Backend, opts verify.OpenOptions, stdout, stderr io.Writer) int {
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintf(stderr, "dedup verify: find this executable to start the workers: %v\n", err)
		return exitFail
	}
	var bar *progressBar
	if !f.quiet {
		bar = newProgressBar(stderr)
		f.cfg.Progress = bar.update
	}
	rep, err := verify.RunProcesses(ctx, f.cfg, b, opts, verify.ProcessOptions{
		Processes: f.procs, KillEvery: f.kills, Command: []string{exe, "verify"},
	})
	if bar != nil {
		bar.finish()
	}
	if err != nil {
		fmt.Fprintf(stderr, "dedup verify: %s\n", strings.TrimPrefix(explainOpen(err, f.path, f.addr).Error(), "verify: "))
		return exitFail
	}
	return reportVerify(f, &rep, stdout, stderr)
}

// reportVerify prints the report and returns the exit status.
func reportVerify(f verifyFlags, r *verify.Report, stdout, stderr io.Writer) int {
	rep := *r
	if f.json {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			fmt.Fprintf(stderr, "dedup verify: write the report: %v\n", err)
			return exitFail
		}
	} else {
		writeSummary(stdout, &rep)
	}
	switch {
	case rep.TimedOut:
		fmt.Fprintf(stderr, "dedup verify: timed out after %v with %d of %d messages unfinished; raise --timeout or lower --messages\n",
			f.timeout, rep.Unfinished, rep.Messages)
	case rep.Interrupted:
		fmt.Fprintf(stderr, "dedup verify: interrupted with %d of %d messages unfinished\n", rep.Unfinished, rep.Messages)
	}
	if !rep.OK {
		return exitFail
	}
	return exitOK
}

// writeSummary prints the report for a person.
// layerLine lists the duplicates each layer caught, cheapest layer first.
func layerLine(m map[string]int64) string {
	order := []string{"window", "bloom"}
	var rest []string
	for name := range m {
		if name != "window" && name != "bloom" && name != "durable" && !strings.HasSuffix(name, "_errors") {
			rest = append(rest, name)
		}
	}
	sort.Strings(rest)
	order = append(append(order, rest...), "durable")
	var parts []string
	for _, name := range order {
		if n, ok := m[name]; ok {
			part := fmt.Sprintf("%s %d", name, n)
			if e := m[name+"_errors"]; e > 0 {
				part += fmt.Sprintf(" (%d failed calls passed over)", e)
			}
			parts = append(parts, part)
		}
	}
	return strings.Join(parts, ", ")
}

func writeSummary(w io.Writer, r *verify.Report) {
	p := func(label, format string, args ...any) {
		fmt.Fprintf(w, "  %-22s %s\n", label, fmt.Sprintf(format, args...))
	}
	fmt.Fprintf(w, "dedup verify: %s store, %s mode, %s broker\n", r.Store, r.Mode, r.Broker)
	if r.Broker == "kafka" {
		fmt.Fprintf(w, "  (Kafka topic %s; the extra copies are re-sends under the same Dedup-Msg-Id on another partition)\n", r.Stream)
	} else if r.Broker == "rabbitmq" {
		fmt.Fprintf(w, "  (RabbitMQ queue %s; the extra copies are producer retries under the same message_id; %d connection drops)\n", r.Stream, r.ConnectionDrops)
	} else if r.Stream != "" {
		fmt.Fprintf(w, "  (JetStream stream %s; the extra copies are producer retries outside the broker's duplicate window)\n", r.Stream)
	}
	switch r.Mode {
	case verify.InboxMode:
		fmt.Fprintln(w, "  (the ledger row and the dedup record commit in one transaction)")
	case verify.ApplyMode:
		fmt.Fprintln(w, "  (the ledger row and the dedup record commit in one transaction, sent in one round trip)")
	case verify.LeaseMode:
		fmt.Fprintln(w, "  (claim, effect, complete, ack; a crash between the effect and Complete is not injected)")
	}
	p("messages", "%d  (%d consumers, dup-rate %v, crash-rate %v, fail-rate %v, lease %s, seed %d)",
		r.Messages, r.Consumers, r.DupRate, r.CrashRate, r.FailRate, r.Lease, r.Seed)
	if r.Processes > 0 {
		p("processes", "%d x %d consumers  (%d started, %d SIGKILLed mid-run with %d deliveries in flight)",
			r.Processes, r.Consumers, r.ProcessStarts, r.ProcessKills, r.KilledDeliveries)
	}
	if r.FailoverEvery > 0 {
		p("failovers", "%d by CLUSTER FAILOVER, %d masters SIGKILLed and promoted over  (one every %d deliveries)",
			r.Failovers, r.MasterKills, r.FailoverEvery)
		if r.FailoverErrors > 0 {
			p("", "%d failover steps failed: %s", r.FailoverErrors, r.FailoverError)
		}
	}
	p("deliveries", "%d  (%d broker duplicates, %d redeliveries)", r.Deliveries, r.BrokerDuplicates, r.Redeliveries)
	p("effects", "%d  (ledger rows)", r.Effects)
	p("duplicates skipped", "%d", r.DuplicatesSkipped)
	if len(r.Layers) > 0 {
		p("caught by layer", "%s", layerLine(r.Layers))
		if r.Flushes > 0 {
			p("fast-store flushes", "%d  (each also emptied the window: a failover plus a restart)", r.Flushes)
		}
	}
	p("crashes", "%d before commit, %d after commit before ack", r.CrashesBeforeCommit, r.CrashesAfterCommit)
	if r.Mode.Transactional() {
		p("takeovers", "%d  (no leases in inbox mode: the transaction is the lease)", r.Takeovers)
	} else {
		p("takeovers", "%d  (expired leases of crashed consumers)", r.Takeovers)
	}
	p("handler failures", "%d  (released and retried)", r.HandlerFailures)
	p("in-progress nacks", "%d", r.InProgressNacks)
	p("store errors", "%d  (nacked: fail closed)", r.StoreErrors)
	if r.LeasesLost > 0 {
		p("leases lost", "%d  (taken over while still working)", r.LeasesLost)
	}
	p("slowest delivery", "%.1f ms", r.SlowestDeliveryMS)
	if r.Conflicts > 0 {
		p("conflicts", "%d  (fingerprint mismatch on identical copies)", r.Conflicts)
	}
	if r.FirstError != "" {
		p("first error", "%s", r.FirstError)
	}
	p("lost", "%d%s", r.Lost, sample(r.LostSample))
	p("double applied", "%d%s", r.DoubleApplied, sample(r.DoubleSample))
	if r.KillWindowDoubles > 0 {
		p("", "%d of them by a process SIGKILLed after its effect, before Complete (lease mode's open window)", r.KillWindowDoubles)
	}
	if r.Unfinished > 0 {
		p("unfinished", "%d", r.Unfinished)
	}
	if r.StrayEffects > 0 {
		p("stray effects", "%d", r.StrayEffects)
	}
	p("time", "%.2f s, %.0f msgs/s", r.Seconds, r.Throughput)
	if r.Path != "" {
		p("database", "%s", r.Path)
	}
	if r.OK {
		fmt.Fprintf(w, "PASS: all %d messages applied exactly once\n", r.Messages)
		return
	}
	fmt.Fprintf(w, "FAIL: %s (rerun with --seed %d)\n", strings.Join(r.Violations(), "; "), r.Seed)
	if r.KillWindowDoubles > 0 {
		fmt.Fprintf(w, "hint: in lease mode the effect is outside the store; a process killed between the effect and Complete\n"+
			"      applies it again on the take-over. Only the inbox (--mode inbox) or an idempotent effect closes that window.\n")
	}
	if r.FailoverEvery > 0 && r.DoubleApplied > 0 && r.Store == "redis" {
		fmt.Fprintf(w, "hint: Redis replicates asynchronously: a master killed before its replica had a claim or a completion\n"+
			"      takes it along, and the redelivery is claimed again on the promoted replica (WithReplicaAck narrows\n"+
			"      the window, it does not close it). The layered store (--store layered) keeps the durable record that decides.\n")
	}
	if r.LeasesLost > 0 && r.Mode == verify.LeaseMode {
		fmt.Fprintf(w, "hint: %d consumers were still working when their lease (%s) ran out and another took the key over;\n"+
			"      in lease mode that applies the effect again. Raise --lease above the slowest delivery, or use the inbox.\n",
			r.LeasesLost, r.Lease)
	}
}

func sample(ids []string) string {
	if len(ids) == 0 {
		return ""
	}
	return "  (e.g. " + strings.Join(ids, ", ") + ")"
}

// explainOpen makes a store's open error specific: what PostgreSQL
// answered when a server did, which SQLite file could not be opened and
// why.
func explainOpen(err error, path, addr string) error {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		conn := addr
		if conn == "" {
			conn = os.Getenv("DEDUP_POSTGRES_URL")
		}
		if conn == "" {
			conn = defaultPostgresURL
		}
		return explainPostgres(err, conn)
	}
	if path != "" {
		return explainSQLitePath(err, path)
	}
	return err
}
