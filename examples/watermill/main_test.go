package main

import (
	"context"
	"path/filepath"
	"testing"
)

// Every order is charged once however often it is delivered, with one
// receipt; a second run on the same file (a restart replaying the same
// orders) charges nothing and publishes no receipt.
func TestRunChargesOnceAcrossRestart(t *testing.T) {
	db := filepath.Join(t.TempDir(), "orders.db")
	const orders, deliveries = 50, 3
	s, err := run(context.Background(), db, orders, deliveries)
	if err != nil {
		t.Fatal(err)
	}
	if s.Delivered != orders*deliveries || s.Charged != orders || s.Ledger != orders || s.Receipts != orders || s.Duplicates != orders*(deliveries-1) {
		t.Fatalf("first run: %+v", s)
	}
	s, err = run(context.Background(), db, orders, 1)
	if err != nil {
		t.Fatal(err)
	}
	if s.Charged != 0 || s.Ledger != orders || s.Receipts != 0 || s.Duplicates != orders {
		t.Fatalf("after the restart: %+v", s)
	}
	if _, err := run(context.Background(), db, 0, 1); err == nil {
		t.Fatal("a bad flag was accepted")
	}
}
