package redisstore

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/redis/rueidis"
)

// TestCompleteOneFencesAsBatch: a group of one key is completed by
// completeOneScript, a group of several by completeManyScript; both must
// decide alike. Each case is set up twice on keys of its own, then
// completed alone (the one-key script) and beside a filler key in one
// group (the batch script), and the two answers and records are compared:
//   - a live token completes: the same completed record (kind, token,
//     attempt, fingerprint, result), an expiry of the server's clock plus
//     the retention, and the retention as the key's TTL;
//   - another token is lease lost and leaves the record as it was;
//   - the token that already completed the record is done again, with no
//     change;
//   - a claim taken over (its lease expired and another claim acquired)
//     is lease lost, and the new owner's record is left as it was;
//   - a released key (gone) is lease lost, and nothing is created;
//   - a completed record of the previous text format with the token is
//     done, unchanged; an in-progress text record is lease lost, unchanged.
func TestCompleteOneFencesAsBatch(t *testing.T) {
	s := privateStore(t)
	ctx := context.Background()
	c := s.client
	fp := dedup.FingerprintOf([]byte("p"))
	n := 0
	claim := func(lease time.Duration) dedup.Claim {
		t.Helper()
		n++
		cl, err := s.Claim(ctx, dedup.Key{Scope: "one", ID: strconv.Itoa(n)}, fp, lease)
		if err != nil || cl.Outcome != dedup.Acquired {
			t.Fatalf("claim: %v %v", cl.Outcome, err)
		}
		return cl
	}
	raw := func(cl dedup.Claim) (string, bool) {
		t.Helper()
		v, err := c.Do(ctx, c.B().Get().Key(s.RedisKey(cl.Key)).Build()).ToString()
		if err != nil {
			if rueidis.IsRedisNil(err) {
				return "", false
			}
			t.Fatal(err)
		}
		return v, true
	}
	pttl := func(cl dedup.Claim) int64 {
		t.Helper()
		v, err := c.Do(ctx, c.B().Pttl().Key(s.RedisKey(cl.Key)).Build()).AsInt64()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	serverMs := func() int64 {
		t.Helper()
		v, err := c.Do(ctx, c.B().Time().Build()).AsStrSlice()
		if err != nil {
			t.Fatal(err)
		}
		sec, _ := strconv.ParseInt(v[0], 10, 64)
		us, _ := strconv.ParseInt(v[1], 10, 64)
		return sec*1000 + us/1000
	}
	const retention = time.Hour
	// complete sends it alone (batch false: completeOneScript) or with a
	// filler key claimed for the purpose (batch true: completeManyScript),
	// and returns its error.
	complete := func(it dedup.Completion, batch bool) error {
		t.Helper()
		items := []dedup.Completion{it}
		if batch {
			items = append(items, dedup.Completion{Claim: claim(time.Minute), Result: []byte("filler")})
		}
		errs := make([]error, len(items))
		s.completeItems(ctx, items, retention, errs)
		if batch && errs[1] != nil {
			t.Fatalf("filler: %v", errs[1])
		}
		return errs[0]
	}
	// setText replaces cl's record with a text-format one of state st.
	setText := func(cl dedup.Claim, st byte) {
		t.Helper()
		v := string(st) + string(cl.Token[:]) + "1:" + strconv.FormatInt(time.Now().Add(time.Hour).UnixMilli(), 10) + ":" +
			strconv.Itoa(len(fp)) + ":" + string(fp)
		if st == 'c' {
			v += "old-result"
		}
		if err := c.Do(ctx, c.B().Set().Key(s.RedisKey(cl.Key)).Value(v).PxMilliseconds(time.Hour.Milliseconds()).Build()).Error(); err != nil {
			t.Fatal(err)
		}
	}
	type outcome struct {
		err     error
		before  string // the record before the call ("" when absent)
		after   string
		present bool
		ttl     int64
		t0, t1  int64 // server ms around the call
	}
	cases := []struct {
		name string
		// prepare returns the completion to send, after setting its key up.
		prepare func() dedup.Completion
		want    error
		changed bool // the record is rewritten (completed now)
	}{
		{"live token", func() dedup.Completion {
			return dedup.Completion{Claim: claim(time.Minute), Result: []byte("result")}
		}, nil, true},
		{"another token", func() dedup.Completion {
			cl := claim(time.Minute)
			cl.Token = dedup.NewToken()
			return dedup.Completion{Claim: cl, Result: []byte("result")}
		}, dedup.ErrLeaseLost, false},
		{"completed again by its token", func() dedup.Completion {
			it := dedup.Completion{Claim: claim(time.Minute), Result: []byte("first")}
			if err := complete(it, false); err != nil {
				t.Fatal(err)
			}
			it.Result = []byte("second")
			return it
		}, nil, false},
		{"taken over", func() dedup.Completion {
			old := claim(time.Millisecond)
			time.Sleep(5 * time.Millisecond)
			if cl, err := s.Claim(ctx, old.Key, fp, time.Minute); err != nil || !cl.TakenOver {
				t.Fatalf("take-over: %+v %v", cl, err)
			}
			return dedup.Completion{Claim: old, Result: []byte("result")}
		}, dedup.ErrLeaseLost, false},
		{"released", func() dedup.Completion {
			cl := claim(time.Minute)
			if err := s.Release(ctx, cl); err != nil {
				t.Fatal(err)
			}
			return dedup.Completion{Claim: cl, Result: []byte("result")}
		}, dedup.ErrLeaseLost, false},
		{"text completed by its token", func() dedup.Completion {
			cl := claim(time.Minute)
			setText(cl, 'c')
			return dedup.Completion{Claim: cl, Result: []byte("result")}
		}, nil, false},
		{"text in progress", func() dedup.Completion {
			cl := claim(time.Minute)
			setText(cl, 'p')
			return dedup.Completion{Claim: cl, Result: []byte("result")}
		}, dedup.ErrLeaseLost, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var got [2]outcome
			for i, batch := range []bool{false, true} {
				it := tc.prepare()
				o := &got[i]
				o.before, _ = raw(it.Claim)
				o.t0 = serverMs()
				o.err = complete(it, batch)
				o.t1 = serverMs()
				o.after, o.present = raw(it.Claim)
				if o.present {
					o.ttl = pttl(it.Claim)
				}
			}
			for i, o := range got {
				path := [2]string{"one-key script", "batch script"}[i]
				if !errors.Is(o.err, tc.want) || (tc.want == nil) != (o.err == nil) {
					t.Fatalf("%s: %v, want %v", path, o.err, tc.want)
				}
				if !tc.changed {
					if o.after != o.before || o.present != (o.before != "") {
						t.Fatalf("%s changed the record: %q -> %q", path, o.before, o.after)
					}
					continue
				}
				r, ok := parseRecord(o.after)
				if !ok || !r.completed || o.after[1:17] != o.before[1:17] || o.after[23:] != o.before[23:]+"result" {
					t.Fatalf("%s wrote %q from %q, want the completed record", path, o.after, o.before)
				}
				if r.n < o.t0+retention.Milliseconds() || r.n > o.t1+retention.Milliseconds() {
					t.Fatalf("%s wrote expiry %d, want the server's clock (%d..%d) plus the retention", path, r.n, o.t0, o.t1)
				}
				if o.ttl > retention.Milliseconds() || o.ttl < retention.Milliseconds()-60000 {
					t.Fatalf("%s left a TTL of %d ms, want the retention", path, o.ttl)
				}
			}
			// Both paths wrote the same record but for the token (each
			// key's own) and the expiry.
			if a, b := got[0].after, got[1].after; tc.changed && (a[:1] != b[:1] || a[23:] != b[23:]) {
				t.Fatalf("one-key script wrote %q, batch script %q", a, b)
			}
		})
	}
	// The one-key groups went through completeOneScript.
	ok, err := c.Do(ctx, c.B().ScriptExists().Sha1(s.completeOne.sha).Build()).AsIntSlice()
	if err != nil || len(ok) != 1 || ok[0] != 1 {
		t.Fatalf("completeOneScript not on the server (%v %v): lone completions did not use it", ok, err)
	}
}
