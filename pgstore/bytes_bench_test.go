package pgstore_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/jackc/pgx/v5/pgxpool"
)

// BenchmarkBytesPerRow measures what a record costs on disk: it claims and
// completes rows keys through the store (ClaimBatch and CompleteBatch of
// 1000, each completion one batch behind its claim, as a consumer works),
// with message IDs that are UUIDs in text (36 bytes), a fingerprint of
// the payload as dedup.FingerprintOf makes it ("sha256:" and 64 hex
// digits) and an 8-byte result, and then reports the records table's heap
// (pg_table_size: heap, free space map, visibility map, TOAST) and index
// bytes (pg_indexes_size) per live row, as they are right after the last
// completion. Autovacuum runs as the server is configured; the benchmark
// logs whether it is on (the shared test server has it off; point
// DEDUP_POSTGRES_URL at a server with the defaults for the figure
// docs/benchmarks.md quotes).
//
// Beside it, in the same run and with the same keys, a compact prototype
// of the record that issue 20 asks for, filled by the equivalent raw
// statements: the scope as an integer, one deadline column (the lease end
// while in progress, the expiry once completed), the token as uuid, the
// message ID as uuid (the keys are UUIDs), no created_at, no index but
// the primary key (so a completion is a HOT update), fillfactor 60, and
// the fingerprint as its 32-byte digest instead of hex. It is
// not the store's schema: it says how far a redesign can go.
//
//	DEDUP_POSTGRES_URL=postgres://... go test -run '^$' -bench BytesPerRow -benchtime 1x ./pgstore/
//
// -short claims 100,000 keys instead of 1,000,000.
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
	proto := s.Tables().Schema + ".proto"
	if _, err := pool.Exec(ctx, `CREATE TABLE `+proto+` (
	until       timestamptz NOT NULL,
	scope       int4        NOT NULL,
	attempts    int4        NOT NULL,
	state       int2        NOT NULL,
	token       uuid        NOT NULL,
	id          uuid        NOT NULL,
	fingerprint bytea       NOT NULL,
	result      bytea,
	PRIMARY KEY (scope, id)) WITH (fillfactor = 60)`); err != nil {
		b.Fatal(err)
	}
	protoClaim := `INSERT INTO ` + proto + ` (until, scope, attempts, state, token, id, fingerprint)
SELECT now() + interval '30 seconds', 1, 1, 1, u.token, u.id, u.fp
FROM unnest($1::uuid[], $2::uuid[], $3::bytea[]) AS u(id, token, fp)
ON CONFLICT DO NOTHING`
	protoComplete := `UPDATE ` + proto + ` r SET until = now() + interval '1 day', state = 2, result = $3::bytea
FROM unnest($1::uuid[], $2::uuid[]) AS u(id, token)
WHERE r.scope = 1 AND r.id = u.id AND r.token = u.token`
	uuidText := func(u [16]byte) string {
		return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
	}
	result := []byte("12345678")
	for b.Loop() {
		var pending []dedup.Completion
		var pendingIDs, pendingToks [][16]byte
		start := time.Now()
		for done := 0; done < rows; done += batch {
			reqs := make([]dedup.ClaimRequest, batch)
			pids, ptoks, pfps := make([][16]byte, batch), make([][16]byte, batch), make([][]byte, batch)
			for i := range reqs {
				var id [16]byte
				for j := range id {
					id[j] = byte(rand.Uint32())
				}
				payload := id[:]
				fp := dedup.FingerprintOf(payload)
				digest := sha256.Sum256(payload)
				pids[i], ptoks[i], pfps[i] = id, dedup.NewToken(), digest[:]
				reqs[i] = dedup.ClaimRequest{Key: dedup.Key{Scope: benchScope, ID: uuidText(id)}, Fingerprint: fp}
			}
			cs, err := s.ClaimBatch(ctx, reqs, 30*time.Second)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := pool.Exec(ctx, protoClaim, pids, ptoks, pfps); err != nil {
				b.Fatal(err)
			}
			if pending != nil {
				if _, err := s.CompleteBatch(ctx, pending, time.Hour); err != nil {
					b.Fatal(err)
				}
				if _, err := pool.Exec(ctx, protoComplete, pendingIDs, pendingToks, result); err != nil {
					b.Fatal(err)
				}
			}
			pending = make([]dedup.Completion, batch)
			for i, c := range cs {
				pending[i] = dedup.Completion{Claim: c, Result: result}
			}
			pendingIDs, pendingToks = pids, ptoks
		}
		if _, err := s.CompleteBatch(ctx, pending, time.Hour); err != nil {
			b.Fatal(err)
		}
		if _, err := pool.Exec(ctx, protoComplete, pendingIDs, pendingToks, result); err != nil {
			b.Fatal(err)
		}
		b.Logf("%d claims and completes in %v", rows, time.Since(start).Round(time.Second))
	}
	for _, t := range []struct{ name, table string }{{"store", s.Tables().Records}, {"proto", proto}} {
		heap, index, live := tableBytes(b, pool, t.table)
		b.Logf("%s: %d live rows, heap %d B/row, indexes %d B/row", t.name, live, heap/live, index/live)
		b.ReportMetric(float64(heap+index)/float64(live), t.name+"-B/row")
		b.ReportMetric(float64(heap)/float64(live), t.name+"-heap-B/row")
		b.ReportMetric(float64(index)/float64(live), t.name+"-index-B/row")
	}
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
