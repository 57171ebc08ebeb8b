package pgstore_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
)

// Migrate creates every table once, records each version, and is a no-op
// the second time; Check then passes.
func TestMigrateIdempotent(t *testing.T) {
	t.Parallel()
	pool := testPool(t)
	schema := freshSchema(t, pool)
	s, err := pgstore.New(pool, pgstore.WithSchema(schema), pgstore.WithTablePrefix("app_"))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := s.Check(ctx); !errors.Is(err, pgstore.ErrNotMigrated) || !strings.Contains(err.Error(), "dedup migrate") {
		t.Fatalf("Check before Migrate = %v, want ErrNotMigrated saying how to migrate", err)
	}
	r, err := s.Migrate(ctx)
	if err != nil || len(r.Applied) != pgstore.SchemaVersion || r.Version != pgstore.SchemaVersion {
		t.Fatalf("first Migrate = %+v, %v", r, err)
	}
	r, err = s.Migrate(ctx)
	if err != nil || len(r.Applied) != 0 || r.Version != pgstore.SchemaVersion {
		t.Fatalf("second Migrate = %+v, %v; want nothing applied", r, err)
	}
	st, err := s.Check(ctx)
	if err != nil || st.Version != pgstore.SchemaVersion {
		t.Fatalf("Check = %+v, %v", st, err)
	}
	for _, table := range []string{"app_rec", "app_rec_p", "app_scopes", "app_retention", "app_outbox", "app_schema_migrations"} {
		if n := queryInt(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = $2`, schema, table); n != 1 {
			t.Errorf("table %s.%s missing", schema, table)
		}
	}
	// The empty tables of migrations 0001-0005 are gone, and the compact
	// table has no index but its primary key (a completion is a HOT
	// update).
	for _, table := range []string{"app_records", "app_records_p"} {
		if n := queryInt(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = $2`, schema, table); n != 0 {
			t.Errorf("empty old table %s.%s still there", schema, table)
		}
	}
	if n := queryInt(t, pool, `SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND tablename = 'app_rec'`, schema); n != 1 {
		t.Errorf("app_rec has %d indexes, want only its primary key", n)
	}
	// The store works on the prefixed tables.
	c, err := s.Claim(ctx, key("m1"), fpA, time.Minute)
	if err != nil || c.Outcome != dedup.Acquired {
		t.Fatalf("Claim on the prefixed tables = %v, %v", c.Outcome, err)
	}
}

// Instances starting together migrate once between them.
func TestMigrateConcurrent(t *testing.T) {
	t.Parallel()
	pool := testPool(t)
	schema := freshSchema(t, pool)
	var wg sync.WaitGroup
	applied := make([]int, 6)
	for i := range applied {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := pgstore.New(pool, pgstore.WithSchema(schema))
			if err != nil {
				t.Error(err)
				return
			}
			r, err := s.Migrate(context.Background())
			if err != nil {
				t.Errorf("concurrent Migrate: %v", err)
			}
			applied[i] = len(r.Applied)
		}()
	}
	wg.Wait()
	total := 0
	for _, n := range applied {
		total += n
	}
	if total != pgstore.SchemaVersion {
		t.Fatalf("migrations applied by 6 concurrent calls: %v, want %d in all", applied, pgstore.SchemaVersion)
	}
	if n := queryInt(t, pool, `SELECT count(*) FROM `+`"`+schema+`".dedup_schema_migrations`); n != pgstore.SchemaVersion {
		t.Fatalf("%d migration rows", n)
	}
}

// A migration edited after it was applied is refused, not papered over.
func TestMigrateRefusesEditedMigration(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	if _, err := s.Pool().Exec(context.Background(), `UPDATE `+s.Tables().Migrations+` SET checksum = 'edited' WHERE version = 1`); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Migrate(context.Background()); !dedup.IsStoreError(err) || !strings.Contains(err.Error(), "edited") {
		t.Fatalf("Migrate over an edited migration = %v", err)
	}
}

// Bad options are argument errors from New, before any I/O.
func TestOptions(t *testing.T) {
	t.Parallel()
	pool := testPool(t)
	for name, opt := range map[string]pgstore.Option{
		"empty schema":       pgstore.WithSchema(""),
		"quoted schema":      pgstore.WithSchema(`a"; DROP TABLE x; --`),
		"upper-case schema":  pgstore.WithSchema("Dedup"),
		"pg_ schema":         pgstore.WithSchema("pg_dedup"),
		"long prefix":        pgstore.WithTablePrefix(strings.Repeat("p", 43)),
		"prefix with dash":   pgstore.WithTablePrefix("a-b"),
		"digit first":        pgstore.WithTablePrefix("1x"),
		"zero grace":         pgstore.WithInProgressGrace(0),
		"partition 30m":      pgstore.WithPartitions(30 * time.Minute),
		"partition 90m":      pgstore.WithPartitions(90 * time.Minute),
		"ahead under 1":      pgstore.WithPartitionsAhead(time.Minute),
		"zero lock timeout":  pgstore.WithMaintenanceLockTimeout(0),
		"negative partition": pgstore.WithPartitions(-time.Hour),
	} {
		opts := []pgstore.Option{opt}
		if name == "ahead under 1" {
			opts = append(opts, pgstore.WithPartitions(time.Hour))
		}
		if _, err := pgstore.New(pool, opts...); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("%s: New = %v, want ErrInvalidArgument", name, err)
		}
	}
	if _, err := pgstore.New(nil); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("New(nil) = %v", err)
	}
	if _, err := pgstore.New(pool, pgstore.WithTablePrefix(""), pgstore.WithSchema("x_1")); err != nil {
		t.Errorf("empty prefix: %v", err)
	}
}

// A scope whose retention is shorter than its replay horizon is reported
// when it is set and at every start-up check, through the logger and the
// hook; a window that covers its horizon is not.
func TestRetentionWarnings(t *testing.T) {
	t.Parallel()
	var logs bytes.Buffer
	var mu sync.Mutex
	var hooked []pgstore.RetentionWarning
	opts := []pgstore.Option{
		pgstore.WithLogger(slog.New(slog.NewTextHandler(&logs, nil))),
		pgstore.WithRetentionWarningHook(func(_ context.Context, w pgstore.RetentionWarning) {
			mu.Lock()
			hooked = append(hooked, w)
			mu.Unlock()
		}),
	}
	s := openStore(t, opts...)
	ctx := context.Background()
	if err := s.SetRetention(ctx, "payments/capture", time.Hour, 24*time.Hour); err != nil {
		t.Fatal(err)
	}
	if err := s.SetRetention(ctx, "orders/transitions", 4*time.Hour, time.Hour); err != nil {
		t.Fatal(err)
	}
	if err := s.SetRetention(ctx, "analytics", 5*time.Minute, 0); err != nil {
		t.Fatal(err)
	}
	if len(hooked) != 1 || hooked[0].Scope != "payments/capture" || hooked[0].ReplayHorizon != 24*time.Hour {
		t.Fatalf("hook after SetRetention: %+v", hooked)
	}
	st, err := s.Check(ctx)
	if err != nil || len(st.Warnings) != 1 || st.Warnings[0].Scope != "payments/capture" || st.Warnings[0].Retention != time.Hour {
		t.Fatalf("Check = %+v, %v; want one warning for payments/capture", st, err)
	}
	if len(hooked) != 2 {
		t.Fatalf("hook calls after Check: %d, want 2", len(hooked))
	}
	out := logs.String()
	if strings.Count(out, "level=WARN") != 2 || !strings.Contains(out, "scope=payments/capture") || !strings.Contains(out, "replay_horizon=24h0m0s") ||
		strings.Contains(out, "orders/transitions") || strings.Contains(out, "analytics") {
		t.Fatalf("log:\n%s", out)
	}
	if !strings.Contains(st.Warnings[0].String(), "applied again") {
		t.Errorf("warning text %q does not say what goes wrong", st.Warnings[0])
	}
	ws, err := s.RetentionWindows(ctx)
	if err != nil || len(ws) != 3 || ws[0].Scope != "analytics" || ws[0].ReplayHorizon != 0 || ws[2].Retention != time.Hour {
		t.Fatalf("RetentionWindows = %+v, %v", ws, err)
	}
	for name, err := range map[string]error{
		"zero retention":   s.SetRetention(ctx, "x", 0, 0),
		"negative horizon": s.SetRetention(ctx, "x", time.Hour, -time.Hour),
		"bad scope":        s.SetRetention(ctx, "a\nb", time.Hour, 0),
	} {
		if !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("SetRetention with %s = %v", name, err)
		}
	}
}

// ClaimBatch sends a key repeated in the batch once; every later request
// reports what a claim right after the first would have seen.
func TestClaimBatchRepeatedKeys(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		ctx := context.Background()
		done := mustClaim(t, s, "done", fpA, time.Minute, dedup.Acquired)
		if err := s.Complete(ctx, done, []byte("r"), day); err != nil {
			t.Fatal(err)
		}
		mustClaim(t, s, "busy", fpA, time.Hour, dedup.Acquired)
		reqs := []dedup.ClaimRequest{
			{Key: key("new"), Fingerprint: fpA},
			{Key: key("done"), Fingerprint: fpA},
			{Key: key("busy"), Fingerprint: fpA},
			{Key: key("new"), Fingerprint: fpA},  // first acquired -> in progress
			{Key: key("new"), Fingerprint: fpB},  // first acquired, other payload -> mismatch
			{Key: key("new"), Fingerprint: ""},   // unchecked -> in progress
			{Key: key("done"), Fingerprint: fpA}, // first duplicate -> duplicate
			{Key: key("done"), Fingerprint: fpB}, // -> mismatch
			{Key: key("busy"), Fingerprint: fpA}, // first in progress -> in progress
			{Key: key("busy"), Fingerprint: fpB}, // -> mismatch
		}
		got, err := s.ClaimBatch(ctx, reqs, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		want := []dedup.Outcome{dedup.Acquired, dedup.Duplicate, dedup.InProgress, dedup.InProgress, dedup.Mismatch, dedup.InProgress,
			dedup.Duplicate, dedup.Mismatch, dedup.InProgress, dedup.Mismatch}
		for i, w := range want {
			if got[i].Outcome != w || got[i].Key != reqs[i].Key {
				t.Errorf("request %d (%s, %q) = %v, want %v", i, reqs[i].Key.ID, reqs[i].Fingerprint, got[i].Outcome, w)
			}
		}
		if got[3].LeaseUntil != got[0].LeaseUntil || got[3].Attempt != 1 || !got[3].Token.IsZero() {
			t.Errorf("repeat of an acquired key = %+v; want the first's lease, attempt 1, no token", got[3])
		}
		if string(got[6].Result) != "r" || &got[6].Result[0] == &got[1].Result[0] {
			t.Errorf("repeated duplicates must each carry their own copy of the result")
		}
		if n := countRecords(t, s, "new"); n != 1 {
			t.Fatalf("%d records of the repeated key", n)
		}
	})
}

// Large batches keep request order, and concurrent batches over the same
// keys in opposite orders neither deadlock nor acquire a key twice.
func TestClaimBatchConcurrentOverlapping(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		ctx := context.Background()
		const n = 1000
		reqs := make([]dedup.ClaimRequest, n)
		for i := range reqs {
			reqs[i] = dedup.ClaimRequest{Key: key(fmt.Sprintf("k%04d", i)), Fingerprint: fpA}
		}
		rev := make([]dedup.ClaimRequest, n)
		for i := range rev {
			rev[i] = reqs[n-1-i]
		}
		var wg sync.WaitGroup
		results := make([][]dedup.Claim, 8)
		for w := range results {
			wg.Add(1)
			go func() {
				defer wg.Done()
				in := reqs
				if w%2 == 1 {
					in = rev
				}
				cs, err := s.ClaimBatch(ctx, in, time.Minute)
				if err != nil {
					t.Errorf("ClaimBatch: %v", err)
					return
				}
				for i, c := range cs {
					if c.Key != in[i].Key {
						t.Errorf("batch answer %d is for %v, want %v", i, c.Key, in[i].Key)
						return
					}
				}
				results[w] = cs
			}()
		}
		wg.Wait()
		acquired := map[dedup.Key]int{}
		for _, cs := range results {
			for _, c := range cs {
				if c.Outcome == dedup.Acquired {
					acquired[c.Key]++
				} else if c.Outcome != dedup.InProgress {
					t.Fatalf("outcome %v for %v", c.Outcome, c.Key)
				}
			}
		}
		for _, r := range reqs {
			if acquired[r.Key] != 1 {
				t.Fatalf("%v acquired %d times by 8 batches, want once", r.Key, acquired[r.Key])
			}
		}
	})
}
