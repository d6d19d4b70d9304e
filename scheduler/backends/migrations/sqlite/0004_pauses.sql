-- Fleet-wide pauses: while a job has a row here, its ticks are recorded `paused`.
CREATE TABLE IF NOT EXISTS scheduler_pauses (
	job_key INTEGER NOT NULL,
	job_name TEXT NOT NULL,
	paused_by TEXT NOT NULL,
	paused_at DATETIME NOT NULL,
	reason TEXT,
	PRIMARY KEY (job_key)
);
