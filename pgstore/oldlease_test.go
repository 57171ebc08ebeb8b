package pgstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
)

// An old in-progress record whose lease ran out is taken over after the
// migration with its attempt count carried (attempt + 1), and a claim
// with another fingerprint is a mismatch.
func TestOldLeaseTakenOverWithAttempts(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := v5Store(t, m)
		ctx := context.Background()
		oldRecords(t, s, 2)
		table := s.Tables().Schema + `."dedup_records"`
		if s.Partitioned() {
			table = s.Tables().Schema + `."dedup_records_p"`
		}
		if _, err := s.Pool().Exec(ctx, `INSERT INTO `+table+` (scope, id, state, token, fingerprint, result, lease_until, expires_at, attempts, created_at)
VALUES ($1, 'lapsed', 1, '\x07'::bytea, $2::bytea, NULL, statement_timestamp() - interval '1 minute', statement_timestamp() + interval '1 day', 2, statement_timestamp())`,
			key("").Scope, []byte(fpA)); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		mustClaim(t, s, "lapsed", "sha256:other", time.Minute, dedup.Mismatch)
		c := mustClaim(t, s, "lapsed", fpA, time.Minute, dedup.Acquired)
		if c.Attempt != 3 || !c.TakenOver {
			t.Fatalf("take-over of an old lease: attempt %d, taken over %v; want 3, true", c.Attempt, c.TakenOver)
		}
	})
}

// v5Store returns a store of mode m in a fresh schema migrated to version
// 5 only (the layout before the compact records), closed when t ends.
func v5Store(t *testing.T, m mode) *pgstore.Store {
	t.Helper()
	pool := testPool(t)
	s, err := pgstore.New(pool, append([]pgstore.Option{pgstore.WithSchema(freshSchema(t, pool))}, m.opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if _, err := pgstore.MigrateTo(context.Background(), s, 5); err != nil {
		t.Fatal(err)
	}
	return s
}
