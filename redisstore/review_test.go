package redisstore_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
)

// TestCompleteBatchSameClaimTwice: a batch that completes one claim twice
// (the same key and token, two results) completes it once: the second
// item is "already done by this token", which changes nothing, as a
// second Complete does. The script reads every key with one MGET before
// it writes, so it must not decide the second item on the value it read
// before the first item's write (which overwrote the stored result).
func TestCompleteBatchSameClaimTwice(t *testing.T) {
	for name, addrs := range map[string][]string{"standalone": standaloneAddrs(t), "cluster": clusterAddrs(t)} {
		t.Run(name, func(t *testing.T) {
			s := open(t, addrs)
			ctx := context.Background()
			k := dedup.Key{Scope: fmt.Sprintf("rev1-twice-%d", time.Now().UnixNano()), ID: "m1"}
			fp := dedup.FingerprintOf([]byte("p"))
			c, err := s.Claim(ctx, k, fp, time.Minute)
			if err != nil || c.Outcome != dedup.Acquired {
				t.Fatalf("claim: %v %v", c.Outcome, err)
			}
			errs, err := s.CompleteBatch(ctx, []dedup.Completion{{Claim: c, Result: []byte("first")}, {Claim: c, Result: []byte("second")}}, time.Hour)
			if err != nil || errs[0] != nil || errs[1] != nil {
				t.Fatalf("complete batch: %v %v", errs, err)
			}
			d, err := s.Claim(ctx, k, fp, time.Minute)
			if err != nil || d.Outcome != dedup.Duplicate {
				t.Fatalf("claim after: %v %v", d.Outcome, err)
			}
			if string(d.Result) != "first" {
				t.Fatalf("stored result %q, want %q: completing an already completed claim changed its record", d.Result, "first")
			}
		})
	}
}
