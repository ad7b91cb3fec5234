-- pgbroker_0003_registry_at_size: registry at size.
-- Drafted by migrations/new_revision.py from sql/, then reviewed: function definitions only, no hand-written blocks.

CREATE OR REPLACE FUNCTION pgbroker._interest_shrink(p_watch_ids integer[], p_row_keys jsonb[], p_names text[], p_epochs bigint[], p_client_ids text[])
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_rows tid[];
    v_clients text[];  -- each row's clients left, as the text of a text[] (an array of arrays cannot be ragged)
BEGIN
    SELECT array_agg(x.row_ctid), array_agg(x.clients::text)
      INTO v_rows, v_clients
      FROM (SELECT u.watch_id, u.row_key, u.name, u.epoch, array_agg(u.client_id) AS gone
              FROM unnest(p_watch_ids, p_row_keys, p_names, p_epochs, p_client_ids)
                   AS u(watch_id, row_key, name, epoch, client_id)
             -- (jsonb compares slowly: sorting 100,000 keys took 0.4 s; their hashes first, the keys on a tie)
             GROUP BY u.watch_id, jsonb_hash(u.row_key), u.row_key, u.name, u.epoch
             ORDER BY u.watch_id, jsonb_hash(u.row_key), u.row_key, u.name, u.epoch) g
     CROSS JOIN LATERAL (
           -- Computed from the row as locked: FOR UPDATE re-reads a row
           -- changed since the statement's snapshot, and this with it.
           SELECT i.ctid AS row_ctid,
                  CASE WHEN cardinality(g.gone) = 1 THEN array_remove(i.clients, g.gone[1])
                       ELSE ARRAY(SELECT c.c FROM unnest(i.clients) AS c(c) WHERE c.c <> ALL (g.gone)) END AS clients
             FROM pgbroker.interest i
            WHERE i.watch_id = g.watch_id AND i.row_key = g.row_key AND i.name = g.name AND i.epoch = g.epoch
              FOR UPDATE) x;
    IF v_rows IS NULL THEN
        RETURN;
    END IF;
    -- Joined by ctid alone: a TID probe per row given, whatever the table's
    -- statistics say.  (With ctid = ANY (v_rows) as well, the generic plan
    -- scanned the TIDs and the unnest again for each: 30,000 rows took 5 s.)
    UPDATE pgbroker.interest i
       SET clients = r.clients::text[]
      FROM unnest(v_rows, v_clients) AS r(row_ctid, clients)
     WHERE i.ctid = r.row_ctid AND r.clients <> '{}';
    DELETE FROM pgbroker.interest i
     USING unnest(v_rows, v_clients) AS r(row_ctid, clients)
     WHERE i.ctid = r.row_ctid AND r.clients = '{}';
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
