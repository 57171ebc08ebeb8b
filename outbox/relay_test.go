package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
)

// rig is an outbox in a fresh PostgreSQL schema.
type rig struct {
	t   testing.TB
	s   *pgstore.Store
	src *pgstore.OutboxSource
}

func newRig(t testing.TB, opts ...pgstore.OutboxOption) *rig {
	t.Helper()
	pool := testenv.PostgresPool(t)
	s, err := pgstore.New(pool, pgstore.WithSchema(testenv.PostgresSchema(t, pool)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if _, err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	src, err := s.OutboxSource(opts...)
	if err != nil {
		t.Fatal(err)
	}
	return &rig{t: t, s: s, src: src}
}

// write commits msgs in one transaction.
func (r *rig) write(msgs ...outbox.Message) {
	r.t.Helper()
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, r.s.Pool(), func(tx pgx.Tx) error { return r.s.WriteOutbox(ctx, tx, msgs...) }); err != nil {
		r.t.Fatal(err)
	}
}

func (r *rig) count(where string) int {
	r.t.Helper()
	var n int
	if err := r.s.Pool().QueryRow(context.Background(), `SELECT count(*) FROM `+r.s.Tables().Outbox+` WHERE `+where).Scan(&n); err != nil {
		r.t.Fatal(err)
	}
	return n
}

// run starts a relay; it is closed when the test ends. The returned
// channel gets Run's error.
func (r *rig) run(pub outbox.Publisher, opts ...outbox.Option) (*outbox.Relay, chan error) {
	r.t.Helper()
	rl, err := outbox.NewRelay(r.src, pub, append([]outbox.Option{outbox.WithLeaseTTL(300 * time.Millisecond), outbox.WithPollInterval(20 * time.Millisecond),
		outbox.WithBackoff(5*time.Millisecond, 20*time.Millisecond)}, opts...)...)
	if err != nil {
		r.t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { errc <- rl.Run(context.Background()) }()
	r.t.Cleanup(func() { rl.Close() })
	return rl, errc
}

// eventually waits for cond, failing the test after a generous bound (a
// hang, not a timing check).
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("never happened: %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// fakePub acknowledges everything but the IDs told to fail, and logs
// each publish in order.
type fakePub struct {
	mu        sync.Mutex
	log       []outbox.Message
	permanent map[string]bool
	transient map[string]int // failures left
	always    map[string]bool
}

func newFakePub() *fakePub {
	return &fakePub{permanent: map[string]bool{}, transient: map[string]int{}, always: map[string]bool{}}
}

func (p *fakePub) Publish(ctx context.Context, batch []outbox.Message, results []error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	// Like an adapter: once a send fails, no later message of its key is
	// sent in this call.
	stopped := map[string]bool{}
	for i, m := range batch {
		switch {
		case stopped[m.Key]:
			results[i] = outbox.ErrNotSent
			continue
		case p.permanent[m.ID]:
			results[i] = outbox.Permanent(errors.New("rejected by the broker"))
		case p.always[m.ID]:
			results[i] = errors.New("broker unavailable")
		case p.transient[m.ID] > 0:
			p.transient[m.ID]--
			results[i] = errors.New("send failed")
		default:
			p.log = append(p.log, m)
			continue
		}
		stopped[m.Key] = true
	}
}

// published returns how many times each ID was acknowledged.
func (p *fakePub) published() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := map[string]int{}
	for _, m := range p.log {
		out[m.ID]++
	}
	return out
}

// firstOrder returns, per key, the IDs in the order of their first
// acknowledgement.
func (p *fakePub) firstOrder() map[string][]string {
	p.mu.Lock()
	defer p.mu.Unlock()
	seen := map[string]bool{}
	out := map[string][]string{}
	for _, m := range p.log {
		if !seen[m.ID] {
			seen[m.ID] = true
			out[m.Key] = append(out[m.Key], m.ID)
		}
	}
	return out
}

func msg(id, key string) outbox.Message {
	return outbox.Message{ID: id, Topic: "orders.events", Key: key, Payload: []byte(id)}
}

// A transaction that took a lower id and commits after a higher one was
// published is published too: the relay reads unpublished rows, not rows
// past a cursor.
func TestLateCommitLowerIDIsPublished(t *testing.T) {
	t.Parallel()
	r := newRig(t, pgstore.WithOutboxPartitions(1))
	ctx := context.Background()
	late, err := r.s.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer late.Rollback(ctx)
	if err := r.s.WriteOutbox(ctx, late, msg("late", "a")); err != nil {
		t.Fatal(err)
	}
	r.write(msg("early", "b"))
	pub := newFakePub()
	r.run(pub)
	eventually(t, "the committed higher id published", func() bool { return pub.published()["early"] == 1 })
	if pub.published()["late"] != 0 {
		t.Fatal("an uncommitted row was published")
	}
	if err := late.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the late-committing lower id published", func() bool { return pub.published()["late"] == 1 })
	var lateID, earlyID int64
	r.s.Pool().QueryRow(ctx, `SELECT (SELECT id FROM `+r.s.Tables().Outbox+` WHERE message_key='late'), (SELECT id FROM `+r.s.Tables().Outbox+` WHERE message_key='early')`).Scan(&lateID, &earlyID)
	if lateID >= earlyID {
		t.Fatalf("the late row has id %d, the early %d: the test did not build the trap", lateID, earlyID)
	}
}

// A rolled-back transaction's messages are never published.
func TestRollbackPublishesNothing(t *testing.T) {
	t.Parallel()
	r := newRig(t, pgstore.WithOutboxPartitions(2))
	ctx := context.Background()
	pub := newFakePub()
	rl, _ := r.run(pub)
	for i := range 20 {
		tx, err := r.s.Pool().Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := r.s.WriteOutbox(ctx, tx, msg(fmt.Sprint("rb-", i), "k")); err != nil {
			t.Fatal(err)
		}
		tx.Rollback(ctx)
		r.write(msg(fmt.Sprint("ok-", i), "k"))
	}
	eventually(t, "the committed messages published", func() bool { return len(pub.published()) == 20 })
	for id := range pub.published() {
		if id[:2] != "ok" {
			t.Fatalf("rolled-back message %s was published", id)
		}
	}
	// The publisher saw them before the relay marked them: wait for the
	// marks.
	eventually(t, "every committed row marked", func() bool { return r.count(`published_at IS NULL`) == 0 })
	// The relay counts a batch after its mark statement returns: wait for
	// the count too.
	eventually(t, "20 published in the relay's stats", func() bool { return rl.Stats().Published == 20 })
	if st := rl.Stats(); st.Lag <= 0 || st.Published != 20 {
		t.Fatalf("stats %+v: want 20 published and a commit-to-publish lag", st)
	}
}

// A relay that dies between the broker's acknowledgement and the mark
// leaves the rows unmarked; the relay that takes its partitions over
// sends them again under the same IDs, and a consumer with dedup applies
// each once.
func TestCrashAfterAckBeforeMark(t *testing.T) {
	t.Parallel()
	r := newRig(t, pgstore.WithOutboxPartitions(4))
	const n = 200
	for i := range n {
		r.write(msg(fmt.Sprint("evt-", i), fmt.Sprint("agg-", i%10)))
	}
	pub := newFakePub()
	boom := errors.New("killed after the ack")
	var once sync.Once
	_, errc := r.run(pub, outbox.WithRelayID("doomed"), outbox.WithBatchSize(50), outbox.WithMarkHook(func(int, []outbox.Message) error {
		var err error
		once.Do(func() { err = boom })
		return err
	}))
	if err := <-errc; !errors.Is(err, boom) {
		t.Fatalf("Run = %v, want the hook's error", err)
	}
	// Rows the broker acknowledged that were never marked: the window.
	window := 0
	for id := range pub.published() {
		window += r.count(`published_at IS NULL AND message_key = '` + id + `'`)
	}
	if window == 0 {
		t.Fatal("no acknowledged row left unmarked: the crash window was not exercised")
	}
	r.run(pub, outbox.WithRelayID("heir"))
	eventually(t, "every row published after the take-over", func() bool { return r.count(`published_at IS NULL`) == 0 })
	resent := 0
	for _, c := range pub.published() {
		if c > 1 {
			resent++
		}
	}
	if resent == 0 {
		t.Fatal("nothing was sent twice: the crash window was not exercised")
	}
	// The consumer side: dedup on the message ID.
	store, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	applied := map[string]int{}
	pub.mu.Lock()
	log := append([]outbox.Message(nil), pub.log...)
	pub.mu.Unlock()
	for _, m := range log {
		c, err := store.Claim(context.Background(), dedup.Key{Scope: "consumer", ID: m.ID}, "", time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if c.Outcome == dedup.Acquired {
			applied[m.ID]++
			if err := store.Complete(context.Background(), c, nil, time.Hour); err != nil {
				t.Fatal(err)
			}
		}
	}
	for i := range n {
		if applied[fmt.Sprint("evt-", i)] != 1 {
			t.Fatalf("evt-%d applied %d times", i, applied[fmt.Sprint("evt-", i)])
		}
	}
	checkOrder(t, pub, 10, n)
}

// checkOrder checks that each key's messages were first acknowledged in
// the order they were written (evt-i for key agg-(i mod keys)).
func checkOrder(t *testing.T, pub *fakePub, keys, n int) {
	t.Helper()
	for k, ids := range pub.firstOrder() {
		last := -1
		for _, id := range ids {
			var i int
			fmt.Sscanf(id, "evt-%d", &i)
			if i <= last {
				t.Fatalf("key %s: %s after evt-%d", k, id, last)
			}
			last = i
		}
	}
}

// Two and four relays split the partitions in fair shares; when one is
// killed (no lease released) the others take its partitions over, every
// row is published and each key keeps its order.
func TestRelaysSplitAndTakeOver(t *testing.T) {
	for _, relays := range []int{2, 4} {
		t.Run(fmt.Sprint(relays, "relays"), func(t *testing.T) {
			t.Parallel()
			const parts = 8
			r := newRig(t, pgstore.WithOutboxPartitions(parts))
			if err := r.src.CreateIndex(context.Background()); err != nil {
				t.Fatal(err)
			}
			pub := newFakePub()
			boom := errors.New("killed")
			var kill sync.Once
			killNow := make(chan struct{})
			var rls []*outbox.Relay
			var victimErr chan error
			for i := range relays {
				opts := []outbox.Option{outbox.WithRelayID(fmt.Sprint("relay-", i)), outbox.WithBatchSize(20)}
				if i == 0 {
					opts = append(opts, outbox.WithMarkHook(func(int, []outbox.Message) error {
						select {
						case <-killNow:
							var err error
							kill.Do(func() { err = boom })
							return err
						default:
							return nil
						}
					}))
				}
				rl, errc := r.run(pub, opts...)
				rls = append(rls, rl)
				if i == 0 {
					victimErr = errc
				}
			}
			fair := (parts + relays - 1) / relays
			eventually(t, "each relay holds its fair share", func() bool {
				total := 0
				for _, rl := range rls {
					p := rl.Stats().Partitions
					if p > fair {
						return false
					}
					total += p
				}
				return total == parts
			})
			const n = 400
			for i := range n / 2 {
				r.write(msg(fmt.Sprint("evt-", i), fmt.Sprint("agg-", i%16)))
			}
			eventually(t, "the first half published", func() bool { return r.count(`published_at IS NULL`) == 0 })
			close(killNow)
			for i := n / 2; i < n; i++ {
				r.write(msg(fmt.Sprint("evt-", i), fmt.Sprint("agg-", i%16)))
			}
			if rls[0].Stats().Partitions > 0 {
				if err := <-victimErr; !errors.Is(err, boom) {
					t.Fatalf("the killed relay's Run = %v", err)
				}
			}
			eventually(t, "every row published by the survivors", func() bool { return r.count(`published_at IS NULL`) == 0 })
			eventually(t, "the survivors hold every partition", func() bool {
				total := 0
				for _, rl := range rls[1:] {
					total += rl.Stats().Partitions
				}
				return total == parts
			})
			if got := len(pub.published()); got != n {
				t.Fatalf("%d distinct messages published, want %d", got, n)
			}
			checkOrder(t, pub, 16, n)
		})
	}
}

// A relay whose lease was taken over can neither mark nor record a
// failure: the statements are fenced by the epoch.
func TestFencedRelayCannotMark(t *testing.T) {
	t.Parallel()
	r := newRig(t, pgstore.WithOutboxPartitions(1))
	ctx := context.Background()
	r.write(msg("evt-1", "a"))
	old, ok, err := r.src.Acquire(ctx, "old", 0, time.Millisecond)
	if err != nil || !ok {
		t.Fatal(ok, err)
	}
	msgs, err := r.src.Fetch(ctx, old, 10, false)
	if err != nil || len(msgs) != 1 {
		t.Fatal(len(msgs), err)
	}
	var heir outbox.Lease
	eventually(t, "the expired lease taken over", func() bool {
		heir, ok, err = r.src.Acquire(ctx, "heir", 0, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		return ok
	})
	if heir.Epoch <= old.Epoch {
		t.Fatalf("take-over epoch %d, old %d", heir.Epoch, old.Epoch)
	}
	if err := r.src.Mark(ctx, old, []int64{msgs[0].Seq}); !errors.Is(err, outbox.ErrLeaseLost) {
		t.Fatalf("fenced Mark = %v, want ErrLeaseLost", err)
	}
	if err := r.src.Fail(ctx, old, []outbox.Failure{{Seq: msgs[0].Seq, Err: "x", Quarantine: true}}); !errors.Is(err, outbox.ErrLeaseLost) {
		t.Fatalf("fenced Fail = %v, want ErrLeaseLost", err)
	}
	if _, ok, _ := r.src.Acquire(ctx, "old", 0, time.Hour); ok {
		t.Fatal("the old relay took a live lease back")
	}
	if n := r.count(`published_at IS NULL AND quarantined_at IS NULL AND attempts = 0`); n != 1 {
		t.Fatal("the fenced relay changed the row")
	}
	if err := r.src.Mark(ctx, heir, []int64{msgs[0].Seq}); err != nil {
		t.Fatal(err)
	}
	if n := r.count(`published_at IS NOT NULL`); n != 1 {
		t.Fatal("the owner could not mark")
	}
}

// A poison message is quarantined with its error and attempt count; other
// keys flow; its own key waits (Block) or goes on (Skip).
func TestPoisonQuarantine(t *testing.T) {
	for _, policy := range []outbox.Policy{outbox.Block, outbox.Skip} {
		t.Run(map[outbox.Policy]string{outbox.Block: "block", outbox.Skip: "skip"}[policy], func(t *testing.T) {
			t.Parallel()
			r := newRig(t, pgstore.WithOutboxPartitions(2))
			pub := newFakePub()
			pub.permanent["a-1"] = true
			pub.always["c-1"] = true
			r.write(msg("a-0", "a"), msg("a-1", "a"), msg("a-2", "a"), msg("b-0", "b"), msg("b-1", "b"),
				msg("c-1", "c"), msg("c-2", "c"))
			rl, _ := r.run(pub, outbox.WithPoisonPolicy(policy), outbox.WithMaxAttempts(3))
			eventually(t, "both poison rows quarantined", func() bool { return r.count(`quarantined_at IS NOT NULL`) == 2 })
			eventually(t, "the other key flows", func() bool { p := pub.published(); return p["b-0"] == 1 && p["b-1"] == 1 && p["a-0"] == 1 })
			var attemptsA, attemptsC int
			var errA string
			r.s.Pool().QueryRow(context.Background(), `SELECT (SELECT attempts FROM `+r.s.Tables().Outbox+` WHERE message_key='a-1'),
				(SELECT last_error FROM `+r.s.Tables().Outbox+` WHERE message_key='a-1'),
				(SELECT attempts FROM `+r.s.Tables().Outbox+` WHERE message_key='c-1')`).Scan(&attemptsA, &errA, &attemptsC)
			if attemptsA != 1 || attemptsC != 3 || errA == "" {
				t.Fatalf("a-1: %d attempts, error %q; c-1: %d attempts; want 1 (permanent), an error, 3 (max)", attemptsA, errA, attemptsC)
			}
			if policy == outbox.Skip {
				eventually(t, "the poisoned keys go on", func() bool { p := pub.published(); return p["a-2"] >= 1 && p["c-2"] >= 1 })
			} else {
				// Let the relay poll a few more times, counted, then
				// check the keys still wait.
				f := rl.Stats().Fetches
				eventually(t, "more polls of the partitions", func() bool { return rl.Stats().Fetches >= f+10 })
				if n := r.count(`published_at IS NULL`); n != 4 {
					t.Fatalf("%d rows unpublished, want the 2 quarantined and the 2 behind them", n)
				}
				if p := pub.published(); p["a-2"] != 0 || p["c-2"] != 0 {
					t.Fatal("a message of a blocked key was published behind its quarantined one")
				}
			}
			eventually(t, "2 quarantined in the relay's stats", func() bool { return rl.Stats().Quarantined == 2 })
		})
	}
}

// With a poll interval far beyond the test, only LISTEN/NOTIFY can wake
// the relay; poll-only mode publishes by polling.
func TestWakeUp(t *testing.T) {
	t.Run("notify", func(t *testing.T) {
		t.Parallel()
		r := newRig(t, pgstore.WithOutboxPartitions(2))
		pub := newFakePub()
		rl, _ := r.run(pub, outbox.WithPollInterval(time.Hour), outbox.WithLeaseTTL(time.Hour))
		eventually(t, "partitions held", func() bool { return rl.Stats().Partitions == 2 })
		// Give the listener its LISTEN: a row written before it would be
		// found by the wake-up Listen makes after LISTEN anyway.
		for i := range 5 {
			r.write(msg(fmt.Sprint("evt-", i), fmt.Sprint("k", i)))
		}
		eventually(t, "published on notification", func() bool { return len(pub.published()) == 5 })
	})
	t.Run("poll-only", func(t *testing.T) {
		t.Parallel()
		r := newRig(t, pgstore.WithOutboxPartitions(2))
		pub := newFakePub()
		rl, _ := r.run(pub, outbox.WithPollOnly())
		eventually(t, "partitions held", func() bool { return rl.Stats().Partitions == 2 })
		for i := range 5 {
			r.write(msg(fmt.Sprint("evt-", i), fmt.Sprint("k", i)))
		}
		eventually(t, "published by polling", func() bool { return len(pub.published()) == 5 })
	})
}

// Pruning deletes published rows only.
func TestRetentionKeepsUnpublished(t *testing.T) {
	t.Parallel()
	r := newRig(t, pgstore.WithOutboxPartitions(1))
	ctx := context.Background()
	for i := range 10 {
		r.write(msg(fmt.Sprint("evt-", i), "k"))
	}
	l, _, err := r.src.Acquire(ctx, "me", 0, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := r.src.Fetch(ctx, l, 4, false)
	if err != nil || len(msgs) != 4 {
		t.Fatal(len(msgs), err)
	}
	if err := r.src.Mark(ctx, l, []int64{msgs[0].Seq, msgs[1].Seq, msgs[2].Seq}); err != nil {
		t.Fatal(err)
	}
	if err := r.src.Fail(ctx, l, []outbox.Failure{{Seq: msgs[3].Seq, Err: "poison", Quarantine: true}}); err != nil {
		t.Fatal(err)
	}
	n, err := r.src.Prune(ctx, 0, 100)
	if err != nil || n != 3 {
		t.Fatalf("Prune = %d, %v; want the 3 published rows", n, err)
	}
	if got := r.count(`true`); got != 7 {
		t.Fatalf("%d rows left, want the 7 unpublished (one quarantined)", got)
	}
	if n, _ := r.src.Prune(ctx, 0, 100); n != 0 {
		t.Fatalf("a second prune deleted %d", n)
	}
}

// Bad messages are refused before any I/O: the caller's transaction is
// still usable, and nothing is written.
func TestBadMessagesRejectedBeforeIO(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	ctx := context.Background()
	bad := []outbox.Message{
		{Topic: ""},
		{Topic: "has space"},
		{Topic: "t", ID: "bad id"},
		{Topic: "t", Key: "nul\x00"},
		{Topic: "t", Headers: map[string]string{"x": "a\r\nb"}},
		{Topic: "t", Headers: map[string]string{"": "v"}},
		{Topic: "t", Payload: make([]byte, outbox.MaxPayloadSize+1)},
	}
	tx, err := r.s.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	for i, m := range bad {
		if err := r.s.WriteOutbox(ctx, tx, msg("good", "k"), m); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Fatalf("bad message %d: %v, want ErrInvalidArgument", i, err)
		}
		var b pgx.Batch
		if err := r.s.QueueOutbox(&b, m); !errors.Is(err, dedup.ErrInvalidArgument) || b.Len() != 0 {
			t.Fatalf("QueueOutbox of bad message %d: %v, %d queued", i, err, b.Len())
		}
	}
	if _, err := tx.Exec(ctx, `SELECT 1`); err != nil {
		t.Fatalf("the transaction was aborted: %v", err)
	}
	tx.Commit(ctx)
	if n := r.count(`true`); n != 0 {
		t.Fatalf("%d rows written", n)
	}
	if err := r.s.WriteOutbox(ctx, nil, msg("x", "k")); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Fatalf("nil tx: %v", err)
	}
}
