package memstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/storetest"
)

// checkTable fails t unless every shard's table and records agree: each
// slot points to a live record whose hash it carries and is reachable
// from its home slot, each live record has exactly one slot, the free
// list holds the other records, scope numbers are counted by their
// records, and the bytes are the records' sizes.
func checkTable(t *testing.T, s *Store) {
	t.Helper()
	for si := range s.shards {
		sh := &s.shards[si]
		sh.mu.Lock()
		err := sh.check(s)
		sh.mu.Unlock()
		if err != nil {
			t.Fatalf("shard %d: %v", si, err)
		}
	}
}

func (sh *shard) check(s *Store) error {
	mask := uint64(len(sh.slots) - 1)
	if len(sh.slots)&(len(sh.slots)-1) != 0 || len(sh.slots) < minSlots {
		return fmt.Errorf("%d slots", len(sh.slots))
	}
	slotOf := map[uint32]uint64{}
	for pos, w := range sh.slots {
		if w == 0 {
			continue
		}
		ri := uint32(w) - 1
		if ri >= sh.top {
			return fmt.Errorf("slot %d: record %d of %d", pos, ri, sh.top)
		}
		if _, dup := slotOf[ri]; dup {
			return fmt.Errorf("record %d in two slots", ri)
		}
		slotOf[ri] = uint64(pos)
		r := sh.rec(ri)
		if r.idp == nil {
			return fmt.Errorf("slot %d: record %d is free", pos, ri)
		}
		sid := r.meta >> scopeShift
		if hs := mix(maphash.String(s.seed, r.id()), sid); uint32(hs) != uint32(w>>32) {
			return fmt.Errorf("slot %d: hash %x, record's %x", pos, w>>32, uint32(hs))
		}
		for i := w >> 32 & mask; i != uint64(pos); i = (i + 1) & mask {
			if sh.slots[i] == 0 {
				return fmt.Errorf("slot %d: empty slot %d between it and its home", pos, i)
			}
		}
		if _, home := s.hash(r.id()); home != sh {
			return fmt.Errorf("record %q in the wrong shard", r.id())
		}
	}
	if len(slotOf) != sh.n {
		return fmt.Errorf("%d slots used, n %d", len(slotOf), sh.n)
	}
	if sh.n*4 > len(sh.slots)*3 {
		return fmt.Errorf("%d records in %d slots", sh.n, len(sh.slots))
	}
	free := 0
	for f := sh.free; f != 0; f = uint32(sh.rec(f - 1).until) {
		if sh.rec(f-1).idp != nil {
			return fmt.Errorf("free record %d has a key", f-1)
		}
		if free++; free > int(sh.top) {
			return fmt.Errorf("free list loops")
		}
	}
	if free+sh.n != int(sh.top) {
		return fmt.Errorf("%d free + %d live != %d records", free, sh.n, sh.top)
	}
	refs := map[uint32]int32{}
	var size int64
	for ri := range sh.top {
		r := sh.rec(ri)
		if r.idp == nil {
			continue
		}
		if _, ok := slotOf[ri]; !ok {
			return fmt.Errorf("record %d (%q) has no slot", ri, r.id())
		}
		sid := r.meta >> scopeShift
		refs[sid]++
		size += RecordOverhead + int64(len(sh.scopeName(sid))+r.idLen()) + r.extraSize()
		if (r.more != nil) != (r.meta&extraBit != 0) {
			return fmt.Errorf("record %d: extra %v, bit %v", ri, r.more != nil, r.meta&extraBit != 0)
		}
		if r.meta&kindMask == fpString && (r.more == nil || r.more.fp == "") {
			return fmt.Errorf("record %d: a string fingerprint not kept", ri)
		}
	}
	if size != sh.bytes {
		return fmt.Errorf("bytes %d, records' sizes %d", sh.bytes, size)
	}
	if m := sh.multi; m != nil {
		for id := uint32(1); id <= uint32(len(m.names)); id++ {
			name := m.names[id-1]
			if name == "" {
				if refs[id] != 0 || m.refs[id-1] != 0 {
					return fmt.Errorf("free scope number %d has %d records", id, refs[id])
				}
				continue
			}
			if m.refs[id-1] != refs[id] || refs[id] == 0 {
				return fmt.Errorf("scope %q: counted %d, has %d records", name, m.refs[id-1], refs[id])
			}
			if m.ids[name] != id || name == sh.scope {
				return fmt.Errorf("scope %q numbered %d, map says %d", name, id, m.ids[name])
			}
		}
		if len(m.ids)+len(m.free) != len(m.names) {
			return fmt.Errorf("%d scopes, %d free numbers, %d names", len(m.ids), len(m.free), len(m.names))
		}
	} else if len(refs) > 1 || (len(refs) == 1 && refs[0] == 0) {
		return fmt.Errorf("records of other scopes without a scope table")
	}
	return nil
}

// A model record: the claim state table written out plainly.
type modelRecord struct {
	token     dedup.Token
	fp        dedup.Fingerprint
	until     time.Time
	attempt   int
	completed bool
	result    []byte
}

// TestTableAgainstModel drives the store with random calls on keys that
// share IDs across scopes and checks every answer against a plain model
// of the claim state table, and the table's invariants after every call.
// With a small capacity the store may forget completed records (evicted
// or expired and dropped), never one in progress.
func TestTableAgainstModel(t *testing.T) {
	for _, tc := range []struct {
		name            string
		shards, cap, n  int
		strict, maxByte bool
		scopes          int // 0: four scopes
	}{
		{name: "unbounded", shards: 2, cap: 1 << 20, n: 8_000},
		{name: "one-shard", shards: 1, cap: 1 << 20, n: 8_000},
		{name: "evicting", shards: 2, cap: 48, n: 8_000},
		{name: "strict", shards: 1, cap: 40, n: 8_000, strict: true},
		{name: "max-bytes", shards: 4, cap: 1 << 20, n: 8_000, maxByte: true},
		// Many scopes in one small shard: scope numbers freed and reused
		// all the time, under capacity and byte pressure.
		{name: "many-scopes", shards: 1, cap: 1 << 20, n: 3_000, scopes: 40},
		{name: "many-scopes-evicting", shards: 1, cap: 24, n: 4_000, scopes: 40},
		{name: "many-scopes-strict-bytes", shards: 1, cap: 1 << 20, n: 4_000, scopes: 40, strict: true, maxByte: true},
	} {
		for seed := range uint64(3) {
			t.Run(tc.name+"/"+strconv.FormatUint(seed, 10), func(t *testing.T) {
				t.Parallel()
				clock := storetest.NewClock()
				opts := []Option{WithClock(clock), WithShards(tc.shards), WithCapacity(tc.cap)}
				if tc.strict {
					opts = append(opts, WithStrictCapacity())
				}
				if tc.maxByte {
					opts = append(opts, WithMaxBytes(12_000))
				}
				s, err := New(opts...)
				if err != nil {
					t.Fatal(err)
				}
				defer s.Close()
				scopes := []string{"a", "b", "c", "scope/with/a/longer/name"}
				if tc.scopes > 0 {
					scopes = nil
					for i := range tc.scopes {
						scopes = append(scopes, "scope-"+strconv.Itoa(i))
					}
				}
				runModel(t, s, clock, rand.New(rand.NewPCG(seed, 7)), scopes, tc.n, tc.cap < 1<<20 || tc.maxByte)
			})
		}
	}
}

func runModel(t *testing.T, s *Store, clock *storetest.Clock, rnd *rand.Rand, scopes []string, steps int, forgets bool) {
	ctx := context.Background()
	fps := []dedup.Fingerprint{"", dedup.FingerprintOf([]byte("x")), dedup.FingerprintOf([]byte("y")), "custom", "other"}
	model := map[dedup.Key]*modelRecord{}
	var claims []dedup.Claim
	key := func() dedup.Key {
		return dedup.Key{Scope: scopes[rnd.IntN(len(scopes))], ID: "id-" + strconv.Itoa(rnd.IntN(60))}
	}
	old := func() (dedup.Claim, bool) {
		if len(claims) == 0 {
			return dedup.Claim{}, false
		}
		return claims[len(claims)-1-rnd.IntN(min(len(claims), 8))], true
	}
	durations := []time.Duration{time.Second, 5 * time.Second, time.Minute}
	for step := range steps {
		now := clock.Now()
		switch op := rnd.IntN(20); {
		case op < 8: // Claim
			k, fp, lease := key(), fps[rnd.IntN(len(fps))], durations[rnd.IntN(len(durations))]
			c, err := s.Claim(ctx, k, fp, lease)
			m := model[k]
			if m != nil && m.completed && !m.until.After(now) {
				m = nil // expired: as absent
			}
			if errors.Is(err, dedup.ErrFull) {
				switch {
				case m == nil:
				case m.completed && forgets: // evicted
					delete(model, k)
				default:
					t.Fatalf("step %d: claim of a held key %v refused: %v", step, k, err)
				}
				continue
			}
			if err != nil {
				t.Fatalf("step %d: claim: %v", step, err)
			}
			if m != nil && m.completed && forgets && c.Outcome == dedup.Acquired && c.Attempt == 1 {
				m = nil // evicted
			}
			want, attempt := dedup.Acquired, 1
			switch {
			case m == nil:
			case (m.until.After(now) || !m.completed) && !fp.Matches(m.fp):
				want = dedup.Mismatch
			case m.completed:
				want, attempt = dedup.Duplicate, m.attempt
			case m.until.After(now):
				want, attempt = dedup.InProgress, m.attempt
			default:
				attempt = m.attempt + 1
			}
			if c.Outcome != want || (want != dedup.Mismatch && c.Attempt != attempt) || c.Key != k {
				t.Fatalf("step %d: claim %v fp %q: %v attempt %d, model %v attempt %d (%+v)", step, k, fp, c.Outcome, c.Attempt, want, attempt, m)
			}
			switch want {
			case dedup.Duplicate:
				if !bytes.Equal(c.Result, m.result) || !c.ExpiresAt.Equal(m.until) {
					t.Fatalf("step %d: duplicate %v: result %q expires %v, model %q %v", step, k, c.Result, c.ExpiresAt, m.result, m.until)
				}
			case dedup.InProgress:
				if !c.LeaseUntil.Equal(m.until) {
					t.Fatalf("step %d: in progress until %v, model %v", step, c.LeaseUntil, m.until)
				}
			case dedup.Acquired:
				if !c.LeaseUntil.Equal(now.Add(lease)) || c.TakenOver != (attempt > 1) || c.Token.IsZero() {
					t.Fatalf("step %d: acquired %+v", step, c)
				}
				nm := &modelRecord{token: c.Token, fp: fp, until: now.Add(lease), attempt: attempt}
				if attempt > 1 && m.fp != "" {
					nm.fp = m.fp // a take-over keeps the original fingerprint
				}
				model[k] = nm
				claims = append(claims, c)
			}
		case op < 12: // Complete, usually the latest claim
			c, ok := old()
			if !ok {
				continue
			}
			ret := durations[rnd.IntN(len(durations))]
			var result []byte
			if rnd.IntN(2) == 0 {
				result = []byte("result-" + strconv.Itoa(step))
			}
			err := s.Complete(ctx, c, result, ret)
			m := model[c.Key]
			switch {
			case m != nil && m.token == c.Token && m.completed && (forgets || !m.until.After(now)) && errors.Is(err, dedup.ErrLeaseLost):
				delete(model, c.Key) // evicted, or dropped once expired
			case m == nil || m.token != c.Token:
				if !errors.Is(err, dedup.ErrLeaseLost) {
					t.Fatalf("step %d: complete of a lost claim: %v", step, err)
				}
			case m.completed:
				if err != nil {
					t.Fatalf("step %d: second complete: %v", step, err)
				}
			default:
				if err != nil {
					t.Fatalf("step %d: complete: %v", step, err)
				}
				m.completed, m.until, m.result = true, now.Add(ret), result
			}
		case op < 14: // Release
			c, ok := old()
			if !ok {
				continue
			}
			err := s.Release(ctx, c)
			if m := model[c.Key]; m != nil && m.token == c.Token && !m.completed {
				if err != nil {
					t.Fatalf("step %d: release: %v", step, err)
				}
				delete(model, c.Key)
			} else if !errors.Is(err, dedup.ErrLeaseLost) {
				t.Fatalf("step %d: release of a lost claim: %v", step, err)
			}
		case op < 15: // Extend
			c, ok := old()
			if !ok {
				continue
			}
			lease := durations[rnd.IntN(len(durations))]
			got, err := s.Extend(ctx, c, lease)
			if m := model[c.Key]; m != nil && m.token == c.Token && !m.completed {
				if err != nil || !got.LeaseUntil.Equal(now.Add(lease)) {
					t.Fatalf("step %d: extend: %v %v", step, got.LeaseUntil, err)
				}
				m.until = now.Add(lease)
			} else if !errors.Is(err, dedup.ErrLeaseLost) {
				t.Fatalf("step %d: extend of a lost claim: %v", step, err)
			}
		case op < 18:
			clock.Advance(time.Duration(rnd.IntN(3000)) * time.Millisecond)
		case op < 19:
			if _, err := s.Sweep(ctx, 1+rnd.IntN(10)); err != nil {
				t.Fatal(err)
			}
		default:
			if _, err := s.Sweep(ctx, 1000); err != nil {
				t.Fatal(err)
			}
		}
		checkTable(t, s)
		if forgets {
			continue
		}
		held := 0
		for _, m := range model {
			if !m.completed || m.until.After(clock.Now()) {
				held++
			}
		}
		if st := s.Stats(); st.Records < held {
			t.Fatalf("step %d: %d records, model %d", step, st.Records, held)
		}
	}
}

// TestTableGrowsAndShrinksAround: many keys in one shard grow the table
// from its 8 slots; releasing them all leaves an empty, consistent table,
// and the records are reused.
func TestTableGrowsAndShrinksAround(t *testing.T) {
	ctx := context.Background()
	s, err := New(WithShards(1))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var claims []dedup.Claim
	for i := range 5000 {
		c, err := s.Claim(ctx, dedup.Key{Scope: "s" + strconv.Itoa(i%3), ID: strconv.Itoa(i / 3)}, "", time.Minute)
		if err != nil || c.Outcome != dedup.Acquired {
			t.Fatalf("claim %d: %v %v", i, c.Outcome, err)
		}
		claims = append(claims, c)
	}
	checkTable(t, s)
	rand.Shuffle(len(claims), func(i, j int) { claims[i], claims[j] = claims[j], claims[i] })
	for i, c := range claims {
		if err := s.Release(ctx, c); err != nil {
			t.Fatal(err)
		}
		if i%97 == 0 {
			checkTable(t, s)
		}
	}
	checkTable(t, s)
	sh := &s.shards[0]
	if sh.n != 0 || sh.multi == nil || len(sh.multi.ids) != 0 || sh.bytes != 0 {
		t.Fatalf("after releasing all: %d records, scopes %v, %d bytes", sh.n, sh.multi.ids, sh.bytes)
	}
	top := sh.top
	for i := range 5000 {
		if _, err := s.Claim(ctx, dedup.Key{Scope: "t", ID: strconv.Itoa(i)}, "", time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	if sh.top != top {
		t.Errorf("%d records handed out again after %d were freed", sh.top, top)
	}
	checkTable(t, s)
}

// TestSizes: a record is 80 bytes and a shard 128 (two cache lines of its
// own); the attempt count saturates instead of spilling into the ID's
// length.
func TestSizes(t *testing.T) {
	if n := unsafe.Sizeof(record{}); n != 80 {
		t.Errorf("record: %d bytes, want 80", n)
	}
	if n := unsafe.Sizeof(shard{}); n != 128 {
		t.Errorf("shard: %d bytes, want 128", n)
	}
	var r record
	r.setKey(strings.Repeat("x", dedup.MaxIDBytes), 5)
	r.setAttempt(maxAttempt)
	r.setAttempt(min(r.attempt()+1, maxAttempt))
	if r.attempt() != maxAttempt || r.idLen() != dedup.MaxIDBytes || r.meta>>scopeShift != 5 {
		t.Errorf("attempt %d, ID length %d, scope %d", r.attempt(), r.idLen(), r.meta>>scopeShift)
	}
	if _, err := New(WithShards(1), WithCapacity(1<<28+1)); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("capacity 2^28+1 in one shard: %v", err)
	}
}
