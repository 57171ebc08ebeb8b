// Package consumer is the broker-neutral half of an idempotent consumer:
// what happens around the dedup claim. A [Processor] takes one delivered
// [Message], derives its dedup key, claims it in a [dedup.Store] (or
// applies it in a transactional [Inbox]), runs the handler, and returns a
// [Decision] that a broker adapter (package dedupnats) turns into an ack,
// a delayed negative ack or a dead letter.
//
// # Guarantees
//
//   - A message is acknowledged only when it was applied, found applied
//     before (a duplicate: acknowledged silently, never an error, or the
//     broker would redeliver it forever), recorded as a business
//     rejection, or kept by the dead-letter sink. Nothing is acknowledged
//     and discarded silently.
//   - A store failure fails closed: Retry, never "new" or "duplicate".
//   - Failures are classified ([Transient], [Permanent], [Reject],
//     [Unknown]; anything else is unclassified and treated as transient
//     with a smaller budget). Retries use bounded exponential backoff with
//     full jitter, and each class has an attempt limit after which the
//     message is dead-lettered, so a poison message neither blocks the
//     stream nor retries forever.
//   - An unknown outcome (a timed-out call that may have succeeded) is
//     reconciled by the stable key before any retry: the [Reconciler] is
//     asked right after the failure and again before an attempt that takes
//     over a claim whose earlier owner never finished.
//   - Dead letters keep the whole original message and its IDs, the class,
//     a bounded one-line reason (never the payload, unless the handler's
//     own error text held it), the attempt count and the first and last
//     failure times. [Replay] sends them back under the original IDs,
//     rate-limited, with a dry run, checking the dedup store first.
//   - [Processor.ProcessBatch] decides for each message of a batch exactly
//     what Process would for them in order, with one batch claim and one
//     batch complete; the claims waiting in a batch are extended so none
//     expires while the handlers before it run.
//
// # Limits
//
// Attempt counts and failure times live in the processor's memory
// (bounded): a restart starts them again. [WithMaxDeliveries] bounds a
// message that crashes the process before its failure can be counted, by
// the broker's own delivery count. In inbox mode a business rejection
// commits the handler's writes made before it returned.
package consumer
