package layered_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/layered"
	"github.com/dedupkit/dedup/layered/redisfilter"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/dedupkit/dedup/storetest"
	"github.com/dedupkit/dedup/window"
	"github.com/jackc/pgx/v5"
	"github.com/redis/rueidis"
)

// memFilter is an in-process layered.Filter for the tests that need no
// Redis: the layered store checks entries' expiry itself.
type memFilter struct {
	mu      sync.Mutex
	m       map[dedup.Key][]byte
	lookups atomic.Int64
}

func newMemFilter() *memFilter { return &memFilter{m: map[dedup.Key][]byte{}} }

func (f *memFilter) Lookup(ctx context.Context, k dedup.Key) ([]byte, bool, error) {
	f.lookups.Add(1)
	f.mu.Lock()
	defer f.mu.Unlock()
	v, ok := f.m[k]
	return v, ok, nil
}

func (f *memFilter) Remember(ctx context.Context, es []layered.FilterEntry) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, e := range es {
		f.m[e.Key] = append([]byte(nil), e.Value...)
	}
	return nil
}

func (f *memFilter) reset() {
	f.mu.Lock()
	clear(f.m)
	f.mu.Unlock()
}

func redisFilter(t testing.TB, addrs []string) *redisfilter.Filter {
	f, err := redisfilter.Open(rueidis.ClientOption{InitAddress: addrs},
		redisfilter.WithPrefix(fmt.Sprintf("layered-filter-%016x:", rand.Uint64())))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// TestConformanceFilter: window + filter + durable store obey the whole
// claim contract (the filter never claims, so every answer but a
// duplicate is the durable store's).
func TestConformanceFilter(t *testing.T) {
	storetest.Run(t, func(t testing.TB, clock *storetest.Clock) dedup.Store {
		return newLayered(t,
			layered.WithWindow(win(t, window.WithClock(clock), window.WithCapacity(1024))),
			layered.WithFilter(newMemFilter(), "filter"),
			layered.WithDurable(mem(t, clock), "durable"),
			layered.WithClock(clock))
	}, storetest.Features{ManualClock: true, Extend: true})
}

// TestConformanceRedisFilterPostgres: the same over the real Redis filter
// and the real PostgreSQL store, the history check included.
func TestConformanceRedisFilterPostgres(t *testing.T) {
	addrs := testenv.Addrs(t, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
	pool := testenv.PostgresPool(t)
	schema := testenv.PostgresSchema(t, pool)
	mig, err := pgstore.New(pool, pgstore.WithSchema(schema))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := mig.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	mig.Close()
	storetest.Run(t, func(t testing.TB, _ *storetest.Clock) dedup.Store {
		durable, err := pgstore.New(pool, pgstore.WithSchema(schema))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { durable.Close() })
		return newLayered(t, layered.WithWindow(win(t, window.WithCapacity(4096))),
			layered.WithFilter(redisFilter(t, addrs), "redis"), layered.WithDurable(durable, "postgres"))
	}, storetest.Features{Extend: true})
}

// TestFilterFlushedMidRunApply: PostgreSQL's one-round-trip inbox behind
// a window and the Redis filter on a private redis-server, 8 goroutines
// delivering every message several times while Redis is flushed (and the
// window emptied) in the middle of the rounds: the ledger ends with
// exactly one row per message, and Redis, the window and PostgreSQL each
// caught duplicates.
func TestFilterFlushedMidRunApply(t *testing.T) {
	testenv.Addrs(t, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
	pg, pool, ledger := pgLedger(t)
	ctx := context.Background()
	srv := testenv.StartRedis(t, "")
	w := win(t)
	lay := newLayered(t, layered.WithWindow(w), layered.WithFilter(redisFilter(t, srv.Addrs()), "redis"))
	deliver := func(id string) error {
		key := dedup.Key{Scope: "ledger", ID: id}
		fp := dedup.FingerprintOf([]byte("body-" + id))
		c, err := lay.RunInbox(ctx, key, fp, time.Hour, func(ctx context.Context) (dedup.Claim, error) {
			var b pgx.Batch
			b.Queue(`INSERT INTO `+ledger+` (msg_id) VALUES ($1)`, id)
			return pg.Apply(ctx, key, fp, time.Hour, []byte("ok"), &b)
		})
		switch {
		case err != nil:
			return err
		case c.Outcome == dedup.Acquired, c.Outcome == dedup.Duplicate:
			return nil
		}
		return fmt.Errorf("%s: outcome %v", id, c.Outcome)
	}
	const n = 150
	var flushes atomic.Int32
	for round := range 4 {
		var wg sync.WaitGroup
		for g := range 8 {
			wg.Go(func() {
				for i := range n {
					if g == 0 && i == n/2 && round >= 1 {
						// Mid-round, while the others deliver: Redis loses
						// every key and this consumer restarts.
						srv.CLI("flushall")
						w.Reset()
						flushes.Add(1)
					}
					if err := deliver(fmt.Sprint("m", (i+g*17)%n)); err != nil {
						t.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
		if round == 1 {
			w.Reset() // a restart between rounds: the next round's window misses go to Redis
		}
	}
	if err := lay.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	// A last restart with Redis intact: m new messages, written to Redis
	// once committed, then redelivered to an empty window. Whatever the
	// filter's gate decided about the flushed rounds, a durable duplicate
	// sets it probing every probeEvery (32) misses, so at least one of the
	// m redeliveries must be answered by Redis, not by timing luck.
	const m = 100
	for i := range m {
		if err := deliver(fmt.Sprint("x", i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := lay.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	w.Reset()
	fastBefore := lay.Stats().Fast
	for i := range m {
		if err := deliver(fmt.Sprint("x", i)); err != nil {
			t.Fatal(err)
		}
	}
	if lay.Stats().Fast == fastBefore {
		t.Errorf("none of %d redeliveries after a restart with Redis intact was caught by Redis", m)
	}
	var rows, distinct int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT msg_id) FROM `+ledger).Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	if rows != n+m || distinct != n+m {
		t.Fatalf("ledger has %d rows for %d messages after %d flushes; want exactly %d, one each", rows, distinct, flushes.Load(), n+m)
	}
	st := lay.Stats()
	if st.Window == 0 || st.Fast == 0 || st.Durable == 0 {
		t.Fatalf("stats %+v: want duplicates caught by the window, Redis and PostgreSQL", st)
	}
	t.Logf("%d deliveries, %d flushes: %+v", 4*8*n, flushes.Load(), st)
}

// TestFilterIsNotAClaim: the filter never answers "in progress" or
// "mismatch" (only the durable store does), an entry with another
// fingerprint falls through to the durable mismatch, and an entry written
// for a claim without a fingerprint (the record's is unknown) only
// answers claims without one.
func TestFilterIsNotAClaim(t *testing.T) {
	clock := storetest.NewClock()
	f := newMemFilter()
	durable := mem(t, clock)
	lay := newLayered(t, layered.WithFilter(f, "filter"), layered.WithDurable(durable, "durable"), layered.WithClock(clock))
	ctx := context.Background()
	k := dedup.Key{Scope: "s", ID: "k"}
	c, err := lay.Claim(ctx, k, "sha256:a", time.Minute)
	if err != nil || c.Outcome != dedup.Acquired {
		t.Fatal(c.Outcome, err)
	}
	if ip, _ := lay.Claim(ctx, k, "sha256:a", time.Minute); ip.Outcome != dedup.InProgress {
		t.Fatalf("while in progress: %v, want the durable store's InProgress", ip.Outcome)
	}
	if err := lay.Complete(ctx, c, []byte("res"), time.Hour); err != nil {
		t.Fatal(err)
	}
	if err := lay.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	before := lay.Stats().Fast
	if d, _ := lay.Claim(ctx, k, "sha256:a", time.Minute); d.Outcome != dedup.Duplicate || string(d.Result) != "res" || lay.Stats().Fast != before+1 {
		t.Fatalf("same fingerprint: %v %q, stats %+v; want the filter's duplicate with the result", d.Outcome, d.Result, lay.Stats())
	}
	if m, _ := lay.Claim(ctx, k, "sha256:b", time.Minute); m.Outcome != dedup.Mismatch {
		t.Fatalf("another fingerprint: %v, want the durable store's mismatch", m.Outcome)
	}
	// A durable duplicate found by a claim without a fingerprint is written
	// back with the fingerprint unknown.
	k2 := dedup.Key{Scope: "s", ID: "k2"}
	c2, _ := durable.Claim(ctx, k2, "sha256:x", time.Minute)
	if err := durable.Complete(ctx, c2, nil, time.Hour); err != nil {
		t.Fatal(err)
	}
	if d, _ := lay.Claim(ctx, k2, "", time.Minute); d.Outcome != dedup.Duplicate {
		t.Fatal(d.Outcome)
	}
	if err := lay.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	fast := lay.Stats().Fast
	if m, _ := lay.Claim(ctx, k2, "sha256:y", time.Minute); m.Outcome != dedup.Mismatch || lay.Stats().Fast != fast {
		t.Fatalf("unknown fingerprint in the filter, another in the claim: %v, stats %+v; want the durable mismatch", m.Outcome, lay.Stats())
	}
	if d, _ := lay.Claim(ctx, k2, "", time.Minute); d.Outcome != dedup.Duplicate || lay.Stats().Fast != fast+1 {
		t.Fatalf("claim without a fingerprint: %v, stats %+v; want the filter's duplicate", d.Outcome, lay.Stats())
	}
	// An entry past its expiry is not a duplicate, whatever the filter
	// still holds.
	clock.Advance(2 * time.Hour)
	if a, _ := lay.Claim(ctx, k, "sha256:a", time.Minute); a.Outcome != dedup.Acquired {
		t.Fatalf("after the retention: %v, want Acquired from the durable store", a.Outcome)
	}
}

// TestFilterLookupsPayForThemselves: while the window catches every
// duplicate, lookups find nothing and stop (one window miss in 16 is
// still probed); after a restart (an empty window) the redeliveries are
// durable duplicates, which reopen the lookups, and the filter catches
// the rest.
func TestFilterLookupsPayForThemselves(t *testing.T) {
	l := newLedger(t)
	f := newMemFilter()
	w := win(t)
	lay := newLayered(t, layered.WithWindow(w), layered.WithFilter(f, "filter"))
	ctx := context.Background()
	deliver := func(id string) {
		t.Helper()
		c, err := l.deliver(ctx, lay, id)
		if err != nil || (c.Outcome != dedup.Acquired && c.Outcome != dedup.Duplicate) {
			t.Fatalf("delivery of %s: %v %v", id, c.Outcome, err)
		}
	}
	const n = 1000
	for i := range n { // every message twice in a row: the window catches the copies
		deliver(fmt.Sprint("m", i))
		deliver(fmt.Sprint("m", i))
	}
	st := lay.Stats()
	if !st.LookupsPaused || st.LookupsSkipped == 0 || st.Window != n || st.Fast != 0 {
		t.Fatalf("window catching every duplicate: %+v; want lookups paused after finding nothing", st)
	}
	if st.Lookups >= n/2 {
		t.Fatalf("%d lookups for %d window misses: want most skipped", st.Lookups, n)
	}
	if err := lay.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	w.Reset() // a restart: every redelivery misses the window
	for i := range n {
		deliver(fmt.Sprint("m", i))
	}
	st2 := lay.Stats()
	if st2.LookupsPaused || st2.Fast < n/2 {
		t.Fatalf("after a restart: %+v; want lookups open again and most redeliveries caught by the filter", st2)
	}
	if rows, distinct := l.effects(t); rows != n || distinct != n {
		t.Fatalf("ledger has %d rows for %d messages, want %d", rows, distinct, n)
	}
	t.Logf("first pass %+v; after the restart %+v", st, st2)
}

// TestFilterProbesBackOff: while the window catches every duplicate, the
// closed gate's probes find nothing, and each closed period doubles the
// misses per probe (32, 64, ... up to 1024), so a long stream of new
// messages pays far fewer lookups than one in 32; a restart's durable
// duplicates put the probes back at one in 32, which reopens the lookups
// quickly.
func TestFilterProbesBackOff(t *testing.T) {
	l := newLedger(t)
	f := newMemFilter()
	w := win(t)
	lay := newLayered(t, layered.WithWindow(w), layered.WithFilter(f, "filter"))
	ctx := context.Background()
	deliver := func(id string) {
		t.Helper()
		c, err := l.deliver(ctx, lay, id)
		if err != nil || (c.Outcome != dedup.Acquired && c.Outcome != dedup.Duplicate) {
			t.Fatalf("delivery of %s: %v %v", id, c.Outcome, err)
		}
	}
	const n = 5000
	for i := range n {
		deliver(fmt.Sprint("m", i))
		deliver(fmt.Sprint("m", i))
	}
	st := lay.Stats()
	// Open: 32 lookups; closed: 8 probes a period at 32, 64, 128, 256
	// misses apart (3,840 misses), then about 2 at 512: about 66. At a
	// fixed one in 32 it would be 32 + 4,968/32 = 187.
	if !st.LookupsPaused || st.Lookups > 80 || st.Lookups < 40 {
		t.Fatalf("%d lookups for %d window misses (stats %+v): want about 66, the probes backing off", st.Lookups, n, st)
	}
	if err := lay.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	w.Reset()
	const m = 1000
	for i := range m {
		deliver(fmt.Sprint("m", i))
	}
	st2 := lay.Stats()
	if st2.LookupsPaused || st2.Fast < m/2 {
		t.Fatalf("after a restart: %+v; want lookups open again within a few hundred redeliveries", st2)
	}
}

// failingFilter fails every call, as a Redis that is down.
type failingFilter struct{ calls atomic.Int64 }

func (f *failingFilter) Lookup(context.Context, dedup.Key) ([]byte, bool, error) {
	f.calls.Add(1)
	return nil, false, errors.New("down")
}
func (f *failingFilter) Remember(context.Context, []layered.FilterEntry) error {
	f.calls.Add(1)
	return errors.New("down")
}

// TestFilterDownFallsThrough: a filter that fails every call never stops
// processing or changes an answer: the durable store decides.
func TestFilterDownFallsThrough(t *testing.T) {
	l := newLedger(t)
	f := &failingFilter{}
	lay := newLayered(t, layered.WithFilter(f, "filter"))
	ctx := context.Background()
	for range 2 {
		for i := range 50 {
			if c, err := l.deliver(ctx, lay, fmt.Sprint("m", i)); err != nil || (c.Outcome != dedup.Acquired && c.Outcome != dedup.Duplicate) {
				t.Fatal(c.Outcome, err)
			}
		}
	}
	if err := lay.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if st := lay.Stats(); st.Durable != 50 || st.FastErrors == 0 || f.calls.Load() == 0 {
		t.Fatalf("stats %+v: want 50 durable duplicates and the filter's failures counted", st)
	}
	if rows, _ := l.effects(t); rows != 50 {
		t.Fatalf("%d effects, want 50", rows)
	}
}
