package pgstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
)

// After migration 0006 a binary of version 5 that still runs must not
// claim in the old tables: the key it looks for may have been moved to
// the compact table, where it is completed. Its claim (an insert into the
// old table) fails instead of acquiring the key again.
func TestOldBinaryRefusedAfterMigration(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := v5Store(t, m)
		ctx := context.Background()
		oldRecords(t, s, 4)
		if _, err := s.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		// The new binary moves the old completed key and replays it.
		c, err := s.Claim(ctx, key(oldID(1)), fpA, time.Minute)
		if err != nil || c.Outcome != dedup.Duplicate {
			t.Fatalf("new binary: %v, %v; want duplicate", c.Outcome, err)
		}
		table := s.Tables().Schema + `."dedup_records"`
		if s.Partitioned() {
			table = s.Tables().Schema + `."dedup_records_p"`
		}
		// The old binary's claim of the same key: an insert into the old table.
		tag, err := s.Pool().Exec(ctx, `INSERT INTO `+table+` (scope, id, state, token, fingerprint, result, lease_until, expires_at, attempts, created_at)
VALUES ($1, $2, 1, '\x09'::bytea, $3::bytea, NULL, statement_timestamp() + interval '1 minute', statement_timestamp() + interval '1 day', 1, statement_timestamp())`,
			key("").Scope, oldID(1), []byte(fpA))
		if err == nil {
			t.Fatalf("an old binary acquired a key the new table holds as completed (%s)", tag)
		}
	})
}
