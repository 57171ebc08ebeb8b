package sqlitestore_test

import (
	"context"
	"database/sql"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/sqlitestore"
)

// benchStore opens a store with the default options (synchronous FULL) on
// a new file, with a ledger table for the business write.
func benchStore(b *testing.B) *sqlitestore.Store {
	b.Helper()
	s, err := sqlitestore.Open(filepath.Join(b.TempDir(), "bench.db"))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { s.Close() })
	if _, err := s.DB().Exec(`CREATE TABLE ledger (msg_id TEXT PRIMARY KEY)`); err != nil {
		b.Fatal(err)
	}
	return s
}

// parallelism is the number of goroutines per CPU in the parallel
// benchmarks: enough writers to contend for SQLite's one write lock even on
// a small machine.
const parallelism = 4

func reportRate(b *testing.B) {
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
}

// BenchmarkClaimComplete claims and completes a new key per operation: two
// autocommit statements, two commits.
func BenchmarkClaimComplete(b *testing.B) {
	fp := dedup.FingerprintOf([]byte("payload"))
	result := []byte("ok")
	run := func(s *sqlitestore.Store, id string) error {
		ctx := context.Background()
		c, err := s.Claim(ctx, dedup.Key{Scope: "bench", ID: id}, fp, time.Minute)
		if err != nil {
			return err
		}
		return s.Complete(ctx, c, result, time.Hour)
	}
	b.Run("serial", func(b *testing.B) {
		s := benchStore(b)
		b.ReportAllocs()
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			if err := run(s, strconv.Itoa(i)); err != nil {
				b.Fatal(err)
			}
		}
		reportRate(b)
	})
	b.Run("parallel", func(b *testing.B) {
		s := benchStore(b)
		var next atomic.Int64
		b.SetParallelism(parallelism)
		b.ReportAllocs()
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if err := run(s, strconv.FormatInt(next.Add(1), 10)); err != nil {
					b.Error(err)
					return
				}
			}
		})
		reportRate(b)
	})
}

// BenchmarkInbox applies new messages through the transactional inbox,
// batch messages per transaction: each message is one record upsert plus
// one business insert, and each transaction one commit.
func BenchmarkInbox(b *testing.B) {
	fp := dedup.FingerprintOf([]byte("payload"))
	for _, batch := range []int{1, 100} {
		b.Run("batch="+strconv.Itoa(batch), func(b *testing.B) {
			s := benchStore(b)
			ctx := context.Background()
			ids := make([]string, b.N)
			for i := range ids {
				ids[i] = "msg-" + strconv.Itoa(i)
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; {
				tx, err := s.DB().BeginTx(ctx, nil)
				if err != nil {
					b.Fatal(err)
				}
				for end := min(i+batch, b.N); i < end; i++ {
					id := ids[i]
					c, err := s.Inbox(ctx, tx, dedup.Key{Scope: "bench", ID: id}, fp, time.Hour, func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
						_, err := tx.ExecContext(ctx, `INSERT INTO ledger (msg_id) VALUES (?)`, id)
						return nil, err
					})
					if err != nil || c.Outcome != dedup.Acquired {
						b.Fatalf("Inbox = %v, %v", c.Outcome, err)
					}
				}
				if err := tx.Commit(); err != nil {
					b.Fatal(err)
				}
			}
			reportRate(b)
		})
	}
}

// BenchmarkNaiveCheckThenInsert is the usual wrong design, for comparison
// in the same run: SELECT whether the message was processed, then insert
// the business row and the processed marker, each statement in its own
// autocommit transaction. It is not even correct (two consumers can both
// pass the SELECT, and a crash between the inserts loses the marker).
func BenchmarkNaiveCheckThenInsert(b *testing.B) {
	setup := func(b *testing.B) *sql.DB {
		s := benchStore(b)
		db := s.DB()
		if _, err := db.Exec(`CREATE TABLE processed (msg_id TEXT PRIMARY KEY)`); err != nil {
			b.Fatal(err)
		}
		return db
	}
	naive := func(db *sql.DB, id string) error {
		var n int
		if err := db.QueryRow(`SELECT count(*) FROM processed WHERE msg_id = ?`, id).Scan(&n); err != nil || n > 0 {
			return err
		}
		if _, err := db.Exec(`INSERT INTO ledger (msg_id) VALUES (?)`, id); err != nil {
			return err
		}
		_, err := db.Exec(`INSERT INTO processed (msg_id) VALUES (?)`, id)
		return err
	}
	b.Run("serial", func(b *testing.B) {
		db := setup(b)
		b.ReportAllocs()
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			if err := naive(db, "msg-"+strconv.Itoa(i)); err != nil {
				b.Fatal(err)
			}
		}
		reportRate(b)
	})
	b.Run("parallel", func(b *testing.B) {
		db := setup(b)
		var next atomic.Int64
		b.SetParallelism(parallelism)
		b.ReportAllocs()
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if err := naive(db, "msg-"+strconv.FormatInt(next.Add(1), 10)); err != nil {
					b.Error(err)
					return
				}
			}
		})
		reportRate(b)
	})
}
