// Package dedupwatermill brings dedup's claim stores into Watermill
// (github.com/ThreeDotsLabs/watermill): a handler middleware that runs each
// message's handler once per key, on any [dedup.Store] (memstore, the
// window in front of a store, SQLite, Redis, PostgreSQL, layered), and an
// [outbox.Publisher] that lets the outbox relay publish through any
// Watermill publisher.
//
//	mw, err := dedupwatermill.New(store, "billing")
//	if err != nil { ... }
//	defer mw.Close() // after the router
//	poison, _ := middleware.PoisonQueueWithFilter(pub, "poison", dedupwatermill.ShouldPoison)
//	router.AddMiddleware(poison, middleware.Retry{MaxRetries: 5, InitialInterval: 100 * time.Millisecond}.Middleware, mw.Middleware)
//
// # What one message goes through
//
// The key is the message UUID in the middleware's scope (or a metadata
// field: [WithMetadataKey], or any business key: [WithKeyFunc]); the
// fingerprint is SHA-256 of the payload ([WithFingerprint] to change it),
// so the same key with another payload is a conflict, never a duplicate.
//
//	claim answer          middleware returns               router
//	acquired              the handler's outputs             publishes them, acks
//	duplicate             nil, nil (no outputs)             acks
//	in progress           *dedup.InProgressError           nacks (Retry backs off)
//	fingerprint mismatch  dedup.ErrFingerprintMismatch     nacks (or poison queue)
//	store error           *dedup.StoreError (fail closed)  nacks
//
// # When the claim ends
//
//   - Completed only once the router acked the message, that is after it
//     published the handler's produced messages (Watermill acks after the
//     publish). A duplicate therefore re-emits nothing: the first run's
//     outputs were published before its ack. Completions of messages acked
//     within one poll interval ([WithAckPollInterval], 1ms) go to the store
//     in one batch.
//   - Nacked after the handler succeeded (the publish of produced messages
//     failed, or a middleware outside this one failed): the claim is kept,
//     never released, because the handler's effect ran. The redelivery is
//     refused as in progress until the lease ends, then takes the key over
//     and runs the handler again with Claim.TakenOver set ([ClaimFrom]): the
//     handler reconciles (or its effect is idempotent by design) and its
//     outputs are published then. Releasing here would run the effect again
//     at once, with nothing telling the handler it already ran.
//   - Handler error: the classifier decides ([Classify] by default). An
//     ordinary error releases the claim, so the redelivery runs the handler
//     at once (Watermill's own Deduplicator loses that message: it records
//     the key before the handler and never forgets it). A handler that
//     returns an error must not have applied its effect; an error marked
//     [consumer.Unknown], a cancelled context or a timeout keeps the claim
//     (an unknown outcome is never released); a business rejection marked
//     [consumer.Reject] is recorded as the final outcome and acked.
//   - Panic: the claim is kept and the panic goes on (to Watermill's
//     Recoverer, or the router's own recovery, which nacks).
//   - Long handlers: [WithHeartbeat] extends the lease from the claim until
//     the router acks or nacks; a lost lease cancels the message's context
//     with cause [dedup.ErrLeaseLost].
//
// # Composing with Retry and PoisonQueue
//
// Add them in this order (Watermill runs the first added outermost):
// PoisonQueueWithFilter(pub, topic, [ShouldPoison]), then Retry, then this
// middleware next to the handler. Retry then calls the middleware again
// for each try: a released claim is claimed anew, and an
// [ErrInProgress] (another delivery holds the key) is retried with Retry's
// backoff. [ShouldPoison] keeps ErrInProgress and store errors out of the
// poison queue (they are about the key or the store, not the message: the
// router nacks and the broker redelivers); a handler that keeps failing
// goes to the poison queue with its claim released, so a replay from the
// poison queue under the same UUID runs it.
//
// # What it does not guarantee
//
//   - The completion comes after the ack. If the process dies (or the store
//     fails) between the ack and the completion, the record stays in
//     progress until its lease ends and a later redelivery (there should be
//     none: the message was acked) would take it over: the same window as a
//     consumer that crashes after its commit and before its ack. Effects
//     that must happen once whatever happens belong in the store's
//     transactional inbox (sqlitestore, pgstore) inside the handler.
//   - A handler that ran when the router nacked (a failed publish of its
//     outputs) runs again after the lease: the handler must reconcile on
//     TakenOver, or be idempotent.
//   - A store without a live lease holder cannot tell an in-flight delivery
//     from a crashed one before the lease ends: size the lease to the
//     slowest handler, or use the heartbeat.
package dedupwatermill
