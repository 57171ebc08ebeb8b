// Package redisstore is the [dedup.Store] on Redis and Redis Cluster: the
// fast, shared placement, sub-millisecond and visible to every consumer
// instance.
//
// # Guarantees
//
// Every transition (claim, take-over of an expired lease, complete,
// release, extend) is one Lua script on one key: one round trip, atomic on
// the server, timed by the server's clock (TIME), so consumers with skewed
// clocks agree on when a lease ends. Scripts are sent by SHA (EVALSHA) and
// resent whole only when a server answers NOSCRIPT. A record is one
// string with a fixed 28-byte header (state, owner token, hold or expiry,
// attempt count, fingerprint code), the fingerprint (a SHA-256 one as its
// 32 raw bytes) and the result; its TTL is the lease plus a take-over hold
// while in progress and exactly the retention once completed. A completed
// record with a SHA-256 fingerprint and a 32-byte result is 92 bytes, and
// about 200 bytes of Redis memory with its key (MEMORY USAGE;
// docs/benchmarks.md). The scripts fence a call by comparing the token at
// its fixed offset and complete a record by copying its header's tail,
// without decoding it.
//
// # Upgrading from the text records
//
// Versions before the binary layout wrote the same fields as text. This
// version reads both: a completed text record is a duplicate (or a
// mismatch) until it expires, an in-progress one is in progress until its
// lease ends and is then taken over in the binary layout, so a rolling
// upgrade neither loses a record nor lets a duplicate through
// (TestTextRecordsStayReadable). The older version does not read the
// binary layout: while both run, an old process that meets a new record
// fails closed with a store error (the message is redelivered, nothing is
// lost or applied twice), and its fenced calls on a new record report a
// lost lease. Finish the rollout before relying on old processes. Concurrent calls from many
// goroutines share connections and are pipelined by the client, so they
// are coalesced into shared round trips while a lone caller pays no extra
// latency. ClaimBatch sends the first command of every claim in one
// pipeline (and the claim script, in a second, for keys found in
// progress); CompleteBatch sends one pipeline of script calls, each
// completing up to 128 keys that may share a script (any keys on a
// standalone server, keys of one hash slot on a cluster), each key fenced
// by its own token: one script call instead of one a key saves the server
// about a third of its time per completion. Concurrent Complete calls are
// sent the same way: a call joins the batch that fills while up to two
// batches are on the wire, and the first caller to find a slot free sends
// it (a lone call is sent at once; a caller whose context ends before its
// batch is sent gets a not-applied error and its record stays in
// progress; one whose context ends while a batch of several callers is
// on the wire gets an error whose outcome is unknown; a call still queued
// at Close gets ErrClosed and is not sent). On a cluster the client
// splits a pipeline per node and slot and the replies come back in request
// order.
//
// # Cancellation and deadlines
//
// A call whose context has already ended is refused before anything is
// sent: a [*dedup.StoreError] that wraps the context's error and is
// NotApplied. Once a call is on its way it waits for its reply: a
// cancellation of the caller's context no longer ends it, because the
// reply is the only way to know what a claim or a completion did (a
// claim given up on may have run, and then its key waits for the lease
// to end; a completion given up on may have completed). Every call runs
// on a context that keeps the caller's values and deadline but not its
// bare cancellation, and ends at the first of: its reply; the caller's
// deadline or, for a caller that can cancel but set no deadline, the
// store's call bound ([WithCallTimeout]; by default the client's
// ConnWriteTimeout for a store from [Open], 10s for one from [New], which
// cannot see its client's options; it holds even for a client whose
// keep-alive PINGs are off, Dialer.KeepAlive < 0); the client's ConnWriteTimeout (rueidis sets a call answered
// on its caller's goroutine a connection deadline of that length, and
// detects a silent server on a busy connection with PINGs bounded by it,
// plus at most one keep-alive interval; 10s by default: set it, with
// Dialer.KeepAlive, to the longest a shutdown may wait for a silent
// server); Close of a store from [Open], which closes the client. A
// completion with [WithReplicaAck] is the exception: its pipeline holds
// WAIT, which rueidis sends on a dedicated connection with no
// ConnWriteTimeout and which closing the client does not end, so it ends
// at the caller's deadline or at WAIT's timeout plus ConnWriteTimeout
// (plus 30s for a store from [New], which does not know its client's
// options), whichever is first. A call ended that way returns a store
// error whose outcome is unknown. So a
// consumer that stops (its context cancelled) while a call waits for a
// live server gets that call's real outcome, a claim it can complete or
// release, instead of a key left in progress until its lease ends; on a
// silent server the stop waits up to ConnWriteTimeout for that call. The
// exception is a completion that joined a batch another caller sends: its
// caller returns when its context ends (outcome unknown) while the batch
// goes on. A side effect that is also the reason for this: rueidis
// answers a lone call on an idle connection on the caller's goroutine
// only when the call's context has a deadline or cannot be cancelled; a
// cancellable one without a deadline (a consumer's) sent every call
// through its writer and reader goroutines for good
// (docs/benchmarks.md, dedupamqp with Redis, one worker).
//
// # What Redis does not guarantee
//
// Redis is not transactional with your business database, and it loses
// keys: FLUSHALL, a restart without persistence, eviction under maxmemory,
// or a failover to a replica that had not yet received the last writes
// (replication is asynchronous). A completed key that is lost makes the
// next delivery of that message look new, and the effect runs twice: a
// retry that arrives 90 seconds after a failover charges the customer
// again. TestFlushAllLetsDuplicatesThrough shows it. Do not use Redis as
// the only dedup layer for effects that must not repeat: put it in front of
// a durable store (PostgreSQL or SQLite with the transactional inbox) in
// the layered deduplicator, where a Redis miss falls through to the durable
// record. Set maxmemory-policy to noeviction on a Redis that holds claims.
// [WithReplicaAck] makes each completion wait for replicas (WAIT) and fail
// closed when they do not answer in time; that narrows the failover window
// but does not close it (WAIT is not consensus: see the option).
//
// # Failures
//
// Connection refused, a timeout, a context ended before the call and a
// server restart give a [*dedup.StoreError] wrapping the cause; callers fail closed (the
// Runner does not run the handler and does not report a duplicate). No
// store error is reported SafeToRetry once the script may have been sent:
// a claim whose reply was lost may have run, and then its lease protects
// the key until it ends (a redelivery sees InProgress, then takes over); a
// complete whose reply was lost is safe to send again with the same token,
// which is a no-op if it had run. The client reconnects by itself.
//
// # Client choice
//
// rueidis, because it pipelines concurrent commands automatically over a
// few connections. Measured on this kind of machine (docs/benchmarks.md and
// the shared baselines): rueidis auto-pipelining from 64 goroutines gave
// 1.75x the throughput of go-redis with 64 goroutines and a 5x lower p99,
// with no batching code in this package. go-redis appears only in the
// benchmark, as the naive baseline.
package redisstore
