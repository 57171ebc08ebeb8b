package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/dedupkit/dedup/pgstore"
)

const outboxAbout = `Usage: dedup outbox status|list|retry ID|drop ID [flags]

Inspects and repairs the outbox of a PostgreSQL store (pgstore):

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

func runOutbox(args []string, stdout, stderr io.Writer) int {
	var f pgFlags
	var parts, limit int
	var quarantined, dryRun bool
	fs := flag.NewFlagSet("dedup outbox", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
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
	}
	if err := checkTimeout(f.timeout); err != nil {
		return fail(err)
	}
	ctx, cancel := commandContext(f.timeout)
	defer cancel()
	s, err := f.open(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "dedup outbox: %v\n", err)
		return exitFail
	}
	defer s.Close()
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
		fmt.Fprintf(stdout, "backlog %d, oldest unpublished %v, quarantined %d, published (kept) %d, oldest open transaction %v\n",
			st.Backlog, st.OldestAge.Round(time.Millisecond), st.Quarantined, st.Published, st.OldestTransaction.Round(time.Millisecond))
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
			fmt.Fprintf(stdout, "relay %s: %s, %d partitions, up %v\n", r.Relay, state, r.Partitions, r.Since.Round(time.Second))
		}
	case "list":
		rows, err := s.OutboxList(ctx, quarantined, limit)
		if err != nil {
			fmt.Fprintf(stderr, "dedup outbox list: %v\n", err)
			return exitFail
		}
		if f.json {
			if rows == nil {
				rows = []pgstore.OutboxRow{}
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
		var r pgstore.OutboxRow
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
