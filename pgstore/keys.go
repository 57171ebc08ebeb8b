package pgstore

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"sync"

	"github.com/dedupkit/dedup"
)

// How a key and a fingerprint are stored in the compact records
// (migration 0006). The SQL functions key_id and key_text of that
// migration do the same in the server; TestKeyEncodingMatchesServer
// checks that the two agree.

// encodeID returns the stored form of a message ID: a canonical lower-case
// UUID as its 16 bytes, any other ID as its bytes, after a zero byte when
// it is itself 16 bytes long. A valid ID has no control character, so no
// text ID starts with a zero byte and the forms never collide.
func encodeID(id string) []byte { return appendID(make([]byte, 0, len(id)+1), id) }

// appendID appends encodeID(id) to dst.
func appendID(dst []byte, id string) []byte {
	if u, ok := parseUUID(id); ok {
		return append(dst, u[:]...)
	}
	if len(id) == 16 {
		dst = append(dst, 0)
	}
	return append(dst, id...)
}

// decodeID is the inverse of encodeID.
func decodeID(b []byte) string {
	switch {
	case len(b) == 16:
		return formatUUID(b)
	case len(b) > 0 && b[0] == 0:
		return string(b[1:])
	}
	return string(b)
}

// parseUUID parses the canonical lower-case form of a UUID
// (8-4-4-4-12 hexadecimal digits).
func parseUUID(s string) (u [16]byte, ok bool) {
	if len(s) != 36 || s[8] != '-' || s[13] != '-' || s[18] != '-' || s[23] != '-' {
		return u, false
	}
	j := 0
	for i := 0; i < 36; {
		if i == 8 || i == 13 || i == 18 || i == 23 {
			i++
			continue
		}
		hi, ok1 := fromHex(s[i])
		lo, ok2 := fromHex(s[i+1])
		if !ok1 || !ok2 {
			return u, false
		}
		u[j] = hi<<4 | lo
		j++
		i += 2
	}
	return u, true
}

func fromHex(c byte) (byte, bool) {
	switch {
	case '0' <= c && c <= '9':
		return c - '0', true
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10, true
	}
	return 0, false
}

func formatUUID(b []byte) string {
	const digits = "0123456789abcdef"
	var out [36]byte
	j := 0
	for i, c := range b {
		if i == 4 || i == 6 || i == 8 || i == 10 {
			out[j] = '-'
			j++
		}
		out[j], out[j+1] = digits[c>>4], digits[c&15]
		j += 2
	}
	return string(out[:])
}

// fpDigest returns the stored form of a fingerprint: empty for the empty
// fingerprint ("not checked"), otherwise the first 16 bytes of the
// SHA-256 of its whole text (the SQL function fp_digest of migration
// 0007). The store only compares fingerprints for equality: two different
// fingerprints share a stored form only by a 128-bit collision of
// SHA-256, whoever made them. (Decoding the digest a "sha256:" fingerprint
// spells, as version 6 did, stored two fingerprints that differ only in
// their last 32 digits alike: TestFingerprintDifferentLateIsMismatch.)
func fpDigest(fp dedup.Fingerprint) []byte {
	d, _ := digestInto(make([]byte, 0, 16), nil, fp)
	return d
}

// digestInto is fpDigest writing the digest into dst (empty, with room
// for 16 bytes) and hashing a copy of fp made in scratch, which it
// returns for the next call: a batch's digests then take no allocation
// each.
func digestInto(dst, scratch []byte, fp dedup.Fingerprint) (d, scratchOut []byte) {
	if fp == "" {
		return dst, scratch
	}
	scratch = append(scratch[:0], fp...)
	sum := sha256.Sum256(scratch)
	return append(dst, sum[:16]...), scratch
}

// recordFingerprint returns the fingerprint a record with stored digest d
// carries, as the caller with fingerprint fp and digest fpd sees it: fp
// itself when the digests agree, the empty fingerprint when the record
// has none, and otherwise one that matches no fingerprint but the empty
// one.
func recordFingerprint(d []byte, fp dedup.Fingerprint, fpd []byte) dedup.Fingerprint {
	switch {
	case len(d) == 0:
		return ""
	case fp != "" && string(d) == string(fpd):
		return fp
	}
	return fp + "\x00" // not fp, and not empty
}

// scopeCache maps scope names to their integers in the scopes table. A
// scope's integer never changes once given, so the cache is never
// invalidated.
type scopeCache struct {
	mu sync.RWMutex
	m  map[string]int32
}

// scopeID returns the integer of scope, asking the server (which gives a
// new scope one, in autocommit: the scopes table is never written inside
// a caller's transaction) on the first use of the scope in this process.
func (s *Store) scopeID(ctx context.Context, scope string) (int32, error) {
	s.scopes.mu.RLock()
	id, ok := s.scopes.m[scope]
	s.scopes.mu.RUnlock()
	if ok {
		return id, nil
	}
	if err := s.pool.QueryRow(ctx, `SELECT `+s.names.qualify("scope_id")+`($1::text)`, scope).Scan(&id); err != nil {
		return 0, err
	}
	s.cacheScope(scope, id)
	return id, nil
}

func (s *Store) cacheScope(scope string, id int32) {
	s.scopes.mu.Lock()
	if s.scopes.m == nil {
		s.scopes.m = map[string]int32{}
	}
	s.scopes.m[scope] = id
	s.scopes.mu.Unlock()
}

// keyRef is a key as the records store it.
type keyRef struct {
	scope int32
	id    []byte
}

// ref returns the stored form of key.
func (s *Store) ref(ctx context.Context, key dedup.Key) (keyRef, error) {
	sid, err := s.scopeID(ctx, key.Scope)
	if err != nil {
		return keyRef{}, err
	}
	return keyRef{scope: sid, id: encodeID(key.ID)}, nil
}

// refString is a map key for a stored key.
func refString(scope int32, id []byte) string {
	var b [4]byte
	binary.BigEndian.PutUint32(b[:], uint32(scope))
	return string(b[:]) + string(id)
}

// lastScope remembers the last scope a batch looked up: the keys of a
// batch come sorted by scope, and usually share one.
type lastScope struct {
	name string
	sid  int32
	ok   bool
}

func (l *lastScope) id(ctx context.Context, s *Store, scope string) (int32, error) {
	if l.ok && l.name == scope {
		return l.sid, nil
	}
	sid, err := s.scopeID(ctx, scope)
	if err != nil {
		return 0, err
	}
	l.name, l.sid, l.ok = scope, sid, true
	return sid, nil
}
