package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

const proxyBenchBody = `{"amount":1299,"currency":"EUR","customer":"cus_8f2a","description":"order 18273"}`

// proxyBenchUpstream answers every POST 201 with a small JSON body, as a
// payments API would, after reading the request.
func proxyBenchUpstream() *httptest.Server {
	resp := []byte(`{"id":"pay_1","status":"succeeded","amount":1299,"currency":"EUR"}` + "\n")
	return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(resp)))
		w.WriteHeader(http.StatusCreated)
		w.Write(resp)
	}))
}

// loadCase is one target of the load generator; key returns the
// Idempotency-Key of client c's i-th request.
type loadCase struct {
	name string
	base string
	key  func(c, i int) string
}

// BenchmarkProxyLoad is a load generator: 64 clients, each on its own
// keep-alive connection, POST to the same upstream directly, through a
// plain httputil.ReverseProxy, and through `dedup proxy` (serveProxy, the
// command's own code: flags, memory store, request log to /dev/null,
// metrics) with a new key per request and with replays of stored keys;
// and, to separate the two changes, through the plain proxy given dedup
// proxy's pooled copy buffers.
// Each iteration gives every case one burst of 64 x perClient requests,
// starting with a different case each time, so that the machine's load
// falls on every case alike; it reports requests/s per case and the
// ratios to the plain reverse proxy.
//
// Run: go test -run '^$' -bench ProxyLoad -benchtime 20x ./cmd/dedup/
func BenchmarkProxyLoad(b *testing.B) {
	const clients, perClient = 64, 40
	up := proxyBenchUpstream()
	defer up.Close()
	target, _ := url.Parse(up.URL)
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConns, tr.MaxIdleConnsPerHost = 1024, 1024
	plain := httptest.NewServer(&httputil.ReverseProxy{
		Rewrite:   func(pr *httputil.ProxyRequest) { pr.SetURL(target); pr.SetXForwarded() },
		Transport: tr,
	})
	defer plain.Close()
	// The same plain proxy with the pooled copy buffers that dedup proxy
	// uses: what is left between it and dedup proxy is the idempotency
	// layer itself.
	pooled := httptest.NewServer(&httputil.ReverseProxy{
		Rewrite:    func(pr *httputil.ProxyRequest) { pr.SetURL(target); pr.SetXForwarded() },
		Transport:  tr,
		BufferPool: newBufferPool(),
	})
	defer pooled.Close()

	devnull, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		b.Fatal(err)
	}
	defer devnull.Close()
	ctx, cancel := context.WithCancel(context.Background())
	addr := make(chan string, 1)
	done := make(chan int, 1)
	go func() {
		done <- serveProxy(ctx, []string{"--listen", "127.0.0.1:0", "--upstream", up.URL, "--single-tenant",
			"--memory-records", "10000000"}, io.Discard, devnull, func(a string) { addr <- strings.Fields(a)[0] })
	}()
	var dedupURL string
	select {
	case a := <-addr:
		dedupURL = "http://" + a
	case code := <-done:
		cancel()
		b.Fatalf("dedup proxy exited with %d", code)
	}
	defer func() { cancel(); <-done }()

	// One transport per client: each keeps one connection alive per
	// target, as wrk's connections do.
	transports := make([]*http.Transport, clients)
	for c := range transports {
		transports[c] = &http.Transport{MaxIdleConnsPerHost: 1, DisableCompression: true}
		defer transports[c].CloseIdleConnections()
	}
	run := fmt.Sprintf("%x", time.Now().UnixNano())
	post := func(c int, base, key string, want int) error {
		req, _ := http.NewRequest(http.MethodPost, base+"/payments", strings.NewReader(proxyBenchBody))
		req.Header.Set("Content-Type", "application/json")
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := transports[c].RoundTrip(req)
		if err != nil {
			return err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != want {
			return fmt.Errorf("%s: status %d, want %d", base, resp.StatusCode, want)
		}
		return nil
	}
	// The replayed keys: perClient per client, stored before the first
	// burst.
	replayKey := func(c, i int) string { return "replay-" + run + "-" + strconv.Itoa(c) + "-" + strconv.Itoa(i) }
	for c := range clients {
		for i := range perClient {
			if err := post(c, dedupURL, replayKey(c, i), http.StatusCreated); err != nil {
				b.Fatal(err)
			}
		}
	}
	var burst int
	cases := []loadCase{
		{"direct", up.URL, func(c, i int) string { return "" }},
		{"reverseproxy", plain.URL, func(c, i int) string { return "" }},
		{"reverseproxy-pooled", pooled.URL, func(c, i int) string { return "" }},
		{"dedup-new", dedupURL, func(c, i int) string {
			return "new-" + run + "-" + strconv.Itoa(burst) + "-" + strconv.Itoa(c) + "-" + strconv.Itoa(i)
		}},
		{"dedup-replay", dedupURL, replayKey},
	}
	took := make([]time.Duration, len(cases))
	round := 0
	for b.Loop() {
		for j := range cases {
			ci := (round + j) % len(cases)
			cs := cases[ci]
			burst++
			var wg sync.WaitGroup
			errs := make(chan error, clients)
			start := time.Now()
			for c := range clients {
				wg.Go(func() {
					for i := range perClient {
						if err := post(c, cs.base, cs.key(c, i), http.StatusCreated); err != nil {
							errs <- err
							return
						}
					}
				})
			}
			wg.Wait()
			took[ci] += time.Since(start)
			close(errs)
			for err := range errs {
				b.Fatal(err)
			}
		}
		round++
	}
	rate := func(i int) float64 { return float64(b.N*clients*perClient) / took[i].Seconds() }
	base := rate(1)
	for i, cs := range cases {
		b.ReportMetric(rate(i), cs.name+"-req/s")
		if i != 1 {
			b.ReportMetric(rate(i)/base, cs.name+"/reverseproxy")
		}
	}
}
