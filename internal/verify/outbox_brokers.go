package verify

import (
	"context"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/dedupkit/dedup/dedupamqp"
	"github.com/dedupkit/dedup/dedupkafka"
	"github.com/dedupkit/dedup/dedupnats"
	"github.com/dedupkit/dedup/outbox"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// outboxBroker is the broker of a `verify --outbox` run: the relays'
// publisher (the adapter's own outbox.Publisher) and the consumers.
type outboxBroker interface {
	// topic is the outbox rows' Topic; stream names the run's stream,
	// topic or queue for the report.
	topic() string
	stream() string
	publisher() outbox.Publisher
	// consume delivers each event to handle with `workers` goroutines,
	// one aggregate's events one at a time and in broker order, and
	// acknowledges an event only after handle returned true (false: the
	// run is ending, no ack). stop waits for the consumers after ctx ends.
	consume(ctx context.Context, workers int, handle func(id, agg string, v uint64) bool) (stop func(), err error)
	close(ctx context.Context, keep bool)
}

func openOutboxBroker(ctx context.Context, cfg OutboxConfig, runID string) (outboxBroker, error) {
	switch cfg.Broker {
	case "kafka":
		return openKafkaOutbox(runID)
	case "rabbitmq":
		return openAMQPOutbox(cfg, runID)
	}
	return openNATSOutbox(ctx, cfg, runID)
}

// outboxDelivery is one delivery handed to a worker.
type outboxDelivery struct {
	id, agg string
	v       uint64
	ack     func()
}

// dispatch starts n workers; send routes a delivery to the worker of its
// aggregate (so one aggregate runs in order), and wait waits for them
// after ctx ended.
func dispatch(ctx context.Context, n int, handle func(id, agg string, v uint64) bool) (send func(outboxDelivery), wait func()) {
	work := make([]chan outboxDelivery, n)
	var wg sync.WaitGroup
	for i := range work {
		work[i] = make(chan outboxDelivery, 256)
		wg.Go(func() {
			for {
				var d outboxDelivery
				select {
				case d = <-work[i]:
				case <-ctx.Done():
					// The channels are never closed: a broker callback
					// may still be sending after its consumer stopped.
					return
				}
				if !handle(d.id, d.agg, d.v) {
					return
				}
				d.ack() // after durable work
			}
		})
	}
	send = func(d outboxDelivery) {
		h := fnv.New32a()
		h.Write([]byte(d.agg))
		select {
		case work[h.Sum32()%uint32(n)] <- d:
		case <-ctx.Done():
		}
	}
	return send, wg.Wait
}

// ---- NATS JetStream ----

type natsOutbox struct {
	nc   *nats.Conn
	js   jetstream.JetStream
	name string
	pub  outbox.Publisher
}

func openNATSOutbox(ctx context.Context, cfg OutboxConfig, runID string) (*natsOutbox, error) {
	nc, err := nats.Connect(cfg.NATSURL, nats.Name("dedup verify --outbox"), nats.Timeout(5*time.Second))
	if err != nil {
		return nil, fmt.Errorf("verify: connect to NATS at %s (set --nats-url or $DEDUP_NATS_URL): %w", cfg.NATSURL, err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, err
	}
	o := &natsOutbox{nc: nc, js: js, name: "DEDUP_VERIFY_OUTBOX_" + strings.ToUpper(runID)}
	// A short duplicate window: re-sends after it reach the consumers,
	// whose dedup must absorb them.
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: o.name, Subjects: []string{o.name + ".>"},
		Storage: jetstream.FileStorage, Duplicates: 200 * time.Millisecond}); err != nil {
		nc.Close()
		return nil, fmt.Errorf("verify: create stream %s: %w", o.name, err)
	}
	if o.pub, err = dedupnats.NewOutboxPublisher(js, 10*time.Second, dedupnats.WithExpectStream(o.name)); err != nil {
		o.close(ctx, false)
		return nil, err
	}
	return o, nil
}

func (o *natsOutbox) topic() string               { return o.name + ".events" }
func (o *natsOutbox) stream() string              { return o.name }
func (o *natsOutbox) publisher() outbox.Publisher { return o.pub }

func (o *natsOutbox) consume(ctx context.Context, workers int, handle func(id, agg string, v uint64) bool) (func(), error) {
	cons, err := o.js.CreateOrUpdateConsumer(ctx, o.name, jetstream.ConsumerConfig{Durable: "verify", AckPolicy: jetstream.AckExplicitPolicy,
		AckWait: 30 * time.Second, MaxAckPending: 20000})
	if err != nil {
		return nil, err
	}
	send, wait := dispatch(ctx, workers, handle)
	cc, err := cons.Consume(func(m jetstream.Msg) {
		h := m.Headers()
		v, _ := strconv.ParseUint(h.Get(dedupnats.HeaderVersion), 10, 64)
		send(outboxDelivery{id: h.Get(dedupnats.HeaderMsgID), agg: h.Get(dedupnats.HeaderAggregate), v: v, ack: func() { m.Ack() }})
	}, jetstream.PullMaxMessages(500))
	if err != nil {
		return nil, err
	}
	return func() { cc.Stop(); wait() }, nil
}

func (o *natsOutbox) close(ctx context.Context, keep bool) {
	if !keep {
		o.js.DeleteStream(ctx, o.name)
	}
	o.nc.Close()
}

// ---- Kafka (in-process kfake cluster) ----

// kafkaOutboxPartitions is the partition count of the run's topic.
const kafkaOutboxPartitions = 8

type kafkaOutbox struct {
	fake  *kfake.Cluster
	seeds []string
	name  string
	pub   *dedupkafka.Publisher
}

// openKafkaOutbox starts an in-process kfake cluster (it speaks the real
// protocol) whose first produce responses are lost after the write: the
// idempotent producer's own retry must not duplicate them.
func openKafkaOutbox(runID string) (*kafkaOutbox, error) {
	o := &kafkaOutbox{name: "dedup-verify-outbox-" + runID}
	fake, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(kafkaOutboxPartitions, o.name))
	if err != nil {
		return nil, fmt.Errorf("verify: start the in-process Kafka cluster: %w", err)
	}
	o.fake, o.seeds = fake, fake.ListenAddrs()
	fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.RequestTimedOut, Count: 5})
	if o.pub, err = dedupkafka.NewPublisher(o.seeds, dedupkafka.WithDeliveryTimeout(10*time.Second)); err != nil {
		fake.Close()
		return nil, err
	}
	return o, nil
}

func (o *kafkaOutbox) topic() string               { return o.name }
func (o *kafkaOutbox) stream() string              { return o.name }
func (o *kafkaOutbox) publisher() outbox.Publisher { return o.pub.Outbox() }

// consume runs one group member: after each poll it runs every
// partition's records in offset order (partitions in parallel, at most
// workers at once: one aggregate is one record key, so one partition) and
// then commits the poll's offsets, so an offset moves only past applied
// records.
func (o *kafkaOutbox) consume(ctx context.Context, workers int, handle func(id, agg string, v uint64) bool) (func(), error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(o.seeds...), kgo.ConsumerGroup("verify-outbox"), kgo.ConsumeTopics(o.name),
		kgo.DisableAutoCommit(), kgo.BlockRebalanceOnPoll(), kgo.FetchMaxWait(50*time.Millisecond))
	if err != nil {
		return nil, err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		sem := make(chan struct{}, workers)
		for ctx.Err() == nil {
			fs := cl.PollRecords(ctx, 2000)
			if fs.IsClientClosed() || ctx.Err() != nil {
				cl.AllowRebalance()
				return
			}
			var wg sync.WaitGroup
			var mu sync.Mutex
			complete := true
			fs.EachPartition(func(p kgo.FetchTopicPartition) {
				if len(p.Records) == 0 {
					return
				}
				sem <- struct{}{}
				wg.Go(func() {
					defer func() { <-sem }()
					for _, r := range p.Records {
						var id, agg string
						var v uint64
						for _, h := range r.Headers {
							switch h.Key {
							case dedupkafka.HeaderMsgID:
								id = string(h.Value)
							case dedupkafka.HeaderAggregate:
								agg = string(h.Value)
							case dedupkafka.HeaderVersion:
								v, _ = strconv.ParseUint(string(h.Value), 10, 64)
							}
						}
						if !handle(id, agg, v) {
							mu.Lock()
							complete = false
							mu.Unlock()
							return
						}
					}
				})
			})
			wg.Wait()
			if complete {
				cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
				cl.CommitUncommittedOffsets(cctx)
				cancel()
			}
			cl.AllowRebalance()
		}
	}()
	return func() { <-done; cl.Close() }, nil
}

func (o *kafkaOutbox) close(context.Context, bool) {
	o.pub.Close()
	o.fake.Close()
}

// ---- RabbitMQ ----

type amqpOutbox struct {
	conn  *amqp.Connection
	queue string
	pub   *dedupamqp.Publisher
}

// openAMQPOutbox declares a durable classic queue for the run; the relay
// publishes to the default exchange with the queue as routing key, in
// confirm mode, mandatory, with message_id = the event's stable ID.
func openAMQPOutbox(cfg OutboxConfig, runID string) (*amqpOutbox, error) {
	conn, err := amqp.Dial(cfg.AMQPURL)
	if err != nil {
		return nil, fmt.Errorf("verify: connect to RabbitMQ at %s (set --amqp-url or $DEDUP_AMQP_URL): %w", cfg.AMQPURL, err)
	}
	o := &amqpOutbox{conn: conn, queue: "dedup-verify-outbox-" + runID}
	ch, err := conn.Channel()
	if err == nil {
		_, err = ch.QueueDeclare(o.queue, true, false, false, false, amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeClassic})
		ch.Close()
	}
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("verify: declare queue %s: %w", o.queue, err)
	}
	if o.pub, err = dedupamqp.NewPublisher(cfg.AMQPURL); err != nil {
		o.close(context.Background(), false)
		return nil, err
	}
	return o, nil
}

func (o *amqpOutbox) topic() string               { return o.queue }
func (o *amqpOutbox) stream() string              { return o.queue }
func (o *amqpOutbox) publisher() outbox.Publisher { return o.pub.Outbox(10 * time.Second) }

func (o *amqpOutbox) consume(ctx context.Context, workers int, handle func(id, agg string, v uint64) bool) (func(), error) {
	ch, err := o.conn.Channel()
	if err != nil {
		return nil, err
	}
	if err := ch.Qos(1000, 0, false); err != nil {
		ch.Close()
		return nil, err
	}
	ds, err := ch.ConsumeWithContext(ctx, o.queue, "verify-outbox", false, false, false, false, nil)
	if err != nil {
		ch.Close()
		return nil, err
	}
	send, wait := dispatch(ctx, workers, handle)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-ctx.Done():
				return
			case d, ok := <-ds:
				if !ok {
					return
				}
				str := func(k string) string { s, _ := d.Headers[k].(string); return s }
				v, _ := strconv.ParseUint(str(dedupamqp.HeaderVersion), 10, 64)
				send(outboxDelivery{id: d.MessageId, agg: str(dedupamqp.HeaderAggregate), v: v, ack: func() { d.Ack(false) }})
			}
		}
	}()
	return func() { <-done; wait(); ch.Close() }, nil
}

func (o *amqpOutbox) close(_ context.Context, keep bool) {
	if !keep {
		if ch, err := o.conn.Channel(); err == nil {
			ch.QueueDelete(o.queue, false, false, false)
			ch.Close()
		}
	}
	if o.pub != nil {
		o.pub.Close()
	}
	o.conn.Close()
}
