package pgstore_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
)

// A relay that polled an idle, vacuumed outbox many times must not read
// the backlog that then arrives with a plan made for the empty table. In
// pgx's default mode a statement is prepared by name per connection and
// PostgreSQL switches it to a generic plan after five executions; for the
// relay's read that plan walked the whole table for each row (a
// 50,000-row backlog read for minutes). The source's reads and marks are
// planned at each execution: on one connection (so that
// pg_prepared_statements sees them all) no statement on the outbox table
// has a generic plan after many reads and marks of the empty table, while
// a plain query run as often beside them does (the check can see one).
func TestOutboxSourceNotPlannedForAnEmptyTable(t *testing.T) {
	t.Parallel()
	for _, indexed := range []bool{true, false} {
		t.Run(fmt.Sprint("index=", indexed), func(t *testing.T) {
			t.Parallel()
			pool := newPool(t, 1)
			s := openStoreOn(t, pool, freshSchema(t, pool))
			ctx := context.Background()
			src, err := s.OutboxSource(pgstore.WithOutboxPartitions(1))
			if err != nil {
				t.Fatal(err)
			}
			if indexed {
				if err := src.CreateIndex(ctx); err != nil {
					t.Fatal(err)
				}
			}
			ob := s.Tables().Outbox
			if _, err := pool.Exec(ctx, `VACUUM `+ob); err != nil {
				t.Fatal(err)
			}
			l, ok, err := src.Acquire(ctx, "r1", 0, 1<<40)
			if err != nil || !ok {
				t.Fatalf("Acquire = %v, %v", ok, err)
			}
			control := `SELECT count(*) FROM ` + ob + ` WHERE id > $1`
			for i := range 10 {
				if msgs, err := src.Fetch(ctx, l, 100, false); err != nil || len(msgs) != 0 {
					t.Fatalf("Fetch of the empty table = %d messages, %v", len(msgs), err)
				}
				if err := src.Mark(ctx, l, []int64{int64(i + 1)}); err != nil {
					t.Fatal(err)
				}
				if err := src.Fail(ctx, l, []outbox.Failure{{Seq: int64(i + 1), Err: "x"}}); err != nil {
					t.Fatal(err)
				}
				var n int
				if err := pool.QueryRow(ctx, control, int64(i)).Scan(&n); err != nil {
					t.Fatal(err)
				}
			}
			msgs := make([]outbox.Message, 300)
			for i := range msgs {
				msgs[i] = outbox.Message{Topic: "t", Key: fmt.Sprint("agg-", i%30), Payload: []byte("p")}
			}
			if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return s.WriteOutbox(ctx, tx, msgs...) }); err != nil {
				t.Fatal(err)
			}
			got, err := src.Fetch(ctx, l, 100, false)
			if err != nil || len(got) != 100 {
				t.Fatalf("Fetch of the backlog = %d messages, %v; want 100", len(got), err)
			}
			seqs := make([]int64, len(got))
			for i, m := range got {
				seqs[i] = m.Seq
			}
			if err := src.Mark(ctx, l, seqs); err != nil {
				t.Fatal(err)
			}
			if left := countRows(t, s, `published_at IS NULL`); left != 200 {
				t.Fatalf("%d rows unpublished after marking 100 of 300", left)
			}
			// Statements with parameters that read or change the outbox's
			// rows (an INSERT ... VALUES has one plan whatever the table
			// holds).
			rows, err := pool.Query(ctx, `SELECT statement, generic_plans FROM pg_prepared_statements
WHERE strpos(statement, $1) > 0 AND cardinality(parameter_types) > 0 AND statement NOT LIKE 'INSERT INTO %'`, ob+" ")
			if err != nil {
				t.Fatal(err)
			}
			type stmt struct {
				SQL     string
				Generic int64
			}
			all, err := pgx.CollectRows(rows, pgx.RowToStructByPos[stmt])
			if err != nil {
				t.Fatal(err)
			}
			sawControl := false
			for _, st := range all {
				if st.SQL == control {
					sawControl = st.Generic > 0
					continue
				}
				if st.Generic > 0 {
					t.Errorf("planned generically %d times: %s", st.Generic, strings.Join(strings.Fields(st.SQL), " "))
				}
			}
			if !sawControl {
				t.Fatalf("the control query got no generic plan (statements seen: %d): the check cannot see one", len(all))
			}
		})
	}
}

func countRows(t *testing.T, s *pgstore.Store, where string) int {
	t.Helper()
	var n int
	if err := s.Pool().QueryRow(context.Background(), `SELECT count(*) FROM `+s.Tables().Outbox+` WHERE `+where).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}
