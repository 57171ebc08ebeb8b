package dedup

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"
)

// A BatchHandler is the handler of [Runner.DoBatch]: it applies request i
// under the claim c.
type BatchHandler func(ctx context.Context, i int, c Claim) (result []byte, err error)

// PanicError is a handler's panic, which [Runner.DoBatch] returns as the
// error of the request whose handler panicked instead of panicking on.
type PanicError struct {
	Value any // what the handler panicked with
}

func (e *PanicError) Error() string { return fmt.Sprintf("dedup: handler panicked: %v", e.Value) }

// DoBatch runs h for each request in reqs, in order, and returns for each
// the Result and error that [Runner.DoClaim] would have returned had it
// been called for the requests one after the other, with two calls to the
// store for the whole batch instead of two per request:
//
//   - Every key is claimed in one call ([ClaimBatch]: one round trip on a
//     [BatchClaimer]). A request with an invalid key or fingerprint fails
//     alone with its [*ArgumentError]. A store failure of that call fails
//     every other request with it (fail closed) and no handler runs.
//   - The handlers of the keys acquired run one at a time, in request
//     order. A failed handler's claim is released or kept at once, as the
//     classifier says.
//   - Then the successes and the failures to record are completed in one
//     call ([CompleteBatch]: one round trip on a [BatchCompleter]), on a
//     context detached from ctx and bounded by the finalize timeout
//     ([WithFinalizeTimeout]): the handlers' effects happened, and a ctx
//     that ends during the round trip (a shutdown, while a
//     consumer.Pipeline completes the batch on a goroutine of its own)
//     must not cut their record short.
//
// A key repeated in reqs is acquired by its first request only; the later
// ones get an [*InProgressError], as from ClaimBatch, and do not run. Do
// them again after DoBatch returns: they are then duplicates, or
// acquirable if the first one failed and was released.
//
// Leases: a claim waits for the handlers before it, and a success waits
// for the final complete. So while the handlers run, DoBatch extends every
// claim it holds but is not running, each third of the lease (or each
// heartbeat, when [WithHeartbeat] is shorter), and a claim does not expire
// however long the batch takes: a handler starts with at least two thirds
// of its lease left. The running handler's own claim is treated as in Do
// (extended only with WithHeartbeat). A claim found lost while it waited,
// or not extended for half a lease (the store failed), is not run on: it
// is released and its request is done alone, as Do does, after the batch.
// On a store that is not an [Extender] every request is done alone.
//
// A panic in h does not panic on, so that the other requests' outcomes are
// not lost: it releases that request's claim and every claim not yet run,
// and that request's error is a [*PanicError]; the successes before it are
// completed, and the requests after it are then done alone, one at a time,
// as Do does (a panic there is returned the same way). Once ctx is done,
// the claims not yet run are released on a detached context and their
// requests are done alone, where the claim on the done context fails
// closed.
//
// Hooks see each request's claim (with the duration of the batch call),
// and each complete, release and keep, as for Do.
func (r *Runner) DoBatch(ctx context.Context, reqs []ClaimRequest, h BatchHandler) ([]Result, []error) {
	return r.StartBatch(ctx, reqs, h).Finish()
}

// A PendingBatch is a batch whose claims were made and whose handlers ran
// ([Runner.StartBatch]), and whose completion is left to Finish.
type PendingBatch struct {
	b     *batch
	clean bool
	done  bool // Finish was called
	// finished is set once Finish returned: a Finish cut short (a hook
	// panicked) may leave the heartbeat writing the claims' state.
	finished bool
	beats    bool // a heartbeat runs
	// The successes and the failures to record, completed by Finish.
	pending []Completion
	at      []int   // index into b.claims of each pending completion
	herrs   []error // the failures to record, by pending completion; nil if none
}

// StartBatch does the first half of [Runner.DoBatch]: it claims the batch
// in one call and runs the handlers of the keys acquired, in order,
// releasing or keeping each failure's claim at once, and returns before
// the successes are completed. [PendingBatch.Finish] completes them in one
// call, does the requests left to be done alone, and returns what DoBatch
// would have returned. Until Finish returns, the batch's claims awaiting
// their completion stay extended by its heartbeat, so the caller may do
// other work in between (claim and run the next batch: see
// consumer.Pipeline). Finish must be called exactly once, from any
// goroutine; nothing the batch claimed is completed before it.
func (r *Runner) StartBatch(ctx context.Context, reqs []ClaimRequest, h BatchHandler) *PendingBatch {
	mem := r.takeMem()
	res, errs := mem.results(len(reqs))
	b := &batch{r: r, ctx: ctx, reqs: reqs, h: h, res: res, errs: errs, mem: mem}
	pb := &PendingBatch{b: b}
	if h == nil {
		for i := range errs {
			errs[i] = &ArgumentError{Arg: "handler", Reason: "is nil"}
		}
		return pb
	}
	ext, ok := r.store.(Extender)
	if !ok {
		// Every request alone, now: Finish has nothing left to do.
		pb.clean = true
		for i := range reqs {
			res[i], errs[i] = r.alone(ctx, reqs, i, h)
			pb.clean = pb.clean && errs[i] == nil
		}
		return pb
	}
	b.cond.L = &b.mu
	b.claim()
	pb.runHandlers(ext)
	return pb
}

// Clean reports whether every request of the batch was acquired and its
// handler succeeded, so that only the completion of the successes is left
// to Finish (which may still fail). A batch that is not clean has a
// request that was found done or taken, failed, or is left to be done
// alone.
func (pb *PendingBatch) Clean() bool { return pb.clean }

// RunsHandlers reports whether Finish will run handlers: requests left to
// be done alone, after the batch (a claim lost while it waited, a panic,
// a done context).
func (pb *PendingBatch) RunsHandlers() bool { return len(pb.b.alone) > 0 }

// Finish completes the batch's successes in one call, does the requests
// left to be done alone, and returns, for each request, the Result and
// error [Runner.DoBatch] would have returned. A second call returns the
// same slices and does nothing.
func (pb *PendingBatch) Finish() ([]Result, []error) {
	b := pb.b
	if pb.done {
		return b.res, b.errs
	}
	pb.done = true
	pb.completeStopped()
	for _, i := range b.alone {
		b.res[i], b.errs[i] = b.r.alone(b.ctx, b.reqs, i, b.h)
	}
	pb.finished = true
	return b.res, b.errs
}

// completeStopped completes the batch and then stops its heartbeat, also
// when the completion is cut short by a panic (a hook's): a heartbeat left
// running would re-arm its timer for the life of the process and extend
// any claim still waiting, whose lease would then never end.
func (pb *PendingBatch) completeStopped() {
	if pb.beats {
		defer pb.b.stopHeartbeat()
	}
	pb.completeAll()
}

// Release hands the batch's working memory back to the runner once
// Finish returned, so that a later batch of the runner is made in it
// (the Results and errors Finish returned, the claims' state, the
// completions): a caller that runs batch after batch and copies what
// Finish returned (as consumer.Processor does) allocates them once
// instead of once a batch. After Release the slices Finish returned must
// not be read, nor Finish called again (it then returns nil slices): a
// later batch writes them. Release does nothing unless Finish returned:
// called before it, or after a Finish cut short by a panic (a hook's,
// recovered by the caller; a deferred Release runs then), it leaves the
// memory to the batch, whose heartbeat may still write it. A second
// Release does nothing. Call it on Finish's goroutine, or after Finish
// returned.
func (pb *PendingBatch) Release() {
	b := pb.b
	if !pb.finished || b.mem == nil {
		return
	}
	mem := b.mem
	b.mem, b.res, b.errs, b.idx, b.st = nil, nil, nil, nil, nil
	pb.pending, pb.at = nil, nil
	mem.clear()
	r := b.r
	r.freeMu.Lock()
	if len(r.free) < maxFreeBatches {
		r.free = append(r.free, mem)
	}
	r.freeMu.Unlock()
}

// maxFreeBatches bounds the released batches' memory a runner keeps: as
// many as the batches a busy caller has between StartBatch and Release
// at once (a consumer's partitions times its pipeline depth), beyond
// which a batch allocates.
const maxFreeBatches = 16

// takeMem returns the memory of a batch released earlier, or new memory.
func (r *Runner) takeMem() *batchMem {
	r.freeMu.Lock()
	defer r.freeMu.Unlock()
	if n := len(r.free); n > 0 {
		mem := r.free[n-1]
		r.free[n-1], r.free = nil, r.free[:n-1]
		return mem
	}
	return &batchMem{}
}

// batchMem is a batch's working memory, which a released batch hands to
// a later one (see PendingBatch.Release): each slice is kept at its
// capacity, emptied of every reference when released.
type batchMem struct {
	res     []Result
	errs    []error
	idx     []int
	st      []held
	pending []Completion
	at      []int
}

// results returns zeroed Results and errors for n requests, in mem's
// memory when it is large enough.
func (mem *batchMem) results(n int) ([]Result, []error) {
	if cap(mem.res) < n {
		mem.res, mem.errs = make([]Result, n), make([]error, n)
	}
	mem.res, mem.errs = mem.res[:n], mem.errs[:n]
	return mem.res, mem.errs
}

// clear drops every reference the memory holds (results, errors,
// claims) and empties it, keeping the capacity.
func (mem *batchMem) clear() {
	clear(mem.res)
	clear(mem.errs)
	clear(mem.pending[:cap(mem.pending)])
	mem.res, mem.errs, mem.idx, mem.st, mem.pending, mem.at = mem.res[:0], mem.errs[:0], mem.idx[:0], mem.st[:0], mem.pending[:0], mem.at[:0]
}

// alone does request i as Do does, returning a panic as a *PanicError.
func (r *Runner) alone(ctx context.Context, reqs []ClaimRequest, i int, h BatchHandler) (res Result, err error) {
	defer func() {
		if p := recover(); p != nil {
			res, err = Result{}, &PanicError{Value: p}
		}
	}()
	return r.do(ctx, reqs[i].Key, reqs[i].Fingerprint, nil, func(ctx context.Context, c Claim) ([]byte, error) {
		return h(ctx, i, c)
	})
}

// batch is one call of DoBatch.
type batch struct {
	r    *Runner
	ctx  context.Context
	reqs []ClaimRequest
	h    BatchHandler
	res  []Result
	errs []error

	// The requests acquired, in order: their index in reqs, their claim
	// and its state.
	idx    []int
	claims []Claim
	alone  []int // requests done alone after the batch

	start time.Time // of the batch claim
	// mem is the memory res, errs, idx, st and the completions were made
	// in, handed back to the runner by PendingBatch.Release.
	mem  *batchMem
	mu   sync.Mutex
	cond sync.Cond
	st   []held
	// The heartbeat (guarded by mu): its timer, when its beat is due, the
	// context of its extensions (made by the first beat, ended when it
	// stops: a store that hangs must not hold Finish for as long as the
	// batch's context lives),
	// whether it was stopped, and whether a beat is extending claims.
	hb       *time.Timer
	due      time.Time
	hbCtx    context.Context
	hbCancel context.CancelFunc
	stopping bool
	beating  bool
}

// held is the state of one claim the batch holds.
type held struct {
	waiting bool          // not running: the heartbeat keeps it alive
	busy    bool          // an extension of it is in flight
	lost    bool          // an extension found the lease lost
	from    time.Duration // since start: start of the claim or of its last extension
}

// claim claims every valid request in one call and settles those that
// will not run.
func (b *batch) claim() {
	r := b.r
	observe := !r.cfg.hooks.Empty()
	valid, at := b.reqs, []int(nil) // at: index in reqs of each valid request; nil when all are
	for i, q := range b.reqs {
		err := ValidateClaim(q.Key, q.Fingerprint, r.cfg.lease)
		if err == nil {
			if at != nil {
				valid, at = append(valid, q), append(at, i)
			}
			continue
		}
		b.errs[i] = err
		if observe {
			r.claimed(b.ctx, q.Key, Claim{}, err, 0)
		}
		if at == nil { // the first invalid request: copy the valid ones before it
			valid, at = make([]ClaimRequest, i, len(b.reqs)), make([]int, i, len(b.reqs))
			copy(valid, b.reqs[:i])
			for j := range at {
				at[j] = j
			}
		}
	}
	if len(valid) == 0 {
		return
	}
	b.start = time.Now()
	cs, err := ClaimBatch(b.ctx, r.store, valid, r.cfg.lease)
	if err == nil && len(cs) != len(valid) {
		err = &StoreError{Store: r.cfg.name, Op: "claim batch", Err: errors.New("the store returned " +
			strconv.Itoa(len(cs)) + " claims for " + strconv.Itoa(len(valid)) + " requests")}
	}
	took := time.Since(b.start)
	if cap(b.mem.idx) < len(valid) {
		b.mem.idx = make([]int, 0, len(valid))
	}
	b.idx = b.mem.idx[:0]
	for j := range valid {
		i := j
		if at != nil {
			i = at[j]
		}
		var c *Claim
		if err == nil {
			c = &cs[j]
		}
		if observe {
			var cc Claim
			if c != nil {
				cc = *c
			}
			r.claimed(b.ctx, valid[j].Key, cc, err, took)
		}
		if err != nil {
			b.errs[i] = err
			continue
		}
		var done bool
		if b.res[i], done, b.errs[i] = settled(c); !done {
			if n := len(b.idx); n != j {
				cs[n] = *c // cs is ours: keep the acquired claims at its front
			}
			b.idx = append(b.idx, i)
		}
	}
	if err != nil {
		return
	}
	b.claims = cs[:len(b.idx)]
	b.mem.idx = b.idx
	if cap(b.mem.st) < len(b.claims) {
		b.mem.st = make([]held, len(b.claims))
	}
	b.st = b.mem.st[:len(b.claims)]
	b.mem.st = b.st
	for j := range b.st {
		b.st[j] = held{waiting: true}
	}
}

// runHandlers runs the handlers of the acquired requests in order,
// keeping the waiting claims alive, and leaves the successes to complete
// to completeAll.
func (pb *PendingBatch) runHandlers(ext Extender) {
	b := pb.b
	if len(b.claims) == 0 {
		return
	}
	r := b.r
	pb.clean = len(b.claims) == len(b.reqs)
	if len(b.claims) > 1 {
		b.startHeartbeat(ext)
		pb.beats = true
	}
	if mem := b.mem; cap(mem.pending) < len(b.claims) {
		mem.pending, mem.at = make([]Completion, 0, len(b.claims)), make([]int, 0, len(b.claims))
	}
	pb.pending, pb.at = b.mem.pending[:0], b.mem.at[:0]
	aborted := false // a handler panicked
	for j := range b.claims {
		c, i := &b.claims[j], b.idx[j]
		lost, stale := b.take(j)
		switch {
		case lost:
			b.alone = append(b.alone, i)
			pb.clean = false
			continue
		case aborted || stale || b.ctx.Err() != nil:
			b.abandon(*c)
			b.alone = append(b.alone, i)
			pb.clean = false
			continue
		}
		out, herr, p, panicked := b.run(i, *c)
		if panicked { // run released the claim
			b.errs[i] = &PanicError{Value: p}
			aborted, pb.clean = true, false
			continue
		}
		if herr != nil {
			pb.clean = false
		}
		op, stored := r.disposal(out, herr)
		if op == "complete" {
			b.wait(j)
			if herr != nil && pb.herrs == nil {
				pb.herrs = make([]error, len(pb.pending), cap(pb.pending))
			}
			if pb.herrs != nil {
				pb.herrs = append(pb.herrs, herr)
			}
			pb.pending, pb.at = append(pb.pending, Completion{Claim: *c, Result: stored}), append(pb.at, j)
			continue
		}
		fctx, cancel, detached := r.finalContext(b.ctx)
		b.res[i], b.errs[i] = finished(b.res[i], op, nil, herr, r.finish(fctx, c, op, nil, detached))
		cancel()
	}
}

// completeAll completes the successes (and the failures to record) in one
// call, on a context detached from the batch's and bounded by the finalize
// timeout: the batch's context may end during the round trip (a shutdown
// while a pipeline completes the batch on its own goroutine), and cut
// short, the completion would leave every record in progress, to be taken
// over and applied again after its lease.
func (pb *PendingBatch) completeAll() {
	if len(pb.pending) == 0 {
		return
	}
	b, r := pb.b, pb.b.r
	fctx, cancel := context.WithTimeout(context.WithoutCancel(b.ctx), r.cfg.finalizeTimeout)
	defer cancel()
	for k, err := range r.completeBatch(fctx, pb.pending) {
		var herr error
		if pb.herrs != nil {
			herr = pb.herrs[k]
		}
		i := b.idx[pb.at[k]]
		b.res[i], b.errs[i] = finished(b.res[i], "complete", pb.pending[k].Result, herr, err)
	}
}

// run runs request i's handler under c as Do does, and recovers a panic
// (after which the claim is released).
func (b *batch) run(i int, c Claim) (out []byte, herr error, p any, panicked bool) {
	defer func() {
		if p = recover(); p != nil {
			panicked = true
		}
	}()
	out, herr = b.r.run(b.ctx, &c, nil, func(ctx context.Context, c Claim) ([]byte, error) { return b.h(ctx, i, c) })
	return out, herr, nil, false
}

// take takes claim j off the heartbeat to run it, once no extension of
// it is in flight, and says whether it was found lost or went without an
// extension for half a lease.
func (b *batch) take(j int) (lost, stale bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	s := &b.st[j]
	for s.busy {
		b.cond.Wait()
	}
	s.waiting = false
	return s.lost, time.Since(b.start)-s.from > b.r.cfg.lease/2
}

// wait hands claim j, a success waiting for its completion, back to the
// heartbeat.
func (b *batch) wait(j int) {
	b.mu.Lock()
	b.st[j].waiting = true
	b.mu.Unlock()
}

// abandon releases a claim the batch will not run on.
func (b *batch) abandon(c Claim) {
	fctx, cancel := context.WithTimeout(context.WithoutCancel(b.ctx), b.r.cfg.finalizeTimeout)
	defer cancel()
	_ = b.r.finish(fctx, &c, "release", nil, true)
}

// startHeartbeat arms the batch's heartbeat: a timer whose function
// extends every waiting claim and arms it again, each third of the lease
// (or each heartbeat, when WithHeartbeat is shorter). No goroutine waits
// for it: one runs only when a beat is due, which a batch that takes less
// than a beat never has.
func (b *batch) startHeartbeat(ext Extender) {
	every := b.r.cfg.lease / 3
	if hb := b.r.cfg.heartbeat; hb > 0 && hb < every {
		every = hb
	}
	every = max(every, time.Millisecond)
	b.mu.Lock()
	b.due = time.Now().Add(every)
	b.hb = time.AfterFunc(every, func() { b.beat(ext, every) })
	b.mu.Unlock()
}

// stopHeartbeat stops the heartbeat, ends the context of an extension in
// flight and waits for the beat in progress: no extension is in flight or
// starts once it returns.
func (b *batch) stopHeartbeat() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.stopping = true
	b.hb.Stop()
	if b.hbCancel != nil {
		b.hbCancel()
	}
	for b.beating {
		b.cond.Wait()
	}
}

// beat extends every waiting claim, one at a time, unless the heartbeat
// stopped, and arms the next beat every after this one was due, as a
// ticker would: the time the extensions took does not push the beats
// back (re-armed every after a beat ended, a beat of d would leave a
// claim every + d without an extension, and one over half the lease is
// found stale). A beat that took longer than every is followed at once
// by the next, and the beats go on every from then.
func (b *batch) beat(ext Extender, every time.Duration) {
	lease := b.r.cfg.lease
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.stopping {
		return
	}
	b.beating = true
	if b.hbCtx == nil { // the first beat: a batch that ends before one has none
		b.hbCtx, b.hbCancel = context.WithCancel(b.ctx)
	}
	ctx := b.hbCtx
	for j := 0; j < len(b.claims) && !b.stopping; j++ {
		s := &b.st[j]
		if !s.waiting || s.lost {
			continue
		}
		s.busy = true
		b.mu.Unlock()
		from := time.Since(b.start)
		_, err := ext.Extend(ctx, b.claims[j], lease)
		b.mu.Lock()
		s.busy = false
		switch {
		case err == nil:
			s.from = from
		case errors.Is(err, ErrLeaseLost):
			s.lost = true
		}
		b.cond.Broadcast()
	}
	b.beating = false
	if !b.stopping {
		now := time.Now()
		b.due = b.due.Add(every)
		if b.due.Before(now) {
			b.due = now
		}
		b.hb.Reset(b.due.Sub(now))
	}
	b.cond.Broadcast()
}

// completeBatch completes items in one call and emits a finish event for
// each. A call the store refuses for a passing condition ([IsTransient])
// is tried again (see [WithCompleteAttempts]); if it is still refused, the
// items are completed one at a time, each with its own tries, since a
// one-row completion holds a single lock and cannot be part of a
// deadlock. An item refused alone that way (a store that sends items
// separately) is retried alone too. ctx is detached from the batch's and
// bounded by the finalize timeout (completeAll): its end is not the
// caller's, and the items completed one at a time share it.
func (r *Runner) completeBatch(ctx context.Context, items []Completion) []error {
	start := time.Now()
	var (
		errs []error
		err  error
	)
	for try := range r.cfg.completeTries {
		if try > 0 && !pause(ctx, try) {
			break
		}
		errs, err = CompleteBatch(ctx, r.store, items, r.cfg.retention)
		if err == nil && len(errs) != len(items) {
			err = &StoreError{Store: r.cfg.name, Op: "complete batch", Err: errors.New("the store returned " +
				strconv.Itoa(len(errs)) + " results for " + strconv.Itoa(len(items)) + " completions")}
		}
		if !IsTransient(err) {
			break
		}
	}
	switch {
	case IsTransient(err) && ctx.Err() == nil:
		errs = make([]error, len(items))
		for k := range items {
			errs[k] = r.complete(ctx, &items[k].Claim, items[k].Result, true)
		}
	case err != nil:
		errs = make([]error, len(items))
		for k := range errs {
			errs[k] = err
		}
	default:
		for k, e := range errs {
			if IsTransient(e) {
				errs[k] = r.complete(ctx, &items[k].Claim, items[k].Result, true)
			}
		}
	}
	if !r.cfg.hooks.Empty() {
		took := time.Since(start)
		for k, it := range items {
			r.cfg.hooks.Finished(ctx, FinishEvent{Store: r.cfg.name, Key: it.Claim.Key, Op: "complete", Duration: took, Err: errs[k]})
		}
	}
	return errs
}
