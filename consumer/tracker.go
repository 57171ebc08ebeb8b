package consumer

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup"
)

// tracker remembers failed attempts per key, bounded, in this process. A
// success or a dead letter forgets the key. The hot path (a key that never
// failed) reads one atomic and takes no lock.
type tracker struct {
	size  atomic.Int64
	mu    sync.Mutex
	cap   int
	m     map[dedup.Key]*failState
	order []dedup.Key // insertion order, with stale entries skipped
}

type failState struct {
	failures    int
	first, last time.Time
	unknown     bool // the last failure was an unknown outcome
}

func newTracker(capacity int) *tracker {
	return &tracker{cap: capacity, m: make(map[dedup.Key]*failState)}
}

// attempt returns the number of the attempt about to run at key.
func (t *tracker) attempt(k dedup.Key) int {
	if t.size.Load() == 0 {
		return 1
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if s := t.m[k]; s != nil {
		return s.failures + 1
	}
	return 1
}

// unknown reports whether key's last failure was an unknown outcome.
func (t *tracker) unknown(k dedup.Key) bool {
	if t.size.Load() == 0 {
		return false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.m[k]
	return s != nil && s.unknown
}

// fail counts a failure at now and returns the failure count.
func (t *tracker) fail(k dedup.Key, now time.Time, unknown bool) (int, time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.m[k]
	if s == nil {
		for len(t.m) >= t.cap && len(t.order) > 0 {
			old := t.order[0]
			t.order = t.order[1:]
			delete(t.m, old)
		}
		s = &failState{first: now}
		t.m[k] = s
		t.order = append(t.order, k)
		if len(t.order) > 2*t.cap+16 {
			t.compact()
		}
	}
	s.failures++
	s.last = now
	s.unknown = unknown
	t.size.Store(int64(len(t.m)))
	return s.failures, s.first
}

// times returns key's first and last failure times, zero if none.
func (t *tracker) times(k dedup.Key) (first, last time.Time) {
	if t.size.Load() == 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if s := t.m[k]; s != nil {
		return s.first, s.last
	}
	return
}

func (t *tracker) forget(k dedup.Key) {
	if t.size.Load() == 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.m, k)
	t.size.Store(int64(len(t.m)))
}

// compact drops order entries whose keys were forgotten or re-added.
func (t *tracker) compact() {
	seen := make(map[dedup.Key]bool, len(t.m))
	kept := t.order[:0]
	for _, k := range t.order {
		if t.m[k] != nil && !seen[k] {
			seen[k] = true
			kept = append(kept, k)
		}
	}
	t.order = kept
}
