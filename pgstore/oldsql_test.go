package pgstore_test

// The statements of the store before migration 0006 (schema version 5),
// as that version rendered them for schema OLDSCHEMA and prefix dedup_,
// with the default grace of 24h: the benchmarks run them on a schema
// migrated to version 5, beside the store, to compare the two layouts in
// one process.
const (
	oldSQLClaimBatch = `WITH ins AS (
	INSERT INTO "OLDSCHEMA"."dedup_records" AS r (scope, id, state, token, fingerprint, result, lease_until, expires_at, attempts, created_at)
	SELECT u.scope, u.id, 1, u.token, u.fp, NULL, (SELECT LEAST(statement_timestamp() + ($5::int8 * interval '1 microsecond'), '2262-04-11 23:47:16.854775Z'::timestamptz)), (SELECT LEAST(statement_timestamp() + (($5::int8 + 86400000000) * interval '1 microsecond'), '2262-04-11 23:47:16.854775Z'::timestamptz)), 1, statement_timestamp()
	FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bytea[]) AS u(scope, id, token, fp)
	ON CONFLICT (scope, id) DO UPDATE SET
	state       = CASE WHEN ((r.state = 2 AND r.expires_at <= statement_timestamp()) OR (r.state = 1 AND r.lease_until <= statement_timestamp() AND (r.fingerprint = ''::bytea OR excluded.fingerprint = ''::bytea OR r.fingerprint = excluded.fingerprint))) THEN excluded.state ELSE r.state END,
	token       = CASE WHEN ((r.state = 2 AND r.expires_at <= statement_timestamp()) OR (r.state = 1 AND r.lease_until <= statement_timestamp() AND (r.fingerprint = ''::bytea OR excluded.fingerprint = ''::bytea OR r.fingerprint = excluded.fingerprint))) THEN excluded.token ELSE r.token END,
	fingerprint = CASE WHEN ((r.state = 2 AND r.expires_at <= statement_timestamp()) OR (r.state = 1 AND r.lease_until <= statement_timestamp() AND (r.fingerprint = ''::bytea OR excluded.fingerprint = ''::bytea OR r.fingerprint = excluded.fingerprint))) AND (r.state = 2 OR r.fingerprint = ''::bytea) THEN excluded.fingerprint ELSE r.fingerprint END,
	result      = CASE WHEN ((r.state = 2 AND r.expires_at <= statement_timestamp()) OR (r.state = 1 AND r.lease_until <= statement_timestamp() AND (r.fingerprint = ''::bytea OR excluded.fingerprint = ''::bytea OR r.fingerprint = excluded.fingerprint))) THEN excluded.result ELSE r.result END,
	lease_until = CASE WHEN ((r.state = 2 AND r.expires_at <= statement_timestamp()) OR (r.state = 1 AND r.lease_until <= statement_timestamp() AND (r.fingerprint = ''::bytea OR excluded.fingerprint = ''::bytea OR r.fingerprint = excluded.fingerprint))) THEN excluded.lease_until ELSE r.lease_until END,
	expires_at  = CASE WHEN ((r.state = 2 AND r.expires_at <= statement_timestamp()) OR (r.state = 1 AND r.lease_until <= statement_timestamp() AND (r.fingerprint = ''::bytea OR excluded.fingerprint = ''::bytea OR r.fingerprint = excluded.fingerprint))) THEN excluded.expires_at ELSE r.expires_at END,
	attempts    = CASE WHEN ((r.state = 2 AND r.expires_at <= statement_timestamp()) OR (r.state = 1 AND r.lease_until <= statement_timestamp() AND (r.fingerprint = ''::bytea OR excluded.fingerprint = ''::bytea OR r.fingerprint = excluded.fingerprint))) THEN CASE WHEN r.state = 1 THEN r.attempts + 1 ELSE 1 END ELSE r.attempts END,
	created_at  = CASE WHEN ((r.state = 2 AND r.expires_at <= statement_timestamp()) OR (r.state = 1 AND r.lease_until <= statement_timestamp() AND (r.fingerprint = ''::bytea OR excluded.fingerprint = ''::bytea OR r.fingerprint = excluded.fingerprint))) AND r.state = 2 THEN excluded.created_at ELSE r.created_at END
	RETURNING (substr(r.token, 1, 8) = $6::bytea AND r.attempts = 1) AS easy, CASE WHEN (substr(r.token, 1, 8) = $6::bytea AND r.attempts = 1) THEN NULL ELSE r END AS rec)
SELECT (rec).scope, (rec).id, (rec).state, (rec).token, (rec).attempts, (rec).fingerprint, (rec).result, (rec).lease_until, (rec).expires_at
FROM ins WHERE NOT easy
UNION ALL
SELECT NULL, NULL, 0::int2, NULL, count(*)::int4, NULL, NULL, (SELECT LEAST(statement_timestamp() + ($5::int8 * interval '1 microsecond'), '2262-04-11 23:47:16.854775Z'::timestamptz)), (SELECT LEAST(statement_timestamp() + ($5::int8 * interval '1 microsecond'), '2262-04-11 23:47:16.854775Z'::timestamptz)) FROM ins`
	oldSQLCompleteBatch = `WITH l AS MATERIALIZED (
	SELECT count(*) AS n FROM unnest($1::text[], $2::text[], $3::bytea[]) AS u(scope, id, token)
	CROSS JOIN LATERAL (
		SELECT 1 FROM "OLDSCHEMA"."dedup_records" x WHERE x.scope = u.scope AND x.id = u.id AND x.token = u.token FOR NO KEY UPDATE) x),
d AS (
	UPDATE "OLDSCHEMA"."dedup_records" r SET
	result     = CASE WHEN r.state = 1 THEN u.result ELSE r.result END,
	expires_at = CASE WHEN r.state = 1 THEN LEAST(statement_timestamp() + GREATEST(($5::int8 * interval '1 microsecond'), COALESCE(u.keep, interval '0')), '2262-04-11 23:47:16.854775Z'::timestamptz) ELSE r.expires_at END,
	state      = 2
	FROM (SELECT u.*, w.retention AS keep
		FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bytea[]) WITH ORDINALITY AS u(scope, id, token, result, o)
		LEFT JOIN "OLDSCHEMA"."dedup_retention" w ON w.scope = u.scope) u
	WHERE r.scope = u.scope AND r.id = u.id AND r.token = u.token AND (SELECT n FROM l) >= 0
	RETURNING u.o)
SELECT (SELECT count(*) FROM d), ARRAY(SELECT generate_series(1, cardinality($1::text[]))::int8 EXCEPT ALL SELECT o FROM d)`
	oldSQLClaim = `INSERT INTO "OLDSCHEMA"."dedup_records" AS r (scope, id, state, token, fingerprint, result, lease_until, expires_at, attempts, created_at)
VALUES ($1::text, $2::text, 1, $3::bytea, $4::bytea, NULL, LEAST(statement_timestamp() + ($5::int8 * interval '1 microsecond'), '2262-04-11 23:47:16.854775Z'::timestamptz), LEAST(statement_timestamp() + (($5::int8 + 86400000000) * interval '1 microsecond'), '2262-04-11 23:47:16.854775Z'::timestamptz), 1, statement_timestamp())
ON CONFLICT (scope, id) DO UPDATE SET
	state       = CASE WHEN ((r.state = 2 AND r.expires_at <= statement_timestamp()) OR (r.state = 1 AND r.lease_until <= statement_timestamp() AND (r.fingerprint = ''::bytea OR excluded.fingerprint = ''::bytea OR r.fingerprint = excluded.fingerprint))) THEN excluded.state ELSE r.state END,
	token       = CASE WHEN ((r.state = 2 AND r.expires_at <= statement_timestamp()) OR (r.state = 1 AND r.lease_until <= statement_timestamp() AND (r.fingerprint = ''::bytea OR excluded.fingerprint = ''::bytea OR r.fingerprint = excluded.fingerprint))) THEN excluded.token ELSE r.token END,
	fingerprint = CASE WHEN ((r.state = 2 AND r.expires_at <= statement_timestamp()) OR (r.state = 1 AND r.lease_until <= statement_timestamp() AND (r.fingerprint = ''::bytea OR excluded.fingerprint = ''::bytea OR r.fingerprint = excluded.fingerprint))) AND (r.state = 2 OR r.fingerprint = ''::bytea) THEN excluded.fingerprint ELSE r.fingerprint END,
	result      = CASE WHEN ((r.state = 2 AND r.expires_at <= statement_timestamp()) OR (r.state = 1 AND r.lease_until <= statement_timestamp() AND (r.fingerprint = ''::bytea OR excluded.fingerprint = ''::bytea OR r.fingerprint = excluded.fingerprint))) THEN excluded.result ELSE r.result END,
	lease_until = CASE WHEN ((r.state = 2 AND r.expires_at <= statement_timestamp()) OR (r.state = 1 AND r.lease_until <= statement_timestamp() AND (r.fingerprint = ''::bytea OR excluded.fingerprint = ''::bytea OR r.fingerprint = excluded.fingerprint))) THEN excluded.lease_until ELSE r.lease_until END,
	expires_at  = CASE WHEN ((r.state = 2 AND r.expires_at <= statement_timestamp()) OR (r.state = 1 AND r.lease_until <= statement_timestamp() AND (r.fingerprint = ''::bytea OR excluded.fingerprint = ''::bytea OR r.fingerprint = excluded.fingerprint))) THEN excluded.expires_at ELSE r.expires_at END,
	attempts    = CASE WHEN ((r.state = 2 AND r.expires_at <= statement_timestamp()) OR (r.state = 1 AND r.lease_until <= statement_timestamp() AND (r.fingerprint = ''::bytea OR excluded.fingerprint = ''::bytea OR r.fingerprint = excluded.fingerprint))) THEN CASE WHEN r.state = 1 THEN r.attempts + 1 ELSE 1 END ELSE r.attempts END,
	created_at  = CASE WHEN ((r.state = 2 AND r.expires_at <= statement_timestamp()) OR (r.state = 1 AND r.lease_until <= statement_timestamp() AND (r.fingerprint = ''::bytea OR excluded.fingerprint = ''::bytea OR r.fingerprint = excluded.fingerprint))) AND r.state = 2 THEN excluded.created_at ELSE r.created_at END
RETURNING r.state, r.token, r.attempts, r.fingerprint, r.result, r.lease_until, r.expires_at`
	oldSQLComplete = `UPDATE "OLDSCHEMA"."dedup_records" SET
	result     = CASE WHEN state = 1 THEN $4::bytea ELSE result END,
	expires_at = CASE WHEN state = 1 THEN LEAST(statement_timestamp() + GREATEST(($5::int8 * interval '1 microsecond'), COALESCE((SELECT w.retention FROM "OLDSCHEMA"."dedup_retention" w WHERE w.scope = $1::text), interval '0')), '2262-04-11 23:47:16.854775Z'::timestamptz) ELSE expires_at END,
	state      = 2
WHERE scope = $1::text AND id = $2::text AND token = $3::bytea`
)
