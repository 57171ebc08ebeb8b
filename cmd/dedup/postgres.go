package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
)

// defaultPostgresURL is the connection string without --addr or
// $DEDUP_POSTGRES_URL.
const defaultPostgresURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// pgFlags are the flags `dedup migrate` and `dedup sweep` share: where the
// store's tables are.
type pgFlags struct {
	addr       string
	schema     string
	prefix     string
	partitions time.Duration
	ahead      time.Duration
	timeout    time.Duration
	json       bool
}

func (f *pgFlags) register(fs *flag.FlagSet, timeout time.Duration) {
	fs.StringVar(&f.addr, "addr", "", "PostgreSQL connection `string`, a URL or key=value pairs (default: $DEDUP_POSTGRES_URL or "+defaultPostgresURL+")")
	fs.StringVar(&f.schema, "schema", "public", "`schema` of the store's tables (created by migrate if missing)")
	fs.StringVar(&f.prefix, "prefix", "dedup_", "`prefix` of the store's table names")
	fs.DurationVar(&f.partitions, "partitions", 0, "the store uses the time-partitioned records table with partitions of this `interval` (a whole number of hours, e.g. 24h); 0: the plain table")
	fs.DurationVar(&f.ahead, "ahead", 72*time.Hour, "with --partitions: create partitions this far past now")
	fs.DurationVar(&f.timeout, "timeout", timeout, "bound on the whole command")
	fs.BoolVar(&f.json, "json", false, "print the result as one JSON object")
}

// connString returns --addr, $DEDUP_POSTGRES_URL or the default.
func (f *pgFlags) connString() string {
	if f.addr != "" {
		return f.addr
	}
	if v := os.Getenv("DEDUP_POSTGRES_URL"); v != "" {
		return v
	}
	return defaultPostgresURL
}

// check validates the shared flags, naming the flag that is wrong.
func (f *pgFlags) check() error {
	if err := checkTimeout(f.timeout); err != nil {
		return err
	}
	if f.prefix == "" {
		// pgstore accepts an empty prefix (tables named records, outbox
		// and schema_migrations, the last being golang-migrate's own
		// table): from the command line it is far likelier a mistake.
		return badUsage("--prefix must not be empty: the tables would be named records, outbox and schema_migrations (the name golang-migrate uses) in schema %s; keep the default dedup_ or choose another prefix", f.schema)
	}
	var ae *dedup.ArgumentError
	if _, err := pgstore.New(nil, f.options()...); errors.As(err, &ae) && ae.Arg != "pool" {
		name := map[string]string{"schema": "--schema", "table prefix": "--prefix", "partition interval": "--partitions", "partitions ahead": "--ahead"}[ae.Arg]
		if name == "" {
			name = "a flag"
		}
		return badUsage("%s: %s", name, strings.TrimPrefix(err.Error(), "dedup: "))
	}
	return nil
}

func (f *pgFlags) options() []pgstore.Option {
	opts := []pgstore.Option{
		pgstore.WithSchema(f.schema),
		pgstore.WithTablePrefix(f.prefix),
		// Warnings are printed by the commands themselves.
		pgstore.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))),
	}
	if f.partitions != 0 {
		opts = append(opts, pgstore.WithPartitions(f.partitions), pgstore.WithPartitionsAhead(f.ahead))
	}
	return opts
}

// open connects, explaining how to point the command elsewhere if it
// cannot.
func (f *pgFlags) open(ctx context.Context) (*pgstore.Store, error) {
	s, err := pgstore.Open(ctx, f.connString(), f.options()...)
	if err != nil {
		return nil, explainPostgres(err, f.connString())
	}
	return s, nil
}

// parseCommand parses args into fs, printing help for -h.
func parseCommand(fs *flag.FlagSet, args []string, about string, stdout io.Writer) error {
	if err := parseInterspersed(fs, args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printUsage(stdout, about, fs)
			return err
		}
		return badUsage("%s", flagError(fs, err))
	}
	if fs.NArg() > 0 {
		return badUsage("unexpected argument %q: %s takes only flags", fs.Arg(0), strings.TrimPrefix(fs.Name(), "dedup "))
	}
	return nil
}

// printUsage prints about and the flags in the layout of `dedup verify -h`.
func printUsage(w io.Writer, about string, fs *flag.FlagSet) {
	fmt.Fprint(w, about)
	fs.VisitAll(func(fl *flag.Flag) {
		name, use := flag.UnquoteUsage(fl)
		if name != "" {
			name = " " + name
		}
		line := "  --" + fl.Name + name
		if len(line) < 22 {
			line += strings.Repeat(" ", 22-len(line))
		} else {
			line += "\n" + strings.Repeat(" ", 22)
		}
		if fl.DefValue != "" && fl.DefValue != "false" && fl.DefValue != "0" && fl.DefValue != "0s" {
			use += " (default " + fl.DefValue + ")"
		}
		fmt.Fprintln(w, line+wrap(use, 22, 79))
	})
}

// commandContext is the context of a command: cancelled by an interrupt or
// after timeout.
func commandContext(timeout time.Duration) (context.Context, func()) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	return ctx, func() { cancel(); stop() }
}

const migrateAbout = `Usage: dedup migrate [flags]

Creates or upgrades the schema of the PostgreSQL store (pgstore): the
compact records table, its time-partitioned variant and the scopes table,
the per-scope retention window table and the outbox tables, each
migration in its own transaction, recorded in <prefix>schema_migrations.
Running it again does nothing; instances that migrate at the same time
are serialised by an advisory lock. With --partitions it also creates the
partitions for the coming --ahead.

A schema from before version 6 keeps its records in the old tables
(<prefix>records, <prefix>records_p): migrate then converts them online,
moving them into the compact tables in batches of --convert-batch while
the store is in use (claims move the keys they touch first, so every old
record stays deduplicated), printing its progress, and drops the old
tables once empty. Upgrade every instance before running it: an older
version would still write the old tables. A large table may need a
longer --timeout; an interrupted conversion carries on where it stopped
when migrate runs again.

Then it checks the retention windows and warns about every scope whose
retention is shorter than its replay horizon.

Exit status: 0 on success (warnings included), 1 on failure, 2 on bad
usage.

Flags:
`

// migrateReport is the JSON output of `dedup migrate --json`.
type migrateReport struct {
	Schema            string   `json:"schema"`
	Prefix            string   `json:"prefix"`
	Applied           []string `json:"applied"`
	Version           int      `json:"version"`
	PartitionsCreated []string `json:"partitions_created"`
	// Converted counts the old records moved to the compact tables,
	// Expired those dropped because they had expired; ConvertPending says
	// an old table is still there (run migrate again).
	Converted      int64    `json:"converted"`
	Expired        int64    `json:"expired_dropped"`
	DroppedTables  []string `json:"dropped_tables"`
	ConvertPending bool     `json:"convert_pending"`
	Warnings       []string `json:"warnings"`
}

func runMigrate(args []string, stdout, stderr io.Writer) int {
	var f pgFlags
	fs := flag.NewFlagSet("dedup migrate", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	f.register(fs, time.Minute)
	batch := fs.Int("convert-batch", 5000, "old records moved per statement when converting a schema from before version 6")
	err := parseCommand(fs, args, migrateAbout, stdout)
	if err == nil {
		err = f.check()
	}
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "dedup migrate: %v\nRun 'dedup migrate -h' for the flags.\n", err)
		return exitUsage
	}
	ctx, done := commandContext(f.timeout)
	defer done()
	s, err := f.open(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "dedup migrate: %v\n", err)
		return exitFail
	}
	defer s.Close()
	res, err := s.Migrate(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "dedup migrate: %v\n", err)
		if len(res.Applied) > 0 {
			fmt.Fprintf(stderr, "dedup migrate: applied before the failure: %s\n", strings.Join(res.Applied, ", "))
		}
		return exitFail
	}
	if *batch <= 0 {
		fmt.Fprintf(stderr, "dedup migrate: --convert-batch must be positive, got %d\n", *batch)
		return exitUsage
	}
	var last time.Time
	conv, err := s.Convert(ctx, pgstore.ConvertOptions{BatchSize: *batch, OnProgress: func(p pgstore.ConvertProgress) {
		if f.json || time.Since(last) < time.Second {
			return
		}
		last = time.Now()
		fmt.Fprintf(stdout, "dedup migrate: converting %s%s: %d of about %d old records\n", f.prefix, p.Table, p.Done, p.Estimate)
	}})
	if err != nil {
		fmt.Fprintf(stderr, "dedup migrate: converting the old records (%d moved so far; run migrate again to carry on): %v\n", conv.Moved+conv.Expired, err)
		return exitFail
	}
	st, err := s.Check(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "dedup migrate: check after migrating: %v\n", err)
		return exitFail
	}
	rep := migrateReport{Schema: f.schema, Prefix: f.prefix, Applied: nonNil(res.Applied), Version: st.Version,
		PartitionsCreated: nonNil(res.PartitionsCreated), Converted: conv.Moved, Expired: conv.Expired,
		DroppedTables: nonNil(conv.Dropped), ConvertPending: conv.Pending, Warnings: []string{}}
	for _, w := range st.Warnings {
		rep.Warnings = append(rep.Warnings, w.String())
	}
	if f.json {
		return writeJSON(stdout, stderr, "migrate", rep)
	}
	where := fmt.Sprintf("schema %s, table prefix %q", f.schema, f.prefix)
	if len(res.Applied) == 0 {
		fmt.Fprintf(stdout, "dedup migrate: %s already at version %d; nothing to do\n", where, st.Version)
	} else {
		fmt.Fprintf(stdout, "dedup migrate: %s: applied %s; now at version %d\n", where, strings.Join(res.Applied, ", "), st.Version)
	}
	if len(res.PartitionsCreated) > 0 {
		fmt.Fprintf(stdout, "  partitions created: %s\n", strings.Join(res.PartitionsCreated, ", "))
	}
	if len(conv.Dropped) > 0 {
		fmt.Fprintf(stdout, "  converted %d old records to the compact tables (%d expired ones dropped); old tables dropped: %s\n",
			conv.Moved, conv.Expired, strings.Join(conv.Dropped, ", "))
	}
	if conv.Pending {
		fmt.Fprintf(stdout, "warning: an old records table is still there (busy, or rows locked); run migrate again to finish the conversion\n")
	}
	for _, w := range rep.Warnings {
		fmt.Fprintf(stdout, "warning: %s\n", w)
	}
	return exitOK
}

const sweepAbout = `Usage: dedup sweep [flags]

Deletes expired records from the PostgreSQL store (pgstore) in bounded
batches: each batch is one DELETE of at most --batch rows, oldest expiry
first, that skips rows other transactions hold (FOR UPDATE SKIP LOCKED),
so it never waits on a claim and never holds locks for long. Expired
records are already invisible to claims; sweeping reclaims space. It
prints the rows deleted and the lag between their expiry and their
deletion: a lag that grows from run to run means the sweeper falls behind.

By default it runs one batch; --until-empty runs batches until one deletes
fewer than --batch rows. With --partitions (the store's partition
interval) it first creates the partitions ahead and drops the partitions
whose records have all expired.

Exit status: 0 on success, 1 on failure, 2 on bad usage.

Flags:
`

// sweepReport is the JSON output of `dedup sweep --json`.
type sweepReport struct {
	Deleted           int      `json:"deleted"`
	Batches           int      `json:"batches"`
	MaxLagSeconds     float64  `json:"max_lag_seconds"`
	MeanLagSeconds    float64  `json:"mean_lag_seconds"`
	Seconds           float64  `json:"seconds"`
	RowsPerSecond     float64  `json:"rows_per_second"`
	MoreRemain        bool     `json:"more_remain"`
	PartitionsDropped []string `json:"partitions_dropped"`
	PartitionsCreated []string `json:"partitions_created"`
}

func runSweep(args []string, stdout, stderr io.Writer) int {
	kind, args := sweepStoreKind(args)
	if kind == "sqlite" {
		return runSweepSQLite(args, stdout, stderr)
	} else if kind != "postgres" {
		fmt.Fprintf(stderr, "dedup sweep: --store must be postgres or sqlite, got %q\n", kind)
		return exitUsage
	}
	var f pgFlags
	var batch, maxBatches int
	var untilEmpty bool
	var pause time.Duration
	fs := flag.NewFlagSet("dedup sweep", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	f.register(fs, 10*time.Minute)
	fs.IntVar(&batch, "batch", 1000, "most rows one DELETE removes (at least 1)")
	fs.BoolVar(&untilEmpty, "until-empty", false, "run batches until one deletes fewer than --batch rows")
	fs.IntVar(&maxBatches, "max-batches", 0, "with --until-empty: stop after this many batches (0: no bound)")
	fs.DurationVar(&pause, "pause", 2*time.Millisecond, "with --until-empty: wait this long between batches, to leave the disk and CPU to claims (0: none)")
	err := parseCommand(fs, args, sweepAbout, stdout)
	if err == nil {
		err = f.check()
	}
	if err == nil {
		switch {
		case batch < 1 || batch > maxBatch:
			err = badUsage("--batch must be between 1 and %d, got %d", maxBatch, batch)
		case maxBatches < 0:
			err = badUsage("--max-batches must not be negative, got %d", maxBatches)
		case pause < 0 || pause > maxPause:
			err = badUsage("--pause must be between 0 and %v, got %v", maxPause, pause)
		case !untilEmpty && maxBatches != 0:
			err = badUsage("--max-batches applies only with --until-empty")
		}
	}
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "dedup sweep: %v\nRun 'dedup sweep -h' for the flags.\n", err)
		return exitUsage
	}
	ctx, done := commandContext(f.timeout)
	defer done()
	s, err := f.open(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "dedup sweep: %v\n", err)
		return exitFail
	}
	defer s.Close()
	if _, err := s.Check(ctx); err != nil {
		fmt.Fprintf(stderr, "dedup sweep: %v\n", err)
		return exitFail
	}
	if !untilEmpty {
		maxBatches = 1
	}
	r, err := s.Maintain(ctx, batch, maxBatches, pause)
	if err != nil {
		fmt.Fprintf(stderr, "dedup sweep: %v\n", err)
		if r.Deleted > 0 || len(r.PartitionsDropped) > 0 {
			fmt.Fprintf(stderr, "dedup sweep: before the failure it deleted %d records and dropped %d partitions\n", r.Deleted, len(r.PartitionsDropped))
		}
		return exitFail
	}
	rep := sweepReport{Deleted: r.Deleted, Batches: r.Batches, MaxLagSeconds: r.MaxLag.Seconds(), MeanLagSeconds: r.MeanLag.Seconds(),
		Seconds: r.Elapsed.Seconds(), MoreRemain: r.Deleted == r.Batches*batch && r.Deleted > 0,
		PartitionsDropped: nonNil(r.PartitionsDropped), PartitionsCreated: nonNil(r.PartitionsCreated)}
	if r.Elapsed > 0 {
		rep.RowsPerSecond = float64(r.Deleted) / r.Elapsed.Seconds()
	}
	if f.json {
		return writeJSON(stdout, stderr, "sweep", rep)
	}
	batches := "batches"
	if rep.Batches == 1 {
		batches = "batch"
	}
	fmt.Fprintf(stdout, "dedup sweep: deleted %d expired records in %d %s (%.2f s, %.0f rows/s)\n",
		rep.Deleted, rep.Batches, batches, rep.Seconds, rep.RowsPerSecond)
	if r.Deleted > 0 {
		fmt.Fprintf(stdout, "  lag behind expiry: max %s, mean %s\n", r.MaxLag.Round(time.Millisecond), r.MeanLag.Round(time.Millisecond))
	}
	if f.partitions > 0 {
		fmt.Fprintf(stdout, "  partitions dropped: %s\n", listOrNone(r.PartitionsDropped))
		fmt.Fprintf(stdout, "  partitions created: %s\n", listOrNone(r.PartitionsCreated))
	} else if ps, err := partitionCount(ctx, s); err == nil && ps > 0 {
		fmt.Fprintf(stdout, "note: the partitioned records table has %d partitions; pass --partitions with the store's interval to drop expired ones\n", ps)
	}
	if rep.MoreRemain {
		fmt.Fprintln(stdout, "more expired records remain: run again, or use --until-empty")
	}
	return exitOK
}

// partitionCount counts the partitions of the partitioned table, for a
// hint when --partitions was not given.
func partitionCount(ctx context.Context, s *pgstore.Store) (int, error) {
	var n int
	err := s.Pool().QueryRow(ctx, `SELECT count(*) FROM pg_inherits WHERE inhparent = to_regclass($1)`, s.Tables().RecordsPartitioned).Scan(&n)
	return n, err
}

func writeJSON(stdout, stderr io.Writer, cmd string, v any) int {
	enc := json.NewEncoder(stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		fmt.Fprintf(stderr, "dedup %s: write the report: %v\n", cmd, err)
		return exitFail
	}
	return exitOK
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

func listOrNone(s []string) string {
	if len(s) == 0 {
		return "none"
	}
	return strings.Join(s, ", ")
}
