-- pgbroker_0004_filters: filters.
-- Drafted by migrations/new_revision.py from sql/, with the hand-written blocks marked below.

-- ---------------------------------------------------------------------------
-- Hand-written (begin): before the functions.  SQL-language functions below
-- name the new table and columns, which are made at the end (the outbox's
-- columns last: ALTER TABLE locks it, and the lock is held to commit), so
-- their bodies are not checked at creation, as pg_dump does.
SET LOCAL check_function_bodies = off;

CREATE TABLE pgbroker.filter_shape (
    watch_id integer NOT NULL,   -- no foreign key (see subscription); unwatch() deletes its table's
    columns text[] NOT NULL,
    range_column text NOT NULL DEFAULT '',
    added_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    PRIMARY KEY (watch_id, columns, range_column)
);
COMMENT ON TABLE pgbroker.filter_shape IS
    'The shapes (sets of columns) of the filters subscribed to per watched table: the triggers compute each changed row''s point of each. Internal: subscribe with a filter adds them.';
COMMENT ON COLUMN pgbroker.filter_shape.watch_id IS 'The watched table.';
COMMENT ON COLUMN pgbroker.filter_shape.columns IS 'The columns of the shape compared for equality, sorted (COLLATE "C").';
COMMENT ON COLUMN pgbroker.filter_shape.range_column IS 'The column of the shape compared with a range; empty for none.';
COMMENT ON COLUMN pgbroker.filter_shape.added_at IS 'When the first filter of this shape was subscribed.';
-- Hand-written (end).
-- ---------------------------------------------------------------------------

DROP FUNCTION pgbroker.subscribe(text,regclass,jsonb,text,bigint,interval);
DROP FUNCTION pgbroker.unsubscribe(text,regclass,jsonb,text,bigint);
CREATE OR REPLACE FUNCTION pgbroker._check_read_committed(p_call text)
 RETURNS void
 LANGUAGE plpgsql
 STABLE
AS $function$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION '% needs a READ COMMITTED transaction, not %', p_call, upper(current_setting('transaction_isolation'))
            USING ERRCODE = 'PB011',
                  HINT = 'Call it in a transaction of its own or at READ COMMITTED: this transaction''s snapshot hides the subscriptions made since it began, which would outlive the client.';
    END IF;
END
$function$;
COMMENT ON FUNCTION pgbroker._check_read_committed(text) IS 'Internal: PB011 unless the transaction is READ COMMITTED; p_call names the caller in the message.';
REVOKE ALL ON FUNCTION pgbroker._check_read_committed(text) FROM PUBLIC;
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
    PERFORM pgbroker._check_read_committed('client_unregister');
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
COMMENT ON FUNCTION pgbroker.client_unregister(text,text,bigint) IS 'Holder only: unregister client CLIENT_ID and drop all its subscriptions; false when it was not registered. PB011 in a REPEATABLE READ or SERIALIZABLE transaction.';
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
    PERFORM pgbroker._check_read_committed('client_unregister_many');
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
As client_unregister() otherwise: from the holder''s session or with the holder''s current EPOCH, PB011 in a REPEATABLE READ or SERIALIZABLE transaction. 22004 / 22023 for a NULL array or a NULL, empty or too long id, naming its position (client_ids[3]); nothing of the call is kept then.';
CREATE OR REPLACE FUNCTION pgbroker._filter_max_points()
 RETURNS integer
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$ SELECT 1000 $function$;
COMMENT ON FUNCTION pgbroker._filter_max_points() IS 'Internal: the most points one filter may expand into (54000 beyond).';
REVOKE ALL ON FUNCTION pgbroker._filter_max_points() FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._filter_max_shapes()
 RETURNS integer
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$ SELECT 32 $function$;
COMMENT ON FUNCTION pgbroker._filter_max_shapes() IS 'Internal: the most shapes (sets of filtered columns) a watched table may have (54000 beyond).';
REVOKE ALL ON FUNCTION pgbroker._filter_max_shapes() FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._filter_points(p_watch pgbroker.watched, p_filters jsonb[], p_bulk boolean, OUT positions integer[], OUT points jsonb[], OUT shapes jsonb[])
 RETURNS record
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET "TimeZone" TO 'UTC'
 SET "IntervalStyle" TO 'postgres'
 SET extra_float_digits TO '1'
 SET bytea_output TO 'hex'
 SET lc_monetary TO 'C'
AS $function$
DECLARE
    v_bad record;
    v_bad_column text;
    v_bad_type regtype;
    v_simple boolean;
    v_try integer;
    v_pos bigint[];
    v_cols text[];
    v_vals jsonb[];
    v_enc jsonb[];
    v_cast text;
    v_state text;
    v_message text;
    v_range_pos bigint[];
    v_range_parts jsonb[];
    v_range_cols text[];
BEGIN
    IF cardinality(p_watch.key_columns) = 1 AND p_watch.key_types[1] IN ('jsonb'::regtype, 'json'::regtype) THEN
        RAISE EXCEPTION 'table % cannot be subscribed to by filter: its key is one jsonb column', p_watch.table_name
            USING ERRCODE = 'PB023', HINT = 'Subscribe by key, or to the whole table.';
    END IF;
    -- The common case first, in two statements: filters of one column each, of the table, with a JSON scalar or
    -- null (equality), so that each filter is one point.  Tried first as every filter on the first one's column,
    -- read with operators; then as any one column each, read with jsonb_each (a call per filter: 10,000 filters
    -- took 31 ms read with operators, 60 with jsonb_object_keys and jsonb_each).  Anything else (an error
    -- included) takes the steps below, which check one thing at a time, expand "in" and several columns, and name
    -- the first bad filter.  (No aggregate per filter here: 10,000 of them made the statement three times slower.)
    BEGIN
        FOR v_try IN 1..2 LOOP
            IF v_try = 1 THEN
                v_cols := ARRAY(SELECT jsonb_object_keys(p_filters[1]));
                CONTINUE WHEN cardinality(v_cols) <> 1;
            ELSE
                SELECT array_agg(DISTINCT k.col) INTO v_cols
                  FROM unnest(p_filters) AS u(f), jsonb_object_keys(u.f) AS k(col);
            END IF;
            SELECT e.cases INTO v_cast FROM pgbroker._filter_encoder(p_watch.relid, v_cols) AS e
             WHERE cardinality(v_cols) = (SELECT count(*) FROM pg_catalog.pg_attribute a
                                           WHERE a.attrelid = p_watch.relid AND a.attname = ANY (v_cols)
                                             AND a.attnum > 0 AND NOT a.attisdropped);
            CONTINUE WHEN v_cast IS NULL;
            -- u.v IS NOT NULL: the filter has the column (first try); f.f - u.col = '{}': it is the filter's only
            -- one; with one row per filter, none is empty.
            EXECUTE format($q$
                SELECT array_agg(f.i::integer ORDER BY f.i),
                       array_agg(jsonb_build_object(u.col, CASE jsonb_typeof(u.v) WHEN 'null' THEN 'null'::jsonb
                                                                                  WHEN 'object' THEN NULL
                                                                                  WHEN 'array' THEN NULL
                                                                                  ELSE CASE u.col %s END END)
                                 ORDER BY f.i),
                       coalesce(bool_and(coalesce(u.v IS NOT NULL AND jsonb_typeof(u.v) NOT IN ('object', 'array')
                                                  AND f.f - u.col = '{}'::jsonb, false)), true)
                       AND count(*) = cardinality($1)
                  FROM unnest($1) WITH ORDINALITY AS f(f, i), %s$q$,
                v_cast, CASE v_try WHEN 1 THEN 'LATERAL (SELECT $2 AS col, f.f -> $2 AS v) u'
                                   ELSE 'jsonb_each(f.f) AS u(col, v)' END)
               INTO positions, points, v_simple USING p_filters, v_cols[1];
            IF v_simple THEN
                shapes := ARRAY(SELECT to_jsonb(ARRAY[c.col]) FROM unnest(v_cols) AS c(col));
                RETURN;
            END IF;
        END LOOP;
    EXCEPTION WHEN data_exception OR integrity_constraint_violation THEN
        NULL;  -- not an object, or a value that does not cast: named below
    END;
    -- Each filter a non-empty object.
    SELECT u.i, u.f INTO v_bad FROM unnest(p_filters) WITH ORDINALITY AS u(f, i)
     WHERE u.f IS NULL OR jsonb_typeof(u.f) <> 'object' OR u.f = '{}'::jsonb
     ORDER BY u.i LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION '%: a filter must be a non-empty JSON object of column names and values, not %',
                pgbroker._filter_where(p_bulk, v_bad.i), coalesce(v_bad.f::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'For example {"team": 7}, {"status": {"in": ["open", "pending"]}}, {"closed_at": null}.';
    END IF;
    -- Every (filter, column, condition), read once (arrays: unnest, never subscripts).
    SELECT array_agg(u.i ORDER BY u.i), array_agg(x.key ORDER BY u.i), array_agg(x.value ORDER BY u.i)
      INTO v_pos, v_cols, v_vals
      FROM unnest(p_filters) WITH ORDINALITY AS u(f, i), jsonb_each(u.f) AS x(key, value);
    -- Each column one of the table's (an exact, case-sensitive name, as the catalog has it): each name once.
    SELECT min(u.i) AS i, u.col INTO v_bad
      FROM unnest(v_pos, v_cols) AS u(i, col)
     WHERE u.col IN (SELECT d.col FROM (SELECT DISTINCT c AS col FROM unnest(v_cols) AS c) d
                      WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_attribute a
                                         WHERE a.attrelid = p_watch.relid AND a.attname = d.col AND a.attnum > 0
                                           AND NOT a.attisdropped))
     GROUP BY u.col ORDER BY 1 LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION '%: column % of table % does not exist', pgbroker._filter_where(p_bulk, v_bad.i),
                quote_ident(v_bad.col), p_watch.table_name
            USING ERRCODE = 'undefined_column';
    END IF;
    -- Each value: a JSON value (equality), {"eq": value}, {"in": [values, ...]} (not empty), or a range: one or two
    -- of gt / gte (lower bound) and lt / lte (upper bound), each a JSON scalar.
    SELECT q.i, q.col, q.v, q.problem INTO v_bad
      FROM (SELECT u.i, u.col, u.v,
                   CASE WHEN jsonb_typeof(u.v) = 'array' THEN 'array'
                        WHEN u.v = '{}'::jsonb THEN 'empty'
                        WHEN u.v ?| ARRAY['neq', 'ne', 'like', 'ilike', 'not', 'is', 'contains'] THEN 'unsupported'
                        WHEN EXISTS (SELECT FROM jsonb_object_keys(u.v) AS k
                                      WHERE k NOT IN ('eq', 'in', 'gt', 'gte', 'lt', 'lte')) THEN 'unknown'
                        WHEN (u.v ? 'eq' OR u.v ? 'in') AND (SELECT count(*) FROM jsonb_object_keys(u.v)) > 1 THEN 'several'
                        WHEN u.v ? 'in' AND (jsonb_typeof(u.v -> 'in') <> 'array' OR u.v -> 'in' = '[]'::jsonb) THEN 'in'
                        WHEN (u.v ? 'gt' AND u.v ? 'gte') OR (u.v ? 'lt' AND u.v ? 'lte') THEN 'bounds'
                        WHEN EXISTS (SELECT FROM jsonb_each(u.v) AS b
                                      WHERE b.key IN ('gt', 'gte', 'lt', 'lte')
                                        AND jsonb_typeof(b.value) IN ('null', 'array', 'object')) THEN 'bound'
                   END AS problem
              FROM unnest(v_pos, v_cols, v_vals) AS u(i, col, v)
             WHERE jsonb_typeof(u.v) IN ('array', 'object')) q
     WHERE q.problem IS NOT NULL
     ORDER BY q.i LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION '%: %', pgbroker._filter_where(p_bulk, v_bad.i), CASE v_bad.problem
                WHEN 'array' THEN format('the value of column %s is an array: several values are {"in": [...]}, an array value {"eq": [...]}',
                                         quote_ident(v_bad.col))
                WHEN 'empty' THEN format('column %s has an empty operator object', quote_ident(v_bad.col))
                WHEN 'several' THEN format('column %s has "eq" or "in" beside another operator (%s): give one',
                                           quote_ident(v_bad.col), v_bad.v)
                WHEN 'in' THEN format('"in" of column %s must be a non-empty JSON array', quote_ident(v_bad.col))
                WHEN 'bounds' THEN format('column %s has two lower or two upper bounds (%s): give one of gt and gte, one of lt and lte',
                                          quote_ident(v_bad.col), v_bad.v)
                WHEN 'bound' THEN format('a bound of column %s is not a JSON scalar (%s)', quote_ident(v_bad.col), v_bad.v)
                WHEN 'unsupported' THEN format('operator %s of column %s is not supported',
                                               (SELECT k FROM jsonb_object_keys(v_bad.v) AS k
                                                 WHERE k IN ('neq', 'ne', 'like', 'ilike', 'not', 'is', 'contains') LIMIT 1),
                                               quote_ident(v_bad.col))
                ELSE format('unknown operator %s of column %s',
                            quote_literal((SELECT k FROM jsonb_object_keys(v_bad.v) AS k
                                            WHERE k NOT IN ('eq', 'in', 'gt', 'gte', 'lt', 'lte') LIMIT 1)),
                            quote_ident(v_bad.col)) END
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'A column''s condition is a JSON value (equality; null matches NULL), {"eq": value}, {"in": [value, ...]}, '
                         'or a range: {"gte": 10, "lt": 20} (gt, gte, lt, lte).';
    END IF;
    -- The ranges: taken apart (v_range_pos, v_range_parts), the rest expanded below.
    IF EXISTS (SELECT FROM unnest(v_vals) AS u(v) WHERE jsonb_typeof(u.v) = 'object' AND NOT (u.v ? 'eq' OR u.v ? 'in')) THEN
        SELECT r.positions, r.parts, r.columns INTO v_range_pos, v_range_parts, v_range_cols
          FROM pgbroker._filter_ranges(p_watch, v_pos, v_cols, v_vals, p_bulk) AS r;
        SELECT array_agg(u.i ORDER BY u.n), array_agg(u.col ORDER BY u.n), array_agg(u.v ORDER BY u.n)
          INTO v_pos, v_cols, v_vals
          FROM unnest(v_pos, v_cols, v_vals) WITH ORDINALITY AS u(i, col, v, n)
         WHERE NOT (jsonb_typeof(u.v) = 'object' AND NOT (u.v ? 'eq' OR u.v ? 'in'));
    END IF;
    -- Every (filter, column, value): the values of "in" one by one (a value given twice makes a point given twice,
    -- which subscribes once).
    SELECT array_agg(e.i ORDER BY e.n, e.m), array_agg(e.col ORDER BY e.n, e.m), array_agg(e.v ORDER BY e.n, e.m)
      INTO v_pos, v_cols, v_vals
      FROM (SELECT u.i, u.col, u.n, y.m, y.v
              FROM unnest(v_pos, v_cols, v_vals) WITH ORDINALITY AS u(i, col, c, n)
              CROSS JOIN LATERAL (SELECT z.v, z.m FROM jsonb_array_elements(u.c -> 'in') WITH ORDINALITY AS z(v, m)
                                   WHERE jsonb_typeof(u.c) = 'object' AND u.c ? 'in'
                                  UNION ALL
                                  SELECT CASE WHEN jsonb_typeof(u.c) = 'object' THEN u.c -> 'eq' ELSE u.c END, 1
                                   WHERE jsonb_typeof(u.c) <> 'object' OR u.c ? 'eq') AS y(v, m)) e;
    -- Too many points?
    SELECT n.i, n.points INTO v_bad
      FROM (SELECT c.i, round(exp(sum(ln(c.n)))) AS points
              FROM (SELECT u.i, u.col, count(*) AS n FROM unnest(v_pos, v_cols) AS u(i, col) GROUP BY u.i, u.col) c
             GROUP BY c.i) n
     WHERE n.points > pgbroker._filter_max_points()
     ORDER BY n.i LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION '%: the filter has % combinations of values, more than %', pgbroker._filter_where(p_bulk, v_bad.i),
                v_bad.points, pgbroker._filter_max_points()
            USING ERRCODE = 'program_limit_exceeded', HINT = 'Split it into several filters.';
    END IF;
    -- Each column's values cast to its type (so "7" and 7 are the same value of an integer column), and encoded as
    -- the triggers encode the row's value, in one statement; a column whose type has no equality is refused.
    -- (None to cast when every filter is one range.)
    IF v_pos IS NOT NULL THEN
        SELECT e.cases, e.bad_column, e.bad_type INTO v_cast, v_bad_column, v_bad_type
          FROM pgbroker._filter_encoder(p_watch.relid, ARRAY(SELECT DISTINCT c FROM unnest(v_cols) AS c)) AS e;
        IF v_cast IS NULL THEN
            SELECT min(u.i) AS i INTO v_bad FROM unnest(v_pos, v_cols) AS u(i, col) WHERE u.col = v_bad_column;
            RAISE EXCEPTION '%: column % has type %, which has no equality operator', pgbroker._filter_where(p_bulk, v_bad.i),
                    quote_ident(v_bad_column), v_bad_type
                USING ERRCODE = 'PB023', HINT = 'Filters compare for equality: filter on another column.';
        END IF;
        BEGIN
            EXECUTE format($q$SELECT array_agg(CASE WHEN jsonb_typeof(u.v) = 'null' THEN 'null'::jsonb ELSE CASE u.col %s END END
                                               ORDER BY u.n)
                                FROM unnest($1, $2) WITH ORDINALITY AS u(v, col, n)$q$, v_cast)
               INTO v_enc USING v_vals, v_cols;
        EXCEPTION WHEN data_exception OR integrity_constraint_violation THEN
            -- Which value: one at a time, in order, for the message.
            FOR v_bad IN SELECT u.i, u.col, u.v, a.atttypid::regtype AS typ
                           FROM unnest(v_pos, v_cols, v_vals) AS u(i, col, v)
                           JOIN pg_catalog.pg_attribute a ON a.attrelid = p_watch.relid AND a.attname = u.col
                          WHERE jsonb_typeof(u.v) <> 'null' ORDER BY u.i, u.col LOOP
                BEGIN
                    EXECUTE format('SELECT %s::%s', CASE WHEN v_bad.typ = 'jsonb'::regtype THEN quote_literal(v_bad.v)
                                                         ELSE quote_literal(v_bad.v #>> '{}') END, v_bad.typ);
                EXCEPTION WHEN data_exception OR integrity_constraint_violation THEN
                    GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_message = MESSAGE_TEXT;
                    RAISE EXCEPTION '%: value % of column % does not cast to its type %: %', pgbroker._filter_where(p_bulk, v_bad.i),
                            v_bad.v, quote_ident(v_bad.col), v_bad.typ, v_message
                        USING ERRCODE = v_state;
                END;
            END LOOP;
            RAISE;  -- cannot happen: no value alone fails
        END;
    END IF;
    -- The points.  Filters of one column: one point per value.  Others: the product of their columns' values,
    -- built column by column, then each filter's range (a filter of a range alone: the range).
    IF v_range_pos IS NULL
       AND NOT EXISTS (SELECT FROM unnest(v_pos, v_cols) AS u(i, col) GROUP BY u.i HAVING count(DISTINCT u.col) > 1) THEN
        SELECT array_agg(u.i::integer ORDER BY u.n), array_agg(jsonb_build_object(u.col, u.enc) ORDER BY u.n),
               array_agg(DISTINCT to_jsonb(ARRAY[u.col]))
          INTO positions, points, shapes
          FROM unnest(v_pos, v_cols, v_enc) WITH ORDINALITY AS u(i, col, enc, n);
        RETURN;
    END IF;
    WITH RECURSIVE e AS (
        SELECT u.i, u.col, u.enc FROM unnest(v_pos, v_cols, v_enc) AS u(i, col, enc)
    ), c AS (
        SELECT e.i, e.col, e.enc, dense_rank() OVER (PARTITION BY e.i ORDER BY e.col COLLATE "C") AS k FROM e
    ), r AS (
        SELECT r.i, r.part, r.col FROM unnest(v_range_pos, v_range_parts, v_range_cols) AS r(i, part, col)
    ), s AS (
        SELECT c.i, max(c.k) AS k, array_agg(DISTINCT c.col COLLATE "C") AS columns FROM c GROUP BY c.i
        UNION ALL
        SELECT r.i, 0, '{}' FROM r WHERE r.i NOT IN (SELECT e.i FROM e)
    ), p (i, k, point) AS (
        SELECT s.i, 0::bigint, '{}'::jsonb FROM s
        UNION ALL
        SELECT p.i, c.k, p.point || jsonb_build_object(c.col, c.enc) FROM p JOIN c ON c.i = p.i AND c.k = p.k + 1
    )
    -- A shape: its equality columns, and a range's column as a last element {"range": column}.
    SELECT array_agg(p.i::integer ORDER BY p.i), array_agg(p.point || coalesce(r.part, '{}') ORDER BY p.i),
           array_agg(DISTINCT to_jsonb(s.columns) || CASE WHEN r.col IS NULL THEN '[]'::jsonb
                                                          ELSE jsonb_build_array(jsonb_build_object('range', r.col)) END)
      INTO positions, points, shapes
      FROM p JOIN s ON s.i = p.i AND s.k = p.k
      LEFT JOIN r ON r.i = p.i;
END
$function$;
COMMENT ON FUNCTION pgbroker._filter_points(pgbroker.watched,jsonb[],boolean) IS 'Internal: the points (subscription keys) of filters of a watched table, with their filters'' positions, and their shapes; the first bad filter''s error names it.';
REVOKE ALL ON FUNCTION pgbroker._filter_points(pgbroker.watched,jsonb[],boolean) FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._filter_shapes_add(p_watch pgbroker.watched, p_shapes jsonb[], p_wait interval)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_shapes bigint;
BEGIN
    -- A shape: a JSON array of its equality columns, then {"range": column} if it has one.
    IF NOT EXISTS (SELECT FROM unnest(p_shapes) AS u(s)
                    WHERE NOT EXISTS (SELECT FROM pgbroker.filter_shape f
                                       WHERE f.watch_id = p_watch.watch_id
                                         AND f.columns = ARRAY(SELECT e #>> '{}' FROM jsonb_array_elements(u.s) AS e
                                                                WHERE jsonb_typeof(e) = 'string')
                                         AND f.range_column = coalesce(u.s -> -1 ->> 'range', ''))) THEN
        RETURN;
    END IF;
    PERFORM pgbroker._watch_lock_table(p_watch.relid::regclass, p_wait);
    INSERT INTO pgbroker.filter_shape (watch_id, columns, range_column)
    SELECT p_watch.watch_id, ARRAY(SELECT e #>> '{}' FROM jsonb_array_elements(u.s) AS e WHERE jsonb_typeof(e) = 'string'),
           coalesce(u.s -> -1 ->> 'range', '')
      FROM unnest(p_shapes) AS u(s)
    ON CONFLICT DO NOTHING;
    SELECT count(*) INTO v_shapes FROM pgbroker.filter_shape f WHERE f.watch_id = p_watch.watch_id;
    IF v_shapes > pgbroker._filter_max_shapes() THEN
        RAISE EXCEPTION 'table % would have % shapes of filters (sets of filtered columns, and ranges), more than %',
                p_watch.table_name, v_shapes, pgbroker._filter_max_shapes()
            USING ERRCODE = 'program_limit_exceeded',
                  HINT = 'Filter on fewer combinations of columns; shapes stay until unwatch().';
    END IF;
END
$function$;
COMMENT ON FUNCTION pgbroker._filter_shapes_add(pgbroker.watched,jsonb[],interval) IS 'Internal: record the shapes (JSON arrays of sorted column names, and {"range": column}) not known yet of a watched table, under the table''s lock (PB022 after p_wait); its triggers are rendered again.';
REVOKE ALL ON FUNCTION pgbroker._filter_shapes_add(pgbroker.watched,jsonb[],interval) FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._filter_shapes_render()
 RETURNS trigger
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_watch pgbroker.watched;
BEGIN
    FOR v_watch IN SELECT w.* FROM pgbroker.watched w WHERE w.watch_id IN (SELECT a.watch_id FROM added_shapes a)
                    ORDER BY w.watch_id LOOP
        PERFORM pgbroker._watch_create_functions(v_watch);
    END LOOP;
    RETURN NULL;
END
$function$;
COMMENT ON FUNCTION pgbroker._filter_shapes_render() IS 'Internal (statement trigger): render the trigger functions of the tables that have new filter shapes.';
REVOKE ALL ON FUNCTION pgbroker._filter_shapes_render() FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._filter_where(p_bulk boolean, p_position bigint)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $function$ SELECT CASE WHEN p_bulk THEN 'filters[' || p_position || ']' ELSE 'filter' END $function$;
COMMENT ON FUNCTION pgbroker._filter_where(boolean,bigint) IS 'Internal: "filter" or "filters[i]", for error messages.';
REVOKE ALL ON FUNCTION pgbroker._filter_where(boolean,bigint) FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._subscribe_filters(p_name text, p_epoch bigint, p_client_ids text[], p_watch pgbroker.watched, p_filters jsonb[], p_wait interval, p_bulk boolean)
 RETURNS bigint
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_ids text[];
    v_points jsonb[];
    v_positions integer[];
    v_shapes jsonb[];
BEGIN
    PERFORM pgbroker._wait_ms(p_wait);  -- 22023 on a negative wait, before anything
    SELECT p.positions, p.points, p.shapes INTO v_positions, v_points, v_shapes
      FROM pgbroker._filter_points(p_watch, p_filters, p_bulk) AS p;
    IF cardinality(v_points) = cardinality(p_filters) THEN
        v_ids := p_client_ids;  -- one point per filter (a filter has at least one), in order
    ELSE
        v_ids := ARRAY(SELECT c.id FROM unnest(v_positions) WITH ORDINALITY AS p(pos, n)
                         JOIN unnest(p_client_ids) WITH ORDINALITY AS c(id, i) ON c.i = p.pos
                        ORDER BY p.n);
    END IF;
    PERFORM pgbroker._filter_shapes_add(p_watch, v_shapes, p_wait);
    RETURN pgbroker._subscribe_pairs(p_name, p_epoch, v_ids, p_watch, v_points, p_wait, v_positions);
END
$function$;
COMMENT ON FUNCTION pgbroker._subscribe_filters(text,bigint,text[],pgbroker.watched,jsonb[],interval,boolean) IS 'Internal: subscribe client_ids[i] to every point of filters[i] of a watched table; returns how many subscriptions were new.';
REVOKE ALL ON FUNCTION pgbroker._subscribe_filters(text,bigint,text[],pgbroker.watched,jsonb[],interval,boolean) FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._subscribe_pairs(p_name text, p_epoch bigint, p_client_ids text[], p_watch pgbroker.watched, p_keys jsonb[], p_wait interval, p_positions integer[])
 RETURNS bigint
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET plan_cache_mode TO 'force_custom_plan'
 SET enable_mergejoin TO 'off'
 SET jit TO 'off'
AS $function$
DECLARE
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
    -- its pairs needs looking for below.  That takes a probe per client,
    -- which saves one per pair: asked only of clients given several pairs
    -- (a batch of 10,000 filters of 10,000 clients spent 17 ms on it).
    WITH ids AS (
        SELECT u.id, min(coalesce(u.pos, u.i)) AS i, count(*) AS pairs
          FROM unnest(p_client_ids, p_positions) WITH ORDINALITY AS u(id, pos, i) GROUP BY u.id
    )
    SELECT min(ids.i) FILTER (WHERE c.client_key IS NULL), array_agg(ids.id), array_agg(c.client_key),
           array_agg(ids.pairs > 1 AND NOT EXISTS (SELECT FROM pgbroker.subscription s
                                                    WHERE s.client_key = c.client_key AND s.watch_id = p_watch.watch_id))
      INTO v_bad, v_ids, v_client_keys, v_fresh
      FROM ids
      LEFT JOIN LATERAL (SELECT x.client_key FROM pgbroker.client x
                          WHERE x.name = p_name AND x.epoch = p_epoch AND x.client_id = ids.id
                            FOR KEY SHARE) c ON true;
    IF v_bad IS NOT NULL THEN
        RAISE EXCEPTION 'client "%" (client_ids[%]) is not registered with broker "%"',
                (SELECT u.id FROM unnest(p_client_ids, p_positions) WITH ORDINALITY AS u(id, pos, i)
                  WHERE coalesce(u.pos, u.i) = v_bad LIMIT 1), v_bad, p_name
            USING ERRCODE = 'PB010', HINT = 'Register it first with pgbroker.client_register() or client_register_many().';
    END IF;
    PERFORM pgbroker._subscribe_lock(p_watch, p_watch.relid::regclass, p_wait);
    v_watched := pgbroker._registry_watched(p_name);
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
          FROM (SELECT DISTINCT u.id, u.row_key FROM unnest(p_client_ids, p_keys) AS u(id, row_key)) g
          JOIN clients c ON c.id = g.id
          -- an index probe per pair of a client that is not fresh, never a scan of what the table has
          LEFT JOIN LATERAL (SELECT true AS found FROM pgbroker.subscription s
                              WHERE NOT c.fresh
                                AND s.client_key = c.client_key AND s.watch_id = p_watch.watch_id AND s.row_key = g.row_key
                              LIMIT 1) e ON true
         WHERE e.found IS NULL
    ), added AS (
        INSERT INTO pgbroker.subscription (client_key, watch_id, row_key)
        SELECT n.client_key, p_watch.watch_id, n.row_key FROM new n
    ), interest AS (
        INSERT INTO pgbroker.interest AS i (watch_id, row_key, name, epoch, lock_key, clients, range_box)
        SELECT p_watch.watch_id, n.row_key, p_name, p_epoch, (SELECT l.lock_key FROM pgbroker.lease l WHERE l.name = p_name),
               array_agg(n.id), pgbroker._range_box(p_watch.watch_id, n.row_key)
          FROM new n
         GROUP BY n.row_key
        ON CONFLICT ON CONSTRAINT interest_pkey DO UPDATE SET clients = i.clients || excluded.clients
    )
    -- (A FILTER is tested before its aggregate's argument: nothing is
    -- announced while nobody watches.)
    SELECT count(*),
           sum(num_nulls(pg_notify('pgbroker_registry_' || md5(p_name),
                                   pgbroker._registry_subscription_event('subscribe', p_name, p_epoch, n.id,
                                                                         p_watch.relid::regclass::text, n.row_key))))
               FILTER (WHERE v_watched)
      INTO v_new, v_announced
      FROM new n;
    RETURN v_new;
END
$function$;
COMMENT ON FUNCTION pgbroker._subscribe_pairs(text,bigint,text[],pgbroker.watched,jsonb[],interval,integer[]) IS 'Internal: subscribe client_ids[i] to the encoded key (or filter point) keys[i] of a watched table, for every i, in one statement under the table''s watch lock; returns how many were new.';
REVOKE ALL ON FUNCTION pgbroker._subscribe_pairs(text,bigint,text[],pgbroker.watched,jsonb[],interval,integer[]) FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._watch_create_functions(p_watch pgbroker.watched)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
$function$;
COMMENT ON FUNCTION pgbroker._watch_create_functions(pgbroker.watched) IS 'Internal: (re)generate the trigger functions of a watched table, for its mode and its filters'' shapes.';
REVOKE ALL ON FUNCTION pgbroker._watch_create_functions(pgbroker.watched) FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._watch_ffanout_template()
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $function$ SELECT $t$
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
$function$;
COMMENT ON FUNCTION pgbroker._watch_ffanout_template() IS 'Internal: template of the INSERT ... SELECT by which the watch triggers of a table with filters fan out its changes.';
REVOKE ALL ON FUNCTION pgbroker._watch_ffanout_template() FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._watch_filtered_statement_template()
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $function$ SELECT $t$
BEGIN
{{filtered}}
    RETURN NULL;
END
$t$
$function$;
COMMENT ON FUNCTION pgbroker._watch_filtered_statement_template() IS 'Internal: template of the statement-level INSERT, UPDATE and DELETE trigger functions of a watched table with filters.';
REVOKE ALL ON FUNCTION pgbroker._watch_filtered_statement_template() FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._watch_filtered_template()
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $function$ SELECT $t$        IF pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), pgbroker._lock_gate({{watch_id}}))
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
$function$;
COMMENT ON FUNCTION pgbroker._watch_filtered_template() IS 'Internal: template of the fan-out of the changes of a table with filters (both trigger modes).';
REVOKE ALL ON FUNCTION pgbroker._watch_filtered_template() FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._watch_funresolved_template()
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $function$ SELECT $t$
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients, new_points, old_points)
        SELECT l.name, l.epoch, {{watch_id}}, l.op, l.row_key, l.changed, NULL, l.new_points, l.old_points
          FROM (SELECT b.name, b.epoch, b.lock_key, k.op, k.row_key, k.changed, k.new_points, k.old_points
                  FROM ({{fchanges}} OFFSET 0) k
                 CROSS JOIN pgbroker.lease b
                 WHERE b.state = 'held' AND b.expires_at IS NULL
                OFFSET 0) l
         WHERE {{alive_and_woken:l}}$t$
$function$;
COMMENT ON FUNCTION pgbroker._watch_funresolved_template() IS 'Internal: template of the INSERT ... SELECT of a table with filters that writes changes for every live broker with their clients left to be resolved at fetch.';
REVOKE ALL ON FUNCTION pgbroker._watch_funresolved_template() FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._watch_points(p_watch pgbroker.watched, p_row text)
 RETURNS text
 LANGUAGE sql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
$function$;
COMMENT ON FUNCTION pgbroker._watch_points(pgbroker.watched,text) IS 'Internal: the SQL expression of the filter points and range probes (jsonb[], one per shape) of a row of a watched table; NULL without filters.';
REVOKE ALL ON FUNCTION pgbroker._watch_points(pgbroker.watched,text) FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._watch_shapes(p_watch pgbroker.watched)
 RETURNS TABLE(columns text[], range_column text)
 LANGUAGE sql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT f.columns, f.range_column FROM pgbroker.filter_shape f
     WHERE f.watch_id = p_watch.watch_id
       AND NOT EXISTS (SELECT FROM unnest(array_remove(f.columns || f.range_column, '')) AS c
                        WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_attribute a
                                           WHERE a.attrelid = p_watch.relid AND a.attname = c AND a.attnum > 0
                                             AND NOT a.attisdropped))
     ORDER BY f.columns, f.range_column
$function$;
COMMENT ON FUNCTION pgbroker._watch_shapes(pgbroker.watched) IS 'Internal: the shapes (sorted equality columns, and the range''s column or empty) of the filters of a watched table whose columns all exist.';
REVOKE ALL ON FUNCTION pgbroker._watch_shapes(pgbroker.watched) FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker.subscribe(client_id text, "table" regclass, key jsonb DEFAULT NULL::jsonb, name text DEFAULT 'default'::text, epoch bigint DEFAULT NULL::bigint, wait interval DEFAULT '00:00:05'::interval, filter jsonb DEFAULT NULL::jsonb)
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
    v_key jsonb;
BEGIN
    IF subscribe.filter IS NOT NULL THEN
        IF subscribe.key IS NOT NULL THEN
            RAISE EXCEPTION 'give a key or a filter, not both' USING ERRCODE = 'invalid_parameter_value';
        END IF;
        RETURN pgbroker._subscribe_filters(v_name, v_epoch, ARRAY[subscribe.client_id], v_watch, ARRAY[subscribe.filter],
                                           subscribe.wait, false) > 0;
    END IF;
    v_key := pgbroker._encode_key(v_watch, subscribe.key);
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
COMMENT ON FUNCTION pgbroker.subscribe(text,regclass,jsonb,text,bigint,interval,jsonb) IS 'Holder only: subscribe client CLIENT_ID to the row of watched TABLE whose primary key is KEY (jsonb: a scalar for a
one-column key, an array in key order for a composite one), or to the whole table when KEY and FILTER are NULL, or to
the rows matching FILTER (a JSON object of column values: {"team": 7}, {"status": {"in": ["open", "pending"]}},
{"closed_at": null}; several columns must all match; sql/README.md, "Filters"), whose clients are also told when a row
leaves it (outbox_fetch''s left).
No gap: once it returns, every change that commits later is in the outbox, so a client that subscribes and then reads
the row (or the filter''s rows) misses nothing. Waits up to WAIT for writer transactions already past their trigger
(PB022 after that); writers never wait for it. Returns false when the subscription existed (a filter: each of its points).
PB010 unknown client, PB021 table not watched, 22023 bad key; a bad filter: 22023, 42703, PB023, 54000, 22P02 (sql/README.md, "Filters").';
REVOKE ALL ON FUNCTION pgbroker.subscribe(text,regclass,jsonb,text,bigint,interval,jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgbroker.subscribe(text,regclass,jsonb,text,bigint,interval,jsonb) TO pgbroker_broker;
CREATE OR REPLACE FUNCTION pgbroker.subscribe_filters(client_ids text[], "table" regclass, filters jsonb[], name text DEFAULT 'default'::text, epoch bigint DEFAULT NULL::bigint, wait interval DEFAULT '00:00:05'::interval)
 RETURNS bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_name text := pgbroker._check_name(subscribe_filters.name);
    v_epoch bigint := pgbroker._acting_epoch(v_name, subscribe_filters.epoch);
    v_n integer := pgbroker._check_arrays('client_ids', array_ndims(subscribe_filters.client_ids),
                                          cardinality(subscribe_filters.client_ids), 'filters',
                                          array_ndims(subscribe_filters.filters), cardinality(subscribe_filters.filters),
                                          false);
    v_watch pgbroker.watched := pgbroker._watch_of(subscribe_filters."table");
BEGIN
    IF v_n = 0 THEN
        RETURN 0;
    END IF;
    RETURN pgbroker._subscribe_filters(v_name, v_epoch, subscribe_filters.client_ids, v_watch, subscribe_filters.filters,
                                       subscribe_filters.wait, true);
END
$function$;
COMMENT ON FUNCTION pgbroker.subscribe_filters(text[],regclass,jsonb[],text,bigint,interval) IS 'Holder only: subscribe client CLIENT_IDS[i] to the rows of watched TABLE matching FILTERS[i] (as subscribe()''s
FILTER), for every i, in one statement; returns how many subscriptions (points of filters) were new.
As subscribe_many() otherwise: no gap, one wait for the table''s writers per call, errors naming their position
(client_ids[3], filters[3]): PB010, 22023, 42703, PB023, 54000, 22P02; nothing of the call is kept when it fails.';
REVOKE ALL ON FUNCTION pgbroker.subscribe_filters(text[],regclass,jsonb[],text,bigint,interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgbroker.subscribe_filters(text[],regclass,jsonb[],text,bigint,interval) TO pgbroker_broker;
CREATE OR REPLACE FUNCTION pgbroker.unsubscribe(client_id text, "table" regclass, key jsonb DEFAULT NULL::jsonb, name text DEFAULT 'default'::text, epoch bigint DEFAULT NULL::bigint, filter jsonb DEFAULT NULL::jsonb)
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
    v_keys jsonb[];
    v_n integer;
BEGIN
    IF unsubscribe.filter IS NULL THEN
        v_keys := ARRAY[pgbroker._encode_key(v_watch, unsubscribe.key)];
    ELSIF unsubscribe.key IS NOT NULL THEN
        RAISE EXCEPTION 'give a key or a filter, not both' USING ERRCODE = 'invalid_parameter_value';
    ELSE
        SELECT p.points INTO v_keys FROM pgbroker._filter_points(v_watch, ARRAY[unsubscribe.filter], false) AS p;
    END IF;
    WITH gone AS (
        DELETE FROM pgbroker.subscription s
         WHERE s.client_key = v_client AND s.watch_id = v_watch.watch_id AND s.row_key = ANY (v_keys)
        RETURNING s.row_key
    )
    SELECT array_agg(g.row_key) INTO v_keys FROM gone g;
    v_n := cardinality(v_keys);
    IF v_n IS NULL THEN
        RETURN false;
    END IF;
    PERFORM pgbroker._interest_shrink(array_fill(v_watch.watch_id, ARRAY[v_n]), v_keys, array_fill(v_name, ARRAY[v_n]),
                                      array_fill(v_epoch, ARRAY[v_n]), array_fill(unsubscribe.client_id, ARRAY[v_n]));
    IF pgbroker._registry_watched(v_name) THEN
        PERFORM pg_notify('pgbroker_registry_' || md5(v_name),
                          pgbroker._registry_subscription_event('unsubscribe', v_name, v_epoch, unsubscribe.client_id,
                                                                v_watch.relid::regclass::text, k))
           FROM unnest(v_keys) AS k;
    END IF;
    RETURN true;
END
$function$;
COMMENT ON FUNCTION pgbroker.unsubscribe(text,regclass,jsonb,text,bigint,jsonb) IS 'Holder only: drop the subscription of CLIENT_ID to KEY of TABLE (KEY and FILTER NULL: the whole-table one), or to every point of FILTER (as in subscribe()); false when there was none.';
REVOKE ALL ON FUNCTION pgbroker.unsubscribe(text,regclass,jsonb,text,bigint,jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgbroker.unsubscribe(text,regclass,jsonb,text,bigint,jsonb) TO pgbroker_broker;
DROP FUNCTION pgbroker._outbox_fetch_departed(text,bigint,bigint,integer,bigint[]);  -- its result type changed: dropped and created again
CREATE OR REPLACE FUNCTION pgbroker._outbox_fetch_departed(p_name text, p_epoch bigint, p_floor bigint, p_max_rows integer, p_ack bigint[])
 RETURNS TABLE(id bigint, "table" text, op text, key jsonb, changed text[], clients text[], at timestamp with time zone, "left" text[])
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
               CASE WHEN o.id > v_upto OR o.left_clients IS NULL THEN o.left_clients
                    ELSE ARRAY(SELECT x.c FROM unnest(o.left_clients) WITH ORDINALITY AS x(c, n)
                                WHERE NOT EXISTS (SELECT FROM pgbroker.outbox_departed d
                                                   WHERE d.name = p_name AND d.epoch = p_epoch AND d.client_id = x.c
                                                     AND d.last_id >= o.id)
                                ORDER BY x.n) END AS left_clients,
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
           b.op::text, b.row_key, b.changed, b.clients, b.at, nullif(b.left_clients, '{}')
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
               CASE WHEN o.new_points IS NOT NULL THEN coalesce(f.clients, '{}')
                    WHEN o.op = 'T'
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
                                ORDER BY 1) END AS clients,
               f.left_clients
          FROM pgbroker.outbox o
          -- A row of a table with filters: the subscribers of its key, of the whole table and of the keys its
          -- points match after the change, and those of the keys its points before it match only, who saw it
          -- leave (as the triggers do).
          LEFT JOIN LATERAL (
               SELECT array_agg(m.c ORDER BY m.c) AS clients, array_agg(m.c ORDER BY m.c) FILTER (WHERE m.gone) AS left_clients
                 FROM (SELECT x.c, bool_and(p.old) AS gone
                         FROM (SELECT q.key, bool_and(q.old) AS old
                                 FROM (SELECT k, false
                                         FROM unnest(pgbroker._filter_keys(o.watch_id, o.new_points) || ARRAY[o.row_key, 'null'::jsonb]) AS k
                                       UNION ALL
                                       SELECT k, true FROM unnest(pgbroker._filter_keys(o.watch_id, o.old_points)) AS k) AS q (key, old)
                                GROUP BY q.key) p
                         JOIN pgbroker.interest i
                           ON i.watch_id = o.watch_id AND i.row_key = p.key AND i.name = p_name AND i.epoch = p_epoch
                        CROSS JOIN LATERAL unnest(i.clients) AS x(c)
                        GROUP BY x.c) m
                WHERE o.new_points IS NOT NULL) f ON true
         WHERE o.name = p_name AND o.epoch = p_epoch AND o.clients IS NULL
    ), told AS (
        -- Each row by its ctid (only this broker's session changes its rows): joined by (name, id), or
        -- (name, epoch, id) on the plan of a generic estimate of one row, each was looked for among all the
        -- epoch's rows, O(n^2): a fetch ran for minutes over 13,000 rows written while subscribes churned.
        UPDATE pgbroker.outbox o SET clients = r.clients, left_clients = r.left_clients
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
$function$;
DROP FUNCTION pgbroker.outbox_fetch(text,integer,bigint[]);  -- its result type changed: dropped and created again
CREATE OR REPLACE FUNCTION pgbroker.outbox_fetch(name text DEFAULT 'default'::text, max_rows integer DEFAULT 1000, ack bigint[] DEFAULT NULL::bigint[])
 RETURNS TABLE(id bigint, "table" text, op text, key jsonb, changed text[], clients text[], at timestamp with time zone, "left" text[])
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
    v_departed boolean;
    v_granted boolean;
    v_floor bigint;
BEGIN
    -- The holder's epoch, whether rows await their clients, whether the
    -- lease names have grants, the floor when it has nothing to move (as
    -- _outbox_floor's first test: NULL otherwise, and _outbox_floor runs),
    -- and whether a departure may hide a client from rows past it (past 0
    -- when the floor is not known yet: the departures' path, slower, is
    -- right whatever they hide).
    SELECT l.epoch, EXISTS (SELECT FROM pgbroker.outbox u WHERE u.name = l.name AND u.epoch = l.epoch AND u.clients IS NULL),
           EXISTS (SELECT FROM pgbroker.outbox_departed d
                    WHERE d.name = l.name AND d.epoch = l.epoch AND d.last_id > coalesce(x.floor, 0)),
           EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'lease'),
           x.floor
      INTO v_epoch, v_unresolved, v_departed, v_granted, v_floor
      FROM pgbroker.lease l,
           (SELECT string_to_array(current_setting('pgbroker.outbox_floor', true), ':') AS s) f,
           LATERAL (SELECT CASE WHEN f.s[1] = l.epoch::text AND cardinality(f.s) = 5
                                     AND current_setting('transaction_isolation') = 'read committed'
                                     AND CASE WHEN f.s[4] <> '' THEN f.s[4]::xid8 >= pg_snapshot_xmin(pg_current_snapshot())
                                              ELSE to_timestamp(nullif(f.s[5], '')::double precision)
                                                   >= clock_timestamp() - interval '100 ms' END
                                THEN f.s[2]::bigint END AS floor) x
     WHERE l.name = outbox_fetch.name AND l.state = 'held' AND l.expires_at IS NULL
       AND l.holder_pid = pg_backend_pid() AND l.holder_backend_start = pgbroker._my_backend_start();
    IF v_epoch IS NULL OR v_granted THEN
        PERFORM pgbroker._name_check('lease', outbox_fetch.name, true);
    END IF;
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
    IF v_departed THEN
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
           o.op::text, o.row_key, o.changed, o.clients, o.at, o.left_clients
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
once, never empty), at, left (those of the clients that the row left: their filters matched it before this update and
none of their subscriptions matches it after; NULL when none).
Rows stay until acknowledged, by outbox_ack() or by passing their ids as ACK to the next outbox_fetch() (one round
trip less): at-least-once delivery within the epoch.';
REVOKE ALL ON FUNCTION pgbroker.outbox_fetch(text,integer,bigint[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgbroker.outbox_fetch(text,integer,bigint[]) TO pgbroker_broker;
CREATE OR REPLACE FUNCTION pgbroker.schema_version()
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$ SELECT '0.1.0+4'::text $function$;
CREATE OR REPLACE FUNCTION pgbroker.subscribe_many(client_ids text[], "table" regclass, keys jsonb[], name text DEFAULT 'default'::text, epoch bigint DEFAULT NULL::bigint, wait interval DEFAULT '00:00:05'::interval)
 RETURNS bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_name text := pgbroker._check_name(subscribe_many.name);
    v_epoch bigint := pgbroker._acting_epoch(v_name, subscribe_many.epoch);
    v_n integer := pgbroker._check_arrays('client_ids', array_ndims(subscribe_many.client_ids),
                                          cardinality(subscribe_many.client_ids), 'keys', array_ndims(subscribe_many.keys),
                                          cardinality(subscribe_many.keys), false);
    v_watch pgbroker.watched := pgbroker._watch_of(subscribe_many."table");
BEGIN
    RETURN pgbroker._subscribe_pairs(v_name, v_epoch, subscribe_many.client_ids, v_watch,
                                     pgbroker._encode_keys(v_watch, subscribe_many.keys), subscribe_many.wait, NULL);
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
    DELETE FROM pgbroker.filter_shape WHERE watch_id = v_watch.watch_id;
    DELETE FROM pgbroker.interest WHERE watch_id = v_watch.watch_id;
    DELETE FROM pgbroker.watched WHERE watch_id = v_watch.watch_id;
    RETURN true;
END
$function$;

CREATE OR REPLACE FUNCTION pgbroker._filter_encoder(p_relid oid, p_columns text[], OUT cases text, OUT bad_column text, OUT bad_type regtype)
 RETURNS record
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_col record;
BEGIN
    cases := '';
    FOR v_col IN SELECT a.attname::text AS col, a.atttypid::regtype AS typ,
                        coalesce(nullif(t.typbasetype, 0), t.oid)::regtype AS base
                   FROM pg_catalog.pg_attribute a
                   JOIN pg_catalog.pg_type t ON t.oid = a.atttypid
                  WHERE a.attrelid = p_relid AND a.attnum > 0 AND NOT a.attisdropped
                    AND a.attname = ANY (p_columns)
                  ORDER BY a.attnum LOOP
        BEGIN
            EXECUTE format('SELECT NULL::%s = NULL::%s', v_col.typ, v_col.typ);
        EXCEPTION WHEN undefined_function THEN
            cases := NULL;
            bad_column := v_col.col;
            bad_type := v_col.typ;
            RETURN;
        END;
        cases := cases || format(' WHEN %L THEN to_jsonb(%s::%s)', v_col.col,
                                 CASE WHEN v_col.base = 'jsonb'::regtype THEN 'u.v' ELSE $q$(u.v #>> '{}')$q$ END, v_col.typ);
    END LOOP;
END
$function$;
COMMENT ON FUNCTION pgbroker._filter_encoder(oid,text[]) IS 'Internal: the CASE that casts and encodes filter values of the given columns of a table, or the first column whose type has no equality.';
REVOKE ALL ON FUNCTION pgbroker._filter_encoder(oid,text[]) FROM PUBLIC;
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
              -- (unnest in the select list: streamed to the sort, where unnest in FROM first wrote
              -- the pairs to a tuplestore, on disk past work_mem: 100,000 pairs, ~60 ms)
              FROM (SELECT unnest(p_watch_ids) AS watch_id, unnest(p_row_keys) AS row_key, unnest(p_names) AS name,
                           unnest(p_epochs) AS epoch, unnest(p_client_ids) AS client_id) u
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

CREATE OR REPLACE FUNCTION pgbroker._filter_keys(p_watch_id integer, p_points jsonb[])
 RETURNS jsonb[]
 LANGUAGE plpgsql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF NOT EXISTS (SELECT FROM unnest(p_points) AS p WHERE p ? '') THEN
        RETURN p_points;
    END IF;
    RETURN ARRAY(SELECT p FROM unnest(p_points) AS p WHERE NOT p ? ''
                 UNION
                 SELECT j.row_key
                   FROM unnest(p_points) AS p
                   JOIN pgbroker.interest j
                     ON j.range_box @> pgbroker._range_probe(p_watch_id, p) AND j.watch_id = p_watch_id
                    AND pgbroker._range_matches(j.row_key, p)
                  WHERE p ? '');
END
$function$;
COMMENT ON FUNCTION pgbroker._filter_keys(integer,jsonb[]) IS 'Internal: the subscription keys matched by a changed row''s filter points: the points of equality, and the keys of the ranges containing its range probes'' values.';
REVOKE ALL ON FUNCTION pgbroker._filter_keys(integer,jsonb[]) FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._filter_ranges(p_watch pgbroker.watched, p_pos bigint[], p_cols text[], p_vals jsonb[], p_bulk boolean, OUT positions bigint[], OUT parts jsonb[], OUT columns text[])
 RETURNS record
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET "TimeZone" TO 'UTC'
 SET "IntervalStyle" TO 'postgres'
 SET extra_float_digits TO '1'
AS $function$
DECLARE
    v_bad record;
    v_col record;
    v_pos bigint[];
    v_parts jsonb[];
    v_empty bigint;
    v_state text;
    v_message text;
BEGIN
    SELECT u.i, array_agg(u.col ORDER BY u.col) AS cols INTO v_bad
      FROM unnest(p_pos, p_cols, p_vals) AS u(i, col, v)
     WHERE jsonb_typeof(u.v) = 'object' AND NOT (u.v ? 'eq' OR u.v ? 'in')
     GROUP BY u.i HAVING count(*) > 1
     ORDER BY u.i LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION '%: columns % both have a range: a filter may have one', pgbroker._filter_where(p_bulk, v_bad.i),
                array_to_string(ARRAY(SELECT quote_ident(c) FROM unnest(v_bad.cols) AS c), ' and ')
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Subscribe to one filter per range and filter the rest in the client.';
    END IF;
    positions := '{}';
    parts := '{}';
    columns := '{}';
    FOR v_col IN SELECT u.col, a.atttypid::regtype AS typ, pgbroker._range_class(a.atttypid) AS class,
                        array_agg(u.i ORDER BY u.i) AS pos, array_agg(u.v ORDER BY u.i) AS conds
                   FROM unnest(p_pos, p_cols, p_vals) AS u(i, col, v)
                   JOIN pg_catalog.pg_attribute a ON a.attrelid = p_watch.relid AND a.attname = u.col
                  WHERE jsonb_typeof(u.v) = 'object' AND NOT (u.v ? 'eq' OR u.v ? 'in')
                  GROUP BY u.col, a.atttypid
                  ORDER BY min(u.i) LOOP
        IF v_col.class IS NULL THEN
            RAISE EXCEPTION '%: column % has type %, which ranges cannot filter', pgbroker._filter_where(p_bulk, v_col.pos[1]),
                    quote_ident(v_col.col), v_col.typ
                USING ERRCODE = 'PB023',
                      HINT = 'A range filters a column of an integer, numeric, floating-point, date or timestamp type.';
        END IF;
        BEGIN
            EXECUTE format($q$
                SELECT array_agg(x.i ORDER BY x.i),
                       array_agg(jsonb_build_object($3, x.bounds, '', jsonb_build_array($3, x.lo, x.hi, $4)) ORDER BY x.i),
                       min(x.i) FILTER (WHERE x.empty)
                  FROM (SELECT u.i,
                               jsonb_strip_nulls(jsonb_build_object('gt', to_jsonb(b.gt), 'gte', to_jsonb(b.gte),
                                                                    'lt', to_jsonb(b.lt), 'lte', to_jsonb(b.lte))) AS bounds,
                               to_jsonb(%2$s) AS lo, to_jsonb(%3$s) AS hi,
                               coalesce(coalesce(b.gt, b.gte) > coalesce(b.lt, b.lte)
                                        OR (coalesce(b.gt, b.gte) = coalesce(b.lt, b.lte) AND num_nonnulls(b.gt, b.lt) > 0),
                                        false) AS empty
                          FROM unnest($1, $2) AS u(i, c)
                         CROSS JOIN LATERAL (SELECT (u.c ->> 'gt')::%1$s AS gt, (u.c ->> 'gte')::%1$s AS gte,
                                                    (u.c ->> 'lt')::%1$s AS lt, (u.c ->> 'lte')::%1$s AS lte) b) x$q$,
                           v_col.typ, pgbroker._range_float(v_col.class, 'coalesce(b.gt, b.gte)'),
                           pgbroker._range_float(v_col.class, 'coalesce(b.lt, b.lte)'))
               INTO v_pos, v_parts, v_empty USING v_col.pos, v_col.conds, v_col.col, v_col.class;
        EXCEPTION WHEN data_exception OR integrity_constraint_violation THEN
            -- Which bound: one at a time, in order, for the message.
            FOR v_bad IN SELECT u.i, b.key AS op, b.value AS v FROM unnest(v_col.pos, v_col.conds) AS u(i, c),
                                jsonb_each(u.c) AS b ORDER BY u.i, b.key LOOP
                BEGIN
                    EXECUTE format('SELECT %L::%s', v_bad.v #>> '{}', v_col.typ);
                EXCEPTION WHEN data_exception OR integrity_constraint_violation THEN
                    GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_message = MESSAGE_TEXT;
                    RAISE EXCEPTION '%: bound % (%) of column % does not cast to its type %: %',
                            pgbroker._filter_where(p_bulk, v_bad.i), v_bad.v, v_bad.op, quote_ident(v_col.col), v_col.typ,
                            v_message
                        USING ERRCODE = v_state;
                END;
            END LOOP;
            RAISE;  -- cannot happen: no bound alone fails
        END;
        IF v_empty IS NOT NULL THEN
            RAISE EXCEPTION '%: the range of column % is empty (%)', pgbroker._filter_where(p_bulk, v_empty),
                    quote_ident(v_col.col), (SELECT u.c FROM unnest(v_col.pos, v_col.conds) AS u(i, c) WHERE u.i = v_empty LIMIT 1)
                USING ERRCODE = 'invalid_parameter_value', HINT = 'No value is above its lower bound and below its upper one.';
        END IF;
        positions := positions || v_pos;
        parts := parts || v_parts;
        columns := columns || array_fill(v_col.col, ARRAY[cardinality(v_pos)]);
    END LOOP;
END
$function$;
COMMENT ON FUNCTION pgbroker._filter_ranges(pgbroker.watched,bigint[],text[],jsonb[],boolean) IS 'Internal: the ranges of filters checked, cast and encoded as parts of their points, with their positions and columns.';
REVOKE ALL ON FUNCTION pgbroker._filter_ranges(pgbroker.watched,bigint[],text[],jsonb[],boolean) FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._range_box(p_watch_id integer, p_key jsonb)
 RETURNS box
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$
    SELECT CASE WHEN jsonb_typeof(p_key) = 'object' AND p_key ? ''
                THEN box(point(coalesce((p_key -> '' ->> 1)::float8, -1e308), pgbroker._range_hash(p_watch_id, p_key)),
                         point(coalesce((p_key -> '' ->> 2)::float8, 1e308), pgbroker._range_hash(p_watch_id, p_key))) END
$function$;
COMMENT ON FUNCTION pgbroker._range_box(integer,jsonb) IS 'Internal: the box of a range filter''s subscription key in the interest''s SP-GiST index; NULL for other keys.';
REVOKE ALL ON FUNCTION pgbroker._range_box(integer,jsonb) FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._range_class(p_type regtype)
 RETURNS text
 LANGUAGE sql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
    SELECT CASE coalesce(nullif(t.typbasetype, 0), t.oid)::regtype
               WHEN 'smallint'::regtype THEN 'numeric' WHEN 'integer'::regtype THEN 'numeric'
               WHEN 'bigint'::regtype THEN 'numeric' WHEN 'numeric'::regtype THEN 'numeric'
               WHEN 'real'::regtype THEN 'real' WHEN 'double precision'::regtype THEN 'double precision'
               WHEN 'date'::regtype THEN 'date' WHEN 'timestamp without time zone'::regtype THEN 'timestamp'
               WHEN 'timestamp with time zone'::regtype THEN 'timestamptz' END
      FROM pg_catalog.pg_type t
     WHERE t.oid = p_type
$function$;
COMMENT ON FUNCTION pgbroker._range_class(regtype) IS 'Internal: how a range filter compares values of this type (numeric, real, double precision, date, timestamp, timestamptz), or NULL for a type ranges cannot filter.';
REVOKE ALL ON FUNCTION pgbroker._range_class(regtype) FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._range_float(p_class text, p_expr text)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $function$
    -- (greatest and least ignore a NULL: the CASE keeps it NULL, outside every range.)
    SELECT format(CASE WHEN p_class IN ('date', 'timestamp', 'timestamptz')
                       THEN 'CASE WHEN %1$s IS NOT NULL THEN least(greatest(extract(epoch FROM %1$s), -1e308), 1e308)::float8 END'
                       WHEN p_class = 'numeric'
                       THEN 'CASE WHEN %1$s IS NOT NULL THEN least(greatest((%1$s)::numeric, -1e308), 1e308)::float8 END'
                       ELSE 'CASE WHEN %1$s IS NOT NULL THEN least(greatest((%1$s)::float8, -1e308), 1e308) END' END, p_expr)
$function$;
COMMENT ON FUNCTION pgbroker._range_float(text,text) IS 'Internal: the SQL expression of the float8 (monotonic, within +-1e308) by which a value of a range class is placed in the SP-GiST index.';
REVOKE ALL ON FUNCTION pgbroker._range_float(text,text) FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._range_hash(p_watch_id integer, p_key jsonb)
 RETURNS double precision
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$
    SELECT (pg_catalog.jsonb_hash(p_key - '' - (p_key -> '' ->> 0)) # pg_catalog.hashtext(p_key -> '' ->> 0)
            # p_watch_id)::float8
$function$;
COMMENT ON FUNCTION pgbroker._range_hash(integer,jsonb) IS 'Internal: the y coordinate of a range key''s or a range probe''s box: a hash of the table, the range''s column and the other columns'' values.';
REVOKE ALL ON FUNCTION pgbroker._range_hash(integer,jsonb) FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._range_holds(p_range jsonb, p_class text, p_value jsonb)
 RETURNS boolean
 LANGUAGE plpgsql
 STABLE PARALLEL SAFE
AS $function$
DECLARE
    v text := p_value #>> '{}';
BEGIN
    IF v IS NULL THEN
        RETURN false;
    ELSIF p_class = 'numeric' THEN
        RETURN coalesce(v::numeric > (p_range ->> 'gt')::numeric, true) AND coalesce(v::numeric >= (p_range ->> 'gte')::numeric, true)
               AND coalesce(v::numeric < (p_range ->> 'lt')::numeric, true) AND coalesce(v::numeric <= (p_range ->> 'lte')::numeric, true);
    ELSIF p_class = 'double precision' THEN
        RETURN coalesce(v::float8 > (p_range ->> 'gt')::float8, true) AND coalesce(v::float8 >= (p_range ->> 'gte')::float8, true)
               AND coalesce(v::float8 < (p_range ->> 'lt')::float8, true) AND coalesce(v::float8 <= (p_range ->> 'lte')::float8, true);
    ELSIF p_class = 'real' THEN
        RETURN coalesce(v::real > (p_range ->> 'gt')::real, true) AND coalesce(v::real >= (p_range ->> 'gte')::real, true)
               AND coalesce(v::real < (p_range ->> 'lt')::real, true) AND coalesce(v::real <= (p_range ->> 'lte')::real, true);
    ELSIF p_class = 'date' THEN
        RETURN coalesce(v::date > (p_range ->> 'gt')::date, true) AND coalesce(v::date >= (p_range ->> 'gte')::date, true)
               AND coalesce(v::date < (p_range ->> 'lt')::date, true) AND coalesce(v::date <= (p_range ->> 'lte')::date, true);
    ELSIF p_class = 'timestamp' THEN
        RETURN coalesce(v::timestamp > (p_range ->> 'gt')::timestamp, true)
               AND coalesce(v::timestamp >= (p_range ->> 'gte')::timestamp, true)
               AND coalesce(v::timestamp < (p_range ->> 'lt')::timestamp, true)
               AND coalesce(v::timestamp <= (p_range ->> 'lte')::timestamp, true);
    ELSIF p_class = 'timestamptz' THEN
        -- Encoded with their offset (+00:00): the session's TimeZone does not enter.
        RETURN coalesce(v::timestamptz > (p_range ->> 'gt')::timestamptz, true)
               AND coalesce(v::timestamptz >= (p_range ->> 'gte')::timestamptz, true)
               AND coalesce(v::timestamptz < (p_range ->> 'lt')::timestamptz, true)
               AND coalesce(v::timestamptz <= (p_range ->> 'lte')::timestamptz, true);
    END IF;
    RETURN false;
END
$function$;
COMMENT ON FUNCTION pgbroker._range_holds(jsonb,text,jsonb) IS 'Internal: whether an encoded value is within a range filter''s bounds, compared exactly as its class.';
REVOKE ALL ON FUNCTION pgbroker._range_holds(jsonb,text,jsonb) FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._range_probe(p_watch_id integer, p_probe jsonb)
 RETURNS box
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$
    SELECT box(point((p_probe -> '' ->> 1)::float8, pgbroker._range_hash(p_watch_id, p_probe)),
               point((p_probe -> '' ->> 1)::float8, pgbroker._range_hash(p_watch_id, p_probe)))
$function$;
COMMENT ON FUNCTION pgbroker._range_probe(integer,jsonb) IS 'Internal: the box (a point) of a changed row''s range probe in the interest''s SP-GiST index.';
REVOKE ALL ON FUNCTION pgbroker._range_probe(integer,jsonb) FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._range_matches(p_key jsonb, p_probe jsonb)
 RETURNS boolean
 LANGUAGE sql
 STABLE PARALLEL SAFE
AS $function$
    SELECT p_key -> '' -> 0 = p_probe -> '' -> 0
           AND p_key - '' - (p_probe -> '' ->> 0) = p_probe - '' - (p_probe -> '' ->> 0)
           AND pgbroker._range_holds(p_key -> (p_probe -> '' ->> 0), p_probe -> '' ->> 2, p_probe -> (p_probe -> '' ->> 0))
$function$;
COMMENT ON FUNCTION pgbroker._range_matches(jsonb,jsonb) IS 'Internal: whether a range filter''s key (an SP-GiST candidate) holds a changed row''s range probe: same column, same other values, value within the bounds.';
REVOKE ALL ON FUNCTION pgbroker._range_matches(jsonb,jsonb) FROM PUBLIC;
COMMENT ON FUNCTION pgbroker._lock_class_drain() IS 'Internal: ''pgbw''; (class, _lock_gate(lease lock_key)) is taken shared by writers that wake a broker, and broker_sleep() takes every gate of it exclusively.';
COMMENT ON FUNCTION pgbroker._lock_class_watch() IS 'Internal: ''pgbs''; (class, _lock_gate(watch_id)) is try-locked shared by writers'' triggers, and subscribe takes every gate of the watch exclusively.';
CREATE OR REPLACE FUNCTION pgbroker._lock_gate(p_key integer)
 RETURNS integer
 LANGUAGE sql
 STABLE PARALLEL SAFE
AS $function$ SELECT pgbroker._lock_gate_key(p_key, pg_catalog.pg_backend_pid() % pgbroker._lock_gates()) $function$;
COMMENT ON FUNCTION pgbroker._lock_gate(integer) IS 'Internal: the second key of this session''s gate of the gated lock p_key (by its pid; inlined in the triggers).';
REVOKE ALL ON FUNCTION pgbroker._lock_gate(integer) FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._lock_gate_key(p_key integer, p_gate integer)
 RETURNS integer
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$ SELECT (p_key % 134217728) * 16 + p_gate $function$;
COMMENT ON FUNCTION pgbroker._lock_gate_key(integer,integer) IS 'Internal: the second key of gate p_gate (0 to 15) of the gated lock p_key.';
REVOKE ALL ON FUNCTION pgbroker._lock_gate_key(integer,integer) FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._lock_gates()
 RETURNS integer
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$ SELECT 16 $function$;
COMMENT ON FUNCTION pgbroker._lock_gates() IS 'Internal: how many gates a gated lock has (see sql/300_watched_tables.sql).';
REVOKE ALL ON FUNCTION pgbroker._lock_gates() FROM PUBLIC;
CREATE OR REPLACE FUNCTION pgbroker._subscribe_lock(p_watch pgbroker.watched, p_table regclass, p_wait interval)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_timeout text := current_setting('lock_timeout');
    v_wait_ms text := pgbroker._wait_ms(p_wait);  -- '0' (NULL): no limit
    v_deadline timestamptz := clock_timestamp() + (v_wait_ms || ' ms')::interval;
    v_key integer;
BEGIN
    IF (SELECT count(*) FROM pg_catalog.pg_trigger t
         WHERE t.tgrelid = p_watch.relid AND t.tgenabled <> 'D'
           AND t.tgname IN ('_pgbroker_watch_ins', '_pgbroker_watch_upd', '_pgbroker_watch_del', '_pgbroker_watch_trunc')) <> 4 THEN
        RAISE EXCEPTION 'the pgbroker triggers of table % are missing or disabled', p_table
            USING ERRCODE = 'PB021', HINT = 'An administrator must call pgbroker.watch() on it again (or ENABLE the triggers).';
    END IF;
    BEGIN
        FOR v_key IN SELECT pgbroker._lock_gate_key(p_watch.watch_id, g) FROM generate_series(0, pgbroker._lock_gates() - 1) g
                     UNION ALL SELECT p_watch.watch_id LOOP
            IF NOT pg_try_advisory_xact_lock(pgbroker._lock_class_watch(), v_key) THEN
                -- What is left of WAIT, at least 1 ms (a lock_timeout of 0 is no limit).
                PERFORM set_config('lock_timeout',
                                   CASE WHEN v_wait_ms = '0' THEN '0'
                                        ELSE greatest(1, ceil(extract(epoch FROM v_deadline - clock_timestamp()) * 1000))::bigint::text END,
                                   true);
                PERFORM pg_advisory_xact_lock(pgbroker._lock_class_watch(), v_key);
                PERFORM set_config('lock_timeout', v_timeout, true);
            END IF;
        END LOOP;
    EXCEPTION WHEN lock_not_available THEN
        RAISE EXCEPTION 'table % is busy: a writer transaction stayed open longer than %', p_watch.table_name, p_wait
            USING ERRCODE = 'PB022', HINT = 'Retry, or pass a longer wait.';
    END;
END
$function$;
COMMENT ON FUNCTION pgbroker._subscribe_lock(pgbroker.watched,regclass,interval) IS 'Internal: check a watched table''s triggers (PB021), then take every gate of its watch lock exclusively to commit, waiting at most p_wait in all for writers (PB022).';
CREATE OR REPLACE FUNCTION pgbroker._watch_alive_template()
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $function$ SELECT $t$CASE
            WHEN NOT pg_try_advisory_xact_lock_shared(pgbroker._lock_class_drain(), pgbroker._lock_gate({{r}}.lock_key))
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
AS $function$ SELECT $t$        IF pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), pgbroker._lock_gate({{watch_id}}))
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
$function$;
CREATE OR REPLACE FUNCTION pgbroker._watch_truncate_template()
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $function$ SELECT $t$
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
    v_gate_key integer;
    v_awake integer := pgbroker._epoch_key(v_epoch);
BEGIN
    SELECT lock_key INTO v_key FROM pgbroker.lease l WHERE l.name = v_name;
    -- Wait, still awake, until no writer holds a gate of the drain lock, and
    -- take them all: by tries, so that writers never find a request of ours
    -- queued (they would take it for a broker going to sleep, and NOTIFY),
    -- and all or none (a gate held while another is waited for would tell
    -- its writers the same), at most WAIT (a long writer transaction must
    -- not keep us from draining).
    LOOP
        BEGIN
            FOR v_gate_key IN SELECT pgbroker._lock_gate_key(v_key, g) FROM generate_series(0, pgbroker._lock_gates() - 1) g
                              UNION ALL SELECT v_key LOOP  -- and the key itself (300_watched_tables.sql)
                IF NOT pg_try_advisory_xact_lock(pgbroker._lock_class_drain(), v_gate_key) THEN
                    RAISE EXCEPTION USING ERRCODE = 'lock_not_available';  -- gives back the gates taken
                END IF;
            END LOOP;
            EXIT;
        EXCEPTION WHEN lock_not_available THEN
            IF clock_timestamp() >= v_deadline THEN
                IF NOT pgbroker._awake_held(v_awake) THEN
                    PERFORM pg_advisory_lock(pgbroker._lock_class_awake(), v_awake);
                END IF;
                RETURN 'busy';
            END IF;
            PERFORM pg_sleep(0.001);
        END;
    END LOOP;
    -- Every gate of the drain lock is ours until this returns: writers from now on NOTIFY.
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
-- Hand-written (begin): after the functions.
CREATE TRIGGER _600_render
AFTER INSERT ON pgbroker.filter_shape
REFERENCING NEW TABLE AS added_shapes
FOR EACH STATEMENT EXECUTE FUNCTION pgbroker._filter_shapes_render();
COMMENT ON TRIGGER _600_render ON pgbroker.filter_shape IS 'A new filter shape renders its table''s trigger functions again.';

-- The view subscriptions gains its last column, filter (CREATE OR REPLACE
-- VIEW keeps its grants; a column added at the end is allowed).
CREATE OR REPLACE VIEW pgbroker.subscriptions AS
SELECT c.name, c.client_id, w.relid::regclass AS "table",
       CASE WHEN jsonb_typeof(s.row_key) NOT IN ('null', 'object') THEN s.row_key END AS key, s.subscribed_at,
       -- A filter's points are keys that are JSON objects (350_filters.sql), which no row's key is; a range's
       -- member "" is for the index.
       CASE WHEN jsonb_typeof(s.row_key) = 'object' THEN s.row_key - '' END AS filter
  FROM (SELECT l.name, l.epoch FROM pgbroker.lease l
         WHERE CASE WHEN (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'lease')
                          OR pgbroker.name_allowed('lease', l.name)) THEN pgbroker.broker_alive(l.name) END
        OFFSET 0) l  -- once per lease
  JOIN pgbroker.client c ON c.name = l.name AND c.epoch = l.epoch
  JOIN pgbroker.subscription s ON s.client_key = c.client_key
  JOIN pgbroker.watched w ON w.watch_id = s.watch_id;
COMMENT ON COLUMN pgbroker.subscriptions.key IS 'The row key (jsonb), NULL for a whole-table subscription or one by filter.';
COMMENT ON COLUMN pgbroker.subscriptions.filter IS 'For a subscription by filter: one point of the filter, a JSON object of column values and at most one range ({"team": 7, "price": {"gte": 10}}; a filter with "in" has a row per value); NULL otherwise.';

-- Every watched table's trigger functions, rendered by this revision's
-- templates (gated locks): CREATE OR REPLACE FUNCTION, no table lock, so
-- before the tables' locks below (a writer that holds the outbox's and
-- waits for the interest's while this waits for the outbox's is a
-- deadlock: their window stays as short as it was).  A writer's first
-- trigger call after the commit runs them; writers of the functions they
-- replace hold the watch and drain locks' keys themselves, which
-- subscribe() and broker_sleep() wait for too (300_watched_tables.sql).
SELECT count(pgbroker._watch_create_functions(w)) FROM pgbroker.watched w;

-- The interest's box of range filters, and its SP-GiST index (ACCESS
-- EXCLUSIVE on the interest, held to commit, as the outbox's below: a
-- nullable column without a default rewrites nothing; the index, partial,
-- reads the interest once and holds none of its rows).  Its fill factor,
-- 45 (sql/400_subscriptions.sql), applies to the pages written from now on.
ALTER TABLE pgbroker.interest ADD COLUMN range_box box, SET (fillfactor = 45);
COMMENT ON COLUMN pgbroker.interest.range_box IS 'For a range filter''s key: its bounds (x) and its table, column and other columns'' values (a hash, y), for the SP-GiST probe; NULL otherwise.';
CREATE INDEX interest_range ON pgbroker.interest USING spgist (range_box) WHERE range_box IS NOT NULL;

-- Last: the outbox's new columns (ACCESS EXCLUSIVE on the outbox, held to
-- commit: writers of watched tables wait from here to the commit; nullable
-- columns without a default rewrite nothing).
ALTER TABLE pgbroker.outbox ADD COLUMN left_clients text[], ADD COLUMN new_points jsonb[], ADD COLUMN old_points jsonb[];
COMMENT ON COLUMN pgbroker.outbox.left_clients IS 'Those of the clients whose filters the row matched before the change (U) and none of whose subscriptions it matches after: the row left them. NULL: none.';
COMMENT ON COLUMN pgbroker.outbox.new_points IS 'Rows whose clients are resolved when fetched, of a table with filters: the row''s filter points after the change (before it, for D).';
COMMENT ON COLUMN pgbroker.outbox.old_points IS 'Same: the row''s filter points before an update (its clients that match none of the rest are told the row left).';
-- Hand-written (end).
