package redisstore

import (
	"fmt"
	"slices"
	"testing"
)

// TestGroupsNoKeyTwice: completeManyScript reads every key of its call
// before it writes any, so groups never puts a key twice in one group: a
// repeated key starts a later group (run after the earlier one in the same
// pipeline), the order of the items is kept, and a group still holds at
// most maxScriptKeys.
func TestGroupsNoKeyTwice(t *testing.T) {
	s := &Store{}
	got := s.groups([]string{"a", "b", "a", "c", "a", "b"})
	want := [][]int{{0, 1}, {2, 3}, {4, 5}}
	if !slices.EqualFunc(got, want, slices.Equal) {
		t.Fatalf("groups = %v, want %v", got, want)
	}
	keys := make([]string, 300)
	for i := range keys {
		keys[i] = fmt.Sprint("k", i)
	}
	got = s.groups(keys)
	if len(got) != 3 || len(got[0]) != maxScriptKeys || len(got[1]) != maxScriptKeys || len(got[2]) != 300-2*maxScriptKeys {
		t.Fatalf("300 distinct keys in groups of %d, %d, %d (%d groups)", len(got[0]), len(got[1]), len(got[len(got)-1]), len(got))
	}
	// On a cluster each slot has its groups; a key repeated goes to a new
	// group of its slot, the other slots' groups are unchanged.
	s.cluster = true
	a, b := "{x}a", "{y}b"
	got = s.groups([]string{a, b, a, b, a})
	for _, g := range got {
		seen := map[string]bool{}
		for _, i := range g {
			k := []string{a, b, a, b, a}[i]
			if seen[k] {
				t.Fatalf("cluster groups %v put %s twice in one group", got, k)
			}
			seen[k] = true
		}
	}
	if len(got) != 5 {
		t.Fatalf("cluster groups = %v, want 5 groups of one key", got)
	}
}
