package memstore

import (
	"context"
	"errors"
	"hash/maphash"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/storetest"
)

// TestClaimBatchFullReleasesWhatItTook: a batch refused part way with
// ErrFull returns no claims, so the keys it acquired before the refusal
// would stay in progress, owned by nobody, until their leases end (and in
// a strict store hold capacity nothing can evict). They are released, as
// the dedup.ClaimBatch fallback does.
func TestClaimBatchFullReleasesWhatItTook(t *testing.T) {
	ctx := context.Background()
	s, err := New(WithShards(1), WithCapacity(4), WithStrictCapacity())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var reqs []dedup.ClaimRequest
	for i := range 6 {
		reqs = append(reqs, dedup.ClaimRequest{Key: dedup.Key{Scope: "s", ID: strconv.Itoa(i)}})
	}
	if _, err := s.ClaimBatch(ctx, reqs, time.Hour); !errors.Is(err, dedup.ErrFull) {
		t.Fatalf("batch of 6 in a strict store of 4: %v, want ErrFull", err)
	}
	if st := s.Stats(); st.Records != 0 {
		t.Errorf("after the refused batch: %d records held, want 0", st.Records)
	}
	// The redelivered messages are claimed at once, not reported in
	// progress for an hour.
	for _, r := range reqs[:4] {
		c, err := s.Claim(ctx, r.Key, "", time.Minute)
		if err != nil || c.Outcome != dedup.Acquired {
			t.Fatalf("claim of %v after the refused batch: %v %v, want acquired", r.Key, c.Outcome, err)
		}
	}
	checkTable(t, s)
}

// TestMakeRoomFindsSparseRecords: a byte-bounded shard whose live records
// are few and far apart in its records (the others released) must still
// find them to make room: a non-strict store evicts a live completed
// record and a strict one drops an expired one, instead of refusing the
// new key with ErrFull because the scan saw only free records.
func TestMakeRoomFindsSparseRecords(t *testing.T) {
	for _, strict := range []bool{false, true} {
		t.Run("strict="+strconv.FormatBool(strict), func(t *testing.T) {
			ctx := context.Background()
			clock := storetest.NewClock()
			opts := []Option{WithClock(clock), WithShards(1), WithMaxBytes(1 << 20)}
			if strict {
				opts = append(opts, WithStrictCapacity())
			}
			s, err := New(opts...)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			var claims []dedup.Claim
			for i := range 6000 {
				c, err := s.Claim(ctx, dedup.Key{Scope: "s", ID: strconv.Itoa(i)}, "", time.Hour)
				if err != nil {
					t.Fatal(err)
				}
				claims = append(claims, c)
			}
			// Keep the last 8 records (indexes 5992-5999), release the rest.
			for _, c := range claims[:len(claims)-8] {
				if err := s.Release(ctx, c); err != nil {
					t.Fatal(err)
				}
			}
			ret := time.Hour
			if strict {
				ret = time.Second
			}
			for _, c := range claims[len(claims)-8:] {
				if err := s.Complete(ctx, c, make([]byte, 140<<10), ret); err != nil {
					t.Fatal(err)
				}
			}
			clock.Advance(2 * time.Second) // the strict store's records expire
			if st := s.Stats(); st.Bytes < 1<<20-1000 {
				t.Fatalf("%+v: want the byte bound reached", st)
			}
			// Every new key must get room (it takes a freed record, next
			// to the live ones: the free list is last in, first out) and
			// its result passes the bound again.
			for i := range 40 {
				k := dedup.Key{Scope: "s", ID: "new-" + strconv.Itoa(i)}
				c, err := s.Claim(ctx, k, "", time.Minute)
				if err != nil {
					t.Fatalf("claim %d of a new key with %+v: %v", i, s.Stats(), err)
				}
				if err := s.Complete(ctx, c, make([]byte, 140<<10), ret); err != nil {
					t.Fatal(err)
				}
				clock.Advance(2 * time.Second)
				checkTable(t, s)
			}
		})
	}
}

// collidingIDs returns n pairs of IDs whose hashes, mixed with the given
// scope numbers, agree in their low 32 bits (the slot word's tag).
func collidingIDs(s *Store, sidA, sidB uint32, n int) [][2]string {
	seen := map[uint32]string{}
	var pairs [][2]string
	for i := 0; len(pairs) < n; i++ {
		a := "a" + strconv.Itoa(i)
		seen[uint32(mix(maphash.String(s.seed, a), sidA))] = a
		b := "b" + strconv.Itoa(i)
		if x, ok := seen[uint32(mix(maphash.String(s.seed, b), sidB))]; ok {
			pairs = append(pairs, [2]string{x, b})
			delete(seen, uint32(mix(maphash.String(s.seed, x), sidA)))
		}
	}
	return pairs
}

// TestEqualTagsInOneRun: keys whose slot words carry the same 32-bit hash
// tag (so the same home slot at any table size) in one probe run, in the
// same scope and in two scopes, stay distinct keys through claims,
// completions, releases of the one before or after the other in the run,
// growth and expiry.
func TestEqualTagsInOneRun(t *testing.T) {
	ctx := context.Background()
	clock := storetest.NewClock()
	s, err := New(WithClock(clock), WithShards(1))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	// Scope "first" is number 0, "second" number 1.
	first := dedup.Key{Scope: "first", ID: "seed"}
	c0, err := s.Claim(ctx, first, "", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	second := dedup.Key{Scope: "second", ID: "seed"}
	c1, err := s.Claim(ctx, second, "", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		sa, sb string
		ia, ib uint32
	}{
		{"same scope", "first", "first", 0, 0},
		{"two scopes", "first", "second", 0, 1},
		{"two other scopes", "second", "second", 1, 1},
	} {
		pairs := collidingIDs(s, tc.ia, tc.ib, 4)
		for pi, p := range pairs {
			ka, kb := dedup.Key{Scope: tc.sa, ID: p[0]}, dedup.Key{Scope: tc.sb, ID: p[1]}
			ca, err := s.Claim(ctx, ka, "", time.Hour)
			if err != nil || ca.Outcome != dedup.Acquired {
				t.Fatalf("%s %d: claim a: %v %v", tc.name, pi, ca.Outcome, err)
			}
			cb, err := s.Claim(ctx, kb, "", time.Hour)
			if err != nil || cb.Outcome != dedup.Acquired {
				t.Fatalf("%s %d: claim b: %v %v (a colliding tag taken for b's key)", tc.name, pi, cb.Outcome, err)
			}
			if err := s.Complete(ctx, cb, []byte("b"), time.Hour); err != nil {
				t.Fatal(err)
			}
			// Releasing a (before b in the run) shifts b back: b stays a
			// duplicate with its own result, a is claimable again.
			if err := s.Release(ctx, ca); err != nil {
				t.Fatal(err)
			}
			checkTable(t, s)
			if c, err := s.Claim(ctx, kb, "", time.Hour); err != nil || c.Outcome != dedup.Duplicate || string(c.Result) != "b" {
				t.Fatalf("%s %d: b after a's release: %v %q %v", tc.name, pi, c.Outcome, c.Result, err)
			}
			ca, err = s.Claim(ctx, ka, "", time.Hour)
			if err != nil || ca.Outcome != dedup.Acquired || ca.Attempt != 1 {
				t.Fatalf("%s %d: a again: %v %d %v", tc.name, pi, ca.Outcome, ca.Attempt, err)
			}
			if err := s.Complete(ctx, cb, nil, time.Hour); err != nil {
				t.Fatalf("%s %d: b completed again by its token: %v", tc.name, pi, err)
			}
			// a's token does not complete b and b's does not release a.
			if err := s.Release(ctx, dedup.Claim{Key: ka, Outcome: dedup.Acquired, Token: cb.Token}); !errors.Is(err, dedup.ErrLeaseLost) {
				t.Fatalf("%s %d: release of a by b's token: %v", tc.name, pi, err)
			}
		}
		// Grow the table past the pairs, then let b's expire and sweep.
		for i := range 300 {
			if _, err := s.Claim(ctx, dedup.Key{Scope: tc.sb, ID: tc.name + "/fill" + strconv.Itoa(i)}, "", time.Hour); err != nil {
				t.Fatal(err)
			}
		}
		checkTable(t, s)
		for pi, p := range pairs {
			ka := dedup.Key{Scope: tc.sa, ID: p[0]}
			if c, err := s.Claim(ctx, ka, "", time.Hour); err != nil || c.Outcome != dedup.InProgress {
				t.Fatalf("%s %d: a after growth: %v %v", tc.name, pi, c.Outcome, err)
			}
		}
	}
	clock.Advance(2 * time.Hour)
	if _, err := s.Sweep(ctx, 1<<20); err != nil {
		t.Fatal(err)
	}
	checkTable(t, s)
	if err := s.Complete(ctx, c0, nil, time.Hour); err != nil {
		t.Fatal(err)
	}
	if err := s.Complete(ctx, c1, nil, time.Hour); err != nil {
		t.Fatal(err)
	}
}

// TestScopeNumberReuse: a scope whose last record goes gives its number
// to the next new scope; the new scope's keys never find a record of the
// old one (same ID, same number), and the old scope, back again, starts
// empty.
func TestScopeNumberReuse(t *testing.T) {
	ctx := context.Background()
	clock := storetest.NewClock()
	s, err := New(WithClock(clock), WithShards(1))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := s.Claim(ctx, dedup.Key{Scope: "zero", ID: "x"}, "", time.Hour); err != nil {
		t.Fatal(err)
	}
	prev := ""
	for round := range 50 {
		scope := "scope-" + strconv.Itoa(round)
		var claims []dedup.Claim
		for i := range 5 {
			k := dedup.Key{Scope: scope, ID: "id-" + strconv.Itoa(i)}
			c, err := s.Claim(ctx, k, dedup.FingerprintOf([]byte(scope)), time.Hour)
			if err != nil || c.Outcome != dedup.Acquired || c.Attempt != 1 {
				t.Fatalf("round %d: %v: %v attempt %d %v (found the previous scope's record?)", round, k, c.Outcome, c.Attempt, err)
			}
			claims = append(claims, c)
		}
		if prev != "" {
			// The previous scope is gone: its keys are new again.
			k := dedup.Key{Scope: prev, ID: "id-0"}
			c, err := s.Claim(ctx, k, "", time.Hour)
			if err != nil || c.Outcome != dedup.Acquired {
				t.Fatalf("round %d: old scope's key %v: %v %v", round, k, c.Outcome, err)
			}
			if err := s.Release(ctx, c); err != nil {
				t.Fatal(err)
			}
		}
		// Drop the scope's records three ways: release, expiry + sweep,
		// expiry + re-claim by another scope's miss.
		for i, c := range claims {
			switch i % 2 {
			case 0:
				if err := s.Release(ctx, c); err != nil {
					t.Fatal(err)
				}
			default:
				if err := s.Complete(ctx, c, []byte(scope), time.Second); err != nil {
					t.Fatal(err)
				}
			}
		}
		clock.Advance(2 * time.Second)
		if _, err := s.Sweep(ctx, 1<<20); err != nil {
			t.Fatal(err)
		}
		checkTable(t, s)
		if m := s.shards[0].multi; m == nil || len(m.ids) != 0 {
			t.Fatalf("round %d: scopes left %v", round, m.ids)
		}
		prev = scope
	}
	if m := s.shards[0].multi; len(m.names) > 2 {
		t.Fatalf("%d scope numbers for at most two scopes at a time", len(m.names))
	}
}

// TestConcurrentFewKeys: many goroutines claim, complete, release and
// extend few keys with a short lease under -race: at most one holder of
// a key at a time, and each key's effect applied exactly once.
func TestConcurrentFewKeys(t *testing.T) {
	ctx := context.Background()
	s, err := New(WithShards(2), WithCapacity(64))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	const keys, workers, rounds = 6, 32, 300
	var holders [keys * 3]atomic.Int32
	var applied [keys * 3]atomic.Int32
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rnd := rand.New(rand.NewPCG(uint64(w), 1))
			for range rounds {
				ki := rnd.IntN(keys * 3)
				k := dedup.Key{Scope: "s" + strconv.Itoa(ki%3), ID: strconv.Itoa(ki / 3)}
				c, err := s.Claim(ctx, k, "", time.Hour)
				if err != nil {
					t.Error(err)
					return
				}
				if c.Outcome != dedup.Acquired {
					continue
				}
				if n := holders[ki].Add(1); n != 1 {
					t.Errorf("%v: %d holders", k, n)
				}
				if rnd.IntN(3) == 0 {
					if _, err := s.Extend(ctx, c, time.Hour); err != nil {
						t.Error(err)
					}
				}
				if rnd.IntN(2) == 0 {
					holders[ki].Add(-1)
					if err := s.Release(ctx, c); err != nil {
						t.Error(err)
					}
					continue
				}
				applied[ki].Add(1)
				holders[ki].Add(-1)
				if err := s.Complete(ctx, c, []byte("r"), time.Hour); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	for ki := range applied {
		if n := applied[ki].Load(); n > 1 {
			t.Errorf("key %d applied %d times", ki, n)
		}
	}
	checkTable(t, s)
}

// TestScopeNumbersFitTheRecord: a shard of maxPerShard records, the
// first scope's records all gone and every other record in a scope of its
// own, numbers its scopes up to maxPerShard; the largest must survive the
// record's meta, or its record would read as the first scope's (a key of
// one scope found under another, an ID of the other scope never found).
func TestScopeNumbersFitTheRecord(t *testing.T) {
	sid := uint32(maxPerShard)
	r := record{meta: sid<<scopeShift | completedBit | fpDigest}
	if got := r.meta >> scopeShift; got != sid {
		t.Fatalf("scope number %d reads back as %d", sid, got)
	}
	if _, err := New(WithShards(1), WithCapacity(maxPerShard+1)); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Fatalf("a shard of %d records: %v, want ErrInvalidArgument", maxPerShard+1, err)
	}
}

// TestConcurrentBatchesUnderPressure: batches of one to three keys (a key
// may repeat) from many goroutines in a store of 8 records under a byte
// bound, evicting and strict, with short retentions and refused batches
// rolled back: at most one holder of a key at a time, and every acquired
// claim completes or releases.
func TestConcurrentBatchesUnderPressure(t *testing.T) {
	ctx := context.Background()
	for _, strict := range []bool{false, true} {
		opts := []Option{WithShards(2), WithCapacity(8), WithMaxBytes(3000)}
		if strict {
			opts = append(opts, WithStrictCapacity())
		}
		s, _ := New(opts...)
		const keys = 40
		var holders [keys]atomic.Int32
		var wg sync.WaitGroup
		for w := range 32 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rnd := rand.New(rand.NewPCG(uint64(w), 2))
				for range 2000 {
					var reqs []dedup.ClaimRequest
					var kis []int
					for range 1 + rnd.IntN(3) {
						ki := rnd.IntN(keys)
						kis = append(kis, ki)
						reqs = append(reqs, dedup.ClaimRequest{Key: dedup.Key{Scope: "s" + strconv.Itoa(ki%5), ID: strconv.Itoa(ki)}})
					}
					cs, err := s.ClaimBatch(ctx, reqs, time.Hour)
					if errors.Is(err, dedup.ErrFull) {
						continue
					}
					if err != nil {
						t.Error(err)
						return
					}
					for i, c := range cs {
						if c.Outcome != dedup.Acquired {
							continue
						}
						if n := holders[kis[i]].Add(1); n != 1 {
							t.Errorf("%v: %d holders", c.Key, n)
						}
					}
					for i, c := range cs {
						if c.Outcome != dedup.Acquired {
							continue
						}
						holders[kis[i]].Add(-1)
						if rnd.IntN(2) == 0 {
							if err := s.Release(ctx, c); err != nil {
								t.Error(err)
							}
						} else if err := s.Complete(ctx, c, []byte("rrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrr"), time.Duration(1+rnd.IntN(3))*time.Millisecond); err != nil {
							t.Error(err)
						}
					}
				}
			}()
		}
		wg.Wait()
		checkTable(t, s)
		for si := range s.shards {
			sh := &s.shards[si]
			for ri := range sh.top {
				if r := sh.rec(ri); r.idp != nil && !r.completed() {
					t.Errorf("strict=%v: %q left in progress, owned by nobody", strict, r.id())
				}
			}
		}
		s.Close()
	}
}
