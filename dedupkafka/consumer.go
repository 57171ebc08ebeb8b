package dedupkafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup/consumer"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// ErrClosed is returned by Run after Close, and by Run called twice.
var ErrClosed = errors.New("dedupkafka: consumer closed")

// errCrashed ends Run when the test hook simulated a crash.
var errCrashed = errors.New("dedupkafka: simulated crash")

// A Consumer runs a [consumer.Processor] over the records of a Kafka
// consumer group. See the package documentation for what it commits and
// when.
type Consumer struct {
	p      *consumer.Processor
	cfg    consumerConfig
	cl     *kgo.Client
	group  string
	topics []string

	mu      sync.Mutex
	parts   map[tp]*part
	crashed atomic.Bool
	// pipeDepth is the batches of a partition in flight in batch mode; 0:
	// 2 (the benchmarks try others).
	pipeDepth int

	// rebalance is set when a rebalance waits for the loop to allow it
	// (kgo.OnPartitionsCallbackBlocked); pollMu guards pollCancel, the
	// cancel of the poll in progress, which the callback calls so that a
	// poll waiting for records does not hold the rebalance up.
	rebalance  atomic.Bool
	pollMu     sync.Mutex
	pollCancel context.CancelFunc
	// decided (guarded by pollMu) is set when a batch's decisions arrive
	// on a pipeline goroutine (batch mode), and cleared when the loop takes
	// the offsets to commit: a poll that starts with it set takes only what
	// is buffered, and one that waits for records is cancelled when it is
	// set, so that records made final while the loop polls are committed
	// without waiting for more records.
	decided bool
	// batches counts the batches in flight (batch mode), over every
	// partition: the loop waits for them before it commits for a rebalance
	// or a shutdown, and before it returns.
	batches sync.WaitGroup

	// lanes are the processor's lanes the record-mode drains run on, one
	// per goroutine of a round (see round); made and closed by the loop's
	// goroutine only.
	lanes []*consumer.Lane

	lifecycle

	st consumerStats
}

// lifecycle is what Consumer and Transactor share about Run and Close: Run
// runs at most once, Close asks it to end and waits for it, and a Close
// before any Run releases the client itself and makes a later Run return.
type lifecycle struct {
	running  atomic.Bool
	closing  chan struct{} // closed by the first Close
	closeOne sync.Once
	done     chan struct{} // closed when Run has returned, or by a Close before Run
	// looked, when set (by tests), runs in stop once it has looked at
	// whether Run started.
	looked func()
}

func newLifecycle() lifecycle {
	return lifecycle{closing: make(chan struct{}), done: make(chan struct{})}
}

// stop asks Run to end and waits for it; if Run never started, it marks
// the lifecycle as run and done and calls release (the client's Close).
// One look decides which: a Run that starts after a first look (that it
// had not started) and before a second would make both fail, and stop
// would return while Run still runs.
func (l *lifecycle) stop(release func()) {
	l.closeOne.Do(func() { close(l.closing) })
	first := l.running.CompareAndSwap(false, true)
	if l.looked != nil {
		l.looked()
	}
	if first {
		close(l.done)
		release()
		return
	}
	<-l.done
}

// runContext returns ctx cancelled also by Close, or false if Close came
// first.
func (l *lifecycle) runContext(ctx context.Context) (context.Context, context.CancelFunc, bool) {
	select {
	case <-l.closing:
		return ctx, func() {}, false
	default:
	}
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		select {
		case <-l.closing:
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, cancel, true
}

type tp struct {
	topic     string
	partition int32
}

// part is what the consumer holds of one assigned partition: the records
// polled and not yet final, in offset order, and the offsets.
//
// In batch mode a partition's batches go through its pipeline, and the
// decisions of a batch arrive on a goroutine of the pipeline, possibly
// after the round that submitted it (while the loop polls again): backlog,
// sent, next, held, due, redeliver and gen are then read and written
// under the consumer's mu.
type part struct {
	tp
	backlog   []*kgo.Record
	due       time.Time // when a held head may run again
	held      bool      // the head waits until due (its fetches are paused)
	paused    bool      // the partition's fetches are paused
	redeliver int       // how many times the head was run before
	next      kgo.EpochOffset
	committed int64

	// Batch mode: the first sent records of backlog are in batches
	// submitted and not yet decided; flight holds, oldest first, a channel
	// per batch submitted that is closed once its decisions were made (used
	// by the partition's drain only); gen counts the holds, so that the
	// decisions of a batch submitted before a hold are dropped.
	pl     *consumer.Pipeline
	sent   int
	flight []chan struct{}
	gen    uint64
}

// Stats counts what a consumer did.
type Stats struct {
	// Records counts records polled.
	Records uint64
	// Final counts records whose decision was final (applied, duplicate,
	// rejected, dead-lettered); Duplicates and DeadLettered are among them.
	Final, Duplicates, DeadLettered uint64
	// Held counts Retry decisions: the partition waited and ran the record
	// again.
	Held uint64
	// EnvelopeErrors counts records dead-lettered because a header could
	// not be read.
	EnvelopeErrors uint64
	// Commits and CommitErrors count offset commits (one per partition).
	Commits, CommitErrors uint64
	// Revoked and Lost count partitions taken away by a rebalance or lost
	// to a group error; Dropped counts records polled and not final that
	// were dropped with them (they are redelivered to the new owner).
	Revoked, Lost, Dropped uint64
}

type consumerStats struct {
	records, final, duplicates, deadLettered, held, envelope atomic.Uint64
	commits, commitErrors, revoked, lost, dropped            atomic.Uint64
}

// NewConsumer returns a consumer of topics in group on the brokers
// ("host:port" seeds) that runs p for each record. It validates its
// arguments before any I/O and returns a [*dedup.ArgumentError] for a bad
// one; the client connects lazily, in Run.
func NewConsumer(brokers []string, group string, topics []string, p *consumer.Processor, opts ...ConsumerOption) (*Consumer, error) {
	switch {
	case len(brokers) == 0:
		return nil, bad("brokers", "needs at least one seed broker")
	case group == "":
		return nil, bad("group", "is empty")
	case len(topics) == 0:
		return nil, bad("topics", "needs at least one topic")
	case p == nil:
		return nil, bad("processor", "is nil")
	}
	for _, t := range topics {
		if !validTopic(t) {
			return nil, bad("topics", fmt.Sprintf("%q is not a topic name", t))
		}
	}
	cfg := defaultConsumerConfig()
	for _, o := range opts {
		o.applyConsumer(&cfg)
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	c := &Consumer{p: p, cfg: cfg, group: group, topics: slices.Clone(topics), parts: map[tp]*part{},
		lifecycle: newLifecycle()}
	kopts := append(slices.Clone(cfg.kopts),
		kgo.SeedBrokers(brokers...),
		kgo.ConsumerGroup(group),
		kgo.ConsumeTopics(topics...),
		kgo.DisableAutoCommit(),
		kgo.BlockRebalanceOnPoll(),
		kgo.OnPartitionsCallbackBlocked(c.blocked),
		kgo.OnPartitionsRevoked(c.revoked),
		kgo.OnPartitionsLost(c.lost),
	)
	cl, err := kgo.NewClient(kopts...)
	if err != nil {
		return nil, fmt.Errorf("dedupkafka: new client: %w", err)
	}
	c.cl = cl
	return c, nil
}

// validTopic reports whether s can name a Kafka topic.
func validTopic(s string) bool {
	if s == "" || len(s) > 249 || s == "." || s == ".." {
		return false
	}
	for i := 0; i < len(s); i++ {
		b := s[i]
		if !(b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9' || b == '.' || b == '_' || b == '-') {
			return false
		}
	}
	return true
}

// Client returns the franz-go client, for metrics and admin requests. Do
// not poll or commit with it.
func (c *Consumer) Client() *kgo.Client { return c.cl }

// Stats returns the counts so far.
func (c *Consumer) Stats() Stats {
	s := &c.st
	return Stats{
		Records: s.records.Load(), Final: s.final.Load(), Duplicates: s.duplicates.Load(),
		DeadLettered: s.deadLettered.Load(), Held: s.held.Load(), EnvelopeErrors: s.envelope.Load(),
		Commits: s.commits.Load(), CommitErrors: s.commitErrors.Load(),
		Revoked: s.revoked.Load(), Lost: s.lost.Load(), Dropped: s.dropped.Load(),
	}
}

// Run consumes until ctx is done or Close is called, then leaves the group
// (committing what is final) and returns nil. It returns early with an
// error only when the client fails for good. Run may be called once.
//
// When ctx ends or Close is called, no new record starts; the records
// being processed run on a context that outlives ctx by the drain timeout
// ([WithDrainTimeout]), so that their completions are recorded and
// committed rather than cut short.
func (c *Consumer) Run(ctx context.Context) error {
	if !c.running.CompareAndSwap(false, true) {
		return ErrClosed
	}
	defer close(c.done)
	ctx, cancel, ok := c.runContext(ctx)
	if !ok {
		c.cl.Close()
		return ErrClosed
	}
	defer cancel()
	c.warn(ctx)
	err := c.loop(ctx)
	// Leaving the group runs the revocation callback, which commits what is
	// final (unless a simulated crash said not to).
	c.cl.Close()
	if errors.Is(err, errCrashed) {
		return err
	}
	return nil
}

// Close stops Run, waits for it to commit and leave the group, and closes
// the client. It is safe to call more than once.
func (c *Consumer) Close() error {
	c.stop(func() { c.cl.Close() })
	return nil
}

// loop polls, processes and commits until ctx is done. The commit of a
// round's offsets runs while the next round is polled and processed
// (pipelined: the commit's round trip overlaps the work), and the
// rebalance that BlockRebalanceOnPoll holds back is allowed only once no
// commit is in flight: when one waits (blocked), the loop waits for the
// commit in flight, commits the round it just processed synchronously and
// allows the rebalance, so that a rebalance never interleaves with
// processing or a commit. Every return waits for the commit in flight and
// allows the rebalance, so that leaving the group (Close) can proceed.
//
// In batch mode a round may end with batches still in flight (their
// completions overlap the next poll and the next round's claims): their
// records become final when their decisions arrive, and are committed by
// the next commit after that; a poll is cut short when decisions arrive
// while it waits for records (see Consumer.decided). Before it commits
// for a rebalance or a shutdown, and before it returns, the loop waits
// for every batch in flight, so that the rebalance callbacks (which
// commit what is final and drop the rest) and Close find none.
func (c *Consumer) loop(ctx context.Context) error {
	var inflight chan struct{} // closed when the commit in flight is done; nil if none
	settle := func() {
		if inflight != nil {
			<-inflight
			inflight = nil
		}
	}
	defer func() {
		c.batches.Wait()
		settle()
		c.closeLanes()
		c.cl.AllowRebalance()
	}()
	// Records run on a context that outlives ctx by the drain timeout: a
	// Close while a record's completion is in flight lets it land (cut
	// short, it would leave the record in progress, commit nothing, and
	// the next consumer would take it over after the lease and apply it
	// again). The loop itself stops between records as soon as ctx ends.
	rctx, rcancel := context.WithCancel(context.WithoutCancel(ctx))
	defer rcancel()
	stopDrain := context.AfterFunc(ctx, func() { time.AfterFunc(c.cfg.drain, rcancel) })
	defer stopDrain()
	for ctx.Err() == nil {
		pctx, cancel := context.WithCancel(ctx)
		if d, ok := c.nextDue(); ok {
			cancel()
			pctx, cancel = context.WithTimeout(ctx, max(d, 0))
		}
		c.pollMu.Lock()
		if c.decided {
			// Decisions arrived since the offsets were taken: take what is
			// buffered and commit them, rather than wait for records.
			pctx = nil
		} else {
			c.pollCancel = cancel
		}
		if c.rebalance.Load() {
			cancel() // a rebalance waits: let it in
		}
		c.pollMu.Unlock()
		fs := c.cl.PollRecords(pctx, c.cfg.maxPoll)
		c.pollMu.Lock()
		c.pollCancel = nil
		c.pollMu.Unlock()
		cancel()
		if fs.IsClientClosed() {
			return nil
		}
		fs.EachError(func(t string, p int32, err error) {
			if !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
				c.cfg.logger.Warn("dedupkafka: fetch error", slog.String("topic", t), slog.Int("partition", int(p)), slog.Any("err", err))
			}
		})
		work := c.take(fs)
		c.round(ctx, rctx, work)
		if c.cfg.crash != nil && c.cfg.crash(c.finalOffsets()) {
			c.crashed.Store(true)
			return errCrashed
		}
		settle()
		if c.rebalance.Swap(false) || ctx.Err() != nil {
			c.batches.Wait()
			c.takeDecided()
			parts := c.allParts()
			c.commit(ctx, parts, false)
			c.pauseResume()
			c.cl.AllowRebalance()
			continue
		}
		// The offsets are taken now: the next round's drain (and, in batch
		// mode, the decisions of the batches in flight) move pt.next.
		c.takeDecided()
		parts, offs := c.allParts(), c.finalOffsets()
		done := make(chan struct{})
		inflight = done
		go func() {
			defer close(done)
			c.commitOffsets(ctx, parts, offs, false)
		}()
		c.pauseResume()
	}
	return nil
}

// takeDecided clears decided before the loop takes the offsets to commit.
func (c *Consumer) takeDecided() {
	c.pollMu.Lock()
	c.decided = false
	c.pollMu.Unlock()
}

// noteDecided runs after a batch's decisions were applied: it sets
// decided and ends a poll that waits for records, so that the loop
// commits them.
func (c *Consumer) noteDecided() {
	c.pollMu.Lock()
	defer c.pollMu.Unlock()
	c.decided = true
	if c.pollCancel != nil {
		c.pollCancel()
	}
}

// blocked runs, on a goroutine of its own, when a rebalance waits for the
// loop to allow it: it tells the loop, and ends a poll that waits for
// records.
func (c *Consumer) blocked(context.Context, *kgo.Client) {
	c.pollMu.Lock()
	defer c.pollMu.Unlock()
	c.rebalance.Store(true)
	if c.pollCancel != nil {
		c.pollCancel()
	}
}

// nextDue returns how long until the earliest held partition may run.
func (c *Consumer) nextDue() (time.Duration, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var first time.Time
	for _, pt := range c.parts {
		if pt.held && len(pt.backlog) > 0 && (first.IsZero() || pt.due.Before(first)) {
			first = pt.due
		}
	}
	if first.IsZero() {
		return 0, false
	}
	return time.Until(first), true
}

// take adds the polled records to their partitions and returns the
// partitions with records ready to run.
func (c *Consumer) take(fs kgo.Fetches) []*part {
	c.mu.Lock()
	defer c.mu.Unlock()
	fs.EachPartition(func(p kgo.FetchTopicPartition) {
		if len(p.Records) == 0 {
			return
		}
		k := tp{p.Topic, p.Partition}
		pt := c.parts[k]
		if pt == nil {
			pt = &part{tp: k, committed: -1, next: kgo.EpochOffset{Epoch: -1, Offset: -1}}
			c.parts[k] = pt
		}
		c.st.records.Add(uint64(len(p.Records)))
		pt.backlog = append(pt.backlog, p.Records...)
	})
	now := time.Now()
	var work []*part
	for _, pt := range c.parts {
		if len(pt.backlog) > pt.sent && (!pt.held || !now.Before(pt.due)) {
			work = append(work, pt)
		}
	}
	return work
}

// allParts returns the partitions assigned.
func (c *Consumer) allParts() []*part {
	c.mu.Lock()
	defer c.mu.Unlock()
	parts := make([]*part, 0, len(c.parts))
	for _, pt := range c.parts {
		parts = append(parts, pt)
	}
	return parts
}

// round processes the partitions in work, at most the concurrency at once,
// each in offset order until its backlog is empty or a record must wait.
//
// rctx is the context records run on (see loop); ctx ends the round.
func (c *Consumer) round(ctx, rctx context.Context, work []*part) {
	if len(work) == 0 {
		return
	}
	ch := make(chan *part)
	var wg sync.WaitGroup
	n := min(c.cfg.concurrency, len(work))
	if c.cfg.batch <= 1 {
		// Each goroutine counts its decisions on a lane of its own.
		for len(c.lanes) < n {
			c.lanes = append(c.lanes, c.p.NewLane())
		}
	}
	for i := range n {
		var lane *consumer.Lane
		if c.cfg.batch <= 1 {
			lane = c.lanes[i]
		}
		wg.Go(func() {
			for pt := range ch {
				c.drain(ctx, rctx, pt, lane)
			}
		})
	}
	for _, pt := range work {
		ch <- pt
	}
	close(ch)
	wg.Wait()
}

// closeLanes closes the lanes of the record-mode drains, once no round
// runs: their counts go to the processor's.
func (c *Consumer) closeLanes() {
	for _, l := range c.lanes {
		l.Close()
	}
	c.lanes = nil
}

// drain runs pt's backlog in order. A Retry decision holds the partition:
// the record and those after it stay in the backlog until the delay ends.
// In record mode the records run on lane (nil in batch mode), which no
// other goroutine uses meanwhile.
func (c *Consumer) drain(ctx, rctx context.Context, pt *part, lane *consumer.Lane) {
	if c.cfg.batch > 1 {
		c.drainBatches(ctx, rctx, pt)
		return
	}
	// The counts of final records go to the shared stats once per drain,
	// not once per record: partitions run on several cores at once, and an
	// atomic add per record makes them fight over its cache line.
	var final, duplicates, deadLettered uint64
	defer func() {
		c.st.final.Add(final)
		if duplicates > 0 {
			c.st.duplicates.Add(duplicates)
		}
		if deadLettered > 0 {
			c.st.deadLettered.Add(deadLettered)
		}
	}()
	// The records made final are cut off the backlog once, on the way out,
	// not one at a time: the partition is a heap object, and each store of
	// its backlog (a pointer) costs a write barrier while the GC runs.
	done := 0
	defer func() {
		if done == len(pt.backlog) {
			pt.backlog = nil
			pt.held = false
		} else {
			pt.backlog = pt.backlog[done:]
		}
	}()
	for done < len(pt.backlog) && ctx.Err() == nil {
		r := pt.backlog[done]
		m, err := newMessage(r, 1+pt.redeliver)
		d := consumer.Decision{Err: err}
		if err == nil {
			d = lane.Process(rctx, m)
		}
		if d.Action == 0 {
			c.st.envelope.Add(1)
			d = c.p.Quarantine(rctx, m, consumer.ClassPermanent, d.Err)
		}
		if d.Action == consumer.Retry {
			if ctx.Err() != nil {
				return // shutting down: the record stays unfinished
			}
			pt.redeliver++
			pt.held = true
			pt.due = time.Now().Add(min(max(d.Delay, 0), c.cfg.maxHold))
			c.st.held.Add(1)
			c.cfg.logger.Debug("dedupkafka: holding partition", slog.String("topic", pt.topic),
				slog.Int("partition", int(pt.partition)), slog.Int64("offset", r.Offset),
				slog.String("message_id", m.ID), slog.Duration("delay", d.Delay), slog.Any("err", d.Err))
			return
		}
		final++
		if d.Duplicate {
			duplicates++
		}
		if d.Action == consumer.DeadLettered {
			deadLettered++
		}
		pt.next = kgo.EpochOffset{Epoch: r.LeaderEpoch, Offset: r.Offset + 1}
		done++
		pt.redeliver = 0
	}
}

// drainBatches is drain in batch mode ([WithBatch]): it runs pt's backlog
// in batches through the partition's [consumer.Pipeline], so that a
// batch's completion overlaps the claim and handlers of the next, and
// decides each record in offset order once its batch's completion
// returned. It returns once every record of the backlog was submitted,
// without waiting for the last batches' completions: those overlap the
// next poll and the next round's claims, and their decisions (which make
// records final, or hold the partition) arrive on the pipeline's
// goroutine (see decideBatch).
//
// A Retry holds the partition at its record as in drain; the records
// after it stay in the backlog (those of a later batch already run are
// found duplicate when they run again). After a batch that is not clean
// (a handler failed, a key was found in progress, a record could not be
// read) the next batch waits for its decisions, so that a record to retry
// holds the partition before any later batch runs, as in drain. A batch
// is built only once the batch depth before it was decided (the pipeline
// holds depth, 2 by default), in this round or an earlier one: so only
// the batch right after one whose completion fails can have run.
func (c *Consumer) drainBatches(ctx, rctx context.Context, pt *part) {
	depth := c.pipeDepth
	if depth == 0 {
		depth = 2
	}
	if pt.pl == nil {
		pt.pl = c.p.NewPipeline(depth)
	}
	c.mu.Lock()
	stale := pt.sent == 0 && len(pt.flight) > 0
	// The partition runs again: a hold it had ended (its delay passed).
	pt.held = false
	gen := pt.gen
	c.mu.Unlock()
	if stale {
		// What is in flight was submitted before a hold and its decisions
		// are dropped: its records run again, after it.
		pt.pl.Wait()
		pt.flight = nil
	}
	for ctx.Err() == nil {
		if len(pt.flight) >= depth {
			<-pt.flight[0]
			pt.flight = pt.flight[1:]
		}
		c.mu.Lock()
		if pt.gen != gen || pt.sent >= len(pt.backlog) {
			c.mu.Unlock() // held meanwhile, or everything submitted
			break
		}
		n := min(c.cfg.batch, len(pt.backlog)-pt.sent)
		recs := pt.backlog[pt.sent : pt.sent+n]
		redeliver := 0
		if pt.sent == 0 {
			redeliver = pt.redeliver
		}
		pt.sent += n
		c.mu.Unlock()
		// run is what the processor runs: ms, unless a record could not be
		// read (then errs holds its error and at the index in ms of each
		// message run); the common batch allocates neither.
		ms := make([]*consumer.Message, n)
		var errs []error
		var at []int
		for i, r := range recs {
			delivery := 1
			if i == 0 {
				delivery += redeliver
			}
			m, err := newMessage(r, delivery)
			ms[i] = m
			if err != nil {
				if errs == nil {
					errs, at = make([]error, n), make([]int, i, n)
					for j := range at {
						at[j] = j
					}
				}
				errs[i] = err // decided in its turn, after the records before it
				continue
			}
			if at != nil {
				at = append(at, i)
			}
		}
		run := ms
		if at != nil {
			run = make([]*consumer.Message, len(at))
			for j, i := range at {
				run[j] = ms[i]
			}
		}
		dec := make(chan struct{})
		pt.flight = append(pt.flight, dec)
		c.batches.Add(1)
		// The batch runs on rctx, as drain's records do: a Close while its
		// handlers or its completion run lets them land (cut short, a
		// handler's call would be an unknown outcome, released and run
		// again by the next consumer); ctx only stops the next batch.
		clean := pt.pl.Submit(rctx, run, func(rds []consumer.Decision) {
			defer c.batches.Done()
			defer close(dec)
			ds := rds // the pipeline's, ours to keep
			if at != nil {
				ds = make([]consumer.Decision, n)
				for j, d := range rds {
					ds[at[j]] = d
				}
			}
			c.decideBatch(ctx, rctx, pt, gen, recs, ms, errs, ds)
			pt.pl.Recycle(rds) // decideBatch kept nothing of them
		})
		if !clean || len(run) < n {
			pt.pl.Wait()
			pt.flight = pt.flight[:0]
		}
	}
}

// decideBatch makes the decisions of a batch of pt submitted at hold
// count gen (ctx is the loop's, which a shutdown ends; rctx the one
// records run on, see loop): recs are its records (the first of pt.backlog, unless a hold
// came since), ms their messages, errs the envelope errors of those that
// could not be read (quarantined now, in their turn; nil if none), ds the processor's
// decisions. The records become final in order up to the first Retry,
// which holds the partition at its record. It runs on the pipeline's
// goroutine, the batches of a partition one at a time in their order.
func (c *Consumer) decideBatch(ctx, rctx context.Context, pt *part, gen uint64, recs []*kgo.Record, ms []*consumer.Message, errs []error, ds []consumer.Decision) {
	c.mu.Lock()
	dropped := pt.gen != gen
	c.mu.Unlock()
	if dropped {
		return // held at an earlier record: these stay in the backlog
	}
	// Only this partition's decisions change pt.gen, and they run one at
	// a time: the batch is still current without the lock, which the
	// quarantine's I/O must not hold.
	stop := len(recs)
	var final, duplicates, deadLettered uint64
	for i := range recs {
		d := ds[i]
		if errs != nil && errs[i] != nil {
			c.st.envelope.Add(1)
			d = c.p.Quarantine(rctx, ms[i], consumer.ClassPermanent, errs[i])
		}
		if d.Action == consumer.Retry {
			stop = i
			ds[i] = d
			break
		}
		final++
		if d.Duplicate {
			duplicates++
		}
		if d.Action == consumer.DeadLettered {
			deadLettered++
		}
	}
	c.st.final.Add(final)
	if duplicates > 0 {
		c.st.duplicates.Add(duplicates)
	}
	if deadLettered > 0 {
		c.st.deadLettered.Add(deadLettered)
	}
	defer c.noteDecided()
	c.mu.Lock()
	defer c.mu.Unlock()
	if stop > 0 {
		r := recs[stop-1]
		pt.next = kgo.EpochOffset{Epoch: r.LeaderEpoch, Offset: r.Offset + 1}
		pt.redeliver = 0
	}
	pt.backlog = pt.backlog[stop:]
	if stop == len(recs) {
		pt.sent -= stop
		if len(pt.backlog) == 0 {
			pt.backlog = nil
		}
		return
	}
	// The partition holds at recs[stop]: the records after it, submitted
	// or not, stay in the backlog and run again once the delay ended.
	pt.sent = 0
	pt.gen++
	if ctx.Err() != nil {
		return // shutting down: the record stays unfinished
	}
	d, m := ds[stop], ms[stop]
	pt.redeliver++
	pt.held = true
	pt.due = time.Now().Add(min(max(d.Delay, 0), c.cfg.maxHold))
	c.st.held.Add(1)
	c.cfg.logger.Debug("dedupkafka: holding partition", slog.String("topic", pt.topic),
		slog.Int("partition", int(pt.partition)), slog.Int64("offset", recs[stop].Offset),
		slog.String("message_id", m.ID), slog.Duration("delay", d.Delay), slog.Any("err", d.Err))
}

// finalOffsets returns the offsets to commit: one past the last final
// record of each assigned partition, where it moved.
func (c *Consumer) finalOffsets() map[string]map[int32]kgo.EpochOffset {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := map[string]map[int32]kgo.EpochOffset{}
	for _, pt := range c.parts {
		if pt.next.Offset > pt.committed {
			if out[pt.topic] == nil {
				out[pt.topic] = map[int32]kgo.EpochOffset{}
			}
			out[pt.topic][pt.partition] = pt.next
		}
	}
	return out
}

// commit commits the final offsets of parts synchronously, on a context
// detached from ctx with its own timeout, so a shutdown still commits.
func (c *Consumer) commit(ctx context.Context, parts []*part, locked bool) {
	if !locked {
		c.mu.Lock()
	}
	offs := map[string]map[int32]kgo.EpochOffset{}
	for _, pt := range parts {
		if pt.next.Offset > pt.committed && c.parts[pt.tp] == pt {
			if offs[pt.topic] == nil {
				offs[pt.topic] = map[int32]kgo.EpochOffset{}
			}
			offs[pt.topic][pt.partition] = pt.next
		}
	}
	if !locked {
		c.mu.Unlock()
	}
	c.commitOffsets(ctx, parts, offs, locked)
}

// commitOffsets commits offs, the final offsets of parts; locked says
// whether the caller holds c.mu.
func (c *Consumer) commitOffsets(ctx context.Context, parts []*part, offs map[string]map[int32]kgo.EpochOffset, locked bool) {
	if len(offs) == 0 {
		return
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.commitWait)
	defer cancel()
	ok := map[tp]int64{}
	c.cl.CommitOffsetsSync(cctx, offs, func(_ *kgo.Client, _ *kmsg.OffsetCommitRequest, resp *kmsg.OffsetCommitResponse, err error) {
		if err != nil {
			c.st.commitErrors.Add(uint64(len(offs)))
			c.cfg.logger.Warn("dedupkafka: offset commit failed (the records are redelivered and found duplicate)", slog.Any("err", err))
			return
		}
		for _, t := range resp.Topics {
			for _, p := range t.Partitions {
				if e := kerr.ErrorForCode(p.ErrorCode); e != nil {
					c.st.commitErrors.Add(1)
					c.cfg.logger.Warn("dedupkafka: offset commit failed", slog.String("topic", t.Topic), slog.Int("partition", int(p.Partition)), slog.Any("err", e))
					continue
				}
				c.st.commits.Add(1)
				ok[tp{t.Topic, p.Partition}] = offs[t.Topic][p.Partition].Offset
			}
		}
	})
	if !locked {
		c.mu.Lock()
		defer c.mu.Unlock()
	}
	for _, pt := range parts {
		if o, found := ok[pt.tp]; found && o > pt.committed {
			pt.committed = o
		}
	}
}

// pauseResume pauses the fetches of held partitions, so no record after a
// held one is polled, and resumes those no longer held.
func (c *Consumer) pauseResume() {
	c.mu.Lock()
	defer c.mu.Unlock()
	pause, resume := map[string][]int32{}, map[string][]int32{}
	for _, pt := range c.parts {
		switch {
		case pt.held && !pt.paused:
			pause[pt.topic] = append(pause[pt.topic], pt.partition)
		case !pt.held && pt.paused:
			resume[pt.topic] = append(resume[pt.topic], pt.partition)
		default:
			continue
		}
		pt.paused = pt.held
	}
	if len(pause) > 0 {
		c.cl.PauseFetchPartitions(pause)
	}
	if len(resume) > 0 {
		c.cl.ResumeFetchPartitions(resume)
	}
}

// revoked runs when a rebalance takes partitions away (and when the
// client leaves the group): it commits what is final of them, never past
// an unfinished record, and drops their unfinished records, which the new
// owner reads again from the committed offset. BlockRebalanceOnPoll makes
// it run only between rounds, never during processing or a commit.
func (c *Consumer) revoked(ctx context.Context, cl *kgo.Client, lost map[string][]int32) {
	c.release(ctx, lost, !c.crashed.Load(), &c.st.revoked)
}

// lost runs when the group membership failed (a session timeout, a
// fencing): the partitions may already belong to another member, so
// nothing is committed; their unfinished records are dropped.
func (c *Consumer) lost(ctx context.Context, cl *kgo.Client, lost map[string][]int32) {
	c.release(ctx, lost, false, &c.st.lost)
}

func (c *Consumer) release(ctx context.Context, tps map[string][]int32, commit bool, n *atomic.Uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var gone []*part
	for t, ps := range tps {
		for _, p := range ps {
			if pt := c.parts[tp{t, p}]; pt != nil {
				gone = append(gone, pt)
			}
			n.Add(1)
		}
	}
	if commit {
		c.commit(ctx, gone, true)
	}
	for _, pt := range gone {
		c.st.dropped.Add(uint64(len(pt.backlog)))
		delete(c.parts, pt.tp)
	}
	if len(tps) > 0 {
		c.cl.ResumeFetchPartitions(tps)
	}
}
