package deduphttp

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// Problem codes: the "code" member of every problem+json body the
// middleware writes, for clients that branch on the reason rather than the
// status.
const (
	CodeKeyMissing      = "idempotency_key_missing"        // 400
	CodeKeyInvalid      = "idempotency_key_invalid"        // 400
	CodeTenantMissing   = "tenant_missing"                 // 401 or as configured
	CodeTenantInvalid   = "tenant_ambiguous"               // 400
	CodeNotAcceptable   = "stored_encoding_not_acceptable" // 406
	CodeBodyTooLarge    = "request_body_too_large"         // 413
	CodeBodyUnreadable  = "request_body_unreadable"        // 400
	CodeFingerprint     = "fingerprint_failed"             // 400
	CodeKeyReused       = "idempotency_key_reused"         // 422
	CodeInProgress      = "idempotency_key_in_progress"    // 409
	CodeStoreDown       = "idempotency_store_unavailable"  // 503
	CodeStoredCorrupted = "idempotency_record_unreadable"  // 500
)

// problem is an RFC 9457 problem details object. Type is always
// "about:blank", so Title is the status's reason phrase; Code is an
// extension member naming the reason.
type problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail,omitempty"`
	Code   string `json:"code"`
}

// writeProblem writes status with an application/problem+json body.
func writeProblem(w http.ResponseWriter, status int, code, detail string) {
	b, _ := json.Marshal(problem{Type: "about:blank", Title: http.StatusText(status), Status: status, Detail: detail, Code: code})
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Content-Length", strconv.Itoa(len(b)+1))
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	w.Write(append(b, '\n'))
}
