// Package redisfilter is a [layered.Filter] on Redis: the layered store's
// read-only record of completed keys, shared by every instance. A lookup
// is one GET and a batch of entries one pipeline of SET PX, both sent
// through rueidis, which pipelines concurrent lookups on one connection
// (auto-pipelining), so a lookup costs the server one plain read.
//
// It holds no claims and no leases: a key is only written after the
// durable store recorded it completed, and a lost key (FLUSHALL, a
// failover, eviction) costs a durable round trip, never a wrong answer.
// Use it with layered.WithFilter; the package imports rueidis so that the
// layered package need not.
package redisfilter

import (
	"context"
	"strconv"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/layered"
	"github.com/redis/rueidis"
)

const storeName = "redisfilter"

// Filter is a [layered.Filter] on a rueidis client. It is safe for
// concurrent use.
type Filter struct {
	client rueidis.Client
	prefix string
	own    bool
}

type config struct{ prefix string }

// Option configures a Filter.
type Option interface{ apply(*config) }

type option func(*config)

func (f option) apply(c *config) { f(c) }

// WithPrefix sets the prefix of every Redis key the filter writes, which
// must differ from a redisstore's on the same server. Default "dedupf:".
func WithPrefix(p string) Option { return option(func(c *config) { c.prefix = p }) }

// New returns a filter on a client the caller owns: Close leaves it open.
func New(c rueidis.Client, opts ...Option) (*Filter, error) {
	if c == nil {
		return nil, &dedup.ArgumentError{Arg: "redis client", Reason: "is nil"}
	}
	cfg := config{prefix: "dedupf:"}
	for _, o := range opts {
		o.apply(&cfg)
	}
	if cfg.prefix == "" {
		return nil, &dedup.ArgumentError{Arg: "redisfilter prefix", Reason: "is empty"}
	}
	return &Filter{client: c, prefix: cfg.prefix}, nil
}

// Open connects to Redis with the given rueidis options (several
// InitAddress entries of a cluster make a cluster client) and returns a
// filter that owns the client: Close closes it. Client-side caching is
// turned off: the layered store's window already keeps this process's
// recent keys.
func Open(opt rueidis.ClientOption, opts ...Option) (*Filter, error) {
	opt.DisableCache = true
	c, err := rueidis.NewClient(opt)
	if err != nil {
		return nil, &dedup.StoreError{Store: storeName, Op: "open", Err: err, NotApplied: true}
	}
	f, err := New(c, opts...)
	if err != nil {
		c.Close()
		return nil, err
	}
	f.own = true
	return f, nil
}

// RedisKey returns the Redis key of k: prefix, the scope's length, the
// scope and the ID ("dedupf:8:payments:evt-1"), so no two keys collide.
func (f *Filter) RedisKey(k dedup.Key) string {
	return f.prefix + strconv.Itoa(len(k.Scope)) + ":" + k.Scope + ":" + k.ID
}

// Lookup implements [layered.Filter] with one GET.
func (f *Filter) Lookup(ctx context.Context, key dedup.Key) ([]byte, bool, error) {
	b, err := f.client.Do(ctx, f.client.B().Get().Key(f.RedisKey(key)).Build()).AsBytes()
	switch {
	case rueidis.IsRedisNil(err):
		return nil, false, nil
	case err != nil:
		return nil, false, &dedup.StoreError{Store: storeName, Op: "lookup", Err: err, NotApplied: true}
	}
	return b, true, nil
}

// Remember implements [layered.Filter]: one SET PX per entry, all in one
// pipeline (one round trip per node of a cluster). A TTL under a
// millisecond is rounded up to one.
func (f *Filter) Remember(ctx context.Context, entries []layered.FilterEntry) error {
	if len(entries) == 0 {
		return nil
	}
	cmds := make(rueidis.Commands, 0, len(entries))
	for _, e := range entries {
		ms := max(e.TTL.Milliseconds(), 1)
		cmds = append(cmds, f.client.B().Set().Key(f.RedisKey(e.Key)).Value(rueidis.BinaryString(e.Value)).PxMilliseconds(ms).Build())
	}
	for _, r := range f.client.DoMulti(ctx, cmds...) {
		if err := r.Error(); err != nil {
			return &dedup.StoreError{Store: storeName, Op: "remember", Err: err}
		}
	}
	return nil
}

// Ping checks that Redis answers.
func (f *Filter) Ping(ctx context.Context) error {
	if err := f.client.Do(ctx, f.client.B().Ping().Build()).Error(); err != nil {
		return &dedup.StoreError{Store: storeName, Op: "ping", Err: err, NotApplied: true}
	}
	return nil
}

// Close closes the client if Open made it.
func (f *Filter) Close() error {
	if f.own {
		f.client.Close()
	}
	return nil
}

var _ layered.Filter = (*Filter)(nil)
