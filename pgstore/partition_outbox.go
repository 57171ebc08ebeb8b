package pgstore

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/jackc/pgx/v5"
)

// Retention of the outbox by time partitions. [Store.PartitionOutbox]
// turns the (empty) outbox table into one partitioned by created_at in
// ranges of a fixed length, with a default partition so that a write
// never fails for want of one; [Store.EnsureOutboxPartitions] creates the
// ranges ahead; [Store.DropPublishedOutboxPartitions] drops a range once
// it is over and every row in it was published long enough ago: a whole
// partition goes in one DROP, with no row deleted one by one and nothing
// left for VACUUM. A partition that still holds an unpublished row (in
// line or quarantined) is never dropped; its published rows go by the
// batched delete of [OutboxSource.Prune] like on an unpartitioned table.
// The relay's retention loop (outbox.WithRetention) runs all three, at
// its pacing, when the table is partitioned.

// outboxPartComment marks a partitioned outbox table with its range
// length, in seconds.
const outboxPartComment = "dedup outbox partitioned every "

// outboxPartLayout formats the start of a range (UTC) in its partition's
// name: <prefix>outbox_p_20261124t063000.
const outboxPartLayout = "20060102t150405"

// outboxPartitionsAhead is how many ranges past the current one
// EnsureOutboxPartitions keeps ready.
const outboxPartitionsAhead = 3

// ErrOutboxNotEmpty is returned by [Store.PartitionOutbox] when the
// outbox table holds rows: publish and prune them (or move them) first.
var ErrOutboxNotEmpty = errors.New("pgstore: the outbox table holds rows; partitioning needs it empty")

// OutboxPartitioning returns the range length of the partitioned outbox
// table, or 0 when the table is not partitioned.
func (s *Store) OutboxPartitioning(ctx context.Context) (time.Duration, error) {
	if err := s.begin(ctx, "outbox partitions"); err != nil {
		return 0, err
	}
	var kind, comment string
	err := s.pool.QueryRow(ctx, `SELECT c.relkind::text, COALESCE(obj_description(c.oid, 'pg_class'), '')
FROM pg_class c WHERE c.oid = to_regclass($1)`, s.names.outbox).Scan(&kind, &comment)
	if err != nil {
		return 0, s.fail(ctx, "outbox partitions", err, true)
	}
	if kind != "p" {
		return 0, nil
	}
	secs, err := strconv.ParseInt(strings.TrimPrefix(comment, outboxPartComment), 10, 64)
	if err != nil || !strings.HasPrefix(comment, outboxPartComment) || secs <= 0 {
		return 0, s.fail(ctx, "outbox partitions", fmt.Errorf("partitioned outbox table without its range comment (%q)", comment), true)
	}
	return time.Duration(secs) * time.Second, nil
}

// PartitionOutbox turns the outbox table into one partitioned by
// created_at in ranges of every (a whole number of seconds, at least one
// minute), with a default partition, and creates the current range and
// three ahead. The table must be empty ([ErrOutboxNotEmpty]): run it at
// deployment, or once the relays drained it and the retention removed the
// published rows. It runs in one transaction that locks the table ACCESS
// EXCLUSIVE for the few milliseconds of the change (waiting at most the
// maintenance lock timeout); the new table keeps every column, the
// identity's next value, the indexes of the migrations and the NOTIFY
// trigger. A table already partitioned is left as it is.
func (s *Store) PartitionOutbox(ctx context.Context, every time.Duration) error {
	if every < time.Minute || every%time.Second != 0 {
		return &dedup.ArgumentError{Arg: "outbox partition range", Reason: "must be whole seconds, at least 1m, got " + every.String()}
	}
	if err := s.begin(ctx, "partition outbox"); err != nil {
		return err
	}
	ob := s.names.outbox
	q := s.names.qualify
	n := func(name string) string { return pgx.Identifier{s.names.prefix + name}.Sanitize() }
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = `+sqlLiteral(itoa(int(s.cfg.lockTimeout.Milliseconds()))+"ms")); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `LOCK TABLE `+ob+` IN ACCESS EXCLUSIVE MODE`); err != nil {
			return err
		}
		var kind string
		var rows bool
		var next int64
		if err := tx.QueryRow(ctx, `SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)`, ob).Scan(&kind); err != nil {
			return err
		}
		if kind == "p" {
			return nil
		}
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+ob+`),
	COALESCE(pg_sequence_last_value(pg_get_serial_sequence($1, 'id')), 0) + 1`, ob).Scan(&rows, &next); err != nil {
			return err
		}
		if rows {
			return ErrOutboxNotEmpty
		}
		tmp := q("outbox_partitioned_new")
		_, err := tx.Exec(ctx, `CREATE TABLE `+tmp+` (LIKE `+ob+` INCLUDING DEFAULTS INCLUDING IDENTITY INCLUDING GENERATED,
	PRIMARY KEY (id, created_at)) PARTITION BY RANGE (created_at);
DROP TABLE `+ob+`;
ALTER TABLE `+tmp+` RENAME TO `+n("outbox")+`;
ALTER TABLE `+ob+` ALTER COLUMN id RESTART WITH `+strconv.FormatInt(next, 10)+`;
COMMENT ON TABLE `+ob+` IS `+sqlLiteral(outboxPartComment+strconv.FormatInt(int64(every/time.Second), 10))+`;
CREATE INDEX `+n("outbox_unpublished")+` ON `+ob+` (id) WHERE published_at IS NULL;
CREATE INDEX `+n("outbox_quarantined")+` ON `+ob+` (aggregate, id) WHERE quarantined_at IS NOT NULL AND published_at IS NULL;
CREATE INDEX `+n("outbox_published")+` ON `+ob+` (published_at) WHERE published_at IS NOT NULL;
CREATE TRIGGER `+n("outbox_notify")+` AFTER INSERT ON `+ob+` FOR EACH STATEMENT EXECUTE FUNCTION `+q("outbox_notify")+`();
CREATE TABLE `+q("outbox_p_default")+` PARTITION OF `+ob+` DEFAULT`)
		return err
	})
	if errors.Is(err, ErrOutboxNotEmpty) {
		return err
	}
	if err != nil {
		return s.fail(ctx, "partition outbox", err, false)
	}
	_, err = s.EnsureOutboxPartitions(ctx)
	return err
}

// An OutboxPartition is one range partition of the partitioned outbox.
type OutboxPartition struct {
	Name       string    // bare table name, in the store's schema
	Start, End time.Time // the range of created_at it holds
}

// OutboxPartitions lists the range partitions of the partitioned outbox,
// oldest first (the default partition is not listed).
func (s *Store) OutboxPartitions(ctx context.Context) ([]OutboxPartition, error) {
	every, err := s.OutboxPartitioning(ctx)
	if err != nil || every == 0 {
		return nil, err
	}
	rows, err := s.pool.Query(ctx, `SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass($1)`, s.names.outbox)
	if err != nil {
		return nil, s.fail(ctx, "outbox partitions", err, true)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, s.fail(ctx, "outbox partitions", err, true)
	}
	var out []OutboxPartition
	for _, name := range names {
		ts, ok := strings.CutPrefix(name, s.names.prefix+"outbox_p_")
		if !ok {
			continue
		}
		start, err := time.ParseInLocation(outboxPartLayout, ts, time.UTC)
		if err != nil || start.Format(outboxPartLayout) != ts {
			continue // the default partition, or not ours
		}
		out = append(out, OutboxPartition{Name: name, Start: start, End: start.Add(every)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Start.Before(out[j].Start) })
	return out, nil
}

// EnsureOutboxPartitions creates the partitions of the partitioned outbox
// from the range holding the server's current time to three ranges past
// it, and returns the names of those it created (none when the table is
// not partitioned). A range whose rows already went to the default
// partition (maintenance stalled) cannot be created; it is skipped and
// its rows stay in the default partition, which is never dropped.
func (s *Store) EnsureOutboxPartitions(ctx context.Context) ([]string, error) {
	every, err := s.OutboxPartitioning(ctx)
	if err != nil || every == 0 {
		return nil, err
	}
	now, err := serverNow(ctx, s.pool)
	if err != nil {
		return nil, s.fail(ctx, "outbox partitions", err, true)
	}
	return s.ensureOutboxRanges(ctx, every, floorTo(now, every), now.Add(outboxPartitionsAhead*every))
}

// ensureOutboxRanges creates the ranges from start (a range boundary)
// through the one holding until.
func (s *Store) ensureOutboxRanges(ctx context.Context, every time.Duration, start, until time.Time) ([]string, error) {
	var created []string
	var errs []error
	for ; !start.After(until); start = start.Add(every) {
		name := s.names.prefix + "outbox_p_" + start.UTC().Format(outboxPartLayout)
		from, to := start.UTC().Format(time.RFC3339), start.Add(every).UTC().Format(time.RFC3339)
		var made bool
		err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NULL`, s.names.qualify(name[len(s.names.prefix):])).Scan(&made); err != nil || !made {
				return err
			}
			_, err := tx.Exec(ctx, `SET LOCAL lock_timeout = `+sqlLiteral(itoa(int(s.cfg.lockTimeout.Milliseconds()))+"ms")+`;
CREATE TABLE `+s.names.qualify(name[len(s.names.prefix):])+` PARTITION OF `+s.names.outbox+` FOR VALUES FROM (`+sqlLiteral(from)+`) TO (`+sqlLiteral(to)+`)`)
			return err
		})
		switch {
		case err != nil:
			made = false
			errs = append(errs, fmt.Errorf("create outbox partition %s: %w", name, err))
		case made:
			created = append(created, name)
		}
	}
	if len(errs) > 0 {
		return created, s.fail(ctx, "outbox partitions", errors.Join(errs...), false)
	}
	return created, nil
}

// DropPublishedOutboxPartitions drops every range partition of the
// partitioned outbox whose range is over and whose rows were all
// published more than olderThan ago (an empty one included), and returns
// their names. A partition holding an unpublished row, quarantined or in
// line, is never dropped. Each drop checks and drops in one transaction
// that first locks the outbox table ACCESS EXCLUSIVE (parent first, the
// order writers lock in), so a row committed into the partition by a
// transaction that was open when its range ended is seen; the lock waits
// at most the maintenance lock timeout ([WithMaintenanceLockTimeout]) and
// a busy table is tried again on the next pass. Writers wait at most that
// long plus the two index probes of the check and the drop.
func (s *Store) DropPublishedOutboxPartitions(ctx context.Context, olderThan time.Duration) ([]string, error) {
	parts, err := s.OutboxPartitions(ctx)
	if err != nil || len(parts) == 0 {
		return nil, err
	}
	now, err := serverNow(ctx, s.pool)
	if err != nil {
		return nil, s.fail(ctx, "drop outbox partitions", err, true)
	}
	keep := saturating(max(olderThan, 0))
	var dropped []string
	var errs []error
	for _, p := range parts {
		if p.End.After(now) {
			break // the current range and those ahead receive rows
		}
		pq := s.names.qualify(p.Name[len(s.names.prefix):])
		check := `SELECT NOT EXISTS (SELECT 1 FROM ` + pq + ` WHERE published_at IS NULL)
	AND NOT EXISTS (SELECT 1 FROM ` + pq + ` WHERE published_at >= statement_timestamp() - ($1::int8 * interval '1 microsecond'))`
		ok, err := s.dropPartition(ctx, "outbox", s.names.outbox, pq, p.Name, check, keep)
		switch {
		case err != nil:
			errs = append(errs, err)
		case ok:
			dropped = append(dropped, p.Name)
		}
	}
	if len(errs) > 0 {
		return dropped, s.fail(ctx, "drop outbox partitions", errors.Join(errs...), false)
	}
	return dropped, nil
}
