-- A tick's attempts (job `retries`): the row holds the latest, earlier ones are kept in
-- scheduler_attempts; when its next is due; whether it was caught up.
CREATE TABLE IF NOT EXISTS scheduler_attempts (
	job_key INTEGER NOT NULL,
	scheduled_at DATETIME NOT NULL,
	attempt INTEGER NOT NULL,
	instance TEXT,
	run_id BIGINT,
	status VARCHAR(16) NOT NULL,
	started_at DATETIME,
	finished_at DATETIME,
	duration_s FLOAT,
	error TEXT,
	told TEXT,
	PRIMARY KEY (job_key, scheduled_at, attempt)
);
ALTER TABLE scheduler_ticks ADD COLUMN attempt INTEGER DEFAULT '1' NOT NULL;
ALTER TABLE scheduler_ticks ADD COLUMN retry_at DATETIME;
ALTER TABLE scheduler_ticks ADD COLUMN caught_up BOOLEAN DEFAULT 0 NOT NULL;
CREATE INDEX IF NOT EXISTS scheduler_ticks_retry_at ON scheduler_ticks (retry_at) WHERE retry_at IS NOT NULL;
