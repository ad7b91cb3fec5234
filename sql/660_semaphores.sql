-- pgbroker: counting semaphores.
--
-- A semaphore NAME with limit L has permits numbered 1..L; each permit is a
-- session-level advisory lock (class 'pgbm', key), the key registered per
-- (name, permit) in pgbroker.semaphore_permit.  A holder's permit is freed by
-- the server the moment its session ends, so a crashed holder's permit comes
-- back at once, with no sweeper.  A caller passing limit L competes for
-- permits 1..L only: holders never outnumber the largest limit in use, and a
-- caller with a smaller limit is granted a permit only while one of its
-- first L is free.
--
-- Waiting.  semaphore_release() sends NOTIFY on semaphore_channel(name).  A
-- client waits without polling by LISTENing on that channel *before* it
-- tries (semaphore_acquire(..., wait => '0')), then waiting for a
-- notification and trying again: a permit released between its failed try
-- and its wait still reaches it, as the notification is queued for it.
-- semaphore_acquire() with a WAIT cannot receive notifications inside one
-- statement: it waits in the lock manager on one held permit at a time, in
-- turn, for at most 100 ms each, trying every permit between two waits.
--
-- Permits registered by a transaction that then rolls back are gone, and
-- their keys are never used again: as for named locks (650_locks.sql), a
-- permit registered by the open transaction is held for the transaction and
-- turned into a session lock when it commits.

CREATE FUNCTION pgbroker._lock_class_permit()
RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1885823597 $$;
COMMENT ON FUNCTION pgbroker._lock_class_permit() IS
    'Internal: ''pgbm''; (class, semaphore_permit.key) is the session-level advisory lock of a semaphore permit.';

CREATE TABLE pgbroker.semaphore_permit (
    name text NOT NULL,
    permit integer NOT NULL,
    key integer GENERATED ALWAYS AS IDENTITY CONSTRAINT semaphore_permit_key_unique UNIQUE,
    registered_xid xid8 NOT NULL DEFAULT pg_catalog.pg_current_xact_id(),
    pending integer NOT NULL DEFAULT 0,
    retired_xid xid8,
    PRIMARY KEY (name, permit)
);
COMMENT ON TABLE pgbroker.semaphore_permit IS
    'The permits of each semaphore and their advisory lock keys, registered at first use. Internal: read the view pgbroker.semaphores.';
COMMENT ON COLUMN pgbroker.semaphore_permit.name IS 'The semaphore name, verbatim (1 to 200 bytes).';
COMMENT ON COLUMN pgbroker.semaphore_permit.permit IS 'Permit number, 1 to the largest limit used with this name.';
COMMENT ON COLUMN pgbroker.semaphore_permit.key IS 'Second key of the permit''s advisory lock (the first is 1885823597, ''pgbm'').';
COMMENT ON COLUMN pgbroker.semaphore_permit.registered_xid IS 'Internal: the transaction that registered the permit.';
COMMENT ON COLUMN pgbroker.semaphore_permit.pending IS 'Internal: holds taken by the registering transaction, made session locks at its commit.';
COMMENT ON COLUMN pgbroker.semaphore_permit.retired_xid IS 'Internal: the maintain() transaction that found the semaphore idle (NULL: in use); a later maintain() deletes its permits once no older snapshot is left and they are still free. Using the semaphore clears it.';

CREATE FUNCTION pgbroker._semaphore_permit_commit()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- This transaction holds the transaction-level lock: this succeeds at once.
    FOR i IN 1 .. coalesce((SELECT p.pending FROM pgbroker.semaphore_permit p WHERE p.key = NEW.key), 0) LOOP
        PERFORM pg_advisory_lock(pgbroker._lock_class_permit(), NEW.key);
    END LOOP;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pgbroker._semaphore_permit_commit() IS
    'Internal deferred trigger: when the transaction that registered a permit commits, turn its pending holds into session locks.';

CREATE CONSTRAINT TRIGGER _660_permit_at_commit
    AFTER INSERT ON pgbroker.semaphore_permit
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION pgbroker._semaphore_permit_commit();
COMMENT ON TRIGGER _660_permit_at_commit ON pgbroker.semaphore_permit IS
    'Takes the permits that the registering transaction acquired, when it commits (none if it rolls back).';

-- Try permits 1..cardinality(p_keys) once; the permit number taken, or NULL.
CREATE FUNCTION pgbroker._semaphore_try(p_keys integer[], p_own boolean[])
RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    FOR i IN 1 .. cardinality(p_keys) LOOP
        IF p_own[i] THEN
            -- Registered by this open transaction (see above).
            IF pg_try_advisory_xact_lock(pgbroker._lock_class_permit(), p_keys[i]) THEN
                UPDATE pgbroker.semaphore_permit SET pending = pending + 1 WHERE key = p_keys[i];
                RETURN i;
            END IF;
        ELSIF pg_try_advisory_lock(pgbroker._lock_class_permit(), p_keys[i]) THEN
            RETURN i;
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pgbroker._semaphore_try(integer[], boolean[]) IS
    'Internal: try each permit once (p_own: registered by this open transaction); the permit number taken, or NULL.';

-- The lock keys of permits 1..p_limit of semaphore p_name, registering the
-- missing ones (waiting at most p_wait for a concurrent registration; NULL
-- when that ran out).
CREATE FUNCTION pgbroker._semaphore_keys(p_name text, p_limit integer, p_wait interval)
RETURNS integer[]
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_keys integer[];
    v_retired boolean;
    v_timeout text;
BEGIN
    SELECT array_agg(key ORDER BY permit), bool_or(retired_xid IS NOT NULL) INTO v_keys, v_retired
      FROM pgbroker.semaphore_permit WHERE name = p_name AND permit <= p_limit;
    IF cardinality(v_keys) = p_limit AND NOT v_retired THEN
        RETURN v_keys;
    END IF;
    -- A timed wait for rows, as in _lock_key (650_locks.sql): what it was
    -- granted is undone with the block when it runs out.
    v_timeout := current_setting('lock_timeout');
    BEGIN
        PERFORM set_config('lock_timeout', pgbroker._wait_ms(p_wait), true);
        IF v_retired THEN
            -- Found idle by maintain(): in use again (waits for a maintain()
            -- deleting the permits; they are then registered afresh below).
            UPDATE pgbroker.semaphore_permit SET retired_xid = NULL WHERE name = p_name AND retired_xid IS NOT NULL;
        END IF;
        INSERT INTO pgbroker.semaphore_permit (name, permit)
        SELECT p_name, g FROM generate_series(1, p_limit) AS g
        ON CONFLICT (name, permit) DO NOTHING;
        PERFORM set_config('lock_timeout', v_timeout, true);
    EXCEPTION WHEN lock_not_available THEN
        PERFORM set_config('lock_timeout', v_timeout, true);
        RETURN NULL;
    END;
    SELECT array_agg(key ORDER BY permit) INTO v_keys
      FROM pgbroker.semaphore_permit WHERE name = p_name AND permit <= p_limit;
    RETURN v_keys;
END
$$;
COMMENT ON FUNCTION pgbroker._semaphore_keys(text, integer, interval) IS
    'Internal: the advisory lock keys of permits 1..p_limit of semaphore p_name, registered at first use or marked in use again after maintain() found them idle (NULL when a concurrent registration outlasted p_wait).';

-- The channel is named after a digest of the name: stable before the first
-- acquire, at most 63 bytes whatever the name; two names that shared a digest
-- would only wake each other's waiters for nothing.
CREATE FUNCTION pgbroker.semaphore_channel(name text)
RETURNS text
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT pgbroker._name_check('semaphore', pgbroker._check_key(semaphore_channel.name, 'semaphore name'), false);
    SELECT 'pgbroker_semaphore_' || md5(semaphore_channel.name);
$$;
COMMENT ON FUNCTION pgbroker.semaphore_channel(text) IS
    'The channel semaphore_release(NAME) notifies (payload: the permit number): LISTEN on it before trying semaphore_acquire(NAME, limit, ''0''), then wait for a notification and try again.';

CREATE FUNCTION pgbroker.semaphore_acquire(name text, "limit" integer, wait interval DEFAULT '0')
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := semaphore_acquire.name;
    v_keys integer[];
    v_mine boolean;
    v_retired boolean;
    v_own boolean[];
    v_got integer;
    v_deadline timestamptz;
    v_watch integer;
BEGIN
    -- The hot path: checks inline, one registry query, the tries inline (no
    -- helper calls, each of which would set the search_path again).
    IF v_name IS NULL OR v_name = '' OR octet_length(v_name) > 200 THEN
        PERFORM pgbroker._check_key(v_name, 'semaphore name');   -- 22023 with its message
    END IF;
    IF semaphore_acquire.wait < '0'::interval THEN
        PERFORM pgbroker._wait_ms(semaphore_acquire.wait);   -- 22023 with its message
    END IF;
    PERFORM pgbroker._name_check('semaphore', v_name, true);
    IF semaphore_acquire."limit" IS NULL OR semaphore_acquire."limit" < 1 OR semaphore_acquire."limit" > 1000 THEN
        RAISE EXCEPTION 'semaphore limit must be 1 to 1000, got %', coalesce(semaphore_acquire."limit"::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT array_agg(p.key ORDER BY p.permit), bool_or(p.registered_xid = pg_current_xact_id_if_assigned()),
           bool_or(p.retired_xid IS NOT NULL)
      INTO v_keys, v_mine, v_retired
      FROM pgbroker.semaphore_permit p WHERE p.name = v_name AND p.permit <= semaphore_acquire."limit";
    IF cardinality(v_keys) IS DISTINCT FROM semaphore_acquire."limit" OR v_retired THEN
        -- First use of (some of) these permits: register them (or mark them
        -- in use again after maintain() found them idle).
        v_keys := pgbroker._semaphore_keys(v_name, semaphore_acquire."limit", semaphore_acquire.wait);
        IF v_keys IS NULL THEN
            RETURN NULL;
        END IF;
        v_mine := true;   -- maybe: look below
    END IF;
    IF v_mine THEN
        -- Some permits registered by this open transaction (see above).
        SELECT array_agg(p.registered_xid IS NOT DISTINCT FROM pg_current_xact_id_if_assigned() ORDER BY p.permit)
          INTO v_own
          FROM pgbroker.semaphore_permit p WHERE p.name = v_name AND p.permit <= semaphore_acquire."limit";
        v_got := pgbroker._semaphore_try(v_keys, v_own);
    ELSE
        v_own := array_fill(false, ARRAY[semaphore_acquire."limit"]);
        FOR i IN 1 .. semaphore_acquire."limit" LOOP
            IF pg_try_advisory_lock(pgbroker._lock_class_permit(), v_keys[i]) THEN
                RETURN i;
            END IF;
        END LOOP;
    END IF;
    IF v_got IS NOT NULL OR semaphore_acquire.wait = '0'::interval THEN
        RETURN v_got;
    END IF;
    v_deadline := clock_timestamp() + semaphore_acquire.wait;   -- NULL: no deadline
    v_watch := pg_backend_pid() % semaphore_acquire."limit";
    LOOP
        EXIT WHEN clock_timestamp() >= v_deadline;
        v_watch := v_watch % semaphore_acquire."limit" + 1;
        -- Every try failed, so this session holds none of the permits: a
        -- permit granted just as the slice runs out is counted, and kept
        -- (_advisory_wait, 100_lease.sql); an error during the wait leaves
        -- no permit behind.
        IF pgbroker._advisory_wait(pgbroker._lock_class_permit(), v_keys[v_watch], false, false,
                                   greatest(least(coalesce(v_deadline - clock_timestamp(), '100 ms'), '100 ms'),
                                            '0'::interval)) THEN
            RETURN v_watch;
        END IF;
        v_got := pgbroker._semaphore_try(v_keys, v_own);
        IF v_got IS NOT NULL THEN
            RETURN v_got;
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pgbroker.semaphore_acquire(text, integer, interval) IS
$$Take a permit of semaphore NAME, of which at most LIMIT (1 to 1000) are handed out, and return its number (1..LIMIT); NULL when WAIT ran out.
Session scope: held until semaphore_release(NAME) or the session ends (a crashed holder's permit is free at once).
WAIT: '0' (the default) tries once and never blocks; an interval waits up to that long; NULL waits as long as it takes; negative: 22023.
Callers passing different limits: a caller with limit L competes for permits 1..L only. No order among waiters.
To be woken at once by a release, LISTEN on semaphore_channel(NAME) and retry with WAIT '0' on each notification (sql/README.md, "Semaphores").$$;

CREATE FUNCTION pgbroker.semaphore_release(name text)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET client_min_messages = error   -- pg_advisory_unlock warns when the lock is not held: we return false instead
AS $$
DECLARE
    v_name text := semaphore_release.name;
    v_permit pgbroker.semaphore_permit;
    v_keys integer[];
    v_permits integer[];
    v_mine boolean;
BEGIN
    IF v_name IS NULL OR v_name = '' OR octet_length(v_name) > 200 THEN
        PERFORM pgbroker._check_key(v_name, 'semaphore name');   -- 22023 with its message
    END IF;
    -- The highest permit this session holds, so that low numbers stay in use.
    SELECT array_agg(p.key ORDER BY p.permit DESC), array_agg(p.permit ORDER BY p.permit DESC),
           bool_or(p.registered_xid = pg_current_xact_id_if_assigned())
      INTO v_keys, v_permits, v_mine
      FROM pgbroker.semaphore_permit p WHERE p.name = v_name;
    IF NOT v_mine THEN
        -- The hot path: no permit registered by this open transaction.
        FOR i IN 1 .. cardinality(v_keys) LOOP
            IF pg_advisory_unlock(pgbroker._lock_class_permit(), v_keys[i]) THEN
                -- semaphore_channel(v_name), without its call, settings frame and name check
                -- (giving back needs no grant)
                PERFORM pg_notify('pgbroker_semaphore_' || md5(v_name), v_permits[i]::text);
                RETURN true;
            END IF;
        END LOOP;
        RETURN false;
    END IF;
    FOR v_permit IN SELECT * FROM pgbroker.semaphore_permit p WHERE p.name = v_name ORDER BY p.permit DESC LOOP
        IF v_permit.registered_xid = pg_current_xact_id_if_assigned() THEN
            -- Registered by this open transaction: give back a pending hold.
            IF v_permit.pending > 0 THEN
                UPDATE pgbroker.semaphore_permit SET pending = pending - 1 WHERE key = v_permit.key;
                RETURN true;
            END IF;
        ELSIF pg_advisory_unlock(pgbroker._lock_class_permit(), v_permit.key) THEN
            PERFORM pg_notify('pgbroker_semaphore_' || md5(v_name), v_permit.permit::text);   -- as above
            RETURN true;
        END IF;
    END LOOP;
    RETURN false;
END
$$;
COMMENT ON FUNCTION pgbroker.semaphore_release(text) IS
    'Give back a permit of semaphore NAME held by this session (its highest-numbered one) and NOTIFY semaphore_channel(NAME); false, changing nothing, when it holds none.';

-- Forgetting idle semaphores (maintain()): as for lock names (650_locks.sql,
-- "Forgetting idle names"), in two passes, a semaphore's permits together:
-- retired when none is held nor waited for, deleted in a later pass once no
-- snapshot older than the retiring transaction is left, when a momentary try
-- gets every one of them.  No client caches permit keys.
CREATE FUNCTION pgbroker._semaphore_names_upkeep(p_max integer, OUT removed bigint, OUT remaining bigint)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_db oid := (SELECT oid FROM pg_database WHERE datname = current_database());
    v_horizon xid8 := pgbroker._xid_horizon();
    v_own integer[];
    v_name text;
    v_keys integer[];
    v_got integer;
    v_done bigint;
BEGIN
    removed := 0;
    v_own := ARRAY(SELECT l.objid::integer FROM pg_locks l
                    WHERE l.locktype = 'advisory' AND l.database = v_db AND l.classid = 1885823597::oid
                      AND l.objsubid = 2 AND l.pid = pg_backend_pid());
    -- 2. Delete retired semaphores nobody can use a permit key of any more.
    FOR v_name IN SELECT DISTINCT p.name FROM pgbroker.semaphore_permit p
                   WHERE p.retired_xid < v_horizon LIMIT greatest(p_max / 4, 1) LOOP
        v_keys := ARRAY(SELECT p.key FROM pgbroker.semaphore_permit p
                         WHERE p.name = v_name AND p.retired_xid < v_horizon FOR UPDATE SKIP LOCKED);
        -- Every permit of the name, each still retired (else: in use again).
        CONTINUE WHEN cardinality(v_keys) IS DISTINCT FROM
                      (SELECT count(*) FROM pgbroker.semaphore_permit p WHERE p.name = v_name)
                      OR v_keys && v_own;
        v_got := 0;
        FOR i IN 1 .. cardinality(v_keys) LOOP
            EXIT WHEN NOT pg_try_advisory_lock(1885823597, v_keys[i]);
            v_got := i;
        END LOOP;
        FOR i IN 1 .. v_got LOOP
            PERFORM pg_advisory_unlock(1885823597, v_keys[i]);
        END LOOP;
        CONTINUE WHEN v_got < cardinality(v_keys);
        DELETE FROM pgbroker.semaphore_permit p WHERE p.key = ANY (v_keys);
        GET DIAGNOSTICS v_done = ROW_COUNT;
        removed := removed + v_done;
    END LOOP;
    -- 1. Retire semaphores none of whose permits is held nor waited for.
    UPDATE pgbroker.semaphore_permit p SET retired_xid = pg_current_xact_id()
     WHERE p.name IN (SELECT x.name FROM pgbroker.semaphore_permit x
                       WHERE x.retired_xid IS NULL
                       GROUP BY x.name
                      HAVING bool_and(x.key::oid NOT IN (SELECT l.objid FROM pg_locks l
                                                              WHERE l.locktype = 'advisory' AND l.database = v_db
                                                                AND l.classid = 1885823597::oid AND l.objsubid = 2))
                       LIMIT greatest(p_max / 4, 1))
       AND p.retired_xid IS NULL;
    SELECT count(*) INTO remaining
      FROM (SELECT FROM pgbroker.semaphore_permit p WHERE p.retired_xid IS NOT NULL LIMIT p_max) x;
END
$$;
COMMENT ON FUNCTION pgbroker._semaphore_names_upkeep(integer) IS
    'Internal (maintain()): delete the permits of semaphores retired by an earlier pass that nobody can use any more, and retire semaphores none of whose permits is held nor waited for (about P_MAX / 4 semaphores each); REMOVED permits deleted, REMAINING retired permits left (at most P_MAX counted).';
