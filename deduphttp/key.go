package deduphttp

import (
	"errors"
	"strconv"
)

// MaxKeyBytes is the longest Idempotency-Key value accepted, in bytes after
// the quotes and escapes of a Structured Field string are removed. Longer
// keys are rejected with 400. 255 bytes holds any UUID, ULID or random
// token a client would reasonably send.
const MaxKeyBytes = 255

// KeyError says why an Idempotency-Key header value was rejected.
type KeyError struct {
	// Reason is a short explanation in plain English, safe to show a client.
	Reason string
}

func (e *KeyError) Error() string { return "deduphttp: invalid Idempotency-Key: " + e.Reason }

// ErrInvalidKey matches every [*KeyError] with errors.Is.
var ErrInvalidKey = errors.New("deduphttp: invalid Idempotency-Key")

// Is makes errors.Is(err, ErrInvalidKey) true.
func (e *KeyError) Is(target error) bool { return target == ErrInvalidKey }

func keyError(reason string) error { return &KeyError{Reason: reason} }

// ParseKey parses one Idempotency-Key header field value and returns the key.
//
// Two forms are accepted, both with optional surrounding spaces or tabs:
//
//   - the form of the IETF httpapi draft, a Structured Field String
//     (RFC 9651 section 3.3.3): a double-quoted string of printable ASCII
//     (0x20-0x7E) in which only \" and \\ are escapes;
//   - the common bare form sent by many clients: one or more characters
//     from 0x21-0x7E other than the double quote, backslash, comma and
//     semicolon (a UUID, ULID, base64 or hex token).
//
// Structured Field parameters after the string (;name=value) are not
// accepted. The key must not be empty and must be at most [MaxKeyBytes]
// long. Any other value gives a [*KeyError].
func ParseKey(v string) (string, error) {
	v = trimOWS(v)
	if v == "" {
		return "", keyError("is empty")
	}
	if v[0] != '"' {
		if len(v) > MaxKeyBytes {
			return "", keyError("is " + strconv.Itoa(len(v)) + " bytes, over the limit of " + strconv.Itoa(MaxKeyBytes))
		}
		for i := 0; i < len(v); i++ {
			c := v[i]
			if c <= 0x20 || c >= 0x7f || c == '"' || c == '\\' || c == ',' || c == ';' {
				return "", keyError("has a character not allowed in a bare key at byte " + strconv.Itoa(i) + " (quote it as a Structured Field string, or use letters, digits and -._~:/+=)")
			}
		}
		return v, nil
	}
	// A Structured Field String. Fast path: no escapes.
	var out []byte
	i := 1
	for ; i < len(v); i++ {
		c := v[i]
		switch {
		case c == '\\':
			if i+1 >= len(v) {
				return "", keyError("ends inside an escape")
			}
			n := v[i+1]
			if n != '"' && n != '\\' {
				return "", keyError("has an invalid escape at byte " + strconv.Itoa(i) + " (only \\\" and \\\\ are allowed)")
			}
			if out == nil {
				out = make([]byte, 0, len(v))
				out = append(out, v[1:i]...)
			}
			out = append(out, n)
			i++
		case c == '"':
			if i != len(v)-1 {
				return "", keyError("has characters after the closing quote (parameters and lists are not accepted)")
			}
			var s string
			if out == nil {
				s = v[1:i]
			} else {
				s = string(out)
			}
			if s == "" {
				return "", keyError("is empty")
			}
			if len(s) > MaxKeyBytes {
				return "", keyError("is " + strconv.Itoa(len(s)) + " bytes, over the limit of " + strconv.Itoa(MaxKeyBytes))
			}
			return s, nil
		case c < 0x20 || c > 0x7e:
			return "", keyError("has a character outside printable ASCII at byte " + strconv.Itoa(i))
		default:
			if out != nil {
				out = append(out, c)
			}
		}
	}
	return "", keyError("has no closing quote")
}

func trimOWS(s string) string {
	for len(s) > 0 && (s[0] == ' ' || s[0] == '\t') {
		s = s[1:]
	}
	for len(s) > 0 && (s[len(s)-1] == ' ' || s[len(s)-1] == '\t') {
		s = s[:len(s)-1]
	}
	return s
}
