package sqlitestore_test

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/dedupkit/dedup/storetest"
)

const (
	fpA = dedup.Fingerprint("sha256:aaaa")
	fpB = dedup.Fingerprint("sha256:bbbb")
	day = 24 * time.Hour
)

// open returns a store on a new file with a manual clock and two business
// tables: ledger, whose primary key is the message id, and effects, which
// has no unique constraint and so counts every effect that was committed.
func open(t testing.TB, opts ...sqlitestore.Option) (*sqlitestore.Store, *storetest.Clock) {
	t.Helper()
	clock := storetest.NewClock()
	s, err := sqlitestore.Open(filepath.Join(t.TempDir(), "inbox.db"), append([]sqlitestore.Option{sqlitestore.WithClock(clock)}, opts...)...)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { _ = s.Close() })
	for _, q := range []string{
		`CREATE TABLE ledger (msg_id TEXT PRIMARY KEY)`,
		`CREATE TABLE effects (msg_id TEXT NOT NULL)`,
	} {
		if _, err := s.DB().Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	return s, clock
}

// apply is the business handler: it records the message in the ledger and
// counts the effect.
func apply(msgID string, runs *atomic.Int32) sqlitestore.InboxHandler {
	return func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
		if runs != nil {
			runs.Add(1)
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO ledger (msg_id) VALUES (?)`, msgID); err != nil {
			return nil, err
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO effects (msg_id) VALUES (?)`, msgID); err != nil {
			return nil, err
		}
		return []byte("applied:" + msgID), nil
	}
}

func count(t testing.TB, s *sqlitestore.Store, table, msgID string) int {
	t.Helper()
	var n int
	if err := s.DB().QueryRow(`SELECT count(*) FROM `+table+` WHERE msg_id = ?`, msgID).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func key(id string) dedup.Key { return dedup.Key{Scope: "payments/consumer", ID: id} }

func runInbox(t testing.TB, s *sqlitestore.Store, id string, fp dedup.Fingerprint, h sqlitestore.InboxHandler, want dedup.Outcome) dedup.Claim {
	t.Helper()
	c, err := s.RunInbox(context.Background(), key(id), fp, day, h)
	if err != nil {
		t.Fatalf("RunInbox(%s): %v", id, err)
	}
	if c.Outcome != want {
		t.Fatalf("RunInbox(%s) = %v, want %v", id, c.Outcome, want)
	}
	return c
}

// A message is applied once; every replay is a duplicate that neither runs
// the handler nor commits a second effect, and carries the stored result.
func TestInboxAppliesOnce(t *testing.T) {
	s, _ := open(t)
	var runs atomic.Int32
	c := runInbox(t, s, "m1", fpA, apply("m1", &runs), dedup.Acquired)
	if c.Attempt != 1 || c.TakenOver || c.Token.IsZero() || string(c.Result) != "applied:m1" {
		t.Fatalf("first delivery = %+v", c)
	}
	for i := range 3 {
		d := runInbox(t, s, "m1", fpA, apply("m1", &runs), dedup.Duplicate)
		if string(d.Result) != "applied:m1" {
			t.Fatalf("replay %d result = %q, want the stored one", i, d.Result)
		}
	}
	if runs.Load() != 1 || count(t, s, "effects", "m1") != 1 || count(t, s, "ledger", "m1") != 1 {
		t.Fatalf("after 4 deliveries: %d handler runs, %d effects; want 1 and 1", runs.Load(), count(t, s, "effects", "m1"))
	}
	// A lease-mode claim sees the inbox record as a duplicate too.
	if d, err := s.Claim(context.Background(), key("m1"), fpA, time.Minute); err != nil || d.Outcome != dedup.Duplicate {
		t.Fatalf("Claim after the inbox = %v, %v; want duplicate", d.Outcome, err)
	}
}

// The record and the business write commit together in the caller's
// transaction: neither is visible before the commit, both are after it.
func TestInboxCommitsWithBusinessWrite(t *testing.T) {
	s, _ := open(t)
	ctx := context.Background()
	tx, err := s.DB().BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	c, err := s.Inbox(ctx, tx, key("m1"), fpA, day, apply("m1", nil))
	if err != nil || c.Outcome != dedup.Acquired {
		t.Fatalf("Inbox = %v, %v", c.Outcome, err)
	}
	// Inside the transaction a second delivery is already a duplicate.
	var runs atomic.Int32
	if d, err := s.Inbox(ctx, tx, key("m1"), fpA, day, apply("m1", &runs)); err != nil || d.Outcome != dedup.Duplicate || runs.Load() != 0 {
		t.Fatalf("second Inbox in the same transaction = %v, %v, %d runs", d.Outcome, err, runs.Load())
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if count(t, s, "ledger", "m1") != 1 {
		t.Fatal("the business write was not committed")
	}
	runInbox(t, s, "m1", fpA, apply("m1", &runs), dedup.Duplicate)
	if runs.Load() != 0 {
		t.Fatal("the handler ran for a committed message")
	}
}

// A rolled-back transaction leaves no record and no effect, and the
// redelivery applies the message.
func TestInboxRollbackLeavesNoRecord(t *testing.T) {
	s, _ := open(t)
	ctx := context.Background()
	tx, err := s.DB().BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	c, err := s.Inbox(ctx, tx, key("m1"), fpA, day, apply("m1", nil))
	if err != nil || c.Outcome != dedup.Acquired {
		t.Fatalf("Inbox = %v, %v", c.Outcome, err)
	}
	if err := tx.Rollback(); err != nil { // the consumer crashed before its commit
		t.Fatal(err)
	}
	if count(t, s, "effects", "m1") != 0 {
		t.Fatal("a rolled-back effect is visible")
	}
	var runs atomic.Int32
	r := runInbox(t, s, "m1", fpA, apply("m1", &runs), dedup.Acquired)
	if r.Attempt != 1 || runs.Load() != 1 || count(t, s, "effects", "m1") != 1 {
		t.Fatalf("redelivery after rollback: attempt %d, %d runs, %d effects; want 1, 1, 1", r.Attempt, runs.Load(), count(t, s, "effects", "m1"))
	}
}

// A handler error is returned unchanged; nothing is committed, neither the
// record nor the effect written before the error.
func TestInboxHandlerErrorLeavesNothing(t *testing.T) {
	s, _ := open(t)
	boom := errors.New("card declined by a flaky gateway")
	c, err := s.RunInbox(context.Background(), key("m1"), fpA, day, func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
		if _, err := tx.ExecContext(ctx, `INSERT INTO effects (msg_id) VALUES ('m1')`); err != nil {
			return nil, err
		}
		return nil, boom
	})
	if err != boom || c.Outcome != 0 {
		t.Fatalf("RunInbox with a failing handler = %v, %v; want the handler's error itself", c.Outcome, err)
	}
	if count(t, s, "effects", "m1") != 0 {
		t.Fatal("the effect of a failed handler was committed")
	}
	n, err := s.Claim(context.Background(), key("m1"), fpA, time.Minute)
	if err != nil || n.Outcome != dedup.Acquired || n.Attempt != 1 {
		t.Fatalf("Claim after a failed inbox run = %+v, %v; want acquired, attempt 1 (no record left)", n, err)
	}
}

// A panicking handler rolls the transaction back and lets go of the write
// lock: the next delivery applies the message.
func TestInboxHandlerPanicRollsBack(t *testing.T) {
	s, _ := open(t)
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("the handler's panic did not reach the caller")
			}
		}()
		s.RunInbox(context.Background(), key("m1"), fpA, day, func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
			if _, err := tx.ExecContext(ctx, `INSERT INTO effects (msg_id) VALUES ('m1')`); err != nil {
				return nil, err
			}
			panic("handler bug")
		})
	}()
	runInbox(t, s, "m1", fpA, apply("m1", nil), dedup.Acquired)
	if n := count(t, s, "effects", "m1"); n != 1 {
		t.Fatalf("%d effects, want 1 (the panicking run must have rolled back)", n)
	}
}

// Many goroutines deliver one message at once: exactly one runs the
// handler and commits one effect; all others see a duplicate.
func TestInboxConcurrentOneEffect(t *testing.T) {
	s, _ := open(t)
	const n = 32
	var runs, acquired, dups atomic.Int32
	var start, done sync.WaitGroup
	start.Add(1)
	for range n {
		done.Add(1)
		go func() {
			defer done.Done()
			start.Wait()
			c, err := s.RunInbox(context.Background(), key("hot"), fpA, day, func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
				runs.Add(1)
				// No unique constraint on effects: only the inbox record
				// stops a second effect.
				if _, err := tx.ExecContext(ctx, `INSERT INTO effects (msg_id) VALUES ('hot')`); err != nil {
					return nil, err
				}
				return []byte("once"), nil
			})
			switch {
			case err != nil:
				t.Errorf("RunInbox: %v", err)
			case c.Outcome == dedup.Acquired:
				acquired.Add(1)
			case c.Outcome == dedup.Duplicate && string(c.Result) == "once":
				dups.Add(1)
			default:
				t.Errorf("RunInbox = %v with result %q", c.Outcome, c.Result)
			}
		}()
	}
	start.Done()
	done.Wait()
	if e := count(t, s, "effects", "hot"); runs.Load() != 1 || acquired.Load() != 1 || dups.Load() != n-1 || e != 1 {
		t.Fatalf("%d concurrent deliveries: %d runs, %d acquired, %d duplicates, %d effects; want 1, 1, %d, 1",
			n, runs.Load(), acquired.Load(), dups.Load(), e, n-1)
	}
}

// A conflict does not abort the caller's transaction: after a duplicate,
// the caller can still write and commit.
func TestInboxConflictKeepsTransaction(t *testing.T) {
	s, _ := open(t)
	ctx := context.Background()
	runInbox(t, s, "m1", fpA, apply("m1", nil), dedup.Acquired)
	tx, err := s.DB().BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	for _, tc := range []struct {
		fp   dedup.Fingerprint
		want dedup.Outcome
	}{{fpA, dedup.Duplicate}, {fpB, dedup.Mismatch}} {
		c, err := s.Inbox(ctx, tx, key("m1"), tc.fp, day, apply("m1", nil))
		if err != nil || c.Outcome != tc.want {
			t.Fatalf("Inbox(%s) = %v, %v; want %v", tc.fp, c.Outcome, err, tc.want)
		}
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO effects (msg_id) VALUES ('after-conflict')`); err != nil {
		t.Fatalf("write after a conflict: %v", err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatalf("commit after a conflict: %v", err)
	}
	if count(t, s, "effects", "after-conflict") != 1 {
		t.Fatal("the write after the conflict was not committed")
	}
}

// The inbox respects a lease-mode owner: in progress while its lease lives,
// a mismatch for another fingerprint, and a take-over once the lease has
// expired, after which the old owner's token is dead.
func TestInboxAndLeaseOwner(t *testing.T) {
	s, clock := open(t)
	ctx := context.Background()
	owner, err := s.Claim(ctx, key("m1"), fpA, time.Minute)
	if err != nil || owner.Outcome != dedup.Acquired {
		t.Fatalf("Claim = %v, %v", owner.Outcome, err)
	}
	var runs atomic.Int32
	p := runInbox(t, s, "m1", fpA, apply("m1", &runs), dedup.InProgress)
	if !p.LeaseUntil.Equal(owner.LeaseUntil) {
		t.Fatalf("in-progress lease end %v, want the owner's %v", p.LeaseUntil, owner.LeaseUntil)
	}
	runInbox(t, s, "m1", fpB, apply("m1", &runs), dedup.Mismatch)
	if runs.Load() != 0 {
		t.Fatal("the handler ran while another owner held the key")
	}
	clock.Advance(2 * time.Minute)
	runInbox(t, s, "m1", fpB, apply("m1", &runs), dedup.Mismatch) // expired, but another request's key
	c := runInbox(t, s, "m1", fpA, apply("m1", &runs), dedup.Acquired)
	if !c.TakenOver || c.Attempt != 2 || runs.Load() != 1 {
		t.Fatalf("take-over by the inbox = %+v, %d runs; want attempt 2, taken over, 1 run", c, runs.Load())
	}
	if err := s.Complete(ctx, owner, []byte("late"), day); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("the old owner's Complete after the take-over: %v, want ErrLeaseLost", err)
	}
	if d := runInbox(t, s, "m1", fpA, apply("m1", &runs), dedup.Duplicate); string(d.Result) != "applied:m1" {
		t.Fatalf("stored result %q, want the inbox handler's", d.Result)
	}
}

// An inbox record expires after its retention like any completion.
func TestInboxRetention(t *testing.T) {
	s, clock := open(t)
	var runs atomic.Int32
	h := func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
		runs.Add(1)
		return nil, nil
	}
	c, err := s.RunInbox(context.Background(), key("m1"), fpA, time.Hour, h)
	if err != nil || c.Outcome != dedup.Acquired || !c.ExpiresAt.Equal(clock.Now().Add(time.Hour)) {
		t.Fatalf("RunInbox = %+v, %v; want acquired, expiring in an hour", c, err)
	}
	clock.Advance(59 * time.Minute)
	runInbox(t, s, "m1", fpA, h, dedup.Duplicate)
	clock.Advance(time.Minute)
	if c := runInbox(t, s, "m1", fpB, h, dedup.Acquired); c.Attempt != 1 || runs.Load() != 2 {
		t.Fatalf("after retention: %+v, %d runs; want a fresh acquisition", c, runs.Load())
	}
}

// Inbox checks its arguments before any I/O.
func TestInboxInvalidArguments(t *testing.T) {
	s, _ := open(t)
	ctx := context.Background()
	tx, err := s.DB().BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	h := apply("m1", nil)
	for name, call := range map[string]func() error{
		"nil tx":         func() error { _, err := s.Inbox(ctx, nil, key("m1"), fpA, day, h); return err },
		"nil handler":    func() error { _, err := s.Inbox(ctx, tx, key("m1"), fpA, day, nil); return err },
		"zero retention": func() error { _, err := s.Inbox(ctx, tx, key("m1"), fpA, 0, h); return err },
		"bad key":        func() error { _, err := s.Inbox(ctx, tx, dedup.Key{Scope: "s"}, fpA, day, h); return err },
		"run nil handler": func() error {
			_, err := s.RunInbox(ctx, key("m1"), fpA, day, nil)
			return err
		},
		"run negative retention": func() error {
			_, err := s.RunInbox(ctx, key("m1"), fpA, -time.Second, h)
			return err
		},
	} {
		if err := call(); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("%s: error %v, want ErrInvalidArgument", name, err)
		}
	}
}
