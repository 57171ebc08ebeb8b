package dedup

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"net/url"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Size limits of a [Key], in bytes. Stores may rely on them for column sizes.
const (
	MaxScopeBytes = 256
	MaxIDBytes    = 512
)

// A Key names one logical event inside a scope.
//
// Scope says whose and which deduplication this is: a tenant, a consumer
// group, an operation, or a path of them ("payments/charge-consumer"). It is
// always explicit; nothing in this module derives it from code location.
// ID identifies the event, not the entity: keying on an order ID collapses
// OrderPlaced and OrderShipped into one. Use the transport message ID, a
// command ID, or [BusinessKey] when two message IDs may carry one intent.
//
// Keys are compared byte for byte. The zero Key is invalid.
type Key struct {
	Scope string
	ID    string
}

// NewKey returns the key (scope, id) or an [*ArgumentError] saying what is
// wrong with it.
func NewKey(scope, id string) (Key, error) {
	k := Key{Scope: scope, ID: id}
	if err := k.Validate(); err != nil {
		return Key{}, err
	}
	return k, nil
}

// String returns scope and ID in a form meant for logs, not for parsing.
func (k Key) String() string { return k.Scope + "/" + k.ID }

// Validate reports whether k is usable: scope and ID non-empty, within
// [MaxScopeBytes] and [MaxIDBytes], valid UTF-8, and free of control
// characters. The error is an [*ArgumentError] that matches
// [ErrInvalidArgument].
func (k Key) Validate() error {
	if err := validatePart("key scope", k.Scope, MaxScopeBytes); err != nil {
		return err
	}
	return validatePart("key id", k.ID, MaxIDBytes)
}

func validatePart(arg, s string, max int) error {
	switch {
	case s == "":
		return &ArgumentError{Arg: arg, Reason: "is empty"}
	case len(s) > max:
		return &ArgumentError{Arg: arg, Reason: "is " + strconv.Itoa(len(s)) + " bytes, over the limit of " + strconv.Itoa(max)}
	}
	for i := 0; i < len(s); {
		// Fast path: eight printable ASCII bytes at a time. A chunk with a
		// byte below 0x20 or at or above 0x7f goes through the exact check.
		if i+8 <= len(s) {
			x := binary.LittleEndian.Uint64([]byte(s[i : i+8]))
			const lo, hi = 0x0101010101010101, 0x8080808080808080
			if ((x-0x20*lo)&^x|(x+lo)|x)&hi == 0 {
				i += 8
				continue
			}
		}
		c := s[i]
		if c < utf8.RuneSelf {
			if c < 0x20 || c == 0x7f {
				return &ArgumentError{Arg: arg, Reason: "has a control character at byte " + strconv.Itoa(i)}
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			return &ArgumentError{Arg: arg, Reason: "is not valid UTF-8 at byte " + strconv.Itoa(i)}
		}
		if unicode.IsControl(r) {
			return &ArgumentError{Arg: arg, Reason: "has a control character at byte " + strconv.Itoa(i)}
		}
		i += size
	}
	return nil
}

// BusinessKey builds a key from the fields that make up one business intent,
// for example ("payments", "invoice", invoiceID, "capture"), so that two
// messages with different transport IDs but the same intent collide on
// purpose. The fields are escaped and joined, so ("a/b","c") and ("a","b/c")
// give different IDs; an ID that would exceed [MaxIDBytes] is replaced by a
// SHA-256 of the fields. The ID starts with "bk:" so it cannot collide with
// a transport message ID. Every field must be non-empty valid UTF-8.
func BusinessKey(scope string, fields ...string) (Key, error) {
	if len(fields) == 0 {
		return Key{}, &ArgumentError{Arg: "business key", Reason: "has no fields"}
	}
	var b strings.Builder
	b.WriteString("bk:")
	for i, f := range fields {
		if f == "" || !utf8.ValidString(f) {
			return Key{}, &ArgumentError{Arg: "business key field " + strconv.Itoa(i), Reason: "is empty or not valid UTF-8"}
		}
		if i > 0 {
			b.WriteByte('/')
		}
		b.WriteString(url.PathEscape(f))
	}
	id := b.String()
	if len(id) > MaxIDBytes {
		h := sha256.New()
		for _, f := range fields {
			var n [8]byte
			putUint64(n[:], uint64(len(f)))
			h.Write(n[:])
			h.Write([]byte(f))
		}
		id = "bk#sha256:" + hex.EncodeToString(h.Sum(nil))
	}
	return NewKey(scope, id)
}

func putUint64(b []byte, v uint64) {
	for i := 7; i >= 0; i-- {
		b[i] = byte(v)
		v >>= 8
	}
}
