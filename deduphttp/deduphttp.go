package deduphttp

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup"
)

// Header names the middleware reads and writes.
const (
	// HeaderKey is the request header carrying the idempotency key.
	HeaderKey = "Idempotency-Key"
	// HeaderReplayed is set to "true" on a response replayed from the
	// store (the handler did not run for it).
	HeaderReplayed = "Idempotent-Replayed"
	// HeaderExpires is set on every stored or replayed response: an
	// HTTP-date until which the key's response is kept at least. A retry
	// with the key after it may run the handler again.
	HeaderExpires = "Idempotency-Key-Expires"
)

// Middleware applies idempotency keys to HTTP handlers on a [dedup.Store].
// It is safe for concurrent use; one Middleware may wrap many handlers.
type Middleware struct {
	store   dedup.Store
	cfg     config
	expires atomic.Pointer[expiresCache]
}

// New returns a Middleware on store, or a [*dedup.ArgumentError] for a nil
// store or a bad option. The caller keeps ownership of store.
func New(store dedup.Store, opts ...Option) (*Middleware, error) {
	if store == nil {
		return nil, &dedup.ArgumentError{Arg: "store", Reason: "is nil"}
	}
	cfg := defaultConfig()
	for _, o := range opts {
		if o != nil {
			o.apply(&cfg)
		}
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return &Middleware{store: store, cfg: cfg}, nil
}

// Handler wraps next; whether a key is required follows [WithKeyRequired].
func (m *Middleware) Handler(next http.Handler) http.Handler {
	return m.wrap(next, m.cfg.required)
}

// Required wraps next so that an unsafe request without a key gets 400.
func (m *Middleware) Required(next http.Handler) http.Handler { return m.wrap(next, true) }

// Optional wraps next so that a request without a key passes through
// unchanged; a request with one is deduplicated.
func (m *Middleware) Optional(next http.Handler) http.Handler { return m.wrap(next, false) }

func (m *Middleware) wrap(next http.Handler, required bool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		m.serve(w, r, next, required)
	})
}

func safeMethod(method string) bool {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	return false
}

func (m *Middleware) now() time.Time { return m.cfg.clock.Now() }

// setExpires sets the expiry header to t, formatted once per second.
func (m *Middleware) setExpires(h http.Header, t time.Time) {
	sec := t.Unix()
	if e := m.expires.Load(); e != nil && e.sec == sec {
		h[HeaderExpires] = e.val
		return
	}
	e := &expiresCache{sec: sec, val: []string{t.UTC().Format(http.TimeFormat)}}
	m.expires.Store(e)
	h[HeaderExpires] = e.val
}

// expiresCache is the last formatted expiry header. Its slice is shared by
// the responses of one second; net/http never modifies it.
type expiresCache struct {
	sec int64
	val []string
}

var replayedValue = []string{"true"}

// initialBodyBuffer is the most readBody allocates before bytes arrive: a
// larger declared Content-Length is read into a buffer that grows with the
// bytes actually received, so a client that declares a large body and
// sends nothing costs no more than one that declares a small one.
const initialBodyBuffer = 16 << 10

// readBody reads at most limit bytes of body, and one more to detect an
// overflow. A small declared length is read in one allocation.
func readBody(body io.Reader, length, limit int64) ([]byte, error) {
	if length >= 0 && length <= initialBodyBuffer && length <= limit {
		b := make([]byte, length, length+1)
		if _, err := io.ReadFull(body, b); err != nil {
			return nil, err
		}
		// A body longer than its Content-Length is the server's problem;
		// read one more byte only to return a consistent result.
		if n, _ := body.Read(b[length : length+1]); n == 0 {
			return b, nil
		}
		b = b[:length+1]
		return readGrowing(body, b, limit)
	}
	return readGrowing(body, make([]byte, 0, 512), limit)
}

// readGrowing appends body to b until EOF or limit+1 bytes, doubling the
// buffer only when it is full.
func readGrowing(body io.Reader, b []byte, limit int64) ([]byte, error) {
	for int64(len(b)) <= limit {
		if len(b) == cap(b) {
			b = slices.Grow(b, min(cap(b), int(limit+1)-len(b)))
		}
		end := min(cap(b), int(limit+1))
		n, err := body.Read(b[len(b):end])
		b = b[:len(b)+n]
		if err == io.EOF {
			return b, nil
		}
		if err != nil {
			return nil, err
		}
	}
	return b, nil
}

func (m *Middleware) logError(r *http.Request, err error) {
	if m.cfg.onError != nil {
		m.cfg.onError(r, err)
	}
}

func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler, required bool) {
	if safeMethod(r.Method) {
		next.ServeHTTP(w, r)
		return
	}
	vals := r.Header.Values(HeaderKey)
	if len(vals) == 0 {
		if required {
			writeProblem(w, http.StatusBadRequest, CodeKeyMissing, "This operation requires an "+HeaderKey+" header.")
			if m.cfg.onDone != nil {
				m.cfg.onDone(r, Event{Class: ClassRejected, Status: http.StatusBadRequest})
			}
			return
		}
		next.ServeHTTP(w, r)
		return
	}
	var ev *Event
	if m.cfg.onDone != nil {
		ev = &Event{start: m.now()}
		defer func() {
			ev.Duration = m.now().Sub(ev.start)
			m.cfg.onDone(r, *ev)
		}()
	}
	status, class := m.serveKeyed(w, r, next, vals, ev)
	if ev != nil {
		ev.Status, ev.Class = status, class
	}
}

// reject writes a problem answer that touched no store.
func reject(w http.ResponseWriter, status int, code, detail string) (int, Class) {
	writeProblem(w, status, code, detail)
	return status, ClassRejected
}

func (m *Middleware) serveKeyed(w http.ResponseWriter, r *http.Request, next http.Handler, vals []string, ev *Event) (int, Class) {
	if len(vals) > 1 {
		return reject(w, http.StatusBadRequest, CodeKeyInvalid, "Send exactly one "+HeaderKey+" header.")
	}
	id, err := ParseKey(vals[0])
	if err != nil {
		return reject(w, http.StatusBadRequest, CodeKeyInvalid, "The "+HeaderKey+" header "+err.(*KeyError).Reason+".")
	}
	if ev != nil {
		ev.KeyHash = keyHash(id)
	}
	tenant := ""
	if m.cfg.tenant != nil {
		t, err := m.cfg.tenant(r)
		if errors.Is(err, ErrTenantInvalid) {
			return reject(w, http.StatusBadRequest, CodeTenantInvalid, "The request names its sender ambiguously: "+strings.TrimPrefix(err.Error(), ErrTenantInvalid.Error()+": ")+".")
		}
		if err != nil || t == "" {
			return reject(w, m.cfg.tenantStatus, CodeTenantMissing, "The request does not say who sends it, so its "+HeaderKey+" cannot be scoped.")
		}
		tenant = t
		if ev != nil {
			ev.Tenant = t
		}
	}
	principal := ""
	if m.cfg.principal != nil {
		p, err := m.cfg.principal(r)
		if errors.Is(err, ErrTenantInvalid) {
			return reject(w, http.StatusBadRequest, CodeTenantInvalid, "The request names its sender ambiguously: "+strings.TrimPrefix(err.Error(), ErrTenantInvalid.Error()+": ")+".")
		}
		if err != nil || p == "" {
			return reject(w, m.cfg.tenantStatus, CodeTenantMissing, "The request does not say who sends it, so its "+HeaderKey+" cannot be scoped.")
		}
		sum := sha256.Sum256([]byte(p))
		principal = hex.EncodeToString(sum[:16])
	}
	if r.ContentLength > m.cfg.maxBody {
		return reject(w, http.StatusRequestEntityTooLarge, CodeBodyTooLarge, "A request with an "+HeaderKey+" may have a body of at most "+strconv.FormatInt(m.cfg.maxBody, 10)+" bytes.")
	}
	var body []byte
	if r.Body != nil && r.Body != http.NoBody {
		body, err = readBody(r.Body, r.ContentLength, m.cfg.maxBody)
		r.Body.Close()
		if err != nil {
			return reject(w, http.StatusBadRequest, CodeBodyUnreadable, "The request body could not be read.")
		}
		if int64(len(body)) > m.cfg.maxBody {
			return reject(w, http.StatusRequestEntityTooLarge, CodeBodyTooLarge, "A request with an "+HeaderKey+" may have a body of at most "+strconv.FormatInt(m.cfg.maxBody, 10)+" bytes.")
		}
		r.Body = &bodyReader{b: body}
	}
	fp, err := m.cfg.fingerprint(r, body)
	if err != nil {
		return reject(w, http.StatusBadRequest, CodeFingerprint, "The request payload could not be fingerprinted: "+err.Error())
	}
	key := scopedKey(tenant, principal, r.Method, m.cfg.route(r), id)

	ctx := r.Context()
	claimed := time.Now() // the deadline is real time, whatever WithClock says
	c, err := m.store.Claim(ctx, key, fp, m.cfg.lease)
	if err == nil && c.Outcome == dedup.InProgress && m.cfg.wait > 0 {
		c, err = m.waitClaim(ctx, key, fp, c)
	}
	if err != nil {
		m.logError(r, err)
		w.Header().Set("Retry-After", "1")
		writeProblem(w, http.StatusServiceUnavailable, CodeStoreDown, "The idempotency store is unavailable; the request was not processed. Retry with the same key.")
		return http.StatusServiceUnavailable, ClassStoreDown
	}
	switch c.Outcome {
	case dedup.Duplicate:
		return m.replay(w, r, c)
	case dedup.InProgress:
		w.Header().Set("Retry-After", strconv.FormatInt(retryAfter(c.LeaseUntil.Sub(m.now())), 10))
		writeProblem(w, http.StatusConflict, CodeInProgress, "A request with this "+HeaderKey+" is still being processed, or its outcome is unknown until its lease ends. Retry later with the same key.")
		return http.StatusConflict, ClassInProgress
	case dedup.Mismatch:
		writeProblem(w, http.StatusUnprocessableEntity, CodeKeyReused, "This "+HeaderKey+" was already used for a different request payload.")
		return http.StatusUnprocessableEntity, ClassMismatch
	case dedup.Acquired:
		return m.run(w, r, next, c, claimed)
	default:
		m.logError(r, errors.New("deduphttp: store returned outcome "+c.Outcome.String()))
		writeProblem(w, http.StatusServiceUnavailable, CodeStoreDown, "The idempotency store gave an unexpected answer; the request was not processed.")
		return http.StatusServiceUnavailable, ClassStoreDown
	}
}

// retryAfter is the Retry-After of an in-progress key: the whole seconds
// left on its lease, rounded up, at least 1.
func retryAfter(left time.Duration) int64 {
	if left <= time.Second {
		return 1
	}
	return int64((left + time.Second - 1) / time.Second)
}

// keyHash is what a log may show of a client's key: the first 8 bytes of
// its SHA-256, in hex.
func keyHash(id string) string {
	sum := sha256.Sum256([]byte(id))
	return hex.EncodeToString(sum[:8])
}

// waitClaim polls the key until it is no longer in progress, the wait runs
// out (the last InProgress claim is returned) or ctx ends.
func (m *Middleware) waitClaim(ctx context.Context, key dedup.Key, fp dedup.Fingerprint, c dedup.Claim) (dedup.Claim, error) {
	deadline := time.NewTimer(m.cfg.wait)
	defer deadline.Stop()
	pause := 5 * time.Millisecond
	t := time.NewTimer(pause)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return c, nil
		case <-deadline.C:
			return c, nil
		case <-t.C:
		}
		nc, err := m.store.Claim(ctx, key, fp, m.cfg.lease)
		if err != nil {
			return nc, err
		}
		if nc.Outcome != dedup.InProgress {
			return nc, nil
		}
		c = nc
		pause = min(2*pause, 200*time.Millisecond)
		t.Reset(pause)
	}
}

func (m *Middleware) replay(w http.ResponseWriter, r *http.Request, c dedup.Claim) (int, Class) {
	sr, err := decodeResponse(c.Result)
	if err != nil {
		m.logError(r, err)
		writeProblem(w, http.StatusInternalServerError, CodeStoredCorrupted, "The stored response for this "+HeaderKey+" cannot be read.")
		return http.StatusInternalServerError, ClassReplayed
	}
	if enc := sr.header["Content-Encoding"]; len(enc) > 0 && !acceptsEncodings(r.Header["Accept-Encoding"], enc) {
		writeProblem(w, http.StatusNotAcceptable, CodeNotAcceptable, "The stored response for this "+HeaderKey+" is encoded as "+strings.Join(enc, ", ")+", which this request's Accept-Encoding does not accept.")
		return http.StatusNotAcceptable, ClassReplayed
	}
	h := w.Header()
	for k, vs := range sr.header {
		h[k] = vs
	}
	h[HeaderReplayed] = replayedValue
	h.Set("Content-Length", strconv.Itoa(len(sr.body)))
	m.setExpires(h, c.ExpiresAt)
	w.WriteHeader(sr.status)
	if r.Method != http.MethodHead {
		w.Write(sr.body)
	}
	return sr.status, ClassReplayed
}

// run calls next with a recorder and then, by the request's outcome class,
// stores the response, releases the key or holds it until its lease ends.
func (m *Middleware) run(w http.ResponseWriter, r *http.Request, next http.Handler, c dedup.Claim, claimed time.Time) (status int, class Class) {
	rec := &recorder{w: w, m: m}
	hctx := r.Context()
	if m.cfg.handlerTimeout > 0 {
		var cancel context.CancelFunc
		hctx, cancel = context.WithDeadline(context.WithoutCancel(hctx), claimed.Add(m.cfg.handlerTimeout))
		defer cancel()
		r = r.WithContext(hctx)
	}
	panicked := true
	defer func() {
		if panicked {
			rec.outcome = outcomeHeld
		}
		status, class = m.finish(r, hctx, c, rec)
	}()
	next.ServeHTTP(rec, r)
	panicked = false
	return
}

// outcomeHeld marks a response that can never be stored: the handler
// panicked, hijacked the connection or wrote too much.
const outcomeHeld Outcome = 255

// finish applies the outcome classes (see the package doc): never started
// releases, finished stores by the policy (or releases), unknown holds the
// key until its lease ends. The store call runs on a detached context with
// its own timeout.
func (m *Middleware) finish(r *http.Request, hctx context.Context, c dedup.Claim, rec *recorder) (int, Class) {
	outcome := rec.outcome
	switch {
	case rec.hijacked || rec.overflow:
		outcome = outcomeHeld
	case rec.status == 0 && outcome == OutcomeFinished && hctx.Err() != nil:
		// Nothing written and the handler's context ended: we cannot tell
		// whether it did its work.
		outcome = OutcomeUnknown
	}
	status := rec.status
	if status == 0 && outcome == OutcomeFinished {
		status = http.StatusOK
	}
	var op func(context.Context) error
	class := ClassHeld
	switch {
	case outcome == OutcomeNotStarted:
		op, class = func(ctx context.Context) error { return m.store.Release(ctx, c) }, ClassReleased
	case outcome == OutcomeFinished && !m.cfg.storeStatus(status):
		op, class = func(ctx context.Context) error { return m.store.Release(ctx, c) }, ClassReleased
	case outcome == OutcomeFinished || (outcome == OutcomeUnknown && m.cfg.storeUnknown && status != 0):
		sr := storedResponse{status: status, header: rec.header, body: rec.body}
		op, class = func(ctx context.Context) error { return m.store.Complete(ctx, c, sr.encode(), m.cfg.retention) }, ClassStored
	}
	if op == nil {
		return status, class
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), m.cfg.finalizeTimout)
	defer cancel()
	if err := op(ctx); err != nil {
		// A failed Complete leaves the outcome unknown: the key stays
		// claimed until its lease ends.
		m.logError(r, err)
		return status, ClassHeld
	}
	return status, class
}

// scopedKey builds the store key of a request: the scope holds the tenant
// (with the principal's hash, when there is one), method and route, each path-escaped (so the "/" separators are
// unambiguous), or their SHA-256 when too long; the ID is the client's key.
func scopedKey(tenant, principal, method, route, id string) dedup.Key {
	var b strings.Builder
	b.Grow(12 + len(tenant) + len(principal) + len(method) + len(route))
	b.WriteString("http/")
	b.WriteString(url.PathEscape(tenant))
	if principal != "" {
		b.WriteString(";p=") // PathEscape escapes ';': unambiguous
		b.WriteString(principal)
	}
	b.WriteByte('/')
	b.WriteString(url.PathEscape(method))
	b.WriteByte('/')
	b.WriteString(url.PathEscape(route))
	scope := b.String()
	if len(scope) > dedup.MaxScopeBytes {
		h := sha256.New()
		for i, p := range []string{tenant, principal, method, route} {
			if i == 1 && p == "" {
				continue // scopes without a principal hash as they always did
			}
			h.Write([]byte(strconv.Itoa(len(p))))
			h.Write([]byte{':'})
			h.Write([]byte(p))
		}
		scope = "http#sha256:" + hex.EncodeToString(h.Sum(nil))
	}
	return dedup.Key{Scope: scope, ID: id}
}

// bodyReader replays the body already read, as the handler's r.Body.
type bodyReader struct {
	b []byte
	i int
}

func (b *bodyReader) Read(p []byte) (int, error) {
	if b.i >= len(b.b) {
		return 0, io.EOF
	}
	n := copy(p, b.b[b.i:])
	b.i += n
	return n, nil
}

func (b *bodyReader) Close() error { return nil }
