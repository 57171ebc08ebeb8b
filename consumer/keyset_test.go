package consumer

import (
	"math/rand/v2"
	"strconv"
	"testing"

	"github.com/dedupkit/dedup"
)

// TestKeySetAsMap: keySet answers as a map of the same keys would, for
// sets large enough that many keys share a filter bit (1,000 keys in
// 4,096 bits) or every bit is set (up to 16,000 keys: looked up in the
// index), sets around the size at which the index is made, keys that
// differ only in their scope, an empty scope, and sets that are reset and
// filled again (small after large: an index left over must not answer).
func TestKeySetAsMap(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	space := 3000
	key := func() dedup.Key {
		scopes := []string{"", "a", "b", "orders"}
		return dedup.Key{Scope: scopes[rng.IntN(len(scopes))], ID: strconv.Itoa(rng.IntN(space))}
	}
	var a, b keySet
	for round := range 30 {
		n := 1 + rng.IntN(1000)
		space = 3000
		switch round % 3 {
		case 1: // around the scan's limit, where the index is made
			n = keySetScan - 2 + rng.IntN(6)
		case 2: // more keys than the filter's bits: every bit set
			n, space = 4096+rng.IntN(12000), 30000
		}
		ma, mb := map[dedup.Key]bool{}, map[dedup.Key]bool{}
		a.reset()
		b.reset()
		a.grow(n)
		for range n {
			k := key()
			if got, want := a.add(k), !ma[k]; got != want {
				t.Fatalf("round %d: add(%v) = %v, want %v", round, k, got, want)
			}
			ma[k] = true
		}
		for range 1 + rng.IntN(200) {
			k := key()
			b.add(k)
			mb[k] = true
		}
		want := false
		for k := range mb {
			want = want || ma[k]
		}
		if got := a.meets(&b); got != want {
			t.Fatalf("round %d: meets = %v, want %v", round, got, want)
		}
		if got := b.meets(&a); got != want {
			t.Fatalf("round %d: meets (the other way) = %v, want %v", round, got, want)
		}
		for range 500 {
			k := key()
			if got := a.has(k, hashKey(k)); got != ma[k] {
				t.Fatalf("round %d: has(%v) = %v, want %v", round, k, got, ma[k])
			}
		}
		if len(a.keys) != len(ma) {
			t.Fatalf("round %d: %d keys kept, want %d", round, len(a.keys), len(ma))
		}
	}
	a.reset()
	if a.has(dedup.Key{ID: "1"}, hashKey(dedup.Key{ID: "1"})) || a.meets(&b) {
		t.Fatal("an empty set has a key")
	}
}
