package consumer

import (
	"context"
	"errors"
	"time"

	"github.com/dedupkit/dedup"
)

// An Applier is a store that commits a message's writes with its dedup
// record in one step, sent at once: pgstore.Store (W = *pgx.Batch) is one.
// Apply runs writes only when it acquires key, and returns the claim as
// RunInbox does.
type Applier[W any] interface {
	Apply(ctx context.Context, key dedup.Key, fp dedup.Fingerprint, retention time.Duration, result []byte, writes W) (dedup.Claim, error)
}

// A WritesHandler turns one message into the writes that apply it and the
// result to store with its record. It must not change anything itself:
// its writes run after it returns, with the record, or not at all (on a
// duplicate they never run).
type WritesHandler[W any] func(ctx context.Context, m *Message, d Delivery) (writes W, result []byte, err error)

// NewApply returns a processor that applies each message by handing the
// writes h builds to ap, which commits them with the dedup record in one
// step (pgstore.Store.Apply: one round trip). A crash at any instant
// leaves both or neither, as with NewInbox; the difference is that h runs
// before the claim, on every delivery, duplicates included, so it must
// only build the writes.
//
// A failing write (a constraint violation, say) is the handler's failure,
// classified as its error is (unclassified: transient), and nothing is
// recorded. A business rejection ([Reject]) records the key with the
// rejection's result and none of the writes. An outcome the reconciler
// settles as applied records the key with the reconciled result.
func NewApply[W any](name string, ap Applier[W], h WritesHandler[W], opts ...Option) (*Processor, error) {
	p, err := newStepProcessor(name, "applier", any(ap) == nil, h == nil, opts)
	if err != nil {
		return nil, err
	}
	p.apply = func(ctx context.Context, p *Processor, m *Message, key dedup.Key, fp dedup.Fingerprint) (applied, error) {
		var a applied
		var writes W
		d := Delivery{Key: key, Attempt: p.track.attempt(key)}
		out, err := p.attempt(ctx, m, d, func(ctx context.Context) ([]byte, error) {
			w, res, err := h(ctx, m, d)
			writes = w
			return res, err
		})
		var ce *classError
		switch {
		case err != nil && errors.As(err, &ce) && ce.class == ClassBusiness:
			var none W
			writes, out, a.recorded = none, ce.result, true
		case err != nil:
			a.ran = true
			return a, err
		}
		c, err := ap.Apply(ctx, key, fp, p.cfg.retention, out, writes)
		if err != nil {
			// A write that failed is the handler's failure; a store
			// failure is not (fail closed).
			a.ran, a.recorded = !dedup.IsStoreError(err), false
			return a, err
		}
		a.ran = c.Outcome == dedup.Acquired
		return a, a.claimed(c, out)
	}
	return p, nil
}
