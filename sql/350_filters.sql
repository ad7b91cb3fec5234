-- pgbroker: subscriptions by column value (filters).
--
-- A filter is a JSON object naming columns of a watched table, each with a
-- value ({"team": 7}), {"eq": value} or {"in": [values]}, or, for one
-- column of a filter, a range ({"gte": 10, "lt": 20}); a JSON null matches
-- NULL; several columns must all match (sql/README.md, "Filters").
-- A filter is expanded into its points, one per combination of its values
-- ({"team": {"in": [1, 2]}, "kind": "x"} has two), and each point is an
-- ordinary subscription whose key is the point itself, a JSON object of the
-- columns' values encoded as the triggers encode a row's values
-- ({"kind": "x", "team": 1}).  Row keys are never objects (a scalar or an
-- array; filters are refused on a table whose key is one jsonb column), so
-- points and keys never meet, and subscribe, unsubscribe, the interest, the
-- outbox's resolution and the sweep handle points as keys.
--
-- A filter with a range is a point too, of its other columns, with the
-- range's column and its bounds: {"team": 7, "price": {"gte": 10, "lt": 20},
-- "": ["price", 10, 20, "numeric"]}.  Its member "" (no column has an empty
-- name) names the range's column, the bounds as float8 (null: unbounded)
-- and the column's class of comparison.  Its interest row carries a box
-- (pgbroker._range_box) in an SP-GiST index: x from the lower to the upper
-- bound, y a hash of the table, the column and the other columns' values.
-- A changed row's probe is the degenerate box of its value (_range_probe);
-- the boxes containing it are the candidates (a value within a range has
-- its float8 within the range's: _range_float), and the exact comparison,
-- in the column's type, decides (_range_holds).
--
-- The set of columns of a point, and its range's column, is its shape.
-- pgbroker.filter_shape lists the shapes in use per watched table; the
-- triggers of a table with shapes compute, for each changed row, its point
-- (or range probe) of every shape from OLD and from NEW and probe the
-- interest for them as for the row's key (600_triggers.sql).  A new shape re-renders the table's trigger functions
-- (under the table's lock, as watch() does): tables without shapes keep the
-- triggers they had, and pay nothing.

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

-- ---------------------------------------------------------------------------
-- Ranges.  A range's column must have a class of comparison: its type (the
-- base type of a domain) is one of these, the values and bounds are compared
-- as it, and its float8 places them in the SP-GiST index (_range_float).
CREATE FUNCTION pgbroker._range_class(p_type regtype)
RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE coalesce(nullif(t.typbasetype, 0), t.oid)::regtype
               WHEN 'smallint'::regtype THEN 'numeric' WHEN 'integer'::regtype THEN 'numeric'
               WHEN 'bigint'::regtype THEN 'numeric' WHEN 'numeric'::regtype THEN 'numeric'
               WHEN 'real'::regtype THEN 'real' WHEN 'double precision'::regtype THEN 'double precision'
               WHEN 'date'::regtype THEN 'date' WHEN 'timestamp without time zone'::regtype THEN 'timestamp'
               WHEN 'timestamp with time zone'::regtype THEN 'timestamptz' END
      FROM pg_catalog.pg_type t
     WHERE t.oid = p_type
$$;
COMMENT ON FUNCTION pgbroker._range_class(regtype) IS
    'Internal: how a range filter compares values of this type (numeric, real, double precision, date, timestamp, timestamptz), or NULL for a type ranges cannot filter.';

-- The SQL expression of the float8 of P_EXPR, a value of class P_CLASS:
-- its number, or its epoch in seconds, within +-1e308 (NaN and infinities
-- at the ends, where the type orders them); NULL for NULL.  Monotonic, never decreasing:
-- a value inside a range has its float8 inside the range's floats' (the
-- exact comparison is _range_holds's).
CREATE FUNCTION pgbroker._range_float(p_class text, p_expr text)
RETURNS text
LANGUAGE sql IMMUTABLE
AS $$
    -- (greatest and least ignore a NULL: the CASE keeps it NULL, outside every range.)
    SELECT format(CASE WHEN p_class IN ('date', 'timestamp', 'timestamptz')
                       THEN 'CASE WHEN %1$s IS NOT NULL THEN least(greatest(extract(epoch FROM %1$s), -1e308), 1e308)::float8 END'
                       WHEN p_class = 'numeric'
                       THEN 'CASE WHEN %1$s IS NOT NULL THEN least(greatest((%1$s)::numeric, -1e308), 1e308)::float8 END'
                       ELSE 'CASE WHEN %1$s IS NOT NULL THEN least(greatest((%1$s)::float8, -1e308), 1e308) END' END, p_expr)
$$;
COMMENT ON FUNCTION pgbroker._range_float(text, text) IS
    'Internal: the SQL expression of the float8 (monotonic, within +-1e308) by which a value of a range class is placed in the SP-GiST index.';

-- The y of a range's box, and of a probe's: a hash of the table, the
-- range's column and the other columns' values (numbers equal as numeric
-- hash alike), so that one SP-GiST probe finds the ranges of one point.  Of
-- immutable parts only, so that it is inlined where it is called.
CREATE FUNCTION pgbroker._range_hash(p_watch_id integer, p_key jsonb)
RETURNS float8
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT (pg_catalog.jsonb_hash(p_key - '' - (p_key -> '' ->> 0)) # pg_catalog.hashtext(p_key -> '' ->> 0)
            # p_watch_id)::float8
$$;
COMMENT ON FUNCTION pgbroker._range_hash(integer, jsonb) IS
    'Internal: the y coordinate of a range key''s or a range probe''s box: a hash of the table, the range''s column and the other columns'' values.';

-- The box of subscription key P_KEY of a range filter (x: from the lower
-- bound's float8 to the upper's; unbounded: +-1e308); NULL for any other key.
CREATE FUNCTION pgbroker._range_box(p_watch_id integer, p_key jsonb)
RETURNS box
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN jsonb_typeof(p_key) = 'object' AND p_key ? ''
                THEN box(point(coalesce((p_key -> '' ->> 1)::float8, -1e308), pgbroker._range_hash(p_watch_id, p_key)),
                         point(coalesce((p_key -> '' ->> 2)::float8, 1e308), pgbroker._range_hash(p_watch_id, p_key))) END
$$;
COMMENT ON FUNCTION pgbroker._range_box(integer, jsonb) IS
    'Internal: the box of a range filter''s subscription key in the interest''s SP-GiST index; NULL for other keys.';

-- The box of a changed row's range probe, {"": [column, float8 of the
-- value, class], other columns: values, column: value} (the triggers make
-- it, _watch_points): a point, NULL when the value is NULL.
CREATE FUNCTION pgbroker._range_probe(p_watch_id integer, p_probe jsonb)
RETURNS box
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT box(point((p_probe -> '' ->> 1)::float8, pgbroker._range_hash(p_watch_id, p_probe)),
               point((p_probe -> '' ->> 1)::float8, pgbroker._range_hash(p_watch_id, p_probe)))
$$;
COMMENT ON FUNCTION pgbroker._range_probe(integer, jsonb) IS
    'Internal: the box (a point) of a changed row''s range probe in the interest''s SP-GiST index.';

-- Whether value P_VALUE (encoded as the triggers encode it) is within range
-- P_RANGE ({"gte": 10, "lt": 20}), compared exactly as class P_CLASS.
-- NULL is in no range.  PL/pgSQL, never inlined: only the SP-GiST probe's
-- candidates call it (inlined, its six classes made every plan that probes
-- ranges costlier to make than to run), and a branch per class: PL/pgSQL
-- prepares an expression the first time a transaction runs it, so each
-- transaction prepares only its classes' (one CASE of all six: 60 us).
CREATE FUNCTION pgbroker._range_holds(p_range jsonb, p_class text, p_value jsonb)
RETURNS boolean
LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $$
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
$$;
COMMENT ON FUNCTION pgbroker._range_holds(jsonb, text, jsonb) IS
    'Internal: whether an encoded value is within a range filter''s bounds, compared exactly as its class.';

-- Whether interest key P_KEY is a range that a changed row's probe P_PROBE
-- falls in: the same column, the same values of the other columns, and the
-- value within the bounds (a candidate of the SP-GiST probe, compared exactly).
CREATE FUNCTION pgbroker._range_matches(p_key jsonb, p_probe jsonb)
RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT p_key -> '' -> 0 = p_probe -> '' -> 0
           AND p_key - '' - (p_probe -> '' ->> 0) = p_probe - '' - (p_probe -> '' ->> 0)
           AND pgbroker._range_holds(p_key -> (p_probe -> '' ->> 0), p_probe -> '' ->> 2, p_probe -> (p_probe -> '' ->> 0))
$$;
COMMENT ON FUNCTION pgbroker._range_matches(jsonb, jsonb) IS
    'Internal: whether a range filter''s key (an SP-GiST candidate) holds a changed row''s range probe: same column, same other values, value within the bounds.';

-- The ranges of filters: (p_pos[j], p_cols[j], p_vals[j]) are every (filter,
-- column, condition), those with a range's operators (gt, gte, lt, lte)
-- the ranges.  Each filter has at most one (22023), on a column with a
-- class (PB023), its bounds cast to the column's type (22P02, or the cast's
-- own SQLSTATE) and not empty (22023).  Returns, per filter with a range,
-- its position, its part of the filter's points (the column's encoded
-- bounds and the member ""; see the top of this file) and the column.
-- One statement per column with ranges, whatever the number of filters.
CREATE FUNCTION pgbroker._filter_ranges(p_watch pgbroker.watched, p_pos bigint[], p_cols text[], p_vals jsonb[],
                                        p_bulk boolean, OUT positions bigint[], OUT parts jsonb[], OUT columns text[])
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
SET TimeZone = 'UTC' SET IntervalStyle = 'postgres' SET extra_float_digits = 1
AS $$
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
$$;
COMMENT ON FUNCTION pgbroker._filter_ranges(pgbroker.watched, bigint[], text[], jsonb[], boolean) IS
    'Internal: the ranges of filters checked, cast and encoded as parts of their points, with their positions and columns.';

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
$$;
COMMENT ON FUNCTION pgbroker._filter_shapes_add(pgbroker.watched, jsonb[], interval) IS
    'Internal: record the shapes (JSON arrays of sorted column names, and {"range": column}) not known yet of a watched table, under the table''s lock (PB022 after p_wait); its triggers are rendered again.';
