package dedupwatermill

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
)

// Middleware deduplicates the messages of Watermill handlers on a
// [dedup.Store]. Use [Middleware.Middleware] as a message.HandlerMiddleware
// and Close the Middleware after the router has stopped. It is safe for
// concurrent use.
type Middleware struct {
	store  dedup.Store
	ext    dedup.Extender // nil without heartbeat or without support
	scope  string
	cfg    config
	stats  counters
	wake   chan struct{}
	quit   chan struct{} // closed by Close: heartbeats hand over and exit
	stopC  chan struct{} // closed by Close after the heartbeats exited
	done   chan struct{} // closed when the completer exited
	closed atomic.Bool

	mu      sync.Mutex
	queue   []waiting // handlers returned, not yet seen acked or nacked
	drained bool      // the completer has exited: push completes itself
	beating sync.WaitGroup
}

// waiting is a claim whose handler returned successfully (or whose failure
// is to be recorded) and whose message the router has not decided yet.
type waiting struct {
	msg    *message.Message
	claim  dedup.Claim
	result []byte
}

// Stats counts what the middleware decided.
type Stats struct {
	// Acquired: claims won; the handler ran.
	Acquired uint64
	// Duplicates: messages whose key was completed; acked, no handler run.
	Duplicates uint64
	// InProgress: messages whose key another delivery holds; an error
	// ([ErrInProgress]) went to the router.
	InProgress uint64
	// Mismatches: keys reused with another payload
	// ([dedup.ErrFingerprintMismatch]).
	Mismatches uint64
	// StoreErrors: claims that failed in the store (fail closed: nacked).
	StoreErrors uint64
	// Completed: claims completed after the router acked the message.
	Completed uint64
	// CompleteFailed: completions the store did not confirm (the record
	// stays in progress until its lease ends).
	CompleteFailed uint64
	// Released: claims removed after a handler error classified Release.
	Released uint64
	// Kept: claims left to their lease: an unknown outcome (a handler
	// error classified Keep, a panic, or a message nacked after its
	// handler succeeded, which is a failed publish of produced messages).
	Kept uint64
	// LeaseLost: heartbeats or completions that found the lease taken.
	LeaseLost uint64
}

type counters struct {
	acquired, duplicates, inProgress, mismatches, storeErrors atomic.Uint64
	completed, completeFailed, released, kept, leaseLost      atomic.Uint64
}

// ErrInProgress is matched (errors.Is) by the error returned for a message
// whose key another delivery holds under a live lease. It is the same
// sentinel as [dedup.ErrInProgress]; the error is a [*dedup.InProgressError]
// carrying when the lease ends. Watermill's Retry middleware backs off on
// it; keep it out of the poison queue with [ShouldPoison].
var ErrInProgress = dedup.ErrInProgress

// New returns a Middleware on store for the keys of scope (the consumer
// group or operation: the same message UUID in two scopes is two keys),
// or an [*dedup.ArgumentError] for a bad option. It starts one goroutine,
// the completer, which Close stops.
func New(store dedup.Store, scope string, opts ...Option) (*Middleware, error) {
	if store == nil {
		return nil, bad("store", "is nil")
	}
	if _, err := dedup.NewKey(scope, "x"); err != nil {
		return nil, err
	}
	cfg := defaultConfig()
	for _, o := range opts {
		o.apply(&cfg)
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	m := &Middleware{
		store: store, scope: scope, cfg: cfg,
		wake: make(chan struct{}, 1), quit: make(chan struct{}), stopC: make(chan struct{}), done: make(chan struct{}),
	}
	if ext, ok := store.(dedup.Extender); ok && cfg.heartbeat > 0 {
		m.ext = ext
	}
	go m.completer()
	return m, nil
}

// Classify is the default classifier of handler errors:
//
//   - context.Canceled or context.DeadlineExceeded (a Timeout middleware,
//     a shutdown mid-call), or an error marked [consumer.Unknown]: [dedup.Keep].
//     The effect may have started; the key stays claimed until its lease
//     ends, and the redelivery after that takes it over.
//   - an error marked [consumer.Reject] (a business rejection): [dedup.Record].
//   - any other error: [dedup.Release]. The handler reported that it
//     failed: it must not have applied its effect (apply it in one
//     transaction, or mark the error Unknown), and the redelivery runs it
//     again at once.
func Classify(err error) dedup.Disposition {
	switch consumer.ClassOf(err) {
	case consumer.ClassUnknown:
		return dedup.Keep
	case consumer.ClassBusiness:
		return dedup.Record
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return dedup.Keep
	}
	return dedup.Release
}

// ShouldPoison is a filter for Watermill's PoisonQueueWithFilter: it keeps
// out of the poison queue the errors that are not about the message: a key
// in progress elsewhere and a store failure (both are nacked and
// redelivered) and a lease lost by this delivery. Everything else goes to
// the poison queue as usual.
func ShouldPoison(err error) bool {
	return !errors.Is(err, dedup.ErrInProgress) && !dedup.IsStoreError(err) && !errors.Is(err, dedup.ErrLeaseLost)
}

type claimKey struct{}

// ClaimFrom returns the claim a handler runs under, from the message's
// context (msg.Context()). Claim.Attempt and Claim.TakenOver tell a
// handler that it took over a delivery whose outcome is unknown (a crash,
// a timeout, a failed publish of produced messages after the effect): it
// should reconcile before acting again.
func ClaimFrom(ctx context.Context) (dedup.Claim, bool) {
	if c, ok := ctx.Value(claimKey{}).(*claimCtx); ok {
		return dedup.Claim{Key: c.key, Outcome: dedup.Acquired, Token: c.token, Attempt: int(c.attempt),
			TakenOver: c.takenOver, LeaseUntil: c.leaseUntil}, true
	}
	return dedup.Claim{}, false
}

// claimCtx is the handler's context: the message's context with what an
// acquired claim holds, in one 96-byte allocation (context.WithValue
// would box the whole 144-byte Claim in a second one).
type claimCtx struct {
	context.Context
	key        dedup.Key
	token      dedup.Token
	leaseUntil time.Time
	attempt    int32 // saturated
	takenOver  bool
}

func newClaimCtx(parent context.Context, c dedup.Claim) *claimCtx {
	return &claimCtx{Context: parent, key: c.Key, token: c.Token, leaseUntil: c.LeaseUntil,
		attempt: int32(min(c.Attempt, math.MaxInt32)), takenOver: c.TakenOver}
}

func (c *claimCtx) Value(key any) any {
	if _, ok := key.(claimKey); ok {
		return c
	}
	return c.Context.Value(key)
}

func (c *claimCtx) String() string { return "dedupwatermill.claimCtx" }

// Stats returns the counters so far.
func (m *Middleware) Stats() Stats {
	s := &m.stats
	return Stats{
		Acquired: s.acquired.Load(), Duplicates: s.duplicates.Load(), InProgress: s.inProgress.Load(),
		Mismatches: s.mismatches.Load(), StoreErrors: s.storeErrors.Load(), Completed: s.completed.Load(),
		CompleteFailed: s.completeFailed.Load(), Released: s.released.Load(), Kept: s.kept.Load(),
		LeaseLost: s.leaseLost.Load(),
	}
}

// Middleware is the message.HandlerMiddleware. For each message it:
//
//  1. derives the key and fingerprint (an error: returned, the handler
//     does not run);
//  2. claims the key: a duplicate returns (nil, nil), so the router acks
//     it and publishes nothing (the first run's outputs were published
//     before its ack); a key in progress returns an [*dedup.InProgressError];
//     a reused key returns [dedup.ErrFingerprintMismatch]; a store failure
//     returns the [*dedup.StoreError] (fail closed: the router nacks);
//  3. runs the handler with the claim in the message's context;
//  4. on success returns the produced messages and completes the claim
//     only once the router has acked the message, that is after it
//     published them; if the router nacks it instead (the publish failed,
//     or a middleware outside this one failed), the claim is kept until
//     the lease ends, since the handler's effect ran: the redelivery after
//     the lease takes it over and runs the handler again (TakenOver), and
//     its outputs are published then;
//  5. on a handler error applies the classifier ([Classify]); a panic
//     keeps the claim and panics on.
func (m *Middleware) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		return m.handle(msg, h)
	}
}

func (m *Middleware) handle(msg *message.Message, h message.HandlerFunc) (out []*message.Message, err error) {
	if m.closed.Load() {
		return nil, dedup.ErrClosed
	}
	key, err := m.cfg.keyOf(m.scope, msg)
	if err != nil {
		return nil, err
	}
	fp, err := m.cfg.fingerprintOf(msg)
	if err != nil {
		return nil, err
	}
	ctx := msg.Context()
	c, err := m.store.Claim(ctx, key, fp, m.cfg.lease)
	if err != nil {
		if dedup.IsStoreError(err) {
			m.stats.storeErrors.Add(1)
		}
		return nil, err
	}
	switch c.Outcome {
	case dedup.Duplicate:
		m.stats.duplicates.Add(1)
		return nil, nil
	case dedup.InProgress:
		m.stats.inProgress.Add(1)
		return nil, c.Err()
	case dedup.Mismatch:
		m.stats.mismatches.Add(1)
		return nil, c.Err()
	}
	m.stats.acquired.Add(1)

	var hctx context.Context = newClaimCtx(ctx, c)
	var hb *beat
	if m.ext != nil {
		var cancel context.CancelCauseFunc
		hctx, cancel = context.WithCancelCause(hctx)
		if hb = m.heartbeat(hctx, cancel, msg, c); hb == nil {
			cancel(nil)
		}
	}
	msg.SetContext(hctx)
	// failed ends the heartbeat of a handler that did not succeed and
	// gives the message its context back, for Retry's next try.
	failed := func() {
		if hb != nil {
			hb.halt()
		}
		msg.SetContext(ctx)
	}
	finished := false
	defer func() {
		if finished {
			return
		}
		// A panic: the effect may have started. Keep the claim.
		failed()
		m.stats.kept.Add(1)
	}()
	out, err = h(msg)
	finished = true
	if err == nil {
		m.enqueue(waiting{msg: msg, claim: c}, hb)
		return out, nil
	}
	switch m.cfg.classify(err) {
	case dedup.Keep:
		failed()
		m.stats.kept.Add(1)
		return nil, err
	case dedup.Record:
		var re dedup.ResultError
		var result []byte
		if errors.As(err, &re) {
			result = re.Result()
		}
		m.enqueue(waiting{msg: msg, claim: c, result: result}, hb)
		return nil, nil
	}
	failed()
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), m.cfg.finalizeTimeout)
	defer cancel()
	if rerr := m.store.Release(fctx, c); rerr != nil {
		if errors.Is(rerr, dedup.ErrLeaseLost) {
			m.stats.leaseLost.Add(1)
		}
		return nil, errors.Join(err, rerr)
	}
	m.stats.released.Add(1)
	return nil, err
}

// push hands a decided claim to the completer.
func (m *Middleware) push(w waiting) {
	m.mu.Lock()
	if m.drained {
		// Closed while the handler ran: sort and complete it here, as
		// the completer would have.
		m.mu.Unlock()
		pending, acked := m.sort([]waiting{w}, nil)
		m.complete(acked, nil)
		m.stats.kept.Add(uint64(len(pending)))
		return
	}
	m.queue = append(m.queue, w)
	first := len(m.queue) == 1
	m.mu.Unlock()
	if first { // the completer may be idle; otherwise it comes back on its own
		select {
		case m.wake <- struct{}{}:
		default:
		}
	}
}

// beat is one heartbeat goroutine.
type beat struct {
	item   chan waiting  // the decided claim, once the handler returned
	stop   chan struct{} // closed when the handler failed or panicked
	exited chan struct{}
}

// handOver gives the heartbeat the decided claim: it goes on extending
// the lease until the router acks or nacks (a slow publish of produced
// messages keeps the lease), then hands the claim to the completer.
func (b *beat) handOver(w waiting) { b.item <- w }

// halt stops the heartbeat of a handler that failed or panicked.
func (b *beat) halt() {
	close(b.stop)
	<-b.exited
}

// heartbeat starts extending c's lease every heartbeat until the message
// is decided or the heartbeat is halted; nil after Close.
func (m *Middleware) heartbeat(ctx context.Context, cancel context.CancelCauseFunc, msg *message.Message, c dedup.Claim) *beat {
	m.mu.Lock()
	if m.closed.Load() {
		m.mu.Unlock()
		return nil
	}
	m.beating.Add(1)
	m.mu.Unlock()
	b := &beat{item: make(chan waiting, 1), stop: make(chan struct{}), exited: make(chan struct{})}
	go func() {
		defer m.beating.Done()
		defer close(b.exited)
		// The heartbeat's context ends with it (after the router decided,
		// or the handler failed), so that it does not stay registered
		// with the message's parent context.
		defer cancel(nil)
		t := time.NewTicker(m.cfg.heartbeat)
		defer t.Stop()
		var item *waiting
		for {
			var acked, nacked <-chan struct{}
			if item != nil {
				acked, nacked = msg.Acked(), msg.Nacked()
			}
			select {
			case w := <-b.item:
				item = &w
			case <-b.stop:
				return
			case <-acked:
				m.push(*item)
				return
			case <-nacked:
				m.stats.kept.Add(1)
				return
			case <-m.quit:
				if item != nil {
					m.push(*item) // the completer sorts it as it drains
				} else {
					m.stats.kept.Add(1)
				}
				return
			case <-t.C:
				ectx, ecancel := context.WithTimeout(context.WithoutCancel(ctx), m.cfg.finalizeTimeout)
				_, err := m.ext.Extend(ectx, c, m.cfg.lease)
				ecancel()
				if errors.Is(err, dedup.ErrLeaseLost) {
					m.stats.leaseLost.Add(1)
					cancel(dedup.ErrLeaseLost)
					if item != nil {
						return // nothing to complete: another owner has it
					}
					select { // wait for the handler; its claim cannot be completed
					case <-b.item:
					case <-b.stop:
					}
					return
				}
			}
		}
	}()
	return b
}

// enqueue hands a decided claim to its heartbeat, or to the completer.
func (m *Middleware) enqueue(w waiting, hb *beat) {
	if hb != nil {
		hb.handOver(w)
		return
	}
	m.push(w)
}

// completer completes the claims of acked messages in batches and drops
// those of nacked ones (kept until the lease ends).
func (m *Middleware) completer() {
	defer close(m.done)
	var pending, acked []waiting
	var items []dedup.Completion
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	for {
		if len(pending) == 0 {
			select {
			case <-m.wake:
			case <-m.stopC:
				m.drain(pending)
				return
			}
		}
		// Let the router ack what it is publishing, and more messages
		// arrive: their completions go in one batch.
		timer.Reset(m.cfg.pollInterval)
		select {
		case <-timer.C:
		case <-m.stopC:
			timer.Stop()
			m.drain(pending)
			return
		}
		m.mu.Lock()
		pending = append(pending, m.queue...)
		clear(m.queue)
		m.queue = m.queue[:0]
		m.mu.Unlock()
		pending, acked = m.sort(pending, acked[:0])
		items = m.complete(acked, items[:0])
		clear(acked)
	}
}

// sort moves the acked items of pending to acked, drops the nacked ones
// and returns what is left undecided.
func (m *Middleware) sort(pending, acked []waiting) ([]waiting, []waiting) {
	n := 0
	for _, w := range pending {
		select {
		case <-w.msg.Acked():
			acked = append(acked, w)
			continue
		default:
		}
		select {
		case <-w.msg.Nacked():
			m.stats.kept.Add(1)
			continue
		default:
		}
		pending[n] = w
		n++
	}
	clear(pending[n:])
	return pending[:n], acked
}

// drain completes, on quit, what is already acked; undecided claims are
// left to their lease.
func (m *Middleware) drain(pending []waiting) {
	m.mu.Lock()
	pending = append(pending, m.queue...)
	m.queue = nil
	m.drained = true
	m.mu.Unlock()
	pending, acked := m.sort(pending, nil)
	m.complete(acked, nil)
	m.stats.kept.Add(uint64(len(pending)))
}

// complete completes the acked claims in one batch, on a detached context
// bounded by the finalize timeout, retrying transient refusals one by one.
func (m *Middleware) complete(acked []waiting, items []dedup.Completion) []dedup.Completion {
	if len(acked) == 0 {
		return items
	}
	for _, w := range acked {
		items = append(items, dedup.Completion{Claim: w.claim, Result: w.result})
	}
	ctx, cancel := context.WithTimeout(context.Background(), m.cfg.finalizeTimeout)
	defer cancel()
	errs, err := dedup.CompleteBatch(ctx, m.store, items, m.cfg.retention)
	for i, it := range items {
		e := err
		if errs != nil {
			e = errs[i]
		}
		if e != nil && (dedup.IsTransient(e) || errs == nil && dedup.IsStoreError(e)) {
			e = m.completeOne(ctx, it)
		}
		switch {
		case e == nil:
			m.stats.completed.Add(1)
		case errors.Is(e, dedup.ErrLeaseLost):
			m.stats.leaseLost.Add(1)
		default:
			m.stats.completeFailed.Add(1)
		}
	}
	clear(items)
	return items[:0]
}

// completeOne completes one claim, trying again while the store refuses
// it for a passing condition.
func (m *Middleware) completeOne(ctx context.Context, it dedup.Completion) error {
	var err error
	for try := range m.cfg.completeTries {
		if try > 0 {
			d := min(5*time.Millisecond<<min(try-1, 6), 200*time.Millisecond)
			d += time.Duration(rand.Int64N(int64(d/2) + 1))
			t := time.NewTimer(d)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				return err
			}
		}
		if err = m.store.Complete(ctx, it.Claim, it.Result, m.cfg.retention); err == nil || !(dedup.IsTransient(err) || dedup.IsStoreError(err)) {
			return err
		}
	}
	return err
}

// Close stops the completer after completing the claims of messages
// already acked; claims of messages not yet decided stay until their
// lease ends (an unknown outcome is never released). Close the router
// first. Later messages fail with [dedup.ErrClosed]. It does not close
// the store.
func (m *Middleware) Close() error {
	m.mu.Lock()
	if m.closed.Swap(true) {
		m.mu.Unlock()
		return nil
	}
	m.mu.Unlock()
	close(m.quit)
	m.beating.Wait()
	close(m.stopC)
	<-m.done
	return nil
}
