package redisstore

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/redis/rueidis"
)

// TestClaimNoKeepAliveFrozenServerEnds: a store on a client whose
// keep-alive is off (Dialer.KeepAlive < 0: no PINGs), whose connection
// runs its goroutine pipeline (it had concurrent calls). A claim on a
// frozen server, its caller cancelled (no deadline): it ends at the
// store's call bound, the client's ConnWriteTimeout for a store from Open,
// WithCallTimeout for one from New; before the bound, rueidis had nothing
// to end it with (no PING detects the silent server) until the thaw.
func TestClaimNoKeepAliveFrozenServerEnds(t *testing.T) {
	for _, from := range []string{"open", "new"} {
		t.Run(from, func(t *testing.T) { testClaimNoKeepAliveFrozen(t, from) })
	}
}

func testClaimNoKeepAliveFrozen(t *testing.T, from string) {
	srv := testenv.StartRedis(t, "")
	g := startReplyGate(t, srv.Addrs()[0])
	const cwt = 300 * time.Millisecond
	opt := rueidis.ClientOption{InitAddress: g.addr(), PipelineMultiplex: -1, ConnWriteTimeout: cwt,
		DisableCache: true, Dialer: net.Dialer{KeepAlive: -1}}
	var s *Store
	if from == "open" {
		var err error
		if s, err = Open(opt); err != nil {
			t.Fatal(err)
		}
	} else {
		cl, err := rueidis.NewClient(opt)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(cl.Close)
		if s, err = New(cl, WithCallTimeout(cwt)); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { s.Close() })
	bg := context.Background()
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() {
			for range 20 {
				s.Ping(bg)
			}
		})
	}
	wg.Wait()
	key := dedup.Key{Scope: "rev1", ID: "noka"}
	g.reset()
	srv.Freeze()
	thawed := false
	defer func() {
		if !thawed {
			srv.Thaw()
		}
	}()
	ctx, cancel := context.WithCancel(bg)
	done := make(chan error, 1)
	go func() {
		_, err := s.Claim(ctx, key, dedup.FingerprintOf([]byte("p")), time.Minute)
		done <- err
	}()
	waitFor(t, "the claim to be sent", func() bool { return g.sent(s.RedisKey(key)) })
	cancel()
	select {
	case err := <-done:
		t.Logf("returned before the thaw: %v", err)
	case <-time.After(10 * cwt * 2):
		srv.Thaw()
		thawed = true
		err := <-done
		t.Fatalf("claim cancelled on a frozen server, client without keep-alive: still waiting %v after the cancel (ConnWriteTimeout %v); returned %v only after the thaw", 10*cwt*2, cwt, err)
	}
}
