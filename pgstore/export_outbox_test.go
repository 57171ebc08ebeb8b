package pgstore

import (
	"context"
	"time"
)

// EnsureOutboxRanges creates the partitioned outbox's ranges from start
// (a range boundary) through the one holding until, past ones included,
// for tests that place rows in ranges that are over.
func EnsureOutboxRanges(ctx context.Context, s *Store, start, until time.Time) ([]string, error) {
	every, err := s.OutboxPartitioning(ctx)
	if err != nil {
		return nil, err
	}
	return s.ensureOutboxRanges(ctx, every, start, until)
}

// MarkBitmap is markBitmap, for a test against PostgreSQL's get_bit.
func MarkBitmap(seqs []int64, lo, hi int64) []byte { return markBitmap(seqs, lo, hi) }
