-- A replica's schedule of a job that changed is kept (ended) beside the one in force:
-- the registrations' key gains `since` (a table made anew: SQLite cannot change a key).
-- When replicas were last seen alive.
CREATE TABLE IF NOT EXISTS scheduler_seen (
	instance TEXT NOT NULL,
	seen_at DATETIME NOT NULL,
	PRIMARY KEY (instance)
);
ALTER TABLE scheduler_registrations RENAME TO scheduler_registrations_old;
CREATE TABLE scheduler_registrations (
	instance TEXT NOT NULL,
	job_key INTEGER NOT NULL,
	job_name TEXT NOT NULL,
	schedule TEXT,
	since DATETIME NOT NULL,
	until DATETIME,
	PRIMARY KEY (instance, job_key, since)
);
INSERT INTO scheduler_registrations (instance, job_key, job_name, schedule, since, until)
SELECT instance, job_key, job_name, schedule, since, until FROM scheduler_registrations_old;
DROP TABLE scheduler_registrations_old;
