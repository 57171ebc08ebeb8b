package dedup

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"strconv"
	"strings"
)

// MaxFingerprintBytes is the longest fingerprint a store accepts.
const MaxFingerprintBytes = 128

// A Fingerprint is a digest of what a claim is for: the payload, or the
// fields of it that define the request. It is stored with the claim; the
// same key claimed with another fingerprint is a conflict
// ([FingerprintMismatch]), never a duplicate, so a reused key can never
// return an unrelated stored result.
//
// The empty Fingerprint means "not checked" and matches any other. Build
// fingerprints with [FingerprintOf], [FingerprintParts] or [FingerprintJSON]
// (SHA-256, never a weak checksum: CRC32 and Adler-32 collide on payloads
// that differ only in a sequence number). Any other string of at most
// [MaxFingerprintBytes] is accepted as is, for callers with their own digest.
type Fingerprint string

const fingerprintPrefix = "sha256:"

// FingerprintOf returns the SHA-256 fingerprint of payload.
func FingerprintOf(payload []byte) Fingerprint {
	sum := sha256.Sum256(payload)
	return encodeFingerprint(&sum)
}

// FingerprintParts returns the SHA-256 fingerprint of several parts, each
// length-prefixed so that ("ab","c") and ("a","bc") differ. Use it for a
// method, a path and a body, or for the chosen fields of a message.
func FingerprintParts(parts ...[]byte) Fingerprint {
	h := sha256.New()
	var n [8]byte
	for _, p := range parts {
		binary.BigEndian.PutUint64(n[:], uint64(len(p)))
		h.Write(n[:])
		h.Write(p)
	}
	var sum [sha256.Size]byte
	h.Sum(sum[:0])
	return encodeFingerprint(&sum)
}

func encodeFingerprint(sum *[sha256.Size]byte) Fingerprint {
	var buf [len(fingerprintPrefix) + 2*sha256.Size]byte
	copy(buf[:], fingerprintPrefix)
	hex.Encode(buf[len(fingerprintPrefix):], sum[:])
	return Fingerprint(buf[:])
}

// FingerprintJSON returns the fingerprint of a JSON document in canonical
// form: object keys sorted, insignificant white space removed, numbers kept
// as written. With fields, only those members count; a field is a top-level
// name or a dotted path ("customer.id"), and a missing field counts as
// absent (distinct from null). Two documents that differ only in key order,
// spacing or a field that is not listed get the same fingerprint.
//
// It returns an [*ArgumentError] if doc is not one valid JSON value.
func FingerprintJSON(doc []byte, fields ...string) (Fingerprint, error) {
	dec := json.NewDecoder(bytes.NewReader(doc))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return "", &ArgumentError{Arg: "JSON document", Reason: "does not parse: " + err.Error()}
	}
	if dec.More() {
		return "", &ArgumentError{Arg: "JSON document", Reason: "has data after the first value"}
	}
	if len(fields) > 0 {
		picked := make(map[string]any, len(fields))
		for _, f := range fields {
			if x, ok := lookupPath(v, f); ok {
				picked[f] = x
			}
		}
		v = picked
	}
	canon, err := json.Marshal(v) // maps marshal with sorted keys
	if err != nil {
		return "", &ArgumentError{Arg: "JSON document", Reason: err.Error()}
	}
	return FingerprintOf(canon), nil
}

func lookupPath(v any, path string) (any, bool) {
	for part := range strings.SplitSeq(path, ".") {
		m, ok := v.(map[string]any)
		if !ok {
			return nil, false
		}
		if v, ok = m[part]; !ok {
			return nil, false
		}
	}
	return v, true
}

// Matches reports whether two fingerprints agree: equal, or either is empty
// (not checked).
func (f Fingerprint) Matches(other Fingerprint) bool {
	return f == "" || other == "" || f == other
}

func (f Fingerprint) validate() error {
	if len(f) > MaxFingerprintBytes {
		return &ArgumentError{Arg: "fingerprint", Reason: "is " + strconv.Itoa(len(f)) + " bytes, over the limit of " + strconv.Itoa(MaxFingerprintBytes)}
	}
	return nil
}
