package pgstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
)

// Before Convert, the first inbox of a scope in a REPEATABLE READ
// transaction whose snapshot predates the scope's row moves the key's old
// record: the record's scope must not be looked up again inside the
// caller's snapshot (an ON CONFLICT on a row it cannot see is a
// serialization failure, which would abort the caller's transaction).
// The old completed key is a duplicate with its old result.
func TestInboxRepeatableReadAdoptsOldRecord(t *testing.T) {
	// The plain table only: the partitioned one requires READ COMMITTED.
	t.Parallel()
	inboxRepeatableRead(t, modes[0])
}

func inboxRepeatableRead(t *testing.T, m mode) {
	pool := testPool(t)
	s, err := pgstore.New(pool, append([]pgstore.Option{pgstore.WithSchema(freshSchema(t, pool))}, m.opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	if _, err := pgstore.MigrateTo(ctx, s, 5); err != nil {
		t.Fatal(err)
	}
	oldRecords(t, s, 4)
	if _, err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT 1`); err != nil { // the snapshot
		t.Fatal(err)
	}
	ran := false
	c, err := s.Inbox(ctx, tx, key(oldID(1)), fpA, time.Hour, func(context.Context, pgx.Tx) ([]byte, error) {
		ran = true
		return []byte("again"), nil
	})
	if err != nil {
		t.Fatalf("Inbox in a repeatable read transaction: %v", err)
	}
	if ran || c.Outcome != dedup.Duplicate || string(c.Result) != "result-1" {
		t.Fatalf("old completed key: outcome %v, result %q, handler ran %v; want duplicate result-1", c.Outcome, c.Result, ran)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}
