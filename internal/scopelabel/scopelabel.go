// Package scopelabel bounds the values of a metric label taken from key
// scopes, which users choose and may multiply without limit (a tenant per
// scope). It is shared by dedupprom and dedupotel.
package scopelabel

import (
	"sync"
	"sync/atomic"
)

// Other is the label value of every scope past the cap or outside the
// allowlist.
const Other = "other"

// A Limiter maps a scope to a bounded label: the scope itself when it is
// in the allowlist, or (without an allowlist) when it is among the first
// Max distinct scopes seen; Other for every other scope. Lookups of known
// scopes take no lock and allocate nothing.
type Limiter struct {
	mapFn   func(string) string
	max     int
	allowed map[string]struct{} // nil: admit the first max
	mu      sync.Mutex
	seen    atomic.Pointer[map[string]string]
}

// New returns a limiter. allow, when non-empty, is the exact set of scopes
// that keep their name; otherwise the first max distinct scopes do. mapFn,
// when not nil, rewrites a scope before either rule (e.g. to drop a tenant
// prefix).
func New(max int, allow []string, mapFn func(string) string) *Limiter {
	l := &Limiter{max: max, mapFn: mapFn}
	if len(allow) > 0 {
		l.allowed = make(map[string]struct{}, len(allow))
		for _, s := range allow {
			l.allowed[s] = struct{}{}
		}
	}
	m := map[string]string{}
	l.seen.Store(&m)
	return l
}

// Label returns the label value of scope.
func (l *Limiter) Label(scope string) string {
	if l.mapFn != nil {
		scope = l.mapFn(scope)
	}
	if l.allowed != nil {
		if _, ok := l.allowed[scope]; ok {
			return scope
		}
		return Other
	}
	seen := *l.seen.Load()
	if v, ok := seen[scope]; ok {
		return v
	}
	if len(seen) >= l.max {
		return Other
	}
	return l.admit(scope)
}

// admit adds scope under the cap, copying the map so that readers never
// lock. The copies stop once the cap is reached, so their total cost is
// bounded by max squared.
func (l *Limiter) admit(scope string) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	old := *l.seen.Load()
	if v, ok := old[scope]; ok {
		return v
	}
	if len(old) >= l.max {
		return Other
	}
	m := make(map[string]string, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	// A private copy of the string: the caller's may alias a buffer.
	s := string(append([]byte(nil), scope...))
	m[s] = s
	l.seen.Store(&m)
	return s
}

// Pair is a cache key of two label values.
type Pair struct{ A, B string }

// Cache maps a pair of bounded label values to pre-resolved series, so
// that an event costs a map lookup instead of a label-hashing lookup in
// the metrics library. The caller bounds the pairs (bounded labels).
type Cache[V any] struct {
	mu   sync.Mutex
	m    atomic.Pointer[map[Pair]*V]
	make func(Pair) *V
}

// NewCache returns a cache that builds a missing entry with mk.
func NewCache[V any](mk func(Pair) *V) *Cache[V] {
	c := &Cache[V]{make: mk}
	m := map[Pair]*V{}
	c.m.Store(&m)
	return c
}

// Get returns the entry of p, building it on first use.
func (c *Cache[V]) Get(p Pair) *V {
	if v, ok := (*c.m.Load())[p]; ok {
		return v
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	old := *c.m.Load()
	if v, ok := old[p]; ok {
		return v
	}
	m := make(map[Pair]*V, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	v := c.make(p)
	m[p] = v
	c.m.Store(&m)
	return v
}

// Scoped returns the entry of (a, the label of scope). A scope that has a
// label of its own is its own label, so without a rewrite it is found in
// one lookup under its raw value; otherwise the label is resolved first.
func (c *Cache[V]) Scoped(a, scope string, l *Limiter) *V {
	if l.mapFn == nil {
		if v, ok := (*c.m.Load())[Pair{A: a, B: scope}]; ok {
			return v
		}
	}
	return c.Get(Pair{A: a, B: l.Label(scope)})
}
