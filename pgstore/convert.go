package pgstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/jackc/pgx/v5"
)

// ConvertOptions tunes [Store.Convert].
type ConvertOptions struct {
	// BatchSize is how many old records one statement moves. Default 5000.
	BatchSize int
	// Pause is the time between two batches, so that claims keep most of
	// the server. Default 0.
	Pause time.Duration
	// OnProgress, if set, is called after every batch.
	OnProgress func(ConvertProgress)
}

// ConvertProgress is what a conversion has done so far.
type ConvertProgress struct {
	// Table is the old table being converted ("records" or "records_p",
	// after the prefix).
	Table string
	// Done is how many of its records have been moved (or dropped,
	// expired) so far; Estimate is how many it held when the conversion
	// started (the planner's estimate: it may be off).
	Done, Estimate int64
}

// ConvertResult says what [Store.Convert] did.
type ConvertResult struct {
	// Moved counts the old records moved to the compact tables; Expired
	// those dropped because the sweeper could have deleted them.
	Moved, Expired int64
	// Batches counts the statements that moved them.
	Batches int
	// Dropped lists the old tables dropped, now empty.
	Dropped []string
	// Pending is true when an old table is still there: a transaction
	// held it past the maintenance lock timeout when it was to be dropped,
	// or rows were locked. Call Convert again.
	Pending bool
}

// Convert moves the records of the tables of schema versions 1-5
// (<prefix>records, <prefix>records_p) into the compact tables of
// migration 0006, in batches, while the store is in use, and then drops
// them. Run it after [Store.Migrate] once every instance runs a version
// of this package with migration 0006 (`dedup migrate` does both): an
// older instance would still write the old table.
//
// Until an old table is gone every claim moves its key's old record first
// (in the same round trip when it can), so an old record is read and
// deduplicated exactly as before, during and after the conversion; a
// batch skips the rows a claim holds (FOR UPDATE SKIP LOCKED) and picks
// them up on a later round. Old records already expired are dropped
// instead of moved. Dropping a table waits at most
// [WithMaintenanceLockTimeout] for its lock; if it cannot, the result
// says Pending and the next call finishes.
func (s *Store) Convert(ctx context.Context, opts ConvertOptions) (ConvertResult, error) {
	var res ConvertResult
	if opts.BatchSize == 0 {
		opts.BatchSize = 5000
	}
	if opts.BatchSize < 0 {
		return res, argErr("convert batch size", "must be positive")
	}
	if err := s.begin(ctx, "convert"); err != nil {
		return res, err
	}
	for _, t := range []struct {
		name, table string
		move        func(context.Context, *ConvertResult, ConvertOptions, *ConvertProgress) error
	}{
		{"records", s.names.legacy, s.convertPlain},
		{"records_p", s.names.legacyP, s.convertPartitioned},
	} {
		var est float64
		var exists bool
		err := s.pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL,
	COALESCE((SELECT sum(GREATEST(c.reltuples, 0)) FROM pg_class c WHERE c.oid = to_regclass($1)
		OR c.oid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = to_regclass($1))), 0)`, t.table).Scan(&exists, &est)
		if err != nil {
			return res, s.fail(ctx, "convert", err, true)
		}
		if !exists {
			continue
		}
		p := ConvertProgress{Table: t.name, Estimate: int64(est)}
		// Rows a claim held are skipped by a round; the next round finds
		// them. A few rounds, then the table is left for the next call.
		for round := 0; round < 5; round++ {
			if err := t.move(ctx, &res, opts, &p); err != nil {
				return res, err
			}
			var left bool
			if err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+t.table+`)`).Scan(&left); err != nil {
				return res, s.fail(ctx, "convert", err, true)
			}
			if !left {
				break
			}
		}
		dropped, err := s.dropOld(ctx, t.table)
		if err != nil {
			return res, err
		}
		if dropped {
			res.Dropped = append(res.Dropped, s.names.prefix+t.name)
		} else {
			res.Pending = true
		}
	}
	return res, nil
}

// convertPlain moves the plain table's rows in ctid order, one batch a
// statement, from the block where the last batch ended.
func (s *Store) convertPlain(ctx context.Context, res *ConvertResult, opts ConvertOptions, p *ConvertProgress) error {
	q := `WITH d AS (
	DELETE FROM ` + s.names.legacy + ` WHERE ctid = ANY (ARRAY(
		SELECT ctid FROM ` + s.names.legacy + ` WHERE ctid >= ('(' || $2::int8 || ',0)')::tid LIMIT $1 FOR UPDATE SKIP LOCKED))
	RETURNING *, ctid AS c),
ins AS (
	INSERT INTO ` + s.names.records + ` (deadline, scope, attempts, state, token, id, fingerprint, result)
	SELECT CASE WHEN d.state = 2 THEN d.expires_at ELSE d.lease_until END, ` + s.names.qualify("scope_id") + `(d.scope), d.attempts, d.state, d.token,
		` + s.names.qualify("key_id") + `(d.id), ` + s.names.qualify("fp_digest") + `(d.fingerprint), d.result
	FROM d WHERE d.expires_at > ` + now + `
	ON CONFLICT (scope, id) DO NOTHING
	RETURNING 1)
SELECT count(*), (SELECT count(*) FROM d WHERE d.expires_at <= ` + now + `), COALESCE(max((c::text::point)[0])::int8, 0) FROM d`
	var block int64
	for {
		var n, gone int64
		if err := s.pool.QueryRow(ctx, q, opts.BatchSize, block).Scan(&n, &gone, &block); err != nil {
			return s.failAuto(ctx, "convert", err)
		}
		if n == 0 {
			return nil
		}
		res.Batches++
		res.Moved += n - gone
		res.Expired += gone
		p.Done += n
		if opts.OnProgress != nil {
			opts.OnProgress(*p)
		}
		if err := pause(ctx, opts.Pause); err != nil {
			return s.fail(ctx, "convert", err, true)
		}
	}
}

// convertPartitioned moves the partitioned table's rows partition by
// partition: it reads a batch of keys in ctid order, then moves them with
// adopt_p under their advisory locks (taken in order, as a claim batch
// takes them), in one transaction.
func (s *Store) convertPartitioned(ctx context.Context, res *ConvertResult, opts ConvertOptions, p *ConvertProgress) error {
	rows, err := s.pool.Query(ctx, `SELECT c.oid::regclass::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass($1) ORDER BY 1`, s.names.legacyP)
	if err != nil {
		return s.fail(ctx, "convert", err, true)
	}
	parts, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return s.fail(ctx, "convert", err, true)
	}
	for _, part := range parts {
		// The cursor is the last row read: a row adopt_p could not move
		// is not read again in this round.
		var block, off int64
		for {
			rows, err := s.pool.Query(ctx, `SELECT scope, id, (ctid::text::point)[0]::int8, (ctid::text::point)[1]::int8, expires_at <= `+now+` FROM `+part+`
WHERE ctid > ('(' || $2::int8 || ',' || $3::int8 || ')')::tid LIMIT $1`, opts.BatchSize, block, off)
			if err != nil {
				return s.fail(ctx, "convert", err, true)
			}
			var keys []dedup.Key
			var gone int64
			for rows.Next() {
				var k dedup.Key
				var b, o int64
				var expired bool
				if err := rows.Scan(&k.Scope, &k.ID, &b, &o, &expired); err != nil {
					rows.Close()
					return s.fail(ctx, "convert", err, true)
				}
				keys = append(keys, k)
				if b > block || b == block && o > off {
					block, off = b, o
				}
				if expired {
					gone++
				}
			}
			if err := rows.Err(); err != nil {
				return s.fail(ctx, "convert", err, true)
			}
			if len(keys) == 0 {
				break
			}
			slices.SortFunc(keys, func(a, b dedup.Key) int {
				if c := compareStrings(a.Scope, b.Scope); c != 0 {
					return c
				}
				return compareStrings(a.ID, b.ID)
			})
			keys = slices.Compact(keys)
			locks := make([]int64, len(keys))
			scopes, ids := make([]string, len(keys)), make([]string, len(keys))
			for i, k := range keys {
				locks[i], scopes[i], ids[i] = s.keyLock(k), k.Scope, k.ID
			}
			slices.Sort(locks)
			locks = slices.Compact(locks)
			err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, s.sql.lockMany, locks); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, s.sql.pAdopt, scopes, ids)
				return err
			})
			if err != nil {
				return s.fail(ctx, "convert", err, false)
			}
			n := int64(len(keys))
			res.Batches++
			res.Moved += n - gone
			res.Expired += gone
			p.Done += n
			if opts.OnProgress != nil {
				opts.OnProgress(*p)
			}
			if err := pause(ctx, opts.Pause); err != nil {
				return s.fail(ctx, "convert", err, true)
			}
		}
	}
	return nil
}

func compareStrings(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

var errOldTableNotEmpty = errors.New("old records table not empty")

// dropOld drops an old table once it is empty, under an exclusive lock
// taken within the maintenance lock timeout. It reports false when the
// table could not be dropped yet (busy, or rows left).
func (s *Store) dropOld(ctx context.Context, table string) (bool, error) {
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = `+sqlLiteral(itoa(int(s.cfg.lockTimeout.Milliseconds()))+"ms")); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `LOCK TABLE `+table+` IN ACCESS EXCLUSIVE MODE`); err != nil {
			return err
		}
		var left bool
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+table+`)`).Scan(&left); err != nil {
			return err
		}
		if left {
			return errOldTableNotEmpty
		}
		_, err := tx.Exec(ctx, `DROP TABLE `+table)
		return err
	})
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, errOldTableNotEmpty):
		return false, nil
	case isLockTimeout(err):
		s.logger().InfoContext(ctx, "dedup old records table busy; call Convert again to drop it", "table", table,
			"lock_timeout", s.cfg.lockTimeout.String())
		return false, nil
	}
	return false, s.fail(ctx, "convert", fmt.Errorf("drop %s: %w", table, err), false)
}

func pause(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	return wallClock{}.Sleep(ctx, d)
}
