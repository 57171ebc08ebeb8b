// Package memstore is the in-memory reference implementation of the
// [dedup.Store] contract: sharded for parallel use, bounded, and driven by
// an injectable clock so lease and retention can be tested without
// sleeping.
//
// What it guarantees: every row of the claim state table, atomically per
// key (one mutex-protected section per transition), within one process.
//
// What it does not: records live in this process only and are gone on
// restart, so a redelivery after a restart passes as new. Use it for tests,
// as the window in front of a durable store, or where losing the record
// on restart is acceptable. A full store evicts expired records first; if
// none are expired it evicts the completed record that expires soonest
// (counted in [Stats].Evicted, and a duplicate of that key will pass), or
// with [WithStrictCapacity] it refuses the claim with [dedup.ErrFull]
// instead. In-progress records are never evicted: that would break fencing.
package memstore

import (
	"context"
	"hash/maphash"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup"
)

const storeName = "memory"

// Store is an in-memory dedup store. It is safe for concurrent use.
type Store struct {
	shards   []shard
	mask     uint64
	seed     maphash.Seed
	clock    dedup.Clock
	base     time.Time // times are kept as nanoseconds since base
	perShard int
	strict   bool
	system   bool // clock is the system clock: read the monotonic clock directly
	closed   atomic.Bool
	evicted  atomic.Int64
	maxBytes int64        // 0: no byte bound
	bytes    atomic.Int64 // the records' sizes, by recordSize
}

type shard struct {
	mu sync.Mutex
	m  map[dedup.Key]*record
	_  [48]byte // keep shards on separate cache lines
}

type record struct {
	token     dedup.Token
	fp        dedup.Fingerprint
	result    []byte
	until     int64 // lease end while in progress, expiry once completed
	attempt   int32
	completed bool
}

type config struct {
	clock    dedup.Clock
	capacity int
	shards   int
	strict   bool
	maxBytes int64
}

// Option configures a Store.
type Option interface{ apply(*config) }

type option func(*config)

func (f option) apply(c *config) { f(c) }

// WithClock sets the clock for leases and retention. Default
// dedup.SystemClock{}.
func WithClock(c dedup.Clock) Option { return option(func(cfg *config) { cfg.clock = c }) }

// WithCapacity bounds the number of records. Default 1,000,000.
func WithCapacity(n int) Option { return option(func(cfg *config) { cfg.capacity = n }) }

// WithShards sets the number of shards, rounded up to a power of two.
// Default 64.
func WithShards(n int) Option { return option(func(cfg *config) { cfg.shards = n }) }

// WithStrictCapacity makes a full store refuse new keys with a
// [*dedup.StoreError] wrapping [dedup.ErrFull] instead of evicting a live
// completed record. Default off (evict the soonest-expiring one).
func WithStrictCapacity() Option { return option(func(cfg *config) { cfg.strict = true }) }

// WithMaxBytes bounds the memory the records take, counted as their keys,
// fingerprints and results plus [RecordOverhead] each. A claim of a new key
// that would pass the bound first frees expired records, then evicts as a
// full store does (or, with [WithStrictCapacity], is refused with
// [dedup.ErrFull]). A Complete is never refused: results of claims already
// admitted may pass the bound by their own size. Default 0: bounded by
// [WithCapacity] only.
func WithMaxBytes(n int64) Option { return option(func(cfg *config) { cfg.maxBytes = n }) }

// RecordOverhead is what [WithMaxBytes] counts for a record beyond its
// key, fingerprint and result: the map entry, the record and its pointers.
const RecordOverhead = 160

func recordSize(k dedup.Key, fp dedup.Fingerprint, result []byte) int64 {
	return int64(RecordOverhead + len(k.Scope) + len(k.ID) + len(fp) + len(result))
}

func defaultConfig() config {
	return config{clock: dedup.SystemClock{}, capacity: 1_000_000, shards: 64}
}

func (c *config) validate() error {
	switch {
	case c.clock == nil:
		return &dedup.ArgumentError{Arg: "memstore clock", Reason: "is nil"}
	case c.shards < 1 || c.shards > 1<<16:
		return &dedup.ArgumentError{Arg: "memstore shards", Reason: "must be between 1 and 65536"}
	case c.capacity < c.shards:
		return &dedup.ArgumentError{Arg: "memstore capacity", Reason: "must be at least the number of shards"}
	case c.maxBytes < 0:
		return &dedup.ArgumentError{Arg: "memstore max bytes", Reason: "must not be negative"}
	}
	return nil
}

// New returns an empty Store.
func New(opts ...Option) (*Store, error) {
	cfg := defaultConfig()
	for _, o := range opts {
		o.apply(&cfg)
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	n := 1
	for n < cfg.shards {
		n <<= 1
	}
	s := &Store{
		shards:   make([]shard, n),
		mask:     uint64(n - 1),
		seed:     maphash.MakeSeed(),
		clock:    cfg.clock,
		perShard: (cfg.capacity + n - 1) / n,
		strict:   cfg.strict,
		maxBytes: cfg.maxBytes,
	}
	_, s.system = cfg.clock.(dedup.SystemClock)
	s.base = s.clock.Now()
	for i := range s.shards {
		s.shards[i].m = make(map[dedup.Key]*record)
	}
	return s, nil
}

func (s *Store) now() int64 {
	if s.system {
		return int64(time.Since(s.base)) // half the cost of time.Now().Sub
	}
	return int64(s.clock.Now().Sub(s.base))
}

func (s *Store) time(n int64) time.Time { return s.base.Add(time.Duration(n)) }

func (s *Store) shard(k dedup.Key) *shard {
	// The ID alone spreads keys well: scopes are few, IDs are many.
	return &s.shards[maphash.String(s.seed, k.ID)&s.mask]
}

// begin checks what every call checks before touching state.
func (s *Store) begin(ctx context.Context, op string) error {
	if s.closed.Load() {
		return dedup.ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return &dedup.StoreError{Store: storeName, Op: op, Err: err, NotApplied: true}
	}
	return nil
}

// Claim implements [dedup.Store].
func (s *Store) Claim(ctx context.Context, key dedup.Key, fp dedup.Fingerprint, lease time.Duration) (dedup.Claim, error) {
	if err := dedup.ValidateClaim(key, fp, lease); err != nil {
		return dedup.Claim{}, err
	}
	if err := s.begin(ctx, "claim"); err != nil {
		return dedup.Claim{}, err
	}
	sh := s.shard(key)
	sh.mu.Lock()
	c, err := s.claimLocked(sh, key, fp, lease, s.now())
	sh.mu.Unlock()
	return c, err
}

func (s *Store) claimLocked(sh *shard, key dedup.Key, fp dedup.Fingerprint, lease time.Duration, now int64) (dedup.Claim, error) {
	r, found := sh.m[key]
	attempt := int32(1)
	if found {
		live := r.until > now
		switch {
		case (live || !r.completed) && !fp.Matches(r.fp):
			return dedup.Claim{Key: key, Outcome: dedup.Mismatch}, nil
		case r.completed && live:
			return dedup.Claim{Key: key, Outcome: dedup.Duplicate, Attempt: int(r.attempt),
				Result: clone(r.result), ExpiresAt: s.time(r.until)}, nil
		case live:
			return dedup.Claim{Key: key, Outcome: dedup.InProgress, Attempt: int(r.attempt), LeaseUntil: s.time(r.until)}, nil
		case !r.completed: // lease expired: take over, keep the original fingerprint
			attempt = r.attempt + 1
			if r.fp != "" {
				fp = r.fp
			}
		}
	} else {
		if len(sh.m) >= s.perShard {
			if err := s.makeRoom(sh, now); err != nil {
				return dedup.Claim{}, err
			}
		}
		if s.maxBytes > 0 {
			if err := s.fitBytes(sh, recordSize(key, fp, nil), now); err != nil {
				return dedup.Claim{}, err
			}
		}
	}
	if !found {
		r = new(record)
		sh.m[key] = r
		s.bytes.Add(recordSize(key, fp, nil))
	} else {
		s.bytes.Add(int64(len(fp)-len(r.fp)) - int64(len(r.result)))
	}
	*r = record{token: dedup.NewToken(), fp: fp, until: dedup.DeadlineNanos(now, lease), attempt: attempt}
	return dedup.Claim{Key: key, Outcome: dedup.Acquired, Token: r.token, Attempt: int(attempt),
		TakenOver: attempt > 1, LeaseUntil: s.time(r.until)}, nil
}

// makeRoom frees one slot in a full shard: it samples up to 32 records
// (map iteration starts at a random place), deletes the expired completed
// ones, and if there were none evicts the sampled completed record that
// expires soonest.
func (s *Store) makeRoom(sh *shard, now int64) error {
	const sample = 32
	var victim dedup.Key
	victimUntil, freed, seen := int64(-1), 0, 0
	for k, r := range sh.m {
		if r.completed {
			if r.until <= now {
				s.drop(sh, k, r)
				freed++
			} else if victimUntil < 0 || r.until < victimUntil {
				victim, victimUntil = k, r.until
			}
		}
		if seen++; seen == sample {
			break
		}
	}
	switch {
	case freed > 0:
		return nil
	case victimUntil >= 0 && !s.strict:
		s.drop(sh, victim, sh.m[victim])
		s.evicted.Add(1)
		return nil
	}
	return &dedup.StoreError{Store: storeName, Op: "claim", Err: dedup.ErrFull, NotApplied: true}
}

// fitBytes makes room in sh for a new record of size bytes under the byte
// bound, as makeRoom does for the record count, a few rounds at most.
func (s *Store) fitBytes(sh *shard, size int64, now int64) error {
	for range 4 {
		if s.bytes.Load()+size <= s.maxBytes {
			return nil
		}
		if err := s.makeRoom(sh, now); err != nil {
			return err
		}
	}
	if s.bytes.Load()+size <= s.maxBytes {
		return nil
	}
	return &dedup.StoreError{Store: storeName, Op: "claim", Err: dedup.ErrFull, NotApplied: true}
}

// drop deletes the record r of key k from sh and uncounts its bytes.
func (s *Store) drop(sh *shard, k dedup.Key, r *record) {
	delete(sh.m, k)
	s.bytes.Add(-recordSize(k, r.fp, r.result))
}

// Complete implements [dedup.Store].
func (s *Store) Complete(ctx context.Context, c dedup.Claim, result []byte, retention time.Duration) error {
	if err := dedup.ValidateComplete(c, retention); err != nil {
		return err
	}
	if err := s.begin(ctx, "complete"); err != nil {
		return err
	}
	sh := s.shard(c.Key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	return s.completeLocked(sh, c, result, retention)
}

func (s *Store) completeLocked(sh *shard, c dedup.Claim, result []byte, retention time.Duration) error {
	r, ok := sh.m[c.Key]
	switch {
	case !ok || r.token != c.Token:
		return dedup.ErrLeaseLost
	case r.completed: // the same owner completing again: no change
		return nil
	}
	r.completed, r.result, r.until = true, clone(result), dedup.DeadlineNanos(s.now(), retention)
	s.bytes.Add(int64(len(r.result)))
	return nil
}

// CompleteBatch implements [dedup.BatchCompleter]: each item is completed
// atomically under its shard's lock, as Complete does.
func (s *Store) CompleteBatch(ctx context.Context, items []dedup.Completion, retention time.Duration) ([]error, error) {
	if err := dedup.ValidateCompleteBatch(items, retention); err != nil {
		return nil, err
	}
	if err := s.begin(ctx, "complete batch"); err != nil {
		return nil, err
	}
	errs := make([]error, len(items))
	for i, it := range items {
		sh := s.shard(it.Claim.Key)
		sh.mu.Lock()
		errs[i] = s.completeLocked(sh, it.Claim, it.Result, retention)
		sh.mu.Unlock()
	}
	return errs, nil
}

// Release implements [dedup.Store]. The next claim starts again at attempt 1.
func (s *Store) Release(ctx context.Context, c dedup.Claim) error {
	if err := dedup.ValidateRelease(c); err != nil {
		return err
	}
	if err := s.begin(ctx, "release"); err != nil {
		return err
	}
	sh := s.shard(c.Key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	r, ok := sh.m[c.Key]
	if !ok || r.token != c.Token || r.completed {
		return dedup.ErrLeaseLost
	}
	s.drop(sh, c.Key, r)
	return nil
}

// Extend implements [dedup.Extender].
func (s *Store) Extend(ctx context.Context, c dedup.Claim, lease time.Duration) (dedup.Claim, error) {
	if err := dedup.ValidateClaim(c.Key, "", lease); err != nil {
		return c, err
	}
	if err := dedup.ValidateRelease(c); err != nil {
		return c, err
	}
	if err := s.begin(ctx, "extend"); err != nil {
		return c, err
	}
	sh := s.shard(c.Key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	r, ok := sh.m[c.Key]
	if !ok || r.token != c.Token || r.completed {
		return c, dedup.ErrLeaseLost
	}
	r.until = dedup.DeadlineNanos(s.now(), lease)
	c.LeaseUntil = s.time(r.until)
	return c, nil
}

// ClaimBatch implements [dedup.BatchClaimer]. Each key is claimed
// atomically; the batch as a whole is not one atomic step (neither is it
// in any networked store), which the contract allows.
func (s *Store) ClaimBatch(ctx context.Context, reqs []dedup.ClaimRequest, lease time.Duration) ([]dedup.Claim, error) {
	if err := dedup.ValidateBatch(reqs, lease); err != nil {
		return nil, err
	}
	if err := s.begin(ctx, "claim batch"); err != nil {
		return nil, err
	}
	out := make([]dedup.Claim, len(reqs))
	now := s.now()
	for i, r := range reqs {
		sh := s.shard(r.Key)
		sh.mu.Lock()
		c, err := s.claimLocked(sh, r.Key, r.Fingerprint, lease, now)
		sh.mu.Unlock()
		if err != nil {
			return nil, err
		}
		out[i] = c
	}
	return out, nil
}

// Sweep implements [dedup.Sweeper]: it deletes up to limit expired
// completed records. Expired records are already invisible to Claim.
func (s *Store) Sweep(ctx context.Context, limit int) (int, error) {
	if limit <= 0 {
		return 0, &dedup.ArgumentError{Arg: "sweep limit", Reason: "must be positive"}
	}
	if err := s.begin(ctx, "sweep"); err != nil {
		return 0, err
	}
	n, now := 0, s.now()
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		for k, r := range sh.m {
			if n == limit {
				break
			}
			if r.completed && r.until <= now {
				s.drop(sh, k, r)
				n++
			}
		}
		sh.mu.Unlock()
		if n == limit || ctx.Err() != nil {
			break
		}
	}
	return n, nil
}

// Stats is a snapshot of a Store's size.
type Stats struct {
	Records int   // records held, expired ones included until swept
	Evicted int64 // live completed records evicted to make room
	Bytes   int64 // the records' size as WithMaxBytes counts it
}

// Stats returns the store's current size.
func (s *Store) Stats() Stats {
	st := Stats{Evicted: s.evicted.Load(), Bytes: s.bytes.Load()}
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		st.Records += len(sh.m)
		sh.mu.Unlock()
	}
	return st
}

// Close drops every record; later calls return [dedup.ErrClosed].
func (s *Store) Close() error {
	if s.closed.Swap(true) {
		return nil
	}
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		clear(sh.m)
		sh.mu.Unlock()
	}
	s.bytes.Store(0)
	return nil
}

func clone(b []byte) []byte {
	if len(b) == 0 {
		return nil
	}
	return append([]byte(nil), b...)
}
