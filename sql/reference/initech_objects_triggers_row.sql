-- Reference rendering (generated; do not edit): what pgbroker.watch('initech.objects', mode => 'row') installs.
--
-- The templates are in sql/600_triggers.sql; tests/test_reference_rendering.py
-- renders them on a fresh install and compares with this file.  After changing
-- the templates: PGBROKER_UPDATE_REFERENCE=1 python -m pytest tests/test_reference_rendering.py

-- ---------------------------------------------------------------------------
-- _pgbroker_watch_ins

CREATE TRIGGER _pgbroker_watch_ins AFTER INSERT ON initech.objects FOR EACH ROW EXECUTE FUNCTION pgbroker._watch_1_ins();

CREATE OR REPLACE FUNCTION pgbroker._watch_1_ins()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
        IF pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), pgbroker._lock_gate(1))
           AND current_setting('transaction_isolation') = 'read committed' THEN
            IF NOT EXISTS (SELECT FROM pgbroker.interest WHERE watch_id = 1 AND row_key = 'null'::jsonb) THEN
                INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
                SELECT z.name, z.epoch, 1, z.op, z.row_key, z.changed, z.clients
                  FROM (SELECT i.name, i.epoch, i.lock_key, i.clients, k.op, k.row_key, k.changed
                          FROM (SELECT 'I'::"char" AS op, to_jsonb(NEW.id) AS row_key, NULL::text[] AS changed) k
                          JOIN pgbroker.interest i ON i.watch_id = 1 AND i.row_key = k.row_key
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

        WITH whole AS MATERIALIZED (
            SELECT i.name, i.epoch, i.lock_key, i.clients
              FROM pgbroker.interest i
             WHERE i.watch_id = 1 AND i.row_key = 'null'::jsonb)
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT t.name, t.epoch, 1, k.op, k.row_key, k.changed, t.clients
          FROM (SELECT 'I'::"char" AS op, to_jsonb(NEW.id) AS row_key, NULL::text[] AS changed OFFSET 0) k
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
            END IF;
        ELSE

        -- A subscribe() is under way, or the snapshot may predate one: every
        -- live broker gets the changes, their clients resolved when fetched.
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT l.name, l.epoch, 1, l.op, l.row_key, l.changed, NULL
          FROM (SELECT b.name, b.epoch, b.lock_key, k.op, k.row_key, k.changed
                  FROM (SELECT 'I'::"char" AS op, to_jsonb(NEW.id) AS row_key, NULL::text[] AS changed OFFSET 0) k
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

CREATE TRIGGER _pgbroker_watch_upd AFTER UPDATE ON initech.objects FOR EACH ROW EXECUTE FUNCTION pgbroker._watch_1_upd();

CREATE OR REPLACE FUNCTION pgbroker._watch_1_upd()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF NEW.id = OLD.id THEN
        IF pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), pgbroker._lock_gate(1))
           AND current_setting('transaction_isolation') = 'read committed' THEN
            IF NOT EXISTS (SELECT FROM pgbroker.interest WHERE watch_id = 1 AND row_key = 'null'::jsonb) THEN
                INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
                SELECT z.name, z.epoch, 1, z.op, z.row_key, z.changed, z.clients
                  FROM (SELECT i.name, i.epoch, i.lock_key, i.clients, k.op, k.row_key, k.changed
                          FROM (SELECT 'U'::"char" AS op, to_jsonb(NEW.id) AS row_key, c.changed FROM (SELECT array_remove(ARRAY[CASE WHEN NEW.id IS DISTINCT FROM OLD.id THEN 'id' END, CASE WHEN NEW.kind IS DISTINCT FROM OLD.kind THEN 'kind' END, CASE WHEN NEW.name IS DISTINCT FROM OLD.name THEN 'name' END, CASE WHEN NEW.config IS DISTINCT FROM OLD.config THEN 'config' END, CASE WHEN NEW.updated_at IS DISTINCT FROM OLD.updated_at THEN 'updated_at' END]::text[], NULL) AS changed) c
                                   WHERE cardinality(c.changed) > 0) k
                          JOIN pgbroker.interest i ON i.watch_id = 1 AND i.row_key = k.row_key
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

        WITH whole AS MATERIALIZED (
            SELECT i.name, i.epoch, i.lock_key, i.clients
              FROM pgbroker.interest i
             WHERE i.watch_id = 1 AND i.row_key = 'null'::jsonb)
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT t.name, t.epoch, 1, k.op, k.row_key, k.changed, t.clients
          FROM (SELECT 'U'::"char" AS op, to_jsonb(NEW.id) AS row_key, c.changed FROM (SELECT array_remove(ARRAY[CASE WHEN NEW.id IS DISTINCT FROM OLD.id THEN 'id' END, CASE WHEN NEW.kind IS DISTINCT FROM OLD.kind THEN 'kind' END, CASE WHEN NEW.name IS DISTINCT FROM OLD.name THEN 'name' END, CASE WHEN NEW.config IS DISTINCT FROM OLD.config THEN 'config' END, CASE WHEN NEW.updated_at IS DISTINCT FROM OLD.updated_at THEN 'updated_at' END]::text[], NULL) AS changed) c
                                   WHERE cardinality(c.changed) > 0 OFFSET 0) k
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
            END IF;
        ELSE

        -- A subscribe() is under way, or the snapshot may predate one: every
        -- live broker gets the changes, their clients resolved when fetched.
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT l.name, l.epoch, 1, l.op, l.row_key, l.changed, NULL
          FROM (SELECT b.name, b.epoch, b.lock_key, k.op, k.row_key, k.changed
                  FROM (SELECT 'U'::"char" AS op, to_jsonb(NEW.id) AS row_key, c.changed FROM (SELECT array_remove(ARRAY[CASE WHEN NEW.id IS DISTINCT FROM OLD.id THEN 'id' END, CASE WHEN NEW.kind IS DISTINCT FROM OLD.kind THEN 'kind' END, CASE WHEN NEW.name IS DISTINCT FROM OLD.name THEN 'name' END, CASE WHEN NEW.config IS DISTINCT FROM OLD.config THEN 'config' END, CASE WHEN NEW.updated_at IS DISTINCT FROM OLD.updated_at THEN 'updated_at' END]::text[], NULL) AS changed) c
                                   WHERE cardinality(c.changed) > 0 OFFSET 0) k
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
    ELSE
        -- A key change: a D of the old key and an I of the new one.
        IF pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), pgbroker._lock_gate(1))
           AND current_setting('transaction_isolation') = 'read committed' THEN
            IF NOT EXISTS (SELECT FROM pgbroker.interest WHERE watch_id = 1 AND row_key = 'null'::jsonb) THEN
                INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
                SELECT z.name, z.epoch, 1, z.op, z.row_key, z.changed, z.clients
                  FROM (SELECT i.name, i.epoch, i.lock_key, i.clients, k.op, k.row_key, k.changed
                          FROM (SELECT * FROM (VALUES ('D'::"char", to_jsonb(OLD.id), NULL::text[]), ('I', to_jsonb(NEW.id), NULL))
                                     AS c (op, row_key, changed)) k
                          JOIN pgbroker.interest i ON i.watch_id = 1 AND i.row_key = k.row_key
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

        WITH whole AS MATERIALIZED (
            SELECT i.name, i.epoch, i.lock_key, i.clients
              FROM pgbroker.interest i
             WHERE i.watch_id = 1 AND i.row_key = 'null'::jsonb)
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT t.name, t.epoch, 1, k.op, k.row_key, k.changed, t.clients
          FROM (SELECT * FROM (VALUES ('D'::"char", to_jsonb(OLD.id), NULL::text[]), ('I', to_jsonb(NEW.id), NULL))
                                     AS c (op, row_key, changed) OFFSET 0) k
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
            END IF;
        ELSE

        -- A subscribe() is under way, or the snapshot may predate one: every
        -- live broker gets the changes, their clients resolved when fetched.
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT l.name, l.epoch, 1, l.op, l.row_key, l.changed, NULL
          FROM (SELECT b.name, b.epoch, b.lock_key, k.op, k.row_key, k.changed
                  FROM (SELECT * FROM (VALUES ('D'::"char", to_jsonb(OLD.id), NULL::text[]), ('I', to_jsonb(NEW.id), NULL))
                                     AS c (op, row_key, changed) OFFSET 0) k
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
    END IF;
    RETURN NULL;
END
$function$;

-- ---------------------------------------------------------------------------
-- _pgbroker_watch_del

CREATE TRIGGER _pgbroker_watch_del AFTER DELETE ON initech.objects FOR EACH ROW EXECUTE FUNCTION pgbroker._watch_1_del();

CREATE OR REPLACE FUNCTION pgbroker._watch_1_del()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
        IF pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), pgbroker._lock_gate(1))
           AND current_setting('transaction_isolation') = 'read committed' THEN
            IF NOT EXISTS (SELECT FROM pgbroker.interest WHERE watch_id = 1 AND row_key = 'null'::jsonb) THEN
                INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
                SELECT z.name, z.epoch, 1, z.op, z.row_key, z.changed, z.clients
                  FROM (SELECT i.name, i.epoch, i.lock_key, i.clients, k.op, k.row_key, k.changed
                          FROM (SELECT 'D'::"char" AS op, to_jsonb(OLD.id) AS row_key, NULL::text[] AS changed) k
                          JOIN pgbroker.interest i ON i.watch_id = 1 AND i.row_key = k.row_key
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

        WITH whole AS MATERIALIZED (
            SELECT i.name, i.epoch, i.lock_key, i.clients
              FROM pgbroker.interest i
             WHERE i.watch_id = 1 AND i.row_key = 'null'::jsonb)
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT t.name, t.epoch, 1, k.op, k.row_key, k.changed, t.clients
          FROM (SELECT 'D'::"char" AS op, to_jsonb(OLD.id) AS row_key, NULL::text[] AS changed OFFSET 0) k
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
            END IF;
        ELSE

        -- A subscribe() is under way, or the snapshot may predate one: every
        -- live broker gets the changes, their clients resolved when fetched.
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT l.name, l.epoch, 1, l.op, l.row_key, l.changed, NULL
          FROM (SELECT b.name, b.epoch, b.lock_key, k.op, k.row_key, k.changed
                  FROM (SELECT 'D'::"char" AS op, to_jsonb(OLD.id) AS row_key, NULL::text[] AS changed OFFSET 0) k
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
