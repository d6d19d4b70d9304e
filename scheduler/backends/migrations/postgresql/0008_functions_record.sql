-- Which postgres.sql is installed (its sha256), and by which version: the gate's
-- functions are installed again whenever that file changes, not only when a table does.
CREATE TABLE IF NOT EXISTS scheduler_functions (
    sha256       text PRIMARY KEY,
    version      integer NOT NULL,
    installed_at timestamp with time zone NOT NULL
);
