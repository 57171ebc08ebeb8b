package verify

import (
	"context"
	"database/sql"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/layered"
	"github.com/dedupkit/dedup/window"
)

// LayerReporter is a target that can say which layer caught how many
// duplicates, and how many fast-store flushes it injected.
type LayerReporter interface {
	LayerStats() (caught map[string]int64, flushes int)
}

// Flusher empties a fast store, as FLUSHALL or a failover to an empty
// replica does.
type Flusher func(ctx context.Context) error

// layeredInbox puts a window and a fast store in front of a SQL store's
// transactional inbox, through layered.Store.RunInbox, and injects
// fast-store flushes: every flushEvery deliveries it flushes the fast store
// and empties the window (a failover together with a consumer restart), so
// that only the durable inbox stands between a redelivery and a second
// effect.
type layeredInbox struct {
	inner     InboxStore
	lay       *layered.Store
	win       *window.Window
	fastName  string
	flusher   *fastFlusher
	closeFast func() error
}

// fastFlusher flushes a layered target's fast store and empties its window
// every `every` deliveries (a failover together with a consumer restart).
type fastFlusher struct {
	flush     Flusher
	every     int64
	win       *window.Window
	delivered atomic.Int64
	mu        sync.Mutex
	flushes   int
	// track, when not nil, is told each key before the fast store may
	// write it, so that flush can find the keys; its error fails the
	// delivery.
	track func(context.Context, dedup.Key) error
}

// tick counts one delivery of key, flushes when it is due and then
// tracks key.
func (f *fastFlusher) tick(ctx context.Context, key dedup.Key) error {
	if n := f.delivered.Add(1); f.flush != nil && f.every > 0 && n%f.every == 0 {
		f.mu.Lock()
		if err := f.flush(ctx); err == nil {
			f.flushes++
		}
		if f.win != nil {
			f.win.Reset()
		}
		f.mu.Unlock()
	}
	if f.track != nil {
		return f.track(ctx, key)
	}
	return nil
}

func (f *fastFlusher) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.flushes
}

// layerCounts reports what each layer of lay caught.
func layerCounts(lay *layered.Store, win *window.Window, fastName string) map[string]int64 {
	st := lay.Stats()
	m := map[string]int64{"durable": st.Durable}
	if win != nil {
		m["window"] = st.Window
		if st.Bloom > 0 {
			m["bloom"] = st.Bloom
		}
	}
	if fastName != "" {
		m[fastName] = st.Fast
		m[fastName+"_errors"] = st.FastErrors
	}
	return m
}

// NewLayeredInbox returns an inbox-mode target named name: window (may be
// nil) -> fast store (may be nil) -> inner's inbox. With flush set and
// flushEvery > 0 it flushes the fast store every flushEvery deliveries.
// Close closes inner and calls closeFast. track, when not nil, is told
// each key before the fast store may write it (so that flush can find
// the keys); its error fails the delivery.
//
// lease is the fast-store lease held while the durable transaction runs. It
// may be short: if it runs out, another consumer gets past the fast store
// and waits on the durable store's row instead, which still decides.
func NewLayeredInbox(ctx context.Context, name string, inner InboxStore, win *window.Window, fast dedup.Store,
	fastName string, lease time.Duration, flush Flusher, flushEvery int, closeFast func() error,
	track func(context.Context, dedup.Key) error) (*InboxTarget, error) {
	opts := []layered.Option{layered.WithInboxLease(lease)}
	if win != nil {
		opts = append(opts, layered.WithWindow(win))
	}
	if fast != nil {
		opts = append(opts, layered.WithFast(fast, fastName))
	}
	lay, err := layered.New(opts...)
	if err != nil {
		return nil, err
	}
	l := &layeredInbox{inner: inner, lay: lay, win: win, fastName: fastName, closeFast: closeFast,
		flusher: &fastFlusher{flush: flush, every: int64(flushEvery), win: win, track: track}}
	t, err := NewInbox(ctx, name, l)
	if err != nil {
		return nil, err
	}
	t.layers = l
	return t, nil
}

// RunInbox implements InboxStore through the layers.
func (l *layeredInbox) RunInbox(ctx context.Context, key dedup.Key, fp dedup.Fingerprint, ret time.Duration,
	h func(ctx context.Context, tx *sql.Tx) ([]byte, error)) (dedup.Claim, error) {
	if err := l.flusher.tick(ctx, key); err != nil {
		return dedup.Claim{}, err
	}
	return l.lay.RunInbox(ctx, key, fp, ret, func(ctx context.Context) (dedup.Claim, error) {
		return l.inner.RunInbox(ctx, key, fp, ret, h)
	})
}

// DB is the durable store's database, where the ledger lives.
func (l *layeredInbox) DB() *sql.DB { return l.inner.DB() }

// Close closes the durable store and the fast store.
func (l *layeredInbox) Close() error {
	err := l.inner.Close()
	if l.closeFast != nil {
		err = errors.Join(err, l.closeFast())
	}
	return err
}

// LayerStats reports what each layer caught.
func (l *layeredInbox) LayerStats() (map[string]int64, int) {
	return layerCounts(l.lay, l.win, l.fastName), l.flusher.count()
}
