// Package dedupamqp runs a [consumer.Processor] over RabbitMQ with
// amqp091-go: a [Consumer] that acknowledges after the processor's
// decision, a confirm-mode [Publisher] with stable message IDs (also the
// outbox relay's publisher), and a [DLQ] that keeps dead letters on a
// dead-letter exchange for `dedup dlq` and [consumer.Replay].
//
// RabbitMQ has no broker-side deduplication worth the name: every nack at
// shutdown, consumer crash and connection drop redelivers. The consumer's
// dedup store is what makes those redeliveries harmless.
//
// # Consumer
//
//   - Manual acknowledgements only, each sent after the processor decided:
//     applied, duplicate (acknowledged silently), business rejection and
//     dead letter (kept by the processor's sink first) are acked.
//   - Retry: RabbitMQ has no delayed negative acknowledgement, and a
//     requeue comes straight back. The adapter declares one retry queue
//     per delay ("<queue>.retry.<delay>", x-message-ttl, dead-lettering
//     back to the work queue through the default exchange), publishes a
//     copy of the message there (same message_id, header Dedup-Retries
//     one higher) in confirm mode, and acks the original only after the
//     copy is confirmed. If the copy cannot be confirmed the original is
//     requeued: a crash between the two leaves two copies, never none, and
//     dedup absorbs the second. The queue is not blocked meanwhile.
//   - QoS prefetch bounds what the broker sends ahead ([WithPrefetch]);
//     [WithConcurrency] bounds how many run at once. [WithBatch] lets a
//     worker claim and complete the deliveries already waiting together
//     (ProcessBatch: two store round trips per batch), each still acked
//     alone after its own decision.
//   - Delivery count: a quorum queue's x-delivery-count (earlier returned
//     deliveries) plus Dedup-Retries, plus one; on a classic queue the
//     redelivered flag counts as one earlier delivery.
//   - Start-up warnings ([Warning]): a quorum queue without a dead-letter
//     exchange drops a message past its delivery limit (20 by default
//     from RabbitMQ 4); a classic queue without one drops what the broker
//     gives up on.
//
// # Connection recovery: the adapter reconnects, the library does not
//
// amqp091-go can recover connections and channels by itself, but then the
// same *Channel value lives on across the drop: a delivery received
// before it still carries that channel as its Acknowledger, and its raw
// delivery tag, which means nothing (or another message) on the new
// channel; and every pending publisher confirm is failed. This package
// never enables library recovery (a dial configuration with Recovery set
// is refused). Each connection is a session with its own channels; a
// delivery is settled only on the session it came from and only while
// that session is alive (a per-session flag set when the connection or
// either channel closes, checked before every ack, nack and retry). A
// decision reached after its channel died is dropped and counted
// (Stats.Stale): the broker has already returned that message to the
// queue, and its redelivery on the new session is a duplicate the
// processor absorbs. The consumer then dials again with backoff,
// redeclares its queues and resubscribes. Stats.PreconditionFailed counts
// channels closed with PRECONDITION_FAILED, the broker's answer to an
// unknown delivery tag; the tests assert it stays 0 across drops.
//
// # Publisher
//
// Confirm mode, persistent, mandatory: a returned (unroutable) message is
// a [*ReturnError], never success. MessageId is the message's stable ID
// on every attempt. A confirm lost with the connection ([ErrConfirmLost])
// or a broker nack is published again under the same ID on a new
// connection, so the worst case is a duplicate that the consumer's dedup
// absorbs. [Publisher.Outbox] adapts it to the outbox relay.
//
// # What it does not do
//
// It does not deduplicate on the broker (no plugin), so a duplicate costs
// a delivery and a store lookup. Reading the dead-letter queue takes one
// pass over it (AMQP cannot peek), fine for dead letters, not for a
// backlog of millions. Attempt counts of the processor live in memory.
package dedupamqp
