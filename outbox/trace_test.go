package outbox_test

import (
	"context"
	"testing"

	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
)

type traceKey struct{}

// The process's header injector is applied by the PostgreSQL writers that
// are given a context (WriteOutbox, QueueOutboxContext), never to a
// message with its own traceparent, and not by QueueOutbox (no context).
// The injector here acts only on contexts carrying traceKey, so the
// package's other tests, running in parallel, are untouched.
func TestHeaderInjectorOnPostgresWriters(t *testing.T) {
	outbox.SetHeaderInjector(func(ctx context.Context, h map[string]string) map[string]string {
		tp, _ := ctx.Value(traceKey{}).(string)
		if tp == "" {
			return h
		}
		if h == nil {
			h = map[string]string{}
		}
		h["traceparent"] = tp
		return h
	})
	t.Cleanup(func() { outbox.SetHeaderInjector(nil) })
	r := newRig(t, pgstore.WithOutboxPartitions(1))
	ctx := context.WithValue(context.Background(), traceKey{}, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	err := pgx.BeginFunc(ctx, r.s.Pool(), func(tx pgx.Tx) error {
		if err := r.s.WriteOutbox(ctx, tx, msg("written", "a"), outbox.Message{ID: "own", Topic: "t", Headers: map[string]string{"traceparent": "mine"}}); err != nil {
			return err
		}
		var b pgx.Batch
		if err := r.s.QueueOutboxContext(ctx, &b, msg("queued-ctx", "a")); err != nil {
			return err
		}
		if err := r.s.QueueOutbox(&b, msg("queued", "a")); err != nil {
			return err
		}
		return tx.SendBatch(ctx, &b).Close()
	})
	if err != nil {
		t.Fatal(err)
	}
	for id, want := range map[string]string{"written": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		"queued-ctx": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "own": "mine", "queued": ""} {
		var got string
		if err := r.s.Pool().QueryRow(ctx, `SELECT COALESCE(headers->>'traceparent', '') FROM `+r.s.Tables().Outbox+` WHERE message_key = $1`, id).Scan(&got); err != nil {
			t.Fatal(id, err)
		}
		if got != want {
			t.Errorf("%s: traceparent %q, want %q", id, got, want)
		}
	}
}
