-- Whether a job's live replicas disagree on its schedule, and since when; run-now
-- requests; the watermark of missed ticks, which starts where the sweep was on a
-- ledger that has run (the epoch on a new one).
ALTER TABLE scheduler_jobs ADD COLUMN drift_since DATETIME;
ALTER TABLE scheduler_jobs ADD COLUMN drift_alerted BOOLEAN DEFAULT 0 NOT NULL;
CREATE TABLE IF NOT EXISTS scheduler_requests (
	id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
	job_key INTEGER NOT NULL,
	job_name TEXT NOT NULL,
	requested_by TEXT NOT NULL,
	requested_at DATETIME NOT NULL,
	taken_by TEXT,
	taken_at DATETIME,
	outcome TEXT,
	status TEXT,
	run_id BIGINT,
	error TEXT,
	finished_at DATETIME
);
CREATE INDEX IF NOT EXISTS scheduler_requests_pending ON scheduler_requests (id) WHERE taken_by IS NULL;
INSERT OR IGNORE INTO scheduler_maintenance (task, last_run_at)
SELECT 'missed', coalesce((SELECT last_run_at FROM scheduler_maintenance WHERE task = 'sweep'), '1970-01-01 00:00:00.000000');
