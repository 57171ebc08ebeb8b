package main

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/dedupkit/dedup/sqlitestore"
)

// server is one run of the API on a database file.
type server struct {
	url    string
	cancel context.CancelFunc
	done   chan error
}

func start(t *testing.T, db string) *server {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &server{url: "http://" + ln.Addr().String(), cancel: cancel, done: make(chan error, 1)}
	go func() { s.done <- serve(ctx, ln, db, io.Discard) }()
	t.Cleanup(func() { s.stop(t) })
	return s
}

// stop shuts the server down as an interrupt does and waits for it.
func (s *server) stop(t *testing.T) {
	t.Helper()
	if s.cancel == nil {
		return
	}
	s.cancel()
	s.cancel = nil
	if err := <-s.done; err != nil {
		t.Errorf("serve: %v", err)
	}
}

type reply struct {
	status   int
	replayed bool
	payment  payment
}

func (s *server) pay(t *testing.T, user, key, body string) reply {
	t.Helper()
	req, _ := http.NewRequest("POST", s.url+"/payments", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+user)
	req.Header.Set("Idempotency-Key", `"`+key+`"`)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	r := reply{status: resp.StatusCode, replayed: resp.Header.Get("Idempotent-Replayed") == "true"}
	if resp.StatusCode == http.StatusCreated {
		if err := json.NewDecoder(resp.Body).Decode(&r.payment); err != nil {
			t.Fatal(err)
		}
	}
	return r
}

func (s *server) list(t *testing.T, user string) []payment {
	t.Helper()
	req, _ := http.NewRequest("GET", s.url+"/payments", nil)
	req.Header.Set("Authorization", "Bearer "+user)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var ps []payment
	if err := json.NewDecoder(resp.Body).Decode(&ps); err != nil {
		t.Fatal(err)
	}
	return ps
}

// TestRestartKeepsLedgerAndKeysTogether: after a restart a retry replays
// the payment made before it, the next payment gets a new ID (not pay_1
// again), and the ledger lists each payment once.
func TestRestartKeepsLedgerAndKeysTogether(t *testing.T) {
	db := filepath.Join(t.TempDir(), "payments.db")
	s := start(t, db)
	first := s.pay(t, "alice", "order-42", `{"amount":1000,"currency":"EUR"}`)
	if first.status != http.StatusCreated || first.replayed || first.payment.ID != "pay_1" {
		t.Fatalf("first payment: %+v", first)
	}
	if r := s.pay(t, "alice", "order-42", `{"amount":1000,"currency":"EUR"}`); !r.replayed || r.payment != first.payment {
		t.Fatalf("retry before the restart: %+v, want a replay of %+v", r, first.payment)
	}
	s.stop(t)

	s = start(t, db)
	if r := s.pay(t, "alice", "order-42", `{"amount":1000,"currency":"EUR"}`); !r.replayed || r.payment != first.payment {
		t.Fatalf("retry after the restart: %+v, want a replay of %+v", r, first.payment)
	}
	second := s.pay(t, "alice", "order-43", `{"amount":500,"currency":"EUR"}`)
	if second.status != http.StatusCreated || second.replayed || second.payment.ID == first.payment.ID {
		t.Fatalf("next payment after the restart: %+v; its ID must differ from %s", second, first.payment.ID)
	}
	if r := s.pay(t, "alice", "order-42", `{"amount":9999,"currency":"EUR"}`); r.status != http.StatusUnprocessableEntity {
		t.Errorf("the same key with another amount: status %d, want 422", r.status)
	}
	if r := s.pay(t, "bob", "order-42", `{"amount":1000,"currency":"EUR"}`); r.status != http.StatusCreated || r.replayed || r.payment.User != "bob" {
		t.Errorf("another user with the same key: %+v, want a payment of his own", r)
	}
	ps := s.list(t, "alice")
	if len(ps) != 2 || ps[0] != first.payment || ps[1] != second.payment {
		t.Errorf("alice's ledger: %+v, want %+v and %+v", ps, first.payment, second.payment)
	}
}

// TestChargeFoundAfterLostResponse: a charge recorded in the ledger whose
// response was never recorded by the middleware (the process died in
// between) is found by the retry, not made again.
func TestChargeFoundAfterLostResponse(t *testing.T) {
	db := filepath.Join(t.TempDir(), "payments.db")
	s := start(t, db)
	first := s.pay(t, "carol", "k-1", `{"amount":7,"currency":"USD"}`)
	s.stop(t)
	// The ledger row of the lost attempt, written straight to the table.
	st := openLedger(t, db)
	p, err := st.charge(context.Background(), "carol", `"k-2"`, 8, "USD") // charged, unanswered
	if err != nil {
		t.Fatal(err)
	}
	s = start(t, db)
	r := s.pay(t, "carol", "k-2", `{"amount":8,"currency":"USD"}`)
	if r.status != http.StatusCreated || r.payment.ID != p.ID {
		t.Fatalf("retry of the unanswered charge: %+v, want the recorded %s", r, p.ID)
	}
	if ps := s.list(t, "carol"); len(ps) != 2 || ps[0] != first.payment {
		t.Errorf("carol's ledger: %+v, want two payments", ps)
	}
}

// TestGracefulShutdown: a request in flight when the interrupt arrives
// finishes with its answer, and the server then stops.
func TestGracefulShutdown(t *testing.T) {
	db := filepath.Join(t.TempDir(), "payments.db")
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	beforeCharge = func() { once.Do(func() { close(entered); <-release }) }
	t.Cleanup(func() { beforeCharge = nil })
	s := start(t, db)
	got := make(chan reply, 1)
	go func() { got <- s.pay(t, "dave", "k-1", `{"amount":1,"currency":"EUR"}`) }()
	<-entered
	s.cancel() // the interrupt, while the payment is in its handler
	stopped := s.done
	s.cancel = nil
	select {
	case err := <-stopped:
		t.Fatalf("serve returned (%v) with a request in flight", err)
	default:
	}
	close(release)
	if r := <-got; r.status != http.StatusCreated || r.payment.ID != "pay_1" {
		t.Fatalf("the request in flight: %+v, want its payment", r)
	}
	if err := <-stopped; err != nil {
		t.Fatalf("serve: %v", err)
	}
	// The payment was durable: a new run replays it.
	s = start(t, db)
	if r := s.pay(t, "dave", "k-1", `{"amount":1,"currency":"EUR"}`); !r.replayed || r.payment.ID != "pay_1" {
		t.Errorf("after the restart: %+v, want the replay of pay_1", r)
	}
}

// openLedger opens the ledger of db directly, as the lost attempt wrote it.
func openLedger(t *testing.T, db string) ledger {
	t.Helper()
	st, err := sqlitestore.Open(db)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return ledger{db: st.DB()}
}
