package pgstore_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
)

// partitioned opens a store on hourly partitions with 3h created ahead.
func partitioned(t testing.TB) *pgstore.Store {
	t.Helper()
	return openStore(t, pgstore.WithPartitions(time.Hour), pgstore.WithPartitionsAhead(3*time.Hour))
}

// pastPartition attaches the partition for the hour that started ago
// hours before the current one, as EnsurePartitions would have when that
// hour was current, and returns its bare name.
func pastPartition(t testing.TB, s *pgstore.Store, ago int) string {
	t.Helper()
	var now time.Time
	if err := s.Pool().QueryRow(context.Background(), `SELECT statement_timestamp()`).Scan(&now); err != nil {
		t.Fatal(err)
	}
	start := now.UTC().Truncate(time.Hour).Add(-time.Duration(ago) * time.Hour)
	name := "dedup_rec_p_" + start.Format("20060102t15")
	q := s.Tables().Schema + `."` + name + `"`
	_, err := s.Pool().Exec(context.Background(), `CREATE TABLE `+q+` PARTITION OF `+s.Tables().RecordsPartitioned+
		` FOR VALUES FROM ('`+start.Format(time.RFC3339)+`') TO ('`+start.Add(time.Hour).Format(time.RFC3339)+`')`)
	if err != nil {
		t.Fatal(err)
	}
	return name
}

// seedPartition inserts n completed records into the partition of the
// hour ago hours back, expiring at expiry relative to now.
func seedPartition(t testing.TB, s *pgstore.Store, ago int, prefix string, n int, expiry time.Duration) {
	t.Helper()
	_, err := s.Pool().Exec(context.Background(), `INSERT INTO `+s.Tables().RecordsPartitioned+`
	(scope, id, state, token, fingerprint, result, deadline, attempts, created_at)
SELECT `+fn(s, "scope_id")+`($1), `+fn(s, "key_id")+`($2 || g), 2, '\x0102'::bytea, `+fn(s, "fp_digest")+`('sha256:aaaa'::bytea), 'old-result'::bytea,
	statement_timestamp() + $3::int8 * interval '1 microsecond', 1,
	date_trunc('hour', statement_timestamp()) - $4::int * interval '1 hour' + interval '1 minute'
FROM generate_series(0, $5::int - 1) g`, key("").Scope, prefix, expiry.Microseconds(), ago, n)
	if err != nil {
		t.Fatalf("seed partition: %v", err)
	}
}

func partitionNames(t testing.TB, s *pgstore.Store) []string {
	t.Helper()
	ps, err := s.Partitions(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, p := range ps {
		out = append(out, p.Name)
	}
	return out
}

// Migrate creates the current and coming partitions, once.
func TestPartitionsCreatedAhead(t *testing.T) {
	t.Parallel()
	s := partitioned(t)
	names := partitionNames(t, s)
	if len(names) != 4 { // the current hour and the 3 after it
		t.Fatalf("partitions after Migrate = %v, want 4", names)
	}
	created, err := s.EnsurePartitions(context.Background())
	if err != nil || len(created) != 0 {
		t.Fatalf("EnsurePartitions again = %v, %v; want nothing new", created, err)
	}
	if r, err := s.Migrate(context.Background()); err != nil || len(r.Applied)+len(r.PartitionsCreated) != 0 {
		t.Fatalf("Migrate again = %+v, %v", r, err)
	}
	plain := openStore(t)
	if _, err := plain.EnsurePartitions(context.Background()); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Fatalf("EnsurePartitions on a plain store: %v", err)
	}
}

// A partition whose records have all expired is dropped whole; one with a
// live record, and the current one, are kept; rows are never deleted one
// by one for it.
func TestPartitionDrop(t *testing.T) {
	t.Parallel()
	s := partitioned(t)
	ctx := context.Background()
	old := pastPartition(t, s, 3)
	mixed := pastPartition(t, s, 2)
	seedPartition(t, s, 3, "old-", 5000, -time.Minute)
	seedPartition(t, s, 2, "mixed-", 1000, -time.Minute)
	seedPartition(t, s, 2, "keep-", 1, time.Hour)
	seed(t, s, "current-", 10, time.Minute) // expired, in the current partition

	dropped, err := s.DropExpiredPartitions(ctx)
	if err != nil || len(dropped) != 1 || dropped[0] != old {
		t.Fatalf("DropExpiredPartitions = %v, %v; want only %s", dropped, err, old)
	}
	names := strings.Join(partitionNames(t, s), " ")
	if strings.Contains(names, old) || !strings.Contains(names, mixed) {
		t.Fatalf("partitions after the drop: %s", names)
	}
	if n := countPrefix(t, s, "old-"); n != 0 {
		t.Fatalf("%d rows of the dropped partition still visible", n)
	}
	if n := countPrefix(t, s, "current-"); n != 10 {
		t.Fatalf("the current partition lost rows: %d of 10", n)
	}
	mustClaim(t, s, "keep-0", fpA, time.Minute, dedup.Duplicate)

	// Once its last record expires, the partition goes too.
	if _, err := s.Pool().Exec(ctx, `UPDATE `+s.Tables().RecordsPartitioned+` SET deadline = statement_timestamp() - interval '1 second' WHERE id = 'keep-0'`); err != nil {
		t.Fatal(err)
	}
	r, err := s.Maintain(ctx, 1000, 0, 0)
	if err != nil || len(r.PartitionsDropped) != 1 || r.PartitionsDropped[0] != mixed || r.Deleted != 10 {
		t.Fatalf("Maintain = %+v, %v; want %s dropped and the 10 expired current rows deleted", r, err, mixed)
	}
}

// The drop waits at most the lock timeout for a transaction that holds
// the partition, then gives up until the next pass instead of queueing
// claims behind it.
func TestPartitionDropGivesWayToTransactions(t *testing.T) {
	t.Parallel()
	s := openStore(t, pgstore.WithPartitions(time.Hour), pgstore.WithMaintenanceLockTimeout(50*time.Millisecond))
	ctx := context.Background()
	old := pastPartition(t, s, 2)
	seedPartition(t, s, 2, "old-", 10, -time.Minute)
	tx, err := s.Pool().Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT count(*) FROM `+s.Tables().RecordsPartitioned); err != nil {
		t.Fatal(err)
	}
	dropped, err := s.DropExpiredPartitions(ctx)
	if err != nil || len(dropped) != 0 {
		t.Fatalf("drop while a transaction reads the table = %v, %v; want nothing dropped and no error", dropped, err)
	}
	tx.Rollback(ctx)
	if dropped, err := s.DropExpiredPartitions(ctx); err != nil || len(dropped) != 1 || dropped[0] != old {
		t.Fatalf("drop after the transaction ended = %v, %v", dropped, err)
	}
}

// (scope, id) stays unique across partitions: a live record in an old
// partition is a duplicate; an expired one is taken over and moves to the
// current partition, leaving the old one to drain.
func TestPartitionedKeyUniqueAcrossPartitions(t *testing.T) {
	t.Parallel()
	s := partitioned(t)
	ctx := context.Background()
	old := pastPartition(t, s, 5)
	seedPartition(t, s, 5, "live-", 1, time.Hour)
	seedPartition(t, s, 5, "gone-", 1, -time.Minute)
	d := mustClaim(t, s, "live-0", fpA, time.Minute, dedup.Duplicate)
	if string(d.Result) != "old-result" {
		t.Fatalf("duplicate from an old partition carries %q", d.Result)
	}
	mustClaim(t, s, "live-0", fpB, time.Minute, dedup.Mismatch)
	c := mustClaim(t, s, "gone-0", fpB, time.Minute, dedup.Acquired)
	if c.Attempt != 1 {
		t.Fatalf("claim over an expired record: attempt %d", c.Attempt)
	}
	inOld := queryInt(t, s.Pool(), `SELECT count(*) FROM `+s.Tables().Schema+`."`+old+`" WHERE id = 'gone-0'`)
	if inOld != 0 || countRecords(t, s, "gone-0") != 1 {
		t.Fatalf("the taken record stayed in the old partition (%d) or was duplicated (%d)", inOld, countRecords(t, s, "gone-0"))
	}
	// Many concurrent claims and batches of keys spread over partitions
	// never make two rows of one key.
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			reqs := []dedup.ClaimRequest{{Key: key("gone-0"), Fingerprint: fpB}, {Key: key("live-0"), Fingerprint: fpA}, {Key: key("fresh"), Fingerprint: fpA}}
			if w%2 == 0 {
				reqs[0], reqs[2] = reqs[2], reqs[0]
			}
			if _, err := s.ClaimBatch(ctx, reqs, time.Minute); err != nil {
				t.Errorf("ClaimBatch: %v", err)
			}
			if _, err := s.Claim(ctx, key("fresh"), fpA, time.Minute); err != nil {
				t.Errorf("Claim: %v", err)
			}
		}()
	}
	wg.Wait()
	for _, id := range []string{"gone-0", "live-0", "fresh"} {
		if n := countRecords(t, s, id); n != 1 {
			t.Fatalf("%d rows of %s", n, id)
		}
	}
}

// Claims keep working while partitions are dropped under them.
func TestPartitionDropUnderLoad(t *testing.T) {
	t.Parallel()
	s := partitioned(t)
	ctx := context.Background()
	for ago := 2; ago <= 6; ago++ {
		pastPartition(t, s, ago)
		seedPartition(t, s, ago, "p"+strconv.Itoa(ago)+"-", 2000, -time.Minute)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var claims [4]int
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				id := "w" + strconv.Itoa(w) + "-" + strconv.Itoa(i)
				c, err := s.Claim(ctx, key(id), fpA, time.Minute)
				if err != nil || c.Outcome != dedup.Acquired {
					t.Errorf("Claim(%s) during drops = %v, %v", id, c.Outcome, err)
					return
				}
				claims[w]++
			}
		}()
	}
	var dropped []string
	for len(dropped) < 5 {
		d, err := s.DropExpiredPartitions(ctx)
		if err != nil {
			t.Fatal(err)
		}
		dropped = append(dropped, d...)
	}
	close(stop)
	wg.Wait()
	t.Logf("dropped %d partitions of 2000 rows each while %v claims ran", len(dropped), claims)
}

// Outside READ COMMITTED the partitioned inbox refuses to run: its check
// after the key's lock could not see a record committed meanwhile.
func TestPartitionedNeedsReadCommitted(t *testing.T) {
	t.Parallel()
	s := partitioned(t)
	ctx := context.Background()
	tx, err := s.Pool().BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	ran := false
	_, err = s.Inbox(ctx, tx, key("m1"), fpA, day, func(context.Context, pgx.Tx) ([]byte, error) { ran = true; return nil, nil })
	if !dedup.IsStoreError(err) || !strings.Contains(err.Error(), "READ COMMITTED") || ran {
		t.Fatalf("Inbox under REPEATABLE READ = %v (handler ran: %v); want a store error naming READ COMMITTED", err, ran)
	}
	tx.Rollback(ctx)
	if countRecords(t, s, "m1") != 0 {
		t.Fatal("the refused inbox wrote a record")
	}
}
