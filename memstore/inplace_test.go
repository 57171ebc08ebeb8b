package memstore

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/storetest"
)

// TestClaimsAreTheCallers pins what Claim and ClaimBatch return now that
// the claim is written in place: a refused claim is the zero Claim (no
// field of a claim written before it), each claim owns its Result, and a
// batch's claims are each the one of its own key.
func TestClaimsAreTheCallers(t *testing.T) {
	ctx := context.Background()
	clock := storetest.NewClock()
	s, err := New(WithClock(clock), WithShards(1), WithCapacity(2), WithStrictCapacity())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	k := func(id string) dedup.Key { return dedup.Key{Scope: "s", ID: id} }
	a, err := s.Claim(ctx, k("a"), "", time.Minute)
	if err != nil || a.Outcome != dedup.Acquired || a.Attempt != 1 || a.TakenOver || a.Token == (dedup.Token{}) {
		t.Fatalf("claim of a: %+v %v", a, err)
	}
	if err := s.Complete(ctx, a, []byte("result"), time.Hour); err != nil {
		t.Fatal(err)
	}
	b, err := s.Claim(ctx, k("b"), "", time.Minute)
	if err != nil || b.Outcome != dedup.Acquired || b.Token == a.Token {
		t.Fatalf("claim of b: %+v %v", b, err)
	}
	// Full and strict: refused, and nothing of an earlier claim shows.
	c, err := s.Claim(ctx, k("c"), "", time.Minute)
	if !errors.Is(err, dedup.ErrFull) || c.Outcome != 0 || c.Token != (dedup.Token{}) || c.Key != (dedup.Key{}) || c.Attempt != 0 || !c.LeaseUntil.IsZero() {
		t.Fatalf("refused claim: %+v %v, want the zero Claim and ErrFull", c, err)
	}
	d1, err1 := s.Claim(ctx, k("a"), "", time.Minute)
	d2, err2 := s.Claim(ctx, k("a"), "", time.Minute)
	if err1 != nil || err2 != nil || d1.Outcome != dedup.Duplicate || string(d1.Result) != "result" || d1.Token != (dedup.Token{}) || !d1.LeaseUntil.IsZero() {
		t.Fatalf("duplicate: %+v %v %v", d1, err1, err2)
	}
	copy(d1.Result, "XXXXXX")
	if string(d2.Result) != "result" {
		t.Fatalf("two duplicates share their Result: %q", d2.Result)
	}
	if d3, _ := s.Claim(ctx, k("a"), "", time.Minute); string(d3.Result) != "result" {
		t.Fatalf("a caller's change to a duplicate's Result reached the record: %q", d3.Result)
	}
	ip, err := s.Claim(ctx, k("b"), "", time.Minute)
	if err != nil || ip.Outcome != dedup.InProgress || ip.Token != (dedup.Token{}) || ip.Result != nil || ip.Attempt != 1 || !ip.LeaseUntil.Equal(b.LeaseUntil) {
		t.Fatalf("in progress: %+v %v", ip, err)
	}
	// A take-over after the lease: attempt 2, taken over, a new token.
	clock.Advance(2 * time.Minute)
	to, err := s.Claim(ctx, k("b"), "", time.Minute)
	if err != nil || to.Outcome != dedup.Acquired || !to.TakenOver || to.Attempt != 2 || to.Token == b.Token || to.Key != k("b") {
		t.Fatalf("take-over: %+v %v", to, err)
	}
	// A batch: each claim is its own key's, in order.
	if err := s.Complete(ctx, to, []byte("b done"), time.Hour); err != nil {
		t.Fatal(err)
	}
	cs, err := s.ClaimBatch(ctx, []dedup.ClaimRequest{{Key: k("b")}, {Key: k("a")}}, time.Minute)
	if err != nil || len(cs) != 2 || cs[0].Key != k("b") || string(cs[0].Result) != "b done" || cs[1].Key != k("a") || string(cs[1].Result) != "result" {
		t.Fatalf("batch: %+v %v", cs, err)
	}
	// A refused batch returns no claims.
	if cs, err := s.ClaimBatch(ctx, []dedup.ClaimRequest{{Key: k("a")}, {Key: k("new")}}, time.Minute); !errors.Is(err, dedup.ErrFull) || cs != nil {
		t.Fatalf("refused batch: %+v %v, want nil and ErrFull", cs, err)
	}
	checkTable(t, s)
}
