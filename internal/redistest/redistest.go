// Package redistest opens redisstore stores for the tests of the packages
// that run over one (consumer, dedupnats, dedupkafka): on the server
// named by DEDUP_REDIS_ADDR (default 127.0.0.1:6379), under a prefix of
// the test's own, whose keys are deleted when the test ends. It lives
// apart from internal/testenv so that testenv does not import redisstore.
package redistest

import (
	"context"
	"testing"

	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/redisstore"
	"github.com/redis/rueidis"
)

// Store opens a redisstore under prefix, skipping (or failing, with
// DEDUP_REQUIRE_SERVICES=1) when no Redis answers. The store is closed and
// every key under prefix deleted in the test's cleanup.
func Store(t testing.TB, prefix string, opts ...redisstore.Option) *redisstore.Store {
	t.Helper()
	addrs := testenv.Addrs(t, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
	s, err := redisstore.Open(rueidis.ClientOption{InitAddress: addrs}, append([]redisstore.Option{redisstore.WithPrefix(prefix)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		c := s.Client()
		keys, _ := c.Do(ctx, c.B().Keys().Pattern(prefix+"*").Build()).AsStrSlice()
		if len(keys) > 0 {
			c.Do(ctx, c.B().Del().Key(keys...).Build())
		}
		s.Close()
	})
	return s
}
