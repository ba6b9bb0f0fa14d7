#!/bin/sh
# Runs once, when the compose stack's PostgreSQL volume is first created (docker-entrypoint-initdb.d).
# Two roles, as docs/operations.md recommends for production: the owner runs `idemproxy migrate` and owns
# the schema; the serving role the proxy connects with may only read and write rows, so a compromised or
# buggy proxy cannot drop or alter the key table. Their passwords come from the environment
# (docker-compose.yml passes IDEMPROXY_OWNER_PASSWORD and IDEMPROXY_PASSWORD), never from this file.
set -eu
psql -v ON_ERROR_STOP=1 -U "${POSTGRES_USER:-postgres}" -d postgres -q \
  -v owner_password="${IDEMPROXY_OWNER_PASSWORD:?IDEMPROXY_OWNER_PASSWORD is required}" \
  -v serve_password="${IDEMPROXY_PASSWORD:?IDEMPROXY_PASSWORD is required}" <<'SQL'
CREATE ROLE idemproxy_owner LOGIN PASSWORD :'owner_password';
CREATE ROLE idemproxy LOGIN PASSWORD :'serve_password';
CREATE DATABASE idemproxy OWNER idemproxy_owner;
\connect idemproxy
CREATE SCHEMA idemproxy AUTHORIZATION idemproxy_owner;
GRANT USAGE ON SCHEMA idemproxy TO idemproxy;
ALTER DEFAULT PRIVILEGES FOR ROLE idemproxy_owner IN SCHEMA idemproxy
    GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO idemproxy;
SQL
