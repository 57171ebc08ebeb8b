package pgstore_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// oldStore returns a store whose schema is migrated to version 5 only,
// with the layout of records before migration 0006, and the statements of
// that version rendered for it.
func oldStore(b *testing.B, pool *pgxpool.Pool) (schema string, claimBatch, completeBatch, claim string) {
	b.Helper()
	schema = freshSchema(b, pool)
	s, err := pgstore.New(pool, pgstore.WithSchema(schema))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { s.Close() })
	if _, err := pgstore.MigrateTo(context.Background(), s, 5); err != nil {
		b.Fatal(err)
	}
	r := func(q string) string { return strings.ReplaceAll(q, `"OLDSCHEMA"`, s.Tables().Schema) }
	return schema, r(oldSQLClaimBatch), r(oldSQLCompleteBatch), r(oldSQLClaim)
}

// oldBatch sends the version-5 ClaimBatch statement as that version's
// ClaimBatch did (keys in order, text arrays, batch-prefixed tokens, the
// fingerprint's text) and reads its rows; it returns the tokens.
func oldBatch(ctx context.Context, pool *pgxpool.Pool, q string, reqs []dedup.ClaimRequest) ([][]byte, error) {
	n := len(reqs)
	scopes, ids, toks, fps := make([]string, n), make([]string, n), make([][]byte, n), make([][]byte, n)
	prefix := dedup.NewToken()
	for i, r := range reqs {
		t := make([]byte, 16)
		copy(t, prefix[:8])
		t[15], t[14] = byte(i), byte(i>>8)
		scopes[i], ids[i], toks[i], fps[i] = r.Key.Scope, r.Key.ID, t, []byte(r.Fingerprint)
	}
	rows, err := pool.Query(ctx, q, scopes, ids, toks, fps, (30 * time.Second).Microseconds(), prefix[:8])
	if err != nil {
		return nil, err
	}
	var got int
	for rows.Next() {
		var scope, id *string
		var state int16
		var tok, fp, res []byte
		var attempts int32
		var lease, exp time.Time
		if err := rows.Scan(&scope, &id, &state, &tok, &attempts, &fp, &res, &lease, &exp); err != nil {
			rows.Close()
			return nil, err
		}
		if state == 0 {
			got += int(attempts)
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if got != n {
		return nil, fmt.Errorf("old claim batch acquired %d of %d", got, n)
	}
	return toks, nil
}

// BenchmarkBytesPerRow measures what a record costs on disk and what the
// store costs in claim throughput, in one process, on three tables: the
// store as it is (compact layout, WithVacuum's default runs), the same
// store with WithVacuum(0, 0) (today's: the code before those runs), and
// the layout before migration 0006 (schema version 5) filled by that
// version's statements (sent as version 5 sent them). It claims and
// completes rows keys (1,000,000; -short 100,000) through each, in batches
// of 1000, each completion one batch behind its claim as a consumer
// works, the three in an order that rotates from batch to batch, each
// timed alone. Message IDs are UUIDs in text (36 bytes), the fingerprint
// is dedup.FingerprintOf's ("sha256:" and 64 hex digits), the result 8
// bytes.
//
// Beside them, the floor: a table with the compact layout filled with
// the same completed records by one INSERT each (no claim, so no update
// and no dead version), fillfactor 100 and only the primary key: the
// smallest PostgreSQL table that holds the same facts (key, fingerprint,
// token, state, attempts, deadline, result).
//
// It reports each table's heap (pg_table_size) and index bytes
// (pg_indexes_size) per live row right after the last completion, and
// the claim and completion rates with their ratios; with the pgstattuple
// extension in the database, where the heap bytes go (live tuples, dead
// ones, free space).
// Autovacuum runs as the server is configured (point DEDUP_POSTGRES_URL
// at a server with the defaults; the shared test server has it off):
//
//	DEDUP_POSTGRES_URL=postgres://... go test -run '^$' -bench BytesPerRow -benchtime 1x ./pgstore/
func BenchmarkBytesPerRow(b *testing.B) {
	rows := 1_000_000
	if testing.Short() {
		rows = 100_000
	}
	const batch = 1000
	s, _ := benchStore(b)
	pool := s.Pool()
	ctx := context.Background()
	var autovacuum string
	if err := pool.QueryRow(ctx, `SHOW autovacuum`).Scan(&autovacuum); err != nil {
		b.Fatal(err)
	}
	b.Logf("autovacuum = %s", autovacuum)
	// DEDUP_FILLFACTOR tries another fillfactor on the store's table (the
	// measurement that chose the migration's).
	if ff := os.Getenv("DEDUP_FILLFACTOR"); ff != "" {
		if _, err := pool.Exec(ctx, `ALTER TABLE `+s.Tables().Records+` SET (fillfactor = `+strconv.Itoa(atoi(b, ff))+`)`); err != nil {
			b.Fatal(err)
		}
		b.Logf("fillfactor = %s", ff)
	}
	// DEDUP_RELOPTIONS sets other storage parameters on the store's table
	// (for example "autovacuum_vacuum_scale_factor = 0.02"), to measure
	// what they change.
	if ro := os.Getenv("DEDUP_RELOPTIONS"); ro != "" {
		if _, err := pool.Exec(ctx, `ALTER TABLE `+s.Tables().Records+` SET (`+ro+`)`); err != nil {
			b.Fatal(err)
		}
		b.Logf("reloptions: %s", ro)
	}
	// Today's: the same store without WithVacuum's runs (the code before
	// it), in a schema of its own on the same pool and server.
	s0 := openStoreOn(b, pool, freshSchema(b, pool), pgstore.WithVacuum(0, 0))
	oldSchema, oldClaim, oldComplete, _ := oldStore(b, pool)
	floor := s.Tables().Schema + ".floor"
	if _, err := pool.Exec(ctx, `CREATE TABLE `+floor+` (LIKE `+s.Tables().Records+` INCLUDING ALL) WITH (fillfactor = 100)`); err != nil {
		b.Fatal(err)
	}
	var scope int32
	if err := pool.QueryRow(ctx, `SELECT `+fn(s, "scope_id")+`($1)`, benchScope).Scan(&scope); err != nil {
		b.Fatal(err)
	}
	floorInsert := `INSERT INTO ` + floor + ` (deadline, scope, attempts, state, token, id, fingerprint, result)
SELECT now() + interval '1 hour', $1::int4, 1, 2, u.token, u.id, u.fp, $4::bytea
FROM unnest($2::bytea[], $3::bytea[], $5::bytea[]) AS u(id, token, fp)`
	uuidText := func() string {
		var u [16]byte
		for j := range u {
			u[j] = byte(rand.Uint32())
		}
		return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
	}
	result := []byte("12345678")
	// newKeys returns a batch of new keys: the requests, and the stored
	// IDs, tokens and fingerprints of the floor's completed records.
	newKeys := func() (reqs []dedup.ClaimRequest, ids, toks, fps [][]byte) {
		reqs = make([]dedup.ClaimRequest, batch)
		ids, toks, fps = make([][]byte, batch), make([][]byte, batch), make([][]byte, batch)
		for i := range reqs {
			id := uuidText()
			fp := dedup.FingerprintOf([]byte(id))
			t := dedup.NewToken()
			reqs[i] = dedup.ClaimRequest{Key: dedup.Key{Scope: benchScope, ID: id}, Fingerprint: fp}
			ids[i], toks[i], fps[i] = pgstore.EncodeID(id), t[:], pgstore.FingerprintDigest(fp)
		}
		return reqs, ids, toks, fps
	}
	var took [6]time.Duration // claims: new, old, today's; completions: the same
	timed := func(i int, f func() error) {
		start := time.Now()
		err := f()
		took[i] += time.Since(start)
		if err != nil {
			b.Fatal(err)
		}
	}
	for b.Loop() {
		var pending, pending0 []dedup.Completion
		var oldPending []dedup.ClaimRequest
		var oldToks [][]byte
		start := time.Now()
		for round := 0; round*batch < rows; round++ {
			reqs, ids, toks, fps := newKeys()
			// The old statement needs its keys in order, as its
			// ClaimBatch sorted them.
			sorted := append([]dedup.ClaimRequest(nil), reqs...)
			sortReqs(sorted)
			var cs, cs0 []dedup.Claim
			var newToks [][]byte
			claims := []func(){
				func() {
					timed(0, func() error {
						var err error
						cs, err = s.ClaimBatch(ctx, reqs, 30*time.Second)
						return err
					})
				},
				func() {
					timed(1, func() error {
						var err error
						newToks, err = oldBatch(ctx, pool, oldClaim, sorted)
						return err
					})
				},
				func() {
					timed(2, func() error {
						var err error
						cs0, err = s0.ClaimBatch(ctx, reqs, 30*time.Second)
						return err
					})
				},
			}
			for k := range claims {
				claims[(round+k)%len(claims)]()
			}
			if _, err := pool.Exec(ctx, floorInsert, scope, ids, toks, result, fps); err != nil {
				b.Fatal(err)
			}
			if pending != nil {
				completes := []func(){
					func() {
						timed(3, func() error { _, err := s.CompleteBatch(ctx, pending, time.Hour); return err })
					},
					func() {
						timed(4, func() error { return oldCompleteBatch(ctx, pool, oldComplete, oldPending, oldToks, result) })
					},
					func() {
						timed(5, func() error { _, err := s0.CompleteBatch(ctx, pending0, time.Hour); return err })
					},
				}
				for k := range completes {
					completes[(round+k)%len(completes)]()
				}
			}
			pending, pending0 = make([]dedup.Completion, batch), make([]dedup.Completion, batch)
			for i := range cs {
				pending[i] = dedup.Completion{Claim: cs[i], Result: result}
				pending0[i] = dedup.Completion{Claim: cs0[i], Result: result}
			}
			oldPending, oldToks = sorted, newToks
		}
		if _, err := s.CompleteBatch(ctx, pending, time.Hour); err != nil {
			b.Fatal(err)
		}
		if _, err := s0.CompleteBatch(ctx, pending0, time.Hour); err != nil {
			b.Fatal(err)
		}
		if err := oldCompleteBatch(ctx, pool, oldComplete, oldPending, oldToks, result); err != nil {
			b.Fatal(err)
		}
		b.Logf("%d claims and completes on each layout in %v", rows, time.Since(start).Round(time.Second))
	}
	pgstore.WaitVacuum(s) // a run the last completions started
	b.Logf("compact: %d VACUUMs run by the store", pgstore.VacuumRuns(s))
	oldTable := pgx.Identifier{oldSchema, "dedup_records"}.Sanitize()
	for _, t := range []struct{ name, table string }{{"compact", s.Tables().Records}, {"today", s0.Tables().Records}, {"v5", oldTable}, {"floor", floor}} {
		heap, index, live := tableBytes(b, pool, t.table)
		b.Logf("%s: %d live rows, heap %d B/row, indexes %d B/row, total %d B/row", t.name, live, heap/live, index/live, (heap+index)/live)
		b.ReportMetric(float64(heap+index)/float64(live), t.name+"-B/row")
		b.ReportMetric(float64(heap)/float64(live), t.name+"-heap-B/row")
		b.ReportMetric(float64(index)/float64(live), t.name+"-index-B/row")
	}
	breakdown(b, pool, "compact", s.Tables().Records)
	breakdown(b, pool, "today", s0.Tables().Records)
	breakdown(b, pool, "floor", floor)
	b.Logf("compact: %d autovacuums during the run", autovacuums(b, pool, s.Tables().Records))
	// DEDUP_SETTLE=1 goes on after the figures above, to show what the
	// table settles at once autovacuum has been (in a long-running store
	// the dead versions of the last minute are a small part of the
	// records kept): it waits for the next autovacuum of the store's
	// table (at most 3 minutes), reports the sizes, then claims and
	// completes another tenth of the keys the same way (and fills the
	// floor with them), so that the space vacuum freed is used again, and
	// reports the sizes once more.
	if os.Getenv("DEDUP_SETTLE") != "" {
		n0 := autovacuums(b, pool, s.Tables().Records)
		wait := time.Now()
		for autovacuums(b, pool, s.Tables().Records) == n0 && time.Since(wait) < 3*time.Minute {
			time.Sleep(time.Second)
		}
		b.Logf("waited %v for an autovacuum (%d now)", time.Since(wait).Round(time.Second), autovacuums(b, pool, s.Tables().Records))
		heap, index, live := tableBytes(b, pool, s.Tables().Records)
		b.Logf("compact after autovacuum: %d live rows, heap %d B/row, indexes %d B/row, total %d B/row", live, heap/live, index/live, (heap+index)/live)
		b.ReportMetric(float64(heap+index)/float64(live), "vacuumed-B/row")
		var pending []dedup.Completion
		for round := 0; round*batch < rows/10; round++ {
			reqs, ids, toks, fps := newKeys()
			cs, err := s.ClaimBatch(ctx, reqs, 30*time.Second)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := pool.Exec(ctx, floorInsert, scope, ids, toks, result, fps); err != nil {
				b.Fatal(err)
			}
			if pending != nil {
				if _, err := s.CompleteBatch(ctx, pending, time.Hour); err != nil {
					b.Fatal(err)
				}
			}
			pending = make([]dedup.Completion, batch)
			for i, c := range cs {
				pending[i] = dedup.Completion{Claim: c, Result: result}
			}
		}
		if _, err := s.CompleteBatch(ctx, pending, time.Hour); err != nil {
			b.Fatal(err)
		}
		for _, t := range []struct{ name, table string }{{"compact", s.Tables().Records}, {"floor", floor}} {
			heap, index, live := tableBytes(b, pool, t.table)
			b.Logf("%s after another %d: %d live rows, heap %d B/row, indexes %d B/row, total %d B/row", t.name, rows/10, live, heap/live, index/live, (heap+index)/live)
			b.ReportMetric(float64(heap+index)/float64(live), t.name+"-settled-B/row")
		}
		breakdown(b, pool, "compact settled", s.Tables().Records)
	}
	rate := func(i int) float64 { return float64(rows) / took[i].Seconds() }
	b.ReportMetric(rate(0), "claim-ids/s")
	b.ReportMetric(rate(1), "v5-claim-ids/s")
	b.ReportMetric(rate(2), "today-claim-ids/s")
	b.ReportMetric(rate(0)/rate(1), "claim/v5")
	b.ReportMetric(rate(0)/rate(2), "claim/today")
	b.ReportMetric(rate(3), "complete-ids/s")
	b.ReportMetric(rate(4), "v5-complete-ids/s")
	b.ReportMetric(rate(5), "today-complete-ids/s")
	b.ReportMetric(rate(3)/rate(4), "complete/v5")
	b.ReportMetric(rate(3)/rate(5), "complete/today")
}

// oldCompleteBatch sends the version-5 CompleteBatch statement for the
// sorted requests and their tokens.
func oldCompleteBatch(ctx context.Context, pool *pgxpool.Pool, q string, reqs []dedup.ClaimRequest, toks [][]byte, result []byte) error {
	n := len(reqs)
	scopes, ids, results := make([]string, n), make([]string, n), make([][]byte, n)
	for i, r := range reqs {
		scopes[i], ids[i], results[i] = r.Key.Scope, r.Key.ID, result
	}
	var completed int64
	var lost []int64
	if err := pool.QueryRow(ctx, q, scopes, ids, toks, results, time.Hour.Microseconds()).Scan(&completed, &lost); err != nil {
		return err
	}
	if completed != int64(n) {
		return fmt.Errorf("old complete batch completed %d of %d", completed, n)
	}
	return nil
}

func sortReqs(r []dedup.ClaimRequest) {
	slices.SortFunc(r, func(a, b dedup.ClaimRequest) int {
		if c := strings.Compare(a.Key.Scope, b.Key.Scope); c != 0 {
			return c
		}
		return strings.Compare(a.Key.ID, b.Key.ID)
	})
}

func atoi(b *testing.B, s string) int {
	n, err := strconv.Atoi(s)
	if err != nil {
		b.Fatal(err)
	}
	return n
}

// tableBytes returns a table's heap and index sizes and its row count.
func tableBytes(b *testing.B, pool *pgxpool.Pool, table string) (heap, index, rows int64) {
	b.Helper()
	err := pool.QueryRow(context.Background(), `SELECT pg_table_size($1::regclass), pg_indexes_size($1::regclass), (SELECT count(*) FROM `+table+`)`, table).
		Scan(&heap, &index, &rows)
	if err != nil {
		b.Fatal(err)
	}
	if rows == 0 {
		b.Fatalf("%s is empty", table)
	}
	return heap, index, rows
}

// BenchmarkClaimVsV5 compares one Store.Claim of a new key on the compact
// layout with the version-5 claim statement (sent as version 5 sent it:
// the scope and ID as text, the fingerprint's text) on a schema migrated
// to version 5, alternating the two on every op from one goroutine, each
// timed alone, and reports both rates and their ratio.
//
//	go test -run '^$' -bench ClaimVsV5 -benchtime 5000x -count 5 ./pgstore/
func BenchmarkClaimVsV5(b *testing.B) {
	s, _ := benchStore(b)
	pool := s.Pool()
	ctx := context.Background()
	_, _, _, oldClaim := oldStore(b, pool)
	g := newIDs()
	var took [2]time.Duration
	round := 0
	step := func() {
		id, oldID := g.next(), g.next()
		cases := []func() error{
			func() error {
				c, err := s.Claim(ctx, dedup.Key{Scope: benchScope, ID: id}, fpA, 30*time.Second)
				if err == nil && c.Outcome != dedup.Acquired {
					err = fmt.Errorf("claim %v", c.Outcome)
				}
				return err
			},
			func() error {
				tok := dedup.NewToken()
				var state int16
				var t, fp, res []byte
				var attempts int32
				var lease, exp time.Time
				return pool.QueryRow(ctx, oldClaim, benchScope, oldID, tok[:], []byte(fpA), (30*time.Second).Microseconds()).
					Scan(&state, &t, &attempts, &fp, &res, &lease, &exp)
			},
		}
		for k := range cases {
			i := (k + round) % 2
			start := time.Now()
			err := cases[i]()
			took[i] += time.Since(start)
			if err != nil {
				b.Fatal(err)
			}
		}
		round++
	}
	for range 20 {
		step()
	}
	took, round = [2]time.Duration{}, 0
	for b.Loop() {
		step()
	}
	rate := func(i int) float64 { return float64(round) / took[i].Seconds() }
	b.ReportMetric(rate(0), "claims/s")
	b.ReportMetric(rate(1), "v5-claims/s")
	b.ReportMetric(rate(0)/rate(1), "claim/v5")
}

// autovacuums returns how many times autovacuum has vacuumed table.
func autovacuums(b *testing.B, pool *pgxpool.Pool, table string) int64 {
	b.Helper()
	var n int64
	if err := pool.QueryRow(context.Background(), `SELECT coalesce((SELECT autovacuum_count FROM pg_stat_user_tables WHERE relid = $1::regclass), 0)`, table).Scan(&n); err != nil {
		b.Fatal(err)
	}
	return n
}

// breakdown logs where a table's heap bytes go, per live row (live
// tuples, dead tuples, free space), when the server has the pgstattuple
// extension; it logs nothing otherwise.
func breakdown(b *testing.B, pool *pgxpool.Pool, name, table string) {
	b.Helper()
	ctx := context.Background()
	var live, liveBytes, dead, deadBytes, free int64
	err := pool.QueryRow(ctx, `SELECT tuple_count, tuple_len, dead_tuple_count, dead_tuple_len, free_space FROM pgstattuple($1::regclass)`, table).
		Scan(&live, &liveBytes, &dead, &deadBytes, &free)
	if err != nil {
		b.Logf("%s: no breakdown (%v)", name, err)
		return
	}
	if live == 0 {
		return
	}
	b.Logf("%s heap per live row: live tuples %d B, dead tuples %d B (%d dead versions), free space %d B", name, liveBytes/live, deadBytes/live, dead, free/live)
}
