package pgstore_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
)

// TestCompleteBatchFindsRowsByKey: CompleteBatch's statement reaches the
// rows of a batch through the primary key, never by a sequential scan of
// the records table, whatever the planner thinks of the table (issue 16):
// prepared as pgx prepares it and planned both generic and custom for a
// batch of 100 of 5,000 analyzed records. Its UPDATE ... FROM unnest
// before was planned as a hash join over a sequential scan of a table of
// this size (the planner prices 100 index probes above a scan of some
// 30,000 rows), which cost time in proportion to the table.
func TestCompleteBatchFindsRowsByKey(t *testing.T) {
	s := openStore(t)
	ctx := context.Background()
	for b := range 5 {
		reqs := make([]dedup.ClaimRequest, 1000)
		for i := range reqs {
			reqs[i] = dedup.ClaimRequest{Key: key(fmt.Sprint("plan-", b*1000+i))}
		}
		if _, err := s.ClaimBatch(ctx, reqs, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	table := s.Tables().Records
	name := strings.Trim(table[strings.LastIndex(table, ".")+1:], `"`)
	conn, err := s.Pool().Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, `ANALYZE `+table); err != nil {
		t.Fatal(err)
	}
	// A batch of 100 of the records, as CompleteBatch sends it.
	var scopes []int32
	var ids, tokens, results [][]byte
	rows, err := conn.Query(ctx, `SELECT scope, id, token FROM `+table+` ORDER BY scope, id LIMIT 100`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var sc int32
		var id, tok []byte
		if err := rows.Scan(&sc, &id, &tok); err != nil {
			t.Fatal(err)
		}
		scopes, ids, tokens, results = append(scopes, sc), append(ids, id), append(tokens, tok), append(results, []byte("r"))
	}
	if err := rows.Err(); err != nil || len(ids) != 100 {
		t.Fatalf("%d records read: %v", len(ids), err)
	}
	if _, err := conn.Exec(ctx, `PREPARE cb (int4[], bytea[], bytea[], bytea[], int8) AS `+pgstore.CompleteBatchSQL(s)); err != nil {
		t.Fatal(err)
	}
	defer conn.Exec(ctx, `DEALLOCATE cb; RESET plan_cache_mode`)
	for _, mode := range []string{"force_generic_plan", "force_custom_plan"} {
		if _, err := conn.Exec(ctx, `SET plan_cache_mode = `+mode); err != nil {
			t.Fatal(err)
		}
		// The simple protocol puts the arguments into the text as literals:
		// EXPLAIN takes no parameters of its own.
		rows, err := conn.Query(ctx, `EXPLAIN EXECUTE cb($1, $2, $3, $4, $5)`, pgx.QueryExecModeSimpleProtocol,
			scopes, ids, tokens, results, int64(time.Hour/time.Microsecond))
		if err != nil {
			t.Fatal(err)
		}
		var plan []string
		for rows.Next() {
			var line string
			if err := rows.Scan(&line); err != nil {
				t.Fatal(err)
			}
			plan = append(plan, line)
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		text := strings.Join(plan, "\n")
		if strings.Contains(text, "Seq Scan on "+name) || strings.Contains(text, "Seq Scan on "+table) {
			t.Errorf("%s: the plan scans the records table:\n%s", mode, text)
		}
		if !strings.Contains(text, name+"_pkey") {
			t.Errorf("%s: the plan does not use the primary key:\n%s", mode, text)
		}
	}
}
