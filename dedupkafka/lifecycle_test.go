package dedupkafka

import (
	"context"
	"runtime"
	"sync/atomic"
	"testing"
)

// Close looked twice at whether Run had started: once to choose between
// waiting for Run and closing the client itself, and once more (a
// compare-and-swap) to claim the close. A Run that started between the
// looks made both fail: Close returned at once, while Run went on (it
// returns ErrClosed, but only after closing the client), so Close
// returned before the client was closed and before Run returned, which
// its doc promises. The Consumer and the Transactor share the
// lifecycle. Here a Run-shaped function (the lifecycle's steps as Run
// takes them, its client's Close gated) starts at the moment Close has
// looked.
func TestCloseWhileRunStarts(t *testing.T) {
	l := newLifecycle()
	gate := make(chan struct{})
	var released atomic.Int32
	runErr := make(chan error, 1)
	run := func() error {
		if !l.running.CompareAndSwap(false, true) {
			return ErrClosed
		}
		defer close(l.done)
		_, cancel, ok := l.runContext(context.Background())
		defer cancel()
		if !ok {
			<-gate // the client's Close
			released.Add(1)
			return ErrClosed
		}
		t.Error("Run started after Close")
		return nil
	}
	l.looked = func() {
		go func() { runErr <- run() }()
		for !l.running.Load() {
			// Wait for Run's start (or, once Close has claimed the
			// lifecycle, go on at once).
			runtime.Gosched()
		}
	}
	stopped := make(chan struct{})
	go func() {
		l.stop(func() { released.Add(1) })
		close(stopped)
	}()
	select {
	case <-stopped:
		select {
		case <-l.done:
		default:
			close(gate)
			<-runErr
			t.Fatal("Close returned while Run was still running")
		}
	case <-l.done:
		// Close waits for Run, which waits for the gate.
	}
	close(gate)
	<-stopped
	if err := <-runErr; err != ErrClosed {
		t.Fatalf("Run: %v, want ErrClosed", err)
	}
	if n := released.Load(); n != 1 {
		t.Fatalf("the client was closed %d times, want 1", n)
	}
}
