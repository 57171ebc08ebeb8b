package verify

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// NATSOptions configure [RunNATS].
type NATSOptions struct {
	// URL of the NATS server with JetStream enabled.
	URL string
	// Keep leaves the run's stream on the server for inspection.
	Keep bool
}

// Header names of the envelope, as package dedupnats writes them.
const (
	hdrMsgID     = "Dedup-Msg-Id"
	hdrNatsMsgID = "Nats-Msg-Id"
)

// RunNATS is [Run] over a real JetStream server instead of the simulated
// broker. It creates a stream and a durable pull consumer for the run,
// publishes every message (with Nats-Msg-Id set to its ID, so a producer
// retry inside the duplicate window is dropped by the broker; the extra
// copies of --dup-rate are published as producer retries from outside
// that window, under another Nats-Msg-Id, so the broker delivers them and
// only the consumer's dedup stands between them and a double effect),
// then consumes with Config.Consumers workers:
//
//   - an acknowledged outcome is acked (AckSync: the broker confirmed it);
//   - a crash, before or after the commit, acks nothing: JetStream
//     redelivers after its AckWait (the lease, at least 1s);
//   - any other outcome is a NakWithDelay.
//
// The run ends when the broker has confirmed an ack for every published
// copy. The stream is deleted unless opts.Keep.
func RunNATS(ctx context.Context, cfg Config, t Target, opts NATSOptions) (Report, error) {
	b, err := start(cfg, t, "nats")
	if err != nil {
		return Report{}, err
	}
	cfg = b.cfg
	nc, err := nats.Connect(opts.URL, nats.Name("dedup verify"), nats.Timeout(5*time.Second))
	if err != nil {
		return Report{}, fmt.Errorf("verify: connect to NATS at %s (start nats-server with -js, or set --nats-url / $DEDUP_NATS_URL): %w", opts.URL, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return Report{}, fmt.Errorf("verify: JetStream: %w", err)
	}

	streamName := "DEDUP_VERIFY_" + b.runID
	subject := "dedup-verify." + b.runID
	ackWait := max(cfg.Lease, time.Second)
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	stream, err := js.CreateStream(sctx, jetstream.StreamConfig{
		Name: streamName, Subjects: []string{subject}, Storage: jetstream.FileStorage,
		Duplicates: 2 * time.Minute,
	})
	if err != nil {
		return Report{}, fmt.Errorf("verify: create stream %s (is JetStream enabled? start nats-server with -js): %w", streamName, err)
	}
	b.report.Stream = streamName
	if !opts.Keep {
		defer func() {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			_ = js.DeleteStream(dctx, streamName)
		}()
	}
	cons, err := stream.CreateOrUpdateConsumer(sctx, jetstream.ConsumerConfig{
		Durable: "verify", AckPolicy: jetstream.AckExplicitPolicy, AckWait: ackWait,
		MaxDeliver: -1, MaxAckPending: 4 * max(cfg.Consumers, 64),
	})
	if err != nil {
		return Report{}, fmt.Errorf("verify: create consumer on %s: %w", streamName, err)
	}

	// Publish every message, and the extra copies, before consuming; the
	// broker learns each copy's stream sequence from its PubAck.
	if err := b.publishNATS(ctx, js, subject); err != nil {
		return b.report, err
	}
	b.report.Deliveries = 0

	// The accounting runs on one goroutine, as in Run.
	results := make(chan natsSettled, cfg.Consumers)
	work := make(chan jetstream.Msg)
	var wg sync.WaitGroup
	var seen sync.Map // stream sequence -> struct{} once its ack is confirmed
	for i := range cfg.Consumers {
		rng := rand.New(rand.NewPCG(cfg.Seed+uint64(i)+1, uint64(i)))
		wg.Go(func() {
			for m := range work {
				results <- b.consumeNATS(ctx, t, m, rng, &seen)
			}
		})
	}
	iter, err := cons.Messages(jetstream.PullMaxMessages(2 * cfg.Consumers))
	if err != nil {
		close(work)
		wg.Wait()
		return b.report, fmt.Errorf("verify: consume %s: %w", streamName, err)
	}
	fetchDone := make(chan struct{})
	go func() {
		defer close(fetchDone)
		defer close(work)
		for {
			m, err := iter.Next()
			if err != nil {
				return // stopped, or the connection closed
			}
			select {
			case work <- m:
			case <-ctx.Done():
				return
			}
		}
	}()

	tick := time.NewTicker(cfg.ProgressEvery)
	defer tick.Stop()
	stopped := false
loop:
	for b.done < cfg.Messages {
		select {
		case r := <-results:
			b.report.Deliveries++
			if r.redelivered {
				b.report.Redeliveries++
			}
			b.account(r.s, r.acked)
		case <-tick.C:
			b.progress()
		case <-ctx.Done():
			stopped = true
			break loop
		}
	}
	b.progress()
	iter.Stop()
	// Drain: settle what the workers still hold without counting new acks
	// as progress of a finished run.
	go func() {
		for r := range results {
			_ = r
		}
	}()
	<-fetchDone
	wg.Wait()
	close(results)
	return b.conclude(ctx, t, stopped)
}

// natsSettled is a delivery's outcome and whether its ack was confirmed
// for the first time.
type natsSettled struct {
	s           settled
	acked       bool
	redelivered bool
}

// publishNATS publishes every message and its extra copies, counting
// them as pending.
func (b *broker) publishNATS(ctx context.Context, js jetstream.JetStream, subject string) error {
	const window = 512 // async publishes in flight
	var futures []jetstream.PubAckFuture
	flush := func() error {
		select {
		case <-js.PublishAsyncComplete():
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Minute):
			return errors.New("verify: NATS did not confirm publishes within a minute")
		}
		for _, f := range futures {
			select {
			case <-f.Ok():
			case err := <-f.Err():
				return fmt.Errorf("verify: publish: %w", err)
			}
		}
		futures = futures[:0]
		return nil
	}
	pub := func(seq int, natsID string) error {
		id := b.msgID(seq)
		m := nats.NewMsg(subject)
		m.Header.Set(hdrMsgID, id)
		m.Header.Set(hdrNatsMsgID, natsID)
		m.Data = payloadOf(id, seq)
		f, err := js.PublishMsgAsync(m)
		if err != nil {
			return fmt.Errorf("verify: publish %s: %w", id, err)
		}
		futures = append(futures, f)
		if len(futures) >= window {
			return flush()
		}
		return nil
	}
	for seq := range b.cfg.Messages {
		b.next = seq + 1
		id := b.msgID(seq)
		b.pending[seq] = 1
		if err := pub(seq, id); err != nil {
			return err
		}
		if b.rng.Float64() < b.cfg.DupRate {
			b.pending[seq]++
			b.report.BrokerDuplicates++
			if err := pub(seq, id+"/retry"); err != nil {
				return err
			}
		}
		if seq%1000 == 0 {
			b.progress()
		}
	}
	return flush()
}

// consumeNATS handles one JetStream message on a worker goroutine.
func (b *broker) consumeNATS(ctx context.Context, t Target, m jetstream.Msg, rng *rand.Rand, seen *sync.Map) natsSettled {
	meta, err := m.Metadata()
	id := m.Headers().Get(hdrMsgID)
	seq, ok := b.parseMsgID(id)
	if err != nil || !ok {
		// Not ours: a stray message on the run's subject. Terminate it so it
		// does not come back, and count it.
		_ = m.Term()
		return natsSettled{s: settled{res: Result{Outcome: StoreFailed, Err: fmt.Errorf("stray message %q on the run's stream", id)}}}
	}
	d := b.delivery(seq)
	d.Redelivered = int(meta.NumDelivered) - 1
	d.Fault = faultOf(b.cfg, rng.Float64())
	start := time.Now()
	res := t.Apply(ctx, d)
	s := settled{d: d, res: res, took: time.Since(start)}
	out := natsSettled{s: s, redelivered: d.Redelivered > 0}
	lease := b.cfg.Lease
	switch {
	case res.Outcome.acked():
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		err := m.DoubleAck(actx)
		cancel()
		if err == nil {
			_, dup := seen.LoadOrStore(meta.Sequence.Stream, struct{}{})
			out.acked = !dup
		}
	case res.Outcome == CrashedBeforeCommit || res.Outcome == CrashedAfterCommit:
		// A dead consumer acks nothing; AckWait brings it back.
	case res.Outcome == InProgress:
		_ = m.NakWithDelay(max(res.RetryAfter, lease/20) + time.Duration(rng.Int64N(int64(lease/20)+1)))
	default:
		_ = m.NakWithDelay(lease/20 + time.Duration(rng.Int64N(int64(lease/20)+1)))
	}
	return out
}

// faultOf draws a fault from u in [0,1).
func faultOf(cfg Config, u float64) Fault {
	switch c := cfg.CrashRate; {
	case u < c/2:
		return CrashBeforeCommit
	case u < c:
		return CrashAfterCommit
	case u < c+cfg.FailRate:
		return HandlerFailure
	}
	return NoFault
}
