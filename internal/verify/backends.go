package verify

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/redisstore"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/dedupkit/dedup/window"
	"github.com/redis/rueidis"
)

// A Backend is a kind of store that `dedup verify --store` can open. To add
// a store, write its Open (usually the store's constructor wrapped in
// [NewLease], or [NewInbox] for a SQL store with an inbox) and add it to
// the list in [Backends].
type Backend struct {
	// Name is the value of --store.
	Name string
	// Summary is one line for the help text.
	Summary string
	// Modes lists the modes the store supports; the first is the default.
	Modes []Mode
	// UsesPath is set when the store lives in a file that --path names.
	UsesPath bool
	// UsesAddr is set when the store is on a server that --addr names.
	UsesAddr bool
	// Open opens the store for one run.
	Open func(ctx context.Context, o OpenOptions) (Target, error)
}

// OpenOptions are what a Backend needs to open its store.
type OpenOptions struct {
	// Mode is one of the backend's Modes.
	Mode Mode
	// Path is the database file; empty means a new temporary file.
	Path string
	// Addr is the server address (comma-separated for a cluster); empty
	// means the engine's environment variable or its loopback default.
	Addr string
	// FlushEvery, for the layered store, flushes its fast store and empties
	// its window every FlushEvery deliveries; 0 never.
	FlushEvery int
	// Durable is the durable layer of the layered store: "sqlite" (the
	// default: the SQLite inbox in Path) or "postgres" (pgstore's inbox
	// on $DEDUP_POSTGRES_URL or the loopback default, in Schema).
	Durable string
	// Keep keeps a temporary database file after Close.
	Keep bool
	// Lease is the claim lease of lease mode.
	Lease time.Duration
	// Messages is the number of messages of the run, for sizing.
	Messages int

	// The fields below let several processes share one store; RunProcesses
	// sets them. Schema is the PostgreSQL schema of the run (empty: a new
	// random one), RedisPrefix the layered store's Redis key prefix (empty:
	// a new random one), and LedgerFile, in lease mode, a file that every
	// effect is appended to instead of an in-memory ledger. Attach opens
	// what another process created: no schema or table is created, and
	// Close drops or deletes nothing.
	Schema      string
	RedisPrefix string
	LedgerFile  string
	Attach      bool
}

// Backends returns the stores verify can open, the default first.
func Backends() []Backend {
	return []Backend{
		{
			Name:     "sqlite",
			Summary:  "the embedded SQLite store (sqlitestore), in a temporary file unless --path is given",
			Modes:    []Mode{InboxMode, LeaseMode},
			UsesPath: true,
			Open:     openSQLite,
		},
		{
			Name:    "memory",
			Summary: "the in-memory reference store (memstore)",
			Modes:   []Mode{LeaseMode},
			Open:    openMemory,
		},
		{
			Name: "layered",
			Summary: "window -> Redis ($DEDUP_REDIS_ADDR, 127.0.0.1:6379, or --addr) -> the SQLite inbox; " +
				"--flush-every N deletes this run's Redis keys and empties the window every N deliveries",
			Modes:    []Mode{InboxMode},
			UsesPath: true,
			UsesAddr: true,
			Open:     openLayered,
		},
		{
			Name:     "redis",
			Summary:  "the Redis store (redisstore) on $DEDUP_REDIS_ADDR or 127.0.0.1:6379, or --addr; a cluster if several addresses",
			Modes:    []Mode{LeaseMode},
			UsesAddr: true,
			Open:     openRedis,
		},
		{
			Name: "postgres",
			Summary: "the PostgreSQL store (pgstore) on $DEDUP_POSTGRES_URL or " + DefaultPostgresURL + ", or --addr (a connection string); " +
				"inbox and apply modes write the ledger in the same database and transaction; each run works in a schema of its own, dropped at exit unless --keep",
			Modes:    []Mode{InboxMode, ApplyMode, LeaseMode},
			UsesAddr: true,
			Open:     openPostgres,
		},
	}
}

// LookupBackend returns the backend named name.
func LookupBackend(name string) (Backend, bool) {
	for _, b := range Backends() {
		if b.Name == name {
			return b, true
		}
	}
	return Backend{}, false
}

// BackendNames lists the names of the backends, the default first.
func BackendNames() []string {
	var names []string
	for _, b := range Backends() {
		names = append(names, b.Name)
	}
	return names
}

func openMemory(_ context.Context, o OpenOptions) (Target, error) {
	// Room for every message, so that nothing is evicted during the run.
	s, err := memstore.New(memstore.WithCapacity(max(o.Messages+o.Messages/2, 1<<16)))
	if err != nil {
		return nil, err
	}
	if o.LedgerFile != "" || o.Attach {
		s.Close()
		return nil, errors.New("the memory store lives in one process: it cannot be shared by several (use sqlite, redis, postgres or layered)")
	}
	t, err := NewLease("memory", s, o.Lease)
	if err != nil {
		s.Close()
		return nil, err
	}
	return t, nil
}

func openRedisStore(addr string, opts ...redisstore.Option) (*redisstore.Store, error) {
	if addr == "" {
		addr = os.Getenv("DEDUP_REDIS_ADDR")
	}
	if addr == "" {
		addr = "127.0.0.1:6379"
	}
	s, err := redisstore.Open(rueidis.ClientOption{InitAddress: strings.Split(addr, ",")}, opts...)
	if err != nil {
		return nil, fmt.Errorf("%w (is Redis running at %s? set --addr or DEDUP_REDIS_ADDR)", err, addr)
	}
	return s, nil
}

func openRedis(_ context.Context, o OpenOptions) (Target, error) {
	s, err := openRedisStore(o.Addr)
	if err != nil {
		return nil, err
	}
	t, err := newLeaseTarget("redis", s, o)
	if err != nil {
		s.Close()
		return nil, err
	}
	return t, nil
}

// openLayered opens window -> Redis -> SQLite inbox. Each run uses its own
// Redis key prefix, so that flushing is the only way keys go missing.
func openLayered(ctx context.Context, o OpenOptions) (Target, error) {
	// A prefix of its own, so that the injected key loss deletes this run's
	// keys only, never anything else on a shared Redis.
	prefix := o.RedisPrefix
	if prefix == "" {
		prefix = fmt.Sprintf("dedup-verify-%016x:", rand.Uint64())
	}
	fast, err := openRedisStore(o.Addr, redisstore.WithPrefix(prefix))
	if err != nil {
		return nil, err
	}
	win, err := window.New(window.WithCapacity(max(o.Messages, 1<<16)))
	if err != nil {
		fast.Close()
		return nil, err
	}
	keys := newRunKeys(fast, prefix)
	closeFast := func() error {
		if o.Attach {
			return fast.Close() // the keys are the parent's to delete
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		return errors.Join(keys.drop(ctx), fast.Close())
	}
	o.Mode = InboxMode
	switch o.Durable {
	case "", "sqlite":
	case "postgres":
		return openLayeredPostgres(ctx, o, win, fast, keys.flush, closeFast, keys.track)
	default:
		fast.Close()
		return nil, fmt.Errorf("the layered store's durable layer is sqlite or postgres, not %q", o.Durable)
	}
	return openSQLiteWith(ctx, o, func(ctx context.Context, s *sqlitestore.Store) (Target, error) {
		return NewLayeredInbox(ctx, "layered", s, win, fast, "redis", o.Lease, keys.flush, o.FlushEvery, closeFast, keys.track)
	})
}

// runKeys is the set of Redis keys one run's layered store may have
// written, kept in Redis (a set under the run's prefix, so that every
// process of a --processes run adds to it and a killed worker's keys are
// in it too): a flush deletes those keys and nothing else, in time bounded
// by the run's own keys. (It used to SCAN the whole keyspace for the
// prefix, which took about 50 s on a shared Redis that held millions of
// other keys.) A key is added before the fast store can write it; the set
// is never trimmed during the run, so a key written after a flush read
// the set is still deleted by the next flush and at the end.
type runKeys struct {
	fast  *redisstore.Store
	index string
}

func newRunKeys(fast *redisstore.Store, prefix string) *runKeys {
	// Store keys start with the prefix and a digit (RedisKey): no store
	// key can be this one.
	return &runKeys{fast: fast, index: prefix + "keys"}
}

func (r *runKeys) track(ctx context.Context, k dedup.Key) error {
	c := r.fast.Client()
	return c.Do(ctx, c.B().Sadd().Key(r.index).Member(r.fast.RedisKey(k)).Build()).Error()
}

// flush deletes every key in the set, 500 per pipelined round trip (on a
// cluster the client sends each UNLINK to its key's node).
func (r *runKeys) flush(ctx context.Context) error {
	c := r.fast.Client()
	var cursor uint64
	for {
		e, err := c.Do(ctx, c.B().Sscan().Key(r.index).Cursor(cursor).Count(500).Build()).AsScanEntry()
		if err != nil {
			return err
		}
		if len(e.Elements) > 0 {
			cmds := make(rueidis.Commands, 0, len(e.Elements))
			for _, k := range e.Elements {
				cmds = append(cmds, c.B().Unlink().Key(k).Build())
			}
			for _, res := range c.DoMulti(ctx, cmds...) {
				if err := res.Error(); err != nil {
					return err
				}
			}
		}
		if cursor = e.Cursor; cursor == 0 {
			return nil
		}
	}
}

// drop deletes the run's keys and the set.
func (r *runKeys) drop(ctx context.Context) error {
	if err := r.flush(ctx); err != nil {
		return err
	}
	c := r.fast.Client()
	return c.Do(ctx, c.B().Unlink().Key(r.index).Build()).Error()
}

func openSQLite(ctx context.Context, o OpenOptions) (Target, error) {
	return openSQLiteWith(ctx, o, nil)
}

// openSQLiteWith opens the SQLite store (in a temporary file unless o.Path
// is set) and makes the target with wrap, or in o.Mode when wrap is nil.
func openSQLiteWith(ctx context.Context, o OpenOptions, wrap func(context.Context, *sqlitestore.Store) (Target, error)) (Target, error) {
	path, dir := o.Path, ""
	if path == "" {
		var err error
		if dir, err = os.MkdirTemp("", "dedup-verify-"); err != nil {
			return nil, fmt.Errorf("create a temporary directory: %w", err)
		}
		path = filepath.Join(dir, "verify.db")
	}
	cleanup := func() error {
		if dir == "" || o.Keep {
			return nil
		}
		return os.RemoveAll(dir)
	}
	// NORMAL synchronous mode: a commit survives the crash of a process,
	// which is the crash verify injects; FULL adds an fsync per commit
	// that only matters on a power loss.
	s, err := sqlitestore.Open(path, sqlitestore.WithSynchronous(sqlitestore.SyncNormal))
	if err != nil {
		return nil, errors.Join(err, cleanup())
	}
	var t Target
	switch {
	case wrap != nil:
		t, err = wrap(ctx, s)
	case o.Mode == InboxMode:
		t, err = NewInbox(ctx, "sqlite", s)
	case o.Mode == LeaseMode:
		t, err = newLeaseTarget("sqlite", s, o)
	default:
		err = fmt.Errorf("the sqlite store has no mode %q", o.Mode)
	}
	if err != nil {
		return nil, errors.Join(err, s.Close(), cleanup())
	}
	return &fileTarget{Target: t, path: path, cleanup: cleanup}, nil
}

// fileTarget is a target whose database lives in a file.
type fileTarget struct {
	Target
	path    string
	cleanup func() error
}

// Path returns the database file.
func (f *fileTarget) Path() string { return f.path }

// LayerStats passes on the layer counts of a layered target.
func (f *fileTarget) LayerStats() (map[string]int64, int) {
	if ls, ok := f.Target.(LayerReporter); ok {
		return ls.LayerStats()
	}
	return nil, 0
}

// Close closes the store and removes the file if it was temporary and not
// kept.
func (f *fileTarget) Close() error {
	return errors.Join(f.Target.Close(), f.cleanup())
}

// PathOf returns the database file of t, if it has one.
func PathOf(t Target) string {
	if p, ok := t.(interface{ Path() string }); ok {
		return p.Path()
	}
	return ""
}

// ParseMode returns the mode named s ("lease", "inbox" or "apply").
func ParseMode(s string) (Mode, bool) {
	switch m := Mode(strings.ToLower(s)); m {
	case LeaseMode, InboxMode, ApplyMode:
		return m, true
	}
	return "", false
}
