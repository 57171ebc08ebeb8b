package consumer

import "slices"

// ReusesInFlight reports whether the pipeline holds for reuse the memory
// of a batch still in flight (claimed and not yet decided), or holds one
// batch's memory twice (it would be handed to two batches).
func (pl *Pipeline) ReusesInFlight() bool {
	pl.mu.Lock()
	defer pl.mu.Unlock()
	for i, f := range pl.free {
		if slices.Contains(pl.flight, f) || slices.Contains(pl.free[i+1:], f) {
			return true
		}
	}
	return false
}
