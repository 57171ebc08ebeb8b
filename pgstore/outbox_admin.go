package pgstore

import (
	"context"
	"errors"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/outbox"
	"github.com/jackc/pgx/v5"
)

// The operator's view of the outbox, shared with sqlitestore
// ([outbox.Admin]).
type (
	// OutboxStatus is the state of the outbox for an operator (`dedup
	// outbox status`).
	OutboxStatus = outbox.Status
	// OutboxPartitionState is one partition's backlog and lease.
	OutboxPartitionState = outbox.PartitionState
	// OutboxRelayState is one relay that joined.
	OutboxRelayState = outbox.RelayState
	// OutboxRow is one row for `dedup outbox list`.
	OutboxRow = outbox.Row
)

var _ outbox.Admin = (*Store)(nil)

// OutboxStatus reads the outbox's state with partitions partitions (the
// relays' N).
func (s *Store) OutboxStatus(ctx context.Context, partitions int) (OutboxStatus, error) {
	var st OutboxStatus
	if partitions < 1 || partitions > 4096 {
		return st, &dedup.ArgumentError{Arg: "outbox partitions", Reason: "must be between 1 and 4096"}
	}
	if err := s.begin(ctx, "outbox status"); err != nil {
		return st, err
	}
	ob, leases, relays := s.names.outbox, s.names.qualify("outbox_leases"), s.names.qualify("outbox_relays")
	var oldest, oldTx float64
	err := s.pool.QueryRow(ctx, `SELECT
	count(*) FILTER (WHERE published_at IS NULL AND quarantined_at IS NULL),
	count(*) FILTER (WHERE quarantined_at IS NOT NULL AND published_at IS NULL),
	count(*) FILTER (WHERE published_at IS NOT NULL),
	COALESCE(extract(epoch FROM statement_timestamp() - min(created_at) FILTER (WHERE published_at IS NULL AND quarantined_at IS NULL)), 0),
	COALESCE((SELECT extract(epoch FROM statement_timestamp() - min(xact_start)) FROM pg_stat_activity
		WHERE datname = current_database() AND backend_xid IS NOT NULL AND pid <> pg_backend_pid()), 0)
FROM `+ob).Scan(&st.Backlog, &st.Quarantined, &st.Published, &oldest, &oldTx)
	if err != nil {
		return st, s.failAuto(ctx, "outbox status", err)
	}
	st.OldestAge, st.OldestTransaction = seconds(oldest), seconds(oldTx)
	st.Partitions = make([]OutboxPartitionState, partitions)
	for i := range st.Partitions {
		st.Partitions[i].Partition = i
	}
	rows, err := s.pool.Query(ctx, `SELECT `+partExpr+` AS p, count(*), extract(epoch FROM statement_timestamp() - min(o.created_at))
FROM `+ob+` o WHERE o.published_at IS NULL AND o.quarantined_at IS NULL GROUP BY 1`, partitions)
	if err != nil {
		return st, s.failAuto(ctx, "outbox status", err)
	}
	for rows.Next() {
		var p int
		var n int64
		var age float64
		if err := rows.Scan(&p, &n, &age); err != nil {
			rows.Close()
			return st, s.failAuto(ctx, "outbox status", err)
		}
		st.Partitions[p].Backlog, st.Partitions[p].OldestAge = n, seconds(age)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return st, s.failAuto(ctx, "outbox status", err)
	}
	rows, err = s.pool.Query(ctx, `SELECT part, owner, epoch, extract(epoch FROM expires_at - statement_timestamp())
FROM `+leases+` WHERE part < $1::int AND expires_at > '-infinity'`, partitions)
	if err != nil {
		return st, s.failAuto(ctx, "outbox status", err)
	}
	for rows.Next() {
		var p int
		var owner string
		var epoch int64
		var left float64
		if err := rows.Scan(&p, &owner, &epoch, &left); err != nil {
			rows.Close()
			return st, s.failAuto(ctx, "outbox status", err)
		}
		st.Partitions[p].Owner, st.Partitions[p].Epoch, st.Partitions[p].LeaseLeft = owner, epoch, seconds(left)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return st, s.failAuto(ctx, "outbox status", err)
	}
	rows, err = s.pool.Query(ctx, `SELECT relay, partitions, expires_at > statement_timestamp(), extract(epoch FROM statement_timestamp() - started_at)
FROM `+relays+` ORDER BY relay`)
	if err != nil {
		return st, s.failAuto(ctx, "outbox status", err)
	}
	defer rows.Close()
	for rows.Next() {
		var r OutboxRelayState
		var since float64
		if err := rows.Scan(&r.Relay, &r.Partitions, &r.Alive, &since); err != nil {
			return st, s.failAuto(ctx, "outbox status", err)
		}
		r.Since = seconds(since)
		st.Relays = append(st.Relays, r)
	}
	if err := rows.Err(); err != nil {
		return st, s.failAuto(ctx, "outbox status", err)
	}
	return st, nil
}

func seconds(f float64) time.Duration {
	const maxSec = float64(1<<63-1) / float64(time.Second)
	if f > maxSec {
		return time.Duration(1<<63 - 1)
	}
	return time.Duration(f * float64(time.Second))
}

// OutboxList returns up to limit rows in id order: the quarantined ones
// when quarantined is true, else the unpublished ones.
func (s *Store) OutboxList(ctx context.Context, quarantined bool, limit int) ([]OutboxRow, error) {
	if limit < 1 {
		return nil, &dedup.ArgumentError{Arg: "limit", Reason: "must be positive"}
	}
	if err := s.begin(ctx, "outbox list"); err != nil {
		return nil, err
	}
	where := `published_at IS NULL AND quarantined_at IS NULL`
	if quarantined {
		where = `published_at IS NULL AND quarantined_at IS NOT NULL`
	}
	rows, err := s.pool.Query(ctx, `SELECT id, message_key, aggregate, topic, attempts, COALESCE(last_error, ''), created_at, quarantined_at, published_at
FROM `+s.names.outbox+` WHERE `+where+` ORDER BY id LIMIT $1`, limit)
	if err != nil {
		return nil, s.failAuto(ctx, "outbox list", err)
	}
	defer rows.Close()
	var out []OutboxRow
	for rows.Next() {
		var r OutboxRow
		if err := rows.Scan(&r.Seq, &r.ID, &r.Key, &r.Topic, &r.Attempts, &r.LastError, &r.CreatedAt, &r.Quarantined, &r.Published); err != nil {
			return nil, s.failAuto(ctx, "outbox list", err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, s.failAuto(ctx, "outbox list", err)
	}
	return out, nil
}

// ErrOutboxRowNotFound is returned by [Store.OutboxRetry] and
// [Store.OutboxDrop] when no quarantined row has that ID: it is
// [outbox.ErrNoQuarantinedRow].
var ErrOutboxRowNotFound = outbox.ErrNoQuarantinedRow

// OutboxRetry puts the quarantined row of message id back in line: its
// attempts restart at 0 and the relay publishes it next (its key's later
// rows wait behind it again).
func (s *Store) OutboxRetry(ctx context.Context, id string) (OutboxRow, error) {
	return s.outboxAdmin(ctx, "outbox retry", `UPDATE `+s.names.outbox+` SET quarantined_at = NULL, next_attempt_at = NULL, attempts = 0
WHERE message_key = $1 AND published_at IS NULL AND quarantined_at IS NOT NULL`, id, false)
}

// OutboxDrop deletes the quarantined row of message id (only a
// quarantined row: an unpublished row in line is never dropped), so its
// key's later rows flow. With dryRun it returns the row and changes
// nothing.
func (s *Store) OutboxDrop(ctx context.Context, id string, dryRun bool) (OutboxRow, error) {
	return s.outboxAdmin(ctx, "outbox drop", `DELETE FROM `+s.names.outbox+`
WHERE message_key = $1 AND published_at IS NULL AND quarantined_at IS NOT NULL`, id, dryRun)
}

func (s *Store) outboxAdmin(ctx context.Context, op, stmt, id string, dryRun bool) (OutboxRow, error) {
	var r OutboxRow
	if id == "" {
		return r, &dedup.ArgumentError{Arg: "message ID", Reason: "is empty"}
	}
	if err := s.begin(ctx, op); err != nil {
		return r, err
	}
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		err := tx.QueryRow(ctx, `SELECT id, message_key, aggregate, topic, attempts, COALESCE(last_error, ''), created_at, quarantined_at, published_at
FROM `+s.names.outbox+` WHERE message_key = $1 AND published_at IS NULL AND quarantined_at IS NOT NULL ORDER BY id LIMIT 1 FOR UPDATE`, id).
			Scan(&r.Seq, &r.ID, &r.Key, &r.Topic, &r.Attempts, &r.LastError, &r.CreatedAt, &r.Quarantined, &r.Published)
		if errors.Is(err, pgx.ErrNoRows) {
			return ErrOutboxRowNotFound
		}
		if err != nil || dryRun {
			return err
		}
		_, err = tx.Exec(ctx, stmt, id)
		return err
	})
	if errors.Is(err, ErrOutboxRowNotFound) {
		return r, err
	}
	if err != nil {
		return r, s.fail(ctx, op, err, false)
	}
	return r, nil
}
