// Package dedupkafka runs a [consumer.Processor] over Kafka with franz-go:
// a consumer-group [Consumer] that commits offsets only after durable
// work, an idempotent [Publisher] (also the outbox relay's publisher,
// [Publisher.Outbox]), and a [DLQ] that keeps dead letters on a topic for
// `dedup dlq` and [consumer.Replay].
//
// Kafka's own exactly-once (the idempotent producer, transactions) covers
// the produce window and consume-transform-produce inside Kafka. A
// consumer crash after its database commit and before its offset commit,
// a rebalance, an offset reset or a replay still redeliver, and an effect
// outside Kafka (a row, a charge) is outside any Kafka transaction. The
// processor's dedup store is what makes those redeliveries harmless.
//
// # Keys
//
// A record's dedup key is its Dedup-Msg-Id header when present, else
// "topic/partition/offset". The latter catches redelivery of that record
// (a crash, a rebalance, an offset reset), not a producer that sends the
// same event twice (the second copy has another offset): producers should
// set Dedup-Msg-Id, as [Publisher] and the outbox relay do.
// Dedup-Business-Key, Dedup-Aggregate (else the record key) and
// Dedup-Version fill the rest of the [consumer.Message]; a Dedup-Version
// that does not parse dead-letters the record ([HeaderError]).
//
// # Consumer
//
//   - Records of one partition run one at a time, in offset order;
//     partitions run in parallel, at most [WithConcurrency] at once.
//   - Offsets are committed only up to the highest contiguous record whose
//     decision is final (applied, duplicate, rejected, dead-lettered),
//     after each poll's records were processed, on a context detached from
//     Run's. The commit runs while the next poll's records are processed
//     (its round trip overlaps the work; the next commit waits for it), so
//     after a crash up to two polls' records come again, as duplicates. In
//     batch mode ([WithBatch]) a partition's last batch completions of a
//     poll overlap the next poll and its first claims: their records are
//     final once the completion returned, and committed by the next commit
//     after that (a poll waiting for records is cut short to make it).
//   - Retry: Kafka has no per-record negative acknowledgement. A Retry
//     decision holds its partition: its fetches are paused, the record
//     and those after it wait in memory for the processor's delay (capped
//     by [WithMaxHold]), and the other partitions go on. Nothing past the
//     held record is committed.
//   - Rebalances: the client is built with kgo.BlockRebalanceOnPoll, so a
//     rebalance waits until the poll's records are processed and their
//     offsets committed: it never interleaves with processing or a commit
//     (kgo.OnPartitionsCallbackBlocked tells the consumer that one waits;
//     it then waits for the commit and the batch completions in flight,
//     commits synchronously and lets the rebalance in).
//     On revocation the consumer commits what is final and drops the
//     partition's unfinished records (the new owner reads them again from
//     the committed offset and dedup absorbs any repeat). On loss
//     (a fenced or expired membership) nothing is committed. Keep a poll's
//     records times the handler time under the rebalance timeout
//     ([WithMaxPollRecords]).
//   - Dead letters go to the processor's sink; a [DLQ] keeps them on a
//     topic with the original value, key, headers and message ID, plus
//     the failure.
//   - Start-up warnings ([Warning]): a topic whose retention.ms outlives
//     the dedup retention (a replay from its start applies records again),
//     committed offsets that expire before the topic's records, and a
//     replay horizon ([WithReplayHorizon]) past the dedup retention.
//
// # Publisher
//
// franz-go's idempotent producer with acks=all (NewPublisher refuses
// options that weaken either), pinned at franz-go v1.22.2 or later, which
// fixes an idempotent-producer bug that could acknowledge a record it
// never wrote. A produce retried inside the client after a lost response
// is written once; a re-send from outside the client (the relay after a
// crash) carries the same Dedup-Msg-Id and is absorbed by the consumer.
//
// # Transactions
//
// A [Transactor] runs consume-transform-produce on franz-go's
// GroupTransactSession (read_committed, KIP-447 stable offsets): a
// handler's output records and the input offsets commit in one Kafka
// transaction, and the input's dedup record is completed only after that
// commit. What each part covers:
//
//   - The Kafka transaction covers the outputs and the input offsets:
//     both become visible to read_committed readers, or neither. An
//     aborted transaction (a rebalance, a refused offset commit, a failed
//     produce, a handler error) leaves no output and rewinds the offsets.
//   - The dedup store covers the handler's effect outside Kafka (a row, a
//     charge), which no Kafka transaction can roll back: the input's key
//     is claimed before the handler runs. After an abort, this process
//     keeps the claim and the handler's outputs in memory and produces
//     them again in the next transaction without running the handler. A
//     completed key is a duplicate: a replay of the input (an offset
//     reset) skips the handler and produces nothing.
//   - Neither covers a partition that moves to another member while its
//     transaction is open after the handler ran: the claim is left to its
//     lease (never released: the effect may have happened), and the new
//     owner takes it over when the lease ends and runs the handler with
//     [TxInput.TakenOver] set and Attempt > 1. The handler must then
//     reconcile by the message ID (a lookup, the provider's idempotency
//     key) before repeating its effect. A claim is released at once only
//     when the effect certainly did not start ([NotStarted]).
//   - An error ending the transaction (franz-go: none is retryable) may
//     leave its outcome unknown: Run returns it and the transaction's
//     claims are left to their lease. A completion that fails after a
//     commit leaves the key in progress until its lease ends (counted in
//     [TxStats].CompleteErrors); only a later replay of the input would
//     meet it, as a take-over.
//
// # What it does not do
//
// It has no retry topic: a retry holds its partition. Attempt counts live
// in memory. Batch mode ([WithBatch]) gives up strict per-key order when a
// record of the batch is retried. The [Transactor] runs one transaction
// at a time, its records in order (no partition parallelism), has no
// dead-letter topic (a handler that keeps failing holds the transaction,
// with backoff, and is logged), and checks no fingerprint.
package dedupkafka
