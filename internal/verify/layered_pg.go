package verify

import (
	"context"
	"errors"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/layered"
	"github.com/dedupkit/dedup/redisstore"
	"github.com/dedupkit/dedup/window"
)

// openLayeredPostgres opens window -> Redis (fast) -> pgstore's inbox: the
// layered store with PostgreSQL as its durable layer, the shape the
// product is run in at scale. --addr names Redis; PostgreSQL is
// $DEDUP_POSTGRES_URL or the loopback default, in a schema of the run's
// own (o.Schema) that holds the dedup tables and the ledger.
func openLayeredPostgres(ctx context.Context, o OpenOptions, win *window.Window, fast *redisstore.Store,
	flush Flusher, closeFast func() error, track func(context.Context, dedup.Key) error) (Target, error) {
	po := o
	po.Addr, po.Mode = "", InboxMode
	t, err := openPostgres(ctx, po)
	if err != nil {
		return nil, errors.Join(err, closeFast())
	}
	pt := t.(*pgTarget)
	opts := []layered.Option{layered.WithInboxLease(o.Lease), layered.WithFast(fast, "redis")}
	if win != nil {
		opts = append(opts, layered.WithWindow(win))
	}
	lay, err := layered.New(opts...)
	if err != nil {
		return nil, errors.Join(err, closeFast(), pt.Close())
	}
	pt.Target = &pgLayeredTarget{inner: pt.Target.(*pgInboxTarget), lay: lay, win: win, closeFast: closeFast,
		flusher: &fastFlusher{flush: flush, every: int64(o.FlushEvery), win: win, track: track}}
	return pt, nil
}

// pgLayeredTarget runs each delivery through layered.Store.RunInbox with
// pgstore's inbox transaction (the ledger insert inside it) as the durable
// step, which decides.
type pgLayeredTarget struct {
	inner     *pgInboxTarget
	lay       *layered.Store
	win       *window.Window
	flusher   *fastFlusher
	closeFast func() error
}

// Store returns "layered".
func (t *pgLayeredTarget) Store() string { return "layered" }

// Mode returns InboxMode.
func (t *pgLayeredTarget) Mode() Mode { return InboxMode }

// Apply runs one delivery through the layers.
func (t *pgLayeredTarget) Apply(ctx context.Context, d Delivery) Result {
	var c dedup.Claim
	err := t.flusher.tick(ctx, d.Key)
	if err == nil {
		c, err = t.lay.RunInbox(ctx, d.Key, d.Fingerprint, retention, func(ctx context.Context) (dedup.Claim, error) {
			return t.inner.runInbox(ctx, d)
		})
	}
	var ipe *dedup.InProgressError
	switch {
	case errors.As(err, &ipe):
		return Result{Outcome: InProgress, RetryAfter: ipe.RetryAfter(time.Now())}
	case errors.Is(err, dedup.ErrFingerprintMismatch):
		return Result{Outcome: Conflict, Err: err}
	}
	return inboxResult(c, err, d)
}

// Effects counts the ledger rows per message ID.
func (t *pgLayeredTarget) Effects(ctx context.Context, prefix string) (map[string]int, error) {
	return t.inner.Effects(ctx, prefix)
}

// LayerStats reports what each layer caught.
func (t *pgLayeredTarget) LayerStats() (map[string]int64, int) {
	return layerCounts(t.lay, t.win, "redis"), t.flusher.count()
}

// Close closes the durable store and the fast store (and deletes the
// run's Redis keys, unless attached).
func (t *pgLayeredTarget) Close() error {
	return errors.Join(t.inner.Close(), t.closeFast())
}
