package verify

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/redisstore"
	"github.com/dedupkit/dedup/sqlitestore"
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
	// Keep keeps a temporary database file after Close.
	Keep bool
	// Lease is the claim lease of lease mode.
	Lease time.Duration
	// Messages is the number of messages of the run, for sizing.
	Messages int
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
			Name:     "redis",
			Summary:  "the Redis store (redisstore) on $DEDUP_REDIS_ADDR or 127.0.0.1:6379, or --addr; a cluster if several addresses",
			Modes:    []Mode{LeaseMode},
			UsesAddr: true,
			Open:     openRedis,
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
	t, err := NewLease("memory", s, o.Lease)
	if err != nil {
		s.Close()
		return nil, err
	}
	return t, nil
}

func openRedis(_ context.Context, o OpenOptions) (Target, error) {
	addr := o.Addr
	if addr == "" {
		addr = os.Getenv("DEDUP_REDIS_ADDR")
	}
	if addr == "" {
		addr = "127.0.0.1:6379"
	}
	s, err := redisstore.Open(rueidis.ClientOption{InitAddress: strings.Split(addr, ",")})
	if err != nil {
		return nil, fmt.Errorf("%w (is Redis running at %s? set --addr or DEDUP_REDIS_ADDR)", err, addr)
	}
	t, err := NewLease("redis", s, o.Lease)
	if err != nil {
		s.Close()
		return nil, err
	}
	return t, nil
}

func openSQLite(ctx context.Context, o OpenOptions) (Target, error) {
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
	switch o.Mode {
	case InboxMode:
		t, err = NewInbox(ctx, "sqlite", s)
	case LeaseMode:
		t, err = NewLease("sqlite", s, o.Lease)
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

// ParseMode returns the mode named s ("lease" or "inbox").
func ParseMode(s string) (Mode, bool) {
	switch m := Mode(strings.ToLower(s)); m {
	case LeaseMode, InboxMode:
		return m, true
	}
	return "", false
}
