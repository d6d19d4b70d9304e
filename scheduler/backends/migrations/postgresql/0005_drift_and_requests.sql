-- Whether a job's live replicas disagree on its schedule, and since when; run-now
-- requests; the watermark of missed ticks, which starts where the sweep was on a
-- ledger that has run (the epoch on a new one).
ALTER TABLE scheduler_jobs ADD COLUMN IF NOT EXISTS drift_since timestamp with time zone;
ALTER TABLE scheduler_jobs ADD COLUMN IF NOT EXISTS drift_alerted boolean DEFAULT false NOT NULL;

CREATE TABLE IF NOT EXISTS scheduler_requests (
    id           bigserial PRIMARY KEY,
    job_key      integer NOT NULL,
    job_name     text NOT NULL,
    requested_by text NOT NULL,
    requested_at timestamp with time zone NOT NULL,
    taken_by     text,
    taken_at     timestamp with time zone,
    outcome      text,
    status       text,
    run_id       bigint,
    error        text,
    finished_at  timestamp with time zone
);
CREATE INDEX IF NOT EXISTS scheduler_requests_pending
    ON scheduler_requests (id) WHERE taken_by IS NULL;

INSERT INTO scheduler_maintenance (task, last_run_at)
SELECT 'missed', coalesce(
    (SELECT last_run_at FROM scheduler_maintenance WHERE task = 'sweep'),
    '1970-01-01 00:00:00+00')
ON CONFLICT DO NOTHING;
