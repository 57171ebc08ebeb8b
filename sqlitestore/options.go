package sqlitestore

import (
	"strings"
	"time"

	"github.com/dedupkit/dedup"
)

// Synchronous modes accepted by [WithSynchronous].
const (
	// SyncFull makes every commit wait until the write-ahead log is on
	// stable storage: a claim, completion or inbox transaction that
	// returned without error survives a power loss.
	SyncFull = "FULL"
	// SyncNormal syncs only at checkpoints: faster, and a commit still
	// survives a crash of the process, but the last commits before a power
	// loss or an operating system crash may be rolled back. A lost
	// completion is recovered by the lease expiring; a lost inbox
	// transaction loses the business write with it, so the redelivery
	// applies the message again, once.
	SyncNormal = "NORMAL"
)

// An Option configures a [Store] in [Open].
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	clock       dedup.Clock
	table       string
	synchronous string
	busyTimeout time.Duration
	sweepEvery  time.Duration
	sweepHooks  []dedup.Hook
}

func defaultConfig() config {
	return config{
		clock:       dedup.SystemClock{},
		table:       "dedup_records",
		synchronous: SyncFull,
		busyTimeout: 10 * time.Second,
	}
}

func (c *config) validate() error {
	if c.clock == nil {
		return &dedup.ArgumentError{Arg: "clock", Reason: "is nil"}
	}
	if err := validateTable(c.table); err != nil {
		return err
	}
	switch strings.ToUpper(c.synchronous) {
	case SyncFull, SyncNormal:
		c.synchronous = strings.ToUpper(c.synchronous)
	default:
		return &dedup.ArgumentError{Arg: "synchronous mode", Reason: "must be FULL or NORMAL, got " + quote(c.synchronous)}
	}
	if c.sweepEvery < 0 {
		return &dedup.ArgumentError{Arg: "sweep interval", Reason: "must not be negative, got " + c.sweepEvery.String()}
	}
	if c.busyTimeout <= 0 {
		return &dedup.ArgumentError{Arg: "busy timeout", Reason: "must be positive, got " + c.busyTimeout.String()}
	}
	return nil
}

// maxTableName bounds the table name; the index name adds a suffix to it.
const maxTableName = 64

// validateTable accepts a plain SQL identifier: an ASCII letter or an
// underscore, then letters, digits or underscores. Names starting with
// "sqlite_" are reserved by SQLite.
func validateTable(name string) error {
	bad := func(reason string) error {
		return &dedup.ArgumentError{Arg: "table name", Reason: reason + ", got " + quote(name)}
	}
	if name == "" {
		return bad("is empty")
	}
	if len(name) > maxTableName {
		return bad("is longer than 64 bytes")
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		switch {
		case c == '_', 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z':
		case '0' <= c && c <= '9' && i > 0:
		default:
			return bad("must be a plain identifier (letters, digits and underscores, not starting with a digit)")
		}
	}
	if strings.HasPrefix(strings.ToLower(name), "sqlite_") {
		return bad("must not start with sqlite_ (reserved by SQLite)")
	}
	return nil
}

func quote(s string) string { return "\"" + s + "\"" }

// WithClock sets the clock that leases and retention are measured with.
// Time is always taken from this clock and passed to SQL as a parameter,
// never from SQLite's own clock, so that tests can move time by hand.
// Default [dedup.SystemClock].
func WithClock(c dedup.Clock) Option {
	return optionFunc(func(cfg *config) { cfg.clock = c })
}

// WithTable sets the name of the table that holds the records. It must be a
// plain identifier (letters, digits and underscores, not starting with a
// digit or with "sqlite_"), at most 64 bytes. Several stores with different
// tables may share one file. Default "dedup_records".
func WithTable(name string) Option {
	return optionFunc(func(cfg *config) { cfg.table = name })
}

// WithSynchronous sets SQLite's synchronous mode on every connection:
// [SyncFull] ("FULL"), where a commit survives a power loss, or
// [SyncNormal] ("NORMAL"), which is faster and survives a crash of the
// process but may lose the last commits on a power loss. The database is
// always in WAL mode. Case does not matter. Default "FULL".
func WithSynchronous(mode string) Option {
	return optionFunc(func(cfg *config) { cfg.synchronous = mode })
}

// WithBusyTimeout sets how long a write waits for the write lock, held by
// another write of this store, another process or a transaction on
// [Store.DB], before it fails with a [*dedup.StoreError]. SQLite has one
// writer at a time; the others wait up to this long.
// It must be positive and is rounded up to whole milliseconds.
// Default 10s.
func WithBusyTimeout(d time.Duration) Option {
	return optionFunc(func(cfg *config) { cfg.busyTimeout = d })
}

// WithSweepInterval makes the store delete expired records in the
// background every d, in batches of [SweepBatch] (see [Store.SweepExpired]),
// until Close. Default 0: no background sweeping (call [Store.Sweep] or
// run `dedup sweep --store sqlite`).
func WithSweepInterval(d time.Duration) Option {
	return optionFunc(func(c *config) { c.sweepEvery = d })
}
