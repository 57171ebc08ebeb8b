-- What the outbox relay needs (package outbox): per-row attempts, the last
-- error, a retry time and a quarantine mark; partition leases with fencing
-- epochs; the relays alive. The relay reads unpublished rows in id order
-- and marks them, with no cursor, so a row whose transaction commits late
-- with a lower id is read on the next poll like any other (see
-- docs/DESIGN.md, "Outbox relay").
ALTER TABLE {{t:outbox}}
    ADD COLUMN attempts        integer NOT NULL DEFAULT 0,
    ADD COLUMN last_error      text,
    ADD COLUMN next_attempt_at timestamptz,
    ADD COLUMN quarantined_at  timestamptz;
-- Quarantined rows that still hold up their key.
CREATE INDEX {{n:outbox_quarantined}} ON {{t:outbox}} (aggregate, id)
    WHERE quarantined_at IS NOT NULL AND published_at IS NULL;
-- Published rows, for retention.
CREATE INDEX {{n:outbox_published}} ON {{t:outbox}} (published_at)
    WHERE published_at IS NOT NULL;
-- One row per partition of the key space: who holds it, until when, and
-- the fencing epoch that grows on each change of owner.
CREATE TABLE {{t:outbox_leases}} (
    part       integer PRIMARY KEY,
    partitions integer     NOT NULL,
    owner      text        NOT NULL DEFAULT '',
    epoch      bigint      NOT NULL DEFAULT 0,
    expires_at timestamptz NOT NULL DEFAULT '-infinity'
);
-- The relays alive, for the fair share of partitions each takes.
CREATE TABLE {{t:outbox_relays}} (
    relay      text PRIMARY KEY,
    partitions integer     NOT NULL,
    started_at timestamptz NOT NULL DEFAULT statement_timestamp(),
    expires_at timestamptz NOT NULL
);
-- Wake-up: one notification per writing statement on channel
-- "<schema>.<table>" (PostgreSQL folds repeats within a transaction and
-- delivers at commit, never on rollback). Relays LISTEN and also poll.
CREATE FUNCTION {{t:outbox_notify}}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, '');
    RETURN NULL;
END
$$;
CREATE TRIGGER {{n:outbox_notify}} AFTER INSERT ON {{t:outbox}}
    FOR EACH STATEMENT EXECUTE FUNCTION {{t:outbox_notify}}();
