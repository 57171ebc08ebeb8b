package sqlitestore

import (
	"context"
	"database/sql"
	"errors"
	"time"

	"github.com/dedupkit/dedup"
)

// row is a record as the upsert's RETURNING clause reports it.
type row struct {
	state    int64
	token    []byte
	attempts int64
	fp       any // see encodeFingerprint
	result   []byte
	deadline int64
}

// upsert runs the claim or inbox statement st once and reads its row.
// enc is encodeFingerprint(fp).
func upsert(ctx context.Context, st *sql.Stmt, scopeID int64, id string, enc any, tok *dedup.Token, now, deadline int64) (row, error) {
	var r row
	err := st.QueryRowContext(ctx, scopeID, id, tok[:], enc, now, deadline).
		Scan(&r.state, &r.token, &r.attempts, &r.fp, &r.result, &r.deadline)
	return r, err
}

// outcome turns the row returned by an upsert into a Claim (see
// dedup.ClaimedRecord.ClaimFor). Database/sql's Scan has already copied the
// result bytes.
func outcome(key dedup.Key, fp dedup.Fingerprint, enc any, tok *dedup.Token, r *row) (dedup.Claim, error) {
	if r.state != stateInProgress && r.state != stateCompleted {
		return dedup.Claim{}, errors.New("record of key " + key.String() + " has unknown state")
	}
	stored, err := decodeFingerprint(r.fp, fp, enc)
	if err != nil {
		return dedup.Claim{}, errors.New("record of key " + key.String() + ": " + err.Error())
	}
	at := fromNanos(r.deadline) // the lease's end in progress, the expiry completed
	rec := dedup.ClaimedRecord{Completed: r.state == stateCompleted, Token: r.token, Attempts: int(r.attempts),
		Fingerprint: stored, Result: r.result, LeaseUntil: at, ExpiresAt: at}
	return rec.ClaimFor(key, fp, *tok), nil
}

// Claim asks to own key for lease, in one INSERT ... ON CONFLICT DO UPDATE
// statement; see [dedup.Store]. A take-over of an expired lease counts
// attempt + 1; after Release or an expired completion the count restarts
// at 1.
func (s *Store) Claim(ctx context.Context, key dedup.Key, fp dedup.Fingerprint, lease time.Duration) (dedup.Claim, error) {
	if err := dedup.ValidateClaim(key, fp, lease); err != nil {
		return dedup.Claim{}, err
	}
	if s.closed.Load() {
		return dedup.Claim{}, dedup.ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return dedup.Claim{}, s.fail(ctx, "claim", err, true)
	}
	scopeID, _, err := s.scopeID(ctx, nil, key.Scope, true)
	if err != nil {
		return dedup.Claim{}, s.fail(ctx, "claim", err, true)
	}
	if err := s.enter(ctx); err != nil {
		return dedup.Claim{}, s.fail(ctx, "claim", err, true)
	}
	defer s.leave()
	tok := dedup.NewToken()
	now := s.now()
	enc := encodeFingerprint(fp)
	r, err := upsert(ctx, s.claimStmt, scopeID, key.ID, enc, &tok, now, addNanos(now, lease))
	if err != nil {
		return dedup.Claim{}, s.fail(ctx, "claim", err, false)
	}
	c, err := outcome(key, fp, enc, &tok, &r)
	if err != nil {
		return dedup.Claim{}, s.fail(ctx, "claim", err, false)
	}
	return c, nil
}

// ClaimBatch claims every request in one transaction; see
// [dedup.BatchClaimer]. The claims run in order, so a key repeated in the
// batch is acquired (or found) by its first request and the later ones see
// that record: in progress, or a mismatch if their fingerprint differs.
// On error nothing is claimed if the error says so (SafeToRetry); otherwise
// the claims may have been stored and their leases will expire.
func (s *Store) ClaimBatch(ctx context.Context, reqs []dedup.ClaimRequest, lease time.Duration) ([]dedup.Claim, error) {
	if err := dedup.ValidateBatch(reqs, lease); err != nil {
		return nil, err
	}
	if s.closed.Load() {
		return nil, dedup.ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return nil, s.fail(ctx, "claim batch", err, true)
	}
	out := make([]dedup.Claim, len(reqs))
	if len(reqs) == 0 {
		return out, nil
	}
	scopeIDs := make([]int64, len(reqs))
	for i, req := range reqs {
		if i > 0 && req.Key.Scope == reqs[i-1].Key.Scope {
			scopeIDs[i] = scopeIDs[i-1]
			continue
		}
		id, _, err := s.scopeID(ctx, nil, req.Key.Scope, true)
		if err != nil {
			return nil, s.fail(ctx, "claim batch", err, true)
		}
		scopeIDs[i] = id
	}
	if err := s.enter(ctx); err != nil {
		return nil, s.fail(ctx, "claim batch", err, true)
	}
	defer s.leave()
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, s.fail(ctx, "claim batch", err, true)
	}
	rollback := func(err error) error {
		rerr := tx.Rollback()
		return s.fail(ctx, "claim batch", err, rerr == nil || errors.Is(rerr, sql.ErrTxDone))
	}
	st := tx.StmtContext(ctx, s.claimStmt)
	defer st.Close()
	// BEGIN IMMEDIATE holds the write lock now, so the time read here is
	// not made stale by waiting for the lock.
	now := s.now()
	leaseUntil := addNanos(now, lease)
	for i, req := range reqs {
		tok := dedup.NewToken()
		enc := encodeFingerprint(req.Fingerprint)
		r, err := upsert(ctx, st, scopeIDs[i], req.Key.ID, enc, &tok, now, leaseUntil)
		if err != nil {
			return nil, rollback(err)
		}
		if out[i], err = outcome(req.Key, req.Fingerprint, enc, &tok, &r); err != nil {
			return nil, rollback(err)
		}
	}
	if err := tx.Commit(); err != nil {
		// Commit returns the context's error only when it did not try to
		// commit; any other failure leaves the outcome unknown.
		cerr := ctx.Err()
		return nil, s.fail(ctx, "claim batch", err, cerr != nil && err == cerr)
	}
	return out, nil
}

// Complete marks an acquired claim completed with result, kept for
// retention, in one UPDATE fenced by the claim's token; see [dedup.Store].
// It returns [dedup.ErrLeaseLost] when the token no longer owns the record.
// The store keeps its own copy of result.
func (s *Store) Complete(ctx context.Context, c dedup.Claim, result []byte, retention time.Duration) error {
	if err := dedup.ValidateComplete(c, retention); err != nil {
		return err
	}
	if s.closed.Load() {
		return dedup.ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return s.fail(ctx, "complete", err, true)
	}
	scopeID, found, err := s.scopeID(ctx, nil, c.Key.Scope, false)
	if err != nil {
		return s.fail(ctx, "complete", err, true)
	}
	if !found {
		return dedup.ErrLeaseLost // no record of this scope exists
	}
	if err := s.enter(ctx); err != nil {
		return s.fail(ctx, "complete", err, true)
	}
	defer s.leave()
	expiresAt := addNanos(s.now(), retention)
	res, err := s.completeStmt.ExecContext(ctx, result, expiresAt, scopeID, c.Key.ID, c.Token[:])
	return s.fenced(ctx, "complete", res, err)
}

// Release removes an acquired claim that is still in progress, in one
// DELETE fenced by its token; the next claim acquires at once with attempt
// 1. It never removes a completed record: that, or a token that no longer
// owns the record, gives [dedup.ErrLeaseLost].
func (s *Store) Release(ctx context.Context, c dedup.Claim) error {
	if err := dedup.ValidateRelease(c); err != nil {
		return err
	}
	if s.closed.Load() {
		return dedup.ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return s.fail(ctx, "release", err, true)
	}
	scopeID, found, err := s.scopeID(ctx, nil, c.Key.Scope, false)
	if err != nil {
		return s.fail(ctx, "release", err, true)
	}
	if !found {
		return dedup.ErrLeaseLost
	}
	if err := s.enter(ctx); err != nil {
		return s.fail(ctx, "release", err, true)
	}
	defer s.leave()
	res, err := s.releaseStmt.ExecContext(ctx, scopeID, c.Key.ID, c.Token[:])
	return s.fenced(ctx, "release", res, err)
}

// Extend moves the lease of an acquired claim that is still in progress to
// now + lease, in one UPDATE fenced by its token, and returns the claim
// with its new LeaseUntil; see [dedup.Extender]. A lease that ran out but
// was not taken over can still be extended.
func (s *Store) Extend(ctx context.Context, c dedup.Claim, lease time.Duration) (dedup.Claim, error) {
	if err := dedup.ValidateRelease(c); err != nil {
		return dedup.Claim{}, err
	}
	if lease <= 0 {
		return dedup.Claim{}, &dedup.ArgumentError{Arg: "lease", Reason: "must be positive, got " + lease.String()}
	}
	if s.closed.Load() {
		return dedup.Claim{}, dedup.ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return dedup.Claim{}, s.fail(ctx, "extend", err, true)
	}
	scopeID, found, err := s.scopeID(ctx, nil, c.Key.Scope, false)
	if err != nil {
		return dedup.Claim{}, s.fail(ctx, "extend", err, true)
	}
	if !found {
		return dedup.Claim{}, dedup.ErrLeaseLost
	}
	if err := s.enter(ctx); err != nil {
		return dedup.Claim{}, s.fail(ctx, "extend", err, true)
	}
	defer s.leave()
	leaseUntil := addNanos(s.now(), lease)
	res, err := s.extendStmt.ExecContext(ctx, leaseUntil, scopeID, c.Key.ID, c.Token[:])
	if err := s.fenced(ctx, "extend", res, err); err != nil {
		return dedup.Claim{}, err
	}
	c.LeaseUntil = fromNanos(leaseUntil)
	return c, nil
}

// fenced turns the result of a token-fenced statement into an error: a
// store error if it failed, [dedup.ErrLeaseLost] if it matched no row.
func (s *Store) fenced(ctx context.Context, op string, res sql.Result, err error) error {
	if err != nil {
		return s.fail(ctx, op, err, false)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return s.fail(ctx, op, err, false)
	}
	if n == 0 {
		return dedup.ErrLeaseLost
	}
	return nil
}

// Sweep deletes up to limit records whose time is over, in one bounded
// DELETE, and returns how many it deleted; see [dedup.Sweeper]. It deletes
// completed records whose retention has ended, and in-progress records
// whose lease ended more than [InProgressGrace] ago (their owner is gone).
// An in-progress record with a recently expired lease is kept, so that the
// next claim takes it over and sees that an attempt may have started the
// effect. Call it in a loop until it returns less than limit; each call
// holds the write lock only for its own batch.
func (s *Store) Sweep(ctx context.Context, limit int) (int, error) {
	if limit <= 0 {
		return 0, &dedup.ArgumentError{Arg: "sweep limit", Reason: "must be positive"}
	}
	if s.closed.Load() {
		return 0, dedup.ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return 0, s.fail(ctx, "sweep", err, true)
	}
	if err := s.enter(ctx); err != nil {
		return 0, s.fail(ctx, "sweep", err, true)
	}
	defer s.leave()
	now := s.now()
	res, err := s.sweepStmt.ExecContext(ctx, now, subNanos(now, InProgressGrace), int64(limit))
	if err != nil {
		return 0, s.fail(ctx, "sweep", err, false)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, s.fail(ctx, "sweep", err, false)
	}
	return int(n), nil
}
