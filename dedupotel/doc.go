// Package dedupotel records the events of dedup as OpenTelemetry metrics
// and spans. It depends on the OpenTelemetry API only (otel, otel/metric,
// otel/trace, otel/propagation); the application picks the SDK and the
// exporters, and with none installed every call is a no-op.
//
// A [Telemetry] implements the root hook interfaces: give it to
// dedup.WithHooks and layered.WithHooks for the store metrics. For the
// consumer runtime, wrap the handler with [Telemetry.Handler] (a
// "process" span per run) and pass [Telemetry.Observer] to
// consumer.WithObserver (decision metrics, and a span for each duplicate,
// which runs no handler).
//
// # Metrics
//
//	name                                 instrument           attributes                                                   meaning
//	dedup.claims                         Int64ObsCounter      dedup.store, dedup.scope, dedup.outcome                      claims: acquired, duplicate, in_progress, fingerprint_mismatch, error
//	dedup.duplicates                     Int64ObsCounter      dedup.store, dedup.scope                                     duplicates by the store or layer that caught them
//	dedup.takeovers                      Int64ObsCounter      dedup.store, dedup.scope                                     expired leases taken over
//	dedup.store.errors                   Int64Counter         dedup.store, dedup.operation                                 failed store calls (fail closed)
//	dedup.claim.duration                 Float64Histogram s   dedup.store                                                  store latency of a claim
//	dedup.finish.duration                Float64Histogram s   dedup.store, dedup.operation, dedup.result                   ends of claims (complete, release, keep; ok, lease_lost, error): the count counts them, the values are store latency
//	dedup.consumer.decisions             Int64ObsCounter      messaging.system, messaging.consumer.group.name,             applied, duplicate, retry, dead_lettered, rejected
//	                                                          dedup.scope, dedup.action
//	dedup.http.requests                  Int64Counter         http.route, dedup.http.class, http.response.status_code      keyed HTTP requests by what the middleware did
//	messaging.process.duration           Float64Histogram s   messaging.system, messaging.consumer.group.name,             handler runs; error.type is the failure class
//	                                                          messaging.operation.name, error.type
//	dedup.sweep.deleted                  Int64Counter         dedup.store                                                  expired records deleted by sweeper passes (OnSweep)
//	dedup.sweep.duration                 Float64Histogram s   dedup.store, dedup.result                                    sweeper passes (ok, error) and their duration
//
// The count of a histogram is the number of events, so dedup.finish.duration
// also serves as the counter of finishes, and the sum of
// dedup.consumer.decisions is the number of messages processed.
//
// The four counters of the hot path (Int64ObsCounter: asynchronous
// Int64ObservableCounter) are atomic counts per pre-resolved series,
// reported by one callback when the meter collects: an event costs an
// atomic add, where a synchronous Add costs about 85 ns in the SDK (v1.47
// normalises every measurement's attribute set). The histograms have no
// asynchronous form, so a message costs two SDK calls (claim and finish
// latency, about 250 ns together on the benchmark machine: the floor of
// this adapter; see docs/benchmarks.md). Counters observed this way carry
// no exemplars.
//
// dedup.scope is bounded as in dedupprom: the first 100 distinct scopes
// ([WithMaxScopes]) or an allowlist ([WithScopes]), every other scope
// under "other". Spans carry the scope as it is.
//
// # Traces
//
// One trace follows a message from the business transaction to its effect:
//
//   - The producer calls [Telemetry.Inject] (or [Inject]) on the outbox
//     message's Headers inside its business span: the row stores
//     traceparent and tracestate. Or, once at start-up,
//     outbox.SetHeaderInjector(dedupotel.Inject) (or the Telemetry's
//     Inject method): every outbox writer given the business span's
//     context then adds them to each message without a traceparent.
//   - The relay publishes the headers with the message (every publisher
//     sends outbox headers as broker headers). [Telemetry.PublishedHook],
//     given to outbox.WithPublishedHook, adds a "publish" span per batch
//     (kind producer, linked to each message's trace) and a "send <topic>"
//     span per message in the message's trace.
//   - The consumer adapter copies broker headers into consumer.Message.
//     Headers; [Telemetry.Handler] starts "process <subject>" (kind
//     consumer) as a child of the producer's span, with a link to it, and
//     the attributes messaging.system, messaging.destination.name,
//     messaging.consumer.group.name, messaging.message.id,
//     messaging.operation.name, dedup.scope, dedup.attempt,
//     dedup.taken_over; a failure sets error.type to its class and the
//     span status to Error. A take-over adds a dedup.takeover event to the
//     current span.
//   - A duplicate runs no handler: [Telemetry.Observer] records a
//     "process <subject>" span in the same trace, linked to the producer,
//     with dedup.duplicate=true and dedup.handler_ran=false.
//
// For HTTP, the request's span is the server span of the instrumentation
// around the middleware (otelhttp or another): [Telemetry.HTTPObserver],
// given to deduphttp.WithOnDone, sets dedup.http.class on it (stored,
// replayed, in_progress, key_reused, ...) with a "dedup.http" event, and
// counts dedup.http.requests.
package dedupotel
