-- The outbox of notices, the replicas' registrations, what a run was told and its own
-- duration, a job's overrun skips, and two more statuses (interrupted, paused). SQLite
-- cannot change a CHECK constraint: the ticks' table is made anew and its rows copied.
CREATE TABLE IF NOT EXISTS scheduler_notices (
	id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
	event TEXT NOT NULL,
	job_key INTEGER NOT NULL,
	job_name TEXT NOT NULL,
	scheduled_at DATETIME,
	facts TEXT NOT NULL,
	raised_by TEXT NOT NULL,
	raised_at DATETIME NOT NULL,
	lease_by TEXT,
	lease_until DATETIME,
	attempts INTEGER DEFAULT '0' NOT NULL,
	next_attempt_at DATETIME NOT NULL,
	done_at DATETIME,
	outcome TEXT
);
CREATE INDEX IF NOT EXISTS scheduler_notices_pending ON scheduler_notices (next_attempt_at) WHERE done_at IS NULL;
CREATE TABLE IF NOT EXISTS scheduler_registrations (
	instance TEXT NOT NULL,
	job_key INTEGER NOT NULL,
	job_name TEXT NOT NULL,
	schedule TEXT,
	since DATETIME NOT NULL,
	until DATETIME,
	PRIMARY KEY (instance, job_key)
);
ALTER TABLE scheduler_jobs ADD COLUMN overrun_skips INTEGER DEFAULT '0' NOT NULL;
ALTER TABLE scheduler_ticks RENAME TO scheduler_ticks_old;
DROP INDEX IF EXISTS scheduler_ticks_scheduled_at;
DROP INDEX IF EXISTS scheduler_ticks_running;
CREATE TABLE scheduler_ticks (
	job_key INTEGER NOT NULL,
	scheduled_at DATETIME NOT NULL,
	job_name TEXT NOT NULL,
	status VARCHAR(16) NOT NULL,
	instance TEXT,
	holder TEXT,
	run_id BIGINT,
	started_at DATETIME,
	finished_at DATETIME,
	error TEXT,
	manual BOOLEAN DEFAULT 0 NOT NULL,
	told TEXT,
	duration_s FLOAT,
	PRIMARY KEY (job_key, scheduled_at),
	CONSTRAINT scheduler_ticks_status CHECK (status IN ('running', 'succeeded', 'failed', 'interrupted', 'skipped', 'crashed', 'missed', 'paused'))
);
INSERT INTO scheduler_ticks (job_key, scheduled_at, job_name, status, instance, holder, run_id, started_at, finished_at, error, manual)
SELECT job_key, scheduled_at, job_name, status, instance, holder, run_id, started_at, finished_at, error, manual FROM scheduler_ticks_old;
DROP TABLE scheduler_ticks_old;
CREATE INDEX IF NOT EXISTS scheduler_ticks_scheduled_at ON scheduler_ticks (scheduled_at);
CREATE INDEX IF NOT EXISTS scheduler_ticks_running ON scheduler_ticks (job_key) WHERE status = 'running';
