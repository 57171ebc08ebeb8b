package deduphttp_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/dedupkit/dedup/deduphttp"
	"github.com/dedupkit/dedup/memstore"
)

func Example() {
	store, _ := memstore.New()
	defer store.Close()
	m, err := deduphttp.New(store, deduphttp.WithTenant(deduphttp.TenantHeader("X-Account")))
	if err != nil {
		panic(err)
	}
	charges := 0
	mux := http.NewServeMux()
	mux.Handle("POST /charges", m.Required(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		charges++
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "charge %d", charges)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	for _, body := range []string{`{"amount":10}`, `{"amount":10}`, `{"amount":99}`} {
		req, _ := http.NewRequest("POST", srv.URL+"/charges", strings.NewReader(body))
		req.Header.Set("Idempotency-Key", `"8e03978e-40d5-43e8-bc93-6894a57f9324"`)
		req.Header.Set("X-Account", "acct_1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		resp.Body.Close()
		fmt.Println(resp.StatusCode, "replayed:", resp.Header.Get("Idempotent-Replayed") == "true")
	}
	fmt.Println("charges:", charges)
	// Output:
	// 201 replayed: false
	// 201 replayed: true
	// 422 replayed: false
	// charges: 1
}

// Keys bound to the caller: the tenant and the principal (here the
// Authorization header, hashed) scope every key, so another user of the
// same tenant who sends the same key runs their own request.
func Example_principal() {
	store, _ := memstore.New()
	defer store.Close()
	m, _ := deduphttp.New(store,
		deduphttp.WithTenant(deduphttp.TenantHeader("X-Tenant")),
		deduphttp.WithPrincipal(deduphttp.PrincipalHeader("Authorization")))
	runs := 0
	srv := httptest.NewServer(m.Required(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		w.WriteHeader(http.StatusCreated)
	})))
	defer srv.Close()
	for _, auth := range []string{"Bearer alice", "Bearer alice", "Bearer bob", ""} {
		req, _ := http.NewRequest("POST", srv.URL, strings.NewReader(`{"amount":10}`))
		req.Header.Set("Idempotency-Key", "order-7")
		req.Header.Set("X-Tenant", "acme")
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		resp.Body.Close()
		fmt.Printf("%q: %d replayed: %v\n", auth, resp.StatusCode, resp.Header.Get("Idempotent-Replayed") == "true")
	}
	fmt.Println("runs:", runs)
	// Output:
	// "Bearer alice": 201 replayed: false
	// "Bearer alice": 201 replayed: true
	// "Bearer bob": 201 replayed: false
	// "": 401 replayed: false
	// runs: 2
}
