-- Outgoing messages written in the same transaction as the business write
-- (and the inbox record), for a relay to publish later. message_key is
-- the stable ID of the logical event, reused on every publish attempt.
CREATE TABLE {{t:outbox}} (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_key  text COLLATE "C" NOT NULL,
    aggregate    text        NOT NULL DEFAULT '',
    topic        text        NOT NULL,
    payload      bytea       NOT NULL,
    headers      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at   timestamptz NOT NULL DEFAULT statement_timestamp(),
    published_at timestamptz
);
CREATE INDEX {{n:outbox_unpublished}} ON {{t:outbox}} (id) WHERE published_at IS NULL;
