package memstore

// SetBytesLooked makes f run in every claim of a new key once it has
// looked whether the record fits under the byte bound (under its shard's
// lock). Set it before the claims start.
func SetBytesLooked(s *Store, f func()) { s.bytesLooked = f }

// SameShard reports whether the IDs a and b fall in one shard of s.
func SameShard(s *Store, a, b string) bool {
	_, sa := s.hash(a)
	_, sb := s.hash(b)
	return sa == sb
}
