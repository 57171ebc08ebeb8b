package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup"
)

// Action is what the adapter does with a message after [Processor.Process].
type Action uint8

const (
	// Ack acknowledges: the message was applied now or before (Duplicate).
	Ack Action = iota + 1
	// Retry negatively acknowledges: redeliver after Delay. Nothing was
	// recorded as done.
	Retry
	// DeadLettered acknowledges (terminates) the original: the sink kept
	// the message for inspection and replay.
	DeadLettered
	// Rejected acknowledges a business rejection, recorded as the
	// message's outcome: redeliveries are duplicates.
	Rejected
)

var actionNames = [...]string{"", "ack", "retry", "dead-lettered", "rejected"}

func (a Action) String() string {
	if int(a) < len(actionNames) && a != 0 {
		return actionNames[a]
	}
	return "action(?)"
}

// Decision is the result of processing one message.
type Decision struct {
	Action Action
	// Delay is how long to wait before the redelivery (Retry).
	Delay time.Duration
	// Key is the message's dedup key (zero if it could not be derived).
	Key dedup.Key
	// Duplicate is set for an Ack of a message processed before; Result
	// is then the stored result.
	Duplicate bool
	Result    []byte
	// Class and Attempt describe the failure behind Retry, DeadLettered
	// and Rejected; Err is that failure.
	Class   Class
	Attempt int
	Err     error
}

// Acknowledge reports whether the adapter should acknowledge the message
// (every action but Retry).
func (d Decision) Acknowledge() bool { return d.Action != Retry }

// Stats counts decisions since the processor was made.
type Stats struct {
	Applied, Duplicates, Retries, DeadLettered, Rejected uint64
	// InProgress counts retries because another consumer held the key;
	// StoreErrors retries because the store failed (fail closed).
	InProgress, StoreErrors uint64
	// Reconciled counts unknown outcomes the reconciler settled as
	// applied.
	Reconciled uint64
}

// Processor composes key extraction, the dedup claim (a store or a
// transactional inbox), the handler and the failure policy into one
// decision per message. It is broker-neutral and safe for concurrent use.
type Processor struct {
	name  string
	cfg   config
	apply func(ctx context.Context, p *Processor, m *Message, key dedup.Key, fp dedup.Fingerprint) (out applied, err error)
	// runner and h are set in store mode ([New]), which run calls without
	// apply: a method call, not a closure's, with what it did filled in
	// place.
	runner *dedup.Runner
	h      Handler
	// startBatch claims st's items in one batch and runs their handlers
	// (store mode); finish completes them and fills in what each run did.
	// nil in inbox mode.
	startBatch func(ctx context.Context, p *Processor, st *batchRun) (finish func(), pb *dedup.PendingBatch)
	track      *tracker

	// The decision counts are written once a message, by every goroutine
	// the adapter runs messages on (unless each has a Lane); the fields
	// above are read once a message by all of them. The padding keeps the
	// counts off the cache lines of those fields (128 bytes: the
	// adjacent-line prefetch pairs lines), so that a count does not evict
	// them from the other cores.
	_ [128]byte
	counts
	// lanes are the lanes open, whose counts Stats adds in (guarded by
	// lanesMu, which also orders a lane's Close against Stats).
	lanesMu sync.Mutex
	lanes   []*Lane
}

// counts are decision counts: a processor's, or a lane's.
type counts struct {
	applied, duplicates, retries, deadLettered, rejected atomic.Uint64
	inProgress, storeErrors, reconciled                  atomic.Uint64
}

// addTo adds the counts to s.
func (n *counts) addTo(s *Stats) {
	s.Applied += n.applied.Load()
	s.Duplicates += n.duplicates.Load()
	s.Retries += n.retries.Load()
	s.DeadLettered += n.deadLettered.Load()
	s.Rejected += n.rejected.Load()
	s.InProgress += n.inProgress.Load()
	s.StoreErrors += n.storeErrors.Load()
	s.Reconciled += n.reconciled.Load()
}

// moveTo adds the counts to to and sets them to zero.
func (n *counts) moveTo(to *counts) {
	to.applied.Add(n.applied.Swap(0))
	to.duplicates.Add(n.duplicates.Swap(0))
	to.retries.Add(n.retries.Swap(0))
	to.deadLettered.Add(n.deadLettered.Swap(0))
	to.rejected.Add(n.rejected.Swap(0))
	to.inProgress.Add(n.inProgress.Swap(0))
	to.storeErrors.Add(n.storeErrors.Swap(0))
	to.reconciled.Add(n.reconciled.Swap(0))
}

// A Lane processes messages for one goroutine at a time: its Process
// makes exactly the decisions, calls and counts of [Processor.Process].
// What differs is where the counts of the decisions that end a message's
// run (applied, duplicate, rejected, a key in progress, a store failure)
// are kept until [Lane.Close]: on cache lines of the lane's own, which
// [Processor.Stats] adds in, so a snapshot counts them as it would the
// processor's. An adapter that runs messages on several goroutines at
// once (the partitions of a Kafka consumer) gives each goroutine a lane,
// so that they do not all write one counter a message, whose cache line
// would move between the cores at each write.
//
// A lane must not be used by two goroutines at once; goroutines may take
// turns with one. Close it when its goroutine is done with it (see
// [Processor.NewLane]).
type Lane struct {
	p *Processor
	n *counts // &own; the processor's once the lane is closed
	// own is written once a message, by the goroutine that has the lane:
	// the padding keeps it off the lines of other objects (another lane's
	// counts, on another core).
	_   [128]byte
	own counts
	_   [128]byte
}

// NewLane returns a new lane of p. Close it when it is no longer used:
// until then p holds it, and [Processor.Stats] adds its counts in at each
// call, for as long as p lives. A lane never closed loses no count (Stats
// still includes it), but it is never freed, and each one makes Stats
// slower: make one lane per goroutine that lives long, not one per message
// or per batch left open.
func (p *Processor) NewLane() *Lane {
	l := &Lane{p: p}
	l.n = &l.own
	p.lanesMu.Lock()
	p.lanes = append(p.lanes, l)
	p.lanesMu.Unlock()
	return l
}

// Process is [Processor.Process], counted on the lane.
func (l *Lane) Process(ctx context.Context, m *Message) Decision {
	if m == nil {
		return nilMessage(l.p)
	}
	d := l.p.process(ctx, m, l.n)
	l.p.observed(m, d)
	return d
}

// Close adds the lane's counts to its processor's and detaches it: the
// processor no longer looks at it, and a later Process (allowed, not
// concurrently with Close) counts on the processor. Closing twice is no
// change.
func (l *Lane) Close() {
	p := l.p
	p.lanesMu.Lock()
	defer p.lanesMu.Unlock()
	i := slices.Index(p.lanes, l)
	if i < 0 {
		return
	}
	p.lanes = slices.Delete(p.lanes, i, i+1)
	l.own.moveTo(&p.counts)
	l.n = &p.counts
}

// applied is what one run through the store or inbox did.
type applied struct {
	ran       bool // the handler (or reconciler) ran
	duplicate bool
	recorded  bool // a business rejection was completed
	result    []byte
	attempt   int
}

// set takes what the runner reports.
func (a *applied) set(res dedup.Result) {
	a.duplicate, a.recorded, a.result, a.attempt = res.Duplicate, res.Recorded, res.Result, res.Attempt
}

// batchItem is one message of a batch run through the store: the message,
// its key and fingerprint, and what its run did.
type batchItem struct {
	m   *Message
	key dedup.Key
	fp  dedup.Fingerprint
	a   applied
	err error
}

// New returns a processor that claims each message in store (lease mode:
// claim, run h, complete or release) under consumer name.
func New(name string, store dedup.Store, h Handler, opts ...Option) (*Processor, error) {
	if store == nil {
		return nil, &dedup.ArgumentError{Arg: "store", Reason: "is nil"}
	}
	if h == nil {
		return nil, &dedup.ArgumentError{Arg: "handler", Reason: "is nil"}
	}
	p, err := newProcessor(name, opts)
	if err != nil {
		return nil, err
	}
	ropts := []dedup.RunnerOption{
		dedup.WithName(name), dedup.WithLease(p.cfg.lease), dedup.WithRetention(p.cfg.retention),
		dedup.WithClassifier(disposition),
	}
	if p.cfg.heartbeat > 0 {
		ropts = append(ropts, dedup.WithHeartbeat(p.cfg.heartbeat))
	}
	runner, err := dedup.NewRunner(store, append(ropts, p.cfg.runnerOpts...)...)
	if err != nil {
		return nil, err
	}
	p.runner, p.h = runner, h
	p.startBatch = func(ctx context.Context, p *Processor, st *batchRun) (func(), *dedup.PendingBatch) {
		items := st.items
		reqs := st.reqs[:0]
		for j := range items {
			reqs = append(reqs, dedup.ClaimRequest{Key: items[j].key, Fingerprint: items[j].fp})
		}
		st.reqs = reqs
		pb := runner.StartBatch(ctx, reqs, func(ctx context.Context, j int, c dedup.Claim) ([]byte, error) {
			it := &items[j]
			it.a.ran = true
			return p.runHandler(ctx, it.m, it.key, c.TakenOver)
		})
		return func() {
			res, errs := pb.Finish()
			for j := range items {
				it := &items[j]
				if pe, ok := errs[j].(*dedup.PanicError); ok {
					// As in Process: the claim was released; a permanent failure.
					it.a, it.err = applied{ran: true}, panicked(pe.Value)
					continue
				}
				it.a.set(res[j])
				it.err = errs[j]
			}
			// Copied: the runner may make a later batch in their memory.
			pb.Release()
		}, pb
	}
	return p, nil
}

// runHandler applies m (store mode) under a claim that took over an
// earlier owner or not: reconcile if needed, then the handler. Without a
// reconciler that is the handler alone (attempt would call it and return
// what it returns).
func (p *Processor) runHandler(ctx context.Context, m *Message, key dedup.Key, takenOver bool) ([]byte, error) {
	d := Delivery{Key: key, Attempt: p.track.attempt(key), TakenOver: takenOver}
	if p.cfg.reconcile == nil {
		return p.h(ctx, m, d)
	}
	return p.attempt(ctx, m, d, func(ctx context.Context) ([]byte, error) { return p.h(ctx, m, d) })
}

// disposition maps a failure class to what the runner does with the
// claim: a rejection is recorded, an unknown outcome keeps the claim for
// its lease (the take-over reconciles), anything else releases it so the
// retry or a replay applies.
func disposition(err error) dedup.Disposition {
	switch ClassOf(err) {
	case ClassBusiness:
		return dedup.Record
	case ClassUnknown:
		return dedup.Keep
	}
	return dedup.Release
}

// An Inbox is a store with a transactional inbox: sqlitestore.Store
// (Tx = *sql.Tx) and pgstore.Store (Tx = pgx.Tx) are Inboxes.
type Inbox[Tx any] interface {
	RunInbox(ctx context.Context, key dedup.Key, fp dedup.Fingerprint, retention time.Duration,
		h func(ctx context.Context, tx Tx) ([]byte, error)) (dedup.Claim, error)
}

// A TxHandler applies one message inside the inbox's transaction.
type TxHandler[Tx any] func(ctx context.Context, tx Tx, m *Message, d Delivery) ([]byte, error)

// NewInbox returns a processor that applies each message with h inside
// inbox's transaction, together with its dedup record: a crash at any
// instant leaves both or neither.
//
// A handler error rolls the transaction back, whatever its class, except
// a business rejection ([Reject]): its transaction commits with the
// rejection recorded as the outcome, so reject before writing anything
// you would not keep. An unknown outcome the reconciler settles as applied
// also commits.
func NewInbox[Tx any](name string, inbox Inbox[Tx], h TxHandler[Tx], opts ...Option) (*Processor, error) {
	p, err := newStepProcessor(name, "inbox", any(inbox) == nil, h == nil, opts)
	if err != nil {
		return nil, err
	}
	p.apply = func(ctx context.Context, p *Processor, m *Message, key dedup.Key, fp dedup.Fingerprint) (applied, error) {
		var a applied
		var rejected []byte
		c, err := inbox.RunInbox(ctx, key, fp, p.cfg.retention, func(ctx context.Context, tx Tx) ([]byte, error) {
			a.ran = true
			rejected = nil
			d := Delivery{Key: key, Attempt: p.track.attempt(key)}
			out, err := p.attempt(ctx, m, d, func(ctx context.Context) ([]byte, error) { return h(ctx, tx, m, d) })
			var ce *classError
			if err != nil && errors.As(err, &ce) && ce.class == ClassBusiness {
				rejected = ce.result
				a.recorded = true
				return ce.result, nil
			}
			a.recorded = false
			return out, err
		})
		if err != nil {
			a.recorded = false
			return a, err
		}
		res := c.Result
		if a.recorded {
			res = rejected
		}
		return a, a.claimed(c, res)
	}
	return p, nil
}

// newStepProcessor is the start of NewInbox and NewApply: their store
// (named storeArg) and handler must not be nil.
func newStepProcessor(name, storeArg string, noStore, noHandler bool, opts []Option) (*Processor, error) {
	if noStore {
		return nil, &dedup.ArgumentError{Arg: storeArg, Reason: "is nil"}
	}
	if noHandler {
		return nil, &dedup.ArgumentError{Arg: "handler", Reason: "is nil"}
	}
	return newProcessor(name, opts)
}

// claimed takes the claim of an inbox step that acquired with result res,
// or found the key done or taken (an error for the decision).
func (a *applied) claimed(c dedup.Claim, res []byte) error {
	a.attempt = c.Attempt
	switch c.Outcome {
	case dedup.Acquired:
		a.result = res
		return nil
	case dedup.Duplicate:
		a.duplicate, a.result, a.recorded = true, c.Result, false
		return nil
	}
	a.recorded = false
	return c.Err()
}

func newProcessor(name string, opts []Option) (*Processor, error) {
	cfg := defaultConfig(name)
	for _, o := range opts {
		o.apply(&cfg)
	}
	if err := cfg.validate(name); err != nil {
		return nil, err
	}
	return &Processor{name: name, cfg: cfg, track: newTracker(cfg.tracked)}, nil
}

// Name returns the consumer name.
func (p *Processor) Name() string { return p.name }

// Lease returns the claim lease, for adapters that keep the broker's own
// redelivery timer (NATS AckWait) longer than it.
func (p *Processor) Lease() time.Duration { return p.cfg.lease }

// Retention returns how long processed keys are remembered, for adapters
// that compare it with the broker's duplicate window.
func (p *Processor) Retention() time.Duration { return p.cfg.retention }

// Stats returns the decision counts so far.
//
// The counts of the lanes open ([Processor.NewLane]) are included.
func (p *Processor) Stats() Stats {
	var s Stats
	p.lanesMu.Lock()
	defer p.lanesMu.Unlock()
	p.counts.addTo(&s)
	for _, l := range p.lanes {
		l.own.addTo(&s)
	}
	return s
}

// Process runs one message and says what to do with it. It never returns
// a decision that acknowledges a message that was neither applied, found
// applied before, rejected and recorded, nor kept by the dead-letter sink.
//
//   - Applied or duplicate: Ack.
//   - Business rejection ([Reject]): recorded, Rejected.
//   - Another consumer holds the key: Retry after its lease.
//   - The store failed: Retry with backoff (fail closed; not counted as
//     an attempt).
//   - A handler failure (or panic, counted as permanent): Retry with
//     backoff until the class's attempt limit, then DeadLettered. If the
//     sink fails, Retry.
//   - A key that cannot be derived or a fingerprint conflict: DeadLettered
//     at once.
func (p *Processor) Process(ctx context.Context, m *Message) Decision {
	if m == nil {
		return nilMessage(p)
	}
	d := p.process(ctx, m, &p.counts)
	p.observed(m, d)
	return d
}

// ProcessBatch runs a batch of messages and returns, for each, exactly the
// decision [Processor.Process] would have made for the messages one after
// the other, with the same failure classes, attempts, dead letters,
// reconciliation, hooks, observer calls and stats; the store sees two
// round trips for the batch instead of two per message.
//
// In store mode ([New]) it claims every key in one call
// ([dedup.ClaimBatch], one round trip on a [dedup.BatchClaimer]), runs the
// handlers one at a time in message order, releases or keeps a failure's
// claim at once as Process does, and then completes the successes and the
// business rejections (with their results) in one call
// ([dedup.CompleteBatch], one round trip on a [dedup.BatchCompleter]). A
// store failure of the batch claim fails every message closed (Retry), and
// no handler runs. A message whose key repeats one earlier in the batch is
// not claimed with it: it is processed alone after the batch ran, in its
// turn, so it is a duplicate (or runs again if the first one failed and
// was released). So is a message without a valid key or over
// [WithMaxDeliveries], which is dead-lettered in its turn.
//
// Leases: a claim waits for the handlers before it, and a success for the
// batch's complete, so a long batch could outlive its claims. Chunks sized
// to the lease would need a guess of how long handlers take, and would
// still let a success wait for a slow handler after it; instead the
// runner extends every claim the batch holds and is not running
// ([dedup.Extender]) each third of the lease (or each heartbeat, when
// [WithHeartbeat] is shorter), so no claim expires however long the batch
// takes, and a handler starts with at least two thirds of its lease. A
// claim found lost, or not extended for half a lease (the store failed),
// is not run on: its message is processed alone after the batch, as
// Process would. On a store that cannot extend, every message is. See
// [dedup.Runner.DoBatch].
//
// A panic in a handler releases that message's claim and every claim not
// yet run; the message is a permanent failure, as in Process, and the
// messages after it are then processed one at a time, as Process does.
//
// The observer sees every decision after the batch, in message order.
// Dead letters and failure counts are decided after the batch too, so
// once ctx is done (a shutdown) the decisions are those Process would make
// at the end of the batch. In inbox mode ([NewInbox]), whose transaction
// is per message, ProcessBatch calls Process for each message.
//
// A [Pipeline] runs batches with these decisions, overlapping each
// batch's completion with the claim and handlers of the next.
func (p *Processor) ProcessBatch(ctx context.Context, ms []*Message) []Decision {
	if p.startBatch == nil {
		ds := make([]Decision, len(ms))
		for i, m := range ms {
			ds[i] = p.Process(ctx, m)
		}
		return ds
	}
	st := p.prepare(nil, ms)
	st.start(ctx, p)
	st.finish()
	return st.decide(ctx, p)
}

// batchRun is one batch of ProcessBatch (or of a Pipeline) between its
// steps: the messages, those claimed together, and the batch's finish.
// A Pipeline keeps its batchRuns once their batch was decided and done
// returned, and prepares a later batch in one (see recycle): the slices
// and the key set are then written again, never while a batch that uses
// them is in flight. The decisions are always new.
type batchRun struct {
	ms      []*Message
	items   []batchItem
	batched []int                // 1 + the message's index in items; 0: processed alone
	keys    keySet               // the batch's keys
	reqs    []dedup.ClaimRequest // the claims of items, handed to the runner
	// alone is set when a message is processed alone in its turn with its
	// handler (its key repeats one earlier in the batch).
	alone bool
	fin   func()
	pb    *dedup.PendingBatch
}

// prepare derives the keys of ms and picks the messages claimed together,
// in st's memory (a batchRun recycled) or, with st nil, in new memory.
func (p *Processor) prepare(st *batchRun, ms []*Message) *batchRun {
	if st == nil {
		st = &batchRun{}
	}
	st.ms = ms
	if cap(st.items) < len(ms) {
		st.items = make([]batchItem, 0, len(ms))
		st.batched = make([]int, len(ms))
		st.keys.grow(len(ms))
	} else {
		st.batched = st.batched[:len(ms)]
		clear(st.batched)
	}
	for i, m := range ms {
		if m == nil {
			continue
		}
		key, err := p.keyOf(m)
		if err != nil {
			continue // dead-lettered in its turn
		}
		if !st.keys.add(key) {
			st.alone = true
			continue
		}
		if p.overDelivered(m) {
			continue
		}
		st.items = append(st.items, batchItem{m: m, key: key, fp: p.fingerprintOf(m)})
		st.batched[i] = len(st.items)
	}
	return st
}

// recycle empties st for the next prepare, once its batch was decided and
// nothing reads its items, keys or claim requests: it drops every
// reference to the batch's messages, results and errors, and keeps the
// memory. The decisions are not recycled: done may keep them.
func (st *batchRun) recycle() {
	clear(st.items)
	clear(st.reqs)
	st.keys.reset()
	*st = batchRun{items: st.items[:0], batched: st.batched[:0], keys: st.keys, reqs: st.reqs[:0]}
}

// start claims the batch and runs its handlers.
func (st *batchRun) start(ctx context.Context, p *Processor) {
	if len(st.items) > 0 {
		st.fin, st.pb = p.startBatch(ctx, p, st)
	}
}

// clean reports whether every message was claimed with the batch, was
// acquired and ran its handler without a failure: only the completion is
// left.
func (st *batchRun) clean() bool {
	return len(st.items) == len(st.ms) && st.pb != nil && st.pb.Clean()
}

// runsHandlers reports whether finish or decide will run handlers.
func (st *batchRun) runsHandlers() bool {
	return st.alone || st.pb != nil && st.pb.RunsHandlers()
}

// finish completes the batch.
func (st *batchRun) finish() {
	if st.fin != nil {
		st.fin()
	}
}

// decide decides in message order, as Process would: a message not in the
// batch (no valid key, over the delivery limit, or a key repeated) is
// processed alone in its turn, after the messages before it decided.
func (st *batchRun) decide(ctx context.Context, p *Processor) []Decision {
	return st.decideInto(ctx, p, nil)
}

// decideInto is decide in the memory of into (empty, from
// Pipeline.Recycle) when it is large enough, else in a new slice.
func (st *batchRun) decideInto(ctx context.Context, p *Processor, into []Decision) []Decision {
	var ds []Decision
	if cap(into) >= len(st.ms) {
		ds = into[:len(st.ms)]
	} else {
		ds = make([]Decision, len(st.ms))
	}
	for i, m := range st.ms {
		switch {
		case m == nil:
			ds[i] = nilMessage(p)
			continue
		case st.batched[i] > 0:
			it := &st.items[st.batched[i]-1]
			ds[i] = p.decide(ctx, m, it.key, &it.a, it.err, &p.counts)
		default:
			ds[i] = p.process(ctx, m, &p.counts)
		}
		p.observed(m, ds[i])
	}
	return ds
}

func nilMessage(p *Processor) Decision {
	return Decision{Action: Retry, Delay: p.cfg.maxDelay, Err: &dedup.ArgumentError{Arg: "message", Reason: "is nil"}}
}

// process is Process without the observer, counting on cn.
func (p *Processor) process(ctx context.Context, m *Message, cn *counts) Decision {
	key, err := p.keyOf(m)
	if err != nil || p.overDelivered(m) {
		return p.refuse(ctx, m, key, err)
	}
	var a applied
	err = p.run(ctx, m, key, p.fingerprintOf(m), &a)
	return p.decide(ctx, m, key, &a, err, cn)
}

func (p *Processor) observed(m *Message, d Decision) {
	if p.cfg.observe != nil {
		p.cfg.observe(m, d)
	}
}

// refuse decides for a message that must not run: its key (derived as
// key, with keyErr) is not valid, or it was delivered too often. It is
// dead-lettered.
func (p *Processor) refuse(ctx context.Context, m *Message, key dedup.Key, keyErr error) Decision {
	if keyErr != nil {
		return p.deadLetter(ctx, m, key, ClassPermanent, 1, fmt.Errorf("no valid dedup key: %w", keyErr))
	}
	n, _ := p.track.fail(key, p.cfg.clock.Now(), false)
	return p.deadLetter(ctx, m, key, ClassPermanent, n,
		fmt.Errorf("delivered %d times, over the limit of %d (the process may have crashed on it)", m.Delivery, p.cfg.maxDeliver))
}

func (p *Processor) fingerprintOf(m *Message) dedup.Fingerprint {
	if p.cfg.fingerprint == nil {
		return ""
	}
	return p.cfg.fingerprint(m)
}

// overDelivered reports whether the broker delivered m more often than
// WithMaxDeliveries allows.
func (p *Processor) overDelivered(m *Message) bool {
	return p.cfg.maxDeliver > 0 && m.Delivery > p.cfg.maxDeliver
}

// decide turns what a run did into the decision, counted on cn (the
// processor's counts or a lane's).
func (p *Processor) decide(ctx context.Context, m *Message, key dedup.Key, a *applied, err error, cn *counts) Decision {
	if err != nil {
		return p.failed(ctx, m, key, a, err, cn)
	}
	p.track.forget(key)
	switch {
	case a.duplicate:
		cn.duplicates.Add(1)
		return Decision{Action: Ack, Key: key, Duplicate: true, Result: a.result, Attempt: a.attempt}
	case a.recorded:
		cn.rejected.Add(1)
		return Decision{Action: Rejected, Key: key, Result: a.result, Class: ClassBusiness, Attempt: a.attempt}
	}
	cn.applied.Add(1)
	return Decision{Action: Ack, Key: key, Result: a.result, Attempt: a.attempt}
}

// failed decides for a run that returned err. A rejection, a key in
// progress and a store failure are counted on cn; retries, dead letters
// and reconciliations on the processor.
func (p *Processor) failed(ctx context.Context, m *Message, key dedup.Key, a *applied, err error, cn *counts) Decision {
	if a.recorded && ClassOf(err) == ClassBusiness {
		// Store mode: the rejection was recorded and the runner returns
		// the handler's error alongside.
		p.track.forget(key)
		cn.rejected.Add(1)
		return Decision{Action: Rejected, Key: key, Result: a.result, Class: ClassBusiness, Attempt: a.attempt, Err: err}
	}
	if !a.ran || dedup.IsStoreError(err) {
		var ipe *dedup.InProgressError
		switch {
		case errors.As(err, &ipe):
			cn.inProgress.Add(1)
			delay := max(ipe.RetryAfter(p.cfg.clock.Now()), p.cfg.baseDelay)
			return p.retry(m, key, Decision{Action: Retry, Delay: min(delay, p.cfg.lease), Key: key, Err: err})
		case errors.Is(err, dedup.ErrFingerprintMismatch):
			return p.deadLetter(ctx, m, key, ClassPermanent, 1, err)
		case errors.Is(err, dedup.ErrInvalidArgument):
			return p.deadLetter(ctx, m, key, ClassPermanent, 1, err)
		}
		// A store failure, before or after the handler: fail closed. Not an
		// attempt: a store outage must not dead-letter healthy messages.
		cn.storeErrors.Add(1)
		return p.retry(m, key, Decision{Action: Retry, Delay: p.backoff(max(m.Delivery, 1)), Key: key, Err: err})
	}
	class := ClassOf(err)
	if ctx.Err() != nil && (class == Unclassified || class == ClassTransient) {
		// The consumer is shutting down or gave up on this delivery: the
		// handler's failure says nothing about the message. Not an attempt.
		return p.retry(m, key, Decision{Action: Retry, Delay: p.cfg.baseDelay, Key: key, Class: class, Err: err})
	}
	if class == ClassBusiness {
		// Inbox mode never gets here (a rejection commits); a store-mode
		// rejection whose recording failed is a store error above.
		class = Unclassified
	}
	n, _ := p.track.fail(key, p.cfg.clock.Now(), class == ClassUnknown)
	if n >= p.cfg.limits.of(class) {
		return p.deadLetter(ctx, m, key, class, n, err)
	}
	delay := p.backoff(n)
	if class == ClassUnknown {
		// The claim is kept until its lease ends; an earlier redelivery
		// would only find it in progress.
		delay = max(delay, p.cfg.lease)
	}
	return p.retry(m, key, Decision{Action: Retry, Delay: delay, Key: key, Class: class, Attempt: n, Err: err})
}

func (p *Processor) retry(m *Message, key dedup.Key, d Decision) Decision {
	p.retries.Add(1)
	if l := p.cfg.logger; l != nil {
		l.Warn("consumer: retrying message", p.logAttrs(m, key, d.Class, d.Err, slog.Int("attempt", d.Attempt), slog.Duration("delay", d.Delay))...)
	}
	return d
}

// run calls apply and turns a handler panic into a permanent failure. The
// store-mode runner has already released the claim; the inbox has rolled
// back.
func (p *Processor) run(ctx context.Context, m *Message, key dedup.Key, fp dedup.Fingerprint, a *applied) (err error) {
	defer func() {
		if r := recover(); r != nil {
			*a, err = applied{ran: true}, panicked(r)
		}
	}()
	if p.runner != nil {
		// Store mode: m runs under the runner's claim of key, and a
		// says what the run did.
		res, err := p.runner.DoClaim(ctx, key, fp, func(ctx context.Context, c dedup.Claim) ([]byte, error) {
			a.ran = true
			return p.runHandler(ctx, m, key, c.TakenOver)
		})
		a.set(res)
		return err
	}
	*a, err = p.apply(ctx, p, m, key, fp)
	return err
}

// panicked is the failure of a handler that panicked with v: permanent.
func panicked(v any) error { return Permanent(fmt.Errorf("handler panicked: %v", v)) }

// attempt reconciles before the handler when an earlier attempt's outcome
// is unknown, and after it when the handler reports an unknown outcome.
func (p *Processor) attempt(ctx context.Context, m *Message, d Delivery, h func(context.Context) ([]byte, error)) ([]byte, error) {
	rec := p.cfg.reconcile
	if rec != nil && (d.TakenOver || p.track.unknown(d.Key)) {
		r, err := rec(ctx, d.Key, m)
		if err != nil {
			return nil, Unknown(fmt.Errorf("reconcile before retry: %w", err))
		}
		if r.Applied {
			p.reconciled.Add(1)
			return r.Result, nil
		}
	}
	out, err := h(ctx)
	if err == nil || rec == nil || ClassOf(err) != ClassUnknown {
		return out, err
	}
	r, rerr := rec(ctx, d.Key, m)
	switch {
	case rerr != nil:
		return nil, err // still unknown
	case r.Applied:
		p.reconciled.Add(1)
		return r.Result, nil
	}
	// Known not to have happened: an ordinary retry.
	return nil, Transient(err)
}

func (p *Processor) keyOf(m *Message) (dedup.Key, error) {
	if p.cfg.key != nil {
		k, err := p.cfg.key(m)
		if err != nil {
			return k, err
		}
		return k, k.Validate()
	}
	id := m.ID
	if p.cfg.businessKey && m.BusinessKey != "" {
		id = m.BusinessKey
	}
	// The scope is the processor's, which newProcessor validated: only the
	// ID is checked again (beside a one-byte scope: the same error for it).
	return dedup.Key{Scope: p.cfg.scope, ID: id}, dedup.Key{Scope: "s", ID: id}.Validate()
}

// deadLetter hands m to the sink and, once it is kept, decides
// DeadLettered; if the sink fails, Retry.
func (p *Processor) deadLetter(ctx context.Context, m *Message, key dedup.Key, class Class, attempts int, cause error) Decision {
	now := p.cfg.clock.Now()
	first, last := p.track.times(key)
	if first.IsZero() {
		first, last = now, now
	}
	dl := DeadLetter{
		Consumer: p.name, Key: key, Message: *m, Class: class, Reason: p.cfg.reason(cause),
		Attempts: attempts, FirstFailure: first, LastFailure: last,
	}
	if err := p.cfg.sink.DeadLetter(ctx, dl); err != nil {
		n := max(attempts, 1)
		return p.retry(m, key, Decision{Action: Retry, Delay: p.backoff(n), Key: key, Class: class, Attempt: attempts,
			Err: errors.Join(cause, fmt.Errorf("consumer: dead-letter sink failed, the message is kept for a retry: %w", err))})
	}
	p.track.forget(key)
	p.deadLettered.Add(1)
	if l := p.cfg.logger; l != nil {
		l.Error("consumer: message dead-lettered", p.logAttrs(m, key, class, cause, slog.Int("attempts", attempts))...)
	}
	return Decision{Action: DeadLettered, Key: key, Class: class, Attempt: attempts, Err: cause}
}

func (p *Processor) logAttrs(m *Message, key dedup.Key, class Class, err error, extra ...any) []any {
	attrs := []any{
		slog.String("consumer", p.name), slog.String("message_id", m.ID), slog.String("key", key.String()),
		slog.String("class", class.String()),
	}
	if m.BusinessKey != "" {
		attrs = append(attrs, slog.String("business_key", m.BusinessKey))
	}
	if err != nil {
		attrs = append(attrs, slog.String("reason", p.cfg.reason(err)))
	}
	return append(attrs, extra...)
}

// backoff returns the delay before retry n (1-based): full jitter over
// min(max, base*2^(n-1)), floored at base/4.
func (p *Processor) backoff(n int) time.Duration {
	return Backoff(p.cfg.baseDelay, p.cfg.maxDelay, n)
}

// Backoff returns a full-jitter delay before retry n (1-based): uniform in
// [base/4, min(max, base*2^(n-1))).
func Backoff(base, max time.Duration, n int) time.Duration {
	ceil := max
	if n < 1 {
		n = 1
	}
	if n <= 62 {
		if c := base << (n - 1); c > 0 && c < max && c>>(n-1) == base {
			ceil = c
		}
	}
	floor := base / 4
	if ceil <= floor {
		return floor
	}
	return floor + rand.N(ceil-floor)
}

// GiveUp dead-letters m after a Retry decision d that the broker cannot
// honour (its delivery limit is reached, so no redelivery would come).
// Adapters call it instead of letting the message drop. It returns
// DeadLettered, or Retry if the sink failed.
func (p *Processor) GiveUp(ctx context.Context, m *Message, d Decision) Decision {
	class := d.Class
	if class == Unclassified && d.Err == nil {
		class = ClassPermanent
	}
	cause := fmt.Errorf("the broker will not redeliver (delivery %d reached its limit): %w", m.Delivery, errOr(d.Err))
	key := d.Key
	if key == (dedup.Key{}) {
		key, _ = p.keyOf(m)
	}
	return p.deadLetter(ctx, m, key, class, max(d.Attempt, 1), cause)
}

// Quarantine dead-letters m without running it, for a message an adapter
// cannot hand to the handler (a malformed envelope): class and cause say
// why. The key is derived as Process would, when it can be. It returns
// DeadLettered, or Retry if the sink failed.
func (p *Processor) Quarantine(ctx context.Context, m *Message, class Class, cause error) Decision {
	if m == nil {
		return Decision{Action: Retry, Delay: p.cfg.maxDelay, Err: &dedup.ArgumentError{Arg: "message", Reason: "is nil"}}
	}
	key, _ := p.keyOf(m)
	return p.deadLetter(ctx, m, key, class, 1, errOr(cause))
}

func errOr(err error) error {
	if err == nil {
		return errors.New("no error recorded")
	}
	return err
}
