package pgstore

import (
	"context"
	"time"
)

// SweepClock is the time source a test can give a sweep job.
type SweepClock interface {
	Now() time.Time
	Sleep(ctx context.Context, d time.Duration) error
}

// WithSweepClock returns opts whose job times its batches and waits out
// its pauses on c.
func WithSweepClock(opts SweepOptions, c SweepClock) SweepOptions {
	opts.clock = c
	return opts
}
