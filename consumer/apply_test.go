package consumer_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
)

// openApply returns a pgstore in a fresh schema on the real PostgreSQL,
// with a ledger table whose amount must stay positive.
func openApply(t *testing.T) (*pgstore.Store, string) {
	t.Helper()
	pool := testenv.PostgresPool(t)
	s, err := pgstore.New(pool, pgstore.WithSchema(testenv.PostgresSchema(t, pool)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if _, err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	ledger := s.Tables().Schema + ".ledger"
	if _, err := pool.Exec(context.Background(), `CREATE TABLE `+ledger+` (id text NOT NULL, amount int NOT NULL CHECK (amount > 0))`); err != nil {
		t.Fatal(err)
	}
	return s, ledger
}

func ledgerRows(t *testing.T, s *pgstore.Store, ledger, id string) int {
	t.Helper()
	var n int
	if err := s.Pool().QueryRow(context.Background(), `SELECT count(*) FROM `+ledger+` WHERE id = $1`, id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestApplyProcessor: through NewApply on pgstore, a message's queued
// write commits once with its record; redeliveries are duplicates with the
// stored result; a write that fails (a CHECK) is a retry with nothing
// recorded, and the fixed redelivery applies; a rejection is recorded
// without the writes; a handler failure sends nothing.
func TestApplyProcessor(t *testing.T) {
	s, ledger := openApply(t)
	amount := map[string]int{"a": 10, "bad": -1, "rej": 5, "fail": 1}
	var mu sync.Mutex
	p, err := consumer.NewApply("ledger", s, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) (*pgx.Batch, []byte, error) {
		mu.Lock()
		n := amount[m.ID]
		mu.Unlock()
		switch m.Headers["do"] {
		case "reject":
			return nil, nil, consumer.Reject(errors.New("over limit"), []byte("declined"))
		case "fail":
			return nil, nil, consumer.Transient(errors.New("cannot build the writes"))
		}
		var w pgx.Batch
		w.Queue(`INSERT INTO `+ledger+` (id, amount) VALUES ($1, $2)`, m.ID, n)
		return &w, []byte("ok:" + m.ID), nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()

	d := p.Process(ctx, msg("a"))
	want(t, d, consumer.Ack)
	if string(d.Result) != "ok:a" || d.Duplicate {
		t.Fatalf("first delivery %+v", d)
	}
	for range 3 {
		if d := p.Process(ctx, msg("a")); !d.Duplicate || string(d.Result) != "ok:a" {
			t.Fatalf("redelivery %+v, want a duplicate with the stored result", d)
		}
	}
	if n := ledgerRows(t, s, ledger, "a"); n != 1 {
		t.Fatalf("%d ledger rows for a, want 1", n)
	}

	d = p.Process(ctx, msg("bad"))
	want(t, d, consumer.Retry)
	if d.Err == nil || ledgerRows(t, s, ledger, "bad") != 0 {
		t.Fatalf("a failing write: %+v with %d rows", d, ledgerRows(t, s, ledger, "bad"))
	}
	mu.Lock()
	amount["bad"] = 3
	mu.Unlock()
	want(t, p.Process(ctx, msg("bad")), consumer.Ack)

	rej := msg("rej")
	rej.Headers = map[string]string{"do": "reject"}
	want(t, p.Process(ctx, rej), consumer.Rejected)
	if d := p.Process(ctx, msg("rej")); !d.Duplicate || string(d.Result) != "declined" {
		t.Fatalf("redelivered rejection %+v, want a duplicate of the recorded rejection", d)
	}
	if n := ledgerRows(t, s, ledger, "rej"); n != 0 {
		t.Fatalf("a rejection wrote %d ledger rows", n)
	}

	fail := msg("fail")
	fail.Headers = map[string]string{"do": "fail"}
	want(t, p.Process(ctx, fail), consumer.Retry)
	want(t, p.Process(ctx, msg("fail")), consumer.Ack)
	if n := ledgerRows(t, s, ledger, "fail"); n != 1 {
		t.Fatalf("%d ledger rows for fail, want 1", n)
	}
	if st := p.Stats(); st.Applied != 3 || st.Rejected != 1 || st.Duplicates != 4 || st.StoreErrors != 0 {
		t.Fatalf("stats %+v", st)
	}
}

// oneRowProcessor applies each message as one ledger row.
func oneRowProcessor(t *testing.T, s *pgstore.Store, ledger string) *consumer.Processor {
	t.Helper()
	p, err := consumer.NewApply("ledger", s, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) (*pgx.Batch, []byte, error) {
		var w pgx.Batch
		w.Queue(`INSERT INTO `+ledger+` (id, amount) VALUES ($1, 1)`, m.ID)
		return &w, nil, nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestApplyProcessorConcurrent: 32 goroutines process one message at once;
// one write commits and every decision acks.
func TestApplyProcessorConcurrent(t *testing.T) {
	s, ledger := openApply(t)
	p := oneRowProcessor(t, s, ledger)
	var wg sync.WaitGroup
	for range 32 {
		wg.Go(func() { want(t, p.Process(context.Background(), msg("hot")), consumer.Ack) })
	}
	wg.Wait()
	if n := ledgerRows(t, s, ledger, "hot"); n != 1 {
		t.Fatalf("%d ledger rows, want 1", n)
	}
	if st := p.Stats(); st.Applied != 1 || st.Duplicates != 31 {
		t.Fatalf("stats %+v, want 1 applied and 31 duplicates", st)
	}
}

// TestApplyProcessorStoreDown: a store that cannot be reached fails
// closed: a retry, not an attempt, nothing written.
func TestApplyProcessorStoreDown(t *testing.T) {
	s, ledger := openApply(t)
	p := oneRowProcessor(t, s, ledger)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	d := p.Process(ctx, msg("down"))
	want(t, d, consumer.Retry)
	if st := p.Stats(); st.StoreErrors != 1 || d.Attempt != 0 {
		t.Fatalf("decision %+v, stats %+v; want a store error that is not an attempt", d, st)
	}
	if n := ledgerRows(t, s, ledger, "down"); n != 0 {
		t.Fatalf("%d ledger rows", n)
	}
}

func TestNewApplyBadArguments(t *testing.T) {
	if _, err := consumer.NewApply[*pgx.Batch]("x", nil, func(context.Context, *consumer.Message, consumer.Delivery) (*pgx.Batch, []byte, error) {
		return nil, nil, nil
	}); err == nil {
		t.Fatal("nil applier accepted")
	}
	s, _ := openApply(t)
	if _, err := consumer.NewApply[*pgx.Batch]("x", s, nil); err == nil {
		t.Fatal("nil handler accepted")
	}
}

// TestApplyProcessorBadWriteIsDeadLettered: a write the server cannot
// prepare is the handler's failure, counted and bounded, so the message
// ends dead-lettered instead of being retried forever as a store outage.
func TestApplyProcessorBadWriteIsDeadLettered(t *testing.T) {
	s, _ := openApply(t)
	dlq := &consumer.MemoryDLQ{}
	p, err := consumer.NewApply("ledger", s, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) (*pgx.Batch, []byte, error) {
		var w pgx.Batch
		w.Queue(`INSERT INTO no_such_ledger VALUES ($1)`, m.ID)
		return &w, nil, nil
	}, consumer.WithDeadLetter(dlq), consumer.WithLimits(consumer.Limits{Unclassified: 3}))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if d := p.Process(context.Background(), msg("typo")); d.Action != consumer.Retry || d.Attempt != i+1 {
			t.Fatalf("delivery %d: %+v, want a counted retry", i+1, d)
		}
	}
	want(t, p.Process(context.Background(), msg("typo")), consumer.DeadLettered)
	if st := p.Stats(); st.StoreErrors != 0 || st.DeadLettered != 1 {
		t.Fatalf("stats %+v", st)
	}
}
