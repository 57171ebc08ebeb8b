package pgstore_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
)

// Two fingerprints a user can make that differ only after their first 32
// hexadecimal digits (or a text fingerprint and the "sha256:" spelling of
// its own digest) are different requests: a claim with the second after
// the first completed is a mismatch, never a duplicate that replays the
// first one's result. The compact records must not store them alike.
func TestFingerprintDifferentLateIsMismatch(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		ctx := context.Background()
		head := strings.Repeat("ab", 16)
		plain := dedup.Fingerprint("refund order 7")
		pairs := [][2]dedup.Fingerprint{
			{dedup.Fingerprint("sha256:" + head + strings.Repeat("0", 32)), dedup.Fingerprint("sha256:" + head + strings.Repeat("1", 32))},
			{dedup.FingerprintOf([]byte("amount=100")), dedup.FingerprintOf([]byte("amount=100"))[:39] + dedup.Fingerprint(strings.Repeat("f", 32))},
			{plain, dedup.FingerprintOf([]byte(plain))},
		}
		for i, p := range pairs {
			if p[0] == p[1] {
				t.Fatalf("pair %d: not different", i)
			}
			id := "fp-pair-" + string(rune('a'+i))
			c := mustClaim(t, s, id, p[0], time.Minute, dedup.Acquired)
			if err := s.Complete(ctx, c, []byte("result of "+string(p[0])), time.Hour); err != nil {
				t.Fatal(err)
			}
			got, err := s.Claim(ctx, key(id), p[1], time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if got.Outcome != dedup.Mismatch {
				t.Errorf("pair %d: claim with %q after %q completed = %v (result %q), want mismatch", i, p[1], p[0], got.Outcome, got.Result)
			}
			res, err := s.ClaimBatch(ctx, []dedup.ClaimRequest{{Key: key(id), Fingerprint: p[1]}}, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if res[0].Outcome != dedup.Mismatch {
				t.Errorf("pair %d: batch claim with %q = %v, want mismatch", i, p[1], res[0].Outcome)
			}
			// In progress with the second: a claim with the first is a mismatch too.
			id2 := id + "-held"
			mustClaim(t, s, id2, p[1], time.Minute, dedup.Acquired)
			mustClaim(t, s, id2, p[0], time.Minute, dedup.Mismatch)
		}
	})
}
