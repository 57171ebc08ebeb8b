package pgstore_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
)

// Stores with empty scope caches claim one key of a new scope at once:
// the scope gets one integer without an error, and exactly one claimer
// acquires the key.
func TestNewScopeClaimedConcurrently(t *testing.T) {
	t.Parallel()
	pool := testPool(t)
	schema := freshSchema(t, pool)
	openStoreOn(t, pool, schema) // migrates the schema
	const n = 16
	var acquired, other atomic.Int32
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		s, err := pgstore.New(pool, pgstore.WithSchema(schema))
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := s.Claim(context.Background(), dedup.Key{Scope: "brand-new-scope", ID: "k"}, fpA, time.Minute)
			switch {
			case err != nil:
				t.Errorf("claim on a new scope: %v", err)
			case c.Outcome == dedup.Acquired:
				acquired.Add(1)
			default:
				other.Add(1)
			}
		}()
	}
	wg.Wait()
	if acquired.Load() != 1 || other.Load() != n-1 {
		t.Fatalf("%d acquired, %d other; want 1 and %d", acquired.Load(), other.Load(), n-1)
	}
	if c := queryInt(t, pool, `SELECT count(*) FROM "`+schema+`".dedup_scopes WHERE scope = 'brand-new-scope'`); c != 1 {
		t.Fatalf("%d scope rows, want 1", c)
	}
}
