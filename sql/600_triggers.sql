-- pgbroker: the triggers on watched tables, and watch() / unwatch().
--
-- pgbroker.watch(table) installs, on a table with a primary key, three
-- statement-level triggers with transition tables (INSERT, UPDATE, DELETE)
-- and a TRUNCATE trigger.  Their functions are generated per table from the
-- templates below, whose {{slots}} _watch_install() fills with the table's
-- key and columns.  The rendering for initech.objects is committed as
-- sql/reference/initech_objects_triggers.sql (a test keeps it current).
-- After a single-row UPDATE a writer runs:
--
--   1. one try-lock, never a wait: the writer's gate of the table's watch
--      lock (one of 16, by its pid: 300_watched_tables.sql), shared, held to
--      commit; it orders the writer against subscribe(), which takes every
--      gate (400_subscriptions.sql);
--   2. one SELECT: is the statement large, does the table have whole-table
--      subscribers (two index probes);
--   3. one INSERT ... SELECT: for each change (I; U with the changed columns;
--      D; a key change is a D and an I; an UPDATE that changes nothing is no
--      change) the subscribers of its key, per broker (pgbroker.interest: one
--      index probe), one outbox row per change and broker whose holder is
--      alive; and for each such broker the wake-up test, which sends a
--      pg_notify only when it sleeps (500_outbox.sql).
--
-- Statements of more than 1,024 rows run an INSERT planned for their size
-- (EXECUTE: hash joins instead of the cached plan's index probe per row), and
-- test each broker once rather than per row.  Changes of a table with
-- whole-table subscribers merge those into each change's (per broker).
--
-- Two cases are conservative rather than exact, so that no writer ever waits:
-- when the watch lock is taken (a subscribe() is under way), and in a
-- REPEATABLE READ or SERIALIZABLE transaction (whose snapshot may predate a
-- subscription), a change is written for every live broker with its clients
-- left NULL, to be resolved against the subscriptions when it is fetched.
-- The broker then hears of a change that, had it come a moment later, only
-- some clients (or none) would have heard of: at-least-once, never a gap.

-- ---------------------------------------------------------------------------
-- Templates.  {{watch_id}}: the table's watch; {{changes}}: a query of the
-- statement's changes (op, row_key, changed); {{alive_and_woken:X}}: the
-- liveness and wake-up test of the broker of row X (a lease or interest row).

-- Small statements (the cached plan): one interest probe per change.
CREATE FUNCTION pgbroker._watch_fanout_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT z.name, z.epoch, {{watch_id}}, z.op, z.row_key, z.changed, z.clients
          FROM (SELECT i.name, i.epoch, i.lock_key, i.clients, k.op, k.row_key, k.changed
                  FROM ({{changes}} OFFSET 0) k
                 CROSS JOIN LATERAL (
                       -- An index probe per change, whatever the size the plan was made for
                       -- (a hash of the table's interest rows would then serve every later call).
                       SELECT j.name, j.epoch, j.lock_key, j.clients FROM pgbroker.interest j
                        WHERE j.watch_id = {{watch_id}} AND j.row_key = k.row_key OFFSET 0) i
                OFFSET 0) z  -- the test below runs on the rows to write, never on an interest scan
         WHERE {{alive_and_woken:z}}$t$
$template$;
COMMENT ON FUNCTION pgbroker._watch_fanout_template() IS
    'Internal: template of the INSERT ... SELECT by which the watch triggers fan out the changes of a small statement.';

-- Large statements (planned at each run): each broker with interest in the
-- table is tested (and woken) once, then joined; {{keyed}} is a query of the
-- changes with their whole OLD and NEW rows, so that only subscribed rows'
-- columns are compared ({{changed_late}}).
CREATE FUNCTION pgbroker._watch_bulk_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$
        WITH live AS MATERIALIZED (
            SELECT l.name, l.epoch FROM pgbroker.lease l
             WHERE l.state = 'held' AND l.expires_at IS NULL
               AND CASE WHEN EXISTS (SELECT FROM pgbroker.interest j
                                      WHERE j.watch_id = {{watch_id}} AND j.name = l.name AND j.epoch = l.epoch)
                        THEN {{alive_and_woken:l}} END)
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT z.name, z.epoch, {{watch_id}}, z.op, z.row_key, z.changed, z.clients
          FROM (SELECT i.name, i.epoch, i.clients, k.op, k.row_key, {{changed_late}} AS changed
                  FROM ({{keyed}} OFFSET 0) k
                  JOIN pgbroker.interest i ON i.watch_id = {{watch_id}} AND i.row_key = k.row_key
                  JOIN live ON live.name = i.name AND live.epoch = i.epoch
                OFFSET 0) z  -- compared after the join: only subscribed rows' columns
         WHERE z.op <> 'U' OR cardinality(z.changed) > 0$t$
$template$;
COMMENT ON FUNCTION pgbroker._watch_bulk_template() IS
    'Internal: template of the INSERT ... SELECT by which the watch triggers fan out the changes of a large statement.';

-- Tables with whole-table subscribers: each change's subscribers merged with
-- those, per broker and epoch.
CREATE FUNCTION pgbroker._watch_merged_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$
        WITH whole AS MATERIALIZED (
            SELECT i.name, i.epoch, i.lock_key, i.clients
              FROM pgbroker.interest i
             WHERE i.watch_id = {{watch_id}} AND i.row_key = 'null'::jsonb)
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT t.name, t.epoch, {{watch_id}}, k.op, k.row_key, k.changed, t.clients
          FROM ({{changes}} OFFSET 0) k
         CROSS JOIN LATERAL (
               -- Subscribers of the row, with the whole-table ones of the same broker ...
               SELECT r.name, r.epoch, r.lock_key,
                      CASE WHEN w.clients IS NULL THEN r.clients
                           ELSE ARRAY(SELECT DISTINCT c FROM unnest(r.clients || w.clients) AS c ORDER BY 1) END
                 FROM pgbroker.interest r
                 LEFT JOIN whole w ON w.name = r.name AND w.epoch = r.epoch
                WHERE r.watch_id = {{watch_id}} AND r.row_key = k.row_key
               UNION ALL
               -- ... and the whole-table ones of brokers with no subscriber of the row.
               SELECT w.name, w.epoch, w.lock_key, w.clients
                 FROM whole w
                WHERE NOT EXISTS (SELECT FROM pgbroker.interest r
                                   WHERE r.watch_id = {{watch_id}} AND r.row_key = k.row_key AND r.name = w.name
                                     AND r.epoch = w.epoch)
               ) AS t (name, epoch, lock_key, clients)
         WHERE {{alive_and_woken:t}}$t$
$template$;
COMMENT ON FUNCTION pgbroker._watch_merged_template() IS
    'Internal: template of the INSERT ... SELECT of a table with whole-table subscribers (merged per change and broker).';

-- A subscribe() is under way, or the snapshot may predate one: every live
-- broker gets the changes, their clients left NULL, resolved when fetched.
CREATE FUNCTION pgbroker._watch_unresolved_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$
        -- A subscribe() is under way, or the snapshot may predate one: every
        -- live broker gets the changes, their clients resolved when fetched.
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT l.name, l.epoch, {{watch_id}}, l.op, l.row_key, l.changed, NULL
          FROM (SELECT b.name, b.epoch, b.lock_key, k.op, k.row_key, k.changed
                  FROM ({{changes}} OFFSET 0) k
                 CROSS JOIN pgbroker.lease b
                 WHERE b.state = 'held' AND b.expires_at IS NULL
                OFFSET 0) l
         WHERE {{alive_and_woken:l}}$t$
$template$;
COMMENT ON FUNCTION pgbroker._watch_unresolved_template() IS
    'Internal: template of the INSERT ... SELECT that writes changes for every live broker with their clients left to be resolved at fetch.';

-- Whether the holder of the broker of row {{r}} (a lease, or the interest of
-- one of its epochs) is alive, and if so its wake-up.  Evaluated before the
-- outbox row is written, in this order:
--   - the broker is going to sleep (broker_sleep() holds this session's
--     gate of the drain lock, 300_watched_tables.sql): NOTIFY it, if the
--     epoch's holder is alive;
--   - it is not awake (the awake lock of that epoch is free): it sleeps, or
--     the epoch has no holder (the broker is gone, or that epoch was
--     replaced by a new claim and its rows wait for broker_sweep()); if its
--     holder is alive, NOTIFY it, holding the gate shared to commit, so
--     broker_sleep(), which takes every gate, waits for this transaction or
--     it hears the NOTIFY; otherwise write nothing;
--   - it is awake and draining: it will see the row, and its holder is
--     alive (only the epoch's holder takes its awake lock, and drops it when
--     the epoch ends): no test of its own (500_outbox.sql).
-- Lock tests and not rows a snapshot could hide: right at every isolation
-- level.  A NOTIFY repeated in one transaction is sent once.
CREATE FUNCTION pgbroker._watch_alive_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$CASE
            WHEN NOT pg_try_advisory_xact_lock_shared(pgbroker._lock_class_drain(), pgbroker._lock_gate({{r}}.lock_key))
                THEN pgbroker._epoch_alive({{r}}.lock_key, {{r}}.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || {{r}}.lock_key, {{r}}.name)) = 0
            WHEN pg_try_advisory_lock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key({{r}}.epoch))
                THEN pg_advisory_unlock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key({{r}}.epoch))
                     AND pgbroker._epoch_alive({{r}}.lock_key, {{r}}.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || {{r}}.lock_key, {{r}}.name)) = 0
            ELSE true
        END$t$
$template$;
COMMENT ON FUNCTION pgbroker._watch_alive_template() IS
    'Internal: template of the test "is the broker alive, and wake it if it sleeps" of the watch triggers.';

-- The trigger function of INSERT, UPDATE and DELETE.  {{transition}}: the
-- transition table that counts the statement's rows.  JIT is off for large
-- and merging statements: the planner estimates a join of transition tables
-- at rows(OLD) x rows(NEW) x 0.005, so from about 15,000 rows it passed
-- jit_above_cost and compiled, at more cost than it saved (100,000 rows: 40%).
CREATE FUNCTION pgbroker._watch_trigger_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$
DECLARE
    v_large boolean;
    v_whole boolean;
    v_jit text;
BEGIN
    IF pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), pgbroker._lock_gate({{watch_id}}))
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
$template$;
COMMENT ON FUNCTION pgbroker._watch_trigger_template() IS
    'Internal: template of the INSERT, UPDATE and DELETE trigger functions of a watched table (see sql/600_triggers.sql).';

-- Row mode: the trigger functions of INSERT, UPDATE and DELETE, run for
-- each changed row with OLD and NEW at hand (no transition tables, no join).
-- {{row_body}}: the fan-out of the row's change (below); for an UPDATE, of
-- the change of its columns, or of a D and an I when its key changed.
CREATE FUNCTION pgbroker._watch_row_trigger_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$
BEGIN
{{row_body}}
    RETURN NULL;
END
$t$
$template$;
COMMENT ON FUNCTION pgbroker._watch_row_trigger_template() IS
    'Internal: template of the row-level INSERT, UPDATE and DELETE trigger functions of a table watched in row mode.';

CREATE FUNCTION pgbroker._watch_row_update_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$    IF {{same_key}} THEN
{{fanout_update}}
    ELSE
        -- A key change: a D of the old key and an I of the new one.
{{fanout_rekey}}
    END IF;$t$
$template$;
COMMENT ON FUNCTION pgbroker._watch_row_update_template() IS
    'Internal: template of the body of the row-level UPDATE trigger function (an UPDATE of the key is a D and an I).';

-- The fan-out of one row's change(s), {{changes}} (a query over NEW and OLD
-- of one or two rows; an UPDATE that changes nothing has none): the tests
-- of statement mode, in as few steps as a row allows, for it runs once per
-- row.  The watch lock and isolation test, then whether the table has
-- whole-table subscribers, then one INSERT: the subscribers of the row's key
-- (pgbroker.interest: one index probe), one outbox row per live broker.
CREATE FUNCTION pgbroker._watch_row_fanout_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$        IF pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), pgbroker._lock_gate({{watch_id}}))
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
$template$;
COMMENT ON FUNCTION pgbroker._watch_row_fanout_template() IS
    'Internal: template of the fan-out of one row''s change(s) in the row-level trigger functions.';

-- Tables with filters (350_filters.sql).  {{fchanges}}: a query of the
-- changes (op, row_key, changed) with, per change, the row's filter points
-- after it (new_points; before it, for a D) and before it (old_points, for
-- a U).  Each change's subscribers are those of its key, of the whole
-- table and of its new points, and, told the row left them, those of its
-- old points only: one index probe per key and point (the probes of points
-- that did not change are made once), and for a range probe (a shape with
-- a range) one SP-GiST probe ({{range_rows}}).  A change that matches nothing
-- writes nothing.  The same in both modes, for any size of statement.
CREATE FUNCTION pgbroker._watch_ffanout_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients, left_clients)
        SELECT z.name, z.epoch, {{watch_id}}, z.op, z.row_key, z.changed, z.clients, z.left_clients
          FROM (SELECT g.name, g.epoch, g.lock_key, g.clients, g.left_clients, k.op, k.row_key, k.changed
                  FROM ({{fchanges}} OFFSET 0) k
                 CROSS JOIN LATERAL (
                       SELECT m.name, m.epoch, min(m.lock_key) AS lock_key, array_agg(m.c ORDER BY m.c) AS clients,
                              array_agg(m.c ORDER BY m.c) FILTER (WHERE m.gone) AS left_clients
                         FROM (SELECT j.name, j.epoch, min(j.lock_key) AS lock_key, x.c, bool_and(p.old) AS gone
                                 FROM (SELECT q.key, bool_and(q.old) AS old
                                         FROM (SELECT y, false FROM unnest(k.new_points || ARRAY[k.row_key, 'null'::jsonb]) AS y
                                               UNION ALL
                                               SELECT y, true FROM unnest(k.old_points) AS y) AS q (key, old)
                                        GROUP BY q.key) p
                                CROSS JOIN LATERAL (SELECT j.name, j.epoch, j.lock_key, j.clients FROM pgbroker.interest j
                                                     WHERE j.watch_id = {{watch_id}} AND j.row_key = p.key{{range_rows}}
                                                    OFFSET 0) j
                                CROSS JOIN LATERAL unnest(j.clients) AS x(c)
                                GROUP BY j.name, j.epoch, x.c) m
                        GROUP BY m.name, m.epoch) g
                OFFSET 0) z  -- the test below runs on the rows to write, never on an interest scan
         WHERE {{alive_and_woken:z}}$t$
$template$;
COMMENT ON FUNCTION pgbroker._watch_ffanout_template() IS
    'Internal: template of the INSERT ... SELECT by which the watch triggers of a table with filters fan out its changes.';

-- A table with filters, a subscribe() under way or a snapshot that may
-- predate one: as _watch_unresolved_template, with each change's points,
-- by which the fetch resolves its clients (500_outbox.sql).
CREATE FUNCTION pgbroker._watch_funresolved_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients, new_points, old_points)
        SELECT l.name, l.epoch, {{watch_id}}, l.op, l.row_key, l.changed, NULL, l.new_points, l.old_points
          FROM (SELECT b.name, b.epoch, b.lock_key, k.op, k.row_key, k.changed, k.new_points, k.old_points
                  FROM ({{fchanges}} OFFSET 0) k
                 CROSS JOIN pgbroker.lease b
                 WHERE b.state = 'held' AND b.expires_at IS NULL
                OFFSET 0) l
         WHERE {{alive_and_woken:l}}$t$
$template$;
COMMENT ON FUNCTION pgbroker._watch_funresolved_template() IS
    'Internal: template of the INSERT ... SELECT of a table with filters that writes changes for every live broker with their clients left to be resolved at fetch.';

-- The fan-out of a table with filters, in both modes: the watch lock and
-- isolation test, then {{ffanout}} or {{funresolved}}.
CREATE FUNCTION pgbroker._watch_filtered_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$        IF pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), pgbroker._lock_gate({{watch_id}}))
           AND current_setting('transaction_isolation') = 'read committed' THEN
            -- First whether any change has a subscriber at all: one index probe per change for its key, the whole
            -- table and its points, those before an UPDATE only where they moved (a change that matches nothing,
            -- the common case, costs no more).
            IF EXISTS (SELECT FROM ({{fchanges}} OFFSET 0) k
                        CROSS JOIN LATERAL unnest(CASE WHEN k.old_points = k.new_points THEN k.new_points
                                                       ELSE k.new_points || k.old_points END
                                                  || ARRAY[k.row_key, 'null'::jsonb]) AS p(key)
                        CROSS JOIN LATERAL (SELECT 1 FROM pgbroker.interest j
                                             WHERE j.watch_id = {{watch_id}} AND j.row_key = p.key{{range_exists}}
                                            LIMIT 1) j) THEN
{{ffanout}};
            END IF;
        ELSE
{{funresolved}};
        END IF;$t$
$template$;
COMMENT ON FUNCTION pgbroker._watch_filtered_template() IS
    'Internal: template of the fan-out of the changes of a table with filters (both trigger modes).';

-- The statement-level INSERT, UPDATE and DELETE trigger function of a table
-- with filters: {{filtered}} (its function is made with enable_seqscan,
-- enable_bitmapscan and jit off: see _watch_create_functions).
CREATE FUNCTION pgbroker._watch_filtered_statement_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$
BEGIN
{{filtered}}
    RETURN NULL;
END
$t$
$template$;
COMMENT ON FUNCTION pgbroker._watch_filtered_statement_template() IS
    'Internal: template of the statement-level INSERT, UPDATE and DELETE trigger functions of a watched table with filters.';

-- The TRUNCATE trigger function: every client with any interest in the table
-- hears of it, one row per broker (of its live epoch).
CREATE FUNCTION pgbroker._watch_truncate_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$
DECLARE
    v_jit text := current_setting('jit');
BEGIN
    IF pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), pgbroker._lock_gate({{watch_id}}))
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
$template$;
COMMENT ON FUNCTION pgbroker._watch_truncate_template() IS
    'Internal: template of the TRUNCATE trigger function of a watched table.';

-- Fill the {{slots}} of a template: each key of p_slots names a slot.  A slot
-- left unfilled is a bug in the generator, not a user error.
CREATE FUNCTION pgbroker._render(p_template text, p_slots jsonb)
RETURNS text
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_out text := p_template;
    v_slot text;
    v_value text;
BEGIN
    FOR v_slot, v_value IN SELECT key, value FROM jsonb_each_text(p_slots) LOOP
        v_out := replace(v_out, '{{' || v_slot || '}}', v_value);
    END LOOP;
    IF v_out ~ '\{\{[a-z_:]+\}\}' THEN
        RAISE EXCEPTION 'unfilled template slot %', substring(v_out FROM '\{\{[a-z_:]+\}\}');
    END IF;
    RETURN v_out;
END
$$;
COMMENT ON FUNCTION pgbroker._render(text, jsonb) IS 'Internal: replace each {{slot}} of a template by its value in p_slots.';

-- ---------------------------------------------------------------------------
-- Watching a table.

-- The SQL expressions over the rows of a watched table, its NEW rows named
-- P_NEW and its OLD rows P_OLD (range variables n and o of the transition
-- tables, whole rows (k.n) and (k.o), or PL/pgSQL's NEW and OLD): the key
-- (jsonb, as _encode_key makes it) of each, whether they have the same key,
-- whether one is missing (a FULL JOIN found none), and the names of the
-- columns whose value changed.
CREATE FUNCTION pgbroker._watch_exprs(p_watch pgbroker.watched, p_new text, p_old text)
RETURNS jsonb
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_exprs jsonb;
    v_changed text;
BEGIN
    SELECT jsonb_build_object(
               'new_key', CASE WHEN count(*) = 1 THEN format('to_jsonb(%s.%I)', p_new, min(c))
                               ELSE format('jsonb_build_array(%s)', string_agg(format('%s.%I', p_new, c), ', ' ORDER BY i)) END,
               'old_key', CASE WHEN count(*) = 1 THEN format('to_jsonb(%s.%I)', p_old, min(c))
                               ELSE format('jsonb_build_array(%s)', string_agg(format('%s.%I', p_old, c), ', ' ORDER BY i)) END,
               'same_key', string_agg(format('%1$s.%3$I = %2$s.%3$I', p_new, p_old, c), ' AND ' ORDER BY i),
               'new_null', format('%s.%I IS NULL', p_new, min(c) FILTER (WHERE i = 1)),
               'old_null', format('%s.%I IS NULL', p_old, min(c) FILTER (WHERE i = 1)))
      INTO v_exprs
      FROM unnest(p_watch.key_columns) WITH ORDINALITY AS u(c, i);
    -- IS DISTINCT FROM where the type has an equality operator of its own,
    -- the text forms otherwise (json, xml, point...).
    SELECT format('array_remove(ARRAY[%s]::text[], NULL)',
                  string_agg(CASE WHEN to_regoperator(format('=(%s,%s)', t, t)) IS NOT NULL
                                  THEN format('CASE WHEN %1$s.%3$I IS DISTINCT FROM %2$s.%3$I THEN %3$L END',
                                              p_new, p_old, a.attname)
                                  ELSE format('CASE WHEN %1$s.%3$I::text IS DISTINCT FROM %2$s.%3$I::text THEN %3$L END',
                                              p_new, p_old, a.attname)
                             END, ', ' ORDER BY a.attnum))
      INTO v_changed
      FROM pg_catalog.pg_attribute a
      CROSS JOIN LATERAL format_type(a.atttypid, NULL) AS t
     WHERE a.attrelid = p_watch.relid AND a.attnum > 0 AND NOT a.attisdropped;
    RETURN v_exprs || jsonb_build_object('changed', v_changed);
END
$$;
COMMENT ON FUNCTION pgbroker._watch_exprs(pgbroker.watched, text, text) IS
    'Internal: the SQL expressions (keys, same key, missing row, changed columns) over the NEW and OLD rows of a watched table, named as given.';

-- The shapes of a watched table's filters whose columns all exist (a
-- column dropped since is left out: watch() again after ALTER TABLE, as
-- for the changed columns above).
CREATE FUNCTION pgbroker._watch_shapes(p_watch pgbroker.watched)
RETURNS TABLE (columns text[], range_column text)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT f.columns, f.range_column FROM pgbroker.filter_shape f
     WHERE f.watch_id = p_watch.watch_id
       AND NOT EXISTS (SELECT FROM unnest(array_remove(f.columns || f.range_column, '')) AS c
                        WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_attribute a
                                           WHERE a.attrelid = p_watch.relid AND a.attname = c AND a.attnum > 0
                                             AND NOT a.attisdropped))
     ORDER BY f.columns, f.range_column
$$;
COMMENT ON FUNCTION pgbroker._watch_shapes(pgbroker.watched) IS
    'Internal: the shapes (sorted equality columns, and the range''s column or empty) of the filters of a watched table whose columns all exist.';

-- The SQL expression of the filter points of a row P_ROW (n, o, NEW, OLD):
-- an array with one JSON object per shape: of its values, encoded as
-- _filter_points() encodes a filter's; for a shape with a range, the range
-- probe (its equality columns' values, the range column's, and the member
-- "": the column, the value's float8 and its class; see 350_filters.sql).
-- NULL for a table without filters.
CREATE FUNCTION pgbroker._watch_points(p_watch pgbroker.watched, p_row text)
RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN count(*) > 0 THEN
               format('ARRAY[%s]::jsonb[]',
                      string_agg(format('jsonb_build_object(%s)', concat_ws(', ',
                                        (SELECT string_agg(format('%L, %s.%I', c, p_row, c), ', ' ORDER BY c COLLATE "C")
                                           FROM unnest(f.columns) AS c),
                                        (SELECT format('%1$L, %2$s.%1$I, %3$L, jsonb_build_array(%1$L, %4$s, %5$L)',
                                                       f.range_column, p_row, '', 
                                                       pgbroker._range_float(pgbroker._range_class(a.atttypid),
                                                                             format('%s.%I', p_row, f.range_column)),
                                                       pgbroker._range_class(a.atttypid))
                                           FROM pg_catalog.pg_attribute a
                                          WHERE a.attrelid = p_watch.relid AND a.attname = f.range_column))),
                                 ', ' ORDER BY f.columns, f.range_column)) END
      FROM pgbroker._watch_shapes(p_watch) AS f
$$;
COMMENT ON FUNCTION pgbroker._watch_points(pgbroker.watched, text) IS
    'Internal: the SQL expression of the filter points and range probes (jsonb[], one per shape) of a row of a watched table; NULL without filters.';

-- The SQL expressions of a watched table that fill the templates' slots.
CREATE FUNCTION pgbroker._watch_slots(p_watch pgbroker.watched)
RETURNS jsonb
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    r jsonb := pgbroker._watch_exprs(p_watch, 'n', 'o');          -- over the transition tables' rows
    v_changed_k text := pgbroker._watch_exprs(p_watch, '(k.n)', '(k.o)') ->> 'changed';  -- whole rows (bulk)
    r_row jsonb := pgbroker._watch_exprs(p_watch, 'NEW', 'OLD');   -- one row (row mode)
    v_np text := pgbroker._watch_points(p_watch, 'n');
    v_op text := pgbroker._watch_points(p_watch, 'o');
    v_np_row text := pgbroker._watch_points(p_watch, 'NEW');
    v_op_row text := pgbroker._watch_points(p_watch, 'OLD');
    v_filtered jsonb := '{}';
BEGIN
    IF v_np IS NOT NULL THEN
        -- A table with filters: the changes with the rows' points (old_points for U only), and, with ranges, the
        -- interest rows of the ranges a probe p.key falls in (one SP-GiST probe; 350_filters.sql) beside those of
        -- the key p.key (range_rows; range_exists: whether there is one).
        v_filtered := CASE WHEN EXISTS (SELECT FROM pgbroker._watch_shapes(p_watch) AS f WHERE f.range_column <> '')
                           THEN jsonb_build_object('range_rows', format($q$
                                                     UNION ALL
                                                     SELECT j.name, j.epoch, j.lock_key, j.clients FROM pgbroker.interest j
                                                      WHERE p.key ? '' AND j.range_box @> pgbroker._range_probe(%1$s, p.key)
                                                        AND j.watch_id = %1$s AND pgbroker._range_matches(j.row_key, p.key)$q$,
                                                                              p_watch.watch_id),
                                                   'range_exists', format($q$
                                             UNION ALL
                                             SELECT 1 FROM pgbroker.interest j
                                              WHERE p.key ? '' AND j.range_box @> pgbroker._range_probe(%1$s, p.key)
                                                AND j.watch_id = %1$s AND pgbroker._range_matches(j.row_key, p.key)$q$,
                                                                          p_watch.watch_id))
                           ELSE jsonb_build_object('range_rows', '', 'range_exists', '') END
                      || jsonb_build_object(
            'ins_fchanges', format($q$SELECT 'I'::"char" AS op, %s AS row_key, NULL::text[] AS changed, %s AS new_points,
                     NULL::jsonb[] AS old_points FROM pgbroker_new n$q$, r ->> 'new_key', v_np),
            'del_fchanges', format($q$SELECT 'D'::"char" AS op, %s AS row_key, NULL::text[] AS changed, %s AS new_points,
                     NULL::jsonb[] AS old_points FROM pgbroker_old o$q$, r ->> 'old_key', v_op),
            'upd_fchanges', format($q$SELECT c.op, c.row_key, c.changed, c.new_points, c.old_points FROM (
              SELECT (CASE WHEN %1$s THEN 'I' WHEN %2$s THEN 'D' ELSE 'U' END)::"char" AS op,
                     CASE WHEN %2$s THEN %3$s ELSE %4$s END AS row_key,
                     CASE WHEN %1$s OR %2$s THEN NULL ELSE %5$s END AS changed,
                     CASE WHEN %2$s THEN %7$s ELSE %8$s END AS new_points,
                     CASE WHEN %1$s OR %2$s THEN NULL ELSE %7$s END AS old_points
                FROM pgbroker_new n FULL JOIN pgbroker_old o ON %6$s) c
             WHERE c.op <> 'U' OR cardinality(c.changed) > 0$q$,
                                   r ->> 'old_null', r ->> 'new_null', r ->> 'old_key', r ->> 'new_key', r ->> 'changed',
                                   r ->> 'same_key', v_op, v_np),
            'row_ins_fchanges', format($q$SELECT 'I'::"char" AS op, %s AS row_key, NULL::text[] AS changed,
                     %s AS new_points, NULL::jsonb[] AS old_points$q$, r_row ->> 'new_key', v_np_row),
            'row_del_fchanges', format($q$SELECT 'D'::"char" AS op, %s AS row_key, NULL::text[] AS changed,
                     %s AS new_points, NULL::jsonb[] AS old_points$q$, r_row ->> 'old_key', v_op_row),
            'row_upd_fchanges', format($q$SELECT 'U'::"char" AS op, %s AS row_key, c.changed, %s AS new_points,
                     %s AS old_points FROM (SELECT %s AS changed) c WHERE cardinality(c.changed) > 0$q$,
                                       r_row ->> 'new_key', v_np_row, v_op_row, r_row ->> 'changed'),
            'row_rekey_fchanges', format($q$SELECT * FROM (VALUES ('D'::"char", %s, NULL::text[], %s, NULL::jsonb[]),
                                                         ('I', %s, NULL, %s, NULL))
                     AS c (op, row_key, changed, new_points, old_points)$q$,
                                         r_row ->> 'old_key', v_op_row, r_row ->> 'new_key', v_np_row));
    END IF;
    RETURN v_filtered || jsonb_build_object(
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
$$;
COMMENT ON FUNCTION pgbroker._watch_slots(pgbroker.watched) IS
    'Internal: the SQL expressions (key, changed columns, the changes of each kind of statement) that fill the trigger templates for a watched table.';

-- The source of a watched table's trigger function KIND (ins, upd, del, trunc).
CREATE FUNCTION pgbroker._watch_function_body(p_watch pgbroker.watched, p_kind text)
RETURNS text
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_slots jsonb := pgbroker._watch_slots(p_watch);
    v_body text;
    v_fanout text;
    v_row text;
BEGIN
    IF p_kind = 'trunc' THEN
        v_body := pgbroker._watch_truncate_template();  -- a statement trigger in both modes
    ELSIF v_slots ? 'ins_fchanges' THEN
        -- A table with filters: the same fan-out in both modes, over its changes with their points.
        v_fanout := replace(replace(pgbroker._watch_filtered_template(), '{{ffanout}}', pgbroker._watch_ffanout_template()),
                            '{{funresolved}}', pgbroker._watch_funresolved_template());
        IF p_watch.mode = 'row' THEN
            v_body := replace(pgbroker._watch_row_trigger_template(), '{{row_body}}', CASE p_kind
                WHEN 'upd' THEN replace(replace(pgbroker._watch_row_update_template(),
                                                '{{fanout_update}}', replace(v_fanout, '{{fchanges}}', v_slots ->> 'row_upd_fchanges')),
                                        '{{fanout_rekey}}', replace(v_fanout, '{{fchanges}}', v_slots ->> 'row_rekey_fchanges'))
                ELSE replace(v_fanout, '{{fchanges}}', v_slots ->> ('row_' || p_kind || '_fchanges')) END);
        ELSE
            v_body := replace(replace(pgbroker._watch_filtered_statement_template(), '{{filtered}}', v_fanout),
                              '{{fchanges}}', v_slots ->> (p_kind || '_fchanges'));
        END IF;
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
                                                    'row_upd_changes', 'row_rekey_changes', 'ins_fchanges', 'del_fchanges',
                                                    'upd_fchanges', 'row_ins_fchanges', 'row_del_fchanges',
                                                    'row_upd_fchanges', 'row_rekey_fchanges']);
END
$$;
COMMENT ON FUNCTION pgbroker._watch_function_body(pgbroker.watched, text) IS
    'Internal: render the trigger function of kind ins, upd, del or trunc of a watched table from the templates.';

-- (Re)create the trigger functions of a watched table from the templates,
-- for its mode and its filters' shapes.  CREATE OR REPLACE keeps the
-- triggers that call them; a writer runs the new body from its next
-- statement that takes the table's lock (the caller holds it exclusively).
CREATE FUNCTION pgbroker._watch_create_functions(p_watch pgbroker.watched)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_table regclass := p_watch.relid::regclass;
    v_kind text;
    v_event text;
    v_fn text;
    -- Keys (and filtered columns) of a type whose to_jsonb() depends on
    -- session settings are encoded under fixed ones (see _key_settings).
    v_settings text := pgbroker._key_settings(p_watch.key_types || ARRAY(
                           SELECT a.atttypid::regtype FROM pgbroker._watch_shapes(p_watch) AS f,
                                  unnest(array_remove(f.columns || f.range_column, '')) AS c
                             JOIN pg_catalog.pg_attribute a ON a.attrelid = p_watch.relid AND a.attname = c));
    v_filtered boolean := EXISTS (SELECT FROM pgbroker._watch_shapes(p_watch));
BEGIN
    FOR v_kind, v_event IN VALUES ('ins', 'INSERT'), ('upd', 'UPDATE'), ('del', 'DELETE'), ('trunc', 'TRUNCATE') LOOP
        v_fn := format('pgbroker._watch_%s_%s', p_watch.watch_id, v_kind);
        -- SECURITY DEFINER: writers may not touch pgbroker's tables themselves.
        EXECUTE format('CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER '
                       'SET search_path = pg_catalog, pg_temp%s AS %L',
                       v_fn, CASE WHEN v_kind = 'trunc' THEN ''
                                  -- A table with filters: its probes are index probes whatever the interest's
                                  -- statistics say (a plan made while it held a few hundred rows scanned them for
                                  -- each key: 2x the CPU of an UPDATE), a range's probe a plain index scan (a
                                  -- bitmap's set-up cost more than the probe), and no plan is JIT-compiled
                                  -- (estimates grow with the statement's rows and the shapes; a disabled scan
                                  -- costs 1e10).
                                  WHEN v_filtered THEN v_settings || ' SET enable_seqscan = off SET enable_bitmapscan = off SET jit = off'
                                  ELSE v_settings END,
                       pgbroker._watch_function_body(p_watch, v_kind));
        EXECUTE format('COMMENT ON FUNCTION %s() IS %L', v_fn,
                       format('Internal: %s trigger of watched table %s (generated by pgbroker.watch).', v_event, v_table));
        -- Generated functions are internal: nobody calls them but the triggers.
        EXECUTE format('REVOKE ALL ON FUNCTION %s() FROM PUBLIC', v_fn);
    END LOOP;
END
$$;
COMMENT ON FUNCTION pgbroker._watch_create_functions(pgbroker.watched) IS
    'Internal: (re)generate the trigger functions of a watched table, for its mode and its filters'' shapes.';

CREATE FUNCTION pgbroker._watch_install(p_watch pgbroker.watched, p_wait interval)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_table regclass := p_watch.relid::regclass;
    v_kind text;
    v_event text;
    v_transitions text;
    v_fn text;
    -- Whether it owns the table (only an owner may comment on its triggers).
    v_owner boolean := pgbroker._watch_check_rights(v_table,
                           EXISTS (SELECT FROM pg_catalog.pg_trigger t
                                    WHERE t.tgrelid = p_watch.relid AND t.tgname LIKE '\_pgbroker\_watch\_%'));
BEGIN
    PERFORM pgbroker._watch_lock_table(v_table, p_wait);
    PERFORM pgbroker._watch_drop_triggers(p_watch);
    PERFORM pgbroker._watch_create_functions(p_watch);
    FOR v_kind, v_event, v_transitions IN
        VALUES ('ins', 'INSERT', 'REFERENCING NEW TABLE AS pgbroker_new'),
               ('upd', 'UPDATE', 'REFERENCING OLD TABLE AS pgbroker_old NEW TABLE AS pgbroker_new'),
               ('del', 'DELETE', 'REFERENCING OLD TABLE AS pgbroker_old'),
               ('trunc', 'TRUNCATE', '')
    LOOP
        v_fn := format('pgbroker._watch_%s_%s', p_watch.watch_id, v_kind);
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
$$;
COMMENT ON FUNCTION pgbroker._watch_install(pgbroker.watched, interval) IS
    'Internal: (re)generate the trigger functions of a watched table and (re)create its triggers, of its mode, in the caller''s transaction under the table''s lock.';

-- A filter of a new shape was subscribed to (_filter_shapes_add, which
-- holds the table's lock): the table's trigger functions are rendered
-- again, with the shape.  Once per statement.
CREATE FUNCTION pgbroker._filter_shapes_render()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_watch pgbroker.watched;
BEGIN
    FOR v_watch IN SELECT w.* FROM pgbroker.watched w WHERE w.watch_id IN (SELECT a.watch_id FROM added_shapes a)
                    ORDER BY w.watch_id LOOP
        PERFORM pgbroker._watch_create_functions(v_watch);
    END LOOP;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pgbroker._filter_shapes_render() IS
    'Internal (statement trigger): render the trigger functions of the tables that have new filter shapes.';

CREATE TRIGGER _600_render
AFTER INSERT ON pgbroker.filter_shape
REFERENCING NEW TABLE AS added_shapes
FOR EACH STATEMENT EXECUTE FUNCTION pgbroker._filter_shapes_render();
COMMENT ON TRIGGER _600_render ON pgbroker.filter_shape IS 'A new filter shape renders its table''s trigger functions again.';

CREATE FUNCTION pgbroker._watch_drop_triggers(p_watch pgbroker.watched)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_trigger text;
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid = p_watch.relid) THEN
        RETURN;   -- the table was dropped (its oid no longer names anything)
    END IF;
    -- Only those that exist: DROP TRIGGER IF EXISTS would send a NOTICE for each missing one.
    FOR v_trigger IN SELECT t.tgname FROM pg_catalog.pg_trigger t
                      WHERE t.tgrelid = p_watch.relid
                        AND t.tgname IN ('_pgbroker_watch_ins', '_pgbroker_watch_upd', '_pgbroker_watch_del', '_pgbroker_watch_trunc')
                      ORDER BY t.tgname LOOP
        EXECUTE format('DROP TRIGGER %I ON %s', v_trigger, p_watch.relid::regclass);
    END LOOP;
END
$$;
COMMENT ON FUNCTION pgbroker._watch_drop_triggers(pgbroker.watched) IS 'Internal: drop the pgbroker triggers of a watched table.';

CREATE FUNCTION pgbroker.watch("table" regclass, wait interval DEFAULT '5 s', mode text DEFAULT 'statement')
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_rel pg_catalog.pg_class;
    v_cols text[];
    v_types regtype[];
    v_watch pgbroker.watched;
BEGIN
    IF watch."table" IS NULL THEN
        RAISE EXCEPTION 'table must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF watch.mode IS NULL OR watch.mode NOT IN ('statement', 'row') THEN
        RAISE EXCEPTION 'unknown mode %', coalesce(quote_literal(watch.mode), 'NULL')
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'statement (statement-level triggers, the default) or row (row-level triggers).';
    END IF;
    SELECT * INTO v_rel FROM pg_catalog.pg_class WHERE oid = watch."table";
    IF v_rel.relkind <> 'r' THEN
        RAISE EXCEPTION '% is not a table (relkind %)', watch."table", v_rel.relkind
            USING ERRCODE = 'wrong_object_type', HINT = 'Only ordinary tables with a primary key can be watched.';
    END IF;
    IF v_rel.relnamespace = 'pgbroker'::regnamespace THEN
        RAISE EXCEPTION 'pgbroker''s own table % cannot be watched', watch."table" USING ERRCODE = 'wrong_object_type';
    END IF;
    SELECT array_agg(a.attname::text ORDER BY k.n), array_agg(a.atttypid::regtype ORDER BY k.n)
      INTO v_cols, v_types
      FROM pg_catalog.pg_index x
      CROSS JOIN LATERAL unnest(x.indkey) WITH ORDINALITY AS k(attnum, n)
      JOIN pg_catalog.pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = k.attnum
     WHERE x.indrelid = watch."table" AND x.indisprimary;
    IF v_cols IS NULL THEN
        RAISE EXCEPTION 'table % has no primary key', watch."table"
            USING ERRCODE = 'PB020', HINT = 'pgbroker identifies changed rows by their primary key: add one.';
    END IF;
    INSERT INTO pgbroker.watched AS w (relid, table_name, key_columns, key_types, mode)
    VALUES (watch."table", watch."table"::text, v_cols, v_types, watch.mode)
    ON CONFLICT ON CONSTRAINT watched_relid_unique
    DO UPDATE SET table_name = excluded.table_name, mode = excluded.mode, watched_at = clock_timestamp()
    RETURNING * INTO v_watch;
    IF v_watch.key_columns IS DISTINCT FROM v_cols OR v_watch.key_types IS DISTINCT FROM v_types THEN
        RAISE EXCEPTION 'the primary key of % changed since it was watched', watch."table"
            USING ERRCODE = 'PB020', HINT = 'Subscriptions use the old key: unwatch() it, then watch() it again.';
    END IF;
    PERFORM pgbroker._watch_install(v_watch, watch.wait);
    RETURN v_watch.watch_id;
END
$$;
COMMENT ON FUNCTION pgbroker.watch(regclass, interval, text) IS
$$Admin: watch TABLE (an ordinary table with a primary key; 42809 for a view or other relation, PB020 without a key).
Installs triggers that write the subscribed clients of each changed row to the outbox and wake their brokers: with MODE
'statement' (the default) statement-level triggers with transition tables, best for tables changed in bulk; with MODE
'row' row-level ones, cheaper for single-row writes (TRUNCATE is a statement trigger in both); 22023 for another mode.
Both give the same notifications. Idempotent: call it again, with the same mode, after ALTER TABLE adds or removes
columns; with the other mode it switches the table's triggers in one transaction, with no gap. Returns the watch id.
Writers of the table never queue behind it: it asks for the table's lock in 50 ms tries with pauses between them, up to
WAIT (NULL: no limit), then fails with PB022.$$;

CREATE FUNCTION pgbroker.unwatch("table" regclass, wait interval DEFAULT '5 s')
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
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
    DELETE FROM pgbroker.filter_shape WHERE watch_id = v_watch.watch_id;
    DELETE FROM pgbroker.interest WHERE watch_id = v_watch.watch_id;
    DELETE FROM pgbroker.watched WHERE watch_id = v_watch.watch_id;
    RETURN true;
END
$$;
COMMENT ON FUNCTION pgbroker.unwatch(regclass, interval) IS
    'Admin: remove the pgbroker triggers from TABLE, with its subscriptions and pending notifications; false when it was not watched. Takes the table''s lock as watch() does (PB022 after WAIT).';
