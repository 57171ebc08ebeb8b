package layered

import (
	"context"
	"encoding/binary"
	"sync"
	"time"

	"github.com/dedupkit/dedup"
)

// A Filter is a fast shared record of completed keys (usually Redis, see
// package layered/redisfilter), consulted read-only in front of a durable
// store: a lookup that finds a key completed with a matching fingerprint
// is a duplicate; anything else (a miss, a different or unknown
// fingerprint, an error) goes to the durable store, which decides. The
// layered store writes an entry only after the durable store has recorded
// the key as completed, so an entry never says more than the durable
// record. Losing entries (a flush, a failover, eviction) costs durable
// round trips, never a wrong answer.
//
// Values are opaque to the Filter: the layered store encodes the
// fingerprint, the result and the expiry in them.
type Filter interface {
	// Lookup returns the value stored for key; found is false when there
	// is none. It is called from many goroutines at once.
	Lookup(ctx context.Context, key dedup.Key) (value []byte, found bool, err error)
	// Remember stores the entries, each for its TTL (positive), replacing
	// what was there. The layered store calls it from one goroutine with
	// the entries queued since its last call, so a batch should cost one
	// round trip.
	Remember(ctx context.Context, entries []FilterEntry) error
}

// FilterEntry is one completed key for [Filter.Remember].
type FilterEntry struct {
	Key   dedup.Key
	Value []byte
	TTL   time.Duration
}

// encodeEntry packs a filter value: the expiry (Unix milliseconds), then
// the fingerprint and result as the window stores them. The expiry lets a
// lookup refuse a copy that outlived its record on a skewed or late TTL.
func encodeEntry(fp dedup.Fingerprint, result []byte, expires time.Time) []byte {
	b := make([]byte, 0, 2*binary.MaxVarintLen64+len(fp)+len(result))
	b = binary.AppendUvarint(b, uint64(max(expires.UnixMilli(), 0)))
	b = binary.AppendUvarint(b, uint64(len(fp)))
	b = append(b, fp...)
	return append(b, result...)
}

// decodeEntry unpacks a filter value; ok is false for a value this
// package did not write (then the durable store decides).
func decodeEntry(b []byte) (fp, result []byte, expires time.Time, ok bool) {
	ms, w := binary.Uvarint(b)
	if w <= 0 || ms > 1<<62 {
		return nil, nil, time.Time{}, false
	}
	b = b[w:]
	n, w := binary.Uvarint(b)
	if w <= 0 || uint64(len(b)-w) < n {
		return nil, nil, time.Time{}, false
	}
	return b[w : w+int(n)], b[w+int(n):], time.UnixMilli(int64(ms)), true
}

// filterWrite is one queued Remember: the entry's TTL is counted at send
// time from expires, so a write that waited in the queue does not outlive
// its durable record.
type filterWrite struct {
	key     dedup.Key
	value   []byte
	expires time.Time
	flushed chan struct{} // a Flush marker: closed once everything before it was sent
}

// writer sends filter entries from one goroutine, batching what queued up
// while the previous batch was on the wire, so that a new message's
// latency never includes the filter write.
type writer struct {
	mu     sync.RWMutex // held for reading to enqueue, for writing to close
	closed bool
	ch     chan filterWrite
	wake   chan struct{} // cuts the linger short (Flush, Close)
	done   chan struct{}
}

const (
	writeQueue = 4096 // entries waiting; beyond this an entry is dropped
	writeBatch = 256  // entries per Remember

	// writeLinger is how long the writer waits for more entries before it
	// sends a batch: another instance sees a key in the filter this much
	// later (a miss meanwhile only costs it a durable step).
	writeLinger = 10 * time.Millisecond
)

func (s *Store) startWriter() {
	s.w = &writer{ch: make(chan filterWrite, writeQueue), wake: make(chan struct{}, 1), done: make(chan struct{})}
	go s.writeLoop()
}

// queueFilter queues key's completion for the filter. With the queue full
// (the filter is slower than the durable store, or hangs) it drops the
// entry and counts it (Stats.FilterDropped): an entry only saves a later
// lookup's durable step, and sending it inline would hold the caller, who
// has already committed, for up to the cleanup timeout on every
// completion while the filter hangs. After Close it drops it too.
func (s *Store) queueFilter(_ context.Context, key dedup.Key, fp dedup.Fingerprint, result []byte, expires time.Time) {
	if s.cfg.filter == nil || expires.IsZero() {
		return
	}
	fw := filterWrite{key: key, value: encodeEntry(fp, result, expires), expires: expires}
	s.w.mu.RLock()
	if s.w.closed {
		s.w.mu.RUnlock()
		return
	}
	select {
	case s.w.ch <- fw:
		s.w.mu.RUnlock()
		return
	default:
	}
	s.w.mu.RUnlock()
	s.stats.filterDropped.Add(1)
}

func (s *Store) writeLoop() {
	defer close(s.w.done)
	batch := make([]filterWrite, 0, writeBatch)
	entries := make([]FilterEntry, 0, writeBatch)
	linger := time.NewTimer(time.Hour)
	linger.Stop()
	for fw := range s.w.ch {
		batch = append(batch[:0], fw)
		if fw.flushed == nil {
			// Let entries queue for the linger without waking this
			// goroutine for each (a Flush or Close cuts it short), then
			// take them all: one wake-up and one round trip for many.
			linger.Reset(writeLinger)
			select {
			case <-linger.C:
			case <-s.w.wake:
				linger.Stop()
			}
		}
	gather:
		for len(batch) < writeBatch {
			select {
			case next, ok := <-s.w.ch:
				if !ok {
					break gather
				}
				batch = append(batch, next)
			default:
				break gather
			}
		}
		entries = s.send(context.Background(), batch, entries)
	}
}

// send writes batch to the filter on a detached context bounded by the
// cleanup timeout, then closes the Flush markers in it.
func (s *Store) send(ctx context.Context, batch []filterWrite, entries []FilterEntry) []FilterEntry {
	now := s.cfg.clock.Now()
	entries = entries[:0]
	for _, fw := range batch {
		if fw.flushed != nil {
			continue
		}
		if ttl := fw.expires.Sub(now); ttl > 0 {
			entries = append(entries, FilterEntry{Key: fw.key, Value: fw.value, TTL: ttl})
		}
	}
	if len(entries) > 0 {
		cctx, cancel := s.cleanupContext(ctx)
		err := s.cfg.filter.Remember(cctx, entries)
		cancel()
		if err != nil {
			s.fastFailed(ctx, "remember", entries[0].Key, err)
		}
		s.stats.filterWrites.Add(int64(len(entries)))
	}
	for _, fw := range batch {
		if fw.flushed != nil {
			close(fw.flushed)
		}
	}
	clear(entries) // drop the values for the collector
	return entries
}

// Flush waits until every filter write queued before it has been sent (or
// has failed, which is reported to the hooks), or until ctx ends. Without
// a filter it returns at once. Close flushes too.
func (s *Store) Flush(ctx context.Context) error {
	if s.cfg.filter == nil {
		return nil
	}
	marker := filterWrite{flushed: make(chan struct{})}
	s.w.mu.RLock()
	if s.w.closed {
		s.w.mu.RUnlock()
		return dedup.ErrClosed
	}
	select {
	case s.w.ch <- marker:
	case <-ctx.Done():
		s.w.mu.RUnlock()
		return ctx.Err()
	}
	s.w.mu.RUnlock()
	s.w.poke()
	select {
	case <-marker.flushed:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// closeWriter stops the writer after it has sent what was queued.
func (s *Store) closeWriter() {
	if s.w == nil {
		return
	}
	s.w.mu.Lock()
	if !s.w.closed {
		s.w.closed = true
		close(s.w.ch)
	}
	s.w.mu.Unlock()
	s.w.poke()
	<-s.w.done
}

// poke ends the writer's linger.
func (w *writer) poke() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// gate decides whether a window miss is looked up in the filter: a lookup
// pays when hits × (what a durable step costs) exceeds what the lookups
// cost. It starts open (a process that just started, or took over
// partitions, sees the redeliveries that the filter is for); after a
// period of lookups it closes if they did not pay, and then looks up one
// window miss in probe (probeEvery at first), and opens again once those
// pay. Each closed period whose probes did not pay doubles probe, up to
// maxProbeEvery, so a window that catches every duplicate ends up paying
// a lookup on one new message in 1024 instead of one in 32 (measured in
// docs/benchmarks.md); a durable duplicate (the window missed a
// duplicate: the case the filter is for, a restart or a rebalance) sets
// it back to probeEvery, so the filter is found useful again within
// closedPeriod × probeEvery misses. A closed gate costs nothing on the
// durable path: the durable store decides every key either way.
type gate struct {
	mu       sync.Mutex
	closed   bool
	misses   int64 // window misses while closed
	lookups  int64 // in this period
	hits     int64
	lookupNs int64
	durNs    int64 // durable steps' time and count, over the last periods
	durN     int64
	probe    int64 // window misses per probe while closed; 0 means probeEvery
}

const (
	openPeriod   = 32 // lookups between decisions while open
	closedPeriod = 8  // probe lookups between decisions while closed
	probeEvery   = 32 // window misses per probe while closed, at first
	// maxProbeEvery bounds the backoff of the probes.
	maxProbeEvery = 1024
)

// want reports whether to look this window miss up.
func (g *gate) want() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.closed {
		return true
	}
	g.misses++
	return g.misses%max(g.probe, probeEvery) == 0
}

// durableDuplicate records a durable duplicate on a window miss: while
// closed, probe again at the first rate.
func (g *gate) durableDuplicate() {
	g.mu.Lock()
	g.probe = probeEvery
	g.mu.Unlock()
}

// looked records one lookup and decides at the end of a period.
func (g *gate) looked(hit bool, d time.Duration) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.lookups++
	g.lookupNs += int64(d)
	if hit {
		g.hits++
	}
	period := int64(openPeriod)
	if g.closed {
		period = closedPeriod
	}
	if g.lookups < period || g.durN == 0 {
		return
	}
	// Saved: hits × the mean durable step; spent: every lookup's time.
	saved := float64(g.hits) * float64(g.durNs) / float64(g.durN)
	wasClosed := g.closed
	g.closed = saved <= float64(g.lookupNs)
	switch {
	case !g.closed:
		g.probe = probeEvery
	case wasClosed:
		g.probe = min(max(g.probe, probeEvery)*2, maxProbeEvery)
	}
	g.lookups, g.hits, g.lookupNs = 0, 0, 0
	if g.durN > 1024 { // keep the durable mean recent
		g.durNs, g.durN = g.durNs/2, g.durN/2
	}
}

// durable records one durable step's time.
func (g *gate) durable(d time.Duration) {
	g.mu.Lock()
	g.durNs += int64(d)
	g.durN++
	g.mu.Unlock()
}

func (g *gate) isClosed() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.closed
}
