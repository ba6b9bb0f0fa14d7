-- Checks the existing rows against V2's constraint without blocking writes (see V2).
ALTER TABLE idemproxy.records VALIDATE CONSTRAINT records_status_check;
