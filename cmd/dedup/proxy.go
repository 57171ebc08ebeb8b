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
	"strconv"
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

const proxyAbout = `Usage: dedup proxy --upstream URL (--tenant-header NAME | --single-tenant) [flags]

An idempotency reverse proxy: it puts the Idempotency-Key semantics of the
deduphttp middleware in front of any HTTP service. A POST, PUT, PATCH or
DELETE with an Idempotency-Key header is forwarded once per (tenant,
principal, method, path, key); a retry gets the stored response replayed
with Idempotent-Replayed: true, a reuse of the key with another body is a
422, a retry while the first is still running (or while its outcome is
unknown) is a 409 with Retry-After (the seconds left on its lease), and an
unreachable store is a 503 (nothing is forwarded). GET, HEAD, OPTIONS and
TRACE pass through untouched.

What happens to a key follows the outcome of the call:
  never started  the upstream could not be dialled: 502, the key is released
  finished       the upstream answered: stored and replayed for --retention
                 (announced in Idempotency-Key-Expires), except 5xx and the
                 temporary refusals of --no-store-status, which release it
  unknown        the call was sent but timed out (504) or broke: the key stays
                 claimed until --lease ends, so a retry cannot run it twice;
                 --store-errors stores the 504 as the final answer instead
The upstream call is detached from the client: a client that hangs up does
not cancel it, and its response is stored for the client's retry. It ends
--upstream-timeout after the key was claimed, which must be shorter than
--lease.

Keys are bound to the caller: --tenant-header scopes every key by that
header (set it in a trusted gateway: a client could otherwise pose as
another tenant; a keyed request without it is 400, with it twice or named
in Connection is 400), and --principal-header also mixes in the SHA-256
of a header such as Authorization, so another user of the same tenant
cannot replay your response. Without --tenant-header the proxy refuses to
start unless --single-tenant says that only one client can reach it.

SIGINT or SIGTERM stops accepting connections and waits up to
--shutdown-timeout (default: --upstream-timeout plus 10s) for requests in
flight; a call still running then is abandoned, never released.

Every flag can also be set in the environment as DEDUP_PROXY_<FLAG>, e.g.
DEDUP_PROXY_TENANT_HEADER=X-Tenant; a flag on the command line wins.

Flags:
`

// proxyFlags are the flags of `dedup proxy`.
type proxyFlags struct {
	upstream        string
	listen          string
	adminListen     string
	store           string
	path            string
	addr            string
	tenantHeader    string
	singleTenant    bool
	principalHeader string
	requireKey      bool
	noStoreStatus   string
	storeErrors     bool
	retention       time.Duration
	lease           time.Duration
	wait            time.Duration
	upstreamTimeout time.Duration
	shutdownTimeout time.Duration
	readTimeout     time.Duration
	writeTimeout    time.Duration
	idleTimeout     time.Duration
	sweepInterval   time.Duration
	maxBody         int64
	maxStoredBody   int
	memoryRecords   int
	memoryBytes     int64
	logFormat       string

	upstreamURL *url.URL
	notStored   map[int]bool
}

var proxyStores = []string{"memory", "sqlite", "redis", "postgres"}

// finalizeMargin is what the proxy adds to --upstream-timeout for storing
// the response, in the default --shutdown-timeout and --write-timeout.
const finalizeMargin = 10 * time.Second

func newProxyFlagSet(f *proxyFlags) *flag.FlagSet {
	fs := flag.NewFlagSet("dedup proxy", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&f.upstream, "upstream", "", "`URL` of the service to forward to, e.g. http://127.0.0.1:8000 (required)")
	fs.StringVar(&f.listen, "listen", "127.0.0.1:8080", "`address` to listen on, host:port")
	fs.StringVar(&f.adminListen, "admin-listen", "", "`address` of a separate listener for /healthz (the process runs) and /readyz (the store answers); never forwarded. Empty: none")
	fs.StringVar(&f.store, "store", "memory", "where keys are kept: "+strings.Join(proxyStores, ", ")+" (memory forgets them on restart, and refuses new keys with 503 when full rather than evict a live one)")
	fs.StringVar(&f.path, "path", "", "SQLite database `file` for --store sqlite (required with it)")
	fs.StringVar(&f.addr, "addr", "", "server `address` for --store redis (host:port, comma-separated for a cluster; default: $DEDUP_REDIS_ADDR or 127.0.0.1:6379) or --store postgres (a connection string; default: $DEDUP_POSTGRES_URL or "+defaultPostgresURL+"; run 'dedup migrate' first)")
	fs.StringVar(&f.tenantHeader, "tenant-header", "", "request `header` naming the tenant that scopes keys (e.g. X-Tenant); required unless --single-tenant")
	fs.BoolVar(&f.singleTenant, "single-tenant", false, "run without --tenant-header: every caller shares one key space, so any caller who sends a key gets the response stored under it")
	fs.StringVar(&f.principalHeader, "principal-header", "", "request `header` whose SHA-256 is mixed into the key scope (e.g. Authorization), so only the same credential replays a response; a keyed request without it gets 400")
	fs.BoolVar(&f.requireKey, "require-key", false, "answer 400 to a POST, PUT, PATCH or DELETE without an Idempotency-Key (default: forward it without deduplication)")
	fs.StringVar(&f.noStoreStatus, "no-store-status", "401,403,408,409,423,425,429", "comma-separated 4xx `statuses` not stored (the key is released for a retry); 'none' stores every 4xx")
	fs.BoolVar(&f.storeErrors, "store-errors", false, "store upstream 5xx answers and the 504 of an unknown outcome as the final answer, as Stripe stores 500s (default: 5xx releases the key, an unknown outcome holds it until --lease ends)")
	fs.DurationVar(&f.retention, "retention", 24*time.Hour, "how long a stored response is replayed")
	fs.DurationVar(&f.lease, "lease", 30*time.Second, "how long the first request owns its key; must exceed --upstream-timeout")
	fs.DurationVar(&f.wait, "wait", 0, "a retry of a request still running waits up to this long for its response instead of getting 409 at once")
	fs.DurationVar(&f.upstreamTimeout, "upstream-timeout", 25*time.Second, "deadline of the whole upstream exchange, from the key's claim to the last byte of the response (then 504, outcome unknown)")
	fs.DurationVar(&f.shutdownTimeout, "shutdown-timeout", 0, "on SIGINT or SIGTERM, how long to wait for requests in flight (default: --upstream-timeout plus 10s)")
	fs.DurationVar(&f.readTimeout, "read-timeout", 30*time.Second, "bound on reading a request, headers and body")
	fs.DurationVar(&f.writeTimeout, "write-timeout", 0, "bound on a request's whole exchange with the client (default: --read-timeout plus --upstream-timeout plus 10s)")
	fs.DurationVar(&f.idleTimeout, "idle-timeout", 60*time.Second, "how long an idle keep-alive connection stays open")
	fs.DurationVar(&f.sweepInterval, "sweep-interval", time.Minute, "how often expired records are deleted from a store that can sweep (sqlite, postgres, memory); 0: never")
	fs.Int64Var(&f.maxBody, "max-body", 1<<20, "largest keyed request body in `bytes` (larger: 413); at most 64 MiB")
	fs.IntVar(&f.maxStoredBody, "max-stored-body", 1<<20, "largest response body in `bytes` stored for replay (larger: sent, not stored, and the key is held until --lease ends)")
	fs.IntVar(&f.memoryRecords, "memory-records", 1_000_000, "with --store memory: most `records` kept")
	fs.Int64Var(&f.memoryBytes, "memory-bytes", 1<<30, "with --store memory: most `bytes` the records take (keys, fingerprints, stored responses)")
	fs.StringVar(&f.logFormat, "log-format", "text", "log lines as text or json")
	return fs
}

// proxyEnvPrefix prefixes the environment variables that set proxy flags.
const proxyEnvPrefix = "DEDUP_PROXY_"

// parseProxy parses and checks the flags of `dedup proxy`, after taking
// defaults from the environment.
func parseProxy(args []string, stdout io.Writer) (proxyFlags, error) {
	var f proxyFlags
	fs := newProxyFlagSet(&f)
	var envErr error
	fs.VisitAll(func(fl *flag.Flag) {
		name := proxyEnvPrefix + strings.ToUpper(strings.ReplaceAll(fl.Name, "-", "_"))
		if v, ok := os.LookupEnv(name); ok && envErr == nil {
			if err := fs.Set(fl.Name, v); err != nil {
				envErr = badUsage("%s=%q: %v", name, v, err)
			}
		}
	})
	if envErr != nil {
		return f, envErr
	}
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
	for _, l := range []struct{ name, v string }{{"--listen", f.listen}, {"--admin-listen", f.adminListen}} {
		if l.v == "" && l.name == "--admin-listen" {
			continue
		}
		if _, _, err := net.SplitHostPort(l.v); err != nil {
			return badUsage("%s must be host:port, got %q", l.name, l.v)
		}
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
	switch {
	case f.tenantHeader == "" && !f.singleTenant:
		return badUsage("--tenant-header is required: without it any caller who sends a key is replayed the response stored under it; give --single-tenant if only one client can reach the proxy")
	case f.tenantHeader != "" && f.singleTenant:
		return badUsage("--tenant-header and --single-tenant exclude each other")
	}
	if f.shutdownTimeout == 0 {
		f.shutdownTimeout = f.upstreamTimeout + finalizeMargin
	}
	if f.writeTimeout == 0 {
		f.writeTimeout = f.readTimeout + f.upstreamTimeout + finalizeMargin
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"--retention", f.retention}, {"--lease", f.lease}, {"--upstream-timeout", f.upstreamTimeout}, {"--shutdown-timeout", f.shutdownTimeout},
		{"--read-timeout", f.readTimeout}, {"--write-timeout", f.writeTimeout}, {"--idle-timeout", f.idleTimeout}} {
		if d.v <= 0 {
			return badUsage("%s must be positive, got %v", d.name, d.v)
		}
	}
	if f.wait < 0 {
		return badUsage("--wait must not be negative, got %v", f.wait)
	}
	if f.sweepInterval < 0 {
		return badUsage("--sweep-interval must not be negative, got %v", f.sweepInterval)
	}
	if f.upstreamTimeout >= f.lease {
		return badUsage("--upstream-timeout (%v) must be shorter than --lease (%v), or a retry could be forwarded while the first request still runs", f.upstreamTimeout, f.lease)
	}
	if f.maxBody <= 0 || f.maxBody > deduphttp.MaxBodyLimit {
		return badUsage("--max-body must be between 1 and %d bytes, got %d", deduphttp.MaxBodyLimit, f.maxBody)
	}
	if f.maxStoredBody <= 0 {
		return badUsage("--max-stored-body must be positive, got %d", f.maxStoredBody)
	}
	if f.memoryRecords < 64 {
		return badUsage("--memory-records must be at least 64, got %d", f.memoryRecords)
	}
	if f.memoryRecords != 1_000_000 && f.store != "memory" {
		return badUsage("--memory-records applies only to --store memory")
	}
	if f.memoryBytes < 1<<20 {
		return badUsage("--memory-bytes must be at least 1 MiB, got %d", f.memoryBytes)
	}
	if f.logFormat != "text" && f.logFormat != "json" {
		return badUsage("--log-format must be text or json, got %q", f.logFormat)
	}
	f.notStored = map[int]bool{}
	if f.noStoreStatus != "none" && f.noStoreStatus != "" {
		for _, p := range strings.Split(f.noStoreStatus, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(p))
			if err != nil || n < 400 || n > 499 {
				return badUsage("--no-store-status must list 4xx statuses or be 'none', got %q", p)
			}
			f.notStored[n] = true
		}
	}
	return nil
}

// storeStatus is the store policy the flags describe.
func (f *proxyFlags) storeStatus(status int) bool {
	if status >= 500 {
		return f.storeErrors
	}
	return status >= 200 && !f.notStored[status]
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
// store. onDone, if not nil, gets each keyed request's event.
func newProxyHandler(f *proxyFlags, store dedup.Store, log *slog.Logger, onDone ...func(*http.Request, deduphttp.Event)) (http.Handler, error) {
	target := f.upstreamURL
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConns = 1024
	tr.MaxIdleConnsPerHost = 1024
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.SetXForwarded()
		},
		Transport:    tr,
		BufferPool:   newBufferPool(),
		ErrorLog:     slog.NewLogLogger(log.Handler(), slog.LevelWarn),
		ErrorHandler: proxyErrorHandler(log),
	}
	opts := []deduphttp.Option{
		deduphttp.WithKeyRequired(f.requireKey),
		deduphttp.WithLease(f.lease),
		deduphttp.WithRetention(f.retention),
		deduphttp.WithWait(f.wait),
		deduphttp.WithMaxBody(f.maxBody),
		deduphttp.WithMaxStoredBody(f.maxStoredBody),
		deduphttp.WithHandlerTimeout(f.upstreamTimeout),
		deduphttp.WithStorePolicy(f.storeStatus),
		deduphttp.WithErrorLog(func(r *http.Request, err error) {
			log.Error("idempotency store", "method", r.Method, "path", r.URL.Path, "err", err)
		}),
	}
	if f.storeErrors {
		opts = append(opts, deduphttp.WithStoreUnknownOutcome())
	}
	if f.tenantHeader != "" {
		opts = append(opts, deduphttp.WithTenant(deduphttp.TenantHeader(f.tenantHeader)), deduphttp.WithMissingTenantStatus(http.StatusBadRequest))
	} else {
		opts = append(opts, deduphttp.WithSingleTenant())
	}
	if f.principalHeader != "" {
		opts = append(opts, deduphttp.WithPrincipal(deduphttp.PrincipalHeader(f.principalHeader)))
	}
	if len(onDone) > 0 && onDone[0] != nil {
		opts = append(opts, deduphttp.WithOnDone(onDone[0]))
	}
	m, err := deduphttp.New(store, opts...)
	if err != nil {
		return nil, err
	}
	h := m.Handler(rp)
	if f.tenantHeader == "" && f.principalHeader == "" {
		return h, nil
	}
	// A header the scope is built from must reach the upstream as the
	// middleware saw it: a request asking the next hop to drop it (by
	// naming it in Connection) is refused, keyed or not.
	named := []string{f.tenantHeader, f.principalHeader}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for _, c := range r.Header["Connection"] {
			for tok := range strings.SplitSeq(c, ",") {
				tok = strings.TrimSpace(tok)
				for _, n := range named {
					if n != "" && strings.EqualFold(tok, n) {
						w.Header().Set("Content-Type", "application/problem+json")
						w.WriteHeader(http.StatusBadRequest)
						fmt.Fprintf(w, `{"type":"about:blank","title":"Bad Request","status":400,"detail":%q,"code":"tenant_ambiguous"}`+"\n",
							"The Connection header names "+n+", which scopes idempotency keys; it would not reach the upstream.")
						return
					}
				}
			}
		}
		h.ServeHTTP(w, r)
	}), nil
}

// proxyErrorHandler answers an upstream failure and declares its outcome
// class: a dial error never reached the upstream (released, 502); any
// other failure happened after the request may have been sent (unknown,
// 504 for a timeout, else 502), and the key is held until its lease ends.
func proxyErrorHandler(log *slog.Logger) func(http.ResponseWriter, *http.Request, error) {
	return func(w http.ResponseWriter, r *http.Request, err error) {
		status, detail := http.StatusBadGateway, "The upstream service could not be reached; nothing was sent to it. Retry with the same key."
		var oe *net.OpError
		if errors.As(err, &oe) && oe.Op == "dial" {
			deduphttp.SetOutcome(w, deduphttp.OutcomeNotStarted)
		} else {
			deduphttp.SetOutcome(w, deduphttp.OutcomeUnknown)
			var ne net.Error
			if errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()) {
				status = http.StatusGatewayTimeout
				detail = "The upstream service did not finish in time; the request was sent and its outcome is unknown. A retry with the same key gets 409 until the key's lease ends."
			} else {
				detail = "The upstream connection failed after the request was sent; its outcome is unknown. A retry with the same key gets 409 until the key's lease ends."
			}
		}
		log.Warn("upstream error", "method", r.Method, "path", r.URL.Path, "status", status, "err", err)
		w.Header().Set("Content-Type", "application/problem+json")
		w.Header().Set("Cache-Control", "no-store")
		w.WriteHeader(status)
		fmt.Fprintf(w, `{"type":"about:blank","title":%q,"status":%d,"detail":%q,"code":"upstream_unavailable"}`+"\n",
			http.StatusText(status), status, detail)
	}
}

func runProxy(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return serveProxy(ctx, args, stdout, stderr, nil)
}

// serveProxy runs the proxy until ctx is done, then shuts it down
// gracefully. ready, if not nil, is called with the address listened on
// (and, with --admin-listen, the admin address after a space).
func serveProxy(ctx context.Context, args []string, stdout, stderr io.Writer, ready func(addr string)) int {
	f, err := parseProxy(args, stdout)
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "dedup proxy: %v\nRun 'dedup proxy -h' for the flags.\n", err)
		return exitUsage
	}
	// Everything written to stderr from here on goes through one buffer,
	// in order, written out at most logFlushInterval late and at return.
	lb := newLogBuffer(stderr)
	defer lb.Close()
	stderr = lb
	var lh slog.Handler = slog.NewTextHandler(stderr, nil)
	if f.logFormat == "json" {
		lh = slog.NewJSONHandler(stderr, nil)
	}
	log := slog.New(lh)
	openCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	store, err := f.openProxyStore(openCtx)
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
	reg, observe, sweepHook, err := proxyMetrics()
	if err != nil {
		fmt.Fprintf(stderr, "dedup proxy: metrics: %v\n", err)
		return exitFail
	}
	h, err := newProxyHandler(&f, store, log, func(r *http.Request, e deduphttp.Event) {
		observe(r, e)
		log.Info("request", "method", r.Method, "path", r.URL.Path, "tenant", e.Tenant, "key_hash", e.KeyHash,
			"outcome", string(e.Class), "status", e.Status, "duration_ms", float64(e.Duration.Microseconds())/1000)
	})
	if err != nil {
		fmt.Fprintf(stderr, "dedup proxy: %v\n", err)
		return exitUsage
	}
	ln, err := net.Listen("tcp", f.listen)
	if err != nil {
		fmt.Fprintf(stderr, "dedup proxy: listen on %s: %v\n", f.listen, err)
		return exitFail
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: min(10*time.Second, f.readTimeout), ReadTimeout: f.readTimeout,
		WriteTimeout: f.writeTimeout, IdleTimeout: f.idleTimeout, ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	var admin *proxyAdmin
	readyAddr := ln.Addr().String()
	if f.adminListen != "" {
		admin, err = startProxyAdmin(f.adminListen, store, log, reg)
		if err != nil {
			ln.Close()
			fmt.Fprintf(stderr, "dedup proxy: listen on %s: %v\n", f.adminListen, err)
			return exitFail
		}
		defer admin.close()
		readyAddr += " " + admin.addr
	}
	if sw, ok := store.(dedup.Sweeper); ok && f.sweepInterval > 0 {
		stopSweep := startProxySweeper(sw, f.sweepInterval, log, f.store, sweepHook)
		defer stopSweep()
	}
	log.Info("dedup proxy listening", "addr", ln.Addr().String(), "upstream", f.upstream, "store", f.store, "retention", f.retention)
	if ready != nil {
		ready(readyAddr)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	select {
	case err := <-served:
		fmt.Fprintf(stderr, "dedup proxy: %v\n", err)
		return exitFail
	case <-ctx.Done():
	}
	log.Info("dedup proxy shutting down", "wait", f.shutdownTimeout)
	sctx, cancel := context.WithTimeout(context.Background(), f.shutdownTimeout)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		// Calls still running are abandoned, not released: their keys stay
		// claimed until their leases end.
		fmt.Fprintf(stderr, "dedup proxy: shutdown: %v; requests still in flight keep their keys until their leases end\n", err)
		srv.Close()
		<-served
		return exitFail
	}
	<-served
	log.Info("dedup proxy stopped")
	return exitOK
}
