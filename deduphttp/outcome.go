package deduphttp

import (
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Outcome is the class of a request's outcome, which decides what happens
// to its key once the handler returns (see the package doc).
type Outcome uint8

const (
	// OutcomeFinished: the handler produced a complete response. It is
	// stored if the store policy ([WithStorePolicy]) accepts its status,
	// else the key is released. The default.
	OutcomeFinished Outcome = iota
	// OutcomeNotStarted: the effect certainly did not start (the request
	// was refused before any byte reached the code that acts: a dial
	// error, a validation error). The key is released at once.
	OutcomeNotStarted
	// OutcomeUnknown: the effect may or may not have happened (a timeout
	// after the request was sent, an aborted stream). The key stays claimed
	// until its lease ends, and a retry meanwhile gets 409; with
	// [WithStoreUnknownOutcome] the response is stored as final instead.
	OutcomeUnknown
)

// SetOutcome declares the outcome class of the request whose response w
// writes, for a handler wrapped by a [Middleware]; it must be called
// before the handler returns. It reports false when w is not (and does not
// wrap) the middleware's writer, e.g. for a request without a key.
func SetOutcome(w http.ResponseWriter, o Outcome) bool {
	if o > OutcomeUnknown {
		return false
	}
	for {
		switch v := w.(type) {
		case *recorder:
			v.outcome = o
			return true
		case interface{ Unwrap() http.ResponseWriter }:
			w = v.Unwrap()
		default:
			return false
		}
	}
}

// Class says what the middleware did with a keyed request.
type Class string

// The classes of [Event].
const (
	ClassRejected   Class = "rejected"          // refused before the store (400, 401, 413)
	ClassStoreDown  Class = "store_unavailable" // the store failed at claim: 503, nothing ran
	ClassInProgress Class = "in_progress"       // 409: the key is running or its outcome unknown
	ClassMismatch   Class = "key_reused"        // 422
	ClassReplayed   Class = "replayed"          // a stored response was replayed (or 406, 500)
	ClassStored     Class = "stored"            // the handler ran; its response is stored
	ClassReleased   Class = "released"          // the handler ran or never started; the key is free
	ClassHeld       Class = "held"              // outcome unknown: the key is held until its lease ends
)

// Event describes one keyed request, for [WithOnDone]. It holds no raw
// key: KeyHash is enough to correlate a client's retries in logs.
type Event struct {
	Tenant   string        // the tenant, "" without one
	KeyHash  string        // hex of the first 8 bytes of the key's SHA-256; "" for a malformed key
	Class    Class         // what the middleware did
	Status   int           // the status sent
	Duration time.Duration // from the key's arrival to the key stored, released or held

	start time.Time
}

// acceptsEncodings reports whether a request's Accept-Encoding field lines
// accept every content coding in encs. With no Accept-Encoding field any
// coding is acceptable (RFC 9110 section 12.5.3); otherwise a coding is
// acceptable when listed, or matched by "*", with a q above 0.
func acceptsEncodings(accept, encs []string) bool {
	if len(accept) == 0 {
		return true
	}
	for _, line := range encs {
		for enc := range strings.SplitSeq(line, ",") {
			enc = strings.TrimSpace(enc)
			if enc == "" || strings.EqualFold(enc, "identity") {
				continue
			}
			if !acceptsEncoding(accept, enc) {
				return false
			}
		}
	}
	return true
}

func acceptsEncoding(accept []string, enc string) bool {
	star := -1.0
	for _, line := range accept {
		for item := range strings.SplitSeq(line, ",") {
			name, params, _ := strings.Cut(item, ";")
			name = strings.TrimSpace(name)
			q := 1.0
			for p := range strings.SplitSeq(params, ";") {
				k, v, ok := strings.Cut(strings.TrimSpace(p), "=")
				if ok && strings.EqualFold(strings.TrimSpace(k), "q") {
					if f, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil {
						q = f
					}
				}
			}
			switch {
			case strings.EqualFold(name, enc) || (strings.EqualFold(enc, "gzip") && strings.EqualFold(name, "x-gzip")):
				return q > 0
			case name == "*":
				star = q
			}
		}
	}
	return star > 0
}
