package pgstore

import (
	"context"
	"errors"
	"testing"

	"github.com/dedupkit/dedup"
	"github.com/jackc/pgx/v5/pgconn"
)

// TestDeadlockIsTransient: a statement the server rolled back for a
// deadlock or serialization failure is a transient store error (the
// Runner retries a completion that fails so); other statement errors are
// not applied but not transient, and a broken connection is neither.
func TestDeadlockIsTransient(t *testing.T) {
	s := &Store{}
	ctx := context.Background()
	for _, c := range []struct {
		err                 error
		notApplied, transit bool
	}{
		{&pgconn.PgError{Severity: "ERROR", SeverityUnlocalized: "ERROR", Code: "40P01"}, true, true},
		{&pgconn.PgError{Severity: "ERROR", SeverityUnlocalized: "ERROR", Code: "40001"}, true, true},
		{&pgconn.PgError{Severity: "ERROR", SeverityUnlocalized: "ERROR", Code: "23505"}, true, false},
		{&pgconn.PgError{Severity: "FATAL", SeverityUnlocalized: "FATAL", Code: "40P01"}, false, false},
		{errors.New("connection reset by peer"), false, false},
	} {
		se := s.failAuto(ctx, "complete batch", c.err)
		if se.NotApplied != c.notApplied || se.Transient != c.transit || dedup.IsTransient(se) != c.transit {
			t.Errorf("%v: NotApplied %v Transient %v, want %v %v", c.err, se.NotApplied, se.Transient, c.notApplied, c.transit)
		}
	}
}
