package pgstore_test

import (
	"bytes"
	"context"
	"crypto/md5"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
)

// The Go encoding of IDs and fingerprints agrees with the SQL functions
// that convert old records (key_id, key_text, the digest in adopt).
func TestKeyEncodingMatchesServer(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ids := []string{
		"0b4a3f4e-8c1d-4e55-9a7e-2f1c0d9e8b7a", // canonical UUID: 16 bytes
		"0B4A3F4E-8C1D-4E55-9A7E-2F1C0D9E8B7A", // not canonical: text
		"0b4a3f4e8c1d4e559a7e2f1c0d9e8b7a",     // no dashes: text
		"exactly-16-bytes",                     // 16 bytes of text: after a zero byte
		"m1", "ordre-été-✓", strings.Repeat("x", 200),
		"0b4a3f4e-8c1d-4e55-9a7e-2f1c0d9e8b7", "0b4a3f4e-8c1d-4e55-9a7e-2f1c0d9e8b7g",
	}
	for _, id := range ids {
		var enc []byte
		var back string
		if err := s.Pool().QueryRow(context.Background(), `SELECT `+fn(s, "key_id")+`($1), `+fn(s, "key_text")+`(`+fn(s, "key_id")+`($1))`, id).Scan(&enc, &back); err != nil {
			t.Fatal(err)
		}
		if got := pgstore.EncodeID(id); !bytes.Equal(got, enc) {
			t.Errorf("ID %q: Go stores %x, SQL %x", id, got, enc)
		}
		if back != id || pgstore.DecodeID(enc) != id {
			t.Errorf("ID %q: SQL reads back %q, Go %q", id, back, pgstore.DecodeID(enc))
		}
	}
	if n := len(pgstore.EncodeID(ids[0])); n != 16 {
		t.Errorf("a UUID takes %d bytes, want 16", n)
	}
	sum := dedup.FingerprintOf([]byte("payload"))
	for _, fp := range []dedup.Fingerprint{"", fpA, sum, dedup.Fingerprint(strings.ToUpper(string(sum))), sum + "0", sum[:70] + "g", "é" + sum[1:]} {
		var d []byte
		if err := s.Pool().QueryRow(context.Background(), `SELECT `+fn(s, "fp_digest")+`($1::bytea)`, []byte(fp)).Scan(&d); err != nil {
			t.Fatal(err)
		}
		if got := pgstore.FingerprintDigest(fp); !bytes.Equal(got, d) {
			t.Errorf("fingerprint %q: Go digest %x, SQL %x", fp, got, d)
		}
	}
}

// oldRecords seeds the tables of schema version 5 as the store of that
// version wrote them: completed records (half of them with UUIDs as IDs),
// records in progress under a live lease, and expired ones.
func oldRecords(t *testing.T, s *pgstore.Store, n int) {
	t.Helper()
	ctx := context.Background()
	table := s.Tables().Schema + `."dedup_records"`
	if s.Partitioned() {
		table = s.Tables().Schema + `."dedup_records_p"`
		var now time.Time
		if err := s.Pool().QueryRow(ctx, `SELECT statement_timestamp()`).Scan(&now); err != nil {
			t.Fatal(err)
		}
		// Old partitions: the previous hour, this one, the next.
		for h := -1; h <= 1; h++ {
			start := now.UTC().Truncate(time.Hour).Add(time.Duration(h) * time.Hour)
			_, err := s.Pool().Exec(ctx, `CREATE TABLE `+s.Tables().Schema+`."dedup_records_p_`+start.Format("20060102t15")+`" PARTITION OF `+table+
				` FOR VALUES FROM ('`+start.Format(time.RFC3339)+`') TO ('`+start.Add(time.Hour).Format(time.RFC3339)+`')`)
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, q := range []string{`SELECT $1::text, CASE WHEN g % 2 = 0 THEN md5(g::text)::uuid::text ELSE 'old-' || g END, 2, '\x0102'::bytea, $2::bytea, convert_to('result-' || g, 'UTF8'),
	statement_timestamp(), statement_timestamp() + interval '1 hour', 1, statement_timestamp() - interval '1 hour'
FROM generate_series(0, $3::int - 1) g`,
		`SELECT $1::text, 'held-' || g, 1, '\x0304'::bytea, $2::bytea, NULL,
	statement_timestamp() + interval '1 hour', statement_timestamp() + interval '25 hours', 2, statement_timestamp()
FROM generate_series(0, 9) g WHERE $3::int > 0`,
		`SELECT $1::text, 'gone-' || g, 2, '\x0506'::bytea, $2::bytea, NULL,
	statement_timestamp(), statement_timestamp() - interval '1 minute', 1, statement_timestamp()
FROM generate_series(0, 9) g WHERE $3::int > 0`,
	} {
		_, err := s.Pool().Exec(ctx, `INSERT INTO `+table+` (scope, id, state, token, fingerprint, result, lease_until, expires_at, attempts, created_at) `+q, key("").Scope, []byte(fpA), n)
		if err != nil {
			t.Fatalf("seed old records: %v", err)
		}
	}
}

func oldID(g int) string {
	if g%2 == 0 {
		return uuidOfMD5(g)
	}
	return fmt.Sprintf("old-%d", g)
}

// uuidOfMD5 is md5(g::text)::uuid::text, as oldRecords makes IDs.
func uuidOfMD5(g int) string {
	sum := fmt.Sprintf("%x", md5Sum(fmt.Sprint(g)))
	return sum[0:8] + "-" + sum[8:12] + "-" + sum[12:16] + "-" + sum[16:20] + "-" + sum[20:32]
}

// A store upgraded from schema version 5 reads and deduplicates the old
// records at once, while Convert moves them in batches under concurrent
// claims of old and new keys, and after it: no old completed key is ever
// acquired again, every old result is replayed, and the old tables are
// gone at the end.
func TestConvertOldRecordsOnline(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		pool := testPool(t)
		schema := freshSchema(t, pool)
		s, err := pgstore.New(pool, append([]pgstore.Option{pgstore.WithSchema(schema)}, m.opts...)...)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		ctx := context.Background()
		if _, err := pgstore.MigrateTo(ctx, s, 5); err != nil {
			t.Fatal(err)
		}
		const n = 600
		oldRecords(t, s, n)
		r, err := s.Migrate(ctx)
		if err != nil || len(r.Applied) != 4 || r.Applied[0] != "0006_compact_records" || r.Applied[3] != "0009_old_tables_read_only" {
			t.Fatalf("Migrate over version 5 = %+v, %v", r, err)
		}

		// Before the conversion, through the read-through.
		check := func(when string, g int) {
			c, err := s.Claim(ctx, key(oldID(g)), fpA, time.Minute)
			if err != nil || c.Outcome != dedup.Duplicate || string(c.Result) != fmt.Sprintf("result-%d", g) {
				t.Errorf("%s: old key %d: %v %q, %v; want a duplicate with its result", when, g, c.Outcome, c.Result, err)
			}
		}
		check("before", 0)
		check("before", 1)
		if c, err := s.Claim(ctx, key(oldID(2)), fpB, time.Minute); err != nil || c.Outcome != dedup.Mismatch {
			t.Errorf("old key with another fingerprint: %v, %v; want a mismatch", c.Outcome, err)
		}
		if c, err := s.Claim(ctx, key("held-0"), fpA, time.Minute); err != nil || c.Outcome != dedup.InProgress {
			t.Errorf("old key in progress: %v, %v", c.Outcome, err)
		}
		if c, err := s.Claim(ctx, key("gone-0"), fpA, time.Minute); err != nil || c.Outcome != dedup.Acquired || c.Attempt != 1 {
			t.Errorf("old expired key: %+v, %v; want acquired afresh", c, err)
		}

		// Claims of old and new keys while the conversion runs (and on
		// past its end, so that a fast conversion still meets some).
		var acquiredOld, dups, newKeys atomic.Int64
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for w := 0; w < 4; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; ; i++ {
					// At least 20 rounds each, whenever the conversion ends.
					if i >= 20 {
						select {
						case <-stop:
							return
						default:
						}
					}
					g := (i*7 + w*131) % n
					reqs := []dedup.ClaimRequest{{Key: key(oldID(g)), Fingerprint: fpA}, {Key: key(oldID((g + 1) % n)), Fingerprint: fpA},
						{Key: key(fmt.Sprintf("new-%d-%d", w, i)), Fingerprint: fpA}}
					var cs []dedup.Claim
					var err error
					if i%2 == 0 {
						cs, err = s.ClaimBatch(ctx, reqs, time.Minute)
					} else {
						var c dedup.Claim
						c, err = s.Claim(ctx, reqs[0].Key, fpA, time.Minute)
						cs = []dedup.Claim{c}
					}
					if err != nil {
						t.Errorf("claim during the conversion: %v", err)
						return
					}
					for j, c := range cs {
						switch {
						case j < 2 && c.Outcome == dedup.Duplicate:
							dups.Add(1)
						case j < 2:
							acquiredOld.Add(1)
						case c.Outcome == dedup.Acquired:
							newKeys.Add(1)
						}
					}
				}
			}()
		}
		var progress []pgstore.ConvertProgress
		res, err := s.Convert(ctx, pgstore.ConvertOptions{BatchSize: 50, OnProgress: func(p pgstore.ConvertProgress) { progress = append(progress, p) }})
		close(stop)
		wg.Wait()
		if err != nil {
			t.Fatalf("Convert: %v", err)
		}
		// 600 completed and 10 held records, less those the claims moved
		// first; the 10 expired ones (one of them claimed above) dropped.
		// The old table of the other layout was empty: migration 0006
		// dropped it.
		if res.Pending || len(res.Dropped) != 1 || res.Moved+res.Expired == 0 || res.Moved > n+10 {
			t.Fatalf("Convert = %+v", res)
		}
		if len(progress) == 0 || progress[len(progress)-1].Done != res.Moved+res.Expired {
			t.Fatalf("progress %+v does not add up to %+v", progress, res)
		}
		if acquiredOld.Load() != 0 || dups.Load() == 0 || newKeys.Load() == 0 {
			t.Fatalf("during the conversion: %d old completed keys acquired again (want 0), %d duplicates, %d new keys", acquiredOld.Load(), dups.Load(), newKeys.Load())
		}
		for _, tb := range []string{"dedup_records", "dedup_records_p"} {
			if k := queryInt(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename LIKE $2 || '%'`, schema, tb); k != 0 {
				t.Fatalf("%d old tables %s* left", k, tb)
			}
		}
		// After it: every old record, by Claim and by ClaimBatch.
		for g := 0; g < n; g += 3 {
			check("after", g)
		}
		reqs := make([]dedup.ClaimRequest, 0, n)
		for g := 0; g < n; g++ {
			reqs = append(reqs, dedup.ClaimRequest{Key: key(oldID(g)), Fingerprint: fpA})
		}
		cs, err := s.ClaimBatch(ctx, reqs, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		for g, c := range cs {
			if c.Outcome != dedup.Duplicate || string(c.Result) != fmt.Sprintf("result-%d", g) {
				t.Fatalf("batch after the conversion: old key %d: %v %q", g, c.Outcome, c.Result)
			}
		}
		if c, err := s.Claim(ctx, key("held-1"), fpA, time.Minute); err != nil || c.Outcome != dedup.InProgress {
			t.Errorf("old key in progress after the conversion: %v, %v", c.Outcome, err)
		}
		// Nothing more to do.
		if res, err := s.Convert(ctx, pgstore.ConvertOptions{}); err != nil || res.Moved != 0 || len(res.Dropped) != 0 || res.Pending {
			t.Fatalf("second Convert = %+v, %v", res, err)
		}
	})
}

func md5Sum(s string) [16]byte { return md5.Sum([]byte(s)) }
