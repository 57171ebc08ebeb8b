package deduphttp

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"net/http"
	"net/url"
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

// readBody reads at most limit bytes of body (one more to detect an
// overflow), in one allocation when the length is known.
func readBody(body io.Reader, length, limit int64) ([]byte, error) {
	if length < 0 || length > limit {
		return io.ReadAll(io.LimitReader(body, limit+1))
	}
	b := make([]byte, length, length+1)
	if _, err := io.ReadFull(body, b); err != nil {
		return nil, err
	}
	// A body longer than its Content-Length is the server's problem; read
	// one more byte only to return a consistent result.
	if n, _ := body.Read(b[length : length+1]); n > 0 {
		return io.ReadAll(io.LimitReader(io.MultiReader(bytes.NewReader(b[:length+1]), body), limit+1))
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
	switch {
	case len(vals) == 0:
		if required {
			writeProblem(w, http.StatusBadRequest, CodeKeyMissing, "This operation requires an "+HeaderKey+" header.")
			return
		}
		next.ServeHTTP(w, r)
		return
	case len(vals) > 1:
		writeProblem(w, http.StatusBadRequest, CodeKeyInvalid, "Send exactly one "+HeaderKey+" header.")
		return
	}
	id, err := ParseKey(vals[0])
	if err != nil {
		writeProblem(w, http.StatusBadRequest, CodeKeyInvalid, "The "+HeaderKey+" header "+err.(*KeyError).Reason+".")
		return
	}
	tenant := ""
	if m.cfg.tenant != nil {
		t, err := m.cfg.tenant(r)
		if err != nil || t == "" {
			writeProblem(w, m.cfg.tenantStatus, CodeTenantMissing, "The request does not say who sends it, so its "+HeaderKey+" cannot be scoped.")
			return
		}
		tenant = t
	}
	if r.ContentLength > m.cfg.maxBody {
		writeProblem(w, http.StatusRequestEntityTooLarge, CodeBodyTooLarge, "A request with an "+HeaderKey+" may have a body of at most "+strconv.FormatInt(m.cfg.maxBody, 10)+" bytes.")
		return
	}
	var body []byte
	if r.Body != nil && r.Body != http.NoBody {
		body, err = readBody(r.Body, r.ContentLength, m.cfg.maxBody)
		r.Body.Close()
		if err != nil {
			writeProblem(w, http.StatusBadRequest, CodeBodyUnreadable, "The request body could not be read.")
			return
		}
		if int64(len(body)) > m.cfg.maxBody {
			writeProblem(w, http.StatusRequestEntityTooLarge, CodeBodyTooLarge, "A request with an "+HeaderKey+" may have a body of at most "+strconv.FormatInt(m.cfg.maxBody, 10)+" bytes.")
			return
		}
		r.Body = &bodyReader{b: body}
	}
	fp, err := m.cfg.fingerprint(r, body)
	if err != nil {
		writeProblem(w, http.StatusBadRequest, CodeFingerprint, "The request payload could not be fingerprinted: "+err.Error())
		return
	}
	key := scopedKey(tenant, r.Method, m.cfg.route(r), id)

	ctx := r.Context()
	c, err := m.store.Claim(ctx, key, fp, m.cfg.lease)
	if err == nil && c.Outcome == dedup.InProgress && m.cfg.wait > 0 {
		c, err = m.waitClaim(ctx, key, fp, c)
	}
	if err != nil {
		m.logError(r, err)
		w.Header().Set("Retry-After", "1")
		writeProblem(w, http.StatusServiceUnavailable, CodeStoreDown, "The idempotency store is unavailable; the request was not processed. Retry with the same key.")
		return
	}
	switch c.Outcome {
	case dedup.Duplicate:
		m.replay(w, r, c)
	case dedup.InProgress:
		secs := int64(1)
		if d := c.LeaseUntil.Sub(m.now()); d > time.Second {
			secs = int64((d + time.Second - 1) / time.Second)
		}
		w.Header().Set("Retry-After", strconv.FormatInt(secs, 10))
		writeProblem(w, http.StatusConflict, CodeInProgress, "A request with this "+HeaderKey+" is still being processed. Retry later with the same key.")
	case dedup.Mismatch:
		writeProblem(w, http.StatusUnprocessableEntity, CodeKeyReused, "This "+HeaderKey+" was already used for a different request payload.")
	case dedup.Acquired:
		m.run(w, r, next, c)
	default:
		m.logError(r, errors.New("deduphttp: store returned outcome "+c.Outcome.String()))
		writeProblem(w, http.StatusServiceUnavailable, CodeStoreDown, "The idempotency store gave an unexpected answer; the request was not processed.")
	}
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

func (m *Middleware) replay(w http.ResponseWriter, r *http.Request, c dedup.Claim) {
	sr, err := decodeResponse(c.Result)
	if err != nil {
		m.logError(r, err)
		writeProblem(w, http.StatusInternalServerError, CodeStoredCorrupted, "The stored response for this "+HeaderKey+" cannot be read.")
		return
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
}

// run calls next with a recorder, then stores the response or releases the
// key, on a context detached from the request.
func (m *Middleware) run(w http.ResponseWriter, r *http.Request, next http.Handler, c dedup.Claim) {
	rec := &recorder{w: w, m: m}
	finish := func(store bool) {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), m.cfg.finalizeTimout)
		defer cancel()
		var err error
		if store {
			sr := storedResponse{status: rec.status, header: rec.header, body: rec.body}
			err = m.store.Complete(ctx, c, sr.encode(), m.cfg.retention)
		} else {
			err = m.store.Release(ctx, c)
		}
		if err != nil {
			m.logError(r, err)
		}
	}
	defer func() {
		if p := recover(); p != nil {
			finish(false)
			panic(p)
		}
	}()
	next.ServeHTTP(rec, r)
	if rec.status == 0 {
		rec.status = http.StatusOK
	}
	finish(!rec.overflow && !rec.hijacked && m.cfg.storeStatus(rec.status))
}

// scopedKey builds the store key of a request: the scope holds the tenant,
// method and route, each path-escaped (so the "/" separators are
// unambiguous), or their SHA-256 when too long; the ID is the client's key.
func scopedKey(tenant, method, route, id string) dedup.Key {
	var b strings.Builder
	b.Grow(8 + len(tenant) + len(method) + len(route))
	b.WriteString("http/")
	b.WriteString(url.PathEscape(tenant))
	b.WriteByte('/')
	b.WriteString(url.PathEscape(method))
	b.WriteByte('/')
	b.WriteString(url.PathEscape(route))
	scope := b.String()
	if len(scope) > dedup.MaxScopeBytes {
		h := sha256.New()
		for _, p := range []string{tenant, method, route} {
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
