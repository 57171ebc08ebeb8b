package layered_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/layered"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/redisstore"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/dedupkit/dedup/storetest"
	"github.com/dedupkit/dedup/window"
	"github.com/redis/rueidis"
)

func mem(t testing.TB, clock dedup.Clock) *memstore.Store {
	s, err := memstore.New(memstore.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func win(t testing.TB, opts ...window.Option) *window.Window {
	w, err := window.New(opts...)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func newLayered(t testing.TB, opts ...layered.Option) *layered.Store {
	s, err := layered.New(opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// TestConformance: window + fast store + durable store together obey the
// whole claim contract.
func TestConformance(t *testing.T) {
	storetest.Run(t, func(t testing.TB, clock *storetest.Clock) dedup.Store {
		return newLayered(t,
			layered.WithWindow(win(t, window.WithClock(clock), window.WithCapacity(1024))),
			layered.WithFast(mem(t, clock), "fast"),
			layered.WithDurable(mem(t, clock), "durable"),
			layered.WithClock(clock))
	}, storetest.Features{ManualClock: true, Extend: true})
}

// TestConformanceWindowAndDurable: a Confirm-mode window straight in
// front of the durable store.
func TestConformanceWindowAndDurable(t *testing.T) {
	storetest.Run(t, func(t testing.TB, clock *storetest.Clock) dedup.Store {
		return newLayered(t,
			layered.WithWindow(win(t, window.WithClock(clock), window.WithMode(window.Confirm), window.WithBloom(1000, 0.01, 4))),
			layered.WithDurable(mem(t, clock), "durable"),
			layered.WithClock(clock))
	}, storetest.Features{ManualClock: true})
}

// ledger is the business side of an inbox test: every effect is a row in
// a table with no unique constraint, so a double effect is two rows.
type ledger struct {
	store *sqlitestore.Store
}

func newLedger(t testing.TB) *ledger {
	s, err := sqlitestore.Open(filepath.Join(t.TempDir(), "durable.db"), sqlitestore.WithSynchronous(sqlitestore.SyncNormal))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if _, err := s.DB().Exec(`CREATE TABLE ledger (msg_id TEXT NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return &ledger{store: s}
}

// deliver runs one delivery of message id through l's inbox behind lay.
func (l *ledger) deliver(ctx context.Context, lay *layered.Store, id string) (dedup.Claim, error) {
	key := dedup.Key{Scope: "orders", ID: id}
	fp := dedup.FingerprintOf([]byte("body-" + id))
	return lay.RunInbox(ctx, key, fp, time.Hour, func(ctx context.Context) (dedup.Claim, error) {
		return l.store.RunInbox(ctx, key, fp, time.Hour, func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
			_, err := tx.ExecContext(ctx, `INSERT INTO ledger (msg_id) VALUES (?)`, id)
			return []byte("ok-" + id), err
		})
	})
}

func (l *ledger) effects(t testing.TB) (rows, distinct int) {
	t.Helper()
	if err := l.store.DB().QueryRow(`SELECT count(*), count(DISTINCT msg_id) FROM ledger`).Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	return rows, distinct
}

func redisFast(t testing.TB, srv *testenv.RedisServer) *redisstore.Store {
	s, err := redisstore.Open(rueidis.ClientOption{InitAddress: srv.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// TestRedisFlushDurableHolds is the failover incident: Redis loses every
// key (FLUSHALL) while messages are redelivered, and the process restarts
// (an empty window). The durable inbox still holds every record, so no
// message is applied twice; the durable duplicates are written back to
// Redis and the window, so the next round stops early again.
func TestRedisFlushDurableHolds(t *testing.T) {
	testenv.Addrs(t, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
	srv := testenv.StartRedis(t, "")
	l := newLedger(t)
	w := win(t)
	lay := newLayered(t, layered.WithWindow(w), layered.WithFast(redisFast(t, srv), "redis"))
	ctx := context.Background()
	const n = 200
	round := func() {
		t.Helper()
		for i := range n {
			c, err := l.deliver(ctx, lay, fmt.Sprint("m", i))
			if err != nil || (c.Outcome != dedup.Acquired && c.Outcome != dedup.Duplicate) {
				t.Fatalf("delivery of m%d: %v %v", i, c.Outcome, err)
			}
		}
	}
	round() // first deliveries: all applied
	round() // redelivered: the window catches them all
	if st := lay.Stats(); st.Window != n {
		t.Fatalf("second round: %+v, want the window to catch %d", st, n)
	}
	srv.CLI("flushall")
	w.Reset() // and the consumer restarted
	round()
	if st := lay.Stats(); st.Durable != n {
		t.Fatalf("after FLUSHALL and a restart: %+v, want the durable store to catch %d", st, n)
	}
	w.Reset()
	round()
	if st := lay.Stats(); st.Fast != n {
		t.Fatalf("after the backfill: %+v, want Redis to catch %d again", st, n)
	}
	if rows, distinct := l.effects(t); rows != n || distinct != n {
		t.Fatalf("ledger has %d rows for %d messages: want exactly %d (one effect each)", rows, distinct, n)
	}
}

// TestFastStoreDownFallsThrough: with Redis gone the layered store keeps
// processing on the durable store; with the durable store gone it fails
// closed.
func TestFastStoreDownFallsThrough(t *testing.T) {
	testenv.Addrs(t, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
	srv := testenv.StartRedis(t, "")
	fast := redisFast(t, srv)
	l := newLedger(t)
	lay := newLayered(t, layered.WithFast(fast, "redis"))
	ctx := context.Background()
	if c, err := l.deliver(ctx, lay, "a"); err != nil || c.Outcome != dedup.Acquired {
		t.Fatalf("with Redis up: %v %v", c.Outcome, err)
	}
	srv.Stop()
	if c, err := l.deliver(ctx, lay, "b"); err != nil || c.Outcome != dedup.Acquired {
		t.Fatalf("with Redis down: %v %v; the durable store must carry on alone", c.Outcome, err)
	}
	if c, err := l.deliver(ctx, lay, "a"); err != nil || c.Outcome != dedup.Duplicate {
		t.Fatalf("a duplicate with Redis down: %v %v", c.Outcome, err)
	}
	if st := lay.Stats(); st.FastErrors == 0 || st.Durable != 1 {
		t.Fatalf("stats %+v: want fast-store errors counted and the duplicate caught by the durable store", st)
	}
	if rows, _ := l.effects(t); rows != 2 {
		t.Fatalf("%d effects, want 2", rows)
	}

	// The durable store down: fail closed, the handler does not run.
	srv2 := testenv.StartRedis(t, "")
	durable := redisFast(t, srv2)
	lease := newLayered(t, layered.WithFast(mem(t, dedup.SystemClock{}), "memory"), layered.WithDurable(durable, "redis"))
	srv2.Stop()
	r, _ := dedup.NewRunner(lease)
	ran := false
	_, err := r.Do(ctx, dedup.Key{Scope: "s", ID: "x"}, "", func(context.Context) ([]byte, error) { ran = true; return nil, nil })
	if !dedup.IsStoreError(err) || ran {
		t.Fatalf("durable store down: %v ran=%v; want a store error and no run", err, ran)
	}
}

// TestBloomFalsePositiveNeverDropsInConfirmMode forces false positives
// with a tiny filter: in Confirm mode every new message is still applied;
// in Lossy mode some are dropped, which is what that mode promises.
func TestBloomFalsePositiveNeverDropsInConfirmMode(t *testing.T) {
	run := func(mode window.Mode) (applied int, st layered.Stats) {
		clock := dedup.SystemClock{}
		w := win(t, window.WithMode(mode), window.WithBloom(16, 0.5, 2), window.WithCapacity(64))
		lay := newLayered(t, layered.WithWindow(w), layered.WithDurable(mem(t, clock), "memory"))
		r, _ := dedup.NewRunner(lay)
		for i := range 2000 {
			res, err := r.Do(context.Background(), dedup.Key{Scope: "s", ID: fmt.Sprint(i)}, "", func(context.Context) ([]byte, error) { return nil, nil })
			if err != nil {
				t.Fatal(err)
			}
			if !res.Duplicate {
				applied++
			}
		}
		return applied, lay.Stats()
	}
	applied, st := run(window.Confirm)
	if applied != 2000 || st.Suspected == 0 {
		t.Fatalf("confirm mode: %d of 2000 new messages applied, %d suspected; want all applied and some false positives forced", applied, st.Suspected)
	}
	applied, st = run(window.Lossy)
	if applied == 2000 || st.Bloom == 0 {
		t.Fatalf("lossy mode with a tiny filter: %d of 2000 applied, %d dropped; want some dropped (the mode's stated cost)", applied, st.Bloom)
	}
	t.Logf("lossy mode with a 16-key filter dropped %d of 2000 new messages", st.Bloom)
}

// TestManyGoroutinesOneKey: 64 deliveries of one message through the whole
// chain apply it once.
func TestManyGoroutinesOneKey(t *testing.T) {
	testenv.Addrs(t, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
	srv := testenv.StartRedis(t, "")
	l := newLedger(t)
	lay := newLayered(t, layered.WithWindow(win(t)), layered.WithFast(redisFast(t, srv), "redis"))
	var wg sync.WaitGroup
	var done atomic.Int32
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for try := 0; try < 500; try++ {
				c, err := l.deliver(context.Background(), lay, "hot")
				if err != nil {
					t.Error(err)
					return
				}
				if c.Outcome == dedup.Acquired || c.Outcome == dedup.Duplicate {
					done.Add(1)
					return
				}
				time.Sleep(5 * time.Millisecond) // in progress elsewhere: nack and retry
			}
		}()
	}
	wg.Wait()
	if rows, _ := l.effects(t); rows != 1 || done.Load() != 64 {
		t.Fatalf("64 deliveries of one message: %d effects, %d answered; want 1 and 64", rows, done.Load())
	}
}

func TestWindowMismatchIsNotADuplicate(t *testing.T) {
	clock := storetest.NewClock()
	lay := newLayered(t, layered.WithWindow(win(t, window.WithClock(clock))), layered.WithDurable(mem(t, clock), "memory"), layered.WithClock(clock))
	ctx := context.Background()
	k := dedup.Key{Scope: "s", ID: "k"}
	c, _ := lay.Claim(ctx, k, "sha256:a", time.Minute)
	if err := lay.Complete(ctx, c, []byte("for a"), time.Hour); err != nil {
		t.Fatal(err)
	}
	if d, _ := lay.Claim(ctx, k, "sha256:a", time.Minute); d.Outcome != dedup.Duplicate || lay.Stats().Window != 1 {
		t.Fatalf("same fingerprint: %v, stats %+v; want a window duplicate", d.Outcome, lay.Stats())
	}
	if m, _ := lay.Claim(ctx, k, "sha256:b", time.Minute); m.Outcome != dedup.Mismatch {
		t.Fatalf("another fingerprint: %v, want a mismatch from the store, never the window's duplicate", m.Outcome)
	}
}

func TestNewRejectsBadOptions(t *testing.T) {
	for name, opts := range map[string][]layered.Option{
		"no layer":   nil,
		"same names": {layered.WithFast(mem(t, dedup.SystemClock{}), "x"), layered.WithDurable(mem(t, dedup.SystemClock{}), "x")},
		"zero lease": {layered.WithDurable(mem(t, dedup.SystemClock{}), "d"), layered.WithInboxLease(0)},
		"nil clock":  {layered.WithDurable(mem(t, dedup.SystemClock{}), "d"), layered.WithClock(nil)},
		"fast and filter": {layered.WithFast(mem(t, dedup.SystemClock{}), "f"), layered.WithFilter(newMemFilter(), "f2"),
			layered.WithDurable(mem(t, dedup.SystemClock{}), "d")},
	} {
		if _, err := layered.New(opts...); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("%s: %v, want ErrInvalidArgument", name, err)
		}
	}
}
