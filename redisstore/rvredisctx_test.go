package redisstore

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/redis/rueidis"
)

// TestCompleteBatchReplicaAckOnFrozenServerEnds: with WithReplicaAck a
// batch completion goes with its WAIT on a dedicated connection. Its
// caller's context (cancellable, no deadline) is cancelled once it is on
// the wire and the store is closed, on a server that stopped answering
// (SIGSTOP). The package doc says a call ends at the first of its reply,
// the caller's deadline, the client's ConnWriteTimeout (300ms here) or
// Close of a store from Open. callCtx strips the cancellation, so rueidis
// sends the pipeline synchronously, and for a pipeline holding a blocking
// command (WAIT) it sets no connection deadline at all; Close does not
// close a dedicated connection in use either. The call then waits for the
// server, here until it is thawed, whatever the timeout and Close.
//
// The check is on what the call returned, not on how long it took: a
// call that ended by the timeout or Close returns a store error before
// the thaw; one that outlived them returns the server's answer (WAIT's
// count, a ReplicaAckError with no replica) after it.
func TestCompleteBatchReplicaAckOnFrozenServerEnds(t *testing.T) {
	srv := testenv.StartRedis(t, "")
	g := startReplyGate(t, srv.Addrs()[0])
	const cwt = 300 * time.Millisecond
	// No keep-alive PING (its interval is the Dialer's KeepAlive): a PING
	// on the frozen server would kill the warm connection before the call.
	s, err := Open(rueidis.ClientOption{InitAddress: g.addr(), PipelineMultiplex: -1, ConnWriteTimeout: cwt,
		Dialer: net.Dialer{KeepAlive: time.Hour}},
		WithReplicaAck(1, 100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	bg := context.Background()
	// Warm the dedicated connection (a new one cannot finish its
	// handshake with a frozen server) and load the script.
	w := claimOne(t, s, "rack-warm")
	if _, err := s.CompleteBatch(bg, []dedup.Completion{{Claim: w, Result: []byte("w")}}, time.Hour); err != nil {
		t.Fatal(err)
	}
	c := claimOne(t, s, "rack-frozen")
	g.reset()
	srv.Freeze()
	thawed := false
	defer func() {
		if !thawed {
			srv.Thaw()
		}
	}()
	ctx, cancel := context.WithCancel(bg)
	defer cancel()
	type res struct {
		errs []error
		err  error
	}
	var phase string
	done := make(chan res, 1)
	go func() {
		errs, err := s.CompleteBatch(ctx, []dedup.Completion{{Claim: c, Result: []byte("r")}}, time.Hour)
		done <- res{errs, err}
	}()
	waitFor(t, "the completion to be sent", func() bool {
		select {
		case r := <-done:
			t.Fatalf("returned before it was sent: %v %v", r.errs, r.err)
		default:
		}
		return g.sent(s.RedisKey(c.Key))
	})
	cancel()
	closed := make(chan struct{})
	go func() { s.Close(); close(closed) }()
	// Ten times ConnWriteTimeout, and more than rueidis's one-second
	// escape in Close: every bound the doc names has passed.
	var r res
	select {
	case r = <-done:
		phase = "before the thaw"
	case <-time.After(10 * cwt * 2):
		phase = "after the thaw"
		srv.Thaw()
		thawed = true
		r = <-done
	}
	<-closed
	t.Logf("returned %s: errs %v err %v", phase, r.errs, r.err)
	if phase == "after the thaw" {
		var ra *ReplicaAckError
		e := r.err
		if e == nil && len(r.errs) == 1 {
			e = r.errs[0]
		}
		t.Fatalf("a batch completion with WAIT, cancelled and its store closed on a frozen server, "+
			"outlived ConnWriteTimeout (%v) and Close: it returned only once the server was thawed (%v; server's WAIT answer: %v)",
			cwt, e, errors.As(e, &ra))
	}
	var e error = r.err
	if e == nil && len(r.errs) == 1 {
		e = r.errs[0]
	}
	var se *dedup.StoreError
	if e != nil && !errors.As(e, &se) && !errors.Is(e, dedup.ErrClosed) {
		t.Fatalf("completion on a frozen server: %v", e)
	}
	if se != nil && se.NotApplied {
		t.Fatalf("a completion sent reported not applied: %v", e)
	}
}

// TestLoneCompleteNoScriptCancelledMidCall: the server lost its scripts
// (SCRIPT FLUSH, as after a restart) and a lone completion's caller is
// cancelled once its EVALSHA is on the wire. The NOSCRIPT reply is not the
// completion's outcome: the store must still send the script whole (EVAL),
// on the call's context, which a cancellation no longer ends, and report
// the completion done; before callCtx the EVAL was refused by the ended
// context and the caller got an unknown outcome for a completion that had
// certainly not run.
func TestLoneCompleteNoScriptCancelledMidCall(t *testing.T) {
	srv, g, s := gatedStore(t)
	bg := context.Background()
	c := claimOne(t, s, "noscript-mid")
	srv.CLI("script", "flush")
	before := commandCalls(t, srv, "eval")
	g.hold()
	g.reset()
	ctx, cancel := context.WithCancel(bg)
	errc := make(chan error, 1)
	go func() { errc <- s.Complete(ctx, c, []byte("r"), time.Hour) }()
	waitFor(t, "the EVALSHA to be sent", func() bool { return g.sent(s.RedisKey(c.Key)) })
	cancel()
	g.open()
	if err := <-errc; err != nil {
		t.Fatalf("lone completion after SCRIPT FLUSH, cancelled after its EVALSHA went out: %v, want done", err)
	}
	if n := commandCalls(t, srv, "eval") - before; n != 1 {
		t.Fatalf("the server ran EVAL %d times, want 1 (the NOSCRIPT fallback)", n)
	}
	if d, err := s.Claim(bg, c.Key, dedup.FingerprintOf([]byte("p")), time.Minute); err != nil || d.Outcome != dedup.Duplicate || string(d.Result) != "r" {
		t.Fatalf("after: %v %q %v, want a duplicate with the result", d.Outcome, d.Result, err)
	}
	if n := flushesInFlight(s); n != 0 {
		t.Fatalf("%d flush slots held", n)
	}
}

// TestClaimTakeoverCancelledBetweenSteps: a claim of a key whose lease
// ran out needs two steps (SET NX GET finds the record, the claim script
// takes it over). The caller is cancelled while the first is on the
// wire: the second is still sent and the caller gets the take-over it
// made (acquired, attempt 2), never an error that leaves the key held by
// a token nobody has, and never not-applied.
func TestClaimTakeoverCancelledBetweenSteps(t *testing.T) {
	_, g, s := gatedStore(t)
	bg := context.Background()
	key := dedup.Key{Scope: "rev1", ID: "takeover-mid"}
	fp := dedup.FingerprintOf([]byte("p"))
	first, err := s.Claim(bg, key, fp, time.Millisecond)
	if err != nil || first.Outcome != dedup.Acquired {
		t.Fatal(first.Outcome, err)
	}
	time.Sleep(20 * time.Millisecond) // the 1ms lease runs out (setup, not a check)
	g.hold()
	g.reset()
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
	waitFor(t, "the first step to be sent", func() bool { return g.sent(s.RedisKey(key)) })
	cancel()
	g.open()
	r := <-out
	if r.err != nil || r.c.Outcome != dedup.Acquired || !r.c.TakenOver || r.c.Attempt != 2 {
		t.Fatalf("take-over cancelled between its steps: %+v %v, want acquired by take-over, attempt 2", r.c, r.err)
	}
	if err := s.Complete(bg, first, []byte("old"), time.Hour); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("the old owner completed after the take-over: %v", err)
	}
	if err := s.Complete(bg, r.c, []byte("new"), time.Hour); err != nil {
		t.Fatal(err)
	}
}

// TestCloseReplicaAckOnFrozenServerEnds: a completion with WithReplicaAck
// is sent by a flush goroutine (its pipeline, with WAIT, on a dedicated
// connection) that Close waits for. On a server that stopped answering,
// closing the client does not end that connection's call and rueidis
// gives a blocking pipeline no ConnWriteTimeout, so Close waited for the
// flush's own timeout (30s) instead of the bound the doc names (WAIT's
// timeout plus ConnWriteTimeout). Checked by outcome: Close must return
// before the server is thawed.
func TestCloseReplicaAckOnFrozenServerEnds(t *testing.T) {
	srv := testenv.StartRedis(t, "")
	g := startReplyGate(t, srv.Addrs()[0])
	const cwt = 300 * time.Millisecond
	s, err := Open(rueidis.ClientOption{InitAddress: g.addr(), PipelineMultiplex: -1, ConnWriteTimeout: cwt,
		Dialer: net.Dialer{KeepAlive: time.Hour}},
		WithReplicaAck(1, 100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	bg := context.Background()
	w := claimOne(t, s, "rack-close-warm")
	var ra *ReplicaAckError
	if err := s.Complete(bg, w, []byte("w"), time.Hour); !errors.As(err, &ra) {
		t.Fatalf("warm completion without a replica: %v, want a ReplicaAckError", err)
	}
	c := claimOne(t, s, "rack-close-frozen")
	g.reset()
	srv.Freeze()
	thawed := false
	defer func() {
		if !thawed {
			srv.Thaw()
		}
	}()
	ctx, cancel := context.WithCancel(bg)
	errc := make(chan error, 1)
	go func() { errc <- s.Complete(ctx, c, []byte("r"), time.Hour) }()
	waitFor(t, "the completion to be sent", func() bool { return g.sent(s.RedisKey(c.Key)) })
	cancel()
	var se *dedup.StoreError
	if err := <-errc; !errors.As(err, &se) || se.NotApplied {
		t.Fatalf("cancelled completion in a flush: %v, want a store error, outcome unknown", err)
	}
	closed := make(chan struct{})
	go func() { s.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(10 * cwt * 2):
		srv.Thaw()
		thawed = true
		<-closed
		t.Fatalf("Close with a WAIT completion in flight on a frozen server outlived WAIT's timeout plus ConnWriteTimeout (%v): it returned only once the server was thawed", cwt)
	}
}
