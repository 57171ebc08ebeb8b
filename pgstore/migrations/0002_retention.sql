-- Retention windows per scope. retention is a floor: a completion in the
-- scope is kept at least this long whatever the caller asked for.
-- replay_horizon is how far back the broker or client may redeliver; a
-- retention shorter than it lets duplicates through, and the store warns.
CREATE TABLE {{t:retention}} (
    scope          text COLLATE "C" PRIMARY KEY,
    retention      interval    NOT NULL CHECK (retention > interval '0'),
    replay_horizon interval    CHECK (replay_horizon IS NULL OR replay_horizon > interval '0'),
    updated_at     timestamptz NOT NULL DEFAULT statement_timestamp()
);
