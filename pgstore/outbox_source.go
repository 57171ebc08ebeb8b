package pgstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/outbox"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// OutboxSource is the store's outbox table as an [outbox.Source] for
// [outbox.NewRelay]: partitions of the aggregate key's hash
// (hashtextextended(aggregate, 0) mod N), leases in
// <prefix>outbox_leases with a fencing epoch, relays alive in
// <prefix>outbox_relays. Get one with [Store.OutboxSource].
type OutboxSource struct {
	s      *Store
	n      int
	delete bool
	sql    outboxSQL
	mode   []any // perExecution, before the arguments of the array mark and fail

	mu      sync.Mutex // CreateIndex
	imu     sync.Mutex // indexed, partsAt (never held across a build)
	indexed bool       // CreateIndex built the partition index
	partsAt time.Time  // when Prune last kept the time partitions
}

type outboxSQL struct {
	join, leave, acquire, release, fetch, fetchPlain, mark, markBits, owned, fail string
}

// shaped is sent before the read, in the same batch (one implicit
// transaction: see fetch), and as shapedMark before the bitmap mark:
// planner settings under which their plans can only take the shape that stops after a batch (an index
// range in id order: no sequential scan, no bitmap scan, no sort, no JIT),
// and a generic plan, made once per connection and kept by PostgreSQL's
// plan cache while the pool caches the statement (pgx's default mode).
// set_config(..., true) lasts until the end of the transaction: the
// pooled session keeps its own settings. Every execution of the two
// statements, hence every (re)planning of them (after an ANALYZE or a
// VACUUM of the table invalidates the plan), happens under these
// settings: a plan made while the outbox was empty cannot walk the table
// once a backlog arrives, which per-execution planning (d9bf376) guarded
// against at a cost of ~0.2-0.3 ms of planning a read and a mark
// (docs/benchmarks.md, the Kafka relay).
const shaped = `SELECT set_config('enable_seqscan', 'off', true), set_config('enable_bitmapscan', 'off', true), set_config('enable_sort', 'off', true), set_config('jit', 'off', true), set_config('plan_cache_mode', 'force_generic_plan', true)`

// shapedMark is shaped for the bitmap mark, planned at each execution
// (force_custom_plan): a generic plan of the mark made while the table's
// statistics say it is empty or small (a vacuumed outbox whose relay
// keeps up, WithOutboxDeletePublished) prices every index range at one
// row and kept the first index that serves the id range, the
// unpublished rows' (id) index: a mark then read every unpublished row
// of every partition between the batch's lowest and highest id (1,481
// entries for a batch of 100 over 16 partitions, against 100 in the
// partition index) until an ANALYZE made it replan. Planned with the
// batch's bounds, it takes the partition index's range.
var shapedMark = strings.Replace(shaped, "force_generic_plan", "force_custom_plan", 1)

// markBitsMax: a mark sends its ids as a bitmap over [lowest, highest]
// when that range holds at most this many ids per id marked (16
// partitions spread a batch over ~16 times its size); else as an array.
const markBitsMax = 256

// fetchRoom: the most messages a read makes room for before it has them
// (the relay's largest batch); a larger read grows its slice.
const fetchRoom = 10000

var (
	_ outbox.Source     = (*OutboxSource)(nil)
	_ outbox.Notifier   = (*OutboxSource)(nil)
	_ outbox.Pruner     = (*OutboxSource)(nil)
	_ outbox.Prefetcher = (*OutboxSource)(nil)
)

// An OutboxOption configures [Store.OutboxSource].
type OutboxOption interface{ applyOutbox(*OutboxSource) }

type outboxOptionFunc func(*OutboxSource)

func (f outboxOptionFunc) applyOutbox(o *OutboxSource) { f(o) }

// WithOutboxPartitions splits the key space into n partitions (1 to
// 4096), the unit a relay leases. Default 16. Every relay of one outbox
// must use the same n: a relay refuses to join while relays with another
// n are alive.
func WithOutboxPartitions(n int) OutboxOption {
	return outboxOptionFunc(func(o *OutboxSource) { o.n = n })
}

// WithOutboxDeletePublished makes marking delete the published rows
// instead of setting their published_at. Default: keep them for
// [OutboxSource.Prune] to delete after a retention.
func WithOutboxDeletePublished() OutboxOption {
	return outboxOptionFunc(func(o *OutboxSource) { o.delete = true })
}

// OutboxSource returns the outbox table as a relay's source. A bad
// option is an [*dedup.ArgumentError].
func (s *Store) OutboxSource(opts ...OutboxOption) (*OutboxSource, error) {
	o := &OutboxSource{s: s, n: 16}
	for _, opt := range opts {
		if opt != nil {
			opt.applyOutbox(o)
		}
	}
	if o.n < 1 || o.n > 4096 {
		return nil, &dedup.ArgumentError{Arg: "outbox partitions", Reason: "must be between 1 and 4096, got " + itoa(o.n)}
	}
	o.sql = s.outboxSQL(o.delete, o.n)
	o.mode = perExecution(s.pool)
	return o, nil
}

// perExecution returns the mode in which the relay's sparse marks (see
// markBitsMax) and its failures are sent so that PostgreSQL plans each
// execution with its own argument values and the table's size at that
// moment, or nil when the pool's default already does. (The read and the
// bitmap mark are planned under settings that fix their shape instead:
// see shaped and shapedMark.) pgx's default mode prepares each statement by name
// once per connection, and after five executions PostgreSQL may keep a
// generic plan: one made while the outbox was empty (a relay polls an
// idle outbox many times, and a VACUUM of the empty table sets its size to
// zero pages) walks the whole table for each row it reads once a backlog
// arrives, which made one read of a 50,000-row backlog run for minutes.
// The unnamed statement of QueryExecModeCacheDescribe is planned at each
// execution, in the same round trip; planning costs tens of microseconds
// per batch.
func perExecution(pool *pgxpool.Pool) []any {
	cc := pool.Config().ConnConfig
	if cc.DefaultQueryExecMode != pgx.QueryExecModeCacheStatement {
		return nil // the other modes use the unnamed statement already
	}
	if cc.DescriptionCacheCapacity == 0 {
		return []any{pgx.QueryExecModeDescribeExec}
	}
	return []any{pgx.QueryExecModeCacheDescribe}
}

// args puts o.mode before a statement's arguments.
func (o *OutboxSource) args(a ...any) []any {
	return append(o.mode[:len(o.mode):len(o.mode)], a...)
}

// The partition of a row, by the hash of its aggregate key.
const partExpr = `((hashtextextended(o.aggregate, 0) & 9223372036854775807) % $1::int8)::int`

// partOf is the partition expression with n written out, as the
// partition index of n partitions has it.
func partOf(n int) string {
	return `((hashtextextended(aggregate, 0) & 9223372036854775807) % ` + itoa(n) + `)`
}

// CreateIndex creates, if missing, the index of the unpublished rows by
// partition and id for this N, CONCURRENTLY (writers are not blocked):
// with it a read of a partition is one index range in id order; without
// it the relay walks the unpublished rows in id order and filters them,
// which costs about N times more per row. A concurrent build waits for
// the transactions open when it starts (a long transaction delays it), so
// run it at deployment (`dedup relay` runs it in the background at start).
// Relays with another N need their own index ("<prefix>outbox_part<N>");
// an unused one can be dropped by hand.
func (o *OutboxSource) CreateIndex(ctx context.Context) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.imu.Lock()
	done := o.indexed
	o.imu.Unlock()
	if done {
		return nil
	}
	name := pgx.Identifier{o.s.names.prefix + "outbox_part" + itoa(o.n)}.Sanitize()
	cols := ` (` + partOf(o.n) + `, id) WHERE published_at IS NULL AND quarantined_at IS NULL`
	every, err := o.s.OutboxPartitioning(ctx)
	if err != nil {
		return err
	}
	if every > 0 {
		return o.createPartitionedIndex(ctx, name, cols)
	}
	_, err = o.s.pool.Exec(ctx, `CREATE INDEX CONCURRENTLY IF NOT EXISTS `+name+` ON `+o.s.names.outbox+cols)
	if err != nil {
		return o.s.failAuto(ctx, "outbox index", err)
	}
	o.setIndexed()
	return nil
}

func (o *OutboxSource) setIndexed() {
	o.imu.Lock()
	o.indexed = true
	o.imu.Unlock()
}

// createPartitionedIndex builds the partition index on a time-partitioned
// outbox without blocking writers: an index on the parent only (invalid
// until complete), one built CONCURRENTLY on each partition and attached
// to it; ranges created later get theirs with their table.
func (o *OutboxSource) createPartitionedIndex(ctx context.Context, name, cols string) error {
	ob := o.s.names.outbox
	if _, err := o.s.pool.Exec(ctx, `CREATE INDEX IF NOT EXISTS `+name+` ON ONLY `+ob+cols); err != nil {
		return o.s.failAuto(ctx, "outbox index", err)
	}
	rows, err := o.s.pool.Query(ctx, `SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass($1) AND NOT EXISTS (SELECT 1 FROM pg_inherits ii JOIN pg_index x ON x.indexrelid = ii.inhrelid
	WHERE ii.inhparent = to_regclass($2) AND x.indrelid = c.oid)`, ob, o.s.names.qualify("outbox_part"+itoa(o.n)))
	if err != nil {
		return o.s.failAuto(ctx, "outbox index", err)
	}
	parts, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return o.s.failAuto(ctx, "outbox index", err)
	}
	for _, p := range parts {
		idx := pgx.Identifier{p + "_part" + itoa(o.n)}.Sanitize()
		pq := pgx.Identifier{o.s.names.schemaName, p}.Sanitize()
		if _, err := o.s.pool.Exec(ctx, `CREATE INDEX CONCURRENTLY IF NOT EXISTS `+idx+` ON `+pq+cols); err != nil {
			return o.s.failAuto(ctx, "outbox index", err)
		}
		if _, err := o.s.pool.Exec(ctx, `ALTER INDEX `+o.s.names.qualify("outbox_part"+itoa(o.n))+` ATTACH PARTITION `+
			pgx.Identifier{o.s.names.schemaName, p + "_part" + itoa(o.n)}.Sanitize()); err != nil {
			return o.s.failAuto(ctx, "outbox index", err)
		}
	}
	o.setIndexed()
	return nil
}

func (s *Store) outboxSQL(del bool, n int) outboxSQL {
	ob, leases, relays := s.names.outbox, s.names.qualify("outbox_leases"), s.names.qualify("outbox_relays")
	now := `statement_timestamp()`
	usec := func(p string) string { return `(` + p + `::int8 * interval '1 microsecond')` }
	// held locks the lease row of the caller's partition and epoch FOR
	// SHARE: a concurrent take-over (an UPDATE of that row) waits for
	// this statement, or this statement, re-reading the row after the
	// take-over committed, finds another epoch and changes nothing.
	held := `held AS (SELECT 1 FROM ` + leases + ` WHERE part = $1::int AND owner = $2::text AND epoch = $3::int8 FOR SHARE)`
	// The read's rows: the partition's unpublished, unquarantined rows
	// in id order; a row waits behind a quarantined row of its key
	// (unless $3); the per-row probe of the quarantine index runs only
	// when the index holds a row (one probe of it per read, q0):
	// probing the empty index for each row was half of a read's time.
	// q0 is an InitPlan, evaluated at each execution.
	readFrom := `
FROM ` + ob + ` o
WHERE o.published_at IS NULL AND o.quarantined_at IS NULL AND ` + strings.ReplaceAll(partOf(n), "aggregate", "o.aggregate") + ` = $1::int8
	AND ($3::bool OR NOT EXISTS (SELECT 1 FROM ` + ob + ` q0 WHERE q0.quarantined_at IS NOT NULL AND q0.published_at IS NULL)
		OR NOT EXISTS (SELECT 1 FROM ` + ob + ` q
		WHERE q.aggregate = o.aggregate AND q.quarantined_at IS NOT NULL AND q.published_at IS NULL AND q.id < o.id))
ORDER BY o.id
LIMIT $2::int`
	markSet := `UPDATE ` + ob + ` o SET published_at = ` + now + `, next_attempt_at = NULL`
	if del {
		markSet = `DELETE FROM ` + ob + ` o`
	}
	return outboxSQL{
		join: `WITH up AS (
	INSERT INTO ` + relays + ` (relay, partitions, expires_at) VALUES ($1::text, $2::int, ` + now + ` + ` + usec("$3") + `)
	ON CONFLICT (relay) DO UPDATE SET partitions = EXCLUDED.partitions, expires_at = EXCLUDED.expires_at
	RETURNING 1),
gone AS (DELETE FROM ` + relays + ` WHERE expires_at < ` + now + ` - interval '1 day' RETURNING 1)
SELECT count(*) FILTER (WHERE partitions = $2::int), count(*) FILTER (WHERE partitions <> $2::int)
FROM ` + relays + ` WHERE relay <> $1::text AND expires_at > ` + now,
		leave: `WITH r AS (DELETE FROM ` + relays + ` WHERE relay = $1::text RETURNING 1)
UPDATE ` + leases + ` SET owner = '', expires_at = '-infinity' WHERE owner = $1::text`,
		acquire: `INSERT INTO ` + leases + ` AS l (part, partitions, owner, epoch, expires_at)
VALUES ($1::int, $2::int, $3::text, 1, ` + now + ` + ` + usec("$4") + `)
ON CONFLICT (part) DO UPDATE SET
	partitions = EXCLUDED.partitions,
	epoch = CASE WHEN l.owner = EXCLUDED.owner THEN l.epoch ELSE l.epoch + 1 END,
	owner = EXCLUDED.owner,
	expires_at = EXCLUDED.expires_at
WHERE l.owner = EXCLUDED.owner OR l.expires_at <= ` + now + `
RETURNING epoch, expires_at`,
		release: `UPDATE ` + leases + ` SET owner = '', expires_at = '-infinity' WHERE part = $1::int AND owner = $2::text AND epoch = $3::int8`,
		// The read under a batch in flight (FetchNext): rows with id <=
		// $4 come without their body (they are the batch in flight, or
		// late rows that only cut their keys).
		fetch: `SELECT o.id, o.aggregate, o.id <= $4::int8,
	CASE WHEN o.id > $4::int8 THEN o.message_key ELSE '' END,
	CASE WHEN o.id > $4::int8 THEN o.topic ELSE '' END,
	CASE WHEN o.id > $4::int8 THEN o.payload END,
	CASE WHEN o.id > $4::int8 THEN o.headers::text ELSE '{}' END,
	o.created_at, o.attempts, COALESCE(o.next_attempt_at > ` + now + `, false)` + readFrom,
		// The plain read (Fetch), the relay's read when it holds many
		// partitions: every row with its body, the headers as they are
		// (no per-row CASE, no cast to text; the CASEs and the cast were
		// about 40% of the read's executor time: docs/benchmarks.md, the
		// Kafka relay).
		fetchPlain: `SELECT o.id, o.aggregate, o.message_key, o.topic, o.payload, o.headers,
	o.created_at, o.attempts, COALESCE(o.next_attempt_at > ` + now + `, false)` + readFrom,
		// The mark finds the batch's rows in the partition index's range
		// from the batch's lowest id ($5) to its highest ($6), one scan,
		// rather than one primary-key descent per id; the predicates the
		// partition index needs (the partition, unquarantined) hold for
		// every row of a batch: the relay read them so, and only the
		// holder of the partition's lease quarantines its rows. An id of
		// another partition is not marked. It is a plain DELETE or UPDATE,
		// which plans faster than one wrapped to report the lease (planned
		// per execution, see perExecution): a mark that changes every row
		// of its batch held the lease; one that changes fewer asks the
		// lease table afterwards (owned).
		mark: `WITH ` + held + `
` + markSet + ` WHERE ` + strings.ReplaceAll(partOf(n), "aggregate", "o.aggregate") + ` = ($1::int)::int8
	AND o.id >= $5::int8 AND o.id <= $6::int8 AND o.id = ANY($4::int8[])
	AND o.published_at IS NULL AND o.quarantined_at IS NULL AND EXISTS (SELECT 1 FROM held)`,
		// markBits is mark with the ids as a bitmap ($4: bit k, counted
		// as get_bit does, set for id $5 + k): a bit per id of the
		// range rather than 8 bytes per id, tested in constant time (a
		// generic plan would test an array parameter by a linear search
		// per row; the mark is planned per execution, see shapedMark,
		// where an array constant is hashed). The CASE keeps get_bit
		// inside its range whatever order the planner gives the quals.
		markBits: `WITH ` + held + `
` + markSet + ` WHERE ` + strings.ReplaceAll(partOf(n), "aggregate", "o.aggregate") + ` = ($1::int)::int8
	AND o.id >= $5::int8 AND o.id <= $6::int8
	AND CASE WHEN o.id >= $5::int8 AND o.id <= $6::int8 THEN get_bit($4::bytea, (o.id - $5::int8)::int) = 1 ELSE false END
	AND o.published_at IS NULL AND o.quarantined_at IS NULL AND EXISTS (SELECT 1 FROM held)`,
		// Whether the lease of epoch $3 is the caller's now. Epochs only
		// grow and a release or take-over changes the owner or the
		// epoch: if it is, it was at the mark before.
		owned: `SELECT EXISTS (SELECT 1 FROM ` + leases + ` WHERE part = $1::int AND owner = $2::text AND epoch = $3::int8)`,
		fail: `WITH ` + held + `,
f AS (SELECT * FROM unnest($4::int8[], $5::text[], $6::int8[], $7::bool[]) AS f(id, err, delay, q)),
done AS (UPDATE ` + ob + ` o SET attempts = o.attempts + 1, last_error = f.err,
	next_attempt_at = ` + now + ` + ` + usec("f.delay") + `,
	quarantined_at = CASE WHEN f.q THEN ` + now + ` END
FROM f WHERE o.id = f.id AND o.published_at IS NULL AND EXISTS (SELECT 1 FROM held) RETURNING 1)
SELECT EXISTS (SELECT 1 FROM held), (SELECT count(*) FROM done)`,
	}
}

// Partitions implements [outbox.Source].
func (o *OutboxSource) Partitions() int { return o.n }

// Join implements [outbox.Source]. It fails when relays with another
// partition count are alive.
func (o *OutboxSource) Join(ctx context.Context, relay string, ttl time.Duration) (int, error) {
	if err := o.s.begin(ctx, "outbox join"); err != nil {
		return 0, err
	}
	var same, other int
	if err := o.s.pool.QueryRow(ctx, o.sql.join, relay, o.n, saturating(ttl)).Scan(&same, &other); err != nil {
		return 0, o.s.failAuto(ctx, "outbox join", err)
	}
	if other > 0 {
		return 0, fmt.Errorf("pgstore: outbox relay %s with %d partitions: %d %w", relay, o.n, other, outbox.ErrPartitionMismatch)
	}
	return same + 1, nil
}

// Leave implements [outbox.Source].
func (o *OutboxSource) Leave(ctx context.Context, relay string) error {
	if err := o.s.begin(ctx, "outbox leave"); err != nil {
		return err
	}
	if _, err := o.s.pool.Exec(ctx, o.sql.leave, relay); err != nil {
		return o.s.failAuto(ctx, "outbox leave", err)
	}
	return nil
}

// Acquire implements [outbox.Source].
func (o *OutboxSource) Acquire(ctx context.Context, relay string, p int, ttl time.Duration) (outbox.Lease, bool, error) {
	l := outbox.Lease{Partition: p, Owner: relay}
	if p < 0 || p >= o.n {
		return l, false, &dedup.ArgumentError{Arg: "outbox partition", Reason: "out of range: " + itoa(p)}
	}
	if err := o.s.begin(ctx, "outbox acquire"); err != nil {
		return l, false, err
	}
	err := o.s.pool.QueryRow(ctx, o.sql.acquire, p, o.n, relay, saturating(ttl)).Scan(&l.Epoch, &l.Until)
	if errors.Is(err, pgx.ErrNoRows) {
		return l, false, nil
	}
	if err != nil {
		return l, false, o.s.failAuto(ctx, "outbox acquire", err)
	}
	return l, true, nil
}

// Release implements [outbox.Source].
func (o *OutboxSource) Release(ctx context.Context, l outbox.Lease) error {
	if err := o.s.begin(ctx, "outbox release"); err != nil {
		return err
	}
	if _, err := o.s.pool.Exec(ctx, o.sql.release, l.Partition, l.Owner, l.Epoch); err != nil {
		return o.s.failAuto(ctx, "outbox release", err)
	}
	return nil
}

// Fetch implements [outbox.Source].
func (o *OutboxSource) Fetch(ctx context.Context, l outbox.Lease, limit int, skipBlocked bool) ([]outbox.Message, error) {
	return o.fetch(ctx, l, nil, limit, skipBlocked)
}

// FetchNext implements [outbox.Prefetcher]: the same read as Fetch, in
// which the rows up to inflight's last Seq come without their bodies;
// those of inflight are passed over, any other one (committed late, or
// waiting for its retry time) cuts its key.
func (o *OutboxSource) FetchNext(ctx context.Context, l outbox.Lease, inflight []outbox.Message, limit int, skipBlocked bool) ([]outbox.Message, error) {
	return o.fetch(ctx, l, inflight, limit, skipBlocked)
}

func (o *OutboxSource) fetch(ctx context.Context, l outbox.Lease, inflight []outbox.Message, limit int, skipBlocked bool) ([]outbox.Message, error) {
	if err := o.s.begin(ctx, "outbox fetch"); err != nil {
		return nil, err
	}
	// Without a batch in flight the plain read (fetchPlain) serves.
	plain := len(inflight) == 0
	stmt, args := o.sql.fetchPlain, []any{l.Partition, limit, skipBlocked}
	if !plain {
		stmt, args = o.sql.fetch, []any{l.Partition, limit + len(inflight), skipBlocked, inflight[len(inflight)-1].Seq}
	}
	// The read runs after settings that make its plan the one that stops
	// after limit rows, in the same round trip (shaped). Planner settings
	// cannot be given inside the statement they plan, so they take a
	// statement of their own; set_config(..., true) lasts until the end
	// of the transaction, and the statements of a batch, sent with one
	// Sync (or, over the simple protocol, as one query string), are one
	// implicit transaction in every pgx query mode: no BEGIN and COMMIT
	// are needed for the settings to stay on this read and off the pooled
	// session. The planner has no statistics on the partition expression
	// (those of the partial partition index are not used for estimates),
	// so it guesses that 0.5% of the table is in the partition, fewer rows
	// than a batch: with bitmap scans allowed it then reads every
	// unpublished row of the partition and sorts them, per read (5-6 ms a
	// read of a 50,000-row backlog of 16 partitions against 0.7 ms for the
	// ordered index range: docs/benchmarks.md, the Kafka relay). Without
	// the partition index ([OutboxSource.CreateIndex]) it would price the
	// scan as a walk of the whole backlog and JIT-compile it: tens of
	// milliseconds per read.
	var b pgx.Batch
	b.Queue(shaped)
	b.Queue(stmt, args...)
	br := o.s.pool.SendBatch(ctx, &b)
	defer br.Close()
	if _, err := br.Exec(); err != nil {
		return nil, o.s.failAuto(ctx, "outbox fetch", err)
	}
	rows, err := br.Query()
	if err != nil {
		return nil, o.s.failAuto(ctx, "outbox fetch", err)
	}
	defer rows.Close()
	// out is made at the first row, with room for the whole batch: a
	// full batch grown from a small slice copied its messages four times.
	// The room is at most fetchRoom messages: a direct caller's limit may
	// be far above the rows there are (math.MaxInt32 made 257 GB).
	var out []outbox.Message
	var later map[string]bool
	cut := func(k []byte) {
		// This key waits: none of its later rows may overtake the row
		// that cut it.
		if later == nil {
			later = map[string]bool{}
		}
		later[string(k)] = true
	}
	next := 0 // the next message of inflight, which is in Seq order
	// The text columns and the payload are scanned as references to the
	// driver's buffer (valid until the next row) and copied out in bulk,
	// not one allocation each a row: the messages' IDs and keys into one
	// string made after the last row (sliced per message, spans), the
	// payloads into shared chunks (each message's slice capped at its
	// own end), one topic string while the rows' topic does not change;
	// headers other than {} are decoded.
	var (
		seq                 int64
		ahead, notDue       bool
		kb, ib, tb, pb, hdr pgtype.DriverBytes
		created             time.Time
		attempts            int
		topic               string
		text, chunk         []byte
		spans               []int // per message: its ID's end, then its key's end, in text
	)
	dest := []any{&seq, &kb, &ib, &tb, &pb, &hdr, &created, &attempts, &notDue}
	if !plain {
		dest = []any{&seq, &kb, &ahead, &ib, &tb, &pb, &hdr, &created, &attempts, &notDue}
	}
	for rows.Next() {
		if err := rows.Scan(dest...); err != nil {
			return nil, o.s.failAuto(ctx, "outbox fetch", err)
		}
		if ahead {
			for next < len(inflight) && inflight[next].Seq < seq {
				next++
			}
			if next < len(inflight) && inflight[next].Seq == seq {
				continue // in flight: it goes before everything read here
			}
			cut(kb) // committed late below the batch, or not due
			continue
		}
		if notDue || later[string(kb)] {
			cut(kb)
			continue
		}
		if len(out) == limit {
			break
		}
		if string(tb) != topic {
			topic = string(tb)
		}
		if out == nil {
			out = make([]outbox.Message, 0, min(limit, fetchRoom))
			spans = make([]int, 0, 2*cap(out))
		}
		text = append(text, ib...)
		spans = append(spans, len(text))
		text = append(text, kb...)
		spans = append(spans, len(text))
		if len(pb) > cap(chunk)-len(chunk) {
			// A new chunk, doubling from 4 KiB up to 64 KiB (a large
			// payload gets one of its own size).
			chunk = make([]byte, 0, max(min(2*cap(chunk), 64<<10), 4<<10, len(pb)))
		}
		at := len(chunk)
		chunk = append(chunk, pb...)
		m := outbox.Message{Seq: seq, Topic: topic, Payload: chunk[at:len(chunk):len(chunk)], CreatedAt: created, Attempts: attempts}
		if m.Payload == nil {
			m.Payload = []byte{} // an empty payload before the first chunk
		}
		if string(hdr) != "{}" {
			var h map[string]string
			if err := json.Unmarshal(hdr, &h); err != nil {
				return nil, o.s.failAuto(ctx, "outbox fetch", err)
			}
			m.Headers = h
		}
		out = append(out, m)
	}
	if err := rows.Err(); err != nil {
		return nil, o.s.failAuto(ctx, "outbox fetch", err)
	}
	if out == nil {
		return []outbox.Message{}, nil
	}
	all, from := string(text), 0
	for i := range out {
		out[i].ID, out[i].Key = all[from:spans[2*i]], all[spans[2*i]:spans[2*i+1]]
		from = spans[2*i+1]
	}
	return out, nil
}

// Mark implements [outbox.Source]: one statement, fenced by the lease's
// epoch. It marks only rows of the lease's partition.
func (o *OutboxSource) Mark(ctx context.Context, l outbox.Lease, seqs []int64) error {
	if len(seqs) == 0 {
		return nil
	}
	if err := o.s.begin(ctx, "outbox mark"); err != nil {
		return err
	}
	lo, hi := seqs[0], seqs[0]
	for _, q := range seqs[1:] {
		lo, hi = min(lo, q), max(hi, q)
	}
	var tag pgconn.CommandTag
	var err error
	if bits := markBitmap(seqs, lo, hi); bits != nil {
		// Planned under shapedMark, in one round trip.
		var b pgx.Batch
		b.Queue(shapedMark)
		b.Queue(o.sql.markBits, l.Partition, l.Owner, l.Epoch, bits, lo, hi)
		br := o.s.pool.SendBatch(ctx, &b)
		if _, err = br.Exec(); err == nil {
			tag, err = br.Exec()
		}
		if cerr := br.Close(); err == nil {
			err = cerr
		}
	} else {
		// A sparse batch (many partitions): the ids as an array, the
		// statement planned at each execution (see perExecution).
		tag, err = o.s.pool.Exec(ctx, o.sql.mark, o.args(l.Partition, l.Owner, l.Epoch, seqs, lo, hi)...)
	}
	if err != nil {
		return o.s.failAuto(ctx, "outbox mark", err)
	}
	if tag.RowsAffected() == int64(len(seqs)) {
		return nil // the statement changed rows only under the lease
	}
	// Some rows were not changed: already marked (a mark retried after
	// an unknown outcome, an operator's drop), of another partition, or
	// the lease was lost.
	var held bool
	if err := o.s.pool.QueryRow(ctx, o.sql.owned, l.Partition, l.Owner, l.Epoch).Scan(&held); err != nil {
		return o.s.failAuto(ctx, "outbox mark", err)
	}
	if !held {
		return outbox.ErrLeaseLost
	}
	return nil
}

// markBitmap returns seqs as the bitmap of markBits over [lo, hi] (bit
// k of byte k/8, least significant first, for id lo+k), or nil when the
// range holds more than markBitsMax ids per id of seqs or when its bit
// numbers do not fit the int markBits casts them to (a mark of more than
// 2^31 / markBitsMax ids).
func markBitmap(seqs []int64, lo, hi int64) []byte {
	span := uint64(hi - lo) // hi >= lo: ids as far apart as int64 allows fit
	if span >= uint64(markBitsMax)*uint64(len(seqs)) || span > math.MaxInt32 {
		return nil
	}
	bits := make([]byte, span/8+1)
	for _, q := range seqs {
		k := uint64(q - lo)
		bits[k/8] |= 1 << (k % 8)
	}
	return bits
}

// Fail implements [outbox.Source]: one statement, fenced like Mark.
func (o *OutboxSource) Fail(ctx context.Context, l outbox.Lease, fs []outbox.Failure) error {
	if len(fs) == 0 {
		return nil
	}
	if err := o.s.begin(ctx, "outbox fail"); err != nil {
		return err
	}
	ids, errs, delays, qs := make([]int64, len(fs)), make([]string, len(fs)), make([]int64, len(fs)), make([]bool, len(fs))
	for i, f := range fs {
		ids[i], errs[i], delays[i], qs[i] = f.Seq, f.Err, saturating(max(f.RetryAfter, 0)), f.Quarantine
	}
	var held bool
	var n int
	if err := o.s.pool.QueryRow(ctx, o.sql.fail, o.args(l.Partition, l.Owner, l.Epoch, ids, errs, delays, qs)...).Scan(&held, &n); err != nil {
		return o.s.failAuto(ctx, "outbox fail", err)
	}
	if !held {
		return outbox.ErrLeaseLost
	}
	return nil
}

// Listen implements [outbox.Notifier]: it LISTENs on [Store.OutboxChannel]
// on a connection of its own and calls wake after each notification, until
// ctx is done or the connection fails. It does not work through a
// transaction-mode pooler (PgBouncer): run the relay poll-only there.
func (o *OutboxSource) Listen(ctx context.Context, wake func()) error {
	if err := o.s.begin(ctx, "outbox listen"); err != nil {
		return err
	}
	conn, err := o.s.pool.Acquire(ctx)
	if err != nil {
		return o.s.fail(ctx, "outbox listen", err, true)
	}
	// The session now listens: never give it back to the pool.
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		conn.Conn().Close(cctx)
		conn.Release()
	}()
	if _, err := conn.Exec(ctx, `LISTEN `+pgx.Identifier{o.s.OutboxChannel()}.Sanitize()); err != nil {
		return o.s.fail(ctx, "outbox listen", err, true)
	}
	wake() // rows may have been written before LISTEN
	// The pool's cancel handling may wait seconds before it interrupts a
	// read; this session is closed anyway, so on ctx done its socket is
	// closed at once.
	stop := context.AfterFunc(ctx, func() { conn.Conn().PgConn().Conn().Close() })
	defer stop()
	for {
		if _, err := conn.Conn().WaitForNotification(context.WithoutCancel(ctx)); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return o.s.fail(ctx, "outbox listen", err, true)
		}
		wake()
	}
}

// Prune implements [outbox.Pruner]: it deletes up to limit rows published
// more than olderThan ago, oldest first, in one statement, and returns how
// many. It never deletes an unpublished row. When the outbox table is
// partitioned by time ([Store.PartitionOutbox]) it first, at most every
// 10 seconds, creates the ranges ahead and drops the partitions whose rows
// were all published more than olderThan ago
// ([Store.DropPublishedOutboxPartitions]; their rows are not counted in
// the result).
func (o *OutboxSource) Prune(ctx context.Context, olderThan time.Duration, limit int) (int, error) {
	if limit <= 0 {
		return 0, &dedup.ArgumentError{Arg: "prune limit", Reason: "must be positive"}
	}
	if err := o.s.begin(ctx, "outbox prune"); err != nil {
		return 0, err
	}
	o.imu.Lock()
	due := time.Since(o.partsAt) >= 10*time.Second
	if due {
		o.partsAt = time.Now()
	}
	o.imu.Unlock()
	if due {
		if _, err := o.s.EnsureOutboxPartitions(ctx); err != nil {
			return 0, err
		}
		if dropped, err := o.s.DropPublishedOutboxPartitions(ctx, olderThan); err != nil {
			return 0, err
		} else if len(dropped) > 0 {
			o.s.logger().InfoContext(ctx, "dedup outbox partitions dropped", "partitions", dropped)
		}
	}
	ob := o.s.names.outbox
	tag, err := o.s.pool.Exec(ctx, `DELETE FROM `+ob+` WHERE id IN (SELECT id FROM `+ob+`
WHERE published_at IS NOT NULL AND published_at < statement_timestamp() - ($1::int8 * interval '1 microsecond')
ORDER BY published_at LIMIT $2::int)`, saturating(max(olderThan, 0)), limit)
	if err != nil {
		return 0, o.s.failAuto(ctx, "outbox prune", err)
	}
	return int(tag.RowsAffected()), nil
}
