package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/redisstore"
	"github.com/dedupkit/dedup/storetest"
	"github.com/redis/rueidis"
)

// The servers the tests use. Standalone: DEDUP_REDIS_ADDR (default
// 127.0.0.1:6379). Cluster: DEDUP_REDIS_CLUSTER_ADDRS (default the three
// masters that scripts/redis-cluster.sh starts).
func standaloneAddrs(t testing.TB) []string {
	return testenv.Addrs(t, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
}

func clusterAddrs(t testing.TB) []string {
	return testenv.Addrs(t, "DEDUP_REDIS_CLUSTER_ADDRS", "127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002",
		"Redis Cluster (start it with scripts/redis-cluster.sh start)")
}

func open(t testing.TB, addrs []string, opts ...redisstore.Option) *redisstore.Store {
	t.Helper()
	s, err := redisstore.Open(rueidis.ClientOption{InitAddress: addrs}, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

var features = storetest.Features{Extend: true, BatchClaim: true, BatchComplete: true}

func TestConformance(t *testing.T) {
	addrs := standaloneAddrs(t)
	storetest.Run(t, func(t testing.TB, _ *storetest.Clock) dedup.Store { return open(t, addrs) }, features)
}

func TestConformanceCluster(t *testing.T) {
	addrs := clusterAddrs(t)
	if n := len(open(t, addrs).Client().Nodes()); n < 3 {
		t.Fatalf("expected a cluster client with 3 nodes, got %d", n)
	}
	storetest.Run(t, func(t testing.TB, _ *storetest.Clock) dedup.Store { return open(t, addrs) }, features)
}

// TestClusterBatchSpansSlots: a batch whose keys live on every master is
// split per node and slot, and its outcomes come back in request order.
func TestClusterBatchSpansSlots(t *testing.T) {
	s := open(t, clusterAddrs(t))
	reqs := batchRoundTrip(t, s, 150)
	nodes := map[string]bool{}
	for _, r := range reqs {
		// Ask each master whether it holds the key: the batch must have
		// touched all three.
		k := s.RedisKey(r.Key)
		for addr, n := range s.Client().Nodes() {
			if v, _ := n.Do(context.Background(), n.B().Exists().Key(k).Build()).AsInt64(); v == 1 {
				nodes[addr] = true
			}
		}
	}
	if len(nodes) < 3 {
		t.Fatalf("150 keys landed on %d masters; the test needs all 3", len(nodes))
	}
}

// TestCompleteBatchManyKeysPerScript: keys that one script may take
// together (any keys on a standalone server; keys of one hash slot on a
// cluster, here through a hash-tagged prefix) are completed several per
// script call, more than one call's worth, each fenced by its own token.
func TestCompleteBatchManyKeysPerScript(t *testing.T) {
	t.Run("standalone", func(t *testing.T) { batchRoundTrip(t, open(t, standaloneAddrs(t)), 300) })
	t.Run("cluster one slot", func(t *testing.T) {
		s := open(t, clusterAddrs(t), redisstore.WithPrefix("{dedup-test}:"))
		batchRoundTrip(t, s, 300)
	})
}

// batchRoundTrip claims n keys twice each in one batch (the second
// occurrence finds the first in progress), completes the acquired ones in
// one batch with every seventh token stale, checks each item's outcome
// and then each key's record, and returns the requests of the n keys.
func batchRoundTrip(t *testing.T, s *redisstore.Store, n int) []dedup.ClaimRequest {
	t.Helper()
	ctx := context.Background()
	scope := fmt.Sprintf("batch-%d", time.Now().UnixNano())
	reqs := make([]dedup.ClaimRequest, 2*n)
	for i := range reqs {
		reqs[i] = dedup.ClaimRequest{Key: dedup.Key{Scope: scope, ID: fmt.Sprint("k", i%n)}}
	}
	got, err := s.ClaimBatch(ctx, reqs, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	for i, c := range got {
		want := dedup.Acquired
		if i >= n {
			want = dedup.InProgress
		}
		if c.Key != reqs[i].Key || c.Outcome != want {
			t.Fatalf("item %d: %v %v, want %v %v", i, c.Key, c.Outcome, reqs[i].Key, want)
		}
	}
	stale := func(i int) bool { return i%7 == 3 }
	items := make([]dedup.Completion, n)
	for i := range items {
		items[i] = dedup.Completion{Claim: got[i], Result: []byte(reqs[i].Key.ID)}
		if stale(i) {
			items[i].Claim.Token = dedup.NewToken()
		}
	}
	errs, err := s.CompleteBatch(ctx, items, time.Hour)
	if err != nil || len(errs) != len(items) {
		t.Fatalf("CompleteBatch = %d results, %v", len(errs), err)
	}
	for i, err := range errs {
		if stale(i) != errors.Is(err, dedup.ErrLeaseLost) || !stale(i) && err != nil {
			t.Fatalf("completion %d: %v", i, err)
		}
	}
	again, err := s.ClaimBatch(ctx, reqs[:n], time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	for i, c := range again {
		switch {
		case stale(i) && c.Outcome != dedup.InProgress:
			t.Fatalf("the stale completion changed key %d: %v", i, c.Outcome)
		case !stale(i) && (c.Outcome != dedup.Duplicate || string(c.Result) != reqs[i].Key.ID):
			t.Fatalf("key %d after the batch completion: %v %q", i, c.Outcome, c.Result)
		}
	}
	return reqs[:n]
}

func TestKeysDoNotCollide(t *testing.T) {
	s, err := redisstore.New(noClient{})
	if err != nil {
		t.Fatal(err)
	}
	a := s.RedisKey(dedup.Key{Scope: "a:b", ID: "c"})
	b := s.RedisKey(dedup.Key{Scope: "a", ID: "b:c"})
	if a == b {
		t.Fatalf("two keys share the Redis key %q", a)
	}
}

// noClient is only a non-nil rueidis.Client for constructor tests.
type noClient struct{ rueidis.Client }

func (noClient) Mode() rueidis.ClientMode { return rueidis.ClientModeStandalone }

func TestBadOptions(t *testing.T) {
	if _, err := redisstore.New(nil); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Fatalf("nil client: %v", err)
	}
	if _, err := redisstore.New(noClient{}, redisstore.WithTakeoverHold(0)); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Fatalf("zero hold: %v", err)
	}
}

func TestConnectionRefused(t *testing.T) {
	_, err := redisstore.Open(rueidis.ClientOption{InitAddress: []string{"127.0.0.1:" + testenv.FreePort(t)}})
	if !dedup.IsStoreError(err) || !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("Open on a closed port: %v, want a store error wrapping ECONNREFUSED", err)
	}
}

func startServer(t testing.TB, port string) *testenv.RedisServer {
	standaloneAddrs(t) // Redis must be usable here at all
	return testenv.StartRedis(t, port)
}

// TestFlushAllLetsDuplicatesThrough documents the weakness of Redis as the
// only dedup layer: keys lost to a FLUSHALL (or a failover to a replica
// that had not received them, or a restart without persistence) make the
// next delivery of a completed message look new. The layered store is the
// fix: a durable layer behind Redis still holds the record.
func TestFlushAllLetsDuplicatesThrough(t *testing.T) {
	srv := startServer(t, "")
	s := open(t, srv.Addrs())
	ctx := context.Background()
	k := dedup.Key{Scope: "payments", ID: "evt-1"}
	c, err := s.Claim(ctx, k, "", time.Minute)
	if err != nil || c.Outcome != dedup.Acquired {
		t.Fatal(c.Outcome, err)
	}
	if err := s.Complete(ctx, c, []byte("charged"), time.Hour); err != nil {
		t.Fatal(err)
	}
	if d, _ := s.Claim(ctx, k, "", time.Minute); d.Outcome != dedup.Duplicate {
		t.Fatalf("before the flush: %v, want duplicate", d.Outcome)
	}
	srv.CLI("flushall")
	again, err := s.Claim(ctx, k, "", time.Minute)
	if err != nil || again.Outcome != dedup.Acquired {
		t.Fatalf("after FLUSHALL: %v %v; the documented behaviour is that the duplicate passes Redis", again.Outcome, err)
	}
}

// TestServerRestartFailsClosed: while Redis is down every call is a typed
// store error and the Runner does not run the handler; once it is back
// the store works again without a new client.
func TestServerRestartFailsClosed(t *testing.T) {
	srv := startServer(t, "")
	s := open(t, srv.Addrs())
	ctx := context.Background()
	r, _ := dedup.NewRunner(s)
	ran := 0
	h := func(context.Context) ([]byte, error) { ran++; return nil, nil }
	if _, err := r.Do(ctx, dedup.Key{Scope: "s", ID: "before"}, "", h); err != nil || ran != 1 {
		t.Fatalf("with Redis up: %v ran %d", err, ran)
	}
	srv.Stop()
	_, err := r.Do(ctx, dedup.Key{Scope: "s", ID: "during"}, "", h)
	if !dedup.IsStoreError(err) || ran != 1 {
		t.Fatalf("with Redis down: %v ran %d; want a store error and no run (fail closed)", err, ran)
	}
	if c, err := s.Claim(ctx, dedup.Key{Scope: "s", ID: "during"}, "", time.Minute); err == nil || c.Outcome != 0 {
		t.Fatalf("Claim with Redis down = %v %v", c.Outcome, err)
	}
	startServer(t, srv.Port)
	// The first calls after the restart may still meet connections that
	// died with the old server: each fails closed with a store error. A
	// delivery that failed at Complete keeps its lease, like any lost
	// completion, so every retry here is a new message.
	deadline := time.Now().Add(10 * time.Second)
	for i := 0; ; i++ {
		before := ran
		_, err = r.Do(ctx, dedup.Key{Scope: "s", ID: fmt.Sprint("after-", i)}, "", h)
		if err == nil && ran == before+1 {
			return
		}
		if !dedup.IsStoreError(err) || time.Now().After(deadline) {
			t.Fatalf("after the restart: %v; want store errors until the client reconnects, then success", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestTimeoutLostReplyIsProtectedByLease: a claim whose reply never
// arrives (the server froze) times out with a store error; the claim
// itself may still run when the server wakes, and then its lease protects
// the key: nobody else applies the message until the lease ends.
func TestTimeoutLostReplyIsProtectedByLease(t *testing.T) {
	srv := startServer(t, "")
	s := open(t, srv.Addrs())
	k := dedup.Key{Scope: "s", ID: "frozen"}
	if err := s.Ping(context.Background()); err != nil {
		t.Fatal(err)
	}
	srv.Freeze()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	_, err := s.Claim(ctx, k, "", time.Minute)
	cancel()
	srv.Thaw()
	if !dedup.IsStoreError(err) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Claim against a frozen server: %v, want a store error wrapping DeadlineExceeded", err)
	}
	var c dedup.Claim
	for range 50 { // the reconnect may take a moment
		if c, err = s.Claim(context.Background(), k, "", time.Minute); err == nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		t.Fatal(err)
	}
	if c.Outcome != dedup.InProgress && c.Outcome != dedup.Acquired {
		t.Fatalf("after the lost reply: %v", c.Outcome)
	}
	// in progress: the lost claim ran when the server woke and its lease
	// holds the key; acquired: the server never ran it (the client closed
	// the connection first). Either is safe; neither applied it twice.
	t.Logf("after the lost reply the key was %v", c.Outcome)
}

func TestUseAfterCloseWithBorrowedClient(t *testing.T) {
	addrs := standaloneAddrs(t)
	c, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: addrs, DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, _ := redisstore.New(c)
	s.Close()
	if _, err := s.Claim(context.Background(), dedup.Key{Scope: "s", ID: "x"}, "", time.Minute); !errors.Is(err, dedup.ErrClosed) {
		t.Fatalf("Claim after Close: %v", err)
	}
	if err := c.Do(context.Background(), c.B().Ping().Build()).Error(); err != nil {
		t.Fatalf("closing the store closed the caller's client: %v", err)
	}
}

// TestScriptCacheFlushed: a server that lost its script cache (a restart,
// SCRIPT FLUSH, a new cluster node) answers NOSCRIPT; the store resends
// the script whole and every transition still works, single and batched.
func TestScriptCacheFlushed(t *testing.T) {
	srv := startServer(t, "")
	s := open(t, srv.Addrs())
	ctx := context.Background()
	k := dedup.Key{Scope: "s", ID: "k"}
	c, err := s.Claim(ctx, k, "", time.Minute)
	if err != nil || c.Outcome != dedup.Acquired {
		t.Fatalf("first claim: %v %v", c.Outcome, err)
	}
	srv.CLI("script", "flush")
	if p, err := s.Claim(ctx, k, "", time.Minute); err != nil || p.Outcome != dedup.InProgress {
		t.Fatalf("claim of a key in progress after SCRIPT FLUSH: %v %v", p.Outcome, err)
	}
	srv.CLI("script", "flush")
	got, err := s.ClaimBatch(ctx, []dedup.ClaimRequest{{Key: k}, {Key: dedup.Key{Scope: "s", ID: "n"}}}, time.Minute)
	if err != nil || got[0].Outcome != dedup.InProgress || got[1].Outcome != dedup.Acquired {
		t.Fatalf("batch after SCRIPT FLUSH: %v %v", got, err)
	}
	srv.CLI("script", "flush")
	if errs, err := s.CompleteBatch(ctx, []dedup.Completion{{Claim: got[1], Result: []byte("n")}}, time.Hour); err != nil || errs[0] != nil {
		t.Fatalf("batch complete after SCRIPT FLUSH: %v %v", errs, err)
	}
	srv.CLI("script", "flush")
	if err := s.Complete(ctx, c, []byte("r"), time.Hour); err != nil {
		t.Fatalf("complete after SCRIPT FLUSH: %v", err)
	}
	if d, err := s.Claim(ctx, k, "", time.Minute); err != nil || d.Outcome != dedup.Duplicate || string(d.Result) != "r" {
		t.Fatalf("after flushed scripts: %v %q %v", d.Outcome, d.Result, err)
	}
}

// TestSlotAgreesWithCluster: the slot the store groups keys by is the one
// the cluster computes (CLUSTER KEYSLOT), hash tags included, so that a
// script never gets keys of two slots.
func TestSlotAgreesWithCluster(t *testing.T) {
	s := open(t, clusterAddrs(t))
	ctx := context.Background()
	keys := []string{"", "a", "foo", "123456789", "{}", "{", "}", "{}a", "a{}b", "{a}", "x{a}y", "x{a}{b}", "}{a}", "{{a}}", "x{}{a}", "dedup:3:abc:k1", "\x00\xff\xfe"}
	for i := range 200 {
		keys = append(keys, fmt.Sprintf("dedup:%d:scope-%d:id-%d", i%13, i, i*7919))
	}
	for _, k := range keys {
		want, err := s.Client().Do(ctx, s.Client().B().ClusterKeyslot().Key(k).Build()).AsInt64()
		if err != nil {
			t.Fatal(err)
		}
		if got := redisstore.Slot(k); int64(got) != want {
			t.Errorf("slot(%q) = %d, the cluster says %d", k, got, want)
		}
	}
}
