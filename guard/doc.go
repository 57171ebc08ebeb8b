// Package guard makes a replayed or reordered message harmless by design:
// the write itself checks the aggregate's version or state, so no dedup
// record is needed for it to apply once. It is the fourth placement of
// deduplication ("idempotency by design"), usable alone or as the last
// layer behind a dedup store or an inbox.
//
// # Ordering is not idempotency
//
// A dedup record stops the same message twice; it does nothing about two
// different messages arriving in the wrong order. Version 4 arriving after
// version 5 has a new message ID, passes every dedup check, and would
// regress the state. A version guard stops it: [CompareVersion] says
// whether an incoming version is the next one ([Apply]), already applied
// ([Duplicate]), older ([Stale]: never regress) or ahead of a missing one
// ([Gap]), and [Decide] turns that into an action under a [GapPolicy].
//
// # What it guarantees
//
//   - A conditional write ([Advance], [Transition] and their variants)
//     checks and changes the row in one statement, so of any number of
//     concurrent or repeated copies exactly one is applied; the others see
//     rows affected 0, which is reported as a result, not an error.
//   - A stale version never overwrites a newer one, if every write to the
//     row goes through the guard.
//   - The check variants ([AdvanceCheck], [TransitionCheck]) read the row
//     only after a write was refused, to say why; the read never decides
//     to write.
//
// # What it does not
//
//   - It guards one row. Side effects outside that row (an e-mail, a call
//     to another service, rows in other tables) are not covered unless they
//     happen in the same transaction and only when the guard applied.
//   - The caller writes the SQL. The helpers never build statements from
//     table or column names, so they cannot inject SQL; in exchange they
//     cannot check that the WHERE clause really holds the guard. A write
//     without one is not guarded.
//   - [Parked] is in memory and bounded: it is lost on restart and refuses
//     new messages when full. It reorders; it does not persist.
//   - A version guard needs a source that numbers versions per aggregate
//     without holes; with holes, use "version < $n" (newest wins) rather
//     than strict next-version mode.
//
// # Which to use
//
//   - A status machine (pending -> paid): [Transition], the update guarded
//     by "WHERE status = 'pending'". Use [TransitionCheck] when a refused
//     transition must be told apart: already in the target state (a
//     duplicate, ack it) or in some other state (out of order or invalid).
//   - Messages carrying full state (snapshots, upserts by source version):
//     [Advance] with "WHERE version < $n"; a gap is harmless ([GapAllow]).
//   - Messages carrying deltas, where every version must be applied in
//     order: [AdvanceCheck] with "WHERE version = $n - 1"; park a [Gap] in
//     [Parked] (or reject it for redelivery) and re-drive the parked
//     messages from [Parked.Ready] after each applied version.
//
// Statements use the driver's placeholders ($1 on PostgreSQL, ? on
// SQLite); the helpers pass them through, so they work with any dialect.
// The pgx helpers take any of pgx.Tx, *pgx.Conn and *pgxpool.Pool; the
// database/sql helpers (suffix DB) take *sql.DB, *sql.Tx or *sql.Conn. Run
// the guard inside the caller's transaction to make the business write and
// the guard one unit.
package guard
