package consumer_test

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"testing"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/sqlitestore"
)

func openInbox(t *testing.T) *sqlitestore.Store {
	t.Helper()
	s, err := sqlitestore.Open(filepath.Join(t.TempDir(), "inbox.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if _, err := s.DB().Exec(`CREATE TABLE ledger (id TEXT PRIMARY KEY, note TEXT)`); err != nil {
		t.Fatal(err)
	}
	return s
}

func ledger(t *testing.T, s *sqlitestore.Store) map[string]string {
	t.Helper()
	rows, err := s.DB().Query(`SELECT id, note FROM ledger`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]string{}
	for rows.Next() {
		var id, note string
		if err := rows.Scan(&id, &note); err != nil {
			t.Fatal(err)
		}
		out[id] = note
	}
	return out
}

func TestInboxAppliesInTheSameTransaction(t *testing.T) {
	s := openInbox(t)
	dlq := &consumer.MemoryDLQ{}
	fail := errors.New("downstream write failed")
	p, err := consumer.NewInbox("ledger", s, func(ctx context.Context, tx *sql.Tx, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if _, err := tx.ExecContext(ctx, `INSERT INTO ledger VALUES (?, ?)`, m.ID, string(m.Payload)); err != nil {
			return nil, err
		}
		switch m.Headers["do"] {
		case "fail":
			return nil, consumer.Transient(fail) // after writing: must roll back
		case "reject":
			return nil, consumer.Reject(errors.New("over limit"), []byte("declined"))
		}
		return []byte("applied"), nil
	}, consumer.WithDeadLetter(dlq))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()

	d := p.Process(ctx, msg("a"))
	want(t, d, consumer.Ack)
	if string(d.Result) != "applied" {
		t.Fatalf("result %q", d.Result)
	}
	d = p.Process(ctx, msg("a"))
	if !d.Duplicate || string(d.Result) != "applied" {
		t.Fatalf("redelivery %+v, want a duplicate with the stored result", d)
	}

	failing := msg("b")
	failing.Headers = map[string]string{"do": "fail"}
	d = p.Process(ctx, failing)
	want(t, d, consumer.Retry)
	if !errors.Is(d.Err, fail) {
		t.Fatalf("error %v", d.Err)
	}
	if _, ok := ledger(t, s)["b"]; ok {
		t.Fatal("a failed message's write was committed")
	}
	want(t, p.Process(ctx, msg("b")), consumer.Ack) // redelivered, now fine

	rej := msg("c")
	rej.Headers = map[string]string{"do": "reject"}
	d = p.Process(ctx, rej)
	want(t, d, consumer.Rejected)
	if string(d.Result) != "declined" {
		t.Fatalf("rejection result %q", d.Result)
	}
	d = p.Process(ctx, rej)
	if !d.Duplicate || string(d.Result) != "declined" {
		t.Fatalf("redelivered rejection %+v, want a duplicate of the recorded rejection", d)
	}
	got := ledger(t, s)
	if len(got) != 3 {
		t.Fatalf("ledger %v, want a, b and c once each", got)
	}
}

func TestInboxPanicRollsBackAndCounts(t *testing.T) {
	s := openInbox(t)
	p, err := consumer.NewInbox("ledger", s, func(ctx context.Context, tx *sql.Tx, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if _, err := tx.ExecContext(ctx, `INSERT INTO ledger VALUES (?, 'x')`, m.ID); err != nil {
			return nil, err
		}
		panic("bug")
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}), consumer.WithLimits(consumer.Limits{Permanent: 2}))
	if err != nil {
		t.Fatal(err)
	}
	want(t, p.Process(context.Background(), msg("p")), consumer.Retry)
	want(t, p.Process(context.Background(), msg("p")), consumer.DeadLettered)
	if n := len(ledger(t, s)); n != 0 {
		t.Fatalf("%d ledger rows after panics, want 0", n)
	}
}

// TestInboxProcessBatchFallsBackToProcess: an inbox's transaction is per
// message, so ProcessBatch processes each message as Process does.
func TestInboxProcessBatchFallsBackToProcess(t *testing.T) {
	s := openInbox(t)
	p, err := consumer.NewInbox("ledger", s, func(ctx context.Context, tx *sql.Tx, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if _, err := tx.ExecContext(ctx, `INSERT INTO ledger VALUES (?, ?)`, m.ID, string(m.Payload)); err != nil {
			return nil, err
		}
		if m.ID == "bad" {
			return nil, consumer.Transient(errors.New("after the write"))
		}
		return []byte("applied"), nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	ds := p.ProcessBatch(context.Background(), []*consumer.Message{msg("a"), msg("bad"), msg("a"), msg("b")})
	for i, w := range []consumer.Action{consumer.Ack, consumer.Retry, consumer.Ack, consumer.Ack} {
		want(t, ds[i], w)
	}
	if !ds[2].Duplicate || ds[1].Class != consumer.ClassTransient {
		t.Fatalf("decisions %+v", ds)
	}
	if got := ledger(t, s); len(got) != 2 || got["a"] == "" || got["b"] == "" {
		t.Fatalf("ledger %v, want a and b once each", got)
	}
}
