package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/dedupkit/dedup/consumer"
)

// A lane decides as the processor does, and the processor's Stats count
// its decisions while it is open, after Close (moved once, not twice), and
// after a Process that follows Close.
func TestLaneCountsInStats(t *testing.T) {
	f := newFixture(t)
	var fx effects
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		fx.add(m.ID)
		if m.ID == "bad" {
			return nil, consumer.Reject(errors.New("no such order"), []byte("rejected"))
		}
		return []byte("ok:" + m.ID), nil
	})
	ctx := context.Background()
	l := p.NewLane()
	d := l.Process(ctx, msg("m1"))
	want(t, d, consumer.Ack)
	if d.Duplicate || string(d.Result) != "ok:m1" {
		t.Fatalf("first decision %+v", d)
	}
	d = l.Process(ctx, msg("m1"))
	if !d.Duplicate || string(d.Result) != "ok:m1" {
		t.Fatalf("redelivery %+v, want a duplicate with the stored result", d)
	}
	want(t, l.Process(ctx, msg("bad")), consumer.Rejected)
	want(t, p.Process(ctx, msg("m2")), consumer.Ack) // on the processor itself
	check := func(when string, s consumer.Stats, applied, dups uint64) {
		t.Helper()
		if s.Applied != applied || s.Duplicates != dups || s.Rejected != 1 {
			t.Fatalf("stats %s: %+v, want %d applied, %d duplicates, 1 rejected", when, s, applied, dups)
		}
	}
	check("with the lane open", p.Stats(), 2, 1)
	l.Close()
	check("after Close", p.Stats(), 2, 1)
	l.Close()
	check("after a second Close", p.Stats(), 2, 1)
	want(t, l.Process(ctx, msg("m3")), consumer.Ack)
	want(t, l.Process(ctx, msg("m3")), consumer.Ack)
	check("after a Process on the closed lane", p.Stats(), 3, 2)
	if n := fx.get("m1") + fx.get("m3"); n != 2 {
		t.Fatalf("%d effects of m1 and m3, want 1 each", n)
	}
}

// Lanes used at once by their goroutines, with Stats read meanwhile and
// lanes closed as their goroutines finish: every decision is counted once.
func TestLanesConcurrentStats(t *testing.T) {
	f := newFixture(t)
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		return nil, nil
	})
	const lanes, each = 4, 300
	ctx := context.Background()
	var wg sync.WaitGroup
	stop := make(chan struct{})
	var last consumer.Stats
	var reader sync.WaitGroup
	reader.Go(func() {
		for {
			s := p.Stats()
			if s.Applied < last.Applied || s.Duplicates < last.Duplicates {
				t.Errorf("stats went back: %+v after %+v", s, last)
			}
			last = s
			select {
			case <-stop:
				return
			default:
			}
		}
	})
	for i := range lanes {
		wg.Go(func() {
			l := p.NewLane()
			defer l.Close()
			for j := range each {
				m := msg(fmt.Sprintf("l%d-%d", i, j))
				want(t, l.Process(ctx, m), consumer.Ack)
				if d := l.Process(ctx, m); !d.Duplicate {
					t.Errorf("redelivery of %s: %+v, want a duplicate", m.ID, d)
				}
			}
		})
	}
	wg.Wait()
	close(stop)
	reader.Wait()
	if s := p.Stats(); s.Applied != lanes*each || s.Duplicates != lanes*each {
		t.Fatalf("stats %+v, want %d applied and %d duplicates", s, lanes*each, lanes*each)
	}
}
