-- The embedded store's key table: the same record as PostgreSQL's idemproxy.records. Times are
-- milliseconds since the Unix epoch by the host clock; the token is a UUID's 16 bytes; response headers
-- are one blob of length-prefixed name/value pairs, since SQLite has no arrays.
-- The primary key decides a claim: concurrent claims of one key meet in INSERT ... ON CONFLICT on it.
CREATE TABLE records (
    scope            TEXT    NOT NULL,
    key              TEXT    NOT NULL,
    fingerprint      BLOB    NOT NULL,
    status           TEXT    NOT NULL CHECK (status IN ('processing', 'completed', 'failed')),
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

-- Serves the expiry sweeper: expired rows are found in expires_at order.
CREATE INDEX records_expires_at_idx ON records (expires_at);
