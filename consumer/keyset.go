package consumer

import (
	"hash/maphash"

	"github.com/dedupkit/dedup"
)

// keySeed seeds the hashes of keySet.
var keySeed = maphash.MakeSeed()

// keySet is the set of a batch's keys, for the two questions a batch
// asks of keys: is a key repeated inside the batch (prepare), and does
// the batch share a key with a batch in flight (Pipeline.overlaps). Each
// key is hashed once, when it is added; a 4096-bit filter of the hashes
// answers "not in the set" for most keys with one bit test, and only a
// key whose bit is set is looked for among the keys with its hash: in a
// small set by a scan of the hashes, in a set of more than keySetScan keys
// in an index of them (a scan there would make a batch of n keys cost n²
// comparisons once the filter fills: 0.9 s for 20,000 keys). A map would
// hash the key again at each lookup (one insert and a lookup for each
// batch in flight, every key). It is exact: a hash or bit shared by two
// keys costs a comparison, never a wrong answer.
type keySet struct {
	keys   []dedup.Key
	hashes []uint64 // hashes[i] is keys[i]'s
	bits   [keySetBits / 64]uint64
	// index holds 1 + the position of each key at a slot found from its
	// hash by linear probing (0: empty); a power of two at least twice
	// the keys, empty (len 0) while the set has at most keySetScan keys.
	index []int32
}

const (
	keySetBits = 4096
	keySetScan = 256 // keys a lookup may scan (a batch of 100 has no index); beyond, the index
)

// hashKey hashes a key's scope and ID.
func hashKey(k dedup.Key) uint64 {
	h := maphash.String(keySeed, k.ID)
	if k.Scope != "" {
		h ^= maphash.String(keySeed, k.Scope) * 0x9e3779b97f4a7c15
	}
	return h
}

// grow makes room for n keys.
func (s *keySet) grow(n int) {
	if cap(s.keys) < n {
		s.keys, s.hashes = make([]dedup.Key, 0, n), make([]uint64, 0, n)
	}
}

// add adds k and reports whether it was not in the set.
func (s *keySet) add(k dedup.Key) bool {
	h := hashKey(k)
	if s.has(k, h) {
		return false
	}
	s.keys, s.hashes = append(s.keys, k), append(s.hashes, h)
	s.bits[(h%keySetBits)/64] |= 1 << (h % 64)
	switch n := len(s.keys); {
	case n <= keySetScan:
	case 2*n > len(s.index):
		s.reindex(max(4*keySetScan, 2*len(s.index)))
	default:
		s.place(n - 1)
	}
	return true
}

// reindex makes an index of size slots (a power of two) of every key.
func (s *keySet) reindex(size int) {
	if cap(s.index) < size {
		s.index = make([]int32, size)
	} else {
		s.index = s.index[:size]
		clear(s.index)
	}
	for i := range s.keys {
		s.place(i)
	}
}

// place puts key i in the index, at the first empty slot from its hash's.
func (s *keySet) place(i int) {
	mask := uint64(len(s.index) - 1)
	for j := (s.hashes[i] >> 32) & mask; ; j = (j + 1) & mask {
		if s.index[j] == 0 {
			s.index[j] = int32(i + 1)
			return
		}
	}
}

// has reports whether k, whose hash is h, is in the set.
func (s *keySet) has(k dedup.Key, h uint64) bool {
	if s.bits[(h%keySetBits)/64]&(1<<(h%64)) == 0 {
		return false
	}
	if len(s.index) == 0 {
		for i, g := range s.hashes {
			if g == h && s.keys[i] == k {
				return true
			}
		}
		return false
	}
	mask := uint64(len(s.index) - 1)
	for j := (h >> 32) & mask; ; j = (j + 1) & mask {
		i := s.index[j] - 1
		if i < 0 {
			return false
		}
		if s.hashes[i] == h && s.keys[i] == k {
			return true
		}
	}
}

// meets reports whether s and o have a key in common.
func (s *keySet) meets(o *keySet) bool {
	a, b := s, o // look the smaller set up in the larger
	if len(o.keys) < len(a.keys) {
		a, b = o, s
	}
	for i, k := range a.keys {
		if b.has(k, a.hashes[i]) {
			return true
		}
	}
	return false
}

// reset empties the set, keeping its memory and dropping its keys.
func (s *keySet) reset() {
	clear(s.keys)
	s.keys, s.hashes, s.index = s.keys[:0], s.hashes[:0], s.index[:0]
	s.bits = [keySetBits / 64]uint64{}
}
