-- pgbroker_0003_registry_at_size: registry at size.
-- Drafted by migrations/new_revision.py from sql/; review it, then complete the TODOs.

CREATE OR REPLACE FUNCTION pgbroker._interest_shrink(p_watch_ids integer[], p_row_keys jsonb[], p_names text[], p_epochs bigint[], p_client_ids text[])
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_watch_ids integer[];
    v_row_keys jsonb[];
    v_names text[];
    v_epochs bigint[];
BEGIN
    -- Each row once, however many of its clients leave (locking a row once
    -- per departing client cost 16 us a pair: 1.6 s of a departure of
    -- 10,000 clients with 10 subscriptions each; once per row, 0.3 s).
    PERFORM
       FROM (SELECT u.watch_id, u.row_key, u.name, u.epoch
               FROM unnest(p_watch_ids, p_row_keys, p_names, p_epochs) AS u(watch_id, row_key, name, epoch)
              -- (jsonb compares slowly: sorting 100,000 keys took 0.4 s; their hashes first, the keys on a tie)
              GROUP BY u.watch_id, jsonb_hash(u.row_key), u.row_key, u.name, u.epoch
              ORDER BY u.watch_id, jsonb_hash(u.row_key), u.row_key, u.name, u.epoch) g
      CROSS JOIN LATERAL (SELECT FROM pgbroker.interest i
                           WHERE i.watch_id = g.watch_id AND i.row_key = g.row_key AND i.name = g.name AND i.epoch = g.epoch
                             FOR UPDATE) x;
    WITH gone AS (
        SELECT u.watch_id, u.row_key, u.name, u.epoch, array_agg(u.client_id) AS gone
          FROM unnest(p_watch_ids, p_row_keys, p_names, p_epochs, p_client_ids) AS u(watch_id, row_key, name, epoch, client_id)
         GROUP BY u.watch_id, jsonb_hash(u.row_key), u.row_key, u.name, u.epoch
    ), shrunk AS (
        UPDATE pgbroker.interest i
           SET clients = CASE WHEN cardinality(r.gone) = 1 THEN array_remove(i.clients, r.gone[1])
                              ELSE ARRAY(SELECT x.c FROM unnest(i.clients) AS x(c) WHERE x.c <> ALL (r.gone)) END
          FROM (SELECT g.gone, f.ctid AS row_ctid
                  FROM gone g
                 CROSS JOIN LATERAL (SELECT j.ctid FROM pgbroker.interest j
                                      WHERE j.watch_id = g.watch_id AND j.row_key = g.row_key AND j.name = g.name
                                        AND j.epoch = g.epoch
                                     OFFSET 0) f) r
         WHERE i.ctid = r.row_ctid
        RETURNING i.watch_id, i.row_key, i.name, i.epoch, cardinality(i.clients) AS left_over
    )
    SELECT array_agg(s.watch_id), array_agg(s.row_key), array_agg(s.name), array_agg(s.epoch)
      INTO v_watch_ids, v_row_keys, v_names, v_epochs
      FROM shrunk s WHERE s.left_over = 0;
    -- A row can change only once per statement: drop the emptied ones now.
    IF v_watch_ids IS NOT NULL THEN
        DELETE FROM pgbroker.interest i
         USING (SELECT f.ctid AS row_ctid
                  FROM unnest(v_watch_ids, v_row_keys, v_names, v_epochs) AS e(watch_id, row_key, name, epoch)
                 CROSS JOIN LATERAL (SELECT j.ctid FROM pgbroker.interest j
                                      WHERE j.watch_id = e.watch_id AND j.row_key = e.row_key AND j.name = e.name
                                        AND j.epoch = e.epoch
                                     OFFSET 0) f) r
         WHERE i.ctid = r.row_ctid AND cardinality(i.clients) = 0;
    END IF;
END
$function$;
CREATE OR REPLACE FUNCTION pgbroker._outbox_resolve(p_name text, p_epoch bigint)
 RETURNS void
 LANGUAGE sql
AS $function$
    WITH resolved AS MATERIALIZED (
        SELECT o.ctid AS row_ctid,
               -- A row's subscribers by two probes, each on the interest's whole key.  (An OR
               -- with the truncate's case, or row_key IN (key, null), let a plan made on the
               -- statistics of an interest loaded since read the broker's whole interest of
               -- the table for each row: 51 ms a row at 30,000 keys, and the broker fell
               -- behind its writers while clients churned.)
               CASE WHEN o.op = 'T'
                    THEN ARRAY(SELECT DISTINCT s FROM pgbroker.interest i, unnest(i.clients) AS s
                                WHERE i.watch_id = o.watch_id AND i.name = p_name AND i.epoch = p_epoch
                                ORDER BY 1)
                    ELSE ARRAY(SELECT DISTINCT s
                                 FROM (SELECT i.clients FROM pgbroker.interest i
                                        WHERE i.watch_id = o.watch_id AND i.row_key = o.row_key
                                          AND i.name = p_name AND i.epoch = p_epoch
                                       UNION ALL
                                       SELECT i.clients FROM pgbroker.interest i
                                        WHERE i.watch_id = o.watch_id AND i.row_key = 'null'::jsonb
                                          AND i.name = p_name AND i.epoch = p_epoch) q,
                                      unnest(q.clients) AS s
                                ORDER BY 1) END AS clients
          FROM pgbroker.outbox o
         WHERE o.name = p_name AND o.epoch = p_epoch AND o.clients IS NULL
    ), told AS (
        -- Each row by its ctid (only this broker's session changes its rows): joined by (name, id), or
        -- (name, epoch, id) on the plan of a generic estimate of one row, each was looked for among all the
        -- epoch's rows, O(n^2): a fetch ran for minutes over 13,000 rows written while subscribes churned.
        UPDATE pgbroker.outbox o SET clients = r.clients
          FROM resolved r
         WHERE o.ctid = r.row_ctid AND r.clients <> '{}'
    )
    DELETE FROM pgbroker.outbox d USING resolved r WHERE d.ctid = r.row_ctid AND r.clients = '{}';
$function$;
CREATE OR REPLACE FUNCTION pgbroker.registry_watch_begin(name text DEFAULT 'default'::text)
 RETURNS void
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_key integer := pgbroker._registry_key(pgbroker._check_name(registry_watch_begin.name));
BEGIN
    PERFORM pgbroker._name_check('lease', registry_watch_begin.name, false);
    PERFORM pg_advisory_lock_shared(pgbroker._lock_class_registry(), v_key);
    BEGIN
        PERFORM set_config('pgbroker.registry_watching', 'on', false);   -- this session's own changes: see _registry_watched
        -- Wait for the changes that looked for watchers before we registered.
        PERFORM pg_advisory_xact_lock(pgbroker._lock_class_registry_write(), v_key);
    EXCEPTION WHEN query_canceled OR others THEN
        -- A cancel or statement_timeout while waiting: not registered (the
        -- session lock above outlives the error, so it goes here).
        PERFORM pg_advisory_unlock_shared(pgbroker._lock_class_registry(), v_key);
        RAISE;
    END;
END
$function$;
CREATE OR REPLACE FUNCTION pgbroker.schema_version()
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$ SELECT '0.1.0+3'::text $function$;
