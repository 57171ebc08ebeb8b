package verify

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/redis/rueidis"
)

// FailoverKind is what one step of a [ClusterFailover] did.
type FailoverKind string

const (
	// ManualFailover is CLUSTER FAILOVER sent to a replica: the replica and
	// its master agree on the hand-over, the replica catches up first, so
	// no acknowledged write is lost.
	ManualFailover FailoverKind = "failover"
	// MasterKill is a master SIGKILLed; the cluster notices it after
	// cluster-node-timeout and promotes its replica, which lacks whatever
	// the master acknowledged and had not replicated yet. The killed node
	// is then started again and rejoins as a replica.
	MasterKill FailoverKind = "kill"
)

// failoverHealthTimeout bounds how long one step waits for the cluster to
// be whole again (promotion, the restarted node synced as a replica).
const failoverHealthTimeout = time.Minute

// ClusterFailover fails a Redis Cluster with replicas over, one master at
// a time: its steps alternate between a manual failover (CLUSTER FAILOVER
// on a replica) and a killed master (SIGKILL, promotion of its replica by
// the cluster, the killed node restarted as a replica). Each step returns
// only once the cluster is healthy again: cluster_state:ok on every node,
// as many masters as before, and every replica linked and synced.
//
// The nodes must run on this machine (a killed node is restarted from the
// executable and config_file that INFO server names), as
// scripts/redis-cluster.sh start --replicas starts them.
type ClusterFailover struct {
	seeds []string

	mu   sync.Mutex
	step int
}

// NewClusterFailover returns a failover injector for the cluster that the
// seed addresses (host:port) reach. It checks that the cluster has a
// replica for every master and that its nodes can be restarted.
func NewClusterFailover(ctx context.Context, seeds []string) (*ClusterFailover, error) {
	if len(seeds) == 0 {
		return nil, errors.New("no cluster addresses")
	}
	f := &ClusterFailover{seeds: seeds}
	// A node killed by an earlier run may still be rejoining as a replica:
	// wait for the cluster to heal, and for every master to have its
	// replica, for a while before calling the cluster unfit.
	nodes, err := f.topology(ctx) // not a cluster at all: say so at once
	if err != nil {
		return nil, err
	}
	for wait := time.Duration(0); ; wait += 500 * time.Millisecond {
		if nodes, err = f.waitHealthy(ctx, 0); err != nil {
			return nil, err
		}
		lonely := ""
		for _, n := range nodes {
			if n.master() && len(replicasOf(nodes, n)) == 0 {
				lonely = n.addr
				break
			}
		}
		if lonely == "" {
			break
		}
		if wait >= 60*time.Second {
			return nil, fmt.Errorf("master %s has no replica: a failover needs a cluster with replicas (scripts/redis-cluster.sh start --replicas, 127.0.0.1:7100-7105)", lonely)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
	masters := 0
	for _, n := range nodes {
		if !n.master() {
			continue
		}
		masters++
		if _, err := restartCommand(ctx, n.addr); err != nil {
			return nil, err
		}
	}
	if masters == 0 {
		return nil, errors.New("the cluster has no master with slots")
	}
	return f, nil
}

// Step runs the next step (manual failover first, then a kill, and so on)
// and returns what it did and to which node. On an error the cluster may
// be left unhealthy; the next step waits for it first.
func (f *ClusterFailover) Step(ctx context.Context) (FailoverKind, string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	kind := ManualFailover
	if f.step%2 == 1 {
		kind = MasterKill
	}
	f.step++
	nodes, err := f.waitHealthy(ctx, 0)
	if err != nil {
		return kind, "", err
	}
	masters := 0
	for _, n := range nodes {
		if n.master() {
			masters++
		}
	}
	// The masters in a fixed order, a different one each step.
	m, r := pickMaster(nodes, f.step)
	if m == nil {
		return kind, "", errors.New("no master with a linked replica")
	}
	switch kind {
	case ManualFailover:
		if _, err := nodeDo(ctx, r.addr, "CLUSTER", "FAILOVER"); err != nil {
			return kind, r.addr, fmt.Errorf("CLUSTER FAILOVER on %s: %w", r.addr, err)
		}
		if err := waitRole(ctx, r.addr, "master"); err != nil {
			return kind, r.addr, err
		}
		_, err = f.waitHealthy(ctx, masters)
		return kind, m.addr, err
	default:
		restart, err := restartCommand(ctx, m.addr)
		if err != nil {
			return kind, m.addr, err
		}
		pid, err := nodePID(ctx, m.addr)
		if err != nil {
			return kind, m.addr, err
		}
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			return kind, m.addr, fmt.Errorf("kill the master %s (pid %d): %w", m.addr, pid, err)
		}
		// The cluster promotes the replica after cluster-node-timeout.
		if err := waitRole(ctx, r.addr, "master"); err != nil {
			return kind, m.addr, fmt.Errorf("after killing the master %s: %w", m.addr, err)
		}
		if err := startNode(restart); err != nil {
			return kind, m.addr, err
		}
		_, err = f.waitHealthy(ctx, masters)
		return kind, m.addr, err
	}
}

// clusterNode is one line of CLUSTER NODES.
type clusterNode struct {
	id, addr, masterID string
	flags              []string
	slots              bool
}

func (n clusterNode) has(flag string) bool {
	for _, f := range n.flags {
		if f == flag {
			return true
		}
	}
	return false
}

func (n clusterNode) master() bool {
	return n.has("master") && n.slots && !n.has("fail") && !n.has("fail?")
}

func replicasOf(nodes []clusterNode, m clusterNode) []clusterNode {
	var out []clusterNode
	for _, n := range nodes {
		if n.has("slave") && n.masterID == m.id && !n.has("fail") && !n.has("fail?") {
			out = append(out, n)
		}
	}
	return out
}

// pickMaster returns the i-th master (in address order, wrapping) that has
// a replica, and that replica.
func pickMaster(nodes []clusterNode, i int) (m, r *clusterNode) {
	var ms []clusterNode
	for _, n := range nodes {
		if n.master() && len(replicasOf(nodes, n)) > 0 {
			ms = append(ms, n)
		}
	}
	if len(ms) == 0 {
		return nil, nil
	}
	sort.Slice(ms, func(a, b int) bool { return ms[a].addr < ms[b].addr })
	mm := ms[i%len(ms)]
	rr := replicasOf(nodes, mm)[0]
	return &mm, &rr
}

// parseClusterNodes parses the reply of CLUSTER NODES.
func parseClusterNodes(s string) []clusterNode {
	var out []clusterNode
	for _, line := range strings.Split(s, "\n") {
		fs := strings.Fields(line)
		if len(fs) < 8 {
			continue
		}
		addr, _, _ := strings.Cut(fs[1], "@")
		out = append(out, clusterNode{id: fs[0], addr: addr, flags: strings.Split(fs[2], ","),
			masterID: fs[3], slots: len(fs) > 8})
	}
	return out
}

// topology reads CLUSTER NODES from the first seed that answers.
func (f *ClusterFailover) topology(ctx context.Context) ([]clusterNode, error) {
	var errs []error
	for _, a := range f.seeds {
		s, err := nodeDo(ctx, a, "CLUSTER", "NODES")
		if err == nil {
			return parseClusterNodes(s), nil
		}
		errs = append(errs, err)
	}
	return nil, fmt.Errorf("no cluster node answered: %w", errors.Join(errs...))
}

// waitHealthy waits until every node of the cluster says cluster_state:ok,
// there are at least wantMasters masters with slots, and every replica is
// linked to its master and done syncing.
func (f *ClusterFailover) waitHealthy(ctx context.Context, wantMasters int) ([]clusterNode, error) {
	ctx, cancel := context.WithTimeout(ctx, failoverHealthTimeout)
	defer cancel()
	var last error
	for {
		nodes, err := f.topology(ctx)
		if err == nil {
			err = healthy(ctx, nodes, wantMasters)
		}
		if err == nil {
			return nodes, nil
		}
		last = err
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("the cluster is not healthy after %v: %w", failoverHealthTimeout, last)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func healthy(ctx context.Context, nodes []clusterNode, wantMasters int) error {
	masters := 0
	for _, n := range nodes {
		if n.has("fail") || n.has("fail?") || n.has("handshake") || n.has("noaddr") {
			return fmt.Errorf("node %s is %s", n.addr, strings.Join(n.flags, ","))
		}
		info, err := nodeDo(ctx, n.addr, "CLUSTER", "INFO")
		if err != nil {
			return err
		}
		if !strings.Contains(info, "cluster_state:ok") {
			return fmt.Errorf("node %s: cluster_state is not ok", n.addr)
		}
		if n.master() {
			masters++
			continue
		}
		repl, err := nodeDo(ctx, n.addr, "INFO", "replication")
		if err != nil {
			return err
		}
		if !strings.Contains(repl, "master_link_status:up") || !strings.Contains(repl, "master_sync_in_progress:0") {
			return fmt.Errorf("replica %s is not in sync", n.addr)
		}
	}
	if masters < wantMasters {
		return fmt.Errorf("%d masters of %d", masters, wantMasters)
	}
	return nil
}

// waitRole waits until the node at addr reports role (master or slave).
func waitRole(ctx context.Context, addr, role string) error {
	ctx, cancel := context.WithTimeout(ctx, failoverHealthTimeout)
	defer cancel()
	for {
		s, err := nodeDo(ctx, addr, "INFO", "replication")
		if err == nil && strings.Contains(s, "role:"+role+"\r\n") {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s did not become %s within %v (last: %v)", addr, role, failoverHealthTimeout, err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// infoField returns the value of field in an INFO reply.
func infoField(info, field string) string {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			return v
		}
	}
	return ""
}

func nodePID(ctx context.Context, addr string) (int, error) {
	info, err := nodeDo(ctx, addr, "INFO", "server")
	if err != nil {
		return 0, err
	}
	pid, err := strconv.Atoi(infoField(info, "process_id"))
	if err != nil || pid <= 1 {
		return 0, fmt.Errorf("node %s: no process_id in INFO server", addr)
	}
	return pid, nil
}

// restartCommand returns the command that starts the node at addr again:
// its executable and config file, from INFO server. A node must be on this
// machine and started from a config file.
func restartCommand(ctx context.Context, addr string) ([]string, error) {
	if host, _, err := net.SplitHostPort(addr); err != nil || !net.ParseIP(host).IsLoopback() && host != "localhost" {
		return nil, fmt.Errorf("node %s is not on this machine: a killed master could not be restarted", addr)
	}
	info, err := nodeDo(ctx, addr, "INFO", "server")
	if err != nil {
		return nil, err
	}
	exe, conf := infoField(info, "executable"), infoField(info, "config_file")
	if exe == "" || conf == "" {
		return nil, fmt.Errorf("node %s was not started from a config file, so a killed master could not be restarted (start the cluster with scripts/redis-cluster.sh start --replicas)", addr)
	}
	// Redis derives executable from its working directory and argv[0], so
	// a node started as plain "redis-server" names a file that may not
	// exist: then the one on PATH.
	if _, err := os.Stat(exe); err != nil {
		if exe, err = exec.LookPath(filepath.Base(exe)); err != nil {
			return nil, fmt.Errorf("node %s: its executable is not found to restart it: %w", addr, err)
		}
	}
	return []string{exe, conf}, nil
}

// startNode starts a node again. A config file with daemonize yes makes
// the command return at once; otherwise the node runs as a child that is
// reaped when it exits.
func startNode(args []string) error {
	cmd := exec.Command(args[0], args[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("restart the killed node (%s): %w", strings.Join(args, " "), err)
	}
	go cmd.Wait()
	return nil
}

// nodeDo sends one command to one node (not through the cluster's
// routing) and returns its reply as text.
func nodeDo(ctx context.Context, addr string, args ...string) (string, error) {
	c, err := rueidis.NewClient(rueidis.ClientOption{
		InitAddress: []string{addr}, ForceSingleClient: true, DisableCache: true,
		Dialer: net.Dialer{Timeout: 2 * time.Second}, ConnWriteTimeout: 5 * time.Second,
	})
	if err != nil {
		return "", fmt.Errorf("node %s: %w", addr, err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	s, err := c.Do(ctx, c.B().Arbitrary(args...).Build()).ToString()
	if err != nil {
		return "", fmt.Errorf("node %s: %s: %w", addr, strings.Join(args, " "), err)
	}
	// Over RESP3, INFO and CLUSTER NODES are verbatim strings, which keep
	// their format tag.
	return strings.TrimPrefix(s, "txt:"), nil
}
