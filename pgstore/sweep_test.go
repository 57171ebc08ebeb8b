package pgstore_test

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
)

// seed inserts n records directly: completed, expired age ago (age < 0:
// still live for -age), with ids prefix0..prefixN-1, into s's records
// table (the current partition for a partitioned store). Record g expires
// g microseconds earlier than that, so that expiries are distinct, as
// they are in production.
func seed(t testing.TB, s *pgstore.Store, prefix string, n int, age time.Duration) {
	t.Helper()
	_, err := s.Pool().Exec(context.Background(), `INSERT INTO `+records(s)+`
	(scope, id, state, token, fingerprint, result, lease_until, expires_at, attempts, created_at)
SELECT $1, $2 || g, 2, '\x0102'::bytea, ''::bytea, NULL, statement_timestamp(),
	statement_timestamp() - ($3::int8 + g) * interval '1 microsecond', 1, statement_timestamp()
FROM generate_series(0, $4::int - 1) g`, key("").Scope, prefix, age.Microseconds(), n)
	if err != nil {
		t.Fatalf("seed: %v", err)
	}
}

func countPrefix(t testing.TB, s *pgstore.Store, prefix string) int {
	t.Helper()
	return queryInt(t, s.Pool(), `SELECT count(*) FROM `+records(s)+` WHERE id LIKE $1 || '%'`, prefix)
}

// The sweeper deletes expired records in bounded batches, oldest expiry
// first, reports how late it is, and never touches a live record, an
// in-progress record within its grace, or a completed one in retention.
func TestSweepDeletesExpiredInBatches(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		ctx := context.Background()
		seed(t, s, "old-", 2500, time.Hour)
		seed(t, s, "live-", 100, -time.Hour)
		held := mustClaim(t, s, "held", fpA, 10*time.Millisecond, dedup.Acquired) // lease runs out, grace does not
		time.Sleep(50 * time.Millisecond)

		r, err := s.SweepOnce(ctx, 1000)
		if err != nil || r.Deleted != 1000 || r.Batches != 1 {
			t.Fatalf("SweepOnce(1000) = %+v, %v; want 1000 deleted in one batch", r, err)
		}
		if r.MaxLag < time.Hour || r.MeanLag < time.Hour || r.MaxLag > 2*time.Hour {
			t.Fatalf("lag of records expired an hour ago: max %v, mean %v", r.MaxLag, r.MeanLag)
		}
		r, err = s.SweepUntilEmpty(ctx, 400, 0, 0)
		if err != nil || r.Deleted != 1500 || r.Batches != 4 || r.Elapsed <= 0 {
			t.Fatalf("SweepUntilEmpty(400) = %+v, %v; want 1500 deleted in 4 batches, and the time it took", r, err)
		}
		if n := countPrefix(t, s, "old-"); n != 0 {
			t.Fatalf("%d expired records left", n)
		}
		if n := countPrefix(t, s, "live-"); n != 100 {
			t.Fatalf("%d of 100 live records left", n)
		}
		if err := s.Complete(ctx, held, nil, day); err != nil {
			t.Fatalf("the in-progress record within its grace was swept: %v", err)
		}
		if r, err := s.SweepOnce(ctx, 1000); err != nil || r.Deleted != 0 || r.MaxLag != 0 {
			t.Fatalf("sweep of a clean table = %+v, %v", r, err)
		}
		if _, err := s.SweepOnce(ctx, 0); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Fatalf("SweepOnce(0) = %v", err)
		}
	})
}

// An in-progress record whose owner is gone is swept once its lease plus
// the grace is over, and the next claim starts again at attempt 1.
func TestSweepAbandonedLeaseAfterGrace(t *testing.T) {
	s := openStore(t, pgstore.WithInProgressGrace(time.Microsecond))
	mustClaim(t, s, "crashed", fpA, 10*time.Millisecond, dedup.Acquired)
	time.Sleep(50 * time.Millisecond)
	if n, err := s.Sweep(context.Background(), 10); err != nil || n != 1 {
		t.Fatalf("Sweep = %d, %v; want the abandoned record", n, err)
	}
	if c := mustClaim(t, s, "crashed", fpA, time.Minute, dedup.Acquired); c.Attempt != 1 || c.TakenOver {
		t.Fatalf("claim after the sweep = %+v, want a fresh attempt 1", c)
	}
}

// The sweeper skips rows another transaction holds instead of waiting for
// them: it neither blocks nor is blocked, and the held rows are deleted by
// a later pass.
func TestSweepSkipsLockedRows(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		seed(t, s, "old-", 50, time.Hour)
		bg := context.Background()
		tx, err := s.Pool().Begin(bg)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(bg)
		if _, err := tx.Exec(bg, `SELECT 1 FROM `+records(s)+` WHERE id IN ('old-1', 'old-2', 'old-3') FOR UPDATE`); err != nil {
			t.Fatal(err)
		}
		// A deadline only to turn a hang into a failure: a sweeper that
		// waited for the lock would never return while tx is open.
		ctx, cancel := context.WithTimeout(bg, 30*time.Second)
		defer cancel()
		r, err := s.SweepUntilEmpty(ctx, 20, 0, 0)
		if err != nil || r.Deleted != 47 {
			t.Fatalf("sweep with 3 rows locked = %+v, %v; want the 47 others", r, err)
		}
		if n := countPrefix(t, s, "old-"); n != 3 {
			t.Fatalf("%d rows left, want the 3 locked ones", n)
		}
		if err := tx.Commit(bg); err != nil {
			t.Fatal(err)
		}
		if n, err := s.Sweep(bg, 20); err != nil || n != 3 {
			t.Fatalf("sweep after the lock was released = %d, %v; want 3", n, err)
		}
	})
}

// A claim racing the sweeper over expired records always gets an answer,
// and a record being deleted is acquired afresh.
func TestSweepRacingClaims(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		seed(t, s, "k", 2000, time.Hour)
		ctx := context.Background()
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := s.SweepUntilEmpty(ctx, 100, 0, 0); err != nil {
				t.Errorf("sweep: %v", err)
			}
		}()
		reqs := make([]dedup.ClaimRequest, 0, 100)
		for i := range 2000 {
			if i%20 == 0 {
				reqs = append(reqs, dedup.ClaimRequest{Key: key("k" + strconv.Itoa(i)), Fingerprint: fpA})
			}
		}
		for _, r := range reqs {
			c, err := s.Claim(ctx, r.Key, fpA, time.Minute)
			if err != nil || c.Outcome != dedup.Acquired || c.Attempt != 1 {
				t.Errorf("Claim(%s) over an expired record = %+v, %v; want acquired, attempt 1", r.Key.ID, c, err)
			}
		}
		wg.Wait()
		for _, r := range reqs {
			if n := countRecords(t, s, r.Key.ID); n != 1 {
				t.Fatalf("%d records of %s after the race, want 1", n, r.Key.ID)
			}
		}
	})
}

// A pass paces itself by the time its batches take: with PauseRatio k it
// pauses k times as long as each batch took, so it takes at least k + 1
// times its batches' time; with no pause it runs them back to back.
func TestSweepJobPacing(t *testing.T) {
	s := openStore(t)
	pass := func(opts pgstore.SweepOptions) pgstore.SweepResult {
		seed(t, s, "old-"+strconv.Itoa(rand.Int())+"-", 2000, time.Minute)
		done := make(chan pgstore.SweepResult, 1)
		opts.Interval, opts.BatchSize = time.Hour, 100
		opts.OnPass = func(r pgstore.SweepResult, err error) {
			if err != nil {
				t.Error(err)
			}
			done <- r
		}
		j, err := s.StartSweeping(opts)
		if err != nil {
			t.Fatal(err)
		}
		defer j.Close()
		r := <-done
		if r.Deleted != 2000 || r.Batches != 21 || r.Elapsed <= 0 {
			t.Fatalf("pass = %+v, want 2000 rows in 21 batches (the last one empty)", r)
		}
		return r
	}
	// The batches' own time, measured one by one.
	seed(t, s, "probe-", 2000, time.Minute)
	var batches time.Duration
	for {
		r, err := s.SweepOnce(context.Background(), 100)
		if err != nil {
			t.Fatal(err)
		}
		batches += r.Elapsed
		if r.Deleted < 100 {
			break
		}
	}
	paced := pass(pgstore.SweepOptions{PauseRatio: 4, Pause: -1})
	if paced.Elapsed < 3*batches {
		t.Errorf("a pass with PauseRatio 4 took %v; its batches alone take about %v, so want at least %v", paced.Elapsed, batches, 3*batches)
	}
	unpaced := pass(pgstore.SweepOptions{PauseRatio: -1, Pause: -1})
	if unpaced.Elapsed >= paced.Elapsed {
		t.Errorf("a pass without pauses took %v, not less than the paced pass's %v", unpaced.Elapsed, paced.Elapsed)
	}
	for _, bad := range []float64{math.NaN(), math.Inf(1)} {
		if _, err := s.StartSweeping(pgstore.SweepOptions{PauseRatio: bad}); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("PauseRatio %v: %v, want ErrInvalidArgument", bad, err)
		}
	}
}

// The background job sweeps on its own until the table is clean, Close
// stops it and waits for it, and Close of the store stops its jobs.
func TestSweepJob(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		seed(t, s, "old-", 1200, time.Minute)
		passes := make(chan pgstore.SweepResult, 1000)
		var calls atomic.Int32
		j, err := s.StartSweeping(pgstore.SweepOptions{Interval: 5 * time.Millisecond, BatchSize: 500, OnPass: func(r pgstore.SweepResult, err error) {
			calls.Add(1)
			if err != nil {
				t.Errorf("sweep pass: %v", err)
			}
			select {
			case passes <- r:
			default:
			}
		}})
		if err != nil {
			t.Fatal(err)
		}
		deleted := 0
		for deleted < 1200 {
			r := <-passes
			deleted += r.Deleted
		}
		if n := countPrefix(t, s, "old-"); n != 0 {
			t.Fatalf("%d expired records left after the job deleted %d", n, deleted)
		}
		total, n, last := j.Stats()
		if total.Deleted != 1200 || n == 0 || last != nil {
			t.Fatalf("Stats = %+v, %d passes, %v", total, n, last)
		}
		if err := j.Close(); err != nil {
			t.Fatal(err)
		}
		after := calls.Load()
		seed(t, s, "later-", 10, time.Minute)
		time.Sleep(50 * time.Millisecond) // ten intervals
		if calls.Load() != after || countPrefix(t, s, "later-") != 10 {
			t.Fatal("the job went on after Close returned")
		}
		j.Close() // twice is fine

		// A job still running when the store closes is stopped with it.
		var late atomic.Int32
		j2, err := s.StartSweeping(pgstore.SweepOptions{Interval: time.Millisecond, OnPass: func(pgstore.SweepResult, error) { late.Add(1) }})
		if err != nil {
			t.Fatal(err)
		}
		for late.Load() == 0 {
			time.Sleep(time.Millisecond)
		}
		s.Close()
		stopped := late.Load()
		time.Sleep(20 * time.Millisecond)
		if late.Load() != stopped {
			t.Fatal("a job outlived Close of its store")
		}
		j2.Close()
		if _, err := s.StartSweeping(pgstore.SweepOptions{}); !errors.Is(err, dedup.ErrClosed) {
			t.Fatalf("StartSweeping on a closed store: %v", err)
		}
	})
}

// Completions and sweeps honour the scope's retention window as a floor.
func TestRetentionWindowIsAFloor(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		ctx := context.Background()
		if err := s.SetRetention(ctx, key("").Scope, 2*time.Hour, 0); err != nil {
			t.Fatal(err)
		}
		c := mustClaim(t, s, "m1", fpA, time.Minute, dedup.Acquired)
		if err := s.Complete(ctx, c, nil, time.Millisecond); err != nil {
			t.Fatal(err)
		}
		if _, err := s.RunInbox(ctx, key("m2"), fpA, time.Millisecond, func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }); err != nil {
			t.Fatal(err)
		}
		other := dedup.Key{Scope: "analytics", ID: "m3"}
		oc, err := s.Claim(ctx, other, fpA, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Complete(ctx, oc, nil, time.Millisecond); err != nil {
			t.Fatal(err)
		}
		for _, id := range []string{"m1", "m2"} {
			n := queryInt(t, s.Pool(), `SELECT count(*) FROM `+records(s)+` WHERE scope = $1 AND id = $2
AND expires_at - statement_timestamp() BETWEEN interval '119 minutes' AND interval '121 minutes'`, key("").Scope, id)
			if n != 1 {
				t.Fatalf("record %s does not expire in 2h (the scope's window) but in the caller's 1ms", id)
			}
		}
		time.Sleep(20 * time.Millisecond)
		mustClaim(t, s, "m1", fpA, time.Minute, dedup.Duplicate)
		if c, err := s.Claim(ctx, other, fpA, time.Minute); err != nil || c.Outcome != dedup.Acquired {
			t.Fatalf("a scope without a window keeps the caller's retention: %v, %v", c.Outcome, err)
		}
		if err := s.DeleteRetention(ctx, key("").Scope); err != nil {
			t.Fatal(err)
		}
		if w, err := s.RetentionWindows(ctx); err != nil || len(w) != 0 {
			t.Fatalf("windows after delete = %v, %v", w, err)
		}
	})
}
