package sqlitestore

import (
	"context"
	"database/sql"
	"errors"
	"time"

	"github.com/dedupkit/dedup"
)

// An InboxHandler applies one message inside the caller's transaction. It
// returns the result to store with the record (replayed to duplicates; may
// be nil) or an error, which makes the caller roll back.
type InboxHandler = func(ctx context.Context, tx *sql.Tx) ([]byte, error)

// Inbox deduplicates one message inside the caller's transaction tx, which
// must come from [Store.DB] (so that it began with BEGIN IMMEDIATE and holds
// the write lock).
//
// In one statement it inserts the record for key directly as completed,
// kept for retention: the transaction is the lease, so no in-progress state
// is needed. It acquires the key when the record is absent, completed and
// expired, or in progress under an expired lease with a matching
// fingerprint (a take-over of a crashed lease-mode owner). Then:
//
//   - Acquired: h runs on tx. On success its result is stored with the
//     record and Inbox returns a Claim with Outcome Acquired, Result (h's
//     result) and ExpiresAt; commit tx to make the record and h's writes
//     durable together. If h fails, Inbox returns h's error unchanged and
//     the caller must roll back: no record remains, and the redelivery
//     applies the message.
//   - Duplicate, InProgress (a [Store.Claim] owner holds a live lease) or
//     Mismatch: h does not run and the error is nil; see [dedup.Claim].
//     Nothing was written, and tx is still usable: the conflict is
//     resolved by ON CONFLICT, which never aborts the transaction.
//
// A store failure gives a [*dedup.StoreError]; roll back. A concurrent
// transaction for the same key waits for tx (SQLite has one writer at a
// time, and waits up to the busy timeout), then sees a duplicate if tx
// committed, or acquires if it rolled back.
func (s *Store) Inbox(ctx context.Context, tx *sql.Tx, key dedup.Key, fp dedup.Fingerprint, retention time.Duration, h InboxHandler) (dedup.Claim, error) {
	if tx == nil {
		return dedup.Claim{}, &dedup.ArgumentError{Arg: "transaction", Reason: "is nil"}
	}
	if err := validateInbox(key, fp, retention, h); err != nil {
		return dedup.Claim{}, err
	}
	if s.closed.Load() {
		return dedup.Claim{}, dedup.ErrClosed
	}
	c, herr, serr := s.inbox(ctx, tx, key, fp, retention, h)
	if serr != nil {
		return dedup.Claim{}, serr
	}
	if herr != nil {
		return dedup.Claim{}, herr
	}
	return c, nil
}

// RunInbox runs [Store.Inbox] in a transaction of its own on [Store.DB]:
// it begins the transaction, runs Inbox, and commits if h ran and
// succeeded. For a duplicate, an in-progress key or a mismatch nothing was
// written and the transaction is rolled back; the Claim says which. If h
// fails (or panics) the transaction is rolled back and h's error returned
// unchanged; nothing remains, and the redelivery applies the message.
//
// A failed commit gives a [*dedup.StoreError] whose outcome is unknown
// unless it says NotApplied: the record and h's writes are committed
// together or not at all, so the redelivery finds out which.
func (s *Store) RunInbox(ctx context.Context, key dedup.Key, fp dedup.Fingerprint, retention time.Duration, h InboxHandler) (dedup.Claim, error) {
	if err := validateInbox(key, fp, retention, h); err != nil {
		return dedup.Claim{}, err
	}
	if s.closed.Load() {
		return dedup.Claim{}, dedup.ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return dedup.Claim{}, s.fail(ctx, "inbox", err, true)
	}
	// The scope's id, committed on its own before the transaction (once
	// per scope and process), so that it can be cached.
	if _, _, err := s.scopeID(ctx, nil, key.Scope, true); err != nil {
		return dedup.Claim{}, s.fail(ctx, "inbox", err, true)
	}
	if err := s.enter(ctx); err != nil {
		return dedup.Claim{}, s.fail(ctx, "inbox begin", err, true)
	}
	defer s.leave()
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return dedup.Claim{}, s.fail(ctx, "inbox begin", err, true)
	}
	done := false
	defer func() {
		if !done {
			// Reached on a handler error or panic; the handler's error
			// is what the caller needs, and without a commit nothing is
			// applied whatever Rollback says.
			_ = tx.Rollback()
		}
	}()
	c, herr, serr := s.inbox(ctx, tx, key, fp, retention, h)
	if serr != nil {
		done = true
		rerr := tx.Rollback()
		serr.NotApplied = rerr == nil || errors.Is(rerr, sql.ErrTxDone)
		return dedup.Claim{}, serr
	}
	if herr != nil {
		return dedup.Claim{}, herr
	}
	done = true
	if c.Outcome != dedup.Acquired {
		// Nothing to keep: the upsert found the record and left it as is.
		_ = tx.Rollback()
		return c, nil
	}
	if err := tx.Commit(); err != nil {
		// Commit returns the context's error only when it did not try to
		// commit; any other failure leaves the outcome unknown.
		cerr := ctx.Err()
		return dedup.Claim{}, s.fail(ctx, "inbox commit", err, cerr != nil && err == cerr)
	}
	return c, nil
}

func validateInbox(key dedup.Key, fp dedup.Fingerprint, retention time.Duration, h InboxHandler) error {
	if h == nil {
		return &dedup.ArgumentError{Arg: "handler", Reason: "is nil"}
	}
	if retention <= 0 {
		return &dedup.ArgumentError{Arg: "retention", Reason: "must be positive, got " + retention.String()}
	}
	return dedup.ValidateClaim(key, fp, retention)
}

// inbox does the work of Inbox and keeps the handler's error (herr) apart
// from the store's (serr).
func (s *Store) inbox(ctx context.Context, tx *sql.Tx, key dedup.Key, fp dedup.Fingerprint, retention time.Duration, h InboxHandler) (c dedup.Claim, herr error, serr *dedup.StoreError) {
	if err := ctx.Err(); err != nil {
		return c, nil, s.fail(ctx, "inbox", err, true)
	}
	// Inside the caller's transaction: a new scope is added in it (and
	// rolled back with it), and its id is not cached.
	scopeID, _, err := s.scopeID(ctx, tx, key.Scope, true)
	if err != nil {
		return c, nil, s.fail(ctx, "inbox", err, false)
	}
	st := tx.StmtContext(ctx, s.inboxStmt)
	defer st.Close()
	tok := dedup.NewToken()
	now := s.now()
	enc := encodeFingerprint(fp)
	r, err := upsert(ctx, st, scopeID, key.ID, enc, &tok, now, addNanos(now, retention))
	if err != nil {
		return c, nil, s.fail(ctx, "inbox", err, false)
	}
	if c, err = outcome(key, fp, enc, &tok, &r); err != nil {
		return c, nil, s.fail(ctx, "inbox", err, false)
	}
	if c.Outcome != dedup.Acquired {
		return c, nil, nil
	}
	out, err := h(ctx, tx)
	if err != nil {
		return dedup.Claim{}, err, nil
	}
	if out != nil {
		done := tx.StmtContext(ctx, s.inboxDoneStmt)
		defer done.Close()
		res, err := done.ExecContext(ctx, out, scopeID, key.ID, tok[:])
		if err != nil {
			return dedup.Claim{}, nil, s.fail(ctx, "inbox result", err, false)
		}
		if n, err := res.RowsAffected(); err != nil || n != 1 {
			if err == nil {
				err = errors.New("the handler removed or changed the inbox record of key " + key.String())
			}
			return dedup.Claim{}, nil, s.fail(ctx, "inbox result", err, false)
		}
	}
	c.Result = out
	return c, nil, nil
}
