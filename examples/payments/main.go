// Command payments is a small payments-style API made idempotent with the
// deduphttp middleware on a SQLite store, so a client that retries a
// POST after a timeout is never charged twice.
//
//	go run ./examples/payments --listen 127.0.0.1:8081 --db payments.db
//	curl -i -X POST localhost:8081/payments -H 'Authorization: Bearer alice' \
//	     -H 'Idempotency-Key: "order-42"' -d '{"amount":1000,"currency":"EUR"}'
//
// Sending the same request again replays the first response (same payment
// ID, Idempotent-Replayed: true); the same key with another amount is 422;
// another user with the same key gets a payment of their own.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup/deduphttp"
	"github.com/dedupkit/dedup/sqlitestore"
)

// payment is one charge.
type payment struct {
	ID       string `json:"id"`
	User     string `json:"user"`
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
}

// ledger is the business state: the charges made.
type ledger struct {
	mu       sync.Mutex
	next     atomic.Int64
	payments []payment
}

func (l *ledger) charge(user string, amount int64, currency string) payment {
	p := payment{ID: fmt.Sprintf("pay_%d", l.next.Add(1)), User: user, Amount: amount, Currency: currency}
	l.mu.Lock()
	l.payments = append(l.payments, p)
	l.mu.Unlock()
	return p
}

// user is the authenticated principal: in this example, the bearer token
// itself. A real service verifies the token.
func user(r *http.Request) (string, error) {
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || tok == "" {
		return "", errors.New("not authenticated")
	}
	return tok, nil
}

func main() {
	listen := flag.String("listen", "127.0.0.1:8081", "address to listen on")
	db := flag.String("db", "payments.db", "SQLite file holding the idempotency keys")
	flag.Parse()

	store, err := sqlitestore.Open(*db)
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	idem, err := deduphttp.New(store,
		deduphttp.WithTenant(user), // keys are per user: no cross-user replays
		deduphttp.WithRetention(24*time.Hour),
		// Only these fields identify the request: a retry with a new
		// client timestamp is still the same payment.
		deduphttp.WithFingerprint(deduphttp.FingerprintJSONFields("amount", "currency")),
	)
	if err != nil {
		log.Fatal(err)
	}

	var l ledger
	mux := http.NewServeMux()
	mux.Handle("POST /payments", idem.Required(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u, _ := user(r)
		var req struct {
			Amount   int64  `json:"amount"`
			Currency string `json:"currency"`
		}
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.Amount <= 0 || req.Currency == "" {
			http.Error(w, `{"error":"amount and currency are required"}`, http.StatusBadRequest)
			return
		}
		p := l.charge(u, req.Amount, req.Currency)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/payments/"+p.ID)
		w.WriteHeader(http.StatusCreated)
		json.NewEncoder(w).Encode(p)
	})))
	mux.HandleFunc("GET /payments", func(w http.ResponseWriter, r *http.Request) {
		l.mu.Lock()
		defer l.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(l.payments)
	})
	log.Printf("payments API on http://%s", *listen)
	log.Fatal(http.ListenAndServe(*listen, mux))
}
