package pgstore_test

import (
	"context"
	"math"
	"testing"
	"time"
)

// TestForeverRetentionWindow (found by review): a retention window or a
// replay horizon of "forever" reads back as a long duration, not as a
// negative one, so Check neither warns falsely nor goes silent about a
// retention that is really too short.
func TestForeverRetentionWindow(t *testing.T) {
	s := openStore(t)
	ctx := context.Background()
	forever := time.Duration(math.MaxInt64)
	if err := s.SetRetention(ctx, "kept", forever, 30*24*time.Hour); err != nil {
		t.Fatal(err)
	}
	if err := s.SetRetention(ctx, "short", 24*time.Hour, forever); err != nil {
		t.Fatal(err)
	}
	ws, err := s.RetentionWindows(ctx)
	if err != nil {
		t.Fatal(err)
	}
	long := 200 * 365 * 24 * time.Hour
	for _, w := range ws {
		switch w.Scope {
		case "kept":
			if w.Retention < long {
				t.Errorf("a forever retention reads back as %v", w.Retention)
			}
		case "short":
			if w.ReplayHorizon < long {
				t.Errorf("a forever replay horizon reads back as %v", w.ReplayHorizon)
			}
		}
	}
	st, err := s.Check(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Warnings) != 1 {
		t.Fatalf("Check warnings %q: want exactly one, for scope short (24h under a forever horizon)", st.Warnings)
	}
}
