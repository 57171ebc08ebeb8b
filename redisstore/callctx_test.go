package redisstore

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/redis/rueidis"
)

// replyGate is a TCP proxy in front of a Redis server that passes every
// request on at once and can hold the replies: from the client's side the
// server has run the command and gone silent. seen holds every byte the
// client sent, so a test knows when a call is on the wire.
//
// A client behind it must use one connection (PipelineMultiplex -1) made
// before the replies are held: a connection dialled while they are held
// never finishes its handshake.
type replyGate struct {
	ln     net.Listener
	target string

	mu    sync.Mutex
	cond  *sync.Cond
	held  bool
	seen  bytes.Buffer
	conns []net.Conn
}

// gatedStore starts a private Redis behind a reply gate and opens a store
// on it (one connection), closed at the end of the test.
func gatedStore(t *testing.T) (*testenv.RedisServer, *replyGate, *Store) {
	t.Helper()
	srv := testenv.StartRedis(t, "")
	g := startReplyGate(t, srv.Addrs()[0])
	s, err := Open(rueidis.ClientOption{InitAddress: g.addr(), PipelineMultiplex: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return srv, g, s
}

func startReplyGate(t *testing.T, target string) *replyGate {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := &replyGate{ln: ln, target: target}
	g.cond = sync.NewCond(&g.mu)
	go g.accept()
	t.Cleanup(g.close)
	return g
}

func (g *replyGate) addr() []string { return []string{g.ln.Addr().String()} }

func (g *replyGate) accept() {
	for {
		c, err := g.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", g.target)
		if err != nil {
			c.Close()
			continue
		}
		g.mu.Lock()
		g.conns = append(g.conns, c, s)
		g.mu.Unlock()
		go func() { // requests: passed on at once, and recorded
			buf := make([]byte, 32<<10)
			for {
				n, err := c.Read(buf)
				if n > 0 {
					g.mu.Lock()
					g.seen.Write(buf[:n])
					g.mu.Unlock()
					if _, err := s.Write(buf[:n]); err != nil {
						return
					}
				}
				if err != nil {
					s.Close()
					return
				}
			}
		}()
		go func() { // replies: held while the gate is shut
			buf := make([]byte, 32<<10)
			for {
				n, err := s.Read(buf)
				if n > 0 {
					g.mu.Lock()
					for g.held {
						g.cond.Wait()
					}
					g.mu.Unlock()
					if _, err := c.Write(buf[:n]); err != nil {
						return
					}
				}
				if err != nil {
					c.Close()
					return
				}
			}
		}()
	}
}

// hold keeps every reply from now on until open.
func (g *replyGate) hold() {
	g.mu.Lock()
	g.held = true
	g.mu.Unlock()
}

func (g *replyGate) open() {
	g.mu.Lock()
	g.held = false
	g.cond.Broadcast()
	g.mu.Unlock()
}

// sent reports whether the client has sent s since the last reset.
func (g *replyGate) sent(s string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return strings.Contains(g.seen.String(), s)
}

func (g *replyGate) reset() {
	g.mu.Lock()
	g.seen.Reset()
	g.mu.Unlock()
}

func (g *replyGate) close() {
	g.open()
	g.ln.Close()
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, c := range g.conns {
		c.Close()
	}
}

// commandCalls is the number of calls the server counted (INFO
// commandstats) for cmd ("set", "evalsha", ...).
func commandCalls(t *testing.T, srv *testenv.RedisServer, cmd string) int {
	t.Helper()
	for line := range strings.SplitSeq(srv.CLI("info", "commandstats"), "\n") {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_"+cmd+":calls="); ok {
			n, err := strconv.Atoi(rest[:strings.IndexByte(rest, ',')])
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	return 0
}

// TestCallCancelledBeforeIsNotSent: a caller whose context has ended
// before a call gets a not-applied store error wrapping its context's,
// and nothing reaches the server, for every call of the store.
func TestCallCancelledBeforeIsNotSent(t *testing.T) {
	srv := testenv.StartRedis(t, "")
	s, err := Open(rueidis.ClientOption{InitAddress: srv.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	c := claimOne(t, s, "before")
	calls := func() int {
		return commandCalls(t, srv, "set") + commandCalls(t, srv, "evalsha") + commandCalls(t, srv, "eval") + commandCalls(t, srv, "ping")
	}
	before := calls()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	fp := dedup.FingerprintOf([]byte("p"))
	ops := map[string]func() error{
		"claim": func() error {
			_, err := s.Claim(ctx, dedup.Key{Scope: "rev1", ID: "other"}, fp, time.Minute)
			return err
		},
		"claim batch": func() error {
			_, err := s.ClaimBatch(ctx, []dedup.ClaimRequest{{Key: dedup.Key{Scope: "rev1", ID: "other"}}}, time.Minute)
			return err
		},
		"complete": func() error { return s.Complete(ctx, c, []byte("r"), time.Hour) },
		"complete batch": func() error {
			_, err := s.CompleteBatch(ctx, []dedup.Completion{{Claim: c}}, time.Hour)
			return err
		},
		"release": func() error { return s.Release(ctx, c) },
		"extend":  func() error { _, err := s.Extend(ctx, c, time.Minute); return err },
		"ping":    func() error { return s.Ping(ctx) },
	}
	for name, op := range ops {
		err := op()
		var se *dedup.StoreError
		if !errors.As(err, &se) || !se.NotApplied || !errors.Is(err, context.Canceled) {
			t.Errorf("%s on a cancelled context: %v, want a not-applied store error wrapping context.Canceled", name, err)
		}
	}
	if after := calls(); after != before {
		t.Fatalf("the server counted %d calls from callers cancelled before them", after-before)
	}
	if d, err := s.Claim(context.Background(), c.Key, fp, time.Minute); err != nil || d.Outcome != dedup.InProgress {
		t.Fatalf("claimed key after the cancelled calls: %v %v, want still in progress", d.Outcome, err)
	}
}

// TestClaimCancelledMidCallKeepsItsOutcome: a caller cancelled (without a
// deadline) after its claim went out gets the claim the server made,
// acquired with its token, rather than an error that leaves the key held
// by nobody until the lease ends; the claim can then be completed (or
// released) as usual. Before, the cancellation ended the wait: a store
// error, the key in progress under a token nobody had.
func TestClaimCancelledMidCallKeepsItsOutcome(t *testing.T) {
	_, g, s := gatedStore(t)
	bg := context.Background()
	if err := s.Ping(bg); err != nil {
		t.Fatal(err)
	}
	key := dedup.Key{Scope: "mid", ID: "claim"}
	fp := dedup.FingerprintOf([]byte("p"))
	g.hold()
	ctx, cancel := context.WithCancel(bg)
	type res struct {
		c   dedup.Claim
		err error
	}
	out := make(chan res, 1)
	go func() {
		c, err := s.Claim(ctx, key, fp, time.Minute)
		out <- res{c, err}
	}()
	waitFor(t, "the claim to be sent", func() bool { return g.sent(s.RedisKey(key)) })
	cancel()
	g.open()
	r := <-out
	if r.err != nil || r.c.Outcome != dedup.Acquired {
		t.Fatalf("claim cancelled after it was sent: %v %v, want the server's outcome (acquired)", r.c.Outcome, r.err)
	}
	if err := s.Complete(bg, r.c, []byte("done"), time.Hour); err != nil {
		t.Fatalf("completing the claim a cancelled caller got: %v", err)
	}
	if d, err := s.Claim(bg, key, fp, time.Minute); err != nil || d.Outcome != dedup.Duplicate || string(d.Result) != "done" {
		t.Fatalf("after: %v %q %v, want a duplicate with the result", d.Outcome, d.Result, err)
	}
}

// TestCompleteCancelledMidCallKnowsItsOutcome: a lone completion whose
// caller is cancelled (without a deadline) after it went out waits for
// the reply and reports the completion done, not an unknown outcome.
func TestCompleteCancelledMidCallKnowsItsOutcome(t *testing.T) {
	_, g, s := gatedStore(t)
	bg := context.Background()
	if err := s.client.Do(bg, s.client.B().ScriptLoad().Script(completeOneScript).Build()).Error(); err != nil {
		t.Fatal(err)
	}
	c := claimOne(t, s, "mid-complete")
	g.hold()
	g.reset()
	ctx, cancel := context.WithCancel(bg)
	errc := make(chan error, 1)
	go func() { errc <- s.Complete(ctx, c, []byte("r"), time.Hour) }()
	waitFor(t, "the completion to be sent", func() bool { return g.sent(s.RedisKey(c.Key)) })
	cancel()
	g.open()
	if err := <-errc; err != nil {
		t.Fatalf("completion cancelled after it was sent: %v, want the server's answer (done)", err)
	}
	if d, err := s.Claim(bg, c.Key, dedup.FingerprintOf([]byte("p")), time.Minute); err != nil || d.Outcome != dedup.Duplicate || string(d.Result) != "r" {
		t.Fatalf("after: %v %q %v, want a duplicate with the result", d.Outcome, d.Result, err)
	}
}

// TestCallOnFrozenServerEndsAtConnWriteTimeout: on a server that stopped
// answering (SIGSTOP), a claim and a lone completion whose callers have
// no deadline, one of them cancelled while it waits, end with the
// client's ConnWriteTimeout (set short here): a store error wrapping the
// timeout, not a not-applied one (the call went out) and not the caller's
// cancellation, which no longer ends a call that was sent. The claim that
// went out holds its key once the server runs it: nobody gets it before
// the lease ends.
func TestCallOnFrozenServerEndsAtConnWriteTimeout(t *testing.T) {
	srv := testenv.StartRedis(t, "")
	// The gate only shows when a call is on the wire; it holds nothing.
	g := startReplyGate(t, srv.Addrs()[0])
	bg := context.Background()
	// Two stores, each on one connection made before the server froze (a
	// timed-out call closes its connection, and a new one cannot finish
	// its handshake with a frozen server).
	open := func() *Store {
		s, err := Open(rueidis.ClientOption{InitAddress: g.addr(), PipelineMultiplex: -1, ConnWriteTimeout: 300 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		if err := s.client.Do(bg, s.client.B().ScriptLoad().Script(completeOneScript).Build()).Error(); err != nil {
			t.Fatal(err)
		}
		return s
	}
	s1, s2 := open(), open()
	c := claimOne(t, s2, "frozen-complete")
	fp := dedup.FingerprintOf([]byte("p"))
	key := dedup.Key{Scope: "rev1", ID: "frozen-claim"}
	g.reset()
	srv.Freeze()
	thawed := false
	defer func() {
		if !thawed {
			srv.Thaw()
		}
	}()
	check := func(what string, err error) {
		t.Helper()
		var se *dedup.StoreError
		switch {
		case !errors.As(err, &se):
			t.Fatalf("%s on a frozen server: %v, want a store error", what, err)
		case se.NotApplied:
			t.Fatalf("%s on a frozen server reported not applied: %v", what, err)
		case errors.Is(err, context.Canceled):
			t.Fatalf("%s on a frozen server ended by the cancellation: %v, want the call's bound", what, err)
		case !errors.Is(err, os.ErrDeadlineExceeded) && !errors.Is(err, context.DeadlineExceeded):
			// The client's ConnWriteTimeout, or the store's call bound
			// (the same length for a store from Open), whichever fires
			// first.
			t.Fatalf("%s on a frozen server: %v, want the client's timeout or the store's call bound", what, err)
		}
	}
	ctx, cancel := context.WithCancel(bg)
	defer cancel()
	_, err := s1.Claim(ctx, key, fp, time.Minute)
	check("claim", err)

	// A lone completion, its caller cancelled while it waits: the
	// cancellation does not end it, the timeout does.
	cctx, ccancel := context.WithCancel(bg)
	errc := make(chan error, 1)
	go func() { errc <- s2.Complete(cctx, c, []byte("r"), time.Hour) }()
	waitFor(t, "the completion to be sent", func() bool { return g.sent(s2.RedisKey(c.Key)) })
	ccancel()
	err = <-errc
	check("cancelled lone completion", err)
	if n := flushesInFlight(s2); n != 0 {
		t.Fatalf("%d flush slots held after the lone completion returned", n)
	}

	srv.Thaw()
	thawed = true
	var d dedup.Claim
	for range 50 { // the client reconnects
		if d, err = s1.Claim(bg, key, fp, time.Minute); err == nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		t.Fatal(err)
	}
	// In progress: the claim ran when the server woke and its lease holds
	// the key; acquired: the server dropped it with the connection the
	// client closed at its timeout. Never a duplicate or a mismatch.
	if d.Outcome != dedup.InProgress && d.Outcome != dedup.Acquired {
		t.Fatalf("key of a claim that went out before the server froze: %v", d.Outcome)
	}
	t.Logf("after the timed-out claim the key was %v", d.Outcome)
	if d, err = s1.Claim(bg, c.Key, fp, time.Minute); err != nil {
		t.Fatal(err)
	}
	if d.Outcome != dedup.InProgress && (d.Outcome != dedup.Duplicate || string(d.Result) != "r") {
		t.Fatalf("record after a completion that timed out: %v %q", d.Outcome, d.Result)
	}
}
