package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
)

// countingSource counts the relay's reads ahead.
type countingSource struct {
	*pgstore.OutboxSource
	ahead, kept atomic.Int64
}

func (c *countingSource) FetchNext(ctx context.Context, l outbox.Lease, inflight []outbox.Message, limit int, skip bool) ([]outbox.Message, error) {
	c.ahead.Add(1)
	m, err := c.OutboxSource.FetchNext(ctx, l, inflight, limit, skip)
	if len(m) > 0 {
		c.kept.Add(1)
	}
	return m, err
}

// FetchNext passes over the batch in flight, returns what a read after
// its mark would return first, and lets a row committed late below the
// batch cut its key (it waits for a plain read) instead of being
// overtaken by its key's later rows.
func TestFetchNextSkipsInFlightAndCutsLateKeys(t *testing.T) {
	t.Parallel()
	r := newRig(t, pgstore.WithOutboxPartitions(1))
	ctx := context.Background()
	late, err := r.s.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer late.Rollback(ctx)
	if err := r.s.WriteOutbox(ctx, late, msg("late-a", "a")); err != nil {
		t.Fatal(err)
	}
	for i := range 6 {
		r.write(msg(fmt.Sprint("evt-", i), []string{"a", "b"}[i%2]))
	}
	l, _, err := r.src.Acquire(ctx, "me", 0, 3600e9)
	if err != nil {
		t.Fatal(err)
	}
	first, err := r.src.Fetch(ctx, l, 2, false)
	if err != nil || len(first) != 2 || first[0].ID != "evt-0" || first[1].ID != "evt-1" {
		t.Fatalf("Fetch = %v, %v", ids(first), err)
	}
	next, err := r.src.FetchNext(ctx, l, first, 2, false)
	if err != nil || len(next) != 2 || next[0].ID != "evt-2" || next[1].ID != "evt-3" || len(next[0].Payload) == 0 {
		t.Fatalf("FetchNext = %v, %v; want evt-2, evt-3 with their bodies", ids(next), err)
	}
	// The late row (a lower id than the batch in flight) commits now.
	if err := late.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	next, err = r.src.FetchNext(ctx, l, first, 10, false)
	if err != nil || len(next) != 2 || next[0].ID != "evt-3" || next[1].ID != "evt-5" {
		t.Fatalf("FetchNext after the late commit = %v, %v; want only key b's rows (key a waits behind late-a)", ids(next), err)
	}
	if err := r.src.Mark(ctx, l, []int64{first[0].Seq, first[1].Seq}); err != nil {
		t.Fatal(err)
	}
	plain, err := r.src.Fetch(ctx, l, 10, false)
	if err != nil || len(plain) != 5 || plain[0].ID != "late-a" {
		t.Fatalf("Fetch after the mark = %v, %v; want late-a first", ids(plain), err)
	}
}

func ids(ms []outbox.Message) []string {
	var out []string
	for _, m := range ms {
		out = append(out, m.ID)
	}
	return out
}

// A relay on one partition reads ahead under a backlog, throws the read
// away after a batch with a failure, and still publishes every row with
// each key's messages first acknowledged in order.
func TestReadAheadKeepsOrderThroughFailures(t *testing.T) {
	t.Parallel()
	r := newRig(t, pgstore.WithOutboxPartitions(1))
	if err := r.src.CreateIndex(context.Background()); err != nil {
		t.Fatal(err)
	}
	src := &countingSource{OutboxSource: r.src}
	const n, keys = 600, 7
	var batch []outbox.Message
	for i := range n {
		batch = append(batch, msg(fmt.Sprint("evt-", i), fmt.Sprint("agg-", i%keys)))
	}
	r.write(batch...)
	pub := newFakePub()
	for i := 13; i < n; i += 97 {
		pub.transient[fmt.Sprint("evt-", i)] = 2
	}
	rl, err := outbox.NewRelay(src, pub, outbox.WithBatchSize(25), outbox.WithPollInterval(20e6), outbox.WithLeaseTTL(300e6),
		outbox.WithBackoff(5e6, 20e6))
	if err != nil {
		t.Fatal(err)
	}
	go rl.Run(context.Background())
	t.Cleanup(func() { rl.Close() })
	eventually(t, "every row published", func() bool { return rl.Stats().Published == n })
	if got := len(pub.published()); got != n {
		t.Fatalf("%d distinct messages acknowledged, want %d", got, n)
	}
	checkOrder(t, pub, keys, n)
	if src.ahead.Load() == 0 || src.kept.Load() == 0 {
		t.Fatalf("%d reads ahead, %d kept: the relay never read ahead", src.ahead.Load(), src.kept.Load())
	}
	if rl.Stats().Failed == 0 {
		t.Fatal("no failure recorded: the failure path was not exercised")
	}
}

// markFaults is the real source whose marks fail on cue: every fifth
// mark fails, alternately before the statement (nothing marked) and after
// it (marked, but the relay is told it failed: an unknown outcome). Its
// first marks wait until the publisher has been handed a message past
// the batch being marked, which only a relay that publishes under a mark
// in flight does.
type markFaults struct {
	*pgstore.OutboxSource
	calls, failed, overlapped atomic.Int64
	sent                      *atomic.Int64 // the highest Seq handed to the publisher
}

func (m *markFaults) Mark(ctx context.Context, l outbox.Lease, seqs []int64) error {
	n := m.calls.Add(1)
	if n <= 3 && len(seqs) > 0 {
		// The bound is for a relay that never overlaps (it would wait
		// here forever), not a timing check.
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			if m.sent.Load() > slices.Max(seqs) {
				m.overlapped.Add(1)
				break
			}
		}
	}
	switch {
	case n%10 == 5:
		m.failed.Add(1)
		return errors.New("connection reset before the mark")
	case n%10 == 0:
		if err := m.OutboxSource.Mark(ctx, l, seqs); err != nil {
			return err
		}
		m.failed.Add(1)
		return errors.New("connection reset after the mark")
	}
	return m.OutboxSource.Mark(ctx, l, seqs)
}

// seqPub records the highest Seq it was handed.
type seqPub struct {
	*fakePub
	sent *atomic.Int64
}

func (p seqPub) Publish(ctx context.Context, batch []outbox.Message, results []error) {
	for _, m := range batch {
		if m.Seq > p.sent.Load() {
			p.sent.Store(m.Seq)
		}
	}
	p.fakePub.Publish(ctx, batch, results)
}

// A relay on one partition publishes the next batch while the current
// one's mark is in flight; a mark that fails (before or after its
// statement ran) loses nothing and reorders nothing: the batch and the
// one published under its mark are sent again, in order, and a consumer
// that dedups by message ID applies every message once, each key's in
// the order written.
func TestPipelinedMarkFailureKeepsOrder(t *testing.T) {
	t.Parallel()
	r := newRig(t, pgstore.WithOutboxPartitions(1))
	if err := r.src.CreateIndex(context.Background()); err != nil {
		t.Fatal(err)
	}
	var sent atomic.Int64
	src := &markFaults{OutboxSource: r.src, sent: &sent}
	const n, keys = 600, 7
	var batch []outbox.Message
	for i := range n {
		batch = append(batch, msg(fmt.Sprint("evt-", i), fmt.Sprint("agg-", i%keys)))
	}
	r.write(batch...)
	pub := newFakePub()
	rl, err := outbox.NewRelay(src, seqPub{pub, &sent}, outbox.WithBatchSize(25), outbox.WithPollInterval(20e6), outbox.WithLeaseTTL(300e6),
		outbox.WithBackoff(5e6, 20e6))
	if err != nil {
		t.Fatal(err)
	}
	go rl.Run(context.Background())
	t.Cleanup(func() { rl.Close() })
	eventually(t, "every row marked", func() bool { return r.count(`published_at IS NULL`) == 0 })
	if src.overlapped.Load() == 0 {
		t.Fatal("no mark was in flight while the next batch went to the broker: nothing was pipelined")
	}
	if src.failed.Load() < 2 {
		t.Fatalf("%d marks failed: the failure path was not exercised", src.failed.Load())
	}
	got := pub.published()
	if len(got) != n {
		t.Fatalf("%d distinct messages acknowledged, want %d", len(got), n)
	}
	again := 0
	for _, c := range got {
		if c > 1 {
			again++
		}
	}
	if again == 0 {
		t.Fatal("nothing was sent twice after a failed mark")
	}
	checkOrder(t, pub, keys, n)
}
