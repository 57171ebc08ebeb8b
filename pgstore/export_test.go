package pgstore

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
	result     = CASE WHEN r.state = 1 THEN u.result ELSE r.result END,
	expires_at = CASE WHEN r.state = 1 THEN ` + deadline(now+` + `+retentionFor(&s.names, "u.scope", "$5")) + ` ELSE r.expires_at END,
	state      = 2
FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bytea[]) WITH ORDINALITY AS u(scope, id, token, result, o)
WHERE r.scope = u.scope AND r.id = u.id AND r.token = u.token
RETURNING u.o`
}
