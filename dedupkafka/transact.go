package dedupkafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/twmb/franz-go/pkg/kgo"
)

// A TxHandler transforms one input record of a [Transactor]: it may run an
// effect outside Kafka (a row, a charge) and returns the records to
// produce. Those records, and the input's offset, commit in one Kafka
// transaction; the dedup record of the input's key is completed only after
// that transaction committed.
//
// The handler runs again for the same key only when an earlier run failed
// or its transaction could not be kept (see [TxInput.Attempt]): its
// outside effect may then have happened, and it must reconcile by the
// message ID (a lookup, an external idempotency key) before repeating it.
type TxHandler func(ctx context.Context, in TxInput) ([]*kgo.Record, error)

// TxInput is what a [TxHandler] gets for one input record.
type TxInput struct {
	// Message is the record read into the broker-neutral envelope; its ID
	// is the dedup key (the Dedup-Msg-Id header, else topic/partition/
	// offset).
	Message *consumer.Message
	// Record is the input record itself. Do not modify it.
	Record *kgo.Record
	// Attempt is 1 the first time the handler runs for the key. It is
	// more when an earlier run of this process failed, or when the key
	// was taken over from an owner whose lease ran out (TakenOver): the
	// effect may have started then, so reconcile before repeating it.
	Attempt int
	// TakenOver is set when the claim replaced an owner whose lease
	// expired (a member that died or lost the partition mid-transaction).
	TakenOver bool
}

// errNotStarted marks a handler error as certain that no effect started.
type notStartedError struct{ err error }

func (e *notStartedError) Error() string     { return e.err.Error() }
func (e *notStartedError) Unwrap() error     { return e.err }
func (e *notStartedError) SafeToRetry() bool { return true }

// NotStarted marks a handler error as certain that the handler's effect
// did not start (a validation failure before any I/O, a refused
// connection): the [Transactor] then releases the claim at once instead of
// leaving it to its lease, provided no earlier run under the claim (of
// this process, or of an owner it took over from) may have started one:
// then the claim is kept and the next run is told so. Any error whose SafeToRetry method reports true
// (such as a [dedup.StoreError] that was not applied) counts the same.
func NotStarted(err error) error {
	if err == nil {
		return nil
	}
	return &notStartedError{err}
}

func notStarted(err error) bool {
	var s interface{ SafeToRetry() bool }
	return errors.As(err, &s) && s.SafeToRetry()
}

type txConfig struct {
	lease, retention time.Duration
	maxPoll          int
	backoff, maxHold time.Duration
	commitWait       time.Duration
	logger           *slog.Logger
	kopts            []kgo.Opt
	// abortHook, for tests: asked before each commit; true aborts the
	// transaction instead.
	abortHook func() bool
}

// A TxOption configures a [Transactor].
type TxOption interface{ applyTx(*txConfig) }

type txOption func(*txConfig)

func (f txOption) applyTx(c *txConfig) { f(c) }

// WithTxLease sets the dedup claim's lease: it must outlast a handler run
// plus the transaction's end. A claim whose transaction aborts is left to
// this lease when its effect may have started. Default 1m.
func WithTxLease(d time.Duration) TxOption { return txOption(func(c *txConfig) { c.lease = d }) }

// WithTxRetention sets how long a completed key is remembered: at least
// how far back the input topics can be replayed. Default 24h.
func WithTxRetention(d time.Duration) TxOption {
	return txOption(func(c *txConfig) { c.retention = d })
}

// WithTxMaxPollRecords bounds the records of one transaction. Default 500.
func WithTxMaxPollRecords(n int) TxOption { return txOption(func(c *txConfig) { c.maxPoll = n }) }

// WithTxBackoff sets the first delay after an aborted transaction (a
// handler error, a store error, a key held by another owner); it doubles
// with each abort in a row, with full jitter, up to max. Default 50ms, 5s.
func WithTxBackoff(first, max time.Duration) TxOption {
	return txOption(func(c *txConfig) { c.backoff, c.maxHold = first, max })
}

// WithTxCommitTimeout bounds the dedup completions after a commit, which
// run on a context detached from Run's. Default 10s.
func WithTxCommitTimeout(d time.Duration) TxOption {
	return txOption(func(c *txConfig) { c.commitWait = d })
}

// WithTxLogger sets the logger (message IDs, never payloads). Default
// slog.Default().
func WithTxLogger(l *slog.Logger) TxOption { return txOption(func(c *txConfig) { c.logger = l }) }

// WithTxClientOptions adds franz-go options to the transactional client
// (TLS, SASL, timeouts, the transaction timeout). The adapter's own
// options (TransactionalID, ConsumerGroup, ConsumeTopics, read_committed,
// the partition callbacks) are applied after them and win. Default none.
func WithTxClientOptions(opts ...kgo.Opt) TxOption {
	return txOption(func(c *txConfig) { c.kopts = append(c.kopts, opts...) })
}

// TxStats counts what a [Transactor] did.
type TxStats struct {
	// Records counts input records read (again after each abort).
	Records uint64
	// Applied counts keys whose handler output committed; Duplicates
	// input records skipped because their key had committed before.
	Applied, Duplicates uint64
	// HandlerRuns counts handler calls; HandlerErrors the failed ones.
	HandlerRuns, HandlerErrors uint64
	// Reused counts handler outputs produced again, without running the
	// handler, after the transaction that first carried them aborted.
	Reused uint64
	// Commits and Aborts count transactions.
	Commits, Aborts uint64
	// ProduceErrors counts transactions aborted because an output record
	// failed to produce.
	ProduceErrors uint64
	// Waits counts transactions aborted because a key was in progress
	// under another owner (the records wait for its lease).
	Waits uint64
	// Released counts claims given up at once (the effect did not
	// start); LeftToLease claims dropped with their partition while their
	// effect may have started (the next owner takes them over after the
	// lease, with TxInput.TakenOver set).
	Released, LeftToLease uint64
	// CompleteErrors counts dedup completions that failed after a commit
	// (the key stays in progress until its lease ends).
	CompleteErrors uint64
}

type txStats struct {
	records, applied, duplicates, runs, herrs, reused   atomic.Uint64
	commits, aborts, waits, released, leftToLease, cerr atomic.Uint64
	prodErrs                                            atomic.Uint64
}

// A Transactor runs consume-transform-produce on Kafka transactions
// (franz-go's GroupTransactSession, read_committed) with a dedup store for
// what the transaction does not cover. Per transaction:
//
//  1. poll records; begin the transaction;
//  2. per record, in partition order: claim its key in the store; a
//     duplicate is skipped (its outputs committed before); an acquired
//     key runs the handler, whose output records are produced in the
//     transaction;
//  3. end the transaction: the outputs and the input offsets commit
//     together, or neither does;
//  4. only after a commit, complete the dedup records.
//
// When the transaction aborts (a rebalance, a failed produce or offset
// commit, a handler error), the session rewinds to the committed offsets
// and the records are read again. A key whose handler had returned keeps
// its claim and its outputs in memory: the next transaction produces those
// outputs again without running the handler, so the outside effect does
// not repeat. A key whose partition went to another member is left to its
// lease (the effect may have run; it is never released); the new owner
// takes it over when the lease ends and runs the handler with
// TxInput.TakenOver set. A claim is released at once only when the effect
// certainly did not start: the abort came before the handler ran, or the
// handler's error says so ([NotStarted]).
//
// It is not safe for concurrent use; Run once, Close from anywhere.
type Transactor struct {
	sess  *kgo.GroupTransactSession
	store dedup.Store
	ext   dedup.Extender
	h     TxHandler
	scope string
	cfg   txConfig

	mu       sync.Mutex
	assigned map[tp]bool
	held     map[dedup.Key]*heldClaim

	lifecycle

	st txStats
}

// heldClaim is a claim this process owns whose transaction has not
// committed: its handler's outputs wait for the next transaction.
type heldClaim struct {
	claim dedup.Claim
	tp    tp
	ran   bool          // the handler returned: out is its output
	out   []*kgo.Record // templates, copied for each produce
	runs  int           // handler runs so far under this claim
	// base is how many runs the key may have had before this claim: the
	// store's earlier claims (Attempt-1), or more when this process ran
	// the handler under a claim of its own that it lost (taken over and
	// released or expired, evicted), which the store does not count. The
	// handler is told Attempt base+runs.
	base int
	// lost marks a claim whose lease this process lost (Extend said so,
	// or it ran too close to its end): it stays held only to carry its
	// runs into the next claim of the key, even across transactions that
	// abort while another owner holds the key.
	lost bool
}

// attempt is the Attempt the next run of the handler is told.
func (hc *heldClaim) attempt() int { return hc.base + hc.runs + 1 }

// NewTransactor returns a transactor of topics in group, with the
// transactional ID txnID (unique per member: a restarted member reuses its
// own, which fences its previous incarnation), that claims input keys in
// store under scope and runs h. It validates its arguments before any I/O
// and returns a [*dedup.ArgumentError] for a bad one.
func NewTransactor(brokers []string, group, txnID string, topics []string, store dedup.Store, scope string, h TxHandler, opts ...TxOption) (*Transactor, error) {
	switch {
	case len(brokers) == 0:
		return nil, bad("brokers", "needs at least one seed broker")
	case group == "":
		return nil, bad("group", "is empty")
	case txnID == "":
		return nil, bad("transactional id", "is empty")
	case len(topics) == 0:
		return nil, bad("topics", "needs at least one topic")
	case store == nil:
		return nil, bad("store", "is nil")
	case h == nil:
		return nil, bad("handler", "is nil")
	}
	if err := (dedup.Key{Scope: scope, ID: "x"}).Validate(); err != nil {
		return nil, err
	}
	for _, t := range topics {
		if !validTopic(t) {
			return nil, bad("topics", fmt.Sprintf("%q is not a topic name", t))
		}
	}
	cfg := txConfig{lease: time.Minute, retention: 24 * time.Hour, maxPoll: 500, backoff: 50 * time.Millisecond,
		maxHold: 5 * time.Second, commitWait: 10 * time.Second, logger: slog.Default()}
	for _, o := range opts {
		o.applyTx(&cfg)
	}
	switch {
	case cfg.lease <= 0:
		return nil, bad("lease", "must be positive, got "+cfg.lease.String())
	case cfg.retention <= 0:
		return nil, bad("retention", "must be positive, got "+cfg.retention.String())
	case cfg.maxPoll < 1:
		return nil, bad("max poll records", "must be at least 1, got "+strconv.Itoa(cfg.maxPoll))
	case cfg.backoff <= 0 || cfg.maxHold < cfg.backoff:
		return nil, bad("backoff", "needs 0 < first <= max, got "+cfg.backoff.String()+", "+cfg.maxHold.String())
	case cfg.commitWait <= 0:
		return nil, bad("commit timeout", "must be positive, got "+cfg.commitWait.String())
	case cfg.logger == nil:
		return nil, bad("logger", "is nil (pass slog.New(slog.DiscardHandler) to silence it)")
	}
	t := &Transactor{store: store, h: h, scope: scope, cfg: cfg, assigned: map[tp]bool{}, held: map[dedup.Key]*heldClaim{},
		lifecycle: newLifecycle()}
	t.ext, _ = store.(dedup.Extender)
	kopts := append(slices.Clone(cfg.kopts),
		kgo.SeedBrokers(brokers...),
		kgo.TransactionalID(txnID),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.ConsumerGroup(group),
		kgo.ConsumeTopics(topics...),
		kgo.RequireStableFetchOffsets(),
		kgo.OnPartitionsAssigned(t.assign),
		kgo.OnPartitionsRevoked(t.unassign),
		kgo.OnPartitionsLost(t.unassign),
	)
	sess, err := kgo.NewGroupTransactSession(kopts...)
	if err != nil {
		return nil, fmt.Errorf("dedupkafka: new transact session: %w", err)
	}
	t.sess = sess
	return t, nil
}

// Client returns the franz-go client, for metrics and admin requests. Do
// not poll, produce or end transactions with it.
func (t *Transactor) Client() *kgo.Client { return t.sess.Client() }

// Stats returns the counts so far.
func (t *Transactor) Stats() TxStats {
	s := &t.st
	return TxStats{Records: s.records.Load(), Applied: s.applied.Load(), Duplicates: s.duplicates.Load(),
		HandlerRuns: s.runs.Load(), HandlerErrors: s.herrs.Load(), Reused: s.reused.Load(),
		Commits: s.commits.Load(), Aborts: s.aborts.Load(), Waits: s.waits.Load(), ProduceErrors: s.prodErrs.Load(),
		Released: s.released.Load(), LeftToLease: s.leftToLease.Load(), CompleteErrors: s.cerr.Load()}
}

func (t *Transactor) assign(_ context.Context, _ *kgo.Client, m map[string][]int32) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for topic, ps := range m {
		for _, p := range ps {
			t.assigned[tp{topic, p}] = true
		}
	}
}

// unassign runs on revocation and loss: the partitions' held claims stay
// in the store until their lease ends (their effect may have run), and
// are forgotten here once the transaction in flight has ended (see
// forget).
func (t *Transactor) unassign(_ context.Context, _ *kgo.Client, m map[string][]int32) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for topic, ps := range m {
		for _, p := range ps {
			delete(t.assigned, tp{topic, p})
		}
	}
}

// forget drops the held claims of partitions no longer assigned.
func (t *Transactor) forget() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for k, hc := range t.held {
		if !t.assigned[hc.tp] {
			delete(t.held, k)
			if !hc.lost {
				t.st.leftToLease.Add(1)
			}
		}
	}
}

// Run consumes until ctx is done or Close is called, then leaves the group
// and returns nil. It returns an error when the transactional client fails
// for good (franz-go: no error of ending a transaction is retryable); the
// claims of the transaction in flight are then left to their lease.
func (t *Transactor) Run(ctx context.Context) error {
	if !t.running.CompareAndSwap(false, true) {
		return ErrClosed
	}
	defer close(t.done)
	defer t.sess.Close()
	defer func() {
		// Held claims die with this process: left to their lease.
		t.mu.Lock()
		for _, hc := range t.held {
			if !hc.lost {
				t.st.leftToLease.Add(1)
			}
		}
		clear(t.held)
		t.mu.Unlock()
	}()
	ctx, cancel, ok := t.runContext(ctx)
	if !ok {
		return ErrClosed
	}
	defer cancel()
	aborts := 0
	for ctx.Err() == nil {
		fs := t.sess.PollRecords(ctx, t.cfg.maxPoll)
		if fs.IsClientClosed() || ctx.Err() != nil {
			break
		}
		fs.EachError(func(topic string, p int32, err error) {
			if !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
				t.cfg.logger.Warn("dedupkafka: fetch error", slog.String("topic", topic), slog.Int("partition", int(p)), slog.Any("err", err))
			}
		})
		recs := fs.Records()
		if len(recs) == 0 {
			continue
		}
		committed, wait, err := t.transaction(ctx, recs)
		if err != nil {
			if ctx.Err() != nil {
				break
			}
			return err
		}
		if committed {
			aborts = 0
			continue
		}
		aborts++
		if wait <= 0 {
			wait = consumer.Backoff(t.cfg.backoff, t.cfg.maxHold, aborts)
		}
		select {
		case <-ctx.Done():
		case <-time.After(min(wait, t.cfg.maxHold)):
		}
	}
	return nil
}

// Close stops Run, waits for it to end its transaction and leave the
// group. It is safe to call more than once.
func (t *Transactor) Close() error {
	t.stop(func() { t.sess.Close() })
	return nil
}

// transaction runs recs in one transaction. It reports whether it
// committed and, when it aborted for a key held by another owner, how long
// to wait. An error is fatal to the session.
func (t *Transactor) transaction(ctx context.Context, recs []*kgo.Record) (committed bool, wait time.Duration, err error) {
	if err := t.sess.Begin(); err != nil {
		return false, 0, fmt.Errorf("dedupkafka: begin transaction: %w", err)
	}
	t.st.records.Add(uint64(len(recs)))
	var (
		mine    []*heldClaim // acquired or reused here: completed after the commit
		seen    = map[dedup.Key]bool{}
		prodErr atomic.Pointer[error]
		abort   bool
	)
	promise := func(_ *kgo.Record, err error) {
		if err != nil {
			prodErr.CompareAndSwap(nil, &err)
		}
	}
	for _, r := range recs {
		if prodErr.Load() != nil || ctx.Err() != nil {
			abort = true
			break
		}
		m, _ := newMessage(r, 1) // a bad Dedup-Version leaves Version 0; the handler sees the header
		key := dedup.Key{Scope: t.scope, ID: m.ID}
		if key.Validate() != nil {
			key.ID = sourceOf(r) // an ID no store takes: fall back to the record's place
		}
		if seen[key] {
			t.st.duplicates.Add(1) // the same key earlier in this transaction
			continue
		}
		hc, w, ok := t.acquire(ctx, key, r)
		if !ok {
			abort, wait = true, w
			break
		}
		seen[key] = true
		if hc == nil {
			t.st.duplicates.Add(1)
			continue
		}
		if !hc.ran {
			attempt := hc.attempt()
			hc.runs++
			t.st.runs.Add(1)
			out, herr := t.h(ctx, TxInput{Message: m, Record: r, Attempt: attempt, TakenOver: hc.claim.TakenOver})
			if herr != nil {
				t.st.herrs.Add(1)
				t.cfg.logger.Warn("dedupkafka: handler failed; the transaction aborts", slog.String("message_id", m.ID),
					slog.String("source", sourceOf(r)), slog.Int("attempt", hc.runs), slog.Any("err", herr))
				// NotStarted speaks for this run only: release only a
				// claim no earlier run (ours, under this claim or one we
				// lost, or a previous owner's before a take-over) may
				// have started an effect under, or the next run would be
				// told Attempt 1 and repeat it blind.
				if notStarted(herr) && attempt == 1 && !hc.claim.TakenOver {
					t.release(ctx, key, hc)
				} else {
					t.keep(key, hc)
				}
				abort = true
				break
			}
			hc.out = make([]*kgo.Record, len(out))
			for i, o := range out {
				c := *o
				hc.out[i] = &c
			}
			hc.ran = true
		} else {
			t.st.reused.Add(1)
		}
		t.keep(key, hc)
		mine = append(mine, hc)
		for _, o := range hc.out {
			c := kgo.Record{Topic: o.Topic, Key: o.Key, Value: o.Value, Headers: o.Headers, Partition: o.Partition}
			t.sess.Produce(ctx, &c, promise)
		}
	}
	if !abort {
		if ferr := t.sess.Client().Flush(ctx); ferr != nil {
			abort = true
		}
	}
	if prodErr.Load() != nil {
		t.st.prodErrs.Add(1)
		t.cfg.logger.Warn("dedupkafka: produce failed; the transaction aborts", slog.Any("err", *prodErr.Load()))
		abort = true
	}
	if !abort && t.cfg.abortHook != nil && t.cfg.abortHook() {
		abort = true
	}
	ectx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.cfg.commitWait)
	defer cancel()
	try := kgo.TryCommit
	if abort {
		try = kgo.TryAbort
	}
	ok, err := t.sess.End(ectx, try)
	if err != nil {
		// The outcome may be unknown: every claim of the transaction is
		// left to its lease.
		t.forgetAll(mine)
		return false, 0, fmt.Errorf("dedupkafka: end transaction: %w", err)
	}
	if !ok {
		t.st.aborts.Add(1)
		t.forget()
		return false, wait, nil
	}
	t.st.commits.Add(1)
	cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), t.cfg.commitWait)
	defer ccancel()
	for _, hc := range mine {
		t.complete(cctx, hc)
	}
	t.forget()
	return true, 0, nil
}

// acquire returns the claim to run r's key under: a held one (renewed) or
// a new one. It returns nil, true for a duplicate, and false (with a wait)
// when the transaction must abort: a store error, or the key in progress
// under another owner.
//
// A held claim whose lease was lost is claimed anew, and the new claim
// carries the handler runs made under the lost one: the store's attempt
// count does not know them (it restarts at 1 when the key was released or
// evicted meanwhile, and counts a claim, not its runs), and a run told
// Attempt 1 after an earlier run may have started the effect would repeat
// it blind.
func (t *Transactor) acquire(ctx context.Context, key dedup.Key, r *kgo.Record) (*heldClaim, time.Duration, bool) {
	t.mu.Lock()
	hc := t.held[key]
	t.mu.Unlock()
	ran := 0 // runs of this process under claims of the key it lost
	if hc != nil {
		switch {
		case hc.lost:
		case t.ext != nil:
			c, err := t.ext.Extend(ctx, hc.claim, t.cfg.lease)
			switch {
			case err == nil:
				hc.claim.LeaseUntil = c.LeaseUntil
				return hc, 0, true
			case errors.Is(err, dedup.ErrLeaseLost):
				hc.lost = true // taken over by another owner: claim anew below
				t.st.leftToLease.Add(1)
			default:
				return nil, 0, false
			}
		case time.Until(hc.claim.LeaseUntil) > t.cfg.lease/2:
			return hc, 0, true
		default:
			hc.lost = true // too close to its end to trust: claim anew (a take-over of our own lease reads as one)
		}
		ran = hc.base + hc.runs
	}
	c, err := t.store.Claim(ctx, key, "", t.cfg.lease)
	if err != nil {
		t.cfg.logger.Warn("dedupkafka: claim failed; the transaction aborts (fail closed)", slog.String("key", key.String()), slog.Any("err", err))
		return nil, 0, false
	}
	switch c.Outcome {
	case dedup.Acquired:
		return &heldClaim{claim: c, tp: tp{r.Topic, r.Partition}, base: max(c.Attempt-1, ran)}, 0, true
	case dedup.Duplicate:
		if hc != nil {
			t.drop(key)
		}
		return nil, 0, true
	default: // InProgress (another owner); Mismatch cannot happen without a fingerprint
		t.st.waits.Add(1)
		w := time.Until(c.LeaseUntil)
		t.cfg.logger.Debug("dedupkafka: key in progress under another owner; waiting for its lease", slog.String("key", key.String()), slog.Duration("wait", w))
		return nil, max(w, t.cfg.backoff), false
	}
}

func (t *Transactor) keep(key dedup.Key, hc *heldClaim) {
	t.mu.Lock()
	t.held[key] = hc
	t.mu.Unlock()
}

func (t *Transactor) drop(key dedup.Key) {
	t.mu.Lock()
	delete(t.held, key)
	t.mu.Unlock()
}

func (t *Transactor) forgetAll(hs []*heldClaim) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, hc := range hs {
		if t.held[hc.claim.Key] == hc {
			delete(t.held, hc.claim.Key)
			t.st.leftToLease.Add(1)
		}
	}
}

// release gives up a claim whose effect certainly did not start.
func (t *Transactor) release(ctx context.Context, key dedup.Key, hc *heldClaim) {
	t.drop(key)
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.cfg.commitWait)
	defer cancel()
	if err := t.store.Release(rctx, hc.claim); err != nil {
		t.cfg.logger.Warn("dedupkafka: release failed (the key waits for its lease)", slog.String("key", key.String()), slog.Any("err", err))
		return
	}
	t.st.released.Add(1)
}

// complete marks a committed key done, retrying a store error a few
// times (Complete with the same token is idempotent).
func (t *Transactor) complete(ctx context.Context, hc *heldClaim) {
	t.drop(hc.claim.Key)
	var err error
	for try := range 3 {
		if err = t.store.Complete(ctx, hc.claim, nil, t.cfg.retention); err == nil || errors.Is(err, dedup.ErrLeaseLost) || ctx.Err() != nil {
			break
		}
		time.Sleep(time.Duration(try+1) * 20 * time.Millisecond)
	}
	if err != nil {
		t.st.cerr.Add(1)
		t.cfg.logger.Warn("dedupkafka: completion after the commit failed (the key stays in progress until its lease ends)",
			slog.String("key", hc.claim.Key.String()), slog.Any("err", err))
		return
	}
	t.st.applied.Add(1)
}
