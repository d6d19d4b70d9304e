-- A replica's schedule of a job that changed is kept (ended) beside the one in force:
-- the registrations' key gains `since`. When replicas were last seen alive.
CREATE TABLE IF NOT EXISTS scheduler_seen (
    instance text PRIMARY KEY,
    seen_at  timestamp with time zone NOT NULL
);
ALTER TABLE scheduler_registrations DROP CONSTRAINT scheduler_registrations_pkey,
    ADD PRIMARY KEY (instance, job_key, since);
