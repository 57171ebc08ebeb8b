package dedup_test

import (
	"math"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
)

func TestDeadlineSaturates(t *testing.T) {
	now := time.Date(2026, 11, 24, 0, 0, 0, 0, time.UTC)
	cases := []struct {
		name string
		now  time.Time
		d    time.Duration
		want time.Time
	}{
		{"an hour", now, time.Hour, now.Add(time.Hour)},
		{"forever", now, math.MaxInt64, dedup.MaxTime},
		{"just past MaxTime", dedup.MaxTime.Add(-time.Second), 2 * time.Second, dedup.MaxTime},
		{"exactly to MaxTime", dedup.MaxTime.Add(-time.Second), time.Second, dedup.MaxTime},
		{"now after MaxTime", dedup.MaxTime.Add(time.Hour), time.Nanosecond, dedup.MaxTime},
		{"zero", now, 0, now},
	}
	for _, c := range cases {
		if got := dedup.Deadline(c.now, c.d); !got.Equal(c.want) {
			t.Errorf("%s: Deadline(%v, %v) = %v, want %v", c.name, c.now, c.d, got, c.want)
		}
		if !c.now.After(dedup.MaxTime) {
			if got := dedup.DeadlineNanos(c.now.UnixNano(), c.d); got != c.want.UnixNano() {
				t.Errorf("%s: DeadlineNanos = %d, want %d", c.name, got, c.want.UnixNano())
			}
		}
	}
	if !dedup.Deadline(now, math.MaxInt64).After(now.Add(200 * 365 * 24 * time.Hour)) {
		t.Fatal("a forever deadline is not in the far future")
	}
	if got := dedup.MaxTime.UnixNano(); got != math.MaxInt64 {
		t.Fatalf("MaxTime.UnixNano() = %d, want MaxInt64", got)
	}
}
