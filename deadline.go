package dedup

import (
	"math"
	"time"
)

// MaxTime is the latest deadline a store records: a lease or retention
// that would end later ("keep forever", math.MaxInt64) ends at MaxTime
// instead of overflowing into the past. It is the last instant that int64
// nanoseconds since 1970 can hold (2262-04-11T23:47:16.854775807Z), so
// every store can represent it: in nanoseconds (memory, SQLite), in
// microseconds (PostgreSQL's timestamptz, truncated) and as a Redis TTL.
var MaxTime = time.Unix(0, math.MaxInt64).UTC()

// Deadline returns now + d, saturating at [MaxTime]: a duration too long
// to represent means "as late as possible", never a time in the past. A
// negative d is added as it is (callers validate durations first).
func Deadline(now time.Time, d time.Duration) time.Time {
	if !now.Before(MaxTime) {
		return MaxTime
	}
	if d >= MaxTime.Sub(now) { // Sub saturates at the longest Duration
		return MaxTime
	}
	return now.Add(d)
}

// DeadlineNanos is [Deadline] on nanoseconds since 1970, for stores that
// keep their clock as an int64: now + d, saturating at math.MaxInt64
// (which is [MaxTime]).
func DeadlineNanos(now int64, d time.Duration) int64 {
	if d > 0 && now > math.MaxInt64-int64(d) {
		return math.MaxInt64
	}
	return now + int64(d)
}
