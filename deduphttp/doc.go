// Package deduphttp is net/http middleware that makes unsafe requests
// idempotent with the Idempotency-Key header of the IETF httpapi draft
// "The Idempotency-Key HTTP Header Field", on any [dedup.Store] (memstore,
// sqlitestore, redisstore, pgstore).
//
//	m, err := deduphttp.New(store,
//		deduphttp.WithTenant(func(r *http.Request) (string, error) { return userID(r) }),
//		deduphttp.WithRetention(24*time.Hour))
//	mux.Handle("POST /payments", m.Required(createPayment))
//
// # What it guarantees
//
// For a POST, PUT, PATCH or DELETE (any method but GET, HEAD, OPTIONS and
// TRACE, which pass through untouched) carrying a key:
//
//   - The handler runs at most once per (tenant, method, route, key) while
//     its lease is live and, once it stored a response, at most once per
//     retention period: a retry gets the stored status, the allowlisted
//     headers and the body replayed, marked with Idempotent-Replayed: true,
//     and the handler does not run.
//   - A key reused with another payload (another fingerprint) is a 422,
//     never a replay of an unrelated response.
//   - A key whose first request is still running is a 409 with
//     Retry-After (the seconds until its lease ends), or, with [WithWait],
//     the request waits for the first and replays its response.
//   - Tenants are isolated: the tenant is part of the store key, so a
//     tenant can neither read nor collide with another tenant's record
//     (no cross-user response poisoning). Configure [WithTenant]; without
//     it all requests are one tenant.
//   - Fail closed: if the store cannot be reached the request gets 503 and
//     the handler does not run.
//   - A client that hangs up does not decide the outcome: the handler's
//     response does. The response is stored (or the key released) after
//     the handler returns, on a context detached from the request, bounded
//     by [WithFinalizeTimeout].
//
// # What it does not guarantee
//
//   - A handler that outlives its lease ([WithLease], default 30s) may run
//     again for a retry that arrives after the lease ended. Make the lease
//     longer than the slowest handler.
//   - Responses that are not stored release the key, and a retry runs the
//     handler again: by default 5xx responses ([WithStorePolicy]), a
//     panicking handler, and a response body larger than
//     [WithMaxStoredBody] (default 1 MiB; the response still reaches the
//     client). If such a handler had an effect, a retry repeats it: give
//     the handler's own effect an idempotency key, or store such
//     responses.
//   - If storing the response fails after the handler ran, the key stays in
//     progress until its lease ends; the retry after that runs the handler
//     again.
//   - Records live as long as the store keeps them: memstore loses them on
//     restart, durable stores keep them for the retention period.
//   - A handler that hijacks the connection is not recorded: the key is
//     released. Trailers are not stored.
//
// # Status codes
//
// All errors the middleware writes itself are application/problem+json
// (RFC 9457) with type "about:blank", the status's title, a detail and a
// "code" member (the Code constants):
//
//	400  key missing on a route that requires one, several Idempotency-Key
//	     headers, a malformed, empty or oversized key, an unreadable body,
//	     or a fingerprint function that failed (e.g. a body that is not JSON)
//	401  the tenant function found no tenant ([WithMissingTenantStatus])
//	409  the first request with this key is still running (Retry-After)
//	413  the request body is larger than [WithMaxBody] (default 1 MiB)
//	422  the key was used before with another payload
//	500  a stored response could not be decoded
//	503  the store failed; nothing ran (Retry-After: 1)
//
// # Headers
//
//	Idempotency-Key          request: the key, a Structured Field String
//	                         ("...") or a bare token; at most MaxKeyBytes
//	                         (255) bytes; see [ParseKey]
//	Idempotent-Replayed      response: "true" on a replayed response
//	Idempotency-Key-Expires  response: on every response that is stored or
//	                         replayed, the HTTP-date until which it is kept
//	                         at least (the expiry policy)
//	Retry-After              response: on 409 and 503
//
// # Expiry policy
//
// A stored response is replayed for the retention period ([WithRetention],
// default 24 hours) after the handler finished; after that the key is
// forgotten and a request with it runs as new. Each stored or replayed
// response says when in Idempotency-Key-Expires. A key released (not
// stored) is forgotten at once.
//
// # Scope and fingerprint
//
// The store key's scope is the tenant, the method and the route
// ([WithRoute]; default the ServeMux pattern when the middleware wraps a
// handler registered on a Go 1.22 ServeMux, else the URL path). The
// fingerprint ([WithFingerprint]) is by default the SHA-256 of the method,
// the path with its query and the body; [FingerprintJSONFields] fingerprints
// chosen JSON fields instead. The body is read (up to [WithMaxBody]) before
// the handler runs and given to it again unchanged.
package deduphttp
