package verify

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"strconv"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// AMQPOptions configure [RunAMQP].
type AMQPOptions struct {
	// URL of the RabbitMQ server (amqp://user:pass@host:port/vhost).
	URL string
	// Keep leaves the run's queue on the server for inspection.
	Keep bool
	// DropEvery drops the consumers' TCP connection after about every
	// DropEvery deliveries (0: never): every channel dies with its
	// unacknowledged deliveries, which the broker redelivers on the new
	// connection.
	DropEvery int
}

// hdrCopy numbers the copies of one message, so that each copy's
// acknowledgement is counted once however often it is redelivered.
const hdrCopy = "Dedup-Verify-Copy"

// RunAMQP is [Run] over a real RabbitMQ server. It declares a durable
// queue for the run, publishes every message in confirm mode with
// message_id set to its ID (the extra copies of --dup-rate are published
// again under the same message_id, as a producer retry would: RabbitMQ
// delivers both, and only the consumer's dedup stands between them and a
// double effect), then consumes with Config.Consumers workers, each on a
// channel of its own with prefetch 1, all on one connection:
//
//   - an acknowledged outcome is acked;
//   - a crash, before or after the commit, closes the worker's channel
//     without an ack: the broker returns the message to the queue at
//     once, and the worker opens a new channel;
//   - any other outcome is a negative acknowledgement with requeue,
//     after the delay the simulated broker would wait;
//   - every DropEvery deliveries the TCP connection is cut: every
//     channel dies, unacknowledged deliveries come back on the next
//     connection, and an ack sent just before the cut may or may not
//     have reached the broker (its copy may come back: a duplicate).
//
// A copy counts as acknowledged the first time its ack is written without
// error, even if the channel dies right after (the broker may have
// processed that ack, and then never redelivers the copy); the run ends
// when every copy has been. The queue is deleted
// unless opts.Keep.
func RunAMQP(ctx context.Context, cfg Config, t Target, opts AMQPOptions) (Report, error) {
	if opts.DropEvery < 0 {
		return Report{}, fmt.Errorf("--drop-every must not be negative, got %d", opts.DropEvery)
	}
	b, err := start(cfg, t, "rabbitmq")
	if err != nil {
		return Report{}, err
	}
	cfg = b.cfg
	queue := "dedup-verify-" + b.runID
	b.report.Stream = queue

	setup, err := amqp.Dial(opts.URL)
	if err != nil {
		return Report{}, fmt.Errorf("verify: connect to RabbitMQ at %s (start rabbitmq-server, or set --amqp-url / $DEDUP_AMQP_URL): %w", opts.URL, err)
	}
	defer setup.Close()
	sch, err := setup.Channel()
	if err != nil {
		return Report{}, fmt.Errorf("verify: RabbitMQ channel: %w", err)
	}
	if _, err := sch.QueueDeclare(queue, true, false, false, false, amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeClassic}); err != nil {
		return Report{}, fmt.Errorf("verify: declare queue %s: %w", queue, err)
	}
	if !opts.Keep {
		defer func() {
			if c, err := amqp.Dial(opts.URL); err == nil {
				if ch, err := c.Channel(); err == nil {
					_, _ = ch.QueueDelete(queue, false, false, false)
				}
				c.Close()
			}
		}()
	}
	if err := b.publishAMQP(ctx, sch, queue); err != nil {
		return b.report, err
	}
	b.report.Deliveries = 0

	cm := &amqpConns{url: opts.URL}
	defer cm.close()
	results := make(chan natsSettled, cfg.Consumers)
	stop := make(chan struct{})
	var seen sync.Map // "seq/copy" -> struct{} once its ack was sent
	var wg sync.WaitGroup
	for i := range cfg.Consumers {
		rng := rand.New(rand.NewPCG(cfg.Seed+uint64(i)+1, uint64(i)))
		wg.Go(func() { b.consumeAMQP(ctx, t, cm, queue, rng, &seen, results, stop) })
	}

	tick := time.NewTicker(cfg.ProgressEvery)
	defer tick.Stop()
	stopped := false
	sinceDrop := 0
loop:
	for b.done < cfg.Messages {
		select {
		case r := <-results:
			b.report.Deliveries++
			if r.redelivered {
				b.report.Redeliveries++
			}
			b.account(r.s, r.acked)
			sinceDrop++
			if opts.DropEvery > 0 && sinceDrop >= opts.DropEvery && b.done < cfg.Messages {
				sinceDrop = 0
				if cm.drop() {
					b.report.ConnectionDrops++
				}
			}
		case <-tick.C:
			b.progress()
		case <-ctx.Done():
			stopped = true
			break loop
		}
	}
	b.progress()
	close(stop)
	cm.close()
	go func() {
		for range results {
		}
	}()
	wg.Wait()
	close(results)
	return b.conclude(ctx, t, stopped)
}

// publishAMQP publishes every message and its extra copies in confirm
// mode, counting them as pending.
func (b *broker) publishAMQP(ctx context.Context, ch *amqp.Channel, queue string) error {
	if err := ch.Confirm(false); err != nil {
		return fmt.Errorf("verify: confirm mode: %w", err)
	}
	const window = 512
	var pending []*amqp.DeferredConfirmation
	flush := func() error {
		for _, dc := range pending {
			ok, err := dc.WaitContext(ctx)
			if err != nil {
				return err
			}
			if !ok {
				return errors.New("verify: RabbitMQ nacked a publish")
			}
		}
		pending = pending[:0]
		return nil
	}
	pub := func(seq, copy int) error {
		id := b.msgID(seq)
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false, amqp.Publishing{
			MessageId: id, DeliveryMode: amqp.Persistent, Body: payloadOf(id, seq),
			Headers: amqp.Table{hdrMsgID: id, hdrCopy: int32(copy)},
		})
		if err != nil {
			return fmt.Errorf("verify: publish %s: %w", id, err)
		}
		pending = append(pending, dc)
		if len(pending) >= window {
			return flush()
		}
		return nil
	}
	for seq := range b.cfg.Messages {
		b.next = seq + 1
		b.pending[seq] = 1
		if err := pub(seq, 0); err != nil {
			return err
		}
		if b.rng.Float64() < b.cfg.DupRate {
			b.pending[seq]++
			b.report.BrokerDuplicates++
			if err := pub(seq, 1); err != nil {
				return err
			}
		}
		if seq%1000 == 0 {
			b.progress()
		}
	}
	return flush()
}

// amqpConns shares one consumer connection between the workers and
// replaces it after a drop, once per generation.
type amqpConns struct {
	url    string
	mu     sync.Mutex
	conn   *amqp.Connection
	tcp    net.Conn
	gen    uint64
	closed bool
}

// get returns the live connection and its generation, dialling when the
// one of generation seen (or none) is gone.
func (m *amqpConns) get(ctx context.Context) (*amqp.Connection, uint64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for {
		if m.closed {
			return nil, 0, errors.New("closed")
		}
		if m.conn != nil && !m.conn.IsClosed() {
			return m.conn, m.gen, nil
		}
		var tcp net.Conn
		conn, err := amqp.DialConfig(m.url, amqp.Config{Dial: func(network, addr string) (net.Conn, error) {
			c, err := net.DialTimeout(network, addr, 10*time.Second)
			tcp = c
			return c, err
		}})
		if err == nil {
			m.conn, m.tcp = conn, tcp
			m.gen++
			continue
		}
		if ctx.Err() != nil {
			return nil, 0, ctx.Err()
		}
		m.mu.Unlock()
		time.Sleep(100 * time.Millisecond)
		m.mu.Lock()
	}
}

// drop cuts the live connection's TCP stream, as a network failure
// would.
func (m *amqpConns) drop() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.tcp == nil || m.conn == nil || m.conn.IsClosed() {
		return false
	}
	m.tcp.Close()
	return true
}

func (m *amqpConns) close() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.closed = true
	if m.conn != nil {
		m.conn.Close()
	}
}

// consumeAMQP is one worker: a channel with prefetch 1, reopened after a
// crash or a drop, until stop.
func (b *broker) consumeAMQP(ctx context.Context, t Target, cm *amqpConns, queue string, rng *rand.Rand, seen *sync.Map, results chan<- natsSettled, stop <-chan struct{}) {
	for {
		select {
		case <-stop:
			return
		case <-ctx.Done():
			return
		default:
		}
		conn, _, err := cm.get(ctx)
		if err != nil {
			return
		}
		ch, err := conn.Channel()
		if err != nil {
			continue
		}
		if err := ch.Qos(1, 0, false); err != nil {
			continue
		}
		msgs, err := ch.Consume(queue, "", false, false, false, false, nil)
		if err != nil {
			continue
		}
		b.consumeChannel(ctx, t, ch, msgs, rng, seen, results, stop)
		_ = ch.Close()
	}
}

// amqpAfterAck, when set (by tests), runs after each ack written without
// error, before the copy is counted: a test closes the channel there to
// land a drop between an ack the broker has processed and its counting.
var amqpAfterAck func(ch *amqp.Channel)

// consumeChannel handles deliveries of one channel until it dies, a
// crash closes it, or stop.
func (b *broker) consumeChannel(ctx context.Context, t Target, ch *amqp.Channel, msgs <-chan amqp.Delivery, rng *rand.Rand, seen *sync.Map, results chan<- natsSettled, stop <-chan struct{}) {
	for {
		var m amqp.Delivery
		var ok bool
		select {
		case m, ok = <-msgs:
			if !ok {
				return
			}
		case <-stop:
			return
		case <-ctx.Done():
			return
		}
		seq, okID := b.parseMsgID(m.MessageId)
		cp, _ := m.Headers[hdrCopy].(int32)
		if !okID {
			_ = m.Reject(false)
			select {
			case results <- natsSettled{s: settled{res: Result{Outcome: StoreFailed, Err: fmt.Errorf("stray message %q on the run's queue", m.MessageId)}}}:
			case <-stop:
				return
			}
			continue
		}
		d := b.delivery(seq)
		if m.Redelivered {
			d.Redelivered = 1
		}
		d.Fault = faultOf(b.cfg, rng.Float64())
		start := time.Now()
		res := t.Apply(ctx, d)
		out := natsSettled{s: settled{d: d, res: res, took: time.Since(start)}, redelivered: m.Redelivered}
		lease := b.cfg.Lease
		crashed := false
		switch {
		case res.Outcome.acked():
			// The copy is done once its ack is written, whatever happens
			// to the channel next. An ack written just before a drop may
			// or may not have reached the broker, and the channel may
			// already look closed when the write returns: if the ack
			// landed, the broker never redelivers the copy, so waiting
			// for a redelivery would wait forever; if it did not, the
			// copy comes back as a duplicate, and seen keeps its ack
			// from counting twice. A failed write sent nothing: the
			// channel died with the copy unacknowledged and the broker
			// redelivers it.
			err := m.Ack(false)
			if err == nil && amqpAfterAck != nil {
				amqpAfterAck(ch)
			}
			if err == nil {
				_, dup := seen.LoadOrStore(strconv.Itoa(seq)+"/"+strconv.Itoa(int(cp)), struct{}{})
				out.acked = !dup
			}
		case res.Outcome == CrashedBeforeCommit || res.Outcome == CrashedAfterCommit:
			// A dead consumer acks nothing; its channel closes and the
			// broker returns the message.
			crashed = true
		case res.Outcome == InProgress:
			time.Sleep(max(res.RetryAfter, lease/20) + time.Duration(rng.Int64N(int64(lease/20)+1)))
			_ = m.Nack(false, true)
		default:
			time.Sleep(lease/20 + time.Duration(rng.Int64N(int64(lease/20)+1)))
			_ = m.Nack(false, true)
		}
		select {
		case results <- out:
		case <-stop:
			return
		}
		if crashed {
			return
		}
	}
}
