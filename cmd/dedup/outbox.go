package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/dedupkit/dedup/internal/verify"
	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/dedupkit/dedup/sqlitestore"
)

const outboxAbout = `Usage: dedup outbox status|list|retry ID|drop ID [flags]

Inspects and repairs the outbox of a PostgreSQL store (pgstore, the
default) or of a SQLite file (--store sqlite --sqlite-path FILE):

  status    backlog, oldest unpublished age, lag per partition, the relays
            and their leases, quarantined rows, the oldest open transaction
            (its rows are invisible until it ends: it delays, never loses)
  list      unpublished rows in line, or with --quarantined the rows moved
            aside with their error and attempt count
  retry ID  put the quarantined row of message ID back in line (its key's
            later rows wait behind it again)
  drop ID   delete the quarantined row of message ID so its key flows on
            (--dry-run shows the row and changes nothing); a row in line is
            never dropped

Exit status: 0 on success, 1 on failure (no such quarantined row
included), 2 on bad usage.

Flags:
`

func pgstoreOutboxPartitions(n int) pgstore.OutboxOption { return pgstore.WithOutboxPartitions(n) }

// openOutboxAdmin opens the store whose outbox `dedup outbox` inspects.
// A SQLite file must exist (opening would create an empty database).
func openOutboxAdmin(ctx context.Context, f *pgFlags, store, path, table string) (outbox.Admin, func(), error) {
	if store == "sqlite" {
		if _, err := os.Stat(path); err != nil {
			return nil, nil, err
		}
		s, err := sqlitestore.Open(path, sqlitestore.WithTable(table))
		if err != nil {
			return nil, nil, err
		}
		return s, func() { s.Close() }, nil
	}
	s, err := f.open(ctx)
	if err != nil {
		return nil, nil, err
	}
	return s, func() { s.Close() }, nil
}

func runOutbox(args []string, stdout, stderr io.Writer) int {
	var f pgFlags
	var parts, limit int
	var quarantined, dryRun bool
	var store, sqlitePath, sqliteTable string
	fs := flag.NewFlagSet("dedup outbox", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&store, "store", "postgres", "where the outbox is: `postgres` or sqlite")
	fs.StringVar(&sqlitePath, "sqlite-path", "", "with --store sqlite: the database `file`")
	fs.StringVar(&sqliteTable, "sqlite-table", "dedup_records", "with --store sqlite: the store's `table` (the outbox is <table>_outbox)")
	fs.StringVar(&f.addr, "addr", "", "PostgreSQL connection `string` (default: $DEDUP_POSTGRES_URL or "+defaultPostgresURL+")")
	fs.StringVar(&f.schema, "schema", "public", "`schema` of the store's tables")
	fs.StringVar(&f.prefix, "prefix", "dedup_", "`prefix` of the store's table names")
	fs.DurationVar(&f.timeout, "timeout", 30*time.Second, "bound on the whole command")
	fs.BoolVar(&f.json, "json", false, "print the result as JSON")
	fs.IntVar(&parts, "outbox-partitions", 16, "`N` partitions the relays use (for the lag per partition)")
	fs.IntVar(&limit, "limit", 50, "list at most this many rows")
	fs.BoolVar(&quarantined, "quarantined", false, "list: the quarantined rows instead of the rows in line")
	fs.BoolVar(&dryRun, "dry-run", false, "drop: show the row, change nothing")
	fail := func(err error) int {
		fmt.Fprintf(stderr, "dedup outbox: %v\nRun 'dedup outbox -h' for the flags.\n", err)
		return exitUsage
	}
	if err := parseInterspersed(fs, args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printUsage(stdout, outboxAbout, fs)
			return exitOK
		}
		return fail(badUsage("%s", flagError(fs, err)))
	}
	pos := fs.Args()
	if len(pos) == 0 {
		return fail(badUsage("missing subcommand: status, list, retry ID or drop ID"))
	}
	sub := pos[0]
	want := map[string]int{"status": 1, "list": 1, "retry": 2, "drop": 2}[sub]
	switch {
	case want == 0:
		return fail(badUsage("unknown subcommand %q: status, list, retry ID or drop ID", sub))
	case len(pos) != want:
		return fail(badUsage("%s takes %d argument(s), got %d", sub, want-1, len(pos)-1))
	case parts < 1 || parts > 4096:
		return fail(badUsage("--outbox-partitions must be between 1 and 4096"))
	case limit < 1:
		return fail(badUsage("--limit must be positive"))
	case dryRun && sub != "drop":
		return fail(badUsage("--dry-run applies only to drop"))
	case store != "postgres" && store != "sqlite":
		return fail(badUsage("--store must be postgres or sqlite, got %q", store))
	case store == "sqlite" && sqlitePath == "":
		return fail(badUsage("--store sqlite needs --sqlite-path, the database file"))
	}
	if err := checkTimeout(f.timeout); err != nil {
		return fail(err)
	}
	ctx, cancel := commandContext(f.timeout)
	defer cancel()
	s, closeStore, err := openOutboxAdmin(ctx, &f, store, sqlitePath, sqliteTable)
	if err != nil {
		fmt.Fprintf(stderr, "dedup outbox: %v\n", err)
		return exitFail
	}
	defer closeStore()
	switch sub {
	case "status":
		st, err := s.OutboxStatus(ctx, parts)
		if err != nil {
			fmt.Fprintf(stderr, "dedup outbox status: %v\n", err)
			return exitFail
		}
		if f.json {
			return writeJSON(stdout, stderr, "outbox status", st)
		}
		tx := ", oldest open transaction " + st.OldestTransaction.Round(time.Millisecond).String()
		if store == "sqlite" {
			tx = "" // one writer at a time: no row commits behind a relay
		}
		fmt.Fprintf(stdout, "backlog %d, oldest unpublished %v, quarantined %d, published (kept) %d%s\n",
			st.Backlog, st.OldestAge.Round(time.Millisecond), st.Quarantined, st.Published, tx)
		for _, p := range st.Partitions {
			owner := "free"
			if p.Owner != "" && p.LeaseLeft > 0 {
				owner = fmt.Sprintf("%s (epoch %d, %v left)", p.Owner, p.Epoch, p.LeaseLeft.Round(time.Millisecond))
			} else if p.Owner != "" {
				owner = fmt.Sprintf("expired: %s (epoch %d)", p.Owner, p.Epoch)
			}
			fmt.Fprintf(stdout, "partition %3d: backlog %d, lag %v, %s\n", p.Partition, p.Backlog, p.OldestAge.Round(time.Millisecond), owner)
		}
		for _, r := range st.Relays {
			state := "alive"
			if !r.Alive {
				state = "gone"
			}
			up := ""
			if r.Since > 0 {
				up = ", up " + r.Since.Round(time.Second).String()
			}
			fmt.Fprintf(stdout, "relay %s: %s, %d partitions%s\n", r.Relay, state, r.Partitions, up)
		}
	case "list":
		rows, err := s.OutboxList(ctx, quarantined, limit)
		if err != nil {
			fmt.Fprintf(stderr, "dedup outbox list: %v\n", err)
			return exitFail
		}
		if f.json {
			if rows == nil {
				rows = []outbox.Row{}
			}
			return writeJSON(stdout, stderr, "outbox list", rows)
		}
		for _, r := range rows {
			line := fmt.Sprintf("%d\t%s\tkey=%s\ttopic=%s\tattempts=%d\tcreated=%s", r.Seq, r.ID, r.Key, r.Topic, r.Attempts, r.CreatedAt.UTC().Format(time.RFC3339))
			if r.LastError != "" {
				line += "\terror=" + strings.ReplaceAll(cut(r.LastError, 200), "\n", " ")
			}
			fmt.Fprintln(stdout, line)
		}
	case "retry", "drop":
		var r outbox.Row
		if sub == "retry" {
			r, err = s.OutboxRetry(ctx, pos[1])
		} else {
			r, err = s.OutboxDrop(ctx, pos[1], dryRun)
		}
		if err != nil {
			fmt.Fprintf(stderr, "dedup outbox %s %s: %v\n", sub, pos[1], err)
			return exitFail
		}
		verb := map[string]string{"retry": "back in line", "drop": "dropped"}[sub]
		if dryRun {
			verb = "would be dropped (dry run)"
		}
		if f.json {
			return writeJSON(stdout, stderr, "outbox "+sub, map[string]any{"row": r, "dry_run": dryRun})
		}
		fmt.Fprintf(stdout, "%s (seq %d, key %s, %d attempts, error %q) %s\n", r.ID, r.Seq, r.Key, r.Attempts, r.LastError, verb)
	}
	return exitOK
}

const verifyOutboxAbout = `Usage: dedup verify --outbox [flags]

Checks the producer half end to end over a broker (--broker: a real NATS
JetStream server, a real RabbitMQ server, or Kafka on an in-process kfake
cluster that loses produce responses), with that adapter's relay
publisher: producers commit business transactions that bump an aggregate's version
and write its event to the outbox (some rolled back, some held open for
--hold), --relays relays publish them (dying between the broker's acks
and the mark, and in the middle of batches, then restarted under a new
name), consumers with dedup apply them into a ledger. It passes when
every committed event was applied exactly once, no rolled-back event was
delivered, and each aggregate's versions were applied in order.

Exit status: 0 when every check passed, 1 when one failed, 2 on bad usage.

Flags:
`

// wantsOutbox reports whether `dedup verify` was given --outbox.
func wantsOutbox(args []string) bool {
	for _, a := range args {
		if a == "--" {
			return false
		}
		if a == "--outbox" || a == "-outbox" || a == "--outbox=true" || a == "-outbox=true" {
			return true
		}
	}
	return false
}

func runVerifyOutbox(args []string, stdout, stderr io.Writer) int {
	cfg := verify.DefaultOutboxConfig()
	var asJSON, on bool
	var timeout time.Duration
	fs := flag.NewFlagSet("dedup verify --outbox", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.BoolVar(&on, "outbox", true, "check the transactional outbox and relay end to end")
	fs.StringVar(&cfg.Store, "store", cfg.Store, "the outbox's store: `postgres` or sqlite")
	fs.StringVar(&cfg.PostgresURL, "addr", "", "PostgreSQL connection `string` (default: $DEDUP_POSTGRES_URL or "+defaultPostgresURL+")")
	fs.StringVar(&cfg.SQLitePath, "path", "", "SQLite database `file` (default: a temporary file)")
	fs.StringVar(&cfg.Broker, "broker", cfg.Broker, "the `broker` the relays publish to: nats, rabbitmq or kafka (in process on kfake)")
	fs.StringVar(&cfg.NATSURL, "nats-url", "", "for --broker nats: the server `URL` (default: $DEDUP_NATS_URL or nats://127.0.0.1:4222)")
	fs.StringVar(&cfg.AMQPURL, "amqp-url", "", "for --broker rabbitmq: the server `URL` (default: $DEDUP_AMQP_URL or amqp://guest:guest@127.0.0.1:5672/)")
	fs.IntVar(&cfg.Events, "messages", cfg.Events, "business transactions the producers run")
	fs.IntVar(&cfg.Producers, "producers", cfg.Producers, "producers at once")
	fs.IntVar(&cfg.Aggregates, "aggregates", cfg.Aggregates, "aggregates the events belong to")
	fs.IntVar(&cfg.Relays, "relays", cfg.Relays, "relays at once")
	fs.IntVar(&cfg.Partitions, "outbox-partitions", cfg.Partitions, "partitions the relays split")
	fs.IntVar(&cfg.Batch, "batch", cfg.Batch, "rows a relay's partition reads and publishes at a time (the relay faults are drawn per batch)")
	fs.IntVar(&cfg.Consumers, "consumers", cfg.Consumers, "consumer workers")
	fs.Float64Var(&cfg.RollbackRate, "rollback-rate", cfg.RollbackRate, "share of transactions rolled back after writing their event")
	fs.Float64Var(&cfg.HoldRate, "hold-rate", cfg.HoldRate, "share of transactions held open for --hold before committing")
	fs.DurationVar(&cfg.Hold, "hold", cfg.Hold, "how long a held transaction stays open")
	fs.Float64Var(&cfg.CrashRate, "crash-rate", cfg.CrashRate, "chance per batch that a relay dies between the acks and the mark")
	fs.Float64Var(&cfg.KillRate, "kill-rate", cfg.KillRate, "chance per batch that a relay dies mid-batch")
	fs.DurationVar(&cfg.Lease, "lease", cfg.Lease, "the relays' partition lease TTL")
	fs.Uint64Var(&cfg.Seed, "seed", 0, "seed of the producers' and relays' choices (0: random)")
	fs.BoolVar(&cfg.Keep, "keep", false, "keep the schema or file and the stream")
	fs.BoolVar(&asJSON, "json", false, "print the report as JSON")
	fs.DurationVar(&timeout, "timeout", 10*time.Minute, "bound on the whole run")
	if err := parseInterspersed(fs, args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printUsage(stdout, verifyOutboxAbout, fs)
			return exitOK
		}
		fmt.Fprintf(stderr, "dedup verify --outbox: %s\n", flagError(fs, err))
		return exitUsage
	}
	if cfg.PostgresURL == "" {
		cfg.PostgresURL = (&pgFlags{}).connString()
	}
	cfg.NATSURL = natsURLOf(cfg.NATSURL)
	if cfg.AMQPURL == "" {
		cfg.AMQPURL = os.Getenv("DEDUP_AMQP_URL")
	}
	if cfg.AMQPURL == "" {
		cfg.AMQPURL = "amqp://guest:guest@127.0.0.1:5672/"
	}
	if err := cfg.Validate(); err != nil {
		fmt.Fprintf(stderr, "dedup verify --outbox: %v\n", err)
		return exitUsage
	}
	if err := checkTimeout(timeout); err != nil {
		fmt.Fprintf(stderr, "dedup verify --outbox: %v\n", err)
		return exitUsage
	}
	ctx, cancel := commandContext(timeout)
	defer cancel()
	if !asJSON && isTerminal(stderr) {
		cfg.Progress = func(p verify.OutboxProgress) {
			fmt.Fprintf(stderr, "\r%d committed, %d rolled back, %d applied, %d relay deaths, %v   ", p.Committed, p.RolledBack, p.Applied, p.RelayCrashes, p.Elapsed.Round(time.Second))
		}
	}
	rep, err := verify.RunOutbox(ctx, cfg)
	if cfg.Progress != nil {
		fmt.Fprintln(stderr)
	}
	if err != nil {
		fmt.Fprintf(stderr, "dedup verify --outbox: %v\n", err)
		return exitFail
	}
	if asJSON {
		if code := writeJSON(stdout, stderr, "verify --outbox", rep); code != exitOK {
			return code
		}
	} else {
		fmt.Fprintf(stdout, "outbox on %s -> %s %s: %d events (%d committed, %d rolled back, %d held open), %d relays over %d partitions, %d consumers, seed %d\n",
			rep.Store, rep.Broker, rep.Stream, rep.Events, rep.Committed, rep.RolledBack, rep.Held, rep.Relays, rep.Partitions, rep.Consumers, rep.Seed)
		fmt.Fprintf(stdout, "relays: %d died after the acks before the mark, %d died mid-batch, %d rows marked published\n", rep.RelayCrashes, rep.RelayKills, rep.Published)
		fmt.Fprintf(stdout, "consumers: %d deliveries, %d duplicates absorbed by dedup\n", rep.Deliveries, rep.DuplicatesSkipped)
		fmt.Fprintf(stdout, "ledger: %d lost, %d applied twice, %d rolled-back delivered, %d out of order\n", rep.Lost, rep.DoubleApplied, rep.RolledBackSeen, rep.OrderViolations)
		for _, s := range rep.ViolationSamples {
			fmt.Fprintf(stdout, "  %s\n", s)
		}
		fmt.Fprintf(stdout, "%.1fs, %.0f committed events/s\n", rep.Seconds, rep.Throughput)
		if rep.OK {
			fmt.Fprintln(stdout, "PASS")
		} else {
			for _, v := range rep.Violations() {
				fmt.Fprintf(stdout, "FAIL: %s\n", v)
			}
		}
	}
	if !rep.OK {
		return exitFail
	}
	return exitOK
}
