-- The time-partitioned records table, for very high volume: partitioned
-- by the time of each record's latest acquisition, so that old partitions
-- are dropped instead of deleted row by row. A unique key on a partitioned
-- table must include the partition key, so (scope, id) is not unique here
-- by constraint: the store keeps it unique by claiming each key under a
-- transaction-scoped advisory lock. Partitions are created by
-- EnsurePartitions, never by hand.
CREATE TABLE {{t:records_p}} (
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
    PRIMARY KEY (scope, id, created_at)
) PARTITION BY RANGE (created_at);
CREATE INDEX {{n:records_p_expires_at}} ON {{t:records_p}} (expires_at);
