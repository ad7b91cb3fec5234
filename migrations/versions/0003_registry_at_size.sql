-- pgbroker_0003_registry_at_size: registry at size.
-- Drafted by migrations/new_revision.py from sql/; review it, then complete the TODOs.

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
CREATE OR REPLACE FUNCTION pgbroker.schema_version()
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$ SELECT '0.1.0+3'::text $function$;
