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
//     A fast-store mismatch or in-progress lease is reported as such.
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
