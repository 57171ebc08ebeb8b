package storetest

import (
	"testing"

	"github.com/dedupkit/dedup"
)

// TestLinearizableChecker: the checker accepts a history with a valid
// order and rejects the histories issue 12 found on the layered store.
func TestLinearizableChecker(t *testing.T) {
	a, b := dedup.NewToken(), dedup.NewToken()
	ok := []histOp{
		{call: 1, ret: 4, kind: opClaim, fp: fpA, outcome: dedup.Acquired, outToken: a},
		{call: 2, ret: 3, kind: opClaim, fp: fpA, outcome: dedup.InProgress}, // overlaps: may go after
		{call: 5, ret: 6, kind: opComplete, token: a, result: "r"},
		{call: 7, ret: 8, kind: opClaim, fp: "", outcome: dedup.Duplicate, outResult: "r"},
		{call: 9, ret: 10, kind: opClaim, fp: fpB, outcome: dedup.Mismatch},
		{call: 11, ret: 12, kind: opComplete, token: a, result: "r"},
		{call: 13, ret: 14, kind: opRelease, token: a, lost: true},
	}
	if !linearizable(ok) {
		t.Fatal("a linearizable history was rejected")
	}
	// Release is in flight; the owner's fenced call already fails, and a
	// later Claim still answers in progress: no order explains both.
	stale := []histOp{
		{call: 1, ret: 2, kind: opClaim, fp: fpA, outcome: dedup.Acquired, outToken: a},
		{call: 3, ret: 20, kind: opRelease, token: a},
		{call: 4, ret: 5, kind: opExtend, token: a, lost: true},
		{call: 6, ret: 7, kind: opClaim, fp: fpA, outcome: dedup.InProgress},
	}
	if linearizable(stale) {
		t.Fatal("a stale in-progress answer after the lease was lost was accepted")
	}
	// Two owners at once.
	double := []histOp{
		{call: 1, ret: 3, kind: opClaim, fp: fpA, outcome: dedup.Acquired, outToken: a},
		{call: 2, ret: 4, kind: opClaim, fp: fpA, outcome: dedup.Acquired, outToken: b},
	}
	if linearizable(double) {
		t.Fatal("two concurrent acquisitions were accepted")
	}
	// A duplicate with a result nobody stored.
	wrong := []histOp{
		{call: 1, ret: 2, kind: opClaim, fp: fpA, outcome: dedup.Acquired, outToken: a},
		{call: 3, ret: 4, kind: opComplete, token: a, result: "r"},
		{call: 5, ret: 6, kind: opClaim, fp: fpA, outcome: dedup.Duplicate, outResult: "other"},
	}
	if linearizable(wrong) {
		t.Fatal("a duplicate with another result was accepted")
	}
}
