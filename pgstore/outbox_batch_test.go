package pgstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
)

// The read's and the mark's planner settings (set_config(..., true), sent
// in one batch with the statement and without BEGIN and COMMIT) stay on
// the statement and off the pooled session, in every pgx query mode: after a read, after a read
// that fails mid-batch (a lock timeout once the settings ran) and after
// one cancelled mid-batch (blocked on a lock), the pool's one session
// has its own settings and no transaction open, and marks and reads go on.
func TestOutboxFetchSettingsStayOffTheSession(t *testing.T) {
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
			writeOutboxTx(t, s, nil, outbox.Message{ID: "m1", Topic: "t", Key: ks[0]}, outbox.Message{ID: "m2", Topic: "t", Key: ks[1]})
			l, ok, err := src.Acquire(ctx, "r1", 1, time.Hour)
			if err != nil || !ok {
				t.Fatalf("Acquire = %v, %v", ok, err)
			}
			batch, err := src.Fetch(ctx, l, 1, false)
			if err != nil || len(batch) != 1 {
				t.Fatalf("Fetch = %+v, %v; want 1 row", batch, err)
			}
			check("after a read")
			if _, err := src.FetchNext(ctx, l, batch, 1, false); err != nil {
				t.Fatal(err)
			}
			check("after a read ahead")

			// Mid-batch failure (the settings ran, the read waits on a lock
			// and times out) and a cancel mid-batch.
			failMidBatch(t, s, pool, shared, "read", func(ctx context.Context) error {
				_, err := src.Fetch(ctx, l, 1, false)
				return err
			}, check)

			// The session still reads and marks.
			batch, err = src.Fetch(ctx, l, 10, false)
			if err != nil || len(batch) != 2 {
				t.Fatalf("Fetch = %+v, %v; want 2 rows", batch, err)
			}
			if err := src.Mark(ctx, l, seqsOf(batch)); err != nil {
				t.Fatal(err)
			}
			check("after a mark")
			if batch, err = src.Fetch(ctx, l, 10, false); err != nil || len(batch) != 0 {
				t.Fatalf("Fetch after the mark = %+v, %v; want none", batch, err)
			}
		})
	}
}

// The batch shape the read uses (the settings' statement, then a
// statement, with no BEGIN and COMMIT) runs as one transaction in every
// pgx query mode: the second statement sees the settings the first made,
// so the read is planned under them.
func TestOutboxFetchBatchShapeIsOneTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, qm := range queryModes {
		var b pgx.Batch
		b.Queue(`SELECT set_config('enable_bitmapscan', 'off', true), set_config('jit', 'off', true), set_config('plan_cache_mode', 'force_custom_plan', true)`)
		b.Queue(`SELECT current_setting('enable_bitmapscan') || '/' || current_setting('jit') || '/' || current_setting('plan_cache_mode'), $1::int`, 1)
		c, err := testPool(t).Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		br := c.Conn().SendBatch(ctx, &b)
		if _, err := br.Exec(); err != nil {
			t.Fatal(err)
		}
		var got string
		var one int
		if err := br.QueryRow().Scan(&got, &one); err != nil {
			t.Fatal(err)
		}
		if err := br.Close(); err != nil {
			t.Fatal(err)
		}
		c.Release()
		if got != "off/off/force_custom_plan" {
			t.Fatalf("mode %v: the read's statement sees %s, want off/off/force_custom_plan", qm, got)
		}
	}
}

// A take-over that commits while the old holder's mark waits on the lease
// row (FOR SHARE): the mark re-reads the row, changes nothing and returns
// ErrLeaseLost (the count of changed rows and the lease check after it,
// on every layout).
func TestOutboxMarkConcurrentTakeOverEveryLayout(t *testing.T) {
	t.Parallel()
	outboxLayouts(t, func(t *testing.T, s *pgstore.Store, src *pgstore.OutboxSource) {
		ctx := context.Background()
		ks := keysOf(t, s, 2, 2)
		writeOutboxTx(t, s, nil, outbox.Message{ID: "x1", Topic: "t", Key: ks[0]}, outbox.Message{ID: "x2", Topic: "t", Key: ks[1]})
		old, ok, err := src.Acquire(ctx, "old", 2, time.Hour)
		if err != nil || !ok {
			t.Fatalf("Acquire = %v, %v", ok, err)
		}
		batch, err := src.Fetch(ctx, old, 100, false)
		if err != nil || len(batch) != 2 {
			t.Fatalf("Fetch = %+v, %v", batch, err)
		}
		ob := s.Tables().Outbox
		leases := ob[:len(ob)-1] + `_leases"`
		tx, err := s.Pool().Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, `UPDATE `+leases+` SET owner = 'heir', epoch = epoch + 1 WHERE part = 2`); err != nil {
			t.Fatal(err)
		}
		var txPid int32
		if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&txPid); err != nil {
			t.Fatal(err)
		}
		errc := make(chan error, 1)
		go func() { errc <- src.Mark(ctx, old, seqsOf(batch)) }()
		for waiting := false; !waiting; {
			select {
			case err := <-errc:
				t.Fatalf("old holder's Mark = %v before the take-over committed, want it to wait for the lease row", err)
			default:
			}
			if err := testPool(t).QueryRow(ctx, `SELECT count(*) > 0 FROM pg_locks WHERE NOT granted AND $1 = ANY(pg_blocking_pids(pid))`, txPid).Scan(&waiting); err != nil {
				t.Fatal(err)
			}
			if !waiting {
				time.Sleep(5 * time.Millisecond)
			}
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if err := <-errc; !errors.Is(err, outbox.ErrLeaseLost) {
			t.Fatalf("old holder's Mark = %v, want ErrLeaseLost", err)
		}
		for _, m := range batch {
			if !inLine(t, s, m.Seq) {
				t.Fatalf("the fenced mark changed row %d", m.Seq)
			}
		}
	})
}
