// Package layered chains the dedup placements so that a duplicate must get
// past every one of them to do harm, cheapest first:
//
//	window (in process) -> fast layer (Redis) -> durable store (SQL, with the inbox) -> handler
//
// # Which fast layer
//
// The fast layer is either a filter ([WithFilter], with
// layered/redisfilter) or a claiming store ([WithFast], with redisstore).
// Use the filter: it is a read-only record of completed keys, consulted
// with one GET (pipelined with every other caller's) on a window miss and
// written once per key after the durable store recorded it completed, by
// a background writer that batches what queued in 10 ms into one
// pipeline, so a new message never waits for it. A claiming fast store
// costs a new message two fast round trips on its path (the claim, and
// the completion after the durable step) and buys nothing in Claim, whose
// answers other than a duplicate the durable store must confirm anyway;
// in front of a durable step that already answers in one round trip
// (pgstore's Apply and RunInbox, sqlitestore's RunInbox) it made the
// layered store slower than the durable store alone. Its one use is
// RunInbox under many concurrent deliveries of the same message, where
// its "in progress" answer keeps the copies from queueing on the durable
// store's unique index.
//
// The filter's lookups pay only when the window misses duplicates that
// the filter has (another instance's keys, a restart, a rebalance). The
// store measures it: a lookup saves a durable step when it hits and costs
// its own time always, so after 32 lookups it compares hits × the mean
// durable step with the lookups' time, and pauses lookups when they do
// not pay (Stats().LookupsPaused), looking up one window miss in 32 to
// notice when they would again. A new store starts with lookups on: a
// process that just started is when the window knows nothing.
//
// # Semantics
//
//   - An exact window hit on a completed key, with a matching fingerprint,
//     is a duplicate: no network call at all. In Lossy mode a Bloom
//     "maybe" is a duplicate too (best-effort streams only). In Confirm
//     mode a "maybe" is only counted: the stores still decide.
//   - A filter entry for a completed key whose fingerprint matches (any
//     entry for a claim without a fingerprint; an entry written without
//     the record's fingerprint matches only such a claim) is a duplicate:
//     the durable store is not asked. Anything else the filter says (a
//     miss, another fingerprint, an error) goes to the durable store.
//     A filter never answers "in progress" or "mismatch".
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
// It knows nothing after a restart or a rebalance. The filter saves the
// durable step for duplicates that any instance completed; it costs a
// lookup on a window miss while lookups pay, and one batched write per
// key always (about 2% of a stream's throughput in front of PostgreSQL's
// Apply on this machine, docs/benchmarks.md). A claiming fast store saves
// the same and costs two extra round trips for every new message. The durable store
// is the guarantee: only its unique constraint, inside the business
// transaction, survives a crash at any instant and a Redis failover. Use a
// state-transition guard first where the business allows it, the durable
// layer for anything a customer sees, and the window and fast store when
// profiling says the durable store is the bottleneck.
package layered
