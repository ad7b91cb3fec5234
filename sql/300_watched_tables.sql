-- pgbroker: watched tables, and how their rows are named.
--
-- pgbroker.watch(table) (600_triggers.sql) records a table with a primary key
-- here and installs triggers on it.  A row is named by its key, encoded as
-- jsonb: a one-column key as its JSON scalar (to_jsonb(id): 42, "abc"), a
-- composite key as a JSON array in key-column order ([7, "eu"]).  A
-- whole-table subscription has the key JSON null.

CREATE TABLE pgbroker.watched (
    watch_id integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    relid oid NOT NULL CONSTRAINT watched_relid_unique UNIQUE,
    table_name text NOT NULL,
    key_columns text[] NOT NULL,
    key_types regtype[] NOT NULL,
    -- How the triggers fire (600_triggers.sql): once per statement, or once per row.
    mode text NOT NULL DEFAULT 'statement' CONSTRAINT watched_mode_valid CHECK (mode IN ('statement', 'row')),
    watched_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp()
);
COMMENT ON TABLE pgbroker.watched IS 'Tables watched by pgbroker.watch(). Internal: read the view pgbroker.watched_tables.';
COMMENT ON COLUMN pgbroker.watched.watch_id IS 'Internal number of the watch; also names its trigger functions (pgbroker._watch_<id>_ins ...).';
COMMENT ON COLUMN pgbroker.watched.relid IS 'The watched table.';
COMMENT ON COLUMN pgbroker.watched.table_name IS 'Its qualified name when it was watched.';
COMMENT ON COLUMN pgbroker.watched.key_columns IS 'Primary-key columns, in key order.';
COMMENT ON COLUMN pgbroker.watched.key_types IS 'Their types.';
COMMENT ON COLUMN pgbroker.watched.mode IS 'statement: statement-level triggers with transition tables; row: row-level triggers (TRUNCATE stays statement-level).';
COMMENT ON COLUMN pgbroker.watched.watched_at IS 'When watch() last installed the triggers.';


-- ---------------------------------------------------------------------------
-- Lock classes (first key of two-int4 advisory locks; second: see each).
CREATE FUNCTION pgbroker._lock_class_watch()
RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1885823603 $$;
COMMENT ON FUNCTION pgbroker._lock_class_watch() IS
    'Internal: ''pgbs''; (class, _lock_gate(watch_id)) is try-locked shared by writers'' triggers, and subscribe takes every gate of the watch exclusively.';

-- Gates.  A lock that every writer takes shared and that one session
-- takes exclusively to wait for them all (the watch lock, subscribe's; the
-- drain lock, broker_sleep's) is split into 16 gates by the writer's pid:
-- each writer locks its own gate, the exclusive side locks all 16.  Every
-- lock acquisition and release holds the lock-manager partition of its tag
-- (advisory locks have no fast path), so one tag for every writer is one
-- partition lock for every writer, twice per transaction; with gates,
-- writers meet on a tag only when their pids do modulo 16.  The second key
-- of gate G of key K: (K mod 2^27) * 16 + G, within int4 for every K; two
-- keys 2^27 apart share their gates, which only makes them conflict more.
-- The exclusive side also takes the key K itself, the one tag that the
-- triggers rendered before gates (0.1.0's) took: a writer transaction that
-- ran them and outlives the upgrade is waited for too.
CREATE FUNCTION pgbroker._lock_gates()
RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 16 $$;
COMMENT ON FUNCTION pgbroker._lock_gates() IS 'Internal: how many gates a gated lock has (see sql/300_watched_tables.sql).';

CREATE FUNCTION pgbroker._lock_gate_key(p_key integer, p_gate integer)
RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT (p_key % 134217728) * 16 + p_gate $$;
COMMENT ON FUNCTION pgbroker._lock_gate_key(integer, integer) IS
    'Internal: the second key of gate p_gate (0 to 15) of the gated lock p_key.';

CREATE FUNCTION pgbroker._lock_gate(p_key integer)
RETURNS integer LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT pgbroker._lock_gate_key(p_key, pg_catalog.pg_backend_pid() % pgbroker._lock_gates()) $$;
COMMENT ON FUNCTION pgbroker._lock_gate(integer) IS
    'Internal: the second key of this session''s gate of the gated lock p_key (by its pid; inlined in the triggers).';

-- ---------------------------------------------------------------------------
-- The rights watch() and unwatch() need on a table, as PostgreSQL judges them
-- for the functions' owner (current_user in them): USAGE on its schema, the
-- TRIGGER privilege (CREATE TRIGGER), UPDATE, DELETE or TRUNCATE (LOCK TABLE
-- ... ACCESS EXCLUSIVE), and, to drop triggers (unwatch, a second watch, a
-- mode switch), ownership of the table.  Checked before anything is done, so
-- that a refusal is one 42501 naming the right, with the GRANT that gives it.
CREATE FUNCTION pgbroker._watch_check_rights(p_table regclass, p_drop boolean)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_rel pg_catalog.pg_class;
    v_owner boolean;
    v_missing text[] := '{}';
BEGIN
    SELECT * INTO v_rel FROM pg_catalog.pg_class WHERE oid = p_table;
    IF NOT FOUND THEN
        RETURN true;   -- a dropped table: nothing of it to touch
    END IF;
    v_owner := pg_has_role(current_user, v_rel.relowner, 'USAGE');
    IF v_owner THEN
        RETURN true;
    END IF;
    IF NOT has_schema_privilege(current_user, v_rel.relnamespace, 'USAGE') THEN
        RAISE EXCEPTION 'permission denied to watch table %: pgbroker''s functions run as role %, which lacks USAGE on schema %',
                p_table, current_user, v_rel.relnamespace::regnamespace
            USING ERRCODE = 'insufficient_privilege',
                  HINT = format('As the schema''s owner: GRANT USAGE ON SCHEMA %s TO %I;', v_rel.relnamespace::regnamespace,
                                current_user);
    END IF;
    IF p_drop THEN
        RAISE EXCEPTION 'permission denied to drop the triggers of table % (unwatch, or watch again): pgbroker''s functions run as role %, which does not own it',
                p_table, current_user
            USING ERRCODE = 'insufficient_privilege',
                  HINT = format('PostgreSQL lets only a table''s owner drop its triggers: ALTER TABLE %s OWNER TO %I; '
                                'or, as a superuser, GRANT %I TO %I;', p_table, current_user, v_rel.relowner::regrole,
                                current_user);
    END IF;
    IF NOT has_table_privilege(current_user, p_table, 'TRIGGER') THEN
        v_missing := v_missing || 'TRIGGER'::text;
    END IF;
    IF NOT (has_table_privilege(current_user, p_table, 'UPDATE') OR has_table_privilege(current_user, p_table, 'DELETE')
            OR has_table_privilege(current_user, p_table, 'TRUNCATE')) THEN
        v_missing := v_missing || 'UPDATE'::text;
    END IF;
    IF v_missing <> '{}' THEN
        RAISE EXCEPTION 'permission denied to watch table %: pgbroker''s functions run as role %, which lacks the % privilege on it%',
                p_table, current_user, array_to_string(v_missing, ' and '),
                CASE WHEN 'UPDATE' = ANY (v_missing) THEN ' (LOCK TABLE needs UPDATE, DELETE or TRUNCATE)' ELSE '' END
            USING ERRCODE = 'insufficient_privilege',
                  HINT = format('As the table''s owner: GRANT %s ON %s TO %I;', array_to_string(v_missing, ', '), p_table,
                                current_user);
    END IF;
    RETURN false;
END
$$;
COMMENT ON FUNCTION pgbroker._watch_check_rights(regclass, boolean) IS
    'Internal: 42501 unless the current user may watch table p_table (and, with p_drop, drop its triggers); true when it owns the table.';

-- ---------------------------------------------------------------------------
-- Taking a watched table's lock without making its writers queue.
--
-- Creating or dropping a trigger needs a lock that conflicts with every
-- writer, and a lock request that waits makes every later writer wait behind
-- it.  So, as careful schema-change tools do: ask with a short lock_timeout,
-- and when a transaction is in the way, step back (writers go on), sleep a
-- growing while, and ask again, until WAIT has passed (PB022).
CREATE FUNCTION pgbroker._watch_lock_table(p_table regclass, p_wait interval)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_deadline timestamptz := clock_timestamp() + p_wait;
    v_timeout text := current_setting('lock_timeout');
    v_pause double precision := 0.01;
    v_tries integer := 0;
BEGIN
    PERFORM pgbroker._wait_ms(p_wait);  -- 22023 on a negative wait
    LOOP
        v_tries := v_tries + 1;
        BEGIN
            PERFORM set_config('lock_timeout', '50ms', true);
            EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', p_table);
            PERFORM set_config('lock_timeout', v_timeout, true);
            RETURN;
        EXCEPTION WHEN lock_not_available THEN
            IF p_wait IS NOT NULL AND clock_timestamp() + make_interval(secs => v_pause) >= v_deadline THEN
                RAISE EXCEPTION 'table % is busy: a transaction using it stayed open longer than % (% tries)', p_table,
                        p_wait, v_tries
                    USING ERRCODE = 'PB022', HINT = 'Retry when the transaction has ended, or pass a longer wait.';
            END IF;
        END;
        PERFORM pg_sleep(v_pause);
        v_pause := least(v_pause * 2, 0.5);
    END LOOP;
END
$$;
COMMENT ON FUNCTION pgbroker._watch_lock_table(regclass, interval) IS
    'Internal: lock a table ACCESS EXCLUSIVE with 50 ms tries and growing pauses between them, so writers never queue long behind the request; PB022 after p_wait.';

-- ---------------------------------------------------------------------------
-- Keys.

CREATE FUNCTION pgbroker._watch_of(p_table regclass)
RETURNS pgbroker.watched
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_watch pgbroker.watched;
BEGIN
    IF p_table IS NULL THEN
        RAISE EXCEPTION 'table must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    SELECT * INTO v_watch FROM pgbroker.watched WHERE relid = p_table;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'table % is not watched', p_table
            USING ERRCODE = 'PB021', HINT = 'An administrator must call pgbroker.watch() on it first.';
    END IF;
    RETURN v_watch;
END
$$;
COMMENT ON FUNCTION pgbroker._watch_of(regclass) IS 'Internal: the watched row of a table, PB021 when it is not watched.';

-- to_jsonb() of a few types depends on session settings: timestamptz on
-- TimeZone, interval on IntervalStyle, float4/float8 on extra_float_digits,
-- bytea on bytea_output, money on lc_monetary (and so do arrays, ranges and
-- composites of them).  A subscriber and a writer in sessions that differ
-- would then encode the same key differently and miss each other.  So keys
-- are always encoded under fixed settings: _encode_key always, the triggers
-- of a table whose key has a type outside the list below (others pay nothing).
CREATE FUNCTION pgbroker._key_settings(p_types regtype[])
RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN bool_and(coalesce(nullif(t.typbasetype, 0), t.oid)::regtype = ANY (ARRAY[
                    'smallint', 'integer', 'bigint', 'numeric', 'text', 'character varying', 'character',
                    'name', 'uuid', 'boolean', 'date', 'timestamp without time zone',
                    'time without time zone', 'time with time zone', 'oid', 'inet', 'cidr', 'macaddr',
                    'macaddr8', '"char"', 'jsonb']::regtype[])
                    OR t.typtype = 'e')
                THEN ''
                ELSE $s$ SET TimeZone = 'UTC' SET IntervalStyle = 'postgres' SET extra_float_digits = 1 $s$
                  || $s$SET bytea_output = 'hex' SET lc_monetary = 'C'$s$ END
      FROM unnest(p_types) AS k(typ)
      JOIN pg_catalog.pg_type t ON t.oid = k.typ
$$;
COMMENT ON FUNCTION pgbroker._key_settings(regtype[]) IS
    'Internal: the SET clauses the trigger functions of a table with these key types need so that keys encode as _encode_key() does; empty when no key type depends on session settings.';

-- The SQL expression that encodes a key K (an SQL expression of a key of
-- the right shape: a scalar, or an array in key order): each value cast to
-- its column's type (so '"42"' and '42' are the same key of an integer
-- column), then encoded as the triggers encode a row's key.
CREATE FUNCTION pgbroker._key_expression(p_watch pgbroker.watched, p_key text)
RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN count(*) = 1 THEN format('to_jsonb((%s #>> ''{}'')::%s)', p_key, min(t))
                ELSE format('jsonb_build_array(%s)', string_agg(format('(%s->>%s)::%s', p_key, i - 1, t), ', ' ORDER BY i))
           END
      FROM unnest(p_watch.key_types::text[]) WITH ORDINALITY AS u(t, i)
$$;
COMMENT ON FUNCTION pgbroker._key_expression(pgbroker.watched, text) IS
    'Internal: the SQL expression that casts a key (an expression of the right shape) to the key''s types and encodes it.';

-- Whether a key given by a caller has the shape of the table's key: a
-- scalar for a one-column key, an array of scalars in key order for a
-- composite one (NULL and JSON null, the whole table, are not keys here).
-- One expression, no SET clause, every name qualified: inlined into the
-- callers' queries (a sub-SELECT would stop that).
CREATE FUNCTION pgbroker._key_shape_ok(p_columns integer, p_key jsonb)
RETURNS boolean
LANGUAGE sql IMMUTABLE
AS $$
    SELECT CASE WHEN p_columns = 1 THEN pg_catalog.jsonb_typeof(p_key) NOT IN ('object', 'array')
                WHEN pg_catalog.jsonb_typeof(p_key) <> 'array' THEN false
                ELSE pg_catalog.jsonb_array_length(p_key) = p_columns
                     AND NOT pg_catalog.jsonb_path_exists(p_key, 'strict $[*] ? (@ == null || @.type() == "object" || @.type() == "array")')
           END
$$;
COMMENT ON FUNCTION pgbroker._key_shape_ok(integer, jsonb) IS
    'Internal: whether p_key has the shape of a key of p_columns columns (a scalar, or an array of that many scalars).';

-- Normalise a key given by a caller (see _key_expression); NULL or JSON null
-- stands for the whole table.  22023 on a wrong shape, 22P02 and friends on
-- a value that does not cast.
CREATE FUNCTION pgbroker._encode_key(p_watch pgbroker.watched, p_key jsonb)
RETURNS jsonb
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
-- The settings that change to_jsonb() of some key types: see _key_settings().
SET TimeZone = 'UTC' SET IntervalStyle = 'postgres' SET extra_float_digits = 1 SET bytea_output = 'hex'
SET lc_monetary = 'C'
AS $$
DECLARE
    v_n integer := cardinality(p_watch.key_columns);
    v_out jsonb;
BEGIN
    IF p_key IS NULL OR jsonb_typeof(p_key) = 'null' THEN
        RETURN 'null'::jsonb;
    END IF;
    IF NOT pgbroker._key_shape_ok(v_n, p_key) THEN
        RAISE EXCEPTION 'key % does not match the primary key (%) of %', p_key,
                array_to_string(p_watch.key_columns, ', '), p_watch.table_name
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Give a JSON scalar for a one-column key, a JSON array of scalars in key order for a composite one.';
    END IF;
    EXECUTE format('SELECT %s', pgbroker._key_expression(p_watch, '$1')) INTO v_out USING p_key;
    RETURN v_out;
END
$$;
COMMENT ON FUNCTION pgbroker._encode_key(pgbroker.watched, jsonb) IS
    'Internal: the canonical jsonb encoding of a key of the watched table (22023 on a wrong shape).';

-- _encode_key(), its error naming the key's position in a caller's array.
CREATE FUNCTION pgbroker._encode_key_at(p_watch pgbroker.watched, p_key jsonb, p_position integer)
RETURNS jsonb
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_state text;
    v_message text;
    v_hint text;
BEGIN
    RETURN pgbroker._encode_key(p_watch, p_key);
EXCEPTION WHEN data_exception THEN
    GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_message = MESSAGE_TEXT, v_hint = PG_EXCEPTION_HINT;
    IF v_hint = '' THEN
        RAISE EXCEPTION 'keys[%]: %', p_position, v_message USING ERRCODE = v_state;
    END IF;
    RAISE EXCEPTION 'keys[%]: %', p_position, v_message USING ERRCODE = v_state, HINT = v_hint;
END
$$;
COMMENT ON FUNCTION pgbroker._encode_key_at(pgbroker.watched, jsonb, integer) IS
    'Internal: _encode_key(), its error (if any) naming the key''s position in the caller''s array.';

-- The keys of a set-based call, encoded in one statement.  A bad key gets
-- the error _encode_key gives it, its message naming its position
-- (keys[3]: ...), so one bad key among thousands is found at once.
CREATE FUNCTION pgbroker._encode_keys(p_watch pgbroker.watched, p_keys jsonb[])
RETURNS jsonb[]
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
SET TimeZone = 'UTC' SET IntervalStyle = 'postgres' SET extra_float_digits = 1 SET bytea_output = 'hex'
SET lc_monetary = 'C'
AS $$
DECLARE
    v_n integer := cardinality(p_watch.key_columns);
    v_bad integer;
    v_out jsonb[];
BEGIN
    SELECT min(u.i) INTO v_bad FROM unnest(p_keys) WITH ORDINALITY AS u(k, i)
     WHERE u.k IS NOT NULL AND jsonb_typeof(u.k) <> 'null' AND NOT pgbroker._key_shape_ok(v_n, u.k);
    IF v_bad IS NULL THEN
        BEGIN
            EXECUTE format($q$SELECT array_agg(CASE WHEN u.k IS NULL OR jsonb_typeof(u.k) = 'null' THEN 'null'::jsonb
                                                   ELSE %s END ORDER BY u.i)
                                FROM unnest($1) WITH ORDINALITY AS u(k, i)$q$,
                           pgbroker._key_expression(p_watch, 'u.k'))
               INTO v_out USING p_keys;
            RETURN coalesce(v_out, '{}');
        EXCEPTION WHEN data_exception THEN
            NULL;   -- a value that does not cast: find which one below
        END;
    END IF;
    FOR i IN coalesce(v_bad, 1) .. cardinality(p_keys) LOOP
        PERFORM pgbroker._encode_key_at(p_watch, p_keys[i], i);
    END LOOP;
    RAISE EXCEPTION 'the keys of % do not encode, though each one alone does', p_watch.table_name;  -- cannot happen
END
$$;
COMMENT ON FUNCTION pgbroker._encode_keys(pgbroker.watched, jsonb[]) IS
    'Internal: _encode_key() of every key of an array, in one statement; a bad key''s error names its position.';
