-- One row per (scope, key). The primary key is what decides a claim: concurrent claims of one key meet in
-- INSERT ... ON CONFLICT on this constraint, never in a read followed by a write.
-- Types stay portable to Postgres-compatible distributed databases: text with CHECK instead of enums.
CREATE TABLE idemproxy.records (
    scope                  text        NOT NULL,
    key                    text        NOT NULL,
    fingerprint            bytea       NOT NULL,
    status                 text        NOT NULL CHECK (status IN ('processing', 'completed', 'failed')),
    token                  uuid        NOT NULL,
    attempt                integer     NOT NULL,
    claim_kind             text        NOT NULL CHECK (claim_kind IN ('new', 'retry', 'takeover')),
    locked_until           timestamptz NOT NULL,
    created_at             timestamptz NOT NULL,
    expires_at             timestamptz NOT NULL,
    updated_at             timestamptz NOT NULL,
    response_status        smallint,
    response_header_names  text[],
    response_header_values bytea[],
    response_body          bytea,
    body_retained          boolean,
    PRIMARY KEY (scope, key)
);

-- Serves the expiry sweeper: expired rows are found in expires_at order.
CREATE INDEX records_expires_at_idx ON idemproxy.records (expires_at);
