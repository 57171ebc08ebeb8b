package sqlitestore

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"hash/fnv"
	"math"
	"strings"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/outbox"
)

// The outbox in SQLite: <table>_outbox holds the messages written in the
// caller's transaction, <table>_outbox_leases the relays' partition
// leases. Rows are read in rowid order: SQLite has one writer at a time
// and a transaction takes its rowids while it holds the write lock, so a
// row committed later always has a higher rowid than every row committed
// before it (no transaction can commit a lower id late), and AUTOINCREMENT
// never reuses one.

func (s *Store) outboxTables() (ob, leases string) {
	return `"` + s.table + `_outbox"`, `"` + s.table + `_outbox_leases"`
}

// MigrateOutbox creates the outbox tables if they are missing, on a
// connection of the store's own (never in a caller's transaction). Call
// it once at start-up before [Store.WriteOutbox]; [Store.OutboxSource]
// calls it too.
func (s *Store) MigrateOutbox(ctx context.Context) error {
	if s.closed.Load() {
		return dedup.ErrClosed
	}
	ob, leases := s.outboxTables()
	for _, q := range []string{
		`CREATE TABLE IF NOT EXISTS ` + ob + ` (
	id              INTEGER PRIMARY KEY AUTOINCREMENT,
	message_key     TEXT    NOT NULL,
	aggregate       TEXT    NOT NULL DEFAULT '',
	khash           INTEGER NOT NULL,  -- FNV-1a 32 of aggregate: partition = khash % N
	topic           TEXT    NOT NULL,
	payload         BLOB    NOT NULL,
	headers         TEXT    NOT NULL DEFAULT '{}',
	created_at      INTEGER NOT NULL,  -- unix nanoseconds, store clock
	published_at    INTEGER,
	attempts        INTEGER NOT NULL DEFAULT 0,
	last_error      TEXT,
	next_attempt_at INTEGER,
	quarantined_at  INTEGER
) STRICT`,
		`CREATE INDEX IF NOT EXISTS "` + s.table + `_outbox_unpublished" ON ` + ob + ` (id) WHERE published_at IS NULL`,
		`CREATE INDEX IF NOT EXISTS "` + s.table + `_outbox_quarantined" ON ` + ob + ` (aggregate, id) WHERE quarantined_at IS NOT NULL AND published_at IS NULL`,
		`CREATE INDEX IF NOT EXISTS "` + s.table + `_outbox_published" ON ` + ob + ` (published_at) WHERE published_at IS NOT NULL`,
		`CREATE TABLE IF NOT EXISTS ` + leases + ` (
	part       INTEGER PRIMARY KEY,
	partitions INTEGER NOT NULL,
	owner      TEXT    NOT NULL DEFAULT '',
	epoch      INTEGER NOT NULL DEFAULT 0,
	expires_at INTEGER NOT NULL DEFAULT 0
) STRICT`,
		`CREATE TABLE IF NOT EXISTS "` + s.table + `_outbox_relays" (
	relay      TEXT PRIMARY KEY,
	partitions INTEGER NOT NULL,
	expires_at INTEGER NOT NULL
) STRICT`,
	} {
		if _, err := s.db.ExecContext(ctx, q); err != nil {
			return s.fail(ctx, "outbox migrate", err, false)
		}
	}
	return nil
}

// WriteOutbox writes msgs to the outbox table in the caller's transaction
// tx (on [Store.DB] or any handle on the same file): they commit with the
// business write, or not at all. Every message is validated first, its
// trace headers added from ctx ([outbox.SetHeaderInjector]), and an
// empty ID filled with [outbox.NewID]: a bad one is an
// [*dedup.ArgumentError] before any I/O, and nothing is written. Call
// [Store.MigrateOutbox] once before.
func (s *Store) WriteOutbox(ctx context.Context, tx *sql.Tx, msgs ...outbox.Message) error {
	if tx == nil {
		return &dedup.ArgumentError{Arg: "transaction", Reason: "is nil"}
	}
	type row struct {
		headers string
		hash    int64
		payload []byte
	}
	rows := make([]row, len(msgs))
	for i := range msgs {
		m := &msgs[i]
		if err := outbox.PrepareContext(ctx, m); err != nil {
			return err
		}
		rows[i].headers = "{}"
		if len(m.Headers) > 0 {
			b, err := json.Marshal(m.Headers)
			if err != nil {
				return &dedup.ArgumentError{Arg: "message headers", Reason: err.Error()}
			}
			rows[i].headers = string(b)
		}
		rows[i].hash = int64(keyHash(m.Key))
		rows[i].payload = m.Payload
		if rows[i].payload == nil {
			rows[i].payload = []byte{}
		}
	}
	if s.closed.Load() {
		return dedup.ErrClosed
	}
	if len(msgs) == 0 {
		return nil
	}
	ob, _ := s.outboxTables()
	now := s.now()
	q := `INSERT INTO ` + ob + ` (message_key, aggregate, khash, topic, payload, headers, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)`
	for i := range msgs {
		m := &msgs[i]
		if _, err := tx.ExecContext(ctx, q, m.ID, m.Key, rows[i].hash, m.Topic, rows[i].payload, rows[i].headers, now); err != nil {
			if strings.Contains(err.Error(), "no such table") {
				err = errors.Join(err, errors.New("call Store.MigrateOutbox first"))
			}
			return s.fail(ctx, "outbox", err, false)
		}
	}
	return nil
}

// keyHash is FNV-1a 32 of an aggregate key.
func keyHash(k string) uint32 {
	h := fnv.New32a()
	h.Write([]byte(k))
	return h.Sum32()
}

// OutboxSource is the SQLite outbox as an [outbox.Source]: partitions of
// the aggregate key's FNV-1a hash, leases with fencing epochs in
// <table>_outbox_leases, every fenced write in one IMMEDIATE transaction.
// Time is the store's clock.
type OutboxSource struct {
	s *Store
	n int
}

var (
	_ outbox.Source = (*OutboxSource)(nil)
	_ outbox.Pruner = (*OutboxSource)(nil)
)

// OutboxSource creates the outbox tables if needed and returns the outbox
// as a relay's source with n partitions (1 to 4096; one relay per file is
// the usual SQLite deployment, and 1 partition serves it).
func (s *Store) OutboxSource(ctx context.Context, n int) (*OutboxSource, error) {
	if n < 1 || n > 4096 {
		return nil, &dedup.ArgumentError{Arg: "outbox partitions", Reason: "must be between 1 and 4096"}
	}
	if err := s.MigrateOutbox(ctx); err != nil {
		return nil, err
	}
	return &OutboxSource{s: s, n: n}, nil
}

// Partitions implements [outbox.Source].
func (o *OutboxSource) Partitions() int { return o.n }

func plus(t int64, d time.Duration) int64 {
	if d > 0 && t > math.MaxInt64-int64(d) {
		return math.MaxInt64
	}
	return t + int64(d)
}

// write runs f in one IMMEDIATE transaction of the store's own.
func (o *OutboxSource) write(ctx context.Context, op string, f func(tx *sql.Tx, now int64) error) error {
	s := o.s
	if s.closed.Load() {
		return dedup.ErrClosed
	}
	if err := s.enter(ctx); err != nil {
		return s.fail(ctx, op, err, true)
	}
	defer s.leave()
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return s.fail(ctx, op, err, true)
	}
	defer tx.Rollback()
	if err := f(tx, s.now()); err != nil {
		if errors.Is(err, outbox.ErrLeaseLost) || errors.Is(err, outbox.ErrPartitionMismatch) {
			return err
		}
		return s.fail(ctx, op, err, true)
	}
	if err := tx.Commit(); err != nil {
		return s.fail(ctx, op, err, false)
	}
	return nil
}

// Join implements [outbox.Source].
func (o *OutboxSource) Join(ctx context.Context, relay string, ttl time.Duration) (int, error) {
	relays := `"` + o.s.table + `_outbox_relays"`
	var same, other int
	err := o.write(ctx, "outbox join", func(tx *sql.Tx, now int64) error {
		if _, err := tx.ExecContext(ctx, `INSERT INTO `+relays+` (relay, partitions, expires_at) VALUES (?1, ?2, ?3)
ON CONFLICT (relay) DO UPDATE SET partitions = excluded.partitions, expires_at = excluded.expires_at`, relay, o.n, plus(now, ttl)); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM `+relays+` WHERE expires_at < ?`, now-int64(24*time.Hour)); err != nil {
			return err
		}
		if err := tx.QueryRowContext(ctx, `SELECT count(*) FILTER (WHERE partitions = ?2), count(*) FILTER (WHERE partitions <> ?2)
FROM `+relays+` WHERE relay <> ?1 AND expires_at > ?3`, relay, o.n, now).Scan(&same, &other); err != nil {
			return err
		}
		if other > 0 {
			return outbox.ErrPartitionMismatch
		}
		return nil
	})
	return same + 1, err
}

// Leave implements [outbox.Source].
func (o *OutboxSource) Leave(ctx context.Context, relay string) error {
	_, leases := o.s.outboxTables()
	return o.write(ctx, "outbox leave", func(tx *sql.Tx, now int64) error {
		if _, err := tx.ExecContext(ctx, `DELETE FROM "`+o.s.table+`_outbox_relays" WHERE relay = ?`, relay); err != nil {
			return err
		}
		_, err := tx.ExecContext(ctx, `UPDATE `+leases+` SET owner = '', expires_at = 0 WHERE owner = ?`, relay)
		return err
	})
}

// Acquire implements [outbox.Source].
func (o *OutboxSource) Acquire(ctx context.Context, relay string, p int, ttl time.Duration) (outbox.Lease, bool, error) {
	l := outbox.Lease{Partition: p, Owner: relay}
	if p < 0 || p >= o.n {
		return l, false, &dedup.ArgumentError{Arg: "outbox partition", Reason: "out of range"}
	}
	_, leases := o.s.outboxTables()
	ok := false
	err := o.write(ctx, "outbox acquire", func(tx *sql.Tx, now int64) error {
		var until int64
		err := tx.QueryRowContext(ctx, `INSERT INTO `+leases+` AS l (part, partitions, owner, epoch, expires_at) VALUES (?1, ?2, ?3, 1, ?4)
ON CONFLICT (part) DO UPDATE SET
	partitions = excluded.partitions,
	epoch = CASE WHEN l.owner = excluded.owner THEN l.epoch ELSE l.epoch + 1 END,
	owner = excluded.owner,
	expires_at = excluded.expires_at
WHERE l.owner = excluded.owner OR l.expires_at <= ?5
RETURNING epoch, expires_at`, p, o.n, relay, plus(now, ttl), now).Scan(&l.Epoch, &until)
		if errors.Is(err, sql.ErrNoRows) {
			return nil
		}
		if err != nil {
			return err
		}
		ok, l.Until = true, time.Unix(0, until)
		return nil
	})
	return l, ok, err
}

// Release implements [outbox.Source].
func (o *OutboxSource) Release(ctx context.Context, l outbox.Lease) error {
	_, leases := o.s.outboxTables()
	return o.write(ctx, "outbox release", func(tx *sql.Tx, now int64) error {
		_, err := tx.ExecContext(ctx, `UPDATE `+leases+` SET owner = '', expires_at = 0 WHERE part = ? AND owner = ? AND epoch = ?`, l.Partition, l.Owner, l.Epoch)
		return err
	})
}

// Fetch implements [outbox.Source].
func (o *OutboxSource) Fetch(ctx context.Context, l outbox.Lease, limit int, skipBlocked bool) ([]outbox.Message, error) {
	s := o.s
	if s.closed.Load() {
		return nil, dedup.ErrClosed
	}
	ob, _ := s.outboxTables()
	rows, err := s.db.QueryContext(ctx, `SELECT o.id, o.message_key, o.aggregate, o.topic, o.payload, o.headers, o.created_at, o.attempts,
	COALESCE(o.next_attempt_at > ?4, 0)
FROM `+ob+` o
WHERE o.published_at IS NULL AND o.quarantined_at IS NULL AND o.khash % ?1 = ?2
	AND (?5 OR NOT EXISTS (SELECT 1 FROM `+ob+` q
		WHERE q.aggregate = o.aggregate AND q.quarantined_at IS NOT NULL AND q.published_at IS NULL AND q.id < o.id))
ORDER BY o.id LIMIT ?3`, o.n, l.Partition, limit, s.now(), skipBlocked)
	if err != nil {
		return nil, s.fail(ctx, "outbox fetch", err, true)
	}
	defer rows.Close()
	var out []outbox.Message
	var later map[string]bool
	for rows.Next() {
		var m outbox.Message
		var headers string
		var created int64
		var notDue bool
		if err := rows.Scan(&m.Seq, &m.ID, &m.Key, &m.Topic, &m.Payload, &headers, &created, &m.Attempts, &notDue); err != nil {
			return nil, s.fail(ctx, "outbox fetch", err, true)
		}
		if notDue || later[m.Key] {
			if later == nil {
				later = map[string]bool{}
			}
			later[m.Key] = true
			continue
		}
		m.CreatedAt = time.Unix(0, created)
		if headers != "{}" {
			if err := json.Unmarshal([]byte(headers), &m.Headers); err != nil {
				return nil, s.fail(ctx, "outbox fetch", err, true)
			}
		}
		out = append(out, m)
	}
	if err := rows.Err(); err != nil {
		return nil, s.fail(ctx, "outbox fetch", err, true)
	}
	return out, nil
}

// held checks, inside a write transaction, that l is still held.
func (o *OutboxSource) held(ctx context.Context, tx *sql.Tx, l outbox.Lease) error {
	_, leases := o.s.outboxTables()
	var one int
	err := tx.QueryRowContext(ctx, `SELECT 1 FROM `+leases+` WHERE part = ? AND owner = ? AND epoch = ?`, l.Partition, l.Owner, l.Epoch).Scan(&one)
	if errors.Is(err, sql.ErrNoRows) {
		return outbox.ErrLeaseLost
	}
	return err
}

// Mark implements [outbox.Source]: the lease check and the update in one
// IMMEDIATE transaction.
func (o *OutboxSource) Mark(ctx context.Context, l outbox.Lease, seqs []int64) error {
	if len(seqs) == 0 {
		return nil
	}
	ob, _ := o.s.outboxTables()
	ids, err := json.Marshal(seqs)
	if err != nil {
		return err
	}
	return o.write(ctx, "outbox mark", func(tx *sql.Tx, now int64) error {
		if err := o.held(ctx, tx, l); err != nil {
			return err
		}
		_, err := tx.ExecContext(ctx, `UPDATE `+ob+` SET published_at = ?1, next_attempt_at = NULL
WHERE id IN (SELECT value FROM json_each(?2)) AND published_at IS NULL`, now, string(ids))
		return err
	})
}

// Fail implements [outbox.Source], fenced like Mark.
func (o *OutboxSource) Fail(ctx context.Context, l outbox.Lease, fs []outbox.Failure) error {
	if len(fs) == 0 {
		return nil
	}
	ob, _ := o.s.outboxTables()
	return o.write(ctx, "outbox fail", func(tx *sql.Tx, now int64) error {
		if err := o.held(ctx, tx, l); err != nil {
			return err
		}
		for _, f := range fs {
			var q any
			if f.Quarantine {
				q = now
			}
			if _, err := tx.ExecContext(ctx, `UPDATE `+ob+` SET attempts = attempts + 1, last_error = ?1, next_attempt_at = ?2, quarantined_at = ?3
WHERE id = ?4 AND published_at IS NULL`, f.Err, plus(now, max(f.RetryAfter, 0)), q, f.Seq); err != nil {
				return err
			}
		}
		return nil
	})
}

// Prune implements [outbox.Pruner]: published rows only.
func (o *OutboxSource) Prune(ctx context.Context, olderThan time.Duration, limit int) (int, error) {
	if limit <= 0 {
		return 0, &dedup.ArgumentError{Arg: "prune limit", Reason: "must be positive"}
	}
	ob, _ := o.s.outboxTables()
	var n int64
	err := o.write(ctx, "outbox prune", func(tx *sql.Tx, now int64) error {
		res, err := tx.ExecContext(ctx, `DELETE FROM `+ob+` WHERE id IN (SELECT id FROM `+ob+`
WHERE published_at IS NOT NULL AND published_at < ?1 ORDER BY published_at LIMIT ?2)`, now-int64(max(olderThan, 0)), limit)
		if err != nil {
			return err
		}
		n, err = res.RowsAffected()
		return err
	})
	return int(n), err
}
