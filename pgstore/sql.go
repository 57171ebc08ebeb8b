package pgstore

import (
	"errors"
	"strconv"
	"strings"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/jackc/pgx/v5/pgconn"
)

// statements holds the SQL of every transition, rendered once per store
// with its table names. pgx prepares and caches each on every connection.
type statements struct {
	// Plain records table: one statement each.
	claim, inbox, claimBatch string
	// inboxFast is inbox that writes only when it acquires (DO UPDATE ...
	// WHERE): it returns no row for a key it cannot take, whose row it
	// still locks, and current then reads that row.
	inboxFast, current string
	// Store.Apply's claims, which fail unless they acquire: applyNew
	// inserts a new record storing a result ($6) and fails on any
	// existing one; apply is inboxFast storing a result and failing, with
	// applyCheck, when it cannot take the existing record; pApply is
	// apply on the partitioned table, after the key's lock. applyCurrent
	// reads the record that stopped them and whether it is acquirable.
	applyNew, apply, pApply, applyCurrent string
	// Partitioned table: run after the key's advisory lock (lock or
	// lockMany) in the same transaction, in a later statement so that its
	// snapshot sees every commit made before the lock was granted.
	pClaim, pInbox, pClaimBatch string
	// claimNew: ClaimBatch's fast path for a batch of new keys (see
	// Store.claimNew).
	claimNew       string
	lock, lockMany string
	// Token-fenced transitions, on whichever table the store uses.
	complete, completeBatch, release, extend, inboxResult string
	// inboxResultChecked is inboxResult for a pipeline that commits
	// next: it fails, instead of updating nothing, when the record is
	// not there as the inbox wrote it (see recordCheck).
	inboxResultChecked string
	sweep              string
	outbox             string
	// adopt and pAdopt move old records while a conversion is pending.
	adopt, pAdopt string
	// adoptIDs, pAdoptIDs: adopt and adopt_p given the scope integers too
	// (migration 0008), for every move but Convert's.
	adoptIDs, pAdoptIDs string
}

// now is the statement's time on the server: fixed for the whole
// statement, so every CASE of one upsert agrees, and never the client's.
const now = `statement_timestamp()`

// deadline caps a timestamp expression at dedup.MaxTime, so that a lease
// or retention of "forever" is stored as the latest time every store can
// represent instead of failing or overflowing (micros keeps the sum itself
// within timestamptz's range).
func deadline(expr string) string { return `LEAST(` + expr + `, ` + maxTimestamp + `)` }

// maxTimestamp is dedup.MaxTime as a timestamptz literal, truncated to
// PostgreSQL's microseconds.
var maxTimestamp = sqlLiteral(dedup.MaxTime.Truncate(time.Microsecond).Format("2006-01-02 15:04:05.999999Z07:00")) + `::timestamptz`

// usec turns a microseconds parameter or literal into an interval.
func usec(x string) string { return `(` + x + ` * interval '1 microsecond')` }

// acquirable is the condition under which a claim may take the record r
// for a request with fingerprint fp (a digest, see fpDigest): past its
// deadline, and completed (any fingerprint) or in progress with a
// matching fingerprint (either empty, or equal). For an in-progress record
// the deadline is its lease end, for a completed one its expiry. It reads
// r as it was before the statement changed it.
func acquirable(r, fp string) string {
	return `(` + r + `.deadline <= ` + now + ` AND (` + r + `.state = 2 OR ` + r + `.fingerprint = ''::bytea OR ` + fp + ` = ''::bytea OR ` + r + `.fingerprint = ` + fp + `))`
}

// retentionFor is the retention of a completion in scope (its integer):
// what the caller asked for (param, microseconds), raised to the scope's
// window if it has a longer one.
func retentionFor(n *names, scope, param string) string {
	return `GREATEST(` + usec(param+`::int8`) + `, COALESCE((SELECT w.retention FROM ` + n.retention + ` w JOIN ` + n.scopes + ` s ON s.scope = w.scope WHERE s.id = ` + scope + `), interval '0'))`
}

// kind says which record a claim statement inserts.
type kind struct {
	state    string // "1" lease mode, "2" inbox (completed at once)
	deadline string // the lease end, or the expiry of an inbox record
	result   string // "NULL" but for Apply's record
}

func leaseKind(leaseParam string) kind {
	return kind{state: "1", deadline: deadline(now + ` + ` + usec(leaseParam+`::int8`)), result: "NULL"}
}

func inboxKind(n *names, scope, retentionParam string) kind {
	return kind{state: "2", deadline: deadline(now + ` + ` + retentionFor(n, scope, retentionParam)), result: "NULL"}
}

// applyKind is inboxKind with the result ($6) stored at once.
func applyKind(n *names, scope string) kind {
	k := inboxKind(n, scope, "$5")
	k.result = "$6::bytea"
	return k
}

// upsertSet is the DO UPDATE of a plain-table claim. When the existing
// row r is acquirable every column takes the new record's value (a
// take-over of an in-progress record counts attempt + 1 and keeps its
// fingerprint unless it was empty; a record over a completed one starts
// at attempt 1); otherwise every column keeps its value. PostgreSQL
// evaluates every right-hand side against the row as it was.
func upsertSet() string {
	acq := acquirable("r", "excluded.fingerprint")
	return `ON CONFLICT (scope, id) DO UPDATE SET
	state       = CASE WHEN ` + acq + ` THEN excluded.state ELSE r.state END,
	token       = CASE WHEN ` + acq + ` THEN excluded.token ELSE r.token END,
	fingerprint = CASE WHEN ` + acq + ` AND (r.state = 2 OR r.fingerprint = ''::bytea) THEN excluded.fingerprint ELSE r.fingerprint END,
	result      = CASE WHEN ` + acq + ` THEN excluded.result ELSE r.result END,
	deadline    = CASE WHEN ` + acq + ` THEN excluded.deadline ELSE r.deadline END,
	attempts    = CASE WHEN ` + acq + ` THEN CASE WHEN r.state = 1 THEN r.attempts + 1 ELSE 1 END ELSE r.attempts END`
}

const columns = `(scope, id, state, token, fingerprint, result, deadline, attempts)`

// The columns every claim returns, in the order scanRow reads them: the
// one deadline is both the lease end and the expiry (the state says
// which one the caller reads).
const returning = `state, token, attempts, fingerprint, result, deadline AS lease_until, deadline AS expires_at`

// rReturning is returning for the row alias r.
const rReturning = `r.state, r.token, r.attempts, r.fingerprint, r.result, r.deadline AS lease_until, r.deadline AS expires_at`

// values is the row of columns that a one-key claim of kind k inserts:
// $1 scope (its integer), $2 id (encodeID), $3 token, $4 fingerprint
// digest.
func values(k kind) string {
	return `($1::int4, $2::bytea, ` + k.state + `, $3::bytea, $4::bytea, ` + k.result + `, ` + k.deadline + `, 1)`
}

// plainUpsert is the one statement of a claim or inbox step on the plain
// table: $1 scope, $2 id, $3 token, $4 fingerprint, then the kind's
// parameter ($5: lease or retention in microseconds).
func plainUpsert(n *names, k kind) string {
	return `INSERT INTO ` + n.records + ` AS r ` + columns + `
VALUES ` + values(k) + `
` + upsertSet() + `
RETURNING ` + rReturning
}

// plainAcquire is plainUpsert that updates a conflicting row only when it
// is acquirable, so each column is a plain assignment instead of a CASE
// on that condition. A row it cannot take is locked (ON CONFLICT DO
// UPDATE locks the conflicting row whatever its WHERE says) but not
// returned: read it with the current statement in the same transaction.
func plainAcquire(n *names, k kind) string {
	return plainAcquireReturning(n, k, rReturning)
}

// plainAcquireReturning is plainAcquire returning the columns ret.
func plainAcquireReturning(n *names, k kind, ret string) string {
	return `INSERT INTO ` + n.records + ` AS r ` + columns + `
VALUES ` + values(k) + `
ON CONFLICT (scope, id) DO UPDATE SET
	state       = excluded.state,
	token       = excluded.token,
	fingerprint = CASE WHEN r.state = 2 OR r.fingerprint = ''::bytea THEN excluded.fingerprint ELSE r.fingerprint END,
	result      = excluded.result,
	deadline    = excluded.deadline,
	attempts    = CASE WHEN r.state = 1 THEN r.attempts + 1 ELSE 1 END
WHERE ` + acquirable("r", "excluded.fingerprint") + `
RETURNING ` + ret
}

// plainBatch claims the keys of four parallel arrays ($1 scopes, $2 ids,
// $3 tokens, $4 fingerprints; $5 lease; $6 the batch's token prefix) in
// one statement. The keys must be distinct: PostgreSQL refuses to update
// one row twice in a statement. It inserts in array order, so keys sorted
// by the caller are locked in that order.
//
// Most keys of a batch are new, and all the caller needs to know of a key
// it acquired with attempt 1 is its lease end, the same for every key of
// the statement. Every token of a batch starts with the batch's random
// 8-byte prefix ($6), so a row whose token starts with it was written by
// this statement and acquired. The statement returns the full row only of
// the other keys (held, completed, mismatched, or taken over with attempt
// > 1), and then one summary row (state 0) with the number of keys it
// claimed (attempts) and that lease end (lease_until and expires_at): a
// batch of new keys comes back as one row, and the rows it inserts are
// not copied into the CTE's store (a NULL stands for each).
func plainBatch(n *names, k kind) string {
	easy := `(substr(r.token, 1, 8) = $6::bytea AND r.attempts = 1)`
	// The deadline is the same for every row: an uncorrelated subquery,
	// which the server evaluates once per statement.
	k.deadline = `(SELECT ` + k.deadline + `)`
	return `WITH ins AS (
	INSERT INTO ` + n.records + ` AS r ` + columns + `
	SELECT u.scope, u.id, ` + k.state + `, u.token, u.fp, ` + k.result + `, ` + k.deadline + `, 1
	FROM unnest($1::int4[], $2::bytea[], $3::bytea[], $4::bytea[]) AS u(scope, id, token, fp)
	` + upsertSet() + `
	RETURNING ` + easy + ` AS easy, CASE WHEN ` + easy + ` THEN NULL ELSE r END AS rec)
SELECT (rec).scope, (rec).id, (rec).state, (rec).token, (rec).attempts, (rec).fingerprint, (rec).result, (rec).deadline, (rec).deadline
FROM ins WHERE NOT easy
UNION ALL
SELECT NULL, NULL, 0::int2, NULL, count(*)::int4, NULL, NULL, ` + k.deadline + `, ` + k.deadline + ` FROM ins`
}

// newBatch is claimNew's statement: the INSERT of every key's record of
// kind k, in array order, with no ON CONFLICT clause, so that a stored key
// fails the whole statement ($1 scopes, $2 ids, $3 tokens, $4
// fingerprints, then the kind's parameter), and the one row it returns:
// the deadline of those records (the same for every row: the statement's
// time is fixed). The INSERT is a data-modifying CTE with no RETURNING,
// which the server runs to completion without keeping its rows; the
// deadline is an uncorrelated subquery, evaluated once.
func newBatch(n *names, k kind) string {
	return `WITH ins AS (
	INSERT INTO ` + n.records + ` ` + columns + `
	SELECT u.scope, u.id, ` + k.state + `, u.token, u.fp, ` + k.result + `, (SELECT ` + k.deadline + `), 1
	FROM unnest($1::int4[], $2::bytea[], $3::bytea[], $4::bytea[]) AS u(scope, id, token, fp))
SELECT ` + k.deadline
}

// partitionedUpsert is the claim on the partitioned table, for the keys of
// the CTE source u (scope, id, token, fp). It must run after the advisory
// lock of every key in u, in a later statement of the same READ COMMITTED
// transaction, so that its snapshot sees every commit made before the lock
// was granted: no other claim of these keys can run until it commits.
//
// cur locks the key's current row, wherever its partition; the LATERAL
// join makes it one primary key probe per key and partition, whatever the
// planner thinks of the batch's size. An acquirable
// row is deleted and the new record inserted in the partition of now, so a
// partition only ever receives rows while it is current and every old
// partition drains until it can be dropped. A key with no row gets a new
// one. Rows that are not acquirable come back as they are.
//
// u is empty unless the transaction is READ COMMITTED: under REPEATABLE
// READ the snapshot predates the lock and the check could miss a
// committed row, so the statement then does nothing and the caller
// reports it.
func partitionedUpsert(n *names, k kind, source string) string {
	return partitionedClaim(n, k, source) + `
SELECT scope, id, state, token, attempts, fingerprint, result, lease_until, expires_at FROM ins
UNION ALL
SELECT scope, id, ` + returning + ` FROM cur WHERE NOT acq`
}

// partitionedClaim is partitionedUpsert up to its final SELECT: the CTEs
// cur (the key's current row, locked, and whether it is acquirable) and
// ins (the record inserted when it was).
func partitionedClaim(n *names, k kind, source string) string {
	acq := acquirable("r", "u.fp")
	return `WITH u AS (` + source + `
	WHERE current_setting('transaction_isolation') = 'read committed'),
cur AS (
	SELECT r.scope, r.id, r.created_at, r.state, r.token, r.fingerprint, r.result, r.deadline, r.attempts,
		` + acq + ` AS acq
	FROM u CROSS JOIN LATERAL (
		SELECT * FROM ` + n.recordsP + ` x WHERE x.scope = u.scope AND x.id = u.id FOR UPDATE) r),
del AS (
	DELETE FROM ` + n.recordsP + ` d USING cur
	WHERE cur.acq AND d.scope = cur.scope AND d.id = cur.id AND d.created_at = cur.created_at),
ins AS (
	INSERT INTO ` + n.recordsP + ` (scope, id, state, token, fingerprint, result, deadline, attempts, created_at)
	SELECT u.scope, u.id, ` + k.state + `, u.token,
		CASE WHEN c.state = 1 AND c.fingerprint <> ''::bytea THEN c.fingerprint ELSE u.fp END,
		` + k.result + `, ` + k.deadline + `,
		CASE WHEN c.state = 1 THEN c.attempts + 1 ELSE 1 END,
		` + now + `
	FROM u LEFT JOIN cur c ON c.scope = u.scope AND c.id = u.id
	WHERE c.scope IS NULL OR c.acq
	RETURNING scope, id, ` + returning + `)`
}

// applyCheck is the final SELECT of Apply's claim over the CTE c of the
// rows it inserted or took: the acquired record's attempts, lease_until
// and expires_at, or, when c is empty, an error (see recordCheck for the
// technique) that aborts Apply's transaction block before any of the
// caller's writes runs.
func applyCheck(c string) string {
	return `
SELECT CASE count(*) WHEN 1 THEN min(attempts) ELSE (` + sqlLiteral(applyTaken+": ") + ` || count(*))::int END,
	min(lease_until), min(expires_at)
FROM ` + c
}

const (
	// scalarSource is u for one key: $1 scope, $2 id, $3 token, $4 fp.
	scalarSource = `SELECT $1::int4 AS scope, $2::bytea AS id, $3::bytea AS token, $4::bytea AS fp`
	// arraySource is u for a batch of distinct keys.
	arraySource = `SELECT * FROM unnest($1::int4[], $2::bytea[], $3::bytea[], $4::bytea[]) AS u(scope, id, token, fp)`
)

// recordsFillfactor is the fillfactor of the records tables (migration
// 0006) and of every partition: the room an insert leaves on its page for
// the completion's new version of the row (a HOT update). Chosen by
// measurement (docs/benchmarks.md): a batch completion cannot prune the
// versions it makes dead in its own transaction, so room left for it is
// room lost, and full pages measured smallest after a million claims and
// completions.
const recordsFillfactor = 100

// expired is the condition under which the sweeper may delete a record:
// completed and past its expiry, or in progress and past its lease end
// plus the grace (micros).
func expired(grace int64) string {
	return `((state = 2 AND deadline <= ` + now + `) OR (state = 1 AND deadline <= ` + now + ` - ` + usec(strconv.FormatInt(grace, 10)) + `))`
}

func buildStatements(n *names, cfg *config) statements {
	grace := micros(cfg.grace)
	table := n.records
	if cfg.partition > 0 {
		table = n.recordsP
	}
	st := statements{
		claim:     plainUpsert(n, leaseKind("$5")),
		inbox:     plainUpsert(n, inboxKind(n, "$1::int4", "$5")),
		inboxFast: plainAcquire(n, inboxKind(n, "$1::int4", "$5")),
		applyNew: `INSERT INTO ` + n.records + ` AS r ` + columns + `
VALUES ` + values(applyKind(n, "$1::int4")) + `
ON CONFLICT (scope, id) DO UPDATE SET attempts = (` + sqlLiteral(applyTaken+": ") + ` || r.state)::int
RETURNING r.attempts, r.deadline, r.deadline`,
		apply:        `WITH c AS (` + plainAcquireReturning(n, applyKind(n, "$1::int4"), `r.attempts, r.deadline AS lease_until, r.deadline AS expires_at`) + `)` + applyCheck("c"),
		applyCurrent: `SELECT ` + rReturning + `, ` + acquirable("r", "$3::bytea") + ` FROM ` + table + ` r WHERE r.scope = $1::int4 AND r.id = $2::bytea`,
		pApply:       partitionedClaim(n, applyKind(n, "u.scope"), scalarSource) + applyCheck("ins"),
		current:      `SELECT ` + returning + ` FROM ` + n.records + ` WHERE scope = $1::int4 AND id = $2::bytea`,
		claimBatch:   plainBatch(n, leaseKind("$5")),
		claimNew:     newBatch(n, leaseKind("$5")),
		pClaim:       partitionedUpsert(n, leaseKind("$5"), scalarSource),
		pInbox:       partitionedUpsert(n, inboxKind(n, "u.scope", "$5"), scalarSource),
		pClaimBatch:  partitionedUpsert(n, leaseKind("$5"), arraySource),
		lock:         `SELECT pg_advisory_xact_lock($1::int8)`,
		// The keys come sorted and distinct, so that two batches lock
		// their common keys in the same order and cannot deadlock.
		lockMany: `SELECT count(pg_advisory_xact_lock(k)) FROM unnest($1::int8[]) WITH ORDINALITY AS t(k, o)`,
		// adopt moves the old records of the keys ($1 scopes, $2 ids, in
		// key order) while a conversion is pending; see migration 0006.
		adopt:     `SELECT ` + n.qualify("adopt") + `($1::text[], $2::text[])`,
		pAdopt:    `SELECT ` + n.qualify("adopt_p") + `($1::text[], $2::text[])`,
		adoptIDs:  `SELECT ` + n.qualify("adopt") + `($1::text[], $2::text[], $3::integer[])`,
		pAdoptIDs: `SELECT ` + n.qualify("adopt_p") + `($1::text[], $2::text[], $3::integer[])`,
		// Complete: fenced by the token. A second Complete with the same
		// token matches the row and changes nothing, because the CASEs
		// only write while it is in progress.
		complete: `UPDATE ` + table + ` SET
	result   = CASE WHEN state = 1 THEN $4::bytea ELSE result END,
	deadline = CASE WHEN state = 1 THEN ` + deadline(now+` + `+retentionFor(n, "$1::int4", "$5")) + ` ELSE deadline END,
	state    = 2
WHERE scope = $1::int4 AND id = $2::bytea AND token = $3::bytea`,
		completeBatch: completeBatchSQL(n, table, cfg.partition > 0),
		release:       `DELETE FROM ` + table + ` WHERE scope = $1::int4 AND id = $2::bytea AND token = $3::bytea AND state = 1`,
		extend: `UPDATE ` + table + ` SET deadline = ` + deadline(now+` + `+usec("$4::int8")) + `
WHERE scope = $1::int4 AND id = $2::bytea AND token = $3::bytea AND state = 1
RETURNING deadline`,
		inboxResult: `UPDATE ` + table + ` SET result = $4::bytea WHERE scope = $1::int4 AND id = $2::bytea AND token = $3::bytea AND state = 2`,
		inboxResultChecked: `WITH u AS (
	UPDATE ` + table + ` SET result = $4::bytea WHERE scope = $1::int4 AND id = $2::bytea AND token = $3::bytea AND state = 2
	RETURNING 1)
SELECT CASE count(*) WHEN 1 THEN 1 ELSE (` + sqlLiteral(recordCheck+": ") + ` || count(*) || ' rows')::int END FROM u`,
		outbox: `INSERT INTO ` + n.outbox + ` (message_key, aggregate, topic, payload, headers)
VALUES ($1::text, $2::text, $3::text, $4::bytea, $5::text::jsonb)`,
	}
	// Sweep: one bounded statement that skips rows other transactions hold
	// (a claim about to take one over), so it never waits on a lock and
	// never makes a claim wait long. It reports how many rows it deleted
	// and how late (the lag between each row's expiry and its deletion).
	// The plain table has no expiry index (a completion would then not be
	// a HOT update): a pass walks the heap from a block ($2), in ctid
	// order (a TID Range Scan), and the next batch starts at the last
	// block this one deleted from, so a pass reads the table once. The
	// partitioned table's expired rows are mostly dropped with their
	// partitions; its sweep scans the partitions for what is left.
	exp := expired(grace)
	lag := `(` + now + ` - deadline - CASE WHEN state = 1 THEN ` + usec(strconv.FormatInt(grace, 10)) + ` ELSE interval '0' END)`
	var match, block string
	if cfg.partition > 0 {
		// ctid is not unique across partitions: match by primary key.
		match = `(scope, id, created_at) IN (SELECT scope, id, created_at FROM ` + table + ` WHERE ` + exp + ` LIMIT $1 FOR UPDATE SKIP LOCKED)`
		block = `NULL::int8`
	} else {
		match = `ctid = ANY (ARRAY(SELECT ctid FROM ` + table + ` WHERE ctid >= ('(' || $2::int8 || ',0)')::tid AND ` + exp + ` LIMIT $1 FOR UPDATE SKIP LOCKED))`
		block = `max((ctid::text::point)[0])::int8`
	}
	st.sweep = `WITH d AS (
	DELETE FROM ` + table + ` WHERE ` + match + ` AND ` + exp + `
	RETURNING ctid, ` + lag + ` AS lag)
SELECT count(*)::int8,
	COALESCE((EXTRACT(EPOCH FROM max(lag)) * 1000000)::int8, 0),
	COALESCE((EXTRACT(EPOCH FROM avg(lag)) * 1000000)::int8, 0),
	` + block + `
FROM d`
	return st
}

// recordCheck starts the message of the error inboxResultChecked raises
// when it would update no row. SQL has no statement that raises an error
// of one's choosing, so the statement casts the message to an integer,
// which fails with SQLSTATE 22P02 and the message in the error's text. The
// cast is evaluated only in that branch (count(*) is not a constant, so
// the planner cannot fold it early).
const recordCheck = "dedup inbox record missing or changed"

// applyTaken starts the message of the error Apply's claims raise when
// they do not acquire the key (the record is read next).
const applyTaken = "dedup apply: key not acquired"

// checkFailed reports whether err is the failure of a check statement
// whose message starts with msg (see recordCheck).
func checkFailed(err error, msg string) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "22P02" && strings.Contains(pe.Message, msg)
}

// isRecordCheck reports whether err is the failure of inboxResultChecked's
// check.
func isRecordCheck(err error) bool { return checkFailed(err, recordCheck) }

// sqlLiteral quotes s as an SQL string literal.
func sqlLiteral(s string) string { return `'` + strings.ReplaceAll(s, `'`, `''`) + `'` }

// completeBatchSQL is CompleteBatch's statement: complete for each (scope,
// id, token, result) of four parallel arrays; it returns one row: how many
// items' tokens own their records, and the ordinals of the items whose do
// not (empty in the common case, so that a batch comes back as one short
// row whatever its size). The items must be distinct and sorted by key.
//
// Locks are taken in that order by construction, whatever plan the server
// picks: the CTE l locks every item's row first, one primary-key probe per
// item in array order (a LATERAL subquery with FOR NO KEY UPDATE cannot be
// flattened or hashed, so it runs once per row of unnest, in its order).
// A row changed by another transaction after the statement began is
// locked, and then written, in its latest version. The scopes' retention
// windows are looked up once per statement (plain table) or joined once
// (partitioned), not per item. The ordinals of the lost items are computed
// only when the count says some were lost (the ARRAY subquery is an init
// plan, which the server runs only when the CASE needs its value).
//
// On the plain table the write is an INSERT ... ON CONFLICT DO UPDATE of
// the rows l locked, so that it finds each row through the primary key by
// construction too: the planner prices an UPDATE joined with the items as
// a hash join over a sequential scan of the whole table while the table
// is small (below some 30,000 rows; and the cached generic plan made while
// it was smaller keeps doing so as it grows), which cost 3 ms a batch of
// 100 at 10,000 rows and grew with the table (issue 16). Every row it
// proposes conflicts (l holds each one locked, so none can be deleted), so
// it never inserts; its DO UPDATE writes only when the token matches, and
// in the row's latest version, as an UPDATE would. The partitioned table's
// primary key holds the partition key too, so it keeps the UPDATE, gated
// on l through a one-time filter on its count, which the executor
// evaluates before the update reads a single row.
func completeBatchSQL(n *names, table string, partitioned bool) string {
	keep := `LEFT JOIN (` + n.scopes + ` s JOIN ` + n.retention + ` w ON w.scope = s.scope) ON s.id = `
	expiry := func(keep string) string {
		return deadline(now + ` + GREATEST(` + usec("$5::int8") + `, COALESCE(` + keep + `, interval '0'))`)
	}
	if !partitioned {
		return `WITH l AS MATERIALIZED (
	SELECT u.scope, u.id, u.token, u.result FROM unnest($1::int4[], $2::bytea[], $3::bytea[], $4::bytea[]) AS u(scope, id, token, result)
	CROSS JOIN LATERAL (
		SELECT 1 FROM ` + table + ` x WHERE x.scope = u.scope AND x.id = u.id AND x.token = u.token FOR NO KEY UPDATE) x),
w AS MATERIALIZED (
	SELECT s.id, x.retention FROM ` + n.scopes + ` s JOIN ` + n.retention + ` x ON x.scope = s.scope WHERE s.id = ANY($1::int4[])),
d AS (
	INSERT INTO ` + table + ` AS r (scope, id, state, token, result, deadline, attempts)
	SELECT l.scope, l.id, 2, l.token, l.result, ` + expiry("w.retention") + `, 1
	FROM l LEFT JOIN w ON w.id = l.scope
	ON CONFLICT (scope, id) DO UPDATE SET
	result   = CASE WHEN r.state = 1 THEN excluded.result ELSE r.result END,
	deadline = CASE WHEN r.state = 1 THEN excluded.deadline ELSE r.deadline END,
	state    = 2
	WHERE r.token = excluded.token
	RETURNING r.scope, r.id, r.token)
SELECT c.n, CASE WHEN c.n = cardinality($1::int4[]) THEN '{}'::int8[]
	ELSE ARRAY(SELECT u.o FROM unnest($1::int4[], $2::bytea[], $3::bytea[]) WITH ORDINALITY AS u(scope, id, token, o)
		WHERE NOT EXISTS (SELECT 1 FROM d WHERE d.scope = u.scope AND d.id = u.id AND d.token = u.token)) END
FROM (SELECT count(*) AS n FROM d) c`
	}
	return `WITH l AS MATERIALIZED (
	SELECT count(*) AS n FROM unnest($1::int4[], $2::bytea[], $3::bytea[]) AS u(scope, id, token)
	CROSS JOIN LATERAL (
		SELECT 1 FROM ` + table + ` x WHERE x.scope = u.scope AND x.id = u.id AND x.token = u.token FOR NO KEY UPDATE) x),
d AS (
	UPDATE ` + table + ` r SET
	result   = CASE WHEN r.state = 1 THEN u.result ELSE r.result END,
	deadline = CASE WHEN r.state = 1 THEN ` + expiry("u.keep") + ` ELSE r.deadline END,
	state    = 2
	FROM (SELECT u.*, w.retention AS keep
		FROM unnest($1::int4[], $2::bytea[], $3::bytea[], $4::bytea[]) WITH ORDINALITY AS u(scope, id, token, result, o)
		` + keep + `u.scope) u
	WHERE r.scope = u.scope AND r.id = u.id AND r.token = u.token AND (SELECT n FROM l) >= 0
	RETURNING u.o)
SELECT c.n, CASE WHEN c.n = cardinality($1::int4[]) THEN '{}'::int8[]
	ELSE ARRAY(SELECT generate_series(1, cardinality($1::int4[]))::int8 EXCEPT ALL SELECT o FROM d) END
FROM (SELECT count(*) AS n FROM d) c`
}
