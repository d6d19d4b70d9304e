-- Fleet-wide pauses: while a job has a row here, its ticks are recorded `paused`.
CREATE TABLE IF NOT EXISTS scheduler_pauses (
    job_key   serial PRIMARY KEY,
    job_name  text NOT NULL,
    paused_by text NOT NULL,
    paused_at timestamp with time zone NOT NULL,
    reason    text
);
