package main

import (
	"context"
	"errors"
	"io"
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
// until the returned stop is called (which waits for it). Each pass is
// reported to hook (the /metrics registry's sweep series) as a
// [dedup.SweepEvent] named after the store.
func startProxySweeper(sw dedup.Sweeper, interval time.Duration, log *slog.Logger, store string, hook dedup.SweepHook) (stop func()) {
	hooks := dedup.NewHooks(hook)
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
			total, batches, start := 0, 0, time.Now()
			var passErr error
			for ctx.Err() == nil {
				n, err := sw.Sweep(ctx, sweepBatch)
				total += n
				batches++
				if err != nil {
					if ctx.Err() == nil {
						passErr = err
						log.Warn("sweep expired records", "err", err)
					}
					break
				}
				if n < sweepBatch {
					break
				}
			}
			if batches > 0 && (passErr != nil || ctx.Err() == nil) {
				hooks.Swept(ctx, dedup.SweepEvent{Store: store, Deleted: int64(total), Batches: batches,
					Duration: time.Since(start), Err: passErr})
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
// observer that counts each keyed request by outcome class and status,
// and the hook that counts the background sweeper's passes.
func proxyMetrics() (*prometheus.Registry, func(*http.Request, deduphttp.Event), dedup.SweepHook, error) {
	m, err := dedupprom.New()
	if err != nil {
		return nil, nil, nil, err
	}
	reg := prometheus.NewRegistry()
	if err := reg.Register(m); err != nil {
		return nil, nil, nil, err
	}
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg, m.HTTPObserver("proxy"), m, nil
}

// logBuffer batches the proxy's log lines: one write per request line
// would add a system call to every request (a plain reverse proxy logs
// nothing), so lines are collected and written when logFlushBytes have
// gathered, every logFlushInterval, and at Close. A line is at most
// logFlushInterval late; a process killed with SIGKILL loses at most
// that much of its log.
type logBuffer struct {
	mu     sync.Mutex
	out    io.Writer
	buf    []byte
	err    error
	closed bool // after Close, lines are written at once
	stop   chan struct{}
	done   chan struct{}
}

const (
	logFlushBytes    = 32 << 10
	logFlushInterval = 100 * time.Millisecond
)

func newLogBuffer(out io.Writer) *logBuffer {
	b := &logBuffer{out: out, buf: make([]byte, 0, 2*logFlushBytes), stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(b.done)
		t := time.NewTicker(logFlushInterval)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				b.Flush()
			case <-b.stop:
				b.Flush()
				return
			}
		}
	}()
	return b
}

// Write queues p (one log record, as slog writes it).
func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if b.closed || len(b.buf) >= logFlushBytes {
		b.flushLocked()
	}
	return len(p), nil
}

// Flush writes what is queued.
func (b *logBuffer) Flush() {
	b.mu.Lock()
	b.flushLocked()
	b.mu.Unlock()
}

func (b *logBuffer) flushLocked() {
	if len(b.buf) == 0 {
		return
	}
	if _, err := b.out.Write(b.buf); err != nil && b.err == nil {
		b.err = err // a broken stderr: nothing else to tell it to
	}
	if cap(b.buf) > 4*logFlushBytes {
		b.buf = make([]byte, 0, 2*logFlushBytes)
	} else {
		b.buf = b.buf[:0]
	}
}

// Close writes what is queued and stops the flusher; later writes are
// written at once.
func (b *logBuffer) Close() {
	select {
	case <-b.stop:
	default:
		close(b.stop)
	}
	<-b.done
	b.mu.Lock()
	b.closed = true
	b.flushLocked()
	b.mu.Unlock()
}

// proxyBuffer is the size of the buffers the reverse proxy copies
// response bodies through, as httputil allocates per response when no
// pool is set.
const proxyBuffer = 32 << 10

// bufferPool is a httputil.BufferPool that hands out fixed-size arrays,
// so that neither Get nor Put allocates.
type bufferPool struct{ p sync.Pool }

func newBufferPool() *bufferPool {
	return &bufferPool{p: sync.Pool{New: func() any { return new([proxyBuffer]byte) }}}
}

func (p *bufferPool) Get() []byte { return p.p.Get().(*[proxyBuffer]byte)[:] }

func (p *bufferPool) Put(b []byte) {
	if cap(b) >= proxyBuffer {
		p.p.Put((*[proxyBuffer]byte)(b[:proxyBuffer]))
	}
}
