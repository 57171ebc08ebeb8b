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

// A shard keeps the records of one scope, the first it was given, in a
// map by ID (24 bytes an entry, one string hashed and compared), and those
// of any other scope in a map by Key (40 bytes an entry): most stores
// serve one scope, or a few.
type shard struct {
	mu    sync.Mutex
	scope string                // the scope of byID's keys; "" until the first record
	byID  map[string]*record    // records of scope, by ID
	other map[dedup.Key]*record // records of other scopes; nil until one comes
	slab  []record              // records not handed out yet
	free  []*record             // records given back, handed out first
	next  int                   // length of the next slab
	_     [32]byte              // keep shards on separate cache lines (128 bytes each)
}

func (sh *shard) get(k dedup.Key) (*record, bool) {
	if k.Scope == sh.scope {
		r, ok := sh.byID[k.ID]
		return r, ok
	}
	r, ok := sh.other[k]
	return r, ok
}

func (sh *shard) put(k dedup.Key, r *record) {
	if sh.scope == "" {
		sh.scope = k.Scope
	}
	if k.Scope == sh.scope {
		sh.byID[k.ID] = r
		return
	}
	if sh.other == nil {
		sh.other = make(map[dedup.Key]*record)
	}
	sh.other[k] = r
}

func (sh *shard) del(k dedup.Key) {
	if k.Scope == sh.scope {
		delete(sh.byID, k.ID)
	} else {
		delete(sh.other, k)
	}
}

func (sh *shard) len() int { return len(sh.byID) + len(sh.other) }

// sample calls f on up to n records (each map's iteration starts at a
// random place), taking from each map in proportion to its size, until f
// returns false. f may delete the record it is given.
func (sh *shard) sample(n int, f func(k dedup.Key, r *record) bool) {
	total := sh.len()
	if total == 0 {
		return
	}
	fromID := (n*len(sh.byID) + total - 1) / total
	seen := 0
	for id, r := range sh.byID {
		if seen == fromID {
			break
		}
		seen++
		if !f(dedup.Key{Scope: sh.scope, ID: id}, r) {
			return
		}
	}
	for k, r := range sh.other {
		if seen >= n {
			break
		}
		seen++
		if !f(k, r) {
			return
		}
	}
}

// all calls f on every record until f returns false. f may delete the
// record it is given.
func (sh *shard) all(f func(k dedup.Key, r *record) bool) {
	for id, r := range sh.byID {
		if !f(dedup.Key{Scope: sh.scope, ID: id}, r) {
			return
		}
	}
	for k, r := range sh.other {
		if !f(k, r) {
			return
		}
	}
}

// A record is 72 bytes, allocated from its shard's slabs (no allocation
// per key, no size-class rounding) and reused once dropped. A fingerprint
// made by [dedup.FingerprintOf] (or its siblings) is kept as its 32-byte
// SHA-256 digest, not as its 71-byte text; any other fingerprint, and a
// result, go in a separate allocation that most records do without.
type record struct {
	token     dedup.Token
	digest    [32]byte // the fingerprint's SHA-256 when fpKind is fpDigest
	until     int64    // lease end while in progress, expiry once completed
	attempt   int32
	completed bool
	fpKind    uint8
	more      *extra // nil unless a result or an fpString fingerprint is kept
}

type extra struct {
	fp     dedup.Fingerprint // when fpKind is fpString
	result []byte
}

// How a record keeps its fingerprint.
const (
	fpNone   = iota // empty: not checked, matches any
	fpDigest        // "sha256:" and 64 lowercase hex digits: kept as the 32 bytes
	fpString        // anything else: kept as is in more.fp
)

// A print is a claim's fingerprint parsed once: its kind, and its digest
// when it has one.
type print struct {
	fp     dedup.Fingerprint
	kind   uint8
	digest [32]byte
}

const digestPrefix = "sha256:"

// parsePrint sorts fp. Only lowercase hex is taken as a digest, so that
// the digest turns back into exactly the string that was given: two
// fingerprints are equal as digests only if they are equal as strings.
func parsePrint(fp dedup.Fingerprint) (p print) {
	p.fp = fp
	switch {
	case fp == "":
		return p
	case len(fp) != len(digestPrefix)+64 || fp[:len(digestPrefix)] != digestPrefix:
		p.kind = fpString
		return p
	}
	h := fp[len(digestPrefix):]
	for i := range p.digest {
		hi, ok1 := unhex(h[2*i])
		lo, ok2 := unhex(h[2*i+1])
		if !ok1 || !ok2 {
			p.kind = fpString
			return p
		}
		p.digest[i] = hi<<4 | lo
	}
	p.kind = fpDigest
	return p
}

func unhex(c byte) (byte, bool) {
	switch {
	case '0' <= c && c <= '9':
		return c - '0', true
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10, true
	}
	return 0, false
}

// matches is [dedup.Fingerprint.Matches] of p against r's fingerprint.
func (r *record) matches(p *print) bool {
	switch {
	case p.kind == fpNone || r.fpKind == fpNone:
		return true
	case p.kind != r.fpKind:
		return false
	case p.kind == fpDigest:
		return p.digest == r.digest
	}
	return p.fp == r.more.fp
}

// setPrint stores p as r's fingerprint.
func (r *record) setPrint(p *print) {
	r.fpKind, r.digest = p.kind, p.digest
	if p.kind == fpString {
		r.more = &extra{fp: p.fp}
	}
}

func (r *record) result() []byte {
	if r.more == nil {
		return nil
	}
	return r.more.result
}

// size is what WithMaxBytes counts for r under key k.
func (r *record) size(k dedup.Key) int64 {
	n := int64(RecordOverhead + len(k.Scope) + len(k.ID))
	if r.more != nil {
		n += extraSize + int64(len(r.more.fp)+len(r.more.result))
	}
	return n
}

// extraSize is the size of an extra, counted when a record has one.
const extraSize = 48

// alloc hands out a zero record from the shard's slabs. Slabs start small
// and double up to 256 records, so a store of few keys stays small.
func (sh *shard) alloc() *record {
	if n := len(sh.free); n > 0 {
		r := sh.free[n-1]
		sh.free[n-1] = nil
		sh.free = sh.free[:n-1]
		return r
	}
	if len(sh.slab) == 0 {
		sh.next = min(max(2*sh.next, 4), 256)
		sh.slab = make([]record, sh.next)
	}
	r := &sh.slab[0]
	sh.slab = sh.slab[1:]
	return r
}

// recycle gives r back for reuse.
func (sh *shard) recycle(r *record) {
	*r = record{}
	sh.free = append(sh.free, r)
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
// key, fingerprint and result: the map entry and the 72-byte record, which
// holds a fingerprint made by [dedup.FingerprintOf] inline. Another
// fingerprint, or a result, is counted by its length plus 48 bytes.
const RecordOverhead = 136

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
		s.shards[i].byID = make(map[string]*record)
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
	p := parsePrint(fp)
	sh := s.shard(key)
	now := s.now()
	sh.mu.Lock()
	c, err := s.claimLocked(sh, key, &p, lease, now)
	sh.mu.Unlock()
	return c, err
}

func (s *Store) claimLocked(sh *shard, key dedup.Key, p *print, lease time.Duration, now int64) (dedup.Claim, error) {
	r, found := sh.get(key)
	attempt := int32(1)
	takeOver := false
	if found {
		live := r.until > now
		switch {
		case (live || !r.completed) && !r.matches(p):
			return dedup.Claim{Key: key, Outcome: dedup.Mismatch}, nil
		case r.completed && live:
			return dedup.Claim{Key: key, Outcome: dedup.Duplicate, Attempt: int(r.attempt),
				Result: clone(r.result()), ExpiresAt: s.time(r.until)}, nil
		case live:
			return dedup.Claim{Key: key, Outcome: dedup.InProgress, Attempt: int(r.attempt), LeaseUntil: s.time(r.until)}, nil
		case !r.completed: // lease expired: take over, keep the original fingerprint
			attempt = r.attempt + 1
			takeOver = true
		}
	} else {
		if sh.len() >= s.perShard {
			if err := s.makeRoom(sh, now); err != nil {
				return dedup.Claim{}, err
			}
		}
		if s.maxBytes > 0 {
			size := int64(RecordOverhead + len(key.Scope) + len(key.ID))
			if p.kind == fpString {
				size += extraSize + int64(len(p.fp))
			}
			if err := s.fitBytes(sh, size, now); err != nil {
				return dedup.Claim{}, err
			}
		}
	}
	var before int64
	if found {
		before = r.size(key)
	} else {
		r = sh.alloc()
		sh.put(key, r)
	}
	token, until := dedup.NewToken(), dedup.DeadlineNanos(now, lease)
	if takeOver && r.fpKind != fpNone {
		// An in-progress record has no result: only its fingerprint is
		// kept.
		r.token, r.until, r.attempt = token, until, attempt
	} else {
		*r = record{token: token, until: until, attempt: attempt}
		r.setPrint(p)
	}
	s.bytes.Add(r.size(key) - before)
	return dedup.Claim{Key: key, Outcome: dedup.Acquired, Token: token, Attempt: int(attempt),
		TakenOver: attempt > 1, LeaseUntil: s.time(until)}, nil
}

// makeRoom frees one slot in a full shard: it samples up to 32 records
// (map iteration starts at a random place), deletes the expired completed
// ones, and if there were none evicts the sampled completed record that
// expires soonest.
func (s *Store) makeRoom(sh *shard, now int64) error {
	const sample = 32
	var victim dedup.Key
	victimUntil, freed := int64(-1), 0
	sh.sample(sample, func(k dedup.Key, r *record) bool {
		if r.completed {
			if r.until <= now {
				s.drop(sh, k, r)
				freed++
			} else if victimUntil < 0 || r.until < victimUntil {
				victim, victimUntil = k, r.until
			}
		}
		return true
	})
	switch {
	case freed > 0:
		return nil
	case victimUntil >= 0 && !s.strict:
		r, _ := sh.get(victim)
		s.drop(sh, victim, r)
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

// drop deletes the record r of key k from sh, uncounts its bytes and
// recycles it.
func (s *Store) drop(sh *shard, k dedup.Key, r *record) {
	sh.del(k)
	s.bytes.Add(-r.size(k))
	sh.recycle(r)
}

// Complete implements [dedup.Store].
//
// The key is validated only when no record of it holds the claim's token:
// a record that does was claimed under this key, which Claim validated, so
// a bad key still gets its [*dedup.ArgumentError] and changes nothing.
func (s *Store) Complete(ctx context.Context, c dedup.Claim, result []byte, retention time.Duration) error {
	if retention <= 0 || c.Outcome != dedup.Acquired || c.Token.IsZero() {
		return dedup.ValidateComplete(c, retention)
	}
	if err := s.begin(ctx, "complete"); err != nil {
		if verr := c.Key.Validate(); verr != nil {
			return verr
		}
		return err
	}
	sh := s.shard(c.Key)
	now := s.now()
	sh.mu.Lock()
	err := s.completeLocked(sh, c, result, retention, now)
	sh.mu.Unlock()
	if err != nil {
		if verr := c.Key.Validate(); verr != nil {
			return verr
		}
	}
	return err
}

func (s *Store) completeLocked(sh *shard, c dedup.Claim, result []byte, retention time.Duration, now int64) error {
	r, ok := sh.get(c.Key)
	switch {
	case !ok || r.token != c.Token:
		return dedup.ErrLeaseLost
	case r.completed: // the same owner completing again: no change
		return nil
	}
	r.completed, r.until = true, dedup.DeadlineNanos(now, retention)
	if len(result) > 0 {
		if r.more == nil {
			r.more = &extra{}
			s.bytes.Add(extraSize)
		}
		r.more.result = clone(result)
		s.bytes.Add(int64(len(result)))
	}
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
	now := s.now()
	for i, it := range items {
		sh := s.shard(it.Claim.Key)
		sh.mu.Lock()
		errs[i] = s.completeLocked(sh, it.Claim, it.Result, retention, now)
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
	r, ok := sh.get(c.Key)
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
	r, ok := sh.get(c.Key)
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
		p := parsePrint(r.Fingerprint)
		sh := s.shard(r.Key)
		sh.mu.Lock()
		c, err := s.claimLocked(sh, r.Key, &p, lease, now)
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
		sh.all(func(k dedup.Key, r *record) bool {
			if n == limit {
				return false
			}
			if r.completed && r.until <= now {
				s.drop(sh, k, r)
				n++
			}
			return true
		})
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
		st.Records += sh.len()
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
		clear(sh.byID)
		sh.other = nil
		sh.slab, sh.free = nil, nil
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
