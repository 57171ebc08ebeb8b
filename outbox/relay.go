package outbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup"
)

// ErrRelayRunning is returned by [Relay.Run] when the relay already runs.
var ErrRelayRunning = errors.New("outbox: relay already running")

// A Relay publishes the rows of a [Source] through a [Publisher]. It
// joins the source's relays, takes its fair share of the partitions
// (ceil(N / relays alive)) under leases it renews every third of their
// TTL, and runs one goroutine per partition held: read a batch, publish
// it with the broker's asynchronous acknowledgements, mark what was
// acknowledged (per key, the prefix before its first failure) in one
// statement, record the failures in another. Several relays on one
// source split the partitions; a crashed relay's partitions are taken
// over when its leases end; a relay whose lease was taken over cannot
// mark (fencing by epoch).
type Relay struct {
	src Source
	pub Publisher
	cfg config

	running atomic.Bool
	// listening: the source's notifications reach the relay (its
	// Listen has called wake since it last returned).
	listening atomic.Bool
	mu        sync.Mutex
	closed    bool // Close was called: Run does not start
	cancel    context.CancelFunc
	done      chan struct{}

	stats struct {
		published, failed, quarantined, batches, leaseLost, fetches atomic.Int64
		held                                                        atomic.Int64
		lag                                                         atomic.Int64
	}
}

// Stats are a relay's counters since it was made.
type Stats struct {
	Published   int64 // messages acknowledged and marked
	Failed      int64 // failed attempts recorded
	Quarantined int64 // messages quarantined
	Batches     int64 // batches published
	LeaseLost   int64 // marks refused because a lease was taken over
	Fetches     int64 // reads of a partition, empty ones included
	// Lag is the commit-to-publish latency of the last batch marked: the
	// time from its oldest message's insert (the store's clock) to the
	// mark (this host's clock). A long-open producer transaction shows
	// here as a jump when its rows finally go out.
	Lag        time.Duration
	Partitions int // partitions held now
}

// NewRelay returns a relay of src through pub. Bad arguments are an
// [*dedup.ArgumentError].
func NewRelay(src Source, pub Publisher, opts ...Option) (*Relay, error) {
	if src == nil {
		return nil, bad("source", "is nil")
	}
	if pub == nil {
		return nil, bad("publisher", "is nil")
	}
	cfg := defaultConfig()
	for _, o := range opts {
		if o != nil {
			o.apply(&cfg)
		}
	}
	if cfg.id == "" {
		host, _ := os.Hostname()
		if host == "" || !printable(host) {
			host = "relay"
		}
		cfg.id = fmt.Sprintf("%s-%d-%s", host, os.Getpid(), NewID("")[24:])
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if src.Partitions() < 1 {
		return nil, bad("source", "has no partitions")
	}
	return &Relay{src: src, pub: pub, cfg: cfg}, nil
}

// ID is the relay's name in the lease table.
func (r *Relay) ID() string { return r.cfg.id }

// Stats returns the relay's counters.
func (r *Relay) Stats() Stats {
	return Stats{
		Published: r.stats.published.Load(), Failed: r.stats.failed.Load(), Quarantined: r.stats.quarantined.Load(),
		Batches: r.stats.batches.Load(), Fetches: r.stats.fetches.Load(), Lag: time.Duration(r.stats.lag.Load()), LeaseLost: r.stats.leaseLost.Load(), Partitions: int(r.stats.held.Load()),
	}
}

// Close stops a running relay as a cancelled Run context does, and waits
// for Run to return; a Run that starts after Close (or has not yet
// started when Close is called) returns [dedup.ErrClosed] at once. It is
// safe to call at any time, more than once.
func (r *Relay) Close() error {
	r.mu.Lock()
	r.closed = true
	cancel, done := r.cancel, r.done
	r.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
	return nil
}

// worker is the goroutine of one held partition.
type worker struct {
	lease   atomic.Pointer[Lease]
	renewed atomic.Int64 // local monotonic nanoseconds of the last renewal
	wake    chan struct{}
	stop    chan struct{} // closed to stop after the current batch
	done    chan struct{}
}

// crash is the error that makes Run stop as if the process died.
type crash struct{ err error }

// Run runs the relay until ctx is done or [Relay.Close] is called: then
// each partition finishes its batch in flight (publish, mark), the
// leases are released and the relay leaves, on a detached context with
// its own timeout, and Run returns nil. A source error is logged and
// retried; Run returns an error only for a misconfiguration found by the
// source (relays with another partition count), a mark hook's error, or
// [dedup.ErrClosed] when Close came first.
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return ErrRelayRunning
	}
	defer r.running.Store(false)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	r.mu.Lock()
	if r.closed {
		// Decided under the lock Close marks the relay under: a Close
		// either sees this Run's cancel or this Run sees the mark.
		r.mu.Unlock()
		return dedup.ErrClosed
	}
	r.cancel, r.done = cancel, make(chan struct{})
	done := r.done
	r.mu.Unlock()
	defer close(done)

	var (
		wmu     sync.Mutex
		workers = map[int]*worker{}
		crashed = make(chan error, 1)
		bg      sync.WaitGroup
	)
	wakeAll := func() {
		wmu.Lock()
		for _, w := range workers {
			select {
			case w.wake <- struct{}{}:
			default:
			}
		}
		wmu.Unlock()
	}
	if n, ok := r.src.(Notifier); ok && !r.cfg.pollOnly {
		bg.Go(func() { r.listen(ctx, n, wakeAll) })
	}
	if p, ok := r.src.(Pruner); ok && r.cfg.keep > 0 {
		bg.Go(func() { r.prune(ctx, p) })
	}
	stopWorker := func(p int, w *worker) {
		close(w.stop)
		<-w.done
		wmu.Lock()
		delete(workers, p)
		wmu.Unlock()
		r.stats.held.Add(-1)
	}
	start := func(l Lease) {
		w := &worker{wake: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
		w.lease.Store(&l)
		w.renewed.Store(nanotime())
		wmu.Lock()
		workers[l.Partition] = w
		wmu.Unlock()
		r.stats.held.Add(1)
		r.cfg.logger.Info("outbox relay took partition", "relay", r.cfg.id, "partition", l.Partition, "epoch", l.Epoch)
		go func() {
			defer close(w.done)
			if err := r.work(ctx, w); err != nil {
				select {
				case crashed <- err:
				default:
				}
			}
		}()
	}
	n := r.src.Partitions()
	offset := int(hash32(r.cfg.id) % uint32(n))
	beat := r.cfg.ttl / 3
	var runErr error
	timer := time.NewTimer(0)
	defer timer.Stop()
loop:
	for {
		select {
		case <-ctx.Done():
			break loop
		case err := <-crashed:
			runErr = err
			break loop
		case <-timer.C:
		}
		alive, err := r.src.Join(ctx, r.cfg.id, r.cfg.ttl)
		if err != nil {
			if ctx.Err() != nil {
				break loop
			}
			if errors.Is(err, ErrPartitionMismatch) || errors.Is(err, dedup.ErrInvalidArgument) {
				runErr = err
				break loop
			}
			r.cfg.logger.Warn("outbox relay heartbeat failed", "relay", r.cfg.id, "err", err)
			alive = 1
		}
		fair := (n + alive - 1) / alive
		if r.cfg.maxParts > 0 {
			fair = min(fair, r.cfg.maxParts)
		}
		// Renew what we hold; stop a partition whose lease changed
		// hands or could not be renewed for a whole TTL.
		wmu.Lock()
		held := make(map[int]*worker, len(workers))
		for p, w := range workers {
			held[p] = w
		}
		wmu.Unlock()
		for p, w := range held {
			l, ok, err := r.src.Acquire(ctx, r.cfg.id, p, r.cfg.ttl)
			old := w.lease.Load()
			switch {
			case err != nil:
				if time.Duration(nanotime()-w.renewed.Load()) >= r.cfg.ttl {
					r.cfg.logger.Warn("outbox relay lease expired unrenewed", "relay", r.cfg.id, "partition", p, "err", err)
					stopWorker(p, w)
				}
			case !ok || l.Epoch != old.Epoch:
				r.cfg.logger.Warn("outbox relay lost partition", "relay", r.cfg.id, "partition", p)
				stopWorker(p, w)
				if ok { // ours again under a new epoch: start afresh
					start(l)
				}
			default:
				w.lease.Store(&l)
				w.renewed.Store(nanotime())
			}
		}
		wmu.Lock()
		count := len(workers)
		wmu.Unlock()
		// Give up partitions beyond the fair share (highest first in our
		// rotation), after their batch in flight.
		for i := n - 1; i >= 0 && count > fair; i-- {
			p := (offset + i) % n
			wmu.Lock()
			w := workers[p]
			wmu.Unlock()
			if w == nil {
				continue
			}
			l := *w.lease.Load()
			stopWorker(p, w)
			r.release(ctx, l)
			count--
		}
		// Take free partitions up to the fair share.
		for i := 0; i < n && count < fair && ctx.Err() == nil; i++ {
			p := (offset + i) % n
			wmu.Lock()
			_, mine := workers[p]
			wmu.Unlock()
			if mine {
				continue
			}
			l, ok, err := r.src.Acquire(ctx, r.cfg.id, p, r.cfg.ttl)
			if err != nil || !ok {
				continue
			}
			start(l)
			count++
		}
		timer.Reset(beat)
	}
	var crashedRun bool
	if runErr != nil {
		var c crash
		crashedRun = errors.As(runErr, &c)
		if crashedRun {
			runErr = c.err
		}
	}
	cancel()
	wmu.Lock()
	all := make([]*worker, 0, len(workers))
	for _, w := range workers {
		all = append(all, w)
	}
	wmu.Unlock()
	for _, w := range all {
		close(w.stop)
		<-w.done
	}
	r.stats.held.Store(0)
	bg.Wait()
	if !crashedRun {
		cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		for _, w := range all {
			r.release(cctx, *w.lease.Load())
		}
		if err := r.src.Leave(cctx, r.cfg.id); err != nil {
			r.cfg.logger.Warn("outbox relay leave failed", "relay", r.cfg.id, "err", err)
		}
		ccancel()
	}
	return runErr
}

func (r *Relay) release(ctx context.Context, l Lease) {
	if err := r.src.Release(ctx, l); err != nil {
		r.cfg.logger.Warn("outbox relay release failed", "relay", r.cfg.id, "partition", l.Partition, "err", err)
	}
}

// readAheadBelow: a relay holding fewer partitions than this reads a
// partition's next batch under the current one's acknowledgements. With
// more, the other partitions' batches already fill each one's round
// trips, and reading ahead only adds reads (measured: +11% msg/s on one
// partition, -6 to -22% on sixteen; docs/benchmarks.md).
const readAheadBelow = 4

// work runs one partition until w.stop is closed, the lease is lost or a
// mark hook crashes the relay. After a full batch, when the source is a
// [Prefetcher] and the relay holds few partitions (readAheadBelow), it
// reads the next batch while the current one is at the broker. When the
// whole batch was acknowledged and that read found more, the batch's mark
// runs while the next batch is published (see pipelined); otherwise the
// read is thrown away and the partition marks, records its failures and
// reads afresh.
func (r *Relay) work(ctx context.Context, w *worker) error {
	results := make([]error, 0, r.cfg.batch)
	pf, _ := r.src.(Prefetcher)
	skip := r.cfg.policy == Skip
	type fetched struct {
		msgs []Message
		err  error
	}
	ahead := make(chan fetched, 1)
	poll := time.NewTimer(r.cfg.poll)
	defer poll.Stop()
	pause := func(d time.Duration) bool {
		if !poll.Stop() {
			select {
			case <-poll.C:
			default:
			}
		}
		poll.Reset(d)
		select {
		case <-w.stop:
			return false
		case <-w.wake:
		case <-poll.C:
		}
		return true
	}
	// The mark in flight, if any: its batch was acknowledged in full and
	// the batch after it is read (ahead) or at the broker.
	var pend *pipelined
	settle := func() (res markResult) {
		if pend != nil {
			res = <-pend.done
			pend = nil
		}
		return res
	}
	defer settle() // a stop or crash still waits for the mark in flight
	fenced := func(l Lease) error {
		r.stats.leaseLost.Add(1)
		r.cfg.logger.Warn("outbox relay fenced off partition", "relay", r.cfg.id, "partition", l.Partition, "epoch", l.Epoch)
		<-w.stop // the manager sees the new owner on its next beat
		return nil
	}
	// idle is the pause after the next empty read (see idlePause).
	idle := r.cfg.poll
	var next []Message // read under the previous batch's publish
	// A read ahead skips rows committed late below the batch in flight
	// (they cut their keys): a plain read at least every chainMax picks
	// them up under a sustained backlog.
	chainMax := max(r.cfg.poll, time.Second)
	var plainAt int64
	for {
		select {
		case <-w.stop:
			return nil
		default:
		}
		l := *w.lease.Load()
		msgs, prefetched := next, next != nil
		next = nil
		if !prefetched {
			// A plain read must see the batch before marked.
			if res := settle(); res.lost {
				return fenced(l)
			} else if res.retry {
				if !pause(r.cfg.minBackoff) {
					return nil
				}
				continue
			}
			var err error
			msgs, err = r.src.Fetch(ctx, l, r.cfg.batch, skip)
			r.stats.fetches.Add(1)
			plainAt = nanotime()
			if err != nil {
				if ctx.Err() == nil {
					r.cfg.logger.Warn("outbox relay fetch failed", "relay", r.cfg.id, "partition", l.Partition, "err", err)
				}
				if !pause(r.cfg.minBackoff) {
					return nil
				}
				continue
			}
			if len(msgs) == 0 {
				var d time.Duration
				d, idle = r.idlePause(idle)
				if !pause(d) {
					return nil
				}
				continue
			}
			idle = r.cfg.poll
		}
		reading := pf != nil && len(msgs) == r.cfg.batch && time.Duration(nanotime()-plainAt) < chainMax &&
			r.stats.held.Load() < readAheadBelow
		if reading {
			// The batch whose mark is in flight is not marked yet as far
			// as this read can tell: pass it over too (its Seqs are all
			// below msgs', which were read after it).
			inflight := msgs
			if pend != nil {
				inflight = append(slices.Clip(pend.msgs), msgs...)
			}
			go func() {
				m, err := pf.FetchNext(ctx, l, inflight, r.cfg.batch, skip)
				ahead <- fetched{m, err}
			}()
		}
		r.pub.Publish(ctx, msgs, results[:len(msgs)])
		r.stats.batches.Add(1)
		out := r.sort(ctx, msgs, results[:len(msgs)])
		clear(results[:len(msgs)])
		// This batch's mark may only follow the one before it.
		before := settle()
		var f fetched
		if reading {
			f = <-ahead
			r.stats.fetches.Add(1)
		}
		if before.lost {
			return fenced(l)
		}
		if before.retry {
			// The batch before goes again, and this one after it: nothing
			// of this one is marked, and the read ahead is dropped.
			if !pause(r.cfg.minBackoff) {
				return nil
			}
			continue
		}
		if r.cfg.markHook != nil {
			if err := r.cfg.markHook(l.Partition, out.acked); err != nil {
				return crash{err}
			}
		}
		if reading && !r.cfg.noPipeline && out.clean() && len(out.seqs) == len(msgs) && f.err == nil && len(f.msgs) > 0 {
			pend = r.markAsync(ctx, l, msgs, out)
			next = f.msgs
			continue
		}
		lost, retryNow := r.record(ctx, l, out)
		if lost {
			return fenced(l)
		}
		switch {
		case retryNow:
			if !pause(r.cfg.minBackoff) {
				return nil
			}
		case !prefetched && len(msgs) < r.cfg.batch:
			// A short read: the partition is drained for now.
			if !pause(r.cfg.poll) {
				return nil
			}
		}
	}
}

// outcome is a published batch sorted for the mark: what to mark, what
// to record as failed, and whether some messages were not sent.
type outcome struct {
	acked    []Message
	seqs     []int64
	failures []Failure
	retryNow bool
}

func (o *outcome) clean() bool { return len(o.failures) == 0 && !o.retryNow }

// markResult is what a mark found: the lease lost, or a failure after
// which its batch is sent again.
type markResult struct{ lost, retry bool }

// pipelined is a batch whose mark runs while the next batch is
// published. The next batch is read (ahead) and sent only once every
// message of this one was acknowledged, so the broker has each key's
// messages in order whatever happens to the mark; and the next batch's
// mark waits for this one's result: if this mark fails, neither is
// marked, and a plain read sends this batch again and then the next one
// (the consumer's dedup absorbs the second copies, as after any crash
// between the ack and the mark); if the lease was lost, the new owner
// does the same.
type pipelined struct {
	msgs []Message // for the read ahead to pass over
	done chan markResult
}

func (r *Relay) markAsync(ctx context.Context, l Lease, msgs []Message, out outcome) *pipelined {
	p := &pipelined{msgs: msgs, done: make(chan markResult, 1)}
	go func() {
		lost, retry := r.mark(ctx, l, out)
		p.done <- markResult{lost, retry}
	}()
	return p
}

// sort splits a published batch: per key, the prefix before its first
// failure is marked; the failure is recorded (unless the message was not
// sent); the key's later messages are sent again later, in order.
func (r *Relay) sort(ctx context.Context, msgs []Message, results []error) outcome {
	var o outcome
	var broken map[string]bool
	for i := range msgs {
		m := &msgs[i]
		if broken[m.Key] {
			continue // after a failure of its key: sent again later, in order
		}
		if results[i] == nil {
			o.acked = append(o.acked, *m)
			o.seqs = append(o.seqs, m.Seq)
			continue
		}
		if broken == nil {
			broken = map[string]bool{}
		}
		broken[m.Key] = true
		if errors.Is(results[i], ErrNotSent) || ctx.Err() != nil {
			// Not attempted, or cut short by our own shutdown: no attempt
			// is counted against the message.
			o.retryNow = true
			continue
		}
		attempts := m.Attempts + 1
		q := IsPermanent(results[i]) || attempts >= r.cfg.maxAttempts
		o.failures = append(o.failures, Failure{Seq: m.Seq, Err: truncate(results[i].Error(), 2000), RetryAfter: r.backoff(attempts), Quarantine: q})
	}
	return o
}

// mark marks out's acknowledged messages, on a detached context: a
// shutdown mid-batch still records what the broker acknowledged.
func (r *Relay) mark(ctx context.Context, l Lease, out outcome) (lost, retry bool) {
	mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := r.src.Mark(mctx, l, out.seqs); err != nil {
		if errors.Is(err, ErrLeaseLost) {
			return true, false
		}
		r.cfg.logger.Warn("outbox relay mark failed; the batch will be sent again", "relay", r.cfg.id, "partition", l.Partition, "err", err)
		return false, true
	}
	r.stats.published.Add(int64(len(out.seqs)))
	if len(out.acked) > 0 {
		oldest := out.acked[0].CreatedAt
		for _, m := range out.acked[1:] {
			if m.CreatedAt.Before(oldest) {
				oldest = m.CreatedAt
			}
		}
		r.stats.lag.Store(int64(time.Since(oldest)))
		if r.cfg.published != nil {
			r.cfg.published(l.Partition, out.acked)
		}
	}
	return false, false
}

// record marks out's acknowledged messages and then records its
// failures. lost reports a fenced mark; retryNow that some messages were
// not sent and the partition should pause before reading again.
func (r *Relay) record(ctx context.Context, l Lease, out outcome) (lost, retryNow bool) {
	if lost, retry := r.mark(ctx, l, out); lost || retry {
		return lost, retry
	}
	retryNow = out.retryNow
	mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := r.src.Fail(mctx, l, out.failures); err != nil {
		if errors.Is(err, ErrLeaseLost) {
			return true, false
		}
		r.cfg.logger.Warn("outbox relay could not record failures", "relay", r.cfg.id, "partition", l.Partition, "err", err)
		retryNow = true
	} else {
		for _, f := range out.failures {
			r.stats.failed.Add(1)
			if f.Quarantine {
				r.stats.quarantined.Add(1)
				r.cfg.logger.Error("outbox message quarantined", "relay", r.cfg.id, "partition", l.Partition, "seq", f.Seq, "err", f.Err)
			}
		}
	}
	if len(out.failures) > 0 {
		retryNow = true
	}
	return false, retryNow
}

// backoff is the delay after the attempt-th failure, saturating at max.
func (r *Relay) backoff(attempt int) time.Duration {
	d := r.cfg.minBackoff
	for i := 1; i < attempt && d < r.cfg.maxBackoff; i++ {
		if d > r.cfg.maxBackoff/2 {
			return r.cfg.maxBackoff
		}
		d *= 2
	}
	return min(d, r.cfg.maxBackoff)
}

// idlePause returns the pause after an empty read, given the pause due
// (d), and the one due after the next empty read. Without notifications
// it is the poll interval. While the relay listens, a new row's
// notification wakes the partition at once, so its polls back off,
// doubling from the poll interval up to max(poll interval, minimum retry
// backoff): polls then find only rows that notify nobody (a failed
// message's retry coming due, an operator's retry of a quarantined one),
// a minimum backoff late at most. A drained partition so stops reading
// the table every poll interval while the others work.
func (r *Relay) idlePause(d time.Duration) (pause, next time.Duration) {
	if !r.listening.Load() {
		return r.cfg.poll, r.cfg.poll
	}
	ceil := max(r.cfg.poll, r.cfg.minBackoff)
	d = min(d, ceil)
	if d > ceil/2 {
		return d, ceil
	}
	return d, 2 * d
}

func (r *Relay) listen(ctx context.Context, n Notifier, wake func()) {
	for ctx.Err() == nil {
		err := n.Listen(ctx, func() {
			r.listening.Store(true)
			wake()
		})
		// Notifications since the connection failed are lost: every
		// partition reads now and then polls at the poll interval.
		r.listening.Store(false)
		wake()
		if err != nil && ctx.Err() == nil {
			r.cfg.logger.Warn("outbox relay listen failed; polling meanwhile", "relay", r.cfg.id, "err", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(r.cfg.poll):
		}
	}
}

func (r *Relay) prune(ctx context.Context, p Pruner) {
	t := time.NewTicker(r.cfg.pruneEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for ctx.Err() == nil {
			n, err := p.Prune(ctx, r.cfg.keep, r.cfg.pruneLimit)
			if err != nil {
				r.cfg.logger.Warn("outbox relay prune failed", "relay", r.cfg.id, "err", err)
				break
			}
			if n < r.cfg.pruneLimit {
				break
			}
		}
	}
}

func (c crash) Error() string { return "outbox: relay crashed by its mark hook: " + c.err.Error() }
func (c crash) Unwrap() error { return c.err }

var start = time.Now()

func nanotime() int64 { return int64(time.Since(start)) }

func hash32(s string) uint32 {
	h := uint32(2166136261)
	for i := 0; i < len(s); i++ {
		h ^= uint32(s[i])
		h *= 16777619
	}
	return h
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}
