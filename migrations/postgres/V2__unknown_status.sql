-- A record whose request may have reached the upstream without a full answer coming back can be held as
-- 'unknown' (idempotency.on_unknown_outcome = "hold"): never forwarded again until an operator releases it.
-- The new check is added NOT VALID, which takes only a brief lock; V3 validates the existing rows in a
-- transaction of its own, which does not block writes (SHARE UPDATE EXCLUSIVE), so a large table keeps
-- serving while it is checked. Replicas of the previous version keep working meanwhile: they never write
-- 'unknown', and one that reads such a record refuses it as in flight (409) rather than running it.
ALTER TABLE idemproxy.records
    DROP CONSTRAINT records_status_check,
    ADD CONSTRAINT records_status_check
        CHECK (status IN ('processing', 'completed', 'failed', 'unknown')) NOT VALID;
