package verify_test

import (
	"strings"
	"testing"

	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/internal/verify"
)

// failoverRun runs cfg against store (redis or layered over PostgreSQL) on
// a private cluster of 3 masters with a replica each, failing a master
// over every 400 deliveries: by CLUSTER FAILOVER and by SIGKILL in turn.
// It checks that both kinds happened, that no step failed, and that the
// cluster is whole afterwards (3 masters, 3 synced replicas: the killed
// nodes were restarted and rejoined as replicas).
func failoverRun(t *testing.T, store string, cfg verify.Config) verify.Report {
	t.Helper()
	c := testenv.StartRedisCluster(t, 3, 1)
	fo, err := verify.NewClusterFailover(t.Context(), c.Addrs())
	if err != nil {
		t.Fatal(err)
	}
	cfg.Failover, cfg.FailoverEvery = fo.Step, 400
	b, _ := verify.LookupBackend(store)
	o := verify.OpenOptions{Mode: b.Modes[0], Addr: strings.Join(c.Addrs(), ","), Lease: cfg.Lease, Messages: cfg.Messages}
	if store == "layered" {
		t.Setenv("DEDUP_POSTGRES_URL", testenv.PostgresURL(t))
		o.Durable = "postgres"
	}
	tg, err := b.Open(t.Context(), o)
	if err != nil {
		t.Fatal(err)
	}
	rep, err := verify.Run(t.Context(), cfg, tg)
	if cerr := tg.Close(); cerr != nil {
		t.Errorf("close: %v", cerr)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: %d manual failovers, %d masters killed, %d deliveries, %d store errors, %d doubles, layers %v",
		store, rep.Failovers, rep.MasterKills, rep.Deliveries, rep.StoreErrors, rep.DoubleApplied, rep.Layers)
	if rep.Failovers < 1 || rep.MasterKills < 1 || rep.FailoverErrors > 0 {
		t.Fatalf("failovers %d, master kills %d, failed steps %d (%s): the run did not fail the cluster over both ways",
			rep.Failovers, rep.MasterKills, rep.FailoverErrors, rep.FailoverError)
	}
	masters := 0
	for port, role := range c.Roles() {
		switch role {
		case "master":
			masters++
		case "slave":
		default:
			t.Errorf("node %s is %s after the run: a killed master was not restarted", port, role)
		}
	}
	if masters != 3 {
		t.Errorf("%d masters after the run, want 3", masters)
	}
	return rep
}

// TestFailoverLayeredExactlyOnce: the layered store (window, Redis
// Cluster, PostgreSQL inbox) while masters are failed over and killed
// mid-run: every message takes effect exactly once, whatever the fast
// store lost, because the durable inbox decides.
func TestFailoverLayeredExactlyOnce(t *testing.T) {
	cfg := verify.DefaultConfig()
	cfg.Messages = 2500
	cfg.DupRate = 0.5
	rep := failoverRun(t, "layered", cfg)
	if !rep.OK || rep.Lost != 0 || rep.DoubleApplied != 0 || rep.Effects != cfg.Messages {
		t.Fatalf("layered over a failing-over cluster: ok %v, lost %d, doubled %d, effects %d of %d: %v",
			rep.OK, rep.Lost, rep.DoubleApplied, rep.Effects, cfg.Messages, rep.Violations())
	}
}

// TestFailoverRedisAloneReported: Redis alone through the same failovers
// never loses a message (a store error is a nack: fail closed), and a
// message applied twice because a killed master took its record along is
// counted and fails the run rather than passing unseen.
func TestFailoverRedisAloneReported(t *testing.T) {
	cfg := verify.DefaultConfig()
	cfg.Messages = 2500
	rep := failoverRun(t, "redis", cfg)
	if rep.Lost != 0 || rep.Unfinished != 0 {
		t.Fatalf("redis alone: lost %d, unfinished %d", rep.Lost, rep.Unfinished)
	}
	if rep.Effects < cfg.Messages || rep.OK != (rep.DoubleApplied == 0 && rep.Conflicts == 0) {
		t.Fatalf("redis alone: ok %v with %d doubles: %v", rep.OK, rep.DoubleApplied, rep.Violations())
	}
}
