-- pgbroker: named locks.
--
-- A named lock is a PostgreSQL advisory lock in the two-int4 form
-- (class 'pgbl', key), where key is the name's number in pgbroker.lock_name:
-- names are registered, never hashed, so two names never share a lock, and
-- the two-int4 form never meets other code's single-bigint advisory locks
-- (nor the lease's class 'pgbr').  Session-scoped locks die with their
-- session (crash-safe); transaction-scoped ones end with the transaction and
-- work through a pooler in transaction mode.  Locks stack as PostgreSQL's
-- advisory locks do: a session that acquires a lock twice holds it until it
-- has released it twice.
--
-- A name registered by a transaction that then rolls back is gone, and its
-- key is never used again (identity values are not given back); a session
-- lock on that key would name nothing, while another session registers the
-- name afresh with a new key and takes it too.  So while the registering
-- transaction is open, session-scope acquires of that name take a
-- transaction-level lock and count the holds in the row; a deferred trigger
-- turns them into session locks when the transaction commits.

CREATE FUNCTION pgbroker._lock_class_lock()
RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1885823596 $$;
COMMENT ON FUNCTION pgbroker._lock_class_lock() IS
    'Internal: ''pgbl''; (class, lock_name.key) is the advisory lock of a named lock.';

CREATE TABLE pgbroker.lock_name (
    name text PRIMARY KEY,
    key integer GENERATED ALWAYS AS IDENTITY CONSTRAINT lock_name_key_unique UNIQUE,
    created_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    registered_xid xid8 NOT NULL DEFAULT pg_catalog.pg_current_xact_id(),
    pending_exclusive integer NOT NULL DEFAULT 0,
    pending_shared integer NOT NULL DEFAULT 0,
    retired_xid xid8
);
COMMENT ON TABLE pgbroker.lock_name IS
    'Names of named locks and their advisory lock keys, registered at first use. Internal: read the view pgbroker.locks.';
COMMENT ON COLUMN pgbroker.lock_name.name IS 'The lock name, verbatim (1 to 200 bytes).';
COMMENT ON COLUMN pgbroker.lock_name.key IS 'Second key of its advisory lock (the first is 1885823596, ''pgbl'').';
COMMENT ON COLUMN pgbroker.lock_name.created_at IS 'When the name was first used.';
COMMENT ON COLUMN pgbroker.lock_name.registered_xid IS 'Internal: the transaction that registered the name.';
COMMENT ON COLUMN pgbroker.lock_name.pending_exclusive IS 'Internal: exclusive session holds taken by the registering transaction, made session locks at its commit.';
COMMENT ON COLUMN pgbroker.lock_name.pending_shared IS 'Internal: shared session holds taken by the registering transaction, made session locks at its commit.';
COMMENT ON COLUMN pgbroker.lock_name.retired_xid IS 'Internal: the maintain() transaction that found the name idle (NULL: in use); a later maintain() deletes the row once no snapshot older than that transaction is left and the lock is still free. Using the name clears it.';

CREATE FUNCTION pgbroker._lock_name_commit()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_row pgbroker.lock_name;
BEGIN
    SELECT * INTO v_row FROM pgbroker.lock_name WHERE key = NEW.key;
    -- This transaction holds the transaction-level locks: these succeed at once.
    FOR i IN 1 .. coalesce(v_row.pending_exclusive, 0) LOOP
        PERFORM pg_advisory_lock(pgbroker._lock_class_lock(), v_row.key);
    END LOOP;
    FOR i IN 1 .. coalesce(v_row.pending_shared, 0) LOOP
        PERFORM pg_advisory_lock_shared(pgbroker._lock_class_lock(), v_row.key);
    END LOOP;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pgbroker._lock_name_commit() IS
    'Internal deferred trigger: when the transaction that registered a lock name commits, turn its pending session holds into session locks.';

CREATE CONSTRAINT TRIGGER _650_lock_at_commit
    AFTER INSERT ON pgbroker.lock_name
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION pgbroker._lock_name_commit();
COMMENT ON TRIGGER _650_lock_at_commit ON pgbroker.lock_name IS
    'Takes the session locks that the registering transaction acquired, when it commits (none if it rolls back).';

-- Names and keys of the primitives: 1 to 200 bytes of any text.  No SET
-- clause: only SECURITY DEFINER functions with a pinned search_path call it,
-- and a SET clause costs a settings frame per call (measured on the lock
-- cycle); every name in it is qualified.
CREATE FUNCTION pgbroker._check_key(p_value text, p_what text)
RETURNS text
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF p_value IS NULL OR p_value = '' OR pg_catalog.octet_length(p_value) > 200 THEN
        RAISE EXCEPTION '% must be 1 to 200 bytes, got %', p_what,
                        CASE WHEN p_value IS NULL THEN 'NULL' ELSE pg_catalog.octet_length(p_value) || ' bytes' END
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN p_value;
END
$$;
COMMENT ON FUNCTION pgbroker._check_key(text, text) IS
    'Internal: validate the name of a lock, semaphore or counter, or a key of the key-value store (22023 unless 1 to 200 bytes).';

-- The lock key of a name, registering it at first use.  The registration is
-- a row insert: while another session's open transaction registers the same
-- name, the insert waits for that transaction, at most p_wait (1 ms for
-- '0'); NULL when that ran out (the caller then reports "not acquired").
CREATE FUNCTION pgbroker._lock_key(p_name text, p_wait interval)
RETURNS pgbroker.lock_name
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_row pgbroker.lock_name;
    v_key integer;
    v_timeout text;
BEGIN
    SELECT * INTO v_row FROM pgbroker.lock_name WHERE name = p_name;
    IF FOUND AND v_row.retired_xid IS NULL THEN
        RETURN v_row;
    END IF;
    -- A timed wait for a row (its registering transaction, or maintain()).  A
    -- grant just as it runs out is undone with the block, and the caller
    -- says "not acquired": the registering transaction holds the name's lock
    -- until it ends (a maintain() forgetting the name does not: then the
    -- name was busy without a holder, for that moment; sql/README.md).
    v_timeout := current_setting('lock_timeout');
    BEGIN
        PERFORM set_config('lock_timeout', pgbroker._wait_ms(p_wait), true);
        IF v_row.key IS NOT NULL THEN
            -- Found idle by maintain(): in use again.  This waits for a
            -- maintain() deleting the row (then nothing is updated, and the
            -- name is registered afresh below, with a new key).
            UPDATE pgbroker.lock_name SET retired_xid = NULL WHERE key = v_row.key AND retired_xid IS NOT NULL;
        END IF;
        INSERT INTO pgbroker.lock_name (name) VALUES (p_name) ON CONFLICT (name) DO NOTHING RETURNING key INTO v_key;
        PERFORM set_config('lock_timeout', v_timeout, true);
    EXCEPTION WHEN lock_not_available THEN
        PERFORM set_config('lock_timeout', v_timeout, true);
        RETURN NULL;
    END;
    SELECT * INTO v_row FROM pgbroker.lock_name WHERE name = p_name;
    RETURN v_row;
END
$$;
COMMENT ON FUNCTION pgbroker._lock_key(text, interval) IS
    'Internal: the registry row (advisory lock key) of name p_name, registered at first use or marked in use again after maintain() found it idle (waiting at most p_wait for a concurrent registration; NULL when that ran out).';

CREATE FUNCTION pgbroker.lock_acquire(name text, wait interval DEFAULT NULL, shared boolean DEFAULT false,
                                      xact boolean DEFAULT false)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := lock_acquire.name;
    v_key integer;
    v_registered xid8;
    v_retired boolean;
    v_row pgbroker.lock_name;
BEGIN
    -- The hot path: checks inline, one index probe, the lock.
    IF v_name IS NULL OR v_name = '' OR octet_length(v_name) > 200 THEN
        PERFORM pgbroker._check_key(v_name, 'lock name');   -- 22023 with its message
    END IF;
    PERFORM pgbroker._name_check('lock', v_name, true);
    IF lock_acquire.shared IS NULL OR lock_acquire.xact IS NULL THEN
        RAISE EXCEPTION 'shared and xact must not be NULL' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF lock_acquire.wait < '0'::interval THEN
        PERFORM pgbroker._wait_ms(lock_acquire.wait);   -- 22023 with its message
    END IF;
    -- The registry row; registered at first use only, or marked in use again
    -- after maintain() found it idle (few calls pay for that).
    SELECT l.key, l.registered_xid, l.retired_xid IS NOT NULL INTO v_key, v_registered, v_retired
      FROM pgbroker.lock_name l WHERE l.name = v_name;
    IF NOT FOUND OR v_retired THEN
        v_row := pgbroker._lock_key(v_name, lock_acquire.wait);
        v_key := v_row.key;
        v_registered := v_row.registered_xid;
    END IF;
    IF v_key IS NULL THEN
        RETURN false;
    END IF;
    IF NOT lock_acquire.xact AND v_registered = pg_current_xact_id_if_assigned() THEN
        -- Registered by this open transaction: nobody else can see the name
        -- yet.  Hold it for the transaction and take the session lock at
        -- commit (see _lock_name_commit), so a rollback leaves no lock behind.
        IF lock_acquire.shared THEN
            PERFORM pg_advisory_xact_lock_shared(pgbroker._lock_class_lock(), v_key);
            UPDATE pgbroker.lock_name SET pending_shared = pending_shared + 1 WHERE key = v_key;
        ELSE
            PERFORM pg_advisory_xact_lock(pgbroker._lock_class_lock(), v_key);
            UPDATE pgbroker.lock_name SET pending_exclusive = pending_exclusive + 1 WHERE key = v_key;
        END IF;
        RETURN true;
    END IF;
    -- Try first: the common case (the lock is free, or this session holds it
    -- in this mode already) takes no subtransaction.
    IF (CASE WHEN lock_acquire.xact AND lock_acquire.shared THEN pg_try_advisory_xact_lock_shared(pgbroker._lock_class_lock(), v_key)
             WHEN lock_acquire.xact THEN pg_try_advisory_xact_lock(pgbroker._lock_class_lock(), v_key)
             WHEN lock_acquire.shared THEN pg_try_advisory_lock_shared(pgbroker._lock_class_lock(), v_key)
             ELSE pg_try_advisory_lock(pgbroker._lock_class_lock(), v_key) END) THEN
        RETURN true;
    END IF;
    IF lock_acquire.wait = '0'::interval THEN
        RETURN false;
    END IF;
    -- Wait (NULL: as long as it takes, whatever the session's lock_timeout).
    -- A lock granted just as the wait runs out counts as acquired, and is
    -- held; an error during the wait leaves no hold behind (_advisory_wait,
    -- 100_lease.sql).  So true means held, and false that another session
    -- held the lock while this call waited, which changed nothing.
    RETURN pgbroker._advisory_wait(pgbroker._lock_class_lock(), v_key, lock_acquire.shared, lock_acquire.xact,
                                   lock_acquire.wait);
END
$$;
COMMENT ON FUNCTION pgbroker.lock_acquire(text, interval, boolean, boolean) IS
$$Acquire the named lock NAME (1 to 200 bytes, any text; 22023 otherwise): exclusive, or shared with SHARED => true.
WAIT: '0' tries once and never blocks; an interval waits up to that long; NULL (the default) waits as long as it takes; negative: 22023.
Returns true when acquired, false when WAIT ran out (a name first used inside another session's open transaction counts as busy until that transaction ends).
Session scope by default: held until lock_release() or the session ends (a crashed holder's lock is freed at once).
XACT => true: released at commit or rollback (works through a pooler in transaction mode).
Locks stack as PostgreSQL advisory locks do: acquired twice, held until released twice.$$;

CREATE FUNCTION pgbroker.lock_release(name text, shared boolean DEFAULT false)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET client_min_messages = error   -- pg_advisory_unlock warns when the lock is not held: we return false instead
AS $$
DECLARE
    v_name text := lock_release.name;
    v_key integer;
    v_registered xid8;
BEGIN
    IF v_name IS NULL OR v_name = '' OR octet_length(v_name) > 200 THEN
        PERFORM pgbroker._check_key(v_name, 'lock name');   -- 22023 with its message
    END IF;
    IF lock_release.shared IS NULL THEN
        RAISE EXCEPTION 'shared must not be NULL' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT l.key, l.registered_xid INTO v_key, v_registered FROM pgbroker.lock_name l WHERE l.name = v_name;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF v_registered = pg_current_xact_id_if_assigned() THEN
        -- Registered by this open transaction: give back a pending hold.
        IF lock_release.shared THEN
            UPDATE pgbroker.lock_name SET pending_shared = pending_shared - 1 WHERE key = v_key AND pending_shared > 0;
        ELSE
            UPDATE pgbroker.lock_name SET pending_exclusive = pending_exclusive - 1 WHERE key = v_key AND pending_exclusive > 0;
        END IF;
        RETURN FOUND;
    END IF;
    RETURN CASE WHEN lock_release.shared THEN pg_advisory_unlock_shared(pgbroker._lock_class_lock(), v_key)
                ELSE pg_advisory_unlock(pgbroker._lock_class_lock(), v_key) END;
END
$$;
COMMENT ON FUNCTION pgbroker.lock_release(text, boolean) IS
$$Release one hold of the session-scoped lock NAME (shared when SHARED => true). Returns false, changing nothing, when this session does not hold it that way.
Transaction-scoped locks cannot be released early: they end with their transaction (false here).$$;

-- The key of a name without registering it.  Only keys of committed
-- registrations: a key registered by the caller's open transaction may still
-- be rolled back (and then never name anything), so it is not handed out.
-- Clients cache it (the Python Lock does, per connection) and take
-- pg_advisory_lock(1885823596, key) directly, the same lock lock_acquire()
-- takes, while pgbroker.name_grants_version is unchanged: maintain() bumps it
-- when it finds names idle, before it may delete their rows (see "Forgetting
-- idle names" below).  A name found idle has no key to hand out (NULL) until
-- lock_acquire() uses it again.
CREATE FUNCTION pgbroker.lock_key(name text)
RETURNS integer
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT pgbroker._name_check('lock', pgbroker._check_key(lock_key.name, 'lock name'), true);
    SELECT l.key FROM pgbroker.lock_name l
     WHERE l.name = lock_key.name AND l.retired_xid IS NULL
       AND l.registered_xid IS DISTINCT FROM pg_current_xact_id_if_assigned();
$$;
COMMENT ON FUNCTION pgbroker.lock_key(text) IS
$$The advisory lock of named lock NAME is (1885823596, lock_key(NAME)) in the two-int4 form: the same lock lock_acquire(NAME) takes, for pg_locks or for a client that caches the key.
NULL when NAME was never used (it is registered by its first lock_acquire), when the caller's open transaction registered it (a rollback would void that key), or when maintain() found it idle (lock_acquire uses it again).
A name keeps its key while it is in use; a cached key is valid while pgbroker.name_grants_version is unchanged (maintain() changes it before it forgets a name, which then gets a new key at its next use; keys are never reused).$$;

-- Forgetting idle names (maintain(), 720_maintain.sql).  A name nobody holds
-- nor waits for costs a row for ever unless something deletes it, and a
-- deleted name registered again gets a new key: a session still using the
-- old key (a cached key, or a key read just before the deletion) would then
-- hold "the same name" as a session using the new one.  So forgetting takes
-- two passes of maintain(), and the row goes only when nobody can use its
-- key any more:
--   1. retire: names whose lock nobody holds nor waits for (pg_locks) get
--      retired_xid = the pass's transaction, and name_grant_version is
--      bumped in the same transaction: from its commit on, a cached key is
--      not used (the Python Lock compares that version in the same statement
--      that takes the lock), lock_key() hands out no key for the name, and
--      lock_acquire() clears retired_xid (an UPDATE) before it takes the lock.
--   2. delete, in a later pass: a retired row whose retiring transaction is
--      older than every snapshot still in use (pg_stat_activity's
--      backend_xmin and backend_xid: whoever read the row before it was
--      retired has finished that statement or transaction), locked FOR UPDATE
--      SKIP LOCKED (a lock_acquire clearing it meanwhile wins: its UPDATE
--      holds the row, or waits for the deletion and then registers afresh),
--      and whose advisory lock a momentary try gets (nobody holds it: a
--      holder keeps its name).  Keys of this session's own locks are skipped
--      (a try would succeed on them).
-- A name in use keeps its key; an idle name costs nothing after two passes;
-- identity values are never given back, so no two names ever share a key.

-- The oldest transaction id whose effects some snapshot in use may not see:
-- a row changed by a committed transaction older than this is seen changed
-- by every session.  Conservative (every backend of the cluster counts).
CREATE FUNCTION pgbroker._xid_horizon()
RETURNS xid8
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT (pg_current_xact_id()::text::numeric
            - coalesce((SELECT max(greatest(age(a.backend_xmin), age(a.backend_xid)))
                          FROM pg_stat_activity a
                         WHERE a.pid <> pg_backend_pid()
                           AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)), 0))::text::xid8
$$;
COMMENT ON FUNCTION pgbroker._xid_horizon() IS
    'Internal: the oldest transaction id some other session''s snapshot or transaction may still need; a change committed by an older transaction is seen by everyone.';

CREATE FUNCTION pgbroker._lock_names_upkeep(p_max integer, OUT removed bigint, OUT remaining bigint)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_db oid := (SELECT oid FROM pg_database WHERE datname = current_database());
    v_horizon xid8 := pgbroker._xid_horizon();
    v_own integer[];
    v_keys integer[];
    v_gone integer[] := '{}';
    v_retired bigint;
BEGIN
    -- This session's own locks: a try would succeed on them.
    v_own := ARRAY(SELECT l.objid::integer FROM pg_locks l
                    WHERE l.locktype = 'advisory' AND l.database = v_db AND l.classid = 1885823596::oid
                      AND l.objsubid = 2 AND l.pid = pg_backend_pid());
    -- 2. Delete retired names nobody can use the key of any more.
    v_keys := ARRAY(SELECT n.key FROM pgbroker.lock_name n
                     WHERE n.retired_xid < v_horizon AND n.key <> ALL (v_own)
                     LIMIT p_max FOR UPDATE SKIP LOCKED);
    FOR i IN 1 .. coalesce(cardinality(v_keys), 0) LOOP
        IF pg_try_advisory_lock(1885823596, v_keys[i]) THEN
            PERFORM pg_advisory_unlock(1885823596, v_keys[i]);
            v_gone := v_gone || v_keys[i];
        END IF;
    END LOOP;
    DELETE FROM pgbroker.lock_name n WHERE n.key = ANY (v_gone);
    GET DIAGNOSTICS removed = ROW_COUNT;
    -- 1. Retire names whose lock nobody holds nor waits for.
    UPDATE pgbroker.lock_name n SET retired_xid = pg_current_xact_id()
     WHERE n.ctid = ANY (ARRAY(
               SELECT x.ctid FROM pgbroker.lock_name x
                WHERE x.retired_xid IS NULL   -- (pending holds count only while the registering transaction is open)
                  AND x.key::oid NOT IN (SELECT l.objid FROM pg_locks l
                                          WHERE l.locktype = 'advisory' AND l.database = v_db
                                            AND l.classid = 1885823596::oid AND l.objsubid = 2)
                LIMIT p_max FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS v_retired = ROW_COUNT;
    IF v_retired > 0 THEN
        -- Cached keys step aside from this commit on (see above).
        UPDATE pgbroker.name_grant_version SET version = version + 1;
    END IF;
    -- Left: names retired and not yet deleted (a bounded count).
    SELECT count(*) INTO remaining
      FROM (SELECT FROM pgbroker.lock_name n WHERE n.retired_xid IS NOT NULL LIMIT p_max) x;
END
$$;
COMMENT ON FUNCTION pgbroker._lock_names_upkeep(integer) IS
    'Internal (maintain()): delete up to P_MAX lock names retired by an earlier pass that nobody can use any more, and retire up to P_MAX names nobody holds nor waits for; REMOVED deleted, REMAINING retired names left (at most P_MAX counted).';
