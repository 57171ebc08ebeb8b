package redisstore

import (
	"cmp"
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/redis/rueidis"
)

const storeName = "redis"

// Store is a dedup store on Redis or Redis Cluster. It is safe for
// concurrent use; concurrent calls share connections and are pipelined.
type Store struct {
	client    rueidis.Client
	ownClient bool
	prefix    string
	hold      int64  // ms an expired lease is kept for take-over
	holdArg   string // hold as a script argument
	closed    atomic.Bool

	claim, release, extend *script
	completeMany           *script
	completeOne            *script    // completeMany for a group of one key
	coalesce               *coalescer // concurrent Complete calls, sent together
	cluster                bool       // keys of one script must share a slot

	// inlineLone: a lone completion is sent on its caller's goroutine
	// (flushLone). Set by Open, which owns the client (Close closes it,
	// which ends a call waiting for a silent server), when no WAIT
	// follows completions.
	inlineLone bool

	ackReplicas int64 // WAIT for this many replicas after a completion (0: no WAIT)
	ackTimeout  int64 // ms
	// ackBound: how long a pipeline with WAIT may wait for its reply
	// beyond WAIT's own timeout (see doAcked): the client's
	// ConnWriteTimeout for a store from Open, flushTimeout otherwise.
	ackBound time.Duration
	// callBound: how long a call whose caller can cancel but set no
	// deadline may wait for its reply (see callCtx).
	callBound      time.Duration
	callTimeoutSet bool // WithCallTimeout given: Open keeps it
}

type config struct {
	prefix      string
	hold        time.Duration
	ackReplicas int
	ackTimeout  time.Duration
	callTimeout time.Duration
}

// Option configures a Store.
type Option interface{ apply(*config) }

type option func(*config)

func (f option) apply(c *config) { f(c) }

// WithPrefix sets the prefix of every Redis key the store writes. Default
// "dedup:".
func WithPrefix(p string) Option { return option(func(c *config) { c.prefix = p }) }

// WithTakeoverHold sets how long an in-progress record outlives its lease.
// Within the hold an expired lease is taken over with attempt + 1 and a
// claim with another fingerprint is refused; after it the record is gone
// and the next claim starts again at attempt 1. Default 1h.
func WithTakeoverHold(d time.Duration) Option { return option(func(c *config) { c.hold = d }) }

// WithReplicaAck makes Complete and CompleteBatch wait, after writing the
// completed records, until at least replicas replicas of the server that
// holds each key have acknowledged the write (Redis WAIT replicas
// timeout, sent on the connection that wrote). If fewer acknowledge within
// timeout, the call returns a [*dedup.StoreError] wrapping a
// [*ReplicaAckError]: the record is completed on the master but may not
// survive a failover, so the caller fails closed (does not ack); the
// redelivery then finds the completed record (a duplicate, acked) or, if
// the master was lost, claims again. Default: no WAIT (a completion
// returns once the master has it).
//
// What it promises: a completion reported without error was in the
// memory of the master and of at least replicas replicas. What it does
// not: replication stays asynchronous and WAIT is not consensus. A failover
// may still promote a replica that had not acknowledged (Redis Sentinel
// and Cluster pick by replication offset, usually but not always the most
// up to date), replicas acknowledge what they received, not what they
// persisted, and a write acknowledged by every replica is lost if all of
// them restart without persistence. Claims are not waited for: a lost
// claim costs a second run only if its lease was also lost, which the
// durable layer of the layered store covers. Each completion then holds a
// connection of its own (WAIT blocks it) instead of sharing the
// auto-pipelined ones; docs/benchmarks.md measures the cost. replicas must
// be at least 1 and timeout at least 1ms (WAIT 0 would block forever).
func WithReplicaAck(replicas int, timeout time.Duration) Option {
	return option(func(c *config) { c.ackReplicas, c.ackTimeout = replicas, timeout })
}

// WithCallTimeout bounds a call whose context can be cancelled but has no
// deadline: once sent, such a call waits for its reply (a cancellation
// does not end it, see the package doc) for at most d. Default: the
// client's ConnWriteTimeout for a store from [Open] (10s unless set), 10s
// for one from [New], which cannot see its client's options. A context
// with a deadline is bounded by its deadline instead.
func WithCallTimeout(d time.Duration) Option { return option(func(c *config) { c.callTimeout = d }) }

// defaultCallBound is the call bound of a store from New (rueidis's
// default ConnWriteTimeout).
const defaultCallBound = 10 * time.Second

func defaultConfig() config { return config{prefix: "dedup:", hold: time.Hour} }

func (c *config) validate() error {
	if c.hold < time.Millisecond {
		return &dedup.ArgumentError{Arg: "redisstore takeover hold", Reason: "must be at least 1ms"}
	}
	if c.callTimeout < 0 || c.callTimeout > 0 && c.callTimeout < time.Millisecond {
		return &dedup.ArgumentError{Arg: "redisstore call timeout", Reason: "must be at least 1ms"}
	}
	if c.ackReplicas < 0 || c.ackReplicas == 0 && c.ackTimeout != 0 {
		return &dedup.ArgumentError{Arg: "redisstore replica ack", Reason: "replicas must be at least 1"}
	}
	if c.ackReplicas > 0 && c.ackTimeout < time.Millisecond {
		return &dedup.ArgumentError{Arg: "redisstore replica ack timeout", Reason: "must be at least 1ms"}
	}
	return nil
}

// ReplicaAckError is the cause of a completion's [*dedup.StoreError] when
// fewer replicas than [WithReplicaAck] asked for acknowledged the write
// within its timeout. The record is completed on the master.
type ReplicaAckError struct {
	Want, Acked int64
}

func (e *ReplicaAckError) Error() string {
	return "redisstore: " + strconv.FormatInt(e.Acked, 10) + " of " + strconv.FormatInt(e.Want, 10) +
		" replicas acknowledged the completion within the timeout (WAIT); it is on the master but may not survive a failover"
}

// Open connects to Redis with the given rueidis options and returns a store
// that owns the client: Close closes it. Several InitAddress entries of a
// cluster make a cluster client. Client-side caching is turned off (the
// store never reads a key it did not just write through a script).
func Open(opt rueidis.ClientOption, opts ...Option) (*Store, error) {
	opt.DisableCache = true
	c, err := rueidis.NewClient(opt)
	if err != nil {
		return nil, &dedup.StoreError{Store: storeName, Op: "open", Err: err, NotApplied: true}
	}
	s, err := New(c, opts...)
	if err != nil {
		c.Close()
		return nil, err
	}
	s.ownClient = true
	s.inlineLone = s.ackReplicas == 0
	if cwt := connWriteTimeout(opt); cwt > 0 {
		s.ackBound = cwt
		if !s.callTimeoutSet {
			s.callBound = cwt
		}
	}
	return s, nil
}

// connWriteTimeout is the ConnWriteTimeout rueidis uses for opt: its own
// default when opt leaves it 0; 0 when there is none (negative).
func connWriteTimeout(opt rueidis.ClientOption) time.Duration {
	if opt.ConnWriteTimeout != 0 {
		return max(opt.ConnWriteTimeout, 0)
	}
	ka := opt.Dialer.KeepAlive
	if ka == 0 {
		ka = rueidis.DefaultTCPKeepAlive
	}
	return max(rueidis.DefaultTCPKeepAlive, ka) * 10
}

// New returns a store on a client the caller owns: Close leaves it open.
func New(c rueidis.Client, opts ...Option) (*Store, error) {
	if c == nil {
		return nil, &dedup.ArgumentError{Arg: "redis client", Reason: "is nil"}
	}
	cfg := defaultConfig()
	for _, o := range opts {
		o.apply(&cfg)
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return &Store{
		client:  c,
		prefix:  cfg.prefix,
		hold:    cfg.hold.Milliseconds(),
		holdArg: strconv.FormatInt(cfg.hold.Milliseconds(), 10),
		claim:   newScript(claimScript),
		release: newScript(releaseScript),
		extend:  newScript(extendScript),

		completeMany: newScript(completeManyScript),
		completeOne:  newScript(completeOneScript),
		coalesce:     newCoalescer(),
		cluster:      c.Mode() == rueidis.ClientModeCluster,
		ackReplicas:  int64(cfg.ackReplicas),
		ackTimeout:   cfg.ackTimeout.Milliseconds(),
		ackBound:     flushTimeout,
		callBound:    cmp.Or(cfg.callTimeout, defaultCallBound),

		callTimeoutSet: cfg.callTimeout > 0,
	}, nil
}

// Client returns the underlying client.
func (s *Store) Client() rueidis.Client { return s.client }

// RedisKey returns the Redis key of k: prefix, the scope's length, the
// scope and the ID ("dedup:8:payments:evt-1"), so no two keys can collide.
func (s *Store) RedisKey(k dedup.Key) string {
	return s.prefix + strconv.Itoa(len(k.Scope)) + ":" + k.Scope + ":" + k.ID
}

// script is one Lua script sent by SHA (EVALSHA) and resent whole (EVAL)
// only on NOSCRIPT, which also caches it on that server.
type script struct {
	src, sha string
}

func newScript(src string) *script {
	sum := sha1.Sum([]byte(src))
	return &script{src: src, sha: hex.EncodeToString(sum[:])}
}

func (sc *script) evalsha(c rueidis.Client, keys, args []string) rueidis.Completed {
	return c.B().Evalsha().Sha1(sc.sha).Numkeys(int64(len(keys))).Key(keys...).Arg(args...).Build()
}

func (sc *script) eval(c rueidis.Client, keys, args []string) rueidis.Completed {
	return c.B().Eval().Script(sc.src).Numkeys(int64(len(keys))).Key(keys...).Arg(args...).Build()
}

func (sc *script) exec(ctx context.Context, c rueidis.Client, keys, args []string) rueidis.RedisResult {
	res := c.Do(ctx, sc.evalsha(c, keys, args))
	if isNoScript(res.Error()) {
		res = c.Do(ctx, sc.eval(c, keys, args))
	}
	return res
}

// execMulti runs the script once per key, keys[i] with args[i], in one
// pipeline (see execCalls).
func (sc *script) execMulti(ctx context.Context, c rueidis.Client, keys []string, args [][]string) []rueidis.RedisResult {
	calls := make([]call, len(keys))
	for i := range keys {
		calls[i] = call{sc, keys[i : i+1], args[i]}
	}
	return execCalls(ctx, c, calls)
}

// A call is one run of a script.
type call struct {
	sc         *script
	keys, args []string
}

// execCalls runs calls in one pipeline (on a cluster the client splits it
// by node and slot and puts the replies back in order). The calls a
// server answered NOSCRIPT, which did not run, are sent again whole, in
// order, in a second pipeline.
func execCalls(ctx context.Context, c rueidis.Client, calls []call) []rueidis.RedisResult {
	cmds := make(rueidis.Commands, len(calls))
	for i, k := range calls {
		cmds[i] = k.sc.evalsha(c, k.keys, k.args)
	}
	results := c.DoMulti(ctx, cmds...)
	var again []int
	for i, res := range results {
		if isNoScript(res.Error()) {
			again = append(again, i)
		}
	}
	if len(again) > 0 {
		cmds = cmds[:0]
		for _, i := range again {
			cmds = append(cmds, calls[i].sc.eval(c, calls[i].keys, calls[i].args))
		}
		for k, res := range c.DoMulti(ctx, cmds...) {
			results[again[k]] = res
		}
	}
	return results
}

func isNoScript(err error) bool {
	re, ok := rueidis.IsRedisErr(err)
	return ok && re.IsNoScript()
}

func (s *Store) begin(ctx context.Context, op string) error {
	if s.closed.Load() {
		return dedup.ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return &dedup.StoreError{Store: storeName, Op: op, Err: err, NotApplied: true}
	}
	return nil
}

func (s *Store) fail(op string, err error) error {
	if s.closed.Load() {
		return dedup.ErrClosed
	}
	return &dedup.StoreError{Store: storeName, Op: op, Err: err}
}

func ms(d time.Duration) string {
	m := d.Milliseconds()
	if m < 1 {
		m = 1 // Redis counts milliseconds; round a sub-millisecond lease up
	}
	return strconv.FormatInt(m, 10)
}

// Claim implements [dedup.Store]. It sends one plain command, SET NX GET
// PX, which atomically either creates the in-progress record (the key was
// absent) or changes nothing and returns the record it found. A completed
// record is then a duplicate or a mismatch, and an in-progress record with
// another fingerprint a mismatch, decided from that one atomic read, with
// nothing left to write. Only an in-progress record with a matching
// fingerprint needs a second round trip: the claim script decides, in one
// atomic step, whether its lease is live or is taken over. So a first claim
// and a duplicate cost one round trip and one cheap command, and a key in
// progress costs two.
func (s *Store) Claim(ctx context.Context, key dedup.Key, fp dedup.Fingerprint, lease time.Duration) (dedup.Claim, error) {
	if err := dedup.ValidateClaim(key, fp, lease); err != nil {
		return dedup.Claim{}, err
	}
	if err := s.begin(ctx, "claim"); err != nil {
		return dedup.Claim{}, err
	}
	ctx, cancel := s.callCtx(ctx)
	defer cancel()
	tok := dedup.NewToken()
	rk := s.RedisKey(key)
	fpEnc := encodeFP(fp)
	c, inProgress, err := s.firstResult(key, tok, fpEnc, lease, s.client.Do(ctx, s.setNX(rk, &tok, fpEnc, lease)))
	if err != nil || !inProgress {
		return c, err
	}
	return s.claimResult(key, tok, s.claim.exec(ctx, s.client, []string{rk}, s.claimArgs(tok, fpEnc, lease)))
}

// setNX is the first command of a claim: create the record with attempt 1
// unless the key exists, and return what it held.
func (s *Store) setNX(rk string, tok *dedup.Token, fpEnc string, lease time.Duration) rueidis.Completed {
	ms := max(lease.Milliseconds(), 1) + s.hold
	return s.client.B().Set().Key(rk).Value(recordHead((*[16]byte)(tok), s.hold, fpEnc)).Nx().Get().PxMilliseconds(ms).Build()
}

// firstResult reads the reply of setNX. inProgress is set when the key
// holds an in-progress record with a matching fingerprint, which only the
// claim script can decide.
func (s *Store) firstResult(key dedup.Key, tok dedup.Token, fpEnc string, lease time.Duration, res rueidis.RedisResult) (c dedup.Claim, inProgress bool, err error) {
	v, err := res.ToString()
	if rueidis.IsRedisNil(err) {
		return dedup.Claim{Key: key, Outcome: dedup.Acquired, Token: tok, Attempt: 1, LeaseUntil: dedup.Deadline(time.Now(), lease)}, false, nil
	}
	if err != nil {
		return dedup.Claim{}, false, s.fail("claim", err)
	}
	r, ok := parseRecord(v)
	switch {
	case !ok:
		return dedup.Claim{}, false, s.fail("claim", errors.New("key "+s.RedisKey(key)+" holds a value this store did not write"))
	case !fpMatches(fpEnc, r.fpEnc):
		return dedup.Claim{Key: key, Outcome: dedup.Mismatch}, false, nil
	case r.completed:
		c = dedup.Claim{Key: key, Outcome: dedup.Duplicate, Attempt: int(r.attempt), ExpiresAt: time.UnixMilli(r.n)}
		if r.result != "" {
			c.Result = []byte(r.result)
		}
		return c, false, nil
	}
	return dedup.Claim{}, true, nil
}

func (s *Store) claimArgs(tok dedup.Token, fpEnc string, lease time.Duration) []string {
	return []string{recordHead((*[16]byte)(&tok), s.hold, fpEnc), string(tok[:]), ms(lease), s.holdArg, fpEnc}
}

func (s *Store) claimResult(key dedup.Key, tok dedup.Token, res rueidis.RedisResult) (dedup.Claim, error) {
	arr, err := res.ToArray()
	if err != nil {
		return dedup.Claim{}, s.fail("claim", err)
	}
	if len(arr) < 3 {
		return dedup.Claim{}, s.fail("claim", errors.New("unexpected reply from the claim script"))
	}
	code, err1 := arr[0].AsInt64()
	attempt, err2 := arr[1].AsInt64()
	left, err3 := arr[2].AsInt64()
	if err := errors.Join(err1, err2, err3); err != nil {
		return dedup.Claim{}, s.fail("claim", err)
	}
	// The server decided on its own clock; the deadline it reports as time
	// left is placed on ours, for a Retry-After.
	until := dedup.Deadline(time.Now(), time.Duration(min(left, math.MaxInt64/int64(time.Millisecond)))*time.Millisecond)
	c := dedup.Claim{Key: key}
	switch code {
	case 1:
		c.Outcome, c.Token, c.LeaseUntil = dedup.Acquired, tok, until
		if attempt < 0 {
			attempt, c.TakenOver = -attempt, true
		}
		c.Attempt = int(attempt)
	case 2:
		c.Outcome, c.Attempt, c.LeaseUntil = dedup.InProgress, int(attempt), until
	case 3:
		c.Outcome, c.Attempt, c.ExpiresAt = dedup.Duplicate, int(attempt), until
		if len(arr) > 3 {
			if b, err := arr[3].AsBytes(); err == nil && len(b) > 0 {
				c.Result = b
			}
		}
	case 4:
		c.Outcome = dedup.Mismatch
	default:
		return dedup.Claim{}, s.fail("claim", errors.New("unexpected outcome code "+strconv.FormatInt(code, 10)))
	}
	return c, nil
}

// ClaimBatch implements [dedup.BatchClaimer]: the first command of every
// claim in one pipeline, then the claim script for the keys found in
// progress in a second one (usually there are none). On a cluster the
// client splits each pipeline by node and slot and puts the replies back
// in request order. A key repeated in the batch runs in order on its node:
// the first acquires, the later ones see it in progress.
func (s *Store) ClaimBatch(ctx context.Context, reqs []dedup.ClaimRequest, lease time.Duration) ([]dedup.Claim, error) {
	if err := dedup.ValidateBatch(reqs, lease); err != nil {
		return nil, err
	}
	if err := s.begin(ctx, "claim batch"); err != nil {
		return nil, err
	}
	if len(reqs) == 0 {
		return []dedup.Claim{}, nil
	}
	ctx, cancel := s.callCtx(ctx)
	defer cancel()
	toks := make([]dedup.Token, len(reqs))
	keys := make([]string, len(reqs))
	fps := make([]string, len(reqs))
	cmds := make(rueidis.Commands, len(reqs))
	for i, r := range reqs {
		toks[i] = dedup.NewToken()
		keys[i] = s.RedisKey(r.Key)
		fps[i] = encodeFP(r.Fingerprint)
		cmds[i] = s.setNX(keys[i], &toks[i], fps[i], lease)
	}
	out := make([]dedup.Claim, len(reqs))
	var pending []int // in progress: the claim script decides
	for i, res := range s.client.DoMulti(ctx, cmds...) {
		c, inProgress, err := s.firstResult(reqs[i].Key, toks[i], fps[i], lease, res)
		if err != nil {
			return nil, err
		}
		if inProgress {
			pending = append(pending, i)
		}
		out[i] = c
	}
	if len(pending) == 0 {
		return out, nil
	}
	// A second pipeline, in request order, so a key repeated in the batch
	// is decided after its first occurrence acquired it.
	pkeys, args := make([]string, len(pending)), make([][]string, len(pending))
	for j, i := range pending {
		pkeys[j], args[j] = keys[i], s.claimArgs(toks[i], fps[i], lease)
	}
	for j, res := range s.claim.execMulti(ctx, s.client, pkeys, args) {
		i := pending[j]
		c, err := s.claimResult(reqs[i].Key, toks[i], res)
		if err != nil {
			return nil, err
		}
		out[i] = c
	}
	return out, nil
}

// Complete implements [dedup.Store]. Concurrent calls are sent together,
// as one CompleteBatch (see coalesce.go); a lone call is sent at once.
func (s *Store) Complete(ctx context.Context, c dedup.Claim, result []byte, retention time.Duration) error {
	if err := dedup.ValidateComplete(c, retention); err != nil {
		return err
	}
	if err := s.begin(ctx, "complete"); err != nil {
		return err
	}
	return s.completeCoalesced(ctx, c, result, retention)
}

// CompleteBatch implements [dedup.BatchCompleter] in one pipeline: the
// items whose keys share a slot (every key, on a server that is not a
// cluster) are completed by one script call, up to maxScriptKeys keys
// each. Each item is fenced by its own token, as Complete fences it. A
// failed script call fails only its own items.
func (s *Store) CompleteBatch(ctx context.Context, items []dedup.Completion, retention time.Duration) ([]error, error) {
	if err := dedup.ValidateCompleteBatch(items, retention); err != nil {
		return nil, err
	}
	if err := s.begin(ctx, "complete batch"); err != nil {
		return nil, err
	}
	if len(items) == 0 {
		return []error{}, nil
	}
	ctx, cancel := s.callCtx(ctx)
	defer cancel()
	errs := make([]error, len(items))
	s.completeItems(ctx, items, retention, errs)
	return errs, nil
}

// completeItems completes valid items with one retention in one pipeline
// and sets errs[i] for items[i].
func (s *Store) completeItems(ctx context.Context, items []dedup.Completion, retention time.Duration, errs []error) {
	ret := ms(retention)
	if len(items) == 1 && s.ackReplicas == 0 {
		// One key (a lone Complete): the one-key script as one command,
		// without the groups and the pipeline below, which it would
		// come to anyway.
		it := &items[0]
		res := s.completeOne.exec(ctx, s.client, []string{s.RedisKey(it.Claim.Key)}, []string{string(it.Claim.Token[:]), string(it.Result), ret})
		switch done, err := completeReply(res, 1); {
		case err != nil:
			errs[0] = s.fail("complete", err)
		case done != "" && done[0] != '1':
			errs[0] = dedup.ErrLeaseLost
		}
		return
	}
	// A claim given twice (the same key and token) is sent once, with its
	// first item's result, and its later items get the first one's
	// answer: done again by the same token changes nothing, lost stays
	// lost, an unknown outcome stays unknown. So the first result is the
	// one stored whatever order the calls run in: a repeated key's calls
	// are not ordered when the first is answered NOSCRIPT and resent after
	// the second ran (its script was not cached, the other's was), nor
	// under WithReplicaAck on a cluster, where each call goes on its own.
	// The same key with other tokens may run in any order: a completion
	// never changes a record's token, so only one token can match it.
	keys := make([]string, 0, len(items))
	sent := make([]int, 0, len(items)) // the item of each key in keys
	type ref struct {
		key string
		tok dedup.Token
	}
	first := make(map[ref]int, len(items)) // claim -> its first item
	var repeat []int                       // item, then its first, for each repeated claim
	for i := range items {
		k := s.RedisKey(items[i].Claim.Key)
		r := ref{k, items[i].Claim.Token}
		if f, ok := first[r]; ok {
			repeat = append(repeat, i, f)
			continue
		}
		first[r] = i
		keys = append(keys, k)
		sent = append(sent, i)
	}
	groups := s.groups(keys)
	calls := make([]call, len(groups))
	for g, idx := range groups {
		if len(idx) == 1 {
			it := &items[sent[idx[0]]]
			calls[g] = call{s.completeOne, keys[idx[0] : idx[0]+1], []string{string(it.Claim.Token[:]), string(it.Result), ret}}
			continue
		}
		ks, args := make([]string, len(idx)), make([]string, 1, 1+2*len(idx))
		args[0] = ret
		for j, k := range idx {
			ks[j] = keys[k]
			it := &items[sent[k]]
			args = append(args, string(it.Claim.Token[:]), string(it.Result))
		}
		calls[g] = call{s.completeMany, ks, args}
	}
	var results []rueidis.RedisResult
	var ackErrs []error
	if s.ackReplicas > 0 {
		results, ackErrs = s.execAcked(ctx, calls)
	} else {
		results = execCalls(ctx, s.client, calls)
	}
	for g, res := range results {
		idx := groups[g]
		done, err := completeReply(res, len(idx))
		for j, k := range idx {
			i := sent[k]
			switch {
			case err != nil:
				errs[i] = s.fail("complete", err)
			case done != "" && done[j] != '1':
				errs[i] = dedup.ErrLeaseLost
			case ackErrs != nil && ackErrs[g] != nil:
				errs[i] = s.fail("complete", ackErrs[g])
			}
		}
	}
	for r := 0; r < len(repeat); r += 2 {
		errs[repeat[r]] = errs[repeat[r+1]]
	}
}

// completeReply reads the reply of completeManyScript (or, for one key,
// completeOneScript, which answers alike) for n keys: done is ""
// when every key was done, else one byte a key ('1' done, '0' lease lost).
// The reply's type tells the two apart (ToInt64 takes only an integer).
func completeReply(res rueidis.RedisResult, n int) (done string, err error) {
	if err := res.Error(); err != nil {
		return "", err
	}
	if v, err := res.ToInt64(); err == nil {
		if v != 1 {
			return "", fmt.Errorf("complete script answered %d", v)
		}
		return "", nil
	}
	done, err = res.ToString()
	if err == nil && len(done) != n {
		err = fmt.Errorf("complete script answered %d values for %d keys", len(done), n)
	}
	return done, err
}

// execAcked runs calls as execCalls does, each pipeline followed by WAIT
// on the same connection (rueidis sends a pipeline holding a blocking
// command on one dedicated connection, in order), and returns each call's
// reply and the error of the WAIT that followed it: nil when enough
// replicas acknowledged. On a cluster each call (its keys share a slot)
// goes with its own WAIT to the node of its slot, the calls in parallel.
func (s *Store) execAcked(ctx context.Context, calls []call) ([]rueidis.RedisResult, []error) {
	results := make([]rueidis.RedisResult, len(calls))
	ackErrs := make([]error, len(calls))
	if !s.cluster {
		s.execAckedUnit(ctx, calls, results, ackErrs)
		return results, ackErrs
	}
	var wg sync.WaitGroup
	for i := range calls {
		wg.Go(func() { s.execAckedUnit(ctx, calls[i:i+1], results[i:i+1], ackErrs[i:i+1]) })
	}
	wg.Wait()
	return results, ackErrs
}

// execAckedUnit sends calls and a WAIT in one pipeline, then the calls a
// server answered NOSCRIPT again whole, with a WAIT of their own.
func (s *Store) execAckedUnit(ctx context.Context, calls []call, results []rueidis.RedisResult, ackErrs []error) {
	cmds := make(rueidis.Commands, 0, len(calls)+1)
	for _, k := range calls {
		cmds = append(cmds, k.sc.evalsha(s.client, k.keys, k.args))
	}
	cmds = append(cmds, s.wait())
	res := s.doAcked(ctx, cmds)
	ackErr := s.waitError(res[len(calls)])
	var again []int
	for i, r := range res[:len(calls)] {
		results[i], ackErrs[i] = r, ackErr
		if isNoScript(r.Error()) {
			again = append(again, i)
		}
	}
	if len(again) == 0 {
		return
	}
	cmds = cmds[:0]
	for _, i := range again {
		cmds = append(cmds, calls[i].sc.eval(s.client, calls[i].keys, calls[i].args))
	}
	cmds = append(cmds, s.wait())
	res = s.doAcked(ctx, cmds)
	ackErr = s.waitError(res[len(again)])
	for k, i := range again {
		results[i], ackErrs[i] = res[k], ackErr
	}
}

// doAcked sends a pipeline that ends with WAIT. rueidis sends a pipeline
// holding a blocking command on a dedicated connection that gets no
// ConnWriteTimeout deadline and that closing the client does not close,
// so on a server that stopped answering only the context's deadline ends
// it; a call's context has no cancellation (callCtx). So the pipeline gets
// a deadline of its own, WAIT's timeout plus ackBound, unless the
// caller's is earlier.
func (s *Store) doAcked(ctx context.Context, cmds rueidis.Commands) []rueidis.RedisResult {
	bound := time.Now().Add(time.Duration(s.ackTimeout)*time.Millisecond + s.ackBound)
	if dl, ok := ctx.Deadline(); !ok || dl.After(bound) {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, bound)
		defer cancel()
	}
	return s.client.DoMulti(ctx, cmds...)
}

func (s *Store) wait() rueidis.Completed {
	return s.client.B().Wait().Numreplicas(s.ackReplicas).Timeout(s.ackTimeout).Build()
}

// waitError is nil when WAIT's reply counts enough replicas.
func (s *Store) waitError(res rueidis.RedisResult) error {
	n, err := res.AsInt64()
	switch {
	case err != nil:
		return err
	case n < s.ackReplicas:
		return &ReplicaAckError{Want: s.ackReplicas, Acked: n}
	}
	return nil
}

// maxScriptKeys bounds the keys of one completeMany call, which holds the
// server for a few microseconds a key.
const maxScriptKeys = 128

// groups splits the indexes of keys, in order, into groups that one script
// call may take: keys of one slot on a cluster, any keys otherwise; each
// group holds at most maxScriptKeys, and no key twice (completeManyScript
// reads every key before it writes any, so a repeated key goes to a later
// group). completeItems sends a claim only once, so a key repeated here
// comes with another token, and its calls may run in any order (NOSCRIPT
// resends and acked cluster calls do not keep it): a completion does not
// change a record's token, so at most one of them can match.
func (s *Store) groups(keys []string) [][]int {
	var groups [][]int
	open := make(map[uint16]int)            // slot -> its group with room
	last := make(map[string]int, len(keys)) // key -> the group it was last put in
	for i, k := range keys {
		var sl uint16
		if s.cluster {
			sl = slot(k)
		}
		g, ok := open[sl]
		if lg, seen := last[k]; !ok || len(groups[g]) == maxScriptKeys || seen && lg == g {
			g = len(groups)
			var g0 []int
			if !s.cluster {
				g0 = make([]int, 0, min(maxScriptKeys, len(keys)-i))
			}
			groups = append(groups, g0)
			open[sl] = g
		}
		groups[g] = append(groups[g], i)
		last[k] = g
	}
	return groups
}

// slot returns the cluster hash slot of key: CRC16 (XMODEM) of the key,
// or of its hash tag (what lies between the first '{' and the next '}',
// when not empty), modulo 16384, as Redis Cluster computes it.
func slot(key string) uint16 {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			key = key[i+1 : i+1+j]
		}
	}
	var crc uint16
	for k := 0; k < len(key); k++ {
		crc ^= uint16(key[k]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc & 16383
}

// Release implements [dedup.Store]. The next claim starts at attempt 1.
func (s *Store) Release(ctx context.Context, c dedup.Claim) error {
	if err := dedup.ValidateRelease(c); err != nil {
		return err
	}
	if err := s.begin(ctx, "release"); err != nil {
		return err
	}
	ctx, cancel := s.callCtx(ctx)
	defer cancel()
	res := s.release.exec(ctx, s.client, []string{s.RedisKey(c.Key)}, []string{string(c.Token[:])})
	return s.fenced("release", res)
}

// Extend implements [dedup.Extender].
func (s *Store) Extend(ctx context.Context, c dedup.Claim, lease time.Duration) (dedup.Claim, error) {
	if err := dedup.ValidateRelease(c); err != nil {
		return c, err
	}
	if err := dedup.ValidateClaim(c.Key, "", lease); err != nil {
		return c, err
	}
	if err := s.begin(ctx, "extend"); err != nil {
		return c, err
	}
	ctx, cancel := s.callCtx(ctx)
	defer cancel()
	start := time.Now()
	res := s.extend.exec(ctx, s.client, []string{s.RedisKey(c.Key)}, []string{string(c.Token[:]), ms(lease)})
	if err := s.fenced("extend", res); err != nil {
		return c, err
	}
	c.LeaseUntil = dedup.Deadline(start, lease) // the server's lease starts no earlier than this
	return c, nil
}

func (s *Store) fenced(op string, res rueidis.RedisResult) error {
	n, err := res.AsInt64()
	return s.fencedValue(op, n, err)
}

// fencedValue is the error of a fenced script that answered n, or err.
func (s *Store) fencedValue(op string, n int64, err error) error {
	switch {
	case err != nil:
		return s.fail(op, err)
	case n == 0:
		return dedup.ErrLeaseLost
	}
	return nil
}

// Ping implements [dedup.Pinger].
func (s *Store) Ping(ctx context.Context) error {
	if err := s.begin(ctx, "ping"); err != nil {
		return err
	}
	ctx, cancel := s.callCtx(ctx)
	defer cancel()
	if err := s.client.Do(ctx, s.client.B().Ping().Build()).Error(); err != nil {
		return s.fail("ping", err)
	}
	return nil
}

// Close closes the client if the store opened it. Later calls return
// [dedup.ErrClosed]. Completions still queued return ErrClosed and are not
// sent; the batches in flight are ended (their callers get a store error
// or ErrClosed, outcome unknown) and waited for (see coalescer.close).
func (s *Store) Close() error {
	if s.closed.Swap(true) {
		return nil
	}
	s.coalesce.close()
	if s.ownClient {
		s.client.Close()
	}
	s.coalesce.flushes.Wait()
	return nil
}
