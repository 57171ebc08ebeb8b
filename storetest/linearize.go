package storetest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/dedupkit/dedup"
)

// The per-key history check: goroutines call Claim, Complete, Release and
// Extend on a few keys at once, each call recorded with its invocation
// and response times (a shared counter, so "before" is exact), and the
// history of each key must be linearizable against the sequential claim
// state machine of CONTRACT.md: some order of the calls that respects
// real time (a call that returned before another was invoked comes first)
// gives every call the answer it got. Leases are long enough that expiry
// plays no part. The search is Wing and Gong's, with memoisation of
// (calls done, state), which keeps it small for histories of a few dozen
// calls per key.

type opKind uint8

const (
	opClaim opKind = iota
	opComplete
	opRelease
	opExtend
)

func (k opKind) String() string {
	return [...]string{"Claim", "Complete", "Release", "Extend"}[k]
}

// histOp is one call of a history and what it returned.
type histOp struct {
	call, ret int64
	kind      opKind
	fp        dedup.Fingerprint // Claim's fingerprint
	token     dedup.Token       // the token a fenced call used
	result    string            // what Complete stored
	// Returned.
	outcome   dedup.Outcome // Claim's
	outToken  dedup.Token   // Claim's, when acquired
	outResult string        // Claim's, when a duplicate
	lost      bool          // a fenced call's ErrLeaseLost
}

func (o histOp) String() string {
	switch o.kind {
	case opClaim:
		return fmt.Sprintf("[%d,%d] Claim(fp %q) = %v %s %q", o.call, o.ret, o.fp, o.outcome, short(o.outToken), o.outResult)
	default:
		return fmt.Sprintf("[%d,%d] %v(%s %q) lost=%v", o.call, o.ret, o.kind, short(o.token), o.result, o.lost)
	}
}

func short(t dedup.Token) string {
	if t.IsZero() {
		return "-"
	}
	return t.String()[:6]
}

// keyState is the sequential model of one key.
type keyState struct {
	status      uint8 // 0 absent, 1 in progress, 2 completed
	token       dedup.Token
	fp          dedup.Fingerprint
	result      string
	completedBy dedup.Token
}

func (s keyState) id() string {
	return fmt.Sprintf("%d|%x|%s|%s|%x", s.status, s.token, s.fp, s.result, s.completedBy)
}

// step applies o to s and says whether o's answer is the one the model
// gives.
func step(s keyState, o *histOp) (keyState, bool) {
	switch o.kind {
	case opClaim:
		switch s.status {
		case 0:
			if o.outcome != dedup.Acquired {
				return s, false
			}
			return keyState{status: 1, token: o.outToken, fp: o.fp}, true
		case 1:
			if !o.fp.Matches(s.fp) {
				return s, o.outcome == dedup.Mismatch
			}
			return s, o.outcome == dedup.InProgress
		default:
			if !o.fp.Matches(s.fp) {
				return s, o.outcome == dedup.Mismatch
			}
			return s, o.outcome == dedup.Duplicate && o.outResult == s.result
		}
	case opComplete:
		switch {
		case s.status == 1 && s.token == o.token:
			return keyState{status: 2, fp: s.fp, result: o.result, completedBy: o.token}, !o.lost
		case s.status == 2 && s.completedBy == o.token:
			return s, !o.lost
		}
		return s, o.lost
	case opRelease:
		if s.status == 1 && s.token == o.token {
			return keyState{}, !o.lost
		}
		return s, o.lost
	default: // extend
		return s, o.lost != (s.status == 1 && s.token == o.token)
	}
}

// linearizable reports whether ops (at most 64) have a linearization.
func linearizable(ops []histOp) bool {
	n := len(ops)
	if n > 64 {
		panic("storetest: a history of more than 64 calls")
	}
	full := uint64(1)<<n - 1
	if n == 64 {
		full = ^uint64(0)
	}
	seen := make(map[string]bool)
	var search func(done uint64, s keyState) bool
	search = func(done uint64, s keyState) bool {
		if done == full {
			return true
		}
		memo := fmt.Sprintf("%x/%s", done, s.id())
		if seen[memo] {
			return false
		}
		seen[memo] = true
		// The earliest response among the calls not yet placed: a call
		// invoked after it cannot come next.
		first := int64(1<<63 - 1)
		for i := range n {
			if done&(1<<i) == 0 && ops[i].ret < first {
				first = ops[i].ret
			}
		}
		for i := range n {
			if done&(1<<i) != 0 || ops[i].call > first {
				continue
			}
			if ns, ok := step(s, &ops[i]); ok && search(done|1<<i, ns) {
				return true
			}
		}
		return false
	}
	return search(0, keyState{})
}

// testLinearizable runs concurrent calls on a few keys and checks each
// key's history against the sequential claim state machine.
func testLinearizable(t testing.TB, e *Env) {
	const keys, workers, rounds = 8, 4, 3
	ctx := context.Background()
	var clock atomic.Int64
	ext, canExtend := e.Store.(dedup.Extender)
	canExtend = canExtend && e.Features.Extend
	histories := make([][]histOp, keys)
	var mu sync.Mutex
	var wg sync.WaitGroup
	for k := range keys {
		key := e.Key(fmt.Sprint("lin-", k))
		for w := range workers {
			wg.Go(func() {
				rng := rand.New(rand.NewPCG(uint64(k), uint64(w)))
				var mine []histOp
				record := func(o histOp, err error) bool {
					switch {
					case err == nil:
					case errors.Is(err, dedup.ErrLeaseLost) && o.kind != opClaim:
						o.lost = true
					default:
						t.Errorf("%v on %v: %v", o.kind, key, err)
						return false
					}
					mine = append(mine, o)
					return true
				}
				var old dedup.Token // a token this worker held before
				for r := range rounds {
					fp := []dedup.Fingerprint{fpA, fpA, "", fpB}[rng.IntN(4)]
					o := histOp{kind: opClaim, fp: fp, call: clock.Add(1)}
					c, err := e.Store.Claim(ctx, key, fp, longLease)
					o.ret = clock.Add(1)
					o.outcome, o.outToken, o.outResult = c.Outcome, c.Token, string(c.Result)
					if !record(o, err) {
						return
					}
					if c.Outcome != dedup.Acquired {
						if !old.IsZero() && rng.IntN(2) == 0 { // a stale owner's late call
							stale := dedup.Claim{Key: key, Outcome: dedup.Acquired, Token: old}
							res := fmt.Sprintf("stale-%d-%d", w, r)
							o := histOp{kind: opComplete, token: old, result: res, call: clock.Add(1)}
							err := e.Store.Complete(ctx, stale, []byte(res), retention)
							o.ret = clock.Add(1)
							if !record(o, err) {
								return
							}
						}
						continue
					}
					old = c.Token
					if canExtend && rng.IntN(2) == 0 {
						o := histOp{kind: opExtend, token: c.Token, call: clock.Add(1)}
						_, err := ext.Extend(ctx, c, longLease)
						o.ret = clock.Add(1)
						if !record(o, err) {
							return
						}
					}
					if rng.IntN(3) == 0 {
						o := histOp{kind: opRelease, token: c.Token, call: clock.Add(1)}
						err := e.Store.Release(ctx, c)
						o.ret = clock.Add(1)
						if !record(o, err) {
							return
						}
						continue
					}
					res := fmt.Sprintf("w%d-r%d", w, r)
					for range 1 + rng.IntN(2) { // sometimes twice with the same token
						o := histOp{kind: opComplete, token: c.Token, result: res, call: clock.Add(1)}
						err := e.Store.Complete(ctx, c, []byte(res), retention)
						o.ret = clock.Add(1)
						if !record(o, err) {
							return
						}
					}
				}
				mu.Lock()
				histories[k] = append(histories[k], mine...)
				mu.Unlock()
			})
		}
	}
	wg.Wait()
	for k, h := range histories {
		if !linearizable(h) {
			lines := make([]string, len(h))
			for i, o := range h {
				lines[i] = o.String()
			}
			t.Errorf("the history of key lin-%d is not linearizable against the claim state machine:\n%s", k, strings.Join(lines, "\n"))
		}
	}
}
