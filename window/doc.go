// Package window is an in-process record of recently completed keys: an
// exact, bounded, sharded record of their hashes, and, in two of its three
// modes, an ageing Bloom filter behind it. It sits in front of a store (see
// package layered) or, for best-effort streams, alone.
//
//	w, _ := window.New(window.WithCapacity(1 << 20))
//	if v, result, ok := w.Check(key); v == window.Hit && ok {
//		return result // a duplicate: no network call
//	}
//	// ... claim in the store, run the handler, complete in the store, then:
//	w.Add(key, result, time.Now().Add(retention)) // never past the store's record
//
// # What it guarantees
//
//   - A Hit is certain: the key was given to [Window.Add] and its expiresAt
//     has not passed on the window's clock. The record keeps two independent
//     64-bit keyed hashes (hash/maphash, seeds drawn per window) of the scope
//     and the ID, not the strings; two different keys are confused only if
//     both hashes collide: a check of a new key is a false Hit with a
//     probability of about n/2^128 for n keys held (3·10^-33 for a
//     million), and any two of the n collide with about n²/2^129, so the
//     record is exact in practice. Scope and ID are hashed separately, so
//     moving bytes between them gives another key.
//   - An entry never outlives the expiresAt it was added with: Check compares
//     it with the clock on every hit. Expired entries are a Miss and are
//     reclaimed lazily (on Check, and first when a shard needs room).
//   - Memory is bounded. The exact record holds at most [WithCapacity] keys,
//     about 59 bytes each when full (measured: 59 bytes a key with 1M keys,
//     against 208 for golang-lru and 121 for otter holding the same keys),
//     plus the results it keeps (at most [WithResultLimit] bytes each). The
//     Bloom filter's size is fixed when the window is created and never
//     grows, however long the window runs.
//   - The Bloom filter has no false negatives for keys added to its live
//     generations, and its false-positive rate on new keys is at most the
//     configured bound at the worst moment (every generation full), with a
//     10% margin for what the textbook formula leaves out: measured 0.90 to
//     0.96 times the bound at the default size and 0.77 to 0.94 times at a
//     small one, over several turns of the generations.
//   - A Check hit does not allocate. Every method is safe for concurrent use.
//
// # What it does not guarantee
//
//   - It is not durable and not shared: it is empty after a restart, it does
//     not follow a partition that a rebalance moves to another consumer, and
//     it never sees keys completed by other instances. A Miss says nothing;
//     ask the store. Never make it the only layer for effects that must
//     happen once (a charge, an e-mail): put the authoritative store behind
//     it.
//   - A full shard evicts (counted in [Stats].Evictions), and a redelivery of
//     an evicted key is a Miss and goes to the store. Eviction is sampled
//     LRU: the least recently added or hit of 16 neighbouring entries. On a
//     redelivery trace (30% of messages redelivered after a delay of about
//     half the capacity) it caught 84.7% of redeliveries where an exact LRU
//     caught 85.0% and otter, whose admission policy refuses many new keys,
//     13%. A key is evicted only when it is the least recent of the 16, so
//     it survives at least until 15 other keys of its shard (all of them, in
//     a shard of fewer than 16) have been added or hit after it, and in
//     practice about as many as the shard holds.
//   - The Bloom filter cannot forget: [Window.Forget] and expiry drop only the
//     exact entry. A generation is no longer read once every key in it has
//     expired, so with one retention for all keys a key can read Maybe for up
//     to one generation's span after it expired (at most d with
//     [WithRotateEvery](d)), and otherwise until its generation is retired.
//   - Keys are not validated; validate them where they enter the program.
//   - An expiresAt with a monotonic reading (from time.Now) is compared on
//     the monotonic clock; one without (read back from a store) on the wall
//     clock, so a wall-clock jump moves it.
//
// # Modes
//
// [Exact] keeps the exact record only. Use it in front of an authoritative
// store when duplicates come in bursts: a consumer crashed after completing
// a batch and the broker redelivers it within seconds. An exact hit skips
// the network entirely: about 0.1 µs in process instead of a store round
// trip (about 65 µs for Redis on loopback, more for a database, more again
// across a network). That is the whole saving; a Miss adds about 0.05 to
// 0.2 µs before the store is asked (plus a Bloom test, about 0.3 µs, in the
// other modes).
//
// [Confirm] adds the Bloom filter as a backstop for keys the exact record
// has evicted. A Maybe never decides: the caller must confirm it with the
// authoritative store, exactly as for a Miss, so a false positive never
// drops a message. By itself a Maybe saves nothing (the store is asked
// anyway); it is a signal, for metrics (suspected duplicates beyond the
// exact window) and for routing a suspected duplicate straight to the
// authoritative store rather than a fast cache that may have lost it.
//
// [Lossy] adds the Bloom filter and the caller treats a Maybe as a
// duplicate without asking any store. It is for best-effort streams only
// (analytics, metrics), where losing a stated fraction of messages is
// acceptable: it drops about [Window.FalsePositiveBound] of genuinely new
// keys (0.1% by default: one new key in a thousand), plus expired keys for
// up to a generation's span as said above. Never use it for payments,
// orders, or anything a customer sees.
//
// # The Bloom filter
//
// [WithBloom](keys, fpRate, generations) keeps generations standard Bloom
// filters, each sized for keys/generations keys at a rate of
// 1-(1-fpRate)^(1/generations), so that the union of the live generations,
// holding keys keys, has a rate of at most fpRate: each has
// m = -n·ln(p)/ln²2 bits and k = m/n·ln 2 probes. New keys go into the
// newest generation; when it has taken keys/generations keys (counting only
// keys that set a new bit), or when [WithRotateEvery] has passed, the
// oldest generation is cleared and becomes the newest. The default (10M
// keys, 0.1%, 4 generations) takes 20.8 MiB, against 17.1 MiB for one
// bits-and-blooms filter of 10M keys at 0.1% that is never cleared and so
// fills up: ageing costs 22% more memory and keeps the rate bounded
// forever. Retiring a generation clears 5.2 MiB, about 5 ms, paid by the
// Add or Check that triggers it.
//
// It is this package's own, lock-free: the generations are interleaved word
// by word, so one probe reads the same word of every generation from one
// cache line, and a test costs about as many cache misses as a single
// filter; bits are set with atomic OR after the probes' words have been
// read (so their cache misses overlap), and a rotation takes the oldest
// generation out of the set that tests read before clearing it. It was
// chosen over generations of bits-and-blooms filters behind a lock by a
// benchmark in the same run (BenchmarkBloom, 10M keys at 0.1%, half full):
// a test of a new key took 305 ns against 731 ns (122 ns against 310 ns
// from two goroutines), and a test-and-add 540 ns against 1297 ns; a
// single bits-and-blooms filter without ageing or lock took 273 ns and
// 587 ns. These costs are cache misses: a 20 MiB filter does not fit in
// the caches, and a Check in Confirm or Lossy mode pays one test on every
// exact miss.
//
// # Costs
//
// Measured on a shared 2-core VM, in one run with golang-lru v2 and otter
// v2 used directly with the same keys (window_bench_test.go). A hit on a
// batch just added, the case the window is for, takes about 80-95 ns
// (hashing about 25 ns, reading the clock about 27 ns, the lookup and the
// lock the rest) with no allocation; golang-lru's Get took 70-93 ns in the
// same runs, and otter 68-190 ns while missing 17% of the keys. A check
// over 1M random keys is bound by cache and TLB misses for every
// implementation: a miss about 165 ns (76 ns from two goroutines), where
// golang-lru took 149 ns (213 ns) and otter 157 ns (56 ns). An Add that
// evicts takes about 265 ns, against 400-575 ns for golang-lru and 440-725
// ns for otter, which also allocate on every Add.
package window
