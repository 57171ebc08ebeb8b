package layered

import (
	"context"
	"encoding/binary"
	"errors"
	"hash/maphash"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/window"
)

// Layer names used in hook events and [Stats].
const (
	LayerWindow = "window"
	LayerBloom  = "bloom"
)

// Store is a layered deduplicator. As a [dedup.Store] it claims in the
// fast store and then the durable store (lease mode); [Store.RunInbox]
// puts the window and the fast store in front of a durable transactional
// inbox. It is safe for concurrent use.
type Store struct {
	cfg    config
	closed atomic.Bool
	stats  counters

	// pending maps an acquired durable claim to the fast claim taken with
	// it, so Complete and Release can finish both.
	seed    maphash.Seed
	pending [32]pendingShard

	w    *writer // the filter's writer, when there is a filter
	gate gate    // whether window misses are looked up in the filter
}

type pendingShard struct {
	mu sync.Mutex
	m  map[pendingKey]pendingClaim
}

type pendingKey struct {
	key   dedup.Key
	token dedup.Token
}

type pendingClaim struct {
	fast     dedup.Claim // zero when no fast claim was taken
	fp       dedup.Fingerprint
	deadline time.Time // forget it after this if nobody finishes the claim
}

type config struct {
	win         *window.Window
	fast        dedup.Store
	filter      Filter
	durable     dedup.Store
	fastName    string
	durableName string
	inboxLease  time.Duration
	cleanup     time.Duration
	clock       dedup.Clock
	hooks       dedup.Hooks
}

// Option configures a Store.
type Option interface{ apply(*config) }

type option func(*config)

func (f option) apply(c *config) { f(c) }

// WithWindow puts an in-process window first. Default none.
func WithWindow(w *window.Window) Option { return option(func(c *config) { c.win = w }) }

// WithFast puts a fast shared store (usually Redis) before the durable
// one, named in hooks and stats. Default none.
func WithFast(s dedup.Store, name string) Option {
	return option(func(c *config) { c.fast, c.fastName = s, name })
}

// WithFilter puts a fast shared filter of completed keys (usually Redis:
// package layered/redisfilter) between the window and the durable store,
// named in hooks and stats. Unlike WithFast it never claims: a window
// miss is looked up (a duplicate found there ends the call), and the
// durable store decides everything else; a key is written to the filter
// after the durable store recorded it completed (a completion, an inbox
// commit or a durable duplicate), from a background goroutine, so a new
// message pays one lookup at most and never waits for the write. Lookups
// are made only while they pay (see the package documentation). This is
// the fast layer to use in front of a durable step that answers in one
// round trip (pgstore's Apply and RunInbox, sqlitestore's RunInbox) and in
// front of a lease-mode durable store. Not with WithFast. Default none.
func WithFilter(f Filter, name string) Option {
	return option(func(c *config) { c.filter, c.fastName = f, name })
}

// WithDurable sets the authoritative store for lease mode, named in hooks
// and stats. Required for Claim; RunInbox brings its own durable step.
func WithDurable(s dedup.Store, name string) Option {
	return option(func(c *config) { c.durable, c.durableName = s, name })
}

// WithInboxLease sets the fast-store lease that RunInbox holds while the
// durable transaction runs. A crash in between holds redeliveries off for
// this long. Default 30s.
func WithInboxLease(d time.Duration) Option { return option(func(c *config) { c.inboxLease = d }) }

// WithCleanupTimeout bounds the fast-store calls that follow a durable
// step (completing or releasing the fast claim, writing a durable
// duplicate back): they run on a context detached from the caller's, which
// may end between the two steps, so that a cancelled caller never leaves an
// orphaned fast claim that answers "in progress" for a whole lease.
// Default 5s.
func WithCleanupTimeout(d time.Duration) Option {
	return option(func(c *config) { c.cleanup = d })
}

// WithClock sets the clock that dates window entries (now + retention). Use
// the clock of the stores when they take one. Default dedup.SystemClock{}.
func WithClock(c dedup.Clock) Option { return option(func(cfg *config) { cfg.clock = c }) }

// WithHooks adds observers; every layer reports what it caught under its
// own name.
func WithHooks(hs ...dedup.Hook) Option { return option(func(c *config) { c.hooks.Add(hs...) }) }

// New returns a layered Store. It does not own its layers: Close leaves
// them open.
func New(opts ...Option) (*Store, error) {
	cfg := config{fastName: "fast", durableName: "durable", inboxLease: 30 * time.Second, cleanup: 5 * time.Second, clock: dedup.SystemClock{}}
	for _, o := range opts {
		o.apply(&cfg)
	}
	switch {
	case cfg.win == nil && cfg.fast == nil && cfg.filter == nil && cfg.durable == nil:
		return nil, &dedup.ArgumentError{Arg: "layered store", Reason: "has no layer"}
	case cfg.fast != nil && cfg.filter != nil:
		return nil, &dedup.ArgumentError{Arg: "layered store", Reason: "takes a fast store (WithFast) or a filter (WithFilter), not both"}
	case cfg.clock == nil:
		return nil, &dedup.ArgumentError{Arg: "clock", Reason: "is nil"}
	case cfg.inboxLease <= 0:
		return nil, &dedup.ArgumentError{Arg: "inbox lease", Reason: "must be positive"}
	case cfg.cleanup <= 0:
		return nil, &dedup.ArgumentError{Arg: "cleanup timeout", Reason: "must be positive"}
	case cfg.fastName == "" || cfg.durableName == "" || cfg.fastName == cfg.durableName:
		return nil, &dedup.ArgumentError{Arg: "layer names", Reason: "must be non-empty and distinct"}
	}
	s := &Store{cfg: cfg, seed: maphash.MakeSeed()}
	for i := range s.pending {
		s.pending[i].m = make(map[pendingKey]pendingClaim)
	}
	if cfg.filter != nil {
		s.startWriter()
	}
	return s, nil
}

// Claim implements [dedup.Store]: window, then fast store, then the
// durable store, which decides. Only a duplicate ends the claim before the
// durable store: a completed record in the window or the fast store was
// completed in the durable store first. An in-progress lease or a
// mismatch in the fast store may be stale (its owner already released or
// completed the durable record and is on its way to the fast store, or
// crashed in between), so the durable store is asked and its answer is
// returned; the answer of Claim is therefore always the durable store's
// (see the package documentation on linearizability).
func (s *Store) Claim(ctx context.Context, key dedup.Key, fp dedup.Fingerprint, lease time.Duration) (dedup.Claim, error) {
	if err := dedup.ValidateClaim(key, fp, lease); err != nil {
		return dedup.Claim{}, err
	}
	if s.closed.Load() {
		return dedup.Claim{}, dedup.ErrClosed
	}
	if s.cfg.durable == nil {
		return dedup.Claim{}, &dedup.ArgumentError{Arg: "layered store", Reason: "has no durable store: use WithDurable, or RunInbox"}
	}
	if c, done := s.early(ctx, key, fp); done {
		return c, nil
	}
	if c, done := s.lookup(ctx, key, fp); done {
		return c, nil
	}
	fc, fastOK := s.claimFast(ctx, key, fp, lease)
	switch {
	case fastOK && fc.Outcome == dedup.Duplicate:
		return s.fastAnswer(key, fp, fc), nil
	case fastOK && fc.Outcome != dedup.Acquired:
		s.stats.fastUnsure.Add(1) // the durable store confirms or overrules it
		fastOK = false
	}
	start := s.startDurable()
	dc, err := s.cfg.durable.Claim(ctx, key, fp, lease)
	s.endDurable(ctx, key, dc, err, start)
	if err != nil {
		if fastOK {
			s.releaseFast(ctx, fc)
		}
		return dedup.Claim{}, err
	}
	switch dc.Outcome {
	case dedup.Acquired:
		if fastOK && !fastCopySafe(fp, dc) {
			s.releaseFast(ctx, fc)
			fastOK = false
		}
		if !fastOK {
			fc = dedup.Claim{}
		}
		s.hold(dc, fc, fp)
	case dedup.Duplicate:
		s.stats.durable.Add(1)
		s.backfill(ctx, key, fp, fc, fastOK, dc.Result, dc.ExpiresAt)
	default:
		if fastOK {
			s.releaseFast(ctx, fc)
		}
	}
	return dc, nil
}

// early answers from the window when it can: an exact hit with a matching
// fingerprint, or a Bloom "maybe" in Lossy mode.
func (s *Store) early(ctx context.Context, key dedup.Key, fp dedup.Fingerprint) (dedup.Claim, bool) {
	if s.cfg.win == nil {
		return dedup.Claim{}, false
	}
	v, val, has := s.cfg.win.Check(key)
	switch {
	case v == window.Hit && has:
		stored, result := decode(val)
		// The window records the fingerprint the key was completed with
		// as far as this process knows it (empty when unknown). A claim
		// without a fingerprint matches any record; one with a fingerprint
		// only an equal one. Anything else, the stores decide.
		if fp != "" && string(stored) != string(fp) {
			return dedup.Claim{}, false
		}
		s.stats.window.Add(1)
		s.duplicate(ctx, LayerWindow, key)
		c := dedup.Claim{Key: key, Outcome: dedup.Duplicate}
		if len(result) > 0 {
			c.Result = append([]byte(nil), result...)
		}
		return c, true
	case v == window.Maybe && s.cfg.win.Mode() == window.Lossy:
		s.stats.bloom.Add(1)
		s.duplicate(ctx, LayerBloom, key)
		return dedup.Claim{Key: key, Outcome: dedup.Duplicate}, true
	case v == window.Maybe:
		s.stats.suspected.Add(1)
	}
	return dedup.Claim{}, false
}

// lookup asks the filter about a window miss, when there is a filter and
// its lookups pay. A completed entry with a matching fingerprint (or any,
// for a claim without one) is a duplicate, recorded in the window; a
// miss, a failure, an entry with another or an unknown fingerprint, or an
// expired one leave the decision to the durable store.
func (s *Store) lookup(ctx context.Context, key dedup.Key, fp dedup.Fingerprint) (dedup.Claim, bool) {
	if s.cfg.filter == nil {
		return dedup.Claim{}, false
	}
	if !s.gate.want() {
		s.stats.lookupsSkipped.Add(1)
		return dedup.Claim{}, false
	}
	s.stats.lookups.Add(1)
	start := time.Now()
	v, found, err := s.cfg.filter.Lookup(ctx, key)
	took := time.Since(start)
	if err != nil {
		s.gate.looked(false, took)
		s.fastFailed(ctx, "lookup", key, err)
		return dedup.Claim{}, false
	}
	var c dedup.Claim
	hit := false
	if found {
		stored, result, expires, ok := decodeEntry(v)
		hit = ok && (fp == "" || string(stored) == string(fp)) && s.cfg.clock.Now().Before(expires)
		if hit {
			c = dedup.Claim{Key: key, Outcome: dedup.Duplicate, ExpiresAt: expires}
			if len(result) > 0 {
				c.Result = result
			}
			s.stats.fast.Add(1)
			s.duplicate(ctx, s.cfg.fastName, key)
			s.addWindow(key, dedup.Fingerprint(stored), result, expires)
		}
	}
	s.gate.looked(hit, took)
	return c, hit
}

// startDurable and endDurable time a durable step, for the hooks and for
// the filter's gate (what a lookup hit saves).
func (s *Store) startDurable() time.Time {
	if s.cfg.filter == nil {
		return s.started()
	}
	return time.Now()
}

func (s *Store) endDurable(ctx context.Context, key dedup.Key, dc dedup.Claim, err error, start time.Time) {
	if s.cfg.filter != nil && err == nil {
		s.gate.durable(time.Since(start))
		if dc.Outcome == dedup.Duplicate {
			s.gate.durableDuplicate()
		}
	}
	s.observe(ctx, s.cfg.durableName, key, dc, err, start)
}

// claimFast claims in the fast store. ok is false when there is no fast
// store or it failed: then the durable store decides alone.
func (s *Store) claimFast(ctx context.Context, key dedup.Key, fp dedup.Fingerprint, lease time.Duration) (dedup.Claim, bool) {
	if s.cfg.fast == nil {
		return dedup.Claim{}, false
	}
	start := s.started()
	c, err := s.cfg.fast.Claim(ctx, key, fp, lease)
	s.observe(ctx, s.cfg.fastName, key, c, err, start)
	if err != nil {
		s.stats.fastErrors.Add(1)
		return dedup.Claim{}, false
	}
	return c, true
}

// fastAnswer returns a fast store's final answer: a duplicate (recorded
// in the window with the claim's fingerprint, which the record matched), a
// lease held elsewhere, or a mismatch.
func (s *Store) fastAnswer(key dedup.Key, fp dedup.Fingerprint, fc dedup.Claim) dedup.Claim {
	if fc.Outcome == dedup.Duplicate {
		s.stats.fast.Add(1)
		s.addWindow(key, fp, fc.Result, fc.ExpiresAt)
	}
	return fc
}

// backfill writes a durable duplicate back to the faster layers that had
// lost it. A claim without a fingerprint does not write the fast store:
// its copy would match every payload, while the durable record may have a
// fingerprint (see fastCopySafe); the window records the fingerprint as
// unknown, which only a request without one can hit.
func (s *Store) backfill(ctx context.Context, key dedup.Key, fp dedup.Fingerprint, fc dedup.Claim, fastOK bool, result []byte, expires time.Time) {
	if fastOK && fc.Outcome == dedup.Acquired {
		if ret := expires.Sub(s.cfg.clock.Now()); fp != "" && !expires.IsZero() && ret > 0 {
			s.completeFast(ctx, fc, result, ret)
		} else {
			s.releaseFast(ctx, fc)
		}
	}
	s.addWindow(key, fp, result, expires)
	s.queueFilter(ctx, key, fp, result, expires)
}

// Complete implements [dedup.Store]: durable first, then the fast store
// and the window. Only a durable failure is returned.
func (s *Store) Complete(ctx context.Context, c dedup.Claim, result []byte, retention time.Duration) error {
	if err := dedup.ValidateComplete(c, retention); err != nil {
		return err
	}
	if s.closed.Load() {
		return dedup.ErrClosed
	}
	if s.cfg.durable == nil {
		return dedup.ErrLeaseLost
	}
	if err := s.cfg.durable.Complete(ctx, c, result, retention); err != nil {
		if errors.Is(err, dedup.ErrLeaseLost) {
			s.forget(c) // the claim is dead: its fast claim's lease ends on its own
		}
		return err // otherwise the claim stays pending: a retried Complete finishes both
	}
	// Only the first completion of a claim taken here updates the faster
	// layers; completing again changes nothing, as in every store.
	if p, ok := s.forget(c); ok {
		if p.fast.Outcome == dedup.Acquired {
			s.completeFast(ctx, p.fast, result, retention)
		}
		exp := dedup.Deadline(s.cfg.clock.Now(), retention)
		s.addWindow(c.Key, p.fp, result, exp)
		s.queueFilter(ctx, c.Key, p.fp, result, exp)
	}
	return nil
}

// Release implements [dedup.Store]. It releases the fast claim first and
// the durable one second: in between, a new Claim acquires the fast store
// and is then told "in progress" by the durable store, which is still the
// truth; the other order would let a new Claim see a stale fast lease after
// the old owner's fenced calls already fail.
func (s *Store) Release(ctx context.Context, c dedup.Claim) error {
	if err := dedup.ValidateRelease(c); err != nil {
		return err
	}
	if s.closed.Load() {
		return dedup.ErrClosed
	}
	if s.cfg.durable == nil {
		return dedup.ErrLeaseLost
	}
	k := pendingKey{c.Key, c.Token}
	sh := s.shard(k)
	sh.mu.Lock()
	p, found := sh.m[k]
	if found && p.fast.Outcome == dedup.Acquired {
		sh.m[k] = pendingClaim{fp: p.fp, deadline: p.deadline} // the fast claim goes now
	}
	sh.mu.Unlock()
	if found && p.fast.Outcome == dedup.Acquired {
		s.releaseFast(ctx, p.fast)
	}
	err := s.cfg.durable.Release(ctx, c)
	if err == nil || errors.Is(err, dedup.ErrLeaseLost) {
		s.forget(c)
	}
	// Otherwise the durable claim stays pending: a later Complete may still
	// finish it (its fast claim is gone; the durable record decides).
	return err
}

// Extend implements [dedup.Extender] when the durable store does: it
// extends the durable lease, which decides, then the fast store's lease if
// it can (a failure there is only reported).
func (s *Store) Extend(ctx context.Context, c dedup.Claim, lease time.Duration) (dedup.Claim, error) {
	if err := dedup.ValidateRelease(c); err != nil {
		return c, err
	}
	if s.closed.Load() {
		return c, dedup.ErrClosed
	}
	ext, ok := s.cfg.durable.(dedup.Extender)
	if !ok {
		return c, &dedup.ArgumentError{Arg: "layered store", Reason: "its durable store cannot extend leases"}
	}
	c2, err := ext.Extend(ctx, c, lease)
	if err != nil {
		return c, err
	}
	k := pendingKey{c.Key, c.Token}
	sh := s.shard(k)
	sh.mu.Lock()
	p, found := sh.m[k]
	sh.mu.Unlock()
	if fe, ok := s.cfg.fast.(dedup.Extender); ok && found && p.fast.Outcome == dedup.Acquired {
		if _, err := fe.Extend(ctx, p.fast, lease); err != nil {
			s.fastFailed(ctx, "extend", c.Key, err)
		}
	}
	return c2, nil
}

// Close stops the store after sending the filter writes queued so far
// (each bounded by the cleanup timeout); it leaves its layers open (the
// caller owns them).
func (s *Store) Close() error {
	s.closed.Store(true)
	s.closeWriter()
	return nil
}

// RunInbox runs one message through the window and the fast store, then
// through durable, the caller's transactional inbox step (for example a
// closure over sqlitestore's or pgstore's RunInbox with the business
// handler), which decides. Its Claim is returned as it is, and the faster
// layers are updated from it: completed (applied or duplicate) keys are
// recorded in the fast store, the filter and the window, anything else
// releases the fast claim. So durable must return Acquired only after its
// transaction committed (as those RunInbox functions do): an Acquired
// returned from inside a transaction that then fails to commit is written
// to the faster layers as completed, and every instance answers the
// redelivery as a duplicate until the entry expires. A durable step that
// returns a duplicate without ExpiresAt gets an expiry of now + retention
// in the faster layers, which may outlive the durable record.
func (s *Store) RunInbox(ctx context.Context, key dedup.Key, fp dedup.Fingerprint, retention time.Duration,
	durable func(ctx context.Context) (dedup.Claim, error)) (dedup.Claim, error) {
	if err := dedup.ValidateClaim(key, fp, retention); err != nil {
		return dedup.Claim{}, err
	}
	if s.closed.Load() {
		return dedup.Claim{}, dedup.ErrClosed
	}
	if c, done := s.early(ctx, key, fp); done {
		return c, nil
	}
	if c, done := s.lookup(ctx, key, fp); done {
		return c, nil
	}
	fc, fastOK := s.claimFast(ctx, key, fp, s.cfg.inboxLease)
	if fastOK && fc.Outcome != dedup.Acquired {
		return s.fastAnswer(key, fp, fc), nil
	}
	start := s.startDurable()
	dc, err := durable(ctx)
	s.endDurable(ctx, key, dc, err, start)
	switch {
	case err != nil:
		if fastOK {
			s.releaseFast(ctx, fc)
		}
		return dc, err
	case dc.Outcome == dedup.Acquired:
		if fastOK && fastCopySafe(fp, dc) {
			s.completeFast(ctx, fc, dc.Result, retention)
		} else if fastOK {
			s.releaseFast(ctx, fc)
		}
		exp := dedup.Deadline(s.cfg.clock.Now(), retention)
		s.addWindow(key, fp, dc.Result, exp)
		s.queueFilter(ctx, key, fp, dc.Result, exp)
	case dc.Outcome == dedup.Duplicate:
		s.stats.durable.Add(1)
		exp := dc.ExpiresAt
		if exp.IsZero() {
			exp = dedup.Deadline(s.cfg.clock.Now(), retention)
		}
		s.backfill(ctx, key, fp, fc, fastOK, dc.Result, exp)
	default:
		if fastOK {
			s.releaseFast(ctx, fc)
		}
	}
	return dc, nil
}

// fastCopySafe reports whether the fast claim taken with fp may become the
// fast store's copy of the durable record dc. The copy carries fp, and it
// must never match a payload that the durable record would refuse as a
// mismatch: a fast-store duplicate is answered without asking the durable
// store. A claim with a fingerprint makes a copy that matches no more than
// the durable record (which has the same fingerprint, or none). A claim
// without one makes a copy that matches everything, which is right only
// when the durable record was created by this claim (acquired fresh, so
// it has no fingerprint either); a take-over keeps the record's
// fingerprint, and a duplicate has the first request's.
func fastCopySafe(fp dedup.Fingerprint, dc dedup.Claim) bool {
	return fp != "" || (dc.Outcome == dedup.Acquired && !dc.TakenOver)
}

// completeFast completes the fast claim after the durable step, on a
// context detached from ctx (see WithCleanupTimeout).
func (s *Store) completeFast(ctx context.Context, fc dedup.Claim, result []byte, retention time.Duration) {
	cctx, cancel := s.cleanupContext(ctx)
	defer cancel()
	if err := s.cfg.fast.Complete(cctx, fc, result, retention); err != nil {
		s.fastFailed(ctx, "complete", fc.Key, err)
	}
}

// releaseFast releases the fast claim, on a context detached from ctx:
// the caller's context may have ended, which is often why it is released.
func (s *Store) releaseFast(ctx context.Context, fc dedup.Claim) {
	if fc.Outcome != dedup.Acquired {
		return
	}
	cctx, cancel := s.cleanupContext(ctx)
	defer cancel()
	if err := s.cfg.fast.Release(cctx, fc); err != nil {
		s.fastFailed(ctx, "release", fc.Key, err)
	}
}

// cleanupContext returns a context for a fast-store call that finishes a
// step: detached from ctx (keeping its values) and bounded by the cleanup
// timeout.
func (s *Store) cleanupContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), s.cfg.cleanup)
}

func (s *Store) fastFailed(ctx context.Context, op string, key dedup.Key, err error) {
	s.stats.fastErrors.Add(1)
	s.cfg.hooks.StoreFailed(ctx, dedup.StoreErrorEvent{Store: s.cfg.fastName, Op: op, Key: key, Err: err})
}

func (s *Store) addWindow(key dedup.Key, fp dedup.Fingerprint, result []byte, expires time.Time) {
	if s.cfg.win != nil && !expires.IsZero() {
		s.cfg.win.Add(key, encode(fp, result), expires)
	}
}

func (s *Store) duplicate(ctx context.Context, layer string, key dedup.Key) {
	s.cfg.hooks.Claimed(ctx, dedup.ClaimEvent{Store: layer, Key: key, Outcome: dedup.Duplicate})
}

// started reads the clock for a latency only when a hook will see it: a
// claim is a hot path.
func (s *Store) started() time.Time {
	if s.cfg.hooks.Empty() {
		return time.Time{}
	}
	return time.Now()
}

func (s *Store) observe(ctx context.Context, layer string, key dedup.Key, c dedup.Claim, err error, start time.Time) {
	if s.cfg.hooks.Empty() {
		return
	}
	e := dedup.ClaimEvent{Store: layer, Key: key, Outcome: c.Outcome, Attempt: c.Attempt, TakenOver: c.TakenOver, Duration: time.Since(start), Err: err}
	if err != nil {
		e.Outcome = 0
	}
	s.cfg.hooks.Claimed(ctx, e)
}

func (s *Store) shard(k pendingKey) *pendingShard {
	return &s.pending[maphash.String(s.seed, k.key.ID)%uint64(len(s.pending))]
}

func (s *Store) hold(dc, fc dedup.Claim, fp dedup.Fingerprint) {
	k := pendingKey{dc.Key, dc.Token}
	sh := s.shard(k)
	now := s.cfg.clock.Now()
	sh.mu.Lock()
	if len(sh.m) >= 1024 { // forget claims that nobody finished
		for pk, p := range sh.m {
			if now.After(p.deadline) {
				delete(sh.m, pk)
			}
		}
	}
	sh.m[k] = pendingClaim{fast: fc, fp: fp, deadline: dedup.Deadline(dc.LeaseUntil, time.Hour)}
	sh.mu.Unlock()
}

func (s *Store) forget(c dedup.Claim) (pendingClaim, bool) {
	k := pendingKey{c.Key, c.Token}
	sh := s.shard(k)
	sh.mu.Lock()
	p, ok := sh.m[k]
	delete(sh.m, k)
	sh.mu.Unlock()
	return p, ok
}

// encode packs the fingerprint with the result for the window, so that a
// window hit can tell a duplicate from a reused key.
func encode(fp dedup.Fingerprint, result []byte) []byte {
	b := make([]byte, 0, binary.MaxVarintLen64+len(fp)+len(result))
	b = binary.AppendUvarint(b, uint64(len(fp)))
	b = append(b, fp...)
	return append(b, result...)
}

func decode(b []byte) (fp, result []byte) {
	n, w := binary.Uvarint(b)
	if w <= 0 || uint64(len(b)-w) < n {
		return []byte("\x00corrupt"), nil // never equals a real fingerprint
	}
	return b[w : w+int(n)], b[w+int(n):]
}

type counters struct {
	window, bloom, fast, durable, suspected, fastErrors, fastUnsure atomic.Int64

	lookups, lookupsSkipped, filterWrites, filterDropped atomic.Int64
}

// Stats counts the duplicates each layer caught, Bloom "maybe" answers that
// were only suspected (Confirm mode), and fast-store failures that were
// passed over.
type Stats struct {
	Window, Bloom, Fast, Durable int64
	Suspected                    int64
	FastErrors                   int64
	// FastUnsure counts fast-store answers of "in progress" or "mismatch"
	// that Claim passed to the durable store to confirm or overrule.
	FastUnsure int64

	// With a filter (WithFilter): window misses looked up in it, window
	// misses not looked up because lookups were not paying, entries
	// written, and entries dropped because the write queue was
	// full. Fast counts the filter's duplicates, FastErrors its failures.
	Lookups, LookupsSkipped, FilterWrites, FilterDropped int64
	// LookupsPaused is true while lookups are not paying and only probes
	// are sent.
	LookupsPaused bool
}

// Stats returns the counts so far.
func (s *Store) Stats() Stats {
	return Stats{Window: s.stats.window.Load(), Bloom: s.stats.bloom.Load(), Fast: s.stats.fast.Load(),
		Durable: s.stats.durable.Load(), Suspected: s.stats.suspected.Load(), FastErrors: s.stats.fastErrors.Load(),
		FastUnsure: s.stats.fastUnsure.Load(),
		Lookups:    s.stats.lookups.Load(), LookupsSkipped: s.stats.lookupsSkipped.Load(),
		FilterWrites: s.stats.filterWrites.Load(), FilterDropped: s.stats.filterDropped.Load(),
		LookupsPaused: s.cfg.filter != nil && s.gate.isClosed()}
}
