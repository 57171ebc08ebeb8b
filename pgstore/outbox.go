package pgstore

import (
	"context"
	"database/sql"
	"encoding/json"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/outbox"
	"github.com/jackc/pgx/v5"
)

// The outbox writers. Each validates every message before any I/O (an
// [*dedup.ArgumentError] names the first bad one, and nothing is
// written), fills an empty ID once with [outbox.NewID], and writes in the
// caller's transaction: the messages commit with the business write, or
// not at all. None opens a transaction of its own.

// outboxInsert returns the INSERT of one outbox row.
func (s *Store) outboxInsert() string {
	return `INSERT INTO ` + s.names.outbox + ` (message_key, aggregate, topic, payload, headers)
VALUES ($1::text, $2::text, $3::text, $4::bytea, $5::text::jsonb)`
}

// withContext prepares a message with the trace headers of ctx
// ([outbox.SetHeaderInjector]).
func withContext(ctx context.Context) func(*outbox.Message) error {
	return func(m *outbox.Message) error { return outbox.PrepareContext(ctx, m) }
}

// outboxArgs validates msgs and fills their empty IDs with prepare, and
// returns the arguments of their INSERTs.
func outboxArgs(prepare func(*outbox.Message) error, msgs []outbox.Message) ([][]any, error) {
	all := make([][]any, len(msgs))
	for i := range msgs {
		m := &msgs[i]
		if err := prepare(m); err != nil {
			return nil, err
		}
		headers := "{}"
		if len(m.Headers) > 0 {
			b, err := json.Marshal(m.Headers)
			if err != nil {
				return nil, &dedup.ArgumentError{Arg: "message headers", Reason: err.Error()}
			}
			headers = string(b)
		}
		payload := m.Payload
		if payload == nil {
			payload = []byte{}
		}
		all[i] = []any{m.ID, m.Key, m.Topic, payload, headers}
	}
	return all, nil
}

// WriteOutbox writes msgs to the outbox table in the caller's transaction
// tx, in one round trip. An empty ID is filled in msgs (the caller's
// slice) before the write, so the caller can log the IDs, and the trace
// headers of ctx are added when an [outbox.HeaderInjector] is set
// ([outbox.SetHeaderInjector]). Errors: an
// [*dedup.ArgumentError] before any I/O; a [*dedup.StoreError] when the
// write failed (the caller's transaction is then aborted, as after any
// failed statement: roll it back).
func (s *Store) WriteOutbox(ctx context.Context, tx pgx.Tx, msgs ...outbox.Message) error {
	if tx == nil {
		return &dedup.ArgumentError{Arg: "transaction", Reason: "is nil"}
	}
	all, err := outboxArgs(withContext(ctx), msgs)
	if err != nil {
		return err
	}
	if err := s.begin(ctx, "outbox"); err != nil || len(all) == 0 {
		return err
	}
	if len(all) == 1 {
		if _, err := tx.Exec(ctx, s.outboxInsert(), all[0]...); err != nil {
			return s.fail(ctx, "outbox", err, false)
		}
		return nil
	}
	var b pgx.Batch
	for _, args := range all {
		b.Queue(s.outboxInsert(), args...)
	}
	if err := tx.SendBatch(ctx, &b).Close(); err != nil {
		return s.fail(ctx, "outbox", err, false)
	}
	return nil
}

// WriteOutboxSQL is [Store.WriteOutbox] for a database/sql transaction
// (pgx's stdlib driver): one statement per message.
func (s *Store) WriteOutboxSQL(ctx context.Context, tx *sql.Tx, msgs ...outbox.Message) error {
	if tx == nil {
		return &dedup.ArgumentError{Arg: "transaction", Reason: "is nil"}
	}
	all, err := outboxArgs(withContext(ctx), msgs)
	if err != nil {
		return err
	}
	if err := s.begin(ctx, "outbox"); err != nil {
		return err
	}
	for _, args := range all {
		if _, err := tx.ExecContext(ctx, s.outboxInsert(), args...); err != nil {
			return s.fail(ctx, "outbox", err, false)
		}
	}
	return nil
}

// QueueOutbox queues the INSERTs of msgs on b, for [Store.Apply]: the
// outbox rows then commit with the claim and the other writes in Apply's
// one round trip. It does no I/O; a bad message is an
// [*dedup.ArgumentError] and nothing is queued. It has no context, so no
// trace headers are added: see [Store.QueueOutboxContext].
func (s *Store) QueueOutbox(b *pgx.Batch, msgs ...outbox.Message) error {
	return s.queueOutbox(outbox.Prepare, b, msgs)
}

// QueueOutboxContext is [Store.QueueOutbox] that also adds the trace
// headers of ctx to each message ([outbox.SetHeaderInjector]).
func (s *Store) QueueOutboxContext(ctx context.Context, b *pgx.Batch, msgs ...outbox.Message) error {
	return s.queueOutbox(withContext(ctx), b, msgs)
}

func (s *Store) queueOutbox(prepare func(*outbox.Message) error, b *pgx.Batch, msgs []outbox.Message) error {
	if b == nil {
		return &dedup.ArgumentError{Arg: "batch", Reason: "is nil"}
	}
	all, err := outboxArgs(prepare, msgs)
	if err != nil {
		return err
	}
	for _, args := range all {
		b.Queue(s.outboxInsert(), args...)
	}
	return nil
}

// OutboxChannel is the LISTEN channel the outbox table's trigger notifies
// after each statement that writes rows: the schema name, a dot, the
// table's name.
func (s *Store) OutboxChannel() string {
	return s.names.schemaName + "." + s.names.prefix + "outbox"
}

// saturating converts d to microseconds for SQL, clamped to a century so
// that "forever" never overflows into the past.
func saturating(d time.Duration) int64 {
	const century = 100 * 365 * 24 * time.Hour
	return micros(min(max(d, -century), century))
}

// An OutboxMessage is one outgoing message in the form of the first
// outbox API; [outbox.Message] is the current one.
type OutboxMessage struct {
	// Key is the stable ID of the logical event (outbox.Message.ID).
	// Empty: one is drawn once, when the row is written.
	Key string
	// Aggregate is the aggregate key (outbox.Message.Key): the unit of
	// ordering and partitioning.
	Aggregate string
	// Topic is where the relay publishes it. Required.
	Topic string
	// Payload is the message body.
	Payload []byte
	// Headers are published with the message.
	Headers map[string]string
}

func convertOutbox(msgs []OutboxMessage) []outbox.Message {
	out := make([]outbox.Message, len(msgs))
	for i, m := range msgs {
		out[i] = outbox.Message{ID: m.Key, Key: m.Aggregate, Topic: m.Topic, Payload: m.Payload, Headers: m.Headers}
	}
	return out
}

// EnqueueOutbox is [Store.WriteOutbox] for messages of the first outbox
// API.
func (s *Store) EnqueueOutbox(ctx context.Context, tx pgx.Tx, msgs ...OutboxMessage) error {
	return s.WriteOutbox(ctx, tx, convertOutbox(msgs)...)
}

// EnqueueOutboxSQL is [Store.WriteOutboxSQL] for messages of the first
// outbox API.
func (s *Store) EnqueueOutboxSQL(ctx context.Context, tx *sql.Tx, msgs ...OutboxMessage) error {
	return s.WriteOutboxSQL(ctx, tx, convertOutbox(msgs)...)
}
