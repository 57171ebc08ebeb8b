package guard_test

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/dedupkit/dedup/guard"
)

func newParked[T any](t *testing.T, capacity int) *guard.Parked[T] {
	t.Helper()
	p, err := guard.NewParked[T](capacity)
	if err != nil {
		t.Fatalf("NewParked(%d): %v", capacity, err)
	}
	return p
}

func mustPark[T any](t *testing.T, p *guard.Parked[T], agg string, v uint64, msg T) {
	t.Helper()
	if err := p.Park(agg, v, msg); err != nil {
		t.Fatalf("Park(%q, %d): %v", agg, v, err)
	}
}

func TestParkedOrder(t *testing.T) {
	t.Parallel()
	p := newParked[string](t, 10)
	mustPark(t, p, "a", 7, "a7")
	mustPark(t, p, "a", 5, "a5")
	mustPark(t, p, "a", 9, "a9")
	mustPark(t, p, "a", 6, "a6")
	mustPark(t, p, "b", 5, "b5")

	if got := p.Ready("a", 3); got != nil {
		t.Errorf("Ready(a, 3) = %v, want nothing (4 is missing)", got)
	}
	if got, want := p.Ready("a", 4), []string{"a5", "a6", "a7"}; !slices.Equal(got, want) {
		t.Errorf("Ready(a, 4) = %v, want %v", got, want)
	}
	if got, want := p.Versions("a"), []uint64{9}; !slices.Equal(got, want) {
		t.Errorf("Versions(a) = %v, want %v", got, want)
	}
	if got, want := p.Len(), 2; got != want {
		t.Errorf("Len = %d, want %d", got, want)
	}
	if got, want := p.Ready("a", 8), []string{"a9"}; !slices.Equal(got, want) {
		t.Errorf("Ready(a, 8) = %v, want %v", got, want)
	}
	if got, want := p.Ready("b", 4), []string{"b5"}; !slices.Equal(got, want) {
		t.Errorf("Ready(b, 4) = %v, want %v", got, want)
	}
	if got := p.Len(); got != 0 {
		t.Errorf("Len = %d, want 0", got)
	}
}

func TestParkedDrop(t *testing.T) {
	t.Parallel()
	p := newParked[int](t, 10)
	for _, v := range []uint64{8, 3, 5, 4} {
		mustPark(t, p, "a", v, int(v))
	}
	if got, want := p.Drop("a", 5), []int{3, 4, 5}; !slices.Equal(got, want) {
		t.Errorf("Drop(a, 5) = %v, want %v", got, want)
	}
	if got, want := p.Versions("a"), []uint64{8}; !slices.Equal(got, want) {
		t.Errorf("Versions(a) = %v, want %v", got, want)
	}
	if got := p.Len(); got != 1 {
		t.Errorf("Len = %d, want 1", got)
	}
}

func TestParkedCapacity(t *testing.T) {
	t.Parallel()
	p := newParked[string](t, 2)
	mustPark(t, p, "a", 3, "first")
	if err := p.Park("a", 3, "second"); !errors.Is(err, guard.ErrAlreadyParked) {
		t.Errorf("Park same version: %v, want ErrAlreadyParked", err)
	}
	mustPark(t, p, "b", 3, "b3")
	if err := p.Park("c", 3, "c3"); !errors.Is(err, guard.ErrParkingFull) {
		t.Errorf("Park when full: %v, want ErrParkingFull", err)
	}
	if err := p.Park("a", 3, "again"); !errors.Is(err, guard.ErrAlreadyParked) {
		t.Errorf("Park duplicate when full: %v, want ErrAlreadyParked", err)
	}
	if got, want := p.Ready("a", 2), []string{"first"}; !slices.Equal(got, want) {
		t.Errorf("Ready(a, 2) = %v, want %v (the first copy is kept)", got, want)
	}
	mustPark(t, p, "c", 3, "c3") // room again
	if got := p.Len(); got != 2 {
		t.Errorf("Len = %d, want 2", got)
	}
}

// TestParkedConcurrent parks versions 2..n of several aggregates from many
// goroutines while others call Ready, then checks that every message came
// out exactly once and in order.
func TestParkedConcurrent(t *testing.T) {
	t.Parallel()
	const aggs, n = 4, 200
	p := newParked[uint64](t, aggs*n)
	var wg sync.WaitGroup
	for a := range aggs {
		agg := fmt.Sprint("agg", a)
		for w := range 4 {
			wg.Go(func() {
				for v := uint64(2 + w); v <= n; v += 4 {
					if err := p.Park(agg, v, v); err != nil {
						t.Errorf("Park(%s, %d): %v", agg, v, err)
					}
				}
			})
		}
		wg.Go(func() { // a reader whose version 1 is never applied: finds nothing
			for range 100 {
				if got := p.Ready(agg, 5000); got != nil {
					t.Errorf("Ready(%s, 5000) = %v", agg, got)
				}
			}
		})
	}
	wg.Wait()
	if got, want := p.Len(), aggs*(n-1); got != want {
		t.Fatalf("Len = %d, want %d", got, want)
	}
	for a := range aggs {
		agg := fmt.Sprint("agg", a)
		got := p.Ready(agg, 1)
		if len(got) != n-1 {
			t.Fatalf("Ready(%s, 1) returned %d messages, want %d", agg, len(got), n-1)
		}
		for i, v := range got {
			if v != uint64(i+2) {
				t.Fatalf("Ready(%s, 1)[%d] = %d, want %d", agg, i, v, i+2)
			}
		}
	}
	if got := p.Len(); got != 0 {
		t.Errorf("Len = %d, want 0", got)
	}
}
