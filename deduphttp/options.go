package deduphttp

import (
	"errors"
	"fmt"
	"net/http"
	"net/textproto"
	"strconv"
	"strings"
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

// PrincipalFunc returns who, within a tenant, sends the request (a
// verified user ID, the credential presented). Its value is hashed into the
// key scope, never stored as is. An error or an empty principal rejects a
// keyed request with the missing-tenant status.
type PrincipalFunc func(r *http.Request) (string, error)

type config struct {
	tenant         TenantFunc
	singleTenant   bool
	principal      PrincipalFunc
	handlerTimeout time.Duration
	storeUnknown   bool
	onDone         func(*http.Request, Event)
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
	"Location", "Etag", "Last-Modified", "Cache-Control", "Vary",
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
	case c.tenant == nil && !c.singleTenant:
		return bad("tenant", "is not set: a stored response would be replayed to any caller who sends the same key; use WithTenant, or WithSingleTenant when only one client can reach the handler")
	case c.tenant != nil && c.singleTenant:
		return bad("tenant", "WithTenant and WithSingleTenant exclude each other")
	case c.handlerTimeout < 0:
		return bad("handler timeout", "must not be negative, got "+c.handlerTimeout.String())
	case c.handlerTimeout > 0 && c.handlerTimeout >= c.lease:
		return bad("handler timeout", "must be shorter than the lease ("+c.handlerTimeout.String()+" >= "+c.lease.String()+"), or a retry could run while the first call still runs")
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
	case c.maxBody <= 0 || c.maxBody > MaxBodyLimit:
		return bad("max body", "must be between 1 and "+strconv.Itoa(MaxBodyLimit)+" bytes")
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
// two tenants sending the same key never share a record. Required unless
// [WithSingleTenant] is given: without a scope, a key works as a bearer
// token for whoever sent it first's stored response.
func WithTenant(f TenantFunc) Option {
	return optionFunc(func(c *config) { c.tenant = f })
}

// WithSingleTenant declares that every caller of the wrapped handlers is
// one and the same client (or that a gateway in front already separates
// callers), so keys need no tenant scope: any caller who sends a key gets
// the response stored under it. Default off: [New] refuses to build
// without [WithTenant] or this option.
func WithSingleTenant() Option {
	return optionFunc(func(c *config) { c.singleTenant = true })
}

// WithPrincipal mixes who sends the request within its tenant into the key
// scope (its SHA-256, so a credential is never stored), so another user of
// the same tenant cannot replay a stored response either. Default: none,
// keys are scoped by tenant only.
func WithPrincipal(f PrincipalFunc) Option {
	return optionFunc(func(c *config) { c.principal = f })
}

// ErrTenantInvalid is matched (errors.Is) by the error of a tenant or
// principal function when the request names its caller ambiguously: a
// header sent several times, a comma-separated list, or a header the
// request asks to drop at the next hop (named in Connection). The
// middleware answers it with 400.
var ErrTenantInvalid = errors.New("deduphttp: ambiguous tenant or principal")

// TenantHeader returns a [TenantFunc] that reads the tenant from the named
// request header; a missing or empty header is an error; a header sent
// more than once, holding a comma, or named in the request's Connection
// header (a proxy would drop it before the upstream sees it) is an error
// matching [ErrTenantInvalid]. Only use it when a trusted gateway sets the
// header (a client could otherwise claim to be another tenant).
func TenantHeader(name string) TenantFunc {
	name = textproto.CanonicalMIMEHeaderKey(name)
	return func(r *http.Request) (string, error) { return headerValue(r, name, "tenant") }
}

// PrincipalHeader returns a [PrincipalFunc] that reads the principal from
// the named request header (e.g. Authorization: the credential is hashed
// into the key scope). A missing, repeated or Connection-named header is an
// error, as for [TenantHeader]; commas are allowed (a Digest credential
// holds them).
func PrincipalHeader(name string) PrincipalFunc {
	name = textproto.CanonicalMIMEHeaderKey(name)
	return func(r *http.Request) (string, error) { return headerValue(r, name, "principal") }
}

func headerValue(r *http.Request, name, what string) (string, error) {
	noLists := what == "tenant"
	vs := r.Header[name]
	switch {
	case len(vs) == 0 || vs[0] == "":
		return "", &dedup.ArgumentError{Arg: what, Reason: "header " + name + " is missing"}
	case len(vs) > 1:
		return "", fmt.Errorf("%w: header %s is sent %d times", ErrTenantInvalid, name, len(vs))
	case noLists && strings.IndexByte(vs[0], ',') >= 0:
		return "", fmt.Errorf("%w: header %s holds a list", ErrTenantInvalid, name)
	}
	for _, c := range r.Header["Connection"] {
		for tok := range strings.SplitSeq(c, ",") {
			if strings.EqualFold(strings.TrimSpace(tok), name) {
				return "", fmt.Errorf("%w: header %s is named in Connection and would not reach the next hop", ErrTenantInvalid, name)
			}
		}
	}
	return vs[0], nil
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

// MaxBodyLimit is the largest value [WithMaxBody] accepts: 64 MiB.
const MaxBodyLimit = 64 << 20

// WithMaxBody sets the largest request body read for fingerprinting;
// larger keyed requests get 413. The body is read into a buffer that grows
// as bytes arrive, never at the size a request declares. Default 1 MiB, at
// most [MaxBodyLimit].
func WithMaxBody(n int64) Option {
	return optionFunc(func(c *config) { c.maxBody = n })
}

// WithMaxStoredBody sets the largest response body stored for replay. A
// response over it is still sent to the client, but is not stored: the key
// is held until its lease ends (the handler ran; its outcome cannot be
// replayed), and a retry after that runs the handler again. Default 1 MiB.
func WithMaxStoredBody(n int) Option {
	return optionFunc(func(c *config) { c.maxStoredBody = n })
}

// WithReplayHeaders sets the response headers stored and replayed.
// Default [DefaultReplayHeaders].
func WithReplayHeaders(names ...string) Option {
	return optionFunc(func(c *config) { c.replayHeaders = append([]string(nil), names...) })
}

// WithStorePolicy decides from the final status of a finished response
// whether it is stored and replayed (true) or the key is released for a
// retry (false). Default [DefaultStoreStatus].
func WithStorePolicy(f func(status int) bool) Option {
	return optionFunc(func(c *config) { c.storeStatus = f })
}

// WithStoreUnknownOutcome stores the response of a request whose outcome
// is unknown (the handler marked it [OutcomeUnknown], e.g. a proxy's 504
// after the request was sent) as its final answer, as Stripe stores its
// 500s: a retry replays it instead of waiting for the lease to end. A
// handler that panicked, hijacked the connection or wrote a response too
// large to store is still held. Default off: the key stays claimed until
// its lease ends.
func WithStoreUnknownOutcome() Option {
	return optionFunc(func(c *config) { c.storeUnknown = true })
}

// WithHandlerTimeout runs the handler on a context that the client's
// hang-up does not cancel (context.WithoutCancel) and that ends d after
// the key was claimed: the whole exchange's deadline. d must be shorter
// than the lease, so no retry can run while the first call still may.
// Default 0: the handler gets the request's own context.
func WithHandlerTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) { c.handlerTimeout = d })
}

// WithOnDone is called once per keyed request after the middleware has
// answered it and stored, released or held its key, with what happened
// (for a per-request log line or metrics). A request the middleware
// refuses with 400 is reported too, as [ClassRejected]: a malformed or
// repeated key, and a missing key on a [Middleware.Required] route (with
// an empty KeyHash and a zero Duration). Default: none.
func WithOnDone(f func(r *http.Request, e Event)) Option {
	return optionFunc(func(c *config) { c.onDone = f })
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

// DefaultStoreStatus stores 2xx, 3xx and 4xx responses except the
// temporary refusals 401, 403, 408, 409, 423, 425 and 429, after which the
// request never began to execute and a retry (with a fresh token, after a
// pause) should run; those and every 5xx release the key.
func DefaultStoreStatus(status int) bool {
	switch status {
	case 401, 403, 408, 409, 423, 425, 429:
		return false
	}
	return status >= 200 && status < 500
}

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
