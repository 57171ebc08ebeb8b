-- fp_digest stores every fingerprint as the first 16 bytes of the SHA-256
-- of its whole text. Version 6 stored a fingerprint spelled like
-- dedup.FingerprintOf's ("sha256:" and 64 lower-case hex digits) as the
-- first 16 bytes it spells, so two fingerprints a user made that differ
-- only in their last 32 digits were stored alike, and a claim with the
-- second after the first completed was answered as a duplicate with the
-- first one's result (and "x" and the "sha256:" spelling of the digest of
-- "x" were alike too). Records written under version 6 with such a
-- fingerprint now compare as a mismatch with the same fingerprint: the
-- store fails closed (the request is refused, never applied twice) until
-- they expire.
CREATE OR REPLACE FUNCTION {{t:fp_digest}}(fp bytea) RETURNS bytea LANGUAGE sql IMMUTABLE STRICT AS $$
    SELECT CASE
        WHEN fp = ''::bytea THEN ''::bytea
        ELSE substr(sha256(fp), 1, 16)
    END
$$;
