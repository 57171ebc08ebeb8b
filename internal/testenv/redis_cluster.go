package testenv

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// RedisCluster is a private Redis Cluster started by one test, on free
// loopback ports, so that the test may fail its masters over and kill its
// nodes without disturbing the shared cluster on 7000-7002. Each node runs
// daemonized from a config file in the test's temporary directory (INFO
// server names it), as scripts/redis-cluster.sh starts its nodes, so a
// killed node can be started again from it. Every node is stopped when the
// test ends, restarted ones included.
type RedisCluster struct {
	t     testing.TB
	Ports []string
	dir   string
}

// StartRedisCluster starts masters masters with replicas replicas each and
// waits until every node says cluster_state:ok and every replica is in
// sync. A machine without redis-server skips the test (fails it under
// DEDUP_REQUIRE_SERVICES=1).
func StartRedisCluster(t testing.TB, masters, replicas int) *RedisCluster {
	t.Helper()
	for _, cmd := range []string{"redis-server", "redis-cli"} {
		if _, err := exec.LookPath(cmd); err != nil {
			msg := cmd + " is not installed (apt-get install redis-server)"
			if Required() {
				t.Fatal(msg)
			}
			t.Skip(msg)
		}
	}
	exe, _ := exec.LookPath("redis-server")
	c := &RedisCluster{t: t, dir: t.TempDir()}
	t.Cleanup(c.stop)
	n := masters * (1 + replicas)
	for len(c.Ports) < n {
		p := clusterPort(t)
		dir := filepath.Join(c.dir, p)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		conf := filepath.Join(dir, "redis.conf")
		text := fmt.Sprintf("port %s\nbind 127.0.0.1\ndir %s\ncluster-enabled yes\ncluster-config-file nodes.conf\n"+
			"cluster-node-timeout 1000\ncluster-replica-validity-factor 0\nrepl-diskless-sync yes\nrepl-diskless-sync-delay 0\n"+
			"save \"\"\nappendonly no\ndaemonize yes\npidfile %s\nlogfile %s\n",
			p, dir, filepath.Join(dir, "redis.pid"), filepath.Join(dir, "redis.log"))
		if err := os.WriteFile(conf, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command(exe, conf).CombinedOutput(); err != nil {
			t.Fatalf("start redis-server on %s: %v %s", p, err, out)
		}
		c.Ports = append(c.Ports, p)
	}
	for _, p := range c.Ports {
		c.waitPing(p)
	}
	args := []string{"--cluster", "create"}
	args = append(args, c.Addrs()...)
	args = append(args, "--cluster-replicas", strconv.Itoa(replicas), "--cluster-yes")
	if out, err := exec.Command("redis-cli", args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v %s", err, out)
	}
	deadline := time.Now().Add(time.Minute)
	for !c.healthy(masters, masters*replicas) {
		if time.Now().After(deadline) {
			t.Fatalf("the private cluster did not become healthy; logs in %s", c.dir)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return c
}

// clusterPort returns a free port whose cluster bus port (+10000) is free
// too.
func clusterPort(t testing.TB) string {
	for range 100 {
		p := FreePort(t)
		n, _ := strconv.Atoi(p)
		if n+10000 > 65535 {
			continue
		}
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(n+10000))
		if err != nil {
			continue
		}
		l.Close()
		return p
	}
	t.Fatal("no free port pair for a cluster node")
	return ""
}

// Addrs returns the nodes' host:port addresses.
func (c *RedisCluster) Addrs() []string {
	out := make([]string, len(c.Ports))
	for i, p := range c.Ports {
		out[i] = "127.0.0.1:" + p
	}
	return out
}

// CLI runs redis-cli against the node on port; an unreachable node gives
// an error, not a failed test.
func (c *RedisCluster) CLI(port string, args ...string) (string, error) {
	out, err := exec.Command("redis-cli", append([]string{"-p", port}, args...)...).CombinedOutput()
	s := strings.TrimSpace(strings.ReplaceAll(string(out), "\r", ""))
	if err == nil && strings.HasPrefix(s, "Could not connect") {
		err = fmt.Errorf("%s", s)
	}
	return s, err
}

func (c *RedisCluster) waitPing(port string) {
	for range 100 {
		if s, err := c.CLI(port, "ping"); err == nil && s == "PONG" {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	c.t.Fatalf("cluster node %s did not answer", port)
}

// healthy reports whether every node says cluster_state:ok and there are
// the masters and linked, synced replicas wanted.
func (c *RedisCluster) healthy(masters, replicas int) bool {
	m, r := 0, 0
	for _, p := range c.Ports {
		info, err := c.CLI(p, "cluster", "info")
		if err != nil || !strings.Contains(info, "cluster_state:ok") {
			return false
		}
		repl, err := c.CLI(p, "info", "replication")
		switch {
		case err != nil:
			return false
		case strings.Contains(repl, "role:master"):
			m++
		case strings.Contains(repl, "master_link_status:up") && strings.Contains(repl, "master_sync_in_progress:0"):
			r++
		}
	}
	return m == masters && r == replicas
}

// Roles returns each node's role (master or slave) by port; a node that
// does not answer is "down".
func (c *RedisCluster) Roles() map[string]string {
	out := map[string]string{}
	for _, p := range c.Ports {
		s, err := c.CLI(p, "role")
		role, _, _ := strings.Cut(s, "\n")
		if err != nil {
			role = "down"
		}
		out[p] = role
	}
	return out
}

// stop shuts every node down, by its pid file if it does not answer.
func (c *RedisCluster) stop() {
	for _, p := range c.Ports {
		c.CLI(p, "shutdown", "nosave")
		if b, err := os.ReadFile(filepath.Join(c.dir, p, "redis.pid")); err == nil {
			if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && pid > 1 {
				syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	}
}
