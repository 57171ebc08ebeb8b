package dedupotel_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/dedupotel"
	"go.opentelemetry.io/otel/attribute"
)

// TestSweepEvents: sweeper passes through the root hooks become
// dedup.sweep.deleted and one dedup.sweep.duration observation per pass,
// by result.
func TestSweepEvents(t *testing.T) {
	r := newRig(t)
	h := dedup.NewHooks(r.tel)
	ctx := context.Background()
	h.Swept(ctx, dedup.SweepEvent{Store: "postgres", Deleted: 500, Batches: 1, Duration: time.Millisecond})
	h.Swept(ctx, dedup.SweepEvent{Store: "postgres", Deleted: 20, Batches: 1, Duration: time.Millisecond})
	h.Swept(ctx, dedup.SweepEvent{Store: "postgres", Deleted: 3, Err: errors.New("connection reset")})
	h.Swept(ctx, dedup.SweepEvent{Store: "sqlite", Deleted: 0})
	for _, c := range []struct {
		name   string
		want   int64
		result string
		store  string
	}{
		{"dedup.sweep.deleted", 523, "", "postgres"},
		{"dedup.sweep.deleted", 0, "", "sqlite"},
		{"dedup.sweep.duration", 2, "ok", "postgres"},
		{"dedup.sweep.duration", 1, "error", "postgres"},
		{"dedup.sweep.duration", 1, "ok", "sqlite"},
	} {
		kv := []attribute.KeyValue{dedupotel.AttrStore.String(c.store)}
		if c.result != "" {
			kv = append(kv, dedupotel.AttrResult.String(c.result))
		}
		if got := r.sum(t, c.name, kv...); got != c.want {
			t.Errorf("%s %s %s = %d, want %d", c.name, c.store, c.result, got, c.want)
		}
	}
}
