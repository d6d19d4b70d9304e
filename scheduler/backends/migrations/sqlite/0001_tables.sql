-- The first ledger, in the embedded file: the same tables as on PostgreSQL, and a
-- counter for run ids (SQLite has no sequences). Statements are split at a semicolon
-- that ends a line, and run in one transaction; none may end a line inside itself.
CREATE TABLE IF NOT EXISTS scheduler_ticks (
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
	PRIMARY KEY (job_key, scheduled_at),
	CONSTRAINT scheduler_ticks_status CHECK (status IN ('running', 'succeeded', 'failed', 'skipped', 'crashed', 'missed'))
);
CREATE INDEX IF NOT EXISTS scheduler_ticks_scheduled_at ON scheduler_ticks (scheduled_at);
CREATE INDEX IF NOT EXISTS scheduler_ticks_running ON scheduler_ticks (job_key) WHERE status = 'running';
CREATE TABLE IF NOT EXISTS scheduler_jobs (
	job_key INTEGER NOT NULL,
	job_name TEXT NOT NULL,
	consecutive_skips INTEGER DEFAULT '0' NOT NULL,
	skip_alerted BOOLEAN DEFAULT 0 NOT NULL,
	consecutive_failures INTEGER DEFAULT '0' NOT NULL,
	fail_alerted BOOLEAN DEFAULT 0 NOT NULL,
	schedule TEXT,
	tracked_since DATETIME NOT NULL,
	PRIMARY KEY (job_key)
);
CREATE TABLE IF NOT EXISTS scheduler_maintenance (
	task VARCHAR(32) NOT NULL,
	last_run_at DATETIME NOT NULL,
	PRIMARY KEY (task)
);
INSERT OR IGNORE INTO scheduler_maintenance (task, last_run_at)
VALUES ('sweep', '1970-01-01 00:00:00.000000'), ('prune', '1970-01-01 00:00:00.000000');
CREATE TABLE IF NOT EXISTS scheduler_schema (
	version INTEGER NOT NULL,
	applied_at DATETIME NOT NULL,
	PRIMARY KEY (version)
);
CREATE TABLE IF NOT EXISTS scheduler_counters (
	name VARCHAR(32) NOT NULL,
	value BIGINT NOT NULL,
	PRIMARY KEY (name)
);
INSERT OR IGNORE INTO scheduler_counters (name, value) VALUES ('run_id', 0);
