package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
)

// upstream is a test service that counts the POSTs it serves.
type upstream struct {
	runs   atomic.Int64
	status atomic.Int64 // 0: 201
	delay  atomic.Int64 // nanoseconds
	srv    *httptest.Server
}

func newUpstream(t *testing.T) *upstream {
	u := &upstream{}
	u.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if r.Method == http.MethodGet {
			fmt.Fprintf(w, "get %s", r.URL.Path)
			return
		}
		n := u.runs.Add(1)
		if d := time.Duration(u.delay.Load()); d > 0 {
			select {
			case <-time.After(d):
			case <-r.Context().Done():
			}
		}
		st := int(u.status.Load())
		if st == 0 {
			st = http.StatusCreated
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(st)
		json.NewEncoder(w).Encode(map[string]any{"run": n, "tenant": r.Header.Get("X-Tenant"), "body": string(body)})
	}))
	t.Cleanup(u.srv.Close)
	return u
}

// startProxy runs `dedup proxy` with args on a free port until the test
// ends (or stop is called) and returns its base URL.
func startProxy(t *testing.T, args ...string) (base string, stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	addr := make(chan string, 1)
	done := make(chan int, 1)
	var stderr syncBuffer
	go func() {
		done <- serveProxy(ctx, append([]string{"--listen", "127.0.0.1:0"}, args...), io.Discard, &stderr, func(a string) { addr <- strings.Fields(a)[0] })
	}()
	select {
	case a := <-addr:
		base = "http://" + a
	case code := <-done:
		cancel()
		t.Fatalf("proxy exited with %d: %s", code, stderr.String())
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if code := <-done; code != exitOK {
				t.Errorf("proxy exit %d: %s", code, stderr.String())
			}
		})
	}
	t.Cleanup(stop)
	return base, stop
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

type reply struct {
	status int
	header http.Header
	body   string
}

func send(t *testing.T, method, url, key, body string, hdr ...string) reply {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Error(err)
		return reply{}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return reply{resp.StatusCode, resp.Header, string(b)}
}

// TestProxyConcurrentOneKey: 200 identical requests at once run the
// upstream exactly once, on each of the four stores.
func TestProxyConcurrentOneKey(t *testing.T) {
	for _, store := range proxyStores {
		t.Run(store, func(t *testing.T) {
			args := []string{"--store", store}
			switch store {
			case "sqlite":
				args = append(args, "--path", filepath.Join(t.TempDir(), "keys.db"))
			case "redis":
				testenv.Addrs(t, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
			case "postgres":
				testenv.PostgresURL(t)
				var out, errOut syncBuffer
				if code := run([]string{"migrate"}, &out, &errOut); code != 0 {
					t.Fatalf("dedup migrate: exit %d: %s", code, errOut.String())
				}
			}
			testProxyConcurrentOneKey(t, fmt.Sprintf("charge-%s-%d", store, time.Now().UnixNano()), args...)
		})
	}
}

func testProxyConcurrentOneKey(t *testing.T, key string, storeArgs ...string) {
	up := newUpstream(t)
	up.delay.Store(int64(50 * time.Millisecond))
	base, _ := startProxy(t, append([]string{"--upstream", up.srv.URL, "--require-key", "--single-tenant"}, storeArgs...)...)
	const n = 200
	replies := make([]reply, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			replies[i] = send(t, "POST", base+"/charges", `"`+key+`"`, `{"amount":100}`)
		})
	}
	close(start)
	wg.Wait()
	if got := up.runs.Load(); got != 1 {
		t.Fatalf("upstream ran %d times, want exactly 1", got)
	}
	var first string
	for _, r := range replies {
		switch r.status {
		case http.StatusCreated:
			if first == "" {
				first = r.body
			} else if r.body != first {
				t.Errorf("different bodies: %q vs %q", r.body, first)
			}
		case http.StatusConflict:
			if r.header.Get("Retry-After") == "" {
				t.Errorf("409 without Retry-After")
			}
		default:
			t.Errorf("status %d %q", r.status, r.body)
		}
	}
	if first == "" {
		t.Fatal("no client got the upstream's response")
	}
	r := send(t, "POST", base+"/charges", `"`+key+`"`, `{"amount":100}`)
	if r.status != 201 || r.body != first || r.header.Get("Idempotent-Replayed") != "true" || r.header.Get("Idempotency-Key-Expires") == "" {
		t.Errorf("replay: %d %v %q", r.status, r.header, r.body)
	}
	if r := send(t, "POST", base+"/charges", `"`+key+`"`, `{"amount":999}`); r.status != 422 {
		t.Errorf("payload mismatch: %d, want 422", r.status)
	}
	if up.runs.Load() != 1 {
		t.Errorf("upstream ran %d times", up.runs.Load())
	}
}

func TestProxyTenants(t *testing.T) {
	up := newUpstream(t)
	base, _ := startProxy(t, "--upstream", up.srv.URL, "--tenant-header", "X-Tenant")
	a := send(t, "POST", base+"/x", "k", "p", "X-Tenant", "alice")
	b := send(t, "POST", base+"/x", "k", "p", "X-Tenant", "bob")
	if up.runs.Load() != 2 || strings.Contains(b.body, "alice") || !strings.Contains(a.body, "alice") || b.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("tenants not isolated: runs %d, alice %q, bob %q", up.runs.Load(), a.body, b.body)
	}
	if r := send(t, "POST", base+"/x", "k", "p"); r.status != 400 {
		t.Errorf("keyed request without tenant: %d, want 400", r.status)
	}
}

func TestProxyReplaySurvivesRestart(t *testing.T) {
	up := newUpstream(t)
	path := filepath.Join(t.TempDir(), "keys.db")
	base, stop := startProxy(t, "--upstream", up.srv.URL, "--store", "sqlite", "--path", path, "--single-tenant")
	first := send(t, "POST", base+"/pay", "k-restart", "p")
	stop()
	base, _ = startProxy(t, "--upstream", up.srv.URL, "--store", "sqlite", "--path", path, "--single-tenant")
	again := send(t, "POST", base+"/pay", "k-restart", "p")
	if up.runs.Load() != 1 || again.status != first.status || again.body != first.body || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("after a restart: runs %d, %d %q vs %d %q", up.runs.Load(), again.status, again.body, first.status, first.body)
	}
}

// TestProxyOnServerStores: the proxy replays through Redis and PostgreSQL,
// and a restarted proxy still replays from them.
func TestProxyOnServerStores(t *testing.T) {
	for _, store := range []string{"redis", "postgres"} {
		t.Run(store, func(t *testing.T) {
			if store == "redis" {
				testenv.Addrs(t, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
			} else {
				testenv.PostgresURL(t)
				var out, errOut syncBuffer
				if code := run([]string{"migrate"}, &out, &errOut); code != 0 {
					t.Fatalf("dedup migrate: exit %d: %s", code, errOut.String())
				}
			}
			up := newUpstream(t)
			key := fmt.Sprintf("k-%s-%d", store, time.Now().UnixNano())
			base, stop := startProxy(t, "--upstream", up.srv.URL, "--store", store, "--single-tenant")
			first := send(t, "POST", base+"/pay", key, "p")
			dup := send(t, "POST", base+"/pay", key, "p")
			stop()
			base, _ = startProxy(t, "--upstream", up.srv.URL, "--store", store, "--single-tenant")
			again := send(t, "POST", base+"/pay", key, "p")
			if first.status != http.StatusCreated || up.runs.Load() != 1 {
				t.Fatalf("first: %d, runs %d", first.status, up.runs.Load())
			}
			for _, r := range []reply{dup, again} {
				if r.status != first.status || r.body != first.body || r.header.Get("Idempotent-Replayed") != "true" {
					t.Fatalf("replay: %d %q %v, want the first response replayed", r.status, r.body, r.header)
				}
			}
		})
	}
}

func TestProxyUpstreamFailureNotStored(t *testing.T) {
	up := newUpstream(t)
	base, _ := startProxy(t, "--upstream", up.srv.URL, "--single-tenant")
	up.status.Store(500)
	if r := send(t, "POST", base+"/p", "k500", "x"); r.status != 500 {
		t.Fatalf("upstream 500: %d", r.status)
	}
	up.status.Store(0)
	if r := send(t, "POST", base+"/p", "k500", "x"); r.status != 201 || r.header.Get("Idempotent-Replayed") != "" || up.runs.Load() != 2 {
		t.Fatalf("retry after 500: %d %v, runs %d", r.status, r.header, up.runs.Load())
	}
	// 429 and 401 are temporary refusals: not stored, a retry is forwarded.
	for _, st := range []int64{429, 401} {
		up.status.Store(st)
		key := fmt.Sprintf("k%d", st)
		r1 := send(t, "POST", base+"/p", key, "x")
		up.status.Store(0)
		before := up.runs.Load()
		r2 := send(t, "POST", base+"/p", key, "x")
		if r1.status != int(st) || r1.header.Get("Idempotency-Key-Expires") != "" || r2.status != 201 || r2.header.Get("Idempotent-Replayed") != "" || up.runs.Load() != before+1 {
			t.Errorf("%d then retry: %d (expires %q), %d %v, runs %d", st, r1.status, r1.header.Get("Idempotency-Key-Expires"), r2.status, r2.header, up.runs.Load())
		}
	}

	// A dial error never reached an upstream: released, the retry runs.
	ln := httptest.NewServer(http.NotFoundHandler())
	dead := ln.URL
	ln.Close()
	base2, _ := startProxy(t, "--upstream", dead, "--single-tenant")
	if r := send(t, "POST", base2+"/p", "kdial", "x"); r.status != http.StatusBadGateway {
		t.Fatalf("dead upstream: %d %q", r.status, r.body)
	}
	if r := send(t, "POST", base2+"/p", "kdial", "x"); r.status != http.StatusBadGateway {
		t.Fatalf("retry to a dead upstream: %d %q, want 502 again (the key was released)", r.status, r.body)
	}
}

func TestProxyPassThroughAndRequiredKey(t *testing.T) {
	up := newUpstream(t)
	base, _ := startProxy(t, "--upstream", up.srv.URL, "--require-key", "--single-tenant")
	if r := send(t, "GET", base+"/items", "k", ""); r.status != 200 || r.body != "get /items" {
		t.Errorf("GET: %d %q", r.status, r.body)
	}
	if r := send(t, "POST", base+"/items", "", "x"); r.status != 400 || r.header.Get("Content-Type") != "application/problem+json" {
		t.Errorf("missing key: %d %v", r.status, r.header)
	}
	if r := send(t, "POST", base+"/items", `"unterminated`, "x"); r.status != 400 {
		t.Errorf("malformed key: %d", r.status)
	}
	if up.runs.Load() != 0 {
		t.Errorf("upstream ran %d times", up.runs.Load())
	}
	base2, _ := startProxy(t, "--upstream", up.srv.URL, "--single-tenant")
	send(t, "POST", base2+"/items", "", "x")
	send(t, "POST", base2+"/items", "", "x")
	if up.runs.Load() != 2 {
		t.Errorf("optional key: runs %d, want 2", up.runs.Load())
	}
}

// downStore fails every call like an unreachable server.
type downStore struct{}

func (downStore) Claim(context.Context, dedup.Key, dedup.Fingerprint, time.Duration) (dedup.Claim, error) {
	return dedup.Claim{}, &dedup.StoreError{Store: "down", Op: "claim", Err: errors.New("connection refused"), NotApplied: true}
}
func (downStore) Complete(context.Context, dedup.Claim, []byte, time.Duration) error {
	return errors.New("unreachable")
}
func (downStore) Release(context.Context, dedup.Claim) error { return errors.New("unreachable") }
func (downStore) Close() error                               { return nil }

func TestProxyStoreDown(t *testing.T) {
	up := newUpstream(t)
	f, err := parseProxy([]string{"--upstream", up.srv.URL, "--single-tenant"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	var logs syncBuffer
	h, err := newProxyHandler(&f, downStore{}, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	r := send(t, "POST", srv.URL+"/x", "k", "x")
	if r.status != 503 || r.header.Get("Content-Type") != "application/problem+json" {
		t.Errorf("store down: %d %q", r.status, r.body)
	}
	if up.runs.Load() != 0 {
		t.Errorf("upstream ran %d times with the store down", up.runs.Load())
	}
	if !strings.Contains(logs.String(), "connection refused") {
		t.Errorf("store error not logged: %q", logs.String())
	}

	// A Redis store that cannot be reached at start: exit 1, nothing served.
	ln := httptest.NewServer(http.NotFoundHandler())
	addr := strings.TrimPrefix(ln.URL, "http://")
	ln.Close()
	code, _, stderr := runArgs(t, "proxy", "--upstream", up.srv.URL, "--single-tenant", "--store", "redis", "--addr", addr, "--listen", "127.0.0.1:0")
	if code != exitFail || !strings.Contains(stderr, "open the redis store") {
		t.Errorf("unreachable redis: exit %d, %q", code, stderr)
	}
}

func TestProxyFlags(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "--upstream is required"},
		{[]string{"--upstream", "http://x"}, "--tenant-header is required"},
		{[]string{"--upstream", "http://x", "--single-tenant", "--tenant-header", "X-T"}, "exclude each other"},
		{[]string{"--upstream", "http://x", "--single-tenant", "--max-body", "1000000000"}, "--max-body"},
		{[]string{"--upstream", "http://x", "--single-tenant", "--no-store-status", "200"}, "--no-store-status"},
		{[]string{"--upstream", "http://x", "--single-tenant", "--log-format", "xml"}, "--log-format"},
		{[]string{"--upstream", "http://x", "--single-tenant", "--admin-listen", "nope"}, "--admin-listen"},
		{[]string{"--upstream", "http://x", "--single-tenant", "--read-timeout", "-1s"}, "--read-timeout"},
		{[]string{"--upstream", "ftp://x"}, "--upstream must be"},
		{[]string{"--upstream", "http://x", "--single-tenant", "--listen", "nope"}, "--listen"},
		{[]string{"--upstream", "http://x", "--single-tenant", "--store", "mongo"}, "--store must be one of"},
		{[]string{"--upstream", "http://x", "--single-tenant", "--store", "sqlite"}, "--path"},
		{[]string{"--upstream", "http://x", "--single-tenant", "--path", "f.db"}, "--path applies only"},
		{[]string{"--upstream", "http://x", "--single-tenant", "--addr", "h:1"}, "--addr applies only"},
		{[]string{"--upstream", "http://x", "--single-tenant", "--lease", "0s"}, "--lease"},
		{[]string{"--upstream", "http://x", "--single-tenant", "--retention", "-1h"}, "--retention"},
		{[]string{"--upstream", "http://x", "--single-tenant", "--wait", "-1s"}, "--wait"},
		{[]string{"--upstream", "http://x", "--single-tenant", "--lease", "10s", "--upstream-timeout", "20s"}, "--upstream-timeout"},
		{[]string{"--upstream", "http://x", "--single-tenant", "--max-body", "0"}, "--max-body"},
		{[]string{"--upstream", "http://x", "--single-tenant", "--max-stored-body", "-1"}, "--max-stored-body"},
		{[]string{"--upstream", "http://x", "--single-tenant", "--lease", "soon"}, "--lease"},
		{[]string{"--upstream", "http://x", "--single-tenant", "--frob"}, "unknown flag --frob"},
		{[]string{"--upstream", "http://x", "--single-tenant", "extra"}, "unexpected argument"},
	} {
		code, stdout, stderr := runArgs(t, append([]string{"proxy"}, tc.args...)...)
		if code != exitUsage || stdout != "" || !strings.Contains(stderr, tc.want) {
			t.Errorf("%q: exit %d, stderr %q, want exit 2 naming %q", tc.args, code, stderr, tc.want)
		}
	}
	code, stdout, _ := runArgs(t, "proxy", "-h")
	if code != exitOK {
		t.Errorf("-h: exit %d", code)
	}
	for _, w := range []string{"--upstream", "--listen", "--store", "--path", "--addr", "--tenant-header", "--require-key", "--retention", "--lease", "--wait", "--upstream-timeout", "--shutdown-timeout",
		"--single-tenant", "--principal-header", "--no-store-status", "--store-errors", "--admin-listen", "--read-timeout", "--write-timeout", "--idle-timeout", "DEDUP_PROXY_"} {
		if !strings.Contains(stdout, w) {
			t.Errorf("proxy -h lacks %s", w)
		}
	}
}
