// Package pgstore is the durable [dedup.Store] on PostgreSQL, with a
// transactional inbox that joins the caller's transaction, batch claims,
// per-scope retention windows, a bounded cleanup job, and an optional
// time-partitioned records table for very high volume.
//
// # What it guarantees
//
// Every transition of the claim contract is one atomic step on the server.
// On the plain records table (the default) each is one SQL statement: a
// claim is a single INSERT ... ON CONFLICT (scope, id) DO UPDATE whose
// CASE expressions take the row only when it is acquirable (absent,
// completed and expired, or in progress under an expired lease with a
// matching fingerprint) and otherwise write every column back unchanged,
// and whose RETURNING clause shows the row as it ended up: the caller owns
// the key if and only if the row carries its new token. Complete, Release
// and Extend are one UPDATE or DELETE fenced by that token. No call reads,
// decides in Go and then writes.
//
// Why DO UPDATE and not DO NOTHING: ON CONFLICT DO UPDATE locks the
// conflicting row and evaluates its expressions against the latest
// committed version, waiting for an uncommitted insert of the same key to
// commit or roll back. A DO NOTHING followed by a SELECT (in the same
// statement or the next) reads a snapshot that can miss a row committed
// concurrently, or show an older version of it, and would need a retry
// loop to be right. The price: a claim that finds the key held or
// completed still writes a new row version (a no-op update) and its WAL
// record, so a duplicate claim costs a small write and a commit flush
// instead of a read. Duplicates are the exception in a healthy pipeline,
// and the update is usually HOT (no indexed column changes); vacuum
// reclaims the versions.
//
// Time is the server's: leases and expiries are computed in SQL from
// statement_timestamp(), fixed for the duration of one statement so that
// every CASE of one upsert agrees, and durations travel as microseconds.
// Two consumer hosts with skewed clocks therefore agree on when a lease
// ends. (The returned LeaseUntil and ExpiresAt are server times.)
//
// Errors: bad arguments give a [*dedup.ArgumentError] before any I/O; a
// failure of the server, the network or the context gives a
// [*dedup.StoreError] wrapping pgx's error (errors.As finds the
// *pgconn.PgError and its SQLSTATE); a closed store gives
// [dedup.ErrClosed]. A store error is NotApplied (SafeToRetry) only when
// that is certain: the request never left the client
// (pgconn.SafeToRetry), no connection could be made, or the server
// reported an error for a statement in autocommit, which rolls it back.
// A statement cut off by a broken connection has an unknown outcome, and
// the contract's fail-closed rules apply. [Open] and [ParsePoolConfig]
// make a cancelled context send a cancel request to the server, so a claim
// cancelled while it waits for a lock is rolled back and reported
// NotApplied instead of running on after the client left.
//
// # What it does not guarantee
//
//   - Lease mode cannot make an effect outside the database happen once: a
//     crash between the effect and Complete leaves the record in progress,
//     and the take-over after the lease runs the effect again (with
//     Claim.TakenOver set). Use the inbox for effects in the same
//     database, or pass the key downstream as an idempotency key.
//   - A record that expires before the last redelivery lets that
//     redelivery through. Size retention to the replay horizon;
//     [Store.SetRetention] records both and [Store.Check] warns when one is
//     shorter than the other.
//   - The inbox is built for READ COMMITTED, PostgreSQL's default. Under
//     REPEATABLE READ or SERIALIZABLE a transaction that waited for a
//     concurrent one with the same key fails with a serialization error
//     (SQLSTATE 40001) to be retried, and the partitioned table refuses to
//     run at all (its uniqueness check needs a snapshot taken after the
//     key's lock).
//
// # Why pgx v5
//
// pgx speaks PostgreSQL's protocol natively: binary formats for bytea,
// timestamps and arrays (the batch claim sends four arrays in one bind),
// prepared statements cached per connection, and typed errors. Its
// pipelined batches let the partitioned claim send the key's lock and the
// claim in one round trip, in one implicit transaction, and RunInbox
// begin its transaction in the round trip of its first statement
// (Batch.BeginTx) and commit in the round trip of its last. pgxpool is a
// connection pool without database/sql's extra layer, CopyFrom is the bulk
// path the benchmarks use as an upper bound, and pgconn's SafeToRetry and
// cancel requests give the precise failure classes above. database/sql
// users are served through pgx's stdlib adapter ([Store.InboxSQL]).
//
// # Lease mode and the inbox
//
// Lease mode ([Store.Claim], Complete, Release, Extend, [Store.ClaimBatch])
// is for effects outside the database: claim with a lease, act, complete.
// Release removes the record, so the next claim starts again at attempt 1.
//
// The transactional inbox ([Store.Inbox] on a pgx.Tx, [Store.InboxSQL] on a
// *sql.Tx, [Store.RunInbox] for a transaction of its own) is for effects in
// the same database: it inserts the record already completed in the
// caller's transaction, runs the handler on that transaction, and lets the
// caller commit. The transaction is the lease: a crash before the commit
// leaves nothing, and the redelivery applies the message once; a crash
// after the commit makes the redelivery a duplicate. A second transaction
// with the same key waits on the primary key until the first ends, then
// sees a duplicate, or applies if the first rolled back. The conflict is
// resolved by ON CONFLICT, never by a unique violation, so it does not
// abort the caller's transaction (CAMEL-24048). [Store.WriteOutbox]
// (also [Store.WriteOutboxSQL], and [Store.QueueOutbox] for Apply) writes
// outgoing messages to the outbox table in the same transaction, for the
// relay of package outbox to publish ([Store.OutboxSource]). The inbox costs the business transaction one
// more statement and one more indexed row; RunInbox sends that statement
// in one round trip with the BEGIN, and the handler's result with the
// COMMIT, so it adds no round trip. Measured here (BenchmarkInbox, cases
// interleaved; docs/benchmarks.md), a transaction that inserts one ledger
// row runs through RunInbox at 0.62-0.70x the rate of the bare
// transaction from one goroutine and 0.58-0.65x from 16; with a naive
// INSERT ... ON CONFLICT DO NOTHING of the dedup key sent with its BEGIN,
// the floor any inbox pays in WAL, index and CPU, it runs at 0.82-0.85x
// and 0.72-0.78x. The rest is the server's time on the store's upsert:
// the lookup of the scope's retention window, and the set-up of its
// conflict branch. Both modes share the records: an inbox
// delivery takes over the expired lease of a crashed lease-mode owner and
// reports a live one as in progress.
//
// [Store.Apply] is the inbox for writes known before they run: the claim
// and the caller's queued statements go in one pipeline that PostgreSQL
// runs as one implicit transaction. The claim fails unless it acquires,
// which makes the server skip the writes and roll everything back; Apply
// then reads the record and reports the duplicate. A new message costs
// one round trip against the bare transaction's three: in BenchmarkInbox
// Apply takes 1.01-1.03x the bare transaction's time from one goroutine
// and 1.09-1.16x from 16 (1.4-1.5x and 1.7-1.8x the same write sent alone in
// one pipeline, which is what the dedup row costs when no round trip is
// left to save).
//
// # Schema
//
// [Store.Migrate] (or `dedup migrate`) applies the versioned SQL embedded
// in the binary, each migration in its own transaction with its row in
// <prefix>schema_migrations; it is idempotent and serialised between
// instances by an advisory lock. The store never runs DDL on a caller's
// transaction. Tables: <prefix>rec, the records in a compact layout
// (migration 0006): the scope as the integer <prefix>scopes gives it, the
// message ID as bytes (16 for a canonical lower-case UUID; SQL function
// <prefix>key_text turns them back into the ID), state, owner token, the
// fingerprint as the first 16 bytes of the SHA-256 of its text (only ever
// compared), result, attempts and one deadline (the lease end while in
// progress, the expiry once completed); primary key (scope, id) and no
// other index, so that a completion can be a HOT update, and full pages
// (fillfactor 100, measured smallest; docs/benchmarks.md has the bytes per
// record). A completion leaves the claim's version of the record dead,
// and its space is reused only once VACUUM has been: the store runs
// VACUUM (SKIP_LOCKED, TRUNCATE false) on <prefix>rec itself after every 10,000
// completions that are also a tenth of the table ([WithVacuum]), rather
// than leave up to a minute of them to autovacuum (173 against 224 B a
// record after a million, in one run). <prefix>rec_p is the
// partitioned variant (with created_at, its partition key),
// <prefix>retention (scope, retention, replay_horizon), <prefix>outbox
// (id, message_key, aggregate, topic, payload, headers, created_at,
// published_at). [WithSchema] and [WithTablePrefix] place them; the tests
// give every test a schema of its own.
//
// A schema from before version 6 keeps its records in <prefix>records and
// <prefix>records_p until [Store.Convert] (run by `dedup migrate`) moves
// them in batches, online, and drops the old tables; until then every
// claim first moves its key's old record, so old records are read and
// deduplicated as before. The old tables refuse inserts (migration 0009),
// so a binary of schema version 5 still running fails its claims instead
// of acquiring a key whose record has moved.
//
// A scope's retention window is a floor: Complete and the inbox keep a
// record for the longer of the caller's retention and the scope's.
//
// # Cleanup: sweeper or partitions
//
// Expired records are invisible to claims but stay on disk until removed.
// The sweeper ([Store.SweepOnce], [Store.StartSweeping], `dedup sweep`)
// deletes them in bounded batches with one DELETE that picks its rows
// with FOR UPDATE SKIP LOCKED and deletes them by ctid: it never waits for
// a row a claim holds, holds its row locks only for its own batch, and
// reports how late it is (the lag between expiry and deletion). The
// compact table has no expiry index (it would make every completion a
// non-HOT update with a second index entry), so a pass walks the heap in
// ctid order (a TID Range Scan), each batch resuming at the block where
// the one before stopped: a pass reads the table once, whatever the
// backlog; a row skipped because a transaction held it waits for the next
// pass. The background job paces itself by a
// duty cycle: after each batch it pauses as long as the batch took
// ([SweepOptions.PauseRatio]), so it leaves half the machine to claims
// whatever the machine, and pauses longer when load slows its batches.
// In-progress records are swept only after their lease plus a grace
// ([WithInProgressGrace], 24h), so that a crashed owner's record is taken
// over with attempt + 1 first.
//
// For very high volume, [WithPartitions] moves the records to a table
// partitioned by the time of each record's latest acquisition, and cleanup
// drops whole partitions once every record in them has expired
// ([Store.DropExpiredPartitions]): no row-by-row DELETE, no dead tuples,
// no vacuum debt, and a cost independent of the row count. The price is
// paid by every claim. PostgreSQL can only enforce a unique key on a
// partitioned table if it includes the partition key, so (scope, id) is
// not unique by constraint there; the store keeps it unique by taking a
// transaction-scoped advisory lock on the key's hash, then (in a later
// statement of the same transaction, whose snapshot sees every commit made
// before the lock) checking the live partitions and moving or inserting the
// row: one locked section, as the contract allows. Claims on the plain and
// partitioned tables must not be mixed for one prefix; any writer that
// bypasses the store must take the same lock. Each drop holds the table
// exclusively for the check and the drop, waiting at most
// [WithMaintenanceLockTimeout] for transactions to finish, so claims stall
// for at most that long once per partition. The maintenance job creates
// partitions ahead ([WithPartitionsAhead]); a claim with no partition for
// the current time fails closed.
//
// When to pick which, measured with bench_test.go on a shared 2-core
// machine (ratios from one run; absolute figures vary by ±30% from run to
// run): the sweeper deletes about 400k expired rows/s under claim load in
// batches of 5000 without pauses, raising the p99 of concurrent claims
// about 5x; the job's default pacing (batches of 500, a pause as long as
// each batch) deletes 130-145k rows/s and keeps it at 1.5-1.7x its idle
// value. Dropping a partition of 50,000 expired rows takes about 15-20ms
// (2.4-3.4M rows/s) whatever its size, and leaves no dead tuples. In exchange a
// partitioned claim costs more: 0.63x the single claims/s of the plain
// table from one goroutine (0.59x from 16), 0.70x the batch throughput at
// 100 and 1000 keys. Use the plain table with the sweeper unless records
// expire faster than the sweeper can delete them without hurting claims,
// or the delete traffic itself (WAL, replication, vacuum) is the problem.
package pgstore
