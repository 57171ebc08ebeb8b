package verify

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup"
)

// scope is the key scope of every message verify publishes.
const scope = "dedup-verify"

// effectsTimeout bounds the final read of the ledger.
const effectsTimeout = time.Minute

// Run drives the pipeline described by cfg against t until every delivery
// has been acknowledged or ctx ends, then checks the ledger. A deadline on
// ctx that passes is reported as TimedOut, another cancellation as
// Interrupted; both fail the run. The error is for a bad configuration or
// an unreadable ledger, not for a violation, which the Report states.
//
// Run does not close t. Every goroutine it starts has ended when it returns.
func Run(ctx context.Context, cfg Config, t Target) (Report, error) {
	b, err := start(cfg, t, "simulated")
	if err != nil {
		return Report{}, err
	}
	cfg = b.cfg

	out := make(chan Delivery)
	results := make(chan settled, cfg.Consumers)
	var wg sync.WaitGroup
	for range cfg.Consumers {
		wg.Go(func() {
			for d := range out {
				start := time.Now()
				res := t.Apply(ctx, d)
				results <- settled{d: d, res: res, took: time.Since(start)}
			}
			results <- settled{exit: true}
		})
	}
	stopped := b.loop(ctx, out, results)
	// The loop closed out: take the results of the deliveries still in
	// flight (without redelivering them) until every consumer has left.
	for left := 0; left < cfg.Consumers; {
		if r := <-results; r.exit {
			left++
		} else {
			b.settle(r, false)
		}
	}
	wg.Wait()
	return b.conclude(ctx, t, stopped)
}

// start checks cfg and t and returns the broker of a new run over the
// named broker, with cfg's defaults filled in.
func start(cfg Config, t Target, broker string) (*broker, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if t == nil {
		return nil, errors.New("verify: no target")
	}
	if cfg.Seed == 0 {
		cfg.Seed = rand.Uint64() | 1
	}
	if cfg.ProgressEvery == 0 {
		cfg.ProgressEvery = 100 * time.Millisecond
	}
	// A fresh prefix per run keeps message IDs and keys apart from earlier
	// runs on a kept database (and streams apart on a shared server).
	runID := strconv.FormatUint(rand.Uint64()>>24, 36)
	b := newBroker(cfg, runID+"-")
	b.runID = runID
	b.report = Report{
		Store: t.Store(), Mode: t.Mode(), Broker: broker,
		Messages: cfg.Messages, Consumers: cfg.Consumers,
		DupRate: cfg.DupRate, CrashRate: cfg.CrashRate, FailRate: cfg.FailRate,
		Lease: cfg.Lease.String(), Seed: cfg.Seed,
	}
	return b, nil
}

// conclude ends a run: it says whether it stopped early, reads the ledger
// and judges it.
func (b *broker) conclude(ctx context.Context, t Target, stopped bool) (Report, error) {
	elapsed := time.Since(b.start)
	rep := &b.report
	if stopped {
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			rep.TimedOut = true
		} else {
			rep.Interrupted = true
		}
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), effectsTimeout)
	defer cancel()
	effects, err := t.Effects(rctx, b.prefix)
	if err != nil {
		return *rep, fmt.Errorf("verify: check the ledger: %w", err)
	}
	b.judge(effects)
	b.failover.report(rep)
	if ls, ok := t.(LayerReporter); ok {
		rep.Layers, rep.Flushes = ls.LayerStats()
	}
	rep.finish(elapsed)
	return *rep, nil
}

// settled is a delivery with what became of it, or the last word of a
// consumer that has left (exit).
type settled struct {
	d    Delivery
	res  Result
	took time.Duration // how long Apply ran
	exit bool
}

// broker is the simulated at-least-once broker. It runs on one goroutine
// (loop), owns every queue and counter, and hands deliveries out over an
// unbuffered channel, so copies queued back to back reach two consumers at
// about the same time.
type broker struct {
	cfg    Config
	runID  string
	prefix string
	rng    *rand.Rand
	start  time.Time

	next    int     // next message to publish
	pending []int32 // unacknowledged deliveries per message
	done    int     // messages with pending 0 after publication
	ready   fifo
	delayed delayHeap

	report   Report
	failover *failoverRunner
}

func newBroker(cfg Config, prefix string) *broker {
	return &broker{
		cfg:      cfg,
		failover: newFailoverRunner(cfg),
		prefix:   prefix,
		rng:      rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15)),
		start:    time.Now(),
		pending:  make([]int32, cfg.Messages),
	}
}

// msgID returns the ID of message seq: the run's prefix and seq with at
// least seven digits.
func (b *broker) msgID(seq int) string {
	buf := make([]byte, 0, len(b.prefix)+10)
	buf = append(buf, b.prefix...)
	for p := 1_000_000; p > seq && p > 1; p /= 10 {
		buf = append(buf, '0')
	}
	return string(strconv.AppendInt(buf, int64(seq), 10))
}

// parseMsgID returns the seq of a message ID of this run.
func (b *broker) parseMsgID(id string) (int, bool) {
	rest, ok := strings.CutPrefix(id, b.prefix)
	if !ok {
		return 0, false
	}
	seq, err := strconv.Atoi(rest)
	if err != nil || seq < 0 || seq >= b.cfg.Messages || b.msgID(seq) != id {
		return 0, false
	}
	return seq, true
}

// loop runs the broker until every message is done or ctx ends, which it
// reports as stopped. It closes out when it returns.
func (b *broker) loop(ctx context.Context, out chan<- Delivery, results <-chan settled) (stopped bool) {
	defer close(out)
	// A failover under way ends before the ledger is read.
	defer b.failover.wait()
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	var armed time.Time // the due time the timer is set for; zero if none
	var tick <-chan time.Time
	if b.cfg.Progress != nil {
		t := time.NewTicker(b.cfg.ProgressEvery)
		defer t.Stop()
		tick = t.C
	}
	for {
		b.refill()
		if b.done == b.cfg.Messages {
			b.progress()
			return false
		}
		var send chan<- Delivery
		var head Delivery
		if b.ready.len() > 0 {
			send, head = out, b.ready.front()
		}
		var wake <-chan time.Time
		if len(b.delayed) > 0 {
			if due := b.delayed[0].due; !due.Equal(armed) {
				timer.Reset(time.Until(due))
				armed = due
			}
			wake = timer.C
		}
		select {
		case send <- head:
			b.ready.pop()
			b.report.Deliveries++
			b.failover.due(ctx, b.report.Deliveries)
		case r := <-results:
			b.settle(r, true)
		case <-wake:
			armed = time.Time{}
			now := time.Now()
			for len(b.delayed) > 0 && !b.delayed[0].due.After(now) {
				b.enqueue(heap.Pop(&b.delayed).(delayed).d)
			}
		case <-tick:
			b.progress()
		case <-ctx.Done():
			return true
		}
	}
}

// refill publishes new messages while fewer than two deliveries per
// consumer are ready, so redeliveries mix with fresh messages.
func (b *broker) refill() {
	for b.ready.len() < 2*b.cfg.Consumers && b.next < b.cfg.Messages {
		seq := b.next
		b.next++
		d := b.delivery(seq)
		b.pending[seq] = 1
		b.enqueue(d)
		if b.rng.Float64() < b.cfg.DupRate {
			b.pending[seq]++
			b.report.BrokerDuplicates++
			b.enqueue(d)
		}
	}
}

// delivery returns the first delivery of message seq.
func (b *broker) delivery(seq int) Delivery {
	id := b.msgID(seq)
	return Delivery{
		Seq:         seq,
		MsgID:       id,
		Key:         dedup.Key{Scope: scope, ID: id},
		Fingerprint: dedup.FingerprintOf(payloadOf(id, seq)),
	}
}

// payloadOf is the body of message seq.
func payloadOf(id string, seq int) []byte {
	return []byte(`{"msg_id":"` + id + `","amount_cents":` + strconv.Itoa(seq%9973+1) + `}`)
}

// enqueue makes d ready, drawing its fault.
func (b *broker) enqueue(d Delivery) {
	d.Fault = b.fault()
	b.ready.push(d)
}

// fault draws what goes wrong with one delivery.
func (b *broker) fault() Fault { return faultOf(b.cfg, b.rng.Float64()) }

// settle counts what became of a delivery, then forgets it if it was
// acknowledged or schedules its redelivery if not. After the loop stopped
// (live false) nothing is redelivered: the message stays unfinished.
func (b *broker) settle(s settled, live bool) {
	delay, acked := b.account(s, s.res.Outcome.acked())
	if acked || !live {
		return
	}
	d := s.d
	d.Redelivered++
	b.report.Redeliveries++
	heap.Push(&b.delayed, delayed{due: time.Now().Add(delay), d: d})
}

// account counts what became of a delivery and, if acked, that its message
// has one delivery fewer pending. It returns how long the broker should
// wait before redelivering an unacknowledged delivery.
func (b *broker) account(s settled, acked bool) (delay time.Duration, _ bool) {
	rep := &b.report
	res := s.res
	if ms := float64(s.took) / float64(time.Millisecond); ms > rep.SlowestDeliveryMS {
		rep.SlowestDeliveryMS = ms
	}
	if res.TakenOver {
		rep.Takeovers++
	}
	lease := b.cfg.Lease
	switch res.Outcome {
	case Applied:
	case Duplicate:
		rep.DuplicatesSkipped++
	case Conflict:
		rep.Conflicts++
	case CrashedBeforeCommit, CrashedAfterCommit, Killed:
		switch res.Outcome {
		case CrashedBeforeCommit:
			rep.CrashesBeforeCommit++
		case CrashedAfterCommit:
			rep.CrashesAfterCommit++
		default:
			rep.KilledDeliveries++
		}
		// Nobody acknowledged or rejected it: the broker waits out its
		// visibility timeout.
		delay = lease/2 + b.jitter(lease/2)
	case InProgress:
		rep.InProgressNacks++
		delay = max(res.RetryAfter, lease/20) + b.jitter(lease/20)
	case HandlerFailed:
		rep.HandlerFailures++
		delay = lease/20 + b.jitter(lease/20)
	case LeaseLost:
		rep.LeasesLost++
		delay = lease/20 + b.jitter(lease/20)
	default: // StoreFailed, or a target that returned no outcome
		rep.StoreErrors++
		delay = lease/20 + b.jitter(lease/20)
		if res.Err == nil {
			res.Err = fmt.Errorf("target returned outcome %v", res.Outcome)
		}
	}
	if res.Err != nil && rep.FirstError == "" {
		rep.FirstError = res.Outcome.String() + ": " + res.Err.Error()
	}
	if acked {
		b.pending[s.d.Seq]--
		if b.pending[s.d.Seq] == 0 {
			b.done++
		}
	}
	return delay, acked
}

func (b *broker) jitter(d time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return time.Duration(b.rng.Int64N(int64(d) + 1))
}

func (b *broker) progress() {
	if b.cfg.Progress != nil {
		b.cfg.Progress(Progress{Done: b.done, Messages: b.cfg.Messages, Deliveries: b.report.Deliveries, Elapsed: time.Since(b.start)})
	}
}

// judge checks the ledger: exactly one effect per message.
func (b *broker) judge(effects map[string]int) {
	rep := &b.report
	rep.Unfinished = b.cfg.Messages - b.done
	counts := make([]int, b.next)
	for id, n := range effects {
		rep.Effects += n
		seq, ok := b.parseMsgID(id)
		if !ok || seq >= b.next {
			rep.StrayEffects += n
			continue
		}
		counts[seq] = n
	}
	for seq, n := range counts {
		switch {
		case n > 1:
			rep.DoubleApplied++
			if len(rep.DoubleSample) < sampleSize {
				rep.DoubleSample = append(rep.DoubleSample, b.msgID(seq)+" x"+strconv.Itoa(n))
			}
		case n == 0 && b.pending[seq] == 0:
			rep.Lost++
			if len(rep.LostSample) < sampleSize {
				rep.LostSample = append(rep.LostSample, b.msgID(seq))
			}
		}
	}
}

// fifo is a growable ring buffer of deliveries.
type fifo struct {
	buf  []Delivery
	head int
	n    int
}

func (q *fifo) len() int { return q.n }

func (q *fifo) push(d Delivery) {
	if q.n == len(q.buf) {
		nb := make([]Delivery, max(16, 2*len(q.buf)))
		for i := range q.n {
			nb[i] = q.buf[(q.head+i)%len(q.buf)]
		}
		q.buf, q.head = nb, 0
	}
	q.buf[(q.head+q.n)%len(q.buf)] = d
	q.n++
}

func (q *fifo) front() Delivery { return q.buf[q.head] }

func (q *fifo) pop() {
	q.buf[q.head] = Delivery{}
	q.head = (q.head + 1) % len(q.buf)
	q.n--
}

// delayed is a delivery waiting for its redelivery time.
type delayed struct {
	due time.Time
	d   Delivery
}

// delayHeap orders delayed deliveries by due time.
type delayHeap []delayed

func (h delayHeap) Len() int           { return len(h) }
func (h delayHeap) Less(i, j int) bool { return h[i].due.Before(h[j].due) }
func (h delayHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *delayHeap) Push(x any)        { *h = append(*h, x.(delayed)) }
func (h *delayHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// failoverRunner calls Config.Failover every FailoverEvery deliveries, one
// call at a time, and counts what the calls did. A nil runner does
// nothing.
type failoverRunner struct {
	every int
	step  func(ctx context.Context) (FailoverKind, string, error)
	busy  atomic.Bool
	wg    sync.WaitGroup

	mu       sync.Mutex
	manual   int
	kills    int
	errs     int
	firstErr string
}

func newFailoverRunner(cfg Config) *failoverRunner {
	if cfg.Failover == nil || cfg.FailoverEvery <= 0 {
		return nil
	}
	return &failoverRunner{every: cfg.FailoverEvery, step: cfg.Failover}
}

// due starts a step when the count of deliveries says so and no step is
// under way.
func (f *failoverRunner) due(ctx context.Context, deliveries int) {
	if f == nil || deliveries%f.every != 0 || !f.busy.CompareAndSwap(false, true) {
		return
	}
	f.wg.Go(func() {
		defer f.busy.Store(false)
		kind, node, err := f.step(ctx)
		f.mu.Lock()
		defer f.mu.Unlock()
		switch {
		case err != nil:
			f.errs++
			if f.firstErr == "" {
				f.firstErr = fmt.Sprintf("%s of %s: %v", kind, node, err)
			}
		case kind == MasterKill:
			f.kills++
		default:
			f.manual++
		}
	})
}

func (f *failoverRunner) wait() {
	if f != nil {
		f.wg.Wait()
	}
}

func (f *failoverRunner) report(r *Report) {
	if f == nil {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	r.FailoverEvery = f.every
	r.Failovers, r.MasterKills, r.FailoverErrors, r.FailoverError = f.manual, f.kills, f.errs, f.firstErr
}
