package window

import (
	"bytes"
	"hash/maphash"
	"math"
	"strconv"
	"time"
	"unsafe"

	"github.com/dedupkit/dedup"
)

// Mode says whether a Window keeps a Bloom filter beside its exact record
// and what a Bloom "maybe" means.
type Mode uint8

const (
	// Exact keeps the exact record only; no Bloom filter is allocated.
	// Check answers Hit or Miss, and a Hit is certain. Use it in front of
	// an authoritative store when duplicates come in bursts (a crashed
	// batch redelivered).
	Exact Mode = iota
	// Confirm keeps the exact record and an ageing Bloom filter. A key that
	// is not in the exact record but that the Bloom filter may have seen is
	// reported as Maybe, and the caller must confirm it with the
	// authoritative store: a Maybe never decides anything, so no message is
	// ever dropped because of a false positive. Use it to count suspected
	// duplicates and to route them straight to the authoritative store.
	Confirm
	// Lossy keeps the exact record and an ageing Bloom filter, and the
	// caller treats a Maybe as a duplicate without asking any store. It is
	// for best-effort streams (analytics, metrics) only: it drops a fraction
	// of genuinely new keys equal to the Bloom filter's false-positive
	// rate, which is at most the fpRate given to [WithBloom] (default 0.1%,
	// one new key in a thousand), plus, for up to one generation span, keys
	// whose record has expired (see the package documentation).
	Lossy
)

// String returns "exact", "confirm" or "lossy".
func (m Mode) String() string {
	switch m {
	case Exact:
		return "exact"
	case Confirm:
		return "confirm"
	case Lossy:
		return "lossy"
	}
	return "mode(" + strconv.Itoa(int(m)) + ")"
}

// Verdict is what [Window.Check] found.
type Verdict uint8

const (
	// Miss: the key is not in the window, or its record expired. The key
	// may still be a duplicate; ask the store.
	Miss Verdict = iota
	// Hit: the key was recorded as completed with [Window.Add] and its
	// record has not expired. It is a duplicate.
	Hit
	// Maybe: the key is not in the exact record, but the Bloom filter may
	// have seen it (Confirm and Lossy modes only). In Confirm mode ask the
	// authoritative store; in Lossy mode treat it as a duplicate.
	Maybe
)

// String returns "miss", "hit" or "maybe".
func (v Verdict) String() string {
	switch v {
	case Miss:
		return "miss"
	case Hit:
		return "hit"
	case Maybe:
		return "maybe"
	}
	return "verdict(" + strconv.Itoa(int(v)) + ")"
}

// Window is an in-process record of recently completed keys. It is safe
// for concurrent use. See the package documentation for what it
// guarantees.
type Window struct {
	shards      []shard
	shardMask   uint64
	seeds       [4]maphash.Seed
	clock       dedup.Clock
	system      bool      // clock is the system clock: read the monotonic clock directly
	base        time.Time // times are kept as nanoseconds since base
	mode        Mode
	fpRate      float64
	resultLimit int
	bloom       *bloom // nil in Exact mode
}

type config struct {
	capacity    int
	shards      int
	mode        Mode
	bloomKeys   int
	fpRate      float64
	generations int
	rotateEvery time.Duration
	resultLimit int
	clock       dedup.Clock
}

// Option configures a Window.
type Option interface{ apply(*config) }

type option func(*config)

func (f option) apply(c *config) { f(c) }

// WithCapacity bounds the number of keys in the exact record. Default
// 1<<20 (1,048,576). The capacity is split evenly over the shards, and a
// shard that is full makes room for a new key by reclaiming an expired
// entry or else evicting the least recently added or hit of 16 entries
// (sampled LRU), so a window starts evicting a little before it holds
// capacity keys in all. Memory grows with use up to about 59 bytes a key,
// plus the kept results.
func WithCapacity(n int) Option { return option(func(c *config) { c.capacity = n }) }

// WithShards sets the number of independently locked shards of the exact
// record, rounded up to a power of two and lowered to at most the capacity.
// Default 64.
func WithShards(n int) Option { return option(func(c *config) { c.shards = n }) }

// WithMode selects [Exact], [Confirm] or [Lossy]. Default Exact.
func WithMode(m Mode) Option { return option(func(c *config) { c.mode = m }) }

// WithBloom sizes the ageing Bloom filter of the Confirm and Lossy modes:
// the union of its live generations, holding keys keys in all, has a
// false-positive rate of at most fpRate. It keeps generations
// generations (2 to 16); after keys/generations insertions the oldest one
// is cleared and becomes the newest, so memory is fixed and the rate stays
// bounded however long the window runs. Default 10,000,000 keys, 0.001
// and 4 generations, about 20.8 MiB. Ignored in Exact mode, but still
// validated.
func WithBloom(keys int, fpRate float64, generations int) Option {
	return option(func(c *config) { c.bloomKeys, c.fpRate, c.generations = keys, fpRate, generations })
}

// WithRotateEvery also rotates the Bloom filter to a fresh generation when d
// has passed since the last rotation, so that a key leaves the filter at
// most generations*d after it was added. It is checked on Add and Check
// (there is no background goroutine); after a long idle time up to
// generations rotations happen at once. Default 0: rotate by count only.
func WithRotateEvery(d time.Duration) Option { return option(func(c *config) { c.rotateEvery = d }) }

// WithResultLimit keeps results of at most n bytes with their entry, so
// that [Window.Check] can replay them. A longer result is not kept: Check
// reports a Hit with hasResult false, and the caller reads the result from
// its store. Default 4096; 0 keeps only empty results; at most 2^32-1.
func WithResultLimit(n int) Option { return option(func(c *config) { c.resultLimit = n }) }

// WithClock sets the clock that expiry and time-based rotation read.
// Default dedup.SystemClock{}.
func WithClock(clk dedup.Clock) Option { return option(func(c *config) { c.clock = clk }) }

func defaultConfig() config {
	return config{
		capacity:    1 << 20,
		shards:      64,
		mode:        Exact,
		bloomKeys:   10_000_000,
		fpRate:      0.001,
		generations: 4,
		resultLimit: 4096,
		clock:       dedup.SystemClock{},
	}
}

// Limits of the configuration.
const (
	maxShards      = 1 << 16
	maxCapacity    = 1 << 40
	maxBloomKeys   = 1 << 34
	maxGenerations = 16
)

func (c *config) validate() error {
	bad := func(arg, reason string) error { return &dedup.ArgumentError{Arg: "window " + arg, Reason: reason} }
	switch {
	case c.clock == nil:
		return bad("clock", "is nil")
	case c.capacity < 1 || c.capacity > maxCapacity:
		return bad("capacity", "must be between 1 and 2^40, got "+strconv.Itoa(c.capacity))
	case c.shards < 1 || c.shards > maxShards:
		return bad("shards", "must be between 1 and 65536, got "+strconv.Itoa(c.shards))
	case c.mode > Lossy:
		return bad("mode", "is unknown: "+c.mode.String())
	case c.generations < 2 || c.generations > maxGenerations:
		return bad("bloom generations", "must be between 2 and 16, got "+strconv.Itoa(c.generations))
	case c.bloomKeys < c.generations || c.bloomKeys > maxBloomKeys:
		return bad("bloom keys", "must be between the number of generations and 2^34, got "+strconv.Itoa(c.bloomKeys))
	case !(c.fpRate > 0 && c.fpRate < 1):
		return bad("bloom false-positive rate", "must be above 0 and below 1, got "+strconv.FormatFloat(c.fpRate, 'g', -1, 64))
	case c.rotateEvery < 0:
		return bad("rotation period", "must not be negative, got "+c.rotateEvery.String())
	case c.resultLimit < 0 || uint64(c.resultLimit) > math.MaxUint32:
		return bad("result limit", "must be between 0 and 2^32-1, got "+strconv.Itoa(c.resultLimit))
	}
	return nil
}

// New returns an empty Window, or an [*dedup.ArgumentError] for a bad
// option.
func New(opts ...Option) (*Window, error) {
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
	for n > cfg.capacity {
		n >>= 1
	}
	w := &Window{
		shards:      make([]shard, n),
		shardMask:   uint64(n - 1),
		clock:       cfg.clock,
		mode:        cfg.mode,
		resultLimit: cfg.resultLimit,
	}
	for i := range w.seeds {
		w.seeds[i] = maphash.MakeSeed()
	}
	_, w.system = cfg.clock.(dedup.SystemClock)
	w.base = cfg.clock.Now()
	for i := range w.shards {
		// Spread the capacity exactly: the first capacity%n shards take one more.
		limit := cfg.capacity / n
		if i < cfg.capacity%n {
			limit++
		}
		w.shards[i].init(limit)
	}
	if cfg.mode != Exact {
		w.fpRate = cfg.fpRate
		w.bloom = newBloom(cfg.bloomKeys, cfg.fpRate, cfg.generations, int64(cfg.rotateEvery))
	}
	return w, nil
}

// hash returns two independent 64-bit hashes of k. Each is the XOR of
// keyed hashes of the scope and the ID under their own seeds, so that for
// two different keys each collides with probability 2^-64 and both with
// 2^-128; the seeds are drawn per Window.
func (w *Window) hash(k dedup.Key) (h1, h2 uint64) {
	h1 = maphash.String(w.seeds[0], k.Scope) ^ maphash.String(w.seeds[1], k.ID)
	h2 = maphash.String(w.seeds[2], k.Scope) ^ maphash.String(w.seeds[3], k.ID)
	return h1, h2
}

func (w *Window) now() int64 {
	if w.system {
		return int64(time.Since(w.base)) // half the cost of time.Now().Sub
	}
	return int64(w.clock.Now().Sub(w.base))
}

// Check reports whether k was recorded as completed and has not expired.
//
// On a Hit, result is the result given to [Window.Add] and hasResult says
// whether it was kept (a result over the limit of [WithResultLimit] is
// not, and the caller must read it from its store). The result is shared
// with the window and with every other caller of Check: it must not be
// modified. It stays valid after the entry is evicted.
//
// Maybe is only answered in Confirm and Lossy modes; see [Mode]. A Hit does
// not allocate.
func (w *Window) Check(k dedup.Key) (v Verdict, result []byte, hasResult bool) {
	h1, h2 := w.hash(k)
	sh := &w.shards[h2&w.shardMask]
	now := int64(math.MinInt64)
	sh.mu.Lock()
	if i := sh.find(h1, h2); i >= 0 {
		s := &sh.slots[i]
		now = w.now()
		if s.expiry() > now {
			if s.stamp != sh.seq {
				s.stamp = sh.seq
			}
			sh.hits++
			res, has := s.result(), s.meta&flagResult != 0
			sh.mu.Unlock()
			return Hit, res, has
		}
		sh.remove(i)
		sh.expired++
	}
	if w.bloom == nil {
		sh.misses++
		sh.mu.Unlock()
		return Miss, nil, false
	}
	sh.mu.Unlock()
	if now == math.MinInt64 {
		now = w.now()
	}
	if w.bloom.test(h1, h2, now) {
		sh.maybes.Add(1)
		return Maybe, nil, false
	}
	sh.bloomMisses.Add(1)
	return Miss, nil, false
}

// Add records k as completed until expiresAt, with result for replay. The
// entry never outlives expiresAt: pass the end of the store's retention,
// or a key that is new again would be called a duplicate. A result within
// the limit of [WithResultLimit] is copied. Adding a key again replaces its
// entry; adding it with an expiresAt that has passed drops it. In Confirm
// and Lossy modes the key is also added to the Bloom filter.
//
// Keys are not validated (validate them once, where they enter the
// program); the scope and the ID are hashed, not kept.
func (w *Window) Add(k dedup.Key, result []byte, expiresAt time.Time) {
	h1, h2 := w.hash(k)
	sh := &w.shards[h2&w.shardMask]
	now := w.now()
	exp := w.offset(expiresAt)
	if exp <= now || exp <= 0 {
		sh.mu.Lock()
		if i := sh.find(h1, h2); i >= 0 {
			sh.remove(i)
		}
		sh.mu.Unlock()
		return
	}
	var res []byte
	has := len(result) <= w.resultLimit
	if has && len(result) > 0 {
		res = bytes.Clone(result) // never written again
	}
	sh.mu.Lock()
	sh.put(h1, h2, exp, res, has, now)
	sh.mu.Unlock()
	if w.bloom != nil {
		w.bloom.add(h1, h2, exp, now)
	}
}

// offset returns t as nanoseconds since the window's base, within
// [math.MinInt64, maxExpiry].
func (w *Window) offset(t time.Time) int64 {
	return min(int64(t.Sub(w.base)), maxExpiry)
}

// Forget drops the exact entry of k, if any, so that Check no longer
// answers Hit for it. The Bloom filter cannot forget: in Confirm and Lossy
// modes Check may answer Maybe for k until its generation is rotated out.
func (w *Window) Forget(k dedup.Key) {
	h1, h2 := w.hash(k)
	sh := &w.shards[h2&w.shardMask]
	sh.mu.Lock()
	if i := sh.find(h1, h2); i >= 0 {
		sh.remove(i)
	}
	sh.mu.Unlock()
}

// Mode returns the mode the window was created with.
func (w *Window) Mode() Mode { return w.mode }

// FalsePositiveBound returns the configured upper bound of the Bloom
// filter's false-positive rate: in Lossy mode, the fraction of new keys
// that Check answers Maybe for and that are therefore dropped. It is 0 in
// Exact mode.
func (w *Window) FalsePositiveBound() float64 { return w.fpRate }

// Stats is a snapshot of a window's counters and size. Counters are
// cumulative over the window's life, across [Window.Reset].
type Stats struct {
	// Entries is the number of keys in the exact record, including expired
	// ones not yet reclaimed.
	Entries int
	// Hits, Misses and Maybes count the answers of Check.
	Hits, Misses, Maybes uint64
	// Evictions counts live entries dropped to make room.
	Evictions uint64
	// Expired counts expired entries reclaimed.
	Expired uint64
	// Rotations counts Bloom generations retired.
	Rotations uint64
	// BloomBytes is the fixed size of the Bloom filter (0 in Exact mode).
	BloomBytes int64
	// ExactBytes estimates the memory of the exact record: its tables and
	// the results it keeps.
	ExactBytes int64
	// EstimatedFPRate is the Bloom filter's false-positive rate now,
	// estimated from the bits set in its live generations (0 in Exact
	// mode).
	EstimatedFPRate float64
}

// Stats returns the window's counters and sizes.
func (w *Window) Stats() Stats {
	var st Stats
	for i := range w.shards {
		sh := &w.shards[i]
		sh.mu.Lock()
		st.Entries += sh.count
		st.Hits += sh.hits
		st.Misses += sh.misses
		st.Evictions += sh.evictions
		st.Expired += sh.expired
		st.ExactBytes += int64(len(sh.slots))*int64(unsafe.Sizeof(slot{})+4) + sh.resultBytes
		sh.mu.Unlock()
		st.Misses += sh.bloomMisses.Load()
		st.Maybes += sh.maybes.Load()
	}
	st.ExactBytes += int64(len(w.shards)) * int64(unsafe.Sizeof(shard{}))
	if w.bloom != nil {
		st.Rotations = w.bloom.rotations.Load()
		st.BloomBytes = int64(len(w.bloom.words)) * 8
		st.EstimatedFPRate = w.bloom.estimate(w.now())
	}
	return st
}

// Reset empties the exact record and the Bloom filter, as a restart or a
// rebalance would. The counters of [Stats] keep counting.
func (w *Window) Reset() {
	for i := range w.shards {
		sh := &w.shards[i]
		sh.mu.Lock()
		sh.reset()
		sh.mu.Unlock()
	}
	if w.bloom != nil {
		w.bloom.reset(w.now())
	}
}
