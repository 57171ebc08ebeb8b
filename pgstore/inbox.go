package pgstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/jackc/pgx/v5"
)

// An InboxHandler applies one message inside the caller's transaction. It
// returns the result to store with the record (replayed to duplicates; may
// be nil) or an error, which makes the caller roll back.
type InboxHandler = func(ctx context.Context, tx pgx.Tx) ([]byte, error)

// An SQLInboxHandler is an [InboxHandler] for a database/sql transaction.
type SQLInboxHandler = func(ctx context.Context, tx *sql.Tx) ([]byte, error)

// Inbox deduplicates one message inside the caller's transaction tx and,
// if the message is new, applies it there with h.
//
// In one statement it inserts the record for key directly as completed,
// kept for retention (or the scope's retention window if longer): the
// transaction is the lease, so no in-progress state is needed. It acquires
// the key when the record is absent, completed and expired, or in progress
// under an expired lease with a matching fingerprint (a take-over of a
// crashed lease-mode owner). Then:
//
//   - Acquired: h runs on tx. On success its result is stored with the
//     record and Inbox returns a Claim with Outcome Acquired, Result (h's
//     result) and ExpiresAt; commit tx to make the record and h's writes
//     durable together. If h fails, Inbox returns h's error unchanged and
//     the caller must roll back: no record remains, and the redelivery
//     applies the message.
//   - Duplicate, InProgress (a [Store.Claim] owner holds a live lease) or
//     Mismatch: h does not run and the error is nil; see [dedup.Claim].
//     The conflict is resolved by ON CONFLICT DO UPDATE, which never
//     raises, so tx is still usable (a plain INSERT's unique violation
//     would abort it). tx keeps a lock on the record until it ends.
//
// A concurrent transaction with the same key blocks on the primary key
// index (partitioned store: on the key's advisory lock) until tx ends, then
// sees a duplicate if tx committed, or acquires if it rolled back. Use
// READ COMMITTED, PostgreSQL's default: under REPEATABLE READ or
// SERIALIZABLE that concurrent transaction fails with a serialization
// error (SQLSTATE 40001) instead, to be retried like any write conflict
// at those levels, and the partitioned store refuses to run.
//
// Inbox takes a pgx.Tx rather than anything that can run a query on
// purpose: on a pool or a connection in autocommit the record would commit
// before h ran, and a failing h would lose the message. It never begins,
// commits or rolls back tx, and runs no DDL. A store failure gives a
// [*dedup.StoreError]; roll back.
func (s *Store) Inbox(ctx context.Context, tx pgx.Tx, key dedup.Key, fp dedup.Fingerprint, retention time.Duration, h InboxHandler) (dedup.Claim, error) {
	if tx == nil {
		return dedup.Claim{}, &dedup.ArgumentError{Arg: "transaction", Reason: "is nil"}
	}
	if err := validateInbox(key, fp, retention, h == nil); err != nil {
		return dedup.Claim{}, err
	}
	if err := s.begin(ctx, "inbox"); err != nil {
		return dedup.Claim{}, err
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

// inbox does the work of Inbox and keeps the handler's error (herr) apart
// from the store's (serr).
func (s *Store) inbox(ctx context.Context, tx pgx.Tx, key dedup.Key, fp dedup.Fingerprint, retention time.Duration, h InboxHandler) (c dedup.Claim, herr error, serr *dedup.StoreError) {
	// In the caller's transaction: the pool may have no other connection
	// to give, and a scope or a moved record must commit or roll back
	// with the caller's record.
	ref, err := s.txRef(ctx, func(q string, args []any, dest ...any) error { return tx.QueryRow(ctx, q, args...).Scan(dest...) }, key)
	if err != nil {
		return c, nil, s.fail(ctx, "inbox", err, false)
	}
	tok := dedup.NewToken()
	fpd := fpDigest(fp)
	var r row
	args := []any{ref.scope, ref.id, tok[:], fpd, micros(retention)}
	if s.cfg.partition > 0 {
		err = s.lockedRow(ctx, tx, s.keyLock(key), key, s.sql.pInbox, &r, args...)
	} else {
		err = tx.QueryRow(ctx, s.sql.inbox, args...).Scan(r.dest()...)
	}
	if err != nil {
		return c, nil, s.fail(ctx, "inbox", err, false)
	}
	if c, err = outcome(key, fp, fpd, &tok, &r); err != nil {
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
		tag, err := tx.Exec(ctx, s.sql.inboxResult, ref.scope, ref.id, tok[:], out)
		if err == nil && tag.RowsAffected() != 1 {
			err = errors.New("the handler removed or changed the inbox record of key " + key.String())
		}
		if err != nil {
			return dedup.Claim{}, nil, s.fail(ctx, "inbox result", err, false)
		}
	}
	c.Result = out
	return c, nil, nil
}

// InboxSQL is [Store.Inbox] for a database/sql transaction on the same
// database, such as one from pgx's stdlib adapter
// (stdlib.OpenDBFromPool(store.Pool())). Its statements use only scalar
// parameters, so any PostgreSQL driver for database/sql works.
func (s *Store) InboxSQL(ctx context.Context, tx *sql.Tx, key dedup.Key, fp dedup.Fingerprint, retention time.Duration, h SQLInboxHandler) (dedup.Claim, error) {
	if tx == nil {
		return dedup.Claim{}, &dedup.ArgumentError{Arg: "transaction", Reason: "is nil"}
	}
	if err := validateInbox(key, fp, retention, h == nil); err != nil {
		return dedup.Claim{}, err
	}
	if err := s.begin(ctx, "inbox"); err != nil {
		return dedup.Claim{}, err
	}
	ref, err := s.txRef(ctx, func(q string, args []any, dest ...any) error {
		return tx.QueryRowContext(ctx, q, args...).Scan(dest...)
	}, key)
	if err != nil {
		return dedup.Claim{}, s.fail(ctx, "inbox", err, false)
	}
	tok := dedup.NewToken()
	fpd := fpDigest(fp)
	var r row
	args := []any{ref.scope, ref.id, tok[:], fpd, micros(retention)}
	if s.cfg.partition > 0 {
		_, err = tx.ExecContext(ctx, s.sql.lock, s.keyLock(key))
		if err == nil && !s.converted.Load() {
			var pending bool
			if err = tx.QueryRowContext(ctx, s.sql.pAdoptIDs, []string{key.Scope}, []string{key.ID}, []int32{ref.scope}).Scan(&pending); err == nil && !pending {
				s.converted.Store(true)
			}
		}
		if err == nil {
			var scope int32
			var id []byte
			err = tx.QueryRowContext(ctx, s.sql.pInbox, args...).Scan(append([]any{&scope, &id}, r.dest()...)...)
			if errors.Is(err, sql.ErrNoRows) {
				err = errNotReadCommitted
			}
		}
	} else {
		err = tx.QueryRowContext(ctx, s.sql.inbox, args...).Scan(r.dest()...)
	}
	if err != nil {
		return dedup.Claim{}, s.fail(ctx, "inbox", err, false)
	}
	c, err := outcome(key, fp, fpd, &tok, &r)
	if err != nil {
		return dedup.Claim{}, s.fail(ctx, "inbox", err, false)
	}
	if c.Outcome != dedup.Acquired {
		return c, nil
	}
	out, err := h(ctx, tx)
	if err != nil {
		return dedup.Claim{}, err
	}
	if out != nil {
		res, err := tx.ExecContext(ctx, s.sql.inboxResult, ref.scope, ref.id, tok[:], out)
		if err == nil {
			var n int64
			if n, err = res.RowsAffected(); err == nil && n != 1 {
				err = errors.New("the handler removed or changed the inbox record of key " + key.String())
			}
		}
		if err != nil {
			return dedup.Claim{}, s.fail(ctx, "inbox result", err, false)
		}
	}
	c.Result = out
	return c, nil
}

// RunInbox runs [Store.Inbox] in a transaction of its own on the store's
// pool: it begins the transaction (READ COMMITTED), runs Inbox, and commits
// if h ran and succeeded. For a duplicate, an in-progress key or a
// mismatch nothing was written and the transaction is rolled back; the
// Claim says which. If h fails (or panics) the transaction is rolled back
// and h's error returned unchanged; nothing remains, and the redelivery
// applies the message.
//
// It spends as few round trips as the steps allow: the BEGIN and the
// record's upsert (on a partitioned store, the key's lock as well) go in
// one pipelined batch, then h's statements, then the COMMIT, sent in one
// batch with the UPDATE that stores h's result when there is one. A new
// message therefore costs the round trips of a bare transaction doing h's
// writes. On the plain table the claim updates a conflicting row only
// when it can take it (each column a plain assignment, not a CASE), so a
// key it cannot take comes back empty and is read, locked, in one more
// statement: a duplicate costs three round trips (the batch, the read,
// the ROLLBACK).
//
// h gets a pgx.Tx that is pgx's own transaction underneath: nested
// transactions (tx.Begin, on savepoints), LargeObjects and every other
// method work as on a transaction from pgx's pool, and after RunInbox
// returns every method returns an error wrapping pgx.ErrTxClosed. h must
// not commit or roll it back itself; if it does, RunInbox returns a
// [*dedup.StoreError] (NotApplied if it rolled back). When h has used a
// nested transaction or LargeObjects, its result's UPDATE and the COMMIT
// take two round trips instead of one.
//
// A store error before the commit is NotApplied: the transaction never
// committed. A failed commit is NotApplied only when PostgreSQL reported
// the rollback; otherwise (the connection broke during COMMIT) the outcome
// is unknown, and the record and h's writes are committed together or not
// at all, so the redelivery finds out which. The connection goes back to
// the pool idle, or is closed when its state is unknown; it is never
// returned inside a transaction, whatever h or the context does.
func (s *Store) RunInbox(ctx context.Context, key dedup.Key, fp dedup.Fingerprint, retention time.Duration, h InboxHandler) (dedup.Claim, error) {
	if err := validateInbox(key, fp, retention, h == nil); err != nil {
		return dedup.Claim{}, err
	}
	if err := s.begin(ctx, "inbox"); err != nil {
		return dedup.Claim{}, err
	}
	ref, err := s.ref(ctx, key) // before taking a connection: it may need one
	if err != nil {
		return dedup.Claim{}, s.fail(ctx, "inbox begin", err, true)
	}
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return dedup.Claim{}, s.fail(ctx, "inbox begin", err, true)
	}
	tok := dedup.NewToken()
	fpd := fpDigest(fp)
	var b pgx.Batch
	b.BeginTx(pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	args := []any{ref.scope, ref.id, tok[:], fpd, micros(retention)}
	var adopt bool
	if s.cfg.partition > 0 {
		adopt = s.queueLocked(&b, s.keyLock(key), key, s.sql.pInbox, args...)
	} else {
		adopt = s.queueAdopt(&b, false, []string{key.Scope}, []string{key.ID}, []int32{ref.scope})
		b.Queue(s.inboxStmt(), args...)
	}
	br := conn.Conn().SendBatch(ctx, &b)
	tx := &inboxTx{tx: br.Tx(), conn: conn.Conn()}
	defer func() {
		// Whatever happened (a store error, a duplicate, a handler
		// error or panic, a cancelled context), nothing that did not
		// commit stays open: roll back, and the pool destroys a
		// connection that is not idle after that.
		tx.end(ctx)
		conn.Release()
	}()
	op := "inbox begin"
	_, err = br.Exec()
	var r row
	taken := true // the claim returned the row it acquired
	if err == nil {
		op = "inbox"
		if s.cfg.partition > 0 {
			err = s.readLocked(br, adopt, &r)
		} else {
			if adopt {
				err = s.readAdopt(br)
			}
			if err == nil {
				if err = br.QueryRow().Scan(r.dest()...); errors.Is(err, pgx.ErrNoRows) {
					taken, err = false, nil
				}
			}
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err == nil && !taken {
		// A key the claim could not take: it locked the row; read it. One
		// more round trip, for duplicates only, buys the claim of a new
		// key a statement without a CASE per column.
		err = tx.QueryRow(ctx, s.sql.current, ref.scope, ref.id).Scan(r.dest()...)
	}
	if err != nil {
		return dedup.Claim{}, s.fail(ctx, op, err, true) // never committed
	}
	c, err := outcome(key, fp, fpd, &tok, &r)
	if err != nil {
		return dedup.Claim{}, s.fail(ctx, "inbox", err, true)
	}
	if c.Outcome != dedup.Acquired {
		return c, nil // nothing to keep; the deferred rollback releases the row lock
	}
	out, err := h(ctx, tx)
	if err != nil {
		return dedup.Claim{}, err
	}
	if tx.ended {
		return dedup.Claim{}, s.fail(ctx, "inbox commit", errHandlerEnded, tx.rolledBack)
	}
	if out == nil {
		if err := tx.Commit(ctx); err != nil {
			return dedup.Claim{}, s.fail(ctx, "inbox commit", err, tx.rolledBack)
		}
		return c, nil
	}
	notApplied, err := tx.commitWith(ctx, s.sql.inboxResultChecked, ref.scope, ref.id, tok[:], out)
	if err != nil {
		if isRecordCheck(err) {
			err = fmt.Errorf("the handler removed or changed the inbox record of key %s: %w", key, err)
		}
		return dedup.Claim{}, s.fail(ctx, "inbox commit", err, notApplied)
	}
	c.Result = out
	return c, nil
}

// inboxStmt is RunInbox's claim on the plain table.
func (s *Store) inboxStmt() string {
	if s.caseInbox {
		return s.sql.inbox
	}
	return s.sql.inboxFast
}

// errHandlerEnded is the failure of a RunInbox whose handler committed or
// rolled back the transaction itself.
var errHandlerEnded = errors.New("the handler ended RunInbox's transaction itself; return from the handler instead, and RunInbox commits (nil error) or rolls back (an error)")

// rollbackTimeout bounds a rollback run after the caller's context ended.
const rollbackTimeout = 5 * time.Second

// rollback ends tx, on a context that outlives a cancelled ctx.
func rollback(ctx context.Context, tx pgx.Tx) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	_ = tx.Rollback(rctx)
}

func validateInbox(key dedup.Key, fp dedup.Fingerprint, retention time.Duration, noHandler bool) error {
	if noHandler {
		return &dedup.ArgumentError{Arg: "handler", Reason: "is nil"}
	}
	if retention <= 0 {
		return &dedup.ArgumentError{Arg: "retention", Reason: "must be positive, got " + retention.String()}
	}
	return dedup.ValidateClaim(key, fp, retention)
}

// txRef is the stored form of key for a claim in the caller's
// transaction, read through query (a QueryRow on that transaction). A
// scope not cached yet is looked up in the transaction; one it cannot see
// gets its integer from the pool, committed at once (never inside the
// caller's transaction, which would make every other claim of a new scope
// wait for it to end, and could roll the scope's row back while this
// process keeps its integer). On the plain table it also moves the key's
// old record while a conversion is pending, in the caller's transaction
// (the partitioned claim does it after the key's lock).
func (s *Store) txRef(ctx context.Context, query func(q string, args []any, dest ...any) error, key dedup.Key) (keyRef, error) {
	s.scopes.mu.RLock()
	sid, ok := s.scopes.m[key.Scope]
	s.scopes.mu.RUnlock()
	if !ok {
		err := query(`SELECT id FROM `+s.names.scopes+` WHERE scope = $1::text`, []any{key.Scope}, &sid)
		switch {
		case err == nil:
			// Only ever inserted in autocommit: a row it sees is committed.
			s.cacheScope(key.Scope, sid)
		case errors.Is(err, pgx.ErrNoRows) || errors.Is(err, sql.ErrNoRows):
			if sid, err = s.scopeID(ctx, key.Scope); err != nil {
				return keyRef{}, err
			}
		default:
			return keyRef{}, err
		}
	}
	if s.cfg.partition == 0 && !s.converted.Load() {
		var pending bool
		if err := query(s.sql.adoptIDs, []any{[]string{key.Scope}, []string{key.ID}, []int32{sid}}, &pending); err != nil {
			return keyRef{}, err
		}
		if !pending {
			s.converted.Store(true)
		}
	}
	return keyRef{scope: sid, id: encodeID(key.ID)}, nil
}
