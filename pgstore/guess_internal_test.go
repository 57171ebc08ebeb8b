package pgstore

import (
	"sync"
	"testing"
)

// Wrong guesses made at once (several workers sharing a store guessed
// before any learned it was wrong) double the run once, not once each;
// the next episode doubles it again; the run never passes maxGuessRun.
func TestGuessGateOneEpisodeDoublesOnce(t *testing.T) {
	var g guessGate
	if !g.try() {
		t.Fatal("a new store does not guess")
	}
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			g.wrong()
		}()
	}
	wg.Wait()
	if g.run != 1 || g.wait != 1 {
		t.Fatalf("after 8 wrong guesses at once: run %d wait %d, want 1 and 1", g.run, g.wait)
	}
	g.full(true)
	if !g.try() {
		t.Fatal("no guess after the run")
	}
	g.wrong()
	g.wrong()
	if g.run != 2 || g.wait != 2 {
		t.Fatalf("second episode: run %d wait %d, want 2 and 2", g.run, g.wait)
	}
	for range 20 {
		for g.wait > 0 {
			g.full(true)
		}
		g.wrong()
	}
	if g.run != maxGuessRun {
		t.Fatalf("run %d after many episodes, want the cap %d", g.run, maxGuessRun)
	}
}
