package verify

import "testing"

// A double counts as lease mode's kill window only when every extra
// effect came from a process that died with that message in flight.
func TestKillWindowDoubles(t *testing.T) {
	deaths := map[int]map[string]bool{
		10: {"a": true, "b": true},
		11: {"c": true},
	}
	rows := map[string][]int{
		"a": {10, 12},     // killed, then the take-over: the window
		"b": {12, 10},     // order does not matter
		"c": {10, 12},     // 10 died, but not with c in flight: a bug
		"d": {12, 13},     // two live processes: a bug
		"e": {11},         // once
		"f": {10, 11, 12}, // 10 had f? no: only one of two extras explained
	}
	if got := killWindowDoubles(rows, deaths); got != 2 {
		t.Fatalf("killWindowDoubles = %d, want 2 (a and b)", got)
	}
}
