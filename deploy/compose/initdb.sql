-- Runs once, when the compose stack's PostgreSQL volume is first created (docker-entrypoint-initdb.d).
-- Two roles, as docs/operations.md recommends for production: the owner runs `idemproxy migrate` and owns
-- the schema; the serving role the proxy connects with may only read and write rows, so a compromised or
-- buggy proxy cannot drop or alter the key table.
CREATE ROLE idemproxy_owner LOGIN PASSWORD 'owner-demo-password';
CREATE ROLE idemproxy LOGIN PASSWORD 'demo-password';
CREATE DATABASE idemproxy OWNER idemproxy_owner;
\connect idemproxy
CREATE SCHEMA idemproxy AUTHORIZATION idemproxy_owner;
GRANT USAGE ON SCHEMA idemproxy TO idemproxy;
ALTER DEFAULT PRIVILEGES FOR ROLE idemproxy_owner IN SCHEMA idemproxy
    GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO idemproxy;
