package redisstore_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/redisstore"
	"github.com/redis/rueidis"
)

// Open a store on a Redis server (several InitAddress entries of a cluster
// make a cluster client), claim, and complete. It needs a running server,
// so it has no checked output; TestConformance runs the same calls against
// one.
func Example() {
	ctx := context.Background()
	store, err := redisstore.Open(rueidis.ClientOption{InitAddress: []string{"127.0.0.1:6379"}},
		redisstore.WithPrefix("payments:"))
	if err != nil {
		log.Fatalf("open the Redis store: %v", err)
	}
	defer store.Close()

	key, _ := dedup.NewKey("payments", "msg-1")
	c, err := store.Claim(ctx, key, dedup.FingerprintOf([]byte(`{"amount":100}`)), 30*time.Second)
	if err != nil {
		// A store error: the claim's outcome is unknown, so nack and let
		// the redelivery claim again.
		log.Fatal(err)
	}
	switch c.Outcome {
	case dedup.Acquired:
		// Apply the effect, then record it for a day.
		if err := store.Complete(ctx, c, []byte("pay_1"), 24*time.Hour); err != nil {
			log.Fatal(err)
		}
	case dedup.Duplicate:
		fmt.Println("already applied:", string(c.Result))
	case dedup.InProgress:
		fmt.Println("another consumer holds it until", c.LeaseUntil)
	}
}
