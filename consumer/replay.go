package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/dedupkit/dedup"
)

// A Republisher sends a dead-lettered message back to its consumer under
// its original message ID, business key and headers, so the consumer's
// dedup records decide again: a message that completed meanwhile is a
// duplicate, one that never did is applied. A replay with new IDs would
// bypass dedup; no Republisher in this module does that.
type Republisher interface {
	Republish(ctx context.Context, m *Message) error
}

// RepublishFunc adapts a function to [Republisher].
type RepublishFunc func(ctx context.Context, m *Message) error

// Republish calls f.
func (f RepublishFunc) Republish(ctx context.Context, m *Message) error { return f(ctx, m) }

// ToProcessor replays straight into p, in this process, instead of through
// the broker: a Retry decision is a failed replay (the record stays), any
// acknowledging decision a successful one.
func ToProcessor(p *Processor) Republisher {
	return RepublishFunc(func(ctx context.Context, m *Message) error {
		d := p.Process(ctx, m)
		if d.Action == Retry {
			return fmt.Errorf("consumer: replay into %s: retry after %s: %w", p.Name(), d.Delay, d.Err)
		}
		if d.Action == DeadLettered {
			return fmt.Errorf("consumer: replay into %s: dead-lettered again: %w", p.Name(), d.Err)
		}
		return nil
	})
}

// ReplayStatus is what replay did, or would do, with one record.
type ReplayStatus uint8

const (
	// WouldReplay: a dry run found the message not completed.
	WouldReplay ReplayStatus = iota + 1
	// Replayed: republished (and deleted from the dead-letter store unless
	// Keep).
	Replayed
	// AlreadyCompleted: the dedup store holds the key as completed (a
	// redelivery or an earlier replay applied it); not republished, and
	// deleted unless Keep or a dry run.
	AlreadyCompleted
	// SkippedInProgress: a consumer holds the key right now; left for a
	// later replay.
	SkippedInProgress
	// Failed: the republish or the store check failed; the record stays.
	Failed
)

var replayNames = [...]string{"", "would replay", "replayed", "already completed", "in progress", "failed"}

func (s ReplayStatus) String() string {
	if s > 0 && int(s) < len(replayNames) {
		return replayNames[s]
	}
	return "status(?)"
}

// ReplayItem is one record's replay.
type ReplayItem struct {
	Record DeadLetter
	Status ReplayStatus
	Err    error
}

// ReplayOptions select and pace a replay.
type ReplayOptions struct {
	// DryRun reports what a replay would do and changes nothing in the
	// dead-letter store or the broker.
	DryRun bool
	// Rate bounds republishes per second. Default 10; negative: no limit.
	Rate float64
	// Limit stops after this many records (0: all).
	Limit int
	// IDs, if set, replays only these records.
	IDs []string
	// Match, if set, replays only the records it accepts.
	Match func(DeadLetter) bool
	// Store is the consumer's dedup store. With it, replay checks each key
	// first: a completed key is not republished, a key in progress is
	// skipped. The check claims the key for a moment and releases it, so
	// it never records anything. Without it every record is republished
	// and the consumer's dedup decides.
	Store dedup.Store
	// Keep leaves replayed records in the dead-letter store.
	Keep bool
	// Progress, if set, is called after each record.
	Progress func(ReplayItem)
}

// ReplayReport counts a replay's outcomes.
type ReplayReport struct {
	Seen, WouldReplay, Replayed, AlreadyCompleted, InProgress, Failed int
	Items                                                             []ReplayItem
}

func (r *ReplayReport) add(it ReplayItem) {
	r.Items = append(r.Items, it)
	switch it.Status {
	case WouldReplay:
		r.WouldReplay++
	case Replayed:
		r.Replayed++
	case AlreadyCompleted:
		r.AlreadyCompleted++
	case SkippedInProgress:
		r.InProgress++
	case Failed:
		r.Failed++
	}
}

// probeLease is how long the completion check holds a key it acquired
// before releasing it; bounded so a failed release does not block the
// consumer for long.
const probeLease = 5 * time.Second

// Replay sends the dead letters in src back through to, oldest first,
// under their original IDs. It returns the report and the first error
// that stopped it (a cancelled context, a failing list); per-record
// failures are in the report and do not stop it.
func Replay(ctx context.Context, src DeadLetterStore, to Republisher, opts ReplayOptions) (ReplayReport, error) {
	var rep ReplayReport
	if src == nil {
		return rep, &dedup.ArgumentError{Arg: "dead-letter store", Reason: "is nil"}
	}
	if to == nil && !opts.DryRun {
		return rep, &dedup.ArgumentError{Arg: "republisher", Reason: "is nil"}
	}
	rate := opts.Rate
	if rate == 0 {
		rate = 10
	}
	var interval time.Duration
	if rate > 0 {
		interval = time.Duration(float64(time.Second) / rate)
	}
	want := make(map[string]bool, len(opts.IDs))
	for _, id := range opts.IDs {
		want[id] = true
	}
	var next time.Time
	after := ""
	for {
		page, err := src.List(ctx, after, 100)
		if err != nil {
			return rep, fmt.Errorf("consumer: list dead letters: %w", err)
		}
		if len(page) == 0 {
			return rep, nil
		}
		for _, dl := range page {
			after = dl.ID
			if len(want) > 0 && !want[dl.ID] || opts.Match != nil && !opts.Match(dl) {
				continue
			}
			if opts.Limit > 0 && rep.Seen >= opts.Limit {
				return rep, nil
			}
			rep.Seen++
			if !opts.DryRun && interval > 0 {
				if wait := time.Until(next); wait > 0 {
					t := time.NewTimer(wait)
					select {
					case <-ctx.Done():
						t.Stop()
						return rep, ctx.Err()
					case <-t.C:
					}
				}
				next = time.Now().Add(interval)
			}
			if err := ctx.Err(); err != nil {
				return rep, err
			}
			it := replayOne(ctx, src, to, dl, &opts)
			rep.add(it)
			if opts.Progress != nil {
				opts.Progress(it)
			}
		}
	}
}

func replayOne(ctx context.Context, src DeadLetterStore, to Republisher, dl DeadLetter, opts *ReplayOptions) ReplayItem {
	it := ReplayItem{Record: dl}
	if opts.Store != nil {
		st, err := completion(ctx, opts.Store, dl.Key)
		if err != nil {
			it.Status, it.Err = Failed, err
			return it
		}
		switch st {
		case dedup.Duplicate:
			it.Status = AlreadyCompleted
			if !opts.DryRun && !opts.Keep {
				it.Err = src.Delete(ctx, dl.ID)
			}
			return it
		case dedup.InProgress:
			it.Status = SkippedInProgress
			return it
		}
	}
	if opts.DryRun {
		it.Status = WouldReplay
		return it
	}
	m := dl.Message.Clone()
	m.Delivery = 0
	if err := to.Republish(ctx, &m); err != nil {
		it.Status, it.Err = Failed, err
		return it
	}
	it.Status = Replayed
	if !opts.Keep {
		if err := src.Delete(ctx, dl.ID); err != nil {
			it.Err = fmt.Errorf("consumer: replayed, but deleting record %s failed (a later replay will find it completed): %w", dl.ID, err)
		}
	}
	return it
}

// completion reports whether key is completed (Duplicate), held
// (InProgress) or neither (Acquired), by claiming it and releasing at
// once. A fingerprint conflict counts as completed.
func completion(ctx context.Context, s dedup.Store, key dedup.Key) (dedup.Outcome, error) {
	c, err := s.Claim(ctx, key, "", probeLease)
	if err != nil {
		return 0, fmt.Errorf("consumer: check %s in the dedup store: %w", key, err)
	}
	switch c.Outcome {
	case dedup.Acquired:
		if err := s.Release(ctx, c); err != nil && !errors.Is(err, dedup.ErrLeaseLost) {
			return 0, fmt.Errorf("consumer: release the check of %s: %w", key, err)
		}
		return dedup.Acquired, nil
	case dedup.Mismatch:
		return dedup.Duplicate, nil
	}
	return c.Outcome, nil
}
