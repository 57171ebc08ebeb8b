package pgstore

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// partitionNameLayout formats the start of a partition's range (UTC) in
// its name: <prefix>records_p_20261122t00.
const partitionNameLayout = "20060102t15"

// partitionName returns the bare name of the partition starting at start.
func (s *Store) partitionName(start time.Time) string {
	return s.names.prefix + "rec_p_" + start.UTC().Format(partitionNameLayout)
}

// partitionStart parses a partition's bare name back to the start of its
// range; ok is false for a table that is not one of ours.
func (s *Store) partitionStart(name string) (time.Time, bool) {
	ts, ok := strings.CutPrefix(name, s.names.prefix+"rec_p_")
	if !ok {
		return time.Time{}, false
	}
	t, err := time.ParseInLocation(partitionNameLayout, ts, time.UTC)
	if err != nil || t.Format(partitionNameLayout) != ts {
		return time.Time{}, false
	}
	return t, true
}

// floorTo rounds t down to a multiple of d since the Unix epoch, in UTC.
func floorTo(t time.Time, d time.Duration) time.Time {
	return time.Unix(0, t.UnixNano()-t.UnixNano()%int64(d)).UTC()
}

// serverNow reads the server's clock.
func serverNow(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) (time.Time, error) {
	var t time.Time
	err := q.QueryRow(ctx, `SELECT statement_timestamp()`).Scan(&t)
	return t, err
}

// EnsurePartitions creates the partitions of the partitioned records table
// from the one holding the server's current time to [WithPartitionsAhead]
// past it, and returns the names of those it created. Each is created as a
// plain table and then attached (ATTACH PARTITION takes a SHARE UPDATE
// EXCLUSIVE lock on the parent, which does not block claims), in its own
// transaction with the maintenance lock timeout. Migrate and every
// maintenance pass call it; it is idempotent.
func (s *Store) EnsurePartitions(ctx context.Context) ([]string, error) {
	if s.cfg.partition == 0 {
		return nil, &dedup.ArgumentError{Arg: "store", Reason: "is not partitioned (see WithPartitions)"}
	}
	if err := s.begin(ctx, "ensure partitions"); err != nil {
		return nil, err
	}
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return nil, s.fail(ctx, "ensure partitions", err, true)
	}
	defer conn.Release()
	return s.ensurePartitions(ctx, conn.Conn())
}

func (s *Store) ensurePartitions(ctx context.Context, conn *pgx.Conn) ([]string, error) {
	now, err := serverNow(ctx, conn)
	if err != nil {
		return nil, s.fail(ctx, "ensure partitions", err, true)
	}
	var created []string
	for start := floorTo(now, s.cfg.partition); !start.After(now.Add(s.cfg.partitionsAhead)); start = start.Add(s.cfg.partition) {
		name := s.partitionName(start)
		q := s.names.qualify(name[len(s.names.prefix):])
		var exists bool
		if err := conn.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, q).Scan(&exists); err != nil {
			return created, s.fail(ctx, "ensure partitions", err, true)
		}
		if exists {
			continue
		}
		from, to := start.Format(time.RFC3339), start.Add(s.cfg.partition).Format(time.RFC3339)
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `SET LOCAL lock_timeout = `+sqlLiteral(itoa(int(s.cfg.lockTimeout.Milliseconds()))+"ms")+`;
CREATE TABLE IF NOT EXISTS `+q+` (LIKE `+s.names.recordsP+` INCLUDING DEFAULTS INCLUDING CONSTRAINTS) WITH (fillfactor = `+itoa(recordsFillfactor)+`);
ALTER TABLE `+s.names.recordsP+` ATTACH PARTITION `+q+` FOR VALUES FROM (`+sqlLiteral(from)+`) TO (`+sqlLiteral(to)+`)`)
			return err
		})
		if err != nil {
			return created, s.fail(ctx, "ensure partitions", fmt.Errorf("create partition %s: %w", name, err), false)
		}
		created = append(created, name)
	}
	return created, nil
}

// Partitions lists the partitions of the partitioned records table by the
// start of their range, oldest first.
func (s *Store) Partitions(ctx context.Context) ([]Partition, error) {
	if err := s.begin(ctx, "list partitions"); err != nil {
		return nil, err
	}
	rows, err := s.pool.Query(ctx, `SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass($1)`, s.names.recordsP)
	if err != nil {
		return nil, s.fail(ctx, "list partitions", err, true)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, s.fail(ctx, "list partitions", err, true)
	}
	var out []Partition
	for _, n := range names {
		if start, ok := s.partitionStart(n); ok {
			out = append(out, Partition{Name: n, Start: start, End: start.Add(s.cfg.partition)})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Start.Before(out[j].Start) })
	return out, nil
}

// A Partition is one partition of the partitioned records table.
type Partition struct {
	Name       string    // bare table name, in the store's schema
	Start, End time.Time // the range of acquisition times it holds
}

// errPartitionLive says a partition still holds a live record.
var errPartitionLive = errors.New("partition still holds a live record")

// DropExpiredPartitions drops every partition whose range ended before the
// server's current time and whose records have all expired, and returns
// their names. A partition only receives rows while it is current (a
// claim over an expired record moves it to the current partition), so once
// its range is over its rows only age, but a transaction that began while
// it was current may still commit a row into it, and a late Complete or
// Extend can make one live again: each drop therefore checks and drops in
// one transaction that holds the records table exclusively.
//
// That transaction locks the partitioned table ACCESS EXCLUSIVE (parent
// first, the order every claim takes its locks in, so it cannot deadlock
// with them), which waits for the transactions using it to end and makes
// new claims wait behind it; it gives up after the maintenance lock
// timeout ([WithMaintenanceLockTimeout]) and tries again on the next pass,
// so claims stall at most that long plus the few milliseconds of the check
// (an index probe) and the drop, once per partition. A partition that is
// not droppable yet is skipped.
func (s *Store) DropExpiredPartitions(ctx context.Context) ([]string, error) {
	if s.cfg.partition == 0 {
		return nil, &dedup.ArgumentError{Arg: "store", Reason: "is not partitioned (see WithPartitions)"}
	}
	parts, err := s.Partitions(ctx)
	if err != nil {
		return nil, err
	}
	now, err := serverNow(ctx, s.pool)
	if err != nil {
		return nil, s.fail(ctx, "drop partitions", err, true)
	}
	var dropped []string
	var errs []error
	for _, p := range parts {
		if p.End.After(now) {
			break // current and future partitions receive claims
		}
		q := s.names.qualify(p.Name[len(s.names.prefix):])
		ok, err := s.dropPartition(ctx, "records", s.names.recordsP, q, p.Name,
			`SELECT NOT EXISTS (SELECT 1 FROM `+q+` WHERE NOT `+expired(micros(s.cfg.grace))+`)`)
		switch {
		case err != nil:
			errs = append(errs, err)
		case ok:
			dropped = append(dropped, p.Name)
		}
	}
	if len(errs) > 0 {
		return dropped, s.fail(ctx, "drop partitions", errors.Join(errs...), false)
	}
	return dropped, nil
}

// dropPartition drops the range partition part (named name) of parent when
// the boolean query droppable (with args) says it may go. The query runs
// first without a lock, so that a partition still in use costs writers no
// stall; then again in the transaction that drops it, after locking parent
// ACCESS EXCLUSIVE (the parent first, the order writers lock in) for at
// most the maintenance lock timeout, so that a row committed by a
// transaction open when the range ended is seen. A partition that may not
// go yet, or a parent too busy to lock (logged; the next pass tries
// again), is not an error. what names the table in messages.
func (s *Store) dropPartition(ctx context.Context, what, parent, part, name, droppable string, args ...any) (bool, error) {
	var ok bool
	if err := s.pool.QueryRow(ctx, droppable, args...).Scan(&ok); err != nil {
		return false, fmt.Errorf("check %s partition %s: %w", what, name, err)
	}
	if !ok {
		return false, nil
	}
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = `+sqlLiteral(itoa(int(s.cfg.lockTimeout.Milliseconds()))+"ms")); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `LOCK TABLE `+parent+` IN ACCESS EXCLUSIVE MODE`); err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, droppable, args...).Scan(&ok); err != nil {
			return err
		}
		if !ok {
			return errPartitionLive
		}
		_, err := tx.Exec(ctx, `DROP TABLE `+part)
		return err
	})
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, errPartitionLive):
		return false, nil
	case isLockTimeout(err):
		s.logger().InfoContext(ctx, "dedup "+what+" table busy; will try to drop the partition on the next pass", "partition", name,
			"lock_timeout", s.cfg.lockTimeout.String())
		return false, nil
	default:
		return false, fmt.Errorf("drop %s partition %s: %w", what, name, err)
	}
}

// isLockTimeout reports whether err is PostgreSQL's lock_not_available
// (55P03), what lock_timeout raises.
func isLockTimeout(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "55P03"
}
