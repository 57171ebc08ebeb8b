package layered_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/layered"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/dedupkit/dedup/redisstore"
	"github.com/dedupkit/dedup/storetest"
	"github.com/dedupkit/dedup/window"
	"github.com/redis/rueidis"
)

// TestConformanceRedisPostgres runs the whole contract, the history check
// included, over a window, the real Redis and the real PostgreSQL: the
// layers' round trips give concurrent calls real room to interleave
// between a claim's steps, which an in-memory stack does not (a review
// found a fingerprint bug that only this configuration showed).
func TestConformanceRedisPostgres(t *testing.T) {
	addrs := testenv.Addrs(t, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
	pool := testenv.PostgresPool(t)
	schema := testenv.PostgresSchema(t, pool)
	mig, err := pgstore.New(pool, pgstore.WithSchema(schema))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := mig.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	mig.Close()
	storetest.Run(t, func(t testing.TB, _ *storetest.Clock) dedup.Store {
		fast, err := redisstore.Open(rueidis.ClientOption{InitAddress: addrs},
			redisstore.WithPrefix(fmt.Sprintf("layered-conf-%016x:", rand.Uint64())))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { fast.Close() })
		durable, err := pgstore.New(pool, pgstore.WithSchema(schema))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { durable.Close() })
		return newLayered(t, layered.WithWindow(win(t, window.WithCapacity(4096))),
			layered.WithFast(fast, "redis"), layered.WithDurable(durable, "postgres"))
	}, storetest.Features{Extend: true})
}
