package redisstore

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/redis/rueidis"
)

// flushesInFlight is how many flush slots are held.
func flushesInFlight(s *Store) int { return len(s.coalesce.sem) }

// waitFor polls cond, failing the test after many tries.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for i := 0; !cond(); i++ {
		if i == 20000 {
			t.Fatalf("gave up waiting: %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// claimOne claims a fresh key on s.
func claimOne(t *testing.T, s *Store, id string) dedup.Claim {
	t.Helper()
	c, err := s.Claim(context.Background(), dedup.Key{Scope: "rev1", ID: id}, dedup.FingerprintOf([]byte("p")), time.Minute)
	if err != nil || c.Outcome != dedup.Acquired {
		t.Fatalf("claim %s: %v %v", id, c.Outcome, err)
	}
	return c
}

// TestCompleteSenderHonoursItsContext: the caller whose turn it is to send
// a batch still returns when its own context ends while the server does
// not answer, with an error that wraps its context's and does not claim
// the completion was not applied (it was sent). The batch itself goes on
// for the other callers: once the server answers the record is completed.
// Before the fix the sender waited for the batch's reply whatever its
// context said (up to the flush timeout), then reported the batch's
// outcome, here the client's own timeout, not its cancellation.
//
// The batch is one completion, which a store from Open sends on its
// caller's goroutine, where a cancellation no longer ends it once sent
// (TestCallOnFrozenServerEndsAtConnWriteTimeout); inlineLone is turned off
// here so that the flush goroutine, which sends every batch of several
// callers, sends it.
func TestCompleteSenderHonoursItsContext(t *testing.T) {
	srv := testenv.StartRedis(t, "")
	s, err := Open(rueidis.ClientOption{InitAddress: srv.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	s.inlineLone = false
	bg := context.Background()
	// A lone completion is sent as completeOneScript: load it, so that no
	// NOSCRIPT reply adds a round trip below.
	if err := s.client.Do(bg, s.client.B().ScriptLoad().Script(completeOneScript).Build()).Error(); err != nil {
		t.Fatal(err)
	}
	c := claimOne(t, s, "sender")

	srv.Freeze()
	thawed := false
	thaw := func() {
		if !thawed {
			thawed = true
			srv.Thaw()
		}
	}
	defer thaw()
	ctx, cancel := context.WithCancel(bg)
	errc := make(chan error, 1)
	go func() { errc <- s.Complete(ctx, c, []byte("r"), time.Hour) }()
	// The batch is taken and on its way: a slot is held, nothing queued.
	waitFor(t, "the batch to be sent", func() bool { return flushesInFlight(s) == 1 && queued(s) == 0 })
	cancel()
	err = <-errc
	thaw()
	var se *dedup.StoreError
	if !errors.As(err, &se) || !errors.Is(err, context.Canceled) {
		t.Fatalf("sender cancelled while its batch was in flight: %v, want a store error wrapping context.Canceled", err)
	}
	if se.NotApplied {
		t.Fatalf("sender cancelled after its batch was sent reported not applied: %v", err)
	}
	// The batch was not abandoned with its sender: it completes the record.
	waitFor(t, "the batch to finish", func() bool { return flushesInFlight(s) == 0 })
	d, err := s.Claim(bg, c.Key, dedup.FingerprintOf([]byte("p")), time.Minute)
	if err != nil || d.Outcome != dedup.Duplicate || string(d.Result) != "r" {
		t.Fatalf("after the batch: %v %q %v, want duplicate with the result", d.Outcome, d.Result, err)
	}
}

// TestCompleteQueuedAtCloseIsNotSent: a completion still queued (every
// flush slot busy) when the store is closed returns ErrClosed and is never
// sent, even though the client (the caller's) stays open: the record stays
// in progress. Before the fix the queued call went on to send its batch
// after Close had returned and reported success.
func TestCompleteQueuedAtCloseIsNotSent(t *testing.T) {
	srv := testenv.StartRedis(t, "")
	client, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: srv.Addrs(), DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(client.Close)
	s, err := New(client)
	if err != nil {
		t.Fatal(err)
	}
	c := claimOne(t, s, "closed")
	release := fillSlots(s)
	errc := make(chan error, 1)
	go func() { errc <- s.Complete(context.Background(), c, []byte("r"), time.Hour) }()
	waitQueued(t, s, 1)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	release()
	if err := <-errc; !errors.Is(err, dedup.ErrClosed) {
		t.Fatalf("completion queued at Close: %v, want ErrClosed", err)
	}
	other, err := New(client)
	if err != nil {
		t.Fatal(err)
	}
	d, err := other.Claim(context.Background(), c.Key, dedup.FingerprintOf([]byte("p")), time.Minute)
	if err != nil || d.Outcome != dedup.InProgress {
		t.Fatalf("key of a completion queued at Close: %v %v, want still in progress (nothing sent after Close)", d.Outcome, err)
	}
}

// TestCloseEndsFlushInFlight: Close while a batch waits for a server that
// does not answer returns without waiting for the server, the waiting
// caller gets an error (never success, never "not applied": the batch was
// sent), and no flush is left running.
func TestCloseEndsFlushInFlight(t *testing.T) {
	srv := testenv.StartRedis(t, "")
	s, err := Open(rueidis.ClientOption{InitAddress: srv.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	c := claimOne(t, s, "inflight")
	srv.Freeze()
	defer srv.Thaw()
	errc := make(chan error, 1)
	go func() { errc <- s.Complete(context.Background(), c, []byte("r"), time.Hour) }()
	waitFor(t, "the batch to be sent", func() bool { return flushesInFlight(s) == 1 && queued(s) == 0 })
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if n := flushesInFlight(s); n != 0 {
		t.Fatalf("%d flushes still running after Close", n)
	}
	err = <-errc
	var se *dedup.StoreError
	switch {
	case err == nil:
		t.Fatal("completion in flight at Close reported success from a server that never answered")
	case errors.As(err, &se) && se.NotApplied:
		t.Fatalf("completion sent before Close reported not applied: %v", err)
	case se == nil && !errors.Is(err, dedup.ErrClosed):
		t.Fatalf("completion in flight at Close: %v, want ErrClosed or a store error", err)
	}
}

// TestCompleteDoesNotRetainResult: once Complete has returned, the store
// no longer reads the caller's result slice, as io.Writer must not retain
// p. A caller that gives up while its batch is in flight (outcome unknown)
// may reuse its buffer at once; the batch must still store the bytes the
// call was given, not what the buffer holds later (another message's
// result, which a duplicate would then be answered with). The victim's
// item goes in the batch's second script call (another retention), whose
// arguments are built after the first call's reply, which a frozen server
// holds back.
func TestCompleteDoesNotRetainResult(t *testing.T) {
	srv := testenv.StartRedis(t, "")
	s, err := Open(rueidis.ClientOption{InitAddress: srv.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	bg := context.Background()
	first, victim := claimOne(t, s, "first"), claimOne(t, s, "victim")
	fillSlots(s) // both slots held: the completions queue
	errc := make(chan error, 2)
	go func() { errc <- s.Complete(bg, first, []byte("one"), time.Hour) }()
	waitQueued(t, s, 1)
	buf := []byte("mine")
	ctx, cancel := context.WithCancel(bg)
	go func() { errc <- s.Complete(ctx, victim, buf, 2*time.Hour) }()
	waitQueued(t, s, 2)
	srv.Freeze()
	thawed := false
	defer func() {
		if !thawed {
			srv.Thaw()
		}
	}()
	<-s.coalesce.sem // one slot given back: the batch is taken
	waitFor(t, "the batch to be sent", func() bool { return queued(s) == 0 })
	cancel()
	var verr error
	for verr == nil {
		// The victim returns first (the other waits for the frozen server).
		verr = <-errc
	}
	copy(buf, "EVIL") // the caller reuses its buffer
	srv.Thaw()
	thawed = true
	if err := <-errc; err != nil {
		t.Fatalf("first completion: %v", err)
	}
	<-s.coalesce.sem // the other slot fillSlots held
	waitFor(t, "the batch to finish", func() bool { return flushesInFlight(s) == 0 })
	d, err := s.Claim(bg, victim.Key, dedup.FingerprintOf([]byte("p")), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if d.Outcome == dedup.Duplicate && string(d.Result) != "mine" {
		t.Fatalf("stored result %q, want %q: the batch read the caller's buffer after Complete returned", d.Result, "mine")
	}
}

// TestCompleteCoalescedAcrossSlots: on a cluster, completions of keys in
// many hash slots that queue into one batch each complete (the batch is
// split by slot: no CROSSSLOT), each caller gets its own key's answer (a
// stale token among them is lease lost, the rest done), and every record
// holds its own result.
func TestCompleteCoalescedAcrossSlots(t *testing.T) {
	addrs := testenv.Addrs(t, "DEDUP_REDIS_CLUSTER_ADDRS", "127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002",
		"Redis Cluster (start it with scripts/redis-cluster.sh start)")
	s, err := Open(rueidis.ClientOption{InitAddress: addrs})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	bg := context.Background()
	fp := dedup.FingerprintOf([]byte("p"))
	scope := "rev1-slots-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	const n = 48
	claims := make([]dedup.Claim, n)
	slots := map[uint16]bool{}
	for i := range claims {
		k := dedup.Key{Scope: scope, ID: strconv.Itoa(i)}
		c, err := s.Claim(bg, k, fp, time.Minute)
		if err != nil || c.Outcome != dedup.Acquired {
			t.Fatalf("claim %d: %v %v", i, c.Outcome, err)
		}
		claims[i] = c
		slots[slot(s.RedisKey(k))] = true
	}
	if len(slots) < 2 {
		t.Fatalf("keys in %d slots, want several", len(slots))
	}
	stale := claims[7]
	stale.Token[0] ^= 0xff // another token: lease lost
	release := fillSlots(s)
	errs := make([]error, n+1)
	var wg sync.WaitGroup
	for i := range claims {
		wg.Go(func() { errs[i] = s.Complete(bg, claims[i], []byte("r"+strconv.Itoa(i)), time.Hour) })
	}
	wg.Go(func() { errs[n] = s.Complete(bg, stale, []byte("stale"), time.Hour) })
	waitQueued(t, s, n+1)
	release()
	wg.Wait()
	for i, err := range errs[:n] {
		if err != nil {
			t.Fatalf("completion %d: %v", i, err)
		}
	}
	if !errors.Is(errs[n], dedup.ErrLeaseLost) {
		t.Fatalf("stale token: %v, want lease lost", errs[n])
	}
	for i, c := range claims {
		d, err := s.Claim(bg, c.Key, fp, time.Minute)
		if err != nil || d.Outcome != dedup.Duplicate || string(d.Result) != "r"+strconv.Itoa(i) {
			t.Fatalf("key %d after: %v %q %v", i, d.Outcome, d.Result, err)
		}
	}
}

// TestCompleteLoneDeadline: a lone completion (sent on its caller's
// goroutine by a store that pipelines) whose context has a deadline gives
// up when the deadline passes on a server that does not answer, with an
// error that wraps context.DeadlineExceeded (the caller's cause, not the
// cancellation the store uses to end the call) and does not claim the
// completion was not applied (the call may have gone out), and it holds
// no flush slot once it has returned.
func TestCompleteLoneDeadline(t *testing.T) {
	srv := testenv.StartRedis(t, "")
	s, err := Open(rueidis.ClientOption{InitAddress: srv.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if !s.inlineLone {
		t.Fatal("a store opened on a pipelining client does not send lone completions inline")
	}
	bg := context.Background()
	if err := s.client.Do(bg, s.client.B().ScriptLoad().Script(completeOneScript).Build()).Error(); err != nil {
		t.Fatal(err)
	}
	c := claimOne(t, s, "deadline")
	srv.Freeze()
	thawed := false
	defer func() {
		if !thawed {
			srv.Thaw()
		}
	}()
	ctx, cancel := context.WithTimeout(bg, 200*time.Millisecond)
	defer cancel()
	err = s.Complete(ctx, c, []byte("r"), time.Hour)
	srv.Thaw()
	thawed = true
	var se *dedup.StoreError
	if !errors.As(err, &se) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("lone completion past its deadline: %v, want a store error wrapping context.DeadlineExceeded", err)
	}
	if se.NotApplied {
		t.Fatalf("lone completion sent before its deadline reported not applied: %v", err)
	}
	if n := flushesInFlight(s); n != 0 {
		t.Fatalf("%d flush slots held after the lone completion returned", n)
	}
}
