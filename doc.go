// Package dedup is the vocabulary of exactly-once effects over at-least-once
// delivery: keys, fingerprints, the claim lifecycle, the store contract, the
// errors a caller branches on, and the hooks that observe it all.
//
// Brokers and HTTP clients retry. A consumer that applies the same message
// twice charges a customer twice. A consumer that marks a message as seen and
// then fails to apply it loses the message, because the redelivery is skipped
// as a duplicate. This package defines the one state machine that avoids both:
//
//	absent ──Claim──▶ in progress (token, lease, attempt) ──Complete──▶ completed (result, expiry)
//	                    │    ▲                                             │
//	                    │    └── lease expired: taken over, attempt+1      └── retention over: absent
//	                    └──Release──▶ absent (the redelivery runs again)
//
// Every transition is one atomic step in the store (a Lua script, one SQL
// statement, one locked section). Complete, Release and Extend are fenced by
// the owner token: an owner whose lease was taken over gets [ErrLeaseLost] and
// changes nothing. The full state table is in the section "The state
// machine" of docs/DESIGN.md in the repository; the storetest package checks
// every row of it against every store.
//
// Most callers use a [Runner], which claims, runs a handler, and completes or
// releases, and reports a duplicate as a successful no-op (ExampleRunner
// runs this on the memory store):
//
//	r, err := dedup.NewRunner(store, dedup.WithLease(30*time.Second), dedup.WithRetention(24*time.Hour))
//	if err != nil {
//		return err // a bad option: nothing ran
//	}
//	key, err := dedup.NewKey("payments/charge-consumer", msgID)
//	if err != nil {
//		return err // a bad message ID: dead-letter it, do not retry
//	}
//	res, err := r.Do(ctx, key, dedup.FingerprintOf(payload), func(ctx context.Context) ([]byte, error) {
//		return nil, chargeCard(ctx, payload)
//	})
//	switch {
//	case err == nil && res.Duplicate: // ack silently: it was applied before
//	case err == nil:                  // ack: applied now
//	default:                          // nack or retry later: nothing was recorded as done
//	}
//
// What this package does not do: it holds no storage engine (see memstore,
// sqlitestore, redisstore, pgstore), imports nothing outside the standard
// library, and cannot make an external side effect atomic with the store.
// An effect outside the store's transaction has a window between the effect
// and Complete; close it with the transactional inbox of a SQL store, or make
// the effect idempotent downstream (an external idempotency key).
package dedup
