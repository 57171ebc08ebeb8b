package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
)

// A CompleteBatch never creates a record and never resurrects one: items
// whose key was released, swept, taken over by another claim, never
// claimed at all, or claimed in a scope that has no such key report
// ErrLeaseLost and leave no row behind; the new holder of a taken-over
// key keeps its claim; a second completion with the same token changes
// nothing. On both layouts (the plain table completes through INSERT ...
// ON CONFLICT DO UPDATE since 5bc1e60).
func TestCompleteBatchCreatesNothing(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		ctx := context.Background()
		pool := s.Pool()
		table := records(s)
		ids := []string{"live", "released", "swept", "taken", "done"}
		reqs := make([]dedup.ClaimRequest, len(ids))
		for i, id := range ids {
			reqs[i] = dedup.ClaimRequest{Key: key(id), Fingerprint: fpA}
		}
		claims, err := s.ClaimBatch(ctx, reqs, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Release(ctx, claims[1]); err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `DELETE FROM `+table+` WHERE `+keyIs(s, "$1", "$2"), key("").Scope, "swept"); err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `UPDATE `+table+` SET deadline = statement_timestamp() - interval '1 second' WHERE `+keyIs(s, "$1", "$2"), key("").Scope, "taken"); err != nil {
			t.Fatal(err)
		}
		holder := mustClaim(t, s, "taken", fpA, time.Minute, dedup.Acquired)
		if err := s.Complete(ctx, claims[4], []byte("first"), time.Hour); err != nil {
			t.Fatal(err)
		}
		never := claims[0]
		never.Key, never.Token = key("never"), dedup.NewToken()
		elsewhere := claims[0] // the live key's token, in a scope without the key
		elsewhere.Key = dedup.Key{Scope: "elsewhere/consumer", ID: "live"}
		items := []dedup.Completion{
			{Claim: claims[3], Result: []byte("stale")},
			{Claim: never, Result: []byte("never")},
			{Claim: claims[1], Result: []byte("released")},
			{Claim: elsewhere, Result: []byte("elsewhere")},
			{Claim: claims[4], Result: []byte("second")},
			{Claim: claims[2], Result: []byte("swept")},
			{Claim: claims[0], Result: []byte("live")},
		}
		errs, err := s.CompleteBatch(ctx, items, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		for i, err := range errs {
			ok := i == 4 || i == 6
			if ok && err != nil || !ok && !errors.Is(err, dedup.ErrLeaseLost) {
				t.Errorf("item %d (%s): %v", i, items[i].Claim.Key, err)
			}
		}
		for _, id := range []string{"never", "released", "swept"} {
			if n := countRecords(t, s, id); n != 0 {
				t.Errorf("%s: %d records after CompleteBatch, want none", id, n)
			}
		}
		if n := queryInt(t, pool, `SELECT count(*) FROM `+table); n != 3 {
			t.Errorf("%d records, want 3 (live, taken, done)", n)
		}
		var state int16
		var tok []byte
		if err := pool.QueryRow(ctx, `SELECT state, token FROM `+table+` WHERE `+keyIs(s, "$1", "$2"), key("").Scope, "taken").Scan(&state, &tok); err != nil {
			t.Fatal(err)
		}
		if state != 1 || string(tok) != string(holder.Token[:]) {
			t.Errorf("taken-over key: state %d token %x, want the new holder's claim %x in progress", state, tok, holder.Token[:])
		}
		if c := mustClaim(t, s, "done", fpA, time.Minute, dedup.Duplicate); string(c.Result) != "first" {
			t.Errorf("completed twice: result %q, want the first", c.Result)
		}
		if c := mustClaim(t, s, "live", fpA, time.Minute, dedup.Duplicate); string(c.Result) != "live" {
			t.Errorf("live: result %q", c.Result)
		}
		if c := mustClaim(t, s, "released", fpA, time.Minute, dedup.Acquired); c.Attempt != 1 {
			t.Errorf("released key claimed again: attempt %d", c.Attempt)
		}
	})
}

// Two CompleteBatch calls of the same claims racing Release (of
// in-progress keys) and take-over claims (of keys whose lease ran out)
// from another store, over the same keys in other orders: for each key exactly one of them wins, the loser is told
// (ErrLeaseLost, or a duplicate for the claim), a released key has no
// record left, and no call fails (no deadlock).
func TestCompleteBatchRacesReleaseAndTakeOver(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		other, err := pgstore.New(s.Pool(), append([]pgstore.Option{pgstore.WithSchema(schemaOf(s))}, m.opts...)...)
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		pool := s.Pool()
		table := records(s)
		const n = 48
		for round := range 15 {
			reqs := make([]dedup.ClaimRequest, n)
			for i := range reqs {
				reqs[i] = dedup.ClaimRequest{Key: key(fmt.Sprintf("race%02d-%02d", round, i)), Fingerprint: fpA}
			}
			claims, err := s.ClaimBatch(ctx, reqs, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			var lapsed []dedup.ClaimRequest // i % 4 == 2
			for i := 2; i < n; i += 4 {
				if _, err := pool.Exec(ctx, `UPDATE `+table+` SET deadline = statement_timestamp() - interval '1 second' WHERE `+keyIs(s, "$1", "$2"), reqs[i].Key.Scope, reqs[i].Key.ID); err != nil {
					t.Fatal(err)
				}
				lapsed = append(lapsed, reqs[i])
			}
			items := make([]dedup.Completion, n)
			for j, i := range rand.Perm(n) {
				items[j] = dedup.Completion{Claim: claims[i], Result: []byte(reqs[i].Key.ID)}
			}
			var (
				wg       sync.WaitGroup
				errs     []error
				released = make(map[string]bool)
				taken    []dedup.Claim
			)
			start := make(chan struct{})
			wg.Go(func() {
				<-start
				var err error
				if errs, err = s.CompleteBatch(ctx, items, time.Hour); err != nil {
					t.Errorf("round %d: CompleteBatch: %v", round, err)
				}
			})
			// A second completer of the same claims, in the reverse order
			// (a completion retried while the first is in flight).
			items2 := make([]dedup.Completion, n)
			for j, it := range items {
				items2[n-1-j] = it
			}
			var errs2 []error
			wg.Go(func() {
				<-start
				var err error
				if errs2, err = other.CompleteBatch(ctx, items2, time.Hour); err != nil {
					t.Errorf("round %d: second CompleteBatch: %v", round, err)
				}
			})
			wg.Go(func() {
				<-start
				for i := n - 1; i >= 0; i -= 2 { // odd keys
					err := s.Release(ctx, claims[i])
					switch {
					case err == nil:
						released[reqs[i].Key.ID] = true
					case !errors.Is(err, dedup.ErrLeaseLost):
						t.Errorf("round %d: Release: %v", round, err)
					}
				}
			})
			wg.Go(func() {
				<-start
				rev := make([]dedup.ClaimRequest, len(lapsed))
				for i, r := range lapsed {
					rev[len(lapsed)-1-i] = r
				}
				var err error
				if taken, err = other.ClaimBatch(ctx, rev, time.Minute); err != nil {
					t.Errorf("round %d: take-over ClaimBatch: %v", round, err)
				}
			})
			close(start)
			wg.Wait()
			if t.Failed() {
				return
			}
			completed := make(map[string]bool)
			for k, es := range [][]error{errs, errs2} {
				its := [][]dedup.Completion{items, items2}[k]
				for j, err := range es {
					switch {
					case err == nil:
						completed[its[j].Claim.Key.ID] = true
					case !errors.Is(err, dedup.ErrLeaseLost):
						t.Fatalf("round %d: completer %d item %d: %v", round, k, j, err)
					}
				}
			}
			acquired := make(map[string]dedup.Claim)
			for _, c := range taken {
				switch c.Outcome {
				case dedup.Acquired:
					acquired[c.Key.ID] = c
				case dedup.Duplicate:
				default:
					t.Fatalf("round %d: take-over of %s: %v", round, c.Key.ID, c.Outcome)
				}
			}
			for i, r := range reqs {
				id := r.Key.ID
				rows := countRecords(t, s, id)
				switch {
				case i%2 == 1:
					if released[id] == completed[id] {
						t.Fatalf("round %d: %s released %v and completed %v: exactly one must win", round, id, released[id], completed[id])
					}
					if released[id] && rows != 0 {
						t.Fatalf("round %d: %s released, %d records left (completion resurrected it?)", round, id, rows)
					}
				case i%4 == 2:
					_, acq := acquired[id]
					if acq == completed[id] {
						t.Fatalf("round %d: %s taken over %v and completed %v: exactly one must win", round, id, acq, completed[id])
					}
				default:
					if !completed[id] {
						t.Fatalf("round %d: %s not completed", round, id)
					}
				}
				if !released[id] && rows != 1 {
					t.Fatalf("round %d: %s has %d records", round, id, rows)
				}
			}
			for id, c := range acquired {
				var state int16
				var tok []byte
				if err := pool.QueryRow(ctx, `SELECT state, token FROM `+table+` WHERE `+keyIs(s, "$1", "$2"), c.Key.Scope, id).Scan(&state, &tok); err != nil {
					t.Fatal(err)
				}
				if state != 1 || string(tok) != string(c.Token[:]) {
					t.Fatalf("round %d: %s taken over, record state %d token %x, want in progress with %x", round, id, state, tok, c.Token[:])
				}
			}
		}
	})
}

// Stores that each guess their batch is all new (a fresh store guesses
// at once) claim the same new keys, in orders of their own, with a key
// repeated in the batch, while another goroutine completes the previous
// round's keys and another claims some of them alone: each key is
// acquired exactly once, every other claim sees it in progress (or, for
// the previous round's keys, completed), each acquired record holds the
// token and lease end its claim returned, and no call fails (no deadlock,
// no unique violation reaching the caller).
func TestClaimBatchNewKeysRaceAcrossStores(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		ctx := context.Background()
		pool := s.Pool()
		table := records(s)
		const n, stores = 40, 6
		var prev []dedup.Completion
		for round := range 25 {
			reqs := make([]dedup.ClaimRequest, n)
			for i := range reqs {
				reqs[i] = dedup.ClaimRequest{Key: key(fmt.Sprintf("new%02d-%02d", round, i)), Fingerprint: fpA}
			}
			results := make([][]dedup.Claim, stores)
			batches := make([][]dedup.ClaimRequest, stores)
			var wg sync.WaitGroup
			start := make(chan struct{})
			for w := range stores {
				st, err := pgstore.New(pool, append([]pgstore.Option{pgstore.WithSchema(schemaOf(s))}, m.opts...)...)
				if err != nil {
					t.Fatal(err)
				}
				b := make([]dedup.ClaimRequest, 0, n+1)
				for _, i := range rand.Perm(n) {
					b = append(b, reqs[i])
				}
				b = append(b, b[w]) // a key twice in the batch
				batches[w] = b
				wg.Go(func() {
					<-start
					var err error
					if results[w], err = st.ClaimBatch(ctx, b, time.Minute); err != nil {
						t.Errorf("round %d: store %d: %v", round, w, err)
					}
				})
			}
			done := prev
			wg.Go(func() {
				<-start
				if len(done) == 0 {
					return
				}
				rev := make([]dedup.Completion, len(done))
				for i, c := range done {
					rev[len(done)-1-i] = c
				}
				errs, err := s.CompleteBatch(ctx, rev, time.Hour)
				if err != nil {
					t.Errorf("round %d: CompleteBatch: %v", round, err)
					return
				}
				for i, err := range errs {
					if err != nil {
						t.Errorf("round %d: completion %d: %v", round, i, err)
					}
				}
			})
			wg.Go(func() {
				<-start
				for i := 0; i < len(done); i += 5 {
					c, err := s.Claim(ctx, done[i].Claim.Key, fpA, time.Minute)
					if err != nil || c.Outcome != dedup.InProgress && c.Outcome != dedup.Duplicate {
						t.Errorf("round %d: Claim of a held key: %v, %v", round, c.Outcome, err)
					}
				}
			})
			close(start)
			wg.Wait()
			if t.Failed() {
				return
			}
			winner := make(map[string]dedup.Claim)
			for w, cs := range results {
				for j, c := range cs {
					switch c.Outcome {
					case dedup.Acquired:
						if j == n {
							t.Fatalf("round %d: store %d: the repeat of %s in the batch acquired", round, w, c.Key.ID)
						}
						if _, dup := winner[c.Key.ID]; dup {
							t.Fatalf("round %d: %s acquired twice", round, c.Key.ID)
						}
						winner[c.Key.ID] = c
					case dedup.InProgress:
					default:
						t.Fatalf("round %d: store %d: %s: %v", round, w, c.Key.ID, c.Outcome)
					}
				}
			}
			prev = prev[:0]
			for _, r := range reqs {
				c, ok := winner[r.Key.ID]
				if !ok {
					t.Fatalf("round %d: %s acquired by no store", round, r.Key.ID)
				}
				var tok []byte
				var until time.Time
				var attempts int32
				if err := pool.QueryRow(ctx, `SELECT token, deadline, attempts FROM `+table+` WHERE `+keyIs(s, "$1", "$2"), r.Key.Scope, r.Key.ID).Scan(&tok, &until, &attempts); err != nil {
					t.Fatal(err)
				}
				if string(tok) != string(c.Token[:]) || !until.Equal(c.LeaseUntil) || attempts != 1 || c.Attempt != 1 {
					t.Fatalf("round %d: %s record token %x until %v attempts %d; claim %x %v %d", round, r.Key.ID, tok, until, attempts, c.Token[:], c.LeaseUntil, c.Attempt)
				}
				prev = append(prev, dedup.Completion{Claim: c, Result: []byte("r")})
			}
		}
	})
}

// One CompleteBatch over scopes with different retention windows (one
// longer than the retention asked for, one without a window, one much
// longer) gives each record its own scope's expiry, as Complete does.
func TestCompleteBatchRetentionPerScope(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		ctx := context.Background()
		windows := map[string]time.Duration{"a/consumer": 48 * time.Hour, "b/consumer": 0, "c/consumer": 240 * time.Hour}
		for sc, w := range windows {
			if w > 0 {
				if err := s.SetRetention(ctx, sc, w, 0); err != nil {
					t.Fatal(err)
				}
			}
		}
		var reqs []dedup.ClaimRequest
		for i := range 30 {
			for _, sc := range []string{"c/consumer", "a/consumer", "b/consumer"} {
				reqs = append(reqs, dedup.ClaimRequest{Key: dedup.Key{Scope: sc, ID: fmt.Sprint("k", i)}, Fingerprint: fpA})
			}
		}
		claims, err := s.ClaimBatch(ctx, reqs, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		items := make([]dedup.Completion, len(claims))
		for i, c := range claims {
			items[i] = dedup.Completion{Claim: c, Result: []byte("r")}
		}
		var before time.Time
		if err := s.Pool().QueryRow(ctx, `SELECT statement_timestamp()`).Scan(&before); err != nil {
			t.Fatal(err)
		}
		errs, err := s.CompleteBatch(ctx, items, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		for i, err := range errs {
			if err != nil {
				t.Fatalf("item %d: %v", i, err)
			}
		}
		again, err := s.ClaimBatch(ctx, reqs, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range again {
			want := max(windows[c.Key.Scope], time.Hour)
			if c.Outcome != dedup.Duplicate {
				t.Fatalf("%v: %v", c.Key, c.Outcome)
			}
			if d := c.ExpiresAt.Sub(before); d < want || d > want+time.Minute {
				t.Errorf("%v expires %v after the completion, want %v", c.Key, d, want)
			}
		}
	})
}

// Records still in the version-5 tables (completed, in progress, expired)
// among new keys in a batch the store guesses to be all new: the guess
// fails on the moved record and the batch is claimed as each key alone
// would be; a batch of new keys beside an expired old record acquires
// them all, and completing the claims creates nothing else.
func TestClaimBatchGuessWithOldRecords(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := v5Store(t, m)
		ctx := context.Background()
		oldRecords(t, s, 4)
		if _, err := s.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		reqs := []dedup.ClaimRequest{
			{Key: key("fresh-1"), Fingerprint: fpA},
			{Key: key(oldID(1)), Fingerprint: fpA},
			{Key: key("held-3"), Fingerprint: fpA},
			{Key: key("gone-2"), Fingerprint: fpA},
			{Key: key("fresh-2"), Fingerprint: fpA},
			{Key: key("held-4"), Fingerprint: fpB},
		}
		want := []dedup.Outcome{dedup.Acquired, dedup.Duplicate, dedup.InProgress, dedup.Acquired, dedup.Acquired, dedup.Mismatch}
		got, err := s.ClaimBatch(ctx, reqs, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		for i, c := range got {
			if c.Outcome != want[i] {
				t.Errorf("%s: %v, want %v", reqs[i].Key.ID, c.Outcome, want[i])
			}
		}
		if string(got[1].Result) != "result-1" {
			t.Errorf("old duplicate: result %q", got[1].Result)
		}
		// All new but for an expired old record: the guess (after a run of
		// one) inserts them all.
		if _, err := s.ClaimBatch(ctx, []dedup.ClaimRequest{{Key: key("fresh-3")}}, time.Minute); err != nil {
			t.Fatal(err)
		}
		reqs = []dedup.ClaimRequest{{Key: key("fresh-4"), Fingerprint: fpA}, {Key: key("gone-5"), Fingerprint: fpA}}
		got2, err := s.ClaimBatch(ctx, reqs, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		var items []dedup.Completion
		for _, c := range append(got, got2...) {
			if c.Outcome == dedup.Acquired {
				if c.Attempt != 1 {
					t.Errorf("%s: attempt %d", c.Key.ID, c.Attempt)
				}
				items = append(items, dedup.Completion{Claim: c, Result: []byte("new")})
			}
		}
		if len(items) != 5 {
			t.Fatalf("%d acquired, want 5", len(items))
		}
		// A stale claim of an old in-progress key completes nothing.
		stale := items[0].Claim
		stale.Key = key("held-5")
		items = append(items, dedup.Completion{Claim: stale, Result: []byte("stale")})
		errs, err := s.CompleteBatch(ctx, items, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		for i, err := range errs {
			if last := i == len(items)-1; last != errors.Is(err, dedup.ErrLeaseLost) || !last && err != nil {
				t.Errorf("item %d (%s): %v", i, items[i].Claim.Key.ID, err)
			}
		}
		mustClaim(t, s, "held-5", fpA, time.Minute, dedup.InProgress)
	})
}

// A ClaimBatch that guesses its keys are all new, with one of them
// inserted by an inbox in a caller's transaction still open: the batch
// waits for that transaction, whose statements keep working (the batch's
// unique violation is its own, never the caller's), and then sees the
// key as a duplicate with the inbox's result if the caller committed, or
// acquires it if the caller rolled back; the other keys are acquired.
func TestClaimBatchGuessBesideInboxTransaction(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		for _, commit := range []bool{true, false} {
			s := openStore(t, m.opts...)
			ctx := context.Background()
			pool := s.Pool()
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			c, err := s.Inbox(ctx, tx, key("inboxed"), fpA, time.Hour, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				return []byte("inbox result"), nil
			})
			if err != nil || c.Outcome != dedup.Acquired {
				t.Fatalf("Inbox: %v, %v", c.Outcome, err)
			}
			reqs := []dedup.ClaimRequest{{Key: key("a-new"), Fingerprint: fpA}, {Key: key("inboxed"), Fingerprint: fpA}, {Key: key("z-new"), Fingerprint: fpA}}
			type answer struct {
				cs  []dedup.Claim
				err error
			}
			ch := make(chan answer, 1)
			go func() {
				cs, err := s.ClaimBatch(ctx, reqs, time.Minute)
				ch <- answer{cs, err}
			}()
			for i := 0; ; i++ {
				var waiting bool
				if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND (position($1 in query) > 0 OR $2 AND wait_event = 'advisory'))`, schemaOf(s), s.Partitioned()).Scan(&waiting); err != nil {
					t.Fatal(err)
				}
				if waiting {
					break
				}
				if i > 2000 {
					t.Fatal("the batch never waited for the inbox transaction")
				}
				time.Sleep(5 * time.Millisecond)
			}
			if n := queryInt(t, tx, `SELECT count(*) FROM `+records(s)); n != 1 {
				t.Fatalf("the caller's transaction sees %d records, want its own", n)
			}
			if commit {
				err = tx.Commit(ctx)
			} else {
				err = tx.Rollback(ctx)
			}
			if err != nil {
				t.Fatalf("commit %v: %v", commit, err)
			}
			a := <-ch
			if a.err != nil {
				t.Fatalf("commit %v: ClaimBatch: %v", commit, a.err)
			}
			if a.cs[0].Outcome != dedup.Acquired || a.cs[2].Outcome != dedup.Acquired {
				t.Fatalf("commit %v: new keys %v, %v", commit, a.cs[0].Outcome, a.cs[2].Outcome)
			}
			switch got := a.cs[1]; {
			case commit && (got.Outcome != dedup.Duplicate || string(got.Result) != "inbox result"):
				t.Fatalf("after the inbox committed: %v %q, want its duplicate", got.Outcome, got.Result)
			case !commit && (got.Outcome != dedup.Acquired || got.Attempt != 1):
				t.Fatalf("after the inbox rolled back: %v attempt %d, want acquired", got.Outcome, got.Attempt)
			}
			if n := queryInt(t, pool, `SELECT count(*) FROM `+records(s)); n != 3 {
				t.Fatalf("commit %v: %d records, want 3", commit, n)
			}
		}
	})
}

// For every state of the contract's claim table, a batch that guesses its
// keys are all new (a fresh store, a new key beside the stored one) gives
// the stored key the same outcome, attempt, take-over flag and result as
// a claim of that key alone.
func TestClaimBatchGuessMatchesClaimAlone(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		ctx := context.Background()
		pool := s.Pool()
		table := records(s)
		lapse := func(id string) {
			t.Helper()
			if _, err := pool.Exec(ctx, `UPDATE `+table+` SET deadline = statement_timestamp() - interval '1 second' WHERE `+keyIs(s, "$1", "$2"), key("").Scope, id); err != nil {
				t.Fatal(err)
			}
		}
		done := func(id string, fp dedup.Fingerprint) {
			t.Helper()
			c := mustClaim(t, s, id, fp, time.Minute, dedup.Acquired)
			if err := s.Complete(ctx, c, []byte("result of "+id), time.Hour); err != nil {
				t.Fatal(err)
			}
		}
		states := []struct {
			name  string
			fp    dedup.Fingerprint // of the request
			setup func(id string)
		}{
			{"absent", fpA, func(string) {}},
			{"completed-expired", fpA, func(id string) { done(id, fpB); lapse(id) }},
			{"live-same", fpA, func(id string) { mustClaim(t, s, id, fpA, time.Minute, dedup.Acquired) }},
			{"live-other", fpA, func(id string) { mustClaim(t, s, id, fpB, time.Minute, dedup.Acquired) }},
			{"live-unchecked", fpA, func(id string) { mustClaim(t, s, id, "", time.Minute, dedup.Acquired) }},
			{"expired-same", fpA, func(id string) { mustClaim(t, s, id, fpA, time.Minute, dedup.Acquired); lapse(id) }},
			{"expired-other", fpA, func(id string) { mustClaim(t, s, id, fpB, time.Minute, dedup.Acquired); lapse(id) }},
			{"expired-unchecked-request", "", func(id string) { mustClaim(t, s, id, fpB, time.Minute, dedup.Acquired); lapse(id) }},
			{"done-same", fpA, func(id string) { done(id, fpA) }},
			{"done-other", fpA, func(id string) { done(id, fpB) }},
			{"done-unchecked-request", "", func(id string) { done(id, fpB) }},
		}
		for i, st := range states {
			alone, batched := "alone-"+st.name, "batched-"+st.name
			st.setup(alone)
			st.setup(batched)
			want, err := s.Claim(ctx, key(alone), st.fp, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			fresh, err := pgstore.New(pool, append([]pgstore.Option{pgstore.WithSchema(schemaOf(s))}, m.opts...)...)
			if err != nil {
				t.Fatal(err)
			}
			cs, err := fresh.ClaimBatch(ctx, []dedup.ClaimRequest{{Key: key(fmt.Sprint("a-new-", i)), Fingerprint: fpA}, {Key: key(batched), Fingerprint: st.fp}, {Key: key(fmt.Sprint("z-new-", i))}}, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			got := cs[1]
			if got.Outcome != want.Outcome || got.Attempt != want.Attempt || got.TakenOver != want.TakenOver ||
				string(got.Result) != strings.Replace(string(want.Result), alone, batched, 1) ||
				got.LeaseUntil.IsZero() != want.LeaseUntil.IsZero() || got.ExpiresAt.IsZero() != want.ExpiresAt.IsZero() {
				t.Errorf("%s: batch %+v, alone %+v", st.name, got, want)
			}
			if cs[0].Outcome != dedup.Acquired || cs[2].Outcome != dedup.Acquired {
				t.Errorf("%s: new keys %v, %v", st.name, cs[0].Outcome, cs[2].Outcome)
			}
		}
	})
}
