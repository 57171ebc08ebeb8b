package dedupamqp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup/consumer"
	amqp "github.com/rabbitmq/amqp091-go"
)

// ErrClosed is returned by Run on a closed consumer, and by a closed
// publisher.
var ErrClosed = errors.New("dedupamqp: closed")

// ErrRunning is returned by Run when the consumer is already running.
var ErrRunning = errors.New("dedupamqp: consumer already running")

// Consumer feeds a RabbitMQ queue through a [consumer.Processor] and
// settles each delivery after the processor's decision, on the channel it
// arrived on. It connects by itself and reconnects after a drop (see the
// package documentation). It is safe for concurrent use; Run runs once at
// a time.
type Consumer struct {
	url   string
	queue string
	p     *consumer.Processor
	cfg   consumerConfig
	// process handles one delivery; the benchmarks' bare consumer
	// replaces it.
	process func(ctx context.Context, s *session, d *amqp.Delivery)

	mu      sync.Mutex
	running bool
	closed  bool
	cancel  context.CancelFunc
	done    chan struct{}
	session *session // the live session, for tests

	gen     atomic.Uint64
	stats   consumerStats
	retired sync.WaitGroup // handlers of dead sessions still finishing
}

// Stats counts what a consumer did since it was made.
type Stats struct {
	// Delivered counts deliveries received from the broker.
	Delivered uint64
	// Acked counts acknowledgements (applied, duplicate, rejected,
	// dead-lettered).
	Acked uint64
	// Retried counts Retry decisions sent through a retry queue.
	Retried uint64
	// Requeued counts negative acknowledgements with requeue: a Retry
	// whose copy could not be published to its retry queue.
	Requeued uint64
	// DeadLettered counts messages the processor dead-lettered (and the
	// adapter then acknowledged).
	DeadLettered uint64
	// EnvelopeErrors counts messages dead-lettered because their envelope
	// could not be read (no message_id, a malformed header).
	EnvelopeErrors uint64
	// Stale counts decisions not sent because the channel their delivery
	// came on had closed: the broker has already returned those messages
	// to the queue, and their redelivery is absorbed by dedup.
	Stale uint64
	// AckErrors counts settlements the channel refused to send.
	AckErrors uint64
	// Sessions counts connections made (1 + reconnections).
	Sessions uint64
	// PreconditionFailed counts channels the broker closed with
	// PRECONDITION_FAILED (406), the error of an unknown delivery tag. It
	// stays 0 unless a delivery tag is misused.
	PreconditionFailed uint64
	// Batches counts ProcessBatch calls of more than one delivery
	// ([WithBatch]); Batched the deliveries they carried.
	Batches, Batched uint64
}

type consumerStats struct {
	delivered, acked, retried, requeued, deadLettered, envelope, stale, ackErrors, sessions, precondition atomic.Uint64
	batches, batched                                                                                      atomic.Uint64
}

// NewConsumer returns a consumer of queue on the RabbitMQ server at url
// (amqp://user:pass@host:port/vhost), processing with p. It does no I/O.
// A bad argument or option gives a [*dedup.ArgumentError].
func NewConsumer(url, queue string, p *consumer.Processor, opts ...ConsumerOption) (*Consumer, error) {
	switch {
	case p == nil:
		return nil, bad("processor", "is nil")
	case !validName(queue, false):
		return nil, bad("queue", strconv.Quote(queue)+" is not a queue name")
	}
	if _, err := amqp.ParseURI(url); err != nil {
		return nil, bad("url", err.Error())
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
	c := &Consumer{url: url, queue: queue, p: p, cfg: cfg}
	c.process = c.handle
	return c, nil
}

// Queue returns the name of the work queue.
func (c *Consumer) Queue() string { return c.queue }

// RetryQueue returns the name of the retry queue for delay d (after
// rounding up to a configured delay, see [WithRetryDelays]).
func (c *Consumer) RetryQueue(d time.Duration) string {
	return c.queue + ".retry." + c.tier(d).String()
}

// Stats returns the counts so far.
func (c *Consumer) Stats() Stats {
	s := &c.stats
	return Stats{
		Delivered: s.delivered.Load(), Acked: s.acked.Load(), Retried: s.retried.Load(), Requeued: s.requeued.Load(),
		DeadLettered: s.deadLettered.Load(), EnvelopeErrors: s.envelope.Load(), Stale: s.stale.Load(),
		AckErrors: s.ackErrors.Load(), Sessions: s.sessions.Load(), PreconditionFailed: s.precondition.Load(),
		Batches: s.batches.Load(), Batched: s.batched.Load(),
	}
}

// Run declares the work queue and the retry queues, reports the start-up
// [Warning]s, and consumes until ctx is cancelled or Close is called; then
// it stops consuming, lets the messages being processed finish (see
// [WithDrainTimeout]) and settles them, closes the channel (the broker
// returns what was received but not started to the queue) and returns:
// nil after Close, ctx's error after a cancellation. A lost connection is
// redialled with backoff. Run returns early with an error when the
// topology cannot be declared (an argument the broker refuses).
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
	c.warn(runCtx)
	err := c.loop(runCtx)
	c.retired.Wait()
	if err == nil || runCtx.Err() != nil {
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

// A session is one connection with its consuming channel and the
// confirm-mode channel that publishes retry copies. A delivery is settled
// only on the session it came from, and only while that session is alive:
// amqp091-go's recovery is never enabled, so a closed channel is never
// reused and an old delivery tag can never reach a new channel.
type session struct {
	gen    uint64
	conn   *amqp.Connection
	ch     *amqp.Channel
	pub    *amqp.Channel
	pubMu  sync.Mutex
	dead   atomic.Bool
	closed chan struct{} // closed when the session died
}

func (c *Consumer) loop(ctx context.Context) error {
	failures := 0
	for {
		s, msgs, err := c.connect(ctx)
		if err != nil {
			var te *TopologyError
			if errors.As(err, &te) {
				// A declaration the broker refused: retrying will not fix it.
				return err
			}
			if ctx.Err() != nil {
				return nil
			}
			failures++
			delay := consumer.Backoff(c.cfg.reconnectMin, c.cfg.reconnectMax, failures)
			c.cfg.logger.Warn("dedupamqp: connect failed, retrying", slog.String("queue", c.queue),
				slog.Any("error", err), slog.Duration("delay", delay))
			if !sleep(ctx, delay) {
				return nil
			}
			continue
		}
		failures = 0
		c.serve(ctx, s, msgs)
		if ctx.Err() != nil {
			return nil
		}
		c.cfg.logger.Warn("dedupamqp: connection lost; reconnecting (unsettled deliveries return to the queue and are absorbed by dedup)",
			slog.String("queue", c.queue), slog.Uint64("session", s.gen))
		if !sleep(ctx, c.cfg.reconnectMin+time.Duration(rand.Int64N(int64(c.cfg.reconnectMin)))) {
			return nil
		}
	}
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// connect dials, declares the topology and starts consuming.
func (c *Consumer) connect(ctx context.Context) (*session, <-chan amqp.Delivery, error) {
	conn, err := dial(ctx, c.url, c.cfg.dial)
	if err != nil {
		return nil, nil, err
	}
	s := &session{gen: c.gen.Add(1), conn: conn, closed: make(chan struct{})}
	fail := func(err error) (*session, <-chan amqp.Delivery, error) {
		conn.Close()
		return nil, nil, err
	}
	if s.ch, err = conn.Channel(); err != nil {
		return fail(err)
	}
	if err := c.declare(s.ch); err != nil {
		var ae *amqp.Error
		if errors.As(err, &ae) && !conn.IsClosed() {
			// The broker refused the declaration (a channel error), not a
			// lost connection.
			err = &TopologyError{Err: err}
		}
		return fail(err)
	}
	if s.pub, err = conn.Channel(); err != nil {
		return fail(err)
	}
	if err := s.pub.Confirm(false); err != nil {
		return fail(err)
	}
	if err := s.ch.Qos(c.cfg.prefetch, 0, false); err != nil {
		return fail(err)
	}
	msgs, err := s.ch.Consume(c.queue, "dedupamqp-"+strconv.FormatUint(s.gen, 10), false, false, false, false, nil)
	if err != nil {
		return fail(fmt.Errorf("dedupamqp: consume %s: %w", c.queue, err))
	}
	// Watch the connection and both channels: any of them closing ends
	// the session.
	connClosed := conn.NotifyClose(make(chan *amqp.Error, 1))
	chClosed := s.ch.NotifyClose(make(chan *amqp.Error, 1))
	pubClosed := s.pub.NotifyClose(make(chan *amqp.Error, 1))
	go func() {
		var e *amqp.Error
		select {
		case e = <-connClosed:
		case e = <-chClosed:
		case e = <-pubClosed:
		}
		if e != nil && e.Code == amqp.PreconditionFailed {
			c.stats.precondition.Add(1)
			c.cfg.logger.Error("dedupamqp: channel closed with PRECONDITION_FAILED", slog.String("queue", c.queue), slog.Any("error", e))
		}
		s.dead.Store(true)
		close(s.closed)
	}()
	c.stats.sessions.Add(1)
	c.mu.Lock()
	c.session = s
	c.mu.Unlock()
	return s, msgs, nil
}

// dial connects to url, giving up when ctx ends.
func dial(ctx context.Context, url string, cfg amqp.Config) (*amqp.Connection, error) {
	if cfg.Dial == nil {
		d := amqp.DefaultDial(30 * time.Second)
		cfg.Dial = d
	}
	type res struct {
		c   *amqp.Connection
		err error
	}
	out := make(chan res, 1)
	go func() {
		conn, err := amqp.DialConfig(url, cfg)
		out <- res{conn, err}
	}()
	select {
	case r := <-out:
		return r.c, r.err
	case <-ctx.Done():
		go func() {
			if r := <-out; r.c != nil {
				r.c.Close()
			}
		}()
		return nil, ctx.Err()
	}
}

// queueArgs returns the work queue's declaration arguments.
func (c *Consumer) queueArgs() amqp.Table {
	args := amqp.Table{}
	for k, v := range c.cfg.queueArgs {
		args[k] = v
	}
	args[amqp.QueueTypeArg] = c.cfg.queueType
	if c.cfg.dlx != "" {
		args["x-dead-letter-exchange"] = c.cfg.dlx
	}
	if c.cfg.deliveryLimit > 0 {
		args["x-delivery-limit"] = int64(c.cfg.deliveryLimit)
	}
	return args
}

// declare declares the work queue (unless WithoutDeclare) and one retry
// queue per delay.
func (c *Consumer) declare(ch *amqp.Channel) error {
	if c.cfg.declare {
		if _, err := ch.QueueDeclare(c.queue, true, false, false, false, c.queueArgs()); err != nil {
			return fmt.Errorf("dedupamqp: declare queue %s (a queue of that name with other arguments is refused; use WithoutDeclare for a queue declared elsewhere): %w", c.queue, err)
		}
	}
	for _, d := range c.cfg.retryDelays {
		name := c.queue + ".retry." + d.String()
		args := amqp.Table{
			amqp.QueueTypeArg:           Classic,
			amqp.QueueMessageTTLArg:     d.Milliseconds(),
			"x-dead-letter-exchange":    "",
			"x-dead-letter-routing-key": c.queue,
		}
		if _, err := ch.QueueDeclare(name, true, false, false, false, args); err != nil {
			return fmt.Errorf("dedupamqp: declare retry queue %s: %w", name, err)
		}
	}
	return nil
}

// tier rounds d up to a configured retry delay.
func (c *Consumer) tier(d time.Duration) time.Duration {
	for _, t := range c.cfg.retryDelays {
		if d <= t {
			return t
		}
	}
	return c.cfg.retryDelays[len(c.cfg.retryDelays)-1]
}

// serve runs the workers over msgs until ctx ends or the session dies,
// then closes the session.
func (c *Consumer) serve(ctx context.Context, s *session, msgs <-chan amqp.Delivery) {
	// Handlers run on a context that outlives ctx by the drain timeout,
	// so a stop lets the messages being processed finish and be settled.
	procCtx, procCancel := context.WithCancel(context.WithoutCancel(ctx))
	var workers sync.WaitGroup
	for range c.cfg.concurrency {
		workers.Go(func() {
			for d := range msgs {
				c.stats.delivered.Add(1)
				if ctx.Err() != nil || s.dead.Load() {
					// Not started: the broker returns it to the queue when
					// the channel closes.
					continue
				}
				if c.cfg.batch <= 1 {
					c.process(procCtx, s, &d)
					continue
				}
				batch := []amqp.Delivery{d}
			gather:
				for len(batch) < c.cfg.batch {
					select {
					case more, ok := <-msgs:
						if !ok {
							break gather
						}
						c.stats.delivered.Add(1)
						batch = append(batch, more)
					default:
						break gather // take only what is already waiting
					}
				}
				c.handleBatch(procCtx, s, batch)
			}
		})
	}
	finished := make(chan struct{})
	go func() { workers.Wait(); close(finished) }()
	// end lets the handlers still running finish (up to the drain
	// timeout), then closes the session.
	end := func() {
		t := time.NewTimer(c.cfg.drain)
		select {
		case <-finished:
		case <-t.C:
			procCancel()
			<-finished
		}
		t.Stop()
		procCancel()
		s.dead.Store(true)
		// Closing the channel returns every unacknowledged delivery to
		// the queue; Close waits for the broker's close-ok, so the
		// acknowledgements sent before it have been processed.
		_ = s.ch.Close()
		_ = s.pub.Close()
		_ = s.conn.Close()
	}
	select {
	case <-ctx.Done():
		// Stop the flow; the library closes msgs when the cancel is done.
		_ = s.ch.Cancel("dedupamqp-"+strconv.FormatUint(s.gen, 10), false)
		end()
	case <-s.closed:
		// The session is dead: its handlers' decisions will be dropped
		// (their messages are back in the queue), so a new session need
		// not wait for them. They finish in the background; Run waits
		// for them before it returns.
		c.retired.Go(end)
	}
}

// handle processes one delivery and settles it.
func (c *Consumer) handle(ctx context.Context, s *session, d *amqp.Delivery) {
	m, err := newMessage(d, c.queue)
	var dec consumer.Decision
	if err != nil {
		c.stats.envelope.Add(1)
		dec = c.p.Quarantine(ctx, m, consumer.ClassPermanent, err)
	} else {
		dec = c.p.Process(ctx, m)
	}
	c.settle(ctx, s, d, m, dec)
}

// settle sends dec for d on d's own session, unless that session is gone.
// handleBatch runs ds through ProcessBatch (a delivery whose envelope
// cannot be read is quarantined in its turn) and settles each after its
// decision, in delivery order.
func (c *Consumer) handleBatch(ctx context.Context, s *session, ds []amqp.Delivery) {
	ms := make([]*consumer.Message, len(ds))
	decs := make([]consumer.Decision, len(ds))
	run := make([]*consumer.Message, 0, len(ds))
	at := make([]int, 0, len(ds))
	for i := range ds {
		m, err := newMessage(&ds[i], c.queue)
		ms[i] = m
		if err != nil {
			c.stats.envelope.Add(1)
			decs[i] = c.p.Quarantine(ctx, m, consumer.ClassPermanent, err)
			continue
		}
		run = append(run, m)
		at = append(at, i)
	}
	if len(run) == 1 {
		decs[at[0]] = c.p.Process(ctx, run[0])
	} else if len(run) > 1 {
		c.stats.batches.Add(1)
		c.stats.batched.Add(uint64(len(run)))
		for j, dec := range c.p.ProcessBatch(ctx, run) {
			decs[at[j]] = dec
		}
	}
	for i := range ds {
		c.settle(ctx, s, &ds[i], ms[i], decs[i])
	}
}

func (c *Consumer) settle(ctx context.Context, s *session, d *amqp.Delivery, m *consumer.Message, dec consumer.Decision) {
	if s.dead.Load() || s.ch.IsClosed() {
		// The channel d came on is closed: the broker has returned d to
		// the queue already. Its tag means nothing anywhere else.
		c.stats.stale.Add(1)
		return
	}
	var err error
	switch dec.Action {
	case consumer.Ack, consumer.Rejected, consumer.DeadLettered:
		if dec.Action == consumer.DeadLettered {
			c.stats.deadLettered.Add(1)
		}
		err = d.Ack(false)
		c.count(&c.stats.acked, err, m, "ack")
	case consumer.Retry:
		c.retry(ctx, s, d, m, dec.Delay)
	default:
		// Never acknowledge what the processor did not decide to.
		err = d.Nack(false, true)
		c.count(&c.stats.requeued, err, m, "nack")
	}
}

func (c *Consumer) count(n *atomic.Uint64, err error, m *consumer.Message, what string) {
	if err == nil {
		n.Add(1)
		return
	}
	c.stats.ackErrors.Add(1)
	id := ""
	if m != nil {
		id = m.ID
	}
	c.cfg.logger.Warn("dedupamqp: "+what+" failed; the broker will redeliver the message and dedup absorbs it",
		slog.String("queue", c.queue), slog.String("message_id", id), slog.Any("error", err))
}

// retryConfirmTimeout bounds the wait for the broker's confirm of a retry
// copy.
const retryConfirmTimeout = 10 * time.Second

// retry publishes a copy of d to the retry queue of delay and, once the
// broker confirmed it, acknowledges d. If the copy is not confirmed, d is
// requeued instead: never both lost.
func (c *Consumer) retry(ctx context.Context, s *session, d *amqp.Delivery, m *consumer.Message, delay time.Duration) {
	p := amqp.Publishing{
		Headers:         amqp.Table{},
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    amqp.Persistent,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		MessageId:       d.MessageId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		UserId:          d.UserId,
		AppId:           d.AppId,
		Body:            d.Body,
	}
	for k, v := range d.Headers {
		switch k {
		case HeaderDeliveryCount, "x-death", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
			"x-last-death-exchange", "x-last-death-queue", "x-last-death-reason":
		default:
			p.Headers[k] = v
		}
	}
	retries, _ := headerInt(d.Headers[HeaderRetries])
	p.Headers[HeaderRetries] = int64(retries + 1)
	queue := c.RetryQueue(delay)
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), retryConfirmTimeout)
	defer cancel()
	s.pubMu.Lock()
	dc, err := s.pub.PublishWithDeferredConfirmWithContext(pctx, "", queue, false, false, p)
	s.pubMu.Unlock()
	ok := false
	if err == nil {
		ok, err = dc.WaitContext(pctx)
		if err == nil && !ok {
			err = errors.New("the broker nacked the retry copy")
		}
	}
	if err != nil || !ok {
		c.cfg.logger.Warn("dedupamqp: could not send the retry copy; requeueing the message instead",
			slog.String("queue", c.queue), slog.String("message_id", m.ID), slog.Any("error", err))
		if s.dead.Load() {
			c.stats.stale.Add(1)
			return
		}
		err = d.Nack(false, true)
		c.count(&c.stats.requeued, err, m, "nack")
		return
	}
	if s.dead.Load() {
		// The copy is queued and the original comes back too: two
		// deliveries, one effect.
		c.stats.stale.Add(1)
		return
	}
	err = d.Ack(false)
	c.count(&c.stats.retried, err, m, "ack after retry copy")
}

// A TopologyError is a declaration the broker refused (a queue that exists
// with other arguments, a bad argument): Run returns it instead of
// retrying.
type TopologyError struct{ Err error }

func (e *TopologyError) Error() string { return e.Err.Error() }

// Unwrap returns the broker's error.
func (e *TopologyError) Unwrap() error { return e.Err }

// conn returns the live session's connection, for tests that drop it.
func (c *Consumer) conn() *amqp.Connection {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.session == nil {
		return nil
	}
	return c.session.conn
}
