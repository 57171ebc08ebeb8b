package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/dedupkit/dedup/dedupnats"
	"github.com/dedupkit/dedup/dedupprom"
	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

const relayAbout = `Usage: dedup relay [flags]

Runs the outbox relay (package outbox) as a process: it reads the outbox
table of a PostgreSQL store (pgstore) or a SQLite file (sqlitestore) and
publishes its rows to NATS JetStream, each under its stable message ID
(Dedup-Msg-Id and Nats-Msg-Id), in commit order per aggregate key. Start
several on one PostgreSQL outbox: they split --outbox-partitions between
them under leases and take over a dead relay's partitions after --lease.
Progress goes to stderr every --progress. SIGINT or SIGTERM stops it
gracefully: each partition finishes its batch in flight, then the leases
are released.

Exit status: 0 after a graceful stop, 1 on failure, 2 on bad usage.

Flags:
`

type relayFlags struct {
	pg            pgFlags
	store         string
	sqlitePath    string
	broker        string
	natsURL       string
	amqp          relayAMQPFlags
	kafka         relayKafkaFlags
	stream        string
	parts         int
	batch         int
	lease         time.Duration
	poll          time.Duration
	pollOnly      bool
	attempts      int
	policy        string
	retention     time.Duration
	id            string
	progress      time.Duration
	ackWait       time.Duration
	metricsListen string
}

func newRelayFlagSet(f *relayFlags) *flag.FlagSet {
	fs := flag.NewFlagSet("dedup relay", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&f.store, "store", "postgres", "where the outbox is: `postgres` or sqlite")
	fs.StringVar(&f.pg.addr, "addr", "", "PostgreSQL connection `string` (default: $DEDUP_POSTGRES_URL or "+defaultPostgresURL+")")
	fs.StringVar(&f.pg.schema, "schema", "public", "`schema` of the store's tables")
	fs.StringVar(&f.pg.prefix, "prefix", "dedup_", "`prefix` of the store's table names")
	fs.StringVar(&f.sqlitePath, "sqlite-path", "", "with --store sqlite: the database `file`")
	fs.StringVar(&f.broker, "broker", "nats", "where to publish: `nats` (JetStream), rabbitmq or kafka")
	f.amqp.define(fs)
	f.kafka.define(fs)
	fs.StringVar(&f.natsURL, "nats-url", "", "NATS server `URL` (default: $DEDUP_NATS_URL or "+nats.DefaultURL+")")
	fs.StringVar(&f.stream, "stream", "", "expect this JetStream `stream` to store every message (a message to a subject of no stream is then refused and quarantined)")
	fs.IntVar(&f.parts, "outbox-partitions", 16, "`N` partitions of the aggregate key space; every relay of one outbox must use the same N")
	fs.IntVar(&f.batch, "batch", 500, "rows a partition reads and publishes at a time")
	fs.DurationVar(&f.lease, "lease", 10*time.Second, "partition lease TTL, renewed every third of it")
	fs.DurationVar(&f.poll, "poll", time.Second, "how often an idle partition polls when no notification woke it (while listening, idle polls back off to max(this, 100ms))")
	fs.BoolVar(&f.pollOnly, "poll-only", false, "do not LISTEN (behind a transaction-mode pooler): poll only")
	fs.IntVar(&f.attempts, "max-attempts", 10, "quarantine a message after this many failed attempts")
	fs.StringVar(&f.policy, "policy", "block", "a quarantined message's key: `block` (wait for an operator) or skip (go on)")
	fs.DurationVar(&f.retention, "retention", 0, "delete published rows older than this (0: keep them)")
	fs.StringVar(&f.id, "id", "", "this relay's `name` in the lease table (default: host-pid-random)")
	fs.DurationVar(&f.progress, "progress", 5*time.Second, "print progress this often (0: never)")
	fs.DurationVar(&f.ackWait, "ack-wait", 30*time.Second, "wait at most this long for a batch's acknowledgements")
	fs.StringVar(&f.metricsListen, "metrics-listen", "", "serve Prometheus metrics on this `address`'s /metrics (e.g. 127.0.0.1:9464; default: none)")
	return fs
}

func (f *relayFlags) check() error {
	switch {
	case f.store != "postgres" && f.store != "sqlite":
		return badUsage("--store must be postgres or sqlite, got %q", f.store)
	case f.store == "sqlite" && f.sqlitePath == "":
		return badUsage("--store sqlite needs --sqlite-path")
	case f.broker != "nats" && f.broker != "rabbitmq" && f.broker != "kafka":
		return badUsage("--broker must be nats, rabbitmq or kafka, got %q", f.broker)
	case f.parts < 1 || f.parts > 4096:
		return badUsage("--outbox-partitions must be between 1 and 4096, got %d", f.parts)
	case f.policy != "block" && f.policy != "skip":
		return badUsage("--policy must be block or skip, got %q", f.policy)
	case f.progress < 0:
		return badUsage("--progress must not be negative")
	case f.ackWait <= 0:
		return badUsage("--ack-wait must be positive")
	}
	if _, err := outbox.NewRelay(nopSource{f.parts}, nopPublisher{}, f.options(nil)...); err != nil {
		return badUsage("%v", err)
	}
	return nil
}

func (f *relayFlags) options(log *slog.Logger) []outbox.Option {
	opts := []outbox.Option{outbox.WithBatchSize(f.batch), outbox.WithLeaseTTL(f.lease), outbox.WithPollInterval(f.poll),
		outbox.WithMaxAttempts(f.attempts), outbox.WithLogger(log)}
	if f.pollOnly {
		opts = append(opts, outbox.WithPollOnly())
	}
	if f.policy == "skip" {
		opts = append(opts, outbox.WithPoisonPolicy(outbox.Skip))
	}
	if f.retention > 0 {
		opts = append(opts, outbox.WithRetention(f.retention, 1000, time.Minute))
	}
	if f.id != "" {
		opts = append(opts, outbox.WithRelayID(f.id))
	}
	return opts
}

func natsURLOf(flagValue string) string {
	if flagValue != "" {
		return flagValue
	}
	if v := os.Getenv("DEDUP_NATS_URL"); v != "" {
		return v
	}
	return nats.DefaultURL
}

func runRelay(args []string, stdout, stderr io.Writer) int {
	var f relayFlags
	fs := newRelayFlagSet(&f)
	err := parseCommand(fs, args, relayAbout, stdout)
	if err == nil {
		err = f.check()
	}
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "dedup relay: %v\nRun 'dedup relay -h' for the flags.\n", err)
		return exitUsage
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	src, closeSrc, err := openOutboxSource(ctx, &f)
	if err != nil {
		fmt.Fprintf(stderr, "dedup relay: %v\n", err)
		return exitFail
	}
	defer closeSrc()
	if f.broker == "rabbitmq" {
		return runRelayAMQP(ctx, &f, src, stdout, stderr)
	}
	if f.broker == "kafka" {
		return runRelayKafka(ctx, &f, src, stdout, stderr)
	}
	nc, err := nats.Connect(natsURLOf(f.natsURL), nats.Name("dedup relay"), nats.MaxReconnects(-1))
	if err != nil {
		fmt.Fprintf(stderr, "dedup relay: connect to NATS at %s: %v (set --nats-url or DEDUP_NATS_URL)\n", natsURLOf(f.natsURL), err)
		return exitFail
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		fmt.Fprintf(stderr, "dedup relay: %v\n", err)
		return exitFail
	}
	var popts []dedupnats.PublisherOption
	if f.stream != "" {
		popts = append(popts, dedupnats.WithExpectStream(f.stream))
	}
	pub, err := dedupnats.NewOutboxPublisher(js, f.ackWait, popts...)
	if err != nil {
		fmt.Fprintf(stderr, "dedup relay: %v\n", err)
		return exitFail
	}
	return runRelayLoop(ctx, &f, src, pub, "NATS "+natsURLOf(f.natsURL), stdout, stderr)
}

// runRelayLoop runs the relay from src through pub (described as dest)
// until ctx ends, printing progress every --progress and, with
// --metrics-listen, serving its metrics on /metrics; every broker's
// `dedup relay` ends here.
func runRelayLoop(ctx context.Context, f *relayFlags, src outbox.Source, pub outbox.Publisher, dest string, stdout, stderr io.Writer) int {
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	rl, err := outbox.NewRelay(src, pub, f.options(log)...)
	if err != nil {
		fmt.Fprintf(stderr, "dedup relay: %v\n", err)
		return exitFail
	}
	if f.metricsListen != "" {
		srv, err := relayMetrics(f.metricsListen, rl)
		if err != nil {
			fmt.Fprintf(stderr, "dedup relay: metrics: %v\n", err)
			return exitFail
		}
		defer srv.Close()
		fmt.Fprintf(stderr, "dedup relay %s: metrics on http://%s/metrics\n", rl.ID(), srv.Addr())
	}
	fmt.Fprintf(stderr, "dedup relay %s: %s outbox -> %s, %d partitions\n", rl.ID(), f.store, dest, f.parts)
	done, stopped := make(chan struct{}), make(chan struct{})
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
				fmt.Fprintf(stderr, "relay %s: %d published (%.0f/s), last lag %v, %d failed, %d quarantined, %d partitions held\n",
					rl.ID(), st.Published, float64(st.Published-last)/f.progress.Seconds(), st.Lag.Round(time.Millisecond), st.Failed, st.Quarantined, st.Partitions)
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

// relayMetrics serves the relay's counters (dedupprom's relay collector,
// with the Go runtime's and the process's) on addr's /metrics.
func relayMetrics(addr string, rl *outbox.Relay) (*dedupprom.Server, error) {
	m, err := dedupprom.New()
	if err != nil {
		return nil, err
	}
	reg := prometheus.NewRegistry()
	if err := reg.Register(m.RelayCollector(rl.ID(), rl.Stats, nil)); err != nil {
		return nil, err
	}
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return dedupprom.Listen(addr, reg)
}

// openOutboxSource opens the store --store names and returns its outbox.
func openOutboxSource(ctx context.Context, f *relayFlags) (outbox.Source, func(), error) {
	if f.store == "sqlite" {
		s, err := sqlitestore.Open(f.sqlitePath)
		if err != nil {
			return nil, nil, err
		}
		src, err := s.OutboxSource(ctx, f.parts)
		if err != nil {
			s.Close()
			return nil, nil, err
		}
		return src, func() { s.Close() }, nil
	}
	s, err := f.pg.open(ctx)
	if err != nil {
		return nil, nil, err
	}
	if _, err := s.Check(ctx); err != nil {
		s.Close()
		return nil, nil, err
	}
	src, err := s.OutboxSource(pgstoreOutboxPartitions(f.parts))
	if err != nil {
		s.Close()
		return nil, nil, err
	}
	// The partition index, built in the background: a long transaction
	// delays the build, never the relay.
	ictx, cancel := context.WithCancel(ctx)
	built := make(chan struct{})
	go func() {
		defer close(built)
		if err := src.CreateIndex(ictx); err != nil && ictx.Err() == nil {
			fmt.Fprintf(os.Stderr, "dedup relay: the partition index could not be built (the relay works without it, slower): %v\n", err)
		}
	}()
	return src, func() { cancel(); <-built; s.Close() }, nil
}

// nopSource and nopPublisher let check validate the relay options
// before any I/O.
type nopSource struct{ n int }

func (s nopSource) Partitions() int                                        { return s.n }
func (nopSource) Join(context.Context, string, time.Duration) (int, error) { return 1, nil }
func (nopSource) Leave(context.Context, string) error                      { return nil }
func (nopSource) Acquire(context.Context, string, int, time.Duration) (outbox.Lease, bool, error) {
	return outbox.Lease{}, false, nil
}
func (nopSource) Release(context.Context, outbox.Lease) error { return nil }
func (nopSource) Fetch(context.Context, outbox.Lease, int, bool) ([]outbox.Message, error) {
	return nil, nil
}
func (nopSource) Mark(context.Context, outbox.Lease, []int64) error          { return nil }
func (nopSource) Fail(context.Context, outbox.Lease, []outbox.Failure) error { return nil }

type nopPublisher struct{}

func (nopPublisher) Publish(context.Context, []outbox.Message, []error) {}
