package dedupotel_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/dedupotel"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/jackc/pgx/v5"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// With outbox.SetHeaderInjector(dedupotel.Inject), a message written in a
// business span carries that span's traceparent without the caller
// touching its headers; a message that has its own traceparent keeps it;
// outside a span nothing is added.
func TestOutboxWriterInjectsTraceparent(t *testing.T) {
	outbox.SetHeaderInjector(dedupotel.Inject)
	t.Cleanup(func() { outbox.SetHeaderInjector(nil) })
	tp := sdktrace.NewTracerProvider()
	defer tp.Shutdown(context.Background())

	s, err := sqlitestore.Open(filepath.Join(t.TempDir(), "app.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	if err := s.MigrateOutbox(ctx); err != nil {
		t.Fatal(err)
	}
	bctx, span := tp.Tracer("app").Start(ctx, "place order")
	defer span.End()
	callers := map[string]string{"x-tenant": "acme"}
	own := "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	write := func(ctx context.Context, msgs ...outbox.Message) {
		t.Helper()
		err := func() error {
			tx, err := s.DB().BeginTx(ctx, nil)
			if err != nil {
				return err
			}
			defer tx.Rollback()
			if err := s.WriteOutbox(ctx, tx, msgs...); err != nil {
				return err
			}
			return tx.Commit()
		}()
		if err != nil {
			t.Fatal(err)
		}
	}
	write(bctx,
		outbox.Message{ID: "in-span", Topic: "orders", Key: "o/1", Headers: callers},
		outbox.Message{ID: "own-trace", Topic: "orders", Key: "o/1", Headers: map[string]string{"traceparent": own}})
	write(ctx, outbox.Message{ID: "no-span", Topic: "orders", Key: "o/2"})

	headers := func(id string) map[string]string {
		t.Helper()
		var raw string
		if err := s.DB().QueryRow(`SELECT headers FROM dedup_records_outbox WHERE message_key = ?`, id).Scan(&raw); err != nil && err != sql.ErrNoRows {
			t.Fatal(err)
		}
		var h map[string]string
		if err := json.Unmarshal([]byte(raw), &h); err != nil {
			t.Fatal(err)
		}
		return h
	}
	traceID := span.SpanContext().TraceID().String()
	if h := headers("in-span"); !strings.Contains(h["traceparent"], traceID) || h["x-tenant"] != "acme" {
		t.Fatalf("in a span: headers %v, want the traceparent of trace %s and the caller's header", h, traceID)
	}
	if len(callers) != 1 {
		t.Fatalf("the caller's header map was changed: %v", callers)
	}
	if h := headers("own-trace"); h["traceparent"] != own {
		t.Fatalf("a message's own traceparent was replaced: %v", h)
	}
	if h := headers("no-span"); len(h) != 0 {
		t.Fatalf("outside a span: headers %v, want none", h)
	}
}

// consumer.NewApplyOutbox queues its handler's outgoing messages with the
// context given to Process: a message emitted while that context carries
// a span goes out with the span's traceparent (the trace continues from
// the message consumed to the one emitted); without a span nothing is
// added.
func TestApplyOutboxInjectsTraceparent(t *testing.T) {
	outbox.SetHeaderInjector(dedupotel.Inject)
	t.Cleanup(func() { outbox.SetHeaderInjector(nil) })
	tp := sdktrace.NewTracerProvider()
	defer tp.Shutdown(context.Background())

	pool := testenv.PostgresPool(t)
	s, err := pgstore.New(pool, pgstore.WithSchema(testenv.PostgresSchema(t, pool)))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	if _, err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	p, err := consumer.NewApplyOutbox("orders", s, s, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) (*pgx.Batch, []byte, []outbox.Message, error) {
		return &pgx.Batch{}, nil, []outbox.Message{{ID: consumer.OutboxID(m, 0), Topic: "orders.shipped", Key: m.ID}}, nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	sctx, span := tp.Tracer("app").Start(ctx, "consume order")
	defer span.End()
	for _, c := range []struct {
		ctx context.Context
		id  string
	}{{sctx, "in-span"}, {ctx, "no-span"}} {
		if d := p.Process(c.ctx, &consumer.Message{ID: c.id, Payload: []byte("{}")}); d.Action != consumer.Ack {
			t.Fatalf("Process(%s) = %+v", c.id, d)
		}
	}
	headers := func(id string) map[string]string {
		t.Helper()
		var h map[string]string
		if err := pool.QueryRow(ctx, `SELECT headers FROM `+s.Tables().Outbox+` WHERE message_key = $1`, id).Scan(&h); err != nil {
			t.Fatal(err)
		}
		return h
	}
	traceID := span.SpanContext().TraceID().String()
	if h := headers("in-span/out/0"); !strings.Contains(h["traceparent"], traceID) {
		t.Fatalf("emitted in a span: headers %v, want the traceparent of trace %s", h, traceID)
	}
	if h := headers("no-span/out/0"); len(h) != 0 {
		t.Fatalf("emitted outside a span: headers %v, want none", h)
	}
}
