-- adopt and adopt_p given the keys' scope integers (sid[k] is the integer
-- of s[k], which the store has already looked up in autocommit): a move
-- made in the caller's transaction (the inbox) must not look the scope up
-- in that transaction, where a REPEATABLE READ snapshot taken before the
-- scope's row committed cannot see it, and scope_id's INSERT ... ON
-- CONFLICT on the row it cannot see is a serialization failure that
-- aborts the caller's transaction (TestInboxRepeatableReadAdoptsOldRecord).
CREATE FUNCTION {{t:adopt}}(s text[], i text[], sid integer[]) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    IF to_regclass('{{t:records}}') IS NULL THEN
        RETURN false;
    END IF;
    FOR k IN 1 .. coalesce(cardinality(i), 0) LOOP
        WITH d AS (DELETE FROM {{t:records}} WHERE scope = s[k] AND id = i[k] RETURNING *)
        INSERT INTO {{t:rec}} (deadline, scope, attempts, state, token, id, fingerprint, result)
        SELECT CASE WHEN d.state = 2 THEN d.expires_at ELSE d.lease_until END, sid[k], d.attempts, d.state, d.token,
            {{t:key_id}}(d.id), {{t:fp_digest}}(d.fingerprint), d.result
        FROM d WHERE d.expires_at > statement_timestamp()
        ON CONFLICT (scope, id) DO NOTHING;
    END LOOP;
    RETURN true;
EXCEPTION WHEN undefined_table THEN
    RETURN false;
END
$$;
CREATE FUNCTION {{t:adopt_p}}(s text[], i text[], sid integer[]) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    IF to_regclass('{{t:records_p}}') IS NULL THEN
        RETURN false;
    END IF;
    FOR k IN 1 .. coalesce(cardinality(i), 0) LOOP
        WITH d AS (DELETE FROM {{t:records_p}} WHERE scope = s[k] AND id = i[k] RETURNING *)
        INSERT INTO {{t:rec_p}} (deadline, scope, attempts, state, token, id, fingerprint, result)
        SELECT CASE WHEN d.state = 2 THEN d.expires_at ELSE d.lease_until END, sid[k], d.attempts, d.state, d.token,
            {{t:key_id}}(d.id), {{t:fp_digest}}(d.fingerprint), d.result
        FROM d WHERE d.expires_at > statement_timestamp();
    END LOOP;
    RETURN true;
EXCEPTION WHEN undefined_table THEN
    RETURN false;
END
$$;
