package consumer

import (
	"context"
	"errors"
	"strconv"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/outbox"
)

// The atomic bridge: a consumer that applies a message and emits others
// commits the inbox record, its business writes and the outgoing outbox
// rows in one local transaction. A duplicate delivery runs nothing and so
// emits nothing; a rollback emits nothing; the relay (package outbox)
// publishes what committed, under the IDs written here.

// An OutboxWriter writes outgoing messages in the caller's transaction:
// pgstore.Store (Tx = pgx.Tx) and sqlitestore.Store (Tx = *sql.Tx) are
// OutboxWriters.
type OutboxWriter[Tx any] interface {
	WriteOutbox(ctx context.Context, tx Tx, msgs ...outbox.Message) error
}

// A BridgeHandler applies one message inside the inbox's transaction and
// returns its result and the messages to emit. Give each outgoing
// message a stable ID derived from the incoming one ([OutboxID]) so that
// logs and traces join up; only one delivery's messages ever commit.
type BridgeHandler[Tx any] func(ctx context.Context, tx Tx, m *Message, d Delivery) (result []byte, out []outbox.Message, err error)

// NewInboxOutbox is [NewInbox] whose handler also returns outgoing
// messages: they are written with w in the same transaction after h
// succeeds, so they commit with the record and h's writes, or not at all.
// A business rejection ([Reject]) commits the rejection without them.
// An invalid outgoing message is a permanent failure of the message
// ([Permanent]): retrying cannot fix it.
func NewInboxOutbox[Tx any](name string, inbox Inbox[Tx], w OutboxWriter[Tx], h BridgeHandler[Tx], opts ...Option) (*Processor, error) {
	if any(w) == nil {
		return nil, &dedup.ArgumentError{Arg: "outbox writer", Reason: "is nil"}
	}
	if h == nil {
		return nil, &dedup.ArgumentError{Arg: "handler", Reason: "is nil"}
	}
	return NewInbox(name, inbox, func(ctx context.Context, tx Tx, m *Message, d Delivery) ([]byte, error) {
		res, out, err := h(ctx, tx, m, d)
		if err != nil || len(out) == 0 {
			return res, err
		}
		if err := w.WriteOutbox(ctx, tx, out...); err != nil {
			return nil, bridgeError(err)
		}
		return res, nil
	}, opts...)
}

// An OutboxQueuer queues outgoing messages on the writes of an [Applier],
// adding to each the trace headers of ctx when an
// [outbox.SetHeaderInjector] is set: pgstore.Store (W = *pgx.Batch) is
// one.
type OutboxQueuer[W any] interface {
	QueueOutboxContext(ctx context.Context, writes W, msgs ...outbox.Message) error
}

// A WritesBridgeHandler is a [WritesHandler] that also returns the
// messages to emit.
type WritesBridgeHandler[W any] func(ctx context.Context, m *Message, d Delivery) (writes W, result []byte, out []outbox.Message, err error)

// NewApplyOutbox is [NewApply] whose handler also returns outgoing
// messages: they are queued with q on its writes, so the applier commits
// them with the record and the writes in its one step (for pgstore, one
// round trip), with the trace headers of the handler's context (the one
// given to Process) as [NewInboxOutbox] adds them. writes must not be nil
// when out is not empty. An invalid outgoing message is a permanent
// failure of the message.
func NewApplyOutbox[W any](name string, ap Applier[W], q OutboxQueuer[W], h WritesBridgeHandler[W], opts ...Option) (*Processor, error) {
	if any(q) == nil {
		return nil, &dedup.ArgumentError{Arg: "outbox queuer", Reason: "is nil"}
	}
	if h == nil {
		return nil, &dedup.ArgumentError{Arg: "handler", Reason: "is nil"}
	}
	return NewApply(name, ap, func(ctx context.Context, m *Message, d Delivery) (W, []byte, error) {
		writes, res, out, err := h(ctx, m, d)
		if err != nil || len(out) == 0 {
			return writes, res, err
		}
		if err := q.QueueOutboxContext(ctx, writes, out...); err != nil {
			var none W
			return none, nil, bridgeError(err)
		}
		return writes, res, nil
	}, opts...)
}

// OutboxID returns a stable ID for the n-th message emitted while
// applying m: m.ID, "/out/", n.
func OutboxID(m *Message, n int) string {
	return m.ID + "/out/" + strconv.Itoa(n)
}

func bridgeError(err error) error {
	if errors.Is(err, dedup.ErrInvalidArgument) {
		return Permanent(err)
	}
	return err
}
