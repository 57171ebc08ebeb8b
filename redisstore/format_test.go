package redisstore_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/redisstore"
)

// textRecord builds a record in the text format that redisstore wrote
// before the binary layout: state, token, "<attempt>:<n>:<fp length>:",
// fingerprint, result.
func textRecord(state byte, tok dedup.Token, attempt, n int64, fp dedup.Fingerprint, result string) string {
	return string(state) + string(tok[:]) + strconv.FormatInt(attempt, 10) + ":" + strconv.FormatInt(n, 10) + ":" +
		strconv.Itoa(len(fp)) + ":" + string(fp) + result
}

// setRaw writes v at the Redis key of k with a TTL, as an older version
// of the store would have.
func setRaw(t *testing.T, s *redisstore.Store, k dedup.Key, v string, ttl time.Duration) {
	t.Helper()
	c := s.Client()
	if err := c.Do(context.Background(), c.B().Set().Key(s.RedisKey(k)).Value(v).PxMilliseconds(ttl.Milliseconds()).Build()).Error(); err != nil {
		t.Fatal(err)
	}
}

func getRaw(t *testing.T, s *redisstore.Store, k dedup.Key) string {
	t.Helper()
	c := s.Client()
	v, err := c.Do(context.Background(), c.B().Get().Key(s.RedisKey(k)).Build()).ToString()
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// TestTextRecordsStayReadable: records in the text format written by the
// previous version (a rolling upgrade: old and new processes share the
// keys) are read and deduplicated by this one: a completed record is a
// duplicate with its result, attempt and expiry (or a mismatch for another
// fingerprint), single and batched; a live in-progress record is in
// progress (or a mismatch); an expired one is taken over with attempt + 1,
// keeps its fingerprint in the binary layout, and completes; a stale
// token on a text record is lease lost and changes nothing.
func TestTextRecordsStayReadable(t *testing.T) {
	s := open(t, standaloneAddrs(t))
	ctx := context.Background()
	scope := fmt.Sprintf("text-%d", time.Now().UnixNano())
	fp := dedup.FingerprintOf([]byte("payload"))
	other := dedup.FingerprintOf([]byte("other"))
	hold := time.Hour.Milliseconds()
	key := func(id string) dedup.Key { return dedup.Key{Scope: scope, ID: id} }

	// Completed, with a SHA-256 fingerprint and a result.
	exp := time.Now().Add(time.Hour).UnixMilli()
	setRaw(t, s, key("done"), textRecord('c', dedup.NewToken(), 3, exp, fp, "result-bytes"), time.Hour)
	c, err := s.Claim(ctx, key("done"), fp, time.Minute)
	if err != nil || c.Outcome != dedup.Duplicate || string(c.Result) != "result-bytes" || c.Attempt != 3 || c.ExpiresAt.UnixMilli() != exp {
		t.Fatalf("claim of a completed text record: %+v %v", c, err)
	}
	if c, err := s.Claim(ctx, key("done"), "", time.Minute); err != nil || c.Outcome != dedup.Duplicate {
		t.Fatalf("claim without a fingerprint: %v %v", c.Outcome, err)
	}
	if c, err := s.Claim(ctx, key("done"), other, time.Minute); err != nil || c.Outcome != dedup.Mismatch {
		t.Fatalf("claim with another fingerprint: %v %v", c.Outcome, err)
	}
	// A custom (non SHA-256) fingerprint and no result.
	setRaw(t, s, key("custom"), textRecord('c', dedup.NewToken(), 1, exp, "v1:order-7", ""), time.Hour)
	got, err := s.ClaimBatch(ctx, []dedup.ClaimRequest{
		{Key: key("custom"), Fingerprint: "v1:order-7"},
		{Key: key("custom"), Fingerprint: "v1:order-8"},
		{Key: key("done"), Fingerprint: fp},
	}, time.Minute)
	if err != nil || got[0].Outcome != dedup.Duplicate || got[0].Result != nil || got[1].Outcome != dedup.Mismatch ||
		got[2].Outcome != dedup.Duplicate || string(got[2].Result) != "result-bytes" {
		t.Fatalf("batch over text records: %+v %v", got, err)
	}

	// In progress with a live lease (TTL = lease + hold).
	oldTok := dedup.NewToken()
	setRaw(t, s, key("live"), textRecord('p', oldTok, 1, hold, fp, ""), time.Minute+time.Hour)
	if c, err := s.Claim(ctx, key("live"), fp, time.Minute); err != nil || c.Outcome != dedup.InProgress || c.Attempt != 1 {
		t.Fatalf("claim of a live text record: %+v %v", c, err)
	}
	if c, err := s.Claim(ctx, key("live"), other, time.Minute); err != nil || c.Outcome != dedup.Mismatch {
		t.Fatalf("claim of a live text record with another fingerprint: %v %v", c.Outcome, err)
	}
	stale := dedup.Claim{Key: key("live"), Outcome: dedup.Acquired, Token: dedup.NewToken(), Attempt: 1}
	before := getRaw(t, s, key("live"))
	if err := s.Complete(ctx, stale, []byte("x"), time.Hour); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("complete with a stale token: %v", err)
	}
	if err := s.Release(ctx, stale); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("release with a stale token: %v", err)
	}
	if _, err := s.Extend(ctx, stale, time.Minute); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("extend with a stale token: %v", err)
	}
	if errs, err := s.CompleteBatch(ctx, []dedup.Completion{{Claim: stale}}, time.Hour); err != nil || !errors.Is(errs[0], dedup.ErrLeaseLost) {
		t.Fatalf("batch complete with a stale token: %v %v", errs, err)
	}
	if after := getRaw(t, s, key("live")); after != before {
		t.Fatalf("a stale token changed the text record: %q -> %q", before, after)
	}

	// In progress, lease over (TTL below the hold): taken over.
	setRaw(t, s, key("expired"), textRecord('p', oldTok, 2, hold, fp, ""), time.Hour-time.Second)
	c, err = s.Claim(ctx, key("expired"), "", time.Minute)
	if err != nil || c.Outcome != dedup.Acquired || !c.TakenOver || c.Attempt != 3 {
		t.Fatalf("take-over of an expired text record: %+v %v", c, err)
	}
	if v := getRaw(t, s, key("expired")); v[0] != 1 {
		t.Fatalf("the take-over left a record of kind %d, want the binary layout", v[0])
	}
	if m, err := s.Claim(ctx, key("expired"), other, time.Minute); err != nil || m.Outcome != dedup.Mismatch {
		t.Fatalf("the take-over lost the text record's fingerprint: %v %v", m.Outcome, err)
	}
	if err := s.Complete(ctx, c, []byte("r"), time.Hour); err != nil {
		t.Fatal(err)
	}
	if d, err := s.Claim(ctx, key("expired"), fp, time.Minute); err != nil || d.Outcome != dedup.Duplicate || string(d.Result) != "r" || d.Attempt != 3 {
		t.Fatalf("after completing the take-over: %+v %v", d, err)
	}
	// Text-format in-progress record without a fingerprint: the new
	// owner's fingerprint is stored on take-over.
	setRaw(t, s, key("nofp"), textRecord('p', oldTok, 1, hold, "", ""), time.Hour-time.Second)
	if c, err := s.Claim(ctx, key("nofp"), fp, time.Minute); err != nil || c.Outcome != dedup.Acquired || c.Attempt != 2 {
		t.Fatalf("take-over of a text record without a fingerprint: %+v %v", c, err)
	}
	if m, err := s.Claim(ctx, key("nofp"), other, time.Minute); err != nil || m.Outcome != dedup.Mismatch {
		t.Fatalf("after the take-over: %v %v, want a mismatch", m.Outcome, err)
	}
}

// TestCompletedRecordLayout: a completed record with a SHA-256
// fingerprint and a 32-byte result is 92 bytes (a 28-byte header, the
// digest's 32 raw bytes, the result), and its fingerprint still tells a
// duplicate from a mismatch.
func TestCompletedRecordLayout(t *testing.T) {
	s := open(t, standaloneAddrs(t))
	ctx := context.Background()
	k := dedup.Key{Scope: fmt.Sprintf("layout-%d", time.Now().UnixNano()), ID: "k"}
	fp := dedup.FingerprintOf([]byte("p"))
	c, err := s.Claim(ctx, k, fp, time.Minute)
	if err != nil || c.Outcome != dedup.Acquired {
		t.Fatal(c.Outcome, err)
	}
	if n := len(getRaw(t, s, k)); n != 60 {
		t.Fatalf("in-progress record is %d bytes, want 60", n)
	}
	result := bytes.Repeat([]byte{0xab}, 32)
	if err := s.Complete(ctx, c, result, time.Hour); err != nil {
		t.Fatal(err)
	}
	v := getRaw(t, s, k)
	if len(v) != 92 || v[0] != 2 || v[1:17] != string(c.Token[:]) || v[27] != 255 || v[60:] != string(result) {
		t.Fatalf("completed record: %d bytes %x", len(v), v)
	}
	if d, err := s.Claim(ctx, k, fp, time.Minute); err != nil || d.Outcome != dedup.Duplicate || !bytes.Equal(d.Result, result) {
		t.Fatalf("duplicate: %v %v", d.Outcome, err)
	}
	if d, err := s.Claim(ctx, k, dedup.FingerprintOf([]byte("q")), time.Minute); err != nil || d.Outcome != dedup.Mismatch {
		t.Fatalf("another payload: %v %v", d.Outcome, err)
	}
	// A fingerprint that only looks like SHA-256 (upper-case hex) is kept
	// as is and does not match the lower-case one.
	k2 := dedup.Key{Scope: k.Scope, ID: "upper"}
	digest := strings.Repeat("ab", 32)
	upper := dedup.Fingerprint("sha256:" + strings.ToUpper(digest))
	lower := dedup.Fingerprint("sha256:" + digest)
	if c, err := s.Claim(ctx, k2, upper, time.Minute); err != nil || c.Outcome != dedup.Acquired {
		t.Fatal(c.Outcome, err)
	}
	if len(getRaw(t, s, k2)) != 28+len(upper) {
		t.Fatalf("upper-case fingerprint not kept as is")
	}
	if c, err := s.Claim(ctx, k2, lower, time.Minute); err != nil || c.Outcome != dedup.Mismatch {
		t.Fatalf("lower-case against upper-case: %v %v", c.Outcome, err)
	}
}
