package layered_test

import (
	"context"
	"database/sql"
	"fmt"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
	"math/rand/v2"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/layered"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/dedupkit/dedup/window"
)

// BenchmarkDuplicateStreamPostgres is the same stream through the
// PostgreSQL inbox, where a duplicate costs the durable store a whole
// transaction over the network.
// Run: go test -run XXX -bench DuplicateStreamPostgres -benchtime 2000x ./layered/
func BenchmarkDuplicateStreamPostgres(b *testing.B) {
	url := testenv.PostgresURL(b)
	ctx := context.Background()
	schema := fmt.Sprintf("bench_layered_%08x", rand.Uint32())
	s, err := pgstore.Open(ctx, url, pgstore.WithSchema(schema))
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		s.Pool().Exec(ctx, `DROP SCHEMA `+schema+` CASCADE`)
		s.Close()
	}()
	if _, err := s.Migrate(ctx); err != nil {
		b.Fatal(err)
	}
	if _, err := s.Pool().Exec(ctx, `CREATE TABLE `+schema+`.ledger (msg_id text NOT NULL)`); err != nil {
		b.Fatal(err)
	}
	insert := `INSERT INTO ` + schema + `.ledger (msg_id) VALUES ($1)`
	for _, withWindow := range []bool{false, true} {
		name := "store-only"
		if withWindow {
			name = "window+store"
		}
		b.Run(name, func(b *testing.B) {
			var lay *layered.Store
			if withWindow {
				w, _ := window.New()
				lay, _ = layered.New(layered.WithWindow(w))
			}
			prefix := fmt.Sprintf("%s-%08x-", name, rand.Uint32())
			run := 0
			for b.Loop() {
				id := prefix + strconv.Itoa(run/2)
				run++
				key := dedup.Key{Scope: "bench", ID: id}
				durable := func(ctx context.Context) (dedup.Claim, error) {
					return s.RunInbox(ctx, key, "", time.Hour, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
						_, err := tx.Exec(ctx, insert, id)
						return nil, err
					})
				}
				var c dedup.Claim
				if lay != nil {
					c, err = lay.RunInbox(ctx, key, "", time.Hour, durable)
				} else {
					c, err = durable(ctx)
				}
				if err != nil || (c.Outcome != dedup.Acquired && c.Outcome != dedup.Duplicate) {
					b.Fatal(c.Outcome, err)
				}
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "deliveries/s")
		})
	}
}

// BenchmarkDuplicateStream: a stream in which every message arrives twice
// in a row (50% duplicates, a crashed batch redelivered), through the
// durable SQLite inbox alone and with a window in front. One op is one
// delivery. Run: go test -run XXX -bench DuplicateStream -benchtime 4000x ./layered/
func BenchmarkDuplicateStream(b *testing.B) {
	for _, withWindow := range []bool{false, true} {
		name := "store-only"
		if withWindow {
			name = "window+store"
		}
		b.Run(name, func(b *testing.B) {
			s, err := sqlitestore.Open(filepath.Join(b.TempDir(), "bench.db"))
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			if _, err := s.DB().Exec(`CREATE TABLE ledger (msg_id TEXT NOT NULL)`); err != nil {
				b.Fatal(err)
			}
			var lay *layered.Store
			if withWindow {
				w, _ := window.New()
				lay, _ = layered.New(layered.WithWindow(w))
			}
			ctx := context.Background()
			run := 0
			for b.Loop() {
				id := strconv.Itoa(run / 2)
				run++
				key := dedup.Key{Scope: "bench", ID: id}
				durable := func(ctx context.Context) (dedup.Claim, error) {
					return s.RunInbox(ctx, key, "", time.Hour, func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
						_, err := tx.ExecContext(ctx, `INSERT INTO ledger (msg_id) VALUES (?)`, id)
						return nil, err
					})
				}
				var c dedup.Claim
				if lay != nil {
					c, err = lay.RunInbox(ctx, key, "", time.Hour, durable)
				} else {
					c, err = durable(ctx)
				}
				if err != nil || (c.Outcome != dedup.Acquired && c.Outcome != dedup.Duplicate) {
					b.Fatal(c.Outcome, err)
				}
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "deliveries/s")
		})
	}
}
