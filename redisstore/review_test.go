package redisstore_test

import (
	"context"
	"errors"
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

// TestCompleteBatchStaleAndLiveTokenOfOneKey: one key twice in a batch,
// once with a dead token and once with the live one, in either order: the
// dead one is lease lost, the live one completes, and the record holds the
// live one's result. The second item is decided on what the first did.
func TestCompleteBatchStaleAndLiveTokenOfOneKey(t *testing.T) {
	for _, staleFirst := range []bool{true, false} {
		t.Run(fmt.Sprint("staleFirst=", staleFirst), func(t *testing.T) {
			s := open(t, standaloneAddrs(t))
			ctx := context.Background()
			k := dedup.Key{Scope: fmt.Sprintf("rev1-stale-live-%d", time.Now().UnixNano()), ID: "m1"}
			fp := dedup.FingerprintOf([]byte("p"))
			// Filler keys, so the items share a group with others.
			var items []dedup.Completion
			for i := range 3 {
				c, err := s.Claim(ctx, dedup.Key{Scope: k.Scope, ID: fmt.Sprint("f", i)}, fp, time.Minute)
				if err != nil || c.Outcome != dedup.Acquired {
					t.Fatalf("claim filler: %v %v", c.Outcome, err)
				}
				items = append(items, dedup.Completion{Claim: c, Result: []byte("f")})
			}
			c, err := s.Claim(ctx, k, fp, time.Minute)
			if err != nil || c.Outcome != dedup.Acquired {
				t.Fatalf("claim: %v %v", c.Outcome, err)
			}
			stale := c
			stale.Token = dedup.NewToken()
			pair := []dedup.Completion{{Claim: c, Result: []byte("live")}, {Claim: stale, Result: []byte("stale")}}
			if staleFirst {
				pair[0], pair[1] = pair[1], pair[0]
			}
			items = append(items[:1], append(pair, items[1:]...)...)
			errs, err := s.CompleteBatch(ctx, items, time.Hour)
			if err != nil {
				t.Fatal(err)
			}
			for i, it := range items {
				if dead := it.Claim.Token == stale.Token; dead != errors.Is(errs[i], dedup.ErrLeaseLost) || !dead && errs[i] != nil {
					t.Fatalf("item %d (%s): %v", i, it.Result, errs[i])
				}
			}
			d, err := s.Claim(ctx, k, fp, time.Minute)
			if err != nil || d.Outcome != dedup.Duplicate || string(d.Result) != "live" {
				t.Fatalf("claim after: %v %q %v, want a duplicate with the live result", d.Outcome, d.Result, err)
			}
		})
	}
}
