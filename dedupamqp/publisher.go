package dedupamqp

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/outbox"
	amqp "github.com/rabbitmq/amqp091-go"
)

// ErrConfirmLost is the cause of a publish whose confirm never came: the
// channel or connection closed first. The message may or may not be
// stored; the publisher sends it again under the same message_id.
var ErrConfirmLost = errors.New("dedupamqp: publisher confirm lost with the channel")

// ErrNacked is the cause of a publish the broker negatively confirmed (an
// internal error of the broker): retried under the same message_id.
var ErrNacked = errors.New("dedupamqp: publish nacked by the broker")

// A ReturnError is a mandatory publish the broker returned: no queue is
// bound for it. Unroutable is not success, and retrying will not route
// it.
type ReturnError struct {
	Exchange   string
	RoutingKey string
	MessageID  string
	Code       uint16
	Text       string
}

func (e *ReturnError) Error() string {
	return fmt.Sprintf("dedupamqp: message %q returned by the broker from exchange %q, routing key %q: %d %s",
		e.MessageID, e.Exchange, e.RoutingKey, e.Code, e.Text)
}

// Permanent reports true: the outbox relay quarantines an unroutable
// message instead of publishing it again.
func (e *ReturnError) Permanent() bool { return true }

// A PublishError is a publish that failed after its attempts. Err is the
// last cause ([ErrConfirmLost], [ErrNacked], a connection error, a
// [*ReturnError]).
type PublishError struct {
	MessageID string
	Attempts  int
	Err       error
}

func (e *PublishError) Error() string {
	return "dedupamqp: publish " + strconv.Quote(e.MessageID) + " failed after " + strconv.Itoa(e.Attempts) + " attempt(s): " + e.Err.Error()
}

// Unwrap returns the cause.
func (e *PublishError) Unwrap() error { return e.Err }

type publisherConfig struct {
	exchange string
	attempts int
	wait     time.Duration
	dial     amqp.Config
}

func defaultPublisherConfig() publisherConfig {
	return publisherConfig{attempts: 3, wait: 250 * time.Millisecond}
}

// A PublisherOption configures a [Publisher].
type PublisherOption interface{ applyPublisher(*publisherConfig) }

type publisherOption func(*publisherConfig)

func (f publisherOption) applyPublisher(c *publisherConfig) { f(c) }

// WithExchange sets the exchange Publish and the outbox publisher send
// to. Default "" (the default exchange: the routing key is a queue name).
func WithExchange(name string) PublisherOption {
	return publisherOption(func(c *publisherConfig) { c.exchange = name })
}

// WithPublishRetries sets how many times a publish whose outcome is
// unknown (a confirm lost with the connection, a nack, a dial failure) is
// attempted, waiting wait between attempts. Every attempt carries the
// same message_id, so the consumer's dedup absorbs a copy that did land.
// A returned (unroutable) message is not retried. Default 3 attempts,
// 250ms apart.
func WithPublishRetries(attempts int, wait time.Duration) PublisherOption {
	return publisherOption(func(c *publisherConfig) { c.attempts, c.wait = attempts, wait })
}

// WithPublisherDialConfig sets the amqp091-go configuration used to
// connect. Its Recovery must stay nil. Default: amqp091-go's defaults.
func WithPublisherDialConfig(cfg amqp.Config) PublisherOption {
	return publisherOption(func(c *publisherConfig) { c.dial = cfg })
}

// Publisher publishes in confirm mode, every message mandatory and
// persistent, with MessageId set to the message's stable ID on every
// attempt. It owns its connection and redials after a drop. It is safe
// for concurrent use.
type Publisher struct {
	url string
	cfg publisherConfig

	mu     sync.Mutex
	sess   *pubSession
	closed bool
}

// pubSession is one connection with its confirm-mode channel.
type pubSession struct {
	conn *amqp.Connection
	ch   *amqp.Channel
	// mu orders publishes on the channel and guards returned.
	mu sync.Mutex
	// returns receives the broker's basic.return frames. amqp091-go hands
	// a return to this channel before it processes the confirm that
	// follows it, so once a message's confirm is seen, its return (if
	// any) is in this buffer or already in returned.
	returns  chan amqp.Return
	returned map[string]int
}

// NewPublisher returns a publisher to the server at url. It does no I/O.
func NewPublisher(url string, opts ...PublisherOption) (*Publisher, error) {
	if _, err := amqp.ParseURI(url); err != nil {
		return nil, bad("url", err.Error())
	}
	cfg := defaultPublisherConfig()
	for _, o := range opts {
		if o != nil {
			o.applyPublisher(&cfg)
		}
	}
	switch {
	case cfg.attempts < 1:
		return nil, bad("publish attempts", "must be at least 1, got "+strconv.Itoa(cfg.attempts))
	case cfg.wait < 0:
		return nil, bad("publish retry wait", "must not be negative")
	case !validName(cfg.exchange, true):
		return nil, bad("exchange", strconv.Quote(cfg.exchange)+" is not an exchange name")
	case cfg.dial.Recovery != nil:
		return nil, bad("dial config", "must not enable the library's connection recovery")
	}
	return &Publisher{url: url, cfg: cfg}, nil
}

// Close closes the connection. Later publishes return [ErrClosed].
func (p *Publisher) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	if p.sess != nil {
		p.sess.conn.Close()
		p.sess = nil
	}
	return nil
}

// session returns the live session, dialling one if needed.
func (p *Publisher) session(ctx context.Context) (*pubSession, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, ErrClosed
	}
	if s := p.sess; s != nil && !s.ch.IsClosed() {
		return s, nil
	}
	if p.sess != nil {
		p.sess.conn.Close()
		p.sess = nil
	}
	conn, err := dial(ctx, p.url, p.cfg.dial)
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Confirm(false)
	}
	if err != nil {
		conn.Close()
		return nil, err
	}
	s := &pubSession{conn: conn, ch: ch, returns: make(chan amqp.Return, 4096), returned: map[string]int{}}
	ch.NotifyReturn(s.returns)
	p.sess = s
	return s, nil
}

// drain moves the returns received so far into s.returned. s.mu is held.
func (s *pubSession) drain() {
	for {
		select {
		case r := <-s.returns:
			s.returned[r.MessageId]++
		default:
			return
		}
	}
}

// wasReturned reports, and forgets, one return of id.
func (s *pubSession) wasReturned(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.drain()
	if n := s.returned[id]; n > 0 {
		if n == 1 {
			delete(s.returned, id)
		} else {
			s.returned[id] = n - 1
		}
		return true
	}
	return false
}

// pending is one publish awaiting its confirm.
type pending struct {
	s  *pubSession
	dc *amqp.DeferredConfirmation
}

// send publishes msg on the live session without waiting for its
// confirm.
func (p *Publisher) send(ctx context.Context, exchange, key string, msg amqp.Publishing) (pending, error) {
	s, err := p.session(ctx)
	if err != nil {
		return pending{}, err
	}
	s.mu.Lock()
	s.drain()
	dc, err := s.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, msg)
	s.mu.Unlock()
	if err != nil {
		return pending{}, err
	}
	return pending{s, dc}, nil
}

// await waits for pd's confirm and says what it means.
func (p *Publisher) await(ctx context.Context, pd pending, exchange, key, id string) error {
	ok, err := pd.dc.WaitContext(ctx)
	if err != nil {
		return err
	}
	if !ok {
		if pd.s.ch.IsClosed() {
			return ErrConfirmLost
		}
		return ErrNacked
	}
	if pd.s.wasReturned(id) {
		return &ReturnError{Exchange: exchange, RoutingKey: key, MessageID: id, Code: amqp.NoRoute, Text: "NO_ROUTE"}
	}
	return nil
}

// publish sends msg and waits for its confirm, attempting again under
// the same message_id while the outcome is unknown.
func (p *Publisher) publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	var last error
	for attempt := 1; attempt <= p.cfg.attempts; attempt++ {
		if attempt > 1 && !sleep(ctx, p.cfg.wait) {
			return &PublishError{MessageID: msg.MessageId, Attempts: attempt - 1, Err: errors.Join(last, ctx.Err())}
		}
		pd, err := p.send(ctx, exchange, key, msg)
		if err == nil {
			err = p.await(ctx, pd, exchange, key, msg.MessageId)
		}
		if err == nil {
			return nil
		}
		last = err
		var re *ReturnError
		if errors.As(err, &re) || errors.Is(err, ErrClosed) || ctx.Err() != nil {
			return &PublishError{MessageID: msg.MessageId, Attempts: attempt, Err: err}
		}
	}
	return &PublishError{MessageID: msg.MessageId, Attempts: p.cfg.attempts, Err: last}
}

// Publish sends m to the publisher's exchange with routingKey
// (m.Subject when empty) and returns once the broker confirmed it:
// MessageId is m.ID, the envelope headers (business key, aggregate,
// version) and m.Headers travel as headers. An empty m.ID is refused
// before any I/O. A returned message is a [*ReturnError]; a confirm lost
// with the connection is published again under the same ID (see
// [WithPublishRetries]).
func (p *Publisher) Publish(ctx context.Context, routingKey string, m *consumer.Message) error {
	if m == nil {
		return bad("message", "is nil")
	}
	if m.ID == "" {
		return bad("message ID", "is empty: publish every message under a stable ID, set once per logical event")
	}
	if routingKey == "" {
		routingKey = m.Subject
	}
	return p.publish(ctx, p.cfg.exchange, routingKey, publishing(m))
}

// Republish implements [consumer.Republisher] for [consumer.Replay]: it
// sends m to the default exchange with m.Subject, the queue it was
// consumed from, as routing key, under its original message ID, so only
// that queue's consumer sees it again.
func (p *Publisher) Republish(ctx context.Context, m *consumer.Message) error {
	if m == nil || m.ID == "" || m.Subject == "" {
		return bad("message", "needs an ID and the Subject (queue) it came from")
	}
	return p.publish(ctx, "", m.Subject, publishing(m))
}

// Outbox returns the publisher as an outbox relay's [outbox.Publisher]:
// each message goes to the publisher's exchange with its Topic as routing
// key and its ID as message_id. A batch waits at most wait for its
// confirms (0: until the relay's context ends); a message whose confirm
// did not come by then is reported unsent-or-unknown and published again
// by the relay under the same ID.
func (p *Publisher) Outbox(wait time.Duration) outbox.Publisher { return outboxPublisher{p, wait} }

type outboxPublisher struct {
	p    *Publisher
	wait time.Duration
}

// Publish implements [outbox.Publisher]: the whole batch is published in
// order on one channel, then the confirms are awaited. A message whose
// confirm is lost or nacked gets an error (the relay sends it again under
// the same ID); a returned one a permanent error.
func (o outboxPublisher) Publish(ctx context.Context, batch []outbox.Message, results []error) {
	p := o.p
	if o.wait > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, o.wait)
		defer cancel()
	}
	pds := make([]pending, len(batch))
	sent := 0
	for i := range batch {
		m := &batch[i]
		msg := amqp.Publishing{MessageId: m.ID, DeliveryMode: amqp.Persistent, Body: m.Payload, Timestamp: time.Now()}
		if len(m.Headers) > 0 {
			msg.Headers = make(amqp.Table, len(m.Headers))
			for k, v := range m.Headers {
				msg.Headers[k] = v
			}
		}
		pd, err := p.send(ctx, p.cfg.exchange, m.Topic, msg)
		if err != nil {
			results[i] = err
			for j := i + 1; j < len(batch); j++ {
				results[j] = outbox.ErrNotSent
			}
			break
		}
		pds[i] = pd
		sent = i + 1
	}
	for i := range sent {
		results[i] = p.await(ctx, pds[i], p.cfg.exchange, batch[i].Topic, batch[i].ID)
	}
}
