// Package dedupnats runs a [consumer.Processor] on NATS JetStream (the
// jetstream package of nats.go): a durable pull [Consumer] that
// acknowledges each message only after the processor's decision, a
// [Publisher] that stamps the logical message ID on every publish and
// replay, and a dead-letter stream ([DLQ]) that [consumer.Replay] reads.
//
//	js, _ := jetstream.New(nc)
//	dlq, _ := dedupnats.NewDLQ(ctx, js, "ORDERS_DLQ")
//	p, _ := consumer.New("billing", store, handle, consumer.WithDeadLetter(dlq))
//	c, _ := dedupnats.NewConsumer(js, "ORDERS", "billing", p)
//	go c.Run(ctx)
//	defer c.Close()
//
//	pub, _ := dedupnats.NewPublisher(js)
//	dup, err := pub.Publish(ctx, "orders.placed", &consumer.Message{ID: eventID, Payload: body})
//
// # Envelope
//
// A message's logical ID is its Dedup-Msg-Id header, else its Nats-Msg-Id
// header, else "<stream>:<stream sequence>". The last is stable across
// redeliveries of one stored message but not across publishes: a
// producer that publishes the same event again without an ID header makes
// a new message with a new ID, which dedup cannot recognise. Publish with
// an ID. Dedup-Business-Key, Dedup-Aggregate and Dedup-Version (a decimal
// uint64) fill the business key, aggregate and version; every header's
// first value is in Message.Headers; Delivery and Published come from the
// JetStream metadata (NumDelivered, Timestamp).
//
// A message whose Dedup-Version does not parse is not run: the consumer
// hands it to the processor's dead-letter sink at once
// ([consumer.Processor.Quarantine], class permanent, the [*HeaderError] as the
// reason) and terminates it on the broker. Guessing a version would let a
// version guard apply or drop it wrongly, and no retry can fix a header.
//
// # Acknowledgement
//
// Nothing is acknowledged before Process returns. Ack and Rejected are
// acknowledged with Ack (or DoubleAck, see [WithDoubleAck]); Retry with
// NakWithDelay(d.Delay), so the messages behind a failing one keep flowing
// while it waits; DeadLettered with Term, because the sink kept the
// message. Plain Ack is the default because a lost Ack is harmless here:
// the broker redelivers, and the redelivery is a duplicate that the
// processor acknowledges without running the handler.
//
// With MaxDeliver set ([WithMaxDeliver]), a Retry on the last allowed
// delivery is dead-lettered instead ([consumer.Processor.GiveUp]): the
// broker would never redeliver it. If the sink keeps failing until the
// consumer stops, the message is left unacknowledged and logged as an
// error; it stays in the stream but this durable consumer will not see it
// again. The default MaxDeliver is unlimited, since the processor bounds
// attempts by failure class.
//
// Every message held by the consumer, queued or being processed, gets an
// InProgress every third of AckWait, so a handler longer than AckWait (and
// the messages queued behind it) is not redelivered while it runs. The
// default AckWait is max(30s, 1.25 x the processor's lease): after a crash
// the broker redelivers once the dead attempt's claim has expired, so the
// redelivery takes it over at once.
//
// Term is used rather than TermWithReason, which servers before 2.10.4
// ignore (they would redeliver the message).
//
// # Shutdown
//
// Close (or cancelling Run's context) stops pulling, lets the pending pull
// request run out (at most [WithFetchWait]), lets the messages being
// processed finish and be acknowledged (at most [WithDrainTimeout], then
// their context is cancelled), releases the messages fetched but not
// started with Nak for another instance, and flushes the acknowledgements.
// Releasing only after the last pull request ended keeps the broker from
// handing a released message straight back to this consumer's dying
// request.
//
// # Order and concurrency
//
// With the default concurrency of 1, first deliveries are processed in
// stream order; a retried message comes back after its delay, behind the
// messages that followed it. [WithConcurrency] above 1 processes a batch
// in parallel and gives up that order for throughput. [WithBatchProcessing]
// keeps that order and cuts the store's round trips instead: the messages
// queued are run as one batch ([consumer.Processor.ProcessBatch]: one batch
// claim, the handlers in order, one batch complete), then each is settled
// as it would be alone; a message is acknowledged when its batch is done.
//
// # Windows
//
// When Run starts it compares the stream with the processor's retention
// and logs a [WindowWarning] (and calls [WithWindowWarning]'s hook) when
// the stream's duplicate window is shorter than the retention, and when
// the stream keeps messages longer than the retention (a redelivery or a
// replay older than the retention would be applied again).
//
// # Guarantees
//
//   - The broker's duplicate window (Nats-Msg-Id) is defence in depth
//     only: it covers producer retries inside the window. The processor's
//     store covers every redelivery, retry after the window and replay
//     for as long as its retention.
//   - A crash after the store recorded the message but before the Ack:
//     the redelivery is a duplicate, acknowledged without an effect. A
//     crash before: the redelivery applies it (takes over the claim).
//   - A poison message is retried with backoff by Nak delays, not
//     immediately, and then kept in the dead-letter stream with its
//     original IDs; the stream moves on meanwhile.
//   - A dead-letter write is idempotent per (consumer, key, first failure)
//     inside the dead-letter stream's duplicate window.
//   - A replay ([Publisher.Republish]) keeps the original Dedup-Msg-Id and
//     uses a fresh Nats-Msg-Id, so the broker accepts it and the
//     consumer's dedup decides.
//
// # Limits
//
//   - An effect outside the dedup store (an e-mail, a call to another
//     service) can still happen twice when the process dies between the
//     effect and the store's record; use the transactional inbox
//     ([consumer.NewInbox]) or an external idempotency key
//     (consumer.Delivery.Key).
//   - A dead letter is one JetStream message: a payload near the server's
//     max_payload does not fit once JSON-encoded, and the message is then
//     retried instead of dead-lettered.
//   - Messages fetched but not yet acknowledged when the connection drops
//     are redelivered after AckWait.
package dedupnats
