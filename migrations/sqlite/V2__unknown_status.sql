-- Adds the 'unknown' status (idempotency.on_unknown_outcome = "hold"). SQLite cannot change a CHECK
-- constraint in place, so the table is rebuilt under its own name, as SQLite's documentation describes
-- for schema changes; the migration runs in one transaction at start, before the proxy serves.
CREATE TABLE records_v2 (
    scope            TEXT    NOT NULL,
    key              TEXT    NOT NULL,
    fingerprint      BLOB    NOT NULL,
    status           TEXT    NOT NULL CHECK (status IN ('processing', 'completed', 'failed', 'unknown')),
    token            BLOB    NOT NULL,
    attempt          INTEGER NOT NULL,
    claim_kind       TEXT    NOT NULL CHECK (claim_kind IN ('new', 'retry', 'takeover')),
    locked_until     INTEGER NOT NULL,
    created_at       INTEGER NOT NULL,
    expires_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    response_status  INTEGER,
    response_headers BLOB,
    response_body    BLOB,
    body_retained    INTEGER,
    PRIMARY KEY (scope, key)
);
INSERT INTO records_v2 SELECT * FROM records;
DROP TABLE records;
ALTER TABLE records_v2 RENAME TO records;
CREATE INDEX records_expires_at_idx ON records (expires_at);
