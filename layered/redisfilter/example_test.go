package redisfilter_test

import (
	"context"
	"fmt"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/layered"
	"github.com/dedupkit/dedup/layered/redisfilter"
	"github.com/dedupkit/dedup/window"
	"github.com/redis/rueidis"
)

// A window and the Redis filter in front of a durable inbox step (here a
// stand-in for pgstore's Apply): the filter is only read on a window
// miss and written after the durable step recorded the key.
func Example() {
	filter, err := redisfilter.Open(rueidis.ClientOption{InitAddress: []string{"127.0.0.1:6379"}})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer filter.Close()
	w, _ := window.New()
	lay, err := layered.New(layered.WithWindow(w), layered.WithFilter(filter, "redis"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer lay.Close() // sends the filter writes still queued
	key := dedup.Key{Scope: "payments", ID: "evt-1"}
	c, err := lay.RunInbox(context.Background(), key, "", 24*time.Hour, func(ctx context.Context) (dedup.Claim, error) {
		// return pg.Apply(ctx, key, "", 24*time.Hour, nil, &writes)
		return dedup.Claim{Key: key, Outcome: dedup.Acquired}, nil
	})
	fmt.Println(c.Outcome, err)
}
