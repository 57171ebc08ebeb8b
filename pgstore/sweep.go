package pgstore

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/dedupkit/dedup"
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
	var r SweepResult
	if limit <= 0 {
		return r, &dedup.ArgumentError{Arg: "sweep limit", Reason: "must be positive"}
	}
	if err := s.begin(ctx, "sweep"); err != nil {
		return r, err
	}
	start := time.Now()
	var n, maxLag, meanLag int64
	if err := s.pool.QueryRow(ctx, s.sql.sweep, limit).Scan(&n, &maxLag, &meanLag); err != nil {
		return r, s.failAuto(ctx, "sweep", err)
	}
	r.Deleted, r.Batches = int(n), 1
	r.MaxLag, r.MeanLag = time.Duration(maxLag)*time.Microsecond, time.Duration(meanLag)*time.Microsecond
	r.Elapsed = time.Since(start)
	return r, nil
}

// SweepUntilEmpty runs SweepOnce with batches of limit until a batch
// deletes fewer than limit, maxBatches batches have run (0: no bound), or
// ctx is done, pausing pause between batches to leave the disk to claims.
// It returns the sum of the batches, also when it stops on an error.
func (s *Store) SweepUntilEmpty(ctx context.Context, limit, maxBatches int, pause time.Duration) (SweepResult, error) {
	var total SweepResult
	start := time.Now()
	defer func() { total.Elapsed = time.Since(start) }()
	for maxBatches <= 0 || total.Batches < maxBatches {
		r, err := s.SweepOnce(ctx, limit)
		if err != nil {
			return total, err
		}
		total.add(r)
		if r.Deleted < limit {
			break
		}
		if pause > 0 {
			t := time.NewTimer(pause)
			select {
			case <-ctx.Done():
				t.Stop()
				return total, s.fail(ctx, "sweep", ctx.Err(), true)
			case <-t.C:
			}
		}
	}
	return total, nil
}

// SweepOptions configure a [SweepJob].
type SweepOptions struct {
	// Interval is the time between passes. Default 1m.
	Interval time.Duration
	// BatchSize bounds the rows one DELETE removes. Default 1000.
	BatchSize int
	// MaxBatches bounds the batches of one pass; 0 means until a batch
	// deletes fewer than BatchSize.
	MaxBatches int
	// Pause is the time between batches of one pass, which leaves the
	// disk and the CPU to claims: every batch is a transaction whose commit
	// flushes its WAL. Default 2ms; negative for none. Measured on a
	// noisy 2-core machine (BenchmarkSweep): batches of 5000 without a
	// pause delete about 400k rows/s and raise the p99 of concurrent
	// claims 5-6x; batches of 500 to 1000 with a 2ms pause delete
	// 80-140k rows/s and raise it 2-3x.
	Pause time.Duration
	// OnPass, if set, is called after every pass with what it did and its
	// error (nil on success), from the job's goroutine.
	OnPass func(SweepResult, error)
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
		opts.BatchSize = 1000
	}
	switch {
	case opts.Pause == 0:
		opts.Pause = 2 * time.Millisecond
	case opts.Pause < 0:
		opts.Pause = 0
	}
	switch {
	case opts.Interval < 0:
		return nil, &dedup.ArgumentError{Arg: "sweep interval", Reason: "must be positive, got " + opts.Interval.String()}
	case opts.BatchSize < 0:
		return nil, &dedup.ArgumentError{Arg: "sweep batch size", Reason: "must be positive"}
	case opts.MaxBatches < 0:
		return nil, &dedup.ArgumentError{Arg: "sweep max batches", Reason: "must not be negative"}
	}
	ctx, cancel := context.WithCancel(context.Background())
	j := &SweepJob{store: s, opts: opts, cancel: cancel, done: make(chan struct{})}
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
		r, err := j.store.Maintain(ctx, j.opts.BatchSize, j.opts.MaxBatches, j.opts.Pause)
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
	var total SweepResult
	start := time.Now()
	defer func() { total.Elapsed = time.Since(start) }()
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
	r, err := s.SweepUntilEmpty(ctx, limit, maxBatches, pause)
	total.add(r)
	if err != nil {
		errs = append(errs, err)
	}
	return total, errors.Join(errs...)
}
