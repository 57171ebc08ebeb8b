package main

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/sqlitestore"
)

// gatedUpstream is an upstream whose calls do their work (count a run)
// and then wait for the test to open the gate before answering, whatever
// the proxy does to the connection meanwhile: the effect is committed.
type gatedUpstream struct {
	runs      atomic.Int64
	active    atomic.Int64
	maxActive atomic.Int64
	started   chan int64
	cancelled chan struct{} // one send per call whose connection the proxy dropped
	gate      chan struct{}
	gateOnce  sync.Once
	srv       *httptest.Server
}

// newGatedUpstream starts an upstream. With stream it sends its header and
// a first line at once, then the rest after the gate opens.
func newGatedUpstream(t *testing.T, stream bool) *gatedUpstream {
	u := &gatedUpstream{started: make(chan int64, 64), cancelled: make(chan struct{}, 64), gate: make(chan struct{})}
	u.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		n := u.runs.Add(1)
		a := u.active.Add(1)
		defer u.active.Add(-1)
		for m := u.maxActive.Load(); a > m && !u.maxActive.CompareAndSwap(m, a); m = u.maxActive.Load() {
		}
		u.started <- n
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Cache-Control", "private, max-age=60")
		if stream {
			w.WriteHeader(http.StatusOK)
			fmt.Fprintf(w, "part 1 of run %d\n", n)
			http.NewResponseController(w).Flush()
		}
		select {
		case <-u.gate:
		case <-r.Context().Done():
			u.cancelled <- struct{}{}
			<-u.gate // the effect is committed: finish anyway
		}
		if !stream {
			w.WriteHeader(http.StatusCreated)
		}
		fmt.Fprintf(w, "done run %d\n", n)
	}))
	t.Cleanup(func() { u.open(); u.srv.Close() })
	return u
}

func (u *gatedUpstream) open() { u.gateOnce.Do(func() { close(u.gate) }) }

// settle gives the proxy a moment to react to a client's hang-up (a proxy
// that cancels the upstream call does so within it) before the gate opens.
// Nothing is asserted on the time.
func (u *gatedUpstream) settle() {
	select {
	case <-u.cancelled:
	case <-time.After(500 * time.Millisecond):
	}
}

func (u *gatedUpstream) waitStarted(t *testing.T) {
	t.Helper()
	select {
	case <-u.started:
	case <-time.After(30 * time.Second):
		t.Fatal("the upstream was never called")
	}
}

// retryUntilDecided sends the request again until it is no longer 409
// (the first call still running), at most n times, and returns the last
// answer with the number of 409s seen.
func retryUntilDecided(t *testing.T, url, key, body string, n int, hdr ...string) (reply, int) {
	t.Helper()
	conflicts := 0
	for range n {
		r := send(t, "POST", url, key, body, hdr...)
		if r.status != http.StatusConflict {
			return r, conflicts
		}
		conflicts++
		if ra, err := strconv.Atoi(r.header.Get("Retry-After")); err != nil || ra < 1 {
			t.Fatalf("409 with Retry-After %q", r.header.Get("Retry-After"))
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("still 409 after %d retries", n)
	return reply{}, conflicts
}

// TestProxyClientHangUpThenRetry: a client that hangs up while the upstream
// works neither cancels the upstream call nor frees the key; its retry
// replays the response the upstream sent after the hang-up.
func TestProxyClientHangUpThenRetry(t *testing.T) {
	up := newGatedUpstream(t, false)
	base, _ := startProxy(t, "--upstream", up.srv.URL, "--single-tenant", "--upstream-timeout", "20s", "--lease", "30s")
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", base+"/charges", strings.NewReader("amount=1"))
	req.Header.Set("Idempotency-Key", "hang-up")
	errc := make(chan error, 1)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	up.waitStarted(t)
	cancel()
	if err := <-errc; err == nil {
		t.Fatal("the client's request was not cancelled")
	}
	up.settle()
	up.open()
	r, _ := retryUntilDecided(t, base+"/charges", "hang-up", "amount=1", 3000)
	if r.status != http.StatusCreated || r.body != "done run 1\n" || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry after the hang-up: %d %q %v", r.status, r.body, r.header)
	}
	if n := up.runs.Load(); n != 1 {
		t.Fatalf("the upstream ran %d times, want exactly 1", n)
	}
	if cc := r.header.Get("Cache-Control"); cc != "private, max-age=60" {
		t.Errorf("Cache-Control on replay: %q", cc)
	}
}

// TestProxyUpstreamTimeoutHoldsKey: after an upstream timeout the request
// was sent and its outcome is unknown: the retry gets 409 with the time
// left on the lease, and is never forwarded while the first call could
// still be running.
func TestProxyUpstreamTimeoutHoldsKey(t *testing.T) {
	up := newGatedUpstream(t, false)
	base, _ := startProxy(t, "--upstream", up.srv.URL, "--single-tenant", "--upstream-timeout", "300ms", "--lease", "40s")
	if r := send(t, "POST", base+"/p", "slow", "x"); r.status != http.StatusGatewayTimeout || r.header.Get("Idempotency-Key-Expires") != "" {
		t.Fatalf("upstream timeout: %d %v %q", r.status, r.header, r.body)
	}
	for range 5 {
		r := send(t, "POST", base+"/p", "slow", "x")
		ra, _ := strconv.Atoi(r.header.Get("Retry-After"))
		if r.status != http.StatusConflict || ra < 1 || ra > 40 {
			t.Fatalf("retry after a timeout: %d Retry-After %q, want 409 and the seconds left on the 40s lease", r.status, r.header.Get("Retry-After"))
		}
	}
	if n := up.runs.Load(); n != 1 {
		t.Fatalf("the upstream ran %d times, want 1", n)
	}
}

// TestProxyStoreErrorsStoresTimeout: with --store-errors the 504 of an
// unknown outcome is the final answer and is replayed.
func TestProxyStoreErrorsStoresTimeout(t *testing.T) {
	up := newGatedUpstream(t, false)
	base, _ := startProxy(t, "--upstream", up.srv.URL, "--single-tenant", "--upstream-timeout", "300ms", "--lease", "40s", "--store-errors")
	first := send(t, "POST", base+"/p", "slow", "x")
	again := send(t, "POST", base+"/p", "slow", "x")
	if first.status != http.StatusGatewayTimeout || again.status != http.StatusGatewayTimeout || again.header.Get("Idempotent-Replayed") != "true" || up.runs.Load() != 1 {
		t.Fatalf("--store-errors: %d then %d %v, runs %d", first.status, again.status, again.header, up.runs.Load())
	}
}

// TestProxyHangUpMidStream: a client that hangs up while a committed
// response streams does not free the key; the proxy reads the upstream to
// the end and stores it for the retry.
func TestProxyHangUpMidStream(t *testing.T) {
	up := newGatedUpstream(t, true)
	base, _ := startProxy(t, "--upstream", up.srv.URL, "--single-tenant", "--upstream-timeout", "20s", "--lease", "30s")
	req, _ := http.NewRequest("POST", base+"/export", strings.NewReader("x"))
	req.Header.Set("Idempotency-Key", "stream")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	if err != nil || line != "part 1 of run 1\n" {
		t.Fatalf("first line %q, %v", line, err)
	}
	resp.Body.Close() // hang up mid-stream
	http.DefaultClient.CloseIdleConnections()
	up.settle()
	up.open()
	r, _ := retryUntilDecided(t, base+"/export", "stream", "x", 3000)
	if r.status != 200 || r.body != "part 1 of run 1\ndone run 1\n" || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry after a hang-up mid-stream: %d %q", r.status, r.body)
	}
	if n := up.runs.Load(); n != 1 {
		t.Fatalf("the upstream ran %d times, want 1", n)
	}
}

// TestProxyStreamPastLease: an upstream that streams for longer than the
// lease is cut at the whole-exchange deadline (shorter than the lease), so
// no retry is forwarded while it still runs: never two calls at once.
func TestProxyStreamPastLease(t *testing.T) {
	var runs, active, maxActive atomic.Int64
	ended := make(chan struct{}, 8)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		a := active.Add(1)
		for m := maxActive.Load(); a > m && !maxActive.CompareAndSwap(m, a); m = maxActive.Load() {
		}
		defer func() { active.Add(-1); ended <- struct{}{} }()
		w.WriteHeader(200)
		t := time.NewTicker(10 * time.Millisecond)
		defer t.Stop()
		stop := time.After(3 * time.Second) // a stream that nothing cuts ends here
		for {
			select {
			case <-r.Context().Done():
				return
			case <-stop:
				return
			case <-t.C:
				w.Write([]byte("tick\n"))
				http.NewResponseController(w).Flush()
			}
		}
	}))
	defer up.Close()
	base, _ := startProxy(t, "--upstream", up.URL, "--single-tenant", "--upstream-timeout", "400ms", "--lease", "1s")
	go func() {
		req, _ := http.NewRequest("POST", base+"/feed", strings.NewReader("x"))
		req.Header.Set("Idempotency-Key", "feed")
		if resp, err := http.DefaultClient.Do(req); err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	// Retry through the first call and past its lease.
	deadline := time.Now().Add(1800 * time.Millisecond)
	sawConflict := false
	for time.Now().Before(deadline) {
		if runs.Load() == 0 {
			time.Sleep(5 * time.Millisecond)
			continue
		}
		first := active.Load() > 0 && runs.Load() == 1
		req, _ := http.NewRequest("POST", base+"/feed", strings.NewReader("x"))
		req.Header.Set("Idempotency-Key", "feed")
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		resp, err := http.DefaultClient.Do(req.WithContext(ctx))
		if err == nil {
			if first && resp.StatusCode != http.StatusConflict && runs.Load() == 1 {
				t.Errorf("a retry while the first call streams got %d", resp.StatusCode)
			}
			sawConflict = sawConflict || resp.StatusCode == http.StatusConflict
			resp.Body.Close()
		}
		cancel()
		time.Sleep(50 * time.Millisecond)
	}
	if !sawConflict {
		t.Error("no retry got 409 while the key was held")
	}
	if m := maxActive.Load(); m != 1 {
		t.Fatalf("%d upstream calls ran at once for one key, want 1", m)
	}
}

// TestProxyPrincipalBinding: with a principal header, a caller without the
// credential, or with another, cannot replay the stored response; an
// ambiguous or Connection-named tenant header is 400 and not forwarded.
func TestProxyPrincipalBinding(t *testing.T) {
	up := newUpstream(t)
	base, _ := startProxy(t, "--upstream", up.srv.URL, "--tenant-header", "X-Tenant", "--principal-header", "Authorization")
	a := send(t, "POST", base+"/pay", "k", "p", "X-Tenant", "acme", "Authorization", "Bearer alice")
	if a.status != 201 || up.runs.Load() != 1 {
		t.Fatalf("first: %d runs %d", a.status, up.runs.Load())
	}
	if r := send(t, "POST", base+"/pay", "k", "p", "X-Tenant", "acme"); r.status != http.StatusBadRequest || strings.Contains(r.body, "run") {
		t.Errorf("no credential: %d %q, want 400 without the stored body", r.status, r.body)
	}
	b := send(t, "POST", base+"/pay", "k", "p", "X-Tenant", "acme", "Authorization", "Bearer bob")
	if b.header.Get("Idempotent-Replayed") != "" || b.body == a.body || up.runs.Load() != 2 {
		t.Errorf("another principal of the tenant got %d %q (replayed %q), runs %d", b.status, b.body, b.header.Get("Idempotent-Replayed"), up.runs.Load())
	}
	if r := send(t, "POST", base+"/pay", "k", "p", "X-Tenant", "acme", "Authorization", "Bearer alice"); r.header.Get("Idempotent-Replayed") != "true" || r.body != a.body {
		t.Errorf("the same principal's retry: %d %q", r.status, r.body)
	}
	runs := up.runs.Load()
	for name, hdr := range map[string][]string{
		"list":       {"X-Tenant", "acme,evil", "Authorization", "Bearer alice"},
		"connection": {"X-Tenant", "acme", "Authorization", "Bearer alice", "Connection", "X-Tenant"},
	} {
		if r := send(t, "POST", base+"/pay", "k2", "p", hdr...); r.status != http.StatusBadRequest {
			t.Errorf("%s: %d %q, want 400", name, r.status, r.body)
		}
	}
	// Two X-Tenant fields.
	req, _ := http.NewRequest("POST", base+"/pay", strings.NewReader("p"))
	req.Header.Set("Idempotency-Key", "k3")
	req.Header.Set("Authorization", "Bearer alice")
	req.Header.Add("X-Tenant", "acme")
	req.Header.Add("X-Tenant", "other")
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != http.StatusBadRequest {
		t.Errorf("two tenant headers: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}
	if up.runs.Load() != runs {
		t.Errorf("an ambiguous request was forwarded: runs %d, want %d", up.runs.Load(), runs)
	}
}

// TestProxyMemoryFloodKeepsLiveRecords: a flood of unique keys fills the
// memory store; new keys then get 503 and no live record is evicted, so
// the victim's retry is still a replay.
func TestProxyMemoryFloodKeepsLiveRecords(t *testing.T) {
	up := newUpstream(t)
	base, _ := startProxy(t, "--upstream", up.srv.URL, "--single-tenant", "--memory-records", "64")
	victim := send(t, "POST", base+"/pay", "victim", "p")
	full := 0
	for i := range 400 {
		r := send(t, "POST", base+"/pay", "flood-"+strconv.Itoa(i), "p")
		switch r.status {
		case http.StatusCreated:
		case http.StatusServiceUnavailable:
			full++
		default:
			t.Fatalf("flood: %d %q", r.status, r.body)
		}
	}
	if full == 0 {
		t.Fatal("400 keys fit in a store of 64 records")
	}
	runs := up.runs.Load()
	r := send(t, "POST", base+"/pay", "victim", "p")
	if r.status != victim.status || r.body != victim.body || r.header.Get("Idempotent-Replayed") != "true" || up.runs.Load() != runs {
		t.Fatalf("the victim's retry after the flood: %d %q, runs %d -> %d", r.status, r.body, runs, up.runs.Load())
	}
}

// TestProxyAdminLogAndEnv: flags from the environment; /healthz and
// /readyz on the admin listener; one log line per keyed request with the
// key's hash and never the key.
func TestProxyAdminLogAndEnv(t *testing.T) {
	up := newUpstream(t)
	t.Setenv("DEDUP_PROXY_SINGLE_TENANT", "true")
	t.Setenv("DEDUP_PROXY_ADMIN_LISTEN", "127.0.0.1:0")
	t.Setenv("DEDUP_PROXY_LOG_FORMAT", "json")
	ctx, cancel := context.WithCancel(context.Background())
	addrs := make(chan string, 1)
	done := make(chan int, 1)
	var stderr syncBuffer
	go func() {
		done <- serveProxy(ctx, []string{"--listen", "127.0.0.1:0", "--upstream", up.srv.URL}, io.Discard, &stderr, func(a string) { addrs <- a })
	}()
	var f []string
	select {
	case a := <-addrs:
		f = strings.Fields(a)
	case code := <-done:
		cancel()
		t.Fatalf("proxy exited %d: %s", code, stderr.String())
	}
	defer func() {
		cancel()
		<-done
	}()
	if len(f) != 2 {
		t.Fatalf("addresses %q", f)
	}
	for _, p := range []string{"/healthz", "/readyz"} {
		resp, err := http.Get("http://" + f[1] + p)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("%s: %v %v", p, resp, err)
		}
		resp.Body.Close()
	}
	if r := send(t, "GET", "http://"+f[0]+"/healthz", "", ""); r.body != "get /healthz" {
		t.Errorf("the main listener does not forward /healthz upstream: %q", r.body)
	}
	send(t, "POST", "http://"+f[0]+"/pay", "secret-key-123", "p")
	// Log lines are written in batches, at most logFlushInterval late.
	logs := stderr.String()
	for i := 0; i < 500 && !strings.Contains(logs, `"outcome":"stored"`); i++ {
		time.Sleep(10 * time.Millisecond)
		logs = stderr.String()
	}
	if strings.Contains(logs, "secret-key-123") || !strings.Contains(logs, `"key_hash":"`+keyHashForTest("secret-key-123")+`"`) || !strings.Contains(logs, `"outcome":"stored"`) {
		t.Errorf("request log line: %s", logs)
	}
	send(t, "POST", "http://"+f[0]+"/pay", "secret-key-123", "p") // a replay
	resp, err := http.Get("http://" + f[1] + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`dedup_http_requests_total{class="stored",code="201",handler="proxy"} 1`,
		`dedup_http_requests_total{class="replayed",code="201",handler="proxy"} 1`, "go_goroutines"} {
		if !strings.Contains(string(metrics), want) {
			t.Errorf("/metrics on the admin listener lacks %s:\n%s", want, metrics)
		}
	}
	t.Setenv("DEDUP_PROXY_LEASE", "soon")
	if code, _, stderr := runArgs(t, "proxy", "--upstream", "http://x"); code != exitUsage || !strings.Contains(stderr, "DEDUP_PROXY_LEASE") {
		t.Errorf("bad env value: exit %d %q", code, stderr)
	}
}

func keyHashForTest(k string) string {
	sum := sha256.Sum256([]byte(k))
	return hex.EncodeToString(sum[:8])
}

// TestSweepSQLite: `dedup sweep --store sqlite` deletes the expired rows a
// proxy left behind and keeps the live ones.
func TestSweepSQLite(t *testing.T) {
	db := filepath.Join(t.TempDir(), "keys.db")
	s, err := sqlitestore.Open(db)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for i, ret := range []time.Duration{time.Millisecond, time.Millisecond, time.Millisecond, time.Hour} {
		c, err := s.Claim(ctx, dedup.Key{Scope: "s", ID: strconv.Itoa(i)}, "", time.Minute)
		if err == nil {
			err = s.Complete(ctx, c, nil, ret)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	s.Close()
	time.Sleep(5 * time.Millisecond) // let the 1 ms retentions end (the CLI reads the system clock)
	code, stdout, stderr := runArgs(t, "sweep", "--store", "sqlite", "--path", db, "--json", "--batch", "2")
	if code != exitOK || !strings.Contains(stdout, `"deleted":3`) {
		t.Fatalf("sweep: exit %d, %q %q", code, stdout, stderr)
	}
	if code, _, stderr := runArgs(t, "sweep", "--store", "sqlite"); code != exitUsage || !strings.Contains(stderr, "--path") {
		t.Errorf("no path: exit %d %q", code, stderr)
	}
	if code, _, stderr := runArgs(t, "sweep", "--store", "sqlite", "--path", db+".missing"); code != exitFail {
		t.Errorf("missing file: exit %d %q", code, stderr)
	}
	if code, _, _ := runArgs(t, "sweep", "--store", "mongo"); code != exitUsage {
		t.Errorf("--store mongo: exit %d", code)
	}
}
