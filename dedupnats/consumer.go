package dedupnats

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup/consumer"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// ErrClosed is returned by Run on a closed consumer.
var ErrClosed = errors.New("dedupnats: consumer closed")

// ErrRunning is returned by Run when the consumer is already running.
var ErrRunning = errors.New("dedupnats: consumer already running")

// Consumer feeds a JetStream durable pull consumer through a
// [consumer.Processor] and acknowledges each message according to the
// processor's decision, after the decision. It is safe for concurrent
// use; Run runs once at a time.
type Consumer struct {
	js      jetstream.JetStream
	stream  string
	durable string
	p       *consumer.Processor
	cfg     consumerConfig
	process func(ctx context.Context, msg jetstream.Msg) // handle; the benchmarks' bare consumer replaces it
	// handleBatch, with batch processing; the benchmarks' floors replace
	// it. It calls settled once every message of msgs was settled, which
	// may be after it returned.
	processBatch func(ctx context.Context, msgs []jetstream.Msg, settled func())

	mu      sync.Mutex
	running bool
	closed  bool
	cancel  context.CancelFunc
	done    chan struct{}

	// Per run.
	ackWait    time.Duration
	maxDeliver int
	inflight   atomic.Int64  // messages held: queued or processing
	freed      chan struct{} // a held message was settled
	stopping   atomic.Bool   // the pull ended: no request of ours is pending
	held       heldSet
	pipe       *consumer.Pipeline // batch processing: completions overlap the next batch
	pipeDepth  int                // batches in flight in pipe; 0: 2 (the benchmarks try others)

	stats consumerStats
}

// Stats counts what a consumer did with messages since it was made.
type Stats struct {
	// Fetched counts messages received from the broker.
	Fetched uint64
	// Acked counts acknowledgements (applied, duplicate, rejected).
	Acked uint64
	// Naked counts negative acknowledgements (Retry, and messages released
	// on shutdown).
	Naked uint64
	// Terminated counts dead-lettered messages terminated on the broker.
	Terminated uint64
	// GaveUp counts Retry decisions turned into dead letters because
	// MaxDeliver was reached.
	GaveUp uint64
	// EnvelopeErrors counts messages dead-lettered because their envelope
	// headers could not be read.
	EnvelopeErrors uint64
	// InProgress counts InProgress heartbeats sent.
	InProgress uint64
	// AckErrors counts acknowledgements that could not be sent; the broker
	// redelivers those messages and the redelivery is a duplicate.
	AckErrors uint64
}

type consumerStats struct {
	fetched, acked, naked, terminated, gaveUp, envelope, inProgress, ackErrors atomic.Uint64
}

// NewConsumer returns a consumer of the durable pull consumer durable on
// stream, processing with p. It does no I/O: Run creates or updates the
// durable consumer (explicit acknowledgement, AckWait and MaxDeliver as
// configured). A bad argument or option gives a [*dedup.ArgumentError].
func NewConsumer(js jetstream.JetStream, stream, durable string, p *consumer.Processor, opts ...ConsumerOption) (*Consumer, error) {
	switch {
	case js == nil:
		return nil, bad("jetstream", "is nil")
	case p == nil:
		return nil, bad("processor", "is nil")
	case stream == "" || strings.ContainsAny(stream, " .*>\t\r\n/\\"):
		return nil, bad("stream", fmt.Sprintf("%q is not a stream name", stream))
	case durable == "" || strings.ContainsAny(durable, " .*>\t\r\n/\\"):
		return nil, bad("durable", fmt.Sprintf("%q is not a consumer name", durable))
	}
	cfg := defaultConsumerConfig()
	for _, o := range opts {
		if o != nil {
			o.applyConsumer(&cfg)
		}
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	c := &Consumer{js: js, stream: stream, durable: durable, p: p, cfg: cfg}
	c.process, c.processBatch = c.handle, c.handleBatch
	return c, nil
}

// Stats returns the counts so far.
func (c *Consumer) Stats() Stats {
	s := &c.stats
	return Stats{
		Fetched: s.fetched.Load(), Acked: s.acked.Load(), Naked: s.naked.Load(), Terminated: s.terminated.Load(),
		GaveUp: s.gaveUp.Load(), EnvelopeErrors: s.envelope.Load(), InProgress: s.inProgress.Load(),
		AckErrors: s.ackErrors.Load(),
	}
}

// AckWait returns the default AckWait for processor p: max(30s, 1.25 x
// its lease).
func AckWait(p *consumer.Processor) time.Duration {
	return max(30*time.Second, p.Lease()+p.Lease()/4)
}

// Run creates or updates the durable consumer, checks the stream's
// windows against the processor's retention (see [WindowWarning]), and
// processes messages until ctx is cancelled or Close is called; then it
// stops pulling, releases the messages not started, lets the ones being
// processed finish (see [WithDrainTimeout]), flushes their
// acknowledgements and returns: nil after Close, ctx's error after a
// cancellation. It returns early with an error when the stream or the
// durable consumer cannot be set up, the connection is closed, or the
// durable consumer is deleted.
func (c *Consumer) Run(ctx context.Context) error {
	c.mu.Lock()
	switch {
	case c.closed:
		c.mu.Unlock()
		return ErrClosed
	case c.running:
		c.mu.Unlock()
		return ErrRunning
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	c.running, c.cancel, c.done = true, cancel, done
	c.mu.Unlock()
	defer func() {
		cancel()
		c.mu.Lock()
		c.running, c.cancel = false, nil
		c.mu.Unlock()
		close(done)
	}()

	cons, err := c.setup(runCtx)
	if err == nil {
		err = c.loop(runCtx, cons)
	}
	if err == nil || runCtx.Err() != nil && errors.Is(err, runCtx.Err()) {
		err = ctx.Err() // nil after Close
	}
	return err
}

// Close stops Run and waits for it to return; later Runs return
// [ErrClosed]. Do not call it from a handler: it waits for the handler.
func (c *Consumer) Close() error {
	c.mu.Lock()
	c.closed = true
	cancel, done := c.cancel, c.done
	c.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
	return nil
}

func (c *Consumer) setup(ctx context.Context) (jetstream.Consumer, error) {
	s, err := c.js.Stream(ctx, c.stream)
	if err != nil {
		return nil, fmt.Errorf("dedupnats: stream %s: %w", c.stream, err)
	}
	c.checkWindows(ctx, &s.CachedInfo().Config)

	ackWait := c.cfg.ackWait
	if ackWait == 0 {
		ackWait = AckWait(c.p)
	}
	cc := jetstream.ConsumerConfig{
		Durable:    c.durable,
		AckPolicy:  jetstream.AckExplicitPolicy,
		AckWait:    ackWait,
		MaxDeliver: c.cfg.maxDeliver,
	}
	for _, f := range c.cfg.adjust {
		f(&cc)
	}
	switch {
	case cc.AckPolicy != jetstream.AckExplicitPolicy:
		return nil, bad("consumer config", "AckPolicy must stay explicit: the adapter acknowledges each message after its decision")
	case cc.Durable != c.durable || cc.Name != "" && cc.Name != c.durable:
		return nil, bad("consumer config", "must not rename the durable consumer")
	}
	cons, err := c.js.CreateOrUpdateConsumer(ctx, c.stream, cc)
	if err != nil {
		return nil, fmt.Errorf("dedupnats: durable consumer %s on %s: %w", c.durable, c.stream, err)
	}
	got := cons.CachedInfo().Config
	c.ackWait, c.maxDeliver = got.AckWait, got.MaxDeliver
	if c.ackWait <= 0 {
		c.ackWait = 30 * time.Second
	}
	return cons, nil
}

// loop pulls and processes until ctx is done or pulling fails for good.
func (c *Consumer) loop(ctx context.Context, cons jetstream.Consumer) error {
	c.stopping.Store(false)
	c.inflight.Store(0)
	c.freed = make(chan struct{}, 1)
	c.held.reset()

	// Handlers run on a context that outlives ctx by the drain timeout, so
	// a stop lets the messages being processed finish and be acknowledged.
	procCtx, procCancel := context.WithCancel(context.WithoutCancel(ctx))
	defer procCancel()

	queue := make(chan jetstream.Msg, c.cfg.batch)
	var (
		workers   sync.WaitGroup
		mu        sync.Mutex
		unstarted []jetstream.Msg // not started before the stop: released at the end
	)
	chunk := 1 // messages a worker takes from the queue at once
	if c.cfg.batchProcessing {
		chunk = max(c.cfg.batch/2, 1)
		depth := c.pipeDepth
		if depth == 0 {
			depth = 2
		}
		c.pipe = c.p.NewPipeline(depth)
	}
	// done frees the room of n messages settled.
	done := func(n int) {
		c.inflight.Add(-int64(n))
		select {
		case c.freed <- struct{}{}:
		default:
		}
	}
	for range c.cfg.concurrency {
		workers.Go(func() {
			var msgs []jetstream.Msg
			for msg := range queue {
				// A batch's messages are settled after its completion, which
				// overlaps the next batch: each batch has its own slice.
				msgs = take(append(make([]jetstream.Msg, 0, chunk), msg), queue, chunk)
				switch {
				case ctx.Err() != nil || c.stopping.Load():
					mu.Lock()
					unstarted = append(unstarted, msgs...)
					mu.Unlock()
				case c.cfg.batchProcessing:
					n := len(msgs)
					c.processBatch(procCtx, msgs, func() { done(n) })
					continue
				default:
					c.process(procCtx, msg)
				}
				done(len(msgs))
			}
			if c.pipe != nil {
				c.pipe.Wait()
			}
		})
	}
	hbStop := make(chan struct{})
	var hb sync.WaitGroup
	hb.Go(func() { c.heartbeat(hbStop) })

	err := c.pull(ctx, cons, queue)

	// No pull request of ours is pending now; only now can the messages
	// not started be released, or the broker could hand them straight
	// back to our own expiring request.
	c.stopping.Store(true)
	close(queue)
	finished := make(chan struct{})
	go func() { workers.Wait(); close(finished) }()
	t := time.NewTimer(c.cfg.drain)
	select {
	case <-finished:
	case <-t.C:
		procCancel()
		<-finished
	}
	t.Stop()
	for _, msg := range unstarted {
		c.release(msg)
	}
	close(hbStop)
	hb.Wait()
	if nc := c.js.Conn(); nc != nil && !nc.IsClosed() {
		fctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if ferr := nc.FlushWithContext(fctx); ferr != nil {
			c.cfg.logger.Warn("dedupnats: flushing acknowledgements failed; the broker will redeliver what it did not get",
				slog.String("stream", c.stream), slog.String("durable", c.durable), slog.Any("error", ferr))
		}
		cancel()
	}
	return err
}

// take adds to msgs the messages waiting in queue, without waiting for
// more, up to n in all.
func take(msgs []jetstream.Msg, queue <-chan jetstream.Msg, n int) []jetstream.Msg {
	for len(msgs) < n {
		select {
		case msg, ok := <-queue:
			if !ok {
				return msgs
			}
			msgs = append(msgs, msg)
		default:
			return msgs
		}
	}
	return msgs
}

// pull fetches while there is room for at least half a batch, hands each
// message to the workers, and returns nil when ctx is done or an error
// that stops the consumer.
func (c *Consumer) pull(ctx context.Context, cons jetstream.Consumer, queue chan<- jetstream.Msg) error {
	batch := int64(c.cfg.batch)
	low := batch - max(batch/2, 1) // fetch when at most this many are held
	var failures int
	for {
		for c.inflight.Load() > low {
			select {
			case <-c.freed:
			case <-ctx.Done():
				return nil
			}
		}
		if ctx.Err() != nil {
			return nil
		}
		n := int(batch - c.inflight.Load())
		// The pull is not cut short by a stop: it runs to its expiry, so
		// that when pull returns no request of ours is left waiting on the
		// server (see loop). What it brings after the stop is released.
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.fetchWait)
		mb, err := cons.Fetch(n, jetstream.FetchContext(fctx))
		if err == nil {
			for msg := range mb.Messages() {
				c.stats.fetched.Add(1)
				c.inflight.Add(1)
				c.held.add(msg)
				queue <- msg // never blocks: at most batch messages are held
			}
			err = mb.Error()
		}
		cancel()
		switch {
		case err == nil, ctx.Err() != nil:
			failures = 0
			continue
		case errors.Is(err, context.DeadlineExceeded), errors.Is(err, nats.ErrTimeout), errors.Is(err, jetstream.ErrNoMessages):
			failures = 0
			continue
		case errors.Is(err, nats.ErrConnectionClosed), errors.Is(err, jetstream.ErrConsumerDeleted),
			errors.Is(err, jetstream.ErrConsumerNotFound), errors.Is(err, jetstream.ErrStreamNotFound):
			return fmt.Errorf("dedupnats: pull from %s/%s: %w", c.stream, c.durable, err)
		}
		if nc := c.js.Conn(); nc != nil && nc.IsClosed() {
			return fmt.Errorf("dedupnats: pull from %s/%s: %w", c.stream, c.durable, nats.ErrConnectionClosed)
		}
		failures++
		delay := consumer.Backoff(100*time.Millisecond, 5*time.Second, failures)
		c.cfg.logger.Warn("dedupnats: pull failed, retrying", slog.String("stream", c.stream),
			slog.String("durable", c.durable), slog.Any("error", err), slog.Duration("delay", delay))
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
	}
}

// handle processes one message and settles it on the broker.
func (c *Consumer) handle(ctx context.Context, msg jetstream.Msg) {
	m, err := newMessage(msg, c.stream)
	var d consumer.Decision
	if err != nil {
		d = c.quarantine(ctx, m, err)
	} else {
		d = c.p.Process(ctx, m)
	}
	c.settle(ctx, msg, m, d)
}

// handleBatch processes msgs in order in one batch through the pipeline
// ([consumer.Pipeline]: as [consumer.Processor.ProcessBatch], with this
// batch's completion overlapping the claim of the next), then, once the
// batch's completion returned, settles each as handle does and calls
// settled.
func (c *Consumer) handleBatch(ctx context.Context, msgs []jetstream.Msg, settled func()) {
	ms := make([]*consumer.Message, len(msgs))
	ds := make([]consumer.Decision, len(msgs))
	run := make([]*consumer.Message, 0, len(msgs))
	at := make([]int, 0, len(msgs))
	for i, msg := range msgs {
		m, err := newMessage(msg, c.stream)
		ms[i] = m
		if err != nil {
			ds[i] = c.quarantine(ctx, m, err)
			continue
		}
		run, at = append(run, m), append(at, i)
	}
	c.pipe.Submit(ctx, run, func(rds []consumer.Decision) {
		for j, d := range rds {
			ds[at[j]] = d
		}
		for i, msg := range msgs {
			c.settle(ctx, msg, ms[i], ds[i])
		}
		settled()
	})
}

// quarantine dead-letters a message whose envelope cannot be read: no
// retry can fix it. It goes under the processor's name, with the header
// error as the reason.
func (c *Consumer) quarantine(ctx context.Context, m *consumer.Message, err error) consumer.Decision {
	c.stats.envelope.Add(1)
	return c.p.Quarantine(ctx, m, consumer.ClassPermanent, err)
}

// settle acknowledges, terminates or naks msg as its decision d says,
// after turning a Retry that the broker would not honour into a dead
// letter.
func (c *Consumer) settle(ctx context.Context, msg jetstream.Msg, m *consumer.Message, d consumer.Decision) {
	var err error
	last := d.Action == consumer.Retry && c.maxDeliver > 0 && m.Delivery >= c.maxDeliver
	if last {
		d = c.giveUp(ctx, m, d)
	}
	c.held.remove(msg) // no InProgress after the settlement
	switch d.Action {
	case consumer.Ack, consumer.Rejected:
		if c.cfg.doubleAck {
			err = msg.DoubleAck(ctx)
		} else {
			err = msg.Ack()
		}
		c.count(&c.stats.acked, err, m, "ack")
	case consumer.DeadLettered:
		// Term, not TermWithReason: servers before 2.10.4 ignore the latter
		// and would redeliver the message.
		err = msg.Term()
		c.count(&c.stats.terminated, err, m, "term")
	case consumer.Retry:
		if last {
			// The sink kept failing until the drain ended; the broker will
			// not redeliver. The message stays in the stream.
			seq := uint64(0)
			if meta, merr := msg.Metadata(); merr == nil {
				seq = meta.Sequence.Stream
			}
			c.cfg.logger.Error("dedupnats: message reached MaxDeliver and could not be dead-lettered; the broker will not redeliver it (it stays in the stream)",
				slog.String("stream", c.stream), slog.String("durable", c.durable), slog.Uint64("stream_seq", seq),
				slog.String("message_id", m.ID), slog.Any("error", d.Err))
			return
		}
		if d.Delay > 0 {
			err = msg.NakWithDelay(d.Delay)
		} else {
			err = msg.Nak()
		}
		c.count(&c.stats.naked, err, m, "nak")
	default:
		// Never acknowledge what the processor did not decide to.
		err = msg.Nak()
		c.count(&c.stats.naked, err, m, "nak")
	}
}

// giveUp dead-letters a message the broker will not redeliver, retrying
// the sink for as long as ctx allows.
func (c *Consumer) giveUp(ctx context.Context, m *consumer.Message, d consumer.Decision) consumer.Decision {
	c.stats.gaveUp.Add(1)
	for {
		g := c.p.GiveUp(ctx, m, d)
		if g.Action != consumer.Retry {
			return g
		}
		t := time.NewTimer(max(g.Delay, 100*time.Millisecond))
		select {
		case <-ctx.Done():
			t.Stop()
			return g
		case <-t.C:
		}
	}
}

// release hands a message that was fetched but not started back to the
// broker for another instance.
func (c *Consumer) release(msg jetstream.Msg) {
	c.held.remove(msg)
	err := msg.Nak()
	if err != nil {
		c.stats.ackErrors.Add(1)
		return
	}
	c.stats.naked.Add(1)
}

func (c *Consumer) count(n *atomic.Uint64, err error, m *consumer.Message, op string) {
	if err == nil {
		n.Add(1)
		return
	}
	c.stats.ackErrors.Add(1)
	c.cfg.logger.Warn("dedupnats: "+op+" failed; the broker will redeliver the message",
		slog.String("stream", c.stream), slog.String("durable", c.durable), slog.String("message_id", m.ID),
		slog.Any("error", err))
}

// heartbeat sends InProgress for every held message every third of
// AckWait, so neither a long handler nor a message queued behind it is
// redelivered while this process holds it.
func (c *Consumer) heartbeat(stop <-chan struct{}) {
	t := time.NewTicker(max(c.ackWait/3, 10*time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
			c.stats.inProgress.Add(c.held.progress())
		}
	}
}

// heldSet is the set of messages held by this process between fetch and
// settlement.
type heldSet struct {
	mu sync.Mutex
	m  map[jetstream.Msg]struct{}
}

func (h *heldSet) reset() {
	h.mu.Lock()
	h.m = make(map[jetstream.Msg]struct{})
	h.mu.Unlock()
}

func (h *heldSet) add(msg jetstream.Msg) {
	h.mu.Lock()
	h.m[msg] = struct{}{}
	h.mu.Unlock()
}

func (h *heldSet) remove(msg jetstream.Msg) {
	h.mu.Lock()
	delete(h.m, msg)
	h.mu.Unlock()
}

// progress sends InProgress for each held message; under the lock, so
// none is sent after a message left the set to be settled.
func (h *heldSet) progress() uint64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	var n uint64
	for msg := range h.m {
		if msg.InProgress() == nil {
			n++
		}
	}
	return n
}

// WarningKind says which window a [WindowWarning] is about.
type WarningKind uint8

const (
	// DuplicateWindowShort: the stream's duplicate window (Duplicates) is
	// shorter than the processor's retention. A producer retry after the
	// window is stored twice; the consumer's dedup still catches it while
	// its record lives, so this only says that the broker's defence in
	// depth covers less than the consumer's.
	DuplicateWindowShort WarningKind = iota + 1
	// StreamOutlivesRetention: the stream keeps messages (MaxAge, 0 for
	// as long as its limits allow) longer than the processor remembers
	// them. A redelivery or a replay (a new or reset consumer) of a
	// message older than the retention is applied again, unless the
	// handler is idempotent by design (package guard).
	StreamOutlivesRetention
)

func (k WarningKind) String() string {
	switch k {
	case DuplicateWindowShort:
		return "duplicate window shorter than retention"
	case StreamOutlivesRetention:
		return "stream keeps messages longer than retention"
	}
	return "warning(?)"
}

// A WindowWarning is a mismatch between a stream's windows and the
// processor's retention, found when Run starts.
type WindowWarning struct {
	Kind       WarningKind
	Stream     string
	Durable    string
	Duplicates time.Duration // the stream's duplicate window
	MaxAge     time.Duration // the stream's MaxAge; 0: unlimited
	Retention  time.Duration // the processor's
}

func (c *Consumer) checkWindows(ctx context.Context, sc *jetstream.StreamConfig) {
	ret := c.p.Retention()
	w := WindowWarning{Stream: c.stream, Durable: c.durable, Duplicates: sc.Duplicates, MaxAge: sc.MaxAge, Retention: ret}
	var ws []WindowWarning
	if sc.Duplicates < ret {
		w.Kind = DuplicateWindowShort
		ws = append(ws, w)
	}
	if sc.MaxAge == 0 || sc.MaxAge > ret {
		w.Kind = StreamOutlivesRetention
		ws = append(ws, w)
	}
	for _, w := range ws {
		c.cfg.logger.Warn("dedupnats: "+w.Kind.String(),
			slog.String("stream", w.Stream), slog.String("durable", w.Durable), slog.String("consumer", c.p.Name()),
			slog.Duration("duplicate_window", w.Duplicates), slog.Duration("max_age", w.MaxAge),
			slog.Duration("retention", w.Retention))
		if c.cfg.onWarning != nil {
			c.cfg.onWarning(ctx, w)
		}
	}
}
