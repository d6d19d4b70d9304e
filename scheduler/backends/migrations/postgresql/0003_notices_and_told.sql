-- The outbox of notices, the replicas' registrations, what a run was told and its own
-- duration, a job's overrun skips, and two more statuses (interrupted, paused).
CREATE TABLE IF NOT EXISTS scheduler_notices (
    id              bigserial PRIMARY KEY,
    event           text NOT NULL,
    job_key         integer NOT NULL,
    job_name        text NOT NULL,
    scheduled_at    timestamp with time zone,
    facts           text NOT NULL,
    raised_by       text NOT NULL,
    raised_at       timestamp with time zone NOT NULL,
    lease_by        text,
    lease_until     timestamp with time zone,
    attempts        integer DEFAULT 0 NOT NULL,
    next_attempt_at timestamp with time zone NOT NULL,
    done_at         timestamp with time zone,
    outcome         text
);
CREATE INDEX IF NOT EXISTS scheduler_notices_pending
    ON scheduler_notices (next_attempt_at) WHERE done_at IS NULL;

CREATE TABLE IF NOT EXISTS scheduler_registrations (
    instance text NOT NULL,
    job_key  integer NOT NULL,
    job_name text NOT NULL,
    schedule text,
    since    timestamp with time zone NOT NULL,
    until    timestamp with time zone,
    PRIMARY KEY (instance, job_key)
);

ALTER TABLE scheduler_ticks ADD COLUMN IF NOT EXISTS told text;
ALTER TABLE scheduler_ticks ADD COLUMN IF NOT EXISTS duration_s double precision;
ALTER TABLE scheduler_jobs ADD COLUMN IF NOT EXISTS overrun_skips integer DEFAULT 0 NOT NULL;

-- NOT VALID, then VALIDATE: the check of the rows already there takes no lock that
-- stops claims.
ALTER TABLE scheduler_ticks DROP CONSTRAINT scheduler_ticks_status,
    ADD CONSTRAINT scheduler_ticks_status CHECK (status IN
        ('running', 'succeeded', 'failed', 'interrupted', 'skipped', 'crashed', 'missed',
         'paused')) NOT VALID;
ALTER TABLE scheduler_ticks VALIDATE CONSTRAINT scheduler_ticks_status;
