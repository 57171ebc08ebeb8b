package sqlitestore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/sqlitestore"
)

// outboxPub acknowledges everything but the IDs told to fail, and logs
// acknowledged messages in order.
type outboxPub struct {
	mu        sync.Mutex
	log       []outbox.Message
	permanent map[string]bool
}

func (p *outboxPub) Publish(ctx context.Context, batch []outbox.Message, results []error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	stopped := map[string]bool{}
	for i, m := range batch {
		switch {
		case stopped[m.Key]:
			results[i] = outbox.ErrNotSent
		case p.permanent[m.ID]:
			results[i] = outbox.Permanent(errors.New("rejected"))
			stopped[m.Key] = true
		default:
			p.log = append(p.log, m)
		}
	}
}

func (p *outboxPub) ids() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := map[string]int{}
	for _, m := range p.log {
		out[m.ID]++
	}
	return out
}

func openOutbox(t *testing.T, parts int) (*sqlitestore.Store, *sqlitestore.OutboxSource) {
	t.Helper()
	s, err := sqlitestore.Open(filepath.Join(t.TempDir(), "outbox.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	src, err := s.OutboxSource(context.Background(), parts)
	if err != nil {
		t.Fatal(err)
	}
	return s, src
}

func writeOutbox(t *testing.T, s *sqlitestore.Store, commit bool, msgs ...outbox.Message) {
	t.Helper()
	ctx := context.Background()
	tx, err := s.DB().BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	if err := s.WriteOutbox(ctx, tx, msgs...); err != nil {
		t.Fatal(err)
	}
	if commit {
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
	}
}

func unpublished(t *testing.T, s *sqlitestore.Store) int {
	t.Helper()
	var n int
	if err := s.DB().QueryRow(`SELECT count(*) FROM dedup_records_outbox WHERE published_at IS NULL`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("never happened: %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func startRelay(t *testing.T, src outbox.Source, pub outbox.Publisher, opts ...outbox.Option) chan error {
	t.Helper()
	rl, err := outbox.NewRelay(src, pub, append([]outbox.Option{outbox.WithLeaseTTL(300 * time.Millisecond),
		outbox.WithPollInterval(10 * time.Millisecond), outbox.WithBackoff(5*time.Millisecond, 10*time.Millisecond)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { errc <- rl.Run(context.Background()) }()
	t.Cleanup(func() { rl.Close() })
	return errc
}

// The SQLite relay publishes every committed message once in key order,
// nothing rolled back; a crash between ack and mark re-sends under the
// same ID; a poison message holds up only its key.
func TestSQLiteOutboxRelay(t *testing.T) {
	s, src := openOutbox(t, 2)
	const n = 300
	for i := range n {
		m := outbox.Message{ID: fmt.Sprint("evt-", i), Topic: "orders", Key: fmt.Sprint("agg-", i%7), Payload: []byte("x")}
		writeOutbox(t, s, i%10 != 9, m) // every tenth rolls back
	}
	writeOutbox(t, s, true, outbox.Message{ID: "poison", Topic: "orders", Key: "p"}, outbox.Message{ID: "behind", Topic: "orders", Key: "p"})
	pub := &outboxPub{permanent: map[string]bool{"poison": true}}
	boom := errors.New("killed")
	var once sync.Once
	errc := startRelay(t, src, pub, outbox.WithRelayID("doomed"), outbox.WithBatchSize(25), outbox.WithMarkHook(func(int, []outbox.Message) error {
		var err error
		once.Do(func() { err = boom })
		return err
	}))
	if err := <-errc; !errors.Is(err, boom) {
		t.Fatalf("Run = %v", err)
	}
	startRelay(t, src, pub, outbox.WithRelayID("heir"))
	waitFor(t, "all but the poisoned key published, the poison quarantined", func() bool {
		var q int
		s.DB().QueryRow(`SELECT count(*) FROM dedup_records_outbox WHERE quarantined_at IS NOT NULL`).Scan(&q)
		return unpublished(t, s) == 2 && q == 1
	})
	ids := pub.ids()
	resent := 0
	for i := range n {
		c := ids[fmt.Sprint("evt-", i)]
		if i%10 == 9 && c != 0 {
			t.Fatalf("rolled-back evt-%d published", i)
		}
		if i%10 != 9 && c == 0 {
			t.Fatalf("evt-%d never published", i)
		}
		if c > 1 {
			resent++
		}
	}
	if resent == 0 || ids["behind"] != 0 {
		t.Fatalf("%d re-sent (want some, from the crash), 'behind' published %d times (want 0: blocked)", resent, ids["behind"])
	}
	// Per-key order of first acknowledgements.
	pub.mu.Lock()
	seen, last := map[string]bool{}, map[string]int{}
	for _, m := range pub.log {
		if seen[m.ID] {
			continue
		}
		seen[m.ID] = true
		var i int
		fmt.Sscanf(m.ID, "evt-%d", &i)
		if p, ok := last[m.Key]; ok && i <= p {
			t.Fatalf("key %s: %s after evt-%d", m.Key, m.ID, p)
		}
		last[m.Key] = i
	}
	pub.mu.Unlock()
	var attempts int
	var lastErr string
	if err := s.DB().QueryRow(`SELECT attempts, last_error FROM dedup_records_outbox WHERE message_key = 'poison' AND quarantined_at IS NOT NULL`).Scan(&attempts, &lastErr); err != nil || attempts != 1 || lastErr == "" {
		t.Fatalf("poison row: %d attempts, %q, %v", attempts, lastErr, err)
	}
	if n, err := src.Prune(context.Background(), 0, 10000); err != nil || unpublished(t, s) != 2 || n == 0 {
		t.Fatalf("Prune = %d, %v; %d unpublished left", n, err, unpublished(t, s))
	}
}

// A lease taken over fences the old owner's marks.
func TestSQLiteOutboxFencing(t *testing.T) {
	s, src := openOutbox(t, 1)
	ctx := context.Background()
	writeOutbox(t, s, true, outbox.Message{ID: "e", Topic: "t", Key: "k"})
	old, ok, err := src.Acquire(ctx, "old", 0, time.Nanosecond)
	if err != nil || !ok {
		t.Fatal(ok, err)
	}
	msgs, err := src.Fetch(ctx, old, 10, false)
	if err != nil || len(msgs) != 1 {
		t.Fatal(len(msgs), err)
	}
	var heir outbox.Lease
	waitFor(t, "take-over", func() bool { heir, ok, err = src.Acquire(ctx, "heir", 0, time.Hour); return ok })
	if err := src.Mark(ctx, old, []int64{msgs[0].Seq}); !errors.Is(err, outbox.ErrLeaseLost) {
		t.Fatalf("fenced Mark = %v", err)
	}
	if unpublished(t, s) != 1 {
		t.Fatal("the fenced mark changed the row")
	}
	if err := src.Mark(ctx, heir, []int64{msgs[0].Seq}); err != nil || unpublished(t, s) != 0 {
		t.Fatalf("owner's Mark = %v", err)
	}
}

// A bad message is refused before any I/O and the transaction goes on.
func TestSQLiteOutboxBadMessage(t *testing.T) {
	s, _ := openOutbox(t, 1)
	ctx := context.Background()
	tx, err := s.DB().BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	err = s.WriteOutbox(ctx, tx, outbox.Message{Topic: "t"}, outbox.Message{Topic: "bad topic"})
	if !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Fatalf("WriteOutbox = %v", err)
	}
	if err := s.WriteOutbox(ctx, (*sql.Tx)(nil)); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Fatalf("nil tx: %v", err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if unpublished(t, s) != 0 {
		t.Fatal("a row was written")
	}
}
