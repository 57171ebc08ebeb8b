package pgstore_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
)

// The outbox partitioned by time: only an empty table is converted; the
// relay's reads, marks and writers work on it; a partition is dropped
// only once its range is over and every row in it was published more than
// the retention ago, so that no unpublished row (in line or quarantined)
// is ever deleted, whether by DropPublishedOutboxPartitions or by Prune.
func TestOutboxPartitionRetention(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := context.Background()
	ob := s.Tables().Outbox
	write := func(msgs ...outbox.Message) {
		t.Helper()
		if err := pgx.BeginFunc(ctx, s.Pool(), func(tx pgx.Tx) error { return s.WriteOutbox(ctx, tx, msgs...) }); err != nil {
			t.Fatal(err)
		}
	}
	write(outbox.Message{ID: "before", Topic: "t", Key: "k"})
	if err := s.PartitionOutbox(ctx, time.Hour); !errors.Is(err, pgstore.ErrOutboxNotEmpty) {
		t.Fatalf("PartitionOutbox of a table with rows = %v, want ErrOutboxNotEmpty", err)
	}
	if _, err := s.Pool().Exec(ctx, `DELETE FROM `+ob); err != nil {
		t.Fatal(err)
	}
	if err := s.PartitionOutbox(ctx, time.Second); err == nil {
		t.Fatal("a range of 1s was accepted")
	}
	if err := s.PartitionOutbox(ctx, time.Hour); err != nil {
		t.Fatal(err)
	}
	if err := s.PartitionOutbox(ctx, time.Hour); err != nil {
		t.Fatalf("second PartitionOutbox: %v", err)
	}
	if every, err := s.OutboxPartitioning(ctx); err != nil || every != time.Hour {
		t.Fatalf("OutboxPartitioning = %v, %v", every, err)
	}
	parts, err := s.OutboxPartitions(ctx)
	if err != nil || len(parts) < 4 {
		t.Fatalf("OutboxPartitions = %v, %v; want the current range and 3 ahead", parts, err)
	}

	// Writers, the NOTIFY trigger, the partition index and the relay's
	// read and mark on the partitioned table; the identity went on.
	src, err := s.OutboxSource(pgstore.WithOutboxPartitions(1))
	if err != nil {
		t.Fatal(err)
	}
	if err := src.CreateIndex(ctx); err != nil {
		t.Fatal(err)
	}
	var valid, trigger bool
	s.Pool().QueryRow(ctx, `SELECT (SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)),
	EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = to_regclass($2) AND NOT tgisinternal)`, s.Tables().Schema+".dedup_outbox_part1", ob).Scan(&valid, &trigger)
	if !valid || !trigger {
		t.Fatalf("partition index valid %v, notify trigger %v", valid, trigger)
	}
	write(outbox.Message{ID: "now", Topic: "t", Key: "k"})
	l, _, err := src.Acquire(ctx, "me", 0, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	got, err := src.Fetch(ctx, l, 10, false)
	if err != nil || len(got) != 1 || got[0].ID != "now" || got[0].Seq < 2 {
		t.Fatalf("Fetch = %+v, %v; want the new row with an id past the old table's", got, err)
	}
	if err := src.Mark(ctx, l, []int64{got[0].Seq}); err != nil {
		t.Fatal(err)
	}

	// Rows in ranges that are over, placed by hand.
	now := time.Now().UTC().Truncate(time.Hour)
	if _, err := pgstore.EnsureOutboxRanges(ctx, s, now.Add(-5*time.Hour), now.Add(-time.Hour)); err != nil {
		t.Fatal(err)
	}
	put := func(id string, created time.Time, published, quarantined string) {
		t.Helper()
		_, err := s.Pool().Exec(ctx, `INSERT INTO `+ob+` (message_key, topic, payload, created_at, published_at, quarantined_at)
VALUES ($1, 't', '', $2, statement_timestamp() - $3::interval, statement_timestamp() - $4::interval)`, id, created, nullIfEmpty(published), nullIfEmpty(quarantined))
		if err != nil {
			t.Fatal(err)
		}
	}
	put("p5-a", now.Add(-5*time.Hour+time.Minute), "3 hours", "")
	put("p5-b", now.Add(-5*time.Hour+2*time.Minute), "2 hours", "") // range -5h: all published long ago
	put("p4-done", now.Add(-4*time.Hour), "3 hours", "")
	put("p4-in-line", now.Add(-4*time.Hour+time.Minute), "", "") // range -4h: one in line
	put("p3-poison", now.Add(-3*time.Hour), "", "1 hour")        // range -3h: one quarantined
	put("p2-recent", now.Add(-2*time.Hour), "10 minutes", "")    // range -2h: published recently
	// range -1h: empty
	unpublished := func() []string {
		rows, _ := s.Pool().Query(ctx, `SELECT message_key FROM `+ob+` WHERE published_at IS NULL ORDER BY 1`)
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return ids
	}
	before := unpublished()
	name := func(d time.Duration) string { return "dedup_outbox_p_" + now.Add(d).Format("20060102t150405") }
	dropped, err := s.DropPublishedOutboxPartitions(ctx, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(dropped)
	if want := []string{name(-5 * time.Hour), name(-time.Hour)}; !slices.Equal(dropped, want) {
		t.Fatalf("dropped %v, want %v (all published over an hour ago, and empty)", dropped, want)
	}
	if after := unpublished(); !slices.Equal(after, before) || len(after) != 2 {
		t.Fatalf("unpublished rows %v after the drop, want %v", after, before)
	}
	// With the retention at 0 the recently published range goes too; the
	// ranges holding a row in line or quarantined stay. Through Prune,
	// whose batched delete then takes the published row of range -4h.
	n, err := src.Prune(ctx, 0, 100)
	if err != nil {
		t.Fatal(err)
	}
	if after := unpublished(); !slices.Equal(after, before) {
		t.Fatalf("unpublished rows %v after Prune, want %v", after, before)
	}
	parts, _ = s.OutboxPartitions(ctx)
	var left []string
	for _, p := range parts {
		if p.End.Before(now.Add(time.Second)) {
			left = append(left, p.Name)
		}
	}
	if want := []string{name(-4 * time.Hour), name(-3 * time.Hour)}; !slices.Equal(left, want) {
		t.Fatalf("ranges over that are left: %v, want %v", left, want)
	}
	var published int
	s.Pool().QueryRow(ctx, `SELECT count(*) FROM `+ob+` WHERE published_at IS NOT NULL`).Scan(&published)
	if n < 1 || published != 0 {
		t.Fatalf("Prune deleted %d rows, %d published rows left; want the published ones of the kept ranges deleted", n, published)
	}
}

func nullIfEmpty(s string) any {
	if s == "" {
		return nil
	}
	return s
}
