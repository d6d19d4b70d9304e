-- The first ledger: one row per (job key, scheduled tick), the jobs' streaks, the
-- housekeeping clocks, the version record, and the run-id sequence (the fencing token).
-- Statements here and in later files are written to run again on a ledger that already
-- has what they make (IF NOT EXISTS, ON CONFLICT): a ledger is never worse for it.
CREATE SEQUENCE IF NOT EXISTS scheduler_run_id;

CREATE TABLE IF NOT EXISTS scheduler_ticks (
    job_key      integer NOT NULL,
    scheduled_at timestamp with time zone NOT NULL,
    job_name     text NOT NULL,
    status       varchar(16) NOT NULL,
    instance     text,
    holder       text,
    run_id       bigint,
    started_at   timestamp with time zone,
    finished_at  timestamp with time zone,
    error        text,
    manual       boolean DEFAULT false NOT NULL,
    PRIMARY KEY (job_key, scheduled_at),
    CONSTRAINT scheduler_ticks_status CHECK (status IN
        ('running', 'succeeded', 'failed', 'skipped', 'crashed', 'missed'))
);
CREATE INDEX IF NOT EXISTS scheduler_ticks_scheduled_at ON scheduler_ticks (scheduled_at);
CREATE INDEX IF NOT EXISTS scheduler_ticks_running
    ON scheduler_ticks (job_key) WHERE status = 'running';

CREATE TABLE IF NOT EXISTS scheduler_jobs (
    job_key              serial PRIMARY KEY,
    job_name             text NOT NULL,
    consecutive_skips    integer DEFAULT 0 NOT NULL,
    skip_alerted         boolean DEFAULT false NOT NULL,
    consecutive_failures integer DEFAULT 0 NOT NULL,
    fail_alerted         boolean DEFAULT false NOT NULL,
    schedule             text,
    tracked_since        timestamp with time zone NOT NULL
);

CREATE TABLE IF NOT EXISTS scheduler_maintenance (
    task        varchar(32) PRIMARY KEY,
    last_run_at timestamp with time zone NOT NULL
);
INSERT INTO scheduler_maintenance (task, last_run_at)
VALUES ('sweep', '1970-01-01 00:00:00+00'), ('prune', '1970-01-01 00:00:00+00')
ON CONFLICT DO NOTHING;

CREATE TABLE IF NOT EXISTS scheduler_schema (
    version    serial PRIMARY KEY,
    applied_at timestamp with time zone NOT NULL
);

-- Used by the embedded backend only (SQLite has no sequences); made on both alike.
CREATE TABLE IF NOT EXISTS scheduler_counters (
    name  varchar(32) PRIMARY KEY,
    value bigint NOT NULL
);
