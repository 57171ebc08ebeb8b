-- The dedup records: one row per key, in progress (state 1) or completed
-- (state 2). Times are the server's (statement_timestamp()).
CREATE TABLE {{t:records}} (
    scope       text COLLATE "C" NOT NULL,
    id          text COLLATE "C" NOT NULL,
    state       smallint    NOT NULL CHECK (state IN (1, 2)),
    token       bytea       NOT NULL,
    fingerprint bytea       NOT NULL DEFAULT ''::bytea,
    result      bytea,
    lease_until timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    attempts    integer     NOT NULL CHECK (attempts > 0),
    created_at  timestamptz NOT NULL DEFAULT statement_timestamp(),
    PRIMARY KEY (scope, id)
);
CREATE INDEX {{n:records_expires_at}} ON {{t:records}} (expires_at);
