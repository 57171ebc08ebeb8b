package window

import (
	"math"
	"math/bits"
	"sync"
	"sync/atomic"
)

// bloom is an ageing Bloom filter: G generations, each a standard Bloom
// filter of m bits and k probes sized for keys/G keys, of which the newest
// takes insertions. When the newest has taken keys/G keys (or, with a
// rotation period, when the period has passed) the oldest generation is
// cleared and becomes the newest. A key is a "maybe" when all k of its bits
// are set in one live generation.
//
// The generations are interleaved word by word: word w of generation g is
// words[w*G+g]. The k probe positions of a key are the same in every
// generation, so one probe reads the same word of all generations from one
// cache line, or two adjacent ones: a test costs about as many cache misses
// as a single Bloom filter, not G times as many.
//
// Reads and writes are lock-free: bits are set with an atomic OR and read
// with atomic loads; a mutex only serialises rotations. A rotation first
// takes the oldest generation out of the live mask (tests stop reading it),
// clears it, and then publishes it as the newest; insertions meanwhile keep
// going to the previous newest generation, so no insertion is lost.
type bloom struct {
	words  []uint64
	g      uint64 // generations, the stride of words
	nbits  uint64 // bits per generation, a multiple of 64
	k      int
	perGen int64 // insertions before a rotation
	every  int64 // rotation period in ns; 0 = by count only

	// state is the newest generation (low 8 bits) and the mask of the
	// generations that tests read (bits 8 and up).
	state     atomic.Uint64
	gens      []genStats
	last      atomic.Int64 // time of the last rotation, ns since the window's base
	rotations atomic.Uint64
	mu        sync.Mutex // serialises rotate and reset
}

type genStats struct {
	keys   atomic.Int64 // insertions that set at least one new bit
	bits   atomic.Int64 // bits set
	maxExp atomic.Int64 // latest expiry of a key inserted
	_      [40]byte
}

// sizeMargin is how much lower than its share of the bound a generation's
// rate is computed: the textbook rate below assumes independent bits and
// reads a few percent low (without the margin the measured rate was 1-3%
// over the bound on average at the default size), and a 10% margin costs
// about 1.3% more memory.
const sizeMargin = 0.9

// bloomSize returns the bits per generation (a multiple of 64), the number
// of probes and the keys per generation of an ageing filter whose g live
// generations, holding keys keys in all, have a false-positive rate of at
// most p: each generation holds keys/g keys at a rate of at most
// 1-(1-p)^(1/g), less the margin.
func bloomSize(keys int, p float64, g int) (nbits uint64, k int, perGen int64) {
	perGen = int64((keys + g - 1) / g)
	n := float64(perGen)
	pg := -math.Expm1(math.Log1p(-p)/float64(g)) * sizeMargin
	m := math.Ceil(-n * math.Log(pg) / (math.Ln2 * math.Ln2))
	nbits = (uint64(m) + 63) &^ 63
	k = max(1, int(math.Round(float64(nbits)/n*math.Ln2)))
	for bloomRate(nbits, n, k) > pg { // integer k costs a little
		nbits += 64
	}
	return nbits, k, perGen
}

// bloomRate is the false-positive rate of a Bloom filter of m bits and k
// probes holding n keys.
func bloomRate(m uint64, n float64, k int) float64 {
	return math.Pow(-math.Expm1(-float64(k)*n/float64(m)), float64(k))
}

func newBloom(keys int, p float64, g int, every int64) *bloom {
	nbits, k, perGen := bloomSize(keys, p, g)
	b := &bloom{
		words:  make([]uint64, nbits/64*uint64(g)),
		g:      uint64(g),
		nbits:  nbits,
		k:      k,
		perGen: perGen,
		every:  every,
		gens:   make([]genStats, g),
	}
	b.initState(0)
	return b
}

func (b *bloom) allLive() uint64 { return 1<<b.g - 1 }

func (b *bloom) initState(now int64) {
	for i := range b.gens {
		b.gens[i].keys.Store(0)
		b.gens[i].bits.Store(0)
		b.gens[i].maxExp.Store(math.MinInt64)
	}
	b.last.Store(now)
	b.state.Store(b.allLive() << 8)
}

// live returns the generations worth reading at time now: in the live mask,
// not empty, and holding at least one key that has not expired.
func (b *bloom) live(now int64) uint64 {
	st := b.state.Load()
	live := st >> 8
	for m := live; m != 0; m &= m - 1 {
		g := bits.TrailingZeros64(m)
		if gs := &b.gens[g]; gs.keys.Load() == 0 || gs.maxExp.Load() <= now {
			live &^= 1 << g
		}
	}
	return live
}

// test reports whether the key hashed to (h1, h2) may be in a live
// generation.
func (b *bloom) test(h1, h2 uint64, now int64) bool {
	b.maybeRotate(now)
	acc := b.live(now)
	if acc == 0 {
		return false
	}
	h := h1
	for range b.k {
		idx, _ := bits.Mul64(h, b.nbits)
		base := (idx >> 6) * b.g
		bit := idx & 63
		// Read every generation's word, not only those still in acc: the
		// addresses then do not depend on earlier loads, so the CPU can
		// fetch the probes' cache lines in parallel.
		var found uint64
		ws := b.words[base : base+b.g]
		for g := range ws {
			found |= (atomic.LoadUint64(&ws[g]) >> bit & 1) << g
		}
		if acc &= found; acc == 0 {
			return false
		}
		h += h2
	}
	return true
}

// add inserts the key hashed to (h1, h2), whose record expires at exp, into
// the newest generation, and rotates when that generation is full.
func (b *bloom) add(h1, h2 uint64, exp, now int64) {
	b.maybeRotate(now)
	cur := b.state.Load() & 0xff
	// First read every probe's word: the loads are independent, so their
	// cache misses overlap, where an atomic OR would wait for the misses
	// before it one by one. Then set only the bits found clear: an OR of a
	// set bit would still take the cache line away from the other cores.
	var need uint64 // bit i%64: probe i found its bit clear
	h := h1
	for i := range b.k {
		idx, _ := bits.Mul64(h, b.nbits)
		if atomic.LoadUint64(&b.words[(idx>>6)*b.g+cur])&(1<<(idx&63)) == 0 {
			need |= 1 << (i & 63)
		}
		h += h2
	}
	var set int64
	h = h1
	for i := 0; i < b.k && need != 0; i++ {
		if need&(1<<(i&63)) != 0 {
			idx, _ := bits.Mul64(h, b.nbits)
			mask := uint64(1) << (idx & 63)
			if atomic.OrUint64(&b.words[(idx>>6)*b.g+cur], mask)&mask == 0 {
				set++
			}
		}
		h += h2
	}
	gs := &b.gens[cur]
	for {
		old := gs.maxExp.Load()
		if old >= exp || gs.maxExp.CompareAndSwap(old, exp) {
			break
		}
	}
	// A key whose bits were all set already adds nothing to the fill, so it
	// does not count towards the rotation.
	if set > 0 {
		gs.bits.Add(set)
		if gs.keys.Add(1) >= b.perGen {
			b.rotate(cur, now, false)
		}
	}
}

func (b *bloom) maybeRotate(now int64) {
	if b.every > 0 && now-b.last.Load() >= b.every {
		b.rotate(b.state.Load()&0xff, now, true)
	}
}

// rotate retires the oldest generation and makes it the newest, unless the
// newest generation is no longer cur (another caller rotated already) or,
// byTime, the period has not passed. By time, one rotation is done per
// period passed, up to G.
func (b *bloom) rotate(cur uint64, now int64, byTime bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	st := b.state.Load()
	if st&0xff != cur {
		return
	}
	times := uint64(1)
	if byTime {
		elapsed := now - b.last.Load()
		if elapsed < b.every {
			return
		}
		times = min(uint64(elapsed/b.every), b.g)
	}
	live := st >> 8
	for range times {
		old := (cur + 1) % b.g
		live &^= 1 << old
		b.state.Store(cur | live<<8)
		for i := old; i < uint64(len(b.words)); i += b.g {
			atomic.StoreUint64(&b.words[i], 0)
		}
		gs := &b.gens[old]
		gs.keys.Store(0)
		gs.bits.Store(0)
		gs.maxExp.Store(math.MinInt64)
		live |= 1 << old
		cur = old
		b.state.Store(cur | live<<8)
		b.rotations.Add(1)
	}
	b.last.Store(now)
}

// reset clears every generation.
func (b *bloom) reset(now int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.state.Store(0) // nothing is read while clearing
	for i := range b.words {
		atomic.StoreUint64(&b.words[i], 0)
	}
	b.initState(now)
}

// estimate returns the false-positive rate of the live generations from the
// bits they have set.
func (b *bloom) estimate(now int64) float64 {
	keep := 1.0
	for m := b.live(now); m != 0; m &= m - 1 {
		fill := float64(b.gens[bits.TrailingZeros64(m)].bits.Load()) / float64(b.nbits)
		keep *= 1 - math.Pow(fill, float64(b.k))
	}
	return 1 - keep
}
