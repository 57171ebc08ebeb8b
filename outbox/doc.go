// Package outbox is the producer half of exactly-once effects: messages
// written to an outbox table in the caller's business transaction, and a
// relay that publishes them to a broker after the commit, in commit order
// per aggregate key, with one stable message ID on every attempt so that
// the consumer's dedup absorbs the relay's retries.
//
// The package is broker-neutral and store-neutral. [Message] is what a
// producer writes (pgstore and sqlitestore write it in the caller's
// transaction); [Publisher] is the small interface a broker adapter
// implements (dedupnats for NATS JetStream); [Source] is what a store
// gives the relay (partitioned reads, leases with fencing, marking and
// quarantine).
//
// What it guarantees: a message is published only if its transaction
// committed; every committed message is published at least once, under
// its ID, unless an operator drops it from quarantine; messages of one
// Key are published in the order the store reads them (row order among
// committed rows, see docs/DESIGN.md), and a quarantined message holds up
// only its own Key. What it does not: exactly-once publication. A crash
// between the broker's acknowledgement and the mark re-sends the message
// under the same ID; the broker's duplicate window and the consumer's
// dedup store make that harmless.
package outbox
