package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/redisstore"
)

// startReplicated starts a private master and one replica of it and waits
// until the replica's link is up.
func startReplicated(t testing.TB) (master, replica *testenv.RedisServer) {
	t.Helper()
	master = startServer(t, "")
	replica = startServer(t, "")
	master.CLI("config", "set", "repl-diskless-sync-delay", "0")
	// Load the master's data from the socket: a replica loading from disk
	// would leave a dump.rdb in the test's directory.
	replica.CLI("config", "set", "repl-diskless-load", "on-empty-db")
	replica.CLI("replicaof", "127.0.0.1", master.Port)
	deadline := time.Now().Add(20 * time.Second)
	for !strings.Contains(master.CLI("info", "replication"), "state=online") ||
		!strings.Contains(replica.CLI("info", "replication"), "master_link_status:up") {
		if time.Now().After(deadline) {
			t.Fatalf("the replica did not come online:\n%s", replica.CLI("info", "replication"))
		}
		time.Sleep(50 * time.Millisecond)
	}
	return master, replica
}

// TestReplicaAck: with WithReplicaAck(1, ...) a completion returns once
// the replica has the completed record (single and batched); with the
// replica stopped, Complete and CompleteBatch fail closed with a store
// error wrapping a ReplicaAckError after the timeout, while the master
// holds the completed record, so the redelivery is a duplicate.
func TestReplicaAck(t *testing.T) {
	master, replica := startReplicated(t)
	s := open(t, master.Addrs(), redisstore.WithReplicaAck(1, 5*time.Second))
	ctx := context.Background()
	scope := fmt.Sprintf("ack-%d", time.Now().UnixNano())
	claim := func(id string) dedup.Claim {
		t.Helper()
		c, err := s.Claim(ctx, dedup.Key{Scope: scope, ID: id}, "", time.Minute)
		if err != nil || c.Outcome != dedup.Acquired {
			t.Fatal(c.Outcome, err)
		}
		return c
	}
	onReplica := func(id string) string {
		return replica.CLI("get", s.RedisKey(dedup.Key{Scope: scope, ID: id}))
	}

	if err := s.Complete(ctx, claim("one"), []byte("r1"), time.Hour); err != nil {
		t.Fatalf("complete with the replica up: %v", err)
	}
	// WAIT returned 1: the replica has the completed record now, without
	// polling.
	if v := onReplica("one"); !strings.HasSuffix(v, "r1") {
		t.Fatalf("the replica holds %q after an acknowledged completion", v)
	}
	items := []dedup.Completion{{Claim: claim("b1"), Result: []byte("x1")}, {Claim: claim("b2"), Result: []byte("x2")}}
	errs, err := s.CompleteBatch(ctx, items, time.Hour)
	if err != nil || errs[0] != nil || errs[1] != nil {
		t.Fatalf("batch with the replica up: %v %v", errs, err)
	}
	if !strings.HasSuffix(onReplica("b2"), "x2") {
		t.Fatal("the replica lacks an acknowledged batch completion")
	}
	// A stale token is still lease lost, not a replica error.
	stale := claim("stale")
	stale.Token = dedup.NewToken()
	if err := s.Complete(ctx, stale, nil, time.Hour); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("stale token: %v", err)
	}

	replica.Stop()
	short := open(t, master.Addrs(), redisstore.WithReplicaAck(1, 200*time.Millisecond))
	c := claim("down")
	err = short.Complete(ctx, c, []byte("r"), time.Hour)
	var ack *redisstore.ReplicaAckError
	if !dedup.IsStoreError(err) || !errors.As(err, &ack) || ack.Want != 1 || ack.Acked != 0 {
		t.Fatalf("complete with the replica down: %v, want a store error wrapping a ReplicaAckError", err)
	}
	if d, err := s.Claim(ctx, c.Key, "", time.Minute); err != nil || d.Outcome != dedup.Duplicate || string(d.Result) != "r" {
		t.Fatalf("the redelivery after the unacknowledged completion: %v %v, want a duplicate from the master", d.Outcome, err)
	}
	errs, err = short.CompleteBatch(ctx, []dedup.Completion{{Claim: claim("bd1")}, {Claim: claim("bd2")}}, time.Hour)
	if err != nil || !errors.As(errs[0], &ack) || !errors.As(errs[1], &ack) || !dedup.IsStoreError(errs[1]) {
		t.Fatalf("batch with the replica down: %v %v", errs, err)
	}
	// Through the Runner: the handler's effect is not reported done.
	r, _ := dedup.NewRunner(short)
	if _, err := r.Do(ctx, dedup.Key{Scope: scope, ID: "runner"}, "", func(context.Context) ([]byte, error) { return nil, nil }); !errors.As(err, &ack) {
		t.Fatalf("Runner.Do with the replica down: %v", err)
	}
}

// TestReplicaAckCluster: on a cluster the WAIT goes with each slot's
// completions to that slot's master. With replicas (scripts/redis-cluster.sh
// can start them) the completions succeed; without, each fails closed with
// a ReplicaAckError. Either way a batch over many slots comes back whole,
// in order.
func TestReplicaAckCluster(t *testing.T) {
	addrs := clusterAddrs(t)
	plain := open(t, addrs)
	replicated := true
	for _, n := range plain.Client().Nodes() {
		v, err := n.Do(context.Background(), n.B().Info().Section("replication").Build()).ToString()
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(v, "role:master") && strings.Contains(v, "connected_slaves:0") {
			replicated = false
		}
	}
	s := open(t, addrs, redisstore.WithReplicaAck(1, 300*time.Millisecond))
	ctx := context.Background()
	scope := fmt.Sprintf("ackc-%d", time.Now().UnixNano())
	reqs := make([]dedup.ClaimRequest, 40)
	for i := range reqs {
		reqs[i].Key = dedup.Key{Scope: scope, ID: fmt.Sprint(i)}
	}
	claims, err := s.ClaimBatch(ctx, reqs, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	items := make([]dedup.Completion, len(claims))
	for i, c := range claims {
		items[i] = dedup.Completion{Claim: c, Result: []byte(c.Key.ID)}
	}
	errs, err := s.CompleteBatch(ctx, items, time.Hour)
	if err != nil || len(errs) != len(items) {
		t.Fatal(errs, err)
	}
	var ack *redisstore.ReplicaAckError
	for i, e := range errs {
		if replicated && e != nil || !replicated && !errors.As(e, &ack) {
			t.Fatalf("item %d (cluster replicated: %v): %v", i, replicated, e)
		}
	}
	if err := s.Complete(ctx, claims[0], nil, time.Hour); replicated && err != nil || !replicated && !errors.As(err, &ack) {
		t.Fatalf("single complete (cluster replicated: %v): %v", replicated, err)
	}
	again, err := plain.ClaimBatch(ctx, reqs, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	for i, c := range again {
		if c.Outcome != dedup.Duplicate || string(c.Result) != reqs[i].Key.ID {
			t.Fatalf("key %d after the acked batch: %v %q", i, c.Outcome, c.Result)
		}
	}
}

func TestReplicaAckOptions(t *testing.T) {
	for _, tc := range []struct {
		n int
		d time.Duration
	}{{0, time.Second}, {-1, time.Second}, {1, 0}, {1, time.Microsecond}} {
		if _, err := redisstore.New(noClient{}, redisstore.WithReplicaAck(tc.n, tc.d)); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("WithReplicaAck(%d, %v): %v, want an invalid argument", tc.n, tc.d, err)
		}
	}
	if _, err := redisstore.New(noClient{}, redisstore.WithReplicaAck(2, time.Second)); err != nil {
		t.Errorf("WithReplicaAck(2, 1s): %v", err)
	}
}

// BenchmarkReplicaAck: what WithReplicaAck(1, 1s) costs, on a private
// master with one replica on this machine. Cases run interleaved, one
// round of each per b.N, 1024 completions a round (claimed first, not
// timed): Complete from 64 goroutines and CompleteBatch of 128, each
// without and with the WAIT. Reports completions per second per case.
func BenchmarkReplicaAck(b *testing.B) {
	master, _ := startReplicated(b)
	plain := open(b, master.Addrs())
	acked := open(b, master.Addrs(), redisstore.WithReplicaAck(1, time.Second))
	ctx := context.Background()
	const keys = 1024
	round := 0
	claim := func() []dedup.Claim {
		reqs := make([]dedup.ClaimRequest, keys)
		for i := range reqs {
			reqs[i].Key = dedup.Key{Scope: "ack-bench", ID: fmt.Sprint(round, "-", i)}
		}
		round++
		claims, err := plain.ClaimBatch(ctx, reqs, time.Minute)
		if err != nil {
			b.Fatal(err)
		}
		return claims
	}
	single := func(s *redisstore.Store) func([]dedup.Claim) {
		return func(claims []dedup.Claim) {
			errc := make(chan error, 64)
			for g := range 64 {
				go func() {
					var err error
					for i := g; i < keys && err == nil; i += 64 {
						err = s.Complete(ctx, claims[i], []byte("result"), time.Hour)
					}
					errc <- err
				}()
			}
			for range 64 {
				if err := <-errc; err != nil {
					b.Fatal(err)
				}
			}
		}
	}
	batch := func(s *redisstore.Store) func([]dedup.Claim) {
		return func(claims []dedup.Claim) {
			for lo := 0; lo < keys; lo += 128 {
				items := make([]dedup.Completion, 128)
				for i := range items {
					items[i] = dedup.Completion{Claim: claims[lo+i], Result: []byte("result")}
				}
				errs, err := s.CompleteBatch(ctx, items, time.Hour)
				if err != nil || errs[0] != nil {
					b.Fatal(err, errs[0])
				}
			}
		}
	}
	cases := []struct {
		name string
		run  func([]dedup.Claim)
		took time.Duration
	}{
		{"single", single(plain), 0}, {"single-wait", single(acked), 0},
		{"batch128", batch(plain), 0}, {"batch128-wait", batch(acked), 0},
	}
	for b.Loop() {
		for i := range cases {
			claims := claim()
			start := time.Now()
			cases[i].run(claims)
			cases[i].took += time.Since(start)
		}
	}
	for _, c := range cases {
		b.ReportMetric(float64(b.N*keys)/c.took.Seconds(), c.name+"/s")
	}
}
