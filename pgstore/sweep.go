package pgstore

import (
	"context"
	"errors"
	"math"
	"sync"
	"time"

	"github.com/dedupkit/dedup"
)

// The defaults of [SweepOptions]; see there.
const (
	defaultSweepBatch = 500
	defaultSweepPause = time.Millisecond
	defaultPauseRatio = 1.0
)

// SweepResult is what one sweep batch (or a pass of several) did.
type SweepResult struct {
	// Deleted counts the expired records deleted.
	Deleted int
	// Batches counts the DELETE statements run.
	Batches int
	// MaxLag is the longest time between a deleted record's expiry and its
	// deletion: how far the sweeper is behind. A lag that keeps growing
	// means the sweeper deletes fewer rows than expire; run it more often
	// or with larger batches, or use partitions.
	MaxLag time.Duration
	// MeanLag is the mean of that time over the deleted records.
	MeanLag time.Duration
	// PartitionsDropped lists the partitions dropped (partitioned store).
	PartitionsDropped []string
	// PartitionsCreated lists the partitions created (partitioned store).
	PartitionsCreated []string
	// Elapsed is how long it took.
	Elapsed time.Duration
}

func (r *SweepResult) add(o SweepResult) {
	if r.Deleted+o.Deleted > 0 {
		r.MeanLag = time.Duration((int64(r.MeanLag)*int64(r.Deleted) + int64(o.MeanLag)*int64(o.Deleted)) / int64(r.Deleted+o.Deleted))
	}
	r.Deleted += o.Deleted
	r.Batches += o.Batches
	r.MaxLag = max(r.MaxLag, o.MaxLag)
	r.PartitionsDropped = append(r.PartitionsDropped, o.PartitionsDropped...)
	r.PartitionsCreated = append(r.PartitionsCreated, o.PartitionsCreated...)
}

// Sweep deletes up to limit expired records in one bounded DELETE and
// returns how many it deleted; see [dedup.Sweeper] and [Store.SweepOnce].
func (s *Store) Sweep(ctx context.Context, limit int) (int, error) {
	r, err := s.SweepOnce(ctx, limit)
	return r.Deleted, err
}

// SweepOnce deletes up to limit expired records in one statement and says
// how many and how late. It deletes completed records whose retention has
// ended and in-progress records whose lease ended more than the in-progress
// grace ago ([WithInProgressGrace]); expired records are already invisible
// to claims, so sweeping only reclaims space.
//
// The statement picks the rows that expired first (by the expires_at
// index) and skips rows that another transaction holds (FOR UPDATE SKIP
// LOCKED), so it never waits on a claim and a claim waits on it for at
// most one batch's delete of that row. Call it in a loop until it deletes
// fewer than limit, or run a [SweepJob].
func (s *Store) SweepOnce(ctx context.Context, limit int) (SweepResult, error) {
	r, _, err := s.sweepOnce(ctx, limit, nil, wallClock{})
	return r, err
}

// sweepOnce is SweepOnce for the plain table's rows from heap block from
// on (nil: all), and returns the last block it deleted from (nil if none
// or partitioned), where the next batch of a pass starts.
func (s *Store) sweepOnce(ctx context.Context, limit int, from *int64, clock sweepClock) (SweepResult, *int64, error) {
	var r SweepResult
	if limit <= 0 {
		return r, nil, &dedup.ArgumentError{Arg: "sweep limit", Reason: "must be positive"}
	}
	if err := s.begin(ctx, "sweep"); err != nil {
		return r, nil, err
	}
	start := clock.Now()
	var n, maxLag, meanLag int64
	var last *int64
	args := []any{limit}
	if s.cfg.partition == 0 {
		var block int64
		if from != nil {
			block = *from
		}
		args = append(args, block)
	}
	if err := s.pool.QueryRow(ctx, s.sql.sweep, args...).Scan(&n, &maxLag, &meanLag, &last); err != nil {
		return r, nil, s.failAuto(ctx, "sweep", err)
	}
	r.Deleted, r.Batches = int(n), 1
	r.MaxLag, r.MeanLag = time.Duration(maxLag)*time.Microsecond, time.Duration(meanLag)*time.Microsecond
	r.Elapsed = clock.Now().Sub(start)
	return r, last, nil
}

// SweepUntilEmpty runs SweepOnce with batches of limit until a batch
// deletes fewer than limit, maxBatches batches have run (0: no bound), or
// ctx is done, pausing pause between batches to leave the disk to claims.
// It returns the sum of the batches, also when it stops on an error. A
// [SweepJob] paces itself by the time each batch took instead; see
// [SweepOptions.PauseRatio].
func (s *Store) SweepUntilEmpty(ctx context.Context, limit, maxBatches int, pause time.Duration) (SweepResult, error) {
	return s.sweepUntilEmpty(ctx, limit, maxBatches, pacing{pause: pause})
}

// pacing spaces the batches of a sweep: after a batch that took d, the
// sweeper pauses the longer of pause and ratio × d, as clock (nil: the
// wall clock) measures and waits.
type pacing struct {
	pause time.Duration
	ratio float64
	clock sweepClock
}

// sweepClock is the time source of a sweep: it times the batches and waits
// out the pauses between them. Tests put in a clock of their own, which
// counts what the pacing decided without waiting (see export_sweep_test.go).
type sweepClock interface {
	Now() time.Time
	// Sleep waits d, or until ctx is done, and then returns ctx.Err().
	Sleep(ctx context.Context, d time.Duration) error
}

// wallClock is the real time.
type wallClock struct{}

func (wallClock) Now() time.Time { return time.Now() }

func (wallClock) Sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

func (p pacing) clockOrWall() sweepClock {
	if p.clock == nil {
		return wallClock{}
	}
	return p.clock
}

func (p pacing) after(batch time.Duration) time.Duration {
	return max(p.pause, time.Duration(p.ratio*float64(batch)))
}

func (s *Store) sweepUntilEmpty(ctx context.Context, limit, maxBatches int, pace pacing) (total SweepResult, err error) {
	clock := pace.clockOrWall()
	start := clock.Now()
	defer func() { total.Elapsed = clock.Now().Sub(start) }()
	// Each batch starts where the last one ended; rows it skipped because
	// a transaction held them are left for the next pass.
	var from *int64
	for maxBatches <= 0 || total.Batches < maxBatches {
		r, last, err := s.sweepOnce(ctx, limit, from, clock)
		if err != nil {
			return total, err
		}
		total.add(r)
		if r.Deleted < limit {
			break
		}
		from = last
		if pause := pace.after(r.Elapsed); pause > 0 {
			if err := clock.Sleep(ctx, pause); err != nil {
				return total, s.fail(ctx, "sweep", err, true)
			}
		}
	}
	return total, nil
}

// SweepOptions configure a [SweepJob].
//
// The job paces itself: every batch is a transaction that takes CPU,
// deletes index entries and flushes its WAL at commit, which is what
// claims running at the same time wait for. After a batch that took d it
// pauses PauseRatio × d (at least Pause), so that it works at most
// 1/(1 + PauseRatio) of the time, whatever the machine, and a batch slowed
// by load makes the next pause longer. Measured on a noisy 2-core machine
// (BenchmarkSweep, claims from 4 goroutines; docs/benchmarks.md), the
// defaults (batches of 500, PauseRatio 1) delete 130-145k rows/s from a
// large backlog while the p99 of concurrent claims stays at 1.5-1.7x its
// idle value; batches of 5000 without a pause delete about 400k rows/s
// and raise it about 5x. Batch size matters most to claims; PauseRatio
// trades sweep speed for the time left to them.
type SweepOptions struct {
	// Interval is the time between passes. Default 1m.
	Interval time.Duration
	// BatchSize bounds the rows one DELETE removes, and so how long the
	// batch holds its row locks and how much WAL its commit flushes.
	// Default 500.
	BatchSize int
	// MaxBatches bounds the batches of one pass; 0 means until a batch
	// deletes fewer than BatchSize.
	MaxBatches int
	// PauseRatio sizes the pause after each batch of a pass: PauseRatio
	// times the time the batch took (a duty cycle of
	// 1/(1 + PauseRatio)). Default 1 (work half the time); negative for
	// none, leaving Pause alone.
	PauseRatio float64
	// Pause is the shortest pause between batches of one pass. Default
	// 1ms; negative for none.
	Pause time.Duration
	// OnPass, if set, is called after every pass with what it did and its
	// error (nil on success), from the job's goroutine.
	OnPass func(SweepResult, error)
	// Hooks receive a [dedup.SweepEvent] after every pass (rows deleted,
	// batches, the pass's duration and error), for a metrics adapter
	// (dedupprom, dedupotel). Default none.
	Hooks []dedup.Hook
	// Name is the Store of those events. Default "postgres".
	Name string

	// clock times the batches and waits out the pauses; nil is the wall
	// clock. Set by tests only.
	clock sweepClock
}

// SweepJob is a background sweeper started by [Store.StartSweeping]. Each
// pass deletes expired rows in bounded batches; on a partitioned store it
// first creates the partitions ahead ([Store.EnsurePartitions]) and drops
// the partitions whose records have all expired
// ([Store.DropExpiredPartitions]). Close stops it and waits.
type SweepJob struct {
	store  *Store
	opts   SweepOptions
	cancel context.CancelFunc
	done   chan struct{}
	once   sync.Once

	hooks dedup.Hooks

	mu     sync.Mutex
	total  SweepResult
	passes int
	last   error
}

// StartSweeping starts a [SweepJob] that runs a first pass at once and then
// one every opts.Interval. The job belongs to the store: Close of either
// stops it. Errors are logged, passed to OnPass and retried on the next
// pass; they never stop the job.
func (s *Store) StartSweeping(opts SweepOptions) (*SweepJob, error) {
	if opts.Interval == 0 {
		opts.Interval = time.Minute
	}
	if opts.BatchSize == 0 {
		opts.BatchSize = defaultSweepBatch
	}
	switch {
	case opts.Pause == 0:
		opts.Pause = defaultSweepPause
	case opts.Pause < 0:
		opts.Pause = 0
	}
	switch {
	case opts.PauseRatio == 0:
		opts.PauseRatio = defaultPauseRatio
	case opts.PauseRatio < 0:
		opts.PauseRatio = 0
	}
	switch {
	case opts.Interval < 0:
		return nil, &dedup.ArgumentError{Arg: "sweep interval", Reason: "must be positive, got " + opts.Interval.String()}
	case opts.BatchSize < 0:
		return nil, &dedup.ArgumentError{Arg: "sweep batch size", Reason: "must be positive"}
	case opts.MaxBatches < 0:
		return nil, &dedup.ArgumentError{Arg: "sweep max batches", Reason: "must not be negative"}
	case math.IsNaN(opts.PauseRatio) || math.IsInf(opts.PauseRatio, 0):
		return nil, &dedup.ArgumentError{Arg: "sweep pause ratio", Reason: "must be a finite number"}
	}
	if opts.Name == "" {
		opts.Name = "postgres"
	}
	ctx, cancel := context.WithCancel(context.Background())
	j := &SweepJob{store: s, opts: opts, cancel: cancel, done: make(chan struct{}), hooks: dedup.NewHooks(opts.Hooks...)}
	s.mu.Lock()
	if s.closed.Load() {
		s.mu.Unlock()
		cancel()
		return nil, dedup.ErrClosed
	}
	s.jobs[j] = struct{}{}
	s.mu.Unlock()
	go j.run(ctx)
	return j, nil
}

func (j *SweepJob) run(ctx context.Context) {
	defer close(j.done)
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		r, err := j.store.maintain(ctx, j.opts.BatchSize, j.opts.MaxBatches, pacing{pause: j.opts.Pause, ratio: j.opts.PauseRatio, clock: j.opts.clock})
		if ctx.Err() != nil {
			// Stopped mid-pass: the cancellation is not a failure.
			err = nil
		}
		j.mu.Lock()
		j.total.add(r)
		j.passes++
		j.last = err
		j.mu.Unlock()
		if err != nil {
			j.store.logger().Warn("dedup sweep pass failed; retrying on the next pass", "error", err, "deleted", r.Deleted)
		}
		if j.opts.OnPass != nil {
			j.opts.OnPass(r, err)
		}
		j.hooks.Swept(context.WithoutCancel(ctx), dedup.SweepEvent{Store: j.opts.Name, Deleted: int64(r.Deleted), Batches: r.Batches, Duration: r.Elapsed, Err: err})
		t.Reset(j.opts.Interval)
	}
}

// Stats returns the sum of the job's passes so far, how many passes ran,
// and the error of the last pass.
func (j *SweepJob) Stats() (total SweepResult, passes int, lastErr error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	t := j.total
	t.PartitionsDropped = append([]string(nil), t.PartitionsDropped...)
	t.PartitionsCreated = append([]string(nil), t.PartitionsCreated...)
	return t, j.passes, j.last
}

// Close stops the job, interrupting a pass in flight (its current
// statement is cancelled and rolls back), and waits for its goroutine to
// end. It returns nil; closing again does nothing.
func (j *SweepJob) Close() error {
	j.once.Do(func() {
		j.cancel()
		<-j.done
		j.store.mu.Lock()
		delete(j.store.jobs, j)
		j.store.mu.Unlock()
	})
	return nil
}

// Maintain is one maintenance pass, what a [SweepJob] and `dedup sweep`
// run: on a partitioned store, create the partitions ahead and drop those
// whose records have all expired; then delete expired rows in batches of
// limit as [Store.SweepUntilEmpty] does. It returns what it did even when
// it fails part way.
func (s *Store) Maintain(ctx context.Context, limit, maxBatches int, pause time.Duration) (SweepResult, error) {
	return s.maintain(ctx, limit, maxBatches, pacing{pause: pause})
}

func (s *Store) maintain(ctx context.Context, limit, maxBatches int, pace pacing) (total SweepResult, err error) {
	clock := pace.clockOrWall()
	start := clock.Now()
	defer func() { total.Elapsed = clock.Now().Sub(start) }()
	var errs []error
	if s.cfg.partition > 0 {
		created, err := s.EnsurePartitions(ctx)
		total.PartitionsCreated = created
		if err != nil {
			errs = append(errs, err)
		}
		dropped, err := s.DropExpiredPartitions(ctx)
		total.PartitionsDropped = dropped
		if err != nil {
			errs = append(errs, err)
		}
	}
	r, err := s.sweepUntilEmpty(ctx, limit, maxBatches, pace)
	total.add(r)
	if err != nil {
		errs = append(errs, err)
	}
	return total, errors.Join(errs...)
}
