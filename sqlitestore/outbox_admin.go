package sqlitestore

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/outbox"
)

// The operator's view of the SQLite outbox (`dedup outbox --store sqlite
// status|list|retry|drop`), the same as pgstore's ([outbox.Admin]).

var _ outbox.Admin = (*Store)(nil)

func nanosAgo(now, t int64) time.Duration {
	if t <= 0 || now <= t {
		return 0
	}
	return time.Duration(now - t)
}

// OutboxStatus implements [outbox.Admin]: the backlog, the quarantine,
// the kept published rows, the lag per partition (khash mod partitions),
// the leases and the relays. OldestTransaction is always 0: SQLite has
// one writer at a time, and no row commits behind a relay.
func (s *Store) OutboxStatus(ctx context.Context, partitions int) (outbox.Status, error) {
	var st outbox.Status
	if partitions < 1 || partitions > 4096 {
		return st, &dedup.ArgumentError{Arg: "outbox partitions", Reason: "must be between 1 and 4096"}
	}
	if s.closed.Load() {
		return st, dedup.ErrClosed
	}
	ob, leases := s.outboxTables()
	relays := `"` + s.table + `_outbox_relays"`
	now := s.now()
	fail := func(err error) (outbox.Status, error) {
		if isNoTable(err) {
			err = errors.Join(err, errors.New("no outbox in this file (its tables are made by Store.MigrateOutbox or the relay)"))
		}
		return st, s.fail(ctx, "outbox status", err, true)
	}
	var oldest sql.NullInt64
	err := s.db.QueryRowContext(ctx, `SELECT
	count(*) FILTER (WHERE published_at IS NULL AND quarantined_at IS NULL),
	count(*) FILTER (WHERE quarantined_at IS NOT NULL AND published_at IS NULL),
	count(*) FILTER (WHERE published_at IS NOT NULL),
	min(created_at) FILTER (WHERE published_at IS NULL AND quarantined_at IS NULL)
FROM `+ob).Scan(&st.Backlog, &st.Quarantined, &st.Published, &oldest)
	if err != nil {
		return fail(err)
	}
	st.OldestAge = nanosAgo(now, oldest.Int64)
	st.Partitions = make([]outbox.PartitionState, partitions)
	for i := range st.Partitions {
		st.Partitions[i].Partition = i
	}
	rows, err := s.db.QueryContext(ctx, `SELECT khash % ?1, count(*), min(created_at) FROM `+ob+`
WHERE published_at IS NULL AND quarantined_at IS NULL GROUP BY 1`, partitions)
	if err != nil {
		return fail(err)
	}
	for rows.Next() {
		var p int
		var n, created int64
		if err := rows.Scan(&p, &n, &created); err != nil {
			rows.Close()
			return fail(err)
		}
		st.Partitions[p].Backlog, st.Partitions[p].OldestAge = n, nanosAgo(now, created)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fail(err)
	}
	rows, err = s.db.QueryContext(ctx, `SELECT part, owner, epoch, expires_at FROM `+leases+` WHERE part < ? AND expires_at > 0`, partitions)
	if err != nil {
		return fail(err)
	}
	for rows.Next() {
		var p int
		var owner string
		var epoch, until int64
		if err := rows.Scan(&p, &owner, &epoch, &until); err != nil {
			rows.Close()
			return fail(err)
		}
		st.Partitions[p].Owner, st.Partitions[p].Epoch, st.Partitions[p].LeaseLeft = owner, epoch, time.Duration(until-now)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fail(err)
	}
	rows, err = s.db.QueryContext(ctx, `SELECT relay, partitions, expires_at > ? FROM `+relays+` ORDER BY relay`, now)
	if err != nil {
		return fail(err)
	}
	defer rows.Close()
	for rows.Next() {
		var r outbox.RelayState
		if err := rows.Scan(&r.Relay, &r.Partitions, &r.Alive); err != nil {
			return fail(err)
		}
		st.Relays = append(st.Relays, r)
	}
	if err := rows.Err(); err != nil {
		return fail(err)
	}
	return st, nil
}

const outboxRowCols = `id, message_key, aggregate, topic, attempts, COALESCE(last_error, ''), created_at, quarantined_at, published_at`

func scanOutboxRow(sc interface{ Scan(...any) error }) (outbox.Row, error) {
	var r outbox.Row
	var created int64
	var q, p sql.NullInt64
	if err := sc.Scan(&r.Seq, &r.ID, &r.Key, &r.Topic, &r.Attempts, &r.LastError, &created, &q, &p); err != nil {
		return r, err
	}
	r.CreatedAt = time.Unix(0, created).UTC()
	if q.Valid {
		t := time.Unix(0, q.Int64).UTC()
		r.Quarantined = &t
	}
	if p.Valid {
		t := time.Unix(0, p.Int64).UTC()
		r.Published = &t
	}
	return r, nil
}

// OutboxList implements [outbox.Admin].
func (s *Store) OutboxList(ctx context.Context, quarantined bool, limit int) ([]outbox.Row, error) {
	if limit < 1 {
		return nil, &dedup.ArgumentError{Arg: "limit", Reason: "must be positive"}
	}
	if s.closed.Load() {
		return nil, dedup.ErrClosed
	}
	ob, _ := s.outboxTables()
	where := `published_at IS NULL AND quarantined_at IS NULL`
	if quarantined {
		where = `published_at IS NULL AND quarantined_at IS NOT NULL`
	}
	rows, err := s.db.QueryContext(ctx, `SELECT `+outboxRowCols+` FROM `+ob+` WHERE `+where+` ORDER BY id LIMIT ?`, limit)
	if err != nil {
		return nil, s.fail(ctx, "outbox list", err, true)
	}
	defer rows.Close()
	var out []outbox.Row
	for rows.Next() {
		r, err := scanOutboxRow(rows)
		if err != nil {
			return nil, s.fail(ctx, "outbox list", err, true)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, s.fail(ctx, "outbox list", err, true)
	}
	return out, nil
}

// OutboxRetry implements [outbox.Admin]: the row's attempts restart at 0
// and the relay publishes it next. No quarantined row with that ID is
// [outbox.ErrNoQuarantinedRow].
func (s *Store) OutboxRetry(ctx context.Context, id string) (outbox.Row, error) {
	ob, _ := s.outboxTables()
	return s.outboxAdmin(ctx, "outbox retry", `UPDATE `+ob+` SET quarantined_at = NULL, next_attempt_at = NULL, attempts = 0 WHERE id = ?`, id, false)
}

// OutboxDrop implements [outbox.Admin]: only a quarantined row is ever
// deleted.
func (s *Store) OutboxDrop(ctx context.Context, id string, dryRun bool) (outbox.Row, error) {
	ob, _ := s.outboxTables()
	return s.outboxAdmin(ctx, "outbox drop", `DELETE FROM `+ob+` WHERE id = ? AND quarantined_at IS NOT NULL AND published_at IS NULL`, id, dryRun)
}

// outboxAdmin finds the first quarantined row of message id and runs stmt
// on its id, in one IMMEDIATE transaction.
func (s *Store) outboxAdmin(ctx context.Context, op, stmt, id string, dryRun bool) (outbox.Row, error) {
	var r outbox.Row
	if id == "" {
		return r, &dedup.ArgumentError{Arg: "message ID", Reason: "is empty"}
	}
	if s.closed.Load() {
		return r, dedup.ErrClosed
	}
	if err := s.enter(ctx); err != nil {
		return r, s.fail(ctx, op, err, true)
	}
	defer s.leave()
	ob, _ := s.outboxTables()
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return r, s.fail(ctx, op, err, true)
	}
	defer tx.Rollback()
	r, err = scanOutboxRow(tx.QueryRowContext(ctx, `SELECT `+outboxRowCols+` FROM `+ob+`
WHERE message_key = ? AND published_at IS NULL AND quarantined_at IS NOT NULL ORDER BY id LIMIT 1`, id))
	if errors.Is(err, sql.ErrNoRows) {
		return r, outbox.ErrNoQuarantinedRow
	}
	if err != nil {
		return r, s.fail(ctx, op, err, true)
	}
	if dryRun {
		return r, nil
	}
	if _, err := tx.ExecContext(ctx, stmt, r.Seq); err != nil {
		return r, s.fail(ctx, op, err, true)
	}
	if err := tx.Commit(); err != nil {
		return r, s.fail(ctx, op, err, false)
	}
	return r, nil
}

func isNoTable(err error) bool {
	return err != nil && strings.Contains(err.Error(), "no such table")
}
