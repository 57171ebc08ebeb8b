package memstore_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/storetest"
)

func newStore(t testing.TB, clock *storetest.Clock) dedup.Store {
	s, err := memstore.New(memstore.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func TestConformance(t *testing.T) {
	storetest.Run(t, newStore, storetest.Features{ManualClock: true, Extend: true, BatchClaim: true, BatchComplete: true, Sweep: true})
}

func TestBadOptions(t *testing.T) {
	for name, opts := range map[string][]memstore.Option{
		"nil clock":         {memstore.WithClock(nil)},
		"zero shards":       {memstore.WithShards(0)},
		"capacity < shards": {memstore.WithCapacity(3), memstore.WithShards(4)},
	} {
		if _, err := memstore.New(opts...); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("%s: error %v, want ErrInvalidArgument", name, err)
		}
	}
}

func fill(t *testing.T, s *memstore.Store, n int, ret time.Duration) {
	t.Helper()
	ctx := context.Background()
	for i := range n {
		c, err := s.Claim(ctx, dedup.Key{Scope: "s", ID: fmt.Sprint(i)}, "", time.Minute)
		if err != nil || c.Outcome != dedup.Acquired {
			t.Fatalf("claim %d: %v %v", i, c.Outcome, err)
		}
		if err := s.Complete(ctx, c, nil, ret); err != nil {
			t.Fatal(err)
		}
	}
}

// TestCapacityEvictsExpiredFirst: a full store drops expired records
// before it evicts any live one.
func TestCapacityEvictsExpiredFirst(t *testing.T) {
	clock := storetest.NewClock()
	s, _ := memstore.New(memstore.WithClock(clock), memstore.WithCapacity(8), memstore.WithShards(1))
	fill(t, s, 8, time.Second)
	clock.Advance(2 * time.Second)
	fill(t, s, 8, time.Hour) // reuses the expired slots: nothing live is evicted
	if st := s.Stats(); st.Evicted != 0 || st.Records > 8 {
		t.Fatalf("stats %+v: want no live eviction and at most 8 records", st)
	}
}

// TestCapacityEvictsLiveWhenFull: past capacity with nothing expired, the
// default evicts a live completed record and counts it; strict mode fails
// closed instead. In-progress records are never evicted.
func TestCapacityEvictsLiveWhenFull(t *testing.T) {
	ctx := context.Background()
	s, _ := memstore.New(memstore.WithCapacity(4), memstore.WithShards(1))
	fill(t, s, 5, time.Hour)
	if st := s.Stats(); st.Evicted != 1 || st.Records != 4 {
		t.Fatalf("stats %+v: want 1 eviction, 4 records", st)
	}

	strict, _ := memstore.New(memstore.WithCapacity(4), memstore.WithShards(1), memstore.WithStrictCapacity())
	fill(t, strict, 4, time.Hour)
	_, err := strict.Claim(ctx, dedup.Key{Scope: "s", ID: "overflow"}, "", time.Minute)
	if !errors.Is(err, dedup.ErrFull) || !dedup.IsStoreError(err) {
		t.Fatalf("strict full store: %v, want a store error wrapping ErrFull", err)
	}

	busy, _ := memstore.New(memstore.WithCapacity(2), memstore.WithShards(1))
	for i := range 2 {
		if _, err := busy.Claim(ctx, dedup.Key{Scope: "s", ID: fmt.Sprint(i)}, "", time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := busy.Claim(ctx, dedup.Key{Scope: "s", ID: "x"}, "", time.Hour); !errors.Is(err, dedup.ErrFull) {
		t.Fatalf("store full of in-progress records: %v, want ErrFull (never evict a lease)", err)
	}
	for i := range 2 {
		c, _ := busy.Claim(ctx, dedup.Key{Scope: "s", ID: fmt.Sprint(i)}, "", time.Hour)
		if c.Outcome != dedup.InProgress {
			t.Fatalf("in-progress record %d was evicted: %v", i, c.Outcome)
		}
	}
}

// TestFingerprintForms: a SHA-256 fingerprint is kept as its digest and
// any other as its text, and the answers are those of comparing the
// strings: the same digest in uppercase hex is another fingerprint, a
// digest never equals a text, the empty fingerprint matches both, and a
// take-over keeps the fingerprint of the claim it takes over.
func TestFingerprintForms(t *testing.T) {
	ctx := context.Background()
	clock := storetest.NewClock()
	s, err := memstore.New(memstore.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	a, b := dedup.FingerprintOf([]byte("a")), dedup.FingerprintOf([]byte("b"))
	upperA := dedup.Fingerprint("sha256:" + strings.ToUpper(string(a[len("sha256:"):])))
	short := a[:len(a)-1]
	forms := []dedup.Fingerprint{a, b, upperA, short, "custom", dedup.Fingerprint("sha256:" + strings.Repeat("g", 64))}
	for i, stored := range forms {
		key := dedup.Key{Scope: "fp", ID: strconv.Itoa(i)}
		c, err := s.Claim(ctx, key, stored, time.Minute)
		if err != nil || c.Outcome != dedup.Acquired {
			t.Fatalf("claim %q: %v %v", stored, c.Outcome, err)
		}
		// In progress, then completed: the same answers by string equality.
		for _, completed := range []bool{false, true} {
			for _, asked := range append(forms, "") {
				want := dedup.InProgress
				if completed {
					want = dedup.Duplicate
				}
				if !asked.Matches(stored) {
					want = dedup.Mismatch
				}
				got, err := s.Claim(ctx, key, asked, time.Minute)
				if err != nil || got.Outcome != want {
					t.Errorf("stored %q (completed %v), asked %q: %v %v, want %v", stored, completed, asked, got.Outcome, err, want)
				}
			}
			if !completed {
				if err := s.Complete(ctx, c, []byte("r"), time.Hour); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	// A take-over by a claim without a fingerprint keeps the original one.
	for i, stored := range []dedup.Fingerprint{a, "custom"} {
		key := dedup.Key{Scope: "takeover", ID: strconv.Itoa(i)}
		if c, err := s.Claim(ctx, key, stored, time.Second); err != nil || c.Outcome != dedup.Acquired {
			t.Fatalf("claim: %v %v", c.Outcome, err)
		}
		clock.Advance(2 * time.Second)
		c, err := s.Claim(ctx, key, "", time.Minute)
		if err != nil || c.Outcome != dedup.Acquired || !c.TakenOver {
			t.Fatalf("take-over: %+v %v", c, err)
		}
		if got, _ := s.Claim(ctx, key, b, time.Minute); got.Outcome != dedup.Mismatch {
			t.Errorf("%q taken over: another fingerprint got %v, want a mismatch", stored, got.Outcome)
		}
		if got, _ := s.Claim(ctx, key, stored, time.Minute); got.Outcome != dedup.InProgress {
			t.Errorf("%q taken over: its own fingerprint got %v, want in progress", stored, got.Outcome)
		}
	}
}

// TestRecordsReused: records of dropped keys are handed out again, so a
// store whose keys expire as fast as they come does not allocate per key.
func TestRecordsReused(t *testing.T) {
	ctx := context.Background()
	s, err := memstore.New(memstore.WithCapacity(64), memstore.WithShards(1))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	fp := dedup.FingerprintOf([]byte("p"))
	keys := make([]dedup.Key, 4096)
	for i := range keys {
		keys[i] = dedup.Key{Scope: "reuse", ID: strconv.Itoa(i)}
	}
	i := 0
	claim := func() {
		c, err := s.Claim(ctx, keys[i%len(keys)], fp, time.Minute)
		if err != nil || c.Outcome != dedup.Acquired {
			t.Fatalf("claim %d: %v %v", i, c.Outcome, err)
		}
		if err := s.Complete(ctx, c, nil, time.Nanosecond); err != nil {
			t.Fatal(err)
		}
		i++
	}
	for range 128 { // fill the store and its map
		claim()
	}
	if n := testing.AllocsPerRun(1000, claim); n != 0 {
		t.Errorf("%v allocations per new key in a full store of expired records, want 0", n)
	}
	if st := s.Stats(); st.Records > 64 {
		t.Errorf("%d records in a store of capacity 64", st.Records)
	}
}

// TestScopes: a shard keeps its first scope's keys apart from the others';
// the same ID in two scopes is two keys, a full store frees expired
// records of either scope, and Sweep reaches both.
func TestScopes(t *testing.T) {
	ctx := context.Background()
	clock := storetest.NewClock()
	s, err := memstore.New(memstore.WithClock(clock), memstore.WithShards(1), memstore.WithCapacity(8), memstore.WithStrictCapacity())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	claim := func(scope, id string) dedup.Claim {
		t.Helper()
		c, err := s.Claim(ctx, dedup.Key{Scope: scope, ID: id}, "", time.Minute)
		if err != nil {
			t.Fatalf("claim %s/%s: %v", scope, id, err)
		}
		return c
	}
	// The same IDs in the shard's first scope and in two others.
	for _, scope := range []string{"first", "second", "third"} {
		for _, id := range []string{"a", "b"} {
			c := claim(scope, id)
			if c.Outcome != dedup.Acquired {
				t.Fatalf("%s/%s: %v, want acquired", scope, id, c.Outcome)
			}
			if err := s.Complete(ctx, c, []byte(scope), time.Duration(len(scope))*time.Hour); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, scope := range []string{"first", "second", "third"} {
		if c := claim(scope, "a"); c.Outcome != dedup.Duplicate || string(c.Result) != scope {
			t.Fatalf("%s/a: %v %q", scope, c.Outcome, c.Result)
		}
	}
	// Two more keys fill the store; the next is refused (strict).
	claim("first", "c")
	claim("third", "c")
	if _, err := s.Claim(ctx, dedup.Key{Scope: "second", ID: "c"}, "", time.Minute); !errors.Is(err, dedup.ErrFull) {
		t.Fatalf("full store: %v", err)
	}
	// Retention was the scope's length in hours: "first" and "third"
	// expire after 5h, "second" after 6h. Past 5h the expired records of
	// the first scope and of another make room.
	clock.Advance(5*time.Hour + time.Second)
	for _, id := range []string{"x", "y", "z", "w"} {
		if c := claim("second", id); c.Outcome != dedup.Acquired {
			t.Fatalf("second/%s after expiry: %v", id, c.Outcome)
		}
	}
	clock.Advance(time.Hour)
	if n, err := s.Sweep(ctx, 100); err != nil || n != 2 {
		t.Fatalf("sweep: %d %v, want the 2 expired records of scope second", n, err)
	}
	if c := claim("second", "a"); c.Outcome != dedup.Acquired {
		t.Fatalf("second/a after its expiry: %v", c.Outcome)
	}
}

// TestValidatedScopeStillChecksIDs: once a scope has been validated, a
// key in it still has its ID checked (the same argument error as
// before), and a bad scope is never taken for the validated one.
func TestValidatedScopeStillChecksIDs(t *testing.T) {
	ctx := context.Background()
	s, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	bad := []dedup.Key{
		{Scope: "s", ID: ""},
		{Scope: "s", ID: "a\x00b"},
		{Scope: "s", ID: "\xff"},
		{Scope: "s", ID: strings.Repeat("x", dedup.MaxIDBytes+1)},
		{Scope: "s\x01", ID: "a"},
		{Scope: "", ID: "a"},
	}
	errs := func() []string {
		var out []string
		for _, k := range bad {
			_, err := s.Claim(ctx, k, "", time.Minute)
			if !errors.Is(err, dedup.ErrInvalidArgument) {
				t.Fatalf("claim of %q: %v, want an invalid argument", k, err)
			}
			out = append(out, err.Error())
		}
		return out
	}
	before := errs()
	if c, err := s.Claim(ctx, dedup.Key{Scope: "s", ID: "ok"}, "", time.Minute); err != nil || c.Outcome != dedup.Acquired {
		t.Fatalf("valid claim: %v %v", c.Outcome, err)
	}
	after := errs()
	for i := range before {
		if before[i] != after[i] {
			t.Errorf("%q: %q before the scope was validated, %q after", bad[i], before[i], after[i])
		}
	}
	if _, err := s.Claim(ctx, dedup.Key{Scope: "s", ID: "ok2"}, "", 0); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("zero lease in the validated scope: %v", err)
	}
}
