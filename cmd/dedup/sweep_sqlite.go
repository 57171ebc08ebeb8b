package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/dedupkit/dedup/sqlitestore"
)

const sweepSQLiteAbout = `Usage: dedup sweep --store sqlite --path FILE [flags]

Deletes expired records from a SQLite store (sqlitestore) in bounded
batches: each batch is one DELETE of at most --batch rows, oldest expiry
first, holding the write lock only for that batch. Completed records whose
retention ended go; an in-progress record goes only once its lease ended
long ago (its owner is gone). Expired records are already invisible to
claims; sweeping reclaims space. By default it runs batches until one
deletes fewer than --batch rows.

Exit status: 0 on success, 1 on failure, 2 on bad usage.

Flags:
`

// sweepStoreKind finds --store in the arguments of `dedup sweep` and
// returns its value ("postgres" when absent) and the arguments without it,
// so the PostgreSQL sweep keeps its own flags.
func sweepStoreKind(args []string) (string, []string) {
	kind := "postgres"
	rest := make([]string, 0, len(args))
	for i := 0; i < len(args); i++ {
		a := args[i]
		name, val, hasVal := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if !strings.HasPrefix(a, "-") || name != "store" {
			rest = append(rest, a)
			continue
		}
		if !hasVal && i+1 < len(args) {
			i++
			val = args[i]
		}
		kind = val
	}
	return kind, rest
}

// sqliteSweepReport is the JSON output of `dedup sweep --store sqlite --json`.
type sqliteSweepReport struct {
	Deleted int     `json:"deleted"`
	Seconds float64 `json:"seconds"`
}

// runSweepSQLite is `dedup sweep --store sqlite`.
func runSweepSQLite(args []string, stdout, stderr io.Writer) int {
	var path string
	var batch int
	var pause, timeout time.Duration
	var asJSON bool
	fs := flag.NewFlagSet("dedup sweep", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&path, "path", "", "SQLite database `file` (required)")
	fs.IntVar(&batch, "batch", 1000, "most rows one DELETE removes (at least 1)")
	fs.DurationVar(&pause, "pause", 2*time.Millisecond, "wait this long between batches, to leave the write lock to claims (0: none)")
	fs.DurationVar(&timeout, "timeout", 10*time.Minute, "bound on the whole sweep")
	fs.BoolVar(&asJSON, "json", false, "print the result as one JSON object")
	err := parseCommand(fs, args, sweepSQLiteAbout, stdout)
	if err == nil {
		switch {
		case path == "":
			err = badUsage("--store sqlite needs --path, the database file")
		case batch < 1:
			err = badUsage("--batch must be at least 1, got %d", batch)
		case pause < 0:
			err = badUsage("--pause must not be negative, got %v", pause)
		case timeout <= 0:
			err = badUsage("--timeout must be positive, got %v", timeout)
		}
	}
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "dedup sweep: %v\nRun 'dedup sweep --store sqlite -h' for the flags.\n", err)
		return exitUsage
	}
	if _, err := os.Stat(path); err != nil {
		// Opening would create an empty database: refuse a wrong path.
		fmt.Fprintf(stderr, "dedup sweep: %v\n", err)
		return exitFail
	}
	s, err := sqlitestore.Open(path)
	if err != nil {
		fmt.Fprintf(stderr, "dedup sweep: %v\n", err)
		return exitFail
	}
	defer s.Close()
	ctx, done := commandContext(timeout)
	defer done()
	start := time.Now()
	n, err := s.SweepExpired(ctx, batch, pause)
	if err != nil {
		fmt.Fprintf(stderr, "dedup sweep: %v (after deleting %d records)\n", err, n)
		return exitFail
	}
	rep := sqliteSweepReport{Deleted: n, Seconds: time.Since(start).Seconds()}
	if asJSON {
		json.NewEncoder(stdout).Encode(rep)
	} else {
		fmt.Fprintf(stdout, "deleted %d expired records in %.3fs\n", rep.Deleted, rep.Seconds)
	}
	return exitOK
}
