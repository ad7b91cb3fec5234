-- Reference rendering (generated; do not edit): what pgbroker.watch('initech.objects') installs.
--
-- The templates are in sql/600_triggers.sql; tests/test_reference_rendering.py
-- renders them on a fresh install and compares with this file.  After changing
-- the templates: PGBROKER_UPDATE_REFERENCE=1 python -m pytest tests/test_reference_rendering.py

-- ---------------------------------------------------------------------------
-- _pgbroker_watch_ins

CREATE TRIGGER _pgbroker_watch_ins AFTER INSERT ON initech.objects REFERENCING NEW TABLE AS pgbroker_new FOR EACH STATEMENT EXECUTE FUNCTION pgbroker._watch_1_ins();

CREATE OR REPLACE FUNCTION pgbroker._watch_1_ins()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_large boolean;
    v_whole boolean;
    v_jit text;
BEGIN
    IF pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), pgbroker._lock_gate(1))
       AND current_setting('transaction_isolation') = 'read committed' THEN
        SELECT EXISTS (SELECT FROM pgbroker_new OFFSET 1024),
               EXISTS (SELECT FROM pgbroker.interest WHERE watch_id = 1 AND row_key = 'null'::jsonb)
          INTO v_large, v_whole;
        IF NOT v_large AND NOT v_whole THEN

        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT z.name, z.epoch, 1, z.op, z.row_key, z.changed, z.clients
          FROM (SELECT i.name, i.epoch, i.lock_key, i.clients, k.op, k.row_key, k.changed
                  FROM (SELECT 'I'::"char" AS op, to_jsonb(n.id) AS row_key, NULL::text[] AS changed FROM pgbroker_new n OFFSET 0) k
                 CROSS JOIN LATERAL (
                       -- An index probe per change, whatever the size the plan was made for
                       -- (a hash of the table's interest rows would then serve every later call).
                       SELECT j.name, j.epoch, j.lock_key, j.clients FROM pgbroker.interest j
                        WHERE j.watch_id = 1 AND j.row_key = k.row_key OFFSET 0) i
                OFFSET 0) z  -- the test below runs on the rows to write, never on an interest scan
         WHERE CASE
            WHEN NOT pg_try_advisory_xact_lock_shared(pgbroker._lock_class_drain(), pgbroker._lock_gate(z.lock_key))
                THEN pgbroker._epoch_alive(z.lock_key, z.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || z.lock_key, z.name)) = 0
            WHEN pg_try_advisory_lock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(z.epoch))
                THEN pg_advisory_unlock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(z.epoch))
                     AND pgbroker._epoch_alive(z.lock_key, z.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || z.lock_key, z.name)) = 0
            ELSE true
        END;
        ELSE
            v_jit := current_setting('jit');
            PERFORM set_config('jit', 'off', true);
            IF v_whole THEN

        WITH whole AS MATERIALIZED (
            SELECT i.name, i.epoch, i.lock_key, i.clients
              FROM pgbroker.interest i
             WHERE i.watch_id = 1 AND i.row_key = 'null'::jsonb)
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT t.name, t.epoch, 1, k.op, k.row_key, k.changed, t.clients
          FROM (SELECT 'I'::"char" AS op, to_jsonb(n.id) AS row_key, NULL::text[] AS changed FROM pgbroker_new n OFFSET 0) k
         CROSS JOIN LATERAL (
               -- Subscribers of the row, with the whole-table ones of the same broker ...
               SELECT r.name, r.epoch, r.lock_key,
                      CASE WHEN w.clients IS NULL THEN r.clients
                           ELSE ARRAY(SELECT DISTINCT c FROM unnest(r.clients || w.clients) AS c ORDER BY 1) END
                 FROM pgbroker.interest r
                 LEFT JOIN whole w ON w.name = r.name AND w.epoch = r.epoch
                WHERE r.watch_id = 1 AND r.row_key = k.row_key
               UNION ALL
               -- ... and the whole-table ones of brokers with no subscriber of the row.
               SELECT w.name, w.epoch, w.lock_key, w.clients
                 FROM whole w
                WHERE NOT EXISTS (SELECT FROM pgbroker.interest r
                                   WHERE r.watch_id = 1 AND r.row_key = k.row_key AND r.name = w.name
                                     AND r.epoch = w.epoch)
               ) AS t (name, epoch, lock_key, clients)
         WHERE CASE
            WHEN NOT pg_try_advisory_xact_lock_shared(pgbroker._lock_class_drain(), pgbroker._lock_gate(t.lock_key))
                THEN pgbroker._epoch_alive(t.lock_key, t.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || t.lock_key, t.name)) = 0
            WHEN pg_try_advisory_lock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(t.epoch))
                THEN pg_advisory_unlock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(t.epoch))
                     AND pgbroker._epoch_alive(t.lock_key, t.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || t.lock_key, t.name)) = 0
            ELSE true
        END;
            ELSE
                EXECUTE '
        WITH live AS MATERIALIZED (
            SELECT l.name, l.epoch FROM pgbroker.lease l
             WHERE l.state = ''held'' AND l.expires_at IS NULL
               AND CASE WHEN EXISTS (SELECT FROM pgbroker.interest j
                                      WHERE j.watch_id = 1 AND j.name = l.name AND j.epoch = l.epoch)
                        THEN CASE
            WHEN NOT pg_try_advisory_xact_lock_shared(pgbroker._lock_class_drain(), pgbroker._lock_gate(l.lock_key))
                THEN pgbroker._epoch_alive(l.lock_key, l.epoch)
                     AND num_nulls(pg_notify(''pgbroker_wakeup_'' || l.lock_key, l.name)) = 0
            WHEN pg_try_advisory_lock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(l.epoch))
                THEN pg_advisory_unlock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(l.epoch))
                     AND pgbroker._epoch_alive(l.lock_key, l.epoch)
                     AND num_nulls(pg_notify(''pgbroker_wakeup_'' || l.lock_key, l.name)) = 0
            ELSE true
        END END)
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT z.name, z.epoch, 1, z.op, z.row_key, z.changed, z.clients
          FROM (SELECT i.name, i.epoch, i.clients, k.op, k.row_key, NULL::text[] AS changed
                  FROM (SELECT ''I''::"char" AS op, to_jsonb(n.id) AS row_key FROM pgbroker_new n OFFSET 0) k
                  JOIN pgbroker.interest i ON i.watch_id = 1 AND i.row_key = k.row_key
                  JOIN live ON live.name = i.name AND live.epoch = i.epoch
                OFFSET 0) z  -- compared after the join: only subscribed rows'' columns
         WHERE z.op <> ''U'' OR cardinality(z.changed) > 0';
            END IF;
            PERFORM set_config('jit', v_jit, true);
        END IF;
    ELSE

        -- A subscribe() is under way, or the snapshot may predate one: every
        -- live broker gets the changes, their clients resolved when fetched.
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT l.name, l.epoch, 1, l.op, l.row_key, l.changed, NULL
          FROM (SELECT b.name, b.epoch, b.lock_key, k.op, k.row_key, k.changed
                  FROM (SELECT 'I'::"char" AS op, to_jsonb(n.id) AS row_key, NULL::text[] AS changed FROM pgbroker_new n OFFSET 0) k
                 CROSS JOIN pgbroker.lease b
                 WHERE b.state = 'held' AND b.expires_at IS NULL
                OFFSET 0) l
         WHERE CASE
            WHEN NOT pg_try_advisory_xact_lock_shared(pgbroker._lock_class_drain(), pgbroker._lock_gate(l.lock_key))
                THEN pgbroker._epoch_alive(l.lock_key, l.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || l.lock_key, l.name)) = 0
            WHEN pg_try_advisory_lock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(l.epoch))
                THEN pg_advisory_unlock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(l.epoch))
                     AND pgbroker._epoch_alive(l.lock_key, l.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || l.lock_key, l.name)) = 0
            ELSE true
        END;
    END IF;
    RETURN NULL;
END
$function$;

-- ---------------------------------------------------------------------------
-- _pgbroker_watch_upd

CREATE TRIGGER _pgbroker_watch_upd AFTER UPDATE ON initech.objects REFERENCING OLD TABLE AS pgbroker_old NEW TABLE AS pgbroker_new FOR EACH STATEMENT EXECUTE FUNCTION pgbroker._watch_1_upd();

CREATE OR REPLACE FUNCTION pgbroker._watch_1_upd()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_large boolean;
    v_whole boolean;
    v_jit text;
BEGIN
    IF pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), pgbroker._lock_gate(1))
       AND current_setting('transaction_isolation') = 'read committed' THEN
        SELECT EXISTS (SELECT FROM pgbroker_new OFFSET 1024),
               EXISTS (SELECT FROM pgbroker.interest WHERE watch_id = 1 AND row_key = 'null'::jsonb)
          INTO v_large, v_whole;
        IF NOT v_large AND NOT v_whole THEN

        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT z.name, z.epoch, 1, z.op, z.row_key, z.changed, z.clients
          FROM (SELECT i.name, i.epoch, i.lock_key, i.clients, k.op, k.row_key, k.changed
                  FROM (SELECT c.op, c.row_key, c.changed FROM (
              SELECT (CASE WHEN o.id IS NULL THEN 'I' WHEN n.id IS NULL THEN 'D' ELSE 'U' END)::"char" AS op,
                     CASE WHEN n.id IS NULL THEN to_jsonb(o.id) ELSE to_jsonb(n.id) END AS row_key,
                     CASE WHEN o.id IS NULL OR n.id IS NULL THEN NULL ELSE array_remove(ARRAY[CASE WHEN n.id IS DISTINCT FROM o.id THEN 'id' END, CASE WHEN n.kind IS DISTINCT FROM o.kind THEN 'kind' END, CASE WHEN n.name IS DISTINCT FROM o.name THEN 'name' END, CASE WHEN n.config IS DISTINCT FROM o.config THEN 'config' END, CASE WHEN n.updated_at IS DISTINCT FROM o.updated_at THEN 'updated_at' END]::text[], NULL) END AS changed
                FROM pgbroker_new n FULL JOIN pgbroker_old o ON n.id = o.id) c
             WHERE c.op <> 'U' OR cardinality(c.changed) > 0 OFFSET 0) k
                 CROSS JOIN LATERAL (
                       -- An index probe per change, whatever the size the plan was made for
                       -- (a hash of the table's interest rows would then serve every later call).
                       SELECT j.name, j.epoch, j.lock_key, j.clients FROM pgbroker.interest j
                        WHERE j.watch_id = 1 AND j.row_key = k.row_key OFFSET 0) i
                OFFSET 0) z  -- the test below runs on the rows to write, never on an interest scan
         WHERE CASE
            WHEN NOT pg_try_advisory_xact_lock_shared(pgbroker._lock_class_drain(), pgbroker._lock_gate(z.lock_key))
                THEN pgbroker._epoch_alive(z.lock_key, z.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || z.lock_key, z.name)) = 0
            WHEN pg_try_advisory_lock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(z.epoch))
                THEN pg_advisory_unlock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(z.epoch))
                     AND pgbroker._epoch_alive(z.lock_key, z.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || z.lock_key, z.name)) = 0
            ELSE true
        END;
        ELSE
            v_jit := current_setting('jit');
            PERFORM set_config('jit', 'off', true);
            IF v_whole THEN

        WITH whole AS MATERIALIZED (
            SELECT i.name, i.epoch, i.lock_key, i.clients
              FROM pgbroker.interest i
             WHERE i.watch_id = 1 AND i.row_key = 'null'::jsonb)
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT t.name, t.epoch, 1, k.op, k.row_key, k.changed, t.clients
          FROM (SELECT c.op, c.row_key, c.changed FROM (
              SELECT (CASE WHEN o.id IS NULL THEN 'I' WHEN n.id IS NULL THEN 'D' ELSE 'U' END)::"char" AS op,
                     CASE WHEN n.id IS NULL THEN to_jsonb(o.id) ELSE to_jsonb(n.id) END AS row_key,
                     CASE WHEN o.id IS NULL OR n.id IS NULL THEN NULL ELSE array_remove(ARRAY[CASE WHEN n.id IS DISTINCT FROM o.id THEN 'id' END, CASE WHEN n.kind IS DISTINCT FROM o.kind THEN 'kind' END, CASE WHEN n.name IS DISTINCT FROM o.name THEN 'name' END, CASE WHEN n.config IS DISTINCT FROM o.config THEN 'config' END, CASE WHEN n.updated_at IS DISTINCT FROM o.updated_at THEN 'updated_at' END]::text[], NULL) END AS changed
                FROM pgbroker_new n FULL JOIN pgbroker_old o ON n.id = o.id) c
             WHERE c.op <> 'U' OR cardinality(c.changed) > 0 OFFSET 0) k
         CROSS JOIN LATERAL (
               -- Subscribers of the row, with the whole-table ones of the same broker ...
               SELECT r.name, r.epoch, r.lock_key,
                      CASE WHEN w.clients IS NULL THEN r.clients
                           ELSE ARRAY(SELECT DISTINCT c FROM unnest(r.clients || w.clients) AS c ORDER BY 1) END
                 FROM pgbroker.interest r
                 LEFT JOIN whole w ON w.name = r.name AND w.epoch = r.epoch
                WHERE r.watch_id = 1 AND r.row_key = k.row_key
               UNION ALL
               -- ... and the whole-table ones of brokers with no subscriber of the row.
               SELECT w.name, w.epoch, w.lock_key, w.clients
                 FROM whole w
                WHERE NOT EXISTS (SELECT FROM pgbroker.interest r
                                   WHERE r.watch_id = 1 AND r.row_key = k.row_key AND r.name = w.name
                                     AND r.epoch = w.epoch)
               ) AS t (name, epoch, lock_key, clients)
         WHERE CASE
            WHEN NOT pg_try_advisory_xact_lock_shared(pgbroker._lock_class_drain(), pgbroker._lock_gate(t.lock_key))
                THEN pgbroker._epoch_alive(t.lock_key, t.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || t.lock_key, t.name)) = 0
            WHEN pg_try_advisory_lock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(t.epoch))
                THEN pg_advisory_unlock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(t.epoch))
                     AND pgbroker._epoch_alive(t.lock_key, t.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || t.lock_key, t.name)) = 0
            ELSE true
        END;
            ELSE
                EXECUTE '
        WITH live AS MATERIALIZED (
            SELECT l.name, l.epoch FROM pgbroker.lease l
             WHERE l.state = ''held'' AND l.expires_at IS NULL
               AND CASE WHEN EXISTS (SELECT FROM pgbroker.interest j
                                      WHERE j.watch_id = 1 AND j.name = l.name AND j.epoch = l.epoch)
                        THEN CASE
            WHEN NOT pg_try_advisory_xact_lock_shared(pgbroker._lock_class_drain(), pgbroker._lock_gate(l.lock_key))
                THEN pgbroker._epoch_alive(l.lock_key, l.epoch)
                     AND num_nulls(pg_notify(''pgbroker_wakeup_'' || l.lock_key, l.name)) = 0
            WHEN pg_try_advisory_lock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(l.epoch))
                THEN pg_advisory_unlock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(l.epoch))
                     AND pgbroker._epoch_alive(l.lock_key, l.epoch)
                     AND num_nulls(pg_notify(''pgbroker_wakeup_'' || l.lock_key, l.name)) = 0
            ELSE true
        END END)
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT z.name, z.epoch, 1, z.op, z.row_key, z.changed, z.clients
          FROM (SELECT i.name, i.epoch, i.clients, k.op, k.row_key, CASE WHEN k.op = ''U'' THEN array_remove(ARRAY[CASE WHEN (k.n).id IS DISTINCT FROM (k.o).id THEN ''id'' END, CASE WHEN (k.n).kind IS DISTINCT FROM (k.o).kind THEN ''kind'' END, CASE WHEN (k.n).name IS DISTINCT FROM (k.o).name THEN ''name'' END, CASE WHEN (k.n).config IS DISTINCT FROM (k.o).config THEN ''config'' END, CASE WHEN (k.n).updated_at IS DISTINCT FROM (k.o).updated_at THEN ''updated_at'' END]::text[], NULL) END AS changed
                  FROM (SELECT (CASE WHEN o.id IS NULL THEN ''I'' WHEN n.id IS NULL THEN ''D'' ELSE ''U'' END)::"char" AS op,
                     CASE WHEN n.id IS NULL THEN to_jsonb(o.id) ELSE to_jsonb(n.id) END AS row_key, n, o
                FROM pgbroker_new n FULL JOIN pgbroker_old o ON n.id = o.id OFFSET 0) k
                  JOIN pgbroker.interest i ON i.watch_id = 1 AND i.row_key = k.row_key
                  JOIN live ON live.name = i.name AND live.epoch = i.epoch
                OFFSET 0) z  -- compared after the join: only subscribed rows'' columns
         WHERE z.op <> ''U'' OR cardinality(z.changed) > 0';
            END IF;
            PERFORM set_config('jit', v_jit, true);
        END IF;
    ELSE

        -- A subscribe() is under way, or the snapshot may predate one: every
        -- live broker gets the changes, their clients resolved when fetched.
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT l.name, l.epoch, 1, l.op, l.row_key, l.changed, NULL
          FROM (SELECT b.name, b.epoch, b.lock_key, k.op, k.row_key, k.changed
                  FROM (SELECT c.op, c.row_key, c.changed FROM (
              SELECT (CASE WHEN o.id IS NULL THEN 'I' WHEN n.id IS NULL THEN 'D' ELSE 'U' END)::"char" AS op,
                     CASE WHEN n.id IS NULL THEN to_jsonb(o.id) ELSE to_jsonb(n.id) END AS row_key,
                     CASE WHEN o.id IS NULL OR n.id IS NULL THEN NULL ELSE array_remove(ARRAY[CASE WHEN n.id IS DISTINCT FROM o.id THEN 'id' END, CASE WHEN n.kind IS DISTINCT FROM o.kind THEN 'kind' END, CASE WHEN n.name IS DISTINCT FROM o.name THEN 'name' END, CASE WHEN n.config IS DISTINCT FROM o.config THEN 'config' END, CASE WHEN n.updated_at IS DISTINCT FROM o.updated_at THEN 'updated_at' END]::text[], NULL) END AS changed
                FROM pgbroker_new n FULL JOIN pgbroker_old o ON n.id = o.id) c
             WHERE c.op <> 'U' OR cardinality(c.changed) > 0 OFFSET 0) k
                 CROSS JOIN pgbroker.lease b
                 WHERE b.state = 'held' AND b.expires_at IS NULL
                OFFSET 0) l
         WHERE CASE
            WHEN NOT pg_try_advisory_xact_lock_shared(pgbroker._lock_class_drain(), pgbroker._lock_gate(l.lock_key))
                THEN pgbroker._epoch_alive(l.lock_key, l.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || l.lock_key, l.name)) = 0
            WHEN pg_try_advisory_lock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(l.epoch))
                THEN pg_advisory_unlock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(l.epoch))
                     AND pgbroker._epoch_alive(l.lock_key, l.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || l.lock_key, l.name)) = 0
            ELSE true
        END;
    END IF;
    RETURN NULL;
END
$function$;

-- ---------------------------------------------------------------------------
-- _pgbroker_watch_del

CREATE TRIGGER _pgbroker_watch_del AFTER DELETE ON initech.objects REFERENCING OLD TABLE AS pgbroker_old FOR EACH STATEMENT EXECUTE FUNCTION pgbroker._watch_1_del();

CREATE OR REPLACE FUNCTION pgbroker._watch_1_del()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_large boolean;
    v_whole boolean;
    v_jit text;
BEGIN
    IF pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), pgbroker._lock_gate(1))
       AND current_setting('transaction_isolation') = 'read committed' THEN
        SELECT EXISTS (SELECT FROM pgbroker_old OFFSET 1024),
               EXISTS (SELECT FROM pgbroker.interest WHERE watch_id = 1 AND row_key = 'null'::jsonb)
          INTO v_large, v_whole;
        IF NOT v_large AND NOT v_whole THEN

        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT z.name, z.epoch, 1, z.op, z.row_key, z.changed, z.clients
          FROM (SELECT i.name, i.epoch, i.lock_key, i.clients, k.op, k.row_key, k.changed
                  FROM (SELECT 'D'::"char" AS op, to_jsonb(o.id) AS row_key, NULL::text[] AS changed FROM pgbroker_old o OFFSET 0) k
                 CROSS JOIN LATERAL (
                       -- An index probe per change, whatever the size the plan was made for
                       -- (a hash of the table's interest rows would then serve every later call).
                       SELECT j.name, j.epoch, j.lock_key, j.clients FROM pgbroker.interest j
                        WHERE j.watch_id = 1 AND j.row_key = k.row_key OFFSET 0) i
                OFFSET 0) z  -- the test below runs on the rows to write, never on an interest scan
         WHERE CASE
            WHEN NOT pg_try_advisory_xact_lock_shared(pgbroker._lock_class_drain(), pgbroker._lock_gate(z.lock_key))
                THEN pgbroker._epoch_alive(z.lock_key, z.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || z.lock_key, z.name)) = 0
            WHEN pg_try_advisory_lock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(z.epoch))
                THEN pg_advisory_unlock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(z.epoch))
                     AND pgbroker._epoch_alive(z.lock_key, z.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || z.lock_key, z.name)) = 0
            ELSE true
        END;
        ELSE
            v_jit := current_setting('jit');
            PERFORM set_config('jit', 'off', true);
            IF v_whole THEN

        WITH whole AS MATERIALIZED (
            SELECT i.name, i.epoch, i.lock_key, i.clients
              FROM pgbroker.interest i
             WHERE i.watch_id = 1 AND i.row_key = 'null'::jsonb)
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT t.name, t.epoch, 1, k.op, k.row_key, k.changed, t.clients
          FROM (SELECT 'D'::"char" AS op, to_jsonb(o.id) AS row_key, NULL::text[] AS changed FROM pgbroker_old o OFFSET 0) k
         CROSS JOIN LATERAL (
               -- Subscribers of the row, with the whole-table ones of the same broker ...
               SELECT r.name, r.epoch, r.lock_key,
                      CASE WHEN w.clients IS NULL THEN r.clients
                           ELSE ARRAY(SELECT DISTINCT c FROM unnest(r.clients || w.clients) AS c ORDER BY 1) END
                 FROM pgbroker.interest r
                 LEFT JOIN whole w ON w.name = r.name AND w.epoch = r.epoch
                WHERE r.watch_id = 1 AND r.row_key = k.row_key
               UNION ALL
               -- ... and the whole-table ones of brokers with no subscriber of the row.
               SELECT w.name, w.epoch, w.lock_key, w.clients
                 FROM whole w
                WHERE NOT EXISTS (SELECT FROM pgbroker.interest r
                                   WHERE r.watch_id = 1 AND r.row_key = k.row_key AND r.name = w.name
                                     AND r.epoch = w.epoch)
               ) AS t (name, epoch, lock_key, clients)
         WHERE CASE
            WHEN NOT pg_try_advisory_xact_lock_shared(pgbroker._lock_class_drain(), pgbroker._lock_gate(t.lock_key))
                THEN pgbroker._epoch_alive(t.lock_key, t.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || t.lock_key, t.name)) = 0
            WHEN pg_try_advisory_lock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(t.epoch))
                THEN pg_advisory_unlock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(t.epoch))
                     AND pgbroker._epoch_alive(t.lock_key, t.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || t.lock_key, t.name)) = 0
            ELSE true
        END;
            ELSE
                EXECUTE '
        WITH live AS MATERIALIZED (
            SELECT l.name, l.epoch FROM pgbroker.lease l
             WHERE l.state = ''held'' AND l.expires_at IS NULL
               AND CASE WHEN EXISTS (SELECT FROM pgbroker.interest j
                                      WHERE j.watch_id = 1 AND j.name = l.name AND j.epoch = l.epoch)
                        THEN CASE
            WHEN NOT pg_try_advisory_xact_lock_shared(pgbroker._lock_class_drain(), pgbroker._lock_gate(l.lock_key))
                THEN pgbroker._epoch_alive(l.lock_key, l.epoch)
                     AND num_nulls(pg_notify(''pgbroker_wakeup_'' || l.lock_key, l.name)) = 0
            WHEN pg_try_advisory_lock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(l.epoch))
                THEN pg_advisory_unlock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(l.epoch))
                     AND pgbroker._epoch_alive(l.lock_key, l.epoch)
                     AND num_nulls(pg_notify(''pgbroker_wakeup_'' || l.lock_key, l.name)) = 0
            ELSE true
        END END)
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT z.name, z.epoch, 1, z.op, z.row_key, z.changed, z.clients
          FROM (SELECT i.name, i.epoch, i.clients, k.op, k.row_key, NULL::text[] AS changed
                  FROM (SELECT ''D''::"char" AS op, to_jsonb(o.id) AS row_key FROM pgbroker_old o OFFSET 0) k
                  JOIN pgbroker.interest i ON i.watch_id = 1 AND i.row_key = k.row_key
                  JOIN live ON live.name = i.name AND live.epoch = i.epoch
                OFFSET 0) z  -- compared after the join: only subscribed rows'' columns
         WHERE z.op <> ''U'' OR cardinality(z.changed) > 0';
            END IF;
            PERFORM set_config('jit', v_jit, true);
        END IF;
    ELSE

        -- A subscribe() is under way, or the snapshot may predate one: every
        -- live broker gets the changes, their clients resolved when fetched.
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT l.name, l.epoch, 1, l.op, l.row_key, l.changed, NULL
          FROM (SELECT b.name, b.epoch, b.lock_key, k.op, k.row_key, k.changed
                  FROM (SELECT 'D'::"char" AS op, to_jsonb(o.id) AS row_key, NULL::text[] AS changed FROM pgbroker_old o OFFSET 0) k
                 CROSS JOIN pgbroker.lease b
                 WHERE b.state = 'held' AND b.expires_at IS NULL
                OFFSET 0) l
         WHERE CASE
            WHEN NOT pg_try_advisory_xact_lock_shared(pgbroker._lock_class_drain(), pgbroker._lock_gate(l.lock_key))
                THEN pgbroker._epoch_alive(l.lock_key, l.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || l.lock_key, l.name)) = 0
            WHEN pg_try_advisory_lock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(l.epoch))
                THEN pg_advisory_unlock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(l.epoch))
                     AND pgbroker._epoch_alive(l.lock_key, l.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || l.lock_key, l.name)) = 0
            ELSE true
        END;
    END IF;
    RETURN NULL;
END
$function$;

-- ---------------------------------------------------------------------------
-- _pgbroker_watch_trunc

CREATE TRIGGER _pgbroker_watch_trunc AFTER TRUNCATE ON initech.objects FOR EACH STATEMENT EXECUTE FUNCTION pgbroker._watch_1_trunc();

CREATE OR REPLACE FUNCTION pgbroker._watch_1_trunc()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_jit text := current_setting('jit');
BEGIN
    IF pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), pgbroker._lock_gate(1))
       AND current_setting('transaction_isolation') = 'read committed' THEN
        PERFORM set_config('jit', 'off', true);  -- the estimate grows with the table's interest rows
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT t.name, t.epoch, 1, 'T', NULL, NULL, t.clients
          FROM (SELECT i.name, i.epoch, min(i.lock_key) AS lock_key,
                       ARRAY(SELECT DISTINCT c FROM pgbroker.interest j, unnest(j.clients) AS c
                              WHERE j.watch_id = 1 AND j.name = i.name AND j.epoch = i.epoch ORDER BY 1) AS clients
                  FROM pgbroker.interest i
                 WHERE i.watch_id = 1
                 GROUP BY i.name, i.epoch) t
         WHERE CASE
            WHEN NOT pg_try_advisory_xact_lock_shared(pgbroker._lock_class_drain(), pgbroker._lock_gate(t.lock_key))
                THEN pgbroker._epoch_alive(t.lock_key, t.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || t.lock_key, t.name)) = 0
            WHEN pg_try_advisory_lock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(t.epoch))
                THEN pg_advisory_unlock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(t.epoch))
                     AND pgbroker._epoch_alive(t.lock_key, t.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || t.lock_key, t.name)) = 0
            ELSE true
        END;
        PERFORM set_config('jit', v_jit, true);
    ELSE
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT l.name, l.epoch, 1, 'T', NULL, NULL, NULL
          FROM pgbroker.lease l
         WHERE l.state = 'held' AND l.expires_at IS NULL
           AND CASE
            WHEN NOT pg_try_advisory_xact_lock_shared(pgbroker._lock_class_drain(), pgbroker._lock_gate(l.lock_key))
                THEN pgbroker._epoch_alive(l.lock_key, l.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || l.lock_key, l.name)) = 0
            WHEN pg_try_advisory_lock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(l.epoch))
                THEN pg_advisory_unlock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key(l.epoch))
                     AND pgbroker._epoch_alive(l.lock_key, l.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || l.lock_key, l.name)) = 0
            ELSE true
        END;
    END IF;
    RETURN NULL;
END
$function$;
