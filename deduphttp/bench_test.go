package deduphttp_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/deduphttp"
)

var benchBody = `{"amount":1000,"currency":"EUR","customer":"cus_123"}`

func benchHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"id":"pay_1","status":"succeeded"}`)
	})
}

// discardWriter is a ResponseWriter that keeps nothing, so the benchmark
// measures the handler chain and not a recorder.
type discardWriter struct{ h http.Header }

func (d *discardWriter) Header() http.Header         { return d.h }
func (d *discardWriter) WriteHeader(int)             {}
func (d *discardWriter) Write(p []byte) (int, error) { return len(p), nil }

// BenchmarkMiddleware compares a bare handler with the same handler behind
// the middleware on memstore, in process: a new key per request (claim,
// run, complete) and a replayed duplicate (claim, replay).
func BenchmarkMiddleware(b *testing.B) {
	m := newMiddleware(b, newMem(b))
	var seq atomic.Int64
	run := func(b *testing.B, h http.Handler, key func() string) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			w := &discardWriter{h: make(http.Header)}
			u := &url.URL{Path: "/payments"}
			body := strings.NewReader(benchBody)
			for pb.Next() {
				body.Reset(benchBody)
				r := &http.Request{Method: http.MethodPost, URL: u, Header: http.Header{}, Body: io.NopCloser(body),
					ContentLength: int64(len(benchBody)), Host: "example.com", RequestURI: "/payments"}
				if k := key(); k != "" {
					r.Header["Idempotency-Key"] = []string{k}
				}
				clear(w.h)
				h.ServeHTTP(w, r)
			}
		})
	}
	b.Run("bare", func(b *testing.B) { run(b, benchHandler(), func() string { return "" }) })
	// The store's own share of a new key: one Claim and one Complete with
	// a fresh key, the floor under new-key.
	b.Run("store-only", func(b *testing.B) {
		s := newMem(b)
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				k := dedup.Key{Scope: "http//POST/%2Fpayments", ID: "s" + strconv.FormatInt(seq.Add(1), 10)}
				c, err := s.Claim(context.Background(), k, dedup.FingerprintOf([]byte(benchBody)), 30*time.Second)
				if err != nil {
					b.Fatal(err)
				}
				if err := s.Complete(context.Background(), c, []byte(benchBody), 24*time.Hour); err != nil {
					b.Fatal(err)
				}
			}
		})
	})
	b.Run("new-key", func(b *testing.B) {
		run(b, m.Required(benchHandler()), func() string { return "k" + strconv.FormatInt(seq.Add(1), 10) })
	})
	b.Run("replay", func(b *testing.B) { run(b, m.Required(benchHandler()), func() string { return "same" }) })
	// As dedup proxy runs it: the handler on a detached context with a
	// whole-exchange deadline.
	detached := newMiddleware(b, newMem(b), deduphttp.WithHandlerTimeout(25*time.Second))
	b.Run("new-key-detached", func(b *testing.B) {
		run(b, detached.Required(benchHandler()), func() string { return "d" + strconv.FormatInt(seq.Add(1), 10) })
	})
}

// BenchmarkProxy compares calling an upstream directly with calling it
// through a bare httputil.ReverseProxy and through the idempotency proxy
// (the same ReverseProxy behind the middleware on memstore, as `dedup
// proxy` builds it), over real sockets with 64 concurrent clients and a
// new key per request. ns/op is inverse throughput; ns/roundtrip is the
// mean latency one client sees.
func BenchmarkProxy(b *testing.B) {
	up := httptest.NewServer(benchHandler())
	defer up.Close()
	target, _ := url.Parse(up.URL)
	transport := func() *http.Transport {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.MaxIdleConns, t.MaxIdleConnsPerHost = 1024, 1024
		return t
	}
	rp := &httputil.ReverseProxy{
		Rewrite:   func(pr *httputil.ProxyRequest) { pr.SetURL(target); pr.SetXForwarded() },
		Transport: transport(),
	}
	plain := httptest.NewServer(rp)
	defer plain.Close()
	m := newMiddleware(b, newMem(b), deduphttp.WithKeyRequired(false))
	idem := httptest.NewServer(m.Handler(rp))
	defer idem.Close()

	var seq atomic.Int64
	run := func(b *testing.B, base string) {
		client := &http.Client{Transport: transport()}
		b.SetParallelism(max(1, 64/runtime.GOMAXPROCS(0)))
		var total, count atomic.Int64
		defer func() {
			if n := count.Load(); n > 0 {
				b.ReportMetric(float64(total.Load())/float64(n), "ns/roundtrip")
			}
		}()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				start := time.Now()
				req, _ := http.NewRequest(http.MethodPost, base+"/payments", strings.NewReader(benchBody))
				req.Header.Set("Idempotency-Key", "k"+strconv.FormatInt(seq.Add(1), 10))
				resp, err := client.Do(req)
				if err != nil {
					b.Error(err)
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusCreated {
					b.Errorf("status %d", resp.StatusCode)
					return
				}
				total.Add(int64(time.Since(start)))
				count.Add(1)
			}
		})
	}
	b.Run("direct", func(b *testing.B) { run(b, up.URL) })
	b.Run("reverseproxy", func(b *testing.B) { run(b, plain.URL) })
	b.Run("idempotency-proxy", func(b *testing.B) { run(b, idem.URL) })
}
