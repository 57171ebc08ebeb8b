package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
)

// outboxLayouts: the plain and the time-partitioned outbox, with and without
// the partition index, marking by UPDATE and by DELETE.
func outboxLayouts(t *testing.T, f func(t *testing.T, s *pgstore.Store, src *pgstore.OutboxSource)) {
	for _, timeParts := range []bool{false, true} {
		for _, indexed := range []bool{false, true} {
			for _, del := range []bool{false, true} {
				t.Run(fmt.Sprintf("timeparts=%v/index=%v/delete=%v", timeParts, indexed, del), func(t *testing.T) {
					t.Parallel()
					s := openStore(t)
					ctx := context.Background()
					if timeParts {
						if err := s.PartitionOutbox(ctx, time.Hour); err != nil {
							t.Fatal(err)
						}
					}
					opts := []pgstore.OutboxOption{pgstore.WithOutboxPartitions(4)}
					if del {
						opts = append(opts, pgstore.WithOutboxDeletePublished())
					}
					src, err := s.OutboxSource(opts...)
					if err != nil {
						t.Fatal(err)
					}
					if indexed {
						if err := src.CreateIndex(ctx); err != nil {
							t.Fatal(err)
						}
					}
					f(t, s, src)
				})
			}
		}
	}
}

// keysOf returns n aggregate keys of partition p of 4.
func keysOf(t *testing.T, s *pgstore.Store, p, n int) []string {
	t.Helper()
	rows, err := s.Pool().Query(context.Background(), `SELECT k FROM (SELECT 'agg-' || g AS k FROM generate_series(1, 1000) g) x
WHERE ((hashtextextended(k, 0) & 9223372036854775807) % 4) = $1 ORDER BY k LIMIT $2`, p, n)
	if err != nil {
		t.Fatal(err)
	}
	ks, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(ks) != n {
		t.Fatalf("keys of partition %d: %v, %v", p, ks, err)
	}
	return ks
}

func writeOutboxTx(t *testing.T, s *pgstore.Store, tx pgx.Tx, msgs ...outbox.Message) {
	t.Helper()
	ctx := context.Background()
	if tx != nil {
		if err := s.WriteOutbox(ctx, tx, msgs...); err != nil {
			t.Fatal(err)
		}
		return
	}
	if err := pgx.BeginFunc(ctx, s.Pool(), func(tx pgx.Tx) error { return s.WriteOutbox(ctx, tx, msgs...) }); err != nil {
		t.Fatal(err)
	}
}

func seqsOf(msgs []outbox.Message) []int64 {
	out := make([]int64, len(msgs))
	for i, m := range msgs {
		out[i] = m.Seq
	}
	return out
}

// inLine reports whether row id is still in line (unpublished and
// not quarantined).
func inLine(t *testing.T, s *pgstore.Store, id int64) bool {
	t.Helper()
	var n int
	if err := s.Pool().QueryRow(context.Background(), `SELECT count(*) FROM `+s.Tables().Outbox+`
WHERE id = $1 AND published_at IS NULL AND quarantined_at IS NULL`, id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n == 1
}

// A row committed late whose id falls between a batch's lowest and
// highest id, and which the batch does not hold, is not marked by the
// batch's mark, and the next read returns it; every row of the batch is
// marked. Both forms of the mark: the ids as a bitmap over the batch's
// range (partition 3: the batch's rows are close), and as an array
// (partition 1: 2,000 rows of partition 0 between them).
func TestOutboxMarkSparesLateRowInsideBatchRange(t *testing.T) {
	t.Parallel()
	outboxLayouts(t, func(t *testing.T, s *pgstore.Store, src *pgstore.OutboxSource) {
		sparesLateRow(t, s, src, 3, 0)
		sparesLateRow(t, s, src, 1, 2000)
	})
}

// sparesLateRow is TestOutboxMarkSparesLateRowInsideBatchRange on
// partition p, with gap rows of partition 0 written between the batch's
// first two rows and its last two.
func sparesLateRow(t *testing.T, s *pgstore.Store, src *pgstore.OutboxSource, p, gap int) {
	t.Helper()
	{
		ctx := context.Background()
		ks := keysOf(t, s, p, 3)
		writeOutboxTx(t, s, nil, outbox.Message{ID: "a1", Topic: "t", Key: ks[0]}, outbox.Message{ID: "a2", Topic: "t", Key: ks[1]})
		tx, err := s.Pool().Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		writeOutboxTx(t, s, tx, outbox.Message{ID: fmt.Sprint("late-", p), Topic: "t", Key: ks[2]})
		if gap > 0 {
			fill := make([]outbox.Message, gap)
			k0 := keysOf(t, s, 0, 1)[0]
			for i := range fill {
				fill[i] = outbox.Message{Topic: "t", Key: k0}
			}
			writeOutboxTx(t, s, nil, fill...)
		}
		writeOutboxTx(t, s, nil, outbox.Message{ID: "b1", Topic: "t", Key: ks[0]}, outbox.Message{ID: "b2", Topic: "t", Key: ks[1]})
		l, ok, err := src.Acquire(ctx, "r1", p, time.Hour)
		if err != nil || !ok {
			t.Fatalf("Acquire = %v, %v", ok, err)
		}
		batch, err := src.Fetch(ctx, l, 100, false)
		if err != nil || len(batch) != 4 {
			t.Fatalf("Fetch = %+v, %v; want 4 rows", batch, err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		var late int64
		if err := s.Pool().QueryRow(ctx, `SELECT id FROM `+s.Tables().Outbox+` WHERE message_key = $1`, fmt.Sprint("late-", p)).Scan(&late); err != nil {
			t.Fatal(err)
		}
		if late <= batch[0].Seq || late >= batch[3].Seq {
			t.Fatalf("late row %d is not inside the batch's range %d..%d", late, batch[0].Seq, batch[3].Seq)
		}
		if err := src.Mark(ctx, l, seqsOf(batch)); err != nil {
			t.Fatal(err)
		}
		if !inLine(t, s, late) {
			t.Fatalf("the late row %d inside the batch's range was marked", late)
		}
		for _, m := range batch {
			if inLine(t, s, m.Seq) {
				t.Fatalf("batch row %d was not marked", m.Seq)
			}
		}
		if sparse := batch[3].Seq-batch[0].Seq > 2000; sparse != (gap > 0) {
			t.Fatalf("batch range %d..%d: sparse %v, want %v", batch[0].Seq, batch[3].Seq, sparse, gap > 0)
		}
		again, err := src.Fetch(ctx, l, 100, false)
		if err != nil || len(again) != 1 || again[0].Seq != late {
			t.Fatalf("Fetch after the mark = %+v, %v; want the late row alone", again, err)
		}
		if gap > 0 {
			if n := countRows(t, s, `published_at IS NULL AND aggregate = '`+keysOf(t, s, 0, 1)[0]+`'`); n != gap {
				t.Fatalf("%d rows of partition 0 unpublished, want %d", n, gap)
			}
		}
	}
}

// The mark's bitmap, read by PostgreSQL's get_bit the way the mark reads
// it, holds exactly the ids given; a batch spread over more than
// markBitsMax ids per id gets none (the mark sends an array).
func TestOutboxMarkBitmapMatchesGetBit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testPool(t)
	cases := [][]int64{{7}, {1, 2, 3, 4, 5, 6, 7, 8, 9}, {100, 108, 115, 116, 117, 123, 164}, {5, 1, 9, 1}}
	for n := range 50 {
		cases = append(cases, []int64{int64(1000 + n*37%257), int64(1000 + n*11%131), int64(1000 + n)})
	}
	for _, seqs := range cases {
		lo, hi := slices.Min(seqs), slices.Max(seqs)
		bits := pgstore.MarkBitmap(seqs, lo, hi)
		if bits == nil {
			t.Fatalf("%v: no bitmap", seqs)
		}
		rows, err := pool.Query(ctx, `SELECT $2::int8 + k FROM generate_series(0, $3::int8 - $2::int8) k
WHERE CASE WHEN $2::int8 + k >= $2::int8 AND $2::int8 + k <= $3::int8 THEN get_bit($1::bytea, k::int) = 1 ELSE false END`, bits, lo, hi)
		if err != nil {
			t.Fatal(err)
		}
		got, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			t.Fatal(err)
		}
		want := slices.Compact(slices.Sorted(slices.Values(seqs)))
		if !slices.Equal(got, want) {
			t.Fatalf("bitmap of %v read back as %v", seqs, got)
		}
	}
	if bits := pgstore.MarkBitmap([]int64{1, 2}, 1, 1+2*256); bits != nil {
		t.Fatalf("two ids 512 apart got a bitmap of %d bytes", len(bits))
	}
	if bits := pgstore.MarkBitmap([]int64{1, 2}, 1, 2*256); bits == nil {
		t.Fatal("two ids 511 apart got no bitmap")
	}
}

// Per-key order with quarantines that appear and disappear between
// reads, in this partition and in another: a key's later rows wait
// behind its quarantined row (Block) while any row anywhere is
// quarantined or none is, come with skipBlocked (Skip), and flow again
// once the operator drops or retries the row.
func TestOutboxQuarantineComesAndGoesBetweenReads(t *testing.T) {
	t.Parallel()
	outboxLayouts(t, func(t *testing.T, s *pgstore.Store, src *pgstore.OutboxSource) {
		ctx := context.Background()
		k3 := keysOf(t, s, 3, 2)
		k1 := keysOf(t, s, 1, 1)
		writeOutboxTx(t, s, nil,
			outbox.Message{ID: "K-1", Topic: "t", Key: k3[0]},
			outbox.Message{ID: "O-1", Topic: "t", Key: k1[0]},
			outbox.Message{ID: "J-1", Topic: "t", Key: k3[1]},
			outbox.Message{ID: "K-2", Topic: "t", Key: k3[0]},
			outbox.Message{ID: "O-2", Topic: "t", Key: k1[0]},
			outbox.Message{ID: "K-3", Topic: "t", Key: k3[0]},
		)
		l3, _, err := src.Acquire(ctx, "r1", 3, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		l1, _, err := src.Acquire(ctx, "r1", 1, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		ids := func(skip bool, l outbox.Lease) []string {
			t.Helper()
			msgs, err := src.Fetch(ctx, l, 100, skip)
			if err != nil {
				t.Fatal(err)
			}
			var out []string
			for _, m := range msgs {
				out = append(out, m.ID)
			}
			return out
		}
		want := func(got []string, w ...string) {
			t.Helper()
			if !slices.Equal(got, w) {
				t.Fatalf("read %v, want %v", got, w)
			}
		}
		first, err := src.Fetch(ctx, l3, 100, false)
		if err != nil || len(first) != 4 {
			t.Fatalf("Fetch = %+v, %v", first, err)
		}
		// K-1 quarantined: K's later rows wait (Block), come with Skip.
		if err := src.Fail(ctx, l3, []outbox.Failure{{Seq: first[0].Seq, Err: "poison", Quarantine: true}}); err != nil {
			t.Fatal(err)
		}
		want(ids(false, l3), "J-1")
		want(ids(true, l3), "J-1", "K-2", "K-3")
		// Another partition's row quarantined too, then K-1 dropped: K
		// flows while O-1 is quarantined elsewhere.
		o, err := src.Fetch(ctx, l1, 100, false)
		if err != nil || len(o) != 2 {
			t.Fatalf("Fetch of partition 1 = %+v, %v", o, err)
		}
		if err := src.Fail(ctx, l1, []outbox.Failure{{Seq: o[0].Seq, Err: "poison", Quarantine: true}}); err != nil {
			t.Fatal(err)
		}
		want(ids(false, l1))
		want(ids(false, l3), "J-1")
		if _, err := s.OutboxDrop(ctx, "K-1", false); err != nil {
			t.Fatal(err)
		}
		want(ids(false, l3), "J-1", "K-2", "K-3")
		// K-2 quarantined, O-1 retried: no row quarantined but K-2; K-3
		// waits, O-1 and O-2 come in order.
		if err := src.Fail(ctx, l3, []outbox.Failure{{Seq: first[2].Seq, Err: "poison", Quarantine: true}}); err != nil {
			t.Fatal(err)
		}
		if first[2].ID != "K-2" {
			t.Fatalf("batch order %+v", first)
		}
		if _, err := s.OutboxRetry(ctx, "O-1"); err != nil {
			t.Fatal(err)
		}
		want(ids(false, l1), "O-1", "O-2")
		want(ids(false, l3), "J-1")
		// A mark of K-3 under Skip while K-2 is quarantined marks it.
		skipped, err := src.Fetch(ctx, l3, 100, true)
		if err != nil {
			t.Fatal(err)
		}
		if err := src.Mark(ctx, l3, seqsOf(skipped)); err != nil {
			t.Fatal(err)
		}
		want(ids(true, l3))
		if _, err := s.OutboxRetry(ctx, "K-2"); err != nil {
			t.Fatal(err)
		}
		want(ids(false, l3), "K-2")
	})
}

// A lease taken over between read and mark: the old holder's mark
// changes nothing and returns ErrLeaseLost; the heir's mark of the same
// rows (read again) marks them.
func TestOutboxMarkFencedAfterTakeOverEveryLayout(t *testing.T) {
	t.Parallel()
	outboxLayouts(t, func(t *testing.T, s *pgstore.Store, src *pgstore.OutboxSource) {
		ctx := context.Background()
		ks := keysOf(t, s, 2, 2)
		writeOutboxTx(t, s, nil, outbox.Message{ID: "x1", Topic: "t", Key: ks[0]}, outbox.Message{ID: "x2", Topic: "t", Key: ks[1]})
		old, ok, err := src.Acquire(ctx, "old", 2, time.Microsecond)
		if err != nil || !ok {
			t.Fatalf("Acquire = %v, %v", ok, err)
		}
		batch, err := src.Fetch(ctx, old, 100, false)
		if err != nil || len(batch) != 2 {
			t.Fatalf("Fetch = %+v, %v", batch, err)
		}
		var heir outbox.Lease
		for !ok || heir.Owner != "heir" {
			heir, ok, err = src.Acquire(ctx, "heir", 2, time.Hour)
			if err != nil {
				t.Fatal(err)
			}
		}
		if heir.Epoch == old.Epoch {
			t.Fatalf("take-over kept epoch %d", heir.Epoch)
		}
		if err := src.Mark(ctx, old, seqsOf(batch)); !errors.Is(err, outbox.ErrLeaseLost) {
			t.Fatalf("old holder's Mark = %v, want ErrLeaseLost", err)
		}
		for _, m := range batch {
			if !inLine(t, s, m.Seq) {
				t.Fatalf("the fenced mark changed row %d", m.Seq)
			}
		}
		again, err := src.Fetch(ctx, heir, 100, false)
		if err != nil || len(again) != 2 {
			t.Fatalf("heir's Fetch = %+v, %v", again, err)
		}
		if err := src.Mark(ctx, heir, seqsOf(again)); err != nil {
			t.Fatal(err)
		}
		for _, m := range batch {
			if inLine(t, s, m.Seq) {
				t.Fatalf("the heir's mark left row %d", m.Seq)
			}
		}
	})
}

// A mark that changes fewer rows than it was given (already marked, as
// when a mark is sent again after an unknown outcome) still succeeds
// while the lease is held, and reports the lease lost once it is not,
// also when it would change nothing.
func TestOutboxMarkOfMarkedRowsReportsTheLease(t *testing.T) {
	outboxLayouts(t, func(t *testing.T, s *pgstore.Store, src *pgstore.OutboxSource) {
		ctx := context.Background()
		ks := keysOf(t, s, 1, 2)
		writeOutboxTx(t, s, nil, outbox.Message{ID: "m1", Topic: "t", Key: ks[0]}, outbox.Message{ID: "m2", Topic: "t", Key: ks[1]})
		l, ok, err := src.Acquire(ctx, "r", 1, time.Hour)
		if err != nil || !ok {
			t.Fatalf("Acquire = %v, %v", ok, err)
		}
		batch, err := src.Fetch(ctx, l, 100, false)
		if err != nil || len(batch) != 2 {
			t.Fatalf("Fetch = %+v, %v", batch, err)
		}
		if err := src.Mark(ctx, l, seqsOf(batch[:1])); err != nil {
			t.Fatal(err)
		}
		if err := src.Mark(ctx, l, seqsOf(batch)); err != nil {
			t.Fatalf("Mark of one marked and one unmarked row = %v, want nil", err)
		}
		if err := src.Mark(ctx, l, seqsOf(batch)); err != nil {
			t.Fatalf("Mark of marked rows under the lease = %v, want nil", err)
		}
		if err := src.Release(ctx, l); err != nil {
			t.Fatal(err)
		}
		if err := src.Mark(ctx, l, seqsOf(batch)); !errors.Is(err, outbox.ErrLeaseLost) {
			t.Fatalf("Mark of marked rows after the release = %v, want ErrLeaseLost", err)
		}
	})
}
