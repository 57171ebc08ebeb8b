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
	"encoding/binary"
	"errors"
	"fmt"
	"hash/maphash"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/dedupkit/dedup"
)

const storeName = "memory"

// Store is an in-memory dedup store. It is safe for concurrent use.
type Store struct {
	shards   []shard
	shift    uint // a key's hash >> shift is its shard
	seed     maphash.Seed
	clock    dedup.Clock
	base     time.Time // times are kept as nanoseconds since base
	perShard int
	strict   bool
	system   bool // clock is the system clock: read the monotonic clock directly
	closed   atomic.Bool
	evicted  atomic.Int64
	maxBytes int64        // 0: no byte bound
	bytes    atomic.Int64 // the records' sizes, kept only when maxBytes > 0
	// scope is the first scope a Claim validated: strings do not change,
	// so a key in it has only its ID left to check.
	scope atomic.Pointer[string]
	// bytesLooked, when set (by tests), runs once a claim of a new key has
	// looked whether its record fits under the byte bound.
	bytesLooked func()
}

// A shard is an open-addressing table (linear probing, backward-shift
// deletion, at most 3/4 full) of 8-byte slots, each the low 32 bits of its
// key's hash beside the index of its record, over records kept in chunks.
// A lookup hashes the key once (the top bits picked the shard, the low
// bits pick the slot), compares slot words until the hash matches, and
// then compares the one record the slot points to: one probe, no pointer
// chasing beyond the record itself. Records never move (a growing table
// moves slot words only), so a slot's index stays valid until the record
// is dropped.
//
// Keys of the shard's first scope are found by ID alone; any other scope
// gets a small number (counted by its records, forgotten when the last
// goes) that is mixed into the hash and kept in the record.
type shard struct {
	mu     sync.Mutex
	slots  []uint64   // hash<<32 | record index+1; 0 is empty
	chunks [][]record // record i is chunks[i>>chunkBits][i&chunkMask]
	scope  string     // the scope of number 0; "" until the first record
	n      int        // records in the table
	top    uint32     // records handed out of the chunks so far
	free   uint32     // first record of the free list, +1; 0: none
	bytes  int64      // the records' sizes, by size
	multi  *scopes    // scopes other than scope; nil until one comes
	_      [24]byte   // keep shards on separate cache lines (128 bytes each)
}

// scopes numbers a shard's other scopes from 1.
type scopes struct {
	ids   map[string]uint32
	names []string // by number - 1; "" when free
	refs  []int32  // records by number - 1
	free  []uint32 // numbers given back
}

const (
	minSlots  = 8
	chunkBits = 8
	chunkLen  = 1 << chunkBits
	chunkMask = chunkLen - 1
	// maxPerShard bounds a shard's records: scope numbers (from 1, one
	// per record at most, the first scope's records aside) take 28 bits of
	// a record's meta, record indexes 32 bits of a slot.
	maxPerShard = 1<<28 - 1
)

// reset empties sh (its lock aside).
func (sh *shard) reset() {
	sh.slots = make([]uint64, minSlots)
	sh.chunks, sh.scope, sh.multi = nil, "", nil
	sh.n, sh.top, sh.free, sh.bytes = 0, 0, 0, 0
}

// rec returns record i.
func (sh *shard) rec(i uint32) *record { return &sh.chunks[i>>chunkBits][i&chunkMask] }

// mix is the hash of an ID in scope number sid.
func mix(h uint64, sid uint32) uint64 { return h ^ uint64(sid)*0x9e3779b97f4a7c15 }

// scopeID returns the number of scope in sh, if it has one.
func (sh *shard) scopeID(scope string) (uint32, bool) {
	if scope == sh.scope {
		return 0, true
	}
	if sh.multi == nil {
		return 0, false
	}
	id, ok := sh.multi.ids[scope]
	return id, ok
}

// addScope numbers a scope that scopeID did not find.
func (sh *shard) addScope(scope string) uint32 {
	if sh.scope == "" {
		sh.scope = scope
		return 0
	}
	m := sh.multi
	if m == nil {
		m = &scopes{ids: make(map[string]uint32)}
		sh.multi = m
	}
	var id uint32
	if n := len(m.free); n > 0 {
		id = m.free[n-1]
		m.free = m.free[:n-1]
		m.names[id-1] = scope
	} else {
		m.names = append(m.names, scope)
		m.refs = append(m.refs, 0)
		id = uint32(len(m.names))
	}
	m.ids[scope] = id
	return id
}

// scopeName returns the scope of number sid.
func (sh *shard) scopeName(sid uint32) string {
	if sid == 0 {
		return sh.scope
	}
	return sh.multi.names[sid-1]
}

// unref counts one record of scope number sid gone.
func (sh *shard) unref(sid uint32) {
	if sid == 0 {
		return
	}
	m := sh.multi
	if m.refs[sid-1]--; m.refs[sid-1] == 0 {
		delete(m.ids, m.names[sid-1])
		m.names[sid-1] = ""
		m.free = append(m.free, sid)
	}
}

// find looks up the record of ID id in scope number sid, whose hash is hs.
// It returns the slot that holds it, or the empty slot where the probe
// ended (where the key would go) and false.
func (sh *shard) find(hs uint64, sid uint32, id string) (pos uint64, ri uint32, ok bool) {
	mask := uint64(len(sh.slots) - 1)
	tag := hs << 32
	for i := hs & mask; ; i = (i + 1) & mask {
		w := sh.slots[i]
		if w == 0 {
			return i, 0, false
		}
		if w&^0xffffffff == tag {
			ri := uint32(w) - 1
			r := sh.rec(ri)
			if r.meta>>scopeShift == sid && r.idLen() == len(id) && r.id() == id {
				return i, ri, true
			}
		}
	}
}

// slotOf returns the slot that holds record ri, whose hash is hs.
func (sh *shard) slotOf(hs uint64, ri uint32) uint64 {
	mask := uint64(len(sh.slots) - 1)
	for i := hs & mask; ; i = (i + 1) & mask {
		if uint32(sh.slots[i]) == ri+1 {
			return i
		}
	}
}

// emptySlot returns the first empty slot of hs's probe sequence.
func (sh *shard) emptySlot(hs uint64) uint64 {
	mask := uint64(len(sh.slots) - 1)
	i := hs & mask
	for sh.slots[i] != 0 {
		i = (i + 1) & mask
	}
	return i
}

// grow doubles the table. Slot words carry their hash, so nothing is
// hashed again and no record moves.
func (sh *shard) grow() {
	slots := make([]uint64, 2*len(sh.slots))
	mask := uint64(len(slots) - 1)
	for _, w := range sh.slots {
		if w == 0 {
			continue
		}
		i := w >> 32 & mask
		for slots[i] != 0 {
			i = (i + 1) & mask
		}
		slots[i] = w
	}
	sh.slots = slots
}

// removeSlot empties slot i and shifts back the slots after it that
// belong before it, so that every key stays reachable from its home slot
// without tombstones.
func (sh *shard) removeSlot(i uint64) {
	mask := uint64(len(sh.slots) - 1)
	for {
		sh.slots[i] = 0
		j := i
		for {
			j = (j + 1) & mask
			w := sh.slots[j]
			if w == 0 {
				return
			}
			// w may fill the hole at i unless its home lies cyclically
			// in (i, j].
			if home := w >> 32 & mask; (j-home)&mask >= (j-i)&mask {
				sh.slots[i] = w
				i = j
				break
			}
		}
	}
}

// alloc hands out a zero record: one given back if there is one, else the
// next of the chunks. The first chunk starts at 4 records and doubles up
// to 256, so a store of few keys stays small; later chunks have 256. It
// may move the first chunk: no *record may be held across it.
func (sh *shard) alloc() uint32 {
	if sh.free != 0 {
		i := sh.free - 1
		r := sh.rec(i)
		sh.free = uint32(r.until)
		r.until = 0
		return i
	}
	i := sh.top
	switch c := int(i >> chunkBits); {
	case c == 0 && len(sh.chunks) == 0:
		sh.chunks = append(sh.chunks, make([]record, 4))
	case c == 0 && int(i) == len(sh.chunks[0]):
		first := make([]record, 2*i)
		copy(first, sh.chunks[0])
		sh.chunks[0] = first
	case c == len(sh.chunks):
		sh.chunks = append(sh.chunks, make([]record, chunkLen))
	}
	sh.top++
	return i
}

// A record is 80 bytes, kept in its shard's chunks (no allocation per
// key, no size-class rounding) and reused once dropped. A fingerprint
// made by [dedup.FingerprintOf] (or its siblings) is kept as its 32-byte
// SHA-256 digest, not as its 71-byte text; any other fingerprint, and a
// result, go in a separate allocation that most records do without.
type record struct {
	idp   *byte // the bytes of the key's ID (its length is in lenAtt); nil while the record is free
	until int64 // lease end while in progress, expiry once completed; next free+1 while free
	token dedup.Token
	// lenAtt is the ID's length<<lenShift | the attempt count, which
	// saturates at maxAttempt.
	lenAtt uint32
	meta   uint32   // scope number<<scopeShift | extraBit | completedBit | fingerprint kind
	digest [32]byte // the fingerprint's SHA-256 when its kind is fpDigest
	more   *extra   // nil unless a result or an fpString fingerprint is kept
}

const (
	kindMask     = 3
	completedBit = 4
	extraBit     = 8 // more is set: read it only then, it is on the record's far side
	scopeShift   = 4
	lenShift     = 22
	maxAttempt   = 1<<lenShift - 1
)

// An ID's length must fit the 10 bits above the attempt count.
const _ = uint(1<<(32-lenShift) - 1 - dedup.MaxIDBytes)

func (r *record) idLen() int { return int(r.lenAtt >> lenShift) }

func (r *record) attempt() int32 { return int32(r.lenAtt & maxAttempt) }

// setAttempt sets the attempt count, saturating at maxAttempt.
func (r *record) setAttempt(a int32) {
	r.lenAtt = r.lenAtt&^maxAttempt | uint32(min(a, maxAttempt))
}

// id returns the key's ID.
func (r *record) id() string { return unsafe.String(r.idp, r.idLen()) }

// setKey makes r the record of ID id in scope number sid.
func (r *record) setKey(id string, sid uint32) {
	r.idp, r.lenAtt, r.meta = unsafe.StringData(id), uint32(len(id))<<lenShift, sid<<scopeShift
}

func (r *record) completed() bool { return r.meta&completedBit != 0 }

type extra struct {
	fp     dedup.Fingerprint // when the kind is fpString
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
	kind   uint32
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
	kind := r.meta & kindMask
	switch {
	case p.kind == fpNone || kind == fpNone:
		return true
	case p.kind != kind:
		return false
	case p.kind == fpDigest:
		return p.digest == r.digest
	}
	return p.fp == r.more.fp
}

// acquire makes r a new claim of the record's key with fingerprint p
// (dropping any result or fingerprint it kept), and returns how many bytes
// its size changed by.
func (r *record) acquire(p *print, token dedup.Token, until int64, attempt int32) int64 {
	before := r.extraSize()
	r.token, r.until = token, until
	r.setAttempt(attempt)
	r.meta = r.meta&^(completedBit|extraBit|kindMask) | p.kind
	if p.kind == fpDigest {
		r.digest = p.digest
	}
	if before != 0 {
		r.more = nil
	}
	if p.kind == fpString {
		r.setExtra(&extra{fp: p.fp})
	}
	return r.extraSize() - before
}

func (r *record) setExtra(x *extra) {
	r.more = x
	r.meta |= extraBit
}

func (r *record) result() []byte {
	if r.meta&extraBit == 0 {
		return nil
	}
	return r.more.result
}

// extraSize is what WithMaxBytes counts for r beyond RecordOverhead and
// its key.
func (r *record) extraSize() int64 {
	if r.meta&extraBit == 0 {
		return 0
	}
	return extraOverhead + int64(len(r.more.fp)+len(r.more.result))
}

// extraOverhead is the size of an extra, counted when a record has one.
const extraOverhead = 48

// addBytes counts d more bytes held in sh.
func (s *Store) addBytes(sh *shard, d int64) {
	sh.bytes += d
	if s.maxBytes > 0 {
		s.bytes.Add(d)
	}
}

// drop deletes record ri, held in slot pos, from sh: the slot is emptied,
// its bytes uncounted and the record put on the free list.
func (s *Store) drop(sh *shard, pos uint64, ri uint32) {
	sh.removeSlot(pos)
	r := sh.rec(ri)
	sid := r.meta >> scopeShift
	s.addBytes(sh, -(RecordOverhead + int64(len(sh.scopeName(sid))+r.idLen()) + r.extraSize()))
	sh.unref(sid)
	*r = record{until: int64(sh.free)}
	sh.free = ri + 1
	sh.n--
}

// dropRecord drops record ri, found without its slot (by a scan of the
// records): its key is hashed again to find the slot.
func (s *Store) dropRecord(sh *shard, ri uint32) {
	r := sh.rec(ri)
	sid := r.meta >> scopeShift
	s.drop(sh, sh.slotOf(mix(maphash.String(s.seed, r.id()), sid), ri), ri)
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

// WithCapacity bounds the number of records. Default 1,000,000. A shard
// holds fewer than 2^28 records.
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
// key, fingerprint and result. A record takes 80 bytes, which hold a
// fingerprint made by [dedup.FingerprintOf] inline, and its table slots
// 11-22 bytes more (8 a slot, the table 3/8 to 3/4 full): 136 counts them
// with room to spare. Another fingerprint, or a result, is counted by its
// length plus 48 bytes.
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
	case c.capacity/c.shards > maxPerShard:
		return &dedup.ArgumentError{Arg: "memstore capacity", Reason: "must be under 2^28 records a shard (use more shards)"}
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
	n, bits := 1, uint(0)
	for n < cfg.shards {
		n <<= 1
		bits++
	}
	s := &Store{
		shards:   make([]shard, n),
		shift:    64 - bits,
		seed:     maphash.MakeSeed(),
		clock:    cfg.clock,
		perShard: min((cfg.capacity+n-1)/n, maxPerShard),
		strict:   cfg.strict,
		maxBytes: cfg.maxBytes,
	}
	_, s.system = cfg.clock.(dedup.SystemClock)
	s.base = s.clock.Now()
	for i := range s.shards {
		s.shards[i].reset()
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

// hash returns the hash of id and the shard it picks. The ID alone
// spreads keys well: scopes are few, IDs are many.
func (s *Store) hash(id string) (uint64, *shard) {
	h := maphash.String(s.seed, id)
	return h, &s.shards[h>>s.shift]
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

// validateClaim is [dedup.ValidateClaim], without checking again the
// scope that was checked first.
func (s *Store) validateClaim(key dedup.Key, fp dedup.Fingerprint, lease time.Duration) error {
	if known := s.scope.Load(); known != nil && *known == key.Scope {
		// The ID is checked as dedup checks it, beside a scope that is
		// valid: the same answer, the same error for a bad ID.
		return dedup.ValidateClaim(dedup.Key{Scope: "-", ID: key.ID}, fp, lease)
	}
	if err := dedup.ValidateClaim(key, fp, lease); err != nil {
		return err
	}
	if s.scope.Load() == nil {
		scope := key.Scope
		s.scope.CompareAndSwap(nil, &scope)
	}
	return nil
}

// Claim implements [dedup.Store].
func (s *Store) Claim(ctx context.Context, key dedup.Key, fp dedup.Fingerprint, lease time.Duration) (c dedup.Claim, err error) {
	if err := s.validateClaim(key, fp, lease); err != nil {
		return dedup.Claim{}, err
	}
	if err := s.begin(ctx, "claim"); err != nil {
		return dedup.Claim{}, err
	}
	p := parsePrint(fp)
	h, sh := s.hash(key.ID)
	// The claim (144 bytes) is written once, in place, not returned up
	// through the calls below.
	err = s.claimIn(sh, key, h, &p, lease, s.now(), &c)
	return c, err
}

// errOverBytes is the ErrFull of a claim that the byte bound refused
// after the key's own shard had nothing left to free.
var errOverBytes = fmt.Errorf("%w: over the byte bound", dedup.ErrFull)

// claimIn claims key in its shard sh. The byte bound is the store's while
// room is made shard by shard: when the key's shard has nothing left to
// free, the other shards free expired records (and, unless strict, evict
// as a full store does), one at a time so that no two shard locks are
// ever held together, and the claim is tried once more.
//
// The claim is written to c, which is left as it was on an error.
func (s *Store) claimIn(sh *shard, key dedup.Key, h uint64, p *print, lease time.Duration, now int64, c *dedup.Claim) error {
	sh.mu.Lock()
	err := s.claimLocked(sh, key, h, p, lease, now, c)
	sh.mu.Unlock()
	if err != nil && errors.Is(err, errOverBytes) && s.freeElsewhere(sh, recordSize(key, p), now) {
		sh.mu.Lock()
		err = s.claimLocked(sh, key, h, p, lease, now, c)
		sh.mu.Unlock()
	}
	return err
}

// freeElsewhere makes room for size bytes in the shards other than skip,
// a few rounds over them at most, and reports whether the bound now has
// room.
func (s *Store) freeElsewhere(skip *shard, size, now int64) bool {
	for range 4 {
		for i := range s.shards {
			if s.bytes.Load()+size <= s.maxBytes {
				return true
			}
			o := &s.shards[i]
			if o == skip {
				continue
			}
			o.mu.Lock()
			s.makeRoom(o, now) // an error: nothing to free there
			o.mu.Unlock()
		}
	}
	return s.bytes.Load()+size <= s.maxBytes
}

// recordSize is what WithMaxBytes counts for a new record of key.
func recordSize(key dedup.Key, p *print) int64 {
	size := int64(RecordOverhead + len(key.Scope) + len(key.ID))
	if p.kind == fpString {
		size += extraOverhead + int64(len(p.fp))
	}
	return size
}

// claimLocked is claimIn under sh's lock.
func (s *Store) claimLocked(sh *shard, key dedup.Key, h uint64, p *print, lease time.Duration, now int64, c *dedup.Claim) error {
	sid, known := sh.scopeID(key.Scope)
	var pos uint64
	if known {
		var ri uint32
		var found bool
		pos, ri, found = sh.find(mix(h, sid), sid, key.ID)
		if found {
			r := sh.rec(ri)
			live, completed := r.until > now, r.completed()
			switch {
			case (live || !completed) && !r.matches(p):
				*c = dedup.Claim{Key: key, Outcome: dedup.Mismatch}
				return nil
			case completed && live:
				*c = dedup.Claim{Key: key, Outcome: dedup.Duplicate, Attempt: int(r.attempt()),
					Result: clone(r.result()), ExpiresAt: s.time(r.until)}
				return nil
			case live:
				*c = dedup.Claim{Key: key, Outcome: dedup.InProgress, Attempt: int(r.attempt()), LeaseUntil: s.time(r.until)}
				return nil
			}
			token, until := newToken(), dedup.DeadlineNanos(now, lease)
			attempt := int32(1)
			if !completed {
				attempt = min(r.attempt()+1, maxAttempt)
			}
			if !completed && r.meta&kindMask != fpNone {
				// Take-over of an expired lease with a fingerprint: keep
				// it (an in-progress record has no result).
				r.token, r.until = token, until
				r.setAttempt(attempt)
			} else {
				// A completed record expired, or a take-over where the
				// fingerprint is the new claim's.
				s.addBytes(sh, r.acquire(p, token, until, attempt))
			}
			*c = dedup.Claim{Key: key, Outcome: dedup.Acquired, Token: token, Attempt: int(attempt),
				TakenOver: attempt > 1, LeaseUntil: s.time(until)}
			return nil
		}
	}
	// A new key. Making room or growing the table moves slots and may
	// forget the key's scope: then the slot is looked up again.
	moved := !known
	var reserved int64 // bytes of the bound counted for the record already
	if sh.n >= s.perShard {
		if err := s.makeRoom(sh, now); err != nil {
			return err
		}
		moved = true
	}
	if s.maxBytes > 0 {
		// The record's bytes are counted in the bound by the look that
		// finds them room (reserve), not after: a claim in another shard
		// must not find the same room.
		reserved = recordSize(key, p)
		fits := s.reserve(reserved)
		if s.bytesLooked != nil {
			s.bytesLooked()
		}
		if !fits {
			if err := s.fitBytes(sh, reserved, now); err != nil {
				return err
			}
			moved = true
		}
	}
	if (sh.n+1)*4 > len(sh.slots)*3 {
		sh.grow()
		moved = true
	}
	if moved {
		var ok bool
		if sid, ok = sh.scopeID(key.Scope); !ok {
			sid = sh.addScope(key.Scope)
		}
		pos = sh.emptySlot(mix(h, sid))
	}
	ri := sh.alloc()
	sh.slots[pos] = mix(h, sid)<<32 | uint64(ri+1)
	sh.n++
	if sid != 0 {
		sh.multi.refs[sid-1]++
	}
	r := sh.rec(ri)
	r.setKey(key.ID, sid)
	token, until := newToken(), dedup.DeadlineNanos(now, lease)
	d := RecordOverhead + int64(len(key.Scope)+len(key.ID)) + r.acquire(p, token, until, 1)
	sh.bytes += d
	if s.maxBytes > 0 && d != reserved {
		s.bytes.Add(d - reserved)
	}
	*c = dedup.Claim{Key: key, Outcome: dedup.Acquired, Token: token, Attempt: 1, LeaseUntil: s.time(until)}
	return nil
}

// makeRoom frees one slot in a full shard: it samples up to 32 records
// (from a random place in its records), deletes the expired completed
// ones, and if there were none evicts the sampled completed record that
// expires soonest.
//
// A shard over the byte bound may hold few records far apart among its
// freed ones: past 1,024 records scanned the scan stops only once it has
// something to free (or evict), so that a shard holding such records does
// not refuse the key for having looked at free records only.
func (s *Store) makeRoom(sh *shard, now int64) error {
	const sample, scan = 32, 1024
	victim, victimUntil, freed := uint32(0), int64(-1), 0
	if top := sh.top; top > 0 {
		i, seen := rand.Uint32N(top), 0
		for scanned := uint32(1); scanned <= top; scanned++ {
			if r := sh.rec(i); r.idp != nil {
				if r.completed() {
					if r.until <= now {
						s.dropRecord(sh, i)
						freed++
					} else if victimUntil < 0 || r.until < victimUntil {
						victim, victimUntil = i, r.until
					}
				}
				if seen++; seen == sample {
					break
				}
			}
			if i++; i == top {
				i = 0
			}
			if scanned >= scan && (freed > 0 || victimUntil >= 0 && !s.strict) {
				break
			}
		}
	}
	switch {
	case freed > 0:
		return nil
	case victimUntil >= 0 && !s.strict:
		s.dropRecord(sh, victim)
		s.evicted.Add(1)
		return nil
	}
	return &dedup.StoreError{Store: storeName, Op: "claim", Err: dedup.ErrFull, NotApplied: true}
}

// fitBytes makes room in sh for a new record of size bytes under the byte
// bound, as makeRoom does for the record count, a few rounds at most, and
// counts them in the bound (reserve) once they fit.
func (s *Store) fitBytes(sh *shard, size int64, now int64) error {
	for range 4 {
		if s.reserve(size) {
			return nil
		}
		if s.makeRoom(sh, now) != nil {
			break
		}
	}
	if s.reserve(size) {
		return nil
	}
	return &dedup.StoreError{Store: storeName, Op: "claim", Err: errOverBytes, NotApplied: true}
}

// reserve counts size bytes more in the store's bound if they fit under
// it, in one step, and reports whether they did.
func (s *Store) reserve(size int64) bool {
	for {
		cur := s.bytes.Load()
		if cur+size > s.maxBytes {
			return false
		}
		if s.bytes.CompareAndSwap(cur, cur+size) {
			return true
		}
	}
}

// lookup finds the record of key, whose ID hashes to h, in sh.
func (sh *shard) lookup(key dedup.Key, h uint64) (pos uint64, ri uint32, ok bool) {
	sid, ok := sh.scopeID(key.Scope)
	if !ok {
		return 0, 0, false
	}
	return sh.find(mix(h, sid), sid, key.ID)
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
	h, sh := s.hash(c.Key.ID)
	now := s.now()
	sh.mu.Lock()
	err := s.completeLocked(sh, &c, h, result, retention, now)
	sh.mu.Unlock()
	if err != nil {
		if verr := c.Key.Validate(); verr != nil {
			return verr
		}
	}
	return err
}

func (s *Store) completeLocked(sh *shard, c *dedup.Claim, h uint64, result []byte, retention time.Duration, now int64) error {
	_, ri, ok := sh.lookup(c.Key, h)
	if !ok {
		return dedup.ErrLeaseLost
	}
	r := sh.rec(ri)
	switch {
	case r.token != c.Token:
		return dedup.ErrLeaseLost
	case r.completed(): // the same owner completing again: no change
		return nil
	}
	r.meta |= completedBit
	r.until = dedup.DeadlineNanos(now, retention)
	if len(result) > 0 {
		if r.meta&extraBit == 0 {
			r.setExtra(&extra{})
			s.addBytes(sh, extraOverhead)
		}
		r.more.result = clone(result)
		s.addBytes(sh, int64(len(result)))
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
	for i := range items {
		it := &items[i]
		h, sh := s.hash(it.Claim.Key.ID)
		sh.mu.Lock()
		errs[i] = s.completeLocked(sh, &it.Claim, h, it.Result, retention, now)
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
	if s.release(c) {
		return nil
	}
	return dedup.ErrLeaseLost
}

// release drops the record of c if c's token holds it in progress, and
// reports whether it did.
func (s *Store) release(c dedup.Claim) bool {
	h, sh := s.hash(c.Key.ID)
	sh.mu.Lock()
	pos, ri, ok := sh.lookup(c.Key, h)
	if ok {
		if r := sh.rec(ri); r.token == c.Token && !r.completed() {
			s.drop(sh, pos, ri)
			sh.mu.Unlock()
			return true
		}
	}
	sh.mu.Unlock()
	return false
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
	h, sh := s.hash(c.Key.ID)
	now := s.now()
	sh.mu.Lock()
	_, ri, ok := sh.lookup(c.Key, h)
	if ok {
		if r := sh.rec(ri); r.token == c.Token && !r.completed() {
			r.until = dedup.DeadlineNanos(now, lease)
			c.LeaseUntil = s.time(r.until)
			sh.mu.Unlock()
			return c, nil
		}
	}
	sh.mu.Unlock()
	return c, dedup.ErrLeaseLost
}

// ClaimBatch implements [dedup.BatchClaimer]. Each key is claimed
// atomically; the batch as a whole is not one atomic step (neither is it
// in any networked store), which the contract allows. A batch refused part
// way (ErrFull) releases the keys it had acquired, as [dedup.ClaimBatch]'s
// fallback does.
func (s *Store) ClaimBatch(ctx context.Context, reqs []dedup.ClaimRequest, lease time.Duration) ([]dedup.Claim, error) {
	if err := dedup.ValidateBatch(reqs, lease); err != nil {
		return nil, err
	}
	if err := s.begin(ctx, "claim batch"); err != nil {
		return nil, err
	}
	out := make([]dedup.Claim, len(reqs))
	now := s.now()
	for i := range reqs {
		req := &reqs[i]
		p := parsePrint(req.Fingerprint)
		h, sh := s.hash(req.Key.ID)
		if err := s.claimIn(sh, req.Key, h, &p, lease, now, &out[i]); err != nil {
			// The caller gets no claims to complete or release: the keys
			// acquired so far would stay in progress, owned by nobody,
			// until their leases end.
			for _, c := range out[:i] {
				if c.Outcome == dedup.Acquired {
					s.release(c)
				}
			}
			return nil, err
		}
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
		for ri := uint32(0); ri < sh.top && n < limit; ri++ {
			if r := sh.rec(ri); r.idp != nil && r.completed() && r.until <= now {
				s.dropRecord(sh, ri)
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
	st := Stats{Evicted: s.evicted.Load()}
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		st.Records += sh.n
		st.Bytes += sh.bytes
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
		sh.reset() // a call that began before Close finds an empty shard
		sh.mu.Unlock()
	}
	s.bytes.Store(0)
	return nil
}

// newToken is [dedup.NewToken] with the bytes stored eight at a time.
func newToken() (t dedup.Token) {
	for {
		a, b := rand.Uint64(), rand.Uint64()
		if a|b != 0 {
			binary.LittleEndian.PutUint64(t[:8], a)
			binary.LittleEndian.PutUint64(t[8:], b)
			return t
		}
	}
}

func clone(b []byte) []byte {
	if len(b) == 0 {
		return nil
	}
	return append([]byte(nil), b...)
}
