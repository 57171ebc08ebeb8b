package pgstore

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// row is a record as a claim statement returns it.
type row struct {
	state       int16
	token       []byte
	attempts    int32
	fingerprint []byte
	result      []byte
	leaseUntil  time.Time
	expiresAt   time.Time
}

func (r *row) dest() []any {
	return []any{&r.state, &r.token, &r.attempts, &r.fingerprint, &r.result, &r.leaseUntil, &r.expiresAt}
}

// errNotReadCommitted is the failure of a partitioned claim outside READ
// COMMITTED, where the statement does nothing (see partitionedUpsert).
var errNotReadCommitted = errors.New("the partitioned records table needs READ COMMITTED transactions (the claim checks for a committed record after taking the key's lock, which REPEATABLE READ and SERIALIZABLE snapshots cannot see); nothing was written. Use READ COMMITTED for the inbox transaction, or check default_transaction_isolation")

// outcome turns the row a claim statement returned into a Claim (see
// dedup.ClaimedRecord.ClaimFor). tok is nil for a key repeated in a batch, which
// did not run the statement itself.
func outcome(key dedup.Key, fp dedup.Fingerprint, fpd []byte, tok *dedup.Token, r *row) (dedup.Claim, error) {
	if r.state != stateInProgress && r.state != stateCompleted {
		return dedup.Claim{}, fmt.Errorf("record of key %s has unknown state %d", key, r.state)
	}
	var own dedup.Token
	if tok != nil {
		own = *tok
	}
	rec := dedup.ClaimedRecord{Completed: r.state == stateCompleted, Token: r.token, Attempts: int(r.attempts),
		Fingerprint: recordFingerprint(r.fingerprint, fp, fpd), Result: r.result, LeaseUntil: r.leaseUntil, ExpiresAt: r.expiresAt}
	return rec.ClaimFor(key, fp, own), nil
}

// Claim asks to own key for lease, in one INSERT ... ON CONFLICT DO UPDATE
// statement (partitioned: in one round trip that takes the key's advisory
// lock, then claims); see [dedup.Store]. A take-over of an expired lease
// counts attempt + 1; after Release or an expired completion the count
// restarts at 1. The lease is measured by the server's clock.
//
// A claim that finds the key held or completed still writes a new version
// of the row (the DO UPDATE sets every column to its own value): that is
// the price of deciding in one statement that sees the latest committed
// row; see the package documentation.
func (s *Store) Claim(ctx context.Context, key dedup.Key, fp dedup.Fingerprint, lease time.Duration) (dedup.Claim, error) {
	if err := dedup.ValidateClaim(key, fp, lease); err != nil {
		return dedup.Claim{}, err
	}
	if err := s.begin(ctx, "claim"); err != nil {
		return dedup.Claim{}, err
	}
	ref, err := s.ref(ctx, key)
	if err != nil {
		return dedup.Claim{}, s.fail(ctx, "claim", err, true)
	}
	tok := dedup.NewToken()
	fpd := fpDigest(fp)
	var r row
	args := []any{ref.scope, ref.id, tok[:], fpd, micros(lease)}
	if s.cfg.partition > 0 {
		err = s.lockedRow(ctx, s.pool, s.keyLock(key), key, s.sql.pClaim, &r, args...)
	} else {
		err = s.adoptedRow(ctx, s.pool, key, s.sql.claim, &r, args...)
	}
	if err != nil {
		return dedup.Claim{}, s.failAuto(ctx, "claim", err)
	}
	c, err := outcome(key, fp, fpd, &tok, &r)
	if err != nil {
		return dedup.Claim{}, s.fail(ctx, "claim", err, false)
	}
	return c, nil
}

// batcher is what lockedRow sends its two statements through: the pool
// (one implicit transaction per batch) or the caller's transaction.
type batcher interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// lockedRow runs the key's advisory lock and then a partitioned claim
// statement in one round trip and scans its row. On the pool both run in
// one implicit transaction (the pipeline ends with a single Sync), so the
// lock is held until the claim commits; each statement takes its own
// snapshot, so the claim sees every commit made before the lock. While a
// conversion is pending the key's old record is moved between the two.
func (s *Store) lockedRow(ctx context.Context, b batcher, lock int64, key dedup.Key, query string, r *row, args ...any) error {
	var batch pgx.Batch
	adopt := s.queueLocked(&batch, lock, key, query, args...)
	br := b.SendBatch(ctx, &batch)
	err := s.readLocked(br, adopt, r)
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return err
}

// adoptedRow runs a plain-table claim statement and scans its row; while
// a conversion is pending it first moves the key's old record, in the
// same round trip and implicit transaction.
func (s *Store) adoptedRow(ctx context.Context, b batcher, key dedup.Key, query string, r *row, args ...any) error {
	// One look at the flag decides both what is queued and what is read:
	// it may turn true between two looks.
	var batch pgx.Batch
	adopt := !s.converted.Load()
	if adopt {
		batch.Queue(s.sql.adoptIDs, []string{key.Scope}, []string{key.ID}, []int32{args[0].(int32)})
	}
	batch.Queue(query, args...)
	br := b.SendBatch(ctx, &batch)
	var err error
	if adopt {
		err = s.readAdopt(br)
	}
	if err == nil {
		err = br.QueryRow().Scan(r.dest()...)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return err
}

// queueAdopt queues the move of the old records of the keys (sorted)
// when a conversion may be pending, and reports whether it did.
func (s *Store) queueAdopt(batch *pgx.Batch, partitioned bool, scopes, ids []string, sids []int32) bool {
	if s.converted.Load() {
		return false
	}
	q := s.sql.adoptIDs
	if partitioned {
		q = s.sql.pAdoptIDs
	}
	batch.Queue(q, scopes, ids, sids)
	return true
}

// readAdopt reads what queueAdopt queued and notes when the old tables
// are gone.
func (s *Store) readAdopt(br pgx.BatchResults) error {
	var pending bool
	if err := br.QueryRow().Scan(&pending); err != nil {
		return err
	}
	if !pending {
		s.converted.Store(true)
	}
	return nil
}

// queueLocked queues on batch the key's advisory lock, the move of its
// old record while a conversion is pending (reported), and then the
// partitioned claim statement query, for readLocked.
func (s *Store) queueLocked(batch *pgx.Batch, lock int64, key dedup.Key, query string, args ...any) (adopt bool) {
	batch.Queue(s.sql.lock, lock)
	adopt = s.queueAdopt(batch, true, []string{key.Scope}, []string{key.ID}, []int32{args[0].(int32)})
	batch.Queue(query, args...)
	return adopt
}

// readLocked reads the results of what queueLocked queued, the claim's
// row into r. The caller closes br.
func (s *Store) readLocked(br pgx.BatchResults, adopt bool, r *row) error {
	if _, err := br.Exec(); err != nil {
		return err
	}
	if adopt {
		if err := s.readAdopt(br); err != nil {
			return err
		}
	}
	var scope int32
	var id []byte
	dest := append([]any{&scope, &id}, r.dest()...)
	err := br.QueryRow().Scan(dest...)
	if errors.Is(err, pgx.ErrNoRows) {
		err = errNotReadCommitted
	}
	return err
}

// ClaimBatch claims every request in one statement; see
// [dedup.BatchClaimer]. The claims are atomic together (one implicit
// transaction): on error nothing was claimed if the error says
// SafeToRetry, and otherwise the claims may have been stored and their
// leases will expire.
//
// PostgreSQL refuses to update one row twice in a statement, so a key
// repeated in the batch is sent once: its first request claims it, and each
// later request reports what a claim right after the first would have
// seen: in progress if the first acquired or found it in progress, a
// duplicate with the stored result if the first found it completed, or a
// mismatch if its fingerprint differs from the record's. The distinct keys
// are sent in (scope, id) order, so two batches with keys in common lock
// them in the same order and cannot deadlock each other.
func (s *Store) ClaimBatch(ctx context.Context, reqs []dedup.ClaimRequest, lease time.Duration) ([]dedup.Claim, error) {
	if err := dedup.ValidateBatch(reqs, lease); err != nil {
		return nil, err
	}
	if err := s.begin(ctx, "claim batch"); err != nil {
		return nil, err
	}
	out := make([]dedup.Claim, len(reqs))
	if len(reqs) == 0 {
		return out, nil
	}
	keyOf := func(i int) dedup.Key { return reqs[i].Key }
	first, order, _ := distinct(len(reqs), keyOf, keyOf)
	n := len(order)
	scopes, ids := make([]int32, n), make([][]byte, n)
	tokens, fps := make([][]byte, n), make([][]byte, n)
	fpds := make([][]byte, len(reqs)) // the fingerprint digest of each request
	toks := make([]dedup.Token, len(reqs))
	var textScopes, textIDs []string // for the move of old records
	if !s.converted.Load() {
		textScopes, textIDs = make([]string, n), make([]string, n)
	}
	// The digests and IDs of the batch share one buffer each.
	fpBuf := make([]byte, 16*len(reqs))
	var scratch []byte
	idBytes := 0
	for i := range reqs {
		fpds[i], scratch = digestInto(fpBuf[16*i:16*i:16*i+16], scratch, reqs[i].Fingerprint)
		idBytes += len(reqs[i].Key.ID) + 1
	}
	idBuf := make([]byte, 0, idBytes)
	// Every token of the batch is the batch's random prefix and then the
	// key's position in it: unique per key (the prefix is 64 random bits
	// per batch), and the plain statement tells the records it acquired by
	// the prefix alone (see plainBatch).
	prefix := dedup.NewToken()
	var sc lastScope
	for j, i := range order {
		k := reqs[i].Key
		sid, err := sc.id(ctx, s, k.Scope)
		if err != nil {
			return nil, s.fail(ctx, "claim batch", err, true)
		}
		copy(toks[i][:8], prefix[:8])
		binary.BigEndian.PutUint64(toks[i][8:], uint64(j)+1)
		start := len(idBuf)
		idBuf = appendID(idBuf, k.ID)
		scopes[j], ids[j] = sid, idBuf[start:len(idBuf):len(idBuf)]
		tokens[j], fps[j] = toks[i][:], fpds[i]
		if textScopes != nil {
			textScopes[j], textIDs[j] = k.Scope, k.ID
		}
	}
	var rowsOf []row // indexed like reqs; set for first requests with a row
	var hasRow []bool
	rowsFor := func() { rowsOf, hasRow = make([]row, len(reqs)), make([]bool, len(reqs)) }
	got := 0
	// The plain statement returns a row only for a key it did not acquire
	// with attempt 1, then a summary row (state 0) with the number of keys
	// it claimed and the lease end of those it acquired; the partitioned
	// one returns a row for every key.
	var summary row
	summarized := false
	var byRef map[string]int // stored key -> first request
	scan := func(rows pgx.Rows) error {
		var scope *int32
		var id []byte
		var r row
		dest := append([]any{&scope, &id}, r.dest()...)
		for rows.Next() {
			r = row{}
			if err := rows.Scan(dest...); err != nil {
				return err
			}
			if r.state == 0 {
				summary, summarized = r, true
				continue
			}
			if scope == nil || id == nil {
				return errors.New("the batch returned a row without a key")
			}
			if byRef == nil {
				// Built on the first row that needs it: a batch of new keys
				// returns none.
				byRef = make(map[string]int, n)
				for j, i := range order {
					byRef[refString(scopes[j], ids[j])] = i
				}
			}
			i, ok := byRef[refString(*scope, id)]
			if !ok || hasRow[i] {
				return fmt.Errorf("the batch returned key %d/%x, which it did not send or sent once", *scope, id)
			}
			rowsOf[i], hasRow[i] = r, true
			got++
		}
		return rows.Err()
	}
	var err error
	if s.cfg.partition > 0 {
		rowsFor()
		err = s.partitionedBatch(ctx, order, reqs, textScopes, textIDs, scopes, ids, tokens, fps, micros(lease), scan)
	} else {
		inserted := false
		if s.guess.try() {
			// The common batch: every key new. Insert them all and be done,
			// or learn that one was stored and claim with the full statement.
			var until time.Time
			if until, inserted, err = s.claimNew(ctx, textScopes, textIDs, scopes, ids, tokens, fps, micros(lease)); inserted {
				// Every key acquired with attempt 1 and its own token; a
				// repeat of a key in the batch reads its first request's
				// record.
				for i, r := range reqs {
					if f := first[i]; f != i {
						rr := row{state: stateInProgress, token: toks[f][:], attempts: 1, fingerprint: fpds[f], leaseUntil: until, expiresAt: until}
						if out[i], err = outcome(r.Key, r.Fingerprint, fpds[i], nil, &rr); err != nil {
							return nil, s.fail(ctx, "claim batch", err, false)
						}
						continue
					}
					out[i] = dedup.Claim{Key: r.Key, Outcome: dedup.Acquired, Token: toks[i], Attempt: 1, LeaseUntil: until}
				}
				return out, nil
			} else if err == nil {
				s.guess.wrong()
			}
		}
		if !inserted && err == nil {
			rowsFor()
			var batch pgx.Batch
			adopt := s.queueAdopt(&batch, false, textScopes, textIDs, scopes)
			batch.Queue(s.sql.claimBatch, scopes, ids, tokens, fps, micros(lease), prefix[:8])
			br := s.pool.SendBatch(ctx, &batch)
			if adopt {
				err = s.readAdopt(br)
			}
			if err == nil {
				var rows pgx.Rows
				if rows, err = br.Query(); err == nil {
					err = scan(rows)
					rows.Close()
					if err == nil {
						err = rows.Err()
					}
				}
			}
			if cerr := br.Close(); err == nil {
				err = cerr
			}
			if err == nil {
				// Only the summary row came back when every key was new.
				s.guess.full(got == 0)
			}
		}
	}
	if err == nil && summarized {
		// Every key without a row of its own was acquired with attempt 1.
		if int(summary.attempts) != n {
			err = fmt.Errorf("the batch claimed %d keys of %d", summary.attempts, n)
		}
		for _, i := range order {
			if !hasRow[i] {
				// Its record is the one it sent (a repeat of the key in the
				// batch reads it), and only the lease end matters while it is
				// in progress.
				rowsOf[i] = row{state: stateInProgress, token: toks[i][:], attempts: 1, fingerprint: fpds[i], leaseUntil: summary.leaseUntil, expiresAt: summary.expiresAt}
				got++
			}
		}
	}
	if err == nil && got != n {
		err = fmt.Errorf("the batch returned %d rows for %d keys", got, n)
		if got == 0 && s.cfg.partition > 0 {
			err = errNotReadCommitted
		}
	}
	if err != nil {
		return nil, s.failAuto(ctx, "claim batch", err)
	}
	for i, r := range reqs {
		f := first[i]
		var tok *dedup.Token
		if f == i {
			tok = &toks[i]
		}
		rr := rowsOf[f]
		if f != i && rr.result != nil {
			rr.result = bytes.Clone(rr.result) // each claim owns its result
		}
		if out[i], err = outcome(r.Key, r.Fingerprint, fpds[i], tok, &rr); err != nil {
			return nil, s.fail(ctx, "claim batch", err, false)
		}
	}
	return out, nil
}

// claimNew is ClaimBatch's fast path on the plain table, for a batch
// whose keys are all new (distinct, sorted; the arrays as for the
// claimBatch statement): one statement that inserts every key's record in
// progress, in array order, with no ON CONFLICT clause, and returns their
// lease end (see newBatch). It reports whether the keys were inserted, all
// of them acquired with attempt 1 and the tokens sent: a plain INSERT ...
// SELECT FROM unnest inserts a row for every element or fails.
//
// A key already stored (in any state, or inserted by a concurrent
// transaction that then committed) makes the INSERT fail with a unique
// violation, which rolls the whole statement back: nothing is written,
// the locks taken so far are released, and claimNew returns false with no
// error, for the caller to claim the batch with the full statement, which
// reads every stored record. So each key's outcome is decided by one
// statement, and each transaction takes its row locks in key order, as the
// full statement does. Such a failed attempt logs the unique violation in
// the server's log and leaves the rows inserted before it as dead
// versions; the store tries the fast path again only after a run of
// batches of new keys that each wrong guess makes longer (see guessGate).
//
// Without the per-key report of the full statement (a flag or a record
// for each key, through a CTE), a batch of new keys costs no more than a
// raw INSERT ... ON CONFLICT DO NOTHING of the same rows (see
// BenchmarkBatchVsRaw).
func (s *Store) claimNew(ctx context.Context, textScopes, textIDs []string, scopes []int32, ids, tokens, fps [][]byte, lease int64) (until time.Time, inserted bool, err error) {
	if s.converted.Load() {
		err = s.pool.QueryRow(ctx, s.sql.claimNew, scopes, ids, tokens, fps, lease).Scan(&until)
	} else {
		var batch pgx.Batch
		adopt := s.queueAdopt(&batch, false, textScopes, textIDs, scopes)
		batch.Queue(s.sql.claimNew, scopes, ids, tokens, fps, lease)
		br := s.pool.SendBatch(ctx, &batch)
		if adopt {
			err = s.readAdopt(br)
		}
		if err == nil {
			err = br.QueryRow().Scan(&until)
		}
		if cerr := br.Close(); err == nil {
			err = cerr
		}
	}
	if s.keyStored(err) {
		return time.Time{}, false, nil
	}
	return until, err == nil, err
}

// keyStored reports whether err is the unique violation of claimNew's
// INSERT on the records table's primary key.
func (s *Store) keyStored(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "23505" && pe.SchemaName == s.names.schemaName && pe.TableName == s.names.prefix+"rec"
}

// distinct finds the first occurrence of each of n items by id: first[i]
// is the index of the first item with the id of item i, seen maps each id
// to its first item, and order lists the first items sorted by key, so
// that two batches with keys in common lock them in the same order and
// cannot deadlock each other.
func distinct[T comparable](n int, id func(i int) T, key func(i int) dedup.Key) (first, order []int, seen map[T]int) {
	first, order, seen = make([]int, n), make([]int, 0, n), make(map[T]int, n)
	for i := range n {
		k := id(i)
		if j, ok := seen[k]; ok {
			first[i] = j
			continue
		}
		seen[k], first[i] = i, i
		order = append(order, i)
	}
	slices.SortFunc(order, func(a, b int) int {
		ka, kb := key(a), key(b)
		if c := strings.Compare(ka.Scope, kb.Scope); c != 0 {
			return c
		}
		return strings.Compare(ka.ID, kb.ID)
	})
	return first, order, seen
}

// partitionedBatch locks the keys of a batch (sorted, distinct lock keys)
// and claims them, in one round trip and one implicit transaction.
func (s *Store) partitionedBatch(ctx context.Context, order []int, reqs []dedup.ClaimRequest, textScopes, textIDs []string, scopes []int32, ids, tokens, fps [][]byte, lease int64, scan func(pgx.Rows) error) error {
	locks := make([]int64, len(order))
	for j, i := range order {
		locks[j] = s.keyLock(reqs[i].Key)
	}
	slices.Sort(locks)
	locks = slices.Compact(locks)
	var batch pgx.Batch
	batch.Queue(s.sql.lockMany, locks)
	adopt := s.queueAdopt(&batch, true, textScopes, textIDs, scopes)
	batch.Queue(s.sql.pClaimBatch, scopes, ids, tokens, fps, lease)
	br := s.pool.SendBatch(ctx, &batch)
	defer br.Close()
	if _, err := br.Exec(); err != nil {
		return err
	}
	if adopt {
		if err := s.readAdopt(br); err != nil {
			return err
		}
	}
	rows, err := br.Query()
	if err != nil {
		return err
	}
	err = scan(rows)
	rows.Close()
	if err == nil {
		err = rows.Err()
	}
	if err == nil {
		err = br.Close()
	}
	return err
}

// Complete marks an acquired claim completed with result, kept for
// retention (or the scope's retention window, if longer; see
// [Store.SetRetention]), in one UPDATE fenced by the claim's token; see
// [dedup.Store]. It returns [dedup.ErrLeaseLost] when the token no longer
// owns the record. A lease that ran out but was not taken over may still
// complete; completing twice with the same token changes nothing.
func (s *Store) Complete(ctx context.Context, c dedup.Claim, result []byte, retention time.Duration) error {
	if err := dedup.ValidateComplete(c, retention); err != nil {
		return err
	}
	if err := s.begin(ctx, "complete"); err != nil {
		return err
	}
	ref, err := s.ref(ctx, c.Key)
	if err != nil {
		return s.fail(ctx, "complete", err, true)
	}
	tag, err := s.pool.Exec(ctx, s.sql.complete, ref.scope, ref.id, c.Token[:], result, micros(retention))
	if err != nil {
		return s.failAuto(ctx, "complete", err)
	}
	if tag.RowsAffected() == 0 {
		return dedup.ErrLeaseLost
	}
	s.completed(1)
	return nil
}

// CompleteBatch completes every item in one UPDATE over unnest, each
// fenced by its own token as Complete fences it; see
// [dedup.BatchCompleter]. The statement is one implicit transaction: on
// error no item is completed if the error says SafeToRetry, and otherwise
// any may be. An item repeated in the batch (the same key and token) is
// sent once and the repeats report what its first occurrence did; the
// stored result is the first occurrence's, as if they ran one after the
// other. The distinct items are sent in key order, so two batches with
// keys in common update them in the same order.
func (s *Store) CompleteBatch(ctx context.Context, items []dedup.Completion, retention time.Duration) ([]error, error) {
	if err := dedup.ValidateCompleteBatch(items, retention); err != nil {
		return nil, err
	}
	if err := s.begin(ctx, "complete batch"); err != nil {
		return nil, err
	}
	errs := make([]error, len(items))
	if len(items) == 0 {
		return errs, nil
	}
	type item struct {
		key dedup.Key
		tok dedup.Token
	}
	first, order, _ := distinct(len(items),
		func(i int) item { return item{items[i].Claim.Key, items[i].Claim.Token} },
		func(i int) dedup.Key { return items[i].Claim.Key })
	n := len(order)
	scopes, ids := make([]int32, n), make([][]byte, n)
	tokens, results := make([][]byte, n), make([][]byte, n)
	var sc lastScope
	for j, i := range order {
		c := &items[i].Claim
		sid, err := sc.id(ctx, s, c.Key.Scope)
		if err != nil {
			return nil, s.fail(ctx, "complete batch", err, true)
		}
		scopes[j], ids[j], tokens[j], results[j] = sid, encodeID(c.Key.ID), c.Token[:], items[i].Result
	}
	var completed int64
	var lost []int64 // ordinals (from 1) of the distinct items whose tokens lost their records
	err := s.pool.QueryRow(ctx, s.sql.completeBatch, scopes, ids, tokens, results, micros(retention)).Scan(&completed, &lost)
	if err == nil && completed+int64(len(lost)) != int64(n) {
		err = fmt.Errorf("the batch completed %d items and lost %d of %d", completed, len(lost), n)
	}
	if err != nil {
		return nil, s.failAuto(ctx, "complete batch", err)
	}
	s.completed(int(completed))
	if len(lost) == 0 {
		return errs, nil
	}
	done := make([]bool, n)
	for j := range done {
		done[j] = true
	}
	for _, o := range lost {
		if o < 1 || o > int64(n) {
			return nil, s.fail(ctx, "complete batch", fmt.Errorf("the batch returned item %d of %d", o, n), false)
		}
		done[o-1] = false
	}
	pos := make([]int, len(items)) // index in order of each first item
	for j, i := range order {
		pos[i] = j
	}
	for i := range items {
		if !done[pos[first[i]]] {
			errs[i] = dedup.ErrLeaseLost
		}
	}
	return errs, nil
}

// Release removes an acquired claim that is still in progress, in one
// DELETE fenced by its token; the next claim acquires at once with attempt
// 1. It never removes a completed record: that, or a token that no longer
// owns the record, gives [dedup.ErrLeaseLost].
func (s *Store) Release(ctx context.Context, c dedup.Claim) error {
	if err := dedup.ValidateRelease(c); err != nil {
		return err
	}
	if err := s.begin(ctx, "release"); err != nil {
		return err
	}
	ref, err := s.ref(ctx, c.Key)
	if err != nil {
		return s.fail(ctx, "release", err, true)
	}
	tag, err := s.pool.Exec(ctx, s.sql.release, ref.scope, ref.id, c.Token[:])
	if err != nil {
		return s.failAuto(ctx, "release", err)
	}
	if tag.RowsAffected() == 0 {
		return dedup.ErrLeaseLost
	}
	return nil
}

// Extend moves the lease of an acquired claim that is still in progress to
// now + lease on the server's clock, in one UPDATE fenced by its token, and
// returns the claim with its new LeaseUntil; see [dedup.Extender]. A lease
// that ran out but was not taken over can still be extended.
func (s *Store) Extend(ctx context.Context, c dedup.Claim, lease time.Duration) (dedup.Claim, error) {
	if err := dedup.ValidateRelease(c); err != nil {
		return dedup.Claim{}, err
	}
	if lease <= 0 {
		return dedup.Claim{}, &dedup.ArgumentError{Arg: "lease", Reason: "must be positive, got " + lease.String()}
	}
	if err := s.begin(ctx, "extend"); err != nil {
		return dedup.Claim{}, err
	}
	ref, err := s.ref(ctx, c.Key)
	if err != nil {
		return dedup.Claim{}, s.fail(ctx, "extend", err, true)
	}
	var until time.Time
	err = s.pool.QueryRow(ctx, s.sql.extend, ref.scope, ref.id, c.Token[:], micros(lease)).Scan(&until)
	if errors.Is(err, pgx.ErrNoRows) {
		return dedup.Claim{}, dedup.ErrLeaseLost
	}
	if err != nil {
		return dedup.Claim{}, s.failAuto(ctx, "extend", err)
	}
	c.LeaseUntil = until
	return c, nil
}

// adoptKey moves the key's old record into the compact table while a
// conversion is pending, in a transaction of its own (partitioned: under
// the key's advisory lock), for the steps that cannot do it in their own
// round trip. It does nothing once the old tables are gone.
func (s *Store) adoptKey(ctx context.Context, key dedup.Key) error {
	if s.converted.Load() {
		return nil
	}
	sid, err := s.scopeID(ctx, key.Scope)
	if err != nil {
		return err
	}
	scopes, ids, sids := []string{key.Scope}, []string{key.ID}, []int32{sid}
	var pending bool
	if s.cfg.partition == 0 {
		err = s.pool.QueryRow(ctx, s.sql.adoptIDs, scopes, ids, sids).Scan(&pending)
	} else {
		err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, s.sql.lock, s.keyLock(key)); err != nil {
				return err
			}
			return tx.QueryRow(ctx, s.sql.pAdoptIDs, scopes, ids, sids).Scan(&pending)
		})
	}
	if err == nil && !pending {
		s.converted.Store(true)
	}
	return err
}
