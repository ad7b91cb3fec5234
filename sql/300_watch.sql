-- pgbroker: watched tables, subscriptions and the outbox.
--
-- pgbroker.watch(table) installs three statement-level triggers with
-- transition tables (INSERT, UPDATE, DELETE) and a TRUNCATE trigger on a table
-- with a primary key.  For each changed row they look the row's key up in
-- pgbroker.interest (the subscribed clients, kept ready per row and broker)
-- and write one outbox row per change and broker, carrying the list of target
-- clients.  After the statement they wake the affected brokers with
-- pg_notify, unless the broker is awake and draining (see "Wake-ups" below).
--
-- Keys are encoded as jsonb: a one-column key as its JSON scalar
-- (to_jsonb(id): 42, "abc"), a composite key as a JSON array in key-column
-- order ([7, "eu"]).  A whole-table subscription has the key JSON null.

CREATE TABLE pgbroker.watched (
    watch_id integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    relid oid NOT NULL CONSTRAINT watched_relid_unique UNIQUE,
    table_name text NOT NULL,
    key_columns text[] NOT NULL,
    key_types regtype[] NOT NULL,
    watched_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    -- Bumped by every subscribe: REPEATABLE READ writers lock this row FOR SHARE (see _watch_install).
    generation bigint NOT NULL DEFAULT 0
);
COMMENT ON TABLE pgbroker.watched IS 'Tables watched by pgbroker.watch(). Internal: read the view pgbroker.watched_tables.';
COMMENT ON COLUMN pgbroker.watched.watch_id IS 'Internal number of the watch; also names its trigger functions (pgbroker._watch_<id>_ins ...).';
COMMENT ON COLUMN pgbroker.watched.relid IS 'The watched table.';
COMMENT ON COLUMN pgbroker.watched.table_name IS 'Its qualified name when it was watched.';
COMMENT ON COLUMN pgbroker.watched.key_columns IS 'Primary-key columns, in key order.';
COMMENT ON COLUMN pgbroker.watched.key_types IS 'Their types.';
COMMENT ON COLUMN pgbroker.watched.watched_at IS 'When watch() last installed the triggers.';
COMMENT ON COLUMN pgbroker.watched.generation IS 'Internal: bumped by every subscribe, so that REPEATABLE READ writers notice subscriptions newer than their snapshot.';

CREATE TABLE pgbroker.subscription (
    client_key bigint NOT NULL REFERENCES pgbroker.client (client_key) ON DELETE CASCADE,
    watch_id integer NOT NULL REFERENCES pgbroker.watched (watch_id) ON DELETE CASCADE,
    row_key jsonb NOT NULL,
    subscribed_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    PRIMARY KEY (client_key, watch_id, row_key)
);
CREATE INDEX subscription_watch ON pgbroker.subscription (watch_id);
COMMENT ON TABLE pgbroker.subscription IS 'Which client is subscribed to which row (or, with key JSON null, to the whole table). Internal: use subscribe().';
COMMENT ON COLUMN pgbroker.subscription.client_key IS 'The client.';
COMMENT ON COLUMN pgbroker.subscription.watch_id IS 'The watched table.';
COMMENT ON COLUMN pgbroker.subscription.row_key IS 'The row''s key encoded as jsonb (see README), or JSON null for the whole table.';
COMMENT ON COLUMN pgbroker.subscription.subscribed_at IS 'When.';

-- The subscriptions aggregated per (table, key, broker): what the triggers
-- read.  One index probe per changed row, whatever the number of clients.
CREATE TABLE pgbroker.interest (
    watch_id integer NOT NULL REFERENCES pgbroker.watched (watch_id) ON DELETE CASCADE,
    row_key jsonb NOT NULL,
    name text NOT NULL,
    epoch bigint NOT NULL,
    clients bigint[] NOT NULL,
    -- The text of a one-column key, computed once here rather than in every
    -- bulk statement (see _watch_install).
    key_text text COLLATE "C"
        GENERATED ALWAYS AS (CASE WHEN jsonb_typeof(row_key) IN ('number', 'string', 'boolean') THEN row_key #>> '{}' END) STORED,
    PRIMARY KEY (watch_id, row_key, name)
);
CREATE INDEX interest_name ON pgbroker.interest (name);
-- For bulk statements: which brokers have any interest in a table (two index
-- probes, min and max), and one-column keys by their text.
CREATE INDEX interest_watch_name ON pgbroker.interest (watch_id, name);
CREATE INDEX interest_key_text ON pgbroker.interest (watch_id, key_text);
COMMENT ON TABLE pgbroker.interest IS 'Internal: subscribed client_keys per watched row and broker, kept by subscribe/unsubscribe/client_unregister for the triggers.';
COMMENT ON COLUMN pgbroker.interest.watch_id IS 'The watched table.';
COMMENT ON COLUMN pgbroker.interest.row_key IS 'The row key (JSON null: whole table).';
COMMENT ON COLUMN pgbroker.interest.name IS 'The broker (lease name) of these clients.';
COMMENT ON COLUMN pgbroker.interest.epoch IS 'Its epoch.';
COMMENT ON COLUMN pgbroker.interest.clients IS 'client_keys of the subscribed clients.';
COMMENT ON COLUMN pgbroker.interest.key_text IS 'The text of a one-column key (row_key #>> ''{}''), byte-compared by bulk statements.';

-- UNLOGGED: no WAL for the hot path.  Crash recovery empties it, and a
-- promoted standby has it empty; both end every broker session, so the next
-- claim starts a new epoch whose clients re-subscribe and re-read.
CREATE UNLOGGED TABLE pgbroker.outbox (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name text NOT NULL,
    epoch bigint NOT NULL,
    watch_id integer NOT NULL,
    op "char" NOT NULL,
    row_key jsonb,
    changed text[],
    clients bigint[] NOT NULL,
    at timestamptz NOT NULL DEFAULT pg_catalog.statement_timestamp()
);
CREATE INDEX outbox_name_id ON pgbroker.outbox (name, id);
-- A queue table: every row is deleted soon after it is written, and a fetch
-- walks the dead index entries until VACUUM removes them (measured: an empty
-- fetch over 70,000 dead rows takes 3.5 ms instead of 0.13 ms).  Let
-- autovacuum visit it as soon as it holds a few thousand dead rows.
ALTER TABLE pgbroker.outbox SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000,
                                 autovacuum_vacuum_cost_delay = 0);
COMMENT ON TABLE pgbroker.outbox IS
    'Notification targets written by the watch triggers: one row per changed row and broker. UNLOGGED (see README). Internal: use outbox_fetch() / outbox_ack().';
COMMENT ON COLUMN pgbroker.outbox.id IS 'Increasing; for one row of a watched table, in commit order.';
COMMENT ON COLUMN pgbroker.outbox.name IS 'Broker (lease name) to deliver to.';
COMMENT ON COLUMN pgbroker.outbox.epoch IS 'Epoch of that broker when the change was written.';
COMMENT ON COLUMN pgbroker.outbox.watch_id IS 'The watched table.';
COMMENT ON COLUMN pgbroker.outbox.op IS 'I insert, U update, D delete, T truncate.';
COMMENT ON COLUMN pgbroker.outbox.row_key IS 'Key of the changed row (NULL for T).';
COMMENT ON COLUMN pgbroker.outbox.changed IS 'For U: the names of the columns whose value changed; NULL otherwise.';
COMMENT ON COLUMN pgbroker.outbox.clients IS 'client_keys of the clients to tell.';
COMMENT ON COLUMN pgbroker.outbox.at IS 'Start of the statement that made the change.';

-- ---------------------------------------------------------------------------
-- Lock classes (first key of two-int4 advisory locks; second: see each).
CREATE FUNCTION pgbroker._lock_class_watch()
RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1885823603 $$;
COMMENT ON FUNCTION pgbroker._lock_class_watch() IS
    'Internal: ''pgbs''; (class, watch_id) is taken shared by writers'' triggers and exclusively by subscribe.';

CREATE FUNCTION pgbroker._lock_class_drain()
RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1885823607 $$;
COMMENT ON FUNCTION pgbroker._lock_class_drain() IS
    'Internal: ''pgbw''; (class, lease lock_key) is taken shared by writers that wake a broker and exclusively by broker_sleep().';

CREATE FUNCTION pgbroker._lock_class_awake()
RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1885823585 $$;
COMMENT ON FUNCTION pgbroker._lock_class_awake() IS
    'Internal: ''pgba''; (class, lease lock_key) is held (session level) by a broker while it is awake and draining.';

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

-- Normalise a key given by a caller: a scalar for a one-column key, an array
-- for a composite one; each value cast to its column's type (so '"42"' and
-- '42' are the same key of an integer column).  22023 on a wrong shape,
-- 22P02 and friends on a value that does not cast.
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
    v_parts jsonb := CASE WHEN v_n = 1 THEN jsonb_build_array(p_key) ELSE p_key END;
    v_sql text;
    v_out jsonb;
BEGIN
    IF p_key IS NULL OR jsonb_typeof(p_key) = 'null' THEN
        RETURN 'null'::jsonb;
    END IF;
    IF jsonb_typeof(v_parts) <> 'array' OR jsonb_array_length(v_parts) <> v_n
       OR EXISTS (SELECT FROM jsonb_array_elements(v_parts) e WHERE jsonb_typeof(e) IN ('null', 'object', 'array')) THEN
        RAISE EXCEPTION 'key % does not match the primary key (%) of %', p_key,
                array_to_string(p_watch.key_columns, ', '), p_watch.table_name
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Give a JSON scalar for a one-column key, a JSON array of scalars in key order for a composite one.';
    END IF;
    SELECT format('SELECT %s', CASE WHEN v_n = 1 THEN format('to_jsonb(($1->>0)::%s)', min(t)) ELSE
               format('jsonb_build_array(%s)', string_agg(format('($1->>%s)::%s', i - 1, t), ', ' ORDER BY i)) END)
      INTO v_sql
      FROM unnest(p_watch.key_types::text[]) WITH ORDINALITY AS u(t, i);
    EXECUTE v_sql INTO v_out USING v_parts;
    RETURN v_out;
END
$$;
COMMENT ON FUNCTION pgbroker._encode_key(pgbroker.watched, jsonb) IS
    'Internal: the canonical jsonb encoding of a key of the watched table (22023 on a wrong shape).';

-- ---------------------------------------------------------------------------
-- Wake-ups.
--
-- A broker that is awake holds the session-level "awake" lock of its lease
-- and drains the outbox; writers see that and do not NOTIFY (every NOTIFY
-- serialises commits on a cluster-wide lock).  To go to sleep the broker
-- releases "awake", then waits for writers that may have seen it awake
-- (they hold the "drain" lock shared until they commit) and looks at the
-- outbox once more: a writer either saw it asleep and notifies, or committed
-- before that last look.  This holds at every isolation level, because the
-- "awake" test is a lock, not a row a snapshot could hide.

CREATE FUNCTION pgbroker.wakeup_channel(name text DEFAULT 'default')
RETURNS text
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT 'pgbroker_wakeup_' || lock_key FROM pgbroker.lease WHERE lease.name = wakeup_channel.name
$$;
COMMENT ON FUNCTION pgbroker.wakeup_channel(text) IS
$$The LISTEN channel on which the broker of lease NAME is woken: 'pgbroker_wakeup_' followed by the lease's number
(never user text, so no quoting or length issue); the payload is the lease name. NULL before the first claim.$$;

CREATE FUNCTION pgbroker._awake_held(p_key integer)
RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT EXISTS (SELECT FROM pg_catalog.pg_locks l
                    WHERE l.locktype = 'advisory' AND l.pid = pg_catalog.pg_backend_pid() AND l.granted
                      AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())
                      AND l.classid = pgbroker._lock_class_awake()::oid AND l.objid = p_key::oid AND l.objsubid = 2
                      AND l.mode = 'ExclusiveLock')
$$;
COMMENT ON FUNCTION pgbroker._awake_held(integer) IS 'Internal: whether this session holds the awake lock p_key.';

CREATE FUNCTION pgbroker.broker_wake(name text DEFAULT 'default')
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(broker_wake.name);
    v_epoch bigint;
    v_key integer;
BEGIN
    v_epoch := pgbroker._holder_epoch(v_name);
    SELECT lock_key INTO v_key FROM pgbroker.lease l WHERE l.name = v_name;
    IF NOT pgbroker._awake_held(v_key) THEN
        PERFORM pg_advisory_lock(pgbroker._lock_class_awake(), v_key);
    END IF;
    -- A writer that read pgbroker.interest just before this epoch's claim
    -- committed may have written rows for the old epoch after the claim
    -- wiped them: nobody will fetch those, so drop them here.
    DELETE FROM pgbroker.outbox o WHERE o.name = v_name AND o.epoch < v_epoch;
END
$$;
COMMENT ON FUNCTION pgbroker.broker_wake(text) IS
$$Holder only: declare the broker of lease NAME awake and draining, so writers stop sending NOTIFYs.
Idempotent. Call it before draining with outbox_fetch(); call broker_sleep() when the outbox is empty.$$;

CREATE FUNCTION pgbroker.broker_sleep(name text DEFAULT 'default', wait interval DEFAULT '20 ms')
RETURNS text
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(broker_sleep.name);
    v_epoch bigint := pgbroker._holder_epoch(v_name);
    v_wait_ms text := pgbroker._wait_ms(broker_sleep.wait);   -- checked before anything changes
    v_floor bigint;
    v_key integer;
    v_timeout text := current_setting('lock_timeout');
BEGIN
    SELECT lock_key INTO v_key FROM pgbroker.lease l WHERE l.name = v_name;
    IF pgbroker._awake_held(v_key) THEN
        PERFORM pg_advisory_unlock(pgbroker._lock_class_awake(), v_key);
    END IF;
    -- Wait for writers that may have seen us awake (bounded: a long writer
    -- transaction must not stall every other writer queued behind us).
    BEGIN
        PERFORM set_config('lock_timeout', v_wait_ms, true);
        PERFORM pg_advisory_xact_lock(pgbroker._lock_class_drain(), v_key);
        PERFORM set_config('lock_timeout', v_timeout, true);
    EXCEPTION WHEN lock_not_available THEN
        PERFORM pg_advisory_lock(pgbroker._lock_class_awake(), v_key);
        RETURN 'busy';
    END;
    v_floor := pgbroker._outbox_floor(v_name, v_epoch, false);
    IF EXISTS (SELECT FROM pgbroker.outbox o WHERE o.name = v_name AND o.epoch = v_epoch AND o.id > v_floor) THEN
        PERFORM pg_advisory_lock(pgbroker._lock_class_awake(), v_key);
        RETURN 'pending';
    END IF;
    RETURN 'asleep';
END
$$;
COMMENT ON FUNCTION pgbroker.broker_sleep(text, interval) IS
$$Holder only: declare the broker of lease NAME asleep, so that the next writer NOTIFYs it. Call it in autocommit mode.
Returns 'asleep' (outbox empty: LISTEN on wakeup_channel(NAME) and wait), 'pending' (rows arrived: still awake, fetch again)
or 'busy' (a writer transaction still open after WAIT: still awake; poll again soon).$$;

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

-- ---------------------------------------------------------------------------
-- Subscriptions.

-- Remove client p_client from interest rows: of one (watch, key), or all its own when p_watch_id is NULL.
CREATE FUNCTION pgbroker._interest_remove(p_client bigint, p_watch_id integer, p_row_key jsonb)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := (SELECT c.name FROM pgbroker.client c WHERE c.client_key = p_client);
    v_watch_ids integer[];
    v_row_keys jsonb[];
BEGIN
    WITH mine AS (
        DELETE FROM pgbroker.subscription s
         WHERE s.client_key = p_client
           AND (p_watch_id IS NULL OR (s.watch_id = p_watch_id AND s.row_key = p_row_key))
        RETURNING s.watch_id, s.row_key
    ), shrunk AS (
        UPDATE pgbroker.interest i
           SET clients = array_remove(i.clients, p_client)
          FROM mine m
         WHERE i.watch_id = m.watch_id AND i.row_key = m.row_key AND i.name = v_name
        RETURNING i.watch_id, i.row_key, i.clients
    )
    SELECT array_agg(s.watch_id), array_agg(s.row_key) INTO v_watch_ids, v_row_keys
      FROM shrunk s WHERE cardinality(s.clients) = 0;
    -- A row can change only once per statement: drop the emptied ones now.
    DELETE FROM pgbroker.interest i
     USING unnest(v_watch_ids, v_row_keys) AS e(watch_id, row_key)
     WHERE i.watch_id = e.watch_id AND i.row_key = e.row_key AND i.name = v_name AND cardinality(i.clients) = 0;
END
$$;
COMMENT ON FUNCTION pgbroker._interest_remove(bigint, integer, jsonb) IS
    'Internal: drop subscriptions of a client (one, or all when p_watch_id is NULL) and shrink pgbroker.interest.';

CREATE FUNCTION pgbroker.subscribe(client_id text, "table" regclass, key jsonb DEFAULT NULL,
                                   name text DEFAULT 'default', epoch bigint DEFAULT NULL,
                                   wait interval DEFAULT '5 s')
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(subscribe.name);
    v_epoch bigint := pgbroker._acting_epoch(v_name, subscribe.epoch);
    v_client bigint := pgbroker._client_key(v_name, subscribe.client_id);
    v_watch pgbroker.watched := pgbroker._watch_of(subscribe."table");
    v_key jsonb := pgbroker._encode_key(v_watch, subscribe.key);
    v_timeout text := current_setting('lock_timeout');
BEGIN
    -- A subscription to a table whose triggers are gone or disabled would
    -- never hear of a change (triggers dropped by hand, or a dropped watched
    -- table whose oid a new table reused).
    IF (SELECT count(*) FROM pg_catalog.pg_trigger t
         WHERE t.tgrelid = v_watch.relid AND t.tgenabled <> 'D'
           AND t.tgname IN ('_pgbroker_watch_ins', '_pgbroker_watch_upd', '_pgbroker_watch_del', '_pgbroker_watch_trunc')) <> 4 THEN
        RAISE EXCEPTION 'the pgbroker triggers of table % are missing or disabled', subscribe."table"
            USING ERRCODE = 'PB021', HINT = 'An administrator must call pgbroker.watch() on it again (or ENABLE the triggers).';
    END IF;
    -- Exclusive against writers' triggers (shared): writers that already read
    -- the interest without us commit first, later ones see us.
    BEGIN
        PERFORM set_config('lock_timeout', pgbroker._wait_ms(subscribe.wait), true);
        PERFORM pg_advisory_xact_lock(pgbroker._lock_class_watch(), v_watch.watch_id);
        PERFORM set_config('lock_timeout', v_timeout, true);
    EXCEPTION WHEN lock_not_available THEN
        RAISE EXCEPTION 'table % is busy: a writer transaction stayed open longer than %', v_watch.table_name, subscribe.wait
            USING ERRCODE = 'lock_not_available', HINT = 'Retry, or pass a longer wait.';
    END;
    INSERT INTO pgbroker.subscription (client_key, watch_id, row_key)
    VALUES (v_client, v_watch.watch_id, v_key)
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO pgbroker.interest AS i (watch_id, row_key, name, epoch, clients)
    VALUES (v_watch.watch_id, v_key, v_name, v_epoch, ARRAY[v_client])
    ON CONFLICT ON CONSTRAINT interest_pkey DO UPDATE SET clients = i.clients || v_client, epoch = excluded.epoch;
    UPDATE pgbroker.watched SET generation = generation + 1 WHERE watch_id = v_watch.watch_id;
    RETURN true;
END
$$;
COMMENT ON FUNCTION pgbroker.subscribe(text, regclass, jsonb, text, bigint, interval) IS
$$Broker only: subscribe client CLIENT_ID to the row of watched TABLE whose primary key is KEY (jsonb: a scalar for a
one-column key, an array in key order for a composite one), or to the whole table when KEY is NULL.
No gap: once it returns, every change that commits later is in the outbox, so a client that subscribes and then reads
the row misses nothing. Waits up to WAIT for writer transactions already past their trigger (55P03 after that).
Returns false when the subscription existed. PB010 unknown client, PB021 table not watched, 22023 bad key.$$;

CREATE FUNCTION pgbroker.unsubscribe(client_id text, "table" regclass, key jsonb DEFAULT NULL,
                                     name text DEFAULT 'default', epoch bigint DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(unsubscribe.name);
    v_epoch bigint := pgbroker._acting_epoch(v_name, unsubscribe.epoch);
    v_client bigint := pgbroker._client_key(v_name, unsubscribe.client_id);
    v_watch pgbroker.watched := pgbroker._watch_of(unsubscribe."table");
    v_key jsonb := pgbroker._encode_key(v_watch, unsubscribe.key);
BEGIN
    IF NOT EXISTS (SELECT FROM pgbroker.subscription s
                    WHERE s.client_key = v_client AND s.watch_id = v_watch.watch_id AND s.row_key = v_key) THEN
        RETURN false;
    END IF;
    PERFORM pgbroker._interest_remove(v_client, v_watch.watch_id, v_key);
    RETURN true;
END
$$;
COMMENT ON FUNCTION pgbroker.unsubscribe(text, regclass, jsonb, text, bigint) IS
    'Broker only: drop the subscription of CLIENT_ID to KEY of TABLE (NULL: the whole-table one); false when there was none.';

-- ---------------------------------------------------------------------------
-- Delivery.

-- Where a fetch can start.  Acknowledged rows leave dead index entries
-- behind until VACUUM, and a scan from the start of a broker's rows walks
-- them all (an empty fetch over 70,000 dead rows: 3.5 ms instead of 0.1 ms).
-- So each broker session keeps a floor F: no row with id <= F will ever need
-- fetching.  Now and then a fetch reads S, the outbox sequence's value, and
-- only then takes an xid X of its own.  An outbox row is only ever written
-- after its transaction's first write, so a row with id <= S belongs to a
-- transaction whose xid is below X.  Once every xid below X has ended (X is
-- below the current xmin), such a row is visible or gone for good, and F
-- may rise to S, never past a row still waiting.  The state lives in the
-- setting pgbroker.outbox_floor ('epoch:F:S:X:when'); a rolled-back fetch
-- only makes it more conservative.  (A snapshot's xmax is not a substitute
-- for X: it omits running transactions whose xid is above the last one to
-- complete.)
CREATE FUNCTION pgbroker._outbox_floor(p_name text, p_epoch bigint, p_advance boolean)
RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_state text[] := string_to_array(current_setting('pgbroker.outbox_floor', true), ':');
    v_floor bigint := 0;
    v_s bigint;
    v_x xid8;
    v_when timestamptz;
    v_first bigint;
BEGIN
    IF v_state[1] = p_epoch::text AND cardinality(v_state) = 5 THEN
        v_floor := v_state[2]::bigint;
        v_s := nullif(v_state[3], '')::bigint;
        v_x := nullif(v_state[4], '')::xid8;
        v_when := to_timestamp(nullif(v_state[5], '')::double precision);
    END IF;
    IF NOT p_advance OR current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN v_floor;
    END IF;
    IF v_x IS NOT NULL AND v_x < pg_snapshot_xmin(pg_current_snapshot()) THEN
        SELECT min(o.id) INTO v_first FROM pgbroker.outbox o
         WHERE o.name = p_name AND o.epoch = p_epoch AND o.id > v_floor;
        v_floor := greatest(v_floor, least(v_s, v_first - 1));
        v_x := NULL;
    END IF;
    -- A new (S, X) needs an xid taken after reading S: only in a transaction
    -- that has none yet, and at most every 100 ms (each costs an xid).
    IF v_x IS NULL AND pg_current_xact_id_if_assigned() IS NULL
       AND (v_when IS NULL OR v_when < clock_timestamp() - interval '100 ms') THEN
        SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END INTO v_s FROM pgbroker.outbox_id_seq;
        v_x := pg_current_xact_id();
        v_when := clock_timestamp();
    END IF;
    PERFORM set_config('pgbroker.outbox_floor',
                       concat_ws(':', p_epoch, v_floor, coalesce(v_s::text, ''), coalesce(v_x::text, ''),
                                 coalesce(extract(epoch FROM v_when)::text, '')),
                       false);
    RETURN v_floor;
END
$$;
COMMENT ON FUNCTION pgbroker._outbox_floor(text, bigint, boolean) IS
    'Internal: the id below which this broker session''s outbox scans can start (see the comment above it in sql/300_watch.sql); p_advance moves it up when that is safe.';

CREATE FUNCTION pgbroker.outbox_fetch(name text DEFAULT 'default', max_rows integer DEFAULT 1000, ack bigint[] DEFAULT NULL)
RETURNS TABLE (id bigint, "table" text, op text, key jsonb, changed text[], clients text[], at timestamptz)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(outbox_fetch.name);
    v_epoch bigint := pgbroker._holder_epoch(v_name);
    v_floor bigint;
BEGIN
    IF outbox_fetch.max_rows IS NULL OR outbox_fetch.max_rows < 1 THEN
        RAISE EXCEPTION 'max_rows must be at least 1' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- First, before this transaction writes anything (see _outbox_floor).
    v_floor := pgbroker._outbox_floor(v_name, v_epoch, true);
    IF outbox_fetch.ack IS NOT NULL THEN
        -- Acknowledge the previous batch in the same round trip.
        DELETE FROM pgbroker.outbox b WHERE b.name = v_name AND b.id = ANY (outbox_fetch.ack);
    END IF;
    RETURN QUERY
    SELECT o.id, w.relid::regclass::text, o.op::text, o.row_key, o.changed,
           -- One index probe per client (a join would be planned as a hash
           -- join over the whole client table, for every row); clients
           -- unregistered since the change are left out.
           array_remove(ARRAY(SELECT (SELECT c.client_id FROM pgbroker.client c WHERE c.client_key = u.k)
                                FROM unnest(o.clients) WITH ORDINALITY AS u(k, n) ORDER BY u.n), NULL),
           o.at
      FROM (SELECT * FROM pgbroker.outbox b
             WHERE b.name = v_name AND b.epoch = v_epoch AND b.id > v_floor
             ORDER BY b.id
             LIMIT outbox_fetch.max_rows
               FOR UPDATE SKIP LOCKED) o
      JOIN pgbroker.watched w ON w.watch_id = o.watch_id
     ORDER BY o.id;
END
$$;
COMMENT ON FUNCTION pgbroker.outbox_fetch(text, integer, bigint[]) IS
$$Holder only: up to MAX_ROWS pending notifications of lease NAME, oldest first (for any one row: in commit order).
Each: id, table, op (I/U/D/T), key (jsonb, NULL for T), changed (column names, for U), clients (client ids to tell), at.
Rows stay until acknowledged, by outbox_ack() or by passing their ids as ACK to the next outbox_fetch() (one round
trip less): at-least-once delivery within the epoch.$$;

CREATE FUNCTION pgbroker.outbox_ack(name text, ids bigint[])
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(outbox_ack.name);
    v_count bigint;
BEGIN
    PERFORM pgbroker._holder_epoch(v_name);
    DELETE FROM pgbroker.outbox o WHERE o.name = v_name AND o.id = ANY (outbox_ack.ids);
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;
COMMENT ON FUNCTION pgbroker.outbox_ack(text, bigint[]) IS
    'Holder only: acknowledge (delete) delivered notifications IDS of lease NAME; returns how many.';

-- ---------------------------------------------------------------------------
-- Views.

CREATE VIEW pgbroker.watched_tables AS
SELECT w.relid::regclass AS "table", w.key_columns, w.watched_at,
       (SELECT count(*) FROM pgbroker.subscription s WHERE s.watch_id = w.watch_id) AS subscriptions
  FROM pgbroker.watched w;
COMMENT ON VIEW pgbroker.watched_tables IS 'Tables watched by pgbroker, with their key columns and number of subscriptions.';
COMMENT ON COLUMN pgbroker.watched_tables."table" IS 'The watched table.';
COMMENT ON COLUMN pgbroker.watched_tables.key_columns IS 'Its primary-key columns, in the order used by key encoding.';
COMMENT ON COLUMN pgbroker.watched_tables.watched_at IS 'When watch() last installed its triggers.';
COMMENT ON COLUMN pgbroker.watched_tables.subscriptions IS 'Number of subscriptions to it.';

CREATE VIEW pgbroker.subscriptions AS
SELECT c.name, c.client_id, w.relid::regclass AS "table",
       CASE WHEN s.row_key = 'null'::jsonb THEN NULL ELSE s.row_key END AS key, s.subscribed_at
  FROM pgbroker.subscription s
  JOIN pgbroker.client c ON c.client_key = s.client_key
  JOIN pgbroker.watched w ON w.watch_id = s.watch_id;
COMMENT ON VIEW pgbroker.subscriptions IS 'Who is subscribed to what.';
COMMENT ON COLUMN pgbroker.subscriptions.name IS 'Broker (lease name) of the client.';
COMMENT ON COLUMN pgbroker.subscriptions.client_id IS 'The client.';
COMMENT ON COLUMN pgbroker.subscriptions."table" IS 'The watched table.';
COMMENT ON COLUMN pgbroker.subscriptions.key IS 'The row key (jsonb), NULL for a whole-table subscription.';
COMMENT ON COLUMN pgbroker.subscriptions.subscribed_at IS 'When.';

CREATE VIEW pgbroker.outbox_pending AS
SELECT o.name, count(*) AS pending, min(o.at) AS oldest
  FROM pgbroker.outbox o
 GROUP BY o.name;
COMMENT ON VIEW pgbroker.outbox_pending IS 'Undelivered notifications per broker: how many and since when.';
COMMENT ON COLUMN pgbroker.outbox_pending.name IS 'Broker (lease name).';
COMMENT ON COLUMN pgbroker.outbox_pending.pending IS 'Notifications not yet acknowledged.';
COMMENT ON COLUMN pgbroker.outbox_pending.oldest IS 'Statement time of the oldest one.';

CREATE VIEW pgbroker.clients AS
SELECT c.name, c.epoch, c.client_id, c.info, c.registered_at, c.updated_at,
       (SELECT count(*) FROM pgbroker.subscription s WHERE s.client_key = c.client_key)::integer AS subscriptions
  FROM pgbroker.client c
  JOIN pgbroker.lease l ON l.name = c.name AND l.epoch = c.epoch
 WHERE l.state = 'held'
   AND pgbroker._lease_alive(l.holder_pid, l.holder_backend_start, l.lock_key);
COMMENT ON VIEW pgbroker.clients IS 'Clients connected to live brokers, with their broker (lease name) and epoch.';
COMMENT ON COLUMN pgbroker.clients.name IS 'Lease name of the broker the client is connected to.';
COMMENT ON COLUMN pgbroker.clients.epoch IS 'Epoch of that broker.';
COMMENT ON COLUMN pgbroker.clients.client_id IS 'Client identifier given by the broker.';
COMMENT ON COLUMN pgbroker.clients.info IS 'What the broker knows of the client (address, version...).';
COMMENT ON COLUMN pgbroker.clients.registered_at IS 'When it was registered.';
COMMENT ON COLUMN pgbroker.clients.updated_at IS 'When its info last changed.';
COMMENT ON COLUMN pgbroker.clients.subscriptions IS 'How many subscriptions it has.';

-- ---------------------------------------------------------------------------
-- A new claim also wipes the clients, subscriptions and pending
-- notifications of earlier epochs (replaces the definition in 100_lease.sql).
CREATE OR REPLACE FUNCTION pgbroker._lease_clear_state(p_name text, p_epoch bigint)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    DELETE FROM pgbroker.state WHERE name = p_name AND epoch < p_epoch;
    DELETE FROM pgbroker.outbox WHERE name = p_name AND epoch < p_epoch;
    DELETE FROM pgbroker.interest WHERE name = p_name AND epoch < p_epoch;
    DELETE FROM pgbroker.client WHERE name = p_name AND epoch < p_epoch;   -- cascades to subscriptions
END
$$;
COMMENT ON FUNCTION pgbroker._lease_clear_state(text, bigint) IS
    'Internal: delete the broker state, clients, subscriptions and pending notifications of lease p_name left by epochs before p_epoch.';
