package verify

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/dedupkit/dedup"
)

// InboxStore is a SQL store with a transactional inbox, as
// sqlitestore.Store is.
type InboxStore interface {
	// RunInbox begins a transaction, inserts the key's record as completed
	// (or finds it), runs h on the same transaction only when it acquired
	// the key, and commits when h succeeds or rolls back when it fails.
	RunInbox(ctx context.Context, key dedup.Key, fp dedup.Fingerprint, retention time.Duration,
		h func(ctx context.Context, tx *sql.Tx) ([]byte, error)) (dedup.Claim, error)
	// DB is the store's database, where the ledger table lives.
	DB() *sql.DB
	// Close closes the store.
	Close() error
}

// ledgerDDL is the business table. It has no unique constraint on purpose:
// a message applied twice shows up as two rows.
const ledgerDDL = `CREATE TABLE IF NOT EXISTS ledger (msg_id TEXT NOT NULL, applied_at INTEGER)`

// InboxTarget runs a SQL store in inbox mode: the ledger row is inserted
// inside the inbox transaction, so the dedup record and the effect commit
// together or not at all.
//
// Faults: a crash before the commit inserts the ledger row and then fails
// the handler, so the transaction rolls back, row and record alike, as when
// the process dies mid-transaction. A crash after the commit is a committed
// transaction whose delivery is not acknowledged. A handler failure fails
// before the insert.
type InboxTarget struct {
	name   string
	store  InboxStore
	layers LayerReporter // set for a layered target
}

// NewInbox returns an inbox-mode target on s, named name in the report,
// after creating the ledger table in s.DB() if it is missing. Close closes s.
func NewInbox(ctx context.Context, name string, s InboxStore) (*InboxTarget, error) {
	if _, err := s.DB().ExecContext(ctx, ledgerDDL); err != nil {
		return nil, fmt.Errorf("create ledger table: %w", err)
	}
	return &InboxTarget{name: name, store: s}, nil
}

// Store returns the name given to NewInbox.
func (t *InboxTarget) Store() string { return t.name }

// Mode returns InboxMode.
func (t *InboxTarget) Mode() Mode { return InboxMode }

// Apply runs one delivery through the store's inbox.
func (t *InboxTarget) Apply(ctx context.Context, d Delivery) Result {
	c, err := t.store.RunInbox(ctx, d.Key, d.Fingerprint, retention, func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
		if d.Fault == HandlerFailure {
			return nil, errHandler
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO ledger (msg_id, applied_at) VALUES (?, ?)`, d.MsgID, time.Now().UnixNano()); err != nil {
			return nil, err
		}
		if d.Fault == CrashBeforeCommit {
			return nil, errCrash
		}
		return nil, nil
	})
	r := Result{TakenOver: c.TakenOver}
	var ipe *dedup.InProgressError
	switch {
	case errors.Is(err, errCrash):
		r.Outcome = CrashedBeforeCommit
	case errors.Is(err, errHandler):
		r.Outcome = HandlerFailed
	case errors.As(err, &ipe):
		r.Outcome, r.RetryAfter = InProgress, ipe.RetryAfter(time.Now())
	case errors.Is(err, dedup.ErrFingerprintMismatch):
		r.Outcome, r.Err = Conflict, err
	case err != nil:
		r.Outcome, r.Err = StoreFailed, err
	default:
		switch c.Outcome {
		case dedup.Acquired:
			r.Outcome = Applied
			if d.Fault == CrashAfterCommit {
				r.Outcome = CrashedAfterCommit
			}
		case dedup.Duplicate:
			r.Outcome = Duplicate
		case dedup.InProgress:
			r.Outcome, r.RetryAfter = InProgress, time.Until(c.LeaseUntil)
		case dedup.Mismatch:
			r.Outcome, r.Err = Conflict, dedup.ErrFingerprintMismatch
		default:
			r.Outcome, r.Err = StoreFailed, fmt.Errorf("inbox returned outcome %v", c.Outcome)
		}
	}
	return r
}

// Effects counts the ledger rows per message ID.
func (t *InboxTarget) Effects(ctx context.Context, prefix string) (map[string]int, error) {
	// A range scan instead of LIKE, so no character of prefix is special.
	rows, err := t.store.DB().QueryContext(ctx,
		`SELECT msg_id, COUNT(*) FROM ledger WHERE msg_id >= ? AND msg_id < ? GROUP BY msg_id`,
		prefix, prefix+"\U0010FFFF")
	if err != nil {
		return nil, fmt.Errorf("read ledger: %w", err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			return nil, fmt.Errorf("read ledger: %w", err)
		}
		out[id] = n
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read ledger: %w", err)
	}
	return out, nil
}

// Close closes the store.
func (t *InboxTarget) Close() error { return t.store.Close() }

// LayerStats reports what each layer of a layered target caught; nil for
// a plain store.
func (t *InboxTarget) LayerStats() (map[string]int64, int) {
	if t.layers == nil {
		return nil, 0
	}
	return t.layers.LayerStats()
}
