package guard

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// PgxExecer runs a statement on PostgreSQL through pgx. pgx.Tx, *pgx.Conn
// and *pgxpool.Pool satisfy it.
type PgxExecer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// PgxDB runs statements and single-row queries through pgx. pgx.Tx,
// *pgx.Conn and *pgxpool.Pool satisfy it.
type PgxDB interface {
	PgxExecer
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// SQLExecer runs a statement through database/sql. *sql.DB, *sql.Tx and
// *sql.Conn satisfy it.
type SQLExecer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// SQLDB runs statements and single-row queries through database/sql.
// *sql.DB, *sql.Tx and *sql.Conn satisfy it.
type SQLDB interface {
	SQLExecer
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// Stmt is one SQL statement or query written by the caller, with its
// arguments. Its placeholders are the driver's ($1 for PostgreSQL, ? or
// $1 for SQLite); the helpers pass it through unchanged.
type Stmt struct {
	SQL  string
	Args []any
}

// Errors from the SQL helpers.
var (
	// ErrNotFound: the follow-up read of a check variant found no row, so
	// the guarded write matched nothing because the row does not exist.
	// Create it (an INSERT, or an upsert keyed by the stable key) instead.
	ErrNotFound = errors.New("guard: row not found")
	// ErrMultipleRows matches [*RowsError]: a guarded write changed more
	// than one row, so its WHERE clause is not keyed on a unique ID.
	ErrMultipleRows = errors.New("guard: guarded write changed more than one row")
	// ErrGuardMismatch: the guarded write changed nothing, yet the stored
	// version read afterwards says the incoming one is next. The
	// statement's WHERE clause does not express the version guard.
	ErrGuardMismatch = errors.New("guard: write refused a version the stored version says is next")
)

// RowsError reports a guarded write that changed more than one row. The
// changes were made (they are in the caller's transaction, which the
// caller should roll back). It matches [ErrMultipleRows].
type RowsError struct {
	Rows int64 // rows affected
}

func (e *RowsError) Error() string {
	return "guard: guarded write changed " + strconv.FormatInt(e.Rows, 10) + " rows, want at most 1"
}

// Is makes errors.Is(err, ErrMultipleRows) true.
func (e *RowsError) Is(target error) bool { return target == ErrMultipleRows }

// Advance runs the caller's conditional version update on PostgreSQL and
// reports whether it was applied. The statement carries the guard in its
// own WHERE clause, for example
//
//	UPDATE accounts SET balance = $3, version = $2
//	WHERE id = $1 AND version < $2          -- newest wins, gaps allowed
//	WHERE id = $1 AND version = $2 - 1      -- strict: only the next version
//
// One row affected means applied; zero means the incoming version was a
// duplicate or stale (or, in strict mode, ahead of a gap), or the row does
// not exist, and is not an error. More than one row affected returns
// applied true with a [*RowsError]. Use [AdvanceCheck] to tell these
// cases apart.
//
// The caller writes the whole statement, so the helper never splices
// table or column names into SQL and cannot be an injection path; values
// travel only as arguments.
func Advance(ctx context.Context, db PgxExecer, stmt string, args ...any) (applied bool, err error) {
	n, err := execPgx(ctx, db, stmt, args)
	if err != nil {
		return false, err
	}
	return rowsApplied(n)
}

// AdvanceDB is [Advance] through database/sql, for example on SQLite:
//
//	UPDATE accounts SET balance = ?, version = ? WHERE id = ? AND version < ?
func AdvanceDB(ctx context.Context, db SQLExecer, stmt string, args ...any) (applied bool, err error) {
	n, err := execSQL(ctx, db, stmt, args)
	if err != nil {
		return false, err
	}
	return rowsApplied(n)
}

// AdvanceCheck runs update, a conditional version update as for
// [Advance], and when it changes nothing runs current, a query returning
// the row's stored version (one integer column; NULL counts as 0), to say
// why: [Duplicate], [Stale] or, under a strict "version = $n - 1" guard,
// [Gap] (park the message, see [Parked]). When update is applied the
// verdict is [Apply]. A missing row returns [ErrNotFound].
//
// The follow-up read only classifies a write that did not happen; it never
// decides to write, so a concurrent writer cannot turn it into a lost or
// double update. Outside a transaction the value it reads may already be
// newer than the one that refused the write.
func AdvanceCheck(ctx context.Context, db PgxDB, update, current Stmt, incoming uint64) (Verdict, error) {
	n, err := execPgx(ctx, db, update.SQL, update.Args)
	if err != nil {
		return 0, err
	}
	if ok, err := rowsApplied(n); ok || err != nil {
		return Apply, err
	}
	var v *int64
	if err := db.QueryRow(ctx, current.SQL, current.Args...).Scan(&v); err != nil {
		return 0, readErr(err)
	}
	return classifyVersion(v, incoming)
}

// AdvanceCheckDB is [AdvanceCheck] through database/sql.
func AdvanceCheckDB(ctx context.Context, db SQLDB, update, current Stmt, incoming uint64) (Verdict, error) {
	n, err := execSQL(ctx, db, update.SQL, update.Args)
	if err != nil {
		return 0, err
	}
	if ok, err := rowsApplied(n); ok || err != nil {
		return Apply, err
	}
	var v *int64
	if err := db.QueryRowContext(ctx, current.SQL, current.Args...).Scan(&v); err != nil {
		return 0, readErr(err)
	}
	return classifyVersion(v, incoming)
}

// TransitionResult is the outcome of a state-transition guard.
type TransitionResult uint8

const (
	// Applied: this call made the transition.
	Applied TransitionResult = iota + 1
	// AlreadyApplied: the row was not in the expected previous state. From
	// [Transition], that is all it says; from [TransitionCheck], the row
	// is in the target state already, so the message is a duplicate.
	AlreadyApplied
	// UnexpectedState: the row is in neither the previous nor the target
	// state (cancelled, say, or moved past the target). Only
	// [TransitionCheck] returns it; the message is out of order or
	// invalid, and the caller decides whether that is a business rejection.
	UnexpectedState
)

// String returns the result's name, such as "applied".
func (r TransitionResult) String() string {
	switch r {
	case Applied:
		return "applied"
	case AlreadyApplied:
		return "already applied"
	case UnexpectedState:
		return "unexpected state"
	}
	return "transitionresult(" + strconv.Itoa(int(r)) + ")"
}

// Transition runs the caller's state-transition update on PostgreSQL, for
// example
//
//	UPDATE orders SET status = 'paid', paid_at = now()
//	WHERE id = $1 AND status = 'pending'
//
// One row affected is [Applied]; zero is [AlreadyApplied], not an error:
// a replayed message finds the row no longer pending and does nothing.
// More than one row returns Applied with a [*RowsError].
func Transition(ctx context.Context, db PgxExecer, stmt string, args ...any) (TransitionResult, error) {
	n, err := execPgx(ctx, db, stmt, args)
	if err != nil {
		return 0, err
	}
	return transitionRows(n)
}

// TransitionDB is [Transition] through database/sql.
func TransitionDB(ctx context.Context, db SQLExecer, stmt string, args ...any) (TransitionResult, error) {
	n, err := execSQL(ctx, db, stmt, args)
	if err != nil {
		return 0, err
	}
	return transitionRows(n)
}

// TransitionCheck runs update as [Transition] does and, when it changes
// nothing, runs current, a query returning the row's state (one text
// column; NULL reads as ""), to tell [AlreadyApplied] (the state is
// target) from [UnexpectedState] (anything else). It also returns the
// state it read, or target when the update was applied. A missing row
// returns [ErrNotFound].
//
// The follow-up read only classifies a write that did not happen; it never
// decides to write.
func TransitionCheck(ctx context.Context, db PgxDB, update, current Stmt, target string) (TransitionResult, string, error) {
	n, err := execPgx(ctx, db, update.SQL, update.Args)
	if err != nil {
		return 0, "", err
	}
	if r, err := transitionRows(n); r == Applied {
		return r, target, err
	}
	var s *string
	if err := db.QueryRow(ctx, current.SQL, current.Args...).Scan(&s); err != nil {
		return 0, "", readErr(err)
	}
	return classifyState(s, target)
}

// TransitionCheckDB is [TransitionCheck] through database/sql.
func TransitionCheckDB(ctx context.Context, db SQLDB, update, current Stmt, target string) (TransitionResult, string, error) {
	n, err := execSQL(ctx, db, update.SQL, update.Args)
	if err != nil {
		return 0, "", err
	}
	if r, err := transitionRows(n); r == Applied {
		return r, target, err
	}
	var s *string
	if err := db.QueryRowContext(ctx, current.SQL, current.Args...).Scan(&s); err != nil {
		return 0, "", readErr(err)
	}
	return classifyState(s, target)
}

func execPgx(ctx context.Context, db PgxExecer, stmt string, args []any) (int64, error) {
	tag, err := db.Exec(ctx, stmt, args...)
	if err != nil {
		return 0, fmt.Errorf("guard: guarded write: %w", err)
	}
	return tag.RowsAffected(), nil
}

func execSQL(ctx context.Context, db SQLExecer, stmt string, args []any) (int64, error) {
	res, err := db.ExecContext(ctx, stmt, args...)
	if err != nil {
		return 0, fmt.Errorf("guard: guarded write: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("guard: rows affected: %w", err)
	}
	return n, nil
}

func rowsApplied(n int64) (bool, error) {
	switch {
	case n == 0:
		return false, nil
	case n == 1:
		return true, nil
	default:
		return true, &RowsError{Rows: n}
	}
}

func transitionRows(n int64) (TransitionResult, error) {
	ok, err := rowsApplied(n)
	if ok {
		return Applied, err
	}
	return AlreadyApplied, nil
}

func readErr(err error) error {
	if errors.Is(err, sql.ErrNoRows) || errors.Is(err, pgx.ErrNoRows) {
		return ErrNotFound
	}
	return fmt.Errorf("guard: read current: %w", err)
}

func classifyVersion(v *int64, incoming uint64) (Verdict, error) {
	var stored uint64
	if v != nil {
		if *v < 0 {
			return 0, fmt.Errorf("guard: stored version %d is negative", *v)
		}
		stored = uint64(*v)
	}
	verdict := CompareVersion(stored, incoming)
	if verdict == Apply {
		return 0, ErrGuardMismatch
	}
	return verdict, nil
}

func classifyState(s *string, target string) (TransitionResult, string, error) {
	var state string
	if s != nil {
		state = *s
	}
	if state == target {
		return AlreadyApplied, state, nil
	}
	return UnexpectedState, state, nil
}
