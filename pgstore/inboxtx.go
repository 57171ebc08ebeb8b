package pgstore

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// inboxTx is the transaction [Store.RunInbox] hands its handler. It wraps
// pgx's own transaction, begun by the batch that also ran the claim
// ([pgx.Batch.BeginTx]), so that everything a pgx.Tx does (nested
// transactions on savepoints, LargeObjects, ErrTxCommitRollback, closing a
// connection whose commit broke) is pgx's code. What it adds is one more
// way to end: [inboxTx.commitWith] sends the handler's result and the
// COMMIT in one round trip, which pgx's transaction cannot do, and leaves
// this type closed as pgx's own would be.
//
// Not safe for concurrent use, like any pgx.Tx.
type inboxTx struct {
	// tx is pgx's transaction, or once commitWith has ended it, a closed
	// one (see closedTx): either way every call after the end returns an
	// error wrapping pgx.ErrTxClosed.
	tx   pgx.Tx
	conn *pgx.Conn
	// ended says Commit, Rollback or commitWith ran.
	ended bool
	// escaped says a nested transaction or LargeObjects was handed out.
	// Both work on tx directly, so only ending tx itself (Commit or
	// Rollback, never commitWith) closes them.
	escaped bool
	// rolledBack says the end is known to have committed nothing.
	rolledBack bool
}

var _ pgx.Tx = (*inboxTx)(nil)

// Begin starts a nested transaction on a savepoint (pgx's).
func (t *inboxTx) Begin(ctx context.Context) (pgx.Tx, error) {
	t.escaped = true
	return t.tx.Begin(ctx)
}

// Commit commits the transaction. RunInbox commits it after the handler
// returns; a handler that commits it itself gets an error from RunInbox.
func (t *inboxTx) Commit(ctx context.Context) error {
	if t.ended {
		return pgx.ErrTxClosed
	}
	t.ended = true
	err := t.tx.Commit(ctx)
	t.rolledBack = err != nil && (errors.Is(err, pgx.ErrTxCommitRollback) || statementFailed(err))
	return err
}

// Rollback rolls the transaction back. A failed rollback closes the
// connection (pgx), which rolls back on the server too.
func (t *inboxTx) Rollback(ctx context.Context) error {
	if t.ended {
		return pgx.ErrTxClosed
	}
	t.ended = true
	t.rolledBack = true
	return t.tx.Rollback(ctx)
}

// commitWith runs sql, which must fail (not just change nothing) when it
// cannot do its part, and commits. Unless a nested transaction or
// LargeObjects escaped, both go in one pipelined batch with one Sync: if
// sql fails the server skips the COMMIT, and the transaction is rolled
// back here. notApplied says nothing committed for certain.
func (t *inboxTx) commitWith(ctx context.Context, sql string, args ...any) (notApplied bool, err error) {
	if t.ended {
		return false, pgx.ErrTxClosed
	}
	if t.escaped {
		if _, err := t.tx.Exec(ctx, sql, args...); err != nil {
			return true, err // not committed; the caller rolls back
		}
		err := t.Commit(ctx)
		return t.rolledBack, err
	}
	var b pgx.Batch
	b.Queue(sql, args...)
	b.Queue("commit")
	t.ended = true
	t.tx = closedTx()
	br := t.conn.SendBatch(ctx, &b)
	_, err = br.Exec()
	if err == nil {
		var tag pgconn.CommandTag
		if tag, err = br.Exec(); err == nil && tag.String() == "ROLLBACK" {
			err = pgx.ErrTxCommitRollback
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	t.rolledBack = err != nil && (errors.Is(err, pgx.ErrTxCommitRollback) || statementFailed(err))
	if !t.conn.IsClosed() && t.conn.PgConn().TxStatus() != 'I' {
		// sql failed and the server skipped the COMMIT. If the
		// ROLLBACK fails too, the pool destroys the connection, which
		// is not idle.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
		_, _ = t.conn.Exec(rctx, "rollback")
		cancel()
	}
	return t.rolledBack, err
}

// end rolls back unless the transaction has already ended, on a context
// that outlives a cancelled ctx.
func (t *inboxTx) end(ctx context.Context) {
	if !t.ended {
		rollback(ctx, t)
	}
}

// closedTx returns a pgx transaction that is already closed: every method
// returns an error wrapping pgx.ErrTxClosed, and LargeObjects gives large
// objects whose methods do too ([pgx.FailedBatchResults] documents this
// for a batch that began a transaction).
func closedTx() pgx.Tx {
	var b pgx.Batch
	b.BeginTx(pgx.TxOptions{})
	return pgx.FailedBatchResults(&b, pgx.ErrTxClosed).Tx()
}

// LargeObjects returns pgx's large objects API on the transaction.
func (t *inboxTx) LargeObjects() pgx.LargeObjects {
	t.escaped = true
	return t.tx.LargeObjects()
}

func (t *inboxTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	return t.tx.CopyFrom(ctx, table, columns, src)
}

func (t *inboxTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return t.tx.SendBatch(ctx, b)
}

func (t *inboxTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	return t.tx.Prepare(ctx, name, sql)
}

func (t *inboxTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return t.tx.Exec(ctx, sql, args...)
}

func (t *inboxTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return t.tx.Query(ctx, sql, args...)
}

func (t *inboxTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return t.tx.QueryRow(ctx, sql, args...)
}

// Conn returns the connection the transaction runs on.
func (t *inboxTx) Conn() *pgx.Conn { return t.conn }
