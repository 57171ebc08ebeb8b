package outbox

import (
	"context"
	"maps"
	"sync/atomic"
)

// A HeaderInjector writes what ctx carries for the consumers (the W3C
// trace context: traceparent, tracestate) into headers and returns them,
// making the map when headers is nil. dedupotel.Inject and
// (*dedupotel.Telemetry).Inject are HeaderInjectors.
type HeaderInjector func(ctx context.Context, headers map[string]string) map[string]string

var injector atomic.Pointer[HeaderInjector]

// SetHeaderInjector makes every outbox writer that is given a context
// (pgstore's WriteOutbox, WriteOutboxSQL and QueueOutboxContext,
// sqlitestore's WriteOutbox, and through them consumer.NewInboxOutbox and
// consumer.NewApplyOutbox)
// add the headers f writes for the caller's context to each message that
// has no traceparent header of its own, before it is validated and
// written: the trace of the business transaction then continues at the
// relay and at every consumer. Set it once at start-up, as OpenTelemetry's
// own propagator is set process-wide:
//
//	outbox.SetHeaderInjector(dedupotel.Inject)
//
// The package does not import OpenTelemetry; f is called with the
// caller's context and a copy of the message's headers (the caller's map
// is never changed). nil turns injection off. Default: none.
func SetHeaderInjector(f HeaderInjector) {
	if f == nil {
		injector.Store(nil)
		return
	}
	injector.Store(&f)
}

// PrepareContext is [Prepare] after the headers of the process's
// [HeaderInjector] for ctx were added to m (when one is set and m has no
// traceparent header). Writers that are given a context call it before
// any I/O.
func PrepareContext(ctx context.Context, m *Message) error {
	if m == nil {
		return bad("message", "is nil")
	}
	if p := injector.Load(); p != nil && ctx != nil {
		if _, ok := m.Headers["traceparent"]; !ok {
			h := (*p)(ctx, maps.Clone(m.Headers))
			if len(h) > 0 {
				m.Headers = h
			}
		}
	}
	return Prepare(m)
}
