-- pgbroker: the upkeep, one entry point, run by every Python Broker.
--
-- maintain() does, a bounded batch of each per call, in one short
-- transaction that nobody waits for (rows are taken FOR UPDATE SKIP LOCKED,
-- advisory locks only tried, and a part that would wait more than 100 ms for
-- a row is skipped until the next call):
--   sweep           what earlier epochs of every lease left (broker_sweep,
--                   550_sweep.sql), and TTL leases that expired unnoticed
--   lock names      names nobody holds nor waits for are forgotten, in two
--                   passes (650_locks.sql, "Forgetting idle names"): a name
--                   in use keeps its key, an idle one costs no row
--   semaphores      the same for semaphores, all permits of one together
--   rate limits     buckets that are full again (no different from no row)
--   kv expired      key-value entries whose TTL ran out
--   lease history   lease_event rows older than the retention the operator
--                   sets with upkeep_set() (30 days unless set)
-- Counters and live key-value entries are data: they stay until deleted.
-- Each call returns a row per part: what it removed and what is left (at
-- most MAX_ROWS counted); the view pgbroker.upkeep keeps the last call's
-- report and the totals since install, for the health check, the metrics
-- and `pgbroker doctor`.  Two calls at once: the second returns no row at
-- once.  The Python Broker calls it while it holds its lease: every
-- minute, every 5 seconds while a call left rows only a later call removes
-- (the names it marked idle), and again soon while a part removed a full
-- batch; elsewhere pg_cron runs it (sql/README.md, "Upkeep").

CREATE TABLE pgbroker.upkeep_setting (
    history_retention interval NOT NULL DEFAULT '30 days'
        CONSTRAINT upkeep_setting_retention_valid CHECK (history_retention >= '0'::interval),
    singleton boolean PRIMARY KEY DEFAULT true CONSTRAINT upkeep_setting_one_row CHECK (singleton)
);
INSERT INTO pgbroker.upkeep_setting DEFAULT VALUES;
COMMENT ON TABLE pgbroker.upkeep_setting IS 'Internal: one row, the operator''s settings of maintain() (set with upkeep_set(); read the view pgbroker.upkeep).';
COMMENT ON COLUMN pgbroker.upkeep_setting.history_retention IS 'maintain() deletes lease history events older than this.';
COMMENT ON COLUMN pgbroker.upkeep_setting.singleton IS 'Always true: one row.';

CREATE TABLE pgbroker.upkeep_log (
    part text PRIMARY KEY,
    position integer NOT NULL,
    last_run_at timestamptz,
    last_removed bigint NOT NULL DEFAULT 0,
    removed_total bigint NOT NULL DEFAULT 0,
    remaining bigint
);
INSERT INTO pgbroker.upkeep_log (part, position)
VALUES ('sweep', 1), ('lock names', 2), ('semaphores', 3), ('rate limits', 4), ('kv expired', 5), ('lease history', 6);
COMMENT ON TABLE pgbroker.upkeep_log IS 'Internal: per part of maintain(), its last call''s report and the total removed. Read the view pgbroker.upkeep.';
COMMENT ON COLUMN pgbroker.upkeep_log.part IS 'sweep, lock names, semaphores, rate limits, kv expired or lease history.';
COMMENT ON COLUMN pgbroker.upkeep_log.position IS 'Order of the parts in a call.';
COMMENT ON COLUMN pgbroker.upkeep_log.last_run_at IS 'When maintain() last ran this part (NULL: never).';
COMMENT ON COLUMN pgbroker.upkeep_log.last_removed IS 'Rows it removed then.';
COMMENT ON COLUMN pgbroker.upkeep_log.removed_total IS 'Rows removed since install.';
COMMENT ON COLUMN pgbroker.upkeep_log.remaining IS 'Rows left to remove after that call (at most its MAX_ROWS counted; NULL: the part was skipped, a row it needed was busy).';

CREATE FUNCTION pgbroker.upkeep_set(history_retention interval)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF upkeep_set.history_retention IS NULL OR upkeep_set.history_retention < '0'::interval THEN
        RAISE EXCEPTION 'history_retention must be a non-negative interval, got %',
                        coalesce(upkeep_set.history_retention::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE pgbroker.upkeep_setting SET history_retention = upkeep_set.history_retention;
END
$$;
COMMENT ON FUNCTION pgbroker.upkeep_set(interval) IS
    'pgbroker_admin: maintain() deletes lease history events older than HISTORY_RETENTION (non-negative; 22023 otherwise). The default is 30 days.';

CREATE FUNCTION pgbroker.maintain(max_rows integer DEFAULT 5000)
RETURNS TABLE (part text, removed bigint, remaining bigint)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '100ms'
AS $$
DECLARE
    v_max integer := maintain.max_rows;
    v_retention interval;
    v_removed bigint;
    v_remaining bigint;
BEGIN
    IF v_max IS NULL OR v_max < 1 OR v_max > 1000000 THEN
        RAISE EXCEPTION 'max_rows must be 1 to 1000000, got %', coalesce(v_max::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- One call at a time; a second returns at once, with no row.
    SELECT s.history_retention INTO v_retention FROM pgbroker.upkeep_setting s FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    FOR maintain.part IN SELECT u.part FROM pgbroker.upkeep_log u ORDER BY u.position LOOP
        BEGIN
            CASE maintain.part
                WHEN 'sweep' THEN
                    v_removed := pgbroker.broker_sweep(NULL, v_max);
                    SELECT coalesce(sum(w.clients + w.subscriptions + w.interest + w.outbox + w.state), 0)
                      INTO v_remaining FROM pgbroker.sweep_backlog w;
                WHEN 'lock names' THEN
                    SELECT u.removed, u.remaining INTO v_removed, v_remaining FROM pgbroker._lock_names_upkeep(v_max) u;
                WHEN 'semaphores' THEN
                    SELECT u.removed, u.remaining INTO v_removed, v_remaining FROM pgbroker._semaphore_names_upkeep(v_max) u;
                WHEN 'rate limits' THEN
                    SELECT u.removed, u.remaining INTO v_removed, v_remaining FROM pgbroker._rate_limit_upkeep(v_max) u;
                WHEN 'kv expired' THEN
                    SELECT u.removed, u.remaining INTO v_removed, v_remaining FROM pgbroker._kv_expired_upkeep(v_max) u;
                WHEN 'lease history' THEN
                    DELETE FROM pgbroker.lease_event e
                     WHERE e.id = ANY (ARRAY(SELECT x.id FROM pgbroker.lease_event x
                                              WHERE x.at < clock_timestamp() - v_retention
                                              ORDER BY x.id LIMIT v_max FOR UPDATE SKIP LOCKED));
                    GET DIAGNOSTICS v_removed = ROW_COUNT;
                    SELECT count(*) INTO v_remaining
                      FROM (SELECT FROM pgbroker.lease_event x
                             WHERE x.at < clock_timestamp() - v_retention LIMIT v_max) x;
            END CASE;
        EXCEPTION WHEN lock_not_available THEN
            -- A row this part needed was busy for 100 ms: next call.
            v_removed := 0;
            v_remaining := NULL;
        END;
        UPDATE pgbroker.upkeep_log u
           SET last_run_at = clock_timestamp(), last_removed = v_removed,
               removed_total = u.removed_total + v_removed, remaining = v_remaining
         WHERE u.part = maintain.part;
        maintain.removed := v_removed;
        maintain.remaining := v_remaining;
        RETURN NEXT;
    END LOOP;
END
$$;
COMMENT ON FUNCTION pgbroker.maintain(integer) IS
$$The upkeep, in one call: removes at most MAX_ROWS (1 to 1000000; default 5000) rows of each part and returns a row per part, in order: sweep (what earlier epochs of every lease left, broker_sweep), lock names and semaphores nobody holds nor waits for (forgotten in two passes; a name in use keeps its key), rate limits whose bucket is full again, kv expired (entries whose TTL ran out), lease history (older than the retention of upkeep_set(), 30 days unless set).
REMOVED: rows it deleted; REMAINING: rows left to remove (at most MAX_ROWS counted; NULL when the part was skipped because a row it needed stayed busy for 100 ms). Call it again while a part removed MAX_ROWS (more is left); names it finds idle go at a later call, so a minute apart suits it.
Nobody waits for it: rows are taken FOR UPDATE SKIP LOCKED and advisory locks only tried. No row at all: another maintain() is running. Counters and live key-value entries are never removed.
Call it in autocommit mode (each call commits its batches); the Python Broker calls it every minute (every 5 seconds while a call left rows for a later one), pg_cron can too (sql/README.md, "Upkeep").$$;

CREATE VIEW pgbroker.upkeep AS
SELECT u.part, u.last_run_at, u.last_removed, u.removed_total, u.remaining,
       CASE WHEN u.part = 'lease history' THEN s.history_retention END AS retention
  FROM pgbroker.upkeep_log u CROSS JOIN pgbroker.upkeep_setting s
 ORDER BY u.position;
COMMENT ON VIEW pgbroker.upkeep IS
    'One row per part of maintain(): when it last ran, what it removed then and since install, and what it left to remove.';
COMMENT ON COLUMN pgbroker.upkeep.part IS 'sweep, lock names, semaphores, rate limits, kv expired or lease history.';
COMMENT ON COLUMN pgbroker.upkeep.last_run_at IS 'When maintain() last ran it (NULL: never).';
COMMENT ON COLUMN pgbroker.upkeep.last_removed IS 'Rows removed by that call.';
COMMENT ON COLUMN pgbroker.upkeep.removed_total IS 'Rows removed since install.';
COMMENT ON COLUMN pgbroker.upkeep.remaining IS 'Rows left to remove after that call (at most its MAX_ROWS counted; NULL: skipped, a row it needed was busy).';
COMMENT ON COLUMN pgbroker.upkeep.retention IS 'For lease history: the retention set with upkeep_set().';
