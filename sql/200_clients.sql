-- pgbroker: the client registry.
--
-- The broker records the clients connected to it, so a frontend can list
-- them (view pgbroker.clients) and triggers can work out who must hear about
-- a change.  Only the current holder of the lease may change its clients:
-- either from its own session, or from any session that passes the holder's
-- current epoch (checked like broker_assert()).  Clients belong to the epoch
-- that registered them: a new claim makes those of earlier epochs invisible
-- at once (every reader compares the epoch), and broker_sweep() deletes them.
-- A broker that restarts registers its clients again, many per call with
-- client_register_many().

-- No foreign key to the lease: its check would run once per registered
-- client, and a restarting broker registers them by the ten thousand.  Only
-- functions that checked the lease (_acting_epoch) insert here.
CREATE TABLE pgbroker.client (
    client_key bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name text NOT NULL,
    epoch bigint NOT NULL,
    client_id text NOT NULL,
    info jsonb NOT NULL DEFAULT '{}',
    registered_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    updated_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    -- Per epoch: a new epoch registers its clients beside an earlier one's,
    -- never touching (nor waiting for) the rows the sweep deletes.
    CONSTRAINT client_id_unique UNIQUE (name, epoch, client_id),
    CONSTRAINT client_id_valid CHECK (client_id <> '' AND octet_length(client_id) <= 200)
);
COMMENT ON TABLE pgbroker.client IS
    'Clients registered by the broker of each lease. Internal: use client_register() and the view pgbroker.clients.';
COMMENT ON COLUMN pgbroker.client.client_key IS 'Internal number of the client (of one epoch); subscriptions refer to it.';
COMMENT ON COLUMN pgbroker.client.name IS 'Lease name of the broker the client is connected to.';
COMMENT ON COLUMN pgbroker.client.epoch IS 'Epoch of the broker that registered it; clients of earlier epochs are invisible and swept by broker_sweep().';
COMMENT ON COLUMN pgbroker.client.client_id IS 'Identifier given by the broker (1 to 200 bytes), unique per broker and epoch.';
COMMENT ON COLUMN pgbroker.client.info IS 'What the broker knows of the client (address, version...).';
COMMENT ON COLUMN pgbroker.client.registered_at IS 'When it was registered.';
COMMENT ON COLUMN pgbroker.client.updated_at IS 'When its info last changed.';

-- ---------------------------------------------------------------------------
-- Registry events: the registry as a live feed.  While some session watches
-- a broker's registry (registry_watch_begin), every change to its clients
-- and subscriptions is announced on registry_channel(name) at commit, a JSON
-- object with event (register, update, unregister, subscribe, unsubscribe),
-- name, epoch, client_id, and info (for register and update, when under 4,000
-- bytes) or table and key (for subscriptions; key null: the whole table).
-- While nobody watches, nothing is announced, so a broker's calls pay only
-- the test below.  The test is the one the key-value store uses
-- (670_kv.sql), per broker name, with two lock classes:
--   (1885823591 'pgbg', _registry_key(name)) "watchers": held shared by each
--       watching session until registry_watch_end or its end;
--   (1885823590 'pgbf', _registry_key(name)) "writes in flight": held shared
--       by each registry change until its transaction ends, taken with a try
--       before it looks for watchers.
-- A watcher LISTENs, takes "watchers" shared, then "writes in flight"
-- exclusive for its transaction (waiting for the changes that looked before
-- it), and only then reads: every change is either announced after it
-- listens or committed before it reads.  Changes never wait for watchers: one
-- that finds "writes in flight" taken announces itself.

CREATE FUNCTION pgbroker._lock_class_registry()
RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1885823591 $$;
COMMENT ON FUNCTION pgbroker._lock_class_registry() IS
    'Internal: ''pgbg''; (class, _registry_key(name)) is held shared by the sessions that watch the registry of broker name.';

CREATE FUNCTION pgbroker._lock_class_registry_write()
RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1885823590 $$;
COMMENT ON FUNCTION pgbroker._lock_class_registry_write() IS
    'Internal: ''pgbf''; (class, _registry_key(name)) is held shared by registry changes of broker name until they commit.';

-- Two names that share a key only make changes of one announced while the
-- other is watched: harmless.
CREATE FUNCTION pgbroker._registry_key(p_name text)
RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT pg_catalog.hashtext(p_name) $$;
COMMENT ON FUNCTION pgbroker._registry_key(text) IS 'Internal: the second key of the registry locks of broker p_name.';

CREATE FUNCTION pgbroker.registry_channel(name text DEFAULT 'default')
RETURNS text
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT pgbroker._name_check('lease', pgbroker._check_name(registry_channel.name), false);
    SELECT 'pgbroker_registry_' || md5(registry_channel.name);
$$;
COMMENT ON FUNCTION pgbroker.registry_channel(text) IS
$$The channel registry events of broker NAME are announced on while a session watches (registry_watch_begin): 'pgbroker_registry_' and a digest of the name (never user text). Payload: a JSON object with event (register, update, unregister, subscribe, unsubscribe), name, epoch, client_id, and info (register, update; left out over 4,000 bytes) or table and key (subscribe, unsubscribe; key null: the whole table).$$;

CREATE FUNCTION pgbroker.registry_watch_begin(name text DEFAULT 'default')
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_key integer := pgbroker._registry_key(pgbroker._check_name(registry_watch_begin.name));
BEGIN
    PERFORM pgbroker._name_check('lease', registry_watch_begin.name, false);
    PERFORM pg_advisory_lock_shared(pgbroker._lock_class_registry(), v_key);
    BEGIN
        PERFORM set_config('pgbroker.registry_watching', 'on', false);   -- this session's own changes: see _registry_watched
        -- Wait for the changes that looked for watchers before we registered.
        PERFORM pg_advisory_xact_lock(pgbroker._lock_class_registry_write(), v_key);
    EXCEPTION WHEN query_canceled OR others THEN
        -- A cancel or statement_timeout while waiting: not registered (the
        -- session lock above outlives the error, so it goes here).
        PERFORM pg_advisory_unlock_shared(pgbroker._lock_class_registry(), v_key);
        RAISE;
    END;
END
$$;
COMMENT ON FUNCTION pgbroker.registry_watch_begin(text) IS
$$Register this session as a watcher of the registry of broker NAME: from now on every change to its clients and subscriptions is announced on registry_channel(NAME) at commit (without a watcher, nothing is).
Waits for the changes in flight (they looked for watchers before) to commit or roll back. The loop: LISTEN on registry_channel(NAME) (and lease_channel(), whose events tell of a new epoch), then SELECT registry_watch_begin(NAME), both outside a transaction, then read the views clients and subscriptions, then apply each event. Held until registry_watch_end(NAME) or the session ends.$$;

CREATE FUNCTION pgbroker.registry_watch_end(name text DEFAULT 'default')
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET client_min_messages = error   -- pg_advisory_unlock warns when the lock is not held: we return false instead
AS $$
BEGIN
    RETURN pg_advisory_unlock_shared(pgbroker._lock_class_registry(),
                                     pgbroker._registry_key(pgbroker._check_name(registry_watch_end.name)));
END
$$;
COMMENT ON FUNCTION pgbroker.registry_watch_end(text) IS
    'End one registry_watch_begin(NAME) of this session (they stack); false when it has none. Changes stay announced while any session watches.';

-- Whether the changes of this transaction to broker p_name's registry must be
-- announced (see above).  No SET clause: only SECURITY DEFINER functions with
-- a pinned search_path call it; every name in it is qualified.
CREATE FUNCTION pgbroker._registry_watched(p_name text)
RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    v_key integer := pgbroker._registry_key(p_name);
BEGIN
    -- A session's own shared lock never conflicts with its own try: a session
    -- that watches marks itself and always announces.
    IF pg_catalog.pg_try_advisory_xact_lock_shared(pgbroker._lock_class_registry_write(), v_key)
       AND pg_catalog.current_setting('pgbroker.registry_watching', true) IS DISTINCT FROM 'on' THEN
        RETURN NOT (CASE WHEN pg_catalog.pg_try_advisory_lock(pgbroker._lock_class_registry(), v_key)
                         THEN pg_catalog.pg_advisory_unlock(pgbroker._lock_class_registry(), v_key)
                         ELSE false END);
    END IF;
    RETURN true;
END
$$;
COMMENT ON FUNCTION pgbroker._registry_watched(text) IS
    'Internal: whether registry changes of broker p_name must be announced now (a watcher is registered, or one is registering).';

-- The payload of a client's event.
CREATE FUNCTION pgbroker._registry_client_event(p_event text, p_name text, p_epoch bigint, p_client_id text, p_info jsonb)
RETURNS text
LANGUAGE sql IMMUTABLE
AS $$
    SELECT pg_catalog.json_build_object('event', p_event, 'name', p_name, 'epoch', p_epoch, 'client_id', p_client_id,
                                        'info', CASE WHEN pg_catalog.octet_length(p_info::text) <= 4000 THEN p_info END)::text
$$;
COMMENT ON FUNCTION pgbroker._registry_client_event(text, text, bigint, text, jsonb) IS
    'Internal: the registry_channel() payload of a client''s register, update or unregister (info left out over 4,000 bytes).';

-- The epoch on whose behalf the caller acts: its own lease when p_epoch is
-- NULL (PB001 unless this session holds it), else p_epoch once checked like
-- broker_assert() (PB002 unless current and alive).
CREATE FUNCTION pgbroker._acting_epoch(p_name text, p_epoch bigint)
RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_epoch IS NULL THEN
        RETURN pgbroker._holder_epoch(p_name);   -- (which checks the name grants)
    END IF;
    PERFORM pgbroker._name_check('lease', p_name, true);
    PERFORM pgbroker.broker_assert(p_name, p_epoch);
    RETURN p_epoch;
END
$$;
COMMENT ON FUNCTION pgbroker._acting_epoch(text, bigint) IS
    'Internal: the epoch the caller acts for: its own lease (p_epoch NULL) or p_epoch after a broker_assert().';

CREATE FUNCTION pgbroker._client_key(p_name text, p_epoch bigint, p_client_id text)
RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_key bigint;
BEGIN
    -- FOR KEY SHARE: an unregister of this client waits for the caller's
    -- transaction (or went first, and the client is unknown).
    SELECT client_key INTO v_key FROM pgbroker.client
     WHERE name = p_name AND epoch = p_epoch AND client_id = p_client_id
       FOR KEY SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'client "%" is not registered with broker "%"', p_client_id, p_name
            USING ERRCODE = 'PB010', HINT = 'Register it first with pgbroker.client_register().';
    END IF;
    RETURN v_key;
END
$$;
COMMENT ON FUNCTION pgbroker._client_key(text, bigint, text) IS
    'Internal: the client_key of a client registered in epoch p_epoch, its row locked FOR KEY SHARE; PB010 when unknown.';

-- Client ids as the one-row calls check them, NULL first (22004), then the
-- length (22023); p_what names the argument (client_id, client_ids[3]).
CREATE FUNCTION pgbroker._check_client_id(p_client_id text, p_what text)
RETURNS text
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF p_client_id IS NULL THEN
        RAISE EXCEPTION '% must not be NULL', p_what USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF p_client_id = '' OR pg_catalog.octet_length(p_client_id) > 200 THEN
        RAISE EXCEPTION '% must be 1 to 200 bytes long, got % bytes', p_what, pg_catalog.octet_length(p_client_id)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN p_client_id;
END
$$;
COMMENT ON FUNCTION pgbroker._check_client_id(text, text) IS
    'Internal: validate a client id (22004 when NULL, 22023 unless 1 to 200 bytes); p_what names it in the message.';

-- The arrays of a set-based call, described by array_ndims() and
-- cardinality() (NULL for a NULL array): the first one-dimensional (or empty)
-- and not NULL; the other one, unless absent where that is allowed, of the
-- same length.  22004 for a NULL array, 22023 otherwise.  Returns the length.
CREATE FUNCTION pgbroker._check_arrays(p_what text, p_ndims integer, p_n integer,
                                       p_other_what text, p_other_ndims integer, p_other_n integer,
                                       p_other_optional boolean)
RETURNS integer
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF p_n IS NULL THEN
        RAISE EXCEPTION '% must not be NULL', p_what USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF p_other_n IS NULL AND NOT p_other_optional THEN
        RAISE EXCEPTION '% must not be NULL', p_other_what USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF p_ndims > 1 OR p_other_ndims > 1 THEN
        RAISE EXCEPTION '% must be one-dimensional arrays', concat_ws(' and ', p_what, p_other_what)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_other_n <> p_n THEN
        RAISE EXCEPTION '% has % elements and % has %: they must be of the same length', p_what, p_n, p_other_what, p_other_n
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN p_n;
END
$$;
COMMENT ON FUNCTION pgbroker._check_arrays(text, integer, integer, text, integer, integer, boolean) IS
    'Internal: check the arrays of a set-based call (not NULL, one-dimensional, of the same length); returns the length.';

-- Unregistering needs statements that see what committed before them: the
-- client's subscriptions go with it (400_subscriptions.sql), found by a
-- statement of the delete's trigger.  In a REPEATABLE READ or SERIALIZABLE
-- transaction that statement reads the transaction's snapshot, which hides
-- a subscription committed since; that subscription (and the client's id
-- in the interest) would outlive the client, and a client registered again
-- under the same id would be told of that row.  No lock can reveal a commit
-- that came before it, so those levels are refused (PB011) before anything
-- is changed.  At READ COMMITTED a subscribe either committed before the
-- trigger's statement (which sees it) or still holds the client's row (the
-- delete waits for it, then the trigger's statement sees it).
CREATE FUNCTION pgbroker._check_read_committed(p_call text)
RETURNS void
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION '% needs a READ COMMITTED transaction, not %', p_call, upper(current_setting('transaction_isolation'))
            USING ERRCODE = 'PB011',
                  HINT = 'Call it in a transaction of its own or at READ COMMITTED: this transaction''s snapshot hides the subscriptions made since it began, which would outlive the client.';
    END IF;
END
$$;
COMMENT ON FUNCTION pgbroker._check_read_committed(text) IS
    'Internal: PB011 unless the transaction is READ COMMITTED; p_call names the caller in the message.';

CREATE FUNCTION pgbroker.client_register(client_id text, info jsonb DEFAULT '{}', name text DEFAULT 'default', epoch bigint DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(client_register.name);
    v_epoch bigint := pgbroker._acting_epoch(v_name, client_register.epoch);
    v_inserted boolean;
BEGIN
    PERFORM pgbroker._check_client_id(client_register.client_id, 'client_id');
    INSERT INTO pgbroker.client AS c (name, epoch, client_id, info)
    VALUES (v_name, v_epoch, client_register.client_id, coalesce(client_register.info, '{}'))
    ON CONFLICT ON CONSTRAINT client_id_unique
    DO UPDATE SET info = excluded.info, updated_at = clock_timestamp()
    RETURNING (xmax = 0) INTO v_inserted;
    IF pgbroker._registry_watched(v_name) THEN
        PERFORM pg_notify('pgbroker_registry_' || md5(v_name),
                          pgbroker._registry_client_event(CASE WHEN v_inserted THEN 'register' ELSE 'update' END, v_name,
                                                          v_epoch, client_register.client_id,
                                                          coalesce(client_register.info, '{}')));
    END IF;
    RETURN v_inserted;
END
$$;
COMMENT ON FUNCTION pgbroker.client_register(text, jsonb, text, bigint) IS
$$Holder only: register client CLIENT_ID (1 to 200 bytes) with INFO (address, version...) for lease NAME.
Call it from the holder's session, or from another session passing the holder's current EPOCH.
Returns true when the client is new, false when it was registered already (its info is then replaced).$$;

CREATE FUNCTION pgbroker.client_register_many(client_ids text[], infos jsonb[] DEFAULT NULL, name text DEFAULT 'default',
                                              epoch bigint DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Planned for each call's arrays: a generic plan, made for no size in particular, joined them in loops.
SET plan_cache_mode = force_custom_plan
AS $$
DECLARE
    v_name text := pgbroker._check_name(client_register_many.name);
    v_epoch bigint := pgbroker._acting_epoch(v_name, client_register_many.epoch);
    v_bad integer;
    v_new bigint;
    v_watched boolean;
    v_announced bigint;
BEGIN
    PERFORM pgbroker._check_arrays('client_ids', array_ndims(client_register_many.client_ids),
                                   cardinality(client_register_many.client_ids),
                                   'infos', array_ndims(client_register_many.infos), cardinality(client_register_many.infos),
                                   true);
    -- The first bad id, with the error the one-row call gives, naming its position.
    SELECT min(u.i) INTO v_bad
      FROM unnest(client_register_many.client_ids) WITH ORDINALITY AS u(id, i)
     WHERE u.id IS NULL OR u.id = '' OR octet_length(u.id) > 200;
    IF v_bad IS NOT NULL THEN
        PERFORM pgbroker._check_client_id(client_register_many.client_ids[v_bad], format('client_ids[%s]', v_bad));
    END IF;
    v_watched := pgbroker._registry_watched(v_name);
    -- One statement; an id given twice counts once and keeps its last info,
    -- as one-row calls in that order would leave it.
    -- (Arrays are read with unnest, never subscripted: subscripting an array
    -- of variable-length values costs time in proportion to the position.)
    WITH given AS (
        SELECT DISTINCT ON (u.id) u.id, coalesce(u.info, '{}') AS info
          FROM unnest(client_register_many.client_ids, client_register_many.infos) WITH ORDINALITY AS u(id, info, i)
         ORDER BY u.id, u.i DESC
    ), registered AS (
        INSERT INTO pgbroker.client AS c (name, epoch, client_id, info)
        SELECT v_name, v_epoch, g.id, g.info FROM given g
        ON CONFLICT ON CONSTRAINT client_id_unique
        DO UPDATE SET info = excluded.info, updated_at = clock_timestamp()
        RETURNING c.client_id, c.info, (c.xmax = 0) AS inserted
    )
    -- (A FILTER is tested before its aggregate's argument: nothing is
    -- announced while nobody watches.)
    SELECT count(*) FILTER (WHERE r.inserted),
           sum(num_nulls(pg_notify('pgbroker_registry_' || md5(v_name),
                                   pgbroker._registry_client_event(CASE WHEN r.inserted THEN 'register' ELSE 'update' END,
                                                                   v_name, v_epoch, r.client_id, r.info))))
               FILTER (WHERE v_watched)
      INTO v_new, v_announced
      FROM registered r;
    RETURN v_new;
END
$$;
COMMENT ON FUNCTION pgbroker.client_register_many(text[], jsonb[], text, bigint) IS
$$Holder only: register every client of CLIENT_IDS for lease NAME in one statement, client_ids[i] with info INFOS[i] ('{}' when INFOS or it is NULL); returns how many were new.
As client_register() otherwise: from the holder's session or with the holder's current EPOCH; a client registered already gets its info replaced; an id given twice counts once and keeps its last info.
22004 / 22023 for a NULL, empty or too long id, naming its position (client_ids[3]), or for arrays of different lengths; nothing of the call is kept then.$$;

CREATE FUNCTION pgbroker.client_update(client_id text, info jsonb, name text DEFAULT 'default', epoch bigint DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(client_update.name);
    v_epoch bigint := pgbroker._acting_epoch(v_name, client_update.epoch);
    v_key bigint := pgbroker._client_key(v_name, v_epoch, client_update.client_id);
BEGIN
    UPDATE pgbroker.client SET info = coalesce(client_update.info, '{}'), updated_at = clock_timestamp()
     WHERE client_key = v_key;
    IF pgbroker._registry_watched(v_name) THEN
        PERFORM pg_notify('pgbroker_registry_' || md5(v_name),
                          pgbroker._registry_client_event('update', v_name, v_epoch, client_update.client_id,
                                                          coalesce(client_update.info, '{}')));
    END IF;
END
$$;
COMMENT ON FUNCTION pgbroker.client_update(text, jsonb, text, bigint) IS
    'Holder only: replace the info of registered client CLIENT_ID (PB010 when unknown).';

CREATE FUNCTION pgbroker.client_unregister(client_id text, name text DEFAULT 'default', epoch bigint DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
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
$$;
COMMENT ON FUNCTION pgbroker.client_unregister(text, text, bigint) IS
    'Holder only: unregister client CLIENT_ID and drop all its subscriptions; false when it was not registered. PB011 in a REPEATABLE READ or SERIALIZABLE transaction.';

-- A deploy disconnects every client at once.  Each id is looked up by its
-- unique key (a probe each, never a plan made on the statistics of a table
-- just loaded), and the rows go in one DELETE, whose statement triggers
-- drop their subscriptions and interest (400_subscriptions.sql) and record
-- their departure from the pending notifications (500_outbox.sql) with all
-- the rows in hand: 10,000 clients cost what 10,000 clients own.
CREATE FUNCTION pgbroker.client_unregister_many(client_ids text[], name text DEFAULT 'default', epoch bigint DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
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
$$;
COMMENT ON FUNCTION pgbroker.client_unregister_many(text[], text, bigint) IS
$$Holder only: unregister every client of CLIENT_IDS of lease NAME in one statement, with all their subscriptions; returns how many were registered (ids not registered, or given twice, count once or not at all).
As client_unregister() otherwise: from the holder's session or with the holder's current EPOCH, PB011 in a REPEATABLE READ or SERIALIZABLE transaction. 22004 / 22023 for a NULL array or a NULL, empty or too long id, naming its position (client_ids[3]); nothing of the call is kept then.$$;
