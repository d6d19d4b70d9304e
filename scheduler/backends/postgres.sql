-- The gate's two atomic steps on PostgreSQL, one round trip each per batch.
-- The tables come from scheduler/ledger.py; the story is told in scheduler/gate.py.
-- Both functions run on the replica's lock session: the advisory locks they
-- take and release are session-level and live as long as that session.
--
-- Rows are always inserted and locked in one order, (scheduled_at, job_key):
-- replicas claiming the same ticks at the same moment then only ever wait for
-- one another in one direction, never in a cycle.

-- scheduler_claim: claim a batch of ticks.
--
-- For each tick, the primary key (job_key, scheduled_at) decides which replica
-- owns it: the first INSERT wins; every other replica gets no row for it, which
-- the caller reads as `lost`. The owner
-- then tries the job's advisory lock (lock_namespace, key):
--   got it   -> `run`; any other `running` row of the job is stale (its
--               replica died or lost the lock, which freed the lock): `crashed`.
--   held     -> `skipped`: the previous run is still going. The fleet-wide
--               streak grows by one; exactly one skip makes it reach the
--               threshold, and that one reports `alert`.
-- Which unclaimed ticks a replica tries at once (its share of the burst, at
-- most p_capacity runs: its free workers) is explained at the claim below.
-- A tick older than its grace (by the database clock, the same for every
-- replica) is recorded `missed` and never run. Intent `skip` (this replica
-- still runs the job) never asks for the lock: advisory locks stack.
CREATE OR REPLACE FUNCTION scheduler_claim(
    p_namespace  integer,
    p_instance   text,
    p_capacity   integer,
    p_takeover   double precision,
    p_share_from integer,
    p_keys       integer[],
    p_names      text[],
    p_ticks      timestamptz[],
    p_intents    text[],
    p_graces     double precision[],
    p_thresholds integer[]
) RETURNS TABLE (
    job_key           integer,
    scheduled_at      timestamptz,
    outcome           text,
    run_id            bigint,
    started_at        timestamptz,
    holder            text,
    holder_since      timestamptz,
    consecutive_skips integer,
    alert             boolean,
    recovered         boolean,
    crashed           integer,
    live              integer,
    rank              integer
) LANGUAGE plpgsql
-- The planner cannot know how many ticks a call carries and guesses a handful;
-- its nested loops over them would make a burst of n ticks cost n^2.
SET enable_nestloop = off
AS $$
#variable_conflict use_column
DECLARE
    r record;
    v_live integer;
    v_rank integer;
    v_won_keys integer[];
    v_won_names text[];
    v_won_ticks timestamptz[];
    v_won_intents text[];
    v_won_thresholds integer[];
    v_won_run_ids bigint[];
    v_won_started timestamptz[];
    v_other_keys integer[];
    v_other_ticks timestamptz[];
    v_other_fates text[];
    v_keys integer[] := '{}';
    v_ticks timestamptz[] := '{}';
    v_run_ids bigint[] := '{}';
    v_started timestamptz[] := '{}';
BEGIN
    -- The live replicas (see the claim below), reported with every row so that a
    -- replica can leave other replicas' shares out of its next batch.
    SELECT count(*)::integer, (count(*) FILTER (WHERE l.pid < pg_backend_pid()))::integer
      INTO v_live, v_rank
      FROM pg_locks l
     WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ShareLock'
       AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
       AND l.classid = (p_namespace::bigint & 4294967295)::oid
       AND l.objid = 0 AND l.objsubid = 2;
    live := v_live;
    rank := v_rank;
    -- Manual runs (`scheduler trigger`) have a tick of their own: only the lock can stop them.
    FOR r IN
        SELECT q.key, q.name, q.tick
          FROM unnest(p_keys, p_names, p_ticks, p_intents) AS q(key, name, tick, intent)
         WHERE q.intent = 'manual'
    LOOP
        IF NOT pg_try_advisory_lock(p_namespace, r.key) THEN
            RETURN QUERY
            SELECT r.key, r.tick, 'held', NULL::bigint, NULL::timestamptz, t.instance,
                   t.started_at, NULL::integer, false, false, 0, live, rank
              FROM (SELECT NULL) AS one
              LEFT JOIN LATERAL (
                  SELECT t.instance, t.started_at FROM scheduler_ticks t
                   WHERE t.job_key = r.key AND t.status = 'running'
                   ORDER BY t.scheduled_at DESC LIMIT 1) AS t ON true;
            CONTINUE;
        END IF;
        INSERT INTO scheduler_ticks AS t
               (job_key, scheduled_at, job_name, status, instance, run_id, started_at, manual)
        VALUES (r.key, r.tick, r.name, 'running', p_instance, nextval('scheduler_run_id'),
                clock_timestamp(), true)
        ON CONFLICT DO NOTHING
        RETURNING t.run_id, t.started_at INTO run_id, started_at;
        IF FOUND THEN
            v_keys := v_keys || r.key;
            v_ticks := v_ticks || r.tick;
            v_run_ids := v_run_ids || run_id;
            v_started := v_started || started_at;
        ELSE
            PERFORM pg_advisory_unlock(p_namespace, r.key);
            RETURN QUERY SELECT r.key, r.tick, 'lost', NULL::bigint, NULL::timestamptz,
                                NULL::text, NULL::timestamptz, NULL::integer, false, false, 0,
                                live, rank;
        END IF;
    END LOOP;

    -- Ticks past their grace: recorded `missed` (unless some replica has a row).
    -- Ticks another replica owns are left out of the answer, here and below: the
    -- caller takes a tick it sent and got no row for as `lost`. In a healthy
    -- fleet that is most of the ticks a replica tries again after p_takeover.
    RETURN QUERY
    WITH late AS (
        SELECT q.key, q.name, q.tick
          FROM unnest(p_keys, p_names, p_ticks, p_intents, p_graces)
               AS q(key, name, tick, intent, grace)
         WHERE q.intent <> 'manual' AND now() - q.tick > make_interval(secs => q.grace)
    ), recorded AS (
        INSERT INTO scheduler_ticks AS t (job_key, scheduled_at, job_name, status, instance)
        SELECT late.key, late.tick, late.name, 'missed', p_instance
          FROM late ORDER BY late.tick, late.key
        ON CONFLICT DO NOTHING
        RETURNING t.job_key, t.scheduled_at
    )
    SELECT recorded.job_key, recorded.scheduled_at, 'missed',
           NULL::bigint, NULL::timestamptz, NULL::text, NULL::timestamptz, NULL::integer,
           false, false, 0, live, rank
      FROM recorded;

    -- The claim: one INSERT for the ticks this replica tries to win now.
    --
    -- Replicas claim each burst of ticks at the same moment. Each live replica
    -- (a session holding the shared presence lock (lock_namespace, 0)) first
    -- tries its own share of the ticks, by a hash of the job key (Knuth's
    -- multiplicative hash, which the replica can compute too), so that the
    -- replicas insert different rows side by side instead of queueing behind
    -- each other's uncommitted rows. A tick still unclaimed p_takeover seconds
    -- after its time is tried by every replica: a share whose replica is frozen
    -- or busy is not stranded. Other unclaimed ticks are `yielded`. Beyond
    -- p_capacity runs (this replica's free workers), ticks are `deferred`.
    -- (Bursts smaller than p_share_from ticks are not worth spreading: every
    -- replica tries them all, and the others' tries cost no second round trip.)

    IF cardinality(p_keys) < p_share_from THEN
        v_live := 1;  -- every replica tries every tick (`live` still reports the fleet)
    END IF;
    WITH q AS (
        SELECT q.key, q.name, q.tick, q.intent, q.threshold,
               EXISTS (SELECT 1 FROM scheduler_ticks t
                        WHERE t.job_key = q.key AND t.scheduled_at = q.tick) AS taken,
               v_live <= 1 OR mod(mod(q.key::bigint * 2654435761, 4294967296), v_live) = v_rank
                   OR now() - q.tick >= make_interval(secs => p_takeover) AS mine
          FROM unnest(p_keys, p_names, p_ticks, p_intents, p_graces, p_thresholds)
               AS q(key, name, tick, intent, grace, threshold)
         WHERE q.intent IN ('run', 'skip')
           AND now() - q.tick <= make_interval(secs => q.grace)
    ), tried AS (
        SELECT q.key, q.tick, q.name FROM q WHERE NOT q.taken AND q.intent = 'skip'
        UNION ALL
        (SELECT q.key, q.tick, q.name FROM q WHERE NOT q.taken AND q.intent = 'run' AND q.mine
          ORDER BY q.tick, q.key LIMIT p_capacity)
    ), won AS (
        INSERT INTO scheduler_ticks AS t
               (job_key, scheduled_at, job_name, status, instance, run_id, started_at)
        SELECT tried.key, tried.tick, tried.name, 'running', p_instance,
               nextval('scheduler_run_id'), clock_timestamp()
          FROM tried ORDER BY tried.tick, tried.key
        ON CONFLICT DO NOTHING
        RETURNING t.job_key, t.scheduled_at, t.run_id, t.started_at
    ), decided AS (
        SELECT q.key, q.name, q.tick, q.intent, q.threshold, won.run_id, won.started_at,
               CASE WHEN won.run_id IS NOT NULL THEN 'won'
                    WHEN q.taken OR tried.key IS NOT NULL THEN 'lost'  -- another came first
                    WHEN NOT q.mine THEN 'yielded'  -- another replica's share, for now
                    ELSE 'deferred'  -- no free worker for it in this batch
               END AS fate
          FROM q
          LEFT JOIN tried ON tried.key = q.key AND tried.tick = q.tick
          LEFT JOIN won ON won.job_key = q.key AND won.scheduled_at = q.tick
    )
    SELECT array_agg(d.key ORDER BY d.tick, d.key) FILTER (WHERE d.fate = 'won'),
           array_agg(d.name ORDER BY d.tick, d.key) FILTER (WHERE d.fate = 'won'),
           array_agg(d.tick ORDER BY d.tick, d.key) FILTER (WHERE d.fate = 'won'),
           array_agg(d.intent ORDER BY d.tick, d.key) FILTER (WHERE d.fate = 'won'),
           array_agg(d.threshold ORDER BY d.tick, d.key) FILTER (WHERE d.fate = 'won'),
           array_agg(d.run_id ORDER BY d.tick, d.key) FILTER (WHERE d.fate = 'won'),
           array_agg(d.started_at ORDER BY d.tick, d.key) FILTER (WHERE d.fate = 'won'),
           array_agg(d.key) FILTER (WHERE d.fate IN ('yielded', 'deferred')),
           array_agg(d.tick) FILTER (WHERE d.fate IN ('yielded', 'deferred')),
           array_agg(d.fate) FILTER (WHERE d.fate IN ('yielded', 'deferred'))
      INTO v_won_keys, v_won_names, v_won_ticks, v_won_intents, v_won_thresholds,
           v_won_run_ids, v_won_started, v_other_keys, v_other_ticks, v_other_fates
      FROM decided d;

    RETURN QUERY
    SELECT o.key, o.tick, o.fate, NULL::bigint, NULL::timestamptz, NULL::text,
           NULL::timestamptz, NULL::integer, false, false, 0, live, rank
      FROM unnest(v_other_keys, v_other_ticks, v_other_fates) AS o(key, tick, fate);

    -- The ticks this replica won: the lock decides run or skip (in the common order).
    FOR r IN
        SELECT * FROM unnest(v_won_keys, v_won_names, v_won_ticks, v_won_intents,
                             v_won_thresholds, v_won_run_ids, v_won_started)
                   AS w(key, name, tick, intent, threshold, run_id, started_at)
    LOOP
        IF r.intent = 'run' AND pg_try_advisory_lock(p_namespace, r.key) THEN
            v_keys := v_keys || r.key;
            v_ticks := v_ticks || r.tick;
            v_run_ids := v_run_ids || r.run_id;
            v_started := v_started || r.started_at;
            CONTINUE;  -- returned below, with what its start changed
        ELSE
            job_key := r.key;
            scheduled_at := r.tick;
            run_id := NULL;
            started_at := NULL;
            holder := NULL;
            holder_since := NULL;
            recovered := false;
            crashed := 0;
            -- The previous run still holds the lock (on another replica, or on
            -- this one: intent `skip`).
            SELECT t.instance, t.started_at INTO holder, holder_since
              FROM scheduler_ticks t
             WHERE t.job_key = r.key AND t.status = 'running' AND t.scheduled_at <> r.tick
             ORDER BY t.scheduled_at DESC LIMIT 1;
            UPDATE scheduler_ticks t
               SET status = 'skipped', run_id = NULL, started_at = NULL,
                   holder = scheduler_claim.holder
             WHERE t.job_key = r.key AND t.scheduled_at = r.tick;
            INSERT INTO scheduler_jobs AS j
                   (job_key, job_name, consecutive_skips, skip_alerted, tracked_since)
            VALUES (r.key, r.name, 1, 1 >= r.threshold, now())
            ON CONFLICT ON CONSTRAINT scheduler_jobs_pkey DO UPDATE
               SET consecutive_skips = j.consecutive_skips + 1,
                   skip_alerted = j.skip_alerted OR j.consecutive_skips + 1 >= r.threshold
            RETURNING j.consecutive_skips INTO consecutive_skips;
            alert := consecutive_skips = r.threshold;
            outcome := 'skipped';
        END IF;
        RETURN NEXT;
    END LOOP;

    IF cardinality(v_keys) = 0 THEN
        RETURN;
    END IF;
    -- The runs. This replica now holds their locks, so every other `running` row
    -- of those jobs belongs to a replica that died or lost the lock: `crashed`.
    -- And each job's skip streak ends (one recovery notice if it had alerted);
    -- consecutive_skips reports the length of the streak a run ends.
    RETURN QUERY
    WITH runs AS (
        SELECT * FROM unnest(v_keys, v_ticks, v_run_ids, v_started)
                   AS x(key, tick, run_id, started)
    ), stale AS (
        UPDATE scheduler_ticks t
           SET status = 'crashed', finished_at = clock_timestamp(),
               error = coalesce(t.error, 'replica lost its lock before the run finished')
          FROM runs
         WHERE t.job_key = runs.key AND t.status = 'running' AND t.scheduled_at <> runs.tick
        RETURNING t.job_key
    ), stale_per_job AS (
        SELECT stale.job_key, count(*)::integer AS n FROM stale GROUP BY stale.job_key
    ), streaks AS (
        SELECT j.job_key, j.consecutive_skips AS ended, j.skip_alerted AS alerted
          FROM scheduler_jobs j
         WHERE j.job_key = ANY (v_keys) AND (j.consecutive_skips > 0 OR j.skip_alerted)
         ORDER BY j.job_key
           FOR UPDATE
    ), reset AS (
        UPDATE scheduler_jobs j SET consecutive_skips = 0, skip_alerted = false
          FROM streaks WHERE j.job_key = streaks.job_key
        RETURNING j.job_key
    )
    SELECT runs.key, runs.tick, 'run', runs.run_id, runs.started, NULL::text,
           NULL::timestamptz, coalesce(streaks.ended, 0), false,
           coalesce(streaks.alerted, false), coalesce(stale_per_job.n, 0), live, rank
      FROM runs
      LEFT JOIN streaks ON streaks.job_key = runs.key
      LEFT JOIN stale_per_job ON stale_per_job.job_key = runs.key;
END;
$$;

-- scheduler_finish: record finished runs, then release their locks.
--
-- The update is conditional: only a row that is still `running` with this
-- run_id is ours. A stale run (its replica froze and lost the lock) finds its
-- row already `crashed` and changes nothing. The rows are updated before the
-- locks are released, so a replica that takes a lock next and looks for stale
-- `running` rows waits for this transaction and then sees the final status.
-- consecutive_failures: for a failure, the streak so far; for a success, the
-- length of the streak it ends.
CREATE OR REPLACE FUNCTION scheduler_finish(
    p_namespace  integer,
    p_keys       integer[],
    p_ticks      timestamptz[],
    p_run_ids    bigint[],
    p_statuses   text[],
    p_errors     text[],
    p_unlocks    boolean[],
    p_thresholds integer[]
) RETURNS TABLE (
    job_key              integer,
    scheduled_at         timestamptz,
    recorded             boolean,
    finished_at          timestamptz,
    consecutive_failures integer,
    alert                boolean,
    recovered            boolean
) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    r record;
    v_keys integer[];
    v_ticks timestamptz[];
    v_statuses text[];
    v_thresholds integer[];
    v_finished timestamptz[];
BEGIN
    WITH done AS (
        UPDATE scheduler_ticks t
           SET status = f.status, finished_at = clock_timestamp(), error = f.error
          FROM unnest(p_keys, p_ticks, p_run_ids, p_statuses, p_errors, p_thresholds)
               AS f(key, tick, run_id, status, error, threshold)
         WHERE t.job_key = f.key AND t.scheduled_at = f.tick
           AND t.run_id = f.run_id AND t.status = 'running'
        RETURNING t.job_key, t.scheduled_at, t.status, f.threshold, t.finished_at
    )
    SELECT coalesce(array_agg(done.job_key), '{}'), coalesce(array_agg(done.scheduled_at), '{}'),
           coalesce(array_agg(done.status), '{}'), coalesce(array_agg(done.threshold), '{}'),
           coalesce(array_agg(done.finished_at), '{}')
      INTO v_keys, v_ticks, v_statuses, v_thresholds, v_finished
      FROM done;

    -- Failures grow the job's streak; exactly one makes it reach the threshold.
    FOR r IN
        SELECT * FROM unnest(v_keys, v_ticks, v_statuses, v_thresholds, v_finished)
                   AS d(key, tick, status, threshold, finished)
         WHERE d.status = 'failed' ORDER BY d.key
    LOOP
        INSERT INTO scheduler_jobs AS j
               (job_key, job_name, consecutive_failures, fail_alerted, tracked_since)
        SELECT r.key, t.job_name, 1, 1 >= r.threshold, now()
          FROM scheduler_ticks t WHERE t.job_key = r.key AND t.scheduled_at = r.tick
        ON CONFLICT ON CONSTRAINT scheduler_jobs_pkey DO UPDATE
           SET consecutive_failures = j.consecutive_failures + 1,
               fail_alerted = j.fail_alerted OR j.consecutive_failures + 1 >= r.threshold
        RETURNING j.consecutive_failures INTO consecutive_failures;
        RETURN QUERY SELECT r.key, r.tick, true, r.finished, consecutive_failures,
                            consecutive_failures = r.threshold, false;
    END LOOP;

    -- Successes end the streak (one recovery notice if it had alerted).
    RETURN QUERY
    WITH ok AS (
        SELECT * FROM unnest(v_keys, v_ticks, v_statuses, v_finished)
                   AS d(key, tick, status, finished)
         WHERE d.status <> 'failed'
    ), streaks AS (
        SELECT j.job_key, j.consecutive_failures AS ended, j.fail_alerted AS alerted
          FROM scheduler_jobs j
         WHERE j.job_key IN (SELECT ok.key FROM ok WHERE ok.status = 'succeeded')
           AND (j.consecutive_failures > 0 OR j.fail_alerted)
         ORDER BY j.job_key
           FOR UPDATE
    ), reset AS (
        UPDATE scheduler_jobs j SET consecutive_failures = 0, fail_alerted = false
          FROM streaks WHERE j.job_key = streaks.job_key
        RETURNING j.job_key
    )
    SELECT ok.key, ok.tick, true, ok.finished,
           CASE WHEN ok.status = 'succeeded' THEN coalesce(streaks.ended, 0) END,
           false, ok.status = 'succeeded' AND coalesce(streaks.alerted, false)
      FROM ok LEFT JOIN streaks ON streaks.job_key = ok.key;

    -- Runs whose row was no longer theirs (marked crashed while they ran).
    RETURN QUERY
    SELECT f.key, f.tick, false, NULL::timestamptz, NULL::integer, false, false
      FROM unnest(p_keys, p_ticks) AS f(key, tick)
     WHERE NOT EXISTS (SELECT 1 FROM unnest(v_keys, v_ticks) AS d(key, tick)
                        WHERE d.key = f.key AND d.tick = f.tick);

    -- Only now release the locks: the rows above are updated (and row-locked).
    PERFORM pg_advisory_unlock(p_namespace, u.key)
       FROM unnest(p_keys, p_unlocks) AS u(key, unlock)
      WHERE u.unlock
      ORDER BY u.key;
END;
$$;
