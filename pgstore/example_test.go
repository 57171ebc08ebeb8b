package pgstore_test

import (
	"context"
	"log"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
)

// A payments consumer applies each message in one transaction with its
// dedup record and its outgoing message. Run `dedup migrate` (or
// Store.Migrate) once per database before.
func Example_inbox() {
	ctx := context.Background()
	s, err := pgstore.Open(ctx, "postgres://app@db:5432/payments")
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	if _, err := s.Check(ctx); err != nil { // schema version, retention warnings
		log.Fatal(err)
	}
	sweeper, err := s.StartSweeping(pgstore.SweepOptions{Interval: time.Minute})
	if err != nil {
		log.Fatal(err)
	}
	defer sweeper.Close()

	// For each delivery of message msgID with payload body:
	msgID, body := "evt-7f3a", []byte(`{"invoice":"inv-42","amount":1999}`)
	key := dedup.Key{Scope: "payments/capture-consumer", ID: msgID}
	c, err := s.RunInbox(ctx, key, dedup.FingerprintOf(body), 24*time.Hour, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		if _, err := tx.Exec(ctx, `UPDATE invoices SET status = 'captured' WHERE id = $1 AND status = 'open'`, "inv-42"); err != nil {
			return nil, err
		}
		return []byte("captured"), s.EnqueueOutbox(ctx, tx, pgstore.OutboxMessage{
			Key: "capture/inv-42", Topic: "payments.captured", Aggregate: "invoice/inv-42", Payload: body})
	})
	switch {
	case err != nil:
		// Nack: the broker redelivers (fail closed).
	case c.Outcome == dedup.Acquired, c.Outcome == dedup.Duplicate:
		// Ack. A duplicate is not an error.
	default:
		// In progress elsewhere, or the key was reused for another
		// payload: nack with a delay, or dead-letter the mismatch.
	}
}

// The same kind of consumer, when the writes are known before they run:
// Apply sends the claim and the writes in one round trip, as one
// transaction. The writes are plain DML.
func ExampleStore_Apply() {
	ctx := context.Background()
	s, err := pgstore.Open(ctx, "postgres://app@db:5432/payments")
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()

	msgID, body := "evt-7f3a", []byte(`{"account":"acc-9","amount":1999}`)
	var w pgx.Batch
	w.Queue(`INSERT INTO ledger (msg_id, account, amount) VALUES ($1, $2, $3)`, msgID, "acc-9", 1999)
	w.Queue(`UPDATE balances SET amount = amount + $2 WHERE account = $1`, "acc-9", 1999)
	key := dedup.Key{Scope: "payments/ledger-consumer", ID: msgID}
	c, err := s.Apply(ctx, key, dedup.FingerprintOf(body), 24*time.Hour, nil, &w)
	switch {
	case dedup.IsStoreError(err):
		// Nack: the broker redelivers (fail closed).
	case err != nil:
		// A write failed (a constraint, say): nothing was applied. Retry
		// or dead-letter by its class.
	case c.Outcome == dedup.Acquired, c.Outcome == dedup.Duplicate:
		// Ack.
	default:
		// In progress elsewhere, or the key was reused for another
		// payload.
	}
}
