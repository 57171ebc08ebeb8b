package pgstore

import (
	"context"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/dedupkit/dedup"
)

// An Option configures a [Store] in [Open] or [New].
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	schema          string
	prefix          string
	grace           time.Duration
	partition       time.Duration // 0: one plain records table
	partitionsAhead time.Duration
	lockTimeout     time.Duration
	logger          *slog.Logger
	onRetention     func(context.Context, RetentionWarning)
	vacuumMin       int
	vacuumFraction  float64
}

func defaultConfig() config {
	return config{
		schema:          "public",
		prefix:          "dedup_",
		grace:           24 * time.Hour,
		partitionsAhead: 72 * time.Hour,
		lockTimeout:     200 * time.Millisecond,
		vacuumMin:       10_000,
		vacuumFraction:  0.1,
	}
}

// maxIdent is PostgreSQL's identifier length (NAMEDATALEN - 1). The longest
// name the store derives from the prefix is the partition name,
// prefix + "records_p_" + "20060102t15" (21 bytes).
const (
	maxIdent      = 63
	longestSuffix = len("records_p_") + len(partitionNameLayout)
)

func (c *config) validate() error {
	if err := validateIdent("schema", c.schema, maxIdent); err != nil {
		return err
	}
	if c.prefix != "" {
		if err := validateIdent("table prefix", c.prefix, maxIdent-longestSuffix); err != nil {
			return err
		}
	}
	if c.grace <= 0 {
		return &dedup.ArgumentError{Arg: "in-progress grace", Reason: "must be positive, got " + c.grace.String()}
	}
	if c.partition != 0 {
		if c.partition < time.Hour || c.partition%time.Hour != 0 {
			return &dedup.ArgumentError{Arg: "partition interval", Reason: "must be a whole number of hours, got " + c.partition.String()}
		}
		if c.partitionsAhead < c.partition {
			return &dedup.ArgumentError{Arg: "partitions ahead", Reason: "must cover at least one partition interval (" + c.partition.String() + "), got " + c.partitionsAhead.String()}
		}
	}
	if c.vacuumMin < 0 {
		return &dedup.ArgumentError{Arg: "vacuum minimum", Reason: "must not be negative, got " + itoa(c.vacuumMin)}
	}
	if !(c.vacuumFraction >= 0 && c.vacuumFraction <= 1e6) { // also refuses NaN
		return &dedup.ArgumentError{Arg: "vacuum fraction", Reason: "must be between 0 and 1e6, got " + strconv.FormatFloat(c.vacuumFraction, 'g', -1, 64)}
	}
	if c.lockTimeout <= 0 {
		return &dedup.ArgumentError{Arg: "maintenance lock timeout", Reason: "must be positive, got " + c.lockTimeout.String()}
	}
	return nil
}

// validateIdent accepts a plain lower-case SQL identifier: a letter or an
// underscore, then letters, digits or underscores, at most max bytes. Upper
// case is refused because PostgreSQL folds unquoted names to lower case,
// and a name that only works quoted is a trap for whoever opens psql.
func validateIdent(arg, name string, max int) error {
	bad := func(reason string) error {
		return &dedup.ArgumentError{Arg: arg, Reason: reason + `, got "` + name + `"`}
	}
	if name == "" {
		return bad("is empty")
	}
	if len(name) > max {
		return bad("is longer than " + itoa(max) + " bytes")
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		switch {
		case c == '_', 'a' <= c && c <= 'z':
		case '0' <= c && c <= '9' && i > 0:
		default:
			return bad("must be a lower-case identifier (a-z, 0-9 and _, not starting with a digit)")
		}
	}
	if strings.HasPrefix(name, "pg_") {
		return bad("must not start with pg_ (reserved by PostgreSQL)")
	}
	return nil
}

// WithSchema puts the store's tables in the named schema, which Migrate
// creates if it does not exist. A lower-case identifier. Default "public".
func WithSchema(name string) Option {
	return optionFunc(func(c *config) { c.schema = name })
}

// WithTablePrefix sets the prefix of every table and index the store
// creates: <prefix>records, <prefix>records_p, <prefix>retention,
// <prefix>outbox and <prefix>schema_migrations. Two stores with different
// prefixes (or schemas) in one database are independent; tests use that to
// isolate themselves. A lower-case identifier of at most 42 bytes, or
// empty. Default "dedup_".
func WithTablePrefix(prefix string) Option {
	return optionFunc(func(c *config) { c.prefix = prefix })
}

// WithInProgressGrace sets how long an in-progress record is kept after
// its lease ended before the sweeper may delete it (or its partition be
// dropped). Until then the next claim takes it over with attempt + 1 and
// Claim.TakenOver set, so the new owner knows an earlier attempt may have
// applied part of the effect, and a claim with another fingerprint is
// refused. After it, the next claim starts again at attempt 1. Default 24h.
func WithInProgressGrace(d time.Duration) Option {
	return optionFunc(func(c *config) { c.grace = d })
}

// WithPartitions switches the store to the time-partitioned records table
// (<prefix>records_p), partitioned by the time of each record's latest
// acquisition in ranges of interval, a whole number of hours aligned to
// UTC. Expired data is then removed by dropping whole partitions
// ([Store.DropExpiredPartitions]) instead of deleting rows. Claims cost
// more: PostgreSQL cannot enforce a unique key across partitions, so each
// claim takes a transaction-scoped advisory lock on the key and checks the
// live partitions before it inserts; see the package documentation for
// when to choose it. Default 0: the plain records table.
func WithPartitions(interval time.Duration) Option {
	return optionFunc(func(c *config) { c.partition = interval })
}

// WithPartitionsAhead sets how far past the current time
// [Store.EnsurePartitions] (run by Migrate and by every maintenance pass)
// creates partitions, so that a maintenance job that stops for a while does
// not leave claims without a partition to go to. At least one interval.
// Default 72h.
func WithPartitionsAhead(d time.Duration) Option {
	return optionFunc(func(c *config) { c.partitionsAhead = d })
}

// WithMaintenanceLockTimeout bounds how long partition maintenance waits
// for a table lock (PostgreSQL's lock_timeout) before it gives up and tries
// again on the next pass. Dropping a partition locks the records table
// exclusively, so claims queue behind the drop while it waits: this is the
// longest a drop can stall them. Default 200ms.
func WithMaintenanceLockTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) { c.lockTimeout = d })
}

// WithLogger sets the logger for start-up warnings (a scope whose
// retention is shorter than its replay horizon, a schema newer than this
// package) and for the background maintenance job. Default slog.Default().
func WithLogger(l *slog.Logger) Option {
	return optionFunc(func(c *config) { c.logger = l })
}

// WithRetentionWarningHook calls f for every scope whose retention window
// is shorter than its declared replay horizon, when [Store.Check] runs (at
// start-up) and when [Store.SetRetention] stores such a window; use it for
// a metric or an alert. f must be fast and must not block. Default none.
func WithRetentionWarningHook(f func(ctx context.Context, w RetentionWarning)) Option {
	return optionFunc(func(c *config) { c.onRetention = f })
}

// WithVacuum makes the store run VACUUM on its records table, on a
// background goroutine, once at least min records and at least fraction
// of the table's estimated rows (pg_class.reltuples) have been completed
// through it since its last run; WithVacuum(0, 0) turns it off. Default
// 10,000 and 0.1.
//
// Why: a completion writes the completed version of a record and leaves
// the claim's version dead (PostgreSQL does not update in place). Only
// VACUUM makes that space known to later inserts, and autovacuum visits a
// database at most once a minute (autovacuum_naptime) and a table only
// when a fifth of its rows are dead (autovacuum_vacuum_scale_factor), so
// a table that takes records faster than that carries most of a minute
// of dead versions, or space freed that no insert has reused yet: 224 B a
// record after a million claims and completions in one run, against 173
// with this in the same run (and 161 for the same records written once);
// docs/benchmarks.md has the runs.
//
// The run is VACUUM (SKIP_LOCKED, TRUNCATE false): it skips at once when
// autovacuum or another store is vacuuming the table, or DDL holds it, and
// never takes the exclusive lock that truncating the table's empty end
// needs (autovacuum still does that). Each run scans
// the table's pages changed since the last one and the whole primary key,
// so the fraction bounds that cost, as autovacuum's scale factor does:
// with 0.1, each completion pays for reading about ten index entries.
// Every store on the table counts its own completions, so N stores vacuum
// up to N times as often. A role that may not vacuum the table (not its
// owner nor the database's, nor granted MAINTAIN on PostgreSQL 17) is
// found out before the first VACUUM: the store logs one warning and runs
// none for the rest of its life. A run holds one of the pool's
// connections while it lasts: it starts only when the pool has another
// for the callers (idle or yet to be opened), and a store on a pool of one
// connection never runs it. The run looks once a second, with another, for
// a session its VACUUM blocks (DDL on the table, which claims would queue
// behind): it then cancels its VACUUM, as the server does autovacuum's.
// Close cancels a run on the server and waits for it. The partitioned layout ([WithPartitions])
// never runs it: its old partitions are dropped whole.
func WithVacuum(min int, fraction float64) Option {
	return optionFunc(func(c *config) { c.vacuumMin, c.vacuumFraction = min, fraction })
}
