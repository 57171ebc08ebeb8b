package dedup

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"
)

// A Handler applies one message or request. It returns the bytes to store
// as the result (replayed to duplicates; may be nil) or an error.
type Handler func(ctx context.Context) (result []byte, err error)

// A ClaimHandler is a [Handler] that is told about the claim it runs under:
// its Attempt, and whether it TakenOver a crashed owner (whose effect may
// or may not have happened: reconcile before acting again).
type ClaimHandler func(ctx context.Context, c Claim) (result []byte, err error)

// Disposition says what a [Runner] does with its claim when the handler
// fails.
type Disposition uint8

const (
	// Release removes the claim so the redelivery runs the handler again at
	// once. The default: a failed message is never lost.
	Release Disposition = iota
	// Keep leaves the claim in progress until its lease expires; the next
	// delivery after that takes it over (attempt + 1). Use it for an unknown
	// outcome (a timed-out external call that may have succeeded): it holds
	// off concurrent retries for one lease, and the take-over tells the
	// next attempt to reconcile before it acts.
	Keep
	// Record completes the claim as a final outcome (a business rejection):
	// redeliveries become duplicates. The stored result is taken from an
	// error in the chain that implements [ResultError], or is nil.
	Record
)

// ResultError is an error that carries the result to store when its
// disposition is [Record].
type ResultError interface {
	error
	Result() []byte
}

// Result is what [Runner.Do] did.
type Result struct {
	// Duplicate is set when the key was already completed: the handler did
	// not run, and Result holds what the first run stored.
	Duplicate bool
	// Result is the handler's result, or the stored one for a duplicate.
	Result []byte
	// Attempt and TakenOver come from the claim (see [Claim]).
	Attempt   int
	TakenOver bool
	// Recorded is set when the handler failed and its failure was
	// completed as a final outcome ([Record]).
	Recorded bool
}

// Runner runs handlers at most once per key and completes them exactly
// once: claim, run, then complete, or on failure release, keep or record
// the claim as its classifier says. It is safe for concurrent use.
type Runner struct {
	store Store
	cfg   runnerConfig
	// free keeps the working memory of released batches for later
	// ones (see PendingBatch.Release): at most maxFreeBatches.
	freeMu sync.Mutex
	free   []*batchMem
}

type runnerConfig struct {
	name            string
	lease           time.Duration
	retention       time.Duration
	finalizeTimeout time.Duration
	heartbeat       time.Duration
	completeTries   int
	classify        func(error) Disposition
	hooks           Hooks
}

func defaultRunnerConfig() runnerConfig {
	return runnerConfig{
		name:            "store",
		lease:           30 * time.Second,
		retention:       24 * time.Hour,
		finalizeTimeout: 10 * time.Second,
		completeTries:   5,
		classify:        func(error) Disposition { return Release },
	}
}

func (c *runnerConfig) validate() error {
	if err := validateDuration("lease", c.lease); err != nil {
		return err
	}
	if err := validateDuration("retention", c.retention); err != nil {
		return err
	}
	if err := validateDuration("finalize timeout", c.finalizeTimeout); err != nil {
		return err
	}
	if c.heartbeat < 0 || (c.heartbeat > 0 && c.heartbeat >= c.lease) {
		return &ArgumentError{Arg: "heartbeat", Reason: "must be positive and shorter than the lease (" + c.lease.String() + "), got " + c.heartbeat.String()}
	}
	if c.classify == nil {
		return &ArgumentError{Arg: "classifier", Reason: "is nil"}
	}
	if c.completeTries < 1 || c.completeTries > 100 {
		return &ArgumentError{Arg: "complete attempts", Reason: "must be between 1 and 100, got " + strconv.Itoa(c.completeTries)}
	}
	return nil
}

// A RunnerOption configures a [Runner].
type RunnerOption interface{ apply(*runnerConfig) }

type runnerOption func(*runnerConfig)

func (f runnerOption) apply(c *runnerConfig) { f(c) }

// WithName names the store in hook events. Default "store".
func WithName(name string) RunnerOption {
	return runnerOption(func(c *runnerConfig) { c.name = name })
}

// WithLease sets how long a claim is owned before another delivery may take
// it over. Make it longer than the slowest handler, or use [WithHeartbeat].
// Default 30s.
func WithLease(d time.Duration) RunnerOption {
	return runnerOption(func(c *runnerConfig) { c.lease = d })
}

// WithRetention sets how long a completed key is remembered. It must cover
// the longest time the broker or client may redeliver (the replay horizon);
// a record that expires earlier lets the duplicate through. Default 24h.
func WithRetention(d time.Duration) RunnerOption {
	return runnerOption(func(c *runnerConfig) { c.retention = d })
}

// WithCompleteAttempts sets how many times a completion is tried when the
// store refuses it for a passing condition ([IsTransient]: a deadlock or
// serialization failure, which rolled it back), with a short jittered
// backoff between tries (5 ms, doubling, at most 200 ms, within the
// caller's context or the finalize timeout). A batch completion that still
// fails that way is then completed one claim at a time, each with the same
// tries: a single-row completion takes one lock and cannot deadlock. Other
// store errors are not retried (the outcome may be unknown; the lease
// decides). Default 5.
func WithCompleteAttempts(n int) RunnerOption {
	return runnerOption(func(c *runnerConfig) { c.completeTries = n })
}

// WithClassifier decides what happens to the claim when the handler
// returns an error. Default: [Release] for every error.
func WithClassifier(f func(error) Disposition) RunnerOption {
	return runnerOption(func(c *runnerConfig) { c.classify = f })
}

// WithFinalizeTimeout bounds Complete and Release when the caller's context
// is cancelled (before they start, or while a completion runs): they then
// run on a detached context with this timeout, so that a handler that
// succeeded just before a cancel is still recorded. A call of Do gets one
// such timeout, and a batch's completions share one. Default 10s.
func WithFinalizeTimeout(d time.Duration) RunnerOption {
	return runnerOption(func(c *runnerConfig) { c.finalizeTimeout = d })
}

// WithHeartbeat extends the lease every d while the handler runs, on stores
// that implement [Extender]. If an extension finds the lease lost, the
// handler's context is cancelled with cause ErrLeaseLost. d must be shorter
// than the lease. Default 0: no heartbeat.
func WithHeartbeat(d time.Duration) RunnerOption {
	return runnerOption(func(c *runnerConfig) { c.heartbeat = d })
}

// WithHooks adds observers of claims, duplicates, take-overs, finishes and
// store errors.
func WithHooks(hs ...Hook) RunnerOption {
	return runnerOption(func(c *runnerConfig) { c.hooks.Add(hs...) })
}

// NewRunner returns a Runner on s, or an [*ArgumentError] for a bad option.
func NewRunner(s Store, opts ...RunnerOption) (*Runner, error) {
	if s == nil {
		return nil, &ArgumentError{Arg: "store", Reason: "is nil"}
	}
	cfg := defaultRunnerConfig()
	for _, o := range opts {
		o.apply(&cfg)
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return &Runner{store: s, cfg: cfg}, nil
}

// Do runs h for key unless key was already completed.
//
//   - Acquired: h runs; on success the claim is completed with h's result
//     and Do returns it. On error the classifier's disposition is applied
//     and Do returns h's error (joined with a store error if the release
//     failed). A panic in h releases the claim and panics on.
//   - Duplicate: h does not run; Do returns Result.Duplicate with the
//     stored result and a nil error. Acknowledge it.
//   - InProgress: an [*InProgressError] (errors.Is ErrInProgress): retry
//     after its RetryAfter.
//   - Mismatch: [ErrFingerprintMismatch].
//   - A store failure: a [*StoreError]; h did not run (fail closed).
//
// If Complete fails after h succeeded, Do returns the store error: h's
// effect happened but is not recorded, so do not acknowledge; the lease
// expires and the redelivery takes over (make the effect idempotent or use
// a transactional inbox to close that window).
//
// Context cancellation: ctx is passed to h, and h decides what a cancel
// means by what it returns. If ctx is cancelled by the time h returns,
// Complete or Release still runs, on a context detached from ctx and
// bounded by the finalize timeout, so a success is recorded and a failure
// is released rather than left to the lease. A completion that ctx's end
// cuts short (during the store's call, or while it waits to try again
// after a passing refusal) is finished the same way.
func (r *Runner) Do(ctx context.Context, key Key, fp Fingerprint, h Handler) (Result, error) {
	return r.do(ctx, key, fp, h, nil)
}

// DoClaim is [Runner.Do] for a handler that needs the claim it runs under.
func (r *Runner) DoClaim(ctx context.Context, key Key, fp Fingerprint, h ClaimHandler) (Result, error) {
	return r.do(ctx, key, fp, nil, h)
}

// do runs h, or ch when h is nil.
func (r *Runner) do(ctx context.Context, key Key, fp Fingerprint, h Handler, ch ClaimHandler) (Result, error) {
	if h == nil && ch == nil {
		return Result{}, &ArgumentError{Arg: "handler", Reason: "is nil"}
	}
	// Without hooks the store is called here, not through claim: the claim
	// (144 bytes) is copied once from the store's answer, not twice.
	var c Claim
	var err error
	if r.cfg.hooks.Empty() {
		c, err = r.store.Claim(ctx, key, fp, r.cfg.lease)
	} else {
		c, err = r.claim(ctx, key, fp)
	}
	if err != nil {
		return Result{}, err
	}
	// The claim goes down by pointer from here: one copy for the handler,
	// one for the store's Complete, none in between.
	if c.Outcome != Acquired {
		res, _, err := settled(&c)
		return res, err
	}
	res := Result{Attempt: c.Attempt, TakenOver: c.TakenOver}
	out, herr := r.run(ctx, &c, h, ch)
	if herr == nil && ctx.Err() == nil && r.cfg.hooks.Empty() {
		// The common end, as the general one below does it: a success is
		// completed on ctx (not done: no detached context), with no event
		// to time or emit.
		res.Result = out
		return res, r.complete(ctx, &c, out, false)
	}
	fctx, cancel, detached := r.finalContext(ctx)
	defer cancel()
	op, stored := r.disposal(out, herr)
	return finished(res, op, stored, herr, r.finish(fctx, &c, op, stored, detached))
}

// claim claims key and emits the claim's events.
func (r *Runner) claim(ctx context.Context, key Key, fp Fingerprint) (Claim, error) {
	if r.cfg.hooks.Empty() {
		return r.store.Claim(ctx, key, fp, r.cfg.lease)
	}
	start := time.Now()
	c, err := r.store.Claim(ctx, key, fp, r.cfg.lease)
	r.claimed(ctx, key, c, err, time.Since(start))
	return c, err
}

// claimed emits the events of one claim that took d.
func (r *Runner) claimed(ctx context.Context, key Key, c Claim, err error, d time.Duration) {
	e := ClaimEvent{Store: r.cfg.name, Key: key, Outcome: c.Outcome, Attempt: c.Attempt, TakenOver: c.TakenOver, Duration: d, Err: err}
	if err != nil {
		e.Outcome = 0
	}
	r.cfg.hooks.Claimed(ctx, e)
}

// settled returns what do returns for a claim on which no handler runs
// (a duplicate, a key in progress, a mismatch), with done set; for an
// acquired claim, the Result the run starts from.
func settled(c *Claim) (res Result, done bool, err error) {
	switch c.Outcome {
	case Duplicate:
		return Result{Duplicate: true, Result: c.Result, Attempt: c.Attempt}, true, nil
	case Acquired:
		return Result{Attempt: c.Attempt, TakenOver: c.TakenOver}, false, nil
	}
	return Result{Attempt: c.Attempt}, true, c.Err()
}

// finalContext returns the context for Complete or Release after the
// handler: ctx, or when ctx is done, a context detached from it and
// bounded by the finalize timeout (and detached true).
func (r *Runner) finalContext(ctx context.Context) (fctx context.Context, cancel context.CancelFunc, detached bool) {
	if ctx.Err() == nil {
		return ctx, func() {}, false
	}
	fctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), r.cfg.finalizeTimeout)
	return fctx, cancel, true
}

// disposal says how the claim of a handler that returned out and herr
// ends: "complete" with stored (a success, or a failure to record),
// "keep" or "release".
func (r *Runner) disposal(out []byte, herr error) (op string, stored []byte) {
	if herr == nil {
		return "complete", out
	}
	switch r.cfg.classify(herr) {
	case Keep:
		return "keep", nil
	case Record:
		var re ResultError
		if errors.As(herr, &re) {
			stored = re.Result()
		}
		return "complete", stored
	}
	return "release", nil
}

// finished returns what do returns once the claim of a handler that
// returned herr was ended by op, which returned ferr.
func finished(res Result, op string, stored []byte, herr, ferr error) (Result, error) {
	switch {
	case herr == nil:
		res.Result = stored
		return res, ferr
	case op == "keep":
		return res, herr
	case ferr != nil:
		return res, errors.Join(herr, ferr)
	case op == "complete":
		res.Recorded, res.Result = true, stored
	}
	return res, herr
}

// run calls h, with a heartbeat when configured, and releases the claim if
// h panics.
func (r *Runner) run(ctx context.Context, c *Claim, h Handler, ch ClaimHandler) (out []byte, err error) {
	defer func() {
		if p := recover(); p != nil {
			fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.finalizeTimeout)
			defer cancel()
			_ = r.finish(fctx, c, "release", nil, true)
			panic(p)
		}
	}()
	var ext Extender
	if r.cfg.heartbeat > 0 {
		ext, _ = r.store.(Extender)
	}
	if ext == nil {
		if h == nil {
			return ch(ctx, *c)
		}
		return h(ctx)
	}
	hctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	done := make(chan struct{})
	stopped := make(chan struct{})
	hc := *c // the goroutine's copy
	go func() {
		defer close(stopped)
		t := time.NewTicker(r.cfg.heartbeat)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-hctx.Done():
				return
			case <-t.C:
				if _, err := ext.Extend(hctx, hc, r.cfg.lease); errors.Is(err, ErrLeaseLost) {
					cancel(ErrLeaseLost)
					return
				}
			}
		}
	}()
	if h == nil {
		out, err = ch(hctx, *c)
	} else {
		out, err = h(hctx)
	}
	close(done)
	// The handler is done with its claim: end an extension in flight, so
	// that a store that hangs does not hold Do for as long as ctx lives.
	cancel(nil)
	<-stopped
	return out, err
}

// finish ends c by op ("complete" or "release") on ctx; detached says
// ctx is already a context detached from the caller's and bounded by the
// finalize timeout (see complete).
func (r *Runner) finish(ctx context.Context, c *Claim, op string, result []byte, detached bool) error {
	observe := !r.cfg.hooks.Empty()
	var start time.Time
	if observe {
		start = time.Now()
	}
	var err error
	switch op {
	case "complete":
		err = r.complete(ctx, c, result, detached)
	case "release":
		err = r.store.Release(ctx, *c)
	}
	if observe {
		r.cfg.hooks.Finished(ctx, FinishEvent{Store: r.cfg.name, Key: c.Key, Op: op, Duration: time.Since(start), Err: err})
	}
	return err
}

// complete completes c, trying again while the store refuses for a
// passing condition (see [WithCompleteAttempts]).
//
// It starts on ctx, which is live in the common case (no detached context
// to make), but ctx may end while it runs: during the store's call or in
// a pause between tries. The effect has happened by then, and a
// completion left undone would let the key be taken over, and the effect
// applied again, once the lease ends. So from the moment ctx is seen
// done, the remaining tries run on a context detached from it and
// bounded by the finalize timeout; the call that ctx cut short is made
// again (completing a claim that is already completed with the same
// result is no change).
//
// detached says ctx is already such a context (the caller's had ended
// before the completion began, or a batch's completion): its end is the
// finalize timeout's, and it is not detached again, which would give a
// store that hangs a finalize timeout more each time (one per item of a
// batch completed one at a time).
//
// The first try is made here and the rest in completeAgain, whose
// deferred cancels (made in its loop) cost every call of the function
// that holds them a run of the deferred calls on return, even when none
// was made.
func (r *Runner) complete(ctx context.Context, c *Claim, result []byte, detached bool) error {
	err := r.store.Complete(ctx, *c, result, r.cfg.retention)
	if err == nil {
		return nil
	}
	return r.completeAgain(ctx, c, result, detached, err)
}

// completeAgain is complete after its first try returned err (not nil).
func (r *Runner) completeAgain(ctx context.Context, c *Claim, result []byte, detached bool, err error) error {
	for try := 0; try < r.cfg.completeTries; try++ {
		if try > 0 {
			if !pause(ctx, try) {
				if detached {
					break // the finalize timeout ended
				}
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), r.cfg.finalizeTimeout)
				defer cancel()
				detached = true
				if !pause(ctx, try) {
					break
				}
			}
			err = r.store.Complete(ctx, *c, result, r.cfg.retention)
		}
		if err != nil && !detached && ctx.Err() != nil {
			// Cut short by ctx's end: make this try again, detached.
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), r.cfg.finalizeTimeout)
			defer cancel()
			detached = true
			err = r.store.Complete(ctx, *c, result, r.cfg.retention)
		}
		if !IsTransient(err) {
			return err
		}
	}
	return err
}

// pause waits before try number try (1, 2, ...) of a refused completion:
// 5 ms doubling up to 200 ms, each with up to half again of jitter. It
// returns false when ctx ends first.
func pause(ctx context.Context, try int) bool {
	d := min(5*time.Millisecond<<min(try-1, 6), 200*time.Millisecond)
	d += time.Duration(rand.Int64N(int64(d/2) + 1))
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// Once runs h for key with a default [Runner] on s (30s lease, 24h
// retention, release on error). See [Runner.Do].
func Once(ctx context.Context, s Store, key Key, fp Fingerprint, h Handler) (Result, error) {
	r, err := NewRunner(s)
	if err != nil {
		return Result{}, err
	}
	return r.Do(ctx, key, fp, h)
}
