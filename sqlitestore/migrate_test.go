package sqlitestore_test

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/dedupkit/dedup/storetest"
)

// v1DDL is the records table as this package created it before schema
// version 2 (commit d7ec717 and earlier), with its index.
var v1DDL = []string{
	`CREATE TABLE "dedup_records" (
	scope       TEXT    NOT NULL,
	id          TEXT    NOT NULL,
	state       INTEGER NOT NULL,
	token       BLOB    NOT NULL,
	fingerprint TEXT    NOT NULL DEFAULT '',
	result      BLOB,
	lease_until INTEGER NOT NULL,
	expires_at  INTEGER NOT NULL,
	attempts    INTEGER NOT NULL,
	created_at  INTEGER NOT NULL,
	PRIMARY KEY (scope, id)
) STRICT, WITHOUT ROWID`,
	`CREATE INDEX "dedup_records_expires_at" ON "dedup_records" (expires_at)`,
}

// v1Record is one row as the version 1 code wrote it.
type v1Record struct {
	scope, id       string
	completed       bool
	fp              dedup.Fingerprint
	result          []byte
	leaseUntil, exp time.Time
	attempts        int
}

// openV1 creates a database file holding a version 1 records table.
func openV1(t testing.TB, path string) *sql.DB {
	t.Helper()
	db, err := sql.Open("sqlite", "file://"+path+"?_pragma=journal_mode(WAL)&_pragma=synchronous(OFF)")
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range v1DDL {
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	return db
}

// insertV1 writes records as the version 1 code did: in progress with
// expires_at = lease + InProgressGrace, completed with the expiry.
func insertV1(t testing.TB, db *sql.DB, recs []v1Record) {
	t.Helper()
	tx, err := db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	st, err := tx.Prepare(`INSERT INTO dedup_records VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		state, exp := 1, r.leaseUntil.Add(sqlitestore.InProgressGrace)
		if r.completed {
			state, exp = 2, r.exp
		}
		tok := dedup.NewToken()
		if _, err := st.Exec(r.scope, r.id, state, tok[:], string(r.fp), r.result,
			r.leaseUntil.UnixNano(), exp.UnixNano(), r.attempts, r.leaseUntil.Add(-time.Minute).UnixNano()); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
}

// TestMigrateV1: a version 1 database with records of every kind, more
// than two conversion batches of them, is converted when opened; every
// old record then answers as it did before (duplicates with their
// results, leases still held or taken over with the attempt count carried
// on, fingerprints still checked, expired ones acquirable), the old table
// is gone, and opening again changes nothing.
func TestMigrateV1(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "v1.db")
	clock := storetest.NewClock()
	now := clock.Now()
	db := openV1(t, path)
	fpA, fpB := dedup.FingerprintOf([]byte("a")), dedup.FingerprintOf([]byte("b"))
	recs := []v1Record{
		{scope: "s1", id: "done", completed: true, fp: fpA, result: []byte("r1"), leaseUntil: now, exp: now.Add(time.Hour), attempts: 1},
		{scope: "s1", id: "expired", completed: true, fp: fpA, leaseUntil: now.Add(-2 * time.Hour), exp: now.Add(-time.Hour), attempts: 1},
		{scope: "s1", id: "busy", fp: fpB, leaseUntil: now.Add(time.Minute), attempts: 1},
		{scope: "s1", id: "crashed", fp: fpB, leaseUntil: now.Add(-time.Minute), attempts: 2},
		{scope: "s2", id: "nofp", completed: true, leaseUntil: now, exp: now.Add(time.Hour), attempts: 1},
		{scope: "s2", id: "custom", completed: true, fp: "custom-fp", leaseUntil: now, exp: now.Add(time.Hour), attempts: 1},
		{scope: "s2", id: "upper", completed: true, fp: dedup.Fingerprint("sha256:" + fmt.Sprintf("%064X", 0xabcdef)), leaseUntil: now, exp: now.Add(time.Hour), attempts: 1},
	}
	const filler = 2*sqlitestore.MigrateBatch + 345
	for i := range filler {
		recs = append(recs, v1Record{scope: "bulk/" + strconv.Itoa(i%3), id: "m" + strconv.Itoa(i), completed: true,
			fp: dedup.FingerprintOf([]byte(strconv.Itoa(i))), result: []byte(strconv.Itoa(i)), leaseUntil: now, exp: now.Add(time.Hour), attempts: 1})
	}
	insertV1(t, db, recs)
	db.Close()

	s, err := sqlitestore.Open(path, sqlitestore.WithClock(clock))
	if err != nil {
		t.Fatalf("Open on a version 1 database: %v", err)
	}
	defer s.Close()
	claim := func(scope, id string, fp dedup.Fingerprint) dedup.Claim {
		t.Helper()
		c, err := s.Claim(ctx, dedup.Key{Scope: scope, ID: id}, fp, time.Minute)
		if err != nil {
			t.Fatalf("claim %s/%s: %v", scope, id, err)
		}
		return c
	}
	if c := claim("s1", "done", fpA); c.Outcome != dedup.Duplicate || string(c.Result) != "r1" || !c.ExpiresAt.Equal(now.Add(time.Hour)) {
		t.Errorf("completed record: %+v; want a duplicate with result r1 expiring in an hour", c)
	}
	if c := claim("s1", "done", fpB); c.Outcome != dedup.Mismatch {
		t.Errorf("completed record, another payload: %v; want a mismatch", c.Outcome)
	}
	if c := claim("s1", "busy", fpB); c.Outcome != dedup.InProgress || !c.LeaseUntil.Equal(now.Add(time.Minute)) {
		t.Errorf("live lease: %+v; want in progress until the old lease's end", c)
	}
	if c := claim("s1", "busy", fpA); c.Outcome != dedup.Mismatch {
		t.Errorf("live lease, another payload: %v; want a mismatch", c.Outcome)
	}
	if c := claim("s1", "crashed", fpA); c.Outcome != dedup.Mismatch {
		t.Errorf("expired lease, another payload: %v; want a mismatch", c.Outcome)
	}
	if c := claim("s1", "crashed", fpB); c.Outcome != dedup.Acquired || !c.TakenOver || c.Attempt != 3 {
		t.Errorf("expired lease: %+v; want taken over at attempt 3", c)
	}
	if c := claim("s1", "expired", fpB); c.Outcome != dedup.Acquired || c.Attempt != 1 {
		t.Errorf("expired record: %+v; want acquired afresh", c)
	}
	if c := claim("s2", "nofp", fpB); c.Outcome != dedup.Duplicate {
		t.Errorf("record without a fingerprint: %v; want a duplicate", c.Outcome)
	}
	if c := claim("s2", "custom", "custom-fp"); c.Outcome != dedup.Duplicate {
		t.Errorf("record with a non-SHA-256 fingerprint: %v; want a duplicate", c.Outcome)
	}
	if c := claim("s2", "custom", fpA); c.Outcome != dedup.Mismatch {
		t.Errorf("record with a non-SHA-256 fingerprint, another payload: %v; want a mismatch", c.Outcome)
	}
	upper := dedup.Fingerprint("sha256:" + fmt.Sprintf("%064X", 0xabcdef))
	if c := claim("s2", "upper", upper); c.Outcome != dedup.Duplicate {
		t.Errorf("record with an uppercase-hex fingerprint: %v; want a duplicate", c.Outcome)
	}
	if c := claim("s2", "upper", dedup.Fingerprint("sha256:"+fmt.Sprintf("%064x", 0xabcdef))); c.Outcome != dedup.Mismatch {
		t.Errorf("uppercase-hex fingerprint against its lowercase form: %v; want a mismatch (fingerprints compare byte for byte)", c.Outcome)
	}
	reqs := make([]dedup.ClaimRequest, filler)
	for i := range reqs {
		reqs[i] = dedup.ClaimRequest{Key: dedup.Key{Scope: "bulk/" + strconv.Itoa(i%3), ID: "m" + strconv.Itoa(i)},
			Fingerprint: dedup.FingerprintOf([]byte(strconv.Itoa(i)))}
	}
	cs, err := s.ClaimBatch(ctx, reqs, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	for i, c := range cs {
		if c.Outcome != dedup.Duplicate || string(c.Result) != strconv.Itoa(i) {
			t.Fatalf("converted record %d: %v %q; want a duplicate with its result", i, c.Outcome, c.Result)
		}
	}
	var n int
	if err := s.DB().QueryRow(`SELECT count(*) FROM sqlite_schema WHERE name = 'dedup_records_v1'`).Scan(&n); err != nil || n != 0 {
		t.Errorf("the old table is still there (%d, %v)", n, err)
	}
	var version int
	if err := s.DB().QueryRow(`SELECT version FROM dedup_records_schema`).Scan(&version); err != nil || version != sqlitestore.SchemaVersion {
		t.Errorf("schema version %d, %v; want %d", version, err, sqlitestore.SchemaVersion)
	}
	if err := s.DB().QueryRow(`SELECT count(*) FROM dedup_records`).Scan(&n); err != nil || n != len(recs) {
		t.Errorf("%d records after the conversion, %v; want %d", n, err, len(recs))
	}
	s.Close()
	s, err = sqlitestore.Open(path, sqlitestore.WithClock(clock))
	if err != nil {
		t.Fatalf("Open again: %v", err)
	}
	if c := claim("s1", "done", fpA); c.Outcome != dedup.Duplicate {
		t.Errorf("after reopening: %v; want a duplicate", c.Outcome)
	}
}

// TestMigrateInterrupted: a conversion cut off after some batches (the old
// table renamed aside and partly moved) goes on at the next Open, and no
// record is lost or doubled.
func TestMigrateInterrupted(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "cut.db")
	clock := storetest.NewClock()
	now := clock.Now()
	db := openV1(t, path)
	var recs []v1Record
	for i := range 1500 {
		recs = append(recs, v1Record{scope: "s", id: "m" + strconv.Itoa(i), completed: true,
			fp: dedup.FingerprintOf([]byte(strconv.Itoa(i))), leaseUntil: now, exp: now.Add(time.Hour), attempts: 1})
	}
	insertV1(t, db, recs)
	// What a conversion leaves when it stops after its first steps: the
	// old table renamed, the new one created with some records moved.
	s, err := sqlitestore.Open(filepath.Join(t.TempDir(), "template.db"))
	if err != nil {
		t.Fatal(err)
	}
	var ddl []string
	rows, err := s.DB().Query(`SELECT sql FROM sqlite_schema WHERE sql IS NOT NULL AND name NOT LIKE '%_outbox%' ORDER BY rowid`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var q string
		if err := rows.Scan(&q); err != nil {
			t.Fatal(err)
		}
		ddl = append(ddl, q)
	}
	rows.Close()
	s.Close()
	steps := []string{`ALTER TABLE dedup_records RENAME TO dedup_records_v1`}
	steps = append(steps, ddl...)
	steps = append(steps,
		`DELETE FROM dedup_records_schema`,
		`INSERT INTO dedup_records_scopes (name) VALUES ('s')`,
		`INSERT INTO dedup_records (scope_id, id, state, token, fp, result, deadline, attempts)
			SELECT 1, id, state, token, unhex(substr(fingerprint, 8)), result, expires_at, attempts
			FROM dedup_records_v1 ORDER BY scope, id LIMIT 400`,
		`DELETE FROM dedup_records_v1 WHERE id IN (SELECT id FROM dedup_records_v1 ORDER BY scope, id LIMIT 400)`)
	for _, q := range steps {
		if _, err := db.Exec(q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	db.Close()

	s, err = sqlitestore.Open(path, sqlitestore.WithClock(clock))
	if err != nil {
		t.Fatalf("Open after an interrupted conversion: %v", err)
	}
	defer s.Close()
	var n int
	if err := s.DB().QueryRow(`SELECT count(*) FROM dedup_records`).Scan(&n); err != nil || n != len(recs) {
		t.Fatalf("%d records, %v; want %d", n, err, len(recs))
	}
	reqs := make([]dedup.ClaimRequest, len(recs))
	for i := range reqs {
		reqs[i] = dedup.ClaimRequest{Key: dedup.Key{Scope: "s", ID: "m" + strconv.Itoa(i)}, Fingerprint: dedup.FingerprintOf([]byte(strconv.Itoa(i)))}
	}
	cs, err := s.ClaimBatch(ctx, reqs, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	for i, c := range cs {
		if c.Outcome != dedup.Duplicate {
			t.Fatalf("record %d: %v; want a duplicate", i, c.Outcome)
		}
	}
}

// recordBytes fills a fresh file with n completed records of a typical
// shape (a 24-byte scope, 36-byte UUID-like IDs, a SHA-256 fingerprint, a
// 2-byte result) in the layout given, checkpoints the WAL, and returns the
// file's bytes and the bytes of its pages in use, per record.
func recordBytes(t testing.TB, dir, layout string, n int) (file, used float64) {
	t.Helper()
	path := filepath.Join(dir, layout+".db")
	const scope = "payments/charge-consumer"
	id := func(i int) string {
		return fmt.Sprintf("%08x-%04x-4%03x-8%03x-%012x", i*2654435761, i&0xffff, i&0xfff, (i>>12)&0xfff, i*40503)
	}
	now := time.Now()
	var db *sql.DB
	switch layout {
	case "v1":
		db = openV1(t, path)
		recs := make([]v1Record, 0, 1000)
		for i := range n {
			recs = append(recs, v1Record{scope: scope, id: id(i), completed: true, fp: dedup.FingerprintOf([]byte(id(i))),
				result: []byte("ok"), leaseUntil: now, exp: now.Add(24 * time.Hour), attempts: 1})
			if len(recs) == cap(recs) || i == n-1 {
				insertV1(t, db, recs)
				recs = recs[:0]
			}
		}
	case "v2":
		s, err := sqlitestore.Open(path, sqlitestore.WithSynchronous(sqlitestore.SyncNormal))
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		ctx := context.Background()
		for i := 0; i < n; {
			tx, err := s.DB().BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			for end := min(i+1000, n); i < end; i++ {
				c, err := s.Inbox(ctx, tx, dedup.Key{Scope: scope, ID: id(i)}, dedup.FingerprintOf([]byte(id(i))), 24*time.Hour,
					func(context.Context, *sql.Tx) ([]byte, error) { return []byte("ok"), nil })
				if err != nil || c.Outcome != dedup.Acquired {
					t.Fatalf("inbox %d: %v %v", i, c.Outcome, err)
				}
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
		}
		db = s.DB()
	}
	if _, err := db.Exec(`PRAGMA wal_checkpoint(TRUNCATE)`); err != nil {
		t.Fatal(err)
	}
	var pages, free, size int64
	for q, dst := range map[string]*int64{"PRAGMA page_count": &pages, "PRAGMA freelist_count": &free, "PRAGMA page_size": &size} {
		if err := db.QueryRow(q).Scan(dst); err != nil {
			t.Fatal(err)
		}
	}
	if layout == "v1" {
		db.Close()
	}
	return float64(pages*size) / float64(n), float64((pages-free)*size) / float64(n)
}

// TestCompactRecords: the version 2 layout takes at most 3/4 of the bytes
// of version 1 for the same records (binary fingerprint, integer scope,
// one deadline instead of three times).
func TestCompactRecords(t *testing.T) {
	const n = 20_000
	dir := t.TempDir()
	v1, _ := recordBytes(t, dir, "v1", n)
	v2, _ := recordBytes(t, dir, "v2", n)
	t.Logf("file bytes per record: version 1 %.1f, version 2 %.1f (%.2fx)", v1, v2, v2/v1)
	if v2 > 0.75*v1 {
		t.Errorf("version 2 takes %.1f bytes a record against version 1's %.1f: want at most 3/4", v2, v1)
	}
}

// BenchmarkRecordBytes reports the file bytes per record of each layout
// after 100,000 completed records (the figure of docs/benchmarks.md), and
// the bytes in use after converting the version 1 file in place (its
// freed pages stay in the file until VACUUM).
func BenchmarkRecordBytes(b *testing.B) {
	const n = 100_000
	for range b.N {
		dir := b.TempDir()
		v1, _ := recordBytes(b, dir, "v1", n)
		v2, _ := recordBytes(b, dir, "v2", n)
		s, err := sqlitestore.Open(filepath.Join(dir, "v1.db"))
		if err != nil {
			b.Fatal(err)
		}
		var pages, free, size int64
		s.DB().Exec(`PRAGMA wal_checkpoint(TRUNCATE)`)
		for q, dst := range map[string]*int64{"PRAGMA page_count": &pages, "PRAGMA freelist_count": &free, "PRAGMA page_size": &size} {
			if err := s.DB().QueryRow(q).Scan(dst); err != nil {
				b.Fatal(err)
			}
		}
		s.Close()
		b.ReportMetric(v1, "v1-B/record")
		b.ReportMetric(v2, "v2-B/record")
		b.ReportMetric(float64((pages-free)*size)/n, "converted-used-B/record")
	}
}

// TestMigrateConcurrentOpens: processes that open one version 1 file at
// once all convert it together: every Open succeeds (none fails because
// another removed the emptied old table under it) and every record is
// kept once.
func TestMigrateConcurrentOpens(t *testing.T) {
	for round := range 6 {
		path := filepath.Join(t.TempDir(), "race"+strconv.Itoa(round)+".db")
		clock := storetest.NewClock()
		now := clock.Now()
		db := openV1(t, path)
		var recs []v1Record
		for i := range 2500 {
			recs = append(recs, v1Record{scope: "s", id: "m" + strconv.Itoa(i), completed: true,
				leaseUntil: now, exp: now.Add(time.Hour), attempts: 1})
		}
		insertV1(t, db, recs)
		db.Close()
		const opens = 4
		errs := make(chan error, opens)
		stores := make(chan *sqlitestore.Store, opens)
		for range opens {
			go func() {
				s, err := sqlitestore.Open(path, sqlitestore.WithClock(clock))
				errs <- err
				stores <- s
			}()
		}
		for range opens {
			if err := <-errs; err != nil {
				t.Errorf("round %d: Open during another's conversion: %v", round, err)
			}
			if s := <-stores; s != nil {
				var n int
				if err := s.DB().QueryRow(`SELECT count(*) FROM dedup_records`).Scan(&n); err != nil || n != len(recs) {
					t.Errorf("round %d: %d records, %v; want %d", round, n, err, len(recs))
				}
				s.Close()
			}
		}
	}
}
