package deduphttp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/deduphttp"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/storetest"
)

func newMem(t testing.TB) *memstore.Store {
	t.Helper()
	s, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// newMiddleware builds a single-tenant Middleware on s with opts.
func newMiddleware(t testing.TB, s dedup.Store, opts ...deduphttp.Option) *deduphttp.Middleware {
	t.Helper()
	return newScoped(t, s, append([]deduphttp.Option{deduphttp.WithSingleTenant()}, opts...)...)
}

// newScoped builds a Middleware on s with opts only.
func newScoped(t testing.TB, s dedup.Store, opts ...deduphttp.Option) *deduphttp.Middleware {
	t.Helper()
	m, err := deduphttp.New(s, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// counting is a handler that counts its runs and echoes the body and a
// sequence number.
type counting struct {
	runs   atomic.Int64
	status atomic.Int64 // 0: 201
	delay  time.Duration
}

func (c *counting) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := c.runs.Add(1)
	body, _ := io.ReadAll(r.Body)
	if c.delay > 0 {
		time.Sleep(c.delay)
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/things/1")
	w.Header().Set("Set-Cookie", "session=secret")
	st := int(c.status.Load())
	if st == 0 {
		st = http.StatusCreated
	}
	w.WriteHeader(st)
	json.NewEncoder(w).Encode(map[string]any{"run": n, "body": string(body), "tenant": r.Header.Get("X-Tenant")})
}

type result struct {
	status int
	header http.Header
	body   string
}

func post(t testing.TB, client *http.Client, url, key, body string, hdr ...string) result {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Error(err)
		return result{}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return result{resp.StatusCode, resp.Header, string(b)}
}

func problemCode(t testing.TB, r result) string {
	t.Helper()
	if ct := r.header.Get("Content-Type"); ct != "application/problem+json" {
		t.Errorf("status %d: content type %q, want application/problem+json (body %q)", r.status, ct, r.body)
	}
	var p struct {
		Type   string
		Title  string
		Status int
		Code   string
	}
	if err := json.Unmarshal([]byte(r.body), &p); err != nil {
		t.Errorf("problem body %q: %v", r.body, err)
	}
	if p.Status != r.status || p.Type != "about:blank" || p.Title != http.StatusText(r.status) {
		t.Errorf("problem %+v does not match status %d", p, r.status)
	}
	return p.Code
}

func TestConcurrentSameKeyRunsOnce(t *testing.T) {
	for _, wait := range []time.Duration{0, 10 * time.Second} {
		t.Run("wait="+wait.String(), func(t *testing.T) {
			h := &counting{delay: 50 * time.Millisecond}
			m := newMiddleware(t, newMem(t), deduphttp.WithWait(wait))
			srv := httptest.NewServer(m.Required(h))
			defer srv.Close()
			const n = 50
			results := make([]result, n)
			var wg sync.WaitGroup
			start := make(chan struct{})
			for i := range n {
				wg.Go(func() {
					<-start
					results[i] = post(t, srv.Client(), srv.URL+"/pay", `"k-1"`, `{"amount":5}`)
				})
			}
			close(start)
			wg.Wait()
			if got := h.runs.Load(); got != 1 {
				t.Fatalf("handler ran %d times, want 1", got)
			}
			var first string
			created, conflicts := 0, 0
			for _, r := range results {
				switch r.status {
				case http.StatusCreated:
					created++
					if first == "" {
						first = r.body
					} else if r.body != first {
						t.Errorf("responses differ: %q vs %q", r.body, first)
					}
				case http.StatusConflict:
					conflicts++
					if wait > 0 {
						t.Errorf("409 although waiting is on")
					}
					if problemCode(t, r) != deduphttp.CodeInProgress || r.header.Get("Retry-After") == "" {
						t.Errorf("409 without code or Retry-After: %v %q", r.header, r.body)
					}
				default:
					t.Errorf("status %d: %s", r.status, r.body)
				}
			}
			if created == 0 {
				t.Fatal("no client got the response")
			}
			replayed := post(t, srv.Client(), srv.URL+"/pay", `"k-1"`, `{"amount":5}`)
			if replayed.status != http.StatusCreated || replayed.body != first || replayed.header.Get(deduphttp.HeaderReplayed) != "true" {
				t.Errorf("replay after the race: %d %v %q", replayed.status, replayed.header, replayed.body)
			}
			t.Logf("%d created, %d conflicts", created, conflicts)
		})
	}
}

// fixedClock is a dedup.Clock stopped at one instant.
type fixedClock struct{ t time.Time }

func (c fixedClock) Now() time.Time { return c.t }

func TestReplay(t *testing.T) {
	h := &counting{}
	// The store and the middleware read one stopped clock, so the expiry
	// header is checked exactly, not against the wall clock.
	clock := fixedClock{time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC)}
	store, err := memstore.New(memstore.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	m := newMiddleware(t, store, deduphttp.WithRetention(time.Hour), deduphttp.WithClock(clock))
	srv := httptest.NewServer(m.Required(h))
	defer srv.Close()
	first := post(t, srv.Client(), srv.URL, "abc-123", "x")
	second := post(t, srv.Client(), srv.URL, "abc-123", "x")
	if h.runs.Load() != 1 {
		t.Fatalf("handler ran %d times", h.runs.Load())
	}
	if first.status != 201 || second.status != 201 || first.body != second.body {
		t.Fatalf("first %d %q, second %d %q", first.status, first.body, second.status, second.body)
	}
	if first.header.Get(deduphttp.HeaderReplayed) != "" || second.header.Get(deduphttp.HeaderReplayed) != "true" {
		t.Errorf("replay marker: first %q second %q", first.header.Get(deduphttp.HeaderReplayed), second.header.Get(deduphttp.HeaderReplayed))
	}
	for _, name := range []string{"Content-Type", "Location"} {
		if second.header.Get(name) != first.header.Get(name) || second.header.Get(name) == "" {
			t.Errorf("header %s not replayed: %q vs %q", name, second.header.Get(name), first.header.Get(name))
		}
	}
	if second.header.Get("Set-Cookie") != "" {
		t.Errorf("Set-Cookie replayed: %q", second.header.Get("Set-Cookie"))
	}
	if first.header.Get(deduphttp.HeaderExpires) != "" {
		t.Errorf("the first response, of undeclared length, promises to be kept: %q", first.header.Get(deduphttp.HeaderExpires))
	}
	for _, r := range []result{second} {
		exp, err := http.ParseTime(r.header.Get(deduphttp.HeaderExpires))
		if err != nil {
			t.Errorf("expiry header %q: %v", r.header.Get(deduphttp.HeaderExpires), err)
		} else if want := clock.t.Add(time.Hour); !exp.Equal(want) {
			t.Errorf("expiry %v, want the hour of retention after the claim: %v", exp, want)
		}
	}
}

func TestMismatch(t *testing.T) {
	h := &counting{}
	m := newMiddleware(t, newMem(t))
	srv := httptest.NewServer(m.Required(h))
	defer srv.Close()
	post(t, srv.Client(), srv.URL, "k", `{"amount":5}`)
	r := post(t, srv.Client(), srv.URL, "k", `{"amount":500}`)
	if r.status != http.StatusUnprocessableEntity || problemCode(t, r) != deduphttp.CodeKeyReused {
		t.Fatalf("status %d %q, want 422", r.status, r.body)
	}
	r = post(t, srv.Client(), srv.URL+"?x=1", "k", `{"amount":5}`)
	if r.status != http.StatusUnprocessableEntity {
		t.Fatalf("another query: status %d, want 422", r.status)
	}
	if h.runs.Load() != 1 {
		t.Fatalf("handler ran %d times", h.runs.Load())
	}
}

func TestJSONFieldsFingerprint(t *testing.T) {
	h := &counting{}
	m := newMiddleware(t, newMem(t), deduphttp.WithFingerprint(deduphttp.FingerprintJSONFields("amount", "to")))
	srv := httptest.NewServer(m.Required(h))
	defer srv.Close()
	a := post(t, srv.Client(), srv.URL, "k", `{"amount":5,"to":"bob","sent_at":"10:00"}`)
	b := post(t, srv.Client(), srv.URL, "k", `{"to":"bob","amount":5,"sent_at":"10:01"}`)
	if a.status != 201 || b.status != 201 || b.header.Get(deduphttp.HeaderReplayed) != "true" {
		t.Fatalf("volatile field changed the fingerprint: %d, %d %v", a.status, b.status, b.header)
	}
	c := post(t, srv.Client(), srv.URL, "k", `{"to":"eve","amount":5}`)
	if c.status != 422 {
		t.Fatalf("chosen field changed: status %d, want 422", c.status)
	}
	d := post(t, srv.Client(), srv.URL, "k2", `not json`)
	if d.status != 400 || problemCode(t, d) != deduphttp.CodeFingerprint {
		t.Fatalf("not JSON: status %d, want 400", d.status)
	}
	if h.runs.Load() != 1 {
		t.Fatalf("handler ran %d times", h.runs.Load())
	}
}

func TestTenantsAreIsolated(t *testing.T) {
	h := &counting{}
	m := newScoped(t, newMem(t), deduphttp.WithTenant(deduphttp.TenantHeader("X-Tenant")))
	srv := httptest.NewServer(m.Required(h))
	defer srv.Close()
	a := post(t, srv.Client(), srv.URL, "same", "payload", "X-Tenant", "alice")
	b := post(t, srv.Client(), srv.URL, "same", "payload", "X-Tenant", "bob")
	b2 := post(t, srv.Client(), srv.URL, "same", "payload", "X-Tenant", "bob")
	if h.runs.Load() != 2 {
		t.Fatalf("handler ran %d times, want once per tenant", h.runs.Load())
	}
	if !strings.Contains(a.body, `"tenant":"alice"`) || !strings.Contains(b.body, `"tenant":"bob"`) || b2.body != b.body {
		t.Fatalf("bodies crossed tenants: alice %q, bob %q, bob again %q", a.body, b.body, b2.body)
	}
	// Another payload under the same key is a conflict for alice only.
	if r := post(t, srv.Client(), srv.URL, "same", "other", "X-Tenant", "alice"); r.status != 422 {
		t.Errorf("alice reused the key: %d", r.status)
	}
	if r := post(t, srv.Client(), srv.URL, "same", "other", "X-Tenant", "carol"); r.status != 201 || strings.Contains(r.body, "alice") {
		t.Errorf("carol: %d %q", r.status, r.body)
	}
	// Tenants that would collide under naive concatenation.
	c1 := post(t, srv.Client(), srv.URL, "k", "p", "X-Tenant", "a/b")
	c2 := post(t, srv.Client(), srv.URL, "k", "p", "X-Tenant", "a%2Fb")
	if c2.header.Get(deduphttp.HeaderReplayed) != "" || c1.body == c2.body {
		t.Errorf("tenants a/b and a%%2Fb share a record")
	}

	r := post(t, srv.Client(), srv.URL, "k", "p")
	if r.status != http.StatusUnauthorized || problemCode(t, r) != deduphttp.CodeTenantMissing {
		t.Errorf("no tenant: %d %q", r.status, r.body)
	}
	m400 := newScoped(t, newMem(t), deduphttp.WithTenant(deduphttp.TenantHeader("X-Tenant")), deduphttp.WithMissingTenantStatus(400))
	rec := httptest.NewRecorder()
	req := httptest.NewRequest("POST", "/", nil)
	req.Header.Set("Idempotency-Key", "k")
	m400.Required(h).ServeHTTP(rec, req)
	if rec.Code != 400 {
		t.Errorf("configured missing-tenant status: %d", rec.Code)
	}
}

func TestRouteScope(t *testing.T) {
	h := &counting{}
	m := newMiddleware(t, newMem(t))
	mux := http.NewServeMux()
	mux.Handle("POST /a/{id}", m.Required(h))
	mux.Handle("POST /b", m.Required(h))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	post(t, srv.Client(), srv.URL+"/a/1", "k", "p")
	if r := post(t, srv.Client(), srv.URL+"/b", "k", "p"); r.status != 201 || r.header.Get(deduphttp.HeaderReplayed) != "" {
		t.Errorf("another route shared the key: %d %v", r.status, r.header)
	}
	// Same pattern, another path: same scope, other fingerprint.
	if r := post(t, srv.Client(), srv.URL+"/a/2", "k", "p"); r.status != 422 {
		t.Errorf("same route, other path: %d, want 422", r.status)
	}
	if h.runs.Load() != 2 {
		t.Errorf("handler ran %d times, want 2", h.runs.Load())
	}
}

func TestNotStoredOutcomesRelease(t *testing.T) {
	t.Run("5xx", func(t *testing.T) {
		h := &counting{}
		h.status.Store(500)
		m := newMiddleware(t, newMem(t))
		srv := httptest.NewServer(m.Required(h))
		defer srv.Close()
		r1 := post(t, srv.Client(), srv.URL, "k", "p")
		if r1.header.Get(deduphttp.HeaderExpires) != "" {
			t.Errorf("a released response carries the expiry header")
		}
		h.status.Store(0)
		r2 := post(t, srv.Client(), srv.URL, "k", "p")
		if r1.status != 500 || r2.status != 201 || h.runs.Load() != 2 || r2.header.Get(deduphttp.HeaderReplayed) != "" {
			t.Fatalf("statuses %d, %d, runs %d: the 500 was stored", r1.status, r2.status, h.runs.Load())
		}
	})
	t.Run("4xx stored", func(t *testing.T) {
		h := &counting{}
		h.status.Store(402)
		m := newMiddleware(t, newMem(t))
		srv := httptest.NewServer(m.Required(h))
		defer srv.Close()
		post(t, srv.Client(), srv.URL, "k", "p")
		r := post(t, srv.Client(), srv.URL, "k", "p")
		if r.status != 402 || h.runs.Load() != 1 || r.header.Get(deduphttp.HeaderReplayed) != "true" {
			t.Fatalf("4xx not replayed: %d runs %d", r.status, h.runs.Load())
		}
	})
	t.Run("policy", func(t *testing.T) {
		h := &counting{}
		h.status.Store(409)
		m := newMiddleware(t, newMem(t), deduphttp.WithStorePolicy(func(s int) bool { return s < 300 }))
		srv := httptest.NewServer(m.Required(h))
		defer srv.Close()
		post(t, srv.Client(), srv.URL, "k", "p")
		post(t, srv.Client(), srv.URL, "k", "p")
		if h.runs.Load() != 2 {
			t.Fatalf("policy ignored: runs %d", h.runs.Load())
		}
	})
	t.Run("429 and 401 not stored", func(t *testing.T) {
		for _, st := range []int{401, 403, 408, 409, 423, 425, 429} {
			h := &counting{}
			h.status.Store(int64(st))
			m := newMiddleware(t, newMem(t))
			srv := httptest.NewServer(m.Required(h))
			r1 := post(t, srv.Client(), srv.URL, "k", "p")
			h.status.Store(0)
			r2 := post(t, srv.Client(), srv.URL, "k", "p")
			srv.Close()
			if r1.status != st || r1.header.Get(deduphttp.HeaderExpires) != "" || r2.status != 201 || h.runs.Load() != 2 {
				t.Errorf("%d: first %d (expires %q), retry %d, runs %d: the temporary refusal was stored",
					st, r1.status, r1.header.Get(deduphttp.HeaderExpires), r2.status, h.runs.Load())
			}
		}
	})
}

// TestUnrecordableOutcomesHold: a handler that panicked, hijacked the
// connection or wrote more than can be stored may have done its work, so
// its key is held until the lease ends (409 with the time left), never
// released early; after the lease a retry runs it again.
func TestUnrecordableOutcomesHold(t *testing.T) {
	for name, first := range map[string]http.HandlerFunc{
		"panic": func(w http.ResponseWriter, r *http.Request) { panic(http.ErrAbortHandler) },
		"oversized": func(w http.ResponseWriter, r *http.Request) {
			w.Write([]byte("0123456"))
			w.Write([]byte("789abc"))
		},
		"hijack": func(w http.ResponseWriter, r *http.Request) {
			c, buf, err := http.NewResponseController(w).Hijack()
			if err != nil {
				t.Error(err)
				return
			}
			buf.WriteString("HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
			buf.Flush()
			c.Close()
		},
	} {
		t.Run(name, func(t *testing.T) {
			clock := storetest.NewClock()
			s, err := memstore.New(memstore.WithClock(clock))
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			var runs atomic.Int64
			m := newMiddleware(t, s, deduphttp.WithMaxStoredBody(10), deduphttp.WithClock(clock), deduphttp.WithLease(30*time.Second))
			srv := httptest.NewServer(m.Required(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if runs.Add(1) == 1 {
					first(w, r)
					return
				}
				w.WriteHeader(204)
			})))
			defer srv.Close()
			req, _ := http.NewRequest("POST", srv.URL, nil)
			req.Header.Set("Idempotency-Key", "k")
			if resp, err := srv.Client().Do(req); err == nil { // the panic drops the connection
				resp.Body.Close()
			}
			clock.Advance(10 * time.Second)
			r := post(t, srv.Client(), srv.URL, "k", "")
			if r.status != http.StatusConflict || r.header.Get("Retry-After") != "20" || runs.Load() != 1 {
				t.Fatalf("retry within the lease: %d Retry-After %q, runs %d; want 409, 20 s left, 1 run", r.status, r.header.Get("Retry-After"), runs.Load())
			}
			clock.Advance(21 * time.Second)
			if r := post(t, srv.Client(), srv.URL, "k", ""); r.status != 204 || runs.Load() != 2 {
				t.Fatalf("retry after the lease: %d, runs %d", r.status, runs.Load())
			}
		})
	}
}

func TestClientDisconnectStillStores(t *testing.T) {
	started := make(chan struct{})
	var runs atomic.Int64
	m := newMiddleware(t, newMem(t))
	srv := httptest.NewServer(m.Required(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		close(started)
		<-r.Context().Done() // the client is gone; the charge went through anyway
		w.WriteHeader(201)
		w.Write([]byte("charged"))
	})))
	defer srv.Close()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL, strings.NewReader("p"))
	req.Header.Set("Idempotency-Key", "k")
	go func() { <-started; cancel() }()
	if resp, err := srv.Client().Do(req); err == nil {
		resp.Body.Close()
		t.Fatal("request was not cancelled")
	}
	// The handler may still be finishing: a 409 until it has stored.
	for i := 0; ; i++ {
		r := post(t, srv.Client(), srv.URL, "k", "p")
		if r.status == http.StatusConflict && i < 1000 {
			time.Sleep(5 * time.Millisecond)
			continue
		}
		if r.status != 201 || r.body != "charged" || r.header.Get(deduphttp.HeaderReplayed) != "true" || runs.Load() != 1 {
			t.Fatalf("retry after disconnect: %d %q, runs %d", r.status, r.body, runs.Load())
		}
		break
	}
}

func TestKeyRequiredAndOptional(t *testing.T) {
	h := &counting{}
	m := newMiddleware(t, newMem(t))
	mux := http.NewServeMux()
	mux.Handle("/req", m.Required(h))
	mux.Handle("/opt", m.Optional(h))
	mux.Handle("/default", m.Handler(h))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	for _, path := range []string{"/req", "/default"} {
		r := post(t, srv.Client(), srv.URL+path, "", "p")
		if r.status != 400 || problemCode(t, r) != deduphttp.CodeKeyMissing {
			t.Errorf("%s without key: %d %q", path, r.status, r.body)
		}
	}
	if h.runs.Load() != 0 {
		t.Fatalf("handler ran without a key")
	}
	post(t, srv.Client(), srv.URL+"/opt", "", "p")
	post(t, srv.Client(), srv.URL+"/opt", "", "p")
	if h.runs.Load() != 2 {
		t.Fatalf("optional route without key: runs %d, want 2", h.runs.Load())
	}
	mo := newMiddleware(t, newMem(t), deduphttp.WithKeyRequired(false))
	rec := httptest.NewRecorder()
	mo.Handler(h).ServeHTTP(rec, httptest.NewRequest("POST", "/", nil))
	if rec.Code != 201 {
		t.Errorf("WithKeyRequired(false): %d", rec.Code)
	}
}

func TestMalformedKeys(t *testing.T) {
	h := &counting{}
	m := newMiddleware(t, newMem(t))
	srv := httptest.NewServer(m.Required(h))
	defer srv.Close()
	for _, v := range []string{`""`, `"abc`, `"a\nb"`, `"a"; p=1`, `a b`, `a,b`, `"a\x"`, strings.Repeat("x", 256), `"` + strings.Repeat("y", 256) + `"`, "caf\xc3\xa9"} {
		r := post(t, srv.Client(), srv.URL, v, "p")
		if r.status != 400 || problemCode(t, r) != deduphttp.CodeKeyInvalid {
			t.Errorf("key %q: status %d %q", v, r.status, r.body)
		}
	}
	// Two header lines.
	req, _ := http.NewRequest("POST", srv.URL, nil)
	req.Header.Add("Idempotency-Key", "a")
	req.Header.Add("Idempotency-Key", "b")
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 400 {
		t.Errorf("two keys: %d", resp.StatusCode)
	}
	if h.runs.Load() != 0 {
		t.Fatalf("handler ran %d times on bad keys", h.runs.Load())
	}
	// The quoted and bare forms of one key are the same key.
	post(t, srv.Client(), srv.URL, `"same-key"`, "p")
	if r := post(t, srv.Client(), srv.URL, `same-key`, "p"); r.header.Get(deduphttp.HeaderReplayed) != "true" {
		t.Errorf("bare form of a quoted key was not a replay")
	}
}

func TestSafeMethodsPassThrough(t *testing.T) {
	h := &counting{}
	m := newMiddleware(t, &downStore{})
	srv := httptest.NewServer(m.Required(h))
	defer srv.Close()
	for _, method := range []string{"GET", "HEAD", "OPTIONS", "TRACE"} {
		req, _ := http.NewRequest(method, srv.URL, nil)
		req.Header.Set("Idempotency-Key", "k")
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 201 || resp.Header.Get(deduphttp.HeaderExpires) != "" {
			t.Errorf("%s: %d %v", method, resp.StatusCode, resp.Header)
		}
	}
	if h.runs.Load() != 4 {
		t.Errorf("runs %d, want 4", h.runs.Load())
	}
}

// downStore fails every call like an unreachable server.
type downStore struct{ calls atomic.Int64 }

func (s *downStore) err(op string) error {
	s.calls.Add(1)
	return &dedup.StoreError{Store: "down", Op: op, Err: errors.New("connection refused"), NotApplied: true}
}
func (s *downStore) Claim(context.Context, dedup.Key, dedup.Fingerprint, time.Duration) (dedup.Claim, error) {
	return dedup.Claim{}, s.err("claim")
}
func (s *downStore) Complete(context.Context, dedup.Claim, []byte, time.Duration) error {
	return s.err("complete")
}
func (s *downStore) Release(context.Context, dedup.Claim) error { return s.err("release") }
func (s *downStore) Close() error                               { return nil }

func TestStoreDownFailsClosed(t *testing.T) {
	h := &counting{}
	s := &downStore{}
	var logged atomic.Int64
	m := newMiddleware(t, s, deduphttp.WithErrorLog(func(*http.Request, error) { logged.Add(1) }))
	srv := httptest.NewServer(m.Required(h))
	defer srv.Close()
	r := post(t, srv.Client(), srv.URL, "k", "p")
	if r.status != 503 || problemCode(t, r) != deduphttp.CodeStoreDown || r.header.Get("Retry-After") == "" {
		t.Fatalf("store down: %d %v %q", r.status, r.header, r.body)
	}
	if h.runs.Load() != 0 || s.calls.Load() != 1 || logged.Load() != 1 {
		t.Fatalf("runs %d, store calls %d, logged %d", h.runs.Load(), s.calls.Load(), logged.Load())
	}
}

func TestBodyLimit(t *testing.T) {
	h := &counting{}
	m := newMiddleware(t, newMem(t), deduphttp.WithMaxBody(8))
	srv := httptest.NewServer(m.Required(h))
	defer srv.Close()
	if r := post(t, srv.Client(), srv.URL, "k", "123456789"); r.status != 413 || problemCode(t, r) != deduphttp.CodeBodyTooLarge {
		t.Errorf("over the limit: %d", r.status)
	}
	// Unknown length (chunked).
	req, _ := http.NewRequest("POST", srv.URL, io.MultiReader(strings.NewReader("12345"), strings.NewReader("6789")))
	req.Header.Set("Idempotency-Key", "k2")
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 413 {
		t.Errorf("chunked over the limit: %d", resp.StatusCode)
	}
	if r := post(t, srv.Client(), srv.URL, "k3", "12345678"); r.status != 201 || !strings.Contains(r.body, `"body":"12345678"`) {
		t.Errorf("at the limit the handler did not get the body: %d %q", r.status, r.body)
	}
	if h.runs.Load() != 1 {
		t.Errorf("runs %d", h.runs.Load())
	}
}

func TestNewValidates(t *testing.T) {
	s := newMem(t)
	if _, err := deduphttp.New(nil); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("nil store: %v", err)
	}
	// No tenant and no explicit single-tenant opt-in: refused.
	if _, err := deduphttp.New(s); !errors.Is(err, dedup.ErrInvalidArgument) || !strings.Contains(err.Error(), "WithSingleTenant") {
		t.Errorf("no tenant: %v", err)
	}
	for name, o := range map[string]deduphttp.Option{
		"lease":     deduphttp.WithLease(0),
		"retention": deduphttp.WithRetention(-time.Second),
		"wait":      deduphttp.WithWait(-1),
		"maxbody":   deduphttp.WithMaxBody(0),
		"stored":    deduphttp.WithMaxStoredBody(0),
		"tenant":    deduphttp.WithMissingTenantStatus(500),
		"policy":    deduphttp.WithStorePolicy(nil),
		"route":     deduphttp.WithRoute(nil),
		"fp":        deduphttp.WithFingerprint(nil),
		"finalize":  deduphttp.WithFinalizeTimeout(0),
		"header":    deduphttp.WithReplayHeaders(""),
		"clock":     deduphttp.WithClock(nil),
		"both":      deduphttp.WithTenant(deduphttp.TenantHeader("X")),
		"timeout":   deduphttp.WithHandlerTimeout(30 * time.Second),
		"negative":  deduphttp.WithHandlerTimeout(-1),
		"huge body": deduphttp.WithMaxBody(deduphttp.MaxBodyLimit + 1),
	} {
		if _, err := deduphttp.New(s, deduphttp.WithSingleTenant(), o); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func TestCorruptRecord(t *testing.T) {
	h := &counting{}
	var logged atomic.Int64
	m := newMiddleware(t, &corruptingStore{Store: newMem(t)}, deduphttp.WithErrorLog(func(*http.Request, error) { logged.Add(1) }))
	srv := httptest.NewServer(m.Required(h))
	defer srv.Close()
	post(t, srv.Client(), srv.URL, "k", "p")
	if r := post(t, srv.Client(), srv.URL, "k", "p"); r.status != 500 || problemCode(t, r) != deduphttp.CodeStoredCorrupted || logged.Load() != 1 {
		t.Errorf("corrupt record: %d %q, logged %d", r.status, r.body, logged.Load())
	}
	if h.runs.Load() != 1 {
		t.Errorf("handler ran %d times", h.runs.Load())
	}
}

// releaseSignal reports each successful Release on a channel.
type releaseSignal struct {
	dedup.Store
	released chan struct{}
}

func (s *releaseSignal) Release(ctx context.Context, c dedup.Claim) error {
	err := s.Store.Release(ctx, c)
	if err == nil {
		select {
		case s.released <- struct{}{}:
		default:
		}
	}
	return err
}

type corruptingStore struct{ dedup.Store }

func (c *corruptingStore) Complete(ctx context.Context, cl dedup.Claim, _ []byte, ret time.Duration) error {
	return c.Store.Complete(ctx, cl, []byte{9, 9}, ret)
}

func TestParseKey(t *testing.T) {
	ok := map[string]string{
		`"abc"`:                                  "abc",
		`  "a b"  `:                              "a b",
		`"a\"b\\c"`:                              `a"b\c`,
		`8e03978e-40d5-43e8-bc93-6894a57f9324`:   "8e03978e-40d5-43e8-bc93-6894a57f9324",
		`"8e03978e-40d5-43e8-bc93-6894a57f9324"`: "8e03978e-40d5-43e8-bc93-6894a57f9324",
		`dGVzdA==`:                               "dGVzdA==",
		strings.Repeat("x", 255):                 strings.Repeat("x", 255),
		`"` + strings.Repeat(`\"`, 255) + `"`:    strings.Repeat(`"`, 255),
	}
	for in, want := range ok {
		got, err := deduphttp.ParseKey(in)
		if err != nil || got != want {
			t.Errorf("ParseKey(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"", " ", `""`, `"`, `"a`, `"a\`, `"\a"`, `"a"b`, `"a",`, `a"`, `a;b`, "a\tb", "\x7f", `"é"`, strings.Repeat("x", 256), `"` + strings.Repeat(`\\`, 256) + `"`} {
		if got, err := deduphttp.ParseKey(in); !errors.Is(err, deduphttp.ErrInvalidKey) {
			t.Errorf("ParseKey(%q) = %q, %v; want an error", in, got, err)
		}
	}
}

// quote serialises s as a Structured Field String.
func quote(s string) string {
	var b bytes.Buffer
	b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		if s[i] == '"' || s[i] == '\\' {
			b.WriteByte('\\')
		}
		b.WriteByte(s[i])
	}
	b.WriteByte('"')
	return b.String()
}

func FuzzParseKey(f *testing.F) {
	for _, s := range []string{`"abc"`, `abc`, `"a\"b"`, `""`, `"a\\"`, " x ", `"a";b`, strings.Repeat("z", 300)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		k, err := deduphttp.ParseKey(v)
		if err != nil {
			if !errors.Is(err, deduphttp.ErrInvalidKey) {
				t.Fatalf("error %v is not ErrInvalidKey", err)
			}
			return
		}
		if k == "" || len(k) > deduphttp.MaxKeyBytes {
			t.Fatalf("accepted %q (%d bytes)", k, len(k))
		}
		for i := 0; i < len(k); i++ {
			if k[i] < 0x20 || k[i] > 0x7e {
				t.Fatalf("accepted a non-printable byte in %q", k)
			}
		}
		if _, err := dedup.NewKey("s", k); err != nil {
			t.Fatalf("accepted key %q is not a valid dedup key: %v", k, err)
		}
		// Round trip through the Structured Field form.
		if k2, err := deduphttp.ParseKey(quote(k)); err != nil || k2 != k {
			t.Fatalf("round trip of %q: %q, %v", k, k2, err)
		}
	})
}

func FuzzFingerprint(f *testing.F) {
	f.Add("POST", "/a", []byte("x"), "POST", "/a", []byte("y"))
	f.Add("POST", "/a", []byte(""), "POST", "/", []byte("a"))
	f.Add("PUT", "/a?b=1", []byte("{}"), "PUT", "/a", []byte("?b=1{}"))
	f.Fuzz(func(t *testing.T, m1, p1 string, b1 []byte, m2, p2 string, b2 []byte) {
		r1, err1 := http.NewRequest(m1, "http://h"+"/"+p1, nil)
		r2, err2 := http.NewRequest(m2, "http://h"+"/"+p2, nil)
		if err1 != nil || err2 != nil {
			return
		}
		f1, _ := deduphttp.DefaultFingerprint(r1, b1)
		f2, _ := deduphttp.DefaultFingerprint(r2, b2)
		same := r1.Method == r2.Method && r1.URL.RequestURI() == r2.URL.RequestURI() && bytes.Equal(b1, b2)
		if same != (f1 == f2) {
			t.Fatalf("fingerprints %s %s for (%q %q %q) and (%q %q %q)", f1, f2, r1.Method, r1.URL.RequestURI(), b1, r2.Method, r2.URL.RequestURI(), b2)
		}
		if !strings.HasPrefix(string(f1), "sha256:") || len(f1) > dedup.MaxFingerprintBytes {
			t.Fatalf("bad fingerprint %q", f1)
		}
	})
}
