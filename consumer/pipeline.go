package consumer

import (
	"context"
	"slices"
	"sync"
)

// A Pipeline runs batches of messages as [Processor.ProcessBatch] does,
// but lets the completion of one batch overlap the claim and the handlers
// of the next: [Pipeline.Submit] claims a batch and runs its handlers, in
// the caller's goroutine, and returns; the batch's completion (one round
// trip on a [dedup.BatchCompleter]) and its decisions follow on a
// goroutine of the pipeline, which hands the decisions to the batch's
// done function. Where ProcessBatch makes each batch wait for its claim
// and then for its completion, one after the other, a pipeline keeps
// about one round trip busy while the next batch claims.
//
// Each batch gets exactly the decisions ProcessBatch would have made for
// it had the batches been run one after the other, and:
//
//   - done is called once per batch, in the order of Submit, and only
//     after the batch's completion returned: a decision that acknowledges
//     a message is made only once its record is completed (the store said
//     so), so an adapter that acknowledges in done never acknowledges
//     before the durable write, and a completion that fails (a store
//     error, a lost lease, an unknown outcome) gives the decision
//     ProcessBatch gives it (Retry), never an Ack.
//   - Handlers run one at a time, in the order of Submit and of the
//     messages in each batch, as ProcessBatch runs them.
//   - A message whose key is in a batch not yet decided does not overtake
//     it: Submit first waits for every batch in flight to be decided, so
//     the message is claimed after the earlier one's completion (it is a
//     duplicate, or runs again if the earlier one failed), as it would be
//     one batch after the other. So does a batch after one that runs
//     handlers after its own (a key repeated inside it, a claim lost while
//     it waited).
//   - At most depth batches are in flight (claimed and not yet decided);
//     Submit waits for the oldest when there are.
//
// A crash while batches are in flight loses nothing: a batch claimed and
// not completed has its keys in progress until their leases end, and its
// messages were not acknowledged, so the broker redelivers them and the
// redelivery takes the claims over, as after a crash between a handler
// and its completion.
//
// Submit and Wait must be called from one goroutine at a time (the
// adapter's worker); done is called on the pipeline's goroutine and must
// not call Submit or Wait. In inbox mode ([NewInbox], [NewApply]) Submit
// processes the batch with ProcessBatch and calls done before it returns.
type Pipeline struct {
	p     *Processor
	slots chan struct{} // one per batch in flight
	wg    sync.WaitGroup

	mu      sync.Mutex
	tail    chan struct{} // closed when the last batch submitted was decided
	flight  []*batchRun   // the batches in flight, whose keys a batch must not overtake
	barrier bool          // the last batch submitted runs handlers after its own
	// free holds the batchRuns of batches decided whose done returned:
	// the next batches are prepared in their memory (at most depth + 1
	// exist: depth in flight and one being prepared).
	free []*batchRun
	// decisions holds the decision slices handed back by Recycle, whose
	// memory later batches are decided in.
	decisions [][]Decision
}

// NewPipeline returns a pipeline of p with at most depth batches in flight
// (at least 1; 1 runs the batches one after the other, as ProcessBatch).
func (p *Processor) NewPipeline(depth int) *Pipeline {
	return &Pipeline{p: p, slots: make(chan struct{}, max(depth, 1))}
}

// Submit claims the batch ms and runs its handlers, then returns while
// the batch's completion and decisions go on: done gets the decisions, one
// per message in the order of ms, as ProcessBatch returns them (a new
// slice, done's to keep, unless done hands it back with
// [Pipeline.Recycle]). Submit
// reports whether the batch was clean: every message was claimed with the
// batch and its handler succeeded, so that only its completion can still
// turn a decision into a Retry. An adapter that stops at a Retry (a Kafka
// partition held at its record) waits ([Pipeline.Wait]) after a batch
// that is not clean before it submits the next, so that no later message
// runs while the earlier one is still to be retried.
func (pl *Pipeline) Submit(ctx context.Context, ms []*Message, done func([]Decision)) (clean bool) {
	p := pl.p
	if p.startBatch == nil {
		pl.Wait()
		done(p.ProcessBatch(ctx, ms))
		return false
	}
	pl.mu.Lock()
	var mem *batchRun
	if n := len(pl.free); n > 0 {
		mem, pl.free = pl.free[n-1], pl.free[:n-1]
	}
	pl.mu.Unlock()
	st := p.prepare(mem, ms)
	pl.mu.Lock()
	wait := pl.barrier || pl.overlaps(st)
	pl.mu.Unlock()
	if wait {
		pl.Wait()
	}
	pl.slots <- struct{}{}
	pl.mu.Lock()
	pl.flight = append(pl.flight, st)
	pl.mu.Unlock()

	st.start(ctx, p)
	clean = st.clean()

	pl.mu.Lock()
	prev, mine := pl.tail, make(chan struct{})
	pl.tail, pl.barrier = mine, st.runsHandlers()
	pl.mu.Unlock()
	pl.wg.Go(func() {
		defer func() { <-pl.slots }()
		defer close(mine)
		st.finish()
		if prev != nil {
			<-prev
		}
		pl.mu.Lock()
		var into []Decision
		if n := len(pl.decisions); n > 0 {
			into, pl.decisions = pl.decisions[n-1], pl.decisions[:n-1]
		}
		pl.mu.Unlock()
		ds := st.decideInto(ctx, p, into)
		pl.mu.Lock()
		pl.flight = slices.DeleteFunc(pl.flight, func(f *batchRun) bool { return f == st })
		pl.mu.Unlock()
		done(ds)
		// done returned: nothing reads the batch's items, keys or claim
		// requests any more (the runner's batch finished with them in
		// Finish, decide before done). The next batch may have them.
		st.recycle()
		pl.mu.Lock()
		pl.free = append(pl.free, st)
		pl.mu.Unlock()
	})
	return clean
}

// overlaps reports whether a key of st is in a batch in flight. Each
// batch keeps its keys as a set (prepare's), so the check is one lookup a
// key for each batch in flight (at most depth), and nothing is counted in
// and out of a shared map. The caller holds pl.mu.
func (pl *Pipeline) overlaps(st *batchRun) bool {
	for _, f := range pl.flight {
		if st.keys.meets(&f.keys) {
			return true
		}
	}
	return false
}

// Recycle hands back the decisions a batch's done got, once nothing
// reads them any more (done made the acknowledgements and kept nothing
// that points into them): a later batch is decided in their memory
// instead of a new slice. Recycle is optional: a slice not handed back
// is never written again. Call it from done or after it returned, and
// never for a slice still read (done must not keep it, nor anything that
// points into it, such as &ds[i]): the next done may get it, with other
// decisions written in it. A slice handed back again before a batch took
// it is kept once; handed back again after that (while a later done
// holds it) it would be shared, so call it at most once for a slice.
func (pl *Pipeline) Recycle(ds []Decision) {
	if cap(ds) == 0 {
		return
	}
	clear(ds[:cap(ds)])             // drops the keys, results and errors they hold
	end := &ds[:cap(ds)][cap(ds)-1] // the same for every slice of its array
	pl.mu.Lock()
	defer pl.mu.Unlock()
	for _, d := range pl.decisions {
		if &d[:cap(d)][cap(d)-1] == end {
			return // handed back twice: kept once, or two batches would share it
		}
	}
	if len(pl.decisions) < cap(pl.slots) { // more are never in use at once
		pl.decisions = append(pl.decisions, ds[:0])
	}
}

// Wait waits until every batch submitted was decided and its done
// returned.
func (pl *Pipeline) Wait() {
	pl.wg.Wait()
	pl.mu.Lock()
	pl.barrier = false
	pl.mu.Unlock()
}
