package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/redis/rueidis"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/deduphttp"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/redisstore"
	"github.com/dedupkit/dedup/sqlitestore"
)

const proxyAbout = `Usage: dedup proxy --upstream URL [flags]

An idempotency reverse proxy: it puts the Idempotency-Key semantics of the
deduphttp middleware in front of any HTTP service. A POST, PUT, PATCH or
DELETE with an Idempotency-Key header is forwarded once per (tenant,
method, path, key); a retry gets the stored response replayed with
Idempotent-Replayed: true, a reuse of the key with another body is a 422,
a retry while the first is still running is a 409 with Retry-After, and an
unreachable store is a 503 (nothing is forwarded). Upstream 5xx responses,
upstream errors and timeouts (502, 504) are not stored: a retry is
forwarded again. GET, HEAD, OPTIONS and TRACE pass through untouched.
Stored responses are replayed for --retention, announced on each stored
response in Idempotency-Key-Expires.

With --tenant-header every key is scoped by that header's value (set it in
a trusted gateway: a client could otherwise pose as another tenant), and a
keyed request without it gets 400.

SIGINT or SIGTERM stops accepting connections and waits up to
--shutdown-timeout for requests in flight.

Flags:
`

// proxyFlags are the flags of `dedup proxy`.
type proxyFlags struct {
	upstream        string
	listen          string
	store           string
	path            string
	addr            string
	tenantHeader    string
	requireKey      bool
	retention       time.Duration
	lease           time.Duration
	wait            time.Duration
	upstreamTimeout time.Duration
	shutdownTimeout time.Duration
	maxBody         int64
	maxStoredBody   int

	upstreamURL *url.URL
}

var proxyStores = []string{"memory", "sqlite", "redis", "postgres"}

func newProxyFlagSet(f *proxyFlags) *flag.FlagSet {
	fs := flag.NewFlagSet("dedup proxy", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&f.upstream, "upstream", "", "`URL` of the service to forward to, e.g. http://127.0.0.1:8000 (required)")
	fs.StringVar(&f.listen, "listen", "127.0.0.1:8080", "`address` to listen on, host:port")
	fs.StringVar(&f.store, "store", "memory", "where keys are kept: "+strings.Join(proxyStores, ", ")+" (memory forgets them on restart)")
	fs.StringVar(&f.path, "path", "", "SQLite database `file` for --store sqlite (required with it)")
	fs.StringVar(&f.addr, "addr", "", "server `address` for --store redis (host:port, comma-separated for a cluster; default: $DEDUP_REDIS_ADDR or 127.0.0.1:6379) or --store postgres (a connection string; default: $DEDUP_POSTGRES_URL or "+defaultPostgresURL+"; run 'dedup migrate' first)")
	fs.StringVar(&f.tenantHeader, "tenant-header", "", "request `header` naming the tenant that scopes keys (e.g. X-Tenant); empty: one tenant")
	fs.BoolVar(&f.requireKey, "require-key", false, "answer 400 to a POST, PUT, PATCH or DELETE without an Idempotency-Key (default: forward it without deduplication)")
	fs.DurationVar(&f.retention, "retention", 24*time.Hour, "how long a stored response is replayed")
	fs.DurationVar(&f.lease, "lease", 30*time.Second, "how long the first request owns its key; must exceed --upstream-timeout")
	fs.DurationVar(&f.wait, "wait", 0, "a retry of a request still running waits up to this long for its response instead of getting 409 at once")
	fs.DurationVar(&f.upstreamTimeout, "upstream-timeout", 25*time.Second, "bound on waiting for the upstream's response headers (then 504, not stored)")
	fs.DurationVar(&f.shutdownTimeout, "shutdown-timeout", 10*time.Second, "on SIGINT or SIGTERM, how long to wait for requests in flight")
	fs.Int64Var(&f.maxBody, "max-body", 1<<20, "largest keyed request body in `bytes` (larger: 413)")
	fs.IntVar(&f.maxStoredBody, "max-stored-body", 1<<20, "largest response body in `bytes` stored for replay (larger: sent but not stored)")
	return fs
}

// parseProxy parses and checks the flags of `dedup proxy`.
func parseProxy(args []string, stdout io.Writer) (proxyFlags, error) {
	var f proxyFlags
	fs := newProxyFlagSet(&f)
	if err := parseCommand(fs, args, proxyAbout, stdout); err != nil {
		return f, err
	}
	return f, f.check()
}

func (f *proxyFlags) check() error {
	if f.upstream == "" {
		return badUsage("--upstream is required: the URL of the service to forward to")
	}
	u, err := url.Parse(f.upstream)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return badUsage("--upstream must be an http:// or https:// URL with a host, got %q", f.upstream)
	}
	f.upstreamURL = u
	if _, _, err := net.SplitHostPort(f.listen); err != nil {
		return badUsage("--listen must be host:port, got %q", f.listen)
	}
	switch f.store {
	case "memory", "sqlite", "redis", "postgres":
	default:
		return badUsage("--store must be one of %s, got %q", strings.Join(proxyStores, ", "), f.store)
	}
	if f.store == "sqlite" && f.path == "" {
		return badUsage("--store sqlite needs --path, the database file")
	}
	if f.path != "" && f.store != "sqlite" {
		return badUsage("--path applies only to --store sqlite, not to --store %s", f.store)
	}
	if f.addr != "" && f.store != "redis" && f.store != "postgres" {
		return badUsage("--addr applies only to a store on a server (redis, postgres), not to --store %s", f.store)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"--retention", f.retention}, {"--lease", f.lease}, {"--upstream-timeout", f.upstreamTimeout}, {"--shutdown-timeout", f.shutdownTimeout}} {
		if d.v <= 0 {
			return badUsage("%s must be positive, got %v", d.name, d.v)
		}
	}
	if f.wait < 0 {
		return badUsage("--wait must not be negative, got %v", f.wait)
	}
	if f.upstreamTimeout >= f.lease {
		return badUsage("--upstream-timeout (%v) must be shorter than --lease (%v), or a retry could be forwarded while the first request still runs", f.upstreamTimeout, f.lease)
	}
	if f.maxBody <= 0 {
		return badUsage("--max-body must be positive, got %d", f.maxBody)
	}
	if f.maxStoredBody <= 0 {
		return badUsage("--max-stored-body must be positive, got %d", f.maxStoredBody)
	}
	return nil
}

// openStore opens the store the flags name.
func (f *proxyFlags) openStore(ctx context.Context) (dedup.Store, error) {
	return openStore(ctx, f.store, f.path, f.addr)
}

// openStore opens a store by kind (memory, sqlite, redis, postgres) at
// path (sqlite) or addr (redis, postgres; "" for the environment's or the
// loopback default). A PostgreSQL store must have its schema.
func openStore(ctx context.Context, kind, path, addr string) (dedup.Store, error) {
	switch kind {
	case "sqlite":
		return sqlitestore.Open(path)
	case "redis":
		if addr == "" {
			addr = os.Getenv("DEDUP_REDIS_ADDR")
		}
		if addr == "" {
			addr = "127.0.0.1:6379"
		}
		s, err := redisstore.Open(rueidis.ClientOption{InitAddress: strings.Split(addr, ",")})
		if err != nil {
			return nil, fmt.Errorf("%w\nSet --addr or DEDUP_REDIS_ADDR to the server's host:port", err)
		}
		return s, nil
	case "postgres":
		pf := pgFlags{addr: addr, schema: "public", prefix: "dedup_"}
		s, err := pf.open(ctx)
		if err != nil {
			return nil, err
		}
		// Refuse to start on a database without the schema (every call
		// would fail), and log retention shorter than a replay horizon.
		if _, err := s.Check(ctx); err != nil {
			s.Close()
			return nil, err
		}
		return s, nil
	}
	return memstore.New()
}

// newProxyHandler returns the idempotent reverse proxy to f's upstream on
// store.
func newProxyHandler(f *proxyFlags, store dedup.Store, log *slog.Logger) (http.Handler, error) {
	target := f.upstreamURL
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConns = 1024
	tr.MaxIdleConnsPerHost = 1024
	tr.ResponseHeaderTimeout = f.upstreamTimeout
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.SetXForwarded()
		},
		Transport: tr,
		ErrorLog:  slog.NewLogLogger(log.Handler(), slog.LevelWarn),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			status, title := http.StatusBadGateway, "The upstream service could not be reached."
			var ne net.Error
			if errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()) {
				status, title = http.StatusGatewayTimeout, "The upstream service did not answer in time."
			}
			if r.Context().Err() == nil {
				log.Warn("upstream error", "method", r.Method, "path", r.URL.Path, "err", err)
			}
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(status)
			fmt.Fprintf(w, `{"type":"about:blank","title":%q,"status":%d,"detail":%q,"code":"upstream_unavailable"}`+"\n",
				http.StatusText(status), status, title+" The request may be retried with the same key.")
		},
	}
	opts := []deduphttp.Option{
		deduphttp.WithKeyRequired(f.requireKey),
		deduphttp.WithLease(f.lease),
		deduphttp.WithRetention(f.retention),
		deduphttp.WithWait(f.wait),
		deduphttp.WithMaxBody(f.maxBody),
		deduphttp.WithMaxStoredBody(f.maxStoredBody),
		deduphttp.WithErrorLog(func(r *http.Request, err error) {
			log.Error("idempotency store", "method", r.Method, "path", r.URL.Path, "err", err)
		}),
	}
	if f.tenantHeader != "" {
		opts = append(opts, deduphttp.WithTenant(deduphttp.TenantHeader(f.tenantHeader)), deduphttp.WithMissingTenantStatus(http.StatusBadRequest))
	}
	m, err := deduphttp.New(store, opts...)
	if err != nil {
		return nil, err
	}
	return m.Handler(rp), nil
}

func runProxy(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return serveProxy(ctx, args, stdout, stderr, nil)
}

// serveProxy runs the proxy until ctx is done, then shuts it down
// gracefully. ready, if not nil, is called with the address listened on.
func serveProxy(ctx context.Context, args []string, stdout, stderr io.Writer, ready func(addr string)) int {
	f, err := parseProxy(args, stdout)
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "dedup proxy: %v\nRun 'dedup proxy -h' for the flags.\n", err)
		return exitUsage
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	openCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	store, err := f.openStore(openCtx)
	cancel()
	if err != nil {
		fmt.Fprintf(stderr, "dedup proxy: open the %s store: %v\n", f.store, err)
		return exitFail
	}
	defer func() {
		if err := store.Close(); err != nil {
			fmt.Fprintf(stderr, "dedup proxy: close the %s store: %v\n", f.store, err)
		}
	}()
	h, err := newProxyHandler(&f, store, log)
	if err != nil {
		fmt.Fprintf(stderr, "dedup proxy: %v\n", err)
		return exitUsage
	}
	ln, err := net.Listen("tcp", f.listen)
	if err != nil {
		fmt.Fprintf(stderr, "dedup proxy: listen on %s: %v\n", f.listen, err)
		return exitFail
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	log.Info("dedup proxy listening", "addr", ln.Addr().String(), "upstream", f.upstream, "store", f.store, "retention", f.retention)
	if ready != nil {
		ready(ln.Addr().String())
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	select {
	case err := <-served:
		fmt.Fprintf(stderr, "dedup proxy: %v\n", err)
		return exitFail
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), f.shutdownTimeout)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		fmt.Fprintf(stderr, "dedup proxy: shutdown: %v\n", err)
		srv.Close()
		<-served
		return exitFail
	}
	<-served
	log.Info("dedup proxy stopped")
	return exitOK
}
