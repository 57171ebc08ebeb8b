package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/redisstore"
	"github.com/redis/rueidis"
)

// claimOne claims key and fails the test unless it is acquired.
func claimOne(t *testing.T, s *redisstore.Store, k dedup.Key) dedup.Claim {
	t.Helper()
	c, err := s.Claim(context.Background(), k, "", time.Minute)
	if err != nil || c.Outcome != dedup.Acquired {
		t.Fatalf("claim %v: %v %v", k, c.Outcome, err)
	}
	return c
}

// storedResult is the result of key's completed record.
func storedResult(t *testing.T, s *redisstore.Store, k dedup.Key) string {
	t.Helper()
	d, err := s.Claim(context.Background(), k, "", time.Minute)
	if err != nil || d.Outcome != dedup.Duplicate {
		t.Fatalf("claim after: %v %v, want a duplicate", d.Outcome, err)
	}
	return string(d.Result)
}

// TestCompleteBatchRepeatedKeyAfterScriptFlush: a batch that completes one
// claim twice (A "first", B, A "second") is split into a completeMany call
// (A, B) and a completeOne call (A). A server whose script cache holds
// completeOne but not completeMany (it restarted, or SCRIPT FLUSH, and a
// lone Complete has run since) answers the first call NOSCRIPT and runs
// the second: A is completed with "second", then the first call, resent,
// finds it done by its token and changes nothing. The record must hold the
// first item's result, as TestCompleteBatchSameClaimTwice asks.
func TestCompleteBatchRepeatedKeyAfterScriptFlush(t *testing.T) {
	srv := startServer(t, "")
	s := open(t, srv.Addrs())
	ctx := context.Background()
	a := dedup.Key{Scope: "fence", ID: "a"}
	b := dedup.Key{Scope: "fence", ID: "b"}
	z := dedup.Key{Scope: "fence", ID: "z"}
	ca, cb, cz := claimOne(t, s, a), claimOne(t, s, b), claimOne(t, s, z)
	srv.CLI("script", "flush")
	// A lone Complete: completeOne is cached again, completeMany is not.
	if err := s.Complete(ctx, cz, []byte("z"), time.Hour); err != nil {
		t.Fatal(err)
	}
	items := []dedup.Completion{{Claim: ca, Result: []byte("first")}, {Claim: cb, Result: []byte("b")}, {Claim: ca, Result: []byte("second")}}
	errs, err := s.CompleteBatch(ctx, items, time.Hour)
	if err != nil || errs[0] != nil || errs[1] != nil || errs[2] != nil {
		t.Fatalf("complete batch: %v %v", errs, err)
	}
	if got := storedResult(t, s, a); got != "first" {
		t.Fatalf("stored result %q, want %q: the repeated key's later call ran before the earlier one (NOSCRIPT resend)", got, "first")
	}
	if got := storedResult(t, s, b); got != "b" {
		t.Fatalf("b: %q", got)
	}
}

// TestCompleteBatchRepeatedKeyReplicaAckCluster: with WithReplicaAck on a
// cluster, execAcked sends each script call with its WAIT on its own
// goroutine, in parallel. groups puts a repeated key into a second call,
// so two completions of one claim in separate calls would race: the
// record could hold the second item's result. On a cluster without
// replicas every WAIT falls short (a ReplicaAckError) but the scripts
// have run, which is all this test looks at.
func TestCompleteBatchRepeatedKeyReplicaAckCluster(t *testing.T) {
	addrs := clusterAddrs(t)
	plain := open(t, addrs)
	s := open(t, addrs, redisstore.WithReplicaAck(1, time.Millisecond))
	ctx := context.Background()
	scope := fmt.Sprintf("fence-ackc-%d", time.Now().UnixNano())
	wrong := 0
	const rounds = 16
	for r := range rounds {
		a := dedup.Key{Scope: scope, ID: fmt.Sprint("a", r)}
		ca := claimOne(t, plain, a)
		items := []dedup.Completion{{Claim: ca, Result: []byte("first")}, {Claim: ca, Result: []byte("second")}}
		errs, err := s.CompleteBatch(ctx, items, time.Hour)
		if err != nil || !ackedOrNil(errs[0]) || !ackedOrNil(errs[1]) {
			t.Fatalf("round %d: %v %v", r, errs, err)
		}
		if storedResult(t, plain, a) != "first" {
			wrong++
		}
	}
	if wrong > 0 {
		t.Fatalf("%d of %d rounds stored the second completion's result: the repeated key's calls ran in parallel", wrong, rounds)
	}
}

// TestCompleteBatchRepeatsModel: batches of 300 items over 40 keys, each
// key given many times with its live token or a dead one, the keys in
// every state a completion meets (in progress, completed by this token,
// completed in the text format, released, never claimed), more than
// maxScriptKeys in one slot (a hash tag) or spread over slots, on one
// server, a cluster and a cluster with WithReplicaAck. Every item gets
// the answer Complete would give it alone, in order: nil for the live
// token of a record in progress or completed by it, lease lost otherwise;
// the in-progress records hold their first live item's result, the others
// are unchanged, and no record is created.
func TestCompleteBatchRepeatsModel(t *testing.T) {
	type target struct {
		name  string
		addrs []string
		opts  []redisstore.Option
	}
	targets := []target{
		{"standalone", standaloneAddrs(t), nil},
		{"cluster", clusterAddrs(t), nil},
		// Without replicas every WAIT falls short: done items are then
		// ReplicaAckErrors, which ackedOrNil takes.
		{"acked-cluster", clusterAddrs(t), []redisstore.Option{redisstore.WithReplicaAck(1, time.Millisecond)}},
	}
	for _, tg := range targets {
		for _, tagged := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/tagged=%v", tg.name, tagged), func(t *testing.T) {
				plain := open(t, tg.addrs)
				s := open(t, tg.addrs, tg.opts...)
				seeds := uint64(3)
				if tg.opts != nil {
					seeds = 1 // each acked call waits out its WAIT
				}
				for seed := range seeds {
					repeatsModelRound(t, plain, s, tagged, seed)
				}
			})
		}
	}
}

func repeatsModelRound(t *testing.T, plain, s *redisstore.Store, tagged bool, seed uint64) {
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(seed, 7))
	scope := fmt.Sprintf("fence-model-%d-%d", time.Now().UnixNano(), seed)
	if tagged {
		scope = "{" + scope + "}"
	}
	const (
		live = iota
		completed
		textDone
		released
		absent
		nStates
	)
	const nKeys = 40
	keys := make([]dedup.Key, nKeys)
	state := make([]int, nKeys)
	tok := make([]dedup.Token, nKeys)
	pre := make([]string, nKeys)
	for k := range keys {
		keys[k] = dedup.Key{Scope: scope, ID: fmt.Sprint("k", k)}
		state[k] = k % nStates
		switch state[k] {
		case live, completed, released:
			c := claimOne(t, plain, keys[k])
			tok[k] = c.Token
			switch state[k] {
			case completed:
				pre[k] = "pre" + fmt.Sprint(k)
				if err := plain.Complete(ctx, c, []byte(pre[k]), time.Hour); err != nil {
					t.Fatal(err)
				}
			case released:
				if err := plain.Release(ctx, c); err != nil {
					t.Fatal(err)
				}
			}
		case textDone:
			tok[k] = dedup.NewToken()
			pre[k] = "text" + fmt.Sprint(k)
			setRaw(t, plain, keys[k], textRecord('c', tok[k], 1, time.Now().Add(time.Hour).UnixMilli(), "", pre[k]), time.Hour)
		case absent:
			tok[k] = dedup.NewToken()
		}
	}
	items := make([]dedup.Completion, 300)
	firstLive := make([]string, nKeys)
	want := make([]bool, len(items)) // done
	for i := range items {
		k := rng.IntN(nKeys)
		c := dedup.Claim{Key: keys[k], Token: tok[k], Outcome: dedup.Acquired, Attempt: 1}
		if rng.IntN(3) == 0 {
			c.Token = dedup.NewToken()
		}
		items[i] = dedup.Completion{Claim: c, Result: []byte(fmt.Sprint("r", i))}
		if c.Token == tok[k] {
			switch state[k] {
			case live:
				want[i] = true
				if firstLive[k] == "" {
					firstLive[k] = string(items[i].Result)
				}
			case completed, textDone:
				want[i] = true
			}
		}
	}
	errs, err := s.CompleteBatch(ctx, items, time.Hour)
	if err != nil || len(errs) != len(items) {
		t.Fatalf("seed %d: %v %v", seed, len(errs), err)
	}
	for i, e := range errs {
		if want[i] && !ackedOrNil(e) || !want[i] && !errors.Is(e, dedup.ErrLeaseLost) {
			t.Fatalf("seed %d item %d (%v, state %d, live token %v): %v", seed, i, items[i].Claim.Key, state[slices.Index(keys, items[i].Claim.Key)], items[i].Claim.Token == tok[slices.Index(keys, items[i].Claim.Key)], e)
		}
	}
	c := plain.Client()
	for k := range keys {
		res := c.Do(ctx, c.B().Get().Key(plain.RedisKey(keys[k])).Build())
		switch state[k] {
		case released, absent:
			if !rueidis.IsRedisNil(res.Error()) {
				t.Fatalf("seed %d key %d (state %d): a record was created: %v", seed, k, state[k], res.Error())
			}
		case live:
			if firstLive[k] == "" {
				d, err := plain.Claim(ctx, keys[k], "", time.Minute)
				if err != nil || d.Outcome != dedup.InProgress {
					t.Fatalf("seed %d key %d: %v %v, want in progress", seed, k, d.Outcome, err)
				}
			} else if got := storedResult(t, plain, keys[k]); got != firstLive[k] {
				t.Fatalf("seed %d key %d: stored %q, want the first live item's %q", seed, k, got, firstLive[k])
			}
		default:
			if got := storedResult(t, plain, keys[k]); got != pre[k] {
				t.Fatalf("seed %d key %d (state %d): stored %q, want %q unchanged", seed, k, state[k], got, pre[k])
			}
		}
	}
}

// ackedOrNil: a completion done, its replicas' acknowledgment aside (nil,
// or a ReplicaAckError when the master has no replica).
func ackedOrNil(err error) bool {
	var ack *redisstore.ReplicaAckError
	return err == nil || errors.As(err, &ack)
}
