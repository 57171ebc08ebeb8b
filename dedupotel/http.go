package dedupotel

import (
	"net/http"

	"github.com/dedupkit/dedup/deduphttp"
	"github.com/dedupkit/dedup/internal/scopelabel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// Attribute keys of keyed HTTP requests.
const (
	AttrHTTPClass  = attribute.Key("dedup.http.class")
	AttrHTTPStatus = attribute.Key("http.response.status_code")
	AttrHTTPRoute  = attribute.Key("http.route")
)

// HTTPObserver returns a function for [deduphttp.WithOnDone] that counts
// keyed requests as dedup.http.requests (http.route = name, the class
// of what the middleware did, the status code) and, when the request's
// context holds a recording span (the server span of otelhttp or any
// instrumentation that wraps the middleware), sets dedup.http.class on it
// and adds a "dedup.http" event with the class and the time the key took.
// A replay (class replayed) and a 422 (key_reused) thus show on the
// request's own span. The tenant and the key are never attributes.
func (t *Telemetry) HTTPObserver(name string) func(*http.Request, deduphttp.Event) {
	return func(r *http.Request, e deduphttp.Event) {
		code := e.Status
		if code < 100 || code > 599 {
			code = 0
		}
		opts := t.byHTTP.Get(scopelabel.Pair{A: name, B: string(e.Class) + " " + statusText(code)})
		t.httpRequests.Add(r.Context(), 1, opts.add...)
		if sp := trace.SpanFromContext(r.Context()); sp.IsRecording() {
			sp.SetAttributes(AttrHTTPClass.String(string(e.Class)))
			sp.AddEvent("dedup.http", trace.WithAttributes(AttrHTTPClass.String(string(e.Class)), attribute.Float64("dedup.http.key_seconds", e.Duration.Seconds())))
		}
	}
}

type httpSets struct{ add []metric.AddOption }

func statusText(code int) string {
	if code == 0 {
		return "0"
	}
	b := []byte{byte('0' + code/100), byte('0' + code/10%10), byte('0' + code%10)}
	return string(b)
}
