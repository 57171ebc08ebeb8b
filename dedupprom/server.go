package dedupprom

import (
	"context"
	"errors"
	"net"
	"net/http"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/prometheus/client_golang/prometheus"
)

// Server serves /metrics on its own listener, for a command that has no
// admin listener of its own (dedup verify --metrics-addr). It is started
// by [Listen] and stopped by Close.
type Server struct {
	ln   net.Listener
	srv  *http.Server
	done chan struct{}
	err  error
}

// Listen serves g on addr ("127.0.0.1:9090"; port 0 picks one) at
// /metrics until Close. A bad address is an [*dedup.ArgumentError]; a
// listen failure is returned as is.
func Listen(addr string, g prometheus.Gatherer) (*Server, error) {
	if g == nil {
		return nil, &dedup.ArgumentError{Arg: "gatherer", Reason: "is nil"}
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return nil, &dedup.ArgumentError{Arg: "metrics address", Reason: err.Error()}
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", Handler(g))
	s := &Server{ln: ln, done: make(chan struct{}),
		srv: &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second, WriteTimeout: 30 * time.Second, IdleTimeout: time.Minute}}
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			s.err = err
		}
	}()
	return s, nil
}

// Addr returns the address the server listens on.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Close stops the server, letting scrapes in flight finish for up to 5
// seconds, and waits for its goroutine. It returns the error that stopped
// serving, if any.
func (s *Server) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := s.srv.Shutdown(ctx)
	<-s.done
	return errors.Join(err, s.err)
}
