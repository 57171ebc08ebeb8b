// Package sqlitestore is the embedded default [dedup.Store]: claims,
// completions and a transactional inbox in one SQLite file.
//
// # What it guarantees
//
// Every transition of the claim contract (Claim, Complete, Release, Extend)
// is one SQL statement, so SQLite makes it atomic: a claim is a single
// INSERT ... ON CONFLICT DO UPDATE ... RETURNING whose CASE expressions
// take the key only when it is acquirable, and the caller learns from the
// returned token whether it won. No call reads, decides in Go and then
// writes. Complete, Release and Extend are fenced by the owner token.
// Time comes from the store's [dedup.Clock] and is passed in as a
// parameter (unix nanoseconds), never from SQLite's clock.
//
// A call that returned without error is durable as [WithSynchronous] says:
// with "FULL" (the default) a committed claim, completion or inbox
// transaction survives a power loss; with "NORMAL" it survives a crash of
// the process but the last commits before a power loss may be lost.
//
// The store serves many goroutines and several processes on one machine:
// they share the file, and SQLite lets one writer at a time in while the
// others wait up to the busy timeout ([WithBusyTimeout]). Concurrent claims
// of one key are serialised that way, and exactly one acquires it. Writes
// of one Store also queue in the process, so that a waiting goroutine
// starts as soon as the previous write ends instead of sleeping in
// SQLite's busy handler; the queue changes no outcome.
//
// # What it does not do
//
// It is single-host. An SQLite file must not be shared between machines
// (network file systems break its locking, and WAL needs shared memory), so
// consumers on several hosts need a server store (pgstore, redisstore).
// Throughput is bounded by the single writer: batch work into transactions
// (the inbox) or claims into [Store.ClaimBatch] for more.
//
// # Why modernc.org/sqlite and WAL
//
// The driver is modernc.org/sqlite, SQLite translated to pure Go: no cgo,
// so the module builds with CGO_ENABLED=0 and cross-compiles like any Go
// code. The database runs in WAL mode: readers do not block the writer,
// and a commit appends to the log instead of rewriting pages, which makes
// small transactions cheap. Every transaction on [Store.DB] begins with
// BEGIN IMMEDIATE, taking the write lock before its first read, so two
// writers never deadlock upgrading a read lock.
//
// # The transactional inbox
//
// With [Store.Claim] and [Store.Complete] there is a window between the
// effect and the completion: a crash inside it leaves the effect applied
// and the record in progress, and the take-over after the lease runs the
// effect again. When the effect is a write to tables in the same file, the
// inbox closes that window. [Store.Inbox] inserts the record, already
// completed, in the caller's transaction and runs the handler on that same
// transaction; the caller commits once, so the record and the business
// writes are durable together or not at all. A replay finds the completed
// record and the handler does not run; a rolled-back transaction leaves no
// record, so the redelivery applies the message; two concurrent deliveries
// are serialised by SQLite's write lock and the second sees a duplicate.
// [Store.RunInbox] does the begin, commit and rollback for you.
//
// # The record layout
//
// A record is kept compact (schema version 2, [SchemaVersion]): the scope
// as a small integer from a per-table scopes table, the ID as text, the
// token as 16 bytes, a SHA-256 fingerprint as its 32-byte digest, and one
// deadline (the lease's end while in progress, the expiry once completed).
// Measured: 187 file bytes a completed record against 298 for the earlier
// layout (docs/benchmarks.md). [Open] converts a database in the earlier
// layout in batches.
//
// # Housekeeping
//
// Expired records are invisible to Claim (the key is acquired again), but
// they stay in the file until [Store.Sweep] deletes them in bounded
// batches; run it periodically.
package sqlitestore
