// Command upstream is a tiny HTTP service to put behind `dedup proxy` when
// trying it: it accepts any method on any path, counts the requests it
// really handled, and answers a POST with 201 and a JSON body naming the
// new resource, so a replay by the proxy (same id, Idempotent-Replayed) is
// told apart from a second execution (a new id).
//
//	go run ./examples/upstream --listen 127.0.0.1:8000
//
// GET /stats returns how many requests reached it. Interrupt (Ctrl-C or
// SIGTERM) shuts it down gracefully.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"
)

// maxBody bounds what the upstream reads of a request body.
const maxBody = 1 << 20

// handler answers every request; handled counts them.
func handler(handled *atomic.Int64) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /stats", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(map[string]int64{"handled": handled.Load()})
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		n := handled.Add(1)
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
		if err != nil {
			http.Error(w, `{"error":"body too large or unreadable"}`, http.StatusRequestEntityTooLarge)
			return
		}
		resp := map[string]any{"id": fmt.Sprintf("res_%d", n), "method": r.Method, "path": r.URL.Path}
		if json.Valid(body) && len(body) > 0 {
			resp["request"] = json.RawMessage(body)
		} else if len(body) > 0 {
			resp["request"] = string(body)
		}
		status := http.StatusOK
		if r.Method == http.MethodPost {
			status = http.StatusCreated
			w.Header().Set("Location", fmt.Sprintf("%s/res_%d", r.URL.Path, n))
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		json.NewEncoder(w).Encode(resp)
	})
	return mux
}

// serve runs the upstream on ln until ctx is done, then shuts it down,
// letting requests in flight finish for up to 5 seconds.
func serve(ctx context.Context, ln net.Listener, logw io.Writer) error {
	var handled atomic.Int64
	srv := &http.Server{Handler: handler(&handled), ReadHeaderTimeout: 10 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	fmt.Fprintf(logw, "upstream on http://%s\n", ln.Addr())
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		return err
	}
	<-errc
	return nil
}

func main() {
	listen := flag.String("listen", "127.0.0.1:8000", "address to listen on")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatal(err)
	}
	if err := serve(ctx, ln, os.Stderr); err != nil {
		log.Fatal(err)
	}
}
