package pgstore_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A relay that polled an idle, vacuumed outbox many times must not read
// the backlog that then arrives with a plan that walks the table. In
// pgx's default mode a statement is prepared by name per connection and
// PostgreSQL may keep a generic plan for it; made while the outbox was
// empty, the relay's read once did a sequential scan per row (a
// 50,000-row backlog read for minutes, d9bf376). The read now runs a
// generic plan on purpose, made under settings (no sequential or bitmap
// scan, no sort) that leave it one shape, and the mark is planned at each
// execution under the same settings: on one connection, the read's plan
// made for the empty table (pg_prepared_statements: generic, never
// custom) and the mark read and mark the backlog without a sequential scan of the
// table and fetch about a batch of rows each (pg_stat_user_tables); the
// same read planned without index scans is seen to scan the table (the
// check can see a walk). Without enable_seqscan off, the
// plans made for the empty table scan it, indexed or not.
func TestOutboxSourceEmptyTablePlansStopAfterTheBatch(t *testing.T) {
	t.Parallel()
	for _, indexed := range []bool{true, false} {
		t.Run(fmt.Sprint("index=", indexed), func(t *testing.T) {
			t.Parallel()
			pool := newPool(t, 1)
			s := openStoreOn(t, pool, freshSchema(t, pool))
			ctx := context.Background()
			src, err := s.OutboxSource(pgstore.WithOutboxPartitions(1), pgstore.WithOutboxDeletePublished())
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
			for i := range 10 {
				if msgs, err := src.Fetch(ctx, l, 100, false); err != nil || len(msgs) != 0 {
					t.Fatalf("Fetch of the empty table = %d messages, %v", len(msgs), err)
				}
				if msgs, err := src.FetchNext(ctx, l, []outbox.Message{{Seq: 1}}, 100, false); err != nil || len(msgs) != 0 {
					t.Fatalf("FetchNext of the empty table = %d messages, %v", len(msgs), err)
				}
				if err := src.Mark(ctx, l, []int64{int64(i + 1), int64(i + 3)}); err != nil {
					t.Fatal(err)
				}
				if err := src.Fail(ctx, l, []outbox.Failure{{Seq: int64(i + 1), Err: "x"}}); err != nil {
					t.Fatal(err)
				}
			}
			const backlog = 3000
			if _, err := pool.Exec(ctx, `INSERT INTO `+ob+` (message_key, aggregate, topic, payload)
SELECT 'evt-' || g, 'agg-' || (g % 30), 't', '\x00' FROM generate_series(1, $1::int) g`, backlog); err != nil {
				t.Fatal(err)
			}
			// scans is the table's sequential scans and the rows fetched
			// through its indexes, once this connection's statistics are
			// flushed.
			scans := func() (seq, fetched int64) {
				t.Helper()
				if _, err := pool.Exec(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
					t.Fatal(err)
				}
				if err := pool.QueryRow(ctx, `SELECT seq_scan, idx_tup_fetch FROM pg_stat_user_tables WHERE relid = to_regclass($1)`, ob).Scan(&seq, &fetched); err != nil {
					t.Fatal(err)
				}
				return seq, fetched
			}
			const limit = 100
			check := func(what string, seq0, fetched0 int64) {
				t.Helper()
				seq, fetched := scans()
				if seq != seq0 {
					t.Errorf("%s: %d sequential scans of the outbox table", what, seq-seq0)
				}
				if fetched-fetched0 > 2*limit {
					t.Errorf("%s: fetched %d rows through the table's indexes, want about %d", what, fetched-fetched0, limit)
				}
			}
			seq0, fetched0 := scans()
			got, err := src.Fetch(ctx, l, limit, false)
			if err != nil || len(got) != limit {
				t.Fatalf("Fetch of the backlog = %d messages, %v; want %d", len(got), err, limit)
			}
			check("the read", seq0, fetched0)
			seq0, fetched0 = scans()
			ahead, err := src.FetchNext(ctx, l, got, limit, false)
			if err != nil || len(ahead) != limit || ahead[0].Seq <= got[len(got)-1].Seq {
				t.Fatalf("FetchNext of the backlog = %d messages, %v; want %d after the first %d", len(ahead), err, limit, limit)
			}
			check("the read ahead", seq0, fetched0)
			seq0, fetched0 = scans()
			if err := src.Mark(ctx, l, seqsOf(got)); err != nil {
				t.Fatal(err)
			}
			check("the mark", seq0, fetched0)
			if left := countRows(t, s, `true`); left != backlog-limit {
				t.Fatalf("%d rows left after marking %d of %d", left, limit, backlog)
			}
			// The plans were the ones made for the empty table.
			rows, err := pool.Query(ctx, `SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements
WHERE strpos(statement, $1) > 0 AND (statement LIKE 'SELECT o.id%' OR statement LIKE '%get_bit%')`, ob+" ")
			if err != nil {
				t.Fatal(err)
			}
			type stmt struct {
				SQL             string
				Generic, Custom int64
			}
			all, err := pgx.CollectRows(rows, pgx.RowToStructByPos[stmt])
			if err != nil {
				t.Fatal(err)
			}
			if len(all) != 3 {
				t.Fatalf("%d prepared reads and marks, want 3 (the read, the read ahead, the mark)", len(all))
			}
			for _, st := range all {
				// The reads' generic plans are the ones made for the empty
				// table; the mark is planned at each execution (see
				// TestOutboxMarkPlannedOnSmallTableWalksThePartition).
				want := [2]int64{11, 0}
				if strings.Contains(st.SQL, "get_bit") {
					want = [2]int64{0, 11}
				}
				if got := [2]int64{st.Generic, st.Custom}; got != want {
					t.Errorf("%d generic and %d custom plans, want %d and %d: %s", st.Generic, st.Custom, want[0], want[1], strings.Join(strings.Fields(st.SQL), " "))
				}
			}
			// The control: the read's own statement, planned without index
			// scans, walks the table, and the check sees it.
			fresh := newPool(t, 1)
			if _, err := fresh.Exec(ctx, `SET enable_indexscan = off`); err != nil {
				t.Fatal(err)
			}
			if _, err := fresh.Exec(ctx, `SET enable_bitmapscan = off`); err != nil {
				t.Fatal(err)
			}
			var read string // the plain read
			for _, st := range all {
				if strings.HasPrefix(st.SQL, "SELECT o.id") && !strings.Contains(st.SQL, "$4") {
					read = st.SQL
				}
			}
			var seqBefore, seqAfter int64
			stat := `SELECT seq_scan FROM pg_stat_user_tables WHERE relid = to_regclass($1)`
			if _, err := fresh.Exec(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
				t.Fatal(err)
			}
			if err := fresh.QueryRow(ctx, stat, ob).Scan(&seqBefore); err != nil {
				t.Fatal(err)
			}
			if _, err := fresh.Exec(ctx, read, 0, limit, false); err != nil {
				t.Fatal(err)
			}
			if _, err := fresh.Exec(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
				t.Fatal(err)
			}
			if err := fresh.QueryRow(ctx, stat, ob).Scan(&seqAfter); err != nil {
				t.Fatal(err)
			}
			if seqAfter == seqBefore {
				t.Fatal("the read planned on the empty table without the settings did not scan the table: the check cannot see a walk")
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

// A read of one partition walks only the batch's entries of the partition
// index, in id order, and stops: it does not read every unpublished row
// of the partition and sort them. The planner has no statistics on the
// partition expression and guessed the partition smaller than a batch;
// with a bitmap scan it then read all of the partition's rows for each
// batch (5-6 ms a read of a 50,000-row backlog, against 0.7 ms). The
// count is the partition index's idx_tup_read, flushed by the one
// connection that ran the read.
func TestOutboxFetchReadsOnlyItsBatch(t *testing.T) {
	t.Parallel()
	pool := newPool(t, 1)
	s := openStoreOn(t, pool, freshSchema(t, pool))
	ctx := context.Background()
	src, err := s.OutboxSource(pgstore.WithOutboxPartitions(16), pgstore.WithOutboxDeletePublished())
	if err != nil {
		t.Fatal(err)
	}
	if err := src.CreateIndex(ctx); err != nil {
		t.Fatal(err)
	}
	ob := s.Tables().Outbox
	if _, err := pool.Exec(ctx, `INSERT INTO `+ob+` (message_key, aggregate, topic, payload)
SELECT 'evt-' || g, 'agg-' || (g % 1000), 't', convert_to(repeat('x', 200), 'UTF8') FROM generate_series(1, 32000) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE `+ob); err != nil {
		t.Fatal(err)
	}
	var inPart int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+ob+` WHERE ((hashtextextended(aggregate, 0) & 9223372036854775807) % 16) = 3`).Scan(&inPart); err != nil {
		t.Fatal(err)
	}
	// tupRead is the partition index's idx_tup_read once this connection's
	// pending statistics are flushed.
	tupRead := func() int64 {
		t.Helper()
		if _, err := pool.Exec(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
			t.Fatal(err)
		}
		var n int64
		if err := pool.QueryRow(ctx, `SELECT idx_tup_read FROM pg_stat_user_indexes WHERE relid = to_regclass($1) AND indexrelname LIKE '%outbox_part16'`, ob).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	l, ok, err := src.Acquire(ctx, "r1", 3, 1<<40)
	if err != nil || !ok {
		t.Fatalf("Acquire = %v, %v", ok, err)
	}
	const limit = 100
	before := tupRead()
	msgs, err := src.Fetch(ctx, l, limit, false)
	if err != nil || len(msgs) != limit {
		t.Fatalf("Fetch = %d messages, %v; want %d", len(msgs), err, limit)
	}
	for i := 1; i < len(msgs); i++ {
		if msgs[i].Seq <= msgs[i-1].Seq {
			t.Fatalf("Fetch out of id order at %d: %d after %d", i, msgs[i].Seq, msgs[i-1].Seq)
		}
	}
	read := tupRead() - before
	if read == 0 {
		t.Fatal("the partition index read no entries: the check cannot see the read")
	}
	if read > 2*limit {
		t.Fatalf("one read of %d rows walked %d entries of the partition index (the partition holds %d rows): it did not stop after its batch", limit, read, inPart)
	}
}

// outboxIndexScans returns idx_scan of each index of the outbox table
// (by name suffix: "pkey", "outbox_part16", "outbox_quarantined", ...)
// once the connection's pending statistics are flushed. The pool must
// have one connection, the one that ran the statements counted.
func outboxIndexScans(t *testing.T, pool *pgxpool.Pool, ob string) map[string]int64 {
	t.Helper()
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
		t.Fatal(err)
	}
	rows, err := pool.Query(ctx, `SELECT indexrelname::text, idx_scan FROM pg_stat_user_indexes WHERE relid = to_regclass($1)`, ob)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{}
	for rows.Next() {
		var name string
		var n int64
		if err := rows.Scan(&name, &n); err != nil {
			t.Fatal(err)
		}
		for _, suffix := range []string{"pkey", "outbox_part16", "outbox_quarantined", "outbox_unpublished"} {
			if strings.HasSuffix(name, suffix) {
				out[suffix] = n
			}
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// A read of a partition probes the quarantine index once per row only
// while some row is quarantined: with none (the common case), one probe
// of the (empty) index for the whole read, which was half of a read's
// time (0.57 against 0.29 ms for 500 rows). With a quarantined row the
// per-row check still holds its key's later rows back.
func TestOutboxFetchProbesQuarantineOnlyWhenSomeRowIs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, src, ob, l := sixteenThousandRows(t)
	const limit = 100
	before := outboxIndexScans(t, pool, ob)["outbox_quarantined"]
	msgs, err := src.Fetch(ctx, l, limit, false)
	if err != nil || len(msgs) != limit {
		t.Fatalf("Fetch = %d messages, %v; want %d", len(msgs), err, limit)
	}
	if probes := outboxIndexScans(t, pool, ob)["outbox_quarantined"] - before; probes > 2 {
		t.Fatalf("a read of %d rows with no row quarantined probed the quarantine index %d times", limit, probes)
	}
	// Quarantine the first row read: its key's later rows wait, the
	// other keys' rows still come.
	poison := msgs[0]
	if err := src.Fail(ctx, l, []outbox.Failure{{Seq: poison.Seq, Err: "poison", Quarantine: true}}); err != nil {
		t.Fatal(err)
	}
	before = outboxIndexScans(t, pool, ob)["outbox_quarantined"]
	again, err := src.Fetch(ctx, l, limit, false)
	if err != nil || len(again) != limit {
		t.Fatalf("Fetch after the quarantine = %d messages, %v; want %d", len(again), err, limit)
	}
	if probes := outboxIndexScans(t, pool, ob)["outbox_quarantined"] - before; probes < limit {
		t.Fatalf("a read of %d rows with a row quarantined probed the quarantine index %d times: the check cannot see the per-row probe", limit, probes)
	}
	for _, m := range again {
		if m.Key == poison.Key {
			t.Fatalf("message %d of quarantined key %s was read after its quarantined row %d", m.Seq, m.Key, poison.Seq)
		}
	}
	// And with the check skipped (the relay's Skip policy) the key's rows
	// come again.
	skipped, err := src.Fetch(ctx, l, limit, true)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(skipped, func(m outbox.Message) bool { return m.Key == poison.Key }) {
		t.Fatalf("with skipBlocked the quarantined key %s's later rows still wait", poison.Key)
	}
}

// The mark of a batch finds its rows in one scan of the partition
// index's range of the batch, not by a descent of the primary key for
// each id (2,266 buffer reads for a batch of 500 against 1,285-1,527,
// 1.43 against 0.74-0.85 ms serially). It marks exactly the ids given, and none of
// another partition's, whose lease it does not hold.
func TestOutboxMarkWalksThePartitionRange(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, src, ob, l := sixteenThousandRows(t)
	const limit = 100
	msgs, err := src.Fetch(ctx, l, limit, false)
	if err != nil || len(msgs) != limit {
		t.Fatalf("Fetch = %d messages, %v; want %d", len(msgs), err, limit)
	}
	// Every other message of the batch, and one row of another partition.
	var seqs []int64
	for i := 0; i < len(msgs); i += 2 {
		seqs = append(seqs, msgs[i].Seq)
	}
	var other int64
	if err := pool.QueryRow(ctx, `SELECT id FROM `+ob+` WHERE ((hashtextextended(aggregate, 0) & 9223372036854775807) % 16) = 4 ORDER BY id LIMIT 1`).Scan(&other); err != nil {
		t.Fatal(err)
	}
	before := outboxIndexScans(t, pool, ob)
	if err := src.Mark(ctx, l, append(seqs, other)); err != nil {
		t.Fatal(err)
	}
	after := outboxIndexScans(t, pool, ob)
	if n := after["outbox_part16"] - before["outbox_part16"]; n != 1 {
		t.Errorf("the mark scanned the partition index %d times, want 1", n)
	}
	left := map[int64]bool{}
	rows, err := pool.Query(ctx, `SELECT id FROM `+ob+` WHERE id <= $1 OR id = $2`, msgs[len(msgs)-1].Seq, other)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		left[id] = true
	}
	for i, m := range msgs {
		if marked := !left[m.Seq]; marked != (i%2 == 0) {
			t.Errorf("message %d (batch index %d): marked %v", m.Seq, i, marked)
		}
	}
	if !left[other] {
		t.Errorf("the mark of partition 3 deleted row %d of partition 4", other)
	}
}

// sixteenThousandRows opens a 16-partition outbox source (published rows
// deleted) with its partition index on a fresh schema, fills it with
// 16,000 rows over 100 keys, vacuums and analyzes it, and acquires
// partition 3's lease: the table the read and mark plan tests run on.
func sixteenThousandRows(t *testing.T) (*pgxpool.Pool, *pgstore.OutboxSource, string, outbox.Lease) {
	pool := newPool(t, 1)
	s := openStoreOn(t, pool, freshSchema(t, pool))
	ctx := context.Background()
	src, err := s.OutboxSource(pgstore.WithOutboxPartitions(16), pgstore.WithOutboxDeletePublished())
	if err != nil {
		t.Fatal(err)
	}
	if err := src.CreateIndex(ctx); err != nil {
		t.Fatal(err)
	}
	ob := s.Tables().Outbox
	if _, err := pool.Exec(ctx, `INSERT INTO `+ob+` (message_key, aggregate, topic, payload)
SELECT 'evt-' || g, 'agg-' || (g % 100), 't', '\x00' FROM generate_series(1, 16000) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE `+ob); err != nil {
		t.Fatal(err)
	}
	l, ok, err := src.Acquire(ctx, "r1", 3, 1<<40)
	if err != nil || !ok {
		t.Fatalf("Acquire = %v, %v", ok, err)
	}
	return pool, src, ob, l
}

// A mark whose plan is made while the table's statistics say it is empty
// or small (a vacuumed outbox whose relay keeps up, published rows
// deleted), indexed, marks a later backlog's batch through the partition
// index's range: about a batch of index entries, not every unpublished
// row of every partition between the batch's lowest and highest id. A
// generic plan made then priced every index range at one row and kept
// the unpublished rows' (id) index: 1,481 entries for a batch of 100
// over 16 partitions, until an ANALYZE.
func TestOutboxMarkPlannedOnSmallTableWalksThePartition(t *testing.T) {
	t.Parallel()
	for _, before := range []int{0, 200} {
		t.Run(fmt.Sprint("rows=", before), func(t *testing.T) {
			t.Parallel()
			pool := newPool(t, 1)
			s := openStoreOn(t, pool, freshSchema(t, pool))
			ctx := context.Background()
			src, err := s.OutboxSource(pgstore.WithOutboxPartitions(16), pgstore.WithOutboxDeletePublished())
			if err != nil {
				t.Fatal(err)
			}
			if err := src.CreateIndex(ctx); err != nil {
				t.Fatal(err)
			}
			ob := s.Tables().Outbox
			insert := func(n int) {
				t.Helper()
				if _, err := pool.Exec(ctx, `INSERT INTO `+ob+` (message_key, aggregate, topic, payload)
SELECT 'evt-' || g, 'agg-' || (g % 300), 't', '\x00' FROM generate_series(1, $1::int) g`, n); err != nil {
					t.Fatal(err)
				}
			}
			// No autovacuum: its ANALYZE of the backlog would replan the
			// mark with the backlog's statistics.
			if _, err := pool.Exec(ctx, `ALTER TABLE `+ob+` SET (autovacuum_enabled = false)`); err != nil {
				t.Fatal(err)
			}
			if before > 0 {
				insert(before)
			}
			if _, err := pool.Exec(ctx, `VACUUM ANALYZE `+ob); err != nil {
				t.Fatal(err)
			}
			l, ok, err := src.Acquire(ctx, "r1", 3, 1<<40)
			if err != nil || !ok {
				t.Fatalf("Acquire = %v, %v", ok, err)
			}
			for i := range 10 {
				if err := src.Mark(ctx, l, []int64{int64(i + 1), int64(i + 3)}); err != nil {
					t.Fatal(err)
				}
			}
			insert(20000)
			const limit = 100
			batch, err := src.Fetch(ctx, l, limit, false)
			if err != nil || len(batch) != limit {
				t.Fatalf("Fetch = %d messages, %v; want %d", len(batch), err, limit)
			}
			// read is the entries read in the table's indexes, once this
			// connection's statistics are flushed.
			read := func() int64 {
				t.Helper()
				if _, err := pool.Exec(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
					t.Fatal(err)
				}
				var n int64
				if err := pool.QueryRow(ctx, `SELECT sum(idx_tup_read)::int8 FROM pg_stat_user_indexes WHERE relid = to_regclass($1)`, ob).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n
			}
			r0 := read()
			if err := src.Mark(ctx, l, seqsOf(batch)); err != nil {
				t.Fatal(err)
			}
			span := batch[limit-1].Seq - batch[0].Seq
			if n := read() - r0; n < limit || n > 2*limit {
				t.Fatalf("the mark of %d rows (an id range of %d) read %d index entries, want about %d", limit, span, n, limit)
			}
			if span < 4*limit {
				t.Fatalf("the batch's id range is %d: the check cannot see a walk of the range", span)
			}
			if n := countRows(t, s, `true`); n != before+20000-limit {
				t.Fatalf("%d rows left after the mark, want %d", n, before+20000-limit)
			}
		})
	}
}
