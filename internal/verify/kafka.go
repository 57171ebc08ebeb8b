package verify

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// KafkaOptions configure [RunKafka].
type KafkaOptions struct {
	// Brokers are the seed brokers of a real cluster; empty runs an
	// in-process kfake cluster (franz-go's fake, which speaks the real
	// protocol) with broker faults injected.
	Brokers []string
	// Partitions of the run's topic; 0 means 8.
	Partitions int
	// HardCrashEvery makes every HardCrashEvery-th crash kill the group
	// member outright (its client is closed without committing, the group
	// rebalances and a new member joins); the other crashes restart the
	// member's consumption from its committed offsets without leaving the
	// group. 0 means 16; 1 makes every crash a member death.
	HardCrashEvery int
	// LeaveEvery makes a member leave the group gracefully and a new one
	// join after about every LeaveEvery deliveries (0 means 3000; -1
	// never): a rebalance with no crash, mid-run.
	LeaveEvery int
}

// kafkaGroup is the consumer group of a run.
const kafkaGroup = "dedup-verify"

// RunKafka is [Run] over Kafka. It publishes every message (Dedup-Msg-Id
// set to its ID, the ID as record key; the extra copies of --dup-rate are
// re-sends of the same ID under another record key, so on another
// partition, where another member may run them at the same time), then consumes
// with min(Consumers, Partitions) members of one consumer group, each
// processing its partitions in offset order and committing, after each
// poll, the offsets up to the last contiguous acknowledged record:
//
//   - an acknowledged outcome lets the offset move past the record;
//   - a crash, before or after the store's commit, is a process death: the
//     member commits nothing more; its uncommitted records are read again
//     from the committed offsets (by a new member after a rebalance, for a
//     hard crash);
//   - any other outcome holds the partition and runs the record again
//     after a delay.
//
// Members also leave and join mid-run (LeaveEvery). On the in-process
// cluster, kfake injects broker faults: produce responses lost after the
// write (the idempotent producer's retry must not duplicate) and offset
// commits answered with an error after they were applied, or refused. A
// record counts as acknowledged once the group's committed offset, read
// from the broker, is past it; the run ends when every partition is
// committed to its end.
func RunKafka(ctx context.Context, cfg Config, t Target, opts KafkaOptions) (Report, error) {
	b, err := start(cfg, t, "kafka")
	if err != nil {
		return Report{}, err
	}
	cfg = b.cfg
	parts := opts.Partitions
	if parts == 0 {
		parts = 8
	}
	if parts < 1 || parts > 1000 {
		return Report{}, fmt.Errorf("verify: --partitions must be between 1 and 1000, got %d", parts)
	}
	hard := opts.HardCrashEvery
	if hard <= 0 {
		hard = 16
	}
	leave := opts.LeaveEvery
	if leave == 0 {
		leave = 3000
	}
	topic := "dedup-verify-" + b.runID
	seeds := opts.Brokers
	var fake *kfake.Cluster
	if len(seeds) == 0 {
		fake, err = kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(int32(parts), topic))
		if err != nil {
			return Report{}, fmt.Errorf("verify: start the in-process Kafka cluster: %w", err)
		}
		defer fake.Close()
		seeds = fake.ListenAddrs()
	}
	b.report.Stream = topic
	pub, err := kgo.NewClient(kgo.SeedBrokers(seeds...), kgo.DefaultProduceTopic(topic), kgo.ProducerLinger(0))
	if err != nil {
		return Report{}, fmt.Errorf("verify: Kafka client: %w", err)
	}
	defer pub.Close()
	adm := kadm.NewClient(pub)
	if fake == nil {
		sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		_, err := adm.CreateTopic(sctx, int32(parts), -1, nil, topic)
		cancel()
		if err != nil {
			return Report{}, fmt.Errorf("verify: create topic %s on %v: %w", topic, seeds, err)
		}
		defer func() {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			_, _ = adm.DeleteTopics(dctx, topic)
			_, _ = adm.DeleteGroups(dctx, kafkaGroup)
		}()
	}
	if fake != nil {
		// Produce responses lost after the broker wrote the batch.
		fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.RequestTimedOut, Count: 3})
	}
	seqAt, err := b.publishKafka(ctx, pub, topic)
	if err != nil {
		return b.report, err
	}
	b.report.Deliveries = 0
	if fake != nil {
		// Offset commits: some applied and answered with an error (the
		// member does not know they landed), some refused.
		fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.OffsetCommit}, Err: kerr.RequestTimedOut, Count: 5})
		fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.OffsetCommit}, Err: kerr.CoordinatorLoadInProgress, Count: 5})
	}
	tr := openKafkaTrace(b.runID)
	defer tr.close()
	for p, s := range seqAt {
		for off, seq := range s {
			tr.logf("publish seq=%d p=%d off=%d", seq, p, off)
		}
	}
	ends := make(map[int32]int64, parts)
	for p, s := range seqAt {
		ends[p] = int64(len(s))
	}

	results := make(chan natsSettled, 4*cfg.Consumers)
	mctx, stopMembers := context.WithCancel(ctx)
	defer stopMembers()
	members := min(cfg.Consumers, parts)
	var memberOpts []kgo.Opt
	if fake != nil {
		// The injected commit faults are answered at once, and a member
		// retries its commit before it allows the rebalance that members
		// joining at the start begin: with franz-go's default backoff
		// (250 ms doubling, for a real cluster) a commit that drew four or
		// five of the faults in a row held the whole group for 4-8 s, about
		// one run in five. The in-process cluster needs no such backoff.
		memberOpts = append(memberOpts, kgo.RetryBackoffFn(func(int) time.Duration { return 20 * time.Millisecond }))
	}
	var wg sync.WaitGroup
	var deliveries atomic.Int64
	var seen sync.Map // "p/o" -> deliveries so far
	var memberIDs atomic.Int64
	var skips atomic.Int64
	for i := range members {
		rng := rand.New(rand.NewPCG(cfg.Seed+uint64(i)+1, uint64(i)))
		wg.Go(func() {
			crashes := 0
			for mctx.Err() == nil {
				m := &kafkaMember{id: memberIDs.Add(1), tr: tr, b: b, t: t, rng: rng, seeds: seeds, topic: topic, results: results, seen: &seen,
					deliveries: &deliveries, skips: &skips, leave: leave, hardEvery: hard, crashes: &crashes, opts: memberOpts}
				m.run(mctx)
			}
		})
	}

	watermark := make(map[int32]int64, parts)
	poll := time.NewTicker(20 * time.Millisecond)
	defer poll.Stop()
	tick := time.NewTicker(cfg.ProgressEvery)
	defer tick.Stop()
	stopped := false
	var offErr error
loop:
	for b.done < cfg.Messages {
		select {
		case r := <-results:
			b.report.Deliveries++
			if r.redelivered {
				b.report.Redeliveries++
			}
			b.account(r.s, false)
		case <-poll.C:
			octx, cancel := context.WithTimeout(ctx, 10*time.Second)
			offs, err := adm.FetchOffsets(octx, kafkaGroup)
			cancel()
			if err != nil {
				offErr = err
				continue
			}
			offs.Each(func(o kadm.OffsetResponse) {
				if o.Topic != topic || o.Err != nil {
					return
				}
				if o.At != watermark[o.Partition] {
					tr.logf("fetched-commit p=%d at=%d watermark=%d", o.Partition, o.At, watermark[o.Partition])
				}
				for off := watermark[o.Partition]; off < min(o.At, ends[o.Partition]); off++ {
					seq := seqAt[o.Partition][off]
					b.pending[seq]--
					if b.pending[seq] == 0 {
						b.done++
					}
				}
				watermark[o.Partition] = max(watermark[o.Partition], o.At)
			})
		case <-tick.C:
			b.progress()
		case <-ctx.Done():
			stopped = true
			break loop
		}
	}
	b.progress()
	stopMembers()
	go func() {
		for range results {
		}
	}()
	wg.Wait()
	close(results)
	b.report.SkippedPolls = int(skips.Load())
	if stopped && offErr != nil && b.report.FirstError == "" {
		b.report.FirstError = "read committed offsets: " + offErr.Error()
	}
	return b.conclude(ctx, t, stopped)
}

// publishKafka produces every message and its extra copies and returns,
// by partition, the message of each offset.
func (b *broker) publishKafka(ctx context.Context, cl *kgo.Client, topic string) (map[int32][]int, error) {
	const window = 2000
	seqAt := map[int32][]int{}
	var mu sync.Mutex
	var firstErr error
	var wg sync.WaitGroup
	pub := func(seq int, key string) {
		id := b.msgID(seq)
		r := &kgo.Record{Topic: topic, Key: []byte(key), Value: payloadOf(id, seq),
			Headers: []kgo.RecordHeader{{Key: hdrMsgID, Value: []byte(id)}}}
		wg.Add(1)
		cl.Produce(ctx, r, func(r *kgo.Record, err error) {
			defer wg.Done()
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				if firstErr == nil {
					firstErr = fmt.Errorf("verify: produce %s: %w", id, err)
				}
				return
			}
			s := seqAt[r.Partition]
			for int64(len(s)) <= r.Offset {
				s = append(s, -1)
			}
			s[r.Offset] = seq
			seqAt[r.Partition] = s
		})
	}
	for seq := range b.cfg.Messages {
		b.next = seq + 1
		b.pending[seq] = 1
		id := b.msgID(seq)
		pub(seq, id)
		if b.rng.Float64() < b.cfg.DupRate {
			// The copy is a re-send by another producer instance under
			// another record key: it lands on another partition, so two
			// members can race on the message.
			b.pending[seq]++
			b.report.BrokerDuplicates++
			pub(seq, id+"/resend")
		}
		if seq%window == window-1 {
			wg.Wait()
			b.progress()
		}
	}
	wg.Wait()
	if firstErr != nil {
		return nil, firstErr
	}
	for p, s := range seqAt {
		for off, seq := range s {
			if seq < 0 {
				return nil, fmt.Errorf("verify: partition %d has a record at offset %d that verify did not write (a duplicate from the producer?)", p, off)
			}
		}
	}
	return seqAt, nil
}

// errMemberCrashed ends a member's session without a commit.
var errMemberCrashed = errors.New("verify: member crashed")

// kafkaMember is one consumer-group member's life: from joining to a
// crash, a graceful leave or the end of the run.
type kafkaMember struct {
	id         int64
	tr         *kafkaTrace
	b          *broker
	t          Target
	rng        *rand.Rand
	seeds      []string
	topic      string
	results    chan<- natsSettled
	seen       *sync.Map
	deliveries *atomic.Int64
	leave      int
	hardEvery  int
	crashes    *int
	opts       []kgo.Opt // more client options
	skips      *atomic.Int64

	cl      *kgo.Client
	mu      sync.Mutex
	parts   map[int32]*kafkaPart
	crashed atomic.Bool
}

// kafkaPart is a member's position in one partition.
type kafkaPart struct {
	rewind int64 // first offset not committed by this member
	pos    int64 // the offset the next poll of the partition starts at
	next   kgo.EpochOffset
	dirty  bool
}

func (m *kafkaMember) run(ctx context.Context) {
	opts := []kgo.Opt{kgo.SeedBrokers(m.seeds...), kgo.ConsumerGroup(kafkaGroup), kgo.ConsumeTopics(m.topic),
		kgo.DisableAutoCommit(), kgo.BlockRebalanceOnPoll(),
		kgo.HeartbeatInterval(100 * time.Millisecond), kgo.SessionTimeout(6 * time.Second), kgo.RebalanceTimeout(10 * time.Second),
		kgo.FetchMaxWait(50 * time.Millisecond),
		kgo.OnPartitionsAssigned(func(ctx context.Context, cl *kgo.Client, assigned map[string][]int32) {
			m.tr.logf("m%d assigned %v", m.id, assigned[m.topic])
		}),
		kgo.OnPartitionsRevoked(func(ctx context.Context, cl *kgo.Client, revoked map[string][]int32) {
			m.tr.logf("m%d revoked %v crashed=%v", m.id, revoked[m.topic], m.crashed.Load())
			m.release(ctx, revoked[m.topic], !m.crashed.Load())
		}),
		kgo.OnPartitionsLost(func(ctx context.Context, cl *kgo.Client, lost map[string][]int32) {
			m.tr.logf("m%d lost %v", m.id, lost[m.topic])
			m.release(ctx, lost[m.topic], false)
		}),
	}
	cl, err := kgo.NewClient(append(opts, m.opts...)...)
	if err != nil {
		time.Sleep(50 * time.Millisecond)
		return
	}
	m.cl = cl
	m.parts = map[int32]*kafkaPart{}
	defer cl.Close()
	leaveAt := int64(-1)
	if m.leave > 0 {
		leaveAt = m.deliveries.Load() + int64(m.leave/2+m.rng.IntN(m.leave+1))
	}
	for ctx.Err() == nil {
		fs := cl.PollRecords(ctx, 64)
		if fs.IsClientClosed() {
			return
		}
		fs.EachPartition(func(p kgo.FetchTopicPartition) {
			if len(p.Records) > 0 {
				m.tr.logf("m%d poll p=%d off=%d..%d", m.id, p.Partition, p.Records[0].Offset, p.Records[len(p.Records)-1].Offset)
			}
		})
		fs.EachError(func(_ string, p int32, err error) {
			m.tr.logf("m%d fetch error p=%d: %v", m.id, p, err)
		})
		err := m.round(ctx, fs)
		if errors.Is(err, errMemberCrashed) {
			*m.crashes++
			m.tr.logf("m%d crash hard=%v", m.id, *m.crashes%m.hardEvery == 0)
			if *m.crashes%m.hardEvery == 0 {
				m.crashed.Store(true)
				cl.AllowRebalance()
				return // the process died: Close leaves without a commit
			}
			m.restart()
			cl.AllowRebalance()
			continue
		}
		m.commit(ctx)
		cl.AllowRebalance()
		if leaveAt >= 0 && m.deliveries.Load() >= leaveAt {
			return // a graceful leave: the revocation commits what is final
		}
	}
}

// round runs the records of one poll, partition by partition in offset
// order. It stops at the first crash.
//
// Every partition of the poll is taken in hand before any record runs: the
// client's fetch position has already moved past all the polled records, so
// a crash while running the first partition must rewind the others too
// (restart), or their records would never run and a later commit of those
// partitions would pass over them. A poll that does not start where the
// previous one of the partition ended is a skip the harness cannot judge:
// it is counted (the run fails) and the partition is read again from what
// this member committed.
func (m *kafkaMember) round(ctx context.Context, fs kgo.Fetches) error {
	skipped := false
	m.mu.Lock()
	fs.EachPartition(func(p kgo.FetchTopicPartition) {
		if len(p.Records) == 0 {
			return
		}
		first, last := p.Records[0].Offset, p.Records[len(p.Records)-1].Offset
		st := m.parts[p.Partition]
		if st == nil {
			st = &kafkaPart{rewind: first, pos: first, next: kgo.EpochOffset{Epoch: -1, Offset: -1}}
			m.parts[p.Partition] = st
		}
		if first != st.pos {
			m.tr.logf("m%d skip p=%d polled from %d, expected %d", m.id, p.Partition, first, st.pos)
			m.skips.Add(1)
			skipped = true
		}
		st.pos = last + 1
	})
	m.mu.Unlock()
	if skipped {
		return errMemberCrashed
	}
	var err error
	fs.EachPartition(func(p kgo.FetchTopicPartition) {
		if err != nil || len(p.Records) == 0 {
			return
		}
		m.mu.Lock()
		st := m.parts[p.Partition]
		m.mu.Unlock()
		for _, r := range p.Records {
			if err = m.record(ctx, r, st); err != nil {
				return
			}
		}
		// The partition's records are done: commit them before the next
		// partition's, so a crash there does not send them again.
		m.mu.Lock()
		m.commitLocked(ctx, []int32{p.Partition})
		m.mu.Unlock()
	})
	return err
}

// record runs one record until its outcome lets the offset move past it.
func (m *kafkaMember) record(ctx context.Context, r *kgo.Record, st *kafkaPart) error {
	var id string
	for _, h := range r.Headers {
		if h.Key == hdrMsgID {
			id = string(h.Value)
		}
	}
	seq, ok := m.b.parseMsgID(id)
	if !ok {
		return fmt.Errorf("verify: stray record %q", id)
	}
	lease := m.b.cfg.Lease
	for ctx.Err() == nil {
		k := fmt.Sprintf("%d/%d", r.Partition, r.Offset)
		n := 0
		if v, loaded := m.seen.LoadOrStore(k, 1); loaded {
			n = v.(int)
			m.seen.Store(k, n+1)
		}
		d := m.b.delivery(seq)
		d.Redelivered = n
		d.Fault = faultOf(m.b.cfg, m.rng.Float64())
		start := time.Now()
		res := m.t.Apply(ctx, d)
		m.deliveries.Add(1)
		s := settled{d: d, res: res, took: time.Since(start)}
		select {
		case m.results <- natsSettled{s: s, redelivered: n > 0}:
			m.tr.logf("m%d apply p=%d off=%d seq=%d fault=%v -> %v", m.id, r.Partition, r.Offset, seq, d.Fault, res.Outcome)
		case <-ctx.Done():
			return ctx.Err()
		}
		switch {
		case res.Outcome.acked():
			st.next = kgo.EpochOffset{Epoch: r.LeaderEpoch, Offset: r.Offset + 1}
			st.dirty = true
			return nil
		case res.Outcome == CrashedBeforeCommit || res.Outcome == CrashedAfterCommit:
			return errMemberCrashed
		case res.Outcome == InProgress:
			sleepCtx(ctx, max(res.RetryAfter, lease/20)+time.Duration(m.rng.Int64N(int64(lease/20)+1)))
		default:
			sleepCtx(ctx, lease/20+time.Duration(m.rng.Int64N(int64(lease/20)+1)))
		}
	}
	return ctx.Err()
}

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

// restart is a crash without a rebalance: the member's process restarts
// and reads its partitions again from what it committed, dropping what it
// processed since.
func (m *kafkaMember) restart() {
	m.mu.Lock()
	defer m.mu.Unlock()
	set := map[int32]kgo.EpochOffset{}
	for p, st := range m.parts {
		set[p] = kgo.EpochOffset{Epoch: -1, Offset: st.rewind}
		st.pos, st.next, st.dirty = st.rewind, kgo.EpochOffset{Epoch: -1, Offset: -1}, false
	}
	m.tr.logf("m%d restart set %v", m.id, set)
	if len(set) > 0 {
		m.cl.SetOffsets(map[string]map[int32]kgo.EpochOffset{m.topic: set})
	}
}

// commit commits the final offsets of the member's partitions.
func (m *kafkaMember) commit(ctx context.Context) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.commitLocked(ctx, nil)
}

func (m *kafkaMember) commitLocked(ctx context.Context, only []int32) {
	offs := map[int32]kgo.EpochOffset{}
	for p, st := range m.parts {
		if st.dirty && (only == nil || contains(only, p)) {
			offs[p] = st.next
		}
	}
	if len(offs) == 0 {
		return
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	m.cl.CommitOffsetsSync(cctx, map[string]map[int32]kgo.EpochOffset{m.topic: offs},
		func(_ *kgo.Client, _ *kmsg.OffsetCommitRequest, resp *kmsg.OffsetCommitResponse, err error) {
			m.tr.logf("m%d commit %v err=%v", m.id, offs, err)
			if err != nil {
				return
			}
			for _, t := range resp.Topics {
				for _, p := range t.Partitions {
					m.tr.logf("m%d commit p=%d -> %d code=%d", m.id, p.Partition, offs[p.Partition].Offset, p.ErrorCode)
					if p.ErrorCode == 0 {
						if st := m.parts[p.Partition]; st != nil {
							st.rewind, st.dirty = offs[p.Partition].Offset, false
						}
					}
				}
			}
		})
}

func contains(ps []int32, p int32) bool {
	for _, x := range ps {
		if x == p {
			return true
		}
	}
	return false
}

// release forgets revoked or lost partitions, committing what is final of
// revoked ones first.
func (m *kafkaMember) release(ctx context.Context, ps []int32, commit bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if commit && len(ps) > 0 {
		m.commitLocked(ctx, ps)
	}
	for _, p := range ps {
		delete(m.parts, p)
	}
}

// kafkaTrace records the history of a run's records (publication, polls,
// outcomes, commits, rebalances) to the file named by
// DEDUP_VERIFY_KAFKA_TRACE, to pin down how a lost or doubled message
// came about. Unset, it records nothing.
type kafkaTrace struct {
	mu    sync.Mutex
	start time.Time
	f     *os.File
	w     *bufio.Writer
}

func openKafkaTrace(runID string) *kafkaTrace {
	path := os.Getenv("DEDUP_VERIFY_KAFKA_TRACE")
	if path == "" {
		return nil
	}
	f, err := os.Create(path + "." + runID)
	if err != nil {
		return nil
	}
	return &kafkaTrace{start: time.Now(), f: f, w: bufio.NewWriter(f)}
}

func (tr *kafkaTrace) logf(format string, args ...any) {
	if tr == nil {
		return
	}
	tr.mu.Lock()
	defer tr.mu.Unlock()
	fmt.Fprintf(tr.w, "%9.3f ", time.Since(tr.start).Seconds()*1000)
	fmt.Fprintf(tr.w, format, args...)
	tr.w.WriteByte('\n')
}

func (tr *kafkaTrace) close() {
	if tr == nil {
		return
	}
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.w.Flush()
	tr.f.Close()
}
