package verify

import (
	"context"
	"errors"
	"strings"
	"sync"
	"time"

	"github.com/dedupkit/dedup"
)

// retention is how long completed records live during a run: far longer
// than any redelivery verify makes.
const retention = time.Hour

// LeaseTarget runs a [dedup.Store] in lease mode: a [dedup.Runner] claims
// the key, the handler appends one row to an in-memory ledger, the runner
// completes the claim, and the consumer acknowledges.
//
// Faults: a crash before the commit makes the handler fail with a
// disposition of [dedup.Keep], which leaves the claim in progress exactly as
// a dead consumer would, so the redelivery meets InProgress until the lease
// expires and then takes the key over. A crash after the commit is a run
// that completed and then skips the ack. A handler failure releases the
// claim.
//
// Not injected: a crash between the effect and Complete. In lease mode the
// effect is outside the store, so such a crash would apply it again on the
// take-over; only an inbox transaction or an idempotent effect closes it.
type LeaseTarget struct {
	name   string
	store  dedup.Store
	runner *dedup.Runner
	ledger effectLedger
}

// effectLedger is where lease mode writes its effects: in memory for one
// process, or a file that several processes append to (fileLedger).
type effectLedger interface {
	add(msgID string) error
	counts(prefix string) (map[string]int, error)
	close() error
}

// NewLease returns a lease-mode target on s, named name in the report,
// claiming with the given lease. Close closes s.
func NewLease(name string, s dedup.Store, lease time.Duration) (*LeaseTarget, error) {
	r, err := dedup.NewRunner(s,
		dedup.WithName(name),
		dedup.WithLease(lease),
		dedup.WithRetention(retention),
		dedup.WithClassifier(func(err error) dedup.Disposition {
			if errors.Is(err, errCrash) {
				return dedup.Keep
			}
			return dedup.Release
		}),
	)
	if err != nil {
		return nil, err
	}
	return &LeaseTarget{name: name, store: s, runner: r, ledger: &memLedger{rows: map[string]int{}}}, nil
}

// newLeaseTarget is NewLease with the ledger o asks for: the file
// o.LedgerFile when several processes share the run, else memory.
func newLeaseTarget(name string, s dedup.Store, o OpenOptions) (*LeaseTarget, error) {
	t, err := NewLease(name, s, o.Lease)
	if err != nil || o.LedgerFile == "" {
		return t, err
	}
	l, err := openFileLedger(o.LedgerFile)
	if err != nil {
		return nil, err
	}
	t.ledger = l
	return t, nil
}

// Store returns the name given to NewLease.
func (t *LeaseTarget) Store() string { return t.name }

// Mode returns LeaseMode.
func (t *LeaseTarget) Mode() Mode { return LeaseMode }

// Apply runs one delivery through the runner.
func (t *LeaseTarget) Apply(ctx context.Context, d Delivery) Result {
	res, err := t.runner.Do(ctx, d.Key, d.Fingerprint, func(context.Context) ([]byte, error) {
		switch d.Fault {
		case CrashBeforeCommit:
			return nil, errCrash
		case HandlerFailure:
			return nil, errHandler
		}
		return nil, t.ledger.add(d.MsgID)
	})
	r := Result{TakenOver: res.TakenOver}
	var ipe *dedup.InProgressError
	switch {
	case err == nil && res.Duplicate:
		r.Outcome = Duplicate
	case err == nil && d.Fault == CrashAfterCommit:
		r.Outcome = CrashedAfterCommit
	case err == nil:
		r.Outcome = Applied
	case errors.Is(err, errCrash):
		r.Outcome = CrashedBeforeCommit
	case errors.Is(err, errHandler):
		// A failed release is harmless here: the lease expires and the
		// redelivery takes over.
		r.Outcome = HandlerFailed
	case errors.As(err, &ipe):
		r.Outcome, r.RetryAfter = InProgress, ipe.RetryAfter(time.Now())
	case errors.Is(err, dedup.ErrLeaseLost):
		r.Outcome, r.Err = LeaseLost, err
	case errors.Is(err, dedup.ErrFingerprintMismatch):
		r.Outcome, r.Err = Conflict, err
	default:
		r.Outcome, r.Err = StoreFailed, err
	}
	return r
}

// Effects returns the in-memory ledger's rows per message ID.
func (t *LeaseTarget) Effects(_ context.Context, prefix string) (map[string]int, error) {
	return t.ledger.counts(prefix)
}

// Close closes the store.
func (t *LeaseTarget) Close() error { return errors.Join(t.store.Close(), t.ledger.close()) }

// memLedger is the business table of lease mode: one row per effect,
// counted per message ID. It deliberately keeps duplicates.
type memLedger struct {
	mu   sync.Mutex
	rows map[string]int
}

func (l *memLedger) add(msgID string) error {
	l.mu.Lock()
	l.rows[msgID]++
	l.mu.Unlock()
	return nil
}

func (l *memLedger) close() error { return nil }

func (l *memLedger) counts(prefix string) (map[string]int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make(map[string]int, len(l.rows))
	for id, n := range l.rows {
		if strings.HasPrefix(id, prefix) {
			out[id] = n
		}
	}
	return out, nil
}
