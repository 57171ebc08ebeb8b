// Command payments is a small payments-style API made idempotent with the
// deduphttp middleware on a SQLite store, so a client that retries a POST
// after a timeout is never charged twice.
//
//	go run ./examples/payments --listen 127.0.0.1:8081 --db payments.db
//	curl -i -X POST localhost:8081/payments -H 'Authorization: Bearer alice' \
//	     -H 'Idempotency-Key: "order-42"' -d '{"amount":1000,"currency":"EUR"}'
//	curl localhost:8081/payments -H 'Authorization: Bearer alice'
//
// Sending the same request again replays the first response (same payment
// ID, Idempotent-Replayed: true); the same key with another amount is 422;
// another user with the same key gets a payment of their own.
//
// The ledger is a table in the same SQLite database as the idempotency
// keys, so a restart keeps both: a replay after a restart still finds its
// payment, and the next payment gets the next ID, never one already handed
// out. Each ledger row also carries its user and Idempotency-Key under a
// unique index: if the process dies after the charge and before the
// middleware records the response, the retry that comes after the lease
// finds the charge instead of making a second one. Interrupt (Ctrl-C or
// SIGTERM) stops accepting requests, lets those in flight finish for up to
// 10 seconds, then closes the database.
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
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

// schema is the ledger, next to the store's own table.
const schema = `CREATE TABLE IF NOT EXISTS payments (
	seq             INTEGER PRIMARY KEY AUTOINCREMENT, -- never reused, across restarts too
	user            TEXT NOT NULL,
	idempotency_key TEXT NOT NULL,
	amount          INTEGER NOT NULL,
	currency        TEXT NOT NULL,
	UNIQUE (user, idempotency_key)
)`

// ledger is the business state: the charges made, in the store's database.
type ledger struct{ db *sql.DB }

var errKeyReused = errors.New("this Idempotency-Key was used for another payment")

// charge records a payment for user under key, or returns the one already
// recorded under it (a retry whose first attempt charged but was never
// answered).
func (l ledger) charge(ctx context.Context, user, key string, amount int64, currency string) (payment, error) {
	p := payment{User: user, Amount: amount, Currency: currency}
	var seq int64
	err := l.db.QueryRowContext(ctx, `INSERT INTO payments (user, idempotency_key, amount, currency) VALUES (?, ?, ?, ?)
		ON CONFLICT (user, idempotency_key) DO NOTHING RETURNING seq`, user, key, amount, currency).Scan(&seq)
	if errors.Is(err, sql.ErrNoRows) {
		var a int64
		var c string
		if err := l.db.QueryRowContext(ctx, `SELECT seq, amount, currency FROM payments WHERE user = ? AND idempotency_key = ?`,
			user, key).Scan(&seq, &a, &c); err != nil {
			return p, err
		}
		if a != amount || c != currency {
			return p, errKeyReused
		}
	} else if err != nil {
		return p, err
	}
	p.ID = fmt.Sprintf("pay_%d", seq)
	return p, nil
}

func (l ledger) list(ctx context.Context, user string) ([]payment, error) {
	rows, err := l.db.QueryContext(ctx, `SELECT seq, amount, currency FROM payments WHERE user = ? ORDER BY seq`, user)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := []payment{}
	for rows.Next() {
		p := payment{User: user}
		var seq int64
		if err := rows.Scan(&seq, &p.Amount, &p.Currency); err != nil {
			return nil, err
		}
		p.ID = fmt.Sprintf("pay_%d", seq)
		out = append(out, p)
	}
	return out, rows.Err()
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

// beforeCharge, when set (by tests), runs in the handler before the charge.
var beforeCharge func()

// newHandler returns the API on the store's database.
func newHandler(ctx context.Context, store *sqlitestore.Store) (http.Handler, error) {
	if _, err := store.DB().ExecContext(ctx, schema); err != nil {
		return nil, fmt.Errorf("create the ledger table: %w", err)
	}
	idem, err := deduphttp.New(store,
		deduphttp.WithTenant(user), // keys are per user: no cross-user replays
		deduphttp.WithRetention(24*time.Hour),
		// Only these fields identify the request: a retry with a new
		// client timestamp is still the same payment.
		deduphttp.WithFingerprint(deduphttp.FingerprintJSONFields("amount", "currency")),
	)
	if err != nil {
		return nil, err
	}
	l := ledger{db: store.DB()}
	mux := http.NewServeMux()
	mux.Handle("POST /payments", idem.Required(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u, _ := user(r)
		var req struct {
			Amount   int64  `json:"amount"`
			Currency string `json:"currency"`
		}
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.Amount <= 0 || req.Currency == "" {
			writeJSON(w, http.StatusBadRequest, map[string]string{"error": "amount (> 0) and currency are required"})
			return
		}
		if beforeCharge != nil {
			beforeCharge()
		}
		p, err := l.charge(r.Context(), u, r.Header.Get("Idempotency-Key"), req.Amount, req.Currency)
		switch {
		case errors.Is(err, errKeyReused):
			writeJSON(w, http.StatusUnprocessableEntity, map[string]string{"error": err.Error()})
			return
		case err != nil:
			log.Printf("charge: %v", err)
			writeJSON(w, http.StatusInternalServerError, map[string]string{"error": "the payment could not be recorded"})
			return
		}
		w.Header().Set("Location", "/payments/"+p.ID)
		writeJSON(w, http.StatusCreated, p)
	})))
	mux.HandleFunc("GET /payments", func(w http.ResponseWriter, r *http.Request) {
		u, err := user(r)
		if err != nil {
			writeJSON(w, http.StatusUnauthorized, map[string]string{"error": err.Error()})
			return
		}
		ps, err := l.list(r.Context(), u)
		if err != nil {
			writeJSON(w, http.StatusInternalServerError, map[string]string{"error": err.Error()})
			return
		}
		writeJSON(w, http.StatusOK, ps)
	})
	return mux, nil
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}

// shutdownTimeout bounds how long requests in flight may take to finish.
const shutdownTimeout = 10 * time.Second

// serve runs the API on ln with its database at dbPath until ctx is done,
// then shuts down gracefully: no new connections, requests in flight
// finish (up to shutdownTimeout), then the database is closed.
func serve(ctx context.Context, ln net.Listener, dbPath string, logw io.Writer) error {
	store, err := sqlitestore.Open(dbPath)
	if err != nil {
		ln.Close()
		return fmt.Errorf("open the SQLite database %s: %w", dbPath, err)
	}
	defer store.Close()
	h, err := newHandler(ctx, store)
	if err != nil {
		ln.Close()
		return err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	fmt.Fprintf(logw, "payments API on http://%s (database %s)\n", ln.Addr(), dbPath)
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	fmt.Fprintln(logw, "shutting down: finishing requests in flight")
	// A detached context: the one that asked for the shutdown is done.
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), shutdownTimeout)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		return fmt.Errorf("shutdown: %w", err)
	}
	<-errc // http.ErrServerClosed
	return nil
}

func main() {
	listen := flag.String("listen", "127.0.0.1:8081", "address to listen on")
	db := flag.String("db", "payments.db", "SQLite file holding the idempotency keys and the ledger")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatal(err)
	}
	if err := serve(ctx, ln, *db, os.Stderr); err != nil {
		log.Fatal(err)
	}
}
