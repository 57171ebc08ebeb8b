package outbox_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
)

// memSource is a one-partition outbox in memory, a Notifier whose
// notifications the test sends: for the relay's scheduling only, under
// synctest's clock (the relay's SQL is tested against PostgreSQL).
type memSource struct {
	mu      sync.Mutex
	rows    []outbox.Message
	wake    func()
	broken  bool // Listen fails
	fail    chan error
	fetches atomic.Int64
}

func (m *memSource) Partitions() int { return 1 }
func (m *memSource) Join(context.Context, string, time.Duration) (int, error) {
	return 1, nil
}
func (m *memSource) Leave(context.Context, string) error { return nil }
func (m *memSource) Acquire(_ context.Context, relay string, p int, ttl time.Duration) (outbox.Lease, bool, error) {
	return outbox.Lease{Partition: p, Owner: relay, Epoch: 1, Until: time.Now().Add(ttl)}, true, nil
}
func (m *memSource) Release(context.Context, outbox.Lease) error { return nil }
func (m *memSource) Fetch(_ context.Context, _ outbox.Lease, limit int, _ bool) ([]outbox.Message, error) {
	m.fetches.Add(1)
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.rows[:min(limit, len(m.rows))]), nil
}
func (m *memSource) Mark(_ context.Context, _ outbox.Lease, seqs []int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.rows = slices.DeleteFunc(m.rows, func(r outbox.Message) bool { return slices.Contains(seqs, r.Seq) })
	return nil
}
func (m *memSource) Fail(context.Context, outbox.Lease, []outbox.Failure) error { return nil }

// Listen calls wake at once, keeps it for notify, and returns when ctx is
// done or fail is called; while broken it fails at once.
func (m *memSource) Listen(ctx context.Context, wake func()) error {
	m.mu.Lock()
	if m.broken {
		m.mu.Unlock()
		return errors.New("listen: connection refused")
	}
	m.wake = wake
	m.mu.Unlock()
	wake()
	select {
	case <-ctx.Done():
		return nil
	case err := <-m.fail:
		return err
	}
}

// insert writes a row and notifies, as the outbox table's trigger does.
func (m *memSource) insert(msg outbox.Message) {
	m.mu.Lock()
	m.rows = append(m.rows, msg)
	wake := m.wake
	m.mu.Unlock()
	wake()
}

type memPub struct{ got atomic.Int64 }

func (p *memPub) Publish(_ context.Context, batch []outbox.Message, results []error) {
	p.got.Add(int64(len(batch)))
	clear(results)
}

// An idle partition of a relay that listens backs its polls off (from
// the poll interval, doubling, to the minimum retry backoff), a new row's
// notification still reads it at once, and once notifications stop
// coming (the listener failed) it reads at once. Time is
// synctest's: the counts are exact for the schedule, not timings.
func TestIdlePartitionBacksOffWhileListening(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := &memSource{fail: make(chan error)}
		pub := &memPub{}
		rl, err := outbox.NewRelay(src, pub, outbox.WithRelayID("idle"), outbox.WithPollInterval(time.Millisecond),
			outbox.WithBackoff(100*time.Millisecond, time.Second), outbox.WithLeaseTTL(time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- rl.Run(ctx) }()
		defer func() {
			cancel()
			if err := <-done; err != nil {
				t.Error(err)
			}
		}()

		time.Sleep(10 * time.Second)
		synctest.Wait()
		// Polling every 1ms would be ~10,000 reads; backing off to 100ms
		// it is ~100 (1+2+...+64 ms, then every 100 ms).
		if n := src.fetches.Load(); n > 150 {
			t.Fatalf("idle partition read %d times in 10s of a 1ms poll while listening, want <= 150 (backed off to 100ms)", n)
		}

		// A notified row is read without waiting for the backed-off poll.
		at := time.Now()
		src.insert(outbox.Message{Seq: 1, ID: "evt-1", Key: "k", Topic: "t", Payload: []byte{}})
		synctest.Wait()
		if pub.got.Load() != 1 || !time.Now().Equal(at) {
			t.Fatalf("after the notification: %d published, %v later; want 1 at once", pub.got.Load(), time.Since(at))
		}

		// The listener's connection fails: notifications may have been
		// lost, so the partition reads at once, without waiting for the
		// backed-off poll.
		before := src.fetches.Load()
		at = time.Now()
		src.mu.Lock()
		src.broken = true
		src.mu.Unlock()
		src.fail <- errors.New("listen: connection reset")
		synctest.Wait()
		if src.fetches.Load() == before || !time.Now().Equal(at) {
			t.Fatalf("listener failed: %d reads after %v, want a read at once", src.fetches.Load()-before, time.Since(at))
		}
	})
}

// Without notifications (poll-only, or while the listener is down) an
// idle partition polls at the poll interval.
func TestIdlePartitionPollsWithoutNotifications(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := &memSource{fail: make(chan error)}
		rl, err := outbox.NewRelay(src, &memPub{}, outbox.WithRelayID("idle"), outbox.WithPollInterval(time.Millisecond),
			outbox.WithBackoff(100*time.Millisecond, time.Second), outbox.WithLeaseTTL(time.Hour), outbox.WithPollOnly())
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- rl.Run(ctx) }()
		time.Sleep(time.Second)
		synctest.Wait()
		if n := src.fetches.Load(); n < 900 {
			t.Errorf("poll-only idle partition read %d times in 1s of a 1ms poll, want >= 900", n)
		}
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
}

// On PostgreSQL, with polls (and the listener's reconnection, a poll
// interval after its loss) far beyond the test, a row that notified
// nobody (written with the table's triggers disabled) is published once
// the listener's connection is killed: every partition reads at once when
// notifications may have been lost.
func TestListenerLossReadsRowsThatNotifiedNobody(t *testing.T) {
	t.Parallel()
	r := newRig(t, pgstore.WithOutboxPartitions(2))
	pub := newFakePub()
	rl, _ := r.run(pub, outbox.WithPollInterval(time.Hour), outbox.WithBackoff(time.Hour, time.Hour), outbox.WithLeaseTTL(time.Hour))
	eventually(t, "partitions held", func() bool { return rl.Stats().Partitions == 2 })
	// A notified row: the relay listens.
	r.write(msg("evt-0", "k0"))
	eventually(t, "the notified row published", func() bool { return pub.published()["evt-0"] == 1 })

	ctx := context.Background()
	ob := r.s.Tables().Outbox
	if err := pgx.BeginFunc(ctx, r.s.Pool(), func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `ALTER TABLE `+ob+` DISABLE TRIGGER USER`); err != nil {
			return err
		}
		if err := r.s.WriteOutbox(ctx, tx, msg("silent", "k1")); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `ALTER TABLE `+ob+` ENABLE TRIGGER USER`)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	var killed int
	if err := r.s.Pool().QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = current_database() AND query = 'LISTEN ' || quote_ident($1)`, r.s.OutboxChannel()).Scan(&killed); err != nil || killed != 1 {
		t.Fatalf("killed %d listeners, %v; want 1", killed, err)
	}
	eventually(t, "the silent row published after the listener's loss", func() bool { return pub.published()["silent"] == 1 })
}
