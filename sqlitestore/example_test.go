package sqlitestore_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/sqlitestore"
)

// The transactional inbox: the ledger row and the dedup record commit in
// one SQLite transaction, so a crash can never leave one without the
// other, and a redelivery finds the record and writes nothing.
func Example() {
	ctx := context.Background()
	dir, _ := os.MkdirTemp("", "sqlitestore-example")
	defer os.RemoveAll(dir)

	store, err := sqlitestore.Open(filepath.Join(dir, "keys.db"))
	if err != nil {
		panic(err)
	}
	defer store.Close()
	// The business table lives in the same database as the keys.
	if _, err := store.DB().ExecContext(ctx, `CREATE TABLE ledger (id INTEGER PRIMARY KEY, amount INTEGER NOT NULL)`); err != nil {
		panic(err)
	}

	key, _ := dedup.NewKey("payments", "msg-1")
	fp := dedup.FingerprintOf([]byte(`{"amount":100}`))
	for delivery := 1; delivery <= 2; delivery++ {
		c, err := store.RunInbox(ctx, key, fp, 24*time.Hour, func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
			res, err := tx.ExecContext(ctx, `INSERT INTO ledger (amount) VALUES (100)`)
			if err != nil {
				return nil, err
			}
			id, _ := res.LastInsertId()
			return fmt.Appendf(nil, "pay_%d", id), nil
		})
		if err != nil {
			panic(err)
		}
		fmt.Println("delivery", delivery, c.Outcome, string(c.Result))
	}
	var rows int
	store.DB().QueryRowContext(ctx, `SELECT count(*) FROM ledger`).Scan(&rows)
	fmt.Println("ledger rows:", rows)
	// Output:
	// delivery 1 acquired pay_1
	// delivery 2 duplicate pay_1
	// ledger rows: 1
}
