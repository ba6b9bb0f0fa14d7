-- A completion rewrites its record with the response. It changes no indexed column, so the new version
-- is heap-only (HOT: no new index entries) whenever the record's page has room for it; with pages
-- filled whole by new claims, about half of the completions found none and wrote a new entry in both
-- indexes. New pages keep half their room for the completions of the records on them. Changing a
-- storage parameter takes a lock that does not block reads or writes, and existing pages are left as
-- they are, so replicas keep serving while this applies.
ALTER TABLE idemproxy.records SET (fillfactor = 50);
