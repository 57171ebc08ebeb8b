// Package layered chains the dedup placements so that a duplicate must get
// past every one of them to do harm, cheapest first:
//
//	window (in process) -> fast store (Redis) -> durable store (SQL, with the inbox) -> handler
//
// # Semantics
//
//   - An exact window hit on a completed key, with a matching fingerprint,
//     is a duplicate: no network call at all. In Lossy mode a Bloom
//     "maybe" is a duplicate too (best-effort streams only). In Confirm
//     mode a "maybe" is only counted: the stores still decide.
//   - A fast-store duplicate is a duplicate: the durable store is not asked.
//     A fast-store mismatch or in-progress lease is not final in Claim: it
//     may be stale (see Linearizability), so the durable store is asked
//     and its answer returned. In RunInbox it is final, for at most the
//     inbox lease (see below).
//   - A fast-store miss (it acquired) falls through to the durable store,
//     which is authoritative. So does a fast store that is down or slow: its
//     failure is reported to the hooks and never stops processing.
//   - The durable store being down fails closed: a *dedup.StoreError, the
//     handler does not run.
//   - Completion is written to the durable layer first, then to the fast
//     store, then to the window. A failed durable completion is returned
//     (do not ack); a failed fast completion is only reported.
//   - A durable duplicate that the fast store had lost (a FLUSHALL, a
//     failover) is written back to the fast store and the window, so the next
//     redelivery stops early again.
//
// # Linearizability
//
// Claim, Complete, Release and Extend on the layered store are
// linearizable, with the durable store's step as each call's
// linearization point: every answer of Claim is the durable store's, but
// for a duplicate found in the window or the fast store, which exists
// there only because the durable record was completed first (a record
// that expires in the durable store a little before its copy in a faster
// layer is still answered as a duplicate until the copy expires: the
// copies are dated by the same retention, counted from slightly later).
// Complete writes the durable store first (a crash in between must never
// leave a faster layer saying "duplicate" for an effect that is not
// recorded); Release releases the fast claim first (in between, a new Claim
// acquires the fast store and the durable store still answers "in
// progress", which is the truth). A fast-store "in progress" or "mismatch"
// is never returned by Claim without the durable store's confirmation, so
// a stale fast lease (its owner is between its two steps, or crashed
// there) costs one durable round trip, never a wrong answer; Stats counts
// these as FastUnsure. Fast-store calls that follow a durable step run on
// a context detached from the caller's, bounded by WithCleanupTimeout, so a
// caller whose context ends between the two steps leaves no orphaned fast
// claim; a process that crashes between them does, until its lease ends.
//
// RunInbox differs in one way, by design: its durable step runs the
// business transaction, so a fast-store "in progress" is answered as it is
// (the caller redelivers later) instead of opening a transaction that would
// wait on the unique index of the one in flight. That answer can be stale,
// for at most WithInboxLease (default 30s), whenever a fast claim is left
// without an owner: a crash between the durable commit and the fast
// completion, a fast claim whose reply was lost (Redis applied it, the
// client timed out), or a fast completion or release that failed within
// the cleanup timeout.
//
// # What each layer saves, honestly
//
// The window saves both round trips for a duplicate it has seen complete in
// this process: the hot case of a crashed batch redelivered within seconds.
// It knows nothing after a restart or a rebalance. The fast store saves the
// durable round trip for duplicates seen by any instance, and costs one
// extra round trip for every new message (the price of the layer: worth it
// when duplicates are common or the durable store is far). The durable store
// is the guarantee: only its unique constraint, inside the business
// transaction, survives a crash at any instant and a Redis failover. Use a
// state-transition guard first where the business allows it, the durable
// layer for anything a customer sees, and the window and fast store when
// profiling says the durable store is the bottleneck.
package layered
