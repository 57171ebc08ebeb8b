package main

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/deduphttp"
	"github.com/dedupkit/dedup/dedupprom"
	"github.com/dedupkit/dedup/memstore"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// openProxyStore opens the store the flags name; the memory store has a
// strict capacity, so a flood of new keys is refused with 503 instead of
// evicting another client's live record.
func (f *proxyFlags) openProxyStore(ctx context.Context) (dedup.Store, error) {
	if f.store == "memory" {
		return memstore.New(memstore.WithCapacity(f.memoryRecords), memstore.WithMaxBytes(f.memoryBytes), memstore.WithStrictCapacity())
	}
	return f.openStore(ctx)
}

// proxyAdmin is the proxy's admin listener: /healthz and /readyz, never
// forwarded upstream.
type proxyAdmin struct {
	addr string
	srv  *http.Server
	done chan struct{}
}

// readyTimeout bounds one /readyz probe of the store.
const readyTimeout = 2 * time.Second

func startProxyAdmin(addr string, store dedup.Store, log *slog.Logger, metrics prometheus.Gatherer) (*proxyAdmin, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", dedupprom.Handler(metrics))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), readyTimeout)
		defer cancel()
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("Cache-Control", "no-store")
		if err := pingStore(ctx, store); err != nil {
			log.Warn("readyz: the store does not answer", "err", err)
			w.WriteHeader(http.StatusServiceUnavailable)
			w.Write([]byte("store unavailable\n"))
			return
		}
		w.Write([]byte("ok\n"))
	})
	a := &proxyAdmin{addr: ln.Addr().String(), done: make(chan struct{}),
		srv: &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 5 * time.Second, WriteTimeout: 10 * time.Second, IdleTimeout: time.Minute}}
	go func() {
		defer close(a.done)
		a.srv.Serve(ln)
	}()
	return a, nil
}

func (a *proxyAdmin) close() {
	a.srv.Close()
	<-a.done
}

// pingStore checks that the store answers: its Ping when it has one,
// else a claim of a probe key that is released at once.
func pingStore(ctx context.Context, store dedup.Store) error {
	if p, ok := store.(dedup.Pinger); ok {
		return p.Ping(ctx)
	}
	c, err := store.Claim(ctx, dedup.Key{Scope: "dedup-proxy/readyz", ID: "probe"}, "", time.Second)
	if err != nil {
		return err
	}
	if c.Outcome == dedup.Acquired {
		if err := store.Release(ctx, c); err != nil && !errors.Is(err, dedup.ErrLeaseLost) {
			return err
		}
	}
	return nil
}

// sweepBatch is the most records one background sweep call deletes.
const sweepBatch = 1000

// startProxySweeper deletes expired records every interval, in batches,
// until the returned stop is called (which waits for it).
func startProxySweeper(sw dedup.Sweeper, interval time.Duration, log *slog.Logger) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			total := 0
			for ctx.Err() == nil {
				n, err := sw.Sweep(ctx, sweepBatch)
				total += n
				if err != nil {
					if ctx.Err() == nil {
						log.Warn("sweep expired records", "err", err)
					}
					break
				}
				if n < sweepBatch {
					break
				}
			}
			if total > 0 {
				log.Info("swept expired records", "deleted", total)
			}
		}
	})
	return func() {
		cancel()
		wg.Wait()
	}
}

// proxyMetrics returns the registry the admin listener serves on /metrics
// (dedupprom's metrics, with the Go runtime's and the process's) and the
// observer that counts each keyed request by outcome class and status.
func proxyMetrics() (*prometheus.Registry, func(*http.Request, deduphttp.Event), error) {
	m, err := dedupprom.New()
	if err != nil {
		return nil, nil, err
	}
	reg := prometheus.NewRegistry()
	if err := reg.Register(m); err != nil {
		return nil, nil, err
	}
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg, m.HTTPObserver("proxy"), nil
}
