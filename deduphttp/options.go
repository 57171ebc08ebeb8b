package deduphttp

import (
	"net/http"
	"net/textproto"
	"time"

	"github.com/dedupkit/dedup"
)

// An Option configures a [Middleware].
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

// FingerprintFunc computes the fingerprint of a keyed request from the
// request and its body (already read; the handler still gets the whole
// body). An error rejects the request with 400.
type FingerprintFunc func(r *http.Request, body []byte) (dedup.Fingerprint, error)

// TenantFunc returns who sends the request (an authenticated principal, an
// API key's account, a header). An error or an empty tenant rejects a keyed
// request with the missing-tenant status.
type TenantFunc func(r *http.Request) (string, error)

type config struct {
	tenant         TenantFunc
	tenantStatus   int
	route          func(*http.Request) string
	fingerprint    FingerprintFunc
	required       bool
	lease          time.Duration
	retention      time.Duration
	wait           time.Duration
	maxBody        int64
	maxStoredBody  int
	replayHeaders  []string
	storeStatus    func(int) bool
	finalizeTimout time.Duration
	onError        func(*http.Request, error)
	clock          dedup.Clock
}

// DefaultReplayHeaders are the response headers stored and replayed by
// default. Others (Set-Cookie, Date, hop-by-hop and per-response headers)
// are sent on the first response only.
var DefaultReplayHeaders = []string{
	"Content-Type", "Content-Language", "Content-Encoding", "Content-Location",
	"Location", "Etag", "Last-Modified",
}

func defaultConfig() config {
	return config{
		tenantStatus:   http.StatusUnauthorized,
		route:          defaultRoute,
		fingerprint:    DefaultFingerprint,
		required:       true,
		lease:          30 * time.Second,
		retention:      24 * time.Hour,
		maxBody:        1 << 20,
		maxStoredBody:  1 << 20,
		replayHeaders:  DefaultReplayHeaders,
		storeStatus:    DefaultStoreStatus,
		finalizeTimout: 10 * time.Second,
		clock:          dedup.SystemClock{},
	}
}

func (c *config) validate() error {
	bad := func(arg, reason string) error { return &dedup.ArgumentError{Arg: arg, Reason: reason} }
	switch {
	case c.tenantStatus < 400 || c.tenantStatus > 499:
		return bad("missing tenant status", "must be a 4xx status")
	case c.route == nil:
		return bad("route func", "is nil")
	case c.fingerprint == nil:
		return bad("fingerprint func", "is nil")
	case c.lease <= 0:
		return bad("lease", "must be positive, got "+c.lease.String())
	case c.retention <= 0:
		return bad("retention", "must be positive, got "+c.retention.String())
	case c.wait < 0:
		return bad("wait", "must not be negative, got "+c.wait.String())
	case c.maxBody <= 0:
		return bad("max body", "must be positive")
	case c.maxStoredBody <= 0:
		return bad("max stored body", "must be positive")
	case c.storeStatus == nil:
		return bad("store policy", "is nil")
	case c.finalizeTimout <= 0:
		return bad("finalize timeout", "must be positive, got "+c.finalizeTimout.String())
	case c.clock == nil:
		return bad("clock", "is nil")
	}
	hs := make([]string, 0, len(c.replayHeaders))
	for _, h := range c.replayHeaders {
		if h == "" {
			return bad("replay header", "is empty")
		}
		hs = append(hs, textproto.CanonicalMIMEHeaderKey(h))
	}
	c.replayHeaders = hs
	return nil
}

// WithTenant sets who a request belongs to; every key is scoped by it, so
// two tenants sending the same key never share a record. Default: none, all
// requests are one anonymous tenant (use this only when the service has a
// single client, or behind a gateway that already separates tenants).
func WithTenant(f TenantFunc) Option {
	return optionFunc(func(c *config) { c.tenant = f })
}

// TenantHeader returns a [TenantFunc] that reads the tenant from the named
// request header; a missing or empty header is an error. Only use it when
// a trusted gateway sets the header (a client could otherwise claim to be
// another tenant).
func TenantHeader(name string) TenantFunc {
	return func(r *http.Request) (string, error) {
		v := r.Header.Get(name)
		if v == "" {
			return "", &dedup.ArgumentError{Arg: "tenant", Reason: "header " + name + " is missing"}
		}
		return v, nil
	}
}

// WithMissingTenantStatus sets the status of a keyed request whose tenant
// function fails or returns "": a 4xx. Default 401 Unauthorized.
func WithMissingTenantStatus(code int) Option {
	return optionFunc(func(c *config) { c.tenantStatus = code })
}

// WithRoute sets the operation part of the key scope. Default: r.Pattern
// (the Go 1.22 ServeMux pattern that matched) when set, else the URL path.
func WithRoute(f func(*http.Request) string) Option {
	return optionFunc(func(c *config) { c.route = f })
}

// WithFingerprint sets how a request's payload is fingerprinted. Default
// [DefaultFingerprint]: method, path, query and body.
func WithFingerprint(f FingerprintFunc) Option {
	return optionFunc(func(c *config) { c.fingerprint = f })
}

// WithKeyRequired sets whether [Middleware.Handler] requires a key on
// unsafe methods (400 when missing) or lets keyless requests through.
// Default true. [Middleware.Required] and [Middleware.Optional] choose per
// route.
func WithKeyRequired(required bool) Option {
	return optionFunc(func(c *config) { c.required = required })
}

// WithLease sets how long the first request owns its key. A request still
// running after its lease may be run again by a retry: make it longer than
// the slowest handler. Default 30s.
func WithLease(d time.Duration) Option {
	return optionFunc(func(c *config) { c.lease = d })
}

// WithRetention sets how long a completed response is replayed; it is the
// published expiry policy. Default 24h.
func WithRetention(d time.Duration) Option {
	return optionFunc(func(c *config) { c.retention = d })
}

// WithWait makes a request whose key is in progress wait up to d for the
// first request to finish and then replay its response (or run, if the
// first released the key), instead of answering 409 at once. It still gets
// 409 when d runs out. Default 0: no waiting.
func WithWait(d time.Duration) Option {
	return optionFunc(func(c *config) { c.wait = d })
}

// WithMaxBody sets the largest request body read for fingerprinting;
// larger keyed requests get 413. Default 1 MiB.
func WithMaxBody(n int64) Option {
	return optionFunc(func(c *config) { c.maxBody = n })
}

// WithMaxStoredBody sets the largest response body stored for replay. A
// response over it is still sent to the client, but is not stored: the key
// is released and a retry runs the handler again. Default 1 MiB.
func WithMaxStoredBody(n int) Option {
	return optionFunc(func(c *config) { c.maxStoredBody = n })
}

// WithReplayHeaders sets the response headers stored and replayed.
// Default [DefaultReplayHeaders].
func WithReplayHeaders(names ...string) Option {
	return optionFunc(func(c *config) { c.replayHeaders = append([]string(nil), names...) })
}

// WithStorePolicy decides from the final status whether a response is
// stored and replayed (true) or the key is released for a retry (false).
// Default [DefaultStoreStatus]: 2xx, 3xx and 4xx are stored, 5xx released.
func WithStorePolicy(f func(status int) bool) Option {
	return optionFunc(func(c *config) { c.storeStatus = f })
}

// WithFinalizeTimeout bounds storing or releasing a response after the
// handler returns. It runs on a context detached from the request, so a
// client that hung up does not cancel it. Default 10s.
func WithFinalizeTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) { c.finalizeTimout = d })
}

// WithErrorLog is called with store errors (claim, complete, release) and
// unreadable records. Default: none.
func WithErrorLog(f func(r *http.Request, err error)) Option {
	return optionFunc(func(c *config) { c.onError = f })
}

// WithClock sets the clock used for Retry-After and the expiry header.
// Default dedup.SystemClock{}.
func WithClock(clock dedup.Clock) Option {
	return optionFunc(func(c *config) { c.clock = clock })
}

// DefaultStoreStatus stores every final status below 500.
func DefaultStoreStatus(status int) bool { return status < 500 }

// DefaultFingerprint fingerprints the method, the escaped path with its
// query, and the body with [dedup.FingerprintParts].
func DefaultFingerprint(r *http.Request, body []byte) (dedup.Fingerprint, error) {
	return dedup.FingerprintParts([]byte(r.Method), []byte(r.URL.RequestURI()), body), nil
}

// FingerprintJSONFields returns a [FingerprintFunc] of the method, the
// path and the named fields of a JSON body (dotted paths, see
// [dedup.FingerprintJSON]), so volatile fields (timestamps, trace IDs) do
// not make a retry a mismatch. A body that is not JSON is rejected with 400.
func FingerprintJSONFields(fields ...string) FingerprintFunc {
	fields = append([]string(nil), fields...)
	return func(r *http.Request, body []byte) (dedup.Fingerprint, error) {
		fp, err := dedup.FingerprintJSON(body, fields...)
		if err != nil {
			return "", err
		}
		return dedup.FingerprintParts([]byte(r.Method), []byte(r.URL.RequestURI()), []byte(fp)), nil
	}
}

func defaultRoute(r *http.Request) string {
	if r.Pattern != "" {
		return r.Pattern
	}
	return r.URL.Path
}
