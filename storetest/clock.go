package storetest

import (
	"sync"
	"time"
)

// Clock is a manual [dedup.Clock] for stores that take one: time moves only
// when Advance is called, so lease and retention tests do not sleep.
type Clock struct {
	mu  sync.Mutex
	now time.Time
}

// NewClock returns a Clock set to a fixed instant.
func NewClock() *Clock {
	return &Clock{now: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)}
}

// Now returns the clock's time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Advance moves the clock forward by d.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}
