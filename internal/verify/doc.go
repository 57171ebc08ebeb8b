// Package verify is the engine of `dedup verify`: a fault-injecting checker
// that drives an at-least-once pipeline against a store and then counts, in
// a business ledger, how many times each message took effect.
//
// A simulated broker publishes messages with stable IDs onto a queue that
// Config.Consumers goroutines consume. It injects the faults that make
// duplicates happen in production:
//
//   - duplicate deliveries: with Config.DupRate a delivery is queued twice,
//     back to back, so two consumers race on one key;
//   - crashes before the commit: the consumer dies holding the claim, with
//     no effect committed, and acknowledges nothing;
//   - crashes after the commit, before the ack: the effect and the dedup
//     record are durable but the broker never hears of it;
//   - handler failures: the handler returns an error before its effect, so
//     the claim is released and the redelivery must run it again;
//   - redelivery after the visibility timeout, and after a lease expires
//     (the take-over path of a crashed owner).
//
// Every delivery that is not acknowledged is redelivered after a delay. The
// run ends when every delivery has been acknowledged; then every message
// must have exactly one row in the ledger. A message with none is lost, a
// message with more than one was applied twice.
//
// [RunNATS] runs the same pipeline over a real NATS JetStream server instead
// of the simulated broker: the faults are injected by the consumer (a crash
// acks nothing and JetStream redelivers after AckWait; a failure is a
// NakWithDelay), and the extra copies are producer retries from outside
// the broker's duplicate window.
//
// [RunProcesses] runs the consumers as separate OS processes (workers: the
// same binary re-executed, entered through [WorkerMain]) attached to one
// shared store, and SIGKILLs whole workers mid-run, the crash a pod gets.
// The verdict comes from a ledger every process shares: the inbox's SQL
// table, or in lease mode a file the workers append to.
//
// A [Target] is one store in one mode. Lease mode ([NewLease]) runs any
// [dedup.Store] through a [dedup.Runner]: claim, effect, complete, ack.
// Inbox mode ([NewInbox]) writes the ledger row inside the SQL store's
// inbox transaction, so the dedup record and the effect commit together.
//
// What verify does not show: in lease mode the effect is outside the store,
// so a crash between the effect and Complete would apply it twice on the
// take-over. That window is real and is not injected; closing it takes the
// transactional inbox or an idempotent effect. Verify reports what it
// injected, and nothing more.
package verify
