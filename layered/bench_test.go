package layered_test

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/layered"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/dedupkit/dedup/window"
	"github.com/jackc/pgx/v5"
)

// inboxStep is one delivery of message id through a durable inbox whose
// handler writes one ledger row.
type inboxStep func(ctx context.Context, key dedup.Key, id string) (dedup.Claim, error)

// duplicateStream runs a stream in which every message arrives twice in a
// row (50% duplicates, a crashed batch redelivered) through the durable
// inbox alone and with an exact window in front. One op is one delivery.
func duplicateStream(b *testing.B, durable inboxStep) {
	for _, withWindow := range []bool{false, true} {
		name := "store-only"
		var lay *layered.Store
		if withWindow {
			name = "window+store"
			w, _ := window.New()
			lay, _ = layered.New(layered.WithWindow(w))
		}
		b.Run(name, func(b *testing.B) {
			ctx := context.Background()
			prefix := fmt.Sprintf("%s-%08x-", name, rand.Uint32())
			run := 0
			for b.Loop() {
				id := prefix + strconv.Itoa(run/2)
				run++
				key := dedup.Key{Scope: "bench", ID: id}
				step := func(ctx context.Context) (dedup.Claim, error) { return durable(ctx, key, id) }
				var c dedup.Claim
				var err error
				if lay != nil {
					c, err = lay.RunInbox(ctx, key, "", time.Hour, step)
				} else {
					c, err = step(ctx)
				}
				if err != nil || (c.Outcome != dedup.Acquired && c.Outcome != dedup.Duplicate) {
					b.Fatal(c.Outcome, err)
				}
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "deliveries/s")
		})
	}
}

// BenchmarkDuplicateStream: the SQLite inbox (synchronous=FULL).
// Run: go test -run XXX -bench DuplicateStream -benchtime 3000x ./layered/
func BenchmarkDuplicateStream(b *testing.B) {
	s, err := sqlitestore.Open(filepath.Join(b.TempDir(), "bench.db"))
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	if _, err := s.DB().Exec(`CREATE TABLE ledger (msg_id TEXT NOT NULL)`); err != nil {
		b.Fatal(err)
	}
	duplicateStream(b, func(ctx context.Context, key dedup.Key, id string) (dedup.Claim, error) {
		return s.RunInbox(ctx, key, "", time.Hour, func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
			_, err := tx.ExecContext(ctx, `INSERT INTO ledger (msg_id) VALUES (?)`, id)
			return nil, err
		})
	})
}

// BenchmarkDuplicateStreamPostgres: the PostgreSQL inbox, where a
// duplicate costs the durable store a whole transaction over the network.
func BenchmarkDuplicateStreamPostgres(b *testing.B) {
	ctx := context.Background()
	schema := fmt.Sprintf("bench_layered_%08x", rand.Uint32())
	s, err := pgstore.Open(ctx, testenv.PostgresURL(b), pgstore.WithSchema(schema))
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
	duplicateStream(b, func(ctx context.Context, key dedup.Key, id string) (dedup.Claim, error) {
		return s.RunInbox(ctx, key, "", time.Hour, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			_, err := tx.Exec(ctx, insert, id)
			return nil, err
		})
	})
}
