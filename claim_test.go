package dedup_test

import (
	"testing"
	"time"

	"github.com/dedupkit/dedup"
)

// TestClaimedRecordClaimFor reads every kind of row a single-statement
// claim can return.
func TestClaimedRecordClaimFor(t *testing.T) {
	own, other := dedup.NewToken(), dedup.NewToken()
	k := dedup.Key{Scope: "s", ID: "k"}
	until := time.Unix(100, 0)
	cases := []struct {
		name string
		rec  dedup.ClaimedRecord
		fp   dedup.Fingerprint
		own  dedup.Token
		want dedup.Outcome
	}{
		{"our token: acquired", dedup.ClaimedRecord{Token: own[:], Attempts: 1, LeaseUntil: until}, "a", own, dedup.Acquired},
		{"another owner, same fingerprint", dedup.ClaimedRecord{Token: other[:], Attempts: 1, Fingerprint: "a", LeaseUntil: until}, "a", own, dedup.InProgress},
		{"another owner, other fingerprint", dedup.ClaimedRecord{Token: other[:], Fingerprint: "b"}, "a", own, dedup.Mismatch},
		{"completed, same fingerprint", dedup.ClaimedRecord{Completed: true, Token: other[:], Fingerprint: "a", Result: []byte("r")}, "a", own, dedup.Duplicate},
		{"completed, other fingerprint", dedup.ClaimedRecord{Completed: true, Token: other[:], Fingerprint: "b", Result: []byte("r")}, "a", own, dedup.Mismatch},
		{"completed, no fingerprint asked", dedup.ClaimedRecord{Completed: true, Token: other[:], Fingerprint: "b"}, "", own, dedup.Duplicate},
		{"zero token never acquires", dedup.ClaimedRecord{Token: make([]byte, 16), Attempts: 1}, "", dedup.Token{}, dedup.InProgress},
	}
	for _, c := range cases {
		got := c.rec.ClaimFor(k, c.fp, c.own)
		if got.Outcome != c.want || got.Key != k {
			t.Errorf("%s: %v, want %v", c.name, got.Outcome, c.want)
		}
		if got.Outcome == dedup.Mismatch && (got.Result != nil || got.Attempt != 0) {
			t.Errorf("%s: a mismatch leaked the record: %+v", c.name, got)
		}
		if got.Outcome == dedup.Acquired && (got.Token != own || !got.LeaseUntil.Equal(until)) {
			t.Errorf("%s: %+v", c.name, got)
		}
	}
}
