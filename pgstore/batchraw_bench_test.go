package pgstore_test

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
)

// BenchmarkBatchVsRaw puts Store.ClaimBatch and Store.CompleteBatch beside
// the raw statements a hand-written consumer would send on a table laid
// out like the store's (a copy of its records table, same columns and
// indexes), at 100 and 1000 keys a batch, from one goroutine:
//
//   - raw-claim: INSERT ... SELECT FROM unnest(...) ON CONFLICT DO
//     NOTHING, returning nothing (it cannot tell a duplicate from a new
//     key, or return a stored result).
//   - claim: Store.ClaimBatch with the same keys, fingerprints and lease.
//   - raw-claim-counted: raw-claim through a CTE that returns the count
//     of the keys it inserted: the least any one-statement claim that
//     reports something per batch costs (it still cannot tell which keys
//     were duplicates).
//   - raw-insert: the same INSERT with no ON CONFLICT clause (it fails
//     on any stored key), the statement ClaimBatch tries first.
//   - claim-fallback: ClaimBatch, on a second store, of a batch whose
//     last key (in key order) is stored already, with the store set to
//     guess that the batch is all new (pgstore.ResetGuess): the worst
//     case of a wrong guess, which inserts every other key, fails on
//     that one, and claims the batch again with the full statement.
//   - raw-complete: UPDATE ... FROM unnest(...) fenced by the token,
//     completing what raw-claim inserted (no ordered locking).
//   - complete: Store.CompleteBatch of what ClaimBatch acquired.
//   - raw-complete-ordered: raw-complete after the row locks in key order
//     that CompleteBatch takes (issue 12), written the same way (a CTE of
//     one FOR NO KEY UPDATE probe per item): the floor for a batch
//     completion that cannot deadlock, completing what a second raw-claim
//     inserted.
//
// Keys are the store's benchmark IDs, fingerprints dedup.FingerprintOf's.
// Every op is one round: the five claims in an order that rotates from
// round to round, then the three completions in an order that rotates, each timed alone
// (the inputs are built outside the timer). It reports each case's keys
// per second over its own time and the two ratios (ours over raw). Run
// it through /tmp/bench with -count 5 for five ratios:
//
//	go test -run '^$' -bench BatchVsRaw -benchtime 200x -count 5 ./pgstore/
func BenchmarkBatchVsRaw(b *testing.B) {
	for _, size := range []int{100, 1000} {
		b.Run(fmt.Sprintf("size=%d", size), func(b *testing.B) {
			s, raw := benchStore(b)
			ctx := context.Background()
			s2 := openStoreOn(b, s.Pool(), freshSchema(b, s.Pool()))
			// The raw statements write the store's layout as a
			// hand-written consumer would: the scope's integer, the ID's
			// and the fingerprint's stored bytes, built outside the timer.
			rawClaim := `INSERT INTO ` + raw + ` (scope, id, state, token, fingerprint, deadline, attempts)
SELECT u.scope, u.id, 1, u.token, u.fp, now() + interval '30 seconds', 1
FROM unnest($1::int4[], $2::bytea[], $3::bytea[], $4::bytea[]) AS u(scope, id, token, fp)
ON CONFLICT DO NOTHING`
			// The least a one-statement claim that reports anything
			// returns: the count of the keys it inserted, through a CTE.
			rawCounted := `WITH i AS (` + rawClaim + ` RETURNING 1) SELECT count(*) FROM i`
			rawInsert := strings.TrimSuffix(rawClaim, "\nON CONFLICT DO NOTHING")
			if rawInsert == rawClaim {
				b.Fatal("raw insert has an ON CONFLICT clause")
			}
			rawComplete := `UPDATE ` + raw + ` r SET result = u.result, deadline = now() + interval '1 hour', state = 2
FROM unnest($1::int4[], $2::bytea[], $3::bytea[], $4::bytea[]) AS u(scope, id, token, result)
WHERE r.scope = u.scope AND r.id = u.id AND r.token = u.token AND r.state = 1`
			rawOrdered := `WITH l AS MATERIALIZED (
	SELECT count(*) AS n FROM unnest($1::int4[], $2::bytea[], $3::bytea[]) AS u(scope, id, token)
	CROSS JOIN LATERAL (
		SELECT 1 FROM ` + raw + ` x WHERE x.scope = u.scope AND x.id = u.id AND x.token = u.token FOR NO KEY UPDATE) x)
UPDATE ` + raw + ` r SET result = u.result, deadline = now() + interval '1 hour', state = 2
FROM unnest($1::int4[], $2::bytea[], $3::bytea[], $4::bytea[]) AS u(scope, id, token, result)
WHERE r.scope = u.scope AND r.id = u.id AND r.token = u.token AND r.state = 1 AND (SELECT n FROM l) >= 0`
			g := newIDs()
			result := []byte("ok")
			var took [8]time.Duration // raw-claim, claim, raw-complete, complete, raw-complete-ordered, raw-claim-counted, raw-insert, claim-fallback
			timed := func(i int, f func() error) {
				start := time.Now()
				err := f()
				took[i] += time.Since(start)
				if err != nil {
					b.Fatal(err)
				}
			}
			round := 0
			step := func() {
				scopes, idv, toks, fps, results := make([]int32, size), make([][]byte, size), make([][]byte, size), make([][]byte, size), make([][]byte, size)
				idv2 := make([][]byte, size)
				reqs := make([]dedup.ClaimRequest, size)
				for i := range size {
					// A fingerprint as dedup.FingerprintOf makes it, the
					// stored digest of it for the raw statements.
					t := dedup.NewToken()
					id := g.next()
					fp := dedup.FingerprintOf([]byte(id))
					scopes[i], idv[i], idv2[i], toks[i], fps[i], results[i] = 1, pgstore.EncodeID(g.next()), pgstore.EncodeID(g.next()), t[:], pgstore.FingerprintDigest(fp), result
					reqs[i] = dedup.ClaimRequest{Key: dedup.Key{Scope: benchScope, ID: id}, Fingerprint: fp}
				}
				// The keys of the ordered raw completion, claimed outside
				// the timer and sorted as CompleteBatch sorts its items.
				slices.SortFunc(idv2, bytes.Compare)
				if _, err := s.Pool().Exec(ctx, rawClaim, scopes, idv2, toks, fps); err != nil {
					b.Fatal(err)
				}
				var claims []dedup.Claim
				idv3, idv4 := make([][]byte, size), make([][]byte, size)
				for i := range idv3 {
					idv3[i], idv4[i] = pgstore.EncodeID(g.next()), pgstore.EncodeID(g.next())
				}
				// The fallback's batch: new keys and, last in key order, a
				// key claimed outside the timer; the store then set to guess.
				fresh, mixed := make([]dedup.ClaimRequest, size), make([]dedup.ClaimRequest, size)
				for i := range size {
					id := g.next()
					fresh[i] = dedup.ClaimRequest{Key: dedup.Key{Scope: benchScope, ID: id}, Fingerprint: dedup.FingerprintOf([]byte(id))}
					id = g.next()
					mixed[i] = dedup.ClaimRequest{Key: dedup.Key{Scope: benchScope, ID: id}, Fingerprint: dedup.FingerprintOf([]byte(id))}
				}
				stored := fmt.Sprintf("zzzz-%d", round)
				mixed[size-1] = dedup.ClaimRequest{Key: dedup.Key{Scope: benchScope, ID: stored}, Fingerprint: fpA}
				if _, err := s2.Claim(ctx, mixed[size-1].Key, fpA, 30*time.Second); err != nil {
					b.Fatal(err)
				}
				if _, err := s2.ClaimBatch(ctx, fresh, 30*time.Second); err != nil {
					b.Fatal(err)
				}
				pgstore.ResetGuess(s2)
				claimCases := []func(){
					func() {
						timed(6, func() error {
							tag, err := s.Pool().Exec(ctx, rawInsert, scopes, idv4, toks, fps)
							if err == nil && tag.RowsAffected() != int64(size) {
								err = fmt.Errorf("raw insert inserted %d", tag.RowsAffected())
							}
							return err
						})
					},
					func() {
						timed(7, func() error {
							cs, err := s2.ClaimBatch(ctx, mixed, 30*time.Second)
							if err == nil && (cs[size-1].Outcome != dedup.InProgress || cs[0].Outcome != dedup.Acquired) {
								err = fmt.Errorf("fallback batch: %v, %v", cs[0].Outcome, cs[size-1].Outcome)
							}
							return err
						})
					},
					func() {
						timed(5, func() error {
							var n int64
							err := s.Pool().QueryRow(ctx, rawCounted, scopes, idv3, toks, fps).Scan(&n)
							if err == nil && n != int64(size) {
								err = fmt.Errorf("counted raw claim inserted %d", n)
							}
							return err
						})
					},
					func() {
						timed(0, func() error { _, err := s.Pool().Exec(ctx, rawClaim, scopes, idv, toks, fps); return err })
					},
					func() {
						timed(1, func() error {
							var err error
							claims, err = s.ClaimBatch(ctx, reqs, 30*time.Second)
							if err == nil && claims[size-1].Outcome != dedup.Acquired {
								err = fmt.Errorf("claim %v", claims[size-1].Outcome)
							}
							return err
						})
					},
				}
				for k := range claimCases {
					claimCases[(k+round)%len(claimCases)]()
				}
				items := make([]dedup.Completion, size)
				for i, c := range claims {
					items[i] = dedup.Completion{Claim: c, Result: result}
				}
				completeCases := []func(){
					func() {
						timed(2, func() error {
							tag, err := s.Pool().Exec(ctx, rawComplete, scopes, idv, toks, results)
							if err == nil && tag.RowsAffected() != int64(size) {
								err = fmt.Errorf("raw complete updated %d rows", tag.RowsAffected())
							}
							return err
						})
					},
					func() {
						timed(3, func() error {
							errs, err := s.CompleteBatch(ctx, items, time.Hour)
							if err == nil && errs[size-1] != nil {
								err = errs[size-1]
							}
							return err
						})
					},
				}
				completeCases = append(completeCases, func() {
					timed(4, func() error {
						tag, err := s.Pool().Exec(ctx, rawOrdered, scopes, idv2, toks, results)
						if err == nil && tag.RowsAffected() != int64(size) {
							err = fmt.Errorf("raw ordered complete updated %d rows", tag.RowsAffected())
						}
						return err
					})
				})
				for k := range completeCases {
					completeCases[(k+round)%len(completeCases)]()
				}
				round++
			}
			for range 5 {
				step() // connections dialled, statements prepared
			}
			took = [8]time.Duration{}
			round = 0
			for b.Loop() {
				step()
			}
			rate := func(i int) float64 { return float64(round*size) / took[i].Seconds() }
			b.ReportMetric(rate(0), "raw-claim-ids/s")
			b.ReportMetric(rate(1), "claim-ids/s")
			b.ReportMetric(rate(1)/rate(0), "claim/raw")
			b.ReportMetric(rate(5), "raw-counted-claim-ids/s")
			b.ReportMetric(rate(1)/rate(5), "claim/raw-counted")
			b.ReportMetric(rate(6), "raw-insert-ids/s")
			b.ReportMetric(rate(1)/rate(6), "claim/raw-insert")
			b.ReportMetric(rate(7), "claim-fallback-ids/s")
			b.ReportMetric(rate(7)/rate(0), "claim-fallback/raw")
			b.ReportMetric(rate(2), "raw-complete-ids/s")
			b.ReportMetric(rate(3), "complete-ids/s")
			b.ReportMetric(rate(3)/rate(2), "complete/raw")
			b.ReportMetric(rate(4), "raw-ordered-complete-ids/s")
			b.ReportMetric(rate(3)/rate(4), "complete/raw-ordered")
		})
	}
}
