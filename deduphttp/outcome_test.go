package deduphttp_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/deduphttp"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/storetest"
)

// TestOutcomeClasses: a handler's declared outcome decides the key's fate:
// never started releases, unknown holds (409 with the time left on the
// lease) or, with WithStoreUnknownOutcome, stores.
func TestOutcomeClasses(t *testing.T) {
	for _, tc := range []struct {
		name         string
		outcome      deduphttp.Outcome
		storeUnknown bool
		want         int // status of the immediate retry
		runs         int64
	}{
		{"not started", deduphttp.OutcomeNotStarted, false, 201, 2},
		{"unknown", deduphttp.OutcomeUnknown, false, 409, 1},
		{"unknown stored", deduphttp.OutcomeUnknown, true, 504, 1},
		{"finished", deduphttp.OutcomeFinished, false, 504, 2}, // a 5xx finished response is released
	} {
		t.Run(tc.name, func(t *testing.T) {
			clock := storetest.NewClock()
			s, _ := memstore.New(memstore.WithClock(clock))
			defer s.Close()
			opts := []deduphttp.Option{deduphttp.WithClock(clock), deduphttp.WithLease(time.Minute)}
			if tc.storeUnknown {
				opts = append(opts, deduphttp.WithStoreUnknownOutcome())
			}
			var runs atomic.Int64
			m := newMiddleware(t, s, opts...)
			srv := httptest.NewServer(m.Required(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if runs.Add(1) == 1 || tc.name == "finished" {
					if !deduphttp.SetOutcome(w, tc.outcome) {
						t.Error("SetOutcome did not find the middleware's writer")
					}
					w.WriteHeader(http.StatusGatewayTimeout)
					return
				}
				w.WriteHeader(201)
			})))
			defer srv.Close()
			first := post(t, srv.Client(), srv.URL, "k", "p")
			if first.header.Get(deduphttp.HeaderExpires) != "" {
				t.Errorf("a 504 carries the expiry header")
			}
			clock.Advance(15 * time.Second)
			r := post(t, srv.Client(), srv.URL, "k", "p")
			if r.status != tc.want || runs.Load() != tc.runs {
				t.Fatalf("retry: %d, runs %d; want %d, %d", r.status, runs.Load(), tc.want, tc.runs)
			}
			if tc.want == 409 && r.header.Get("Retry-After") != "45" {
				t.Errorf("Retry-After %q, want the 45 s left on the lease", r.header.Get("Retry-After"))
			}
		})
	}
	if deduphttp.SetOutcome(httptest.NewRecorder(), deduphttp.OutcomeUnknown) {
		t.Error("SetOutcome on a writer the middleware does not own reported true")
	}
}

// TestHandlerTimeoutDetaches: with WithHandlerTimeout the client's hang-up
// does not cancel the handler's context; the deadline does.
func TestHandlerTimeoutDetaches(t *testing.T) {
	started, cancelled := make(chan struct{}), make(chan error, 1)
	m := newMiddleware(t, newMem(t), deduphttp.WithHandlerTimeout(200*time.Millisecond), deduphttp.WithLease(time.Minute))
	srv := httptest.NewServer(m.Required(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(started)
		<-r.Context().Done()
		cancelled <- context.Cause(r.Context())
	})))
	defer srv.Close()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL, strings.NewReader("p"))
	req.Header.Set("Idempotency-Key", "k")
	go func() { <-started; cancel() }()
	if resp, err := srv.Client().Do(req); err == nil {
		resp.Body.Close()
	}
	if err := <-cancelled; !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("the handler's context ended with %v, want the deadline (not the client's hang-up)", err)
	}
	// Nothing written and the deadline passed: unknown, held.
	if r := post(t, srv.Client(), srv.URL, "k", "p"); r.status != http.StatusConflict {
		t.Fatalf("retry: %d, want 409", r.status)
	}
}

// TestPrincipalScope: the principal is part of the scope; a caller
// without one is refused, another principal does not get the replay.
func TestPrincipalScope(t *testing.T) {
	h := &counting{}
	m := newScoped(t, newMem(t), deduphttp.WithTenant(deduphttp.TenantHeader("X-Tenant")), deduphttp.WithPrincipal(deduphttp.PrincipalHeader("Authorization")))
	srv := httptest.NewServer(m.Required(h))
	defer srv.Close()
	a := post(t, srv.Client(), srv.URL, "k", "p", "X-Tenant", "t", "Authorization", "Bearer a")
	none := post(t, srv.Client(), srv.URL, "k", "p", "X-Tenant", "t")
	b := post(t, srv.Client(), srv.URL, "k", "p", "X-Tenant", "t", "Authorization", "Bearer b")
	again := post(t, srv.Client(), srv.URL, "k", "p", "X-Tenant", "t", "Authorization", "Bearer a")
	if none.status != 401 || problemCode(t, none) != deduphttp.CodeTenantMissing {
		t.Errorf("no principal: %d %q", none.status, none.body)
	}
	if b.header.Get(deduphttp.HeaderReplayed) != "" || h.runs.Load() != 2 || again.header.Get(deduphttp.HeaderReplayed) != "true" || again.body != a.body {
		t.Errorf("principal b: %d replayed %q; a again: replayed %q; runs %d", b.status, b.header.Get(deduphttp.HeaderReplayed), again.header.Get(deduphttp.HeaderReplayed), h.runs.Load())
	}
	for name, hdr := range map[string][]string{
		"list":       {"X-Tenant", "t,u", "Authorization", "Bearer a"},
		"connection": {"X-Tenant", "t", "Authorization", "Bearer a", "Connection", "x-tenant"},
	} {
		if r := post(t, srv.Client(), srv.URL, "k2", "p", hdr...); r.status != 400 || problemCode(t, r) != deduphttp.CodeTenantInvalid {
			t.Errorf("%s: %d %q, want 400", name, r.status, r.body)
		}
	}
	// Two Authorization fields are ambiguous; a Digest credential's commas
	// are not.
	req, _ := http.NewRequest("POST", srv.URL, strings.NewReader("p"))
	req.Header.Set("Idempotency-Key", "k3")
	req.Header.Set("X-Tenant", "t")
	req.Header.Add("Authorization", "Bearer a")
	req.Header.Add("Authorization", "Bearer b")
	if resp, err := srv.Client().Do(req); err != nil || resp.StatusCode != 400 {
		t.Errorf("two principals: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}
	if h.runs.Load() != 2 {
		t.Errorf("runs %d", h.runs.Load())
	}
	if r := post(t, srv.Client(), srv.URL, "k4", "p", "X-Tenant", "t", "Authorization", `Digest username="a", realm="r"`); r.status != 201 {
		t.Errorf("digest credential: %d %q", r.status, r.body)
	}
}

// TestReplayNegotiation: a stored gzip body is not replayed to a request
// whose Accept-Encoding refuses gzip (406); Cache-Control and Vary are
// replayed; the first response promises retention only when it will be
// stored.
func TestReplayNegotiation(t *testing.T) {
	var runs atomic.Int64
	m := newMiddleware(t, newMem(t))
	srv := httptest.NewServer(m.Required(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.Header().Set("Content-Encoding", "gzip")
		w.Header().Set("Cache-Control", "private, max-age=5")
		w.Header().Set("Vary", "Accept-Encoding")
		w.Header().Set("Content-Length", "4")
		w.WriteHeader(201)
		w.Write([]byte("\x1f\x8b\x08\x00"))
	})))
	defer srv.Close()
	first := post(t, srv.Client(), srv.URL, "k", "p", "Accept-Encoding", "gzip")
	if first.header.Get(deduphttp.HeaderExpires) == "" {
		t.Errorf("a response of declared length that will be stored lacks the expiry header")
	}
	for _, tc := range []struct {
		accept string
		want   int
	}{{"gzip", 201}, {"br, gzip;q=0.5", 201}, {"*", 201}, {"identity", 406}, {"gzip;q=0", 406}, {"br", 406}, {"*;q=0", 406}} {
		r := post(t, srv.Client(), srv.URL, "k", "p", "Accept-Encoding", tc.accept)
		if r.status != tc.want {
			t.Errorf("Accept-Encoding %q: %d, want %d", tc.accept, r.status, tc.want)
			continue
		}
		if tc.want == 406 && problemCode(t, r) != deduphttp.CodeNotAcceptable {
			t.Errorf("406 code")
		}
		if tc.want == 201 && (r.header.Get("Cache-Control") != "private, max-age=5" || r.header.Get("Vary") != "Accept-Encoding") {
			t.Errorf("replayed headers: %v", r.header)
		}
	}
	if runs.Load() != 1 {
		t.Errorf("runs %d", runs.Load())
	}
}

// TestFloodNeverEvictsLiveRecord: on a strict memstore a flood of unique
// keys gets 503 once the store is full; the victim's record stays.
func TestFloodNeverEvictsLiveRecord(t *testing.T) {
	s, err := memstore.New(memstore.WithCapacity(64), memstore.WithShards(1), memstore.WithStrictCapacity())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	h := &counting{}
	m := newMiddleware(t, s)
	srv := httptest.NewServer(m.Required(h))
	defer srv.Close()
	victim := post(t, srv.Client(), srv.URL, "victim", "p")
	full := 0
	for i := range 200 {
		if r := post(t, srv.Client(), srv.URL, "flood-"+strconv.Itoa(i), "p"); r.status == 503 {
			full++
		}
	}
	r := post(t, srv.Client(), srv.URL, "victim", "p")
	if full != 137 || r.header.Get(deduphttp.HeaderReplayed) != "true" || r.body != victim.body {
		t.Fatalf("503s %d (want 137), victim retry %d %q", full, r.status, r.body)
	}
	if _, err := s.Claim(context.Background(), dedup.Key{Scope: "x", ID: "y"}, "", time.Second); !errors.Is(err, dedup.ErrFull) {
		t.Errorf("full store: %v", err)
	}
}
