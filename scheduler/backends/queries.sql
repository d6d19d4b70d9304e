-- The statements the PostgreSQL backend sends, by name (scheduler/backends/queries.py
-- loads them). The gate's steps themselves are the functions of postgres.sql.

-- name: claim
-- One batch of ticks claimed, each answered (scheduler_decide: the claim's steps, in order).
SELECT * FROM scheduler_decide(:ns, :instance, :capacity, :takeover, :share_from, :crashed,
    CAST(:keys AS integer[]), CAST(:names AS text[]), CAST(:ticks AS timestamptz[]),
    CAST(:intents AS text[]), CAST(:graces AS double precision[]),
    CAST(:thresholds AS integer[]), CAST(:fail_thresholds AS integer[]))

-- name: claim_and_fleet
-- As `claim`, with the fleet's shape beside its answer: the live replicas, this one's rank
-- among them, and the database's clock (the next bursts' first claims leave other
-- replicas' shares out: scheduler/backends/shares.py).
SELECT d.*, f.live, f.rank, now() AS db_now
  FROM scheduler_decide(:ns, :instance, :capacity, :takeover, :share_from, :crashed,
    CAST(:keys AS integer[]), CAST(:names AS text[]), CAST(:ticks AS timestamptz[]),
    CAST(:intents AS text[]), CAST(:graces AS double precision[]),
    CAST(:thresholds AS integer[]), CAST(:fail_thresholds AS integer[])) d,
       scheduler_fleet(:ns) f

-- name: taken
-- Which of these ticks a replica has recorded already (a claim answers each `lost`): their
-- places in the arrays sent, 1-based (scheduler_taken). Each tick is sent as its place in
-- `instants` (a burst's ticks share a few): every replica probes every second, and
-- parsing a timestamp per tick cost the server more than the probe.
SELECT scheduler_taken(CAST(:keys AS integer[]), CAST(:at AS integer[]),
                       CAST(:instants AS timestamptz[])) AS places

-- name: taken_and_fleet
-- As `taken`, with the fleet's shape beside it (see `claim_and_fleet`): a replica whose
-- share of the bursts is small claims seldom, and learns of a changed fleet here.
SELECT scheduler_taken(CAST(:keys AS integer[]), CAST(:at AS integer[]),
                       CAST(:instants AS timestamptz[])) AS places,
       f.live, f.rank, now() AS db_now
  FROM scheduler_fleet(:ns) f

-- name: finish
-- One batch of finished runs recorded, then their locks released (scheduler_finish).
SELECT * FROM scheduler_finish(:ns, :instance, CAST(:keys AS integer[]),
    CAST(:ticks AS timestamptz[]), CAST(:run_ids AS bigint[]), CAST(:statuses AS text[]),
    CAST(:errors AS text[]), CAST(:told AS text[]), CAST(:durations AS double precision[]),
    CAST(:unlocks AS boolean[]), CAST(:thresholds AS integer[]),
    CAST(:next_dues AS timestamptz[]), CAST(:retry_in AS double precision[]))

-- name: recheck
-- Runs won ahead whose lease ran out, asked again before they start (scheduler_recheck).
SELECT outcomes FROM scheduler_recheck(:ns, CAST(:keys AS integer[]),
    CAST(:ticks AS timestamptz[]), CAST(:run_ids AS bigint[]), CAST(:give_back AS boolean[]),
    CAST(:kinds AS text[]))

-- name: claim_retries
-- Due retries of these jobs started, lock first (scheduler_start_retries).
SELECT * FROM scheduler_start_retries(:ns, :instance, CAST(:keys AS integer[]), :capacity,
    :crashed, CAST(:fail_thresholds AS integer[]))

-- name: release_strays
-- This session's job locks with no run of this replica behind them, released (the lock
-- invariant: scheduler_release_strays in postgres.sql).
SELECT k AS key FROM scheduler_release_strays(:ns, CAST(:expected AS integer[])) k

-- name: own_locks
-- The job locks this session holds now.
SELECT key FROM scheduler_locks(:ns)
 WHERE pid = pg_backend_pid() AND NOT shared AND key BETWEEN 1 AND 2147483647

-- name: count_crashes
-- Runs the sweep found crashed, counted as failures (scheduler_count_crashes).
SELECT key, failures, notice FROM scheduler_count_crashes(:instance, CAST(:keys AS integer[]),
    CAST(:names AS text[]), CAST(:counts AS integer[]), CAST(:ticks AS timestamptz[]),
    CAST(:thresholds AS integer[]))

-- name: heartbeat
-- The lock session proves it is alive, and looks for run-now requests (scheduler/fleet/run_now.py),
-- for the next retry of a job that is not paused (seconds from now), and whether its node
-- still is a writable primary (a fenced old primary is not). In the same round trip it
-- keeps the lock invariant (scheduler_release_strays; with :expected NULL, it releases none).
SELECT EXISTS (SELECT 1 FROM scheduler_requests WHERE taken_by IS NULL) AS waiting,
       (SELECT extract(epoch FROM min(t.retry_at) - now()) FROM scheduler_ticks t
         WHERE t.retry_at IS NOT NULL AND t.status = 'failed'
           AND NOT EXISTS (SELECT 1 FROM scheduler_pauses p WHERE p.job_key = t.job_key))
         AS retry_in,
       pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on' AS read_only,
       ARRAY(SELECT k FROM scheduler_release_strays(:ns, CAST(:expected AS integer[])) k)
         AS released

-- name: held_locks
-- Job locks some session of this database holds now (scheduler_locks in postgres.sql).
SELECT key FROM scheduler_locks(:ns) WHERE key BETWEEN 1 AND 2147483647

-- name: live_instances
-- Replicas whose lock session is up: they hold (lock_namespace, 0) in share mode.
SELECT a.application_name AS name, a.backend_start AS since,
       host(a.client_addr) AS address, a.pid
  FROM scheduler_locks(:ns) l JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE l.key = 0 AND l.shared
 ORDER BY a.application_name

-- name: lock_holders
-- Job key and the instance whose session holds its lock now.
SELECT l.key, a.application_name AS name
  FROM scheduler_locks(:ns) l JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE l.key BETWEEN 1 AND 2147483647 AND NOT l.shared
