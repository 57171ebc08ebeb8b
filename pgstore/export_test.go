package pgstore

// UseCaseInbox makes s's RunInbox claim with the CASE-per-column upsert,
// for tests and benchmarks that compare it with the acquire-only claim.
func UseCaseInbox(s *Store) { s.caseInbox = true }
