-- A tick's attempts (job `retries`): the row holds the latest, earlier ones are kept in
-- scheduler_attempts; when its next is due; whether it was caught up.
CREATE TABLE IF NOT EXISTS scheduler_attempts (
    job_key      integer NOT NULL,
    scheduled_at timestamp with time zone NOT NULL,
    attempt      integer NOT NULL,
    instance     text,
    run_id       bigint,
    status       varchar(16) NOT NULL,
    started_at   timestamp with time zone,
    finished_at  timestamp with time zone,
    duration_s   double precision,
    error        text,
    told         text,
    PRIMARY KEY (job_key, scheduled_at, attempt)
);
ALTER TABLE scheduler_ticks ADD COLUMN IF NOT EXISTS attempt integer DEFAULT 1 NOT NULL;
ALTER TABLE scheduler_ticks ADD COLUMN IF NOT EXISTS retry_at timestamp with time zone;
ALTER TABLE scheduler_ticks ADD COLUMN IF NOT EXISTS caught_up boolean DEFAULT false NOT NULL;
CREATE INDEX IF NOT EXISTS scheduler_ticks_retry_at
    ON scheduler_ticks (retry_at) WHERE retry_at IS NOT NULL;
