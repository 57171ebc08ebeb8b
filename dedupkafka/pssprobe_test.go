package dedupkafka

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

// pssWindow, with DEDUP_BENCH_PSS=1, resets pg_stat_statements at a
// window's start; the returned function lists the statements of the
// window (calls, rows, execution and planning time, buffers hit, WAL
// records), for b.Log. It needs the extension (shared_preload_libraries
// and CREATE EXTENSION) on a server of the benchmark's own: the reset is
// server-wide.
func pssWindow(b *testing.B, pool *pgxpool.Pool) func() string {
	if os.Getenv("DEDUP_BENCH_PSS") != "1" {
		return func() string { return "" }
	}
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `SELECT pg_stat_statements_reset()`); err != nil {
		b.Fatal(err)
	}
	return func() string {
		rows, err := pool.Query(ctx, `SELECT calls, rows, total_exec_time, total_plan_time, shared_blks_hit, wal_records,
	left(regexp_replace(query, '\s+', ' ', 'g'), 40) FROM pg_stat_statements WHERE query NOT LIKE '%pg_stat_statements%' ORDER BY total_exec_time DESC LIMIT 8`)
		if err != nil {
			b.Fatal(err)
		}
		defer rows.Close()
		var sb strings.Builder
		for rows.Next() {
			var calls, n, hit, wal int64
			var tot, plan float64
			var q string
			if err := rows.Scan(&calls, &n, &tot, &plan, &hit, &wal, &q); err != nil {
				b.Fatal(err)
			}
			fmt.Fprintf(&sb, "\n\t%5d calls %6d rows exec %7.1f ms (%.3f/call) plan %6.1f ms hit %7d (%.1f/row) wal %6d | %s", calls, n, tot, tot/float64(max(calls, 1)), plan, hit, float64(hit)/float64(max(n, 1)), wal, q)
		}
		return sb.String()
	}
}
