-- pgbroker: subscriptions by column value (filters).
--
-- A filter is a JSON object naming columns of a watched table, each with a
-- value ({"team": 7}), {"eq": value} or {"in": [values]}; a JSON null
-- matches NULL; several columns must all match (sql/README.md, "Filters").
-- A filter is expanded into its points, one per combination of its values
-- ({"team": {"in": [1, 2]}, "kind": "x"} has two), and each point is an
-- ordinary subscription whose key is the point itself, a JSON object of the
-- columns' values encoded as the triggers encode a row's values
-- ({"kind": "x", "team": 1}).  Row keys are never objects (a scalar or an
-- array; filters are refused on a table whose key is one jsonb column), so
-- points and keys never meet, and subscribe, unsubscribe, the interest, the
-- outbox's resolution and the sweep handle points as keys.
--
-- The set of columns of a point is its shape.  pgbroker.filter_shape lists
-- the shapes in use per watched table; the triggers of a table with shapes
-- compute, for each changed row, its point of every shape from OLD and from
-- NEW and probe the interest for them as for the row's key
-- (600_triggers.sql).  A new shape re-renders the table's trigger functions
-- (under the table's lock, as watch() does): tables without shapes keep the
-- triggers they had, and pay nothing.

CREATE TABLE pgbroker.filter_shape (
    watch_id integer NOT NULL,   -- no foreign key (see subscription); unwatch() deletes its table's
    columns text[] NOT NULL,
    added_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    PRIMARY KEY (watch_id, columns)
);
COMMENT ON TABLE pgbroker.filter_shape IS
    'The shapes (sets of columns) of the filters subscribed to per watched table: the triggers compute each changed row''s point of each. Internal: subscribe with a filter adds them.';
COMMENT ON COLUMN pgbroker.filter_shape.watch_id IS 'The watched table.';
COMMENT ON COLUMN pgbroker.filter_shape.columns IS 'The columns of the shape, sorted (COLLATE "C").';
COMMENT ON COLUMN pgbroker.filter_shape.added_at IS 'When the first filter of this shape was subscribed.';

-- How many points one filter may expand into (the product of its columns'
-- numbers of values).
CREATE FUNCTION pgbroker._filter_max_points()
RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1000 $$;
COMMENT ON FUNCTION pgbroker._filter_max_points() IS 'Internal: the most points one filter may expand into (54000 beyond).';

-- How many shapes (sets of filtered columns) one watched table may have:
-- each costs every change of the table one or two index probes.
CREATE FUNCTION pgbroker._filter_max_shapes()
RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 32 $$;
COMMENT ON FUNCTION pgbroker._filter_max_shapes() IS 'Internal: the most shapes (sets of filtered columns) a watched table may have (54000 beyond).';

-- Where a filter was given, for error messages: "filter" (one), "filters[3]" (an array).
CREATE FUNCTION pgbroker._filter_where(p_bulk boolean, p_position bigint)
RETURNS text LANGUAGE sql IMMUTABLE
AS $$ SELECT CASE WHEN p_bulk THEN 'filters[' || p_position || ']' ELSE 'filter' END $$;
COMMENT ON FUNCTION pgbroker._filter_where(boolean, bigint) IS 'Internal: "filter" or "filters[i]", for error messages.';

-- How the values of columns P_COLUMNS of a watched table are cast to their
-- types and encoded as the triggers encode a row's values: a CASE on the
-- column name (u.col) of the JSON value u.v, for a statement over
-- (col, v) pairs; or NULL, with the first of those columns whose type has
-- no equality operator (a filter cannot name it) and its type.  Column names come
-- from the catalog and are rendered with %L, types with regtype's output.
CREATE FUNCTION pgbroker._filter_encoder(p_relid oid, p_columns text[],
                                         OUT cases text, OUT bad_column text, OUT bad_type regtype)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
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
$$;
COMMENT ON FUNCTION pgbroker._filter_encoder(oid, text[]) IS
    'Internal: the CASE that casts and encodes filter values of the given columns of a table, or the first column whose type has no equality.';

-- The points of filters P_FILTERS of a watched table: POINTS[j] is a
-- point of filter POSITIONS[j] (in order of position), SHAPES the distinct
-- shapes (JSON arrays of sorted column names).  Every filter is checked
-- first (22023 shape or operator, 42703 column, PB023 column type or table,
-- 54000 too many points, 22P02 or the cast's own SQLSTATE for a value), the
-- first error naming its filter.  Set-based: a few statements and one cast
-- per column, whatever the number of filters.  Column names are only ever
-- compared with the catalog's and rendered with %I / %L.
CREATE FUNCTION pgbroker._filter_points(p_watch pgbroker.watched, p_filters jsonb[], p_bulk boolean,
                                        OUT positions integer[], OUT points jsonb[], OUT shapes jsonb[])
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
-- Values encode as the triggers encode a row's (see _key_settings).
SET TimeZone = 'UTC' SET IntervalStyle = 'postgres' SET extra_float_digits = 1 SET bytea_output = 'hex'
SET lc_monetary = 'C'
AS $$
DECLARE
    v_bad record;
    v_bad_column text;
    v_bad_type regtype;
    v_simple boolean;
    v_pos bigint[];
    v_cols text[];
    v_vals jsonb[];
    v_enc jsonb[];
    v_cast text;
    v_state text;
    v_message text;
BEGIN
    IF cardinality(p_watch.key_columns) = 1 AND p_watch.key_types[1] IN ('jsonb'::regtype, 'json'::regtype) THEN
        RAISE EXCEPTION 'table % cannot be subscribed to by filter: its key is one jsonb column', p_watch.table_name
            USING ERRCODE = 'PB023', HINT = 'Subscribe by key, or to the whole table.';
    END IF;
    -- The common case first, in two statements: filters of one column each, of the table, with a JSON scalar or
    -- null (equality), so that each filter is one point.  Anything else (an error included) takes the steps below,
    -- which check one thing at a time, expand "in" and several columns, and name the first bad filter.  (No
    -- aggregate per filter here: 10,000 of them made the statement three times slower.)
    BEGIN
        SELECT array_agg(DISTINCT k.col) INTO v_cols FROM unnest(p_filters) AS u(f), jsonb_object_keys(u.f) AS k(col);
        SELECT e.cases INTO v_cast FROM pgbroker._filter_encoder(p_watch.relid, v_cols) AS e
         WHERE cardinality(v_cols) = (SELECT count(*) FROM pg_catalog.pg_attribute a
                                       WHERE a.attrelid = p_watch.relid AND a.attname = ANY (v_cols) AND a.attnum > 0
                                         AND NOT a.attisdropped);
        IF v_cast IS NOT NULL THEN
            -- f.f - u.col = '{}': the column is the filter's only one; with one row per filter, none is empty.
            EXECUTE format($q$
                SELECT array_agg(f.i::integer ORDER BY f.i),
                       array_agg(jsonb_build_object(u.col, CASE jsonb_typeof(u.v) WHEN 'null' THEN 'null'::jsonb
                                                                                  WHEN 'object' THEN NULL
                                                                                  WHEN 'array' THEN NULL
                                                                                  ELSE CASE u.col %s END END)
                                 ORDER BY f.i),
                       coalesce(bool_and(jsonb_typeof(u.v) NOT IN ('object', 'array') AND f.f - u.col = '{}'::jsonb), true)
                       AND count(*) = cardinality($1)
                  FROM unnest($1) WITH ORDINALITY AS f(f, i), jsonb_each(f.f) AS u(col, v)$q$, v_cast)
               INTO positions, points, v_simple USING p_filters;
            IF v_simple THEN
                shapes := ARRAY(SELECT to_jsonb(ARRAY[c.col]) FROM unnest(v_cols) AS c(col));
                RETURN;
            END IF;
        END IF;
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
    -- Each value: a JSON value (equality), {"eq": value} or {"in": [values, ...]} (not empty).
    SELECT u.i, u.col, u.v,
           CASE WHEN jsonb_typeof(u.v) = 'array' THEN 'array'
                WHEN u.v = '{}'::jsonb THEN 'empty'
                WHEN (SELECT count(*) FROM jsonb_object_keys(u.v)) > 1 THEN 'several'
                WHEN u.v ? 'in' THEN 'in'
                WHEN u.v ?| ARRAY['lt', 'lte', 'gt', 'gte', 'neq', 'ne', 'like'] THEN 'unsupported'
                ELSE 'unknown' END AS problem
      INTO v_bad
      FROM unnest(v_pos, v_cols, v_vals) AS u(i, col, v)
     WHERE jsonb_typeof(u.v) IN ('array', 'object')
       AND NOT (jsonb_typeof(u.v) = 'object' AND (SELECT count(*) FROM jsonb_object_keys(u.v)) = 1
                AND (u.v ? 'eq' OR (u.v ? 'in' AND jsonb_typeof(u.v -> 'in') = 'array' AND u.v -> 'in' <> '[]'::jsonb)))
     ORDER BY u.i LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION '%: %', pgbroker._filter_where(p_bulk, v_bad.i), CASE v_bad.problem
                WHEN 'array' THEN format('the value of column %s is an array: several values are {"in": [...]}, an array value {"eq": [...]}',
                                         quote_ident(v_bad.col))
                WHEN 'empty' THEN format('column %s has an empty operator object', quote_ident(v_bad.col))
                WHEN 'several' THEN format('column %s has more than one operator (%s): give one (ranges are not supported)',
                                           quote_ident(v_bad.col), v_bad.v)
                WHEN 'in' THEN format('"in" of column %s must be a non-empty JSON array', quote_ident(v_bad.col))
                WHEN 'unsupported' THEN format('operator %s of column %s is not supported: filters compare for equality only',
                                               (SELECT k FROM jsonb_object_keys(v_bad.v) AS k LIMIT 1), quote_ident(v_bad.col))
                ELSE format('unknown operator %s of column %s', quote_literal((SELECT k FROM jsonb_object_keys(v_bad.v) AS k LIMIT 1)),
                            quote_ident(v_bad.col)) END
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'A column''s condition is a JSON value (equality; null matches NULL), {"eq": value} or {"in": [value, ...]}.';
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
    -- The points.  Filters of one column: one point per value.  Others: the product of their columns' values,
    -- built column by column.
    IF NOT EXISTS (SELECT FROM unnest(v_pos, v_cols) AS u(i, col) GROUP BY u.i HAVING count(DISTINCT u.col) > 1) THEN
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
    ), s AS (
        SELECT c.i, max(c.k) AS k, array_agg(DISTINCT c.col COLLATE "C") AS columns FROM c GROUP BY c.i
    ), p (i, k, point) AS (
        SELECT s.i, 0::bigint, '{}'::jsonb FROM s
        UNION ALL
        SELECT p.i, c.k, p.point || jsonb_build_object(c.col, c.enc) FROM p JOIN c ON c.i = p.i AND c.k = p.k + 1
    )
    SELECT array_agg(p.i::integer ORDER BY p.i), array_agg(p.point ORDER BY p.i), array_agg(DISTINCT to_jsonb(s.columns))
      INTO positions, points, shapes
      FROM p JOIN s ON s.i = p.i AND s.k = p.k;
END
$$;
COMMENT ON FUNCTION pgbroker._filter_points(pgbroker.watched, jsonb[], boolean) IS
    'Internal: the points (subscription keys) of filters of a watched table, with their filters'' positions, and their shapes; the first bad filter''s error names it.';

-- Before subscribing to points of new shapes: the table's lock, as watch()
-- takes it (tries of 50 ms, writers never queue behind it), so that every
-- writer from then on runs the trigger functions rendered with the new
-- shapes (the trigger _600_render on filter_shape renders them).  Nothing
-- to do, and no lock, when every shape is known.
CREATE FUNCTION pgbroker._filter_shapes_add(p_watch pgbroker.watched, p_shapes jsonb[], p_wait interval)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_shapes bigint;
BEGIN
    IF NOT EXISTS (SELECT FROM unnest(p_shapes) AS u(s)
                    WHERE NOT EXISTS (SELECT FROM pgbroker.filter_shape f
                                       WHERE f.watch_id = p_watch.watch_id
                                         AND f.columns = ARRAY(SELECT jsonb_array_elements_text(u.s)))) THEN
        RETURN;
    END IF;
    PERFORM pgbroker._watch_lock_table(p_watch.relid::regclass, p_wait);
    INSERT INTO pgbroker.filter_shape (watch_id, columns)
    SELECT p_watch.watch_id, ARRAY(SELECT jsonb_array_elements_text(u.s)) FROM unnest(p_shapes) AS u(s)
    ON CONFLICT DO NOTHING;
    SELECT count(*) INTO v_shapes FROM pgbroker.filter_shape f WHERE f.watch_id = p_watch.watch_id;
    IF v_shapes > pgbroker._filter_max_shapes() THEN
        RAISE EXCEPTION 'table % would have % shapes of filters (sets of filtered columns), more than %',
                p_watch.table_name, v_shapes, pgbroker._filter_max_shapes()
            USING ERRCODE = 'program_limit_exceeded',
                  HINT = 'Filter on fewer combinations of columns; shapes stay until unwatch().';
    END IF;
END
$$;
COMMENT ON FUNCTION pgbroker._filter_shapes_add(pgbroker.watched, jsonb[], interval) IS
    'Internal: record the shapes (JSON arrays of sorted column names) not known yet of a watched table, under the table''s lock (PB022 after p_wait); its triggers are rendered again.';
