package sqlitestore

import (
	"context"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/dedupkit/dedup"
)

// SchemaVersion is the layout of the records table this package writes.
//
//   - Version 1 (before 2026-11-24): scope and fingerprint as text (a
//     SHA-256 fingerprint as 71 characters of "sha256:" and hex), separate
//     lease_until and expires_at columns, and a created_at column nothing
//     read.
//   - Version 2: the scope as a small integer from the "<table>_scopes"
//     table, the fingerprint as its 32-byte digest (a fingerprint that is
//     not FingerprintOf's "sha256:" form is kept as text, an empty one as
//     NULL), and one deadline column: the lease's end while in progress,
//     the expiry once completed (an in-progress record is swept
//     [InProgressGrace] after its lease, a time derived from it).
//
// [Open] converts a version 1 table in place, in batches of
// [MigrateBatch] records, each batch one short transaction; see
// [Store.Open] for what that means for processes still running the old
// code.
const SchemaVersion = 2

// MigrateBatch is how many records one transaction of the conversion from
// an older layout moves.
const MigrateBatch = 1000

// table names of one store.
type tables struct {
	records, scopes, schema, old, deadlineIndex string // quoted
}

func tableNames(t string) tables {
	q := func(s string) string { return `"` + s + `"` }
	return tables{records: q(t), scopes: q(t + "_scopes"), schema: q(t + "_schema"),
		old: q(t + "_v1"), deadlineIndex: q(t + "_deadline")}
}

// layout is what a table of the records' name holds.
type layout int

const (
	layoutAbsent layout = iota
	layoutV1
	layoutV2
	layoutForeign
)

// layoutOf reads the columns of table name (unquoted) through q.
func layoutOf(ctx context.Context, q interface {
	QueryContext(context.Context, string, ...any) (*sql.Rows, error)
}, name string) (layout, error) {
	rows, err := q.QueryContext(ctx, `SELECT name FROM pragma_table_info(?1)`, name)
	if err != nil {
		return 0, err
	}
	defer rows.Close()
	var cols []string
	for rows.Next() {
		var c string
		if err := rows.Scan(&c); err != nil {
			return 0, err
		}
		cols = append(cols, c)
	}
	if err := rows.Err(); err != nil {
		return 0, err
	}
	got := strings.Join(cols, ",")
	switch got {
	case "":
		return layoutAbsent, nil
	case "scope,id,state,token,fingerprint,result,lease_until,expires_at,attempts,created_at":
		return layoutV1, nil
	case "scope_id,id,state,token,fp,result,deadline,attempts":
		return layoutV2, nil
	}
	return layoutForeign, nil
}

// createV2 creates the version 2 objects that are missing.
func createV2(ctx context.Context, tx *sql.Tx, t tables) error {
	for _, q := range []string{
		`CREATE TABLE IF NOT EXISTS ` + t.scopes + ` (
	id   INTEGER PRIMARY KEY,
	name TEXT    NOT NULL UNIQUE
) STRICT`,
		`CREATE TABLE IF NOT EXISTS ` + t.records + ` (
	scope_id INTEGER NOT NULL,         -- ` + t.scopes + `.id
	id       TEXT    NOT NULL,
	state    INTEGER NOT NULL,         -- 1 in progress, 2 completed
	token    BLOB    NOT NULL,         -- owner token, 16 bytes
	fp       ANY,                      -- NULL: none; BLOB: SHA-256 digest; TEXT: another fingerprint
	result   BLOB,
	deadline INTEGER NOT NULL,         -- unix ns: lease end in progress, expiry completed
	attempts INTEGER NOT NULL,
	PRIMARY KEY (scope_id, id)
) STRICT, WITHOUT ROWID`,
		`CREATE INDEX IF NOT EXISTS ` + t.deadlineIndex + ` ON ` + t.records + ` (deadline)`,
		`CREATE TABLE IF NOT EXISTS ` + t.schema + ` (version INTEGER NOT NULL) STRICT`,
	} {
		if _, err := tx.ExecContext(ctx, q); err != nil {
			return err
		}
	}
	return nil
}

// migrate brings the records table to version 2: it creates it, or renames
// a version 1 table aside, creates the new one and moves the records over
// in batches, then records the version. Every step can be repeated: a
// conversion interrupted by a crash goes on at the next Open.
func (s *Store) migrate(ctx context.Context) error {
	t := tableNames(s.table)
	var version int
	if err := s.db.QueryRowContext(ctx, `SELECT version FROM `+t.schema).Scan(&version); err == nil && version >= SchemaVersion {
		l, err := layoutOf(ctx, s.db, s.table)
		if err != nil {
			return err
		}
		if l != layoutV2 {
			return fmt.Errorf("table %s is not a dedup records table (its schema says version %d)", t.records, version)
		}
		return nil
	}
	// Set up, in one transaction that holds the write lock (BEGIN
	// IMMEDIATE), so that two processes opening at once agree.
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	l, err := layoutOf(ctx, tx, s.table)
	if err != nil {
		return err
	}
	switch l {
	case layoutForeign:
		return fmt.Errorf("table %s exists with another layout (not a dedup records table)", t.records)
	case layoutV1:
		if old, err := layoutOf(ctx, tx, s.table+"_v1"); err != nil {
			return err
		} else if old != layoutAbsent {
			return fmt.Errorf("cannot convert table %s: %s exists already", t.records, t.old)
		}
		if _, err := tx.ExecContext(ctx, `ALTER TABLE `+t.records+` RENAME TO `+t.old); err != nil {
			return err
		}
	}
	if err := createV2(ctx, tx, t); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return err
	}
	if old, err := layoutOf(ctx, s.db, s.table+"_v1"); err != nil {
		return err
	} else if old == layoutV1 {
		if _, err := s.moveV1(ctx, t, MigrateBatch); err != nil {
			return fmt.Errorf("convert the records of %s: %w", t.old, err)
		}
	}
	tx, err = s.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, `DROP TABLE IF EXISTS `+t.old); err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, `DELETE FROM `+t.schema); err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+t.schema+` (version) VALUES (?1)`, SchemaVersion); err != nil {
		return err
	}
	return tx.Commit()
}

// moveV1 moves the records of the renamed version 1 table into the new
// one, batch at a time, each batch one transaction, and returns how many
// it moved. A record already in the new table (none should be) keeps the
// new one. The fingerprint is converted in SQL: FingerprintOf's form
// ("sha256:" and 64 lowercase hex digits) becomes its 32-byte digest,
// an empty one NULL, anything else stays text, as encodeFingerprint does.
func (s *Store) moveV1(ctx context.Context, t tables, batch int) (int, error) {
	const pick = `(SELECT * FROM %s ORDER BY scope, id LIMIT ?1)`
	batchOf := fmt.Sprintf(pick, t.old)
	scopes := `INSERT INTO ` + t.scopes + ` (name) SELECT DISTINCT scope FROM ` + batchOf + ` WHERE true
ON CONFLICT (name) DO NOTHING`
	move := `INSERT INTO ` + t.records + ` (scope_id, id, state, token, fp, result, deadline, attempts)
SELECT sc.id, o.id, o.state, o.token,
	CASE
		WHEN o.fingerprint = '' THEN NULL
		WHEN length(o.fingerprint) = 71 AND substr(o.fingerprint, 1, 7) = 'sha256:'
			AND substr(o.fingerprint, 8) NOT GLOB '*[^0-9a-f]*' THEN unhex(substr(o.fingerprint, 8))
		ELSE o.fingerprint
	END,
	o.result,
	CASE WHEN o.state = 1 THEN o.lease_until ELSE o.expires_at END,
	o.attempts
FROM ` + batchOf + ` AS o JOIN ` + t.scopes + ` AS sc ON sc.name = o.scope
WHERE true
ON CONFLICT (scope_id, id) DO NOTHING`
	del := `DELETE FROM ` + t.old + ` WHERE (scope, id) IN (SELECT scope, id FROM ` + t.old + ` ORDER BY scope, id LIMIT ?1)`
	total := 0
	for {
		n, err := func() (int64, error) {
			tx, err := s.db.BeginTx(ctx, nil)
			if err != nil {
				return 0, err
			}
			defer tx.Rollback()
			// Another process opening the file at the same time may have
			// moved the last records and dropped the old table since we
			// looked: then the conversion is done.
			if l, err := layoutOf(ctx, tx, s.table+"_v1"); err != nil || l == layoutAbsent {
				return 0, err
			}
			for _, q := range []string{scopes, move} {
				if _, err := tx.ExecContext(ctx, q, batch); err != nil {
					return 0, err
				}
			}
			res, err := tx.ExecContext(ctx, del, batch)
			if err != nil {
				return 0, err
			}
			n, err := res.RowsAffected()
			if err != nil {
				return 0, err
			}
			return n, tx.Commit()
		}()
		total += int(n)
		if err != nil || n < int64(batch) {
			return total, err
		}
		// Let the other writers of the file in between batches.
		t := time.NewTimer(time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return total, ctx.Err()
		case <-t.C:
		}
	}
}

// encodeFingerprint returns fp as the fp column stores it: nil for none,
// the 32-byte digest of FingerprintOf's form, the text of any other.
// SQLite never finds a blob equal to a text, so two fingerprints are equal
// exactly when their encodings are.
func encodeFingerprint(fp dedup.Fingerprint) any {
	if fp == "" {
		return nil
	}
	if d, ok := sha256Digest(fp); ok {
		return d
	}
	return string(fp)
}

const sha256Prefix = "sha256:"

func sha256Digest(fp dedup.Fingerprint) ([]byte, bool) {
	if len(fp) != len(sha256Prefix)+64 || !strings.HasPrefix(string(fp), sha256Prefix) {
		return nil, false
	}
	hexPart := fp[len(sha256Prefix):]
	for i := 0; i < len(hexPart); i++ {
		if c := hexPart[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return nil, false // FingerprintOf writes lowercase: keep anything else as text
		}
	}
	d := make([]byte, 32)
	if _, err := hex.Decode(d, []byte(hexPart)); err != nil {
		return nil, false
	}
	return d, true
}

// decodeFingerprint turns the fp column's value back into a Fingerprint.
// When it is the encoding of the caller's own fp (the common answer), fp
// itself is returned, without building the string again.
func decodeFingerprint(v any, fp dedup.Fingerprint, enc any) (dedup.Fingerprint, error) {
	switch v := v.(type) {
	case nil:
		return "", nil
	case string:
		return dedup.Fingerprint(v), nil
	case []byte:
		if e, ok := enc.([]byte); ok && string(e) == string(v) {
			return fp, nil
		}
		if len(v) != 32 {
			return "", errors.New("fingerprint digest of " + fmt.Sprint(len(v)) + " bytes")
		}
		return dedup.Fingerprint(sha256Prefix + hex.EncodeToString(v)), nil
	}
	return "", fmt.Errorf("fingerprint of type %T", v)
}

// scopeIDs maps scope names to their ids in the scopes table. An id never
// changes once committed (scopes are never deleted), so it is cached for
// the store's life; an id learned inside a caller's transaction is not
// cached, since that transaction may roll back.
type scopeIDs struct {
	mu sync.RWMutex
	m  map[string]int64
}

func (c *scopeIDs) get(name string) (int64, bool) {
	c.mu.RLock()
	id, ok := c.m[name]
	c.mu.RUnlock()
	return id, ok
}

func (c *scopeIDs) put(name string, id int64) {
	c.mu.Lock()
	if c.m == nil {
		c.m = make(map[string]int64)
	}
	c.m[name] = id
	c.mu.Unlock()
}

// execQuerier is a *sql.DB or a *sql.Tx.
type execQuerier interface {
	ExecContext(context.Context, string, ...any) (sql.Result, error)
	QueryRowContext(context.Context, string, ...any) *sql.Row
}

// scopeID returns the id of scope, adding it to the scopes table first
// when create is set; found is false when it is absent and create is not
// set (then no record of that scope exists). With q == nil it works on the
// database (autocommit) and caches what it learns. With a caller's
// transaction q it first reads the committed id on another connection (a
// reader is never blocked by the transaction's write lock in WAL mode) and
// caches that; only a scope nobody committed yet is added inside q, and
// that id is not cached: the transaction may roll back.
func (s *Store) scopeID(ctx context.Context, q execQuerier, scope string, create bool) (id int64, found bool, err error) {
	if id, ok := s.scopes.get(scope); ok {
		return id, true, nil
	}
	t := tableNames(s.table)
	sel := `SELECT id FROM ` + t.scopes + ` WHERE name = ?1`
	read := func(q execQuerier) (int64, bool, error) {
		var id int64
		switch err := q.QueryRowContext(ctx, sel, scope).Scan(&id); {
		case errors.Is(err, sql.ErrNoRows):
			return 0, false, nil
		case err != nil:
			return 0, false, err
		}
		return id, true, nil
	}
	if id, found, err = read(s.db); err != nil || found {
		if found {
			s.scopes.put(scope, id)
		}
		return id, found, err
	}
	if !create {
		return 0, false, nil
	}
	cache := q == nil
	if cache {
		q = s.db
	}
	if _, err := q.ExecContext(ctx, `INSERT INTO `+t.scopes+` (name) VALUES (?1) ON CONFLICT (name) DO NOTHING`, scope); err != nil {
		return 0, false, err
	}
	if id, found, err = read(q); err != nil || !found {
		if err == nil {
			err = errors.New("scope " + scope + " vanished after it was added")
		}
		return 0, false, err
	}
	if cache {
		s.scopes.put(scope, id)
	}
	return id, true, nil
}
