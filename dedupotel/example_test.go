package dedupotel_test

import (
	"context"
	"fmt"

	"github.com/dedupkit/dedup/dedupotel"
	"github.com/dedupkit/dedup/outbox"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// The producer stores its trace context with the outbox message, inside
// the business transaction's span.
func ExampleInject() {
	tp := sdktrace.NewTracerProvider()
	defer tp.Shutdown(context.Background())
	ctx, span := tp.Tracer("shop").Start(context.Background(), "place order")
	defer span.End()

	msg := outbox.Message{ID: "order-42-placed", Topic: "orders.placed", Key: "order/42"}
	msg.Headers = dedupotel.Inject(ctx, msg.Headers)
	// ... write msg with the outbox writer in the same transaction.

	fmt.Println(len(msg.Headers["traceparent"]))
	// Output: 55
}
