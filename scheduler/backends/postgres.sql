-- The gate's two atomic steps on PostgreSQL, claim and finish: one round trip each per batch.
--
-- The protocol is told once, in docs/guarantees.md ("How a tick runs"). Each function
-- below is one named step of it; scheduler/backends/embedded.py has a method of the same
-- name for each step, so the two backends can be read side by side. The tables come from
-- scheduler/ledger.py. Both entry points run on the replica's lock session: the advisory
-- locks they take and release are session-level and live as long as that session.
--
-- Row locks, one global order. Every transaction that writes these tables takes its row
-- locks in this order, so claims, finishes, sweeps and start-ups never wait for one
-- another in a cycle (housekeeping takes rows of scheduler_maintenance before any):
--   1. new rows of scheduler_ticks (INSERT), in (scheduled_at, job_key) order;
--   2. existing rows of scheduler_ticks (UPDATE), in (scheduled_at, job_key) order;
--   3. rows of scheduler_registrations (start-up, reload and housekeeping only);
--   4. rows of scheduler_jobs, in job_key order;
--   5. scheduler_notices: only inserted here (delivery updates nothing else).
-- A transaction never takes a lock of an earlier class after one of a later class; the
-- housekeeping sweep marks crashed runs (2) and records missed ticks (1) in separate
-- transactions, and start-up updates each changed job row (3) in a transaction of its own.

-- Advisory locks of this fleet: key (0: a live replica's presence, shared), holder.
CREATE FUNCTION scheduler_locks(p_namespace integer)
RETURNS TABLE (key bigint, shared boolean, pid integer)
LANGUAGE sql STABLE AS $$
    SELECT l.objid::bigint, l.mode = 'ShareLock', l.pid
      FROM pg_locks l
     WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
       AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
       AND l.classid = (p_namespace::bigint & 4294967295)::oid
$$;

-- The lock invariant: a replica holds a job's lock only while it has a run or a claim of
-- that job in flight. This session's job locks other than `p_expected` (the jobs it runs)
-- are strays, left by a claim whose transaction failed (advisory locks outlive a
-- rollback) or by a reply that was lost: each is released, however many times it was
-- taken (advisory locks stack within a session), and its key returned.
CREATE FUNCTION scheduler_release_strays(p_namespace integer, p_expected integer[])
RETURNS SETOF integer LANGUAGE plpgsql AS $$
DECLARE
    k integer;
BEGIN
    FOR k IN SELECT l.key FROM scheduler_locks(p_namespace) l
              WHERE l.pid = pg_backend_pid() AND NOT l.shared
                AND l.key BETWEEN 1 AND 2147483647 AND NOT (l.key = ANY (p_expected))
              ORDER BY l.key
    LOOP
        WHILE EXISTS (SELECT 1 FROM scheduler_locks(p_namespace) l
                       WHERE l.pid = pg_backend_pid() AND l.key = k AND NOT l.shared) LOOP
            PERFORM pg_advisory_unlock(p_namespace, k);
        END LOOP;
        RETURN NEXT k;
    END LOOP;
END;
$$;

-- The live replicas (sessions holding the shared presence lock) and this one's rank.
CREATE FUNCTION scheduler_fleet(p_namespace integer, OUT live integer, OUT rank integer)
LANGUAGE plpgsql STABLE AS $$
BEGIN
    SELECT count(*)::integer, (count(*) FILTER (WHERE l.pid < pg_backend_pid()))::integer
      INTO live, rank
      FROM scheduler_locks(p_namespace) l
     WHERE l.key = 0 AND l.shared;
END;
$$;

-- Which live replica's share of a burst a job key falls in (Knuth's multiplicative hash).
-- The one home of the rule: the embedded backend has no shares (its claims take turns at
-- SQLite's one writer, so a burst spread over its replicas would gain nothing).
CREATE FUNCTION scheduler_share(p_key integer, p_live integer)
RETURNS integer LANGUAGE sql IMMUTABLE AS $$
    SELECT mod(mod(p_key::bigint * 2654435761, 4294967296), greatest(p_live, 1))::integer
$$;

-- Which of these ticks some replica has recorded: their places, 1-based. Each tick is its
-- job's key and its place among a few instants (a burst's ticks share one). Every replica
-- probes the other replicas' shares of each burst (scheduler/gate/others.py): at 100
-- replicas of 1,000 jobs, a lookup of the primary key per tick was most of the server's
-- work. The rows of those instants are read instead in one pass of their index and matched
-- by hash, less than half the work. The planner guesses a handful of ticks: a nested loop
-- would probe the key per tick again, and a merge join on the one instant would pair
-- every tick with every row.
CREATE FUNCTION scheduler_taken(p_keys integer[], p_at integer[], p_instants timestamptz[])
RETURNS integer[] LANGUAGE sql STABLE
SET enable_nestloop = off
SET enable_mergejoin = off
SET jit = off
AS $$
    SELECT coalesce(array_agg(q.place ORDER BY q.place), '{}')
      FROM unnest(p_keys, p_at) WITH ORDINALITY AS q(key, at, place)
      JOIN scheduler_ticks t ON t.job_key = q.key AND t.scheduled_at = p_instants[q.at]
     WHERE t.scheduled_at = ANY (p_instants)
$$;

-- A tick on its way through a claim; `fate` is what the claim has decided for it so far.
CREATE TYPE scheduler_tick AS (
    key          integer,
    name         text,
    tick         timestamptz,
    intent       text,
    threshold    integer,
    fate         text,   -- running, skipped, missed, paused: a row to insert; held, lost,
                         -- yielded, deferred: an answer without a row of this replica's
    run_id       bigint,
    started_at   timestamptz,
    holder       text,
    holder_since timestamptz,
    by_hand      boolean, -- skipped: the run holding the lock is one a person asked for
    fail_threshold integer -- the job's fail_alert_after (crashed runs count as failures)
);

-- Whose run holds a job now: its newest `running` row, other than rows this claim inserted
-- (a tick it lost is another replica's run), and whether a person asked for it (a run-now).
CREATE FUNCTION scheduler_holder(
    p_key integer, p_ticks scheduler_tick[], OUT instance text, OUT since timestamptz,
    OUT by_hand boolean
) LANGUAGE sql STABLE AS $$
    SELECT r.instance, r.started_at, r.manual FROM scheduler_ticks r
     WHERE r.job_key = p_key AND r.status = 'running'
       AND (r.job_key, r.scheduled_at) NOT IN (SELECT c.key, c.tick FROM unnest(p_ticks) c
                                                WHERE c.fate IN ('running', 'skipped'))
     ORDER BY r.scheduled_at DESC LIMIT 1
$$;

-- Step 1. Choose: a fate for every tick sent, before any row is written.
--   manual     -> running (its lock is taken first, below; a person asked, paused or not)
--   paused job -> paused (whatever the intent and however late: nobody is meant to run it)
--   skip       -> skipped (this replica still runs the job; late or not, it is recorded)
--   run, late  -> missed (past its grace by the database clock, the same for every replica)
--   catch_up   -> missed if past its grace (the job's catch_up_window), else running.
--   run        -> lost if a replica owns it already; yielded if it is another live
--                 replica's share of a burst and too young to be anyone's; else running,
--                 within p_capacity (this replica's free workers), oldest first, its own
--                 share first, then in the order sent; beyond: deferred, or yielded if
--                 another's share (its owner works through it: offered again shortly).
-- Running, skipped, missed and paused are rows to insert (step 3); lost, yielded and
-- deferred are answers already, kept apart from the steps below (scheduler_decide).
CREATE FUNCTION scheduler_choose(
    p_capacity integer, p_takeover double precision, p_live integer, p_rank integer,
    p_keys integer[], p_names text[], p_ticks timestamptz[], p_intents text[],
    p_graces double precision[], p_thresholds integer[], p_fail_thresholds integer[]
) RETURNS SETOF scheduler_tick LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH q AS (
        SELECT q.*, now() - q.tick > make_interval(secs => q.grace) AS late,
               p_live <= 1 OR scheduler_share(q.key, p_live) = p_rank AS own,
               now() - q.tick >= make_interval(secs => p_takeover) AS anyones,
               -- A probe of the primary key per tick (never a join the planner could
               -- turn into a scan of the whole ledger).
               EXISTS (SELECT 1 FROM scheduler_ticks t
                        WHERE t.job_key = q.key AND t.scheduled_at = q.tick) AS taken,
               q.intent <> 'manual'
                   AND EXISTS (SELECT 1 FROM scheduler_pauses p WHERE p.job_key = q.key) AS paused
          FROM unnest(p_keys, p_names, p_ticks, p_intents, p_graces, p_thresholds,
                      p_fail_thresholds) WITH ORDINALITY
               AS q(key, name, tick, intent, grace, threshold, fail_threshold, place)
    ), runs AS (  -- oldest first, then its own share, then in the order sent
        SELECT q.key, q.tick FROM q
         WHERE q.intent = 'run' AND NOT q.paused AND NOT q.late AND (q.own OR q.anyones)
           AND NOT q.taken
         ORDER BY q.tick, NOT q.own, q.place LIMIT p_capacity
    )
    SELECT q.key, q.name, q.tick, q.intent, q.threshold,
           CASE WHEN q.paused THEN 'paused'
                WHEN q.intent = 'skip' THEN 'skipped'
                WHEN q.intent = 'manual' THEN 'running'
                WHEN q.late THEN 'missed'
                WHEN q.intent = 'catch_up' THEN 'running'  -- its lock is taken first, below
                WHEN q.taken THEN 'lost'
                WHEN runs.key IS NOT NULL THEN 'running'
                WHEN NOT q.own THEN 'yielded'
                ELSE 'deferred' END,
           NULL::bigint, NULL::timestamptz, NULL::text, NULL::timestamptz, NULL::boolean,
           q.fail_threshold
      FROM q LEFT JOIN runs ON runs.key = q.key AND runs.tick = q.tick;
END;
$$;

-- Step 2. A manual run (`scheduler trigger`) has a tick of its own, "now": only the lock
-- can stop it, so the lock comes before its row. Not got: `held`, and no row. A tick
-- caught up after downtime (`catch_up: all`) takes the lock first too: while an older
-- one runs, a newer one waits (`held`) instead of being recorded skipped, so they run
-- once each, oldest first, whichever replicas take them.
CREATE FUNCTION scheduler_lock_manual(p_namespace integer, p_ticks scheduler_tick[])
RETURNS SETOF scheduler_tick LANGUAGE plpgsql AS $$
DECLARE
    t scheduler_tick;
BEGIN
    FOR t IN SELECT * FROM unnest(p_ticks) ORDER BY tick, key LOOP
        IF (t.intent = 'manual' OR (t.intent = 'catch_up' AND t.fate = 'running'))
           AND NOT pg_try_advisory_lock(p_namespace, t.key) THEN
            t.fate := 'held';
            SELECT h.instance, h.since INTO t.holder, t.holder_since
              FROM scheduler_holder(t.key, '{}') h;
        END IF;
        RETURN NEXT t;
    END LOOP;
END;
$$;

-- The lock a claim holds on a scheduled tick while it records it, until its transaction
-- ends: the fleet's namespace and a hash of the tick, in the one-key form of advisory
-- locks (the jobs' locks take the two-key form: scheduler_locks never sees these). Two
-- ticks that share a hash only make one claim leave its tick to be tried again.
CREATE FUNCTION scheduler_tick_lock(p_namespace integer, p_key integer, p_tick timestamptz)
RETURNS bigint LANGUAGE sql STABLE AS $$
    SELECT ((p_namespace::bigint & 4294967295) << 32)
         | (hashint8extended(p_key, (extract(epoch FROM p_tick) * 1000000)::bigint)
            & 4294967295)
$$;

-- Step 3. Insert: one INSERT for every tick with a row to insert, in the common order. The
-- primary key (job_key, scheduled_at) lets exactly one replica own a tick; a tick some
-- replica already owns is `lost` here. A claim never waits for another claim: an INSERT
-- that meets a row another transaction has inserted and not yet committed waits for
-- that transaction to end, and in a fleet short of CPU an owner and a helper claiming
-- the same tick made whole batches wait on each other's (40 replicas of 1,000 jobs on
-- 2 cores: 2.5 claims waiting on average, each 57 ms). A scheduled tick's lock
-- (scheduler_tick_lock) is tried first, whether the tick is to run or to be recorded
-- skipped; held, another claim is recording the tick now, and this one leaves it
-- `yielded`, to be tried again shortly: `lost` once that claim commits, its own if it
-- rolled back. Each lock takes an entry of the server's shared lock table until the
-- claim commits (max_locks_per_transaction x max_connections entries in all, 64 per
-- session by default; a full table fails every lock in the database), so a claim tries
-- at most p_tick_locks of them (scheduler_decide: 32, half a session's default share):
-- runs and skips, about as many as this replica's free workers and its jobs running,
-- never a burst's ticks recorded missed or paused. The rest insert as before.
CREATE FUNCTION scheduler_insert_ticks(
    p_namespace integer, p_instance text, p_ticks scheduler_tick[], p_tick_locks integer
) RETURNS SETOF scheduler_tick LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH contested AS (
        -- A scheduled tick to run or to record skipped: the ticks another claim may be
        -- recording now. A manual run or a caught-up tick holds its job's lock already
        -- (step 2): it waits as before, and gives the lock back if lost.
        SELECT c.*,
               c.intent IN ('run', 'skip') AND c.fate IN ('running', 'skipped') AS contested
          FROM unnest(p_ticks) c
    ), c AS (  -- referenced twice, so evaluated once: each lock is tried once
        SELECT c.*,
               CASE WHEN c.fate NOT IN ('running', 'skipped', 'missed', 'paused') THEN false
                    WHEN NOT c.contested OR c.nth > p_tick_locks THEN true
                    ELSE pg_try_advisory_xact_lock(
                        scheduler_tick_lock(p_namespace, c.key, c.tick)) END AS free
          FROM (SELECT c.*, count(*) FILTER (WHERE c.contested) OVER (ORDER BY c.tick, c.key)
                            AS nth
                  FROM contested c) c
    ), inserted AS (
        INSERT INTO scheduler_ticks AS r
               (job_key, scheduled_at, job_name, status, instance, run_id, started_at, manual,
                caught_up)
        SELECT c.key, c.tick, c.name, c.fate, p_instance,
               CASE WHEN c.fate = 'running' THEN nextval('scheduler_run_id') END,
               CASE WHEN c.fate = 'running' THEN clock_timestamp() END,
               c.intent = 'manual', c.intent = 'catch_up' AND c.fate = 'running'
          FROM c
         WHERE c.free
         ORDER BY c.tick, c.key
        ON CONFLICT DO NOTHING
        RETURNING r.job_key, r.scheduled_at, r.run_id, r.started_at
    )
    SELECT c.key, c.name, c.tick, c.intent, c.threshold,
           CASE WHEN i.job_key IS NOT NULL
                  OR c.fate NOT IN ('running', 'skipped', 'missed', 'paused') THEN c.fate
                WHEN NOT c.free THEN 'yielded'
                ELSE 'lost' END,
           i.run_id, i.started_at, c.holder, c.holder_since, c.by_hand, c.fail_threshold
      FROM c
      LEFT JOIN inserted i ON i.job_key = c.key AND i.scheduled_at = c.tick;
END;
$$;

-- Step 4. Lock or skip: the owner of a tick tries its job's lock, in the common order.
-- Got it: the run starts. Held: the previous run is still going, the tick is `skipped`.
-- Intent `skip` never gets here: advisory locks stack within a session, so the replica
-- that runs the job must never ask for its lock again. A manual run or a caught-up tick
-- that took its lock first (step 2) and lost its row gives the lock back.
CREATE FUNCTION scheduler_take_locks(p_namespace integer, p_ticks scheduler_tick[])
RETURNS SETOF scheduler_tick LANGUAGE plpgsql AS $$
DECLARE
    t scheduler_tick;
BEGIN
    FOR t IN SELECT * FROM unnest(p_ticks) ORDER BY tick, key LOOP
        IF t.fate = 'running' AND t.intent = 'run'
           AND NOT pg_try_advisory_lock(p_namespace, t.key) THEN
            t.fate := 'skipped';
        ELSIF t.fate = 'lost' AND t.intent IN ('manual', 'catch_up') THEN
            PERFORM pg_advisory_unlock(p_namespace, t.key);
        END IF;
        RETURN NEXT t;
    END LOOP;
END;
$$;

-- Step 4b. Pauses, again. Each statement sees what was committed before it began, so a
-- pause committed while this claim waited (on a row another claim had inserted, on a
-- row lock) was not seen by step 1; it was acknowledged to whoever paused, so the tick
-- must not start. A tick of a paused job about to start (not a manual run: a person
-- asked) is recorded paused instead, and the lock it took is given back. If the claim
-- waited at all, its runs' start is stamped now, after the wait. (The embedded backend
-- needs no such step: its claim is one writer's transaction from its first read.)
CREATE FUNCTION scheduler_recheck_pauses(p_namespace integer, p_ticks scheduler_tick[])
RETURNS SETOF scheduler_tick LANGUAGE plpgsql AS $$
DECLARE
    t scheduler_tick;
    v_paused integer[];
    v_now timestamptz := clock_timestamp();
    v_waited boolean := clock_timestamp() - statement_timestamp() > interval '100 ms';
BEGIN
    v_paused := ARRAY(SELECT c.key FROM unnest(p_ticks) c
                       WHERE c.fate = 'running' AND c.intent IN ('run', 'catch_up')
                         AND EXISTS (SELECT 1 FROM scheduler_pauses p WHERE p.job_key = c.key));
    IF cardinality(v_paused) = 0 AND NOT v_waited THEN
        RETURN QUERY SELECT * FROM unnest(p_ticks);
        RETURN;
    END IF;
    FOR t IN SELECT * FROM unnest(p_ticks) ORDER BY tick, key LOOP
        IF t.fate = 'running' AND t.key = ANY (v_paused) AND t.intent IN ('run', 'catch_up') THEN
            UPDATE scheduler_ticks r SET status = 'paused', run_id = NULL, started_at = NULL,
                   caught_up = false
             WHERE r.job_key = t.key AND r.scheduled_at = t.tick;
            PERFORM pg_advisory_unlock(p_namespace, t.key);
            t.fate := 'paused'; t.run_id := NULL; t.started_at := NULL;
        ELSIF t.fate = 'running' AND v_waited THEN
            UPDATE scheduler_ticks r SET started_at = v_now
             WHERE r.job_key = t.key AND r.scheduled_at = t.tick;
            t.started_at := v_now;
        END IF;
        RETURN NEXT t;
    END LOOP;
END;
$$;

-- A run that no worker took within its lease (gate/ahead.py), asked again before it starts:
-- given back (a reload took its job away: the row goes, and the tick is anyone's again);
-- if its job was paused since its claim, a scheduled or caught-up tick is recorded
-- `paused` and a retry waits again for the resume, as it was before its claim (a run a
-- person asked for, `asked`, goes paused or not); else its start is stamped now. Only a
-- row still this run's counts: otherwise `lost`. A run that will not start gives its
-- lock back, as the last thing the call does.
CREATE FUNCTION scheduler_recheck(
    p_namespace integer, p_keys integer[], p_ticks timestamptz[], p_run_ids bigint[],
    p_give_back boolean[], p_kinds text[]
) RETURNS TABLE (outcomes text[]) LANGUAGE plpgsql AS $$
DECLARE
    r record;
    v_outcome text;
    v_unlock integer[] := '{}';
BEGIN
    outcomes := '{}';
    FOR r IN SELECT q.key, q.tick, q.run_id, q.give_back, q.kind,
                    q.kind <> 'asked' AND EXISTS (
                        SELECT 1 FROM scheduler_pauses p WHERE p.job_key = q.key) AS paused
               FROM unnest(p_keys, p_ticks, p_run_ids, p_give_back, p_kinds) WITH ORDINALITY
                    AS q(key, tick, run_id, give_back, kind, place)
              ORDER BY q.place LOOP
        v_outcome := CASE WHEN r.give_back THEN 'lost' WHEN r.paused THEN 'paused' ELSE 'run' END;
        IF r.give_back THEN
            DELETE FROM scheduler_ticks t
             WHERE t.job_key = r.key AND t.scheduled_at = r.tick AND t.run_id = r.run_id
               AND t.status = 'running';
        ELSIF r.paused AND r.kind = 'retry' THEN
            UPDATE scheduler_ticks t
               SET status = a.status, attempt = a.attempt, instance = a.instance,
                   run_id = a.run_id, started_at = a.started_at, finished_at = a.finished_at,
                   duration_s = a.duration_s, error = a.error, told = a.told,
                   retry_at = clock_timestamp()
              FROM scheduler_attempts a
             WHERE t.job_key = r.key AND t.scheduled_at = r.tick AND t.run_id = r.run_id
               AND t.status = 'running' AND a.job_key = t.job_key
               AND a.scheduled_at = t.scheduled_at AND a.attempt = t.attempt - 1;
        ELSIF r.paused THEN
            UPDATE scheduler_ticks t SET status = 'paused', run_id = NULL, started_at = NULL,
                   caught_up = false
             WHERE t.job_key = r.key AND t.scheduled_at = r.tick AND t.run_id = r.run_id
               AND t.status = 'running';
        ELSE
            UPDATE scheduler_ticks t SET started_at = clock_timestamp()
             WHERE t.job_key = r.key AND t.scheduled_at = r.tick AND t.run_id = r.run_id
               AND t.status = 'running';
        END IF;
        IF NOT FOUND THEN
            v_outcome := 'lost';
        END IF;
        outcomes := outcomes || v_outcome;
        IF v_outcome <> 'run' THEN
            v_unlock := v_unlock || r.key;
        END IF;
    END LOOP;
    PERFORM pg_advisory_unlock(p_namespace, k) FROM unnest(v_unlock) k;
    RETURN NEXT;
END;
$$;

-- Step 5. Record skips: each skipped tick's row says whose run held the lock. A tick
-- skipped because a run a person asked for (run-now) was still going is recorded so too,
-- but is not the job overrunning its schedule: it counts in no skip streak (step 7).
CREATE FUNCTION scheduler_record_skips(p_ticks scheduler_tick[])
RETURNS SETOF scheduler_tick LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH skipped AS (
        SELECT s.* FROM unnest(p_ticks) s WHERE s.fate = 'skipped'
    ), holders AS (
        SELECT DISTINCT s.key AS job_key, h.instance, h.since AS started_at, h.by_hand
          FROM skipped s, LATERAL scheduler_holder(s.key, p_ticks) h
    ), updated AS (
        UPDATE scheduler_ticks r
           SET status = 'skipped', run_id = NULL, started_at = NULL, holder = h.instance
          FROM skipped s LEFT JOIN holders h ON h.job_key = s.key
         WHERE r.job_key = s.key AND r.scheduled_at = s.tick
           AND r.job_key = ANY (ARRAY(SELECT skipped.key FROM skipped))
           AND r.scheduled_at = ANY (ARRAY(SELECT skipped.tick FROM skipped))
        RETURNING r.job_key, r.scheduled_at, h.instance, h.started_at, h.by_hand
    )
    SELECT c.key, c.name, c.tick, c.intent, c.threshold, c.fate,
           CASE WHEN c.fate = 'skipped' THEN NULL ELSE c.run_id END,
           CASE WHEN c.fate = 'skipped' THEN NULL ELSE c.started_at END,
           u.instance, u.started_at, coalesce(u.by_hand, false), c.fail_threshold
      FROM unnest(p_ticks) c
      LEFT JOIN updated u ON u.job_key = c.key AND u.scheduled_at = c.tick;
END;
$$;

-- Step 6. Crash stale runs: this replica now holds the locks of the jobs it starts, so any
-- other `running` row of those jobs belongs to a replica that died or lost the lock. They
-- count as failures (scheduler_count_crashes), once the claim's job rows are locked.
-- The rows are looked up by the runs' keys, and found again by where they lie: with
-- nested loops off (scheduler_decide), a join would read the whole index of running
-- rows, and every entry a finished run left in it until a vacuum, in each claim (40
-- replicas of 1,000 jobs: 20 ms a claim, the most of any step).
CREATE FUNCTION scheduler_crash_stale(p_ticks scheduler_tick[], p_message text)
RETURNS TABLE (key integer, crashed integer, newest timestamptz, name text,
               fail_threshold integer) LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH runs AS (
        SELECT c.key, c.tick, c.name, c.fail_threshold FROM unnest(p_ticks) c
         WHERE c.fate = 'running'
    ), stale AS (
        SELECT r.ctid AS row_id
          FROM scheduler_ticks r
         WHERE r.job_key = ANY (ARRAY(SELECT runs.key FROM runs)) AND r.status = 'running'
           AND EXISTS (SELECT 1 FROM runs
                        WHERE runs.key = r.job_key AND runs.tick <> r.scheduled_at)
         ORDER BY r.scheduled_at, r.job_key
           FOR UPDATE OF r
    ), marked AS (
        -- Each row locked above, found again by where it lies (ctid; locked, it stays
        -- there): a join by key could take the index of instants, and read every row of
        -- a burst's second for each.
        UPDATE scheduler_ticks r
           SET status = 'crashed', finished_at = clock_timestamp(),
               error = coalesce(r.error, p_message)
         WHERE r.ctid = ANY (ARRAY(SELECT stale.row_id FROM stale)) AND r.status = 'running'
           AND r.job_key = ANY (ARRAY(SELECT runs.key FROM runs))  -- not the whole index
        RETURNING r.job_key, r.scheduled_at
    )
    SELECT m.job_key, count(*)::integer, max(m.scheduled_at), min(runs.name),
           min(runs.fail_threshold)
      FROM marked m JOIN runs ON runs.key = m.job_key GROUP BY m.job_key;
END;
$$;

-- Crashed runs end their ticks as failures do (a job whose replica is OOM-killed in every
-- run must alert): each grows its job's failure streak, which alerts once when it first
-- reaches the threshold in force; the notice says the runs crashed. Every path that
-- records `crashed` counts them here: a claim or a retry look that finds a dead replica's
-- run (step 6) and the housekeeping sweep; a finish that records a run abandoned at
-- shutdown counts it in scheduler_finish_streaks. Rows of scheduler_jobs in key order.
CREATE FUNCTION scheduler_count_crashes(
    p_instance text, p_keys integer[], p_names text[], p_counts integer[],
    p_ticks timestamptz[], p_thresholds integer[]
) RETURNS TABLE (key integer, failures integer, notice bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    INSERT INTO scheduler_jobs (job_key, job_name, tracked_since)
    SELECT c.key, c.name, now() FROM unnest(p_keys, p_names) AS c(key, name)
     ORDER BY c.key
    ON CONFLICT DO NOTHING;
    RETURN QUERY
    WITH c AS (
        SELECT * FROM unnest(p_keys, p_counts, p_ticks, p_thresholds)
                   AS c(key, n, tick, threshold)
    ), locked AS (
        SELECT j.job_key, j.job_name, j.consecutive_failures, j.fail_alerted
          FROM scheduler_jobs j JOIN c ON c.key = j.job_key
         ORDER BY j.job_key
           FOR UPDATE OF j
    ), updated AS (
        UPDATE scheduler_jobs j
           SET consecutive_failures = l.consecutive_failures + c.n,
               fail_alerted = l.fail_alerted OR l.consecutive_failures + c.n >= c.threshold
          FROM locked l JOIN c ON c.key = l.job_key
         WHERE j.job_key = l.job_key
        RETURNING j.job_key, l.job_name, c.n, c.tick, c.threshold,
                  j.consecutive_failures AS failures,
                  NOT l.fail_alerted AND j.fail_alerted AS alerting
    ), alerts AS (
        INSERT INTO scheduler_notices
               (event, job_key, job_name, scheduled_at, facts, raised_by, raised_at,
                lease_by, lease_until, next_attempt_at)
        SELECT 'job.failures_exceeded', u.job_key, u.job_name, u.tick,
               json_build_object(
                   'consecutive_failures', u.failures, 'threshold', u.threshold,
                   'instance', p_instance, 'crashed', u.n)::text,
               p_instance, now(), p_instance, now() + interval '30 seconds', now()
          FROM updated u
         WHERE u.alerting
        RETURNING id, scheduler_notices.job_key
    )
    SELECT u.job_key, u.failures, a.id FROM updated u LEFT JOIN alerts a ON a.job_key = u.job_key;
END;
$$;

-- Step 7. Skip streaks, one pass over the jobs' rows in key order. A run ends its job's
-- streak of skipped ticks; skips grow it. A streak alerts once, when it first reaches the
-- threshold in force (whatever the threshold was before), and the alert stays raised until
-- a run keeps up again (see scheduler_finish_streaks): then one recovery notice.
CREATE FUNCTION scheduler_skip_streaks(p_instance text, p_ticks scheduler_tick[])
RETURNS TABLE (key integer, tick timestamptz, streak integer, alert boolean, notice bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    INSERT INTO scheduler_jobs (job_key, job_name, tracked_since)
    SELECT c.key, min(c.name), now() FROM unnest(p_ticks) c
     WHERE c.fate = 'skipped' AND NOT c.by_hand GROUP BY c.key ORDER BY c.key
    ON CONFLICT DO NOTHING;
    RETURN QUERY
    WITH per_job AS (
        SELECT c.key, bool_or(c.fate = 'running') AS ran,
               count(*) FILTER (WHERE c.fate = 'skipped')::integer AS skips,
               min(c.threshold) AS threshold
          FROM unnest(p_ticks) c
         WHERE c.fate = 'running' OR (c.fate = 'skipped' AND NOT c.by_hand) GROUP BY c.key
    ), locked AS (
        SELECT j.job_key, j.job_name, j.consecutive_skips, j.skip_alerted
          FROM scheduler_jobs j JOIN per_job p ON p.key = j.job_key
         WHERE p.skips > 0 OR j.consecutive_skips > 0
         ORDER BY j.job_key
           FOR UPDATE OF j
    ), updated AS (
        UPDATE scheduler_jobs j
           SET consecutive_skips = CASE WHEN p.ran THEN 0 ELSE l.consecutive_skips + p.skips END,
               overrun_skips = j.overrun_skips + p.skips,
               skip_alerted = j.skip_alerted
                   OR (NOT p.ran AND l.consecutive_skips + p.skips >= p.threshold)
          FROM locked l JOIN per_job p ON p.key = l.job_key
         WHERE j.job_key = l.job_key
        RETURNING j.job_key, l.job_name, l.consecutive_skips AS before, p.threshold,
                  NOT l.skip_alerted AND j.skip_alerted AS alerting
    ), skips AS (
        SELECT c.key, c.tick, c.holder, c.holder_since, u.before + row_number()
                   OVER (PARTITION BY c.key ORDER BY c.tick) AS streak, u.*
          FROM unnest(p_ticks) c JOIN updated u ON u.job_key = c.key
         WHERE c.fate = 'skipped' AND NOT c.by_hand
    ), alerts AS (
        INSERT INTO scheduler_notices
               (event, job_key, job_name, scheduled_at, facts, raised_by, raised_at,
                lease_by, lease_until, next_attempt_at)
        SELECT 'job.skips_exceeded', s.key, s.job_name, s.tick,
               json_build_object(
                   'consecutive_skips', s.streak, 'threshold', s.threshold,
                   'holder', s.holder, 'holder_since', s.holder_since,
                   'running_s', extract(epoch FROM now() - s.holder_since))::text,
               p_instance, now(), p_instance, now() + interval '30 seconds', now()
          FROM skips s
         WHERE s.alerting AND s.streak = greatest(s.before + 1, s.threshold)
        RETURNING id, scheduler_notices.job_key, scheduler_notices.scheduled_at
    )
    SELECT s.key, s.tick, s.streak::integer, a.id IS NOT NULL, a.id
      FROM skips s LEFT JOIN alerts a ON a.job_key = s.key AND a.scheduled_at = s.tick
    UNION ALL
    SELECT u.job_key, NULL, u.before, false, NULL FROM updated u
     WHERE u.job_key IN (SELECT c.key FROM unnest(p_ticks) c WHERE c.fate = 'running');
END;
$$;

-- Steps 6 and 7, on the jobs' rows: stale runs crashed and counted as failures, then the
-- skip streaks. The rows of scheduler_jobs both touch are made and locked once, in key
-- order (two passes could cross another claim's). One row per tick that runs or was
-- skipped, with what its answer carries: a skip's streak and alert; a run's streak it
-- ends, the stale runs it crashed and the alert they raised.
CREATE FUNCTION scheduler_settle_jobs(p_instance text, p_crashed text, p_ticks scheduler_tick[])
RETURNS TABLE (key integer, tick timestamptz, streak integer, alert boolean, crashed integer,
               notice bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_stale_keys integer[];
    v_stale_counts integer[];
    v_stale_ticks timestamptz[];
    v_stale_names text[];
    v_stale_thresholds integer[];
    v_crash_keys integer[];
    v_crash_notices bigint[];
BEGIN
    IF NOT EXISTS (SELECT 1 FROM unnest(p_ticks) c WHERE c.fate IN ('running', 'skipped')) THEN
        RETURN;
    END IF;
    SELECT array_agg(s.key), array_agg(s.crashed), array_agg(s.newest), array_agg(s.name),
           array_agg(s.fail_threshold)
      INTO v_stale_keys, v_stale_counts, v_stale_ticks, v_stale_names, v_stale_thresholds
      FROM scheduler_crash_stale(p_ticks, p_crashed) s;
    IF v_stale_keys IS NOT NULL THEN
        INSERT INTO scheduler_jobs (job_key, job_name, tracked_since)
        SELECT c.key, min(c.name), now() FROM unnest(p_ticks) c
         WHERE c.fate IN ('running', 'skipped') GROUP BY c.key ORDER BY c.key
        ON CONFLICT DO NOTHING;
        PERFORM 1 FROM scheduler_jobs j
          WHERE j.job_key IN (SELECT c.key FROM unnest(p_ticks) c
                               WHERE c.fate IN ('running', 'skipped'))
          ORDER BY j.job_key FOR UPDATE;
        SELECT array_agg(x.key), array_agg(x.notice) INTO v_crash_keys, v_crash_notices
          FROM scheduler_count_crashes(p_instance, v_stale_keys, v_stale_names, v_stale_counts,
                                       v_stale_ticks, v_stale_thresholds) x;
    END IF;
    RETURN QUERY
    WITH streaks AS (
        SELECT * FROM scheduler_skip_streaks(p_instance, p_ticks)
    ), stale AS (
        SELECT * FROM unnest(v_stale_keys, v_stale_counts) AS s(key, crashed)
    ), crashes AS (
        SELECT * FROM unnest(v_crash_keys, v_crash_notices) AS s(key, notice)
    )
    SELECT c.key, c.tick, coalesce(sk.streak, ended.streak, 0), coalesce(sk.alert, false),
           coalesce(st.crashed, 0), coalesce(sk.notice, cr.notice)
      FROM unnest(p_ticks) c
      LEFT JOIN streaks sk ON sk.key = c.key AND sk.tick = c.tick
      LEFT JOIN streaks ended ON ended.key = c.key AND ended.tick IS NULL AND c.fate = 'running'
      LEFT JOIN stale st ON st.key = c.key AND c.fate = 'running'
      LEFT JOIN crashes cr ON cr.key = c.key AND c.fate = 'running'
     WHERE c.fate IN ('running', 'skipped');
END;
$$;

-- scheduler_decide: claim a batch of ticks, the steps above in order, and answer every
-- tick sent, in one row. First, column by column, each tick this replica recorded (run,
-- skipped, missed, paused) or could not lock (held: a manual run, a tick caught up),
-- with what its answer carries. Then the rest, by outcome, as spans of the ticks' places
-- in the arrays sent (1-based; `_from`: a span's first place, `_counts`: its length):
-- lost (another replica owns it), yielded (another live replica's share of a burst: try
-- again shortly, after this replica's own) and deferred (this replica's, beyond its free
-- workers: try again when one frees). Sent oldest first, its own share first, the deferred
-- ticks are a few spans, so the answer stays small however large the burst: about 100
-- bytes per tick recorded, and the socket buffers hold it while a frozen replica reads
-- nothing. Bursts smaller than p_share_from ticks are not shared out.
CREATE FUNCTION scheduler_decide(
    p_namespace integer, p_instance text, p_capacity integer, p_takeover double precision,
    p_share_from integer, p_crashed text, p_keys integer[], p_names text[],
    p_ticks timestamptz[], p_intents text[], p_graces double precision[],
    p_thresholds integer[], p_fail_thresholds integer[]
) RETURNS TABLE (
    keys integer[], ticks timestamptz[], outcomes text[], run_ids bigint[],
    started_at timestamptz[], holders text[], holder_since timestamptz[], streaks integer[],
    alerts boolean[], crashed integer[], notices bigint[], lost_from integer[],
    lost_counts integer[], yielded_from integer[], yielded_counts integer[],
    deferred_from integer[], deferred_counts integer[]
) LANGUAGE plpgsql
-- The planner cannot know how many ticks a call carries and guesses a handful;
-- its nested loops over them would make a burst of n ticks cost n^2. The cost of a
-- nested loop left (joining one-row answers) then reads as huge: no JIT compilation,
-- which would cost a second or more on every claim.
SET enable_nestloop = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_fleet record;
    v_ticks scheduler_tick[];
    v_left scheduler_tick[];
BEGIN
    -- The fleet's shape only for a batch the server shares out (a smaller one is
    -- everyone's, as in a fleet of one): reading it (pg_locks, every session's locks)
    -- took 100 replicas' claims more than the rest of their work.
    IF cardinality(p_keys) >= p_share_from THEN
        SELECT * INTO v_fleet FROM scheduler_fleet(p_namespace);
    ELSE
        SELECT 1 AS live, 0 AS rank INTO v_fleet;
    END IF;
    v_ticks := ARRAY(SELECT c FROM scheduler_choose(
        p_capacity, p_takeover, v_fleet.live, v_fleet.rank,
        p_keys, p_names, p_ticks, p_intents, p_graces, p_thresholds, p_fail_thresholds) c);
    -- Lost, yielded and deferred ticks are answers already: the steps below take only the
    -- rest, so that a claim of a few runs out of a large burst costs a few runs.
    v_left := ARRAY(SELECT c FROM unnest(v_ticks) c
                     WHERE c.fate IN ('lost', 'yielded', 'deferred'));
    v_ticks := ARRAY(SELECT c FROM unnest(v_ticks) c
                      WHERE c.fate NOT IN ('lost', 'yielded', 'deferred'));
    v_ticks := ARRAY(SELECT c FROM scheduler_lock_manual(p_namespace, v_ticks) c);
    v_ticks := ARRAY(SELECT c FROM scheduler_insert_ticks(  -- 32 tick locks at most
        p_namespace, p_instance, v_ticks, 32) c);
    v_ticks := ARRAY(SELECT c FROM scheduler_take_locks(p_namespace, v_ticks) c);
    v_ticks := ARRAY(SELECT c FROM scheduler_recheck_pauses(p_namespace, v_ticks) c);
    IF EXISTS (SELECT 1 FROM unnest(v_ticks) c WHERE c.fate = 'skipped') THEN
        v_ticks := ARRAY(SELECT c FROM scheduler_record_skips(v_ticks) c);
    END IF;
    RETURN QUERY
    WITH settled AS (
        SELECT * FROM scheduler_settle_jobs(p_instance, p_crashed, v_ticks)
    ), a AS (
        SELECT c.*, s.streak, s.alert, s.crashed, s.notice
          FROM unnest(v_ticks) c LEFT JOIN settled s ON s.key = c.key AND s.tick = c.tick
         WHERE c.fate NOT IN ('lost', 'yielded', 'deferred')
    ), spans AS (  -- places in a row with one outcome: the same place minus rank
        SELECT q.fate, min(q.place)::integer AS first, count(*)::integer AS n
          FROM (SELECT c.fate, q.place,
                       q.place - row_number() OVER (PARTITION BY c.fate ORDER BY q.place) AS span
                  FROM unnest(v_ticks || v_left) c
                  JOIN unnest(p_keys, p_ticks) WITH ORDINALITY AS q(key, tick, place)
                    ON q.key = c.key AND q.tick = c.tick
                 WHERE c.fate IN ('lost', 'yielded', 'deferred')) q
         GROUP BY q.fate, q.span
    )
    SELECT r.*, l.*, y.*, d.*
      FROM (SELECT array_agg(a.key), array_agg(a.tick),
                   array_agg(CASE a.fate WHEN 'running' THEN 'run' ELSE a.fate END),
                   array_agg(a.run_id), array_agg(a.started_at), array_agg(a.holder),
                   array_agg(a.holder_since), array_agg(coalesce(a.streak, 0)),
                   array_agg(coalesce(a.alert, false)), array_agg(coalesce(a.crashed, 0)),
                   array_agg(a.notice)
              FROM a) r,
           (SELECT array_agg(s.first ORDER BY s.first), array_agg(s.n ORDER BY s.first)
              FROM spans s WHERE s.fate = 'lost') l,
           (SELECT array_agg(s.first ORDER BY s.first), array_agg(s.n ORDER BY s.first)
              FROM spans s WHERE s.fate = 'yielded') y,
           (SELECT array_agg(s.first ORDER BY s.first), array_agg(s.n ORDER BY s.first)
              FROM spans s WHERE s.fate = 'deferred') d;
END;
$$;

-- scheduler_claim: scheduler_decide for the replicas of earlier versions, which go on
-- claiming through a rolling deploy (docs/operating.md), in the answer they read: a row
-- per tick answered (yielded ones too; lost ones only if manual or caught up: the rest
-- they read as lost), then one `fleet` row: the fleet's size, from which they leave
-- other replicas' shares out of their next batch, and where deferral began (they read
-- each tick after (deferred_after, deferred_key) as deferred). Drop it once no replica
-- of a version before 10 can be running.
CREATE FUNCTION scheduler_claim(
    p_namespace integer, p_instance text, p_capacity integer, p_takeover double precision,
    p_share_from integer, p_crashed text, p_keys integer[], p_names text[],
    p_ticks timestamptz[], p_intents text[], p_graces double precision[],
    p_thresholds integer[],
    -- Callers of a version before pauses do not know the outcome `paused`: their paused
    -- ticks are left out of the answer, which they read as lost.
    p_answer_paused boolean DEFAULT false,
    -- Each job's fail_alert_after (crashed runs count as failures); older callers: 3.
    p_fail_thresholds integer[] DEFAULT NULL
) RETURNS TABLE (
    job_key integer, scheduled_at timestamptz, outcome text, run_id bigint,
    started_at timestamptz, holder text, holder_since timestamptz, streak integer,
    alert boolean, notice bigint, crashed integer, live integer, rank integer,
    db_now timestamptz, deferred_after timestamptz, deferred_key integer
) LANGUAGE plpgsql
-- The answer's plan is costed over a set-returning function's guessed rows: never worth
-- compiling (JIT would make every claim of an older replica a second late, and lose).
SET jit = off
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH d AS (
        SELECT * FROM scheduler_decide(p_namespace, p_instance, p_capacity, p_takeover,
            p_share_from, p_crashed, p_keys, p_names, p_ticks, p_intents, p_graces,
            p_thresholds, coalesce(p_fail_thresholds, array_fill(3, ARRAY[cardinality(p_keys)])))
    ), rest AS (  -- each span's places, one by one
        SELECT o.outcome, i AS place
          FROM d, LATERAL (VALUES ('lost', d.lost_from, d.lost_counts),
                                  ('yielded', d.yielded_from, d.yielded_counts),
                                  ('deferred', d.deferred_from, d.deferred_counts))
                          AS o(outcome, starts, counts),
               unnest(o.starts, o.counts) AS s(first, n),
               generate_series(s.first, s.first + s.n - 1) AS i
    )
    SELECT a.*, NULL::integer, NULL::integer, NULL::timestamptz, NULL::timestamptz,
           NULL::integer
      FROM d, unnest(d.keys, d.ticks, d.outcomes, d.run_ids, d.started_at, d.holders,
                     d.holder_since, d.streaks, d.alerts, d.notices, d.crashed)
              AS a(key, tick, outcome, run_id, started, holder, since, streak, alert, notice,
                   crashed)
     WHERE a.outcome <> 'paused' OR p_answer_paused
    UNION ALL
    SELECT p_keys[r.place], p_ticks[r.place], r.outcome, NULL, NULL, NULL, NULL, 0, false,
           NULL, 0, NULL, NULL, NULL, NULL, NULL
      FROM rest r
     WHERE r.outcome = 'yielded'
        OR (r.outcome = 'lost' AND p_intents[r.place] IN ('manual', 'catch_up'))
    UNION ALL
    SELECT NULL, NULL, 'fleet', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, f.live, f.rank,
           now(), p_ticks[first.place], p_keys[first.place] - 1  -- from the first deferred on
      FROM scheduler_fleet(p_namespace) f
      LEFT JOIN (SELECT r.place FROM rest r WHERE r.outcome = 'deferred'
                  ORDER BY p_ticks[r.place], p_keys[r.place] LIMIT 1) first ON true;
END;
$$;

-- Retries (job `retries`): a failed tick whose next attempt is due is taken like a
-- manual run, lock first. The replica that gets the job's lock copies the failed attempt
-- to scheduler_attempts and starts the next one on the tick's own row (a new run_id); a
-- lock held elsewhere leaves the tick waiting, which is no skip. SKIP LOCKED and the
-- status check make each attempt one replica's. One attempt per job per call: advisory
-- locks stack within a session, so a job's lock is never asked for twice.
--
-- scheduler_start_retry: one due attempt, its job's lock in hand. No row if a pause was
-- committed while the copy waited on a row: it was acknowledged, so the lock goes back.
CREATE FUNCTION scheduler_start_retry(
    p_namespace integer, p_instance text, p_key integer, p_tick timestamptz
) RETURNS TABLE (run_id bigint, started_at timestamptz, attempt integer)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    INSERT INTO scheduler_attempts AS a
           (job_key, scheduled_at, attempt, instance, run_id, status, started_at,
            finished_at, duration_s, error, told)
    SELECT t.job_key, t.scheduled_at, t.attempt, t.instance, t.run_id, 'failed',
           t.started_at, t.finished_at, t.duration_s, t.error, t.told
      FROM scheduler_ticks t
     WHERE t.job_key = p_key AND t.scheduled_at = p_tick
    ON CONFLICT DO NOTHING;
    IF EXISTS (SELECT 1 FROM scheduler_pauses p WHERE p.job_key = p_key) THEN
        PERFORM pg_advisory_unlock(p_namespace, p_key);
        RETURN;
    END IF;
    RETURN QUERY
    UPDATE scheduler_ticks t
       SET status = 'running', attempt = t.attempt + 1, instance = p_instance,
           run_id = nextval('scheduler_run_id'), started_at = clock_timestamp(),
           finished_at = NULL, duration_s = NULL, error = NULL, told = NULL,
           retry_at = NULL, holder = NULL
     WHERE t.job_key = p_key AND t.scheduled_at = p_tick
    RETURNING t.run_id, t.started_at, t.attempt;
END;
$$;

-- scheduler_start_retries: the due retries of these jobs started, oldest tick first, at
-- most p_capacity, answered in one row: the attempts started, column by column, with the
-- stale runs each found (step 6), and in how many seconds the next retry of these jobs
-- is due. Stale runs count as failures once every attempt is started (job rows come
-- after tick rows), at p_fail_thresholds, the jobs' fail_alert_after.
CREATE FUNCTION scheduler_start_retries(
    p_namespace integer, p_instance text, p_keys integer[], p_capacity integer,
    p_crashed text, p_fail_thresholds integer[]
) RETURNS TABLE (
    keys integer[], ticks timestamptz[], run_ids bigint[], started_at timestamptz[],
    attempts integer[], crashed integer[], next_in double precision
) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    r record;
    v_run record;
    v_runs scheduler_tick[] := '{}';
    v_stale record;
BEGIN
    keys := '{}'; ticks := '{}'; run_ids := '{}'; started_at := '{}'; attempts := '{}';
    crashed := '{}';
    FOR r IN SELECT t.job_key, t.scheduled_at, t.job_name FROM scheduler_ticks t
              WHERE t.retry_at <= now() AND t.status = 'failed' AND t.job_key = ANY (p_keys)
                AND NOT EXISTS (SELECT 1 FROM scheduler_pauses p WHERE p.job_key = t.job_key)
              ORDER BY t.scheduled_at, t.job_key
                FOR UPDATE OF t SKIP LOCKED
    LOOP
        EXIT WHEN cardinality(keys) >= p_capacity;
        CONTINUE WHEN r.job_key = ANY (keys)
                   OR NOT pg_try_advisory_lock(p_namespace, r.job_key);
        SELECT * INTO v_run FROM scheduler_start_retry(p_namespace, p_instance, r.job_key,
                                                       r.scheduled_at);
        CONTINUE WHEN NOT FOUND;
        keys := keys || r.job_key; ticks := ticks || r.scheduled_at;
        run_ids := run_ids || v_run.run_id; started_at := started_at || v_run.started_at;
        attempts := attempts || v_run.attempt;
        v_runs := v_runs || ROW(r.job_key, r.job_name, r.scheduled_at, 'retry', NULL,
            'running', NULL, NULL, NULL, NULL, NULL,
            coalesce(p_fail_thresholds[array_position(p_keys, r.job_key)], 3))::scheduler_tick;
    END LOOP;
    -- With the locks in hand, any other `running` row of these jobs is stale (step 6).
    SELECT array_agg(s.key) AS keys, array_agg(s.crashed) AS counts,
           array_agg(s.newest) AS ticks, array_agg(s.name) AS names,
           array_agg(s.fail_threshold) AS thresholds
      INTO v_stale FROM scheduler_crash_stale(v_runs, p_crashed) s;
    IF v_stale.keys IS NOT NULL THEN
        PERFORM scheduler_count_crashes(p_instance, v_stale.keys, v_stale.names,
                                        v_stale.counts, v_stale.ticks, v_stale.thresholds);
    END IF;
    crashed := ARRAY(SELECT coalesce(s.n, 0)
                       FROM unnest(keys) WITH ORDINALITY AS k(key, place)
                       LEFT JOIN unnest(v_stale.keys, v_stale.counts) AS s(key, n)
                         ON s.key = k.key
                      ORDER BY k.place);
    SELECT extract(epoch FROM min(t.retry_at) - now()) INTO next_in
      FROM scheduler_ticks t
     WHERE t.retry_at IS NOT NULL AND t.status = 'failed' AND t.job_key = ANY (p_keys)
       AND NOT (t.job_key = ANY (keys))
       AND NOT EXISTS (SELECT 1 FROM scheduler_pauses p WHERE p.job_key = t.job_key);
    RETURN NEXT;
END;
$$;

-- scheduler_claim_retries: scheduler_start_retries for the replicas of earlier versions
-- (a rolling deploy), in the answer they read: a row per attempt started, then a last
-- row (job_key NULL) with next_in. Drop it once no replica of a version before 10 can be
-- running.
CREATE FUNCTION scheduler_claim_retries(
    p_namespace integer, p_instance text, p_keys integer[], p_capacity integer,
    p_crashed text, p_fail_thresholds integer[] DEFAULT NULL
) RETURNS TABLE (
    job_key integer, scheduled_at timestamptz, run_id bigint, started_at timestamptz,
    attempt integer, crashed integer, next_in double precision
) LANGUAGE plpgsql
SET jit = off  -- as scheduler_claim's answer: a plan over a guessed set, never compiled
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH s AS (
        SELECT * FROM scheduler_start_retries(p_namespace, p_instance, p_keys, p_capacity,
            p_crashed, coalesce(p_fail_thresholds, array_fill(3, ARRAY[cardinality(p_keys)])))
    )
    SELECT x.key, x.tick, x.run_id, x.started, x.attempt, x.crashed, x.next_in
      FROM (SELECT a.*, NULL::double precision AS next_in
              FROM s, unnest(s.keys, s.ticks, s.run_ids, s.started_at, s.attempts, s.crashed)
                      WITH ORDINALITY AS a(key, tick, run_id, started, attempt, crashed, place)
            UNION ALL
            SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, s.next_in FROM s) x
     ORDER BY x.place NULLS LAST;
END;
$$;

-- A run's finish, on its way through scheduler_finish.
CREATE TYPE scheduler_done AS (
    key         integer,
    tick        timestamptz,
    run_id      bigint,
    status      text,
    error       text,
    threshold   integer,
    next_due    timestamptz,
    finished_at timestamptz,
    recorded    boolean,   -- this call recorded it now
    repeated    boolean,   -- an earlier call recorded it (its answer was lost)
    retrying    boolean    -- a failed attempt with another to come: not the tick's end
);

-- Step 1. Record: a conditional update, in the common order. Only a row that is still
-- `running` with this run_id is this run's: a stale run (its replica froze and lost the
-- lock) finds its row already `crashed` and changes nothing. A finish sent again after a
-- lost answer finds its own final status there, and says so (`repeated`). A failed
-- attempt with another to come (`p_retry_in` seconds from now) gets its `retry_at`.
CREATE FUNCTION scheduler_record_finishes(
    p_keys integer[], p_ticks timestamptz[], p_run_ids bigint[], p_statuses text[],
    p_errors text[], p_told text[], p_durations double precision[],
    p_thresholds integer[], p_next_dues timestamptz[], p_retry_in double precision[]
) RETURNS SETOF scheduler_done LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH f AS (
        SELECT * FROM unnest(p_keys, p_ticks, p_run_ids, p_statuses, p_errors, p_told,
                             p_durations, p_thresholds, p_next_dues, p_retry_in)
                   AS f(key, tick, run_id, status, error, told, duration, threshold, next_due,
                        retry_in)
    ), mine AS (
        -- One probe per run sent, in the one row-lock order (each row is locked as it is
        -- found): never a scan of the ledger, nor each running row taken against each run
        -- sent, as a join planned for a handful of runs was.
        SELECT r.row_id, r.job_key, r.scheduled_at
          FROM (SELECT * FROM f ORDER BY f.tick, f.key) f CROSS JOIN LATERAL (
                   SELECT t.ctid AS row_id, t.job_key, t.scheduled_at FROM scheduler_ticks t
                    WHERE t.job_key = f.key AND t.scheduled_at = f.tick
                      AND t.status = 'running' AND t.run_id = f.run_id
                   OFFSET 0) r
         ORDER BY r.scheduled_at, r.job_key
           FOR UPDATE OF r
    ), done AS (
        -- By where each row locked above lies (as in scheduler_crash_stale): a join by
        -- key took the index of instants, and read a burst's whole second for each row.
        UPDATE scheduler_ticks r
           SET status = f.status, finished_at = clock_timestamp(), error = f.error,
               told = f.told, duration_s = f.duration,
               retry_at = clock_timestamp() + make_interval(secs => f.retry_in)
          FROM mine JOIN f ON f.key = mine.job_key AND f.tick = mine.scheduled_at
         WHERE r.ctid = mine.row_id AND r.status = 'running'
        RETURNING r.job_key, r.scheduled_at, r.finished_at
    )
    SELECT x.key, x.tick, x.run_id, x.status, x.error, x.threshold, x.next_due,
           x.finished_at, x.recorded, NOT x.recorded AND x.finished_at IS NOT NULL,
           x.retry_in IS NOT NULL
      FROM (SELECT f.*, done.job_key IS NOT NULL AS recorded,
                   CASE WHEN done.job_key IS NOT NULL THEN done.finished_at ELSE (
                       SELECT again.finished_at FROM scheduler_ticks again
                        WHERE again.job_key = f.key AND again.scheduled_at = f.tick
                          AND again.run_id = f.run_id AND again.status = f.status) END
                       AS finished_at
              FROM f LEFT JOIN done ON done.job_key = f.key AND done.scheduled_at = f.tick) x;
END;
$$;

-- Step 2. Streaks, one pass over the jobs' rows in key order (only rows with something to
-- change are locked). Failures grow the failure streak, which alerts once when it first
-- reaches the threshold in force; a success ends it (one recovery notice if it had
-- alerted). A run that ends before its job's next tick is due keeps up: it ends an
-- overrun, and an overrun that had raised a skip alert gets its one recovery notice.
-- A failed attempt with another to come changes no streak: it is not the tick's end.
-- A job that ends a tick failed has its row, so its failure streak has a home.
CREATE FUNCTION scheduler_track_failed(p_done scheduler_done[])
RETURNS void LANGUAGE sql AS $$
    INSERT INTO scheduler_jobs (job_key, job_name, tracked_since)
    SELECT d.key, (SELECT r.job_name FROM scheduler_ticks r
                    WHERE r.job_key = d.key AND r.scheduled_at = d.tick), now()
      FROM unnest(p_done) d
     WHERE d.recorded AND d.status IN ('failed', 'crashed') AND NOT d.retrying
     ORDER BY d.key
    ON CONFLICT DO NOTHING
$$;

-- The notices one finish raises, each with its facts, in the order they are inserted: what
-- they say is apart from the streaks that decide whether they are due (the update above
-- them in scheduler_finish_streaks). A plain query, so the planner inlines it there.
CREATE FUNCTION scheduler_finish_notices(
    p_instance text, p_run_id bigint, p_error text, p_crashed boolean, p_threshold integer,
    p_failures integer, p_failures_before integer, p_overrun_skips integer,
    p_fail_alert boolean, p_fail_recovered boolean, p_skips_recovered boolean
) RETURNS TABLE (event text, facts json) LANGUAGE sql STABLE AS $$
    SELECT e.event, e.facts FROM (VALUES
        ('job.failures_exceeded', p_fail_alert, json_build_object(
            'consecutive_failures', p_failures, 'threshold', p_threshold,
            'instance', p_instance, 'run_id', p_run_id, 'error', p_error,
            'crashed', CASE WHEN p_crashed THEN 1 ELSE 0 END)),
        ('job.failures_recovered', p_fail_recovered, json_build_object(
            'consecutive_failures', p_failures_before, 'instance', p_instance,
            'run_id', p_run_id)),
        ('job.recovered', p_skips_recovered, json_build_object(
            'consecutive_skips', p_overrun_skips, 'instance', p_instance,
            'run_id', p_run_id))
    ) AS e(event, due, facts)
     WHERE e.due
$$;

CREATE FUNCTION scheduler_finish_streaks(p_instance text, p_done scheduler_done[])
RETURNS TABLE (key integer, tick timestamptz, failures integer, alert boolean,
                 recovered boolean, skips_recovered boolean, notices bigint[])
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    PERFORM scheduler_track_failed(p_done);
    RETURN QUERY
    WITH d AS (
        -- A run abandoned at shutdown (crashed) ends its tick as a failure does.
        SELECT d.key, d.tick, d.run_id, d.error, d.threshold, d.next_due, d.finished_at,
               CASE WHEN d.retrying THEN 'retrying' WHEN d.status = 'crashed' THEN 'failed'
                    ELSE d.status END AS status,
               d.status = 'crashed' AS crashed,
               d.status IN ('succeeded', 'failed') AND NOT d.retrying
                   AND (d.next_due IS NULL OR d.finished_at <= d.next_due) AS kept_up
          FROM unnest(p_done) d
         WHERE d.recorded
    ), locked AS (
        SELECT j.* FROM scheduler_jobs j
         WHERE EXISTS (
               SELECT 1 FROM d WHERE d.key = j.job_key
                  AND (d.status = 'failed'
                       OR (d.status = 'succeeded' AND (j.consecutive_failures > 0 OR j.fail_alerted))
                       OR (d.kept_up AND (j.skip_alerted OR j.overrun_skips > 0))))
         ORDER BY j.job_key
           FOR UPDATE OF j
    ), updated AS (
        UPDATE scheduler_jobs j
           SET consecutive_failures = CASE d.status WHEN 'failed' THEN l.consecutive_failures + 1
                                                  WHEN 'succeeded' THEN 0
                                                  ELSE l.consecutive_failures END,
               fail_alerted = CASE d.status
                   WHEN 'failed' THEN l.fail_alerted OR l.consecutive_failures + 1 >= d.threshold
                   WHEN 'succeeded' THEN false ELSE l.fail_alerted END,
               -- A run kept up only if no tick was skipped behind it (a replica whose
               -- clock is ahead may skip its next tick before that tick is due).
               skip_alerted = l.skip_alerted AND NOT (d.kept_up AND l.consecutive_skips = 0),
               overrun_skips = CASE WHEN d.kept_up AND l.consecutive_skips = 0 THEN 0
                                    ELSE l.overrun_skips END
          FROM locked l JOIN d ON d.key = l.job_key
         WHERE j.job_key = l.job_key
        RETURNING j.job_key, d.tick, d.status, d.crashed, d.threshold, d.run_id, d.error,
                  l.job_name,
                  j.consecutive_failures AS failures,
                  l.consecutive_failures AS failures_before,
                  d.status = 'failed' AND NOT l.fail_alerted AND j.fail_alerted AS fail_alert,
                  d.status = 'succeeded' AND l.fail_alerted AS fail_recovered,
                  d.kept_up AND l.consecutive_skips = 0 AND l.skip_alerted AS skips_recovered,
                  l.overrun_skips
    ), notices AS (
        INSERT INTO scheduler_notices
               (event, job_key, job_name, scheduled_at, facts, raised_by, raised_at,
                lease_by, lease_until, next_attempt_at)
        SELECT e.event, u.job_key, u.job_name, u.tick, e.facts::text, p_instance, now(),
               p_instance, now() + interval '30 seconds', now()
          FROM updated u
          CROSS JOIN LATERAL scheduler_finish_notices(
              p_instance, u.run_id, u.error, u.crashed, u.threshold, u.failures,
              u.failures_before, u.overrun_skips, u.fail_alert, u.fail_recovered,
              u.skips_recovered) e
        RETURNING id, scheduler_notices.job_key
    )
    SELECT d.key, d.tick,
           CASE d.status WHEN 'failed' THEN coalesce(u.failures, 1)
                         WHEN 'succeeded' THEN coalesce(u.failures_before, 0) END,
           coalesce(u.fail_alert, false), coalesce(u.fail_recovered, false),
           coalesce(u.skips_recovered, false),
           coalesce((SELECT array_agg(n.id ORDER BY n.id) FROM notices n
                      WHERE n.job_key = d.key), '{}')
      FROM d LEFT JOIN updated u ON u.job_key = d.key;
END;
$$;

-- scheduler_finish: record finished runs, then release their locks.
--
-- The rows are updated (and row-locked) before the locks are released, so a replica that
-- takes a lock next and looks for stale `running` rows waits for this transaction and
-- then sees the final status. `failures`: for a failure, the streak so far; for a success,
-- the length of the streak it ends.
CREATE FUNCTION scheduler_finish(
    p_namespace  integer,
    p_instance   text,
    p_keys       integer[],
    p_ticks      timestamptz[],
    p_run_ids    bigint[],
    p_statuses   text[],
    p_errors     text[],
    p_told       text[],
    p_durations  double precision[],
    p_unlocks    boolean[],
    p_thresholds integer[],
    p_next_dues  timestamptz[],
    p_retry_in   double precision[] DEFAULT NULL  -- NULL: callers from before retries
) RETURNS TABLE (
    job_key         integer,
    scheduled_at    timestamptz,
    recorded        boolean,
    finished_at     timestamptz,
    failures        integer,
    alert           boolean,
    recovered       boolean,
    skips_recovered boolean,
    notices         bigint[]
) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_done scheduler_done[];
    v_keys integer[];
    v_ticks timestamptz[];
    v_failures integer[];
    v_alerts boolean[];
    v_recovered boolean[];
    v_skips_recovered boolean[];
    v_notices text[];
BEGIN
    v_done := ARRAY(SELECT d FROM scheduler_record_finishes(
        p_keys, p_ticks, p_run_ids, p_statuses, p_errors, p_told, p_durations,
        p_thresholds, p_next_dues,
        coalesce(p_retry_in, array_fill(NULL::double precision, ARRAY[cardinality(p_keys)])))
        d);
    SELECT array_agg(s.key), array_agg(s.tick), array_agg(s.failures), array_agg(s.alert),
           array_agg(s.recovered), array_agg(s.skips_recovered), array_agg(s.notices::text)
      INTO v_keys, v_ticks, v_failures, v_alerts, v_recovered, v_skips_recovered, v_notices
      FROM scheduler_finish_streaks(p_instance, v_done) s;
    -- Only now release the locks: the rows above are updated (and row-locked).
    PERFORM pg_advisory_unlock(p_namespace, u.key)
       FROM unnest(p_keys, p_unlocks) AS u(key, unlock)
      WHERE u.unlock
      ORDER BY u.key;
    RETURN QUERY
    SELECT d.key, d.tick, d.recorded OR d.repeated, d.finished_at, s.failures,
           coalesce(s.alert, false), coalesce(s.recovered, false),
           coalesce(s.skips_recovered, false), coalesce(s.notices::bigint[], '{}')
      FROM unnest(v_done) d
      LEFT JOIN unnest(v_keys, v_ticks, v_failures, v_alerts, v_recovered, v_skips_recovered,
                       v_notices) AS s(key, tick, failures, alert, recovered, skips_recovered,
                                       notices)
        ON s.key = d.key AND s.tick = d.tick;
END;
$$;
