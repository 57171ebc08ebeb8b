package guard_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/dedupkit/dedup/guard"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "modernc.org/sqlite"
)

// The types the helpers promise to accept.
var (
	_ guard.PgxDB = (pgx.Tx)(nil)
	_ guard.PgxDB = (*pgx.Conn)(nil)
	_ guard.PgxDB = (*pgxpool.Pool)(nil)
	_ guard.SQLDB = (*sql.DB)(nil)
	_ guard.SQLDB = (*sql.Tx)(nil)
	_ guard.SQLDB = (*sql.Conn)(nil)
)

// backend runs the helpers on one engine. Statements are written with $n
// placeholders and table names through tbl; sq rewrites them for the
// engine.
type backend struct {
	schema string // "" on SQLite
	pg     *pgxpool.Pool
	db     *sql.DB
}

func (b *backend) tbl(name string) string {
	if b.schema == "" {
		return name
	}
	return pgx.Identifier{b.schema, name}.Sanitize()
}

// sq rewrites $n placeholders to SQLite's ?n.
func (b *backend) sq(s string) string {
	if b.pg != nil {
		return s
	}
	return strings.ReplaceAll(s, "$", "?")
}

func (b *backend) stmt(s string, args ...any) guard.Stmt {
	return guard.Stmt{SQL: b.sq(s), Args: args}
}

func (b *backend) exec(t *testing.T, s string, args ...any) {
	t.Helper()
	ctx := context.Background()
	var err error
	if b.pg != nil {
		_, err = b.pg.Exec(ctx, s, args...)
	} else {
		_, err = b.db.ExecContext(ctx, b.sq(s), args...)
	}
	if err != nil {
		t.Fatalf("exec %q: %v", s, err)
	}
}

func (b *backend) queryInt(t *testing.T, s string, args ...any) int64 {
	t.Helper()
	ctx := context.Background()
	var n int64
	var err error
	if b.pg != nil {
		err = b.pg.QueryRow(ctx, s, args...).Scan(&n)
	} else {
		err = b.db.QueryRowContext(ctx, b.sq(s), args...).Scan(&n)
	}
	if err != nil {
		t.Fatalf("query %q: %v", s, err)
	}
	return n
}

func (b *backend) advance(s string, args ...any) (bool, error) {
	if b.pg != nil {
		return guard.Advance(context.Background(), b.pg, s, args...)
	}
	return guard.AdvanceDB(context.Background(), b.db, b.sq(s), args...)
}

func (b *backend) advanceCheck(up, cur guard.Stmt, incoming uint64) (guard.Verdict, error) {
	if b.pg != nil {
		return guard.AdvanceCheck(context.Background(), b.pg, up, cur, incoming)
	}
	return guard.AdvanceCheckDB(context.Background(), b.db, up, cur, incoming)
}

func (b *backend) transition(s string, args ...any) (guard.TransitionResult, error) {
	if b.pg != nil {
		return guard.Transition(context.Background(), b.pg, s, args...)
	}
	return guard.TransitionDB(context.Background(), b.db, b.sq(s), args...)
}

func (b *backend) transitionCheck(up, cur guard.Stmt, target string) (guard.TransitionResult, string, error) {
	if b.pg != nil {
		return guard.TransitionCheck(context.Background(), b.pg, up, cur, target)
	}
	return guard.TransitionCheckDB(context.Background(), b.db, up, cur, target)
}

// newPostgres returns a backend in a fresh schema, dropped when the test
// ends.
func newPostgres(t *testing.T) *backend {
	t.Helper()
	pool := testenv.PostgresPool(t)
	name := testenv.PostgresSchema(t, pool)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("create schema: %v", err)
	}
	return &backend{schema: name, pg: pool}
}

// newSQLite returns a backend on a new SQLite file in the test's temporary
// directory.
func newSQLite(t *testing.T) *backend {
	t.Helper()
	dsn := "file:" + filepath.Join(t.TempDir(), "guard.db") +
		"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)"
	db, err := sql.Open("sqlite", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return &backend{db: db}
}

// forBackends runs f as a parallel subtest on PostgreSQL and on SQLite.
func forBackends(t *testing.T, f func(t *testing.T, b *backend)) {
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		f(t, newPostgres(t))
	})
	t.Run("sqlite", func(t *testing.T) {
		t.Parallel()
		f(t, newSQLite(t))
	})
}

func (b *backend) createAccounts(t *testing.T) {
	t.Helper()
	b.exec(t, `CREATE TABLE `+b.tbl("acct")+` (id TEXT PRIMARY KEY, version BIGINT NOT NULL, balance BIGINT NOT NULL)`)
	b.exec(t, `INSERT INTO `+b.tbl("acct")+` (id, version, balance) VALUES ('a', 0, 0), ('b', 0, 0)`)
}

// TestAdvanceOutOfOrder applies full-state snapshots, newest wins: version
// 5 then 4 leaves version 5's state, and 5 again is a duplicate.
func TestAdvanceOutOfOrder(t *testing.T) {
	t.Parallel()
	forBackends(t, func(t *testing.T, b *backend) {
		b.createAccounts(t)
		upd := `UPDATE ` + b.tbl("acct") + ` SET balance = $3, version = $2 WHERE id = $1 AND version < $2`
		cur := b.stmt(`SELECT version FROM `+b.tbl("acct")+` WHERE id = $1`, "a")

		ok, err := b.advance(upd, "a", int64(5), int64(500))
		if err != nil || !ok {
			t.Fatalf("advance to 5 = %v, %v; want applied", ok, err)
		}
		ok, err = b.advance(upd, "a", int64(4), int64(400))
		if err != nil || ok {
			t.Fatalf("advance to 4 after 5 = %v, %v; want not applied", ok, err)
		}
		v, err := b.advanceCheck(b.stmt(upd, "a", int64(4), int64(444)), cur, 4)
		if err != nil || v != guard.Stale {
			t.Fatalf("AdvanceCheck(4) = %v, %v; want stale", v, err)
		}
		v, err = b.advanceCheck(b.stmt(upd, "a", int64(5), int64(555)), cur, 5)
		if err != nil || v != guard.Duplicate {
			t.Fatalf("AdvanceCheck(5) = %v, %v; want duplicate", v, err)
		}
		if got := b.queryInt(t, `SELECT balance FROM `+b.tbl("acct")+` WHERE id = 'a'`); got != 500 {
			t.Errorf("balance = %d, want 500 (version 5's state)", got)
		}
		if got := b.queryInt(t, `SELECT version FROM `+b.tbl("acct")+` WHERE id = 'a'`); got != 5 {
			t.Errorf("version = %d, want 5", got)
		}
		v, err = b.advanceCheck(b.stmt(upd, "a", int64(6), int64(600)), cur, 6)
		if err != nil || v != guard.Apply {
			t.Fatalf("AdvanceCheck(6) = %v, %v; want apply", v, err)
		}
		if got := b.queryInt(t, `SELECT balance FROM `+b.tbl("acct")+` WHERE id = 'a'`); got != 600 {
			t.Errorf("balance = %d, want 600", got)
		}
		if got := b.queryInt(t, `SELECT balance FROM `+b.tbl("acct")+` WHERE id = 'b'`); got != 0 {
			t.Errorf("other row's balance = %d, want 0", got)
		}
	})
}

// msg is one delta for an account, numbered per account.
type msg struct {
	version uint64
	delta   int64
}

// TestAdvanceGapParked applies deltas in strict next-version order: a
// message ahead of a gap is parked and re-driven when the gap fills, and
// duplicates (fresh or parked) apply nothing.
func TestAdvanceGapParked(t *testing.T) {
	t.Parallel()
	forBackends(t, func(t *testing.T, b *backend) {
		b.createAccounts(t)
		parked := newParked[msg](t, 16)
		upd := `UPDATE ` + b.tbl("acct") + ` SET balance = balance + $3, version = $2 WHERE id = $1 AND version = $2 - 1`
		cur := b.stmt(`SELECT version FROM `+b.tbl("acct")+` WHERE id = $1`, "a")
		var verdicts []guard.Verdict
		var handle func(m msg)
		handle = func(m msg) {
			v, err := b.advanceCheck(b.stmt(upd, "a", int64(m.version), m.delta), cur, m.version)
			if err != nil {
				t.Fatalf("AdvanceCheck(v%d): %v", m.version, err)
			}
			verdicts = append(verdicts, v)
			switch v {
			case guard.Apply:
				for _, next := range parked.Ready("a", m.version) {
					handle(next)
				}
			case guard.Gap:
				if err := parked.Park("a", m.version, m); err != nil && !errors.Is(err, guard.ErrAlreadyParked) {
					t.Fatalf("Park(v%d): %v", m.version, err)
				}
			}
		}
		for _, m := range []msg{{1, 1}, {3, 100}, {4, 1000}, {3, 100}, {1, 1}} {
			handle(m)
		}
		if got := b.queryInt(t, `SELECT balance FROM `+b.tbl("acct")+` WHERE id = 'a'`); got != 1 {
			t.Errorf("balance before the gap fills = %d, want 1", got)
		}
		if got, want := fmt.Sprint(parked.Versions("a")), "[3 4]"; got != want {
			t.Errorf("parked versions = %s, want %s", got, want)
		}
		handle(msg{2, 10})  // fills the gap: 2, then parked 3 and 4
		handle(msg{2, 10})  // stale now: the stored version is 4
		handle(msg{3, 100}) // stale
		if got := b.queryInt(t, `SELECT balance FROM `+b.tbl("acct")+` WHERE id = 'a'`); got != 1111 {
			t.Errorf("balance = %d, want 1111 (each delta once)", got)
		}
		if got := b.queryInt(t, `SELECT version FROM `+b.tbl("acct")+` WHERE id = 'a'`); got != 4 {
			t.Errorf("version = %d, want 4", got)
		}
		if got := parked.Len(); got != 0 {
			t.Errorf("parked after the gap filled: %d, want 0", got)
		}
		want := "[apply gap gap gap duplicate apply apply apply stale stale]"
		if got := fmt.Sprint(verdicts); got != want {
			t.Errorf("verdicts = %s, want %s", got, want)
		}
	})
}

// TestAdvanceErrors covers a guard that matches several rows, a statement
// whose WHERE clause does not express the guard, and a missing row.
func TestAdvanceErrors(t *testing.T) {
	t.Parallel()
	forBackends(t, func(t *testing.T, b *backend) {
		b.createAccounts(t)
		ok, err := b.advance(`UPDATE `+b.tbl("acct")+` SET version = $1 WHERE version < $1`, int64(1))
		var re *guard.RowsError
		if !ok || !errors.As(err, &re) || re.Rows != 2 || !errors.Is(err, guard.ErrMultipleRows) {
			t.Errorf("unkeyed advance = %v, %v; want applied with RowsError{2}", ok, err)
		}
		cur := b.stmt(`SELECT version FROM `+b.tbl("acct")+` WHERE id = $1`, "a")
		bad := b.stmt(`UPDATE `+b.tbl("acct")+` SET version = $2 WHERE id = $1 AND version = $2`, "a", int64(2))
		if v, err := b.advanceCheck(bad, cur, 2); !errors.Is(err, guard.ErrGuardMismatch) {
			t.Errorf("AdvanceCheck with a wrong guard = %v, %v; want ErrGuardMismatch", v, err)
		}
		missing := b.stmt(`UPDATE `+b.tbl("acct")+` SET version = $2 WHERE id = $1 AND version < $2`, "zz", int64(2))
		curMissing := b.stmt(`SELECT version FROM `+b.tbl("acct")+` WHERE id = $1`, "zz")
		if v, err := b.advanceCheck(missing, curMissing, 2); !errors.Is(err, guard.ErrNotFound) {
			t.Errorf("AdvanceCheck on a missing row = %v, %v; want ErrNotFound", v, err)
		}
		if _, err := b.advance(`UPDATE no_such_table SET x = 1`); err == nil {
			t.Error("advance on a missing table: no error")
		}
	})
}

func (b *backend) createOrders(t *testing.T) {
	t.Helper()
	b.exec(t, `CREATE TABLE `+b.tbl("orders")+` (id TEXT PRIMARY KEY, status TEXT, paid_count BIGINT NOT NULL DEFAULT 0)`)
	b.exec(t, `INSERT INTO `+b.tbl("orders")+` (id, status) VALUES ('o1', 'pending'), ('o2', 'cancelled'), ('o3', NULL), ('o4', 'pending')`)
}

func TestTransition(t *testing.T) {
	t.Parallel()
	forBackends(t, func(t *testing.T, b *backend) {
		b.createOrders(t)
		pay := `UPDATE ` + b.tbl("orders") + ` SET status = 'paid', paid_count = paid_count + 1 WHERE id = $1 AND status = 'pending'`
		cur := func(id string) guard.Stmt {
			return b.stmt(`SELECT status FROM `+b.tbl("orders")+` WHERE id = $1`, id)
		}
		if r, err := b.transition(pay, "o1"); err != nil || r != guard.Applied {
			t.Fatalf("first transition = %v, %v; want applied", r, err)
		}
		if r, err := b.transition(pay, "o1"); err != nil || r != guard.AlreadyApplied {
			t.Fatalf("replayed transition = %v, %v; want already applied", r, err)
		}
		tests := []struct {
			id        string
			want      guard.TransitionResult
			wantState string
			wantErr   error
		}{
			{"o4", guard.Applied, "paid", nil},
			{"o4", guard.AlreadyApplied, "paid", nil},
			{"o1", guard.AlreadyApplied, "paid", nil},
			{"o2", guard.UnexpectedState, "cancelled", nil},
			{"o3", guard.UnexpectedState, "", nil},
			{"nope", 0, "", guard.ErrNotFound},
		}
		for _, tt := range tests {
			r, state, err := b.transitionCheck(b.stmt(pay, tt.id), cur(tt.id), "paid")
			if r != tt.want || state != tt.wantState || !errors.Is(err, tt.wantErr) || (tt.wantErr == nil && err != nil) {
				t.Errorf("TransitionCheck(%s) = %v, %q, %v; want %v, %q, %v", tt.id, r, state, err, tt.want, tt.wantState, tt.wantErr)
			}
		}
		if got := b.queryInt(t, `SELECT SUM(paid_count) FROM `+b.tbl("orders")); got != 2 {
			t.Errorf("payments applied = %d, want 2", got)
		}
		if r, err := b.transition(`UPDATE ` + b.tbl("orders") + ` SET status = 'x' WHERE status IS NULL OR status = 'cancelled'`); r != guard.Applied || !errors.Is(err, guard.ErrMultipleRows) {
			t.Errorf("unkeyed transition = %v, %v; want applied with ErrMultipleRows", r, err)
		}
	})
}

// TestTransitionConcurrent races 32 goroutines on the same transition of
// one row: exactly one applies it.
func TestTransitionConcurrent(t *testing.T) {
	t.Parallel()
	forBackends(t, func(t *testing.T, b *backend) {
		b.createOrders(t)
		pay := `UPDATE ` + b.tbl("orders") + ` SET status = 'paid', paid_count = paid_count + 1 WHERE id = $1 AND status = 'pending'`
		const n = 32
		results := make([]guard.TransitionResult, n)
		errs := make([]error, n)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				<-start
				results[i], errs[i] = b.transition(pay, "o1")
			})
		}
		close(start)
		wg.Wait()
		applied := 0
		for i := range n {
			if errs[i] != nil {
				t.Errorf("goroutine %d: %v", i, errs[i])
				continue
			}
			switch results[i] {
			case guard.Applied:
				applied++
			case guard.AlreadyApplied:
			default:
				t.Errorf("goroutine %d: result %v", i, results[i])
			}
		}
		if applied != 1 {
			t.Errorf("%d goroutines applied the transition, want exactly 1", applied)
		}
		if got := b.queryInt(t, `SELECT paid_count FROM `+b.tbl("orders")+` WHERE id = 'o1'`); got != 1 {
			t.Errorf("paid_count = %d, want 1", got)
		}
	})
}

// TestAdvanceInTransaction runs the guard inside the caller's transaction
// (pgx.Tx and *sql.Tx), where a rollback undoes the applied version.
func TestAdvanceInTransaction(t *testing.T) {
	t.Parallel()
	forBackends(t, func(t *testing.T, b *backend) {
		b.createAccounts(t)
		ctx := context.Background()
		upd := `UPDATE ` + b.tbl("acct") + ` SET balance = $3, version = $2 WHERE id = $1 AND version < $2`
		run := func(commit bool) bool {
			t.Helper()
			var ok bool
			var err error
			if b.pg != nil {
				tx, txErr := b.pg.Begin(ctx)
				if txErr != nil {
					t.Fatal(txErr)
				}
				ok, err = guard.Advance(ctx, tx, upd, "a", int64(1), int64(100))
				if commit {
					txErr = tx.Commit(ctx)
				} else {
					txErr = tx.Rollback(ctx)
				}
				if txErr != nil {
					t.Fatal(txErr)
				}
			} else {
				tx, txErr := b.db.BeginTx(ctx, nil)
				if txErr != nil {
					t.Fatal(txErr)
				}
				ok, err = guard.AdvanceDB(ctx, tx, b.sq(upd), "a", int64(1), int64(100))
				if commit {
					txErr = tx.Commit()
				} else {
					txErr = tx.Rollback()
				}
				if txErr != nil {
					t.Fatal(txErr)
				}
			}
			if err != nil {
				t.Fatal(err)
			}
			return ok
		}
		if !run(false) {
			t.Fatal("first attempt (rolled back) not applied")
		}
		if !run(true) {
			t.Fatal("after a rollback the version must apply again")
		}
		if run(true) {
			t.Fatal("after a commit the same version applied again")
		}
	})
}
