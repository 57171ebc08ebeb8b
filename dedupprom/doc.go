// Package dedupprom exports the deduplication events of every part of
// dedup as Prometheus metrics, on github.com/prometheus/client_golang.
//
// A [Metrics] is a prometheus.Collector that implements the root hook
// interfaces ([dedup.ClaimHook], [dedup.DuplicateHook],
// [dedup.TakeoverHook], [dedup.FinishHook], [dedup.StoreErrorHook],
// [dedup.SweepHook]: pass it to pgstore.SweepOptions.Hooks or
// sqlitestore.WithSweepHooks) and
// gives observers for the consumer runtime ([Metrics.Observer]) and the
// HTTP middleware ([Metrics.HTTPObserver]). Parts that keep their own
// counters (a layered store, a consumer processor, an outbox relay, a
// broker adapter, a sweeper) are exported by collectors that read their
// Stats at each scrape, so nothing is counted twice; a broker's backlog is
// asked of the broker at each scrape ([Metrics.LagCollector]). Register
// the Metrics and each collector with a registry; serve it with [Handler].
//
// # Metrics
//
// Every name starts with the namespace ([WithNamespace], default "dedup").
//
//	name                                 type       labels                      meaning
//	claims_total                         counter    store, scope, outcome       claims by outcome: acquired, duplicate, in_progress, fingerprint_mismatch, error
//	duplicates_total                     counter    store, scope                duplicates by the store or layer that caught them (window, bloom, the fast and durable store names, the runner name)
//	takeovers_total                      counter    store, scope                expired leases taken over: the previous owner probably crashed mid-effect
//	finishes_total                       counter    store, op, result           ends of claims: op complete, release, keep; result ok, lease_lost, error
//	store_errors_total                   counter    store, op                   failed store calls (fail closed)
//	claim_duration_seconds               histogram  store                       store latency of a claim
//	finish_duration_seconds              histogram  store, op                   store latency of a complete or release
//	consumer_decisions_total             counter    consumer, scope, action     applied, duplicate, retry, dead_lettered, rejected
//	consumer_failures_total              counter    consumer, class             failed runs by class: unclassified, transient, permanent, business, unknown
//	consumer_redeliveries_total          counter    consumer                    messages the broker delivered more than once
//	consumer_reconciled_total            counter    consumer                    unknown outcomes settled as applied by the reconciler (ProcessorCollector)
//	consumer_in_progress_total           counter    consumer                    retries because another consumer held the key (ProcessorCollector)
//	consumer_store_errors_total          counter    consumer                    retries because the store failed (ProcessorCollector)
//	http_requests_total                  counter    handler, class, code        keyed requests: rejected, store_unavailable, in_progress (409), key_reused (422), replayed, stored, released, held
//	http_request_duration_seconds        histogram  handler, class              a keyed request's arrival to its key stored, released or held
//	layered_duplicates_total             counter    store, layer                duplicates caught by each layer: window, bloom, fast, durable (LayeredCollector)
//	layered_suspected_total              counter    store                       Bloom "maybe" answers passed on (LayeredCollector)
//	layered_fast_errors_total            counter    store                       fast-store failures passed over (LayeredCollector)
//	layered_fast_unsure_total            counter    store                       fast "in progress"/"mismatch" confirmed by the durable store (LayeredCollector)
//	outbox_published_total               counter    relay                       messages acknowledged and marked published (RelayCollector)
//	outbox_failed_total                  counter    relay                       failed publish attempts (RelayCollector)
//	outbox_quarantined_total             counter    relay                       messages quarantined (RelayCollector)
//	outbox_batches_total                 counter    relay                       batches published (RelayCollector)
//	outbox_lease_lost_total              counter    relay                       marks refused after a partition take-over (RelayCollector)
//	outbox_fetches_total                 counter    relay                       partition reads (RelayCollector)
//	outbox_partitions_held               gauge      relay                       partitions held now (RelayCollector)
//	outbox_backlog                       gauge      relay                       unpublished messages (RelayCollector with a backlog func)
//	outbox_oldest_unpublished_seconds    gauge      relay                       age of the oldest unpublished message (idem)
//	broker_fetched_total                 counter    system, consumer            messages received (BrokerCollector)
//	broker_acked_total                   counter    system, consumer            acknowledged (BrokerCollector)
//	broker_nacked_total                  counter    system, consumer            negatively acknowledged (BrokerCollector)
//	broker_dead_letters_total            counter    system, consumer            terminated after a dead letter (BrokerCollector)
//	broker_ack_errors_total              counter    system, consumer            acknowledgements not sent (BrokerCollector)
//	broker_lag                           gauge      system, consumer            undelivered messages as the broker reports them at the scrape: NATS num_pending, Kafka group lag, RabbitMQ ready messages (LagCollector)
//	broker_unacked                       gauge      system, consumer            delivered and not acknowledged yet, where the broker says: NATS num_ack_pending (LagCollector)
//	sweep_rows_deleted_total             counter    store                       expired records deleted, from the sweepers' events (OnSweep)
//	sweep_pass_duration_seconds          histogram  store, result               sweeper passes by result ok, error: their duration; the count is the passes (OnSweep)
//	sweep_deleted_total                  counter    store                       expired records deleted (SweepCollector)
//	sweep_passes_total                   counter    store                       sweeper passes (SweepCollector)
//	sweep_last_failed                    gauge      store                       1 when the last pass failed (SweepCollector)
//
// # Bounded labels
//
// The scope label comes from key scopes, which a user may multiply without
// limit (a tenant per scope). It is bounded: by default the first 100
// distinct scopes keep their name and every later one is counted under
// "other" ([WithMaxScopes]); [WithScopes] sets an exact allowlist instead,
// and [WithScopeLabel] rewrites a scope first (dropping a tenant prefix).
// The store, consumer, handler and relay labels are names the user sets
// in configuration. Key IDs, tenants, payloads and error texts are never
// labels.
//
// # Counting once
//
// The layered store reports each claim under the layer that answered it;
// a [dedup.Runner] over it reports the same claim again under the
// runner's name ([dedup.WithName]). Give the hooks to both to see
// duplicates by layer and the runner's totals; sum duplicates_total over
// the layer names only, or filter by store, never over both.
//
// # Cost
//
// An event costs one map lookup (a scope with a label of its own is found
// under its raw value with its pre-resolved series; a scope past the cap
// or with a rewrite takes a second) and atomic adds: no lock and no
// allocation once the series exist. See docs/benchmarks.md.
package dedupprom
