package redisstore

import (
	"bytes"
	"context"
	"sync"
	"time"

	"github.com/dedupkit/dedup"
)

// Concurrent single completions are coalesced: a call to Complete joins
// the batch that is filling, and the first caller that finds a flush slot
// free sends that whole batch as CompleteBatch does (one completeMany
// script call per group of keys), while the callers that came after it
// fill the next batch. So a lone caller sends at once and waits one round
// trip, as before, and under load one script call completes many keys:
// a script call's own cost (its run, its clock read, one reply) is paid
// once a batch instead of once a key (docs/benchmarks.md measures 5.2-5.5
// us of Redis time per single completion against about 2.5 in batches).
//
// Up to maxFlushes batches are in flight at once; rueidis pipelines them
// on its connections. Two, chosen by measurement (64 goroutines, Redis
// time a key): one in flight gave the largest batches (4.4 us a key), two
// 4.6, four 5.2, where the previous one script call a key took 7.1-7.5
// and CompleteBatch 4.2 in the same run; two keeps a second batch on the
// wire while the first one's reply travels.
//
// A batch is sent by a goroutine of the store (started by the caller that
// took the slot, counted, and waited for by Close), on a context detached
// from every caller (with its own timeout, and ended by Close), so one
// caller's cancellation does not fail the others' completions. Every
// caller, the one that started the flush included, waits for its own
// batch's reply or for its own context; a caller that gives up once its
// batch was taken returns an error whose outcome is unknown (the batch may
// still complete its record), as a timed-out single call would, and one
// that gives up before gets a not-applied error and its item is dropped.
// Close fails the batch still filling with ErrClosed (nothing of it is
// sent), ends the flushes in flight and waits for them. A batch that holds
// only the item of the caller taking it is the exception: in a store from
// Open it is sent on that caller's goroutine (see flushLone), since nobody
// else waits for it, and like a claim it then waits for its reply whatever
// its caller's cancellation (callCtx).

const (
	maxFlushes   = 2
	flushTimeout = 30 * time.Second
)

type coalescer struct {
	sem     chan struct{} // a slot per flush in flight
	flushes sync.WaitGroup
	stop    context.Context // ended by Close: flushes in flight give up
	cancel  context.CancelFunc

	mu     sync.Mutex
	cur    *pendingBatch // filling; nil when none
	closed bool          // no item joins, no batch is taken
}

type pendingBatch struct {
	items []dedup.Completion
	rets  []time.Duration
	// dropped marks items whose callers gave up before a flush took the
	// batch (under coalescer.mu; read by the flusher once taken).
	dropped []bool
	errs    []error       // set before done is closed
	done    chan struct{} // closed once errs is set
	taken   bool          // a flusher took it (under coalescer.mu)
}

func newCoalescer() *coalescer {
	stop, cancel := context.WithCancel(context.Background())
	return &coalescer{sem: make(chan struct{}, maxFlushes), stop: stop, cancel: cancel}
}

// close fails the batch that is filling with ErrClosed (none of it was
// sent) and ends the flushes in flight; Store.Close then waits for them
// (co.flushes). Later calls get ErrClosed without queueing. A flush that
// rueidis sends synchronously (a lone one: its connection was idle) waits
// for its deadline rather than for a cancellation, so a flush on a server
// that stopped answering ends when the client is closed (a store that owns
// its client closes it first) or at the client's own read timeout
// (ConnWriteTimeout, 10s by default); one with WAIT (WithReplicaAck) at
// WAIT's timeout plus that bound (doAcked).
func (co *coalescer) close() {
	co.mu.Lock()
	co.closed = true
	if b := co.cur; b != nil {
		co.cur = nil
		b.taken = true
		b.errs = make([]error, len(b.items))
		for i := range b.errs {
			b.errs[i] = dedup.ErrClosed
		}
		close(b.done)
	}
	co.mu.Unlock()
	co.cancel()
}

// completeCoalesced completes one claim through the coalescer. The claim
// and retention are valid.
func (s *Store) completeCoalesced(ctx context.Context, c dedup.Claim, result []byte, retention time.Duration) error {
	co := s.coalesce
	co.mu.Lock()
	if co.closed {
		co.mu.Unlock()
		return dedup.ErrClosed
	}
	b := co.cur
	if b == nil {
		b = &pendingBatch{done: make(chan struct{})}
		co.cur = b
	}
	i := len(b.items)
	// A copy: the caller may reuse result once it returns, which it may
	// do (its context ended) before the flush has read it.
	b.items = append(b.items, dedup.Completion{Claim: c, Result: bytes.Clone(result)})
	b.rets = append(b.rets, retention)
	b.dropped = append(b.dropped, false)
	co.mu.Unlock()
	select {
	case <-b.done:
		return b.errs[i]
	case <-ctx.Done():
		return s.abandon(ctx, b, i)
	case co.sem <- struct{}{}:
	}
	co.mu.Lock()
	take := !b.taken
	lone := take && len(b.items) == 1 && s.inlineLone
	if take {
		b.taken = true
		if co.cur == b {
			co.cur = nil
		}
		// Under mu, which close takes before it waits: every flush
		// started is waited for.
		co.flushes.Add(1)
		if !lone {
			go func() {
				defer co.flushes.Done()
				s.flush(ctx, b)
				<-co.sem
			}()
		}
	}
	co.mu.Unlock()
	if lone {
		s.flushLone(ctx, b)
		<-co.sem
		co.flushes.Done()
		return b.errs[i]
	}
	if !take {
		// Another caller sent this batch (or Close failed it): give the
		// slot back.
		<-co.sem
	}
	select {
	case <-b.done:
		return b.errs[i]
	case <-ctx.Done():
		return s.abandon(ctx, b, i)
	}
}

// abandon is the error of a caller whose context ended while its item
// waited in b: if no flush has taken b yet, the item is dropped and the
// completion certainly not written; otherwise its outcome is unknown.
func (s *Store) abandon(ctx context.Context, b *pendingBatch, i int) error {
	s.coalesce.mu.Lock()
	defer s.coalesce.mu.Unlock()
	if b.taken {
		return s.fail("complete", ctx.Err())
	}
	b.dropped[i] = true
	return &dedup.StoreError{Store: storeName, Op: "complete", Err: ctx.Err(), NotApplied: true}
}

// flushLone sends b, which holds only its caller's item, on the caller's
// goroutine: no goroutine is started and no reply handed over, which is
// what a lone caller (one worker) paid for on every completion. Nobody
// else waits for b. Like every call of the store it runs on s.callCtx(ctx):
// a caller that has given up before it is sent gets a not-applied error
// and nothing is sent; once sent, the call waits for its reply, so its
// outcome is known, until the caller's deadline (or, for a caller without
// one, the store's call bound), the client's ConnWriteTimeout or Close (which closes the client: only stores from
// Open send inline, Store.inlineLone), whichever comes first; a
// cancellation without a deadline does not end it. A call ended that way
// gets an error whose outcome is unknown (the record is in progress until
// its lease ends, or completed).
func (s *Store) flushLone(ctx context.Context, b *pendingBatch) {
	if err := ctx.Err(); err != nil {
		// Not sent: the caller gave up first.
		b.errs = []error{&dedup.StoreError{Store: storeName, Op: "complete", Err: err, NotApplied: true}}
		close(b.done)
		return
	}
	cctx, cancel := s.callCtx(ctx)
	defer cancel()
	errs := make([]error, 1)
	s.completeItems(cctx, b.items, b.rets[0], errs)
	b.errs = errs
	close(b.done)
}

// flush sends b and publishes one error per item. It runs on a context
// that keeps ctx's values but not its end: flushTimeout, or Close.
func (s *Store) flush(ctx context.Context, b *pendingBatch) {
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), flushTimeout)
	defer cancel()
	defer context.AfterFunc(s.coalesce.stop, cancel)()
	errs := make([]error, len(b.items))
	// Items are grouped by retention (completeMany takes one); almost
	// always there is one, and nothing dropped.
	same := true
	for i, r := range b.rets {
		same = same && r == b.rets[0] && !b.dropped[i]
	}
	if same {
		s.completeItems(fctx, b.items, b.rets[0], errs)
	} else {
		var order []time.Duration
		byRet := map[time.Duration][]int{}
		for i, r := range b.rets {
			if b.dropped[i] {
				continue
			}
			if _, ok := byRet[r]; !ok {
				order = append(order, r)
			}
			byRet[r] = append(byRet[r], i)
		}
		for _, r := range order {
			idx := byRet[r]
			items := make([]dedup.Completion, len(idx))
			for j, i := range idx {
				items[j] = b.items[i]
			}
			sub := make([]error, len(idx))
			s.completeItems(fctx, items, r, sub)
			for j, i := range idx {
				errs[i] = sub[j]
			}
		}
	}
	b.errs = errs
	close(b.done)
}
