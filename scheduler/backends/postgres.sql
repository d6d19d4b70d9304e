-- The gate's two atomic steps on PostgreSQL, one round trip each per batch.
-- The tables come from scheduler/ledger.py; the story is told in scheduler/gate.py.
-- Both functions run on the replica's lock session: the advisory locks they
-- take and release are session-level and live as long as that session.

-- scheduler_claim: claim a batch of ticks.
--
-- For each tick, the primary key (job_key, scheduled_at) decides which replica
-- owns it: the first INSERT wins, every other replica gets `lost`. The owner
-- then tries the job's advisory lock (lock_namespace, key):
--   got it   -> `run`; any other `running` row of the job is stale (its
--               replica died or lost the lock, which freed the lock): `crashed`.
--   held     -> `skipped`: the previous run is still going. The fleet-wide
--               streak grows by one; exactly one skip makes it reach the
--               threshold, and that one reports `alert`.
-- A tick older than its grace (by the database clock, the same for every
-- replica) is recorded `missed` and never run.
CREATE OR REPLACE FUNCTION scheduler_claim(
    p_namespace  integer,
    p_instance   text,
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
    crashed           integer
) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    r record;
    v_alerted boolean;
BEGIN
    FOR r IN
        SELECT * FROM unnest(p_keys, p_names, p_ticks, p_intents, p_graces, p_thresholds)
            AS t(key, name, tick, intent, grace, threshold)
    LOOP
        job_key := r.key;
        scheduled_at := r.tick;
        outcome := NULL;
        run_id := NULL;
        started_at := NULL;
        holder := NULL;
        holder_since := NULL;
        consecutive_skips := NULL;
        alert := false;
        recovered := false;
        crashed := 0;

        IF r.intent = 'manual' THEN
            -- A manual run has a tick of its own ("now"): only the lock can stop it.
            IF NOT pg_try_advisory_lock(p_namespace, r.key) THEN
                SELECT t.instance, t.started_at INTO holder, holder_since
                  FROM scheduler_ticks t
                 WHERE t.job_key = r.key AND t.status = 'running'
                 ORDER BY t.scheduled_at DESC LIMIT 1;
                outcome := 'held';
                RETURN NEXT;
                CONTINUE;
            END IF;
            INSERT INTO scheduler_ticks AS t
                   (job_key, scheduled_at, job_name, status, instance, run_id, started_at, manual)
            VALUES (r.key, r.tick, r.name, 'running', p_instance,
                    nextval('scheduler_run_id'), now(), true)
            ON CONFLICT DO NOTHING
            RETURNING t.run_id, t.started_at INTO run_id, started_at;
            IF NOT FOUND THEN
                PERFORM pg_advisory_unlock(p_namespace, r.key);
                outcome := 'lost';
                RETURN NEXT;
                CONTINUE;
            END IF;
        ELSIF now() - r.tick > make_interval(secs => r.grace) THEN
            INSERT INTO scheduler_ticks AS t (job_key, scheduled_at, job_name, status, instance)
            VALUES (r.key, r.tick, r.name, 'missed', p_instance)
            ON CONFLICT DO NOTHING;
            outcome := CASE WHEN FOUND THEN 'missed' ELSE 'lost' END;
            RETURN NEXT;
            CONTINUE;
        ELSE
            -- The claim. run_id is drawn here so that the common path is one INSERT;
            -- a skipped tick gives its number back to nobody (gaps are harmless).
            INSERT INTO scheduler_ticks AS t
                   (job_key, scheduled_at, job_name, status, instance, run_id, started_at)
            VALUES (r.key, r.tick, r.name, 'running', p_instance,
                    nextval('scheduler_run_id'), now())
            ON CONFLICT DO NOTHING
            RETURNING t.run_id, t.started_at INTO run_id, started_at;
            IF NOT FOUND THEN
                outcome := 'lost';
                RETURN NEXT;
                CONTINUE;
            END IF;

            IF r.intent <> 'run' OR NOT pg_try_advisory_lock(p_namespace, r.key) THEN
                -- The previous run still holds the lock (on another replica, or on
                -- this one: intent 'skip', since advisory locks stack in a session).
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
                run_id := NULL;
                started_at := NULL;
                alert := consecutive_skips = r.threshold;
                outcome := 'skipped';
                RETURN NEXT;
                CONTINUE;
            END IF;
        END IF;

        -- This replica owns the tick and holds the lock: every other running row
        -- of the job belongs to a replica that died or lost the lock.
        UPDATE scheduler_ticks t
           SET status = 'crashed', finished_at = now(),
               error = coalesce(t.error, 'replica lost its lock before the run finished')
         WHERE t.job_key = r.key AND t.status = 'running' AND t.scheduled_at <> r.tick;
        GET DIAGNOSTICS crashed = ROW_COUNT;

        -- The job runs again: its skip streak ends (one recovery notice if it
        -- alerted). consecutive_skips reports the length of the streak it ends.
        consecutive_skips := 0;
        PERFORM 1 FROM scheduler_jobs j
          WHERE j.job_key = r.key AND (j.consecutive_skips > 0 OR j.skip_alerted);
        IF FOUND THEN
            SELECT j.skip_alerted, j.consecutive_skips INTO v_alerted, consecutive_skips
              FROM scheduler_jobs j WHERE j.job_key = r.key FOR UPDATE;
            UPDATE scheduler_jobs j SET consecutive_skips = 0, skip_alerted = false
             WHERE j.job_key = r.key;
            recovered := v_alerted;
        END IF;
        outcome := 'run';
        RETURN NEXT;
    END LOOP;
END;
$$;

-- scheduler_finish: record finished runs, then release their locks.
--
-- The update is conditional: only a row that is still `running` with this
-- run_id is ours. A stale run (its replica froze and lost the lock) finds its
-- row already `crashed` and changes nothing. The row is updated before the
-- lock is released, so a replica that takes the lock next and looks for stale
-- `running` rows waits for this transaction and then sees the final status.
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
    v_alerted boolean;
BEGIN
    FOR r IN
        SELECT * FROM unnest(p_keys, p_ticks, p_run_ids, p_statuses, p_errors, p_unlocks,
                             p_thresholds)
            AS t(key, tick, run_id, status, error, unlock, threshold)
    LOOP
        job_key := r.key;
        scheduled_at := r.tick;
        finished_at := NULL;
        consecutive_failures := NULL;
        alert := false;
        recovered := false;

        UPDATE scheduler_ticks t
           SET status = r.status, finished_at = now(), error = r.error
         WHERE t.job_key = r.key AND t.scheduled_at = r.tick
           AND t.run_id = r.run_id AND t.status = 'running'
        RETURNING t.finished_at INTO finished_at;
        recorded := FOUND;

        IF recorded AND r.status = 'failed' THEN
            INSERT INTO scheduler_jobs AS j
                   (job_key, job_name, consecutive_failures, fail_alerted, tracked_since)
            SELECT r.key, t.job_name, 1, 1 >= r.threshold, now()
              FROM scheduler_ticks t WHERE t.job_key = r.key AND t.scheduled_at = r.tick
            ON CONFLICT ON CONSTRAINT scheduler_jobs_pkey DO UPDATE
               SET consecutive_failures = j.consecutive_failures + 1,
                   fail_alerted = j.fail_alerted OR j.consecutive_failures + 1 >= r.threshold
            RETURNING j.consecutive_failures INTO consecutive_failures;
            alert := consecutive_failures = r.threshold;
        ELSIF recorded AND r.status = 'succeeded' THEN
            -- consecutive_failures reports the length of the streak this success ends.
            consecutive_failures := 0;
            PERFORM 1 FROM scheduler_jobs j
              WHERE j.job_key = r.key AND (j.consecutive_failures > 0 OR j.fail_alerted);
            IF FOUND THEN
                SELECT j.fail_alerted, j.consecutive_failures INTO v_alerted, consecutive_failures
                  FROM scheduler_jobs j WHERE j.job_key = r.key FOR UPDATE;
                UPDATE scheduler_jobs j SET consecutive_failures = 0, fail_alerted = false
                 WHERE j.job_key = r.key;
                recovered := v_alerted;
            END IF;
        END IF;

        IF r.unlock THEN
            PERFORM pg_advisory_unlock(p_namespace, r.key);
        END IF;
        RETURN NEXT;
    END LOOP;
END;
$$;
