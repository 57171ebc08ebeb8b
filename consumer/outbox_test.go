package consumer_test

import (
	"context"
	"database/sql"
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/outbox"
	"github.com/jackc/pgx/v5"
)

// The bridge on SQLite: the inbox record, the business write and the
// outgoing message commit together; a duplicate emits nothing; a failure
// after writing emits nothing; an invalid outgoing message is permanent.
func TestInboxOutboxSQLite(t *testing.T) {
	s := openInbox(t)
	ctx := context.Background()
	if err := s.MigrateOutbox(ctx); err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	p, err := consumer.NewInboxOutbox("ledger", s, s, func(ctx context.Context, tx *sql.Tx, m *consumer.Message, d consumer.Delivery) ([]byte, []outbox.Message, error) {
		runs.Add(1)
		if _, err := tx.ExecContext(ctx, `INSERT INTO ledger VALUES (?, ?)`, m.ID, "x"); err != nil {
			return nil, nil, err
		}
		out := []outbox.Message{{ID: consumer.OutboxID(m, 0), Topic: "ledger.written", Key: m.ID, Payload: m.Payload}}
		switch m.Headers["do"] {
		case "fail":
			return nil, out, consumer.Transient(errors.New("after writing"))
		case "bad":
			out[0].Topic = "not a topic"
		}
		return []byte("ok"), out, nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	rows := func(id string) int {
		var n int
		s.DB().QueryRow(`SELECT count(*) FROM dedup_records_outbox WHERE message_key = ?`, id).Scan(&n)
		return n
	}
	want(t, p.Process(ctx, msg("a")), consumer.Ack)
	if d := p.Process(ctx, msg("a")); !d.Duplicate {
		t.Fatalf("redelivery %+v", d)
	}
	if rows("a/out/0") != 1 || runs.Load() != 1 {
		t.Fatalf("%d outbox rows, %d runs; want 1 and 1", rows("a/out/0"), runs.Load())
	}
	failing := msg("b")
	failing.Headers = map[string]string{"do": "fail"}
	want(t, p.Process(ctx, failing), consumer.Retry)
	if rows("b/out/0") != 0 || ledger(t, s)["b"] != "" {
		t.Fatal("a failed delivery committed its outgoing message or its write")
	}
	bad := msg("c")
	bad.Headers = map[string]string{"do": "bad"}
	if d := p.Process(ctx, bad); d.Class != consumer.ClassPermanent || !errors.Is(d.Err, dedup.ErrInvalidArgument) {
		t.Fatalf("invalid outgoing message: %+v", d)
	}
	if ledger(t, s)["c"] != "" {
		t.Fatal("the write of a message with an invalid outgoing message committed")
	}
}

// The bridge on PostgreSQL, both forms, with concurrent deliveries of the
// same messages: each message's outgoing event is written exactly once.
func TestBridgePostgres(t *testing.T) {
	s, ledgerTable := openApply(t)
	ctx := context.Background()
	inbox, err := consumer.NewInboxOutbox("inbox", s, s, func(ctx context.Context, tx pgx.Tx, m *consumer.Message, d consumer.Delivery) ([]byte, []outbox.Message, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO `+ledgerTable+` VALUES ($1, 1)`, m.ID); err != nil {
			return nil, nil, err
		}
		return nil, []outbox.Message{{ID: consumer.OutboxID(m, 0), Topic: "ledger.written", Key: m.ID}}, nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	apply, err := consumer.NewApplyOutbox("apply", s, s, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) (*pgx.Batch, []byte, []outbox.Message, error) {
		b := &pgx.Batch{}
		b.Queue(`INSERT INTO `+ledgerTable+` VALUES ($1, 2)`, m.ID)
		return b, nil, []outbox.Message{{ID: consumer.OutboxID(m, 0), Topic: "ledger.applied", Key: m.ID},
			{ID: consumer.OutboxID(m, 1), Topic: "ledger.applied", Key: m.ID}}, nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for range 8 {
		for _, id := range []string{"m1", "m2", "m3"} {
			wg.Go(func() { inbox.Process(ctx, msg("in-"+id)) })
			wg.Go(func() { apply.Process(ctx, msg("ap-"+id)) })
		}
	}
	wg.Wait()
	// Deliveries that found the key in progress were retried by nobody:
	// deliver once more, as a broker would.
	for _, id := range []string{"m1", "m2", "m3"} {
		inbox.Process(ctx, msg("in-"+id))
		apply.Process(ctx, msg("ap-"+id))
	}
	count := func(where string) int {
		var n int
		if err := s.Pool().QueryRow(ctx, `SELECT count(*) FROM `+s.Tables().Outbox+` WHERE `+where).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := count(`topic = 'ledger.written'`); n != 3 {
		t.Fatalf("inbox form: %d outgoing rows, want 3", n)
	}
	if n := count(`topic = 'ledger.applied'`); n != 6 {
		t.Fatalf("apply form: %d outgoing rows, want 6", n)
	}
	for _, id := range []string{"in-m1", "ap-m2"} {
		if ledgerRows(t, s, ledgerTable, id) != 1 {
			t.Fatalf("%s applied %d times", id, ledgerRows(t, s, ledgerTable, id))
		}
	}
	if _, err := consumer.NewApplyOutbox[*pgx.Batch]("x", s, nil, nil, consumer.WithDeadLetter(&consumer.MemoryDLQ{})); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Fatalf("nil queuer: %v", err)
	}
}
