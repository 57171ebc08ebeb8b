package window

import (
	"math/bits"
	"sync"
	"sync/atomic"
	"unsafe"
)

// The exact record: per shard, an open-addressing hash table with Robin
// Hood probing and backward-shift deletion. Each slot holds a key's 128-bit
// hash (not the key), its expiry, its result and its last-use stamp in 40
// bytes, and a parallel probe array holds 4 bytes a slot: the entry's
// distance from its home slot and 16 more bits of its hash. A lookup walks
// the probe array (a tenth of the table's size, so it stays in the caches
// much longer) and reads a slot only on a tag match, so a miss, the common
// case, does not touch the slots at all. The table grows by doubling up to
// the size that holds the shard's limit at a load of 3/4: about 59 bytes a
// key when full.
//
// Eviction is sampled LRU, as Redis approximates LRU: each shard counts its
// insertions, and an entry's stamp is the count when it was last added or
// hit. To make room, a hand looks at the next 16 entries and reclaims the
// first expired one or else evicts the one with the oldest stamp, then
// moves past them, so the whole table is sampled in turn. A new entry is
// almost never the oldest of 16, so a key survives about as many
// insertions into its shard as the shard holds, and a hit renews it. It
// was chosen over CLOCK (second chance over the slots), which measured
// within 1% of LRU on a redelivery trace but can evict a key a few
// insertions after it was added (when its reference bit is cleared by a
// full turn of the hand), and over a real LRU list, which costs two
// pointers a key and a list move on every hit.

const (
	flagResult = 1 << 0
	flagBits   = 1

	// maxExpiry is the largest expiry that fits in slot.meta: 2^62 ns,
	// about 146 years after the window was created.
	maxExpiry = 1<<(63-flagBits) - 1

	minTable = 16
	sample   = 16 // entries looked at to choose a victim

	// A probe word is (distance from home + 1) << 16 | tag, 0 when empty.
	distOne = 1 << 16
	tagMask = distOne - 1
)

type slot struct {
	h1, h2 uint64
	meta   uint64 // expiry in ns since the window's base << flagBits | flags
	res    *byte  // first byte of the kept result, nil when it is empty
	rlen   uint32 // length of the kept result
	stamp  uint32 // the shard's insertion count when last added or hit
}

// result returns the kept result, shared.
func (s *slot) result() []byte { return unsafe.Slice(s.res, s.rlen) }

func (s *slot) expiry() int64 { return int64(s.meta >> flagBits) }

type shard struct {
	mu sync.Mutex
	// probe holds a 4-byte word per slot, the distance of its entry from
	// its home and 16 bits of its hash: a lookup walks this small array
	// and reads slots only on a tag match, so a miss does not touch slots.
	probe       []uint32
	slots       []slot
	count       int
	limit       int // most entries
	maxTable    int // most slots
	hand        int
	seq         uint32 // insertions, for stamps
	resultBytes int64
	hits        uint64 // the counters below mu are guarded by it
	misses      uint64
	evictions   uint64
	expired     uint64
	maybes      atomic.Uint64 // counted after the lock is released
	bloomMisses atomic.Uint64
	_           [64]byte // keep neighbouring shards off each other's cache lines
}

func (sh *shard) init(limit int) {
	sh.limit = limit
	// At most 3/4 full, and never completely full so probes end.
	sh.maxTable = max((limit*4+2)/3, limit+1)
	sh.reset()
}

func (sh *shard) reset() {
	n := min(minTable, sh.maxTable)
	sh.probe, sh.slots = make([]uint32, n), make([]slot, n)
	sh.count, sh.hand, sh.resultBytes = 0, 0, 0
}

// home returns the slot where h1 belongs in a table of n slots.
func home(h1 uint64, n int) int {
	hi, _ := bits.Mul64(h1, uint64(n))
	return int(hi)
}

// tag returns the 16 bits of h1 kept in the probe array; home uses the
// high bits.
func tag(h1 uint64) uint32 { return uint32(h1) & tagMask }

// find returns the index of the slot holding (h1, h2), or -1.
func (sh *shard) find(h1, h2 uint64) int {
	n := len(sh.probe)
	i := home(h1, n)
	t := tag(h1)
	for want := uint32(distOne); ; want += distOne {
		p := sh.probe[i]
		// Robin Hood: an empty slot, or an entry nearer its home than the
		// key would be, ends the run the key could be in.
		if p < want {
			return -1
		}
		if p&tagMask == t {
			if s := &sh.slots[i]; s.h1 == h1 && s.h2 == h2 {
				return i
			}
		}
		if i++; i == n {
			i = 0
		}
	}
}

// put records (h1, h2) with its expiry and result, replacing an entry of the
// same hash, and makes room first if the shard is full.
func (sh *shard) put(h1, h2 uint64, exp int64, res []byte, hasResult bool, now int64) {
	meta := uint64(exp) << flagBits
	if hasResult {
		meta |= flagResult
	}
	sh.seq++
	e := slot{h1: h1, h2: h2, meta: meta, res: unsafe.SliceData(res), rlen: uint32(len(res)), stamp: sh.seq}
	if i := sh.find(h1, h2); i >= 0 {
		s := &sh.slots[i]
		sh.resultBytes += int64(e.rlen) - int64(s.rlen)
		*s = e
		return
	}
	if sh.count >= sh.limit {
		sh.evict(now)
	}
	if sh.count+1 > len(sh.slots)*3/4 && len(sh.slots) < sh.maxTable {
		sh.grow()
	}
	sh.insert(e)
	sh.count++
	sh.resultBytes += int64(e.rlen)
}

// insert puts e, whose hash is not in the table, at the first slot of its
// probe run that is empty or holds an entry nearer its home, shifting the
// rest of the run forward by one slot.
func (sh *shard) insert(e slot) {
	n := len(sh.slots)
	p := home(e.h1, n)
	word := distOne | tag(e.h1)
	for ; sh.probe[p] >= word&^tagMask; word += distOne {
		if word>>16 == tagMask {
			panic("window: probe run too long") // needs 65535 colliding hashes in a row
		}
		p = sh.next(p)
	}
	end := p
	for sh.probe[end] != 0 {
		end = sh.next(end)
	}
	for i := end; i != p; {
		j := sh.prev(i)
		sh.probe[i], sh.slots[i] = sh.probe[j]+distOne, sh.slots[j]
		i = j
	}
	sh.probe[p], sh.slots[p] = word, e
	// The entries of (p, end] came from one slot back: keep the hand on the
	// entry it was about to look at.
	if h := sh.cyc(sh.hand - p); h > 0 && h <= sh.cyc(end-p) {
		sh.hand = sh.next(sh.hand)
	}
}

func (sh *shard) grow() {
	old, oldProbe := sh.slots, sh.probe
	n := min(2*len(old), sh.maxTable)
	sh.probe, sh.slots = make([]uint32, n), make([]slot, n)
	sh.hand = 0
	for i := range old {
		if oldProbe[i] != 0 {
			sh.insert(old[i])
		}
	}
}

func (sh *shard) next(i int) int {
	if i++; i == len(sh.slots) {
		return 0
	}
	return i
}

func (sh *shard) prev(i int) int {
	if i == 0 {
		return len(sh.slots) - 1
	}
	return i - 1
}

// cyc returns d modulo the table size, for d in (-size, size).
func (sh *shard) cyc(d int) int {
	if d < 0 {
		return d + len(sh.slots)
	}
	return d
}

// remove empties slot i and shifts the entries after it back towards their
// homes, so that no tombstones are needed.
func (sh *shard) remove(i int) {
	sh.resultBytes -= int64(sh.slots[i].rlen)
	sh.count--
	start := i
	for {
		j := sh.next(i)
		if sh.probe[j] < 2*distOne { // empty, or at its home
			sh.probe[i], sh.slots[i] = 0, slot{}
			break
		}
		sh.probe[i], sh.slots[i] = sh.probe[j]-distOne, sh.slots[j]
		i = j
	}
	// The entries of (start, i] moved one slot back: keep the hand on the
	// entry it was about to look at.
	if h := sh.cyc(sh.hand - start); h > 0 && h <= sh.cyc(i-start) {
		sh.hand = sh.prev(sh.hand)
	}
}

// evict frees one entry of a full shard: of the next sample entries from
// the hand, the first expired one, or else the least recently used.
func (sh *shard) evict(now int64) {
	victim, oldest := -1, uint32(0)
	i, seen := sh.hand, 0
	for {
		if sh.probe[i] != 0 {
			s := &sh.slots[i]
			if s.expiry() <= now {
				sh.hand = i
				sh.remove(i) // the next entry shifts into the hand: look at it next
				sh.expired++
				return
			}
			if age := sh.seq - s.stamp; victim < 0 || age > oldest {
				victim, oldest = i, age
			}
			seen++
		}
		if i = sh.next(i); seen == sample || i == sh.hand {
			break
		}
	}
	sh.hand = i
	sh.remove(victim)
	sh.evictions++
}
