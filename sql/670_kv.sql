-- pgbroker: a key-value store with versions, compare-and-set, expiry and watches.
--
-- Values are jsonb.  Every change (set or delete) takes a new version from
-- one sequence, so a key's version grows on every change, also across a
-- delete and a new set.  kv_set with a VERSION is a compare-and-set in one
-- statement: it writes only when the key's current version equals VERSION
-- (0: the key must not exist).  An expired key reads as absent.  While a
-- watcher is registered (kv_watch_begin), every change is announced with
-- NOTIFY on the channel 'pgbroker_kv', payload {"key": ..., "version": ...}
-- ("deleted": true for a delete), at commit.
--
-- Announcing only while someone watches.  A NOTIFY costs every writer a
-- cluster-wide lock held through its commit's WAL flush, which serialises
-- concurrent writers' commits; most writes have no watcher.  Two advisory
-- locks of class 'pgbk' (1885823595) tell, without a lost wake-up:
--   (1885823595, 1) "watchers": each registered watcher holds it shared, for
--       its session (kv_watch_begin .. kv_watch_end; a crashed watcher's goes
--       with its session);
--   (1885823595, 0) "writes in flight": each write holds it shared until its
--       transaction ends, taken with a try before it looks for watchers.
-- A write announces itself unless it got the "in flight" lock and then found
-- the "watchers" lock free (a momentary exclusive try, given back in the same
-- expression; a write that loses that race to another write announces itself,
-- which is harmless).  A watcher LISTENs, takes "watchers" shared, then takes
-- "in flight" exclusive (for its transaction), which waits for the writes
-- that looked before it registered to end, and only then reads.  So every
-- change is either announced after the watcher listens, or committed before
-- it reads.  Writes never wait for watchers: while a watcher registers, the
-- try on "in flight" fails and the write announces itself.

CREATE FUNCTION pgbroker._lock_class_kv()
RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1885823595 $$;
COMMENT ON FUNCTION pgbroker._lock_class_kv() IS
    'Internal: ''pgbk''; (class, 1) is held shared by registered key-value watchers, (class, 0) shared by key-value writes in flight.';

CREATE TABLE pgbroker.kv_entry (
    key text PRIMARY KEY,
    value jsonb NOT NULL,
    version bigint NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    expires_at timestamptz
);
COMMENT ON TABLE pgbroker.kv_entry IS 'The key-value store. Internal: use kv_get(), kv_set(), kv_delete() and the view pgbroker.kv.';
COMMENT ON COLUMN pgbroker.kv_entry.key IS 'The key, verbatim (1 to 200 bytes).';
COMMENT ON COLUMN pgbroker.kv_entry.value IS 'Its value.';
COMMENT ON COLUMN pgbroker.kv_entry.version IS 'Version of the last change (from pgbroker.kv_version_seq: grows on every change).';
COMMENT ON COLUMN pgbroker.kv_entry.updated_at IS 'When it last changed.';
COMMENT ON COLUMN pgbroker.kv_entry.expires_at IS 'When it expires (NULL: never); an expired entry reads as absent.';

CREATE SEQUENCE pgbroker.kv_version_seq AS bigint;
COMMENT ON SEQUENCE pgbroker.kv_version_seq IS 'Versions of the key-value store: every set and delete takes the next one.';

CREATE FUNCTION pgbroker.kv_channel()
RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT 'pgbroker_kv'::text $$;
COMMENT ON FUNCTION pgbroker.kv_channel() IS
    'The channel key-value changes are announced on while a watcher is registered (kv_watch_begin): pgbroker_kv, payload {"key": ..., "version": ...} ("deleted": true for a delete).';

-- Announce a change when a watcher may be registered (see above).  No SET
-- clause: only SECURITY DEFINER functions with a pinned search_path call it,
-- and a SET clause costs a settings frame per call; every name in it is
-- qualified.
CREATE FUNCTION pgbroker._kv_announce(p_key text, p_version bigint, p_deleted boolean)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    -- A session's own shared lock never conflicts with its own try: a session
    -- that watches marks itself (kv_watch_begin) and always announces.
    IF pg_catalog.pg_try_advisory_xact_lock_shared(pgbroker._lock_class_kv(), 0)
       AND pg_catalog.current_setting('pgbroker.kv_watching', true) IS DISTINCT FROM 'on' THEN
        IF (CASE WHEN pg_catalog.pg_try_advisory_lock(pgbroker._lock_class_kv(), 1)
                 THEN pg_catalog.pg_advisory_unlock(pgbroker._lock_class_kv(), 1)
                 ELSE false END) THEN
            RETURN;   -- no watcher registered; one that registers from now on waits for this transaction
        END IF;
    END IF;
    PERFORM pg_catalog.pg_notify('pgbroker_kv',
        CASE WHEN p_deleted THEN pg_catalog.json_build_object('key', p_key, 'version', p_version, 'deleted', true)
             ELSE pg_catalog.json_build_object('key', p_key, 'version', p_version) END::text);
END
$$;
COMMENT ON FUNCTION pgbroker._kv_announce(text, bigint, boolean) IS
    'Internal: NOTIFY kv_channel() of a change to key p_key (version p_version) unless no watcher is registered (see kv_watch_begin).';

CREATE FUNCTION pgbroker.kv_watch_begin()
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pg_advisory_lock_shared(pgbroker._lock_class_kv(), 1);
    BEGIN
        PERFORM set_config('pgbroker.kv_watching', 'on', false);   -- this session's own writes: see _kv_announce
        -- Wait for the writes that looked for watchers before we registered.
        PERFORM pg_advisory_xact_lock(pgbroker._lock_class_kv(), 0);
    EXCEPTION WHEN query_canceled OR others THEN
        -- A cancel or statement_timeout while waiting: not registered (the
        -- session lock above outlives the error, so it goes here).
        PERFORM pg_advisory_unlock_shared(pgbroker._lock_class_kv(), 1);
        RAISE;
    END;
END
$$;
COMMENT ON FUNCTION pgbroker.kv_watch_begin() IS
$$Register this session as a watcher of the key-value store: from now on every change is announced on kv_channel() at commit (without a registered watcher, changes are not announced).
Waits for the key-value writes in flight (they looked for watchers before) to commit or roll back. The loop: LISTEN on kv_channel(), then SELECT kv_watch_begin(), both outside a transaction, then read; held until kv_watch_end() or the session ends.$$;

CREATE FUNCTION pgbroker.kv_watch_end()
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET client_min_messages = error   -- pg_advisory_unlock warns when the lock is not held: we return false instead
AS $$
BEGIN
    RETURN pg_advisory_unlock_shared(pgbroker._lock_class_kv(), 1);
END
$$;
COMMENT ON FUNCTION pgbroker.kv_watch_end() IS
    'End one kv_watch_begin() of this session (registrations stack); false when it has none. Changes stay announced while any session watches.';

CREATE FUNCTION pgbroker.kv_get(key text)
RETURNS TABLE (value jsonb, version bigint, expires_at timestamptz)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_key text := pgbroker._check_key(kv_get.key, 'key');
BEGIN
    PERFORM pgbroker._name_check('kv', v_key, false);
    RETURN QUERY
    SELECT e.value, e.version, e.expires_at FROM pgbroker.kv_entry e
     WHERE e.key = v_key
       AND (e.expires_at IS NULL OR e.expires_at > clock_timestamp());
END
$$;
COMMENT ON FUNCTION pgbroker.kv_get(text) IS
    'The value, version and expiry of KEY (1 to 200 bytes); no row when it is absent or expired.';

CREATE FUNCTION pgbroker.kv_set(key text, value jsonb, version bigint DEFAULT NULL, ttl interval DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_key text := pgbroker._check_key(kv_set.key, 'key');
    v_now timestamptz := clock_timestamp();
    v_expires timestamptz;
    v_new bigint;
BEGIN
    PERFORM pgbroker._name_check('kv', v_key, true);
    IF kv_set.value IS NULL THEN
        RAISE EXCEPTION 'value must not be NULL (use kv_delete, or the JSON null ''null''::jsonb)'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF kv_set.ttl IS NOT NULL AND kv_set.ttl <= '0'::interval THEN
        RAISE EXCEPTION 'ttl must be positive, got %', kv_set.ttl USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF kv_set.version < 0 THEN
        RAISE EXCEPTION 'version must not be negative, got %', kv_set.version USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v_expires := v_now + kv_set.ttl;
    -- Versions: a change takes its version only while it holds the key, so
    -- that versions grow in the order the changes commit.  Every change of a
    -- key holds it until its transaction ends: an update or a delete holds
    -- the row's lock, an insert its new row (a concurrent insert of the key
    -- waits for it, a concurrent update or delete does not see it).  A
    -- number taken while holding the key is therefore greater than the number
    -- of every change of the key that committed before, and smaller than the
    -- number of every change after: those wait for this one to end before
    -- they take theirs.  (A nextval() in the INSERT's VALUES would be taken
    -- before ON CONFLICT waits for the row: a change that committed while it
    -- waited would carry a greater version than this later one, issue 41.)
    IF kv_set.version IS NULL OR kv_set.version = 0 THEN
        -- Plain set, or "must not exist" (an expired entry counts as absent).
        -- ON CONFLICT's SET runs with the row locked; a new row is inserted
        -- with version 0 (never a real version, and seen by this transaction
        -- only) and numbered by the UPDATE below, once it is in place.
        INSERT INTO pgbroker.kv_entry AS e (key, value, version, updated_at, expires_at)
        VALUES (v_key, kv_set.value, 0, v_now, v_expires)
        ON CONFLICT ON CONSTRAINT kv_entry_pkey DO UPDATE
           SET value = excluded.value, version = nextval('pgbroker.kv_version_seq'), updated_at = excluded.updated_at,
               expires_at = excluded.expires_at
         WHERE kv_set.version IS NULL OR e.expires_at <= v_now
        RETURNING e.version INTO v_new;
        IF v_new = 0 THEN
            UPDATE pgbroker.kv_entry AS e SET version = nextval('pgbroker.kv_version_seq')
             WHERE e.key = v_key
            RETURNING e.version INTO v_new;
        END IF;
    ELSE
        -- Compare-and-set: the row is updated only if it still carries the
        -- version the scan read (after a concurrent change, the re-check of
        -- the WHERE fails), so no change of the key committed between this
        -- nextval() and the update, and the number exceeds that version.
        UPDATE pgbroker.kv_entry AS e
           SET value = kv_set.value, version = nextval('pgbroker.kv_version_seq'), updated_at = v_now,
               expires_at = v_expires
         WHERE e.key = v_key AND e.version = kv_set.version AND (e.expires_at IS NULL OR e.expires_at > v_now)
        RETURNING e.version INTO v_new;
    END IF;
    IF v_new IS NOT NULL THEN
        PERFORM pgbroker._kv_announce(v_key, v_new, false);
    END IF;
    RETURN v_new;
END
$$;
COMMENT ON FUNCTION pgbroker.kv_set(text, jsonb, bigint, interval) IS
$$Set KEY (1 to 200 bytes) to VALUE (jsonb, not NULL) and return the new version; TTL (positive) makes it expire that long from now.
With VERSION it is a compare-and-set: it writes only when the current version of KEY is VERSION (0: KEY must be absent or expired) and returns NULL otherwise, changing nothing.
Announces the change on kv_channel() at commit while a watcher is registered (kv_watch_begin).$$;

CREATE FUNCTION pgbroker.kv_delete(key text, version bigint DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_key text := pgbroker._check_key(kv_delete.key, 'key');
    v_now timestamptz := clock_timestamp();
    v_live boolean;
BEGIN
    PERFORM pgbroker._name_check('kv', v_key, true);
    DELETE FROM pgbroker.kv_entry e
     WHERE e.key = v_key AND (kv_delete.version IS NULL OR e.version = kv_delete.version)
    RETURNING e.expires_at IS NULL OR e.expires_at > v_now INTO v_live;
    IF v_live THEN
        -- Numbered after the DELETE, which holds the row: see kv_set.
        PERFORM pgbroker._kv_announce(v_key, nextval('pgbroker.kv_version_seq'), true);
    END IF;
    RETURN coalesce(v_live, false);
END
$$;
COMMENT ON FUNCTION pgbroker.kv_delete(text, bigint) IS
    'Delete KEY; with VERSION only when that is its current version. True when a live entry was deleted (and announced on kv_channel() while a watcher is registered); false, changing nothing visible, otherwise.';

-- Expired entries read as absent; maintain() deletes them, a batch at a
-- time, skipping rows a writer holds (no announcement: readers saw them
-- absent from their expiry on).
CREATE FUNCTION pgbroker._kv_expired_upkeep(p_max integer, OUT removed bigint, OUT remaining bigint)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
BEGIN
    DELETE FROM pgbroker.kv_entry e
     WHERE e.ctid = ANY (ARRAY(SELECT x.ctid FROM pgbroker.kv_entry x
                                WHERE x.expires_at <= v_now LIMIT p_max FOR UPDATE SKIP LOCKED))
       AND e.expires_at <= v_now;
    GET DIAGNOSTICS removed = ROW_COUNT;
    SELECT count(*) INTO remaining
      FROM (SELECT FROM pgbroker.kv_entry x WHERE x.expires_at <= v_now LIMIT p_max) x;
END
$$;
COMMENT ON FUNCTION pgbroker._kv_expired_upkeep(integer) IS
    'Internal (maintain()): delete up to P_MAX expired key-value entries; REMOVED deleted, REMAINING expired ones left (at most P_MAX counted).';
