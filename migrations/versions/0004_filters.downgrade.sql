-- Undo pgbroker_0004_filters.
-- Drafted by migrations/new_revision.py from sql/, with the hand-written blocks marked below.

-- ---------------------------------------------------------------------------
-- Hand-written (begin): before the functions.  Subscriptions by filter go
-- (their points are keys no row has), and the tables with filters get
-- their trigger functions back without them, rendered by the functions of
-- this revision (the table's lock, as watch() takes it), before those are
-- replaced below by the previous revision's.
SET LOCAL check_function_bodies = off;
-- The writers' triggers of this revision hold a gate of a table's watch
-- lock and of its brokers' drain locks; the previous revision's
-- subscribe() and broker_sleep() wait for the keys themselves only.  So
-- first every gate, to commit: writers holding one commit first, later
-- ones find theirs taken and take the conservative paths (clients resolved
-- at fetch, a NOTIFY) until the previous revision's functions are in place.
SELECT count(pg_advisory_xact_lock(pgbroker._lock_class_watch(), pgbroker._lock_gate_key(w.watch_id, g)))
  FROM (SELECT watch_id FROM pgbroker.watched ORDER BY watch_id) w, generate_series(0, pgbroker._lock_gates() - 1) g;
SELECT count(pg_advisory_xact_lock(pgbroker._lock_class_drain(), pgbroker._lock_gate_key(l.lock_key, g)))
  FROM (SELECT lock_key FROM pgbroker.lease ORDER BY lock_key) l, generate_series(0, pgbroker._lock_gates() - 1) g;
DELETE FROM pgbroker.filter_shape;   -- the trigger _600_render renders nothing on a DELETE
SELECT pgbroker._watch_lock_table(w.relid::regclass, NULL), pgbroker._watch_create_functions(w)
  FROM pgbroker.watched w
 WHERE EXISTS (SELECT FROM pgbroker.subscription s WHERE s.watch_id = w.watch_id AND jsonb_typeof(s.row_key) = 'object')
 ORDER BY w.watch_id;
DELETE FROM pgbroker.subscription s WHERE jsonb_typeof(s.row_key) = 'object';
DELETE FROM pgbroker.interest i WHERE jsonb_typeof(i.row_key) = 'object';
ALTER TABLE pgbroker.interest DROP COLUMN range_box, SET (fillfactor = 70);  -- and its index interest_range
DROP TRIGGER _600_render ON pgbroker.filter_shape;
DROP TABLE pgbroker.filter_shape;
-- The view subscriptions without its column filter (DROP and CREATE: its grants and comments again).
SELECT set_config('pgbroker.downgrade_grants',
                  coalesce((SELECT string_agg(format('GRANT %s ON pgbroker.subscriptions TO %I;', a.privilege_type,
                                                     pg_get_userbyid(a.grantee)), ' ' ORDER BY a.grantee, a.privilege_type)
                              FROM pg_catalog.pg_class c, aclexplode(c.relacl) a
                             WHERE c.oid = 'pgbroker.subscriptions'::regclass AND a.grantee NOT IN (0, c.relowner)), ''),
                  true);
DROP VIEW pgbroker.subscriptions;
CREATE VIEW pgbroker.subscriptions AS
SELECT c.name, c.client_id, w.relid::regclass AS "table",
       CASE WHEN s.row_key = 'null'::jsonb THEN NULL ELSE s.row_key END AS key, s.subscribed_at
  FROM (SELECT l.name, l.epoch FROM pgbroker.lease l
         WHERE CASE WHEN (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'lease')
                          OR pgbroker.name_allowed('lease', l.name)) THEN pgbroker.broker_alive(l.name) END
        OFFSET 0) l  -- once per lease
  JOIN pgbroker.client c ON c.name = l.name AND c.epoch = l.epoch
  JOIN pgbroker.subscription s ON s.client_key = c.client_key
  JOIN pgbroker.watched w ON w.watch_id = s.watch_id;
COMMENT ON VIEW pgbroker.subscriptions IS 'Who is subscribed to what: the clients of live brokers, as in the view clients.';
COMMENT ON COLUMN pgbroker.subscriptions.name IS 'Broker (lease name) of the client.';
COMMENT ON COLUMN pgbroker.subscriptions.client_id IS 'The client.';
COMMENT ON COLUMN pgbroker.subscriptions."table" IS 'The watched table.';
COMMENT ON COLUMN pgbroker.subscriptions.key IS 'The row key (jsonb), NULL for a whole-table subscription.';
COMMENT ON COLUMN pgbroker.subscriptions.subscribed_at IS 'When.';
REVOKE ALL ON pgbroker.subscriptions FROM PUBLIC;
DO $grants$ BEGIN EXECUTE current_setting('pgbroker.downgrade_grants'); END $grants$;
-- Hand-written (end).
-- ---------------------------------------------------------------------------

DROP FUNCTION pgbroker._filter_max_points();
DROP FUNCTION pgbroker._filter_max_shapes();
DROP FUNCTION pgbroker._filter_points(pgbroker.watched,jsonb[],boolean);
DROP FUNCTION pgbroker._filter_shapes_add(pgbroker.watched,jsonb[],interval);
DROP FUNCTION pgbroker._filter_shapes_render();
DROP FUNCTION pgbroker._filter_where(boolean,bigint);
DROP FUNCTION pgbroker._subscribe_filters(text,bigint,text[],pgbroker.watched,jsonb[],interval,boolean);
DROP FUNCTION pgbroker._subscribe_pairs(text,bigint,text[],pgbroker.watched,jsonb[],interval,integer[]);
DROP FUNCTION pgbroker._watch_create_functions(pgbroker.watched);
DROP FUNCTION pgbroker._watch_ffanout_template();
DROP FUNCTION pgbroker._watch_filtered_statement_template();
DROP FUNCTION pgbroker._watch_filtered_template();
DROP FUNCTION pgbroker._watch_funresolved_template();
DROP FUNCTION pgbroker._watch_points(pgbroker.watched,text);
DROP FUNCTION pgbroker._watch_shapes(pgbroker.watched);
DROP FUNCTION pgbroker.subscribe(text,regclass,jsonb,text,bigint,interval,jsonb);
DROP FUNCTION pgbroker.subscribe_filters(text[],regclass,jsonb[],text,bigint,interval);
DROP FUNCTION pgbroker.unsubscribe(text,regclass,jsonb,text,bigint,jsonb);
DROP FUNCTION pgbroker._filter_keys(integer,jsonb[]);
DROP FUNCTION pgbroker._filter_ranges(pgbroker.watched,bigint[],text[],jsonb[],boolean);
DROP FUNCTION pgbroker._range_box(integer,jsonb);
DROP FUNCTION pgbroker._range_class(regtype);
DROP FUNCTION pgbroker._range_float(text,text);
DROP FUNCTION pgbroker._range_hash(integer,jsonb);
DROP FUNCTION pgbroker._range_holds(jsonb,text,jsonb);
DROP FUNCTION pgbroker._range_probe(integer,jsonb);
DROP FUNCTION pgbroker._range_matches(jsonb,jsonb);
DROP FUNCTION pgbroker._lock_gate(integer);
DROP FUNCTION pgbroker._lock_gate_key(integer,integer);
DROP FUNCTION pgbroker._lock_gates();
CREATE OR REPLACE FUNCTION pgbroker.subscribe(client_id text, "table" regclass, key jsonb DEFAULT NULL::jsonb, name text DEFAULT 'default'::text, epoch bigint DEFAULT NULL::bigint, wait interval DEFAULT '00:00:05'::interval)
 RETURNS boolean
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_name text := pgbroker._check_name(subscribe.name);
    v_epoch bigint := pgbroker._acting_epoch(v_name, subscribe.epoch);
    v_client bigint := pgbroker._client_key(v_name, v_epoch, subscribe.client_id);
    v_watch pgbroker.watched := pgbroker._watch_of(subscribe."table");
    v_key jsonb := pgbroker._encode_key(v_watch, subscribe.key);
BEGIN
    PERFORM pgbroker._subscribe_lock(v_watch, subscribe."table", subscribe.wait);
    INSERT INTO pgbroker.subscription (client_key, watch_id, row_key)
    VALUES (v_client, v_watch.watch_id, v_key)
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO pgbroker.interest AS i (watch_id, row_key, name, epoch, lock_key, clients)
    VALUES (v_watch.watch_id, v_key, v_name, v_epoch, (SELECT l.lock_key FROM pgbroker.lease l WHERE l.name = v_name),
            ARRAY[subscribe.client_id])
    ON CONFLICT ON CONSTRAINT interest_pkey DO UPDATE SET clients = i.clients || subscribe.client_id;
    IF pgbroker._registry_watched(v_name) THEN
        PERFORM pg_notify('pgbroker_registry_' || md5(v_name),
                          pgbroker._registry_subscription_event('subscribe', v_name, v_epoch, subscribe.client_id,
                                                                v_watch.relid::regclass::text, v_key));
    END IF;
    RETURN true;
END
$function$;
COMMENT ON FUNCTION pgbroker.subscribe(text,regclass,jsonb,text,bigint,interval) IS 'Holder only: subscribe client CLIENT_ID to the row of watched TABLE whose primary key is KEY (jsonb: a scalar for a
one-column key, an array in key order for a composite one), or to the whole table when KEY is NULL.
No gap: once it returns, every change that commits later is in the outbox, so a client that subscribes and then reads
the row misses nothing. Waits up to WAIT for writer transactions already past their trigger (PB022 after that);
writers never wait for it. Returns false when the subscription existed. PB010 unknown client, PB021 table not watched, 22023 bad key.';
REVOKE ALL ON FUNCTION pgbroker.subscribe(text,regclass,jsonb,text,bigint,interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgbroker.subscribe(text,regclass,jsonb,text,bigint,interval) TO pgbroker_broker;
CREATE OR REPLACE FUNCTION pgbroker.unsubscribe(client_id text, "table" regclass, key jsonb DEFAULT NULL::jsonb, name text DEFAULT 'default'::text, epoch bigint DEFAULT NULL::bigint)
 RETURNS boolean
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_name text := pgbroker._check_name(unsubscribe.name);
    v_epoch bigint := pgbroker._acting_epoch(v_name, unsubscribe.epoch);
    v_client bigint := pgbroker._client_key(v_name, v_epoch, unsubscribe.client_id);
    v_watch pgbroker.watched := pgbroker._watch_of(unsubscribe."table");
    v_key jsonb := pgbroker._encode_key(v_watch, unsubscribe.key);
BEGIN
    DELETE FROM pgbroker.subscription s
     WHERE s.client_key = v_client AND s.watch_id = v_watch.watch_id AND s.row_key = v_key;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM pgbroker._interest_shrink(ARRAY[v_watch.watch_id], ARRAY[v_key], ARRAY[v_name], ARRAY[v_epoch],
                                      ARRAY[unsubscribe.client_id]);
    IF pgbroker._registry_watched(v_name) THEN
        PERFORM pg_notify('pgbroker_registry_' || md5(v_name),
                          pgbroker._registry_subscription_event('unsubscribe', v_name, v_epoch, unsubscribe.client_id,
                                                                v_watch.relid::regclass::text, v_key));
    END IF;
    RETURN true;
END
$function$;
COMMENT ON FUNCTION pgbroker.unsubscribe(text,regclass,jsonb,text,bigint) IS 'Holder only: drop the subscription of CLIENT_ID to KEY of TABLE (NULL: the whole-table one); false when there was none.';
REVOKE ALL ON FUNCTION pgbroker.unsubscribe(text,regclass,jsonb,text,bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgbroker.unsubscribe(text,regclass,jsonb,text,bigint) TO pgbroker_broker;
DROP FUNCTION pgbroker._outbox_fetch_departed(text,bigint,bigint,integer,bigint[]);  -- its result type changed: dropped and created again
CREATE OR REPLACE FUNCTION pgbroker._outbox_fetch_departed(p_name text, p_epoch bigint, p_floor bigint, p_max_rows integer, p_ack bigint[])
 RETURNS TABLE(id bigint, "table" text, op text, key jsonb, changed text[], clients text[], at timestamp with time zone)
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_upto bigint;
BEGIN
    DELETE FROM pgbroker.outbox_departed d WHERE d.name = p_name AND d.epoch = p_epoch AND d.last_id <= p_floor;
    SELECT max(d.last_id) INTO v_upto FROM pgbroker.outbox_departed d WHERE d.name = p_name AND d.epoch = p_epoch;
    RETURN QUERY
    WITH acked AS (
        DELETE FROM pgbroker.outbox b
         WHERE b.name = p_name AND b.epoch = p_epoch AND b.id = ANY (p_ack)
    ), batch AS MATERIALIZED (
        SELECT o.id, o.watch_id, o.op, o.row_key, o.changed, o.at,
               CASE WHEN o.id > v_upto THEN o.clients
                    ELSE ARRAY(SELECT x.c FROM unnest(o.clients) WITH ORDINALITY AS x(c, n)
                                WHERE NOT EXISTS (SELECT FROM pgbroker.outbox_departed d
                                                   WHERE d.name = p_name AND d.epoch = p_epoch AND d.client_id = x.c
                                                     AND d.last_id >= o.id)
                                ORDER BY x.n) END AS clients
          FROM pgbroker.outbox o
         WHERE o.name = p_name AND o.epoch = p_epoch AND o.id > p_floor
           AND (p_ack IS NULL OR o.id <> ALL (p_ack))
           AND o.id < COALESCE((SELECT min(u.id) FROM pgbroker.outbox u
                                 WHERE u.name = p_name AND u.epoch = p_epoch AND u.clients IS NULL),
                               9223372036854775807)
         ORDER BY o.id
         LIMIT p_max_rows
    ), emptied AS (
        DELETE FROM pgbroker.outbox e
         WHERE e.name = p_name AND e.epoch = p_epoch AND e.id = ANY (ARRAY(SELECT b.id FROM batch b WHERE b.clients = '{}'))
    )
    SELECT b.id, (SELECT w.relid::regclass::text FROM pgbroker.watched w WHERE w.watch_id = b.watch_id),
           b.op::text, b.row_key, b.changed, b.clients, b.at
      FROM batch b
     WHERE b.clients <> '{}'
     ORDER BY b.id;
END
$function$;
COMMENT ON FUNCTION pgbroker._outbox_fetch_departed(text,bigint,bigint,integer,bigint[]) IS 'Internal: outbox_fetch() while clients departed (pgbroker.outbox_departed): the rows without them, those left with nobody deleted.';
REVOKE ALL ON FUNCTION pgbroker._outbox_fetch_departed(text,bigint,bigint,integer,bigint[]) FROM PUBLIC;
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
CREATE OR REPLACE FUNCTION pgbroker._watch_function_body(p_watch pgbroker.watched, p_kind text)
 RETURNS text
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_slots jsonb := pgbroker._watch_slots(p_watch);
    v_body text;
    v_fanout text;
    v_row text;
BEGIN
    IF p_kind = 'trunc' THEN
        v_body := pgbroker._watch_truncate_template();  -- a statement trigger in both modes
    ELSIF p_watch.mode = 'row' THEN
        -- The statements first (their own slots are filled below) ...
        v_fanout := replace(replace(pgbroker._watch_row_fanout_template(), '{{merged}}', pgbroker._watch_merged_template()),
                            '{{unresolved}}', pgbroker._watch_unresolved_template());
        v_body := replace(pgbroker._watch_row_trigger_template(), '{{row_body}}', CASE p_kind
            WHEN 'upd' THEN replace(replace(pgbroker._watch_row_update_template(),
                                            '{{fanout_update}}', replace(v_fanout, '{{changes}}', v_slots ->> 'row_upd_changes')),
                                    '{{fanout_rekey}}', replace(v_fanout, '{{changes}}', v_slots ->> 'row_rekey_changes'))
            ELSE replace(v_fanout, '{{changes}}', v_slots ->> ('row_' || p_kind || '_changes')) END);
    ELSE
        v_body := pgbroker._watch_trigger_template();
        v_body := replace(v_body, '{{fanout}}', pgbroker._watch_fanout_template());
        v_body := replace(v_body, '{{merged}}', pgbroker._watch_merged_template());
        v_body := replace(v_body, '{{unresolved}}', pgbroker._watch_unresolved_template());
        v_body := replace(v_body, '{{bulk_literal}}', quote_literal(
                              pgbroker._render(replace(pgbroker._watch_bulk_template(), '{{alive_and_woken:l}}',
                                                       pgbroker._render(pgbroker._watch_alive_template(), '{"r": "l"}')),
                                               v_slots || jsonb_build_object('keyed', v_slots ->> (p_kind || '_keyed'),
                                                                             'changed_late', v_slots ->> (p_kind || '_changed_late')))));
        v_slots := v_slots || jsonb_build_object('changes', v_slots ->> (p_kind || '_changes'),
                                                 'transition', CASE p_kind WHEN 'del' THEN 'pgbroker_old' ELSE 'pgbroker_new' END);
    END IF;
    -- ... then the liveness tests, then the table's expressions.
    FOREACH v_row IN ARRAY ARRAY['z', 't', 'l'] LOOP
        v_body := replace(v_body, '{{alive_and_woken:' || v_row || '}}',
                          pgbroker._render(pgbroker._watch_alive_template(), jsonb_build_object('r', v_row)));
    END LOOP;
    RETURN pgbroker._render(v_body, v_slots - ARRAY['ins_changes', 'del_changes', 'upd_changes', 'ins_keyed', 'del_keyed',
                                                    'upd_keyed', 'ins_changed_late', 'del_changed_late',
                                                    'upd_changed_late', 'row_ins_changes', 'row_del_changes',
                                                    'row_upd_changes', 'row_rekey_changes']);
END
$function$;
CREATE OR REPLACE FUNCTION pgbroker._watch_install(p_watch pgbroker.watched, p_wait interval)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_table regclass := p_watch.relid::regclass;
    v_kind text;
    v_event text;
    v_transitions text;
    v_fn text;
    -- Keys of a type whose to_jsonb() depends on session settings are
    -- encoded under fixed ones (see _key_settings).
    v_settings text := pgbroker._key_settings(p_watch.key_types);
    -- Whether it owns the table (only an owner may comment on its triggers).
    v_owner boolean := pgbroker._watch_check_rights(v_table,
                           EXISTS (SELECT FROM pg_catalog.pg_trigger t
                                    WHERE t.tgrelid = p_watch.relid AND t.tgname LIKE '\_pgbroker\_watch\_%'));
BEGIN
    PERFORM pgbroker._watch_lock_table(v_table, p_wait);
    PERFORM pgbroker._watch_drop_triggers(p_watch);
    FOR v_kind, v_event, v_transitions IN
        VALUES ('ins', 'INSERT', 'REFERENCING NEW TABLE AS pgbroker_new'),
               ('upd', 'UPDATE', 'REFERENCING OLD TABLE AS pgbroker_old NEW TABLE AS pgbroker_new'),
               ('del', 'DELETE', 'REFERENCING OLD TABLE AS pgbroker_old'),
               ('trunc', 'TRUNCATE', '')
    LOOP
        v_fn := format('pgbroker._watch_%s_%s', p_watch.watch_id, v_kind);
        -- SECURITY DEFINER: writers may not touch pgbroker's tables themselves.
        EXECUTE format('CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER '
                       'SET search_path = pg_catalog, pg_temp%s AS %L',
                       v_fn, CASE WHEN v_kind = 'trunc' THEN '' ELSE v_settings END,
                       pgbroker._watch_function_body(p_watch, v_kind));
        EXECUTE format('COMMENT ON FUNCTION %s() IS %L', v_fn,
                       format('Internal: %s trigger of watched table %s (generated by pgbroker.watch).', v_event, v_table));
        -- Generated functions are internal: nobody calls them but the triggers.
        EXECUTE format('REVOKE ALL ON FUNCTION %s() FROM PUBLIC', v_fn);
        IF p_watch.mode = 'row' AND v_kind <> 'trunc' THEN
            EXECUTE format('CREATE TRIGGER %I AFTER %s ON %s FOR EACH ROW EXECUTE FUNCTION %s()',
                           '_pgbroker_watch_' || v_kind, v_event, v_table, v_fn);
        ELSE
            EXECUTE format('CREATE TRIGGER %I AFTER %s ON %s %s FOR EACH STATEMENT EXECUTE FUNCTION %s()',
                           '_pgbroker_watch_' || v_kind, v_event, v_table, v_transitions, v_fn);
        END IF;
        CONTINUE WHEN NOT v_owner;
        EXECUTE format('COMMENT ON TRIGGER %I ON %s IS %L', '_pgbroker_watch_' || v_kind, v_table,
                       format('pgbroker: tells subscribed clients of %s.',
                              CASE v_kind WHEN 'ins' THEN 'inserted rows' WHEN 'upd' THEN 'updated rows'
                                          WHEN 'del' THEN 'deleted rows' ELSE 'a TRUNCATE' END));
    END LOOP;
END
$function$;
CREATE OR REPLACE FUNCTION pgbroker._watch_slots(p_watch pgbroker.watched)
 RETURNS jsonb
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    r jsonb := pgbroker._watch_exprs(p_watch, 'n', 'o');          -- over the transition tables' rows
    v_changed_k text := pgbroker._watch_exprs(p_watch, '(k.n)', '(k.o)') ->> 'changed';  -- whole rows (bulk)
    r_row jsonb := pgbroker._watch_exprs(p_watch, 'NEW', 'OLD');   -- one row (row mode)
BEGIN
    RETURN jsonb_build_object(
        'watch_id', p_watch.watch_id,
        'ins_changes', format($q$SELECT 'I'::"char" AS op, %s AS row_key, NULL::text[] AS changed FROM pgbroker_new n$q$,
                              r ->> 'new_key'),
        'del_changes', format($q$SELECT 'D'::"char" AS op, %s AS row_key, NULL::text[] AS changed FROM pgbroker_old o$q$,
                              r ->> 'old_key'),
        -- OLD and NEW rows paired by key: a key change is a D and an I, an
        -- UPDATE that changes no column is no change.
        'upd_changes', format($q$SELECT c.op, c.row_key, c.changed FROM (
              SELECT (CASE WHEN %1$s THEN 'I' WHEN %2$s THEN 'D' ELSE 'U' END)::"char" AS op,
                     CASE WHEN %2$s THEN %3$s ELSE %4$s END AS row_key,
                     CASE WHEN %1$s OR %2$s THEN NULL ELSE %5$s END AS changed
                FROM pgbroker_new n FULL JOIN pgbroker_old o ON %6$s) c
             WHERE c.op <> 'U' OR cardinality(c.changed) > 0$q$,
                              r ->> 'old_null', r ->> 'new_null', r ->> 'old_key', r ->> 'new_key', r ->> 'changed',
                              r ->> 'same_key'),
        -- Bulk statements compare the columns of subscribed rows only: the
        -- changes with their whole OLD and NEW rows, and the comparison.
        'ins_keyed', format($q$SELECT 'I'::"char" AS op, %s AS row_key FROM pgbroker_new n$q$, r ->> 'new_key'),
        'del_keyed', format($q$SELECT 'D'::"char" AS op, %s AS row_key FROM pgbroker_old o$q$, r ->> 'old_key'),
        'upd_keyed', format($q$SELECT (CASE WHEN %1$s THEN 'I' WHEN %2$s THEN 'D' ELSE 'U' END)::"char" AS op,
                     CASE WHEN %2$s THEN %3$s ELSE %4$s END AS row_key, n, o
                FROM pgbroker_new n FULL JOIN pgbroker_old o ON %5$s$q$,
                              r ->> 'old_null', r ->> 'new_null', r ->> 'old_key', r ->> 'new_key', r ->> 'same_key'),
        'ins_changed_late', 'NULL::text[]',
        'del_changed_late', 'NULL::text[]',
        'upd_changed_late', format($q$CASE WHEN k.op = 'U' THEN %s END$q$, v_changed_k),
        -- Row mode: the change of one row, over PL/pgSQL's NEW and OLD.
        'row_ins_changes', format($q$SELECT 'I'::"char" AS op, %s AS row_key, NULL::text[] AS changed$q$,
                                  r_row ->> 'new_key'),
        'row_del_changes', format($q$SELECT 'D'::"char" AS op, %s AS row_key, NULL::text[] AS changed$q$,
                                  r_row ->> 'old_key'),
        'row_upd_changes', format($q$SELECT 'U'::"char" AS op, %s AS row_key, c.changed FROM (SELECT %s AS changed) c
                                   WHERE cardinality(c.changed) > 0$q$, r_row ->> 'new_key', r_row ->> 'changed'),
        'row_rekey_changes', format($q$SELECT * FROM (VALUES ('D'::"char", %s, NULL::text[]), ('I', %s, NULL))
                                     AS c (op, row_key, changed)$q$, r_row ->> 'old_key', r_row ->> 'new_key'),
        'same_key', r_row ->> 'same_key');
END
$function$;
DROP FUNCTION pgbroker.outbox_fetch(text,integer,bigint[]);  -- its result type changed: dropped and created again
CREATE OR REPLACE FUNCTION pgbroker.outbox_fetch(name text DEFAULT 'default'::text, max_rows integer DEFAULT 1000, ack bigint[] DEFAULT NULL::bigint[])
 RETURNS TABLE(id bigint, "table" text, op text, key jsonb, changed text[], clients text[], at timestamp with time zone)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET plan_cache_mode TO 'force_generic_plan'
 SET enable_seqscan TO 'off'
 SET enable_bitmapscan TO 'off'
AS $function$
DECLARE
    v_epoch bigint;
    v_unresolved boolean;
    v_floor bigint;
BEGIN
    PERFORM pgbroker._name_check('lease', outbox_fetch.name, true);
    -- The holder's epoch, whether rows await their clients, and the floor
    -- when it has nothing to move (as _outbox_floor's first test: NULL
    -- otherwise, and _outbox_floor runs).
    SELECT l.epoch, EXISTS (SELECT FROM pgbroker.outbox u WHERE u.name = l.name AND u.epoch = l.epoch AND u.clients IS NULL),
           CASE WHEN f.s[1] = l.epoch::text AND cardinality(f.s) = 5
                     AND current_setting('transaction_isolation') = 'read committed'
                     AND CASE WHEN f.s[4] <> '' THEN f.s[4]::xid8 >= pg_snapshot_xmin(pg_current_snapshot())
                              ELSE to_timestamp(nullif(f.s[5], '')::double precision) >= clock_timestamp() - interval '100 ms' END
                THEN f.s[2]::bigint END
      INTO v_epoch, v_unresolved, v_floor
      FROM pgbroker.lease l,
           (SELECT string_to_array(current_setting('pgbroker.outbox_floor', true), ':') AS s) f
     WHERE l.name = outbox_fetch.name AND l.state = 'held' AND l.expires_at IS NULL
       AND l.holder_pid = pg_backend_pid() AND l.holder_backend_start = pgbroker._my_backend_start();
    IF v_epoch IS NULL THEN
        v_epoch := pgbroker._holder_epoch(outbox_fetch.name);  -- raises the error that applies (bad name, PB001)
    END IF;
    IF outbox_fetch.max_rows IS NULL OR outbox_fetch.max_rows < 1 THEN
        RAISE EXCEPTION 'max_rows must be at least 1' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF v_floor IS NULL THEN
        -- First, before this transaction writes anything (see _outbox_floor).
        v_floor := pgbroker._outbox_floor(outbox_fetch.name, v_epoch, true);
    END IF;
    IF v_unresolved THEN
        PERFORM pgbroker._outbox_resolve(outbox_fetch.name, v_epoch);
    END IF;
    -- Rows that may name clients unregistered since: fetched without them (_outbox_fetch_departed).
    IF EXISTS (SELECT FROM pgbroker.outbox_departed d
                WHERE d.name = outbox_fetch.name AND d.epoch = v_epoch AND d.last_id > v_floor) THEN
        RETURN QUERY SELECT * FROM pgbroker._outbox_fetch_departed(outbox_fetch.name, v_epoch, v_floor, outbox_fetch.max_rows,
                                                                   outbox_fetch.ack);
        RETURN;
    END IF;
    RETURN QUERY
    WITH acked AS (  -- the previous batch, acknowledged in the same round trip
        DELETE FROM pgbroker.outbox b
         WHERE b.name = outbox_fetch.name AND b.epoch = v_epoch AND b.id = ANY (outbox_fetch.ack)
    )
    SELECT o.id, (SELECT w.relid::regclass::text FROM pgbroker.watched w WHERE w.watch_id = o.watch_id),
           o.op::text, o.row_key, o.changed, o.clients, o.at
      FROM pgbroker.outbox o
     WHERE o.name = outbox_fetch.name AND o.epoch = v_epoch AND o.id > v_floor
       AND (outbox_fetch.ack IS NULL OR o.id <> ALL (outbox_fetch.ack))
       AND o.id < COALESCE((SELECT min(u.id) FROM pgbroker.outbox u
                             WHERE u.name = outbox_fetch.name AND u.epoch = v_epoch AND u.clients IS NULL),
                           9223372036854775807)
     ORDER BY o.id
     LIMIT outbox_fetch.max_rows;
END
$function$;
COMMENT ON FUNCTION pgbroker.outbox_fetch(text,integer,bigint[]) IS 'Holder only: up to MAX_ROWS pending notifications of lease NAME, oldest first (for any one row: in commit order).
Each: id, table, op (I/U/D/T), key (jsonb, NULL for T), changed (column names, for U), clients (client ids to tell, each
once, never empty), at.
Rows stay until acknowledged, by outbox_ack() or by passing their ids as ACK to the next outbox_fetch() (one round
trip less): at-least-once delivery within the epoch.';
REVOKE ALL ON FUNCTION pgbroker.outbox_fetch(text,integer,bigint[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgbroker.outbox_fetch(text,integer,bigint[]) TO pgbroker_broker;
DROP FUNCTION pgbroker._check_read_committed(text);
CREATE OR REPLACE FUNCTION pgbroker.client_unregister(client_id text, name text DEFAULT 'default'::text, epoch bigint DEFAULT NULL::bigint)
 RETURNS boolean
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_name text := pgbroker._check_name(client_unregister.name);
    v_epoch bigint := pgbroker._acting_epoch(v_name, client_unregister.epoch);
    v_key bigint;
BEGIN
    SELECT client_key INTO v_key FROM pgbroker.client c
     WHERE c.name = v_name AND c.epoch = v_epoch AND c.client_id = client_unregister.client_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    DELETE FROM pgbroker.client WHERE client_key = v_key;   -- subscriptions go with it (400_subscriptions.sql)
    IF pgbroker._registry_watched(v_name) THEN
        PERFORM pg_notify('pgbroker_registry_' || md5(v_name),
                          pgbroker._registry_client_event('unregister', v_name, v_epoch, client_unregister.client_id, NULL));
    END IF;
    RETURN true;
END
$function$;
COMMENT ON FUNCTION pgbroker.client_unregister(text,text,bigint) IS 'Holder only: unregister client CLIENT_ID and drop all its subscriptions; false when it was not registered.';
CREATE OR REPLACE FUNCTION pgbroker.client_unregister_many(client_ids text[], name text DEFAULT 'default'::text, epoch bigint DEFAULT NULL::bigint)
 RETURNS bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_name text := pgbroker._check_name(client_unregister_many.name);
    v_epoch bigint := pgbroker._acting_epoch(v_name, client_unregister_many.epoch);
    v_bad integer;
    v_gone bigint;
    v_watched boolean;
    v_announced bigint;
BEGIN
    PERFORM pgbroker._check_arrays('client_ids', array_ndims(client_unregister_many.client_ids),
                                   cardinality(client_unregister_many.client_ids), NULL, NULL, NULL, true);
    -- The first bad id, with the error the one-row call gives, naming its position.
    SELECT min(u.i) INTO v_bad
      FROM unnest(client_unregister_many.client_ids) WITH ORDINALITY AS u(id, i)
     WHERE u.id IS NULL OR u.id = '' OR octet_length(u.id) > 200;
    IF v_bad IS NOT NULL THEN
        PERFORM pgbroker._check_client_id(client_unregister_many.client_ids[v_bad], format('client_ids[%s]', v_bad));
    END IF;
    v_watched := pgbroker._registry_watched(v_name);
    -- (A FILTER is tested before its aggregate's argument: nothing is
    -- announced while nobody watches.)
    WITH gone AS (
        DELETE FROM pgbroker.client c
         WHERE c.client_key = ANY (ARRAY(
                   SELECT x.client_key
                     FROM (SELECT DISTINCT u.id FROM unnest(client_unregister_many.client_ids) AS u(id)) g
                    CROSS JOIN LATERAL (SELECT k.client_key FROM pgbroker.client k
                                         WHERE k.name = v_name AND k.epoch = v_epoch AND k.client_id = g.id
                                         OFFSET 0) x))
        RETURNING c.client_id
    )
    SELECT count(*),
           sum(num_nulls(pg_notify('pgbroker_registry_' || md5(v_name),
                                   pgbroker._registry_client_event('unregister', v_name, v_epoch, r.client_id, NULL))))
               FILTER (WHERE v_watched)
      INTO v_gone, v_announced
      FROM gone r;
    RETURN v_gone;
END
$function$;
COMMENT ON FUNCTION pgbroker.client_unregister_many(text[],text,bigint) IS 'Holder only: unregister every client of CLIENT_IDS of lease NAME in one statement, with all their subscriptions; returns how many were registered (ids not registered, or given twice, count once or not at all).
As client_unregister() otherwise: from the holder''s session or with the holder''s current EPOCH. 22004 / 22023 for a NULL array or a NULL, empty or too long id, naming its position (client_ids[3]); nothing of the call is kept then.';
CREATE OR REPLACE FUNCTION pgbroker.schema_version()
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$ SELECT '0.1.0+3'::text $function$;
CREATE OR REPLACE FUNCTION pgbroker.subscribe_many(client_ids text[], "table" regclass, keys jsonb[], name text DEFAULT 'default'::text, epoch bigint DEFAULT NULL::bigint, wait interval DEFAULT '00:00:05'::interval)
 RETURNS bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET plan_cache_mode TO 'force_custom_plan'
 SET enable_mergejoin TO 'off'
AS $function$
DECLARE
    v_name text := pgbroker._check_name(subscribe_many.name);
    v_epoch bigint := pgbroker._acting_epoch(v_name, subscribe_many.epoch);
    v_n integer := pgbroker._check_arrays('client_ids', array_ndims(subscribe_many.client_ids),
                                          cardinality(subscribe_many.client_ids), 'keys', array_ndims(subscribe_many.keys),
                                          cardinality(subscribe_many.keys), false);
    v_watch pgbroker.watched := pgbroker._watch_of(subscribe_many."table");
    v_keys jsonb[] := pgbroker._encode_keys(v_watch, subscribe_many.keys);
    v_ids text[];
    v_client_keys bigint[];
    v_fresh boolean[];
    v_bad integer;
    v_new bigint;
    v_watched boolean;
    v_announced bigint;
BEGIN
    -- Each client given, looked up and its row locked (as subscribe() locks
    -- it) once, by an index probe: a batch costs the same whatever the
    -- number of the epoch's clients.  Or the error subscribe() gives for the
    -- first unknown one, naming its position.  A client with no subscription
    -- to the table yet (every client, after a restart) is "fresh": none of
    -- its pairs needs looking for below.
    WITH ids AS (
        SELECT u.id, min(u.i) AS i FROM unnest(subscribe_many.client_ids) WITH ORDINALITY AS u(id, i) GROUP BY u.id
    )
    SELECT min(ids.i) FILTER (WHERE c.client_key IS NULL), array_agg(ids.id), array_agg(c.client_key),
           array_agg(NOT EXISTS (SELECT FROM pgbroker.subscription s
                                  WHERE s.client_key = c.client_key AND s.watch_id = v_watch.watch_id))
      INTO v_bad, v_ids, v_client_keys, v_fresh
      FROM ids
      LEFT JOIN LATERAL (SELECT x.client_key FROM pgbroker.client x
                          WHERE x.name = v_name AND x.epoch = v_epoch AND x.client_id = ids.id
                            FOR KEY SHARE) c ON true;
    IF v_bad IS NOT NULL THEN
        RAISE EXCEPTION 'client "%" (client_ids[%]) is not registered with broker "%"',
                subscribe_many.client_ids[v_bad], v_bad, v_name
            USING ERRCODE = 'PB010', HINT = 'Register it first with pgbroker.client_register() or client_register_many().';
    END IF;
    PERFORM pgbroker._subscribe_lock(v_watch, subscribe_many."table", subscribe_many.wait);
    v_watched := pgbroker._registry_watched(v_name);
    -- One statement, one round of the watch lock, whatever the number: the
    -- pairs not subscribed yet (a pair given twice counts once), inserted,
    -- and their ids appended to the interest of their key.  No ON CONFLICT: subscriptions to a table are only made under
    -- its watch lock, which this transaction holds exclusively, so no other
    -- can insert one of these pairs meanwhile.  (Arrays are read with unnest,
    -- never subscripted: subscripting an array of variable-length values
    -- costs time in proportion to the position.)
    WITH clients AS (
        SELECT k.id, k.client_key, k.fresh FROM unnest(v_ids, v_client_keys, v_fresh) AS k(id, client_key, fresh)
    ), new AS MATERIALIZED (
        SELECT c.client_key, g.id, g.row_key
          FROM (SELECT DISTINCT u.id, u.row_key FROM unnest(subscribe_many.client_ids, v_keys) AS u(id, row_key)) g
          JOIN clients c ON c.id = g.id
          -- an index probe per pair of a client that is not fresh, never a scan of what the table has
          LEFT JOIN LATERAL (SELECT true AS found FROM pgbroker.subscription s
                              WHERE NOT c.fresh
                                AND s.client_key = c.client_key AND s.watch_id = v_watch.watch_id AND s.row_key = g.row_key
                              LIMIT 1) e ON true
         WHERE e.found IS NULL
    ), added AS (
        INSERT INTO pgbroker.subscription (client_key, watch_id, row_key)
        SELECT n.client_key, v_watch.watch_id, n.row_key FROM new n
    ), interest AS (
        INSERT INTO pgbroker.interest AS i (watch_id, row_key, name, epoch, lock_key, clients)
        SELECT v_watch.watch_id, n.row_key, v_name, v_epoch, (SELECT l.lock_key FROM pgbroker.lease l WHERE l.name = v_name),
               array_agg(n.id)
          FROM new n
         GROUP BY n.row_key
        ON CONFLICT ON CONSTRAINT interest_pkey DO UPDATE SET clients = i.clients || excluded.clients
    )
    -- (A FILTER is tested before its aggregate's argument: nothing is
    -- announced while nobody watches.)
    SELECT count(*),
           sum(num_nulls(pg_notify('pgbroker_registry_' || md5(v_name),
                                   pgbroker._registry_subscription_event('subscribe', v_name, v_epoch, n.id,
                                                                         v_watch.relid::regclass::text, n.row_key))))
               FILTER (WHERE v_watched)
      INTO v_new, v_announced
      FROM new n;
    RETURN v_new;
END
$function$;
CREATE OR REPLACE FUNCTION pgbroker.unwatch("table" regclass, wait interval DEFAULT '00:00:05'::interval)
 RETURNS boolean
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_watch pgbroker.watched;
BEGIN
    SELECT * INTO v_watch FROM pgbroker.watched WHERE relid = unwatch."table";
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid = v_watch.relid) THEN
        PERFORM pgbroker._watch_check_rights(v_watch.relid::regclass, true);
        PERFORM pgbroker._watch_lock_table(v_watch.relid::regclass, unwatch.wait);
    END IF;
    PERFORM pgbroker._watch_drop_triggers(v_watch);
    EXECUTE format('DROP FUNCTION pgbroker._watch_%1$s_ins(), pgbroker._watch_%1$s_upd(), '
                   'pgbroker._watch_%1$s_del(), pgbroker._watch_%1$s_trunc()', v_watch.watch_id);
    DELETE FROM pgbroker.outbox WHERE watch_id = v_watch.watch_id;
    DELETE FROM pgbroker.subscription WHERE watch_id = v_watch.watch_id;
    DELETE FROM pgbroker.interest WHERE watch_id = v_watch.watch_id;
    DELETE FROM pgbroker.watched WHERE watch_id = v_watch.watch_id;
    RETURN true;
END
$function$;

-- ---------------------------------------------------------------------------
-- Hand-written (begin): last, the outbox's columns (its lock held to commit).
ALTER TABLE pgbroker.outbox DROP COLUMN left_clients, DROP COLUMN new_points, DROP COLUMN old_points;
-- Hand-written (end).
DROP FUNCTION pgbroker._filter_encoder(oid,text[]);
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

COMMENT ON FUNCTION pgbroker._lock_class_drain() IS 'Internal: ''pgbw''; (class, lease lock_key) is taken shared by writers that wake a broker and exclusively by broker_sleep().';

COMMENT ON FUNCTION pgbroker._lock_class_watch() IS 'Internal: ''pgbs''; (class, watch_id) is try-locked shared by writers'' triggers and taken exclusively by subscribe.';

CREATE OR REPLACE FUNCTION pgbroker._subscribe_lock(p_watch pgbroker.watched, p_table regclass, p_wait interval)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_timeout text := current_setting('lock_timeout');
BEGIN
    IF (SELECT count(*) FROM pg_catalog.pg_trigger t
         WHERE t.tgrelid = p_watch.relid AND t.tgenabled <> 'D'
           AND t.tgname IN ('_pgbroker_watch_ins', '_pgbroker_watch_upd', '_pgbroker_watch_del', '_pgbroker_watch_trunc')) <> 4 THEN
        RAISE EXCEPTION 'the pgbroker triggers of table % are missing or disabled', p_table
            USING ERRCODE = 'PB021', HINT = 'An administrator must call pgbroker.watch() on it again (or ENABLE the triggers).';
    END IF;
    BEGIN
        PERFORM set_config('lock_timeout', pgbroker._wait_ms(p_wait), true);
        PERFORM pg_advisory_xact_lock(pgbroker._lock_class_watch(), p_watch.watch_id);
        PERFORM set_config('lock_timeout', v_timeout, true);
    EXCEPTION WHEN lock_not_available THEN
        RAISE EXCEPTION 'table % is busy: a writer transaction stayed open longer than %', p_watch.table_name, p_wait
            USING ERRCODE = 'PB022', HINT = 'Retry, or pass a longer wait.';
    END;
END
$function$;
COMMENT ON FUNCTION pgbroker._subscribe_lock(pgbroker.watched,regclass,interval) IS 'Internal: check a watched table''s triggers (PB021), then take its watch lock exclusively to commit, waiting at most p_wait for writers (PB022).';
CREATE OR REPLACE FUNCTION pgbroker._watch_alive_template()
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $function$ SELECT $t$CASE
            WHEN NOT pg_try_advisory_xact_lock_shared(pgbroker._lock_class_drain(), {{r}}.lock_key)
                THEN pgbroker._epoch_alive({{r}}.lock_key, {{r}}.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || {{r}}.lock_key, {{r}}.name)) = 0
            WHEN pg_try_advisory_lock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key({{r}}.epoch))
                THEN pg_advisory_unlock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key({{r}}.epoch))
                     AND pgbroker._epoch_alive({{r}}.lock_key, {{r}}.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || {{r}}.lock_key, {{r}}.name)) = 0
            ELSE true
        END$t$
$function$;

CREATE OR REPLACE FUNCTION pgbroker._watch_row_fanout_template()
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $function$ SELECT $t$        IF pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), {{watch_id}})
           AND current_setting('transaction_isolation') = 'read committed' THEN
            IF NOT EXISTS (SELECT FROM pgbroker.interest WHERE watch_id = {{watch_id}} AND row_key = 'null'::jsonb) THEN
                INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
                SELECT z.name, z.epoch, {{watch_id}}, z.op, z.row_key, z.changed, z.clients
                  FROM (SELECT i.name, i.epoch, i.lock_key, i.clients, k.op, k.row_key, k.changed
                          FROM ({{changes}}) k
                          JOIN pgbroker.interest i ON i.watch_id = {{watch_id}} AND i.row_key = k.row_key
                        OFFSET 0) z  -- the test below runs on the rows to write, never on an interest scan
                 WHERE {{alive_and_woken:z}};
            ELSE
{{merged}};
            END IF;
        ELSE
{{unresolved}};
        END IF;$t$
$function$;

CREATE OR REPLACE FUNCTION pgbroker._watch_trigger_template()
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $function$ SELECT $t$
DECLARE
    v_large boolean;
    v_whole boolean;
    v_jit text;
BEGIN
    IF pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), {{watch_id}})
       AND current_setting('transaction_isolation') = 'read committed' THEN
        SELECT EXISTS (SELECT FROM {{transition}} OFFSET 1024),
               EXISTS (SELECT FROM pgbroker.interest WHERE watch_id = {{watch_id}} AND row_key = 'null'::jsonb)
          INTO v_large, v_whole;
        IF NOT v_large AND NOT v_whole THEN
{{fanout}};
        ELSE
            v_jit := current_setting('jit');
            PERFORM set_config('jit', 'off', true);
            IF v_whole THEN
{{merged}};
            ELSE
                EXECUTE {{bulk_literal}};
            END IF;
            PERFORM set_config('jit', v_jit, true);
        END IF;
    ELSE
{{unresolved}};
    END IF;
    RETURN NULL;
END
$t$
$function$;

CREATE OR REPLACE FUNCTION pgbroker._watch_truncate_template()
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $function$ SELECT $t$
DECLARE
    v_jit text := current_setting('jit');
BEGIN
    IF pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), {{watch_id}})
       AND current_setting('transaction_isolation') = 'read committed' THEN
        PERFORM set_config('jit', 'off', true);  -- the estimate grows with the table's interest rows
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT t.name, t.epoch, {{watch_id}}, 'T', NULL, NULL, t.clients
          FROM (SELECT i.name, i.epoch, min(i.lock_key) AS lock_key,
                       ARRAY(SELECT DISTINCT c FROM pgbroker.interest j, unnest(j.clients) AS c
                              WHERE j.watch_id = {{watch_id}} AND j.name = i.name AND j.epoch = i.epoch ORDER BY 1) AS clients
                  FROM pgbroker.interest i
                 WHERE i.watch_id = {{watch_id}}
                 GROUP BY i.name, i.epoch) t
         WHERE {{alive_and_woken:t}};
        PERFORM set_config('jit', v_jit, true);
    ELSE
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT l.name, l.epoch, {{watch_id}}, 'T', NULL, NULL, NULL
          FROM pgbroker.lease l
         WHERE l.state = 'held' AND l.expires_at IS NULL
           AND {{alive_and_woken:l}};
    END IF;
    RETURN NULL;
END
$t$
$function$;

CREATE OR REPLACE FUNCTION pgbroker.broker_sleep(name text DEFAULT 'default'::text, wait interval DEFAULT '00:00:00.02'::interval)
 RETURNS text
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET enable_seqscan TO 'off'
 SET enable_bitmapscan TO 'off'
AS $function$
DECLARE
    v_name text := pgbroker._check_name(broker_sleep.name);
    v_epoch bigint := pgbroker._holder_epoch(v_name);
    v_wait_ms text := pgbroker._wait_ms(broker_sleep.wait);   -- checked before anything changes
    v_deadline timestamptz := CASE WHEN broker_sleep.wait IS NULL THEN 'infinity'
                                   ELSE clock_timestamp() + (v_wait_ms || ' ms')::interval END;
    v_floor bigint;
    v_key integer;
    v_awake integer := pgbroker._epoch_key(v_epoch);
BEGIN
    SELECT lock_key INTO v_key FROM pgbroker.lease l WHERE l.name = v_name;
    -- Wait, still awake, until no writer holds the drain lock: by tries, so
    -- that writers never find a request of ours queued (they would take it
    -- for a broker going to sleep, and NOTIFY), and at most WAIT (a long
    -- writer transaction must not keep us from draining).
    WHILE NOT pg_try_advisory_xact_lock(pgbroker._lock_class_drain(), v_key) LOOP
        IF clock_timestamp() >= v_deadline THEN
            IF NOT pgbroker._awake_held(v_awake) THEN
                PERFORM pg_advisory_lock(pgbroker._lock_class_awake(), v_awake);
            END IF;
            RETURN 'busy';
        END IF;
        PERFORM pg_sleep(0.001);
    END LOOP;
    -- The drain lock is ours until this returns: writers from now on NOTIFY.
    IF pgbroker._awake_held(v_awake) THEN
        PERFORM pg_advisory_unlock(pgbroker._lock_class_awake(), v_awake);
    END IF;
    v_floor := pgbroker._outbox_floor(v_name, v_epoch, false);
    IF EXISTS (SELECT FROM pgbroker.outbox o WHERE o.name = v_name AND o.epoch = v_epoch AND o.id > v_floor) THEN
        PERFORM pg_advisory_lock(pgbroker._lock_class_awake(), v_awake);
        RETURN 'pending';
    END IF;
    RETURN 'asleep';
END
$function$;

-- ---------------------------------------------------------------------------
-- Hand-written (begin): last, every watched table's trigger functions as the
-- previous revision renders them (as its _watch_install does, without the
-- triggers, which stay), now that its templates are back.
DO $render$
DECLARE
    v_watch pgbroker.watched;
    v_kind text;
BEGIN
    FOR v_watch IN SELECT * FROM pgbroker.watched ORDER BY watch_id LOOP
        FOREACH v_kind IN ARRAY ARRAY['ins', 'upd', 'del', 'trunc'] LOOP
            EXECUTE format('CREATE OR REPLACE FUNCTION pgbroker._watch_%s_%s() RETURNS trigger LANGUAGE plpgsql'
                           ' SECURITY DEFINER SET search_path = pg_catalog, pg_temp%s AS %L',
                           v_watch.watch_id, v_kind,
                           CASE WHEN v_kind = 'trunc' THEN '' ELSE pgbroker._key_settings(v_watch.key_types) END,
                           pgbroker._watch_function_body(v_watch, v_kind));
        END LOOP;
    END LOOP;
END
$render$;
-- Hand-written (end).
