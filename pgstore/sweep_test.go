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
	cols, created := "", ""
	if s.Partitioned() {
		cols, created = ", created_at", ", statement_timestamp()"
	}
	_, err := s.Pool().Exec(context.Background(), `INSERT INTO `+records(s)+`
	(scope, id, state, token, fingerprint, result, deadline, attempts`+cols+`)
SELECT `+fn(s, "scope_id")+`($1), `+fn(s, "key_id")+`($2 || g), 2, '\x0102'::bytea, ''::bytea, NULL,
	statement_timestamp() - ($3::int8 + g) * interval '1 microsecond', 1`+created+`
FROM generate_series(0, $4::int - 1) g`, key("").Scope, prefix, age.Microseconds(), n)
	if err != nil {
		t.Fatalf("seed: %v", err)
	}
}

func countPrefix(t testing.TB, s *pgstore.Store, prefix string) int {
	t.Helper()
	return queryInt(t, s.Pool(), `SELECT count(*) FROM `+records(s)+` WHERE `+fn(s, "key_text")+`(id) LIKE $1 || '%'`, prefix)
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

// pacingClock is a sweep clock that counts what the pacing decided: every
// reading advances it by the next step of a fixed, uneven sequence (so
// batches "take" different times), and Sleep records the pause asked for
// with the batch time the sweeper had just measured, then advances by the
// pause, without waiting.
type pacingClock struct {
	mu     sync.Mutex
	now    time.Time
	reads  int
	last   [2]time.Time // the two latest readings
	pauses []pacingDecision
}

type pacingDecision struct{ batch, pause time.Duration }

func (c *pacingClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.reads++
	c.now = c.now.Add(time.Duration(1+c.reads%7) * time.Millisecond)
	c.last = [2]time.Time{c.last[1], c.now}
	return c.now
}

func (c *pacingClock) Sleep(ctx context.Context, d time.Duration) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.pauses = append(c.pauses, pacingDecision{batch: c.last[1].Sub(c.last[0]), pause: d})
	c.now = c.now.Add(d)
	return ctx.Err()
}

func (c *pacingClock) decisions() []pacingDecision {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]pacingDecision(nil), c.pauses...)
}

// TestSweepJobPacing checks the job's pacing by what it decided, on a
// clock of the test's own: after each full batch it pauses the longer of
// Pause and PauseRatio times the batch's time as measured, never after the
// last batch, and not at all when both are off. No wall time is compared.
func TestSweepJobPacing(t *testing.T) {
	s := openStore(t)
	pass := func(opts pgstore.SweepOptions) (pgstore.SweepResult, []pacingDecision) {
		t.Helper()
		seed(t, s, "old-"+strconv.Itoa(rand.Int())+"-", 2000, time.Minute)
		done := make(chan pgstore.SweepResult, 1)
		opts.Interval, opts.BatchSize = time.Hour, 100
		opts.OnPass = func(r pgstore.SweepResult, err error) {
			if err != nil {
				t.Error(err)
			}
			done <- r
		}
		clock := &pacingClock{now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
		j, err := s.StartSweeping(pgstore.WithSweepClock(opts, clock))
		if err != nil {
			t.Fatal(err)
		}
		defer j.Close()
		r := <-done
		if r.Deleted != 2000 || r.Batches != 21 {
			t.Fatalf("pass = %+v, want 2000 rows in 21 batches (the last one empty)", r)
		}
		return r, clock.decisions()
	}
	for _, tc := range []struct {
		name  string
		opts  pgstore.SweepOptions
		pause func(batch time.Duration) time.Duration // 0: none
	}{
		{"ratio 4", pgstore.SweepOptions{PauseRatio: 4, Pause: -1}, func(b time.Duration) time.Duration { return 4 * b }},
		{"ratio 0.5, at least 3ms", pgstore.SweepOptions{PauseRatio: 0.5, Pause: 3 * time.Millisecond},
			func(b time.Duration) time.Duration { return max(3*time.Millisecond, b/2) }},
		{"defaults", pgstore.SweepOptions{}, func(b time.Duration) time.Duration { return max(time.Millisecond, b) }},
		{"fixed 5ms", pgstore.SweepOptions{PauseRatio: -1, Pause: 5 * time.Millisecond}, func(time.Duration) time.Duration { return 5 * time.Millisecond }},
		{"none", pgstore.SweepOptions{PauseRatio: -1, Pause: -1}, func(time.Duration) time.Duration { return 0 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, got := pass(tc.opts)
			var want int
			if tc.pause(time.Millisecond) > 0 {
				want = r.Batches - 1 // a pause after every full batch, none after the last
			}
			if len(got) != want {
				t.Fatalf("%d pauses in a pass of %d batches, want %d: %v", len(got), r.Batches, want, got)
			}
			var paused, batches time.Duration
			distinct := map[time.Duration]bool{}
			for i, d := range got {
				if d.batch <= 0 {
					t.Fatalf("pause %d follows a batch of %v as measured", i, d.batch)
				}
				if w := tc.pause(d.batch); d.pause != w {
					t.Errorf("pause %d after a batch of %v: %v, want %v", i, d.batch, d.pause, w)
				}
				paused += d.pause
				batches += d.batch
				distinct[d.batch] = true
			}
			if want > 0 && len(distinct) < 2 {
				t.Errorf("the clock gave every batch the same time (%v); the test needs uneven batches", got[0].batch)
			}
			// The pass's elapsed time, on the same clock, holds its pauses.
			if r.Elapsed < paused+batches {
				t.Errorf("pass elapsed %v on the test clock, less than its batches (%v) and pauses (%v)", r.Elapsed, batches, paused)
			}
		})
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
			n := queryInt(t, s.Pool(), `SELECT count(*) FROM `+records(s)+` WHERE `+keyIs(s, "$1", "$2")+`
AND deadline - statement_timestamp() BETWEEN interval '119 minutes' AND interval '121 minutes'`, key("").Scope, id)
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
