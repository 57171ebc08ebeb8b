package pgstore_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
)

// ClaimBatch on the plain table first inserts a batch's keys as new ones
// (one INSERT with no ON CONFLICT clause). A batch with a stored key
// fails that insert, which writes nothing, and is claimed by the full
// statement with the same results as claiming each key alone. After such
// a wrong guess the store claims with the full statement until it has
// seen a run of batches of only new keys, a run that each wrong guess
// doubles. The records of the keys a fast batch acquired carry the tokens
// and lease end it returned.
func TestClaimBatchNewKeysThenStored(t *testing.T) {
	s := openStore(t)
	ctx := context.Background()
	pool := s.Pool()
	table := s.Tables().Records
	lease := time.Minute
	batch := func(prefix string, n int) []dedup.ClaimRequest {
		reqs := make([]dedup.ClaimRequest, n)
		for i := range reqs {
			reqs[i] = dedup.ClaimRequest{Key: key(fmt.Sprintf("%s-%03d", prefix, i)), Fingerprint: fpA}
		}
		return reqs
	}
	// stored checks that the key's record holds c's token and lease end.
	stored := func(c dedup.Claim) {
		t.Helper()
		var tok []byte
		var until time.Time
		var attempts int32
		err := pool.QueryRow(ctx, `SELECT token, deadline, attempts FROM `+table+` WHERE id = $1::bytea`, pgstore.EncodeID(c.Key.ID)).Scan(&tok, &until, &attempts)
		if err != nil {
			t.Fatalf("record of %s: %v", c.Key.ID, err)
		}
		if string(tok) != string(c.Token[:]) || !until.Equal(c.LeaseUntil) || int(attempts) != c.Attempt {
			t.Fatalf("record of %s: token %x until %v attempts %d; the claim said %x, %v, %d", c.Key.ID, tok, until, attempts, c.Token[:], c.LeaseUntil, c.Attempt)
		}
	}

	// All new: the fast path.
	var before time.Time
	if err := pool.QueryRow(ctx, `SELECT now()`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	first, err := s.ClaimBatch(ctx, batch("new", 50), lease)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range first {
		if c.Outcome != dedup.Acquired || c.Attempt != 1 || c.LeaseUntil.Before(before.Add(lease)) {
			t.Fatalf("new key %s: %v attempt %d until %v (server time before %v)", c.Key.ID, c.Outcome, c.Attempt, c.LeaseUntil, before)
		}
		stored(c)
	}
	gate := func(what string, wait, run int) {
		t.Helper()
		if w, r := pgstore.GuessWait(s); w != wait || r != run {
			t.Fatalf("%s: the store waits for %d batches of new keys (run %d), want %d (run %d)", what, w, r, wait, run)
		}
	}
	gate("after a batch of new keys", 0, 0)

	// Stored keys in every state among new ones.
	done := mustClaim(t, s, "done", fpA, lease, dedup.Acquired)
	if err := s.Complete(ctx, done, []byte("r"), time.Hour); err != nil {
		t.Fatal(err)
	}
	mustClaim(t, s, "held", fpA, lease, dedup.Acquired)
	mustClaim(t, s, "other", fpB, lease, dedup.Acquired)
	lapsed := mustClaim(t, s, "lapsed", fpA, lease, dedup.Acquired)
	if _, err := pool.Exec(ctx, `UPDATE `+table+` SET deadline = now() - interval '1 second' WHERE id = $1::bytea`, pgstore.EncodeID("lapsed")); err != nil {
		t.Fatal(err)
	}
	mixed := append(batch("mixed", 40), dedup.ClaimRequest{Key: key("done"), Fingerprint: fpA},
		dedup.ClaimRequest{Key: key("held"), Fingerprint: fpA}, dedup.ClaimRequest{Key: key("other"), Fingerprint: fpA},
		dedup.ClaimRequest{Key: key("lapsed"), Fingerprint: fpA}, dedup.ClaimRequest{Key: first[3].Key, Fingerprint: fpA})
	got, err := s.ClaimBatch(ctx, mixed, lease)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]dedup.Outcome{"done": dedup.Duplicate, "held": dedup.InProgress, "other": dedup.Mismatch, "lapsed": dedup.Acquired, first[3].Key.ID: dedup.InProgress}
	for _, c := range got {
		w, ok := want[c.Key.ID]
		if !ok {
			w = dedup.Acquired
		}
		if c.Outcome != w {
			t.Errorf("mixed batch, key %s: %v, want %v", c.Key.ID, c.Outcome, w)
		}
		switch {
		case c.Key.ID == "done" && string(c.Result) != "r":
			t.Errorf("duplicate result %q", c.Result)
		case c.Key.ID == "lapsed" && (c.Attempt != 2 || c.Token == lapsed.Token):
			t.Errorf("take-over: attempt %d, token reused %v", c.Attempt, c.Token == lapsed.Token)
		case c.Outcome == dedup.Acquired:
			stored(c)
		}
	}
	gate("after a wrong guess", 1, 1)
	// The failed insert left nothing: one record per key claimed so far.
	if n := queryInt(t, pool, `SELECT count(*) FROM `+table); n != 50+40+4 {
		t.Fatalf("%d records, want %d", n, 50+40+4)
	}

	// Next batch: the full statement at once (a stored key in it restarts
	// the run), then a batch of new keys ends the run, and the one after
	// guesses again.
	again, err := s.ClaimBatch(ctx, append(batch("again", 5), dedup.ClaimRequest{Key: key("done"), Fingerprint: fpA}), lease)
	if err != nil {
		t.Fatal(err)
	}
	if again[5].Outcome != dedup.Duplicate {
		t.Fatalf("after a stored key: %v", again[5].Outcome)
	}
	gate("after a full batch with a stored key", 1, 1)
	fresh := func(p string) {
		t.Helper()
		cs, err := s.ClaimBatch(ctx, batch(p, 10), lease)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range cs {
			if c.Outcome != dedup.Acquired {
				t.Fatalf("%s: %v", c.Key.ID, c.Outcome)
			}
			stored(c)
		}
	}
	fresh("fresh")
	gate("after the run", 0, 1)
	fresh("fresher")
	gate("after a right guess", 0, 1)

	// Each wrong guess doubles the run: 2, then 4. While the store waits it
	// does not guess: the count goes down only through the full statement.
	for i, run := range []int{2, 4} {
		mixed := append(batch(fmt.Sprintf("m%d", i), 5), dedup.ClaimRequest{Key: key("done"), Fingerprint: fpA})
		cs, err := s.ClaimBatch(ctx, mixed, lease)
		if err != nil {
			t.Fatal(err)
		}
		if cs[5].Outcome != dedup.Duplicate || cs[0].Outcome != dedup.Acquired {
			t.Fatalf("mixed batch %d: %v, %v", i, cs[0].Outcome, cs[5].Outcome)
		}
		gate(fmt.Sprintf("after wrong guess %d", i+2), run, run)
		for j := range run {
			fresh(fmt.Sprintf("f%d-%d", i, j))
			gate(fmt.Sprintf("after %d batches of new keys", j+1), run-j-1, run)
		}
	}
	// No record twice, none lost: every claimed key has one row.
	if n := queryInt(t, pool, `SELECT count(*) FROM `+table); n != 50+40+4+5+10+10+5+2*10+5+4*10 {
		t.Fatalf("%d records, want %d", n, 50+40+4+5+10+10+5+2*10+5+4*10)
	}
}
