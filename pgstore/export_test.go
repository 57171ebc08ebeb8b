package pgstore

import "context"

// UseCaseInbox makes s's RunInbox claim with the CASE-per-column upsert,
// for tests and benchmarks that compare it with the acquire-only claim.
func UseCaseInbox(s *Store) { s.caseInbox = true }

// UseUnorderedCompleteBatch makes s's CompleteBatch send the statement it
// used before issue 12: one UPDATE ... FROM unnest whose join locks rows
// in whatever order the plan visits them. Only the benchmark that
// measures what ordered locking costs uses it.
func UseUnorderedCompleteBatch(s *Store) {
	table := s.names.records
	if s.cfg.partition > 0 {
		table = s.names.recordsP
	}
	s.sql.completeBatch = `UPDATE ` + table + ` r SET
	result   = CASE WHEN r.state = 1 THEN u.result ELSE r.result END,
	deadline = CASE WHEN r.state = 1 THEN ` + deadline(now+` + `+retentionFor(&s.names, "u.scope", "$5")) + ` ELSE r.deadline END,
	state    = 2
FROM unnest($1::int4[], $2::bytea[], $3::bytea[], $4::bytea[]) WITH ORDINALITY AS u(scope, id, token, result, o)
WHERE r.scope = u.scope AND r.id = u.id AND r.token = u.token
RETURNING u.o`
}

// MigrateTo migrates s's schema up to version v only, for tests that
// start from an older schema.
func MigrateTo(ctx context.Context, s *Store, v int) (MigrateResult, error) { return s.migrate(ctx, v) }

// EncodeID and DecodeID are encodeID and decodeID, FingerprintDigest is
// fpDigest: tests compare them with the SQL functions of migrations 0006 and 0007.
var (
	EncodeID          = encodeID
	DecodeID          = decodeID
	FingerprintDigest = fpDigest
)

// GuessWait returns how many batches of new keys s's plain ClaimBatch
// still wants to see, claimed by the full statement, before it guesses
// again that a batch is all new (0: the next batch guesses), and the run
// it wants after a wrong guess.
func GuessWait(s *Store) (wait, run int) {
	s.guess.mu.Lock()
	defer s.guess.mu.Unlock()
	return s.guess.wait, s.guess.run
}

// CompleteBatchSQL is the statement s's CompleteBatch sends.
func CompleteBatchSQL(s *Store) string { return s.sql.completeBatch }

// ResetGuess makes s's next plain ClaimBatch guess that its batch is all
// new, as a fresh store does: the benchmark of a wrong guess uses it.
func ResetGuess(s *Store) {
	s.guess.mu.Lock()
	defer s.guess.mu.Unlock()
	s.guess.wait, s.guess.run = 0, 0
}

// VacuumRuns returns how many VACUUMs s has sent (WithVacuum).
func VacuumRuns(s *Store) int64 { return s.vac.runs.Load() }

// WaitVacuum waits for s's vacuum run in flight, if any. The caller must
// not complete records meanwhile.
func WaitVacuum(s *Store) { s.vac.wg.Wait() }

// SetConverted sets whether s believes the conversion from the old
// tables is done. False is always safe (the next statements move the
// key's old record first, and learn there is none); tests flip it while
// claims run, as a store's first claims see it flip.
func SetConverted(s *Store, done bool) { s.converted.Store(done) }

// SetVacuumStarted makes f run first in each vacuum run's goroutine, before
// the run uses the pool. Set it before the completions start.
func SetVacuumStarted(s *Store, f func()) { s.vac.started = f }
