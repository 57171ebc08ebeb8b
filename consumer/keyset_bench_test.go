package consumer

import (
	"strconv"
	"testing"

	"github.com/dedupkit/dedup"
)

// BenchmarkKeySetAdd measures adding n distinct keys to a keySet (a
// batch's prepare) and looking them up in a second set (overlaps), with a
// map of the keys as the reference.
func BenchmarkKeySetAdd(b *testing.B) {
	for _, n := range []int{100, 300, 1000, 4096, 20000} {
		keys := make([]dedup.Key, n)
		other := make([]dedup.Key, n)
		for i := range keys {
			keys[i] = dedup.Key{Scope: "s", ID: "k" + strconv.Itoa(i)}
			other[i] = dedup.Key{Scope: "s", ID: "o" + strconv.Itoa(i)}
		}
		b.Run("keyset-"+strconv.Itoa(n), func(b *testing.B) {
			var s, o keySet
			for b.Loop() {
				s.reset()
				o.reset()
				for _, k := range keys {
					s.add(k)
				}
				for _, k := range other {
					o.add(k)
				}
				if s.meets(&o) {
					b.Fatal("meets")
				}
			}
		})
		b.Run("map-"+strconv.Itoa(n), func(b *testing.B) {
			s, o := map[dedup.Key]struct{}{}, map[dedup.Key]struct{}{}
			for b.Loop() {
				clear(s)
				clear(o)
				for _, k := range keys {
					s[k] = struct{}{}
				}
				for _, k := range other {
					o[k] = struct{}{}
				}
				for k := range o {
					if _, ok := s[k]; ok {
						b.Fatal("meets")
					}
				}
			}
		})
	}
}
