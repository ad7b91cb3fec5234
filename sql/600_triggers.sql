-- pgbroker: the triggers on watched tables, and watch() / unwatch().
--
-- pgbroker.watch(table) installs three statement-level triggers with
-- transition tables (INSERT, UPDATE, DELETE) and a TRUNCATE trigger on a table
-- with a primary key.  For each changed row they look the row's key up in
-- pgbroker.interest (400_subscriptions.sql) and write one outbox row per
-- change and broker (500_outbox.sql), carrying the list of target clients.
-- After the statement they wake the affected brokers with pg_notify, unless
-- the broker is awake and draining.  The trigger functions are generated per
-- table by _watch_install(), from the template below.

-- ---------------------------------------------------------------------------
-- Watching a table.

CREATE FUNCTION pgbroker._watch_install(p_watch pgbroker.watched)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_id integer := p_watch.watch_id;
    v_table regclass := p_watch.relid::regclass;
    v_keyn text;     -- key expression over n.*
    v_keyo text;     -- key expression over o.*
    v_join text;     -- n.k = o.k AND ...
    v_n_null text;   -- n.k1 IS NULL
    v_o_null text;
    v_changed text;  -- array of changed column names
    v_kind text;
    v_from text;
    v_op text;
    v_key text;
    v_changed_expr text;
    v_fn text;
    v_body text;
    v_plain text;
    v_bulk text;
    v_count_from text;
    v_settings text := pgbroker._key_settings(p_watch.key_types);
    v_text_key boolean;  -- bulk statements match a one-column key by its text
    v_textn text;        -- that text over n.*
    v_texto text;        -- over o.*
    v_text text;         -- over the statement's rows
    v_bulk_key text;     -- bulk: the key, statement side
    v_src text;          -- bulk: how interest is read
    v_core text;         -- bulk: the INSERT ... SELECT into the outbox
    v_cores text[];      -- bulk: that statement joining interest, and probing it
    -- Every trigger starts by ordering itself against subscribe (the watch
    -- lock, shared; REPEATABLE READ writers also lock the watched row FOR
    -- SHARE, which raises 40001 if a subscribe committed after their
    -- snapshot) and ends by waking the brokers it wrote to that are asleep
    -- (holding their drain lock shared until commit; see "Wake-ups").  The
    -- lock classes are literals here: 1885823603, 1885823607 and 1885823585
    -- are pgbroker._lock_class_watch(), _lock_class_drain() and
    -- _lock_class_awake().
    v_head text := $h$
DECLARE
    v_names text[];
    v_name text;
    v_key integer;
    v_whole boolean;
    v_bulk boolean;
    v_mergejoin text;
    v_jit text;
    v_min text;
    v_max text;
    v_rows bigint;
    v_large boolean;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(1885823603, %1$s);
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM FROM pgbroker.watched WHERE watch_id = %1$s FOR SHARE;
    END IF;
$h$;
    v_tail text := $t$
    IF v_names IS NOT NULL THEN
        FOR v_name, v_key IN SELECT l.name, l.lock_key FROM pgbroker.lease l WHERE l.name = ANY (v_names) LOOP
            PERFORM pg_advisory_xact_lock_shared(1885823607, v_key);
            IF pg_try_advisory_lock_shared(1885823585, v_key) THEN
                PERFORM pg_advisory_unlock_shared(1885823585, v_key);
                PERFORM pg_notify('pgbroker_wakeup_' || v_key, v_name);
            END IF;
        END LOOP;
    END IF;
    RETURN NULL;
END
$t$;
BEGIN
    SELECT CASE WHEN count(*) = 1 THEN format('to_jsonb(n.%I)', min(c))
                ELSE format('jsonb_build_array(%s)', string_agg(format('n.%I', c), ', ' ORDER BY i)) END,
           CASE WHEN count(*) = 1 THEN format('to_jsonb(o.%I)', min(c))
                ELSE format('jsonb_build_array(%s)', string_agg(format('o.%I', c), ', ' ORDER BY i)) END,
           string_agg(format('n.%I = o.%I', c, c), ' AND ' ORDER BY i),
           format('n.%I IS NULL', min(c) FILTER (WHERE i = 1)),
           format('o.%I IS NULL', min(c) FILTER (WHERE i = 1))
      INTO v_keyn, v_keyo, v_join, v_n_null, v_o_null
      FROM unnest(p_watch.key_columns) WITH ORDINALITY AS u(c, i);

    -- A one-column key whose JSON form is its text form (integers, text,
    -- uuid, boolean, enums): bulk statements compare that text with
    -- interest.key_text (row_key #>> '{}', in the "C" collation: byte for
    -- byte, as jsonb compares strings) instead of building a jsonb key per
    -- row; the interest_key_text index serves it.  Measured on 10,000 rows,
    -- every one subscribed: 8 ms less (of 77).  Other keys keep the jsonb
    -- join.
    SELECT cardinality(p_watch.key_columns) = 1
           AND (coalesce(nullif(t.typbasetype, 0), t.oid)::regtype = ANY (ARRAY[
                    'smallint', 'integer', 'bigint', 'text', 'character varying', 'name', 'uuid',
                    'boolean']::regtype[])
                OR t.typtype = 'e'),
           format('(n.%I)::text COLLATE "C"', p_watch.key_columns[1]),
           format('(o.%I)::text COLLATE "C"', p_watch.key_columns[1])
      INTO v_text_key, v_textn, v_texto
      FROM pg_catalog.pg_type t
     WHERE t.oid = p_watch.key_types[1];

    -- Changed columns: IS DISTINCT FROM where the type has an equality
    -- operator of its own, the text forms otherwise (json, xml, point...).
    SELECT format('array_remove(ARRAY[%s]::text[], NULL)',
                  string_agg(CASE WHEN to_regoperator(format('=(%s,%s)', t, t)) IS NOT NULL
                                  THEN format('CASE WHEN n.%I IS DISTINCT FROM o.%I THEN %L END', a.attname, a.attname, a.attname)
                                  ELSE format('CASE WHEN n.%I::text IS DISTINCT FROM o.%I::text THEN %L END', a.attname, a.attname, a.attname)
                             END, ', ' ORDER BY a.attnum))
      INTO v_changed
      FROM pg_catalog.pg_attribute a
      CROSS JOIN LATERAL format_type(a.atttypid, NULL) AS t
     WHERE a.attrelid = p_watch.relid AND a.attnum > 0 AND NOT a.attisdropped;

    -- INSERT, UPDATE, DELETE.  Each trigger function has a plain key join,
    -- run when no client watches the whole table (twice in the text, see
    -- below), and a statement that merges row and whole-table subscribers
    -- per change.  An UPDATE that changes a key shows as a delete of the old
    -- key and an insert of the new one; an UPDATE that changes nothing writes
    -- nothing.
    FOR v_kind, v_from, v_op, v_key, v_changed_expr, v_count_from, v_text IN
        VALUES ('ins', 'pgbroker_new n', $q$'I'$q$, v_keyn, 'NULL::text[]', 'pgbroker_new', v_textn),
               ('del', 'pgbroker_old o', $q$'D'$q$, v_keyo, 'NULL::text[]', 'pgbroker_old', v_texto),
               ('upd', format('pgbroker_new n FULL JOIN pgbroker_old o ON %s', v_join),
                       format($q$CASE WHEN %s THEN 'I' WHEN %s THEN 'D' ELSE 'U' END$q$, v_o_null, v_n_null),
                       format('CASE WHEN %s THEN %s ELSE %s END', v_n_null, v_keyo, v_keyn),
                       format('CASE WHEN %s OR %s THEN NULL ELSE %s END', v_n_null, v_o_null, v_changed),
                       'pgbroker_new',
                       format('CASE WHEN %s THEN %s ELSE %s END', v_n_null, v_texto, v_textn))
    LOOP
        v_fn := format('pgbroker._watch_%s_%s', v_id, v_kind);
        -- The plain statement: each change computed once (OFFSET 0 keeps the
        -- planner from copying the changed-columns expression into the
        -- filter), then one interest probe per change.
        v_plain := format($p$
        WITH ins AS (
            INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
            SELECT i.name, i.epoch, %1$s, k.op, k.row_key, k.changed, i.clients
              FROM (SELECT (%3$s)::"char" AS op, %4$s AS row_key, %5$s AS changed
                      FROM %2$s OFFSET 0) k
              JOIN pgbroker.interest i ON i.watch_id = %1$s AND i.row_key = k.row_key
             WHERE k.op <> 'U' OR cardinality(k.changed) > 0
            RETURNING name)
        SELECT array_agg(d.name) INTO v_names FROM (SELECT DISTINCT name FROM ins) d;$p$, v_id, v_from, v_op, v_key, v_changed_expr);
        -- A bulk UPDATE joins OLD and NEW by key.  The planner picks a merge
        -- join with two sorts, and a hash join is measured faster (10,000
        -- rows: about 10 ms less), so enable_mergejoin is off for that one
        -- statement and put back right after.  It also compares the columns
        -- only of rows that have subscribers (after the interest join).
        -- Measured on 10,000 rows in 0005: 3.4 ms less with 1% of them
        -- subscribed (the case the issue names: a bulk UPDATE with few
        -- subscribers), 4 ms more with every row subscribed (the wider rows
        -- reach the join); with keys matched by text (below), no difference.
        --
        -- JIT is off for bulk statements and for those that merge whole-table
        -- subscribers: the planner estimates a join of two transition tables
        -- at rows(OLD) x rows(NEW) x 0.005, so from about 15,000 rows the
        -- estimate passes jit_above_cost and the statement is compiled, which
        -- costs more than it saves (100,000 rows, 1% subscribed: 230 ms, 40%
        -- more).
        --
        -- The brokers to wake come from RETURNING and a DISTINCT over every
        -- row written (5 ms per 10,000 rows).  When all the table's interest
        -- belongs to one broker (the usual case), two index probes say so
        -- first, and the statement runs without RETURNING: the rows it wrote,
        -- if any, are that broker's.  With no interest at all there is nothing
        -- to write; none can appear before this transaction ends, since
        -- subscribe() waits for the watch lock taken above.
        --
        -- Which plan is best depends on the statement's size against the
        -- table's interest rows, and PL/pgSQL would keep the first one for the
        -- session: a plan made for a huge statement would hash every interest
        -- row of the table for each later, smaller one.  So statements of up
        -- to 1,024 rows always probe interest row by row (a LATERAL subquery
        -- the planner cannot turn into a hash), and larger ones are planned at
        -- each run (EXECUTE: 1 to 2 ms, measured; under 5% of a 5,000-row
        -- statement).
        v_bulk_key := CASE WHEN v_text_key THEN v_text ELSE v_key END;
        v_cores := '{}';
        FOR v_src IN
            VALUES (format('JOIN pgbroker.interest i ON i.watch_id = %s AND i.%I = %%s', v_id,
                           CASE WHEN v_text_key THEN 'key_text' ELSE 'row_key' END)),
                   (format('CROSS JOIN LATERAL (SELECT j.name, j.epoch, j.clients, j.row_key FROM pgbroker.interest j'
                           ' WHERE j.watch_id = %s AND j.%I = %%s OFFSET 0) i', v_id,
                           CASE WHEN v_text_key THEN 'key_text' ELSE 'row_key' END))
        LOOP
            IF v_kind = 'upd' THEN
                v_src := format(v_src, v_bulk_key);
                v_core := format($p$INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
            SELECT z.name, z.epoch, %1$s, z.op, z.row_key, z.changed, z.clients
              FROM (SELECT i.name, i.epoch, i.clients, (%3$s)::"char" AS op, i.row_key, %5$s AS changed
                      FROM %2$s
                      %4$s
                    OFFSET 0) z
             WHERE z.op <> 'U' OR cardinality(z.changed) > 0$p$, v_id, v_from, v_op, v_src, v_changed_expr);
            ELSE
                v_src := format(v_src, 'k.key');
                v_core := format($p$INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
            SELECT i.name, i.epoch, %1$s, k.op, i.row_key, k.changed, i.clients
              FROM (SELECT (%3$s)::"char" AS op, %4$s AS key, %5$s AS changed FROM %2$s OFFSET 0) k
              %6$s$p$, v_id, v_from, v_op, v_bulk_key, v_changed_expr, v_src);
            END IF;
            v_cores := v_cores || v_core;
        END LOOP;
        v_bulk := format($p$
        v_jit := current_setting('jit');
        PERFORM set_config('jit', 'off', true);%2$s
        v_large := EXISTS (SELECT FROM %7$s OFFSET 1024);
        SELECT min(i.name), max(i.name) INTO v_min, v_max FROM pgbroker.interest i WHERE i.watch_id = %1$s;
        IF v_min = v_max THEN
            IF v_large THEN
                EXECUTE %5$L;
                GET DIAGNOSTICS v_rows = ROW_COUNT;
            ELSE
            %3$s;
                GET DIAGNOSTICS v_rows = ROW_COUNT;
            END IF;
            IF v_rows > 0 THEN
                v_names := ARRAY[v_min];
            END IF;
        ELSIF v_min IS NOT NULL THEN
            IF v_large THEN
                EXECUTE %6$L INTO v_names;
            ELSE
            WITH ins AS (
            %3$s
            RETURNING name)
            SELECT array_agg(d.name) INTO v_names FROM (SELECT DISTINCT name FROM ins) d;
            END IF;
        END IF;%4$s
        PERFORM set_config('jit', v_jit, true);$p$, v_id,
            CASE WHEN v_kind = 'upd' THEN $x$
        v_mergejoin := current_setting('enable_mergejoin');
        PERFORM set_config('enable_mergejoin', 'off', true);$x$ ELSE '' END,
            v_cores[2],
            CASE WHEN v_kind = 'upd' THEN $x$
        PERFORM set_config('enable_mergejoin', v_mergejoin, true);$x$ ELSE '' END,
            v_cores[1],
            format('WITH ins AS (%s RETURNING name) SELECT array_agg(d.name) FROM (SELECT DISTINCT name FROM ins) d',
                   v_cores[1]),
            v_count_from);
        -- PL/pgSQL plans a statement once per session, for the number of rows
        -- in the transition table at its first run.  A plan made for a bulk
        -- statement (a hash over every interest row of the table) would then
        -- serve every single-row statement of that session, so small and
        -- large statements run the same text from two places: two plans.
        -- Up to 64 rows, one index probe per row is always the right plan.
        v_body := format(v_head, v_id) || format($b$
    SELECT EXISTS (SELECT FROM pgbroker.interest WHERE watch_id = %1$s AND row_key = 'null'::jsonb),
           EXISTS (SELECT FROM %6$s OFFSET 64)
      INTO v_whole, v_bulk;
    IF v_whole THEN
        v_jit := current_setting('jit');
        PERFORM set_config('jit', 'off', true);
        WITH ins AS (
            INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
            SELECT t.name, t.epoch, %1$s, k.op, k.row_key, k.changed, t.clients
              FROM %2$s
             CROSS JOIN LATERAL (SELECT (%3$s)::"char" AS op, %4$s AS row_key) k0
             CROSS JOIN LATERAL (SELECT k0.op, k0.row_key, CASE WHEN k0.op = 'U' THEN %5$s END AS changed) k
             CROSS JOIN LATERAL (
                   SELECT i.name, max(i.epoch) AS epoch, array_agg(DISTINCT c ORDER BY c) AS clients
                     FROM pgbroker.interest i, unnest(i.clients) AS c
                    WHERE i.watch_id = %1$s AND i.row_key IN (k.row_key, 'null'::jsonb)
                    GROUP BY i.name) t
             WHERE k.op <> 'U' OR cardinality(k.changed) > 0
            RETURNING name)
        SELECT array_agg(d.name) INTO v_names FROM (SELECT DISTINCT name FROM ins) d;
        PERFORM set_config('jit', v_jit, true);
    ELSIF NOT v_bulk THEN%7$s
    ELSE%8$s
    END IF;
$b$, v_id, v_from, v_op, v_key, v_changed_expr, v_count_from, v_plain, v_bulk) || v_tail;
        EXECUTE format('CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER '
                       'SET search_path = pg_catalog, pg_temp%s AS %L', v_fn, v_settings, v_body);
        EXECUTE format('COMMENT ON FUNCTION %s() IS %L', v_fn,
                       format('Internal: %s trigger of watched table %s (generated by pgbroker.watch).',
                              upper(v_kind), v_table));
    END LOOP;

    -- TRUNCATE: every client with any interest in the table hears of it
    -- (JIT off: the estimate grows with the table's interest rows).
    v_fn := format('pgbroker._watch_%s_trunc', v_id);
    v_body := format(v_head, v_id) || format($b$
    v_jit := current_setting('jit');
    PERFORM set_config('jit', 'off', true);
    WITH ins AS (
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT i.name, max(i.epoch), %1$s, 'T', NULL, NULL,
               ARRAY(SELECT DISTINCT c FROM pgbroker.interest j, unnest(j.clients) c
                      WHERE j.watch_id = %1$s AND j.name = i.name ORDER BY 1)
          FROM pgbroker.interest i
         WHERE i.watch_id = %1$s
         GROUP BY i.name
        RETURNING name)
    SELECT array_agg(d.name) INTO v_names FROM (SELECT DISTINCT name FROM ins) d;
    PERFORM set_config('jit', v_jit, true);
$b$, v_id) || v_tail;
    EXECUTE format('CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER '
                   'SET search_path = pg_catalog, pg_temp AS %L', v_fn, v_body);
    EXECUTE format('COMMENT ON FUNCTION %s() IS %L', v_fn, format('Internal: TRUNCATE trigger of watched table %s (generated by pgbroker.watch).', v_table));

    PERFORM pgbroker._watch_drop_triggers(p_watch);
    EXECUTE format('CREATE TRIGGER _pgbroker_watch_ins AFTER INSERT ON %s REFERENCING NEW TABLE AS pgbroker_new '
                   'FOR EACH STATEMENT EXECUTE FUNCTION pgbroker._watch_%s_ins()', v_table, v_id);
    EXECUTE format('CREATE TRIGGER _pgbroker_watch_upd AFTER UPDATE ON %s REFERENCING OLD TABLE AS pgbroker_old NEW TABLE AS pgbroker_new '
                   'FOR EACH STATEMENT EXECUTE FUNCTION pgbroker._watch_%s_upd()', v_table, v_id);
    EXECUTE format('CREATE TRIGGER _pgbroker_watch_del AFTER DELETE ON %s REFERENCING OLD TABLE AS pgbroker_old '
                   'FOR EACH STATEMENT EXECUTE FUNCTION pgbroker._watch_%s_del()', v_table, v_id);
    EXECUTE format('CREATE TRIGGER _pgbroker_watch_trunc AFTER TRUNCATE ON %s '
                   'FOR EACH STATEMENT EXECUTE FUNCTION pgbroker._watch_%s_trunc()', v_table, v_id);
    EXECUTE format('COMMENT ON TRIGGER _pgbroker_watch_ins ON %s IS %L', v_table, 'pgbroker: tells subscribed clients of inserted rows.');
    EXECUTE format('COMMENT ON TRIGGER _pgbroker_watch_upd ON %s IS %L', v_table, 'pgbroker: tells subscribed clients of updated rows.');
    EXECUTE format('COMMENT ON TRIGGER _pgbroker_watch_del ON %s IS %L', v_table, 'pgbroker: tells subscribed clients of deleted rows.');
    EXECUTE format('COMMENT ON TRIGGER _pgbroker_watch_trunc ON %s IS %L', v_table, 'pgbroker: tells every subscribed client of a TRUNCATE.');
    -- Generated functions are internal: nobody calls them but the triggers.
    EXECUTE format('REVOKE ALL ON FUNCTION pgbroker._watch_%1$s_ins(), pgbroker._watch_%1$s_upd(), '
                   'pgbroker._watch_%1$s_del(), pgbroker._watch_%1$s_trunc() FROM PUBLIC', v_id);
END
$$;
COMMENT ON FUNCTION pgbroker._watch_install(pgbroker.watched) IS
    'Internal: (re)generate the trigger functions of a watched table and (re)create its triggers.';

CREATE FUNCTION pgbroker._watch_drop_triggers(p_watch pgbroker.watched)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_trigger text;
BEGIN
    IF to_regclass(p_watch.relid::regclass::text) IS NULL THEN
        RETURN;
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

CREATE FUNCTION pgbroker.watch("table" regclass)
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
    INSERT INTO pgbroker.watched AS w (relid, table_name, key_columns, key_types)
    VALUES (watch."table", watch."table"::text, v_cols, v_types)
    ON CONFLICT ON CONSTRAINT watched_relid_unique
    DO UPDATE SET table_name = excluded.table_name, watched_at = clock_timestamp()
    RETURNING * INTO v_watch;
    IF v_watch.key_columns IS DISTINCT FROM v_cols OR v_watch.key_types IS DISTINCT FROM v_types THEN
        RAISE EXCEPTION 'the primary key of % changed since it was watched', watch."table"
            USING ERRCODE = 'PB020', HINT = 'Subscriptions use the old key: unwatch() it, then watch() it again.';
    END IF;
    PERFORM pgbroker._watch_install(v_watch);
    RETURN v_watch.watch_id;
END
$$;
COMMENT ON FUNCTION pgbroker.watch(regclass) IS
$$Admin: watch TABLE (an ordinary table with a primary key; 42809 for a view or other relation, PB020 without a key).
Installs statement-level triggers (INSERT, UPDATE, DELETE with transition tables; TRUNCATE) that write the subscribed
clients of each changed row to the outbox and wake their brokers. Idempotent: call it again after ALTER TABLE adds or
removes columns. Returns the watch id.$$;

CREATE FUNCTION pgbroker.unwatch("table" regclass)
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
    PERFORM pgbroker._watch_drop_triggers(v_watch);
    EXECUTE format('DROP FUNCTION pgbroker._watch_%1$s_ins(), pgbroker._watch_%1$s_upd(), '
                   'pgbroker._watch_%1$s_del(), pgbroker._watch_%1$s_trunc()', v_watch.watch_id);
    DELETE FROM pgbroker.outbox WHERE watch_id = v_watch.watch_id;
    DELETE FROM pgbroker.watched WHERE watch_id = v_watch.watch_id;   -- cascades to subscriptions and interest
    RETURN true;
END
$$;
COMMENT ON FUNCTION pgbroker.unwatch(regclass) IS
    'Admin: remove the pgbroker triggers from TABLE, with its subscriptions and pending notifications; false when it was not watched.';
