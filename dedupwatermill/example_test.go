package dedupwatermill_test

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/dedupkit/dedup/dedupwatermill"
	"github.com/dedupkit/dedup/memstore"
)

// A router whose handler charges once per message, whatever the broker
// redelivers: the package doc's order of middlewares.
func Example() {
	store, err := memstore.New() // or sqlitestore, redisstore, pgstore
	if err != nil {
		panic(err)
	}
	defer store.Close()
	mw, err := dedupwatermill.New(store, "billing")
	if err != nil {
		panic(err)
	}
	pubSub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	poison, err := middleware.PoisonQueueWithFilter(pubSub, "poison", dedupwatermill.ShouldPoison)
	if err != nil {
		panic(err)
	}
	retry := middleware.Retry{MaxRetries: 5, InitialInterval: 100 * time.Millisecond}
	router.AddMiddleware(poison, retry.Middleware, mw.Middleware)

	charges := 0
	router.AddNoPublisherHandler("charge", "payments", pubSub, func(msg *message.Message) error {
		charges++ // the effect: runs once per message UUID
		return nil
	})
	go router.Run(context.Background())
	<-router.Running()

	msg := message.NewMessage("payment-7", []byte(`{"amount":1999}`))
	for range 3 { // the broker delivers it three times
		if err := pubSub.Publish("payments", msg.Copy()); err != nil {
			panic(err)
		}
	}
	router.Close()
	mw.Close() // after the router: completes what was acked
	pubSub.Close()
	fmt.Println("charges:", charges, "duplicates:", mw.Stats().Duplicates)
	// Output: charges: 1 duplicates: 2
}
