package pgstore_test

import (
	"context"
	"errors"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
)

// Both forms of the mark (a bitmap over the batch's id range, an array
// for a sparse batch), in every pgx query mode, mark exactly the given
// ids of the lease's partition: one id, unsorted and repeated ids, rows
// of other partitions and rows not given inside the range, a range just
// under and at the bitmap's limit, ids around 2^31 and at the top of int64, bitmaps
// whose bytes are a quote or a backslash (the simple protocol sends the
// bitmap as a literal); and a stale epoch's mark marks nothing.
func TestOutboxMarkFormsExactEveryMode(t *testing.T) {
	t.Parallel()
	for _, qm := range queryModes {
		t.Run(qm.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := newPool(t, 1, inMode(qm))
			s := openStoreOn(t, pool, freshSchema(t, testPool(t)))
			src, err := s.OutboxSource(pgstore.WithOutboxPartitions(4))
			if err != nil {
				t.Fatal(err)
			}
			if err := src.CreateIndex(ctx); err != nil {
				t.Fatal(err)
			}
			ob := s.Tables().Outbox
			mine, other := keysOf(t, s, 1, 1)[0], keysOf(t, s, 2, 1)[0]
			l, ok, err := src.Acquire(ctx, "r1", 1, time.Hour)
			if err != nil || !ok {
				t.Fatalf("Acquire = %v, %v", ok, err)
			}
			const top = math.MaxInt64
			type mcase struct {
				name   string
				rows   []int64 // of partition 1
				others []int64 // of partition 2
				seqs   []int64
			}
			span := func(lo, n, width int64) []int64 { // n ids, first lo, last lo+width
				out := []int64{lo}
				for i := int64(1); i < n-1; i++ {
					out = append(out, lo+i)
				}
				return append(out, lo+width)
			}
			cases := []mcase{
				{"one", []int64{10, 11, 12}, nil, []int64{11}},
				{"unsorted-repeated", []int64{101, 102, 103, 104, 105}, []int64{100, 106}, []int64{105, 101, 105, 103, 101}},
				{"other-partition-in-range", []int64{200, 202, 204}, []int64{201, 203}, []int64{204, 201, 200, 203}},
				// bits 0,1,2,5 (0x27 = ') and 10,11,12,14 (0x5c = \)
				{"quote-backslash", []int64{300, 301, 302, 303, 305, 310, 311, 312, 313, 314}, nil, []int64{300, 301, 302, 305, 310, 311, 312, 314}},
				{"under-limit", span(1000, 4, 4*256-1), nil, span(1000, 4, 4*256-1)},
				{"at-limit", span(3000, 4, 4*256), nil, span(3000, 4, 4*256)},
				{"int32-edge", []int64{1<<31 - 2, 1<<31 - 1, 1 << 31, 1<<31 + 1}, []int64{1<<31 + 2}, []int64{1<<31 + 2, 1<<31 - 2, 1 << 31, 1<<31 + 1}},
				{"top", []int64{top - 9, top - 5, top - 1, top}, []int64{top - 7}, []int64{top, top - 9, top - 7, top - 1}},
				{"top-sparse", []int64{top - 2000, top}, nil, []int64{top, top - 2000}},
			}
			for _, c := range cases {
				if _, err := pool.Exec(ctx, `DELETE FROM `+ob); err != nil {
					t.Fatal(err)
				}
				for _, set := range []struct {
					ids []int64
					key string
				}{{c.rows, mine}, {c.others, other}} {
					if len(set.ids) == 0 {
						continue
					}
					if _, err := pool.Exec(ctx, `INSERT INTO `+ob+` (id, message_key, aggregate, topic, payload)
OVERRIDING SYSTEM VALUE SELECT i, 'k' || i, $2::text, 't', '\x00' FROM unnest($1::int8[]) i`, set.ids, set.key); err != nil {
						t.Fatal(err)
					}
				}
				// A stale epoch first: nothing marked, ErrLeaseLost.
				stale := l
				stale.Epoch--
				if err := src.Mark(ctx, stale, c.seqs); !errors.Is(err, outbox.ErrLeaseLost) {
					t.Fatalf("%s: stale Mark = %v, want ErrLeaseLost", c.name, err)
				}
				if n := countRows(t, s, `published_at IS NOT NULL`); n != 0 {
					t.Fatalf("%s: the stale mark marked %d rows", c.name, n)
				}
				if err := src.Mark(ctx, l, c.seqs); err != nil {
					t.Fatalf("%s: Mark = %v", c.name, err)
				}
				rows, err := pool.Query(ctx, `SELECT id FROM `+ob+` WHERE published_at IS NOT NULL ORDER BY id`)
				if err != nil {
					t.Fatal(err)
				}
				got, err := pgx.CollectRows(rows, pgx.RowTo[int64])
				if err != nil {
					t.Fatal(err)
				}
				var want []int64
				for _, id := range c.rows {
					if slices.Contains(c.seqs, id) {
						want = append(want, id)
					}
				}
				slices.Sort(want)
				if !slices.Equal(got, want) {
					t.Fatalf("%s: marked %v, want %v", c.name, got, want)
				}
			}
		})
	}
}

// The bitmap mark's settings (shaped, set_config(..., true) in the
// mark's batch) stay off the pooled session in every pgx query mode:
// after a mark, after one that fails mid-batch (a lock timeout once its
// statement is cached, so the settings ran) and after one cancelled while
// it waits on a lock, the session has its own settings and no
// transaction open, and the next mark marks.
func TestOutboxMarkSettingsStayOffTheSession(t *testing.T) {
	t.Parallel()
	for _, qm := range queryModes {
		t.Run(qm.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := newPool(t, 1, inMode(qm))
			shared := testPool(t)
			s := openStoreOn(t, pool, freshSchema(t, shared))
			src, err := s.OutboxSource(pgstore.WithOutboxPartitions(4))
			if err != nil {
				t.Fatal(err)
			}
			check := sessionKept(t, pool)
			ks := keysOf(t, s, 1, 2)
			writeOutboxTx(t, s, nil, outbox.Message{ID: "m1", Topic: "t", Key: ks[0]}, outbox.Message{ID: "m2", Topic: "t", Key: ks[1]},
				outbox.Message{ID: "m3", Topic: "t", Key: ks[1]})
			l, ok, err := src.Acquire(ctx, "r1", 1, time.Hour)
			if err != nil || !ok {
				t.Fatalf("Acquire = %v, %v", ok, err)
			}
			batch, err := src.Fetch(ctx, l, 10, false)
			if err != nil || len(batch) != 3 {
				t.Fatalf("Fetch = %+v, %v; want 3 rows", batch, err)
			}
			if err := src.Mark(ctx, l, seqsOf(batch[:1])); err != nil {
				t.Fatal(err)
			}
			check("after a mark")

			failMidBatch(t, s, pool, shared, "mark", func(ctx context.Context) error {
				return src.Mark(ctx, l, seqsOf(batch[1:2]))
			}, check)
			if err := src.Mark(ctx, l, seqsOf(batch[1:])); err != nil {
				t.Fatal(err)
			}
			check("after a mark")
			if n := countRows(t, s, `published_at IS NULL`); n != 0 {
				t.Fatalf("%d rows left unpublished after the marks", n)
			}
		})
	}
}

// A bitmap is sent only when its bit numbers fit the int the mark casts
// them to (get_bit($4, (o.id - $5)::int)): a mark of more than 2^23 ids
// (2^31 / markBitsMax) over a range of 2^31 ids or more would otherwise
// fail in PostgreSQL with "integer out of range" at each retry, a range
// the array form marks.
func TestOutboxMarkBitmapBitNumbersFitInt(t *testing.T) {
	t.Parallel()
	var tooBig string
	err := testPool(t).QueryRow(context.Background(), `SELECT get_bit('\x00'::bytea, ((2147483648)::int8)::int)::text`).Scan(&tooBig)
	if pgCode(err) != "22003" {
		t.Fatalf("get_bit at bit 2^31 through ::int = %q, %v; want integer out of range", tooBig, err)
	}
	seqs := make([]int64, 1<<23+1)
	for i := range seqs {
		seqs[i] = 1 + int64(i)
	}
	seqs[len(seqs)-1] = 1 + 1<<31 // the span is 2^31, under markBitsMax ids per id
	if bits := pgstore.MarkBitmap(seqs, 1, 1+1<<31); bits != nil {
		t.Fatalf("a range of 2^31 ids got a bitmap of %d bytes: its last bit number does not fit an int", len(bits))
	}
}
