package pgstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Apply is the transactional inbox in one round trip, for a message whose
// writes are known before they run: it claims key and runs writes in one
// pipeline that PostgreSQL executes as one transaction, so the dedup
// record (completed at once, with result, kept for retention or the
// scope's window if longer) and the writes commit together or not at all.
//
// The claim fails when it does not acquire (for a new key it is one INSERT
// that fails on any existing record; a record found acquirable, expired or
// under an expired lease, is then taken by RunInbox's claim made to fail
// likewise): the server then skips the writes and rolls the whole pipeline
// back, and Apply reads the record that stopped it in a second round trip
// and returns Duplicate (with the stored result), InProgress (a
// [Store.Claim] owner holds a live lease) or Mismatch, with a nil error. A
// concurrent Apply or inbox transaction with the same key makes the claim
// wait until it ends, then see a duplicate if it committed or acquire if
// it rolled back. A new message costs one round trip and one commit; a
// business transaction that writes the same rows the usual way (BEGIN,
// the writes, COMMIT) costs at least three.
//
// writes holds the message's statements, queued with [pgx.Batch.Queue];
// nil or empty records the key alone. Their order is kept. Because they
// are sent before any of them runs, Apply refuses with an
// [*dedup.ArgumentError], before any I/O:
//
//   - anything but DML (INSERT, UPDATE, DELETE, MERGE, SELECT, WITH,
//     VALUES, by the first word): anything else could end the transaction
//     in the middle of the pipeline (a procedure or DO block that commits,
//     VACUUM) and commit the claim without the writes after it, while a
//     function called from DML cannot commit;
//   - result callbacks ([pgx.QueuedQuery.Exec], Query or QueryRow): a
//     callback could not stop the commit, which the server makes when the
//     last statement succeeds.
//
// A write cannot depend on another's result in Go (in SQL it can: a CTE,
// or a subquery on a row an earlier statement wrote). The writes run on a
// pooled connection that goes back to the pool, so they must not change
// the session (set_config with is_local false, a session-level advisory
// lock, SELECT ... INTO a temporary table), as a RunInbox handler must
// not. A handler that must
// read before it writes, or decide in Go between statements, belongs in
// [Store.RunInbox].
//
// Errors: an [*dedup.ArgumentError] for bad input; a [*dedup.StoreError]
// when the store failed, including a condition of the server's rather
// than a fault of a write (a serialization failure or deadlock, a lock or
// statement timeout, a cancel, lack of resources), NotApplied when nothing
// can have committed (when the connection broke after the pipeline was
// sent the outcome is unknown, and the redelivery finds out which, since
// the record and the writes commit together); any other error is a write
// failing (a [*pgconn.PgError] such as a constraint violation, or a
// [pgx.ErrPreprocessingBatch] for a write the server could not prepare or
// pgx could not encode), returned unchanged, and nothing was applied. A
// Claim with Outcome Acquired means the pipeline committed.
//
// On the plain table the pipeline is an implicit transaction at the
// server's default isolation; the partitioned store, whose claim needs
// READ COMMITTED, wraps it in BEGIN ISOLATION LEVEL READ COMMITTED ...
// COMMIT (still one round trip). The pool must use the extended protocol
// (any pgx.QueryExecMode but the simple protocol, which sends a batch as
// one multi-statement string).
func (s *Store) Apply(ctx context.Context, key dedup.Key, fp dedup.Fingerprint, retention time.Duration, result []byte, writes *pgx.Batch) (dedup.Claim, error) {
	if err := validateInbox(key, fp, retention, false); err != nil {
		return dedup.Claim{}, err
	}
	if err := validateWrites(writes); err != nil {
		return dedup.Claim{}, err
	}
	if err := s.begin(ctx, "apply"); err != nil {
		return dedup.Claim{}, err
	}
	ref, err := s.ref(ctx, key)
	if err == nil {
		err = s.adoptKey(ctx, key)
	}
	if err != nil {
		return dedup.Claim{}, s.fail(ctx, "apply", err, true)
	}
	tok := dedup.NewToken()
	// A new key takes one statement that fails on any existing record,
	// the cheapest claim there is; a record found acquirable (expired, or
	// an expired lease) is taken by the full claim.
	stmt := s.sql.applyNew
	if s.cfg.partition > 0 {
		stmt = s.sql.pApply
	}
	for try := 1; ; try++ {
		c, cur, err := s.applyOnce(ctx, stmt, key, ref, fp, retention, &tok, result, writes)
		if err != nil || cur == nil {
			return c, err
		}
		// A record stopped the claim. If it is acquirable, or has gone
		// since (swept, released), claim again.
		if !cur.found || cur.acq {
			if try == maxApplyTries {
				return dedup.Claim{}, s.fail(ctx, "apply", fmt.Errorf("key %s changed under %d claims in a row", key, try), true)
			}
			if cur.found && s.cfg.partition == 0 {
				stmt = s.sql.apply
			}
			continue
		}
		c, err = outcome(key, fp, fpDigest(fp), nil, &cur.r)
		if err != nil {
			return dedup.Claim{}, s.fail(ctx, "apply read", err, true)
		}
		return c, nil
	}
}

// maxApplyTries bounds Apply's claims of one key: a new key takes one, an
// acquirable record two; more means the record keeps changing between a
// claim and the read of what stopped it.
const maxApplyTries = 4

// current is the record that stopped one of Apply's claims, read after
// the claim rolled back: found, and acquirable now.
type current struct {
	r          row
	found, acq bool
}

// Statements of the partitioned store's transaction block.
const (
	beginRC     = "begin isolation level read committed"
	commitSQL   = "commit"
	rollbackSQL = "rollback"
)

// applyOnce sends Apply's pipeline once, with the claim statement stmt:
// the claim, then the writes, which PostgreSQL runs as one implicit
// transaction committed at the pipeline's end. The partitioned store
// wraps them in BEGIN ISOLATION LEVEL READ COMMITTED ... COMMIT with the
// key's lock first, since its claim needs READ COMMITTED whatever the
// server's default. (The writes are DML, which cannot end the transaction
// early; see isDML.) When the claim found a record it could not acquire,
// nothing was applied, and cur is that record, read in the next round
// trip (with the block's ROLLBACK).
func (s *Store) applyOnce(ctx context.Context, stmt string, key dedup.Key, ref keyRef, fp dedup.Fingerprint, retention time.Duration, tok *dedup.Token, result []byte, writes *pgx.Batch) (c dedup.Claim, cur *current, err error) {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return c, nil, s.fail(ctx, "apply", err, true)
	}
	mode := conn.Conn().Config().DefaultQueryExecMode
	if mode == pgx.QueryExecModeSimpleProtocol {
		conn.Release()
		return c, nil, &dedup.ArgumentError{Arg: "pool", Reason: "uses the simple protocol, which sends a batch as one multi-statement string; Apply needs the extended protocol (any other pgx.QueryExecMode), or use RunInbox"}
	}
	defer func() {
		// After a failure the block is aborted (or its state unknown):
		// roll it back so that the connection goes back idle; if that
		// fails, the pool closes the connection.
		if conn.Conn().PgConn().TxStatus() != 'I' && !conn.Conn().IsClosed() {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
			_, _ = conn.Exec(rctx, rollbackSQL)
			cancel()
		}
		conn.Release()
	}()
	block := s.cfg.partition > 0
	n := 1
	if writes != nil {
		n += len(writes.QueuedQueries)
	}
	b := &pgx.Batch{QueuedQueries: make([]*pgx.QueuedQuery, 0, n+4)}
	if block {
		b.Queue(beginRC)
		b.Queue(s.sql.lock, s.keyLock(key))
	}
	fpd := fpDigest(fp)
	b.Queue(stmt, ref.scope, ref.id, tok[:], fpd, micros(retention), result)
	// The claim fails by design on a duplicate, and pgx drops a failed
	// batch's statements from its statement cache, to be prepared again
	// on their next use. In pgx's default mode the store's statements are
	// prepared by name instead (once per connection; later calls do no
	// I/O), and so stay prepared, the read of a duplicate and the block's
	// ROLLBACK included, which could not be prepared while the block is
	// aborted. Other modes (a pool set up for a transaction pooler)
	// prepare nothing.
	if mode == pgx.QueryExecModeCacheStatement {
		prep := []string{stmt, s.sql.applyCurrent}
		if block {
			prep = append(prep, beginRC, s.sql.lock, commitSQL, rollbackSQL)
		}
		for _, q := range prep {
			if _, err := conn.Conn().Prepare(ctx, q, q); err != nil {
				return c, nil, s.fail(ctx, "apply prepare", err, true)
			}
		}
	}
	if writes != nil {
		var eqb pgx.ExtendedQueryBuilder
		for i, q := range writes.QueuedQueries {
			if mode == pgx.QueryExecModeExec {
				// In this mode pgx reports an argument it cannot encode
				// as a plain error, indistinguishable from a broken
				// connection: encode first, to blame the write.
				if err := eqb.Build(conn.Conn().TypeMap(), nil, q.Arguments); err != nil {
					return c, nil, fmt.Errorf("writes[%d]: %w", i, err)
				}
			}
			// New queued queries: pgx keeps a sent query's prepared
			// statement on it, which a failed batch may have deallocated.
			b.Queue(q.SQL, q.Arguments...)
		}
	}
	if block {
		b.Queue(commitSQL)
	}
	br := conn.SendBatch(ctx, b)
	if block {
		if _, err = br.Exec(); err == nil { // BEGIN
			_, err = br.Exec() // the key's lock
		}
	}
	var r row
	if err == nil {
		err = br.QueryRow().Scan(&r.attempts, &r.leaseUntil, &r.expiresAt)
	}
	if err != nil {
		br.Close()
		switch {
		case checkFailed(err, applyTaken):
			cur, err := s.readTaken(ctx, conn.Conn(), block, ref, fpd)
			return c, cur, err
		case writeRefused(err, stmt, s.sql.lock, beginRC, commitSQL):
			return c, nil, err
		}
		return c, nil, s.fail(ctx, "apply", err, notCommitted(err))
	}
	// The writes' results, then the COMMIT's.
	if err := br.Close(); err != nil {
		if statementFailed(err) && !serverCondition(err) {
			return c, nil, err // a write failed: the transaction rolls back
		}
		return c, nil, s.fail(ctx, "apply", err, notCommitted(err))
	}
	if st := conn.Conn().PgConn().TxStatus(); st != 'I' {
		return c, nil, s.fail(ctx, "apply", fmt.Errorf("the pipeline ended inside a transaction (status %q): nothing was committed", st), true)
	}
	r.state, r.token, r.fingerprint, r.result = stateCompleted, tok[:], fpd, result
	c, err = outcome(key, fp, fpd, tok, &r)
	if err != nil {
		return c, nil, s.fail(ctx, "apply", err, false)
	}
	if len(result) > 0 {
		c.Result = result
	}
	return c, nil, nil
}

// readTaken reads the record of key after a claim that found it taken,
// rolling back the claim's aborted block first if it ran in one: one
// round trip on conn (two in a mode where pgx describes a statement
// before it runs it, which an aborted block refuses).
func (s *Store) readTaken(ctx context.Context, conn *pgx.Conn, block bool, ref keyRef, fpd []byte) (*current, error) {
	var cur current
	read := func(row pgx.Row) error {
		err := row.Scan(append(cur.r.dest(), &cur.acq)...)
		cur.found = err == nil
		if errors.Is(err, pgx.ErrNoRows) {
			err = nil
		}
		return err
	}
	var err error
	switch {
	case !block:
		err = read(conn.QueryRow(ctx, s.sql.applyCurrent, ref.scope, ref.id, fpd))
	case conn.Config().DefaultQueryExecMode == pgx.QueryExecModeCacheStatement:
		b := &pgx.Batch{}
		b.Queue(rollbackSQL)
		b.Queue(s.sql.applyCurrent, ref.scope, ref.id, fpd)
		br := conn.SendBatch(ctx, b)
		if _, err = br.Exec(); err == nil {
			err = read(br.QueryRow())
		}
		if cerr := br.Close(); err == nil {
			err = cerr
		}
	default:
		if _, err = conn.Exec(ctx, rollbackSQL); err == nil {
			err = read(conn.QueryRow(ctx, s.sql.applyCurrent, ref.scope, ref.id, fpd))
		}
	}
	if err != nil {
		return nil, s.fail(ctx, "apply read", err, true) // the claim was rolled back, or never committed
	}
	return &cur, nil
}

// notCommitted reports whether a failed Apply pipeline certainly did not
// commit: the server reported an error (which aborts the block before
// its COMMIT), or nothing was sent.
func notCommitted(err error) bool { return statementFailed(err) || notApplied(err) }

// serverCondition reports whether a statement's error is a condition of
// the server rather than a fault of the statement: a serialization failure
// or deadlock (SQLSTATE class 40), insufficient resources (53), a lock not
// available or an object in use (55P03, 55006), an operator intervention such as a
// cancel or statement timeout (57), a system error (58) or an internal
// error (XX). Those are store failures, retried as such; a syntax error, a
// missing table or a constraint violation is the write's own.
func serverCondition(err error) bool {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || len(pe.Code) < 2 {
		return false
	}
	switch pe.Code[:2] {
	case "40", "53", "57", "58", "XX":
		return true
	case "55":
		return pe.Code == "55P03" || pe.Code == "55006" // lock_not_available, object_in_use
	}
	return false
}

// writeRefused reports whether err says that one of the caller's writes
// (not one of the store's statements) was refused before anything ran:
// the server could not prepare it (an ERROR: a syntax error, a missing
// table), or pgx could not encode one of its arguments (pgx then closes
// the connection, with nothing committed). The writes are at fault, not
// the store, and a retry as a store failure would only fail again. A
// connection that broke while preparing (FATAL, or I/O) is the store's.
func writeRefused(err error, store ...string) bool {
	var pre pgx.ErrPreprocessingBatch
	if !errors.As(err, &pre) {
		return false
	}
	for _, q := range store {
		if pre.SQL() == q {
			return false
		}
	}
	// pgx names the step only in the message; TestApplyBadWrite checks it.
	return statementFailed(err) && !serverCondition(err) || strings.HasPrefix(pre.Error(), "error preprocessing batch (build)")
}

// validateWrites refuses what Apply cannot run: result callbacks and
// transaction control (see Apply).
func validateWrites(writes *pgx.Batch) error {
	if writes == nil {
		return nil
	}
	for i, q := range writes.QueuedQueries {
		arg := fmt.Sprintf("writes[%d]", i)
		switch {
		case q == nil:
			return &dedup.ArgumentError{Arg: arg, Reason: "is nil"}
		case q.Fn != nil:
			return &dedup.ArgumentError{Arg: arg, Reason: "has a result callback, which could not stop the commit; queue it without one, or use RunInbox to read results"}
		case !isDML(q.SQL):
			return &dedup.ArgumentError{Arg: arg, Reason: "does not start with a DML keyword (INSERT, UPDATE, DELETE, MERGE, SELECT, WITH, VALUES; nothing before it but blanks): " +
				"anything else could end the transaction Apply runs it in; use RunInbox for anything else"}
		}
	}
	return nil
}

// isDML reports whether statement sql begins with a keyword of a data
// manipulation statement. None of those can end the transaction it runs
// in: a function they call cannot commit or roll back ("invalid
// transaction termination"); only CALL, DO and utility statements can
// (VACUUM, for one, commits what ran before it in the pipeline).
func isDML(sql string) bool {
	w := firstWord(sql)
	for _, k := range dml {
		if strings.EqualFold(w, k) {
			return true
		}
	}
	return false
}

var dml = []string{"INSERT", "UPDATE", "DELETE", "MERGE", "SELECT", "WITH", "VALUES"}

// firstWord is the keyword sql starts with, after blanks only, or "" when
// it starts with anything else (a comment, a parenthesis, a quoted
// identifier) or the word runs on into an identifier. Being strict is the
// point: PostgreSQL's lexer nests /* */ comments and ends -- comments at
// \r as well as \n, and a looser reading could take a CALL hidden behind
// a comment for the INSERT inside it.
func firstWord(sql string) string {
	sql = strings.TrimLeft(sql, " \t\r\n\f\v")
	end := 0
	for end < len(sql) && (sql[end] >= 'a' && sql[end] <= 'z' || sql[end] >= 'A' && sql[end] <= 'Z' || sql[end] == '_') {
		end++
	}
	if end < len(sql) {
		if c := sql[end]; c >= '0' && c <= '9' || c == '$' || c >= 0x80 {
			return "" // the word runs on into an identifier
		}
	}
	return sql[:end]
}
