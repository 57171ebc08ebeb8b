package consumer

import (
	"errors"
	"strconv"
	"strings"
)

// Class is what kind of failure a handler error is. The processor decides
// from the class whether to retry, dead-letter or record the message.
type Class uint8

const (
	// Unclassified is an error with no class: treated as transient, with
	// its own (smaller) attempt limit before it is dead-lettered.
	Unclassified Class = iota
	// ClassTransient is a failure that may pass: a timeout, a refused
	// connection, a lock. Retried with bounded exponential backoff and full
	// jitter.
	ClassTransient
	// ClassPermanent is a technical failure that will not pass by waiting:
	// a payload that does not parse, an unknown schema version. Retried a
	// few times (a deploy may fix it), then dead-lettered.
	ClassPermanent
	// ClassBusiness is a business rejection (insufficient funds, unknown
	// account): a final outcome. It is recorded as the message's result and
	// the message is acknowledged; it is never retried.
	ClassBusiness
	// ClassUnknown is an unknown outcome: an external call that timed out
	// may have succeeded. The processor asks the reconciler before any
	// retry (see [WithReconciler]).
	ClassUnknown
)

var classNames = [...]string{"unclassified", "transient", "permanent", "business", "unknown"}

func (c Class) String() string {
	if int(c) < len(classNames) {
		return classNames[c]
	}
	return "class(" + strconv.Itoa(int(c)) + ")"
}

// classError tags an error with a class. It keeps the cause reachable with
// errors.Is and errors.As.
type classError struct {
	class  Class
	err    error
	result []byte
}

func (e *classError) Error() string {
	if e.err == nil {
		return e.class.String() + " failure"
	}
	return e.err.Error()
}

func (e *classError) Unwrap() error { return e.err }

// Result is the outcome stored for a business rejection; it makes a
// rejection satisfy [dedup.ResultError].
func (e *classError) Result() []byte { return e.result }

// Transient marks err as a transient failure (see [ClassTransient]).
func Transient(err error) error { return &classError{class: ClassTransient, err: err} }

// Permanent marks err as a permanent technical failure (see
// [ClassPermanent]).
func Permanent(err error) error { return &classError{class: ClassPermanent, err: err} }

// Reject marks err as a business rejection (see [ClassBusiness]). result
// is stored as the message's outcome and returned to duplicates; it may be
// nil.
func Reject(err error, result []byte) error {
	return &classError{class: ClassBusiness, err: err, result: result}
}

// Unknown marks err as an unknown outcome (see [ClassUnknown]).
func Unknown(err error) error { return &classError{class: ClassUnknown, err: err} }

// ClassOf returns the class of the outermost classified error in err's
// chain, or Unclassified. A nil error is Unclassified.
func ClassOf(err error) Class {
	var ce *classError
	if errors.As(err, &ce) {
		return ce.class
	}
	return Unclassified
}

// maxReason bounds the failure reason kept in a dead-letter record.
const maxReason = 512

// safeReason is the default failure reason: the error's text, cut to
// maxReason bytes on a rune boundary, with control characters replaced so
// a reason is one log line. The processor never adds the payload; a
// handler that puts payload bytes into its errors should set
// [WithReason].
func safeReason(err error) string {
	if err == nil {
		return ""
	}
	s := err.Error()
	if len(s) > maxReason {
		s = s[:maxReason]
		for len(s) > 0 && !validTail(s) {
			s = s[:len(s)-1]
		}
		s += "..."
	}
	return strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return ' '
		}
		return r
	}, s)
}

// validTail reports whether s does not end inside a multi-byte rune.
func validTail(s string) bool {
	// Walk back over continuation bytes to the rune start.
	i := len(s) - 1
	for i > 0 && s[i]&0xC0 == 0x80 {
		i--
	}
	b := s[i]
	n := len(s) - i
	switch {
	case b < 0x80:
		return n == 1
	case b&0xE0 == 0xC0:
		return n == 2
	case b&0xF0 == 0xE0:
		return n == 3
	case b&0xF8 == 0xF0:
		return n == 4
	}
	return false
}
