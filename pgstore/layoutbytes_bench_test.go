package pgstore_test

import (
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
)

// BenchmarkBytesPerRowLayouts measures the bytes a completed record takes
// in each layout, plain and time-partitioned (issue 21's capacity model):
// rows keys (100,000, or DEDUP_BYTES_ROWS) with UUID IDs and
// dedup.FingerprintOf fingerprints are claimed and completed through the
// store's ClaimBatch and CompleteBatch in batches of 1000, as a consumer
// works, then the heap and index bytes of every table holding records
// (each partition of the partitioned layout) are divided by the rows.
// Sizes are taken right after the last completion, so they include the
// dead versions autovacuum has not reclaimed yet (the shared test server
// runs with autovacuum off: there that is all of them).
//
//	go test -run '^$' -bench BytesPerRowLayouts -benchtime 1x ./pgstore/
func BenchmarkBytesPerRowLayouts(b *testing.B) {
	rows := 100_000
	if v := os.Getenv("DEDUP_BYTES_ROWS"); v != "" {
		rows = atoi(b, v)
	}
	for _, layout := range []struct {
		name string
		opts []pgstore.Option
	}{
		{"plain", nil},
		{"partitioned", []pgstore.Option{pgstore.WithPartitions(24 * time.Hour)}},
	} {
		b.Run(layout.name, func(b *testing.B) {
			for range b.N {
				s, _ := benchStore(b, layout.opts...)
				heap, index := fillAndMeasure(b, s, rows)
				b.ReportMetric(float64(heap)/float64(rows), "heap-B/row")
				b.ReportMetric(float64(index)/float64(rows), "index-B/row")
				b.ReportMetric(float64(heap+index)/float64(rows), "B/row")
			}
		})
	}
}

// fillAndMeasure claims and completes rows new keys on s and returns the
// heap and index bytes of the tables that hold its records.
func fillAndMeasure(b *testing.B, s *pgstore.Store, rows int) (heap, index int64) {
	b.Helper()
	ctx := context.Background()
	const batch = 1000
	result := []byte("ok-12345")
	for done := 0; done < rows; done += batch {
		reqs := make([]dedup.ClaimRequest, min(batch, rows-done))
		for i := range reqs {
			id := newUUID()
			reqs[i] = dedup.ClaimRequest{Key: dedup.Key{Scope: benchScope, ID: id}, Fingerprint: dedup.FingerprintOf([]byte(id))}
		}
		claims, err := s.ClaimBatch(ctx, reqs, time.Minute)
		if err != nil {
			b.Fatal(err)
		}
		items := make([]dedup.Completion, len(claims))
		for i, c := range claims {
			if c.Outcome != dedup.Acquired {
				b.Fatalf("claim %d: %v", i, c.Outcome)
			}
			items[i] = dedup.Completion{Claim: c, Result: result}
		}
		errs, err := s.CompleteBatch(ctx, items, 24*time.Hour)
		if err != nil {
			b.Fatal(err)
		}
		for i, e := range errs {
			if e != nil {
				b.Fatalf("complete %d: %v", i, e)
			}
		}
	}
	// The records table and every table of its partition tree (none for
	// the plain table; a partitioned parent holds no bytes itself).
	table := s.Tables().Records
	if s.Partitioned() {
		table = s.Tables().RecordsPartitioned
	}
	err := s.Pool().QueryRow(ctx, `SELECT coalesce(sum(pg_table_size(relid)), 0), coalesce(sum(pg_indexes_size(relid)), 0)
		FROM (SELECT $1::regclass AS relid UNION SELECT relid FROM pg_partition_tree($1::regclass)) t`, table).Scan(&heap, &index)
	if err != nil {
		b.Fatal(err)
	}
	var n int
	if err := s.Pool().QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&n); err != nil {
		b.Fatal(err)
	}
	if n != rows {
		b.Fatalf("%d rows in %s, want %d", n, table, rows)
	}
	return heap, index
}

// newUUID returns a random version 4 UUID in its canonical text form.
func newUUID() string {
	var u [16]byte
	rand.Read(u[:])
	u[6] = u[6]&0x0f | 0x40
	u[8] = u[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}
