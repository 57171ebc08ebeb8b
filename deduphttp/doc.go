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
//   - Callers are isolated: the tenant (and, with [WithPrincipal], the
//     SHA-256 of the principal) is part of the store key, so a caller can
//     neither read nor collide with another's record. [New] refuses to
//     build without [WithTenant] unless [WithSingleTenant] is given: with
//     no scope, a key is a bearer token for the first caller's response.
//     A tenant header sent twice, holding a list, or named in Connection
//     is 400 ([ErrTenantInvalid]).
//   - Fail closed: if the store cannot be reached at claim the request
//     gets 503 and the handler does not run.
//   - An unknown outcome is never released. What happens to the key
//     follows the class of the outcome ([Outcome], [SetOutcome]):
//     never started (our own 400s, a handler that declares
//     [OutcomeNotStarted]) releases it; finished (a complete response)
//     stores it by [WithStorePolicy] (default [DefaultStoreStatus]: 2xx,
//     3xx and 4xx except 401, 403, 408, 409, 423, 425 and 429) or
//     releases it; unknown (the handler's context ended with nothing
//     written, [OutcomeUnknown], a panic, a hijack, a response larger than
//     [WithMaxStoredBody], a failed Complete) holds it until its lease
//     ends: a retry meanwhile gets 409 with the seconds left on the lease.
//     [WithStoreUnknownOutcome] stores such a response as final instead.
//   - A client that hangs up does not decide the outcome. With
//     [WithHandlerTimeout] the handler runs on a context the hang-up does
//     not cancel, ending a fixed time after the claim (shorter than the
//     lease); the recorder stops writing to a gone client but keeps
//     recording, so the response is stored for the retry. The store call
//     runs on a detached context bounded by [WithFinalizeTimeout].
//
// # What it does not guarantee
//
//   - A handler that outlives its lease ([WithLease], default 30s) may run
//     again for a retry that arrives after the lease ended. Make the lease
//     longer than the slowest handler, or bound the handler with
//     [WithHandlerTimeout].
//   - A finished response that the policy does not store (5xx by default)
//     releases the key, and a retry runs the handler again; if the handler
//     had an effect, give the effect its own idempotency key, or store
//     such responses.
//   - After an unknown outcome the retry that comes after the lease ends
//     runs the handler again.
//   - Records live as long as the store keeps them: memstore loses them on
//     restart, durable stores keep them for the retention period.
//   - Trailers are not stored. With no Accept-Encoding field any stored
//     Content-Encoding is replayed (RFC 9110); a request whose
//     Accept-Encoding refuses it gets 406.
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
//	400  a tenant or principal header sent twice, holding a list, or named
//	     in Connection
//	401  the tenant or principal function found none ([WithMissingTenantStatus])
//	406  the stored Content-Encoding is refused by the request's Accept-Encoding
//	409  the first request with this key is still running or its outcome is
//	     unknown (Retry-After: the seconds left on its lease)
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
//	Idempotency-Key-Expires  response: on a replay, and on a first response
//	                         certain to be stored (a stored status and a
//	                         declared Content-Length within the limit), the
//	                         HTTP-date until which it is kept at least
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
// The store key's scope is the tenant, the principal's hash, the method
// and the route
// ([WithRoute]; default the ServeMux pattern when the middleware wraps a
// handler registered on a Go 1.22 ServeMux, else the URL path). The
// fingerprint ([WithFingerprint]) is by default the SHA-256 of the method,
// the path with its query and the body; [FingerprintJSONFields] fingerprints
// chosen JSON fields instead. The body is read (up to [WithMaxBody], into a
// buffer that grows as bytes arrive) before the handler runs and given to
// it again unchanged.
package deduphttp
