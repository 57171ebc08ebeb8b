package verify_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/internal/verify"
	"github.com/redis/rueidis"
)

// The layered store's --flush-every deletes this run's Redis keys and no
// others, without walking the keyspace: on a private Redis holding 200,000
// foreign keys (some under a prefix that starts like the run's), a run
// with flushes makes no SCAN, flushes (the durable store then catches
// duplicates the flushed keys no longer do), leaves every foreign key in
// place, and after Close none of its own. On the Redis Cluster the run's
// keys, in slots all over the nodes, are all gone after Close.
func TestLayeredFlushDeletesOnlyTheRunsKeys(t *testing.T) {
	t.Parallel()
	t.Run("single", func(t *testing.T) {
		t.Parallel()
		srv := testenv.StartRedis(t, "")
		const foreign = 200000
		srv.CLI("EVAL", `for i = 1, tonumber(ARGV[1]) do
	redis.call('SET', 'foreign:' .. i, 'x')
	if i % 100 == 0 then redis.call('SET', KEYS[1] .. i, 'y') end
end`, "1", "dedup-verify-", strconv.Itoa(foreign))
		near := foreign / 100
		c := client(t, srv.Addrs())
		prefix := fmt.Sprintf("dedup-verify-%016x:", rand.Uint64())
		rep, keys := flushRun(t, c, srv.Addrs()[0], prefix)
		if scans := commandCalls(t, srv, "scan"); scans != 0 {
			t.Errorf("%d SCANs: the flush walked the keyspace", scans)
		}
		if n := dbsize(t, c); n != foreign+near {
			t.Errorf("%d keys after Close, want the %d foreign ones (%d flushes, %d run keys)", n, foreign+near, rep.Flushes, len(keys))
		}
	})
	t.Run("cluster", func(t *testing.T) {
		t.Parallel()
		addrs := testenv.Addrs(t, "DEDUP_REDIS_CLUSTER_ADDRS", "127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002", "Redis Cluster")
		c := client(t, addrs)
		prefix := fmt.Sprintf("dedup-verify-%016x:", rand.Uint64())
		_, keys := flushRun(t, c, strings.Join(addrs, ","), prefix)
		left := 0
		for _, k := range append(keys, prefix+"keys") {
			n, err := c.Do(context.Background(), c.B().Exists().Key(k).Build()).AsInt64()
			if err != nil {
				t.Fatal(err)
			}
			left += int(n)
		}
		if left != 0 {
			t.Errorf("%d of the run's %d keys (and its set) left after Close", left, len(keys))
		}
	})
}

// flushRun runs verify on the layered store at addr with prefix, flushing
// every 150 deliveries, checks exactly once, and returns the report and
// the Redis keys the run wrote (read from its set before Close).
func flushRun(t *testing.T, c rueidis.Client, addr, prefix string) (verify.Report, []string) {
	t.Helper()
	b, _ := verify.LookupBackend("layered")
	cfg := stressConfig()
	tg, err := b.Open(t.Context(), verify.OpenOptions{Mode: b.Modes[0], Lease: cfg.Lease, Messages: cfg.Messages,
		FlushEvery: 150, Addr: addr, RedisPrefix: prefix, Path: filepath.Join(t.TempDir(), "verify.db")})
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	defer func() {
		if !closed {
			tg.Close()
		}
	}()
	rep := run(t, cfg, tg)
	requireExactlyOnce(t, cfg, rep)
	if rep.Flushes == 0 || rep.Layers["durable"] == 0 {
		t.Fatalf("%d flushes, durable caught %d: the flushes lost no key", rep.Flushes, rep.Layers["durable"])
	}
	keys, err := c.Do(context.Background(), c.B().Smembers().Key(prefix+"keys").Build()).AsStrSlice()
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) < cfg.Messages {
		t.Fatalf("the run's set holds %d keys, want at least one per message (%d)", len(keys), cfg.Messages)
	}
	closed = true
	if err := tg.Close(); err != nil {
		t.Fatal(err)
	}
	return rep, keys
}

func client(t *testing.T, addrs []string) rueidis.Client {
	t.Helper()
	c, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: addrs, DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

func dbsize(t *testing.T, c rueidis.Client) int {
	t.Helper()
	n, err := c.Do(context.Background(), c.B().Dbsize().Build()).AsInt64()
	if err != nil {
		t.Fatal(err)
	}
	return int(n)
}

// commandCalls returns how many times the server ran cmd.
func commandCalls(t *testing.T, srv *testenv.RedisServer, cmd string) int {
	t.Helper()
	for line := range strings.SplitSeq(srv.CLI("INFO", "commandstats"), "\n") {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_"+cmd+":calls="); ok {
			n, _ := strconv.Atoi(rest[:strings.IndexByte(rest, ',')])
			return n
		}
	}
	return 0
}
