package pgstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/dedupkit/dedup/pgstore"
)

// BenchmarkOutboxFetch is the relay's plain read alone: one partition's
// first 500 rows (200-byte payloads, no headers) of a 16-partition outbox
// of 20,000 rows, read again and again (nothing is marked), serially on
// one connection. It shows the read's cost a call on both sides (ns/op:
// the round trip with PostgreSQL's execution; B/op and allocs/op: the
// client's decoding), apart from BenchmarkRelay's noise.
func BenchmarkOutboxFetch(b *testing.B) {
	ctx := context.Background()
	pool := newPool(b, 1)
	s := openStoreOn(b, pool, freshSchema(b, pool))
	src, err := s.OutboxSource(pgstore.WithOutboxPartitions(16), pgstore.WithOutboxDeletePublished())
	if err != nil {
		b.Fatal(err)
	}
	if err := src.CreateIndex(ctx); err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+s.Tables().Outbox+` (message_key, aggregate, topic, payload)
SELECT 'evt-' || gen_random_uuid(), 'agg-' || (g % 1000), 'relay-bench', convert_to(repeat('x', 200), 'UTF8') FROM generate_series(1, 20000) g`); err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE `+s.Tables().Outbox); err != nil {
		b.Fatal(err)
	}
	l, ok, err := src.Acquire(ctx, "bench", 3, time.Hour)
	if err != nil || !ok {
		b.Fatalf("Acquire = %v, %v", ok, err)
	}
	b.ReportAllocs()
	for b.Loop() {
		msgs, err := src.Fetch(ctx, l, 500, false)
		if err != nil || len(msgs) != 500 {
			b.Fatalf("Fetch = %d messages, %v", len(msgs), err)
		}
	}
}
