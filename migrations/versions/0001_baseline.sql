-- Generated from sql/ by migrations/build_baseline.py: do not edit.

-- ===== sql/000_schema.sql =====

-- pgbroker: the schema, its roles and the database's search_path.
--
-- Files in sql/ are loaded in name order and together hold the current
-- definition of every pgbroker object, each defined once, one area per file:
--   000 schema, roles, version     050 authority per name
--   100 the lease                  200 clients
--   300 watched tables and keys    400 subscriptions    500 outbox, wake-ups
--   550 sweeping earlier epochs    600 triggers, watch()
--   650 named locks                660 semaphores       670 key-value store
--   680 counters                   690 rate limits      700 views
--   750 console, health, metrics   900 privileges       950 initech.objects (the optional reference table)
-- migrations/ holds the alembic revisions: 0.1.0's, generated from these
-- files at the release (migrations/release.py), then one revision per later
-- change; a test proves that they build the same catalog as these files.

CREATE SCHEMA IF NOT EXISTS pgbroker;
COMMENT ON SCHEMA pgbroker IS
    'pgbroker: singleton broker leases with fencing epochs, change fan-out to subscribed clients, named locks, semaphores, a key-value store, counters and rate limits, in PL/pgSQL. See sql/README.md.';

-- The version of the installed schema: the release that froze it ('0.1.0'),
-- or, for a revision made since that is not released yet, that release and
-- the revision's number ('0.1.0+3').  It lets pgbroker (and you) recognise
-- the schema whichever alembic environment installed it, as extensions know
-- theirs.  Every revision that changes the schema replaces this function,
-- and pgbroker.install.SCHEMA_VERSION says the same (migrations/README.md,
-- "Revisions").
CREATE FUNCTION pgbroker.schema_version()
RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT '0.1.0'::text $$;
COMMENT ON FUNCTION pgbroker.schema_version() IS
    'The version of the installed pgbroker schema: a release (0.1.0), or a release and the number of an unreleased revision made since (0.1.0+3). Anyone may call it.';

-- Roles are cluster-wide.  Create the four pgbroker roles when they are
-- missing and remember which ones this installation created, so that a
-- downgrade drops those and nothing else.
CREATE TABLE pgbroker.installed (
    kind text NOT NULL CONSTRAINT installed_kind_valid CHECK (kind IN ('role', 'schema', 'table')),
    object text NOT NULL,
    installed_at timestamptz NOT NULL DEFAULT pg_catalog.now(),
    PRIMARY KEY (kind, object)
);
COMMENT ON TABLE pgbroker.installed IS
    'Objects outside schema pgbroker that this installation created (roles, initech.objects), so that a downgrade drops those and nothing else. Internal.';
COMMENT ON COLUMN pgbroker.installed.kind IS 'role, schema or table.';
COMMENT ON COLUMN pgbroker.installed.object IS 'Its name (qualified for a table).';
COMMENT ON COLUMN pgbroker.installed.installed_at IS 'When it was created.';

DO $roles$
DECLARE
    v_role text;
BEGIN
    FOREACH v_role IN ARRAY ARRAY['pgbroker_broker', 'pgbroker_reader', 'pgbroker_user', 'pgbroker_admin'] LOOP
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = v_role) THEN
            EXECUTE format('CREATE ROLE %I NOLOGIN', v_role);
            INSERT INTO pgbroker.installed (kind, object) VALUES ('role', v_role);
        END IF;
    END LOOP;
END
$roles$;

-- Split a stored search_path value ('"$user", public') into its elements.
CREATE FUNCTION pgbroker._search_path_elements(p_value text)
RETURNS text[]
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT coalesce(array_agg(CASE WHEN m[1] LIKE '"%' THEN replace(substr(m[1], 2, length(m[1]) - 2), '""', '"')
                                   ELSE m[1] END ORDER BY n), '{}')
    FROM regexp_matches(p_value, '("(?:[^"]|"")*"|[^,\s]+)', 'g') WITH ORDINALITY AS t(m, n)
$$;
COMMENT ON FUNCTION pgbroker._search_path_elements(text) IS
    'Internal: the schema names of a search_path setting, unquoted, in order.';

-- Make `SELECT broker_claim()` work unqualified in new sessions: append
-- pgbroker to the end of this database's default search_path (after the
-- user's own schemas, so it never hides one of their names), when the
-- installing role owns the database.
-- `p_add => false` removes it again.
CREATE FUNCTION pgbroker._set_database_search_path(p_add boolean)
RETURNS text
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_current text;
    v_elems text[];
    v_sql text;
BEGIN
    -- ALTER DATABASE needs its owner (or a superuser); an installer that only
    -- has CREATE on the database leaves its search_path alone and says so.
    IF NOT pg_has_role(current_user, (SELECT d.datdba FROM pg_catalog.pg_database d WHERE d.datname = current_database()),
                       'USAGE') THEN
        RAISE NOTICE 'pgbroker: the search_path of database % is left as it is: role % does not own it', current_database(),
                current_user
            USING HINT = 'Qualify pgbroker''s names (pgbroker.broker_claim()), or set it per role: ALTER ROLE app_role '
                         'SET search_path = "$user", public, pgbroker;';
        RETURN NULL;
    END IF;
    SELECT substr(s, length('search_path=') + 1) INTO v_current
      FROM pg_catalog.pg_db_role_setting d, unnest(d.setconfig) AS s
     WHERE d.setdatabase = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())
       AND d.setrole = 0
       AND s LIKE 'search_path=%';
    v_elems := pgbroker._search_path_elements(coalesce(v_current, '"$user", public'));
    v_elems := array_remove(v_elems, 'pgbroker');
    IF p_add THEN
        v_elems := v_elems || 'pgbroker'::text;
    END IF;
    IF NOT p_add AND (v_elems = ARRAY['$user', 'public'] OR cardinality(v_elems) = 0) THEN
        v_sql := format('ALTER DATABASE %I RESET search_path', current_database());
    ELSE
        SELECT format('ALTER DATABASE %I SET search_path = %s', current_database(),
                      string_agg(format('%I', e), ', ' ORDER BY n))
          INTO v_sql
          FROM unnest(v_elems) WITH ORDINALITY AS t(e, n);
    END IF;
    EXECUTE v_sql;
    RETURN v_sql;
END
$$;
COMMENT ON FUNCTION pgbroker._set_database_search_path(boolean) IS
    'Internal: append pgbroker to (true) or remove it from (false) the current database''s default search_path; NULL, with a NOTICE, when the current user does not own the database.';

SELECT pgbroker._set_database_search_path(true);

-- ===== sql/050_authority.sql =====

-- pgbroker: authority per name.
--
-- pgbroker's roles grant capabilities: pgbroker_broker may claim leases,
-- pgbroker_user may take locks and permits, write keys and counters, ask the
-- rate limiter.  A name grant narrows a capability to names: it gives a role
-- read or write on the names of one kind (lease, lock, semaphore, kv,
-- counter, rate_limit) that begin with a prefix ('' covers every name).
--
-- The rule.  A name that no grant's prefix covers is anyone's: any member of
-- the capability role may use it, as without grants.  Once grants cover it,
-- only members of a role granted on the longest covering prefix may: with
-- write to change state or take a lock, permit or lease, with read (or
-- write) to read it (kv_get, counter_get, the views' rows about it).
-- Everyone else gets 42501 naming the kind and the name, and nothing
-- changes.  Membership is judged on the session's login role (session_user),
-- as takeover => true is, so SET ROLE cannot widen it; prefixes compare
-- exactly, character for character (no LIKE, no case folding: 'billing/' does
-- not cover 'Billing/x', nor 'billing' itself).  Giving back what one holds
-- (lock_release, semaphore_release, broker_release) needs no grant: a
-- revocation bites at the next acquire, claim, heartbeat or renewal.
--
-- What this cannot enforce: advisory locks have no privileges in
-- PostgreSQL.  Any session that can connect can take pg_advisory_lock on any
-- key, so a hostile role can squat a named lock, a permit or a lease's lock
-- (a denial of service) though it can never become a lease's holder (the
-- lease row and epochs decide that).  The view unaccounted_locks
-- (750_console.sql) and pgbroker doctor name such sessions.

CREATE TABLE pgbroker.name_grant (
    kind text NOT NULL
        CONSTRAINT name_grant_kind_valid CHECK (kind IN ('lease', 'lock', 'semaphore', 'kv', 'counter', 'rate_limit')),
    prefix text NOT NULL CONSTRAINT name_grant_prefix_valid CHECK (octet_length(prefix) <= 200),
    role oid NOT NULL,
    rights text NOT NULL CONSTRAINT name_grant_rights_valid CHECK (rights IN ('read', 'write')),
    granted_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    PRIMARY KEY (kind, prefix, role)
);
COMMENT ON TABLE pgbroker.name_grant IS
    'Name grants: which role may read or write the names of a kind that begin with a prefix. Internal: use name_grant(), name_revoke() and the view pgbroker.name_grants.';
COMMENT ON COLUMN pgbroker.name_grant.kind IS 'lease, lock, semaphore, kv, counter or rate_limit.';
COMMENT ON COLUMN pgbroker.name_grant.prefix IS 'The names it covers begin with this ('''' covers every name).';
COMMENT ON COLUMN pgbroker.name_grant.role IS 'The role granted (its oid: a grant outlives a dropped role, and then admits nobody).';
COMMENT ON COLUMN pgbroker.name_grant.rights IS 'read, or write (which implies read).';
COMMENT ON COLUMN pgbroker.name_grant.granted_at IS 'When it was granted or last changed.';

-- Per kind with grants, the lengths of its prefixes: a name's covering
-- prefixes are then found by one index probe per length, whatever the
-- number of grants.  No row: the kind has no grant, and a check costs one
-- probe here.
CREATE TABLE pgbroker.name_grant_kind (
    kind text PRIMARY KEY,
    lengths integer[] NOT NULL
);
COMMENT ON TABLE pgbroker.name_grant_kind IS
    'Internal: per kind with grants, the distinct lengths of its prefixes (kept by name_grant and name_revoke).';
COMMENT ON COLUMN pgbroker.name_grant_kind.kind IS 'The kind.';
COMMENT ON COLUMN pgbroker.name_grant_kind.lengths IS 'The distinct lengths, in characters, of its grants'' prefixes.';

-- A number that changes with every grant and revoke: a client that caches
-- what a name allowed (the Python Lock caches a name's lock key) compares it
-- before using the cache (view pgbroker.name_grants_version).
CREATE TABLE pgbroker.name_grant_version (
    version bigint NOT NULL,
    singleton boolean PRIMARY KEY DEFAULT true CONSTRAINT name_grant_version_one_row CHECK (singleton)
);
INSERT INTO pgbroker.name_grant_version (version) VALUES (0);
COMMENT ON TABLE pgbroker.name_grant_version IS 'Internal: one row, bumped by every name_grant and name_revoke, and by maintain() when it finds lock names idle (their cached keys must not be used).';
COMMENT ON COLUMN pgbroker.name_grant_version.version IS 'Grows with every grant and revoke, and with every maintain() that finds lock names idle.';
COMMENT ON COLUMN pgbroker.name_grant_version.singleton IS 'Always true: one row.';

-- Whether role p_role (the session's login role, for the API's checks) may
-- use p_name of kind p_kind, for writing or only reading, given the kind's
-- prefix lengths (NULL: the kind has no grant): the prefixes of p_name of
-- those lengths are probed longest first (one query each), and the first one
-- with a grant decides.
-- A dropped role's grant admits nobody (pg_has_role is false for an oid that
-- names no role, but for superusers, who pass every check).  PL/pgSQL, so
-- that its queries' plans are cached, each an index probe.  p_role is an
-- oid, not a name: an argument of type name (collation "C") would make the
-- call's collation "C", every text parameter's with it, and the probes unable
-- to use the index (a scan of every grant instead).  No search_path: only
-- functions with a pinned one call it, and every name in it is qualified.
CREATE FUNCTION pgbroker._name_allowed(p_kind text, p_name text, p_write boolean, p_lengths integer[], p_role oid)
RETURNS boolean
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    v_length integer := pg_catalog.length(p_name);
    v_allowed boolean;
BEGIN
    IF p_lengths IS NULL THEN
        RETURN true;
    END IF;
    FOR i IN REVERSE pg_catalog.cardinality(p_lengths) .. 1 LOOP
        CONTINUE WHEN p_lengths[i] > v_length;
        -- NULL when no grant has this prefix; else whether one admits p_role.
        SELECT bool_or((g.rights = 'write' OR NOT p_write) AND pg_catalog.pg_has_role(p_role, g.role, 'MEMBER'))
          INTO v_allowed
          FROM pgbroker.name_grant g
         WHERE g.kind = p_kind AND g.prefix = pg_catalog.left(p_name, p_lengths[i]);
        IF v_allowed IS NOT NULL THEN
            RETURN v_allowed;
        END IF;
    END LOOP;
    RETURN true;   -- no grant covers the name
END
$$;
COMMENT ON FUNCTION pgbroker._name_allowed(text, text, boolean, integer[], oid) IS
    'Internal: whether role p_role may read (p_write false) or write name p_name of kind p_kind, given the kind''s prefix lengths (NULL: no grant).';

-- The check the API functions make: nothing to do (one index probe) for a
-- kind without grants, else 42501 unless allowed.  No SET clause (see above).
CREATE FUNCTION pgbroker._name_check(p_kind text, p_name text, p_write boolean)
RETURNS void
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    v_lengths integer[];
BEGIN
    SELECT k.lengths INTO v_lengths FROM pgbroker.name_grant_kind k WHERE k.kind = p_kind;
    IF v_lengths IS NOT NULL AND NOT pgbroker._name_allowed(p_kind, p_name, p_write, v_lengths,
                                                                 SESSION_USER::text::regrole) THEN
        RAISE EXCEPTION 'permission denied to % % "%": role % has no % grant on its longest covering prefix',
                CASE WHEN p_write THEN 'use' ELSE 'read' END, replace(p_kind, '_', ' '), p_name, SESSION_USER,
                CASE WHEN p_write THEN 'write' ELSE 'read' END
            USING ERRCODE = 'insufficient_privilege',
                  DETAIL = pg_catalog.json_build_object('kind', p_kind, 'name', p_name, 'role', SESSION_USER,
                                                        'rights', CASE WHEN p_write THEN 'write' ELSE 'read' END)::text,
                  HINT = 'An administrator grants it with pgbroker.name_grant(kind, prefix, role); the view pgbroker.name_grants lists the grants.';
    END IF;
END
$$;
COMMENT ON FUNCTION pgbroker._name_check(text, text, boolean) IS
    'Internal: 42501 unless the session''s login role may use (p_write) or read name p_name of kind p_kind.';

CREATE FUNCTION pgbroker.name_allowed(kind text, name text, rights text DEFAULT 'read', "role" regrole DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_lengths integer[];
BEGIN
    IF name_allowed.rights IS NULL OR name_allowed.rights NOT IN ('read', 'write') THEN
        RAISE EXCEPTION 'rights must be read or write, got %', coalesce(name_allowed.rights, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT k.lengths INTO v_lengths FROM pgbroker.name_grant_kind k WHERE k.kind = name_allowed.kind;
    RETURN pgbroker._name_allowed(name_allowed.kind, name_allowed.name, name_allowed.rights = 'write', v_lengths,
                                  coalesce(name_allowed."role"::oid, SESSION_USER::text::regrole::oid));
END
$$;
COMMENT ON FUNCTION pgbroker.name_allowed(text, text, text, regrole) IS
$$Whether ROLE (default: this session's login role) may read (RIGHTS 'read') or use ('write') NAME of KIND by the name grants (the capability roles aside). The views filter their rows with it.$$;

-- Changing the grants.  Each change bumps the version and recomputes its
-- kind's prefix lengths.
CREATE FUNCTION pgbroker._name_grants_changed(p_kind text)
RETURNS void
LANGUAGE sql
AS $$
    UPDATE pgbroker.name_grant_version SET version = version + 1;
    DELETE FROM pgbroker.name_grant_kind WHERE kind = p_kind;
    INSERT INTO pgbroker.name_grant_kind (kind, lengths)
    SELECT p_kind, array_agg(DISTINCT pg_catalog.length(g.prefix) ORDER BY pg_catalog.length(g.prefix))
      FROM pgbroker.name_grant g WHERE g.kind = p_kind
    HAVING count(*) > 0;
$$;
COMMENT ON FUNCTION pgbroker._name_grants_changed(text) IS
    'Internal: after a grant or revoke of kind p_kind, bump the version and recompute the kind''s prefix lengths.';

CREATE FUNCTION pgbroker._name_grant_args(p_kind text, p_prefix text, p_role regrole)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF p_kind IS NULL OR p_prefix IS NULL OR p_role IS NULL THEN
        RAISE EXCEPTION 'kind, prefix and role must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF p_kind NOT IN ('lease', 'lock', 'semaphore', 'kv', 'counter', 'rate_limit') THEN
        RAISE EXCEPTION 'unknown kind "%": one of lease, lock, semaphore, kv, counter, rate_limit', p_kind
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF pg_catalog.octet_length(p_prefix) > 200 THEN
        RAISE EXCEPTION 'prefix is too long: % bytes, at most 200', pg_catalog.octet_length(p_prefix)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;
COMMENT ON FUNCTION pgbroker._name_grant_args(text, text, regrole) IS
    'Internal: check the arguments of name_grant and name_revoke (22004 for a NULL, 22023 for an unknown kind or a prefix over 200 bytes).';

CREATE FUNCTION pgbroker.name_grant(kind text, prefix text, "role" regrole, rights text DEFAULT 'write')
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pgbroker._name_grant_args(name_grant.kind, name_grant.prefix, name_grant."role");
    IF name_grant.rights IS NULL OR name_grant.rights NOT IN ('read', 'write') THEN
        RAISE EXCEPTION 'rights must be read or write, got %', coalesce(name_grant.rights, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO pgbroker.name_grant AS g (kind, prefix, role, rights)
    VALUES (name_grant.kind, name_grant.prefix, name_grant."role", name_grant.rights)
    ON CONFLICT ON CONSTRAINT name_grant_pkey DO UPDATE SET rights = excluded.rights, granted_at = excluded.granted_at;
    PERFORM pgbroker._name_grants_changed(name_grant.kind);
END
$$;
COMMENT ON FUNCTION pgbroker.name_grant(text, text, regrole, text) IS
$$Admin: give ROLE RIGHTS (read, or write which implies read; default write) on the names of KIND (lease, lock, semaphore, kv, counter, rate_limit) that begin with PREFIX ('' : every name). Granting again replaces the rights.
From then on a name PREFIX covers may be used only by members (judged on the session's login role) of the roles granted on its longest covering prefix; others get 42501. A name no grant covers stays anyone's with the capability role. Takes effect at commit, for the next call.$$;

CREATE FUNCTION pgbroker.name_revoke(kind text, prefix text, "role" regrole)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pgbroker._name_grant_args(name_revoke.kind, name_revoke.prefix, name_revoke."role");
    DELETE FROM pgbroker.name_grant g
     WHERE g.kind = name_revoke.kind AND g.prefix = name_revoke.prefix AND g.role = name_revoke."role";
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM pgbroker._name_grants_changed(name_revoke.kind);
    RETURN true;
END
$$;
COMMENT ON FUNCTION pgbroker.name_revoke(text, text, regrole) IS
$$Admin: take back ROLE's grant on PREFIX of KIND; false when there was none. When the last grant covering a name goes, the name is anyone's with the capability role again. Takes effect at commit, for the next call (a lock or permit held stays held until given back; a lease's holder loses it at its next heartbeat or renewal).$$;

-- ===== sql/100_lease.sql =====

-- pgbroker: the singleton broker lease.
--
-- A lease is a named right to be "the" broker.  It is held by a database
-- session through a session-level advisory lock, so it is freed by the server
-- the moment that session ends (process killed, connection lost, server
-- restarted).  The lease row records who holds it and a fencing token, the
-- epoch, which grows with every successful claim and is never reused, not even
-- by a claim that rolled back (epochs come from one sequence, so they may skip
-- values).
--
-- Claims follow their transaction: broker_claim() takes a
-- transaction-level advisory lock, and a deferred constraint trigger turns it
-- into a session-level lock when the transaction commits.  A claim that fails,
-- is cancelled or is rolled back therefore never leaves a lock behind.
--
-- Everything a broker keeps (its state here; its clients, subscriptions and
-- pending notifications in later files) carries the epoch that wrote it, and
-- whatever reads it compares that with the lease's current epoch.  So a new
-- claim makes all that an earlier epoch left invisible at once, in a time
-- that does not depend on how much there is, and broker_sweep()
-- (550_sweep.sql) removes it afterwards in bounded batches.

-- Advisory locks are keyed (class, key) with two int4 values, which PostgreSQL
-- never confuses with single-bigint advisory locks.  The class is 'pgbr'.
CREATE FUNCTION pgbroker._lock_class()
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1885823602 $$;
COMMENT ON FUNCTION pgbroker._lock_class() IS
    'Internal: the first key (0x70676272, ''pgbr'') of every pgbroker advisory lock; the second is lease.lock_key.';

-- A second session-level lock, 'pgbh' ("held"), follows the lease lock: the
-- holder of a session lease takes it when its claim commits and drops it when
-- its release commits (or its session ends).  It is keyed by the epoch, not
-- the lease: writers' triggers test it, for the epoch of the subscribers they
-- found, with a try-lock that they drop at once, and write nothing for an
-- epoch whose holder is gone or was replaced (600_triggers.sql).  A claim
-- never try-locks it, so that test can never make a claim fail; at worst the
-- holder waits the microseconds a test lasts.
CREATE FUNCTION pgbroker._lock_class_alive()
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1885823592 $$;
COMMENT ON FUNCTION pgbroker._lock_class_alive() IS
    'Internal: ''pgbh''; (class, _epoch_key(epoch)) is held (session level) by the holder of a session lease''s epoch while it holds it.';

-- The second key of an epoch's "held" lock: its low 31 bits.  Two epochs
-- share a key only 2^31 claims apart (epochs come from one sequence), and an
-- earlier epoch's rows are swept long before that.
CREATE FUNCTION pgbroker._epoch_key(p_epoch bigint)
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT (p_epoch & 2147483647)::integer $$;
COMMENT ON FUNCTION pgbroker._epoch_key(bigint) IS
    'Internal: the second key of the ''pgbh'' lock of epoch p_epoch (its low 31 bits).';

-- A session's identity: its pid and, since pids are reused, when it first
-- called pgbroker ('<pid>@<microseconds since 1970>', kept in the session's
-- setting pgbroker.session).  Not its backend_start: the functions run as
-- their owner, and pg_stat_activity hides other roles' backend_start (the
-- caller's own session included) from an owner without pg_read_all_stats.
-- A setting is private to its session, and a later session with the same pid
-- first calls pgbroker after this one ended, so no two sessions share an
-- identity.  DISCARD ALL (or RESET ALL) forgets it, as DISCARD ALL forgets
-- the session's advisory locks: the session is then a new one to pgbroker.
-- One SQL expression, inlined into its callers' queries (a PL/pgSQL call per
-- fetch cost the broker more than the rest of the fetch).
CREATE FUNCTION pgbroker._my_backend_start_lookup()
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_start timestamptz := date_trunc('microseconds', clock_timestamp());
BEGIN
    PERFORM set_config('pgbroker.session',
                       pg_backend_pid()::text || '@' || (extract(epoch FROM v_start) * 1000000)::bigint::text, false);
    RETURN v_start;
END
$$;
COMMENT ON FUNCTION pgbroker._my_backend_start_lookup() IS
    'Internal: give this session its identity, the time of its first pgbroker call, kept in the setting pgbroker.session.';

CREATE FUNCTION pgbroker._my_backend_start()
RETURNS timestamptz
LANGUAGE sql VOLATILE
AS $$
    SELECT CASE WHEN pg_catalog.split_part(pg_catalog.current_setting('pgbroker.session', true), '@', 1)
                     = pg_catalog.pg_backend_pid()::text
                THEN 'epoch'::timestamptz
                     + pg_catalog.split_part(pg_catalog.current_setting('pgbroker.session', true), '@', 2)::bigint
                       * interval '1 microsecond'
                ELSE pgbroker._my_backend_start_lookup() END
$$;
COMMENT ON FUNCTION pgbroker._my_backend_start() IS
    'Internal: this session''s identity with its pid: when it first called pgbroker (setting pgbroker.session); tells sessions apart even after pid reuse.';

CREATE TABLE pgbroker.lease (
    name text PRIMARY KEY,
    lock_key integer GENERATED ALWAYS AS IDENTITY
        CONSTRAINT lease_lock_key_unique UNIQUE,
    epoch bigint NOT NULL DEFAULT 0,
    state text NOT NULL DEFAULT 'new'
        CONSTRAINT lease_state_valid CHECK (state IN ('new', 'held', 'released', 'expired')),
    holder_pid integer,
    holder_backend_start timestamptz,
    holder_user name,
    holder_application text,
    holder_address inet,
    holder_info text,
    claimed_at timestamptz,
    heartbeat_at timestamptz,
    released_at timestamptz,
    -- Who holds it: the owner token the claim passed (NULL for a bare claim).
    owner text,
    -- A TTL lease (claimed with ttl =>) is held until expires_at unless
    -- renewed, with no session lock; a session lease has both NULL.
    ttl interval,
    expires_at timestamptz,
    -- Book-keeping for the deferred session-lock trigger (see _lease_sync_session_lock).
    sync_xid xid8,
    session_locked boolean NOT NULL DEFAULT false,
    CONSTRAINT lease_name_valid CHECK (name <> '' AND octet_length(name) <= 63)
);
COMMENT ON TABLE pgbroker.lease IS
    'One row per broker lease name: its current epoch and holder. Internal: read the view pgbroker.brokers.';
COMMENT ON COLUMN pgbroker.lease.name IS 'Lease name (1 to 63 bytes).';
COMMENT ON COLUMN pgbroker.lease.lock_key IS 'Second key of the advisory lock (pgbroker._lock_class(), lock_key); unique per name, so names never collide.';
COMMENT ON COLUMN pgbroker.lease.epoch IS 'Fencing token: greater than every epoch handed out before, across crashes and failovers ((WAL timeline - 1) * 2^40 + a sequence value, so it may skip values); 0 before the first claim.';
COMMENT ON COLUMN pgbroker.lease.state IS 'new (never claimed), held (claimed and not released), released, or expired (a TTL lease whose time ran out unrenewed, once noticed: lease_expiry_check()).';
COMMENT ON COLUMN pgbroker.lease.holder_pid IS 'Backend pid of the session that made the last claim.';
COMMENT ON COLUMN pgbroker.lease.holder_backend_start IS 'With holder_pid, the identity of that session: when it first called pgbroker (guards against pid reuse; see _my_backend_start()).';
COMMENT ON COLUMN pgbroker.lease.holder_user IS 'session_user of the holder.';
COMMENT ON COLUMN pgbroker.lease.holder_application IS 'application_name of the holder at claim time.';
COMMENT ON COLUMN pgbroker.lease.holder_address IS 'Client address of the holder (NULL for a Unix-socket connection).';
COMMENT ON COLUMN pgbroker.lease.holder_info IS 'Free text given by the claimant (broker_claim info =>), for example its hostname.';
COMMENT ON COLUMN pgbroker.lease.claimed_at IS 'When the current epoch was claimed.';
COMMENT ON COLUMN pgbroker.lease.heartbeat_at IS 'Last broker_heartbeat() of the holder (claim time until the first one).';
COMMENT ON COLUMN pgbroker.lease.released_at IS 'When the holder called broker_release(), if it did.';
COMMENT ON COLUMN pgbroker.lease.owner IS 'Owner token given by the holder''s claim (owner =>); NULL for a bare claim. Never shown in views or errors.';
COMMENT ON COLUMN pgbroker.lease.ttl IS 'For a TTL lease: its time to live (renewals extend it by this much by default); NULL for a session lease.';
COMMENT ON COLUMN pgbroker.lease.expires_at IS 'For a TTL lease: when it lapses unless renewed; NULL for a session lease.';
COMMENT ON COLUMN pgbroker.lease.sync_xid IS 'Internal: transaction that last changed the holder; see _lease_sync_session_lock().';
COMMENT ON COLUMN pgbroker.lease.session_locked IS 'Internal: whether the session of that transaction held the session-level lock when it began.';

-- Epochs of all names come from one sequence: a number once handed out is
-- never handed out again, not even when the claim that got it rolled back.
-- A promoted standby may have missed any number of claims (asynchronous
-- replication), so its sequence can be behind the old primary's.  Every
-- promotion starts a new WAL timeline, so the epoch carries the timeline in
-- its high bits: epoch = (timeline - 1) * 2^40 + n, n from the sequence.
-- On timeline 1 the epochs are the sequence's values; after a failover every epoch
-- compares greater than any the old primary handed out, as one bigint.
CREATE SEQUENCE pgbroker.lease_epoch_seq AS bigint MAXVALUE 1099511627775;
COMMENT ON SEQUENCE pgbroker.lease_epoch_seq IS
    'Internal: the low 40 bits of lease epochs (fencing tokens), shared by all lease names, so a number is never reused even after a rolled-back claim.';

-- The epoch for a new claim: the current WAL timeline in the high bits, the
-- sequence in the low 40.
CREATE FUNCTION pgbroker._next_epoch()
RETURNS bigint
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT (('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint - 1) * 1099511627776
           + nextval('pgbroker.lease_epoch_seq')
$$;
COMMENT ON FUNCTION pgbroker._next_epoch() IS
    'Internal: a new epoch, (WAL timeline - 1) * 2^40 + the next value of lease_epoch_seq: greater than every epoch handed out before, across crashes and failovers.';

CREATE TABLE pgbroker.lease_event (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name text NOT NULL,
    epoch bigint NOT NULL,
    event text NOT NULL
        CONSTRAINT lease_event_event_valid CHECK (event IN ('claim', 'takeover', 'stale_takeover', 'release', 'expired')),
    at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    pid integer NOT NULL,
    db_user name NOT NULL,
    application text,
    address inet,
    info text,
    previous_epoch bigint,
    previous_pid integer,
    previous_application text,
    previous_address inet,
    previous_heartbeat_at timestamptz,
    reason text NOT NULL
);
CREATE INDEX lease_event_name_epoch ON pgbroker.lease_event (name, epoch);
COMMENT ON TABLE pgbroker.lease_event IS
    'History of every claim, takeover, release and expiry, each announced on lease_channel() as it commits. Internal: read the view pgbroker.lease_history.';
COMMENT ON COLUMN pgbroker.lease_event.id IS 'Increasing event number.';
COMMENT ON COLUMN pgbroker.lease_event.name IS 'Lease name.';
COMMENT ON COLUMN pgbroker.lease_event.epoch IS 'Epoch claimed or released.';
COMMENT ON COLUMN pgbroker.lease_event.at IS 'When it happened (clock time inside the acting transaction).';
COMMENT ON COLUMN pgbroker.lease_event.pid IS 'Backend pid of the session that acted (for expired: of the holder whose lease lapsed).';
COMMENT ON COLUMN pgbroker.lease_event.db_user IS 'Database user (session_user) that acted.';
COMMENT ON COLUMN pgbroker.lease_event.application IS 'Its application_name.';
COMMENT ON COLUMN pgbroker.lease_event.address IS 'Its client address (NULL over a Unix socket).';
COMMENT ON COLUMN pgbroker.lease_event.info IS 'The info text given to broker_claim().';
COMMENT ON COLUMN pgbroker.lease_event.previous_epoch IS 'For a claim: the epoch it replaced.';
COMMENT ON COLUMN pgbroker.lease_event.previous_pid IS 'For a claim: the previous holder''s pid.';
COMMENT ON COLUMN pgbroker.lease_event.previous_application IS 'For a claim: the previous holder''s application_name.';
COMMENT ON COLUMN pgbroker.lease_event.previous_address IS 'For a claim: the previous holder''s address.';
COMMENT ON COLUMN pgbroker.lease_event.previous_heartbeat_at IS 'For a claim: the previous holder''s last heartbeat.';
COMMENT ON COLUMN pgbroker.lease_event.event IS 'claim, takeover (holder terminated by takeover => true), stale_takeover (holder terminated because its heartbeat was older than stale_after), release, or expired (a TTL lease that lapsed unrenewed).';
COMMENT ON COLUMN pgbroker.lease_event.reason IS 'Why: who took over from whom, how old the heartbeat was, whether the previous holder had released or died.';

-- ---------------------------------------------------------------------------
-- Lease events: every history row is announced on lease_channel() by the
-- transaction that writes it, so a NOTIFY arrives exactly when the change it
-- names commits (and never for a claim that rolled back).  Observers LISTEN
-- before they read pgbroker.brokers and miss nothing.

CREATE FUNCTION pgbroker.lease_channel()
RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT 'pgbroker_lease'::text $$;
COMMENT ON FUNCTION pgbroker.lease_channel() IS
$$The channel every lease event is announced on as it commits: pgbroker_lease. Payload: a JSON object with name, epoch,
event (claim, release, takeover, stale_takeover, expired), pid (the new holder's; for release and expired, the one that
left), application, info (its first 1,000 bytes), at, previous_epoch and previous_pid (for a claim).$$;

CREATE FUNCTION pgbroker._lease_event_announce()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pg_notify('pgbroker_lease',
                      json_build_object('name', NEW.name, 'epoch', NEW.epoch, 'event', NEW.event, 'pid', NEW.pid,
                                        'application', NEW.application,
                                        'info', left(NEW.info, 1000),   -- a NOTIFY payload holds 8,000 bytes
                                        'at', NEW.at, 'previous_epoch', NEW.previous_epoch,
                                        'previous_pid', NEW.previous_pid)::text);
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pgbroker._lease_event_announce() IS
    'Internal (trigger): announce a new lease history row on lease_channel() (delivered when its transaction commits).';

CREATE TRIGGER _100_announce
AFTER INSERT ON pgbroker.lease_event
FOR EACH ROW EXECUTE FUNCTION pgbroker._lease_event_announce();
COMMENT ON TRIGGER _100_announce ON pgbroker.lease_event IS 'Every lease event is announced on lease_channel() at its commit.';

-- ---------------------------------------------------------------------------
-- Broker state: a small key/value store per lease, written only by the
-- holder, wiped by every new claim.
-- Keyed by epoch too, so that a new epoch's writes never meet (nor wait for)
-- the rows an earlier one left, which broker_sweep() deletes.
CREATE TABLE pgbroker.state (
    name text NOT NULL REFERENCES pgbroker.lease (name) ON DELETE CASCADE,
    epoch bigint NOT NULL,
    key text NOT NULL,
    value jsonb NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    PRIMARY KEY (name, epoch, key)
);
COMMENT ON TABLE pgbroker.state IS
    'Key/value state of the current broker of each lease; what earlier epochs wrote is invisible and swept by broker_sweep(). Internal: use broker_state_set() and the view pgbroker.broker_state.';
COMMENT ON COLUMN pgbroker.state.name IS 'Lease name.';
COMMENT ON COLUMN pgbroker.state.key IS 'Key.';
COMMENT ON COLUMN pgbroker.state.epoch IS 'Epoch of the broker that wrote it; rows of earlier epochs are invisible and swept by broker_sweep().';
COMMENT ON COLUMN pgbroker.state.value IS 'Value.';
COMMENT ON COLUMN pgbroker.state.updated_at IS 'When it was last set.';

-- ---------------------------------------------------------------------------
-- Errors.  Every error a user can hit is raised here or by PostgreSQL with a
-- documented SQLSTATE (sql/README.md, "SQLSTATEs").

CREATE FUNCTION pgbroker._check_name(p_name text)
RETURNS text
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF p_name IS NULL THEN
        RAISE EXCEPTION 'lease name must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF p_name = '' THEN
        RAISE EXCEPTION 'lease name must not be empty' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF octet_length(p_name) > 63 THEN
        RAISE EXCEPTION 'lease name is too long: % bytes, at most 63 allowed', octet_length(p_name)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN p_name;
END
$$;
COMMENT ON FUNCTION pgbroker._check_name(text) IS
    'Internal: validate a lease name (22004 when NULL, 22023 when empty or over 63 bytes).';

-- Is the holder of epoch p_epoch, session (pid, identity), alive and holding
-- the lease's lock?  Asked of this very session, its identity says; of
-- another, pg_locks, which every role sees whole: the session holds the
-- lease's lock and the epoch's "held" lock, which it takes when its claim
-- commits.  A later session that got the dead holder's pid holds that epoch's
-- "held" lock never, so pid reuse does not fool it.
CREATE FUNCTION pgbroker._lease_alive(p_pid integer, p_backend_start timestamptz, p_lock_key integer, p_epoch bigint)
RETURNS boolean
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- PL/pgSQL, not SQL: its statements' plans are kept for the session (a
    -- SQL function with SET is planned anew at every call).
    IF p_pid IS NULL THEN
        RETURN false;
    END IF;
    IF p_pid = pg_backend_pid() THEN
        RETURN coalesce(p_backend_start = pgbroker._my_backend_start(), false)
               AND EXISTS (SELECT FROM pg_locks l
                            WHERE l.locktype = 'advisory'
                              AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
                              AND l.classid = pgbroker._lock_class()::oid
                              AND l.objid = p_lock_key::oid
                              AND l.objsubid = 2
                              AND l.granted
                              AND l.pid = p_pid);
    END IF;
    RETURN (SELECT count(DISTINCT l.classid) = 2 FROM pg_locks l
             WHERE l.locktype = 'advisory'
               AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
               AND ((l.classid = pgbroker._lock_class()::oid AND l.objid = p_lock_key::oid)
                    OR (l.classid = pgbroker._lock_class_alive()::oid AND l.objid = pgbroker._epoch_key(p_epoch)::oid))
               AND l.objsubid = 2
               AND l.granted
               AND l.pid = p_pid);
END
$$;
COMMENT ON FUNCTION pgbroker._lease_alive(integer, timestamptz, integer, bigint) IS
    'Internal: true when session p_pid (identity p_backend_start) holds the advisory lock p_lock_key (and, another session, the held lock of epoch p_epoch).';

-- Is the lease held by someone alive: a TTL lease until it expires, a
-- session lease while its holder's session holds the lock.
CREATE FUNCTION pgbroker._lease_live(p_lease pgbroker.lease)
RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT p_lease.state = 'held'
       AND CASE WHEN p_lease.expires_at IS NOT NULL THEN p_lease.expires_at > pg_catalog.clock_timestamp()
                ELSE pgbroker._lease_alive(p_lease.holder_pid, p_lease.holder_backend_start, p_lease.lock_key, p_lease.epoch) END
$$;
COMMENT ON FUNCTION pgbroker._lease_live(pgbroker.lease) IS
    'Internal: true when the lease is held and alive: a TTL lease not yet expired, or a session lease whose holder''s session holds the lock.';

-- The backend that holds the advisory lock of a lease right now, if any.
CREATE FUNCTION pgbroker._lock_holder_pid(p_lock_key integer)
RETURNS integer
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT l.pid FROM pg_catalog.pg_locks l
     WHERE l.locktype = 'advisory'
       AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())
       AND l.classid = pgbroker._lock_class()::oid
       AND l.objid = p_lock_key::oid
       AND l.objsubid = 2
       AND l.granted
     LIMIT 1
$$;
COMMENT ON FUNCTION pgbroker._lock_holder_pid(integer) IS
    'Internal: pid of the backend holding the advisory lock p_lock_key, or NULL.';

CREATE FUNCTION pgbroker._raise_held(p_name text)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_lease pgbroker.lease;
    v_pid integer;
BEGIN
    SELECT * INTO v_lease FROM pgbroker.lease WHERE name = p_name;
    IF v_lease.expires_at IS NOT NULL AND pgbroker._lease_live(v_lease) THEN
        RAISE EXCEPTION 'lease "%" is held until % (a TTL lease claimed by pid %, application "%", epoch %)',
                p_name, v_lease.expires_at, v_lease.holder_pid, coalesce(v_lease.holder_application, ''), v_lease.epoch
            USING ERRCODE = 'lock_not_available',
                  DETAIL = jsonb_build_object('name', p_name, 'pid', v_lease.holder_pid,
                                              'application', v_lease.holder_application,
                                              'address', host(v_lease.holder_address), 'user', v_lease.holder_user,
                                              'info', v_lease.holder_info, 'epoch', v_lease.epoch,
                                              'since', v_lease.claimed_at, 'heartbeat_at', v_lease.heartbeat_at,
                                              'expires_at', v_lease.expires_at)::text,
                  HINT = 'Wait for it to expire or be released (wait => interval), or take it over (takeover => true, pgbroker_admin only).';
    END IF;
    v_pid := pgbroker._lock_holder_pid(v_lease.lock_key);
    IF v_pid IS NOT DISTINCT FROM v_lease.holder_pid AND v_lease.state = 'held' THEN
        RAISE EXCEPTION 'lease "%" is held by pid % (application "%", address %, epoch %, since %)',
                p_name, v_pid, coalesce(v_lease.holder_application, ''),
                coalesce(host(v_lease.holder_address), 'local'), v_lease.epoch, v_lease.claimed_at
            USING ERRCODE = 'lock_not_available',
                  DETAIL = jsonb_build_object('name', p_name, 'pid', v_pid, 'application', v_lease.holder_application,
                                              'address', host(v_lease.holder_address), 'user', v_lease.holder_user,
                                              'info', v_lease.holder_info, 'epoch', v_lease.epoch,
                                              'since', v_lease.claimed_at, 'heartbeat_at', v_lease.heartbeat_at)::text,
                  HINT = 'Wait for it (wait => interval, or NULL to wait until the holder''s session ends), '
                         'take over a hung holder (stale_after => interval), or terminate it (takeover => true, pgbroker_admin only).';
    ELSE
        -- The lock is held by a session that is not the recorded holder: a claim
        -- of that session is committing right now, or a stray lock (sql/README.md, "Internals").
        RAISE EXCEPTION 'lease "%" is locked by pid %, which is not its recorded holder (a claim committing now, or a stray lock)',
                p_name, v_pid
            USING ERRCODE = 'lock_not_available',
                  DETAIL = jsonb_build_object('name', p_name, 'pid', v_pid, 'recorded_pid', v_lease.holder_pid,
                                              'state', v_lease.state, 'epoch', v_lease.epoch)::text,
                  HINT = 'Retry, or end that session (takeover => true).';
    END IF;
END
$$;
COMMENT ON FUNCTION pgbroker._raise_held(text) IS
    'Internal: raise 55P03 lock_not_available naming the session that holds lease p_name (DETAIL: a JSON object).';

-- Convert a wait interval into a lock_timeout value in milliseconds ('0' = forever).
CREATE FUNCTION pgbroker._wait_ms(p_wait interval)
RETURNS text
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_ms numeric;
BEGIN
    IF p_wait IS NULL THEN
        RETURN '0';
    END IF;
    v_ms := ceil(extract(epoch FROM p_wait) * 1000);
    IF v_ms < 0 THEN
        RAISE EXCEPTION 'wait must not be negative: %', p_wait
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Use ''0'' to fail at once, NULL to wait forever.';
    END IF;
    IF v_ms > 2147483647 THEN
        RAISE EXCEPTION 'wait is too long: % (at most 24 days; NULL waits forever)', p_wait
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN greatest(v_ms, 1)::bigint::text;
END
$$;
COMMENT ON FUNCTION pgbroker._wait_ms(interval) IS
    'Internal: a wait interval as a lock_timeout in ms (NULL gives 0, i.e. no limit); 22023 when negative or over 24 days.';

-- ---------------------------------------------------------------------------
-- Timed waits on advisory locks, right by construction.
--
-- A wait with lock_timeout can end with the lock granted AND the timeout
-- error raised: the releaser grants the lock to the first waiter in shared
-- memory while the waiter's timer fires; the waiter then processes the
-- pending cancel inside its wait, and its error cleanup (LockErrorCleanup)
-- finds the grant and records it.  A session-level lock outlives the
-- rollback of the EXCEPTION block, so a caller that answered "not acquired"
-- kept the lock (issue 41); a transaction-level one is given back by that
-- rollback, so for an instant the lock was held by a call that answers "not
-- acquired", and a try by anyone else in that instant failed although nobody
-- held it.  Both are not linearizable.  So every timed wait on an advisory
-- lock goes through _advisory_wait: it waits on a session-level lock,
-- asks pg_locks after a timeout whether the lock was granted all the same,
-- and counts such a grant as acquired (the lock was granted within the call,
-- and the call says so); a transaction-scope wait then holds the lock for
-- the transaction and drops the session hold (at once: both are its own).
-- Any other error during the wait (a cancel, statement_timeout, a deadlock)
-- gives a lock granted meanwhile back before it is raised again: an error
-- means not acquired.

-- Does this session hold advisory lock (p_class, p_key) in this mode (any scope)?
CREATE FUNCTION pgbroker._advisory_held(p_class integer, p_key integer, p_shared boolean)
RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT EXISTS (SELECT FROM pg_catalog.pg_locks l
                    WHERE l.locktype = 'advisory'
                      AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database())
                      AND l.classid = p_class::oid AND l.objid = p_key::oid AND l.objsubid = 2
                      AND l.pid = pg_catalog.pg_backend_pid() AND l.granted
                      AND l.mode = CASE WHEN p_shared THEN 'ShareLock' ELSE 'ExclusiveLock' END)
$$;
COMMENT ON FUNCTION pgbroker._advisory_held(integer, integer, boolean) IS
    'Internal: whether this session holds advisory lock (p_class, p_key) in the mode p_shared names (pg_locks: session or transaction scope).';

-- A session hold of advisory lock (p_class, p_key) made a transaction hold:
-- taken at once (the session holds it), then the session hold goes.
CREATE FUNCTION pgbroker._advisory_to_xact(p_class integer, p_key integer, p_shared boolean)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_shared THEN
        PERFORM pg_advisory_xact_lock_shared(p_class, p_key);
        PERFORM pg_advisory_unlock_shared(p_class, p_key);
    ELSE
        PERFORM pg_advisory_xact_lock(p_class, p_key);
        PERFORM pg_advisory_unlock(p_class, p_key);
    END IF;
END
$$;
COMMENT ON FUNCTION pgbroker._advisory_to_xact(integer, integer, boolean) IS
    'Internal: turn this session''s hold of advisory lock (p_class, p_key) into a hold for the transaction.';

-- Wait at most p_wait (NULL: without limit) for advisory lock (p_class,
-- p_key) in the mode p_shared names, held for the session, or for the
-- transaction with p_xact.  The caller has just tried it and failed, so this
-- session does not hold it in that mode (a session's own holds never
-- conflict with its requests): a grant that pg_locks shows after the wait
-- was made to this call.
CREATE FUNCTION pgbroker._advisory_wait(p_class integer, p_key integer, p_shared boolean, p_xact boolean, p_wait interval)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_timeout text := current_setting('lock_timeout');
    v_got boolean;
BEGIN
    BEGIN
        PERFORM set_config('lock_timeout', pgbroker._wait_ms(p_wait), true);
        IF p_shared THEN
            PERFORM pg_advisory_lock_shared(p_class, p_key);
        ELSE
            PERFORM pg_advisory_lock(p_class, p_key);
        END IF;
        PERFORM set_config('lock_timeout', v_timeout, true);
        IF p_xact THEN
            PERFORM pgbroker._advisory_to_xact(p_class, p_key, p_shared);
        END IF;
        RETURN true;
    EXCEPTION
        WHEN lock_not_available THEN
            -- The wait ran out; granted all the same at that moment?  (The
            -- block's rollback has restored lock_timeout.)
            v_got := pgbroker._advisory_held(p_class, p_key, p_shared);
        WHEN query_canceled OR others THEN
            -- In the block, a transaction hold was undone with it; a session
            -- hold is not: give it back.
            IF pgbroker._advisory_held(p_class, p_key, p_shared) THEN
                IF p_shared THEN
                    PERFORM pg_advisory_unlock_shared(p_class, p_key);
                ELSE
                    PERFORM pg_advisory_unlock(p_class, p_key);
                END IF;
            END IF;
            RAISE;
    END;
    IF v_got AND p_xact THEN
        PERFORM pgbroker._advisory_to_xact(p_class, p_key, p_shared);
    END IF;
    RETURN v_got;
END
$$;
COMMENT ON FUNCTION pgbroker._advisory_wait(integer, integer, boolean, boolean, interval) IS
    'Internal: wait at most p_wait (NULL: no limit) for advisory lock (p_class, p_key), shared or exclusive, for the session or (p_xact) the transaction; true when acquired, also when granted just as the wait ran out; an error during the wait leaves no hold behind. Call it only after a failed try.';

-- ---------------------------------------------------------------------------
-- Turning the claim's transaction lock into a session lock, at commit.

-- Record, the first time a transaction changes a lease's holder, whether this
-- session held the session-level lock when the transaction began.
CREATE FUNCTION pgbroker._lease_touch(p_lease pgbroker.lease)
RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN p_lease.sync_xid IS NOT DISTINCT FROM pg_catalog.pg_current_xact_id_if_assigned()
                THEN p_lease.session_locked
                ELSE p_lease.state = 'held'
                     AND p_lease.expires_at IS NULL
                     AND p_lease.holder_pid = pg_catalog.pg_backend_pid()
                     AND p_lease.holder_backend_start = pgbroker._my_backend_start()
           END
$$;
COMMENT ON FUNCTION pgbroker._lease_touch(pgbroker.lease) IS
    'Internal: whether this session holds the session-level lock of the lease as of the start of the current transaction.';

CREATE FUNCTION pgbroker._lease_sync_session_lock()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_lease pgbroker.lease;
    v_want boolean;
BEGIN
    SELECT * INTO v_lease FROM pgbroker.lease WHERE name = NEW.name;
    IF NOT FOUND OR v_lease.sync_xid IS DISTINCT FROM pg_current_xact_id() THEN
        RETURN NULL;
    END IF;
    v_want := v_lease.state = 'held'
              AND v_lease.expires_at IS NULL   -- a TTL lease has no session lock
              AND v_lease.holder_pid = pg_backend_pid()
              AND v_lease.holder_backend_start = pgbroker._my_backend_start();
    IF v_want = v_lease.session_locked THEN
        RETURN NULL;
    END IF;
    IF v_want THEN
        -- We hold the transaction-level lock, so this succeeds at once.
        PERFORM pg_advisory_lock(pgbroker._lock_class(), v_lease.lock_key);
        PERFORM pg_advisory_lock(pgbroker._lock_class_alive(), pgbroker._epoch_key(v_lease.epoch));
    ELSE
        -- (A session that held the lock held it for this epoch: a claim of
        -- the holder's own session never changes the epoch.)
        PERFORM pg_advisory_unlock(pgbroker._lock_class(), v_lease.lock_key);
        PERFORM pg_advisory_unlock(pgbroker._lock_class_alive(), pgbroker._epoch_key(v_lease.epoch));
    END IF;
    UPDATE pgbroker.lease SET session_locked = v_want WHERE name = NEW.name;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pgbroker._lease_sync_session_lock() IS
    'Internal deferred trigger: at commit, take (claim) or drop (release) the session-level advisory lock so that it follows the transaction.';

CREATE CONSTRAINT TRIGGER _900_sync_session_lock
    AFTER UPDATE OF epoch, state ON pgbroker.lease
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION pgbroker._lease_sync_session_lock();
COMMENT ON TRIGGER _900_sync_session_lock ON pgbroker.lease IS
    'Takes or drops the session-level advisory lock when the claiming or releasing transaction commits.';

-- Release session-level locks of this backend that no lease row accounts for.
-- They can only exist if a transaction failed after its commit-time trigger
-- ran (for example SET CONSTRAINTS ALL IMMEDIATE followed by ROLLBACK).
CREATE FUNCTION pgbroker._lease_sweep()
RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_class integer;
    v_key integer;
    v_count integer := 0;
BEGIN
    FOR v_class, v_key IN
        SELECT l.classid::integer, l.objid::integer
          FROM pg_catalog.pg_locks l
         WHERE l.locktype = 'advisory'
           AND l.pid = pg_backend_pid()
           AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())
           AND l.classid IN (pgbroker._lock_class()::oid, pgbroker._lock_class_alive()::oid)
           AND l.objsubid = 2
           AND l.granted
           AND NOT EXISTS (
                   SELECT FROM pgbroker.lease r
                    WHERE CASE WHEN l.classid = pgbroker._lock_class()::oid THEN r.lock_key
                               ELSE pgbroker._epoch_key(r.epoch) END = l.objid::integer
                      AND (   -- claimed: committed (session lock) or in this transaction (xact lock)
                              (r.state = 'held' AND r.expires_at IS NULL AND r.holder_pid = pg_backend_pid()
                               AND r.holder_backend_start = pgbroker._my_backend_start())
                              -- released in this transaction: the session lock goes at commit
                           OR (r.sync_xid = pg_current_xact_id_if_assigned() AND r.session_locked)))
    LOOP
        PERFORM pg_advisory_unlock(v_class, v_key);
        v_count := v_count + (v_class = pgbroker._lock_class())::integer;  -- the alive lock goes with its lease lock
    END LOOP;
    RETURN v_count;
END
$$;
COMMENT ON FUNCTION pgbroker._lease_sweep() IS
    'Internal: release session-level pgbroker locks of this backend that no lease row accounts for (stray locks).';

-- ---------------------------------------------------------------------------
-- TTL leases that lapse.  A TTL lease whose time ran out unrenewed is free
-- from that moment (_lease_live says so), but no statement runs then to say
-- it.  The first to notice records it, state 'expired' and a history event
-- 'expired' (announced like every event): the next claim of the name, a
-- sweep (broker_sweep), an observer (lease_expiry_check).

CREATE FUNCTION pgbroker._lease_expire(p_name text)
RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_count integer;
BEGIN
    WITH lapsed AS (
        UPDATE pgbroker.lease l SET state = 'expired'
         WHERE (p_name IS NULL OR l.name = p_name)
           AND l.state = 'held' AND l.expires_at <= clock_timestamp()
        RETURNING l.*
    )
    INSERT INTO pgbroker.lease_event (name, epoch, event, pid, db_user, application, address, info, reason)
    SELECT x.name, x.epoch, 'expired', x.holder_pid, x.holder_user, x.holder_application, x.holder_address, x.holder_info,
           format('the TTL lease of epoch %s expired at %s unrenewed (noticed by pid %s)', x.epoch, x.expires_at,
                  pg_backend_pid())
      FROM lapsed x;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;
COMMENT ON FUNCTION pgbroker._lease_expire(text) IS
    'Internal: mark the TTL leases of p_name (NULL: all) whose time ran out expired, with an expired event each; returns how many.';

-- ---------------------------------------------------------------------------
-- Terminating a holder.

CREATE FUNCTION pgbroker._lease_terminate(p_name text, p_pid integer)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_role oid;
BEGIN
    -- The right first, as pg_terminate_backend() judges it for the functions'
    -- owner (current_user here), so that a claim that may not terminate fails
    -- before anything is done: a superuser's session only by a superuser;
    -- another only with pg_signal_backend or the rights of the session's role.
    -- (usesysid is shown to every role; backend_start and state are not.)
    SELECT a.usesysid INTO v_role FROM pg_stat_get_activity(p_pid) a;
    IF v_role IS NOT NULL AND NOT (SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = current_user) THEN
        IF (SELECT r.rolsuper FROM pg_roles r WHERE r.oid = v_role) THEN
            RAISE EXCEPTION 'cannot terminate pid % holding lease "%": it is a session of superuser %, and only a superuser may end one (pgbroker''s functions run as %, not a superuser)',
                    p_pid, p_name, v_role::regrole, current_user
                USING ERRCODE = 'insufficient_privilege',
                      HINT = 'End that session as a superuser (SELECT pg_terminate_backend(pid)), and let brokers log in as ordinary roles.';
        END IF;
        IF NOT pg_has_role(current_user, v_role, 'USAGE') AND NOT pg_has_role(current_user, 'pg_signal_backend', 'USAGE') THEN
            RAISE EXCEPTION 'cannot terminate pid % (role %) holding lease "%": pgbroker''s functions run as role %, which lacks pg_signal_backend',
                    p_pid, v_role::regrole, p_name, current_user
                USING ERRCODE = 'insufficient_privilege',
                      HINT = format('As a superuser (or a role with ADMIN OPTION on it): GRANT pg_signal_backend TO %I;', current_user);
        END IF;
    END IF;
    -- No timeout argument: that would poll for the exit every 100 ms.  The
    -- caller waits on the advisory lock instead, which it gets the moment the
    -- terminated backend releases it.
    BEGIN
        RETURN pg_terminate_backend(p_pid);
    EXCEPTION WHEN insufficient_privilege THEN
        RAISE EXCEPTION 'cannot terminate pid % holding lease "%": pgbroker''s functions run as role %, which lacks the right to',
                p_pid, p_name, current_user
            USING ERRCODE = 'insufficient_privilege',
                  HINT = format('As a superuser (or a role with ADMIN OPTION on it): GRANT pg_signal_backend TO %I;', current_user);
    END;
END
$$;
COMMENT ON FUNCTION pgbroker._lease_terminate(text, integer) IS
    'Internal: send SIGTERM to backend p_pid (the claim then waits for its lock).';

-- Privileged takeover: terminate whoever holds the lock.  Only broker_claim()
-- calls it, after checking that the caller is a pgbroker_admin.
CREATE FUNCTION pgbroker._lease_takeover(p_name text)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_pid integer;
BEGIN
    v_pid := pgbroker._lock_holder_pid((SELECT lock_key FROM pgbroker.lease WHERE name = p_name));
    IF v_pid IS NOT NULL AND v_pid <> pg_backend_pid() THEN
        PERFORM pgbroker._lease_terminate(p_name, v_pid);
    END IF;
    RETURN v_pid;
END
$$;
COMMENT ON FUNCTION pgbroker._lease_takeover(text) IS
    'Internal: terminate the backend holding lease p_name; returns its pid.';

-- Stale takeover: terminate the recorded holder only if it still holds the
-- lock and its last heartbeat is older than p_stale_after.
CREATE FUNCTION pgbroker._lease_takeover_stale(p_name text, p_stale_after interval)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_lease pgbroker.lease;
BEGIN
    SELECT * INTO v_lease FROM pgbroker.lease WHERE name = p_name;
    IF v_lease.state = 'held'
       AND v_lease.heartbeat_at < clock_timestamp() - p_stale_after
       AND v_lease.holder_pid <> pg_backend_pid()
       AND pgbroker._lease_alive(v_lease.holder_pid, v_lease.holder_backend_start, v_lease.lock_key, v_lease.epoch) THEN
        PERFORM pgbroker._lease_terminate(p_name, v_lease.holder_pid);
        RETURN v_lease.holder_pid;
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pgbroker._lease_takeover_stale(text, interval) IS
    'Internal: terminate the holder of lease p_name if its heartbeat is older than p_stale_after; returns its pid or NULL.';

-- ---------------------------------------------------------------------------
-- The claim proper, once the caller's rights have been checked.
--
-- Waiting: the session blocks on the advisory lock for at most p_wait (NULL:
-- without limit).  With p_stale_after it blocks in slices that end when the
-- recorded holder's heartbeat would turn stale, and checks again, so a holder
-- that stops heartbeating while we wait is taken over too.
CREATE FUNCTION pgbroker._lease_claim(p_name text, p_wait interval, p_terminated integer, p_stale_after interval, p_info text,
                                      p_owner text, p_ttl interval, p_takeover boolean)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_me integer := pg_backend_pid();
    v_me_start timestamptz := pgbroker._my_backend_start();
    v_deadline timestamptz;
    v_lease pgbroker.lease;
    v_prev pgbroker.lease;
    v_got boolean := false;
    v_lost boolean := false;
    v_old_timeout text := current_setting('lock_timeout');
    v_slice interval;
    v_killed integer := p_terminated;
    v_event text := CASE WHEN p_terminated IS NULL THEN 'claim' ELSE 'takeover' END;
    v_reason text;
    v_locked_before boolean;
BEGIN
    v_deadline := clock_timestamp() + p_wait;  -- NULL: no limit

    PERFORM pgbroker._lease_sweep();
    SELECT * INTO v_lease FROM pgbroker.lease WHERE name = p_name;
    IF v_lease.state = 'held' AND v_lease.expires_at <= clock_timestamp() THEN
        -- A TTL lease that lapsed unnoticed: say so before claiming over it.
        PERFORM pgbroker._lease_expire(p_name);
        SELECT * INTO v_lease FROM pgbroker.lease WHERE name = p_name;
    END IF;
    IF NOT FOUND THEN
        -- First claim of this name.  Only then INSERT: an INSERT ... ON
        -- CONFLICT waits for any open transaction that changed the row, which
        -- would make wait => '0' block.  It still waits for a concurrent
        -- first claim of the same name; that wait is bounded by p_wait.  A
        -- grant just as the wait runs out is undone with the block, INSERT
        -- and all, and the claim fails: right, as the other claim, which
        -- holds the lease's lock, was open throughout.
        BEGIN
            PERFORM set_config('lock_timeout',
                               pgbroker._wait_ms(CASE WHEN v_deadline IS NOT NULL
                                                      THEN greatest(v_deadline - clock_timestamp(), '0'::interval) END),
                               true);
            INSERT INTO pgbroker.lease (name) VALUES (p_name) ON CONFLICT (name) DO NOTHING;
            PERFORM set_config('lock_timeout', v_old_timeout, true);
        EXCEPTION WHEN lock_not_available THEN
            RAISE EXCEPTION 'lease "%" is being claimed for the first time by a transaction that has not committed yet', p_name
                USING ERRCODE = 'lock_not_available',
                      HINT = 'Wait for it (wait => interval, or NULL to wait until the holder''s session ends).';
        END;
        SELECT * INTO v_lease FROM pgbroker.lease WHERE name = p_name;
    END IF;

    -- Already held by this server session (committed, or claimed earlier in
    -- this transaction) ...
    IF v_lease.state = 'held' AND v_lease.expires_at IS NULL
       AND v_lease.holder_pid = v_me AND v_lease.holder_backend_start = v_me_start THEN
        IF pgbroker._lease_alive(v_me, v_me_start, v_lease.lock_key, v_lease.epoch) THEN
            -- Behind a pooler in transaction mode this server session carries
            -- many callers: only the claim's owner token proves that this is
            -- the same one.  A bare re-claim cannot prove it and is refused.
            IF p_owner IS NULL OR v_lease.owner IS DISTINCT FROM p_owner OR p_ttl IS NOT NULL THEN
                RAISE EXCEPTION 'lease "%" is already held by this server session (epoch %, %)', p_name, v_lease.epoch,
                        CASE WHEN v_lease.owner IS NULL THEN 'claimed without an owner token'
                             WHEN p_ttl IS NOT NULL AND v_lease.owner = p_owner THEN 'as a session lease, not a TTL one'
                             ELSE 'for another owner' END
                    USING ERRCODE = 'PB003',
                          DETAIL = jsonb_build_object('name', p_name, 'pid', v_me, 'application', v_lease.holder_application,
                                                      'epoch', v_lease.epoch, 'since', v_lease.claimed_at)::text,
                          HINT = 'Re-claim with the owner token of the claim (owner =>). Through a pooler in transaction mode, '
                                 'where callers share server sessions, use a TTL lease (ttl =>, owner =>).';
            END IF;
            RETURN v_lease.epoch;
        END IF;
        -- ... unless our lock is gone (pg_advisory_unlock_all(), DISCARD ALL):
        -- then another session may have had it meanwhile; claim a new epoch.
        v_lost := true;
    END IF;
    -- A live TTL lease of this owner, claimed again with a TTL: renew it.
    IF p_ttl IS NOT NULL AND v_lease.expires_at IS NOT NULL AND v_lease.owner = p_owner AND pgbroker._lease_live(v_lease) THEN
        UPDATE pgbroker.lease SET expires_at = clock_timestamp() + p_ttl, ttl = p_ttl, heartbeat_at = clock_timestamp()
         WHERE name = p_name;
        RETURN v_lease.epoch;
    END IF;

    v_got := pg_try_advisory_xact_lock(pgbroker._lock_class(), v_lease.lock_key);
    WHILE NOT v_got LOOP
        IF v_killed IS NULL AND p_stale_after IS NOT NULL THEN
            v_killed := pgbroker._lease_takeover_stale(p_name, p_stale_after);
            IF v_killed IS NOT NULL THEN
                v_event := 'stale_takeover';
            END IF;
        END IF;
        IF v_killed IS NOT NULL THEN
            -- The holder was terminated and its lock is about to go: wait for
            -- it (at least 5 s) even if the caller asked not to wait.
            v_slice := CASE WHEN v_deadline IS NOT NULL THEN greatest(v_deadline - clock_timestamp(), '5 s'::interval) END;
        ELSE
            EXIT WHEN clock_timestamp() >= v_deadline;
            v_slice := v_deadline - clock_timestamp();
            IF p_stale_after IS NOT NULL THEN
                -- Look again when the holder's heartbeat would turn stale
                -- (LEAST ignores NULL: no deadline, or no heartbeat).
                v_slice := least(v_slice,
                                 greatest((SELECT heartbeat_at + p_stale_after - clock_timestamp()
                                             FROM pgbroker.lease WHERE name = p_name), '0'::interval)
                                 + '50 ms'::interval);
            END IF;
        END IF;
        -- Waits on a session lock and then holds the lock for the transaction
        -- (a grant just as the slice ran out counts: see _advisory_wait).
        v_got := pgbroker._advisory_wait(pgbroker._lock_class(), v_lease.lock_key, false, true, v_slice);
        -- Not got: someone else got the lock of the holder we terminated.
        EXIT WHEN NOT v_got AND v_killed IS NOT NULL;
    END LOOP;

    IF NOT v_got THEN
        PERFORM pgbroker._raise_held(p_name);
    END IF;

    -- No session holds it; a live TTL lease may: wait until it expires or is
    -- released (looking every 100 ms), up to the deadline.  takeover => true
    -- claims over it.
    LOOP
        SELECT * INTO v_lease FROM pgbroker.lease WHERE name = p_name;
        EXIT WHEN v_lease.expires_at IS NULL OR NOT pgbroker._lease_live(v_lease);
        IF p_takeover THEN
            v_event := 'takeover';
            EXIT;
        END IF;
        IF clock_timestamp() >= v_deadline THEN
            PERFORM pgbroker._raise_held(p_name);
        END IF;
        PERFORM pg_sleep(greatest(extract(epoch FROM least(v_lease.expires_at, v_deadline, clock_timestamp() + '100 ms'::interval)
                                                    - clock_timestamp()), 0) + 0.001);
    END LOOP;

    -- FOR UPDATE conflicts with broker_assert()'s FOR KEY SHARE: a fenced
    -- transaction that asserted the old epoch commits before the new one exists.
    SELECT * INTO v_prev FROM pgbroker.lease WHERE name = p_name FOR UPDATE;
    -- Whether this session holds the session-level lock (not when it was lost).
    v_locked_before := NOT v_lost AND pgbroker._lease_touch(v_prev);

    v_reason := CASE
        WHEN v_event = 'takeover' AND v_prev.expires_at IS NOT NULL
            THEN format('takeover by %s of the TTL lease of epoch %s', session_user, v_prev.epoch)
        WHEN v_event = 'takeover' THEN format('takeover by %s: terminated pid %s (epoch %s)', session_user, v_killed, v_prev.epoch)
        WHEN v_event = 'stale_takeover' THEN format('heartbeat of pid %s (epoch %s) was %s old, stale_after %s: terminated',
                                                  v_killed, v_prev.epoch, clock_timestamp() - v_prev.heartbeat_at, p_stale_after)
        WHEN v_prev.state = 'new' THEN 'first claim'
        WHEN v_prev.state = 'released' THEN format('epoch %s was released', v_prev.epoch)
        WHEN v_prev.state = 'expired' THEN format('the TTL lease of epoch %s expired at %s', v_prev.epoch, v_prev.expires_at)
        WHEN v_prev.expires_at IS NOT NULL THEN format('the TTL lease of epoch %s expired at %s', v_prev.epoch, v_prev.expires_at)
        WHEN v_lost THEN format('the same session (pid %s) had lost the lock of epoch %s (pg_advisory_unlock_all() or DISCARD ALL)',
                                v_me, v_prev.epoch)
        WHEN v_prev.holder_pid = v_me AND v_prev.state = 'held'
            THEN format('pid %s (epoch %s) had lost its lock and its identity (DISCARD ALL), or ended', v_me, v_prev.epoch)
        ELSE format('session of pid %s (epoch %s) ended', v_prev.holder_pid, v_prev.epoch)
    END;

    -- The epoch comes from a sequence: a claim that rolls back after it
    -- returned its epoch has still used that number up.  Claims of one name
    -- are serialised by the lock and the row lock above, so it grows per name.
    -- The claim commits durably whatever the session's synchronous_commit:
    -- a broker must not act on an epoch that a crash could hand out again.
    PERFORM set_config('synchronous_commit', 'on', true);
    UPDATE pgbroker.lease
       SET epoch = pgbroker._next_epoch(),
           state = 'held',
           holder_pid = v_me,
           holder_backend_start = v_me_start,
           holder_user = session_user,
           holder_application = current_setting('application_name'),
           holder_address = inet_client_addr(),
           holder_info = p_info,
           claimed_at = clock_timestamp(),
           heartbeat_at = clock_timestamp(),
           released_at = NULL,
           owner = p_owner,
           ttl = p_ttl,
           expires_at = clock_timestamp() + p_ttl,
           sync_xid = pg_current_xact_id(),
           session_locked = v_locked_before
     WHERE name = p_name
    RETURNING * INTO v_lease;

    INSERT INTO pgbroker.lease_event
           (name, epoch, event, pid, db_user, application, address, info,
            previous_epoch, previous_pid, previous_application, previous_address, previous_heartbeat_at, reason)
    VALUES (p_name, v_lease.epoch, v_event, v_me, session_user, v_lease.holder_application, v_lease.holder_address, p_info,
            nullif(v_prev.epoch, 0), v_prev.holder_pid, v_prev.holder_application, v_prev.holder_address,
            v_prev.heartbeat_at, v_reason);

    RETURN v_lease.epoch;
END
$$;
COMMENT ON FUNCTION pgbroker._lease_claim(text, interval, integer, interval, text, text, interval, boolean) IS
    'Internal: body of broker_claim() after argument checks and any privileged takeover (p_terminated: pid it terminated).';

-- ---------------------------------------------------------------------------
-- Public API.

CREATE FUNCTION pgbroker.broker_claim(
    name text DEFAULT 'default',
    wait interval DEFAULT '0',
    takeover boolean DEFAULT false,
    stale_after interval DEFAULT NULL,
    info text DEFAULT NULL,
    owner text DEFAULT NULL,
    ttl interval DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(broker_claim.name);
    v_terminated integer;
BEGIN
    PERFORM pgbroker._name_check('lease', v_name, true);
    PERFORM pgbroker._wait_ms(broker_claim.wait);
    IF pg_is_in_recovery() THEN
        RAISE EXCEPTION 'cannot claim lease "%" on a standby: this server is in recovery', v_name
            USING ERRCODE = 'read_only_sql_transaction',
                  HINT = 'Claim on the primary (with libpq, target_session_attrs=read-write finds it).';
    END IF;
    IF broker_claim.takeover IS NULL THEN
        RAISE EXCEPTION 'takeover must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF broker_claim.stale_after IS NOT NULL AND broker_claim.stale_after <= '0'::interval THEN
        RAISE EXCEPTION 'stale_after must be positive: %', broker_claim.stale_after
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF broker_claim.owner IS NOT NULL AND (broker_claim.owner = '' OR octet_length(broker_claim.owner) > 200) THEN
        RAISE EXCEPTION 'owner must be 1 to 200 bytes, got %', octet_length(broker_claim.owner)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF broker_claim.ttl IS NOT NULL AND (broker_claim.owner IS NULL OR broker_claim.ttl <= '0'::interval) THEN
        RAISE EXCEPTION 'a TTL lease needs a positive ttl and an owner token, got ttl % and %', broker_claim.ttl,
                        CASE WHEN broker_claim.owner IS NULL THEN 'no owner' ELSE 'an owner' END
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass owner => a token that identifies this caller (for example a UUID), the same in renewals.';
    END IF;
    -- SECURITY DEFINER hides the caller's current_user; session_user is the
    -- login role, whose rights bound what the session can do (it can always
    -- RESET ROLE back to it).
    IF broker_claim.takeover AND NOT pg_has_role(session_user, 'pgbroker_admin', 'MEMBER') THEN
        RAISE EXCEPTION 'permission denied to take over lease "%": role % is not a member of pgbroker_admin', v_name, session_user
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'Use stale_after => interval to take over a holder whose heartbeat stopped, or ask an administrator.';
    END IF;
    IF broker_claim.takeover THEN
        v_terminated := pgbroker._lease_takeover(v_name);
    END IF;
    RETURN pgbroker._lease_claim(v_name, broker_claim.wait, v_terminated, broker_claim.stale_after, broker_claim.info,
                                 broker_claim.owner, broker_claim.ttl, broker_claim.takeover);
END
$$;
COMMENT ON FUNCTION pgbroker.broker_claim(text, interval, boolean, interval, text, text, interval) IS
$$Claim the broker lease NAME for this session (with ttl: for the OWNER token, from any session) and return its new epoch (the fencing token).
wait: '0' fails at once with 55P03 if another session holds it; an interval blocks up to that long; NULL blocks until the holder's session ends.
takeover => true (the login role must be a member of pgbroker_admin, else 42501): terminate the holder, then claim.
stale_after: terminate a holder whose last broker_heartbeat() is older than this (checked again while waiting), then claim.
info: free text recorded with the holder (for example the hostname).
owner: a token identifying the caller (1 to 200 bytes, for example a UUID). A re-claim from the session that holds the lease returns its epoch only with the same owner; a bare re-claim, or one with another owner, fails with PB003 (through a pooler in transaction mode that is another caller).
ttl (with owner): a TTL lease, held with no session lock until ttl from now; renew it with broker_renew() (or a claim with the same owner and ttl), release it with broker_release(name, owner). It works through any pooler.
The broker state, clients, subscriptions and pending notifications of earlier epochs become invisible at once, whatever their number; broker_sweep() removes them.
The claim follows its transaction: it takes effect at commit and leaves no lock behind on error or rollback.$$;

CREATE FUNCTION pgbroker.broker_release(name text DEFAULT 'default', owner text DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(broker_release.name);
    v_lease pgbroker.lease;
    v_locked_before boolean;
BEGIN
    SELECT * INTO v_lease FROM pgbroker.lease WHERE lease.name = v_name FOR UPDATE;
    IF NOT FOUND OR v_lease.state <> 'held' THEN
        RETURN false;
    END IF;
    IF v_lease.expires_at IS NOT NULL THEN
        -- A TTL lease: its owner releases it, from any session.
        IF v_lease.owner IS DISTINCT FROM broker_release.owner THEN
            RETURN false;
        END IF;
    ELSIF v_lease.holder_pid <> pg_backend_pid() OR v_lease.holder_backend_start <> pgbroker._my_backend_start()
          OR (v_lease.owner IS NOT NULL AND v_lease.owner IS DISTINCT FROM broker_release.owner) THEN
        -- Not this session's, or (behind a pooler) another caller's.
        RETURN false;
    END IF;
    v_locked_before := pgbroker._lease_touch(v_lease);
    UPDATE pgbroker.lease
       SET state = 'released', released_at = clock_timestamp(),
           sync_xid = pg_current_xact_id(), session_locked = v_locked_before
     WHERE lease.name = v_name;
    INSERT INTO pgbroker.lease_event (name, epoch, event, pid, db_user, application, address, info, reason)
    VALUES (v_name, v_lease.epoch, 'release', pg_backend_pid(), session_user,
            current_setting('application_name'), inet_client_addr(), v_lease.holder_info, 'released by its holder');
    RETURN true;
END
$$;
COMMENT ON FUNCTION pgbroker.broker_release(text, text) IS
$$Release lease NAME (a clean hand-over): marks the lease released and, for a session lease, drops the lock when the transaction commits.
A session lease is released by its holder's session (with its owner token, if the claim gave one); a TTL lease by its owner token, from any session.
Returns false, changing nothing, otherwise.$$;

CREATE FUNCTION pgbroker.broker_renew(name text, owner text, ttl interval DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(broker_renew.name);
    v_expires timestamptz;
BEGIN
    PERFORM pgbroker._name_check('lease', v_name, true);
    IF broker_renew.ttl IS NOT NULL AND broker_renew.ttl <= '0'::interval THEN
        RAISE EXCEPTION 'ttl must be positive, got %', broker_renew.ttl USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE pgbroker.lease l
       SET expires_at = clock_timestamp() + coalesce(broker_renew.ttl, l.ttl),
           ttl = coalesce(broker_renew.ttl, l.ttl),
           heartbeat_at = clock_timestamp()
     WHERE l.name = v_name AND l.state = 'held' AND l.expires_at > clock_timestamp()
       AND l.owner = broker_renew.owner
    RETURNING l.expires_at INTO v_expires;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'lease "%" is not held by this owner: its TTL lease expired, was released or was never claimed by it', v_name
            USING ERRCODE = 'PB002', HINT = 'Claim it again (a new epoch): work fenced with the old epoch is refused.';
    END IF;
    RETURN v_expires;
END
$$;
COMMENT ON FUNCTION pgbroker.broker_renew(text, text, interval) IS
$$Extend the TTL lease NAME held by OWNER to TTL (default: the claim's ttl) from now, and return when it now expires.
PB002 when it is not held by OWNER any more (expired, released, or claimed by another): claim again.$$;

CREATE FUNCTION pgbroker.broker_heartbeat(name text DEFAULT 'default')
RETURNS timestamptz
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(broker_heartbeat.name);
    v_at timestamptz;
BEGIN
    PERFORM pgbroker._name_check('lease', v_name, true);
    UPDATE pgbroker.lease
       SET heartbeat_at = clock_timestamp()
     WHERE lease.name = v_name
       AND state = 'held'
       AND expires_at IS NULL   -- a session lease: a TTL lease is renewed with broker_renew()
       AND holder_pid = pg_backend_pid()
       AND holder_backend_start = pgbroker._my_backend_start()
    RETURNING heartbeat_at INTO v_at;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'this session does not hold lease "%"', v_name
            USING ERRCODE = 'PB001', HINT = 'Claim it first with broker_claim().';
    END IF;
    RETURN v_at;
END
$$;
COMMENT ON FUNCTION pgbroker.broker_heartbeat(text) IS
$$Called by the holder's session to show it is not hung; returns the recorded time.
A claim with stale_after => X may terminate a holder whose last heartbeat is older than X.
PB001 when this session does not hold the lease.$$;

CREATE FUNCTION pgbroker.broker_assert(name text, epoch bigint)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_name(broker_assert.name);
    v_lease pgbroker.lease;
BEGIN
    PERFORM pgbroker._name_check('lease', v_name, false);
    IF broker_assert.epoch IS NULL THEN
        RAISE EXCEPTION 'epoch must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- FOR KEY SHARE: heartbeats go on, but a concurrent claim (FOR UPDATE)
    -- waits for this transaction, or this waits for the claim and sees it.
    SELECT * INTO v_lease FROM pgbroker.lease WHERE lease.name = v_name FOR KEY SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'lease "%" has never been claimed', v_name USING ERRCODE = 'PB002';
    END IF;
    IF v_lease.epoch <> broker_assert.epoch THEN
        RAISE EXCEPTION 'epoch % of lease "%" is stale: the current epoch is %', broker_assert.epoch, v_name, v_lease.epoch
            USING ERRCODE = 'PB002', DETAIL = format('holder_pid=%s claimed_at=%s', v_lease.holder_pid, v_lease.claimed_at);
    END IF;
    IF v_lease.state = 'expired' THEN
        RAISE EXCEPTION 'epoch % of lease "%" expired at %', broker_assert.epoch, v_name, v_lease.expires_at
            USING ERRCODE = 'PB002';
    END IF;
    IF v_lease.state <> 'held' THEN
        RAISE EXCEPTION 'epoch % of lease "%" was released', broker_assert.epoch, v_name USING ERRCODE = 'PB002';
    END IF;
    -- A TTL lease must not have expired; a session lease's holder must be
    -- alive and still hold the lock (a lock lost to pg_advisory_unlock_all()
    -- or DISCARD ALL counts as gone: another session could claim any moment).
    IF NOT pgbroker._lease_live(v_lease) THEN
        IF v_lease.expires_at IS NOT NULL THEN
            RAISE EXCEPTION 'epoch % of lease "%" expired at %', broker_assert.epoch, v_name, v_lease.expires_at
                USING ERRCODE = 'PB002';
        END IF;
        RAISE EXCEPTION 'the holder of epoch % of lease "%" (pid %) is gone or no longer holds its lock',
                broker_assert.epoch, v_name, v_lease.holder_pid
            USING ERRCODE = 'PB002';
    END IF;
END
$$;
COMMENT ON FUNCTION pgbroker.broker_assert(text, bigint) IS
$$Fencing check for use inside any transaction: raises PB002 unless EPOCH is the current epoch of lease NAME and its holder's session is alive and holds the lock.
Holds a key-share lock on the lease row until the transaction ends, so a concurrent claim cannot commit a newer epoch before this transaction does.$$;

CREATE FUNCTION pgbroker.broker_alive(name text DEFAULT 'default')
RETURNS boolean
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT pgbroker._name_check('lease', broker_alive.name, false);
    SELECT coalesce((SELECT pgbroker._lease_live(l) FROM pgbroker.lease l WHERE l.name = broker_alive.name), false);
$$;
CREATE FUNCTION pgbroker.lease_expiry_check(name text DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF lease_expiry_check.name IS NOT NULL THEN
        PERFORM pgbroker._name_check('lease', pgbroker._check_name(lease_expiry_check.name), false);
    END IF;
    RETURN pgbroker._lease_expire(lease_expiry_check.name);
END
$$;
COMMENT ON FUNCTION pgbroker.lease_expiry_check(text) IS
$$Record, and announce on lease_channel() (event expired), every TTL lease of NAME (NULL: of every name) whose time ran out unrenewed; returns how many.
The next claim of a name and broker_sweep() do it too; an observer that sees a TTL holder's expires_at pass calls it, so that every observer hears of the expiry.$$;

COMMENT ON FUNCTION pgbroker.broker_alive(text) IS
$$True when lease NAME is held and alive: a TTL lease not yet expired, a session lease whose holder's session exists and holds the lock; false otherwise (also for an unknown name).
pgbroker_reader and pgbroker_broker may ask; it reads pg_locks, which shows every role's sessions.$$;

-- ---------------------------------------------------------------------------
-- Broker state API.

CREATE FUNCTION pgbroker._holder_epoch(p_name text)
RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    v_epoch bigint;
BEGIN
    PERFORM pgbroker._name_check('lease', pgbroker._check_name(p_name), true);
    SELECT epoch INTO v_epoch FROM pgbroker.lease
     WHERE name = p_name
       AND state = 'held'
       AND expires_at IS NULL   -- a session lease; a TTL holder passes its epoch instead
       AND holder_pid = pg_backend_pid()
       AND holder_backend_start = pgbroker._my_backend_start();
    IF NOT FOUND THEN
        RAISE EXCEPTION 'this session does not hold lease "%"', p_name
            USING ERRCODE = 'PB001', HINT = 'Only the holder''s session may change broker state.';
    END IF;
    RETURN v_epoch;
END
$$;
COMMENT ON FUNCTION pgbroker._holder_epoch(text) IS
    'Internal: the epoch of lease p_name if this session holds it as a session lease, else PB001.';

CREATE FUNCTION pgbroker.broker_state_set(name text, key text, value jsonb)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_epoch bigint := pgbroker._holder_epoch(broker_state_set.name);
BEGIN
    IF broker_state_set.key IS NULL OR broker_state_set.value IS NULL THEN
        RAISE EXCEPTION 'key and value must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    INSERT INTO pgbroker.state AS s (name, epoch, key, value)
    VALUES (broker_state_set.name, v_epoch, broker_state_set.key, broker_state_set.value)
    ON CONFLICT ON CONSTRAINT state_pkey
    DO UPDATE SET value = excluded.value, updated_at = clock_timestamp();
END
$$;
COMMENT ON FUNCTION pgbroker.broker_state_set(text, text, jsonb) IS
    'Holder only (PB001 otherwise): set KEY to VALUE in the state of lease NAME. The next claim starts with an empty state.';

CREATE FUNCTION pgbroker.broker_state_delete(name text, key text)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_epoch bigint := pgbroker._holder_epoch(broker_state_delete.name);
BEGIN
    DELETE FROM pgbroker.state s
     WHERE s.name = broker_state_delete.name AND s.epoch = v_epoch AND s.key = broker_state_delete.key;
    RETURN FOUND;
END
$$;
COMMENT ON FUNCTION pgbroker.broker_state_delete(text, text) IS
    'Holder only (PB001 otherwise): delete KEY from the state of lease NAME; false when it was not set.';

CREATE FUNCTION pgbroker.lease_history_prune(older_than interval DEFAULT '30 days')
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_count bigint;
BEGIN
    IF older_than IS NULL OR older_than < '0'::interval THEN
        RAISE EXCEPTION 'older_than must be a non-negative interval' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    DELETE FROM pgbroker.lease_event WHERE at < clock_timestamp() - older_than;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;
COMMENT ON FUNCTION pgbroker.lease_history_prune(interval) IS
    'pgbroker_admin: delete lease history events older than OLDER_THAN; returns how many.';

-- ===== sql/200_clients.sql =====

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
    PERFORM set_config('pgbroker.registry_watching', 'on', false);   -- this session's own changes: see _registry_watched
    -- Wait for the changes that looked for watchers before we registered.
    PERFORM pg_advisory_xact_lock(pgbroker._lock_class_registry_write(), v_key);
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
    'Holder only: unregister client CLIENT_ID and drop all its subscriptions; false when it was not registered.';

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
As client_unregister() otherwise: from the holder's session or with the holder's current EPOCH. 22004 / 22023 for a NULL array or a NULL, empty or too long id, naming its position (client_ids[3]); nothing of the call is kept then.$$;

-- ===== sql/300_watched_tables.sql =====

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
    'Internal: ''pgbs''; (class, watch_id) is try-locked shared by writers'' triggers and taken exclusively by subscribe.';

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

-- ===== sql/400_subscriptions.sql =====

-- pgbroker: subscriptions, and the interest the triggers read.
--
-- A client subscribes to one row of a watched table (by key) or to the whole
-- table.  pgbroker.subscription holds one row per (client, table, key);
-- pgbroker.interest aggregates them per (table, key, broker) into the array of
-- client ids that the triggers (600_triggers.sql) copy into the outbox, so a
-- changed row costs one index probe whatever the number of its subscribers,
-- and the broker's fetch hands the ids over without looking anything up.
--
-- No gap, and no writer ever waits for a subscriber: writers' triggers
-- try-lock the table's watch lock shared (never queueing) and hold it to
-- commit; subscribe() takes it exclusively, so it waits for the writers
-- already past their trigger (up to its WAIT) and every later writer either
-- sees the new interest or finds the lock taken and writes its changes with
-- the subscribers left to be resolved at fetch time (600_triggers.sql).
--
-- Subscriptions and interest belong to an epoch, as clients do: those of an
-- earlier epoch are invisible (the triggers write nothing for an epoch whose
-- holder is gone, the views and calls compare the epoch) until
-- broker_sweep() deletes them; a new epoch's rows never touch theirs.
-- subscribe_many() makes many subscriptions in one statement, for a broker
-- whose clients come back after a restart.

-- No foreign keys: their checks run once per inserted row, and a broker
-- that restarts inserts its subscriptions by the hundred thousand.  The
-- functions keep what they would: subscribe locks its clients' rows (FOR KEY
-- SHARE, so an unregister waits for it or goes first), a deleted client's
-- subscriptions go with it (trigger _400_drop_interest, below), unwatch()
-- deletes its table's.
CREATE TABLE pgbroker.subscription (
    client_key bigint NOT NULL,
    watch_id integer NOT NULL,
    row_key jsonb NOT NULL,
    subscribed_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    PRIMARY KEY (client_key, watch_id, row_key)
);
-- The primary key is the only index: every one more is paid by each of the
-- hundreds of thousands of rows a restarting broker inserts (unwatch() and
-- the watched_tables view read a table's subscriptions by a scan).
COMMENT ON TABLE pgbroker.subscription IS 'Which client is subscribed to which row (or, with key JSON null, to the whole table). Internal: use subscribe().';
COMMENT ON COLUMN pgbroker.subscription.client_key IS 'The client.';
COMMENT ON COLUMN pgbroker.subscription.watch_id IS 'The watched table.';
COMMENT ON COLUMN pgbroker.subscription.row_key IS 'The row''s key encoded as jsonb (sql/README.md, "Key encoding"), or JSON null for the whole table.';
COMMENT ON COLUMN pgbroker.subscription.subscribed_at IS 'When.';

-- The subscriptions aggregated per (table, key, broker): what the triggers
-- read.  One index probe per changed row, whatever the number of clients.
CREATE TABLE pgbroker.interest (
    watch_id integer NOT NULL,   -- no foreign key either (see subscription); unwatch() deletes its table's
    row_key jsonb NOT NULL,
    name text NOT NULL,
    -- In the key: a new epoch's subscribers get rows of their own beside the
    -- earlier epoch's, which the sweep deletes without anyone waiting for it.
    epoch bigint NOT NULL,
    -- The broker's lease lock_key, so that the triggers test whether it is
    -- alive and wake it without looking its lease up.
    lock_key integer NOT NULL,
    -- client_ids, not client_keys: what the broker needs, copied as is into
    -- the outbox (a lookup per client at fetch time cost the broker ~3 µs each).
    clients text[] NOT NULL,
    PRIMARY KEY (watch_id, row_key, name, epoch)
)
-- Room on each page for a row's next version: a subscribe or an unregister
-- rewrites its row's clients, which no index holds, so the update is HOT
-- (no index entry to add) when the page has room.  Filled to the brim by a
-- restart's subscribe_many, every update cost two unique-index insertions.
WITH (fillfactor = 70);
-- The broker's rows (the sweep, a TRUNCATE, the fetch's resolution), and
-- the same key as the primary one in another order, UNIQUE: a statement that
-- names one row by its whole key is a unique probe by whichever index the
-- planner picks.  As (name, epoch) alone, right after subscribe_many() (no
-- ANALYZE yet) the planner took the rows of a new epoch for two and read
-- them all to shrink one client's ten (issue 45).
CREATE UNIQUE INDEX interest_name_epoch ON pgbroker.interest (name, epoch, watch_id, row_key);
COMMENT ON TABLE pgbroker.interest IS 'Internal: subscribed client_ids per watched row and broker, kept by subscribe/unsubscribe/client_unregister for the triggers.';
COMMENT ON COLUMN pgbroker.interest.watch_id IS 'The watched table.';
COMMENT ON COLUMN pgbroker.interest.row_key IS 'The row key (JSON null: whole table).';
COMMENT ON COLUMN pgbroker.interest.name IS 'The broker (lease name) of these clients.';
COMMENT ON COLUMN pgbroker.interest.epoch IS 'Its epoch: rows of an earlier epoch than the lease''s are invisible and swept by broker_sweep().';
COMMENT ON COLUMN pgbroker.interest.lock_key IS 'Its lease''s lock_key (liveness test and wake-up channel of the triggers).';
COMMENT ON COLUMN pgbroker.interest.clients IS 'client_ids of the subscribed clients, each once.';

-- ---------------------------------------------------------------------------
-- Subscriptions.

-- The registry_channel() payload of a subscribe or unsubscribe (200_clients.sql).
CREATE FUNCTION pgbroker._registry_subscription_event(p_event text, p_name text, p_epoch bigint, p_client_id text,
                                                      p_table text, p_key jsonb)
RETURNS text
LANGUAGE sql IMMUTABLE
AS $$
    SELECT pg_catalog.json_build_object('event', p_event, 'name', p_name, 'epoch', p_epoch, 'client_id', p_client_id,
                                        'table', p_table, 'key', p_key)::text
$$;
COMMENT ON FUNCTION pgbroker._registry_subscription_event(text, text, bigint, text, text, jsonb) IS
    'Internal: the registry_channel() payload of a subscribe or unsubscribe (key JSON null: the whole table).';

-- Strike client_ids[i] from the interest row (watch_ids[i], row_keys[i],
-- names[i], epochs[i]), for every i, deleting the rows left with none.
-- Three statements whatever the number of rows, each finding every row by a
-- probe on its whole key (a LATERAL subquery the planner cannot flatten into
-- a join, so never a scan of a broker's interest planned on stale
-- statistics): the cost is that of the rows named, whatever the table holds.
-- The rows are locked first, in one order (two of these never wait for each
-- other in a cycle: one order of the keys, by their hashes); the next statements, with a snapshot taken after those
-- locks, find each row as it was locked and change it by its ctid.
CREATE FUNCTION pgbroker._interest_shrink(p_watch_ids integer[], p_row_keys jsonb[], p_names text[], p_epochs bigint[],
                                          p_client_ids text[])
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_watch_ids integer[];
    v_row_keys jsonb[];
    v_names text[];
    v_epochs bigint[];
BEGIN
    PERFORM
       FROM (SELECT u.watch_id, u.row_key, u.name, u.epoch   -- (a row given twice is locked twice: no matter)
               FROM unnest(p_watch_ids, p_row_keys, p_names, p_epochs) AS u(watch_id, row_key, name, epoch)
              -- (jsonb compares slowly: sorting 100,000 keys took 0.4 s; their hashes first, the keys on a tie)
              ORDER BY u.watch_id, jsonb_hash(u.row_key), u.row_key, u.name, u.epoch) g
      CROSS JOIN LATERAL (SELECT FROM pgbroker.interest i
                           WHERE i.watch_id = g.watch_id AND i.row_key = g.row_key AND i.name = g.name AND i.epoch = g.epoch
                             FOR UPDATE) x;
    WITH gone AS (
        SELECT u.watch_id, u.row_key, u.name, u.epoch, array_agg(u.client_id) AS gone
          FROM unnest(p_watch_ids, p_row_keys, p_names, p_epochs, p_client_ids) AS u(watch_id, row_key, name, epoch, client_id)
         GROUP BY u.watch_id, u.row_key, u.name, u.epoch
    ), shrunk AS (
        UPDATE pgbroker.interest i
           SET clients = CASE WHEN cardinality(r.gone) = 1 THEN array_remove(i.clients, r.gone[1])
                              ELSE ARRAY(SELECT x.c FROM unnest(i.clients) AS x(c) WHERE x.c <> ALL (r.gone)) END
          FROM (SELECT g.gone, f.ctid AS row_ctid
                  FROM gone g
                 CROSS JOIN LATERAL (SELECT j.ctid FROM pgbroker.interest j
                                      WHERE j.watch_id = g.watch_id AND j.row_key = g.row_key AND j.name = g.name
                                        AND j.epoch = g.epoch
                                     OFFSET 0) f) r
         WHERE i.ctid = r.row_ctid
        RETURNING i.watch_id, i.row_key, i.name, i.epoch, cardinality(i.clients) AS left_over
    )
    SELECT array_agg(s.watch_id), array_agg(s.row_key), array_agg(s.name), array_agg(s.epoch)
      INTO v_watch_ids, v_row_keys, v_names, v_epochs
      FROM shrunk s WHERE s.left_over = 0;
    -- A row can change only once per statement: drop the emptied ones now.
    IF v_watch_ids IS NOT NULL THEN
        DELETE FROM pgbroker.interest i
         USING (SELECT f.ctid AS row_ctid
                  FROM unnest(v_watch_ids, v_row_keys, v_names, v_epochs) AS e(watch_id, row_key, name, epoch)
                 CROSS JOIN LATERAL (SELECT j.ctid FROM pgbroker.interest j
                                      WHERE j.watch_id = e.watch_id AND j.row_key = e.row_key AND j.name = e.name
                                        AND j.epoch = e.epoch
                                     OFFSET 0) f) r
         WHERE i.ctid = r.row_ctid AND cardinality(i.clients) = 0;
    END IF;
END
$$;
COMMENT ON FUNCTION pgbroker._interest_shrink(integer[], jsonb[], text[], bigint[], text[]) IS
    'Internal: strike client_ids[i] from the interest row of (watch_ids[i], row_keys[i], names[i], epochs[i]); rows left empty are deleted. A probe per row, locked in key order.';

-- Before subscribing to a table: its triggers must be in place (a
-- subscription to a table whose triggers are gone or disabled would never
-- hear of a change: triggers dropped by hand, or a dropped watched table
-- whose oid a new table reused), then the watch lock, exclusive against
-- writers' triggers (a shared try-lock they hold to commit): writers that
-- already read the interest without us commit first; later ones either see
-- us or, finding the lock taken, leave their subscribers to be resolved at
-- fetch time.  They never queue behind this request.  Held to commit.
CREATE FUNCTION pgbroker._subscribe_lock(p_watch pgbroker.watched, p_table regclass, p_wait interval)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_timeout text := current_setting('lock_timeout');
BEGIN
    IF (SELECT count(*) FROM pg_catalog.pg_trigger t
         WHERE t.tgrelid = p_watch.relid AND t.tgenabled <> 'D'
           AND t.tgname IN ('_pgbroker_watch_ins', '_pgbroker_watch_upd', '_pgbroker_watch_del', '_pgbroker_watch_trunc')) <> 4 THEN
        RAISE EXCEPTION 'the pgbroker triggers of table % are missing or disabled', p_table
            USING ERRCODE = 'PB021', HINT = 'An administrator must call pgbroker.watch() on it again (or ENABLE the triggers).';
    END IF;
    BEGIN
        PERFORM set_config('lock_timeout', pgbroker._wait_ms(p_wait), true);
        PERFORM pg_advisory_xact_lock(pgbroker._lock_class_watch(), p_watch.watch_id);
        PERFORM set_config('lock_timeout', v_timeout, true);
    EXCEPTION WHEN lock_not_available THEN
        RAISE EXCEPTION 'table % is busy: a writer transaction stayed open longer than %', p_watch.table_name, p_wait
            USING ERRCODE = 'PB022', HINT = 'Retry, or pass a longer wait.';
    END;
END
$$;
COMMENT ON FUNCTION pgbroker._subscribe_lock(pgbroker.watched, regclass, interval) IS
    'Internal: check a watched table''s triggers (PB021), then take its watch lock exclusively to commit, waiting at most p_wait for writers (PB022).';

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
    v_client bigint := pgbroker._client_key(v_name, v_epoch, subscribe.client_id);
    v_watch pgbroker.watched := pgbroker._watch_of(subscribe."table");
    v_key jsonb := pgbroker._encode_key(v_watch, subscribe.key);
BEGIN
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
$$;
COMMENT ON FUNCTION pgbroker.subscribe(text, regclass, jsonb, text, bigint, interval) IS
$$Holder only: subscribe client CLIENT_ID to the row of watched TABLE whose primary key is KEY (jsonb: a scalar for a
one-column key, an array in key order for a composite one), or to the whole table when KEY is NULL.
No gap: once it returns, every change that commits later is in the outbox, so a client that subscribes and then reads
the row misses nothing. Waits up to WAIT for writer transactions already past their trigger (PB022 after that);
writers never wait for it. Returns false when the subscription existed. PB010 unknown client, PB021 table not watched, 22023 bad key.$$;

CREATE FUNCTION pgbroker.subscribe_many(client_ids text[], "table" regclass, keys jsonb[], name text DEFAULT 'default',
                                        epoch bigint DEFAULT NULL, wait interval DEFAULT '5 s')
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Planned for each call's arrays: a generic plan, made for no size in particular, joined them in loops.
SET plan_cache_mode = force_custom_plan
-- Hash joins of the arrays: a merge join sorted both (the estimates made it look cheaper).
SET enable_mergejoin = off
AS $$
DECLARE
    v_name text := pgbroker._check_name(subscribe_many.name);
    v_epoch bigint := pgbroker._acting_epoch(v_name, subscribe_many.epoch);
    v_n integer := pgbroker._check_arrays('client_ids', array_ndims(subscribe_many.client_ids),
                                          cardinality(subscribe_many.client_ids), 'keys', array_ndims(subscribe_many.keys),
                                          cardinality(subscribe_many.keys), false);
    v_watch pgbroker.watched := pgbroker._watch_of(subscribe_many."table");
    v_keys jsonb[] := pgbroker._encode_keys(v_watch, subscribe_many.keys);
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
    -- its pairs needs looking for below.
    WITH ids AS (
        SELECT u.id, min(u.i) AS i FROM unnest(subscribe_many.client_ids) WITH ORDINALITY AS u(id, i) GROUP BY u.id
    )
    SELECT min(ids.i) FILTER (WHERE c.client_key IS NULL), array_agg(ids.id), array_agg(c.client_key),
           array_agg(NOT EXISTS (SELECT FROM pgbroker.subscription s
                                  WHERE s.client_key = c.client_key AND s.watch_id = v_watch.watch_id))
      INTO v_bad, v_ids, v_client_keys, v_fresh
      FROM ids
      LEFT JOIN LATERAL (SELECT x.client_key FROM pgbroker.client x
                          WHERE x.name = v_name AND x.epoch = v_epoch AND x.client_id = ids.id
                            FOR KEY SHARE) c ON true;
    IF v_bad IS NOT NULL THEN
        RAISE EXCEPTION 'client "%" (client_ids[%]) is not registered with broker "%"',
                subscribe_many.client_ids[v_bad], v_bad, v_name
            USING ERRCODE = 'PB010', HINT = 'Register it first with pgbroker.client_register() or client_register_many().';
    END IF;
    PERFORM pgbroker._subscribe_lock(v_watch, subscribe_many."table", subscribe_many.wait);
    v_watched := pgbroker._registry_watched(v_name);
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
          FROM (SELECT DISTINCT u.id, u.row_key FROM unnest(subscribe_many.client_ids, v_keys) AS u(id, row_key)) g
          JOIN clients c ON c.id = g.id
          -- an index probe per pair of a client that is not fresh, never a scan of what the table has
          LEFT JOIN LATERAL (SELECT true AS found FROM pgbroker.subscription s
                              WHERE NOT c.fresh
                                AND s.client_key = c.client_key AND s.watch_id = v_watch.watch_id AND s.row_key = g.row_key
                              LIMIT 1) e ON true
         WHERE e.found IS NULL
    ), added AS (
        INSERT INTO pgbroker.subscription (client_key, watch_id, row_key)
        SELECT n.client_key, v_watch.watch_id, n.row_key FROM new n
    ), interest AS (
        INSERT INTO pgbroker.interest AS i (watch_id, row_key, name, epoch, lock_key, clients)
        SELECT v_watch.watch_id, n.row_key, v_name, v_epoch, (SELECT l.lock_key FROM pgbroker.lease l WHERE l.name = v_name),
               array_agg(n.id)
          FROM new n
         GROUP BY n.row_key
        ON CONFLICT ON CONSTRAINT interest_pkey DO UPDATE SET clients = i.clients || excluded.clients
    )
    -- (A FILTER is tested before its aggregate's argument: nothing is
    -- announced while nobody watches.)
    SELECT count(*),
           sum(num_nulls(pg_notify('pgbroker_registry_' || md5(v_name),
                                   pgbroker._registry_subscription_event('subscribe', v_name, v_epoch, n.id,
                                                                         v_watch.relid::regclass::text, n.row_key))))
               FILTER (WHERE v_watched)
      INTO v_new, v_announced
      FROM new n;
    RETURN v_new;
END
$$;
COMMENT ON FUNCTION pgbroker.subscribe_many(text[], regclass, jsonb[], text, bigint, interval) IS
$$Holder only: subscribe client CLIENT_IDS[i] to the row of watched TABLE whose key is KEYS[i] (NULL: the whole table), for every i, in one statement; returns how many subscriptions were new.
As subscribe() otherwise, with one wait for the table's writers per call: no gap; PB010 for an unknown client, 22023 (or the cast's own SQLSTATE) for a bad key, each naming its position (client_ids[3], keys[3]); 22004 / 22023 for NULL arrays or arrays of different lengths; PB021, PB022 as subscribe(). Nothing of the call is kept when it fails.$$;

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
    v_client bigint := pgbroker._client_key(v_name, v_epoch, unsubscribe.client_id);
    v_watch pgbroker.watched := pgbroker._watch_of(unsubscribe."table");
    v_key jsonb := pgbroker._encode_key(v_watch, unsubscribe.key);
BEGIN
    DELETE FROM pgbroker.subscription s
     WHERE s.client_key = v_client AND s.watch_id = v_watch.watch_id AND s.row_key = v_key;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM pgbroker._interest_shrink(ARRAY[v_watch.watch_id], ARRAY[v_key], ARRAY[v_name], ARRAY[v_epoch],
                                      ARRAY[unsubscribe.client_id]);
    IF pgbroker._registry_watched(v_name) THEN
        PERFORM pg_notify('pgbroker_registry_' || md5(v_name),
                          pgbroker._registry_subscription_event('unsubscribe', v_name, v_epoch, unsubscribe.client_id,
                                                                v_watch.relid::regclass::text, v_key));
    END IF;
    RETURN true;
END
$$;
COMMENT ON FUNCTION pgbroker.unsubscribe(text, regclass, jsonb, text, bigint) IS
    'Holder only: drop the subscription of CLIENT_ID to KEY of TABLE (NULL: the whole-table one); false when there was none.';

-- ---------------------------------------------------------------------------
-- Keeping the interest in step with the client registry.

-- A deleted client's subscriptions go with it; one of the current epoch
-- (unregistered) also leaves the interest it made.  (The clients of earlier
-- epochs are deleted by broker_sweep() after their subscriptions, and their
-- interest is deleted whole.)  Once per statement, with the deleted rows in
-- hand: client_unregister_many() deletes ten thousand clients in one.  The
-- subscriptions are found by the primary key's first column, each interest
-- row by its whole key (_interest_shrink): no table here is joined on what
-- its statistics say.
CREATE FUNCTION pgbroker._interest_drop_clients()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_watch_ids integer[];
    v_row_keys jsonb[];
    v_names text[];
    v_epochs bigint[];
    v_client_ids text[];
BEGIN
    WITH gone AS (
        SELECT o.client_key, o.client_id, o.name, o.epoch,
               o.epoch = (SELECT l.epoch FROM pgbroker.lease l WHERE l.name = o.name) AS current
          FROM old_clients o
    ), subs AS (
        DELETE FROM pgbroker.subscription s WHERE s.client_key = ANY (ARRAY(SELECT g.client_key FROM gone g))
        RETURNING s.client_key, s.watch_id, s.row_key
    )
    SELECT array_agg(s.watch_id), array_agg(s.row_key), array_agg(g.name), array_agg(g.epoch), array_agg(g.client_id)
      INTO v_watch_ids, v_row_keys, v_names, v_epochs, v_client_ids
      FROM subs s JOIN gone g ON g.client_key = s.client_key
     WHERE g.current;
    IF v_watch_ids IS NOT NULL THEN
        PERFORM pgbroker._interest_shrink(v_watch_ids, v_row_keys, v_names, v_epochs, v_client_ids);
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pgbroker._interest_drop_clients() IS
    'Internal (statement trigger): delete the deleted clients'' subscriptions; those of the current epoch also leave pgbroker.interest.';

CREATE TRIGGER _400_drop_interest
AFTER DELETE ON pgbroker.client
REFERENCING OLD TABLE AS old_clients
FOR EACH STATEMENT EXECUTE FUNCTION pgbroker._interest_drop_clients();
COMMENT ON TRIGGER _400_drop_interest ON pgbroker.client IS 'A deleted client''s subscriptions go with it, and an unregistered one leaves the interest they made.';

-- ===== sql/500_outbox.sql =====

-- pgbroker: the outbox, wake-ups and delivery.
--
-- The watch triggers (600_triggers.sql) write one outbox row per changed row
-- and live broker, carrying the clients to tell (or NULL: resolved when
-- fetched, for the changes of REPEATABLE READ and SERIALIZABLE writers and
-- those written while a subscribe was under way).  The broker drains its rows with
-- outbox_fetch() and acknowledges them; while it drains it is "awake" and
-- writers send no NOTIFY, and when it runs out of work it goes to sleep with
-- broker_sleep(), after which the next writer wakes it with pg_notify on
-- wakeup_channel(name).

-- UNLOGGED: no WAL for the hot path.  Crash recovery empties it, and a
-- promoted standby has it empty; both end every broker session, so the next
-- claim starts a new epoch whose clients re-subscribe and re-read.  Rows of
-- an earlier epoch than the lease's are never fetched; broker_sweep()
-- deletes them.  Safe after a promotion because nothing in it must survive
-- one, and it has no state whose loss blocks writers: its ids come from a
-- LOGGED sequence (below), not from an identity column.
--
-- The sequence of its ids is LOGGED on purpose.  An identity column of an
-- UNLOGGED table gets an UNLOGGED sequence (PostgreSQL 15 and later), and
-- on PostgreSQL 15 (seen on 15.18; not on 15.20 nor 18.6) a standby that
-- replayed the sequence's creation and made no restartpoint since is
-- promoted with an all-zero sequence page: every nextval(), so every write
-- to a watched table, then fails with "bad magic number in sequence"
-- (XX000) until a checkpoint and a crash restart (issue 26;
-- tests/faults/test_failover_unlogged.py).  A logged sequence is
-- replicated like any table; it writes WAL once every 32 values, and the
-- writer's transaction writes WAL for its own change anyway.  A sequence of
-- its own (not an identity column made LOGGED) keeps its persistence
-- through pg_dump and restore.
CREATE SEQUENCE pgbroker.outbox_id_seq AS bigint;
COMMENT ON SEQUENCE pgbroker.outbox_id_seq IS
    'Ids of pgbroker.outbox rows. LOGGED although the outbox is UNLOGGED: an unlogged sequence can come out of a promotion unusable (sql/500_outbox.sql).';
CREATE UNLOGGED TABLE pgbroker.outbox (
    -- Unique by its sequence; indexed with the broker's name and epoch only
    -- (below): every index is one more hot page that all writers insert into.
    id bigint NOT NULL DEFAULT pg_catalog.nextval('pgbroker.outbox_id_seq'::pg_catalog.regclass),
    name text NOT NULL,
    epoch bigint NOT NULL,
    watch_id integer NOT NULL,
    op "char" NOT NULL,
    row_key jsonb,
    changed text[],
    clients text[],
    at timestamptz NOT NULL DEFAULT pg_catalog.statement_timestamp()
);
-- A fetch reads one epoch's rows in id order, never an earlier epoch's.
CREATE INDEX outbox_name_epoch_id ON pgbroker.outbox (name, epoch, id);
-- The rows whose clients are resolved at fetch time (none but under
-- REPEATABLE READ and SERIALIZABLE writers, or while a subscribe is under
-- way), oldest first: a fetch returns no row past the first of them.
CREATE INDEX outbox_unresolved ON pgbroker.outbox (name, epoch, id) WHERE clients IS NULL;
-- A queue table: every row is deleted soon after it is written, and a fetch
-- walks the dead index entries until VACUUM removes them (measured: an empty
-- fetch over 70,000 dead rows takes 3.5 ms instead of 0.13 ms).  Let
-- autovacuum visit it as soon as it holds a few thousand dead rows.
ALTER TABLE pgbroker.outbox SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000,
                                 autovacuum_vacuum_cost_delay = 0);
COMMENT ON TABLE pgbroker.outbox IS
    'Notification targets written by the watch triggers: one row per changed row and broker. UNLOGGED (sql/README.md, "Server crash and failover"). Internal: use outbox_fetch() / outbox_ack().';
COMMENT ON COLUMN pgbroker.outbox.id IS 'Increasing; for one row of a watched table, in commit order.';
COMMENT ON COLUMN pgbroker.outbox.name IS 'Broker (lease name) to deliver to.';
COMMENT ON COLUMN pgbroker.outbox.epoch IS 'Epoch of that broker when the change was written.';
COMMENT ON COLUMN pgbroker.outbox.watch_id IS 'The watched table.';
COMMENT ON COLUMN pgbroker.outbox.op IS 'I insert, U update, D delete, T truncate.';
COMMENT ON COLUMN pgbroker.outbox.row_key IS 'Key of the changed row (NULL for T).';
COMMENT ON COLUMN pgbroker.outbox.changed IS 'For U: the names of the columns whose value changed; NULL otherwise.';
COMMENT ON COLUMN pgbroker.outbox.clients IS 'client_ids of the clients to tell; NULL: whoever is subscribed when the row is fetched (see 600_triggers.sql).';
COMMENT ON COLUMN pgbroker.outbox.at IS 'Start of the statement that made the change.';

-- ---------------------------------------------------------------------------
-- Lock classes (first key of two-int4 advisory locks; second: see each).
CREATE FUNCTION pgbroker._lock_class_drain()
RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1885823607 $$;
COMMENT ON FUNCTION pgbroker._lock_class_drain() IS
    'Internal: ''pgbw''; (class, lease lock_key) is taken shared by writers that wake a broker and exclusively by broker_sleep().';

CREATE FUNCTION pgbroker._lock_class_awake()
RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1885823585 $$;
COMMENT ON FUNCTION pgbroker._lock_class_awake() IS
    'Internal: ''pgba''; (class, _epoch_key(epoch)) is held (session level) by the holder of a session lease''s epoch while it is awake and draining.';

-- ---------------------------------------------------------------------------
-- Wake-ups.
--
-- A broker that is awake holds the session-level "awake" lock of its epoch
-- and drains the outbox; writers see that and do not NOTIFY (every NOTIFY
-- serialises commits on a cluster-wide lock).  Writers take the "drain" lock
-- shared, held to commit, before they look.  To go to sleep the broker waits
-- until no writer holds "drain" (tries, never a queued request, so writers
-- go on seeing it awake meanwhile), takes it, releases "awake" and looks at
-- the outbox once more: a writer either committed before that last look, or
-- found "drain" taken or "awake" free and notifies.  This holds at every
-- isolation level, because the "awake" test is a lock, not a row a snapshot
-- could hide.  Keyed by the epoch, an awake broker's lock also tells writers
-- that its epoch's holder is alive (600_triggers.sql): no lock test of its
-- own per broker and statement while the broker drains.

CREATE FUNCTION pgbroker.wakeup_channel(name text DEFAULT 'default')
RETURNS text
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT pgbroker._name_check('lease', wakeup_channel.name, false);
    SELECT 'pgbroker_wakeup_' || lock_key FROM pgbroker.lease WHERE lease.name = wakeup_channel.name;
$$;
COMMENT ON FUNCTION pgbroker.wakeup_channel(text) IS
$$The LISTEN channel on which the broker of lease NAME is woken: 'pgbroker_wakeup_' followed by the lease's number
(never user text, so no quoting or length issue); the payload is the lease name. NULL before the first claim.$$;

-- Whether the holder of epoch P_EPOCH of the lease numbered P_LOCK_KEY is
-- alive: its "held" lock is taken (a try that fails: 100_lease.sql), or this
-- very session holds that epoch (its own locks never conflict with it).
-- The triggers ask only when the broker is not awake (600_triggers.sql).
CREATE FUNCTION pgbroker._epoch_alive(p_lock_key integer, p_epoch bigint)
RETURNS boolean
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN pg_try_advisory_lock_shared(pgbroker._lock_class_alive(), pgbroker._epoch_key(p_epoch))
                THEN pg_advisory_unlock_shared(pgbroker._lock_class_alive(), pgbroker._epoch_key(p_epoch))
                     AND EXISTS (SELECT FROM pgbroker.lease h
                                  WHERE h.lock_key = p_lock_key AND h.epoch = p_epoch AND h.state = 'held'
                                    AND h.holder_pid = pg_backend_pid()
                                    AND h.holder_backend_start = pgbroker._my_backend_start())
                ELSE true END
$$;
COMMENT ON FUNCTION pgbroker._epoch_alive(integer, bigint) IS
    'Internal: whether a session holds epoch p_epoch of the lease numbered p_lock_key (its alive lock is taken, or it is this session).';

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
COMMENT ON FUNCTION pgbroker._awake_held(integer) IS 'Internal: whether this session holds the awake lock (class, p_key), p_key an _epoch_key().';

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
    v_key := pgbroker._epoch_key(v_epoch);
    IF NOT pgbroker._awake_held(v_key) THEN
        PERFORM pg_advisory_lock(pgbroker._lock_class_awake(), v_key);
    END IF;
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
SET enable_seqscan = off  -- see outbox_fetch()
SET enable_bitmapscan = off
AS $$
DECLARE
    v_name text := pgbroker._check_name(broker_sleep.name);
    v_epoch bigint := pgbroker._holder_epoch(v_name);
    v_wait_ms text := pgbroker._wait_ms(broker_sleep.wait);   -- checked before anything changes
    v_deadline timestamptz := CASE WHEN broker_sleep.wait IS NULL THEN 'infinity'
                                   ELSE clock_timestamp() + (v_wait_ms || ' ms')::interval END;
    v_floor bigint;
    v_key integer;
    v_awake integer := pgbroker._epoch_key(v_epoch);
BEGIN
    SELECT lock_key INTO v_key FROM pgbroker.lease l WHERE l.name = v_name;
    -- Wait, still awake, until no writer holds the drain lock: by tries, so
    -- that writers never find a request of ours queued (they would take it
    -- for a broker going to sleep, and NOTIFY), and at most WAIT (a long
    -- writer transaction must not keep us from draining).
    WHILE NOT pg_try_advisory_xact_lock(pgbroker._lock_class_drain(), v_key) LOOP
        IF clock_timestamp() >= v_deadline THEN
            IF NOT pgbroker._awake_held(v_awake) THEN
                PERFORM pg_advisory_lock(pgbroker._lock_class_awake(), v_awake);
            END IF;
            RETURN 'busy';
        END IF;
        PERFORM pg_sleep(0.001);
    END LOOP;
    -- The drain lock is ours until this returns: writers from now on NOTIFY.
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
$$;
COMMENT ON FUNCTION pgbroker.broker_sleep(text, interval) IS
$$Holder only: declare the broker of lease NAME asleep, so that the next writer NOTIFYs it. Call it in autocommit mode.
Returns 'asleep' (outbox empty: LISTEN on wakeup_channel(NAME) and wait), 'pending' (rows arrived: still awake, fetch again)
or 'busy' (a writer transaction still open after WAIT: still awake; poll again soon).$$;

-- A broker that ends its epoch awake (a release, or a new claim of its own
-- session) stops being awake for that epoch when this commits: its lock
-- would otherwise tell writers the epoch is alive (600_triggers.sql).
CREATE FUNCTION pgbroker._awake_end()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF (NEW.state <> 'held' OR NEW.epoch <> OLD.epoch)
       AND OLD.holder_pid = pg_backend_pid() AND pgbroker._awake_held(pgbroker._epoch_key(OLD.epoch)) THEN
        PERFORM pg_advisory_unlock(pgbroker._lock_class_awake(), pgbroker._epoch_key(OLD.epoch));
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pgbroker._awake_end() IS
    'Internal deferred trigger: at commit, a session whose epoch ended (released, or replaced by its own new claim) drops its awake lock of that epoch.';

CREATE CONSTRAINT TRIGGER _500_awake_end
    AFTER UPDATE OF epoch, state ON pgbroker.lease
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION pgbroker._awake_end();
COMMENT ON TRIGGER _500_awake_end ON pgbroker.lease IS
    'Drops the awake lock of an epoch its own session ended, when the transaction commits.';

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
AS $$
DECLARE
    v_state text[] := string_to_array(current_setting('pgbroker.outbox_floor', true), ':');
    v_floor bigint := 0;
    v_s bigint;
    v_x xid8;
    v_when timestamptz;
    v_first bigint;
    v_dirty boolean := true;  -- the setting needs writing (unset, or another epoch's)
BEGIN
    -- Most calls: this epoch's state, nothing to move (no X taken, or X not
    -- yet below the oldest running transaction), no new (S, X) due.
    IF v_state[1] = p_epoch::text AND cardinality(v_state) = 5
       AND (NOT p_advance OR current_setting('transaction_isolation') <> 'read committed'
            OR CASE WHEN v_state[4] <> '' THEN v_state[4]::xid8 >= pg_snapshot_xmin(pg_current_snapshot())
                    ELSE pg_current_xact_id_if_assigned() IS NOT NULL
                         OR to_timestamp(nullif(v_state[5], '')::double precision)
                            >= clock_timestamp() - interval '100 ms' END) THEN
        RETURN v_state[2]::bigint;
    END IF;
    IF v_state[1] = p_epoch::text AND cardinality(v_state) = 5 THEN
        v_dirty := false;
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
        v_dirty := true;
    END IF;
    -- A new (S, X) needs an xid taken after reading S: only in a transaction
    -- that has none yet, and at most every 100 ms (each costs an xid).
    IF v_x IS NULL AND pg_current_xact_id_if_assigned() IS NULL
       AND (v_when IS NULL OR v_when < clock_timestamp() - interval '100 ms') THEN
        -- The last id handed out, read without a scan of the sequence:
        -- that scan has no index path, so under the readers' plan pins
        -- (see outbox_fetch) it would be disabled, and JIT-compiled.
        -- NULL (never called): 0, which only keeps the floor where it is.
        v_s := coalesce(pg_sequence_last_value('pgbroker.outbox_id_seq'::regclass), 0);
        v_x := pg_current_xact_id();
        v_when := clock_timestamp();
        v_dirty := true;
    END IF;
    IF v_dirty THEN
        PERFORM set_config('pgbroker.outbox_floor',
                           concat_ws(':', p_epoch, v_floor, coalesce(v_s::text, ''), coalesce(v_x::text, ''),
                                     coalesce(extract(epoch FROM v_when)::text, '')),
                           false);
    END IF;
    RETURN v_floor;
END
$$;
COMMENT ON FUNCTION pgbroker._outbox_floor(text, bigint, boolean) IS
    'Internal: the id below which this broker session''s outbox scans can start (see the comment above it in sql/500_outbox.sql); p_advance moves it up when that is safe.';

-- Rows written while a subscribe was under way name no clients (NULL):
-- whoever is subscribed when they are fetched is told.  Resolved in place;
-- a row left with nobody is deleted.
CREATE FUNCTION pgbroker._outbox_resolve(p_name text, p_epoch bigint)
RETURNS void
LANGUAGE sql
AS $$
    WITH resolved AS MATERIALIZED (
        SELECT o.ctid AS row_ctid,
               -- (A row's subscribers by two probes on the interest's whole key: an OR with the
               -- truncate's case made the planner read the table's whole interest for each row.)
               CASE WHEN o.op = 'T'
                    THEN ARRAY(SELECT DISTINCT s FROM pgbroker.interest i, unnest(i.clients) AS s
                                WHERE i.watch_id = o.watch_id AND i.name = p_name AND i.epoch = p_epoch
                                ORDER BY 1)
                    ELSE ARRAY(SELECT DISTINCT s FROM pgbroker.interest i, unnest(i.clients) AS s
                                WHERE i.watch_id = o.watch_id AND i.row_key IN (o.row_key, 'null'::jsonb)
                                  AND i.name = p_name AND i.epoch = p_epoch
                                ORDER BY 1) END AS clients
          FROM pgbroker.outbox o
         WHERE o.name = p_name AND o.epoch = p_epoch AND o.clients IS NULL
    ), told AS (
        -- Each row by its ctid (only this broker's session changes its rows): joined by (name, id), or
        -- (name, epoch, id) on the plan of a generic estimate of one row, each was looked for among all the
        -- epoch's rows, O(n^2): a fetch ran for minutes over 13,000 rows written while subscribes churned.
        UPDATE pgbroker.outbox o SET clients = r.clients
          FROM resolved r
         WHERE o.ctid = r.row_ctid AND r.clients <> '{}'
    )
    DELETE FROM pgbroker.outbox d USING resolved r WHERE d.ctid = r.row_ctid AND r.clients = '{}';
$$;
COMMENT ON FUNCTION pgbroker._outbox_resolve(text, bigint) IS
    'Internal: give the outbox rows of a broker written with clients NULL the clients subscribed now; drop those with none.';

-- The broker calls it in a loop, so its cost per call and per row is the
-- broker's cost: planned once per session (re-planning cost more than the
-- fetch itself: a one-row fetch 224 us re-planned, 85 us with the generic
-- plan), and as few statements as a call allows, each paying a snapshot:
-- one finds the holder's epoch and whether any row awaits its clients, one
-- acknowledges the previous batch and returns the next (the rows it
-- deletes are left out of those it returns).  Rows are returned as the
-- triggers wrote them: client ids, nothing looked up per row but the
-- table's name.  Rows written with clients NULL (by REPEATABLE READ and
-- SERIALIZABLE writers, and while a subscribe was under way) are resolved
-- first, and those left with nobody to tell are deleted rather than
-- returned.  Each statement sees the rows committed before it started, so
-- a writer may commit an unresolved row after the resolving statement and
-- before the last one: the last returns only the rows before the first
-- unresolved row it sees (an index probe, normally on nothing), and the
-- next call resolves that one.  So no row is returned without its clients,
-- and the rows of one row of a table still come in commit order.
--
-- Its plans, and outbox_ack()'s and broker_sleep()'s, are held to the
-- indexes (enable_seqscan and enable_bitmapscan off): the outbox's
-- statistics are those of the moment autovacuum last looked (a few live
-- rows on the pages a minute of churn left), every vacuum invalidates the
-- plans made on them, and the next may be a sequential scan of every page
-- per call, or a bitmap scan.  Neither marks the dead index entries it
-- passes as dead, as an index scan does, so the indexes then bloat: in
-- bench_endurance.py --no-data, outbox_name_epoch_id went from 16 kB to
-- 2.4 MB in the minute after the ack's plan turned to a sequential scan.
-- The pins decide speed only, never what a statement returns: the
-- wake-up handshake holds whatever the plans (tests/test_wakeup.py breaks
-- it on purpose to show the test sees it).  Every statement these
-- functions run, their helpers' too, must have an index path: PostgreSQL
-- 15 to 17 cost a disabled scan at disable_cost (1e10), far past
-- jit_above_cost, so a statement with none is JIT-compiled at every plan
-- (a test asserts that no plan of the broker loop is disabled or
-- compiled).
CREATE FUNCTION pgbroker.outbox_fetch(name text DEFAULT 'default', max_rows integer DEFAULT 1000, ack bigint[] DEFAULT NULL)
RETURNS TABLE (id bigint, "table" text, op text, key jsonb, changed text[], clients text[], at timestamptz)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
    v_epoch bigint;
    v_unresolved boolean;
    v_floor bigint;
BEGIN
    PERFORM pgbroker._name_check('lease', outbox_fetch.name, true);
    -- The holder's epoch, whether rows await their clients, and the floor
    -- when it has nothing to move (as _outbox_floor's first test: NULL
    -- otherwise, and _outbox_floor runs).
    SELECT l.epoch, EXISTS (SELECT FROM pgbroker.outbox u WHERE u.name = l.name AND u.epoch = l.epoch AND u.clients IS NULL),
           CASE WHEN f.s[1] = l.epoch::text AND cardinality(f.s) = 5
                     AND current_setting('transaction_isolation') = 'read committed'
                     AND CASE WHEN f.s[4] <> '' THEN f.s[4]::xid8 >= pg_snapshot_xmin(pg_current_snapshot())
                              ELSE to_timestamp(nullif(f.s[5], '')::double precision) >= clock_timestamp() - interval '100 ms' END
                THEN f.s[2]::bigint END
      INTO v_epoch, v_unresolved, v_floor
      FROM pgbroker.lease l,
           (SELECT string_to_array(current_setting('pgbroker.outbox_floor', true), ':') AS s) f
     WHERE l.name = outbox_fetch.name AND l.state = 'held' AND l.expires_at IS NULL
       AND l.holder_pid = pg_backend_pid() AND l.holder_backend_start = pgbroker._my_backend_start();
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
    IF EXISTS (SELECT FROM pgbroker.outbox_departed d
                WHERE d.name = outbox_fetch.name AND d.epoch = v_epoch AND d.last_id > v_floor) THEN
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
           o.op::text, o.row_key, o.changed, o.clients, o.at
      FROM pgbroker.outbox o
     WHERE o.name = outbox_fetch.name AND o.epoch = v_epoch AND o.id > v_floor
       AND (outbox_fetch.ack IS NULL OR o.id <> ALL (outbox_fetch.ack))
       AND o.id < COALESCE((SELECT min(u.id) FROM pgbroker.outbox u
                             WHERE u.name = outbox_fetch.name AND u.epoch = v_epoch AND u.clients IS NULL),
                           9223372036854775807)
     ORDER BY o.id
     LIMIT outbox_fetch.max_rows;
END
$$;
COMMENT ON FUNCTION pgbroker.outbox_fetch(text, integer, bigint[]) IS
$$Holder only: up to MAX_ROWS pending notifications of lease NAME, oldest first (for any one row: in commit order).
Each: id, table, op (I/U/D/T), key (jsonb, NULL for T), changed (column names, for U), clients (client ids to tell, each
once, never empty), at.
Rows stay until acknowledged, by outbox_ack() or by passing their ids as ACK to the next outbox_fetch() (one round
trip less): at-least-once delivery within the epoch.$$;

CREATE FUNCTION pgbroker.outbox_ack(name text, ids bigint[])
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
    v_name text := pgbroker._check_name(outbox_ack.name);
    v_epoch bigint := pgbroker._holder_epoch(v_name);
    v_count bigint;
BEGIN
    DELETE FROM pgbroker.outbox o WHERE o.name = v_name AND o.epoch = v_epoch AND o.id = ANY (outbox_ack.ids);
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;
COMMENT ON FUNCTION pgbroker.outbox_ack(text, bigint[]) IS
    'Holder only: acknowledge (delete) delivered notifications IDS of lease NAME; returns how many.';

-- ---------------------------------------------------------------------------
-- Unregistered clients are left out of the notifications still pending for
-- them when those are fetched, not struck from them when they leave: a
-- departure costs one row here whatever the backlog (striking it read every
-- pending row of the epoch: 164 ms per unregister over 100,000 rows, issue
-- 45).  A departure hides its client from the rows up to LAST_ID, the outbox
-- sequence's value when it was recorded: a writer that read the interest
-- after the unregister committed takes a later id, so a client registered
-- again under the same id hears of the changes after that.  A writer
-- transaction that read the interest before the unregister committed may
-- still name it in a later row: a broker ignores ids it no longer knows.
-- UNLOGGED like the outbox, whose rows it qualifies; a fetch deletes the
-- departures its floor has passed (no row they hide is left to fetch), the
-- sweep those of earlier epochs.
CREATE UNLOGGED TABLE pgbroker.outbox_departed (
    name text NOT NULL,
    epoch bigint NOT NULL,
    client_id text NOT NULL,
    last_id bigint NOT NULL,
    PRIMARY KEY (name, epoch, client_id)
);
-- The primary key is the only index: with a second one on (name, epoch,
-- last_id), a generic plan of the fetch's probe per client took the range
-- last_id >= id over every departure of the epoch, for each client of each
-- row (a fetch ran for minutes under churn).  The fetch reads the epoch's
-- departures above its floor whole, and they are few (those of the last
-- moments).
COMMENT ON TABLE pgbroker.outbox_departed IS
    'Internal: clients unregistered while notifications naming them may be pending; outbox_fetch() leaves them out of those rows.';
COMMENT ON COLUMN pgbroker.outbox_departed.name IS 'The broker (lease name) of the client.';
COMMENT ON COLUMN pgbroker.outbox_departed.epoch IS 'Its epoch.';
COMMENT ON COLUMN pgbroker.outbox_departed.client_id IS 'The unregistered client.';
COMMENT ON COLUMN pgbroker.outbox_departed.last_id IS 'The outbox rows with ids up to this one are fetched without the client.';

-- outbox_fetch() while departures are recorded above its floor: the same
-- rows, each client departed after the row was written left out (a probe
-- per client of the rows up to the last departure), and the rows left with
-- nobody deleted instead of returned.  Runs with outbox_fetch()'s settings.
CREATE FUNCTION pgbroker._outbox_fetch_departed(p_name text, p_epoch bigint, p_floor bigint, p_max_rows integer,
                                                p_ack bigint[])
RETURNS TABLE (id bigint, "table" text, op text, key jsonb, changed text[], clients text[], at timestamptz)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
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
           b.op::text, b.row_key, b.changed, b.clients, b.at
      FROM batch b
     WHERE b.clients <> '{}'
     ORDER BY b.id;
END
$$;
COMMENT ON FUNCTION pgbroker._outbox_fetch_departed(text, bigint, bigint, integer, bigint[]) IS
    'Internal: outbox_fetch() while clients departed (pgbroker.outbox_departed): the rows without them, those left with nobody deleted.';

-- Once per statement: client_unregister_many() deletes thousands at once.
CREATE FUNCTION pgbroker._outbox_forget_clients()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_last bigint;
BEGIN
    -- The last id handed out (NULL, never called: 0), read without a scan of the sequence.
    v_last := coalesce(pg_sequence_last_value('pgbroker.outbox_id_seq'::regclass), 0);
    -- (Clients of an earlier epoch: their rows are never fetched, and broker_sweep() deletes them.)
    INSERT INTO pgbroker.outbox_departed AS d (name, epoch, client_id, last_id)
    SELECT o.name, o.epoch, o.client_id, v_last
      FROM old_clients o
     WHERE o.epoch = (SELECT l.epoch FROM pgbroker.lease l WHERE l.name = o.name)
    ON CONFLICT (name, epoch, client_id) DO UPDATE SET last_id = excluded.last_id;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION pgbroker._outbox_forget_clients() IS
    'Internal (statement trigger): record the unregistered clients in pgbroker.outbox_departed; fetches leave them out of the rows pending then.';

CREATE TRIGGER _500_forget_client
AFTER DELETE ON pgbroker.client
REFERENCING OLD TABLE AS old_clients
FOR EACH STATEMENT EXECUTE FUNCTION pgbroker._outbox_forget_clients();
COMMENT ON TRIGGER _500_forget_client ON pgbroker.client IS 'An unregistered client is left out of the notifications pending for it when they are fetched.';

-- ===== sql/550_sweep.sql =====

-- pgbroker: sweeping what earlier epochs left.
--
-- A claim does not delete what the lease's earlier epochs left (broker
-- state, clients, subscriptions, interest, pending notifications): it makes
-- it invisible, since every reader compares the epoch with the lease's, so a
-- takeover costs the same whether the dead broker had no client or a
-- hundred thousand.  broker_sweep() deletes those rows afterwards, a bounded
-- batch per call, in a short transaction of its own.  A new epoch's rows
-- never share a key with an earlier epoch's (every key of these tables holds
-- the epoch, or a client of one epoch), so nobody waits for the rows a sweep
-- locks: writers, subscribers and the new broker go on as if it did not run.
-- The Python Broker sweeps after its claim; a broker in another language
-- calls broker_sweep() until it returns 0 (its loop's idle turn is a good
-- place), and the view pgbroker.sweep_backlog shows what is left.

CREATE FUNCTION pgbroker.broker_sweep(name text DEFAULT NULL, max_rows integer DEFAULT 10000)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_left bigint := broker_sweep.max_rows;
    v_done bigint;
    v_lease record;
    v_clients bigint[];
BEGIN
    IF broker_sweep.name IS NOT NULL THEN
        PERFORM pgbroker._check_name(broker_sweep.name);
    END IF;
    IF broker_sweep.max_rows IS NULL OR broker_sweep.max_rows < 1 THEN
        RAISE EXCEPTION 'max_rows must be at least 1, got %', coalesce(broker_sweep.max_rows::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The janitor's other duty: TTL leases that lapsed unnoticed (100_lease.sql).
    PERFORM pgbroker._lease_expire(broker_sweep.name);
    -- Rows another sweep has locked are skipped (FOR UPDATE SKIP LOCKED): two
    -- sweeps never wait for each other either.  Clients go MAX_ROWS / 16 at a
    -- time with all their subscriptions, so a batch is larger than MAX_ROWS
    -- only when they have more than 15 each.
    FOR v_lease IN SELECT l.name, l.epoch FROM pgbroker.lease l
                    WHERE broker_sweep.name IS NULL OR l.name = broker_sweep.name
                    ORDER BY l.name LOOP
        DELETE FROM pgbroker.outbox o
         WHERE o.ctid = ANY (ARRAY(SELECT x.ctid FROM pgbroker.outbox x
                                    WHERE x.name = v_lease.name AND x.epoch < v_lease.epoch
                                    LIMIT v_left FOR UPDATE SKIP LOCKED));
        GET DIAGNOSTICS v_done = ROW_COUNT;
        v_left := v_left - v_done;
        EXIT WHEN v_left <= 0;
        DELETE FROM pgbroker.outbox_departed d
         WHERE d.ctid = ANY (ARRAY(SELECT x.ctid FROM pgbroker.outbox_departed x
                                    WHERE x.name = v_lease.name AND x.epoch < v_lease.epoch
                                    LIMIT v_left FOR UPDATE SKIP LOCKED));
        GET DIAGNOSTICS v_done = ROW_COUNT;
        v_left := v_left - v_done;
        EXIT WHEN v_left <= 0;
        DELETE FROM pgbroker.interest i
         WHERE i.ctid = ANY (ARRAY(SELECT x.ctid FROM pgbroker.interest x
                                    WHERE x.name = v_lease.name AND x.epoch < v_lease.epoch
                                    LIMIT v_left FOR UPDATE SKIP LOCKED));
        GET DIAGNOSTICS v_done = ROW_COUNT;
        v_left := v_left - v_done;
        EXIT WHEN v_left <= 0;
        -- A batch of the earlier epochs' clients, their subscriptions first
        -- (found by their key: never a scan past clients already emptied).
        v_clients := ARRAY(SELECT x.client_key FROM pgbroker.client x
                            WHERE x.name = v_lease.name AND x.epoch < v_lease.epoch
                            LIMIT greatest(v_left / 16, 1) FOR UPDATE SKIP LOCKED);
        DELETE FROM pgbroker.subscription s WHERE s.client_key = ANY (v_clients);
        GET DIAGNOSTICS v_done = ROW_COUNT;
        v_left := v_left - v_done;
        DELETE FROM pgbroker.client c WHERE c.client_key = ANY (v_clients);
        GET DIAGNOSTICS v_done = ROW_COUNT;
        v_left := v_left - v_done;
        EXIT WHEN v_left <= 0;
        DELETE FROM pgbroker.state s
         WHERE s.ctid = ANY (ARRAY(SELECT x.ctid FROM pgbroker.state x
                                    WHERE x.name = v_lease.name AND x.epoch < v_lease.epoch
                                    LIMIT v_left FOR UPDATE SKIP LOCKED));
        GET DIAGNOSTICS v_done = ROW_COUNT;
        v_left := v_left - v_done;
        EXIT WHEN v_left <= 0;
    END LOOP;
    RETURN broker_sweep.max_rows - v_left;
END
$$;
COMMENT ON FUNCTION pgbroker.broker_sweep(text, integer) IS
$$Delete about MAX_ROWS rows that earlier epochs of lease NAME (NULL: of every lease) left behind: pending notifications (and the clients departed from them), interest, clients with their subscriptions, broker state, in that order. Returns how many it deleted: call it again until it returns 0. Also records and announces TTL leases that expired unnoticed (lease_expiry_check).
Those rows are invisible from the moment a new epoch is claimed; sweeping only frees their space. Nobody waits for a sweep (writers, subscribers and the new broker never touch those rows), and two sweeps skip each other's rows. Call it in autocommit mode, so each batch commits on its own.$$;

-- ===== sql/600_triggers.sql =====

-- pgbroker: the triggers on watched tables, and watch() / unwatch().
--
-- pgbroker.watch(table) installs, on a table with a primary key, three
-- statement-level triggers with transition tables (INSERT, UPDATE, DELETE)
-- and a TRUNCATE trigger.  Their functions are generated per table from the
-- templates below, whose {{slots}} _watch_install() fills with the table's
-- key and columns.  The rendering for initech.objects is committed as
-- sql/reference/initech_objects_triggers.sql (a test keeps it current).
-- After a single-row UPDATE a writer runs:
--
--   1. one try-lock, never a wait: the table's watch lock, shared, held to
--      commit; it orders the writer against subscribe() (400_subscriptions.sql);
--   2. one SELECT: is the statement large, does the table have whole-table
--      subscribers (two index probes);
--   3. one INSERT ... SELECT: for each change (I; U with the changed columns;
--      D; a key change is a D and an I; an UPDATE that changes nothing is no
--      change) the subscribers of its key, per broker (pgbroker.interest: one
--      index probe), one outbox row per change and broker whose holder is
--      alive; and for each such broker the wake-up test, which sends a
--      pg_notify only when it sleeps (500_outbox.sql).
--
-- Statements of more than 1,024 rows run an INSERT planned for their size
-- (EXECUTE: hash joins instead of the cached plan's index probe per row), and
-- test each broker once rather than per row.  Changes of a table with
-- whole-table subscribers merge those into each change's (per broker).
--
-- Two cases are conservative rather than exact, so that no writer ever waits:
-- when the watch lock is taken (a subscribe() is under way), and in a
-- REPEATABLE READ or SERIALIZABLE transaction (whose snapshot may predate a
-- subscription), a change is written for every live broker with its clients
-- left NULL, to be resolved against the subscriptions when it is fetched.
-- The broker then hears of a change that, had it come a moment later, only
-- some clients (or none) would have heard of: at-least-once, never a gap.

-- ---------------------------------------------------------------------------
-- Templates.  {{watch_id}}: the table's watch; {{changes}}: a query of the
-- statement's changes (op, row_key, changed); {{alive_and_woken:X}}: the
-- liveness and wake-up test of the broker of row X (a lease or interest row).

-- Small statements (the cached plan): one interest probe per change.
CREATE FUNCTION pgbroker._watch_fanout_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT z.name, z.epoch, {{watch_id}}, z.op, z.row_key, z.changed, z.clients
          FROM (SELECT i.name, i.epoch, i.lock_key, i.clients, k.op, k.row_key, k.changed
                  FROM ({{changes}} OFFSET 0) k
                 CROSS JOIN LATERAL (
                       -- An index probe per change, whatever the size the plan was made for
                       -- (a hash of the table's interest rows would then serve every later call).
                       SELECT j.name, j.epoch, j.lock_key, j.clients FROM pgbroker.interest j
                        WHERE j.watch_id = {{watch_id}} AND j.row_key = k.row_key OFFSET 0) i
                OFFSET 0) z  -- the test below runs on the rows to write, never on an interest scan
         WHERE {{alive_and_woken:z}}$t$
$template$;
COMMENT ON FUNCTION pgbroker._watch_fanout_template() IS
    'Internal: template of the INSERT ... SELECT by which the watch triggers fan out the changes of a small statement.';

-- Large statements (planned at each run): each broker with interest in the
-- table is tested (and woken) once, then joined; {{keyed}} is a query of the
-- changes with their whole OLD and NEW rows, so that only subscribed rows'
-- columns are compared ({{changed_late}}).
CREATE FUNCTION pgbroker._watch_bulk_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$
        WITH live AS MATERIALIZED (
            SELECT l.name, l.epoch FROM pgbroker.lease l
             WHERE l.state = 'held' AND l.expires_at IS NULL
               AND CASE WHEN EXISTS (SELECT FROM pgbroker.interest j
                                      WHERE j.watch_id = {{watch_id}} AND j.name = l.name AND j.epoch = l.epoch)
                        THEN {{alive_and_woken:l}} END)
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT z.name, z.epoch, {{watch_id}}, z.op, z.row_key, z.changed, z.clients
          FROM (SELECT i.name, i.epoch, i.clients, k.op, k.row_key, {{changed_late}} AS changed
                  FROM ({{keyed}} OFFSET 0) k
                  JOIN pgbroker.interest i ON i.watch_id = {{watch_id}} AND i.row_key = k.row_key
                  JOIN live ON live.name = i.name AND live.epoch = i.epoch
                OFFSET 0) z  -- compared after the join: only subscribed rows' columns
         WHERE z.op <> 'U' OR cardinality(z.changed) > 0$t$
$template$;
COMMENT ON FUNCTION pgbroker._watch_bulk_template() IS
    'Internal: template of the INSERT ... SELECT by which the watch triggers fan out the changes of a large statement.';

-- Tables with whole-table subscribers: each change's subscribers merged with
-- those, per broker and epoch.
CREATE FUNCTION pgbroker._watch_merged_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$
        WITH whole AS MATERIALIZED (
            SELECT i.name, i.epoch, i.lock_key, i.clients
              FROM pgbroker.interest i
             WHERE i.watch_id = {{watch_id}} AND i.row_key = 'null'::jsonb)
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT t.name, t.epoch, {{watch_id}}, k.op, k.row_key, k.changed, t.clients
          FROM ({{changes}} OFFSET 0) k
         CROSS JOIN LATERAL (
               -- Subscribers of the row, with the whole-table ones of the same broker ...
               SELECT r.name, r.epoch, r.lock_key,
                      CASE WHEN w.clients IS NULL THEN r.clients
                           ELSE ARRAY(SELECT DISTINCT c FROM unnest(r.clients || w.clients) AS c ORDER BY 1) END
                 FROM pgbroker.interest r
                 LEFT JOIN whole w ON w.name = r.name AND w.epoch = r.epoch
                WHERE r.watch_id = {{watch_id}} AND r.row_key = k.row_key
               UNION ALL
               -- ... and the whole-table ones of brokers with no subscriber of the row.
               SELECT w.name, w.epoch, w.lock_key, w.clients
                 FROM whole w
                WHERE NOT EXISTS (SELECT FROM pgbroker.interest r
                                   WHERE r.watch_id = {{watch_id}} AND r.row_key = k.row_key AND r.name = w.name
                                     AND r.epoch = w.epoch)
               ) AS t (name, epoch, lock_key, clients)
         WHERE {{alive_and_woken:t}}$t$
$template$;
COMMENT ON FUNCTION pgbroker._watch_merged_template() IS
    'Internal: template of the INSERT ... SELECT of a table with whole-table subscribers (merged per change and broker).';

-- A subscribe() is under way, or the snapshot may predate one: every live
-- broker gets the changes, their clients left NULL, resolved when fetched.
CREATE FUNCTION pgbroker._watch_unresolved_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$
        -- A subscribe() is under way, or the snapshot may predate one: every
        -- live broker gets the changes, their clients resolved when fetched.
        INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, changed, clients)
        SELECT l.name, l.epoch, {{watch_id}}, l.op, l.row_key, l.changed, NULL
          FROM (SELECT b.name, b.epoch, b.lock_key, k.op, k.row_key, k.changed
                  FROM ({{changes}} OFFSET 0) k
                 CROSS JOIN pgbroker.lease b
                 WHERE b.state = 'held' AND b.expires_at IS NULL
                OFFSET 0) l
         WHERE {{alive_and_woken:l}}$t$
$template$;
COMMENT ON FUNCTION pgbroker._watch_unresolved_template() IS
    'Internal: template of the INSERT ... SELECT that writes changes for every live broker with their clients left to be resolved at fetch.';

-- Whether the holder of the broker of row {{r}} (a lease, or the interest of
-- one of its epochs) is alive, and if so its wake-up.  Evaluated before the
-- outbox row is written, in this order:
--   - the broker is going to sleep (broker_sleep() holds the drain lock):
--     NOTIFY it, if the epoch's holder is alive;
--   - it is not awake (the awake lock of that epoch is free): it sleeps, or
--     the epoch has no holder (the broker is gone, or that epoch was
--     replaced by a new claim and its rows wait for broker_sweep()); if its
--     holder is alive, NOTIFY it, holding the drain lock shared to commit,
--     so broker_sleep() waits for this transaction or it hears the NOTIFY;
--     otherwise write nothing;
--   - it is awake and draining: it will see the row, and its holder is
--     alive (only the epoch's holder takes its awake lock, and drops it when
--     the epoch ends): no test of its own (500_outbox.sql).
-- Lock tests and not rows a snapshot could hide: right at every isolation
-- level.  A NOTIFY repeated in one transaction is sent once.
CREATE FUNCTION pgbroker._watch_alive_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$CASE
            WHEN NOT pg_try_advisory_xact_lock_shared(pgbroker._lock_class_drain(), {{r}}.lock_key)
                THEN pgbroker._epoch_alive({{r}}.lock_key, {{r}}.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || {{r}}.lock_key, {{r}}.name)) = 0
            WHEN pg_try_advisory_lock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key({{r}}.epoch))
                THEN pg_advisory_unlock_shared(pgbroker._lock_class_awake(), pgbroker._epoch_key({{r}}.epoch))
                     AND pgbroker._epoch_alive({{r}}.lock_key, {{r}}.epoch)
                     AND num_nulls(pg_notify('pgbroker_wakeup_' || {{r}}.lock_key, {{r}}.name)) = 0
            ELSE true
        END$t$
$template$;
COMMENT ON FUNCTION pgbroker._watch_alive_template() IS
    'Internal: template of the test "is the broker alive, and wake it if it sleeps" of the watch triggers.';

-- The trigger function of INSERT, UPDATE and DELETE.  {{transition}}: the
-- transition table that counts the statement's rows.  JIT is off for large
-- and merging statements: the planner estimates a join of transition tables
-- at rows(OLD) x rows(NEW) x 0.005, so from about 15,000 rows it passed
-- jit_above_cost and compiled, at more cost than it saved (100,000 rows: 40%).
CREATE FUNCTION pgbroker._watch_trigger_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$
DECLARE
    v_large boolean;
    v_whole boolean;
    v_jit text;
BEGIN
    IF pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), {{watch_id}})
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
$template$;
COMMENT ON FUNCTION pgbroker._watch_trigger_template() IS
    'Internal: template of the INSERT, UPDATE and DELETE trigger functions of a watched table (see sql/600_triggers.sql).';

-- Row mode: the trigger functions of INSERT, UPDATE and DELETE, run for
-- each changed row with OLD and NEW at hand (no transition tables, no join).
-- {{row_body}}: the fan-out of the row's change (below); for an UPDATE, of
-- the change of its columns, or of a D and an I when its key changed.
CREATE FUNCTION pgbroker._watch_row_trigger_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$
BEGIN
{{row_body}}
    RETURN NULL;
END
$t$
$template$;
COMMENT ON FUNCTION pgbroker._watch_row_trigger_template() IS
    'Internal: template of the row-level INSERT, UPDATE and DELETE trigger functions of a table watched in row mode.';

CREATE FUNCTION pgbroker._watch_row_update_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$    IF {{same_key}} THEN
{{fanout_update}}
    ELSE
        -- A key change: a D of the old key and an I of the new one.
{{fanout_rekey}}
    END IF;$t$
$template$;
COMMENT ON FUNCTION pgbroker._watch_row_update_template() IS
    'Internal: template of the body of the row-level UPDATE trigger function (an UPDATE of the key is a D and an I).';

-- The fan-out of one row's change(s), {{changes}} (a query over NEW and OLD
-- of one or two rows; an UPDATE that changes nothing has none): the tests
-- of statement mode, in as few steps as a row allows, for it runs once per
-- row.  The watch lock and isolation test, then whether the table has
-- whole-table subscribers, then one INSERT: the subscribers of the row's key
-- (pgbroker.interest: one index probe), one outbox row per live broker.
CREATE FUNCTION pgbroker._watch_row_fanout_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$        IF pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), {{watch_id}})
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
$template$;
COMMENT ON FUNCTION pgbroker._watch_row_fanout_template() IS
    'Internal: template of the fan-out of one row''s change(s) in the row-level trigger functions.';

-- The TRUNCATE trigger function: every client with any interest in the table
-- hears of it, one row per broker (of its live epoch).
CREATE FUNCTION pgbroker._watch_truncate_template()
RETURNS text
LANGUAGE sql IMMUTABLE
AS $template$ SELECT $t$
DECLARE
    v_jit text := current_setting('jit');
BEGIN
    IF pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), {{watch_id}})
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
$template$;
COMMENT ON FUNCTION pgbroker._watch_truncate_template() IS
    'Internal: template of the TRUNCATE trigger function of a watched table.';

-- Fill the {{slots}} of a template: each key of p_slots names a slot.  A slot
-- left unfilled is a bug in the generator, not a user error.
CREATE FUNCTION pgbroker._render(p_template text, p_slots jsonb)
RETURNS text
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_out text := p_template;
    v_slot text;
    v_value text;
BEGIN
    FOR v_slot, v_value IN SELECT key, value FROM jsonb_each_text(p_slots) LOOP
        v_out := replace(v_out, '{{' || v_slot || '}}', v_value);
    END LOOP;
    IF v_out ~ '\{\{[a-z_:]+\}\}' THEN
        RAISE EXCEPTION 'unfilled template slot %', substring(v_out FROM '\{\{[a-z_:]+\}\}');
    END IF;
    RETURN v_out;
END
$$;
COMMENT ON FUNCTION pgbroker._render(text, jsonb) IS 'Internal: replace each {{slot}} of a template by its value in p_slots.';

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
-- Watching a table.

-- The SQL expressions over the rows of a watched table, its NEW rows named
-- P_NEW and its OLD rows P_OLD (range variables n and o of the transition
-- tables, whole rows (k.n) and (k.o), or PL/pgSQL's NEW and OLD): the key
-- (jsonb, as _encode_key makes it) of each, whether they have the same key,
-- whether one is missing (a FULL JOIN found none), and the names of the
-- columns whose value changed.
CREATE FUNCTION pgbroker._watch_exprs(p_watch pgbroker.watched, p_new text, p_old text)
RETURNS jsonb
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_exprs jsonb;
    v_changed text;
BEGIN
    SELECT jsonb_build_object(
               'new_key', CASE WHEN count(*) = 1 THEN format('to_jsonb(%s.%I)', p_new, min(c))
                               ELSE format('jsonb_build_array(%s)', string_agg(format('%s.%I', p_new, c), ', ' ORDER BY i)) END,
               'old_key', CASE WHEN count(*) = 1 THEN format('to_jsonb(%s.%I)', p_old, min(c))
                               ELSE format('jsonb_build_array(%s)', string_agg(format('%s.%I', p_old, c), ', ' ORDER BY i)) END,
               'same_key', string_agg(format('%1$s.%3$I = %2$s.%3$I', p_new, p_old, c), ' AND ' ORDER BY i),
               'new_null', format('%s.%I IS NULL', p_new, min(c) FILTER (WHERE i = 1)),
               'old_null', format('%s.%I IS NULL', p_old, min(c) FILTER (WHERE i = 1)))
      INTO v_exprs
      FROM unnest(p_watch.key_columns) WITH ORDINALITY AS u(c, i);
    -- IS DISTINCT FROM where the type has an equality operator of its own,
    -- the text forms otherwise (json, xml, point...).
    SELECT format('array_remove(ARRAY[%s]::text[], NULL)',
                  string_agg(CASE WHEN to_regoperator(format('=(%s,%s)', t, t)) IS NOT NULL
                                  THEN format('CASE WHEN %1$s.%3$I IS DISTINCT FROM %2$s.%3$I THEN %3$L END',
                                              p_new, p_old, a.attname)
                                  ELSE format('CASE WHEN %1$s.%3$I::text IS DISTINCT FROM %2$s.%3$I::text THEN %3$L END',
                                              p_new, p_old, a.attname)
                             END, ', ' ORDER BY a.attnum))
      INTO v_changed
      FROM pg_catalog.pg_attribute a
      CROSS JOIN LATERAL format_type(a.atttypid, NULL) AS t
     WHERE a.attrelid = p_watch.relid AND a.attnum > 0 AND NOT a.attisdropped;
    RETURN v_exprs || jsonb_build_object('changed', v_changed);
END
$$;
COMMENT ON FUNCTION pgbroker._watch_exprs(pgbroker.watched, text, text) IS
    'Internal: the SQL expressions (keys, same key, missing row, changed columns) over the NEW and OLD rows of a watched table, named as given.';

-- The SQL expressions of a watched table that fill the templates' slots.
CREATE FUNCTION pgbroker._watch_slots(p_watch pgbroker.watched)
RETURNS jsonb
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    r jsonb := pgbroker._watch_exprs(p_watch, 'n', 'o');          -- over the transition tables' rows
    v_changed_k text := pgbroker._watch_exprs(p_watch, '(k.n)', '(k.o)') ->> 'changed';  -- whole rows (bulk)
    r_row jsonb := pgbroker._watch_exprs(p_watch, 'NEW', 'OLD');   -- one row (row mode)
BEGIN
    RETURN jsonb_build_object(
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
$$;
COMMENT ON FUNCTION pgbroker._watch_slots(pgbroker.watched) IS
    'Internal: the SQL expressions (key, changed columns, the changes of each kind of statement) that fill the trigger templates for a watched table.';

-- The source of a watched table's trigger function KIND (ins, upd, del, trunc).
CREATE FUNCTION pgbroker._watch_function_body(p_watch pgbroker.watched, p_kind text)
RETURNS text
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_slots jsonb := pgbroker._watch_slots(p_watch);
    v_body text;
    v_fanout text;
    v_row text;
BEGIN
    IF p_kind = 'trunc' THEN
        v_body := pgbroker._watch_truncate_template();  -- a statement trigger in both modes
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
                                                    'row_upd_changes', 'row_rekey_changes']);
END
$$;
COMMENT ON FUNCTION pgbroker._watch_function_body(pgbroker.watched, text) IS
    'Internal: render the trigger function of kind ins, upd, del or trunc of a watched table from the templates.';

CREATE FUNCTION pgbroker._watch_install(p_watch pgbroker.watched, p_wait interval)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_table regclass := p_watch.relid::regclass;
    v_kind text;
    v_event text;
    v_transitions text;
    v_fn text;
    -- Keys of a type whose to_jsonb() depends on session settings are
    -- encoded under fixed ones (see _key_settings).
    v_settings text := pgbroker._key_settings(p_watch.key_types);
    -- Whether it owns the table (only an owner may comment on its triggers).
    v_owner boolean := pgbroker._watch_check_rights(v_table,
                           EXISTS (SELECT FROM pg_catalog.pg_trigger t
                                    WHERE t.tgrelid = p_watch.relid AND t.tgname LIKE '\_pgbroker\_watch\_%'));
BEGIN
    PERFORM pgbroker._watch_lock_table(v_table, p_wait);
    PERFORM pgbroker._watch_drop_triggers(p_watch);
    FOR v_kind, v_event, v_transitions IN
        VALUES ('ins', 'INSERT', 'REFERENCING NEW TABLE AS pgbroker_new'),
               ('upd', 'UPDATE', 'REFERENCING OLD TABLE AS pgbroker_old NEW TABLE AS pgbroker_new'),
               ('del', 'DELETE', 'REFERENCING OLD TABLE AS pgbroker_old'),
               ('trunc', 'TRUNCATE', '')
    LOOP
        v_fn := format('pgbroker._watch_%s_%s', p_watch.watch_id, v_kind);
        -- SECURITY DEFINER: writers may not touch pgbroker's tables themselves.
        EXECUTE format('CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER '
                       'SET search_path = pg_catalog, pg_temp%s AS %L',
                       v_fn, CASE WHEN v_kind = 'trunc' THEN '' ELSE v_settings END,
                       pgbroker._watch_function_body(p_watch, v_kind));
        EXECUTE format('COMMENT ON FUNCTION %s() IS %L', v_fn,
                       format('Internal: %s trigger of watched table %s (generated by pgbroker.watch).', v_event, v_table));
        -- Generated functions are internal: nobody calls them but the triggers.
        EXECUTE format('REVOKE ALL ON FUNCTION %s() FROM PUBLIC', v_fn);
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
$$;
COMMENT ON FUNCTION pgbroker._watch_install(pgbroker.watched, interval) IS
    'Internal: (re)generate the trigger functions of a watched table and (re)create its triggers, of its mode, in the caller''s transaction under the table''s lock.';

CREATE FUNCTION pgbroker._watch_drop_triggers(p_watch pgbroker.watched)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_trigger text;
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid = p_watch.relid) THEN
        RETURN;   -- the table was dropped (its oid no longer names anything)
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

CREATE FUNCTION pgbroker.watch("table" regclass, wait interval DEFAULT '5 s', mode text DEFAULT 'statement')
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
    IF watch.mode IS NULL OR watch.mode NOT IN ('statement', 'row') THEN
        RAISE EXCEPTION 'unknown mode %', coalesce(quote_literal(watch.mode), 'NULL')
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'statement (statement-level triggers, the default) or row (row-level triggers).';
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
    INSERT INTO pgbroker.watched AS w (relid, table_name, key_columns, key_types, mode)
    VALUES (watch."table", watch."table"::text, v_cols, v_types, watch.mode)
    ON CONFLICT ON CONSTRAINT watched_relid_unique
    DO UPDATE SET table_name = excluded.table_name, mode = excluded.mode, watched_at = clock_timestamp()
    RETURNING * INTO v_watch;
    IF v_watch.key_columns IS DISTINCT FROM v_cols OR v_watch.key_types IS DISTINCT FROM v_types THEN
        RAISE EXCEPTION 'the primary key of % changed since it was watched', watch."table"
            USING ERRCODE = 'PB020', HINT = 'Subscriptions use the old key: unwatch() it, then watch() it again.';
    END IF;
    PERFORM pgbroker._watch_install(v_watch, watch.wait);
    RETURN v_watch.watch_id;
END
$$;
COMMENT ON FUNCTION pgbroker.watch(regclass, interval, text) IS
$$Admin: watch TABLE (an ordinary table with a primary key; 42809 for a view or other relation, PB020 without a key).
Installs triggers that write the subscribed clients of each changed row to the outbox and wake their brokers: with MODE
'statement' (the default) statement-level triggers with transition tables, best for tables changed in bulk; with MODE
'row' row-level ones, cheaper for single-row writes (TRUNCATE is a statement trigger in both); 22023 for another mode.
Both give the same notifications. Idempotent: call it again, with the same mode, after ALTER TABLE adds or removes
columns; with the other mode it switches the table's triggers in one transaction, with no gap. Returns the watch id.
Writers of the table never queue behind it: it asks for the table's lock in 50 ms tries with pauses between them, up to
WAIT (NULL: no limit), then fails with PB022.$$;

CREATE FUNCTION pgbroker.unwatch("table" regclass, wait interval DEFAULT '5 s')
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
    IF EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid = v_watch.relid) THEN
        PERFORM pgbroker._watch_check_rights(v_watch.relid::regclass, true);
        PERFORM pgbroker._watch_lock_table(v_watch.relid::regclass, unwatch.wait);
    END IF;
    PERFORM pgbroker._watch_drop_triggers(v_watch);
    EXECUTE format('DROP FUNCTION pgbroker._watch_%1$s_ins(), pgbroker._watch_%1$s_upd(), '
                   'pgbroker._watch_%1$s_del(), pgbroker._watch_%1$s_trunc()', v_watch.watch_id);
    DELETE FROM pgbroker.outbox WHERE watch_id = v_watch.watch_id;
    DELETE FROM pgbroker.subscription WHERE watch_id = v_watch.watch_id;
    DELETE FROM pgbroker.interest WHERE watch_id = v_watch.watch_id;
    DELETE FROM pgbroker.watched WHERE watch_id = v_watch.watch_id;
    RETURN true;
END
$$;
COMMENT ON FUNCTION pgbroker.unwatch(regclass, interval) IS
    'Admin: remove the pgbroker triggers from TABLE, with its subscriptions and pending notifications; false when it was not watched. Takes the table''s lock as watch() does (PB022 after WAIT).';

-- ===== sql/650_locks.sql =====

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

-- ===== sql/660_semaphores.sql =====

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

-- ===== sql/670_kv.sql =====

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

-- ===== sql/680_counters.sql =====

-- pgbroker: atomic counters.
--
-- One row per counter; every change is one INSERT ... ON CONFLICT DO UPDATE
-- statement, which PostgreSQL makes atomic under any number of concurrent
-- callers (the row lock serialises them and the update re-reads the row).

CREATE TABLE pgbroker.counter (
    name text PRIMARY KEY,
    value bigint NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp()
);
COMMENT ON TABLE pgbroker.counter IS 'Atomic counters. Internal: use counter_add(), counter_get(), counter_set(), counter_delete() and the view pgbroker.counters.';
COMMENT ON COLUMN pgbroker.counter.name IS 'The counter name, verbatim (1 to 200 bytes).';
COMMENT ON COLUMN pgbroker.counter.value IS 'Its value (an absent counter reads as 0).';
COMMENT ON COLUMN pgbroker.counter.updated_at IS 'When it last changed.';

CREATE FUNCTION pgbroker.counter_add(name text, delta bigint DEFAULT 1)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_value bigint;
BEGIN
    PERFORM pgbroker._name_check('counter', pgbroker._check_key(counter_add.name, 'counter name'), true);
    IF counter_add.delta IS NULL THEN
        RAISE EXCEPTION 'delta must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    INSERT INTO pgbroker.counter AS c (name, value)
    VALUES (counter_add.name, counter_add.delta)
    ON CONFLICT ON CONSTRAINT counter_pkey
    DO UPDATE SET value = c.value + excluded.value, updated_at = clock_timestamp()
    RETURNING c.value INTO v_value;
    RETURN v_value;
END
$$;
COMMENT ON FUNCTION pgbroker.counter_add(text, bigint) IS
    'Add DELTA (default 1, may be negative) to counter NAME (created at 0) in one atomic statement and return the new value; 22003 when it would leave the bigint range.';

CREATE FUNCTION pgbroker.counter_get(name text)
RETURNS bigint
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT pgbroker._name_check('counter', pgbroker._check_key(counter_get.name, 'counter name'), false);
    SELECT coalesce((SELECT c.value FROM pgbroker.counter c WHERE c.name = counter_get.name), 0);
$$;
COMMENT ON FUNCTION pgbroker.counter_get(text) IS 'The value of counter NAME; 0 when it does not exist.';

CREATE FUNCTION pgbroker.counter_set(name text, value bigint, expected bigint DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_key(counter_set.name, 'counter name');
BEGIN
    PERFORM pgbroker._name_check('counter', v_name, true);
    IF counter_set.value IS NULL THEN
        RAISE EXCEPTION 'value must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF counter_set.expected IS NULL OR counter_set.expected = 0 THEN
        -- Unconditional, or "currently 0", which an absent counter is too.
        INSERT INTO pgbroker.counter AS c (name, value) VALUES (v_name, counter_set.value)
        ON CONFLICT ON CONSTRAINT counter_pkey
        DO UPDATE SET value = excluded.value, updated_at = clock_timestamp()
         WHERE counter_set.expected IS NULL OR c.value = 0;
    ELSE
        UPDATE pgbroker.counter c SET value = counter_set.value, updated_at = clock_timestamp()
         WHERE c.name = v_name AND c.value = counter_set.expected;
    END IF;
    RETURN FOUND;
END
$$;
COMMENT ON FUNCTION pgbroker.counter_set(text, bigint, bigint) IS
    'Set counter NAME to VALUE and return true; with EXPECTED only when its current value is EXPECTED (an absent counter is 0): false, changing nothing, otherwise.';

-- A counter is data: it stays until deleted, however long nobody touches it.
-- A service that counts per entity (per order, per user) deletes an entity's
-- counter when it is done with it; nothing else removes it.
CREATE FUNCTION pgbroker.counter_delete(name text, expected bigint DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := pgbroker._check_key(counter_delete.name, 'counter name');
BEGIN
    PERFORM pgbroker._name_check('counter', v_name, true);
    DELETE FROM pgbroker.counter c
     WHERE c.name = v_name AND (counter_delete.expected IS NULL OR c.value = counter_delete.expected);
    RETURN FOUND;
END
$$;
COMMENT ON FUNCTION pgbroker.counter_delete(text, bigint) IS
    'Delete counter NAME (it reads as 0 again) and return true; with EXPECTED only when its value is EXPECTED. False, changing nothing, when it does not exist or its value differs.';

-- ===== sql/690_rate_limit.sql =====

-- pgbroker: rate limits (GCRA, judged on the database server's clock).
--
-- rate_limit(name, rate, per, burst, cost) allows at most RATE calls per PER
-- on average and at most BURST (default RATE) at once, for every caller of
-- NAME on every application server: one statement per decision, on the
-- server's clock_timestamp(), so the application servers' clocks and their
-- skew do not matter.
--
-- The algorithm is GCRA (the generic cell rate algorithm, as redis-cell and
-- the ATM networks use it), which is a token bucket kept as one number: the
-- theoretical arrival time TAT of a name.  With the emission interval
-- T = PER / RATE, a call of COST at time NOW is allowed when
--     max(TAT, NOW) + COST*T - NOW <= BURST*T,   i.e.   TAT <= NOW + (BURST - COST)*T
-- and then sets TAT to max(TAT, NOW) + COST*T; a denied call leaves TAT as it
-- was, so it costs later callers nothing.  Each allowed unit advances TAT by
-- T and TAT never passes NOW + BURST*T, so the allowed units of any set of
-- calls whose clock readings lie within an interval of length E number at
-- most BURST + E/T = BURST + RATE*E/PER, whatever their order.
--
-- Exact arithmetic.  Times are numeric counts of femtoseconds (10^-15 s)
-- since the epoch: clock_timestamp() has microseconds, so NOW is exact, and
-- T is PER/RATE rounded *up* to a whole femtosecond (exact integer division),
-- so rounding can only make the limit stricter, by at most one part in 10^9
-- for 10^6 calls per second.  Any integer RATE, BURST and COST and any
-- positive PER (a month counts 30 days, as extract(epoch) counts it) work,
-- with nothing to overflow.
--
-- Concurrency.  The decision is one INSERT ... ON CONFLICT DO UPDATE: the
-- row lock serialises the callers of a name and each decides on the latest
-- TAT.  NOW is read before the statement, so a caller that waited for the
-- row lock decides with a NOW older than the TAT it finds: that can only
-- deny it more (TAT - NOW is larger), never allow more.  Calls of different
-- names never wait for each other.  Parameters may differ between calls of
-- one name (each call is judged by its own): TAT is a time, so what earlier
-- calls used stays counted when RATE, PER or BURST change.
--
-- Crashes.  The state is an UNLOGGED table: no WAL on the callers' path, and
-- standbys do not have it.  Crash recovery (and a failover) empties it, so
-- every limit starts full again: the limiter fails open to a full bucket,
-- allowing at most one extra BURST per name.  A clean restart keeps it.
-- Safe after a promotion: nothing in it must survive one (no row is a full
-- bucket), and it has no sequence or identity column, nothing whose loss or
-- corruption could block a caller; its only index, the primary key, comes
-- back empty and usable (tests/faults/test_failover_unlogged.py calls
-- rate_limit() on a standby promoted without a restartpoint).
--
-- Operators see the view pgbroker.rate_limits (700_views.sql) and the
-- aggregate metrics of pgbroker.metrics (750_console.sql).

CREATE UNLOGGED TABLE pgbroker.rate_limit_state (
    name text PRIMARY KEY,
    tat numeric NOT NULL,
    rate integer NOT NULL,
    per interval NOT NULL,
    burst integer NOT NULL,
    allowed bigint NOT NULL,
    denied bigint NOT NULL,
    last_allowed boolean NOT NULL,
    updated_at timestamptz NOT NULL
) WITH (fillfactor = 50);   -- room on each page for HOT updates: every decision rewrites its row
COMMENT ON TABLE pgbroker.rate_limit_state IS
    'GCRA state of each rate limit (UNLOGGED: emptied by a crash, so every limit starts full). Internal: use rate_limit() and the view pgbroker.rate_limits.';
COMMENT ON COLUMN pgbroker.rate_limit_state.name IS 'The rate limit name, verbatim (1 to 200 bytes).';
COMMENT ON COLUMN pgbroker.rate_limit_state.tat IS
    'Theoretical arrival time, in femtoseconds since the epoch: a call of cost C is allowed when tat <= now + (burst - C) * per / rate.';
COMMENT ON COLUMN pgbroker.rate_limit_state.rate IS 'RATE of the last call.';
COMMENT ON COLUMN pgbroker.rate_limit_state.per IS 'PER of the last call.';
COMMENT ON COLUMN pgbroker.rate_limit_state.burst IS 'BURST of the last call (RATE when it passed NULL).';
COMMENT ON COLUMN pgbroker.rate_limit_state.allowed IS 'Calls allowed since the row was created (a crash resets it).';
COMMENT ON COLUMN pgbroker.rate_limit_state.denied IS 'Calls denied since the row was created (a crash resets it).';
COMMENT ON COLUMN pgbroker.rate_limit_state.last_allowed IS 'Whether the last call was allowed.';
COMMENT ON COLUMN pgbroker.rate_limit_state.updated_at IS 'Server clock of the last call.';

-- The emission interval PER/RATE in femtoseconds, rounded up.  No SET
-- clause (it is inlined into its callers, which pin their search_path), every
-- name qualified.
CREATE FUNCTION pgbroker._rate_limit_interval(p_rate integer, p_per interval)
RETURNS numeric
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT pg_catalog.div(EXTRACT(epoch FROM p_per) * 1000000000000000 + p_rate - 1, p_rate::numeric) $$;
COMMENT ON FUNCTION pgbroker._rate_limit_interval(integer, interval) IS
    'Internal: the GCRA emission interval PER / RATE in femtoseconds, rounded up (so that rounding never allows more).';

-- A number of microseconds as an interval of hours, minutes and seconds
-- only (no days, which timestamptz arithmetic would take as calendar days),
-- saturating at 9 * 10^18 microseconds (285,000 years).
CREATE FUNCTION pgbroker._rate_limit_duration(p_us numeric)
RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT pg_catalog.make_interval(secs => least(p_us, 9000000000000000000) / 1000000) $$;
COMMENT ON FUNCTION pgbroker._rate_limit_duration(numeric) IS
    'Internal: P_US microseconds as an interval without days (saturating at 9 * 10^18 microseconds).';

-- Why a call's parameters are refused; NULL when they are valid.
CREATE FUNCTION pgbroker._rate_limit_invalid(p_rate integer, p_per interval, p_burst integer, p_cost integer)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN p_rate IS NULL OR p_rate <= 0 THEN pg_catalog.format('rate must be a positive integer, got %s', coalesce(p_rate::text, 'NULL'))
        WHEN p_per IS NULL OR EXTRACT(epoch FROM p_per) <= 0 THEN pg_catalog.format('per must be a positive interval, got %s', coalesce(p_per::text, 'NULL'))
        WHEN p_burst <= 0 THEN pg_catalog.format('burst must be a positive integer or NULL (RATE), got %s', p_burst)
        WHEN p_cost IS NULL OR p_cost <= 0 THEN pg_catalog.format('cost must be a positive integer, got %s', coalesce(p_cost::text, 'NULL'))
        WHEN p_cost > coalesce(p_burst, p_rate) THEN
            pg_catalog.format('cost %s is above the burst %s: such a call could never be allowed', p_cost, coalesce(p_burst, p_rate))
    END
$$;
COMMENT ON FUNCTION pgbroker._rate_limit_invalid(integer, interval, integer, integer) IS
    'Internal: why rate_limit() refuses these parameters (22023), or NULL when they are valid.';

CREATE FUNCTION pgbroker.rate_limit(name text, rate integer, per interval, burst integer DEFAULT NULL,
                                    cost integer DEFAULT 1)
RETURNS TABLE (allowed boolean, retry_after interval, remaining integer)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name text := rate_limit.name;
    v_burst integer := coalesce(rate_limit.burst, rate_limit.rate);
    v_now numeric;      -- femtoseconds since the epoch
    v_t numeric;        -- the emission interval, femtoseconds
    v_limit numeric;    -- allowed when tat <= v_limit
    v_tat numeric;
    v_reason text;
BEGIN
    -- The hot path: checks inline; the helpers only word the error.
    IF v_name IS NULL OR v_name = '' OR octet_length(v_name) > 200 THEN
        PERFORM pgbroker._check_key(v_name, 'rate limit name');   -- 22023 with its message
    END IF;
    IF rate_limit.rate IS NULL OR rate_limit.rate <= 0 OR rate_limit.per IS NULL OR v_burst <= 0
       OR rate_limit.cost IS NULL OR rate_limit.cost <= 0 OR rate_limit.cost > v_burst
       OR EXTRACT(epoch FROM rate_limit.per) <= 0 THEN
        v_reason := pgbroker._rate_limit_invalid(rate_limit.rate, rate_limit.per, rate_limit.burst, rate_limit.cost);
        RAISE EXCEPTION '%', v_reason USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pgbroker._name_check('rate_limit', v_name, true);
    v_now := EXTRACT(epoch FROM clock_timestamp()) * 1000000000000000;
    v_t := pgbroker._rate_limit_interval(rate_limit.rate, rate_limit.per);
    v_limit := v_now + (v_burst - rate_limit.cost) * v_t;
    INSERT INTO pgbroker.rate_limit_state AS s
           (name, tat, rate, per, burst, allowed, denied, last_allowed, updated_at)
    VALUES (v_name, v_now + rate_limit.cost * v_t, rate_limit.rate, rate_limit.per, v_burst, 1, 0, true,
            clock_timestamp())
    ON CONFLICT ON CONSTRAINT rate_limit_state_pkey DO UPDATE
       SET tat = CASE WHEN s.tat <= v_limit THEN greatest(s.tat, v_now) + rate_limit.cost * v_t ELSE s.tat END,
           allowed = s.allowed + (s.tat <= v_limit)::integer,
           denied = s.denied + (s.tat > v_limit)::integer,
           last_allowed = s.tat <= v_limit,
           rate = excluded.rate, per = excluded.per, burst = excluded.burst, updated_at = excluded.updated_at
    RETURNING s.tat, s.last_allowed INTO v_tat, rate_limit.allowed;
    IF rate_limit.allowed THEN
        rate_limit.retry_after := '0';
    ELSE
        -- Until tat <= now + (burst - cost) * T, rounded up to the microsecond.
        rate_limit.retry_after := pgbroker._rate_limit_duration(ceil((v_tat - v_limit) / 1000000000));
    END IF;
    rate_limit.remaining := greatest(pg_catalog.div(v_limit + rate_limit.cost * v_t - v_tat, v_t), 0);
    RETURN NEXT;
END
$$;
COMMENT ON FUNCTION pgbroker.rate_limit(text, integer, interval, integer, integer) IS
$$Decide one call of COST (default 1) against the rate limit NAME (1 to 200 bytes): at most RATE per PER on average, and at most BURST (NULL: RATE) at once, for all callers of NAME together.
Returns allowed; retry_after, '0' when allowed, else how long until a call of this COST can be allowed (nobody else calling meanwhile); remaining, how many calls of cost 1 would be allowed right after this one.
GCRA on the server's clock, one statement per decision: concurrent callers are never allowed more than BURST + RATE * elapsed / PER, and a denied call uses nothing up. Works through any pooler; the name's row stays locked until the transaction ends, so call it in autocommit mode or last in a short transaction.
22023 for a bad name, or a RATE, PER, BURST or COST that is NULL (BURST may be), zero or negative, or a COST above BURST; nothing is changed then.
The state is UNLOGGED: a crash (or failover) forgets it and every limit starts full.$$;

-- A bucket that is full again (tat <= now: every unit has been earned back)
-- decides every call as a missing row does, so maintain() deletes such rows
-- (their allowed and denied counts go with them), a batch at a time,
-- skipping rows a caller holds.  A caller waiting for a row being deleted
-- then inserts a fresh, full, row.
CREATE FUNCTION pgbroker._rate_limit_upkeep(p_max integer, OUT removed bigint, OUT remaining bigint)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now numeric := EXTRACT(epoch FROM clock_timestamp()) * 1000000000000000;
BEGIN
    DELETE FROM pgbroker.rate_limit_state s
     WHERE s.ctid = ANY (ARRAY(SELECT x.ctid FROM pgbroker.rate_limit_state x
                                WHERE x.tat <= v_now LIMIT p_max FOR UPDATE SKIP LOCKED))
       AND s.tat <= v_now;
    GET DIAGNOSTICS removed = ROW_COUNT;
    SELECT count(*) INTO remaining
      FROM (SELECT FROM pgbroker.rate_limit_state x WHERE x.tat <= v_now LIMIT p_max) x;
END
$$;
COMMENT ON FUNCTION pgbroker._rate_limit_upkeep(integer) IS
    'Internal (maintain()): delete up to P_MAX rate limits whose bucket is full again (indistinguishable from no row); REMOVED deleted, REMAINING full ones left (at most P_MAX counted).';

-- ===== sql/700_views.sql =====

-- pgbroker: the views, the read-only interface for operators, frontends and
-- pgbroker_reader.  Tables are not an interface; these are.  Rows about a
-- name show only to roles that may read it by the name grants
-- (050_authority.sql): each view filters with name_allowed(), called only
-- when the kind has grants (else every name is readable, and the test costs
-- the view one probe, not a call per row), and tested before anything else
-- is computed for the row (a CASE or the WHERE of a subquery fenced by
-- OFFSET 0, since the functions it guards refuse names one may not read).
-- A broker's
-- clients, subscriptions, state and outbox are shown for the lease's current
-- epoch only: what earlier epochs left is invisible (sweep_backlog counts it).

-- ---------------------------------------------------------------------------
-- Views for operators and frontends.

CREATE VIEW pgbroker.brokers AS
SELECT l.name,
       l.epoch,
       l.state,
       l.holder_pid,
       l.holder_application,
       l.holder_address,
       l.holder_user,
       l.holder_info,
       l.claimed_at,
       l.heartbeat_at,
       pg_catalog.clock_timestamp() - l.heartbeat_at AS heartbeat_age,
       l.released_at,
       pgbroker.broker_alive(l.name) AS alive,
       -- 1885823602 is pgbroker._lock_class(), written out: readers of a view may not run internal functions.
       (SELECT count(*) FROM pg_catalog.pg_locks w
         WHERE w.locktype = 'advisory' AND NOT w.granted
           AND w.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())
           AND w.classid = 1885823602::oid AND w.objid = l.lock_key::oid AND w.objsubid = 2)::integer AS waiting
  FROM pgbroker.lease l
 WHERE (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'lease')
        OR pgbroker.name_allowed('lease', l.name));
COMMENT ON VIEW pgbroker.brokers IS 'One row per lease name: its epoch, holder and whether the holder is alive.';
COMMENT ON COLUMN pgbroker.brokers.name IS 'Lease name.';
COMMENT ON COLUMN pgbroker.brokers.epoch IS 'Current epoch (fencing token); 0 before the first claim.';
COMMENT ON COLUMN pgbroker.brokers.state IS 'new, held, released or expired (a TTL lease that lapsed, once noticed).';
COMMENT ON COLUMN pgbroker.brokers.holder_pid IS 'Backend pid of the holder (of the last holder when not alive).';
COMMENT ON COLUMN pgbroker.brokers.holder_application IS 'application_name of the holder at claim time.';
COMMENT ON COLUMN pgbroker.brokers.holder_address IS 'Client address of the holder; NULL over a Unix socket.';
COMMENT ON COLUMN pgbroker.brokers.holder_user IS 'Database user of the holder.';
COMMENT ON COLUMN pgbroker.brokers.holder_info IS 'Free text the holder gave when claiming (info =>).';
COMMENT ON COLUMN pgbroker.brokers.claimed_at IS 'When the current epoch was claimed.';
COMMENT ON COLUMN pgbroker.brokers.heartbeat_at IS 'Last heartbeat of the holder.';
COMMENT ON COLUMN pgbroker.brokers.heartbeat_age IS 'How long ago that was.';
COMMENT ON COLUMN pgbroker.brokers.released_at IS 'When the holder released the lease, if it did.';
COMMENT ON COLUMN pgbroker.brokers.alive IS 'True when the recorded holder''s backend exists and holds the lock.';
COMMENT ON COLUMN pgbroker.brokers.waiting IS 'Number of sessions blocked in broker_claim() for this lease.';

CREATE VIEW pgbroker.lease_history AS
SELECT id, name, epoch, event, at, pid, db_user, application, address, info,
       previous_epoch, previous_pid, previous_application, previous_address, previous_heartbeat_at, reason
  FROM pgbroker.lease_event
 WHERE (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'lease')
        OR pgbroker.name_allowed('lease', name));
COMMENT ON VIEW pgbroker.lease_history IS 'Every claim, takeover, release and expiry, oldest first by id: who took the lease from whom, when and why. Each was announced on lease_channel() as it committed.';
COMMENT ON COLUMN pgbroker.lease_history.id IS 'Increasing event number.';
COMMENT ON COLUMN pgbroker.lease_history.name IS 'Lease name.';
COMMENT ON COLUMN pgbroker.lease_history.epoch IS 'Epoch claimed or released.';
COMMENT ON COLUMN pgbroker.lease_history.event IS 'claim, takeover, stale_takeover, release or expired.';
COMMENT ON COLUMN pgbroker.lease_history.at IS 'When it happened (clock time inside the claiming transaction).';
COMMENT ON COLUMN pgbroker.lease_history.pid IS 'Backend pid of the session that acted.';
COMMENT ON COLUMN pgbroker.lease_history.db_user IS 'Database user (session_user) that acted.';
COMMENT ON COLUMN pgbroker.lease_history.application IS 'Its application_name.';
COMMENT ON COLUMN pgbroker.lease_history.address IS 'Its client address.';
COMMENT ON COLUMN pgbroker.lease_history.info IS 'The info text given to broker_claim().';
COMMENT ON COLUMN pgbroker.lease_history.previous_epoch IS 'For a claim: the epoch it replaced.';
COMMENT ON COLUMN pgbroker.lease_history.previous_pid IS 'For a claim: the previous holder''s pid.';
COMMENT ON COLUMN pgbroker.lease_history.previous_application IS 'For a claim: the previous holder''s application_name.';
COMMENT ON COLUMN pgbroker.lease_history.previous_address IS 'For a claim: the previous holder''s address.';
COMMENT ON COLUMN pgbroker.lease_history.previous_heartbeat_at IS 'For a claim: the previous holder''s last heartbeat.';
COMMENT ON COLUMN pgbroker.lease_history.reason IS 'Why, in words.';

CREATE VIEW pgbroker.broker_state AS
SELECT s.name, s.epoch, s.key, s.value, s.updated_at
  FROM pgbroker.state s
  JOIN pgbroker.lease l ON l.name = s.name AND l.epoch = s.epoch
 WHERE (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'lease')
        OR pgbroker.name_allowed('lease', s.name));
COMMENT ON VIEW pgbroker.broker_state IS 'Key/value state published by the current broker of each lease.';
COMMENT ON COLUMN pgbroker.broker_state.name IS 'Lease name.';
COMMENT ON COLUMN pgbroker.broker_state.epoch IS 'Epoch of the broker that wrote it.';
COMMENT ON COLUMN pgbroker.broker_state.key IS 'Key.';
COMMENT ON COLUMN pgbroker.broker_state.value IS 'Value.';
COMMENT ON COLUMN pgbroker.broker_state.updated_at IS 'When it was last set.';

-- ---------------------------------------------------------------------------
-- Views.

CREATE VIEW pgbroker.watched_tables AS
SELECT w.relid::regclass AS "table", w.key_columns, w.mode, w.watched_at,
       (SELECT count(*) FROM pgbroker.subscription s
          JOIN pgbroker.client c ON c.client_key = s.client_key
          JOIN pgbroker.lease l ON l.name = c.name AND l.epoch = c.epoch
         WHERE s.watch_id = w.watch_id) AS subscriptions
  FROM pgbroker.watched w;
COMMENT ON VIEW pgbroker.watched_tables IS 'Tables watched by pgbroker, with their key columns, trigger mode and number of subscriptions.';
COMMENT ON COLUMN pgbroker.watched_tables."table" IS 'The watched table.';
COMMENT ON COLUMN pgbroker.watched_tables.key_columns IS 'Its primary-key columns, in the order used by key encoding.';
COMMENT ON COLUMN pgbroker.watched_tables.mode IS 'How its triggers fire: statement (once per statement, with transition tables) or row (once per changed row); see watch().';
COMMENT ON COLUMN pgbroker.watched_tables.watched_at IS 'When watch() last installed its triggers.';
COMMENT ON COLUMN pgbroker.watched_tables.subscriptions IS 'Number of subscriptions to it (of the brokers'' current epochs).';

CREATE VIEW pgbroker.subscriptions AS
SELECT c.name, c.client_id, w.relid::regclass AS "table",
       CASE WHEN s.row_key = 'null'::jsonb THEN NULL ELSE s.row_key END AS key, s.subscribed_at
  FROM (SELECT l.name, l.epoch FROM pgbroker.lease l
         WHERE CASE WHEN (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'lease')
                          OR pgbroker.name_allowed('lease', l.name)) THEN pgbroker.broker_alive(l.name) END
        OFFSET 0) l  -- once per lease
  JOIN pgbroker.client c ON c.name = l.name AND c.epoch = l.epoch
  JOIN pgbroker.subscription s ON s.client_key = c.client_key
  JOIN pgbroker.watched w ON w.watch_id = s.watch_id;
COMMENT ON VIEW pgbroker.subscriptions IS 'Who is subscribed to what: the clients of live brokers, as in the view clients.';
COMMENT ON COLUMN pgbroker.subscriptions.name IS 'Broker (lease name) of the client.';
COMMENT ON COLUMN pgbroker.subscriptions.client_id IS 'The client.';
COMMENT ON COLUMN pgbroker.subscriptions."table" IS 'The watched table.';
COMMENT ON COLUMN pgbroker.subscriptions.key IS 'The row key (jsonb), NULL for a whole-table subscription.';
COMMENT ON COLUMN pgbroker.subscriptions.subscribed_at IS 'When.';

CREATE VIEW pgbroker.outbox_pending AS
SELECT o.name, count(*) AS pending, min(o.at) AS oldest
  FROM pgbroker.outbox o
  JOIN pgbroker.lease l ON l.name = o.name AND l.epoch = o.epoch
 WHERE (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'lease')
        OR pgbroker.name_allowed('lease', o.name))
 GROUP BY o.name;
COMMENT ON VIEW pgbroker.outbox_pending IS 'Undelivered notifications per broker (of its current epoch): how many and since when.';
COMMENT ON COLUMN pgbroker.outbox_pending.name IS 'Broker (lease name).';
COMMENT ON COLUMN pgbroker.outbox_pending.pending IS 'Notifications not yet acknowledged.';
COMMENT ON COLUMN pgbroker.outbox_pending.oldest IS 'Statement time of the oldest one.';

CREATE VIEW pgbroker.clients AS
SELECT c.name, c.epoch, c.client_id, c.info, c.registered_at, c.updated_at,
       (SELECT count(*) FROM pgbroker.subscription s WHERE s.client_key = c.client_key)::integer AS subscriptions
  FROM (SELECT l.name, l.epoch FROM pgbroker.lease l
         WHERE CASE WHEN (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'lease')
                          OR pgbroker.name_allowed('lease', l.name)) THEN pgbroker.broker_alive(l.name) END
        OFFSET 0) l  -- once per lease
  JOIN pgbroker.client c ON c.name = l.name AND c.epoch = l.epoch;
COMMENT ON VIEW pgbroker.clients IS 'Clients connected to live brokers, with their broker (lease name) and epoch.';
COMMENT ON COLUMN pgbroker.clients.name IS 'Lease name of the broker the client is connected to.';
COMMENT ON COLUMN pgbroker.clients.epoch IS 'Epoch of that broker.';
COMMENT ON COLUMN pgbroker.clients.client_id IS 'Client identifier given by the broker.';
COMMENT ON COLUMN pgbroker.clients.info IS 'What the broker knows of the client (address, version...).';
COMMENT ON COLUMN pgbroker.clients.registered_at IS 'When it was registered.';
COMMENT ON COLUMN pgbroker.clients.updated_at IS 'When its info last changed.';
COMMENT ON COLUMN pgbroker.clients.subscriptions IS 'How many subscriptions it has.';

CREATE VIEW pgbroker.sweep_backlog AS
SELECT l.name, l.epoch,
       (SELECT count(*) FROM pgbroker.client c WHERE c.name = l.name AND c.epoch < l.epoch) AS clients,
       (SELECT count(*) FROM pgbroker.client c JOIN pgbroker.subscription s ON s.client_key = c.client_key
         WHERE c.name = l.name AND c.epoch < l.epoch) AS subscriptions,
       (SELECT count(*) FROM pgbroker.interest i WHERE i.name = l.name AND i.epoch < l.epoch) AS interest,
       (SELECT count(*) FROM pgbroker.outbox o WHERE o.name = l.name AND o.epoch < l.epoch) AS outbox,
       (SELECT count(*) FROM pgbroker.state s WHERE s.name = l.name AND s.epoch < l.epoch) AS state
  FROM pgbroker.lease l
 WHERE (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'lease')
        OR pgbroker.name_allowed('lease', l.name));
COMMENT ON VIEW pgbroker.sweep_backlog IS
    'Per lease: the rows its earlier epochs left that broker_sweep() has yet to delete (invisible everywhere else; they only take space).';
COMMENT ON COLUMN pgbroker.sweep_backlog.name IS 'Lease name.';
COMMENT ON COLUMN pgbroker.sweep_backlog.epoch IS 'Its current epoch.';
COMMENT ON COLUMN pgbroker.sweep_backlog.clients IS 'Clients of earlier epochs.';
COMMENT ON COLUMN pgbroker.sweep_backlog.subscriptions IS 'Their subscriptions.';
COMMENT ON COLUMN pgbroker.sweep_backlog.interest IS 'Interest rows of earlier epochs (what the triggers read).';
COMMENT ON COLUMN pgbroker.sweep_backlog.outbox IS 'Notifications of earlier epochs, never to be fetched.';
COMMENT ON COLUMN pgbroker.sweep_backlog.state IS 'Broker state rows of earlier epochs.';

-- ---------------------------------------------------------------------------
-- The coordination primitives.  pg_stat_activity shows other roles' sessions
-- (application_name, backend_start) only to roles with pg_read_all_stats:
-- without it, application and holder_since are NULL for them.  Who holds
-- what comes from pg_locks, which every role sees whole.

CREATE VIEW pgbroker.locks AS
SELECT n.name,
       CASE WHEN l.mode = 'ExclusiveLock' THEN 'exclusive' ELSE 'shared' END AS mode,
       l.pid AS holder_pid,
       a.application_name AS application,
       a.backend_start AS holder_since,
       (SELECT count(*) FROM pg_catalog.pg_locks w
         WHERE w.locktype = 'advisory' AND NOT w.granted AND w.database = l.database
           AND w.classid = l.classid AND w.objid = l.objid AND w.objsubid = 2)::integer AS waiting,
       (SELECT min(w.waitstart) FROM pg_catalog.pg_locks w
         WHERE w.locktype = 'advisory' AND NOT w.granted AND w.database = l.database
           AND w.classid = l.classid AND w.objid = l.objid AND w.objsubid = 2) AS waiting_since
  FROM pg_catalog.pg_locks l
  JOIN pgbroker.lock_name n ON n.key = l.objid::integer
  LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
   AND l.classid = 1885823596::oid   -- named locks ('pgbl')
   AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())
   AND (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'lock')
        OR pgbroker.name_allowed('lock', n.name));
COMMENT ON VIEW pgbroker.locks IS 'Named locks held now: one row per holder and mode, with how many sessions wait for the lock.';
COMMENT ON COLUMN pgbroker.locks.name IS 'Lock name.';
COMMENT ON COLUMN pgbroker.locks.mode IS 'exclusive or shared.';
COMMENT ON COLUMN pgbroker.locks.holder_pid IS 'Backend pid of a holder.';
COMMENT ON COLUMN pgbroker.locks.application IS 'Its application_name (NULL for other roles'' sessions without pg_read_all_stats).';
COMMENT ON COLUMN pgbroker.locks.holder_since IS 'When the holder''s session started (PostgreSQL does not record when an advisory lock was granted); NULL for other roles'' sessions without pg_read_all_stats.';
COMMENT ON COLUMN pgbroker.locks.waiting IS 'Sessions blocked in lock_acquire() for this lock.';
COMMENT ON COLUMN pgbroker.locks.waiting_since IS 'Since when the longest of them has waited.';

CREATE VIEW pgbroker.semaphores AS
SELECT p.name,
       max(p.permit) AS permits,
       count(l.pid)::integer AS held,
       array_agg(l.pid ORDER BY p.permit) FILTER (WHERE l.pid IS NOT NULL) AS holders,
       (SELECT count(DISTINCT w.pid) FROM pg_catalog.pg_locks w
          JOIN pgbroker.semaphore_permit q ON q.key = w.objid::integer AND q.name = p.name
         WHERE w.locktype = 'advisory' AND NOT w.granted AND w.objsubid = 2
           AND w.classid = 1885823597::oid
           AND w.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())
       )::integer AS waiting
  FROM pgbroker.semaphore_permit p
  LEFT JOIN pg_catalog.pg_locks l
    ON l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
   AND l.classid = 1885823597::oid   -- semaphore permits ('pgbm')
   AND l.objid = p.key::oid
   AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())
 WHERE (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'semaphore')
        OR pgbroker.name_allowed('semaphore', p.name))
 GROUP BY p.name;
COMMENT ON VIEW pgbroker.semaphores IS 'Semaphores: how many permits exist, how many are held and by whom.';
COMMENT ON COLUMN pgbroker.semaphores.name IS 'Semaphore name.';
COMMENT ON COLUMN pgbroker.semaphores.permits IS 'The largest limit it has been used with.';
COMMENT ON COLUMN pgbroker.semaphores.held IS 'Permits held now.';
COMMENT ON COLUMN pgbroker.semaphores.holders IS 'Backend pids of the holders, by permit number.';
COMMENT ON COLUMN pgbroker.semaphores.waiting IS 'Sessions blocked in semaphore_acquire() (waiters that LISTEN are not counted).';

CREATE VIEW pgbroker.kv AS
SELECT e.key, e.version, e.updated_at, e.expires_at,
       CASE WHEN pg_catalog.pg_has_role(current_user, 'pgbroker_user', 'MEMBER')
                 OR pg_catalog.pg_has_role(current_user, 'pgbroker_admin', 'MEMBER') THEN e.value END AS value
  FROM pgbroker.kv_entry e
 WHERE (e.expires_at IS NULL OR e.expires_at > pg_catalog.clock_timestamp())
   AND (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'kv') OR pgbroker.name_allowed('kv', e.key));
COMMENT ON VIEW pgbroker.kv IS 'Live entries of the key-value store; values only to members of pgbroker_user or pgbroker_admin.';
COMMENT ON COLUMN pgbroker.kv.key IS 'The key.';
COMMENT ON COLUMN pgbroker.kv.version IS 'Version of its last change.';
COMMENT ON COLUMN pgbroker.kv.updated_at IS 'When it last changed.';
COMMENT ON COLUMN pgbroker.kv.expires_at IS 'When it expires (NULL: never).';
COMMENT ON COLUMN pgbroker.kv.value IS 'Its value, for members of pgbroker_user (NULL for other readers).';

CREATE VIEW pgbroker.counters AS
SELECT c.name, c.value, c.updated_at FROM pgbroker.counter c
 WHERE (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'counter')
        OR pgbroker.name_allowed('counter', c.name));
COMMENT ON VIEW pgbroker.counters IS 'Atomic counters and their values.';
COMMENT ON COLUMN pgbroker.counters.name IS 'Counter name.';
COMMENT ON COLUMN pgbroker.counters.value IS 'Its value.';
COMMENT ON COLUMN pgbroker.counters.updated_at IS 'When it last changed.';

CREATE VIEW pgbroker.rate_limits AS
SELECT s.name, s.rate, s.per, s.burst,
       greatest(0, least(s.burst, pg_catalog.div(c.now + s.burst * c.t - s.tat, c.t)))::integer AS available,
       CASE WHEN s.tat <= c.now THEN NULL
            WHEN s.tat < 8000000000000000000000000000   -- 253,000 years after 1970; later ones overflow a timestamptz
            THEN pg_catalog.to_timestamp(s.tat / 1000000000000000)
            ELSE timestamptz 'infinity' END AS full_at,
       s.allowed, s.denied, s.last_allowed, s.updated_at
  FROM pgbroker.rate_limit_state s
 CROSS JOIN LATERAL (SELECT EXTRACT(epoch FROM pg_catalog.clock_timestamp()) * 1000000000000000 AS now,
                            -- pgbroker._rate_limit_interval(), written out: a view's readers would need
                            -- EXECUTE on a function it calls, and internal functions are granted to nobody
                            pg_catalog.div(EXTRACT(epoch FROM s.per) * 1000000000000000 + s.rate - 1,
                                           s.rate::numeric) AS t) c
 WHERE (NOT EXISTS (SELECT FROM pgbroker.name_grant_kind k WHERE k.kind = 'rate_limit')
        OR pgbroker.name_allowed('rate_limit', s.name));
COMMENT ON VIEW pgbroker.rate_limits IS
    'Rate limits (rate_limit()) with the parameters of their last call: how much is available now, when they are full again, and how many calls were allowed and denied. A crash forgets them all.';
COMMENT ON COLUMN pgbroker.rate_limits.name IS 'Rate limit name.';
COMMENT ON COLUMN pgbroker.rate_limits.rate IS 'RATE of the last call.';
COMMENT ON COLUMN pgbroker.rate_limits.per IS 'PER of the last call.';
COMMENT ON COLUMN pgbroker.rate_limits.burst IS 'BURST of the last call (RATE when it passed NULL).';
COMMENT ON COLUMN pgbroker.rate_limits.available IS 'Calls of cost 1 that would be allowed now, with those parameters (0 to burst).';
COMMENT ON COLUMN pgbroker.rate_limits.full_at IS 'When all of BURST is available again; NULL when it is now.';
COMMENT ON COLUMN pgbroker.rate_limits.allowed IS 'Calls allowed since the name was first used (or since a crash).';
COMMENT ON COLUMN pgbroker.rate_limits.denied IS 'Calls denied since then.';
COMMENT ON COLUMN pgbroker.rate_limits.last_allowed IS 'Whether the last call was allowed.';
COMMENT ON COLUMN pgbroker.rate_limits.updated_at IS 'When the last call was decided.';

-- ---------------------------------------------------------------------------
-- Authority per name (050_authority.sql).

CREATE VIEW pgbroker.name_grants AS
SELECT g.kind, g.prefix, g.role::regrole AS role, g.rights, g.granted_at
  FROM pgbroker.name_grant g;
COMMENT ON VIEW pgbroker.name_grants IS
    'Name grants: which role may read or write the names of a kind that begin with a prefix; a name that no prefix covers is anyone''s with the capability role.';
COMMENT ON COLUMN pgbroker.name_grants.kind IS 'lease, lock, semaphore, kv, counter or rate_limit.';
COMMENT ON COLUMN pgbroker.name_grants.prefix IS 'The names it covers begin with this ('''' covers every name).';
COMMENT ON COLUMN pgbroker.name_grants.role IS 'The role granted (an oid, shown as a number, once the role is dropped: it then admits nobody).';
COMMENT ON COLUMN pgbroker.name_grants.rights IS 'read, or write (which implies read).';
COMMENT ON COLUMN pgbroker.name_grants.granted_at IS 'When it was granted or last changed.';

CREATE VIEW pgbroker.name_grants_version AS
SELECT v.version, ARRAY(SELECT k.kind FROM pgbroker.name_grant_kind k ORDER BY k.kind) AS kinds
  FROM pgbroker.name_grant_version v;
COMMENT ON VIEW pgbroker.name_grants_version IS
    'A number that changes with every name_grant and name_revoke, and the kinds with grants: what a client caches about a name of a kind without grants stays valid while the number is unchanged (the Python Lock takes a lock by its cached key only then).';
COMMENT ON COLUMN pgbroker.name_grants_version.version IS 'Grows with every grant and revoke, and with every maintain() that finds lock names idle (a cached lock key is valid while it is unchanged).';
COMMENT ON COLUMN pgbroker.name_grants_version.kinds IS 'The kinds some grant covers names of (their names are checked at every call, role memberships included).';

-- ===== sql/720_maintain.sql =====

-- pgbroker: the upkeep, one entry point, run by every Python Broker.
--
-- maintain() does, a bounded batch of each per call, in one short
-- transaction that nobody waits for (rows are taken FOR UPDATE SKIP LOCKED,
-- advisory locks only tried, and a part that would wait more than 100 ms for
-- a row is skipped until the next call):
--   sweep           what earlier epochs of every lease left (broker_sweep,
--                   550_sweep.sql), and TTL leases that expired unnoticed
--   lock names      names nobody holds nor waits for are forgotten, in two
--                   passes (650_locks.sql, "Forgetting idle names"): a name
--                   in use keeps its key, an idle one costs no row
--   semaphores      the same for semaphores, all permits of one together
--   rate limits     buckets that are full again (no different from no row)
--   kv expired      key-value entries whose TTL ran out
--   lease history   lease_event rows older than the retention the operator
--                   sets with upkeep_set() (30 days unless set)
-- Counters and live key-value entries are data: they stay until deleted.
-- Each call returns a row per part: what it removed and what is left (at
-- most MAX_ROWS counted); the view pgbroker.upkeep keeps the last call's
-- report and the totals since install, for the health check, the metrics
-- and `pgbroker doctor`.  Two calls at once: the second returns no row at
-- once.  The Python Broker calls it while it holds its lease: every
-- minute, every 5 seconds while a call left rows only a later call removes
-- (the names it marked idle), and again soon while a part removed a full
-- batch; elsewhere pg_cron runs it (sql/README.md, "Upkeep").

CREATE TABLE pgbroker.upkeep_setting (
    history_retention interval NOT NULL DEFAULT '30 days'
        CONSTRAINT upkeep_setting_retention_valid CHECK (history_retention >= '0'::interval),
    singleton boolean PRIMARY KEY DEFAULT true CONSTRAINT upkeep_setting_one_row CHECK (singleton)
);
INSERT INTO pgbroker.upkeep_setting DEFAULT VALUES;
COMMENT ON TABLE pgbroker.upkeep_setting IS 'Internal: one row, the operator''s settings of maintain() (set with upkeep_set(); read the view pgbroker.upkeep).';
COMMENT ON COLUMN pgbroker.upkeep_setting.history_retention IS 'maintain() deletes lease history events older than this.';
COMMENT ON COLUMN pgbroker.upkeep_setting.singleton IS 'Always true: one row.';

CREATE TABLE pgbroker.upkeep_log (
    part text PRIMARY KEY,
    position integer NOT NULL,
    last_run_at timestamptz,
    last_removed bigint NOT NULL DEFAULT 0,
    removed_total bigint NOT NULL DEFAULT 0,
    remaining bigint
);
INSERT INTO pgbroker.upkeep_log (part, position)
VALUES ('sweep', 1), ('lock names', 2), ('semaphores', 3), ('rate limits', 4), ('kv expired', 5), ('lease history', 6);
COMMENT ON TABLE pgbroker.upkeep_log IS 'Internal: per part of maintain(), its last call''s report and the total removed. Read the view pgbroker.upkeep.';
COMMENT ON COLUMN pgbroker.upkeep_log.part IS 'sweep, lock names, semaphores, rate limits, kv expired or lease history.';
COMMENT ON COLUMN pgbroker.upkeep_log.position IS 'Order of the parts in a call.';
COMMENT ON COLUMN pgbroker.upkeep_log.last_run_at IS 'When maintain() last ran this part (NULL: never).';
COMMENT ON COLUMN pgbroker.upkeep_log.last_removed IS 'Rows it removed then.';
COMMENT ON COLUMN pgbroker.upkeep_log.removed_total IS 'Rows removed since install.';
COMMENT ON COLUMN pgbroker.upkeep_log.remaining IS 'Rows left to remove after that call (at most its MAX_ROWS counted; NULL: the part was skipped, a row it needed was busy).';

CREATE FUNCTION pgbroker.upkeep_set(history_retention interval)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF upkeep_set.history_retention IS NULL OR upkeep_set.history_retention < '0'::interval THEN
        RAISE EXCEPTION 'history_retention must be a non-negative interval, got %',
                        coalesce(upkeep_set.history_retention::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE pgbroker.upkeep_setting SET history_retention = upkeep_set.history_retention;
END
$$;
COMMENT ON FUNCTION pgbroker.upkeep_set(interval) IS
    'pgbroker_admin: maintain() deletes lease history events older than HISTORY_RETENTION (non-negative; 22023 otherwise). The default is 30 days.';

CREATE FUNCTION pgbroker.maintain(max_rows integer DEFAULT 5000)
RETURNS TABLE (part text, removed bigint, remaining bigint)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '100ms'
AS $$
DECLARE
    v_max integer := maintain.max_rows;
    v_retention interval;
    v_removed bigint;
    v_remaining bigint;
BEGIN
    IF v_max IS NULL OR v_max < 1 OR v_max > 1000000 THEN
        RAISE EXCEPTION 'max_rows must be 1 to 1000000, got %', coalesce(v_max::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- One call at a time; a second returns at once, with no row.
    SELECT s.history_retention INTO v_retention FROM pgbroker.upkeep_setting s FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    FOR maintain.part IN SELECT u.part FROM pgbroker.upkeep_log u ORDER BY u.position LOOP
        BEGIN
            CASE maintain.part
                WHEN 'sweep' THEN
                    v_removed := pgbroker.broker_sweep(NULL, v_max);
                    SELECT coalesce(sum(w.clients + w.subscriptions + w.interest + w.outbox + w.state), 0)
                      INTO v_remaining FROM pgbroker.sweep_backlog w;
                WHEN 'lock names' THEN
                    SELECT u.removed, u.remaining INTO v_removed, v_remaining FROM pgbroker._lock_names_upkeep(v_max) u;
                WHEN 'semaphores' THEN
                    SELECT u.removed, u.remaining INTO v_removed, v_remaining FROM pgbroker._semaphore_names_upkeep(v_max) u;
                WHEN 'rate limits' THEN
                    SELECT u.removed, u.remaining INTO v_removed, v_remaining FROM pgbroker._rate_limit_upkeep(v_max) u;
                WHEN 'kv expired' THEN
                    SELECT u.removed, u.remaining INTO v_removed, v_remaining FROM pgbroker._kv_expired_upkeep(v_max) u;
                WHEN 'lease history' THEN
                    DELETE FROM pgbroker.lease_event e
                     WHERE e.id = ANY (ARRAY(SELECT x.id FROM pgbroker.lease_event x
                                              WHERE x.at < clock_timestamp() - v_retention
                                              ORDER BY x.id LIMIT v_max FOR UPDATE SKIP LOCKED));
                    GET DIAGNOSTICS v_removed = ROW_COUNT;
                    SELECT count(*) INTO v_remaining
                      FROM (SELECT FROM pgbroker.lease_event x
                             WHERE x.at < clock_timestamp() - v_retention LIMIT v_max) x;
            END CASE;
        EXCEPTION WHEN lock_not_available THEN
            -- A row this part needed was busy for 100 ms: next call.
            v_removed := 0;
            v_remaining := NULL;
        END;
        UPDATE pgbroker.upkeep_log u
           SET last_run_at = clock_timestamp(), last_removed = v_removed,
               removed_total = u.removed_total + v_removed, remaining = v_remaining
         WHERE u.part = maintain.part;
        maintain.removed := v_removed;
        maintain.remaining := v_remaining;
        RETURN NEXT;
    END LOOP;
END
$$;
COMMENT ON FUNCTION pgbroker.maintain(integer) IS
$$The upkeep, in one call: removes at most MAX_ROWS (1 to 1000000; default 5000) rows of each part and returns a row per part, in order: sweep (what earlier epochs of every lease left, broker_sweep), lock names and semaphores nobody holds nor waits for (forgotten in two passes; a name in use keeps its key), rate limits whose bucket is full again, kv expired (entries whose TTL ran out), lease history (older than the retention of upkeep_set(), 30 days unless set).
REMOVED: rows it deleted; REMAINING: rows left to remove (at most MAX_ROWS counted; NULL when the part was skipped because a row it needed stayed busy for 100 ms). Call it again while a part removed MAX_ROWS (more is left); names it finds idle go at a later call, so a minute apart suits it.
Nobody waits for it: rows are taken FOR UPDATE SKIP LOCKED and advisory locks only tried. No row at all: another maintain() is running. Counters and live key-value entries are never removed.
Call it in autocommit mode (each call commits its batches); the Python Broker calls it every minute (every 5 seconds while a call left rows for a later one), pg_cron can too (sql/README.md, "Upkeep").$$;

CREATE VIEW pgbroker.upkeep AS
SELECT u.part, u.last_run_at, u.last_removed, u.removed_total, u.remaining,
       CASE WHEN u.part = 'lease history' THEN s.history_retention END AS retention
  FROM pgbroker.upkeep_log u CROSS JOIN pgbroker.upkeep_setting s
 ORDER BY u.position;
COMMENT ON VIEW pgbroker.upkeep IS
    'One row per part of maintain(): when it last ran, what it removed then and since install, and what it left to remove.';
COMMENT ON COLUMN pgbroker.upkeep.part IS 'sweep, lock names, semaphores, rate limits, kv expired or lease history.';
COMMENT ON COLUMN pgbroker.upkeep.last_run_at IS 'When maintain() last ran it (NULL: never).';
COMMENT ON COLUMN pgbroker.upkeep.last_removed IS 'Rows removed by that call.';
COMMENT ON COLUMN pgbroker.upkeep.removed_total IS 'Rows removed since install.';
COMMENT ON COLUMN pgbroker.upkeep.remaining IS 'Rows left to remove after that call (at most its MAX_ROWS counted; NULL: skipped, a row it needed was busy).';
COMMENT ON COLUMN pgbroker.upkeep.retention IS 'For lease history: the retention set with upkeep_set().';

-- ===== sql/750_console.sql =====

-- pgbroker: the console.  What an operator reads at 3 a.m. in psql, what
-- `pgbroker status` and `pgbroker doctor` print (they read these views, so
-- psql and the CLI agree) and what Prometheus scrapes.  Built only on the
-- views of 700_views.sql and on pg_catalog, never on pgbroker's tables, so
-- that a reader sees here what it may see there (but for lock_audit, which
-- matches pg_locks with the lock registries, as no view could).

-- ---------------------------------------------------------------------------
-- One row per broker: the lease, its clients and its outbox backlog.

CREATE VIEW pgbroker.broker_overview AS
SELECT b.name,
       b.epoch,
       b.state,
       b.alive,
       b.holder_pid,
       b.holder_application,
       b.heartbeat_age,
       (SELECT count(*) FROM pgbroker.lease_history h
         WHERE h.name = b.name AND h.event IN ('takeover', 'stale_takeover'))::integer AS takeovers,
       (SELECT count(*) FROM pgbroker.clients c WHERE c.name = b.name)::integer AS clients,
       (SELECT COALESCE(sum(c.subscriptions), 0) FROM pgbroker.clients c WHERE c.name = b.name)::integer AS subscriptions,
       COALESCE(o.pending, 0)::bigint AS outbox_backlog,
       pg_catalog.clock_timestamp() - o.oldest AS outbox_oldest_age,
       (w.clients + w.subscriptions + w.interest + w.outbox + w.state)::bigint AS sweep_backlog,
       b.claimed_at
  FROM pgbroker.brokers b
  LEFT JOIN pgbroker.outbox_pending o ON o.name = b.name
  LEFT JOIN pgbroker.sweep_backlog w ON w.name = b.name;
COMMENT ON VIEW pgbroker.broker_overview IS
    'One row per broker (lease name): holder, liveness, takeovers, clients, subscriptions, outbox backlog and what is left to sweep. What pgbroker status shows.';
COMMENT ON COLUMN pgbroker.broker_overview.name IS 'Lease name.';
COMMENT ON COLUMN pgbroker.broker_overview.epoch IS 'Current epoch (fencing token).';
COMMENT ON COLUMN pgbroker.broker_overview.state IS 'new, held, released or expired.';
COMMENT ON COLUMN pgbroker.broker_overview.alive IS 'True when the recorded holder''s backend exists and holds the lock.';
COMMENT ON COLUMN pgbroker.broker_overview.holder_pid IS 'Backend pid of the (last) holder.';
COMMENT ON COLUMN pgbroker.broker_overview.holder_application IS 'Its application_name at claim time.';
COMMENT ON COLUMN pgbroker.broker_overview.heartbeat_age IS 'Time since the holder''s last heartbeat.';
COMMENT ON COLUMN pgbroker.broker_overview.takeovers IS 'Takeovers (forced or stale) recorded in pgbroker.lease_history (pruning forgets old ones).';
COMMENT ON COLUMN pgbroker.broker_overview.clients IS 'Clients registered by the live holder (pgbroker.clients).';
COMMENT ON COLUMN pgbroker.broker_overview.subscriptions IS 'Subscriptions of those clients.';
COMMENT ON COLUMN pgbroker.broker_overview.outbox_backlog IS 'Notifications not yet acknowledged (pgbroker.outbox_pending).';
COMMENT ON COLUMN pgbroker.broker_overview.outbox_oldest_age IS 'Age of the oldest of them; NULL when there is none.';
COMMENT ON COLUMN pgbroker.broker_overview.sweep_backlog IS 'Rows earlier epochs left that broker_sweep() has yet to delete (pgbroker.sweep_backlog).';
COMMENT ON COLUMN pgbroker.broker_overview.claimed_at IS 'When the current epoch was claimed.';

-- ---------------------------------------------------------------------------
-- Locks no record accounts for.  Advisory locks have no privileges: any
-- session can take any key of pgbroker's lock classes, squatting a named
-- lock, a permit, a lease's lock or a table's watch lock (a denial of
-- service; it can never make a session a lease's holder).  This lists the
-- sessions that hold such a lock without a pgbroker record behind it: a
-- lease lock or a broker's liveness or wake-up lock held by another session
-- than the lease's recorded holder, a named lock or permit never registered
-- or held by a role the name grants refuse, a lock the API only takes for a
-- transaction held by a session outside one.  A session in the middle of a
-- statement (a claim committing) is left out: what it holds is momentary.
-- One whose claim sits in a transaction not yet committed is listed until it
-- commits: its lease's lock is held, the record not yet visible.
-- Whether a session is in a transaction is read from pg_locks, which every
-- role sees whole (a transaction holds its own virtualxid lock; a session
-- outside one holds none), so that squatters are found whatever the rights
-- of the role that installed pgbroker.  pg_stat_activity shows other roles'
-- state and application_name only to a role with pg_read_all_stats: where it
-- does, a session in the middle of a statement is told apart (left out);
-- where not, application is NULL and such a session counts as idle in its
-- transaction.

CREATE FUNCTION pgbroker.lock_audit()
RETURNS TABLE (pid integer, role name, application text, session_state text, lock_class text, key integer,
               mode text, why text)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH in_transaction AS MATERIALIZED (
        SELECT v.pid FROM pg_catalog.pg_locks v WHERE v.locktype = 'virtualxid' AND v.granted AND v.pid IS NOT NULL)
    SELECT x.pid, x.role, x.application, x.session_state, x.lock_class, x.key, x.mode, x.why
      FROM (SELECT l.pid, a.usename AS role, a.application_name AS application,
                   coalesce(a.state, CASE WHEN l.pid IN (SELECT t.pid FROM in_transaction t) THEN 'idle in transaction'
                                          ELSE 'idle' END) AS session_state,
                   c.lock_class, l.objid::integer AS key, l.mode,
                   CASE
                       WHEN a.state = 'active' THEN NULL
                       WHEN c.lock_class = 'lease' THEN
                           CASE WHEN EXISTS (SELECT FROM pgbroker.lease r
                                              WHERE r.lock_key = l.objid::integer AND r.state = 'held'
                                                AND r.holder_pid = l.pid) THEN NULL
                                ELSE 'a lease''s lock, and this session is not its recorded holder' END
                       WHEN c.lock_class = 'lease alive' THEN
                           CASE WHEN EXISTS (SELECT FROM pgbroker.lease r
                                              WHERE pgbroker._epoch_key(r.epoch) = l.objid::integer
                                                AND r.state = 'held' AND r.holder_pid = l.pid) THEN NULL
                                ELSE 'an epoch''s liveness lock, and this session is not its holder' END
                       WHEN c.lock_class = 'broker awake' THEN
                           CASE WHEN EXISTS (SELECT FROM pgbroker.lease r
                                              WHERE r.lock_key = l.objid::integer AND r.holder_pid = l.pid) THEN NULL
                                ELSE 'a broker''s wake-up lock, and this session is not its holder' END
                       WHEN c.lock_class = 'lock' THEN
                           CASE WHEN n.name IS NULL THEN 'a named lock''s key that no name was given'
                                WHEN NOT pgbroker.name_allowed('lock', n.name, 'write', a.usesysid::regrole)
                                    THEN format('named lock "%s", which the name grants refuse to %s', n.name, a.usename)
                           END
                       WHEN c.lock_class = 'semaphore permit' THEN
                           CASE WHEN sp.name IS NULL THEN 'a permit''s key that no semaphore was given'
                                WHEN NOT pgbroker.name_allowed('semaphore', sp.name, 'write', a.usesysid::regrole)
                                    THEN format('a permit of semaphore "%s", which the name grants refuse to %s',
                                                sp.name, a.usename)
                           END
                       WHEN c.lock_class = 'kv watchers' AND l.objid = 1 THEN NULL
                       WHEN c.lock_class = 'registry watchers' THEN NULL
                       -- The rest pgbroker takes for a statement or a transaction only: held by
                       -- a session outside any transaction, it is a session lock taken by hand.
                       WHEN a.state = 'idle' OR (a.state IS NULL AND l.pid NOT IN (SELECT t.pid FROM in_transaction t))
                           THEN format('a %s lock, which pgbroker only takes inside a statement or transaction', c.lock_class)
                   END AS why
              FROM pg_catalog.pg_locks l
              JOIN (VALUES (1885823602, 'lease'), (1885823592, 'lease alive'), (1885823585, 'broker awake'),
                           (1885823607, 'broker drain'), (1885823603, 'table watch'), (1885823596, 'lock'),
                           (1885823597, 'semaphore permit'), (1885823595, 'kv watchers'),
                           (1885823591, 'registry watchers'), (1885823590, 'registry writes'))
                   AS c(classid, lock_class) ON c.classid = l.classid::bigint
              LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
              LEFT JOIN pgbroker.lock_name n ON c.lock_class = 'lock' AND n.key = l.objid::integer
              LEFT JOIN pgbroker.semaphore_permit sp ON c.lock_class = 'semaphore permit' AND sp.key = l.objid::integer
             WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
               AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = current_database())
               AND l.pid <> pg_backend_pid()) x
     WHERE x.why IS NOT NULL
$$;
COMMENT ON FUNCTION pgbroker.lock_audit() IS
$$The sessions holding an advisory lock of one of pgbroker's lock classes that no pgbroker record accounts for (squatters, or a client that took a lock by hand), with their role, application, state, the lock and why it is unaccounted. What the view unaccounted_locks and pgbroker doctor show.$$;

CREATE VIEW pgbroker.unaccounted_locks AS
SELECT pid, role, application, session_state, lock_class, key, mode, why FROM pgbroker.lock_audit();
COMMENT ON VIEW pgbroker.unaccounted_locks IS
    'Sessions holding a lock of pgbroker''s lock classes that no pgbroker record accounts for: advisory locks have no privileges, so a role can squat one (a denial of service). End such a session with pg_terminate_backend(pid).';
COMMENT ON COLUMN pgbroker.unaccounted_locks.pid IS 'Backend pid of the session holding it.';
COMMENT ON COLUMN pgbroker.unaccounted_locks.role IS 'Its login role.';
COMMENT ON COLUMN pgbroker.unaccounted_locks.application IS 'Its application_name (NULL for another role''s session when the role that installed pgbroker lacks pg_read_all_stats).';
COMMENT ON COLUMN pgbroker.unaccounted_locks.session_state IS 'Its state (idle, idle in transaction, active...; without pg_read_all_stats, another role''s session is idle or idle in transaction, as pg_locks tells).';
COMMENT ON COLUMN pgbroker.unaccounted_locks.lock_class IS 'Which of pgbroker''s locks: lease, lease alive, broker awake, broker drain, table watch, lock, semaphore permit, kv watchers, registry watchers, registry writes.';
COMMENT ON COLUMN pgbroker.unaccounted_locks.key IS 'The second key of the advisory lock.';
COMMENT ON COLUMN pgbroker.unaccounted_locks.mode IS 'ExclusiveLock or ShareLock.';
COMMENT ON COLUMN pgbroker.unaccounted_locks.why IS 'Why no record accounts for it.';

-- ---------------------------------------------------------------------------
-- Health checks that the database alone can answer.  `pgbroker doctor` adds
-- the ones only the client sees (schema version against the package, the
-- connection's pooler and keepalives, its role's grants).

CREATE VIEW pgbroker.health AS
SELECT 'notify_queue'::text AS "check",
       ''::text AS subject,
       pg_catalog.pg_notification_queue_usage() < 0.5 AS ok,
       pg_catalog.format('the NOTIFY queue is %s%% full', round((pg_catalog.pg_notification_queue_usage() * 100)::numeric, 1)) AS detail,
       CASE WHEN pg_catalog.pg_notification_queue_usage() >= 0.5
            THEN 'a session that LISTENs does not consume its notifications (an open transaction holds the queue back): find it in pg_stat_activity and end it' END AS fix
UNION ALL
SELECT 'outbox_lag', o.name,
       o.outbox_oldest_age IS NULL OR o.outbox_oldest_age < interval '60 s',
       CASE WHEN o.outbox_backlog = 0 THEN 'no pending notification'
            ELSE pg_catalog.format('%s pending notification(s), the oldest %s old', o.outbox_backlog,
                                   date_trunc('second', o.outbox_oldest_age)) END,
       CASE WHEN o.outbox_oldest_age >= interval '60 s'
            THEN CASE WHEN o.alive THEN 'the broker does not fetch and acknowledge its outbox (outbox_fetch, outbox_ack): check its logs'
                      ELSE 'no live broker holds this lease: start one (its claim wipes the old epoch''s outbox)' END END
  FROM pgbroker.broker_overview o
UNION ALL
SELECT 'watch_triggers', w."table"::text,
       t.missing = '{}',
       CASE WHEN t.missing = '{}' THEN 'its four triggers are in place and enabled'
            ELSE pg_catalog.format('missing or disabled: %s', pg_catalog.array_to_string(t.missing, ', ')) END,
       CASE WHEN t.missing <> '{}'
            THEN pg_catalog.format('reinstall them as pgbroker_admin: SELECT pgbroker.watch(%L);', w."table"::text) END
  FROM pgbroker.watched_tables w
  CROSS JOIN LATERAL (
      SELECT ARRAY(SELECT e.name
                     FROM unnest(ARRAY['_pgbroker_watch_ins', '_pgbroker_watch_upd',
                                       '_pgbroker_watch_del', '_pgbroker_watch_trunc']) AS e(name)
                    WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_trigger g
                                       WHERE g.tgrelid = w."table"::oid AND g.tgname = e.name
                                         AND g.tgenabled <> 'D')
                    ORDER BY e.name) AS missing) t
UNION ALL
SELECT 'sweep', o.name,
       o.sweep_backlog = 0 OR o.claimed_at > pg_catalog.clock_timestamp() - interval '5 min',
       CASE WHEN o.sweep_backlog = 0 THEN 'nothing of an earlier epoch is left'
            ELSE pg_catalog.format('%s row(s) of earlier epochs left to sweep (epoch %s claimed %s ago)', o.sweep_backlog,
                                   o.epoch, date_trunc('second', pg_catalog.clock_timestamp() - o.claimed_at)) END,
       CASE WHEN o.sweep_backlog > 0 AND o.claimed_at <= pg_catalog.clock_timestamp() - interval '5 min'
            THEN 'nobody sweeps this lease: run pgbroker sweep, or call SELECT pgbroker.broker_sweep() until it returns 0 (the Python Broker does after its claim)' END
  FROM pgbroker.broker_overview o
UNION ALL
SELECT 'unaccounted_lock', pg_catalog.format('pid %s', u.pid), false,
       pg_catalog.format('%s (role %s, application %s, %s) holds %s %s: %s', u.pid, u.role,
                         coalesce(u.application, ''), coalesce(u.session_state, 'state unknown'), u.lock_class, u.key, u.why),
       'if it is not yours, end the session: SELECT pg_terminate_backend(' || u.pid || ');'
  FROM pgbroker.unaccounted_locks u
UNION ALL
SELECT 'broker_alive', o.name,
       o.alive OR o.state <> 'held',
       CASE WHEN o.alive THEN pg_catalog.format('epoch %s is held by pid %s', o.epoch, o.holder_pid)
            WHEN o.state <> 'held' THEN pg_catalog.format('the lease is %s', o.state)
            ELSE pg_catalog.format('epoch %s was held by pid %s, which is gone', o.epoch, o.holder_pid) END,
       CASE WHEN NOT o.alive AND o.state = 'held'
            THEN 'no broker runs for this lease: start one (it takes over with the next epoch)' END
  FROM pgbroker.broker_overview o
UNION ALL
SELECT 'upkeep', '',
       coalesce(u.last_run >= pg_catalog.clock_timestamp() - interval '1 hour', false) OR NOT u.something,
       CASE WHEN u.last_run IS NULL THEN 'maintain() never ran'
            ELSE pg_catalog.format('maintain() last ran %s ago; %s row(s) left to remove',
                                   date_trunc('second', pg_catalog.clock_timestamp() - u.last_run), u.remaining) END,
       CASE WHEN u.something AND coalesce(u.last_run < pg_catalog.clock_timestamp() - interval '1 hour', true)
            THEN 'nothing runs the upkeep: run a Python Broker, schedule SELECT pgbroker.maintain() with pg_cron (sql/README.md, "Upkeep"), or run pgbroker maintain' END
  FROM (SELECT min(l.last_run_at) AS last_run, sum(l.remaining) AS remaining,
               -- Something the upkeep would remove has waited for more than an hour.
               EXISTS (SELECT FROM pgbroker.lock_name n WHERE n.created_at < pg_catalog.clock_timestamp() - interval '1 hour')
               OR EXISTS (SELECT FROM pgbroker.rate_limit_state r
                           WHERE r.updated_at < pg_catalog.clock_timestamp() - interval '1 hour')
               OR EXISTS (SELECT FROM pgbroker.kv_entry e WHERE e.expires_at < pg_catalog.clock_timestamp() - interval '1 hour')
               OR EXISTS (SELECT FROM pgbroker.lease_event e, pgbroker.upkeep_setting s
                           WHERE e.at < pg_catalog.clock_timestamp() - s.history_retention - interval '1 hour') AS something
          FROM pgbroker.upkeep_log l) u;
COMMENT ON VIEW pgbroker.health IS
    'Health checks the database can answer: NOTIFY queue, outbox lag (60 s), watched tables'' triggers, earlier epochs left unswept 5 minutes after a claim, locks no record accounts for, dead brokers, an upkeep (maintain()) that has not run for an hour while what it removes waits. One row per check and subject; fix says what to do when ok is false.';
COMMENT ON COLUMN pgbroker.health."check" IS 'notify_queue, outbox_lag, watch_triggers, sweep, unaccounted_lock, broker_alive or upkeep.';
COMMENT ON COLUMN pgbroker.health.subject IS 'What was checked: a lease name, a watched table, or empty.';
COMMENT ON COLUMN pgbroker.health.ok IS 'False when something needs fixing.';
COMMENT ON COLUMN pgbroker.health.detail IS 'What was found.';
COMMENT ON COLUMN pgbroker.health.fix IS 'What to do about it (NULL when ok).';

-- ---------------------------------------------------------------------------
-- Prometheus: one row per sample.  Metric names are those postgres_exporter
-- gives the same figures through pgbroker/queries.yaml (<query>_<column>),
-- so a dashboard is the same whichever way it is fed.

CREATE VIEW pgbroker.metrics AS
SELECT v.metric, pg_catalog.jsonb_build_object('name', o.name) AS labels, v.value, v.help
  FROM pgbroker.broker_overview o
 CROSS JOIN LATERAL (VALUES
       ('pgbroker_broker_epoch', o.epoch::double precision,
        'Current epoch (fencing token) of the lease.'),
       ('pgbroker_broker_alive', CASE WHEN o.alive THEN 1 ELSE 0 END::double precision,
        '1 when the lease''s holder is alive, else 0.'),
       ('pgbroker_broker_heartbeat_age_seconds', EXTRACT(epoch FROM o.heartbeat_age)::double precision,
        'Seconds since the holder''s last heartbeat.'),
       ('pgbroker_broker_takeovers', o.takeovers::double precision,
        'Takeovers of the lease recorded in its history.'),
       ('pgbroker_broker_clients', o.clients::double precision,
        'Clients registered by the live holder.'),
       ('pgbroker_broker_subscriptions', o.subscriptions::double precision,
        'Subscriptions of those clients.'),
       ('pgbroker_broker_outbox_backlog', o.outbox_backlog::double precision,
        'Notifications not yet acknowledged by the broker.'),
       ('pgbroker_broker_outbox_oldest_age_seconds',
        COALESCE(EXTRACT(epoch FROM o.outbox_oldest_age), 0)::double precision,
        'Age in seconds of the oldest unacknowledged notification (0 when none).'),
       ('pgbroker_broker_sweep_backlog', o.sweep_backlog::double precision,
        'Rows earlier epochs of the lease left that broker_sweep() has yet to delete.')
     ) AS v(metric, value, help)
 WHERE v.value IS NOT NULL
UNION ALL
SELECT 'pgbroker_notify_queue_usage', '{}'::jsonb, pg_catalog.pg_notification_queue_usage(),
       'Fraction of the NOTIFY queue in use (pg_notification_queue_usage()).'
UNION ALL
-- Rate limits in aggregate (a label per name would be one series per user or
-- key): pgbroker.rate_limits has the names.
SELECT v.metric, '{}'::jsonb, v.value, v.help
  FROM (SELECT count(*) AS keys, coalesce(sum(s.allowed), 0) AS allowed, coalesce(sum(s.denied), 0) AS denied
          FROM pgbroker.rate_limit_state s) r
 CROSS JOIN LATERAL (VALUES
       ('pgbroker_rate_limit_keys', r.keys::double precision,
        'Rate limit names in use (pgbroker.rate_limits).'),
       ('pgbroker_rate_limit_allowed_total', r.allowed::double precision,
        'Rate limit calls allowed, all names together (a crash resets it).'),
       ('pgbroker_rate_limit_denied_total', r.denied::double precision,
        'Rate limit calls denied, all names together (a crash resets it).')
     ) AS v(metric, value, help)
UNION ALL
-- The upkeep, per part of maintain() (pgbroker.upkeep).
SELECT v.metric, pg_catalog.jsonb_build_object('part', u.part), v.value, v.help
  FROM pgbroker.upkeep u
 CROSS JOIN LATERAL (VALUES
       ('pgbroker_upkeep_removed_total', u.removed_total::double precision,
        'Rows maintain() removed since install, per part.'),
       ('pgbroker_upkeep_remaining', u.remaining::double precision,
        'Rows maintain() left to remove at its last call, per part (at most its max_rows counted).'),
       ('pgbroker_upkeep_last_run_age_seconds',
        EXTRACT(epoch FROM pg_catalog.clock_timestamp() - u.last_run_at)::double precision,
        'Seconds since maintain() last ran the part.')
     ) AS v(metric, value, help)
 WHERE v.value IS NOT NULL;
COMMENT ON VIEW pgbroker.metrics IS
    'Prometheus samples, one row per metric and label set: lease epoch, holder alive, heartbeat age, takeovers, clients, subscriptions, outbox backlog and oldest age, sweep backlog per broker, NOTIFY queue usage, rate limit names and calls allowed and denied, the upkeep per part.';
COMMENT ON COLUMN pgbroker.metrics.metric IS 'Metric name (the same as postgres_exporter''s through pgbroker/queries.yaml).';
COMMENT ON COLUMN pgbroker.metrics.labels IS 'Labels, as a jsonb object (name: the lease name; part: the part of maintain()).';
COMMENT ON COLUMN pgbroker.metrics.value IS 'The sample''s value.';
COMMENT ON COLUMN pgbroker.metrics.help IS 'HELP text of the metric.';

-- ===== sql/900_privileges.sql =====

-- pgbroker: who may do what, in one place.
--
-- PUBLIC gets USAGE on the schema and nothing else but schema_version(), so
-- that a role without pgbroker rights that calls a function is told it lacks
-- the right to, rather than that the function does not exist.  Four NOLOGIN
-- roles (created in 000_schema.sql) are granted to the user's login roles:
--   pgbroker_reader  SELECT on the views, broker_alive()
--   pgbroker_broker  the lease, broker state, clients, subscriptions, delivery
--   pgbroker_user    the coordination primitives: locks, semaphores, the
--                    key-value store, counters, rate limits (workers that use
--                    them need no power over the lease, such as stale takeovers)
--   pgbroker_admin   all three, plus takeover => true, watch, unwatch, pruning
-- Tables and internal (_-prefixed) functions are never granted: the API
-- functions (SECURITY DEFINER, search_path pinned) and the views are the
-- interface.  A test compares what each role may execute with the role table
-- of sql/README.md.

-- Functions are created with EXECUTE for PUBLIC: take it all back first.
-- (ALTER DEFAULT PRIVILEGES IN SCHEMA cannot take away the global default.)
REVOKE ALL ON SCHEMA pgbroker FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA pgbroker FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA pgbroker FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pgbroker FROM PUBLIC;

GRANT USAGE ON SCHEMA pgbroker TO PUBLIC;
GRANT EXECUTE ON FUNCTION pgbroker.schema_version() TO PUBLIC;

-- pgbroker_admin is a member of the other three.  Since PostgreSQL 16 that
-- needs ADMIN OPTION on them, which an installer with CREATEROLE has on the
-- roles it created, not on roles a superuser created beforehand: then
-- pgbroker_admin gets their privileges directly (at the end of this file).
DO $admin$
DECLARE
    v_role text;
BEGIN
    FOREACH v_role IN ARRAY ARRAY['pgbroker_broker', 'pgbroker_reader', 'pgbroker_user'] LOOP
        IF NOT pg_catalog.pg_has_role('pgbroker_admin', v_role, 'MEMBER') THEN
            BEGIN
                EXECUTE format('GRANT %I TO pgbroker_admin', v_role);
            EXCEPTION WHEN insufficient_privilege THEN
                RAISE NOTICE 'pgbroker: pgbroker_admin is not made a member of %, role % has no ADMIN OPTION on it; it gets its privileges directly',
                        v_role, current_user
                    USING HINT = format('To have the membership, as a superuser: GRANT %I TO pgbroker_admin;', v_role);
            END;
        END IF;
    END LOOP;
END
$admin$;

-- Readers: the views.
GRANT SELECT ON
    pgbroker.brokers,
    pgbroker.lease_history,
    pgbroker.broker_state,
    pgbroker.clients,
    pgbroker.subscriptions,
    pgbroker.watched_tables,
    pgbroker.outbox_pending,
    pgbroker.locks,
    pgbroker.semaphores,
    pgbroker.kv,
    pgbroker.counters,
    pgbroker.rate_limits,
    pgbroker.sweep_backlog,
    pgbroker.name_grants,
    pgbroker.name_grants_version,
    pgbroker.unaccounted_locks,
    pgbroker.broker_overview,
    pgbroker.health,
    pgbroker.metrics,
    pgbroker.upkeep
TO pgbroker_reader;
GRANT EXECUTE ON FUNCTION
    pgbroker.broker_alive(text),
    pgbroker.lease_channel(),
    pgbroker.lease_expiry_check(text),
    pgbroker.registry_channel(text),
    pgbroker.registry_watch_begin(text),
    pgbroker.registry_watch_end(text),
    pgbroker.name_allowed(text, text, text, regrole),
    pgbroker.lock_audit()
TO pgbroker_reader;

-- Brokers: the lease, broker state, clients, subscriptions and delivery.
GRANT EXECUTE ON FUNCTION
    pgbroker.broker_claim(text, interval, boolean, interval, text, text, interval),
    pgbroker.broker_release(text, text),
    pgbroker.broker_renew(text, text, interval),
    pgbroker.broker_heartbeat(text),
    pgbroker.broker_assert(text, bigint),
    pgbroker.broker_alive(text),
    pgbroker.lease_channel(),
    pgbroker.lease_expiry_check(text),
    pgbroker.broker_state_set(text, text, jsonb),
    pgbroker.broker_state_delete(text, text),
    pgbroker.client_register(text, jsonb, text, bigint),
    pgbroker.client_register_many(text[], jsonb[], text, bigint),
    pgbroker.client_update(text, jsonb, text, bigint),
    pgbroker.client_unregister(text, text, bigint),
    pgbroker.client_unregister_many(text[], text, bigint),
    pgbroker.subscribe(text, regclass, jsonb, text, bigint, interval),
    pgbroker.subscribe_many(text[], regclass, jsonb[], text, bigint, interval),
    pgbroker.unsubscribe(text, regclass, jsonb, text, bigint),
    pgbroker.outbox_fetch(text, integer, bigint[]),
    pgbroker.outbox_ack(text, bigint[]),
    pgbroker.broker_wake(text),
    pgbroker.broker_sleep(text, interval),
    pgbroker.wakeup_channel(text),
    pgbroker.broker_sweep(text, integer),
    pgbroker.maintain(integer),
    pgbroker.name_allowed(text, text, text, regrole)
TO pgbroker_broker;

-- Users: the coordination primitives.
GRANT EXECUTE ON FUNCTION
    pgbroker.lock_acquire(text, interval, boolean, boolean),
    pgbroker.lock_release(text, boolean),
    pgbroker.lock_key(text),
    pgbroker.semaphore_acquire(text, integer, interval),
    pgbroker.semaphore_release(text),
    pgbroker.semaphore_channel(text),
    pgbroker.kv_get(text),
    pgbroker.kv_set(text, jsonb, bigint, interval),
    pgbroker.kv_delete(text, bigint),
    pgbroker.kv_channel(),
    pgbroker.kv_watch_begin(),
    pgbroker.kv_watch_end(),
    pgbroker.counter_add(text, bigint),
    pgbroker.counter_get(text),
    pgbroker.counter_set(text, bigint, bigint),
    pgbroker.counter_delete(text, bigint),
    pgbroker.rate_limit(text, integer, interval, integer, integer),
    pgbroker.name_allowed(text, text, text, regrole)
TO pgbroker_user;
-- ... and reads the views of the primitives (a prefix watch lists keys).
GRANT SELECT ON pgbroker.locks, pgbroker.semaphores, pgbroker.kv, pgbroker.counters, pgbroker.rate_limits,
    pgbroker.name_grants_version
TO pgbroker_user;

-- Admins: watching tables and housekeeping (takeover => true is checked by
-- broker_claim itself: the login role must be a member of pgbroker_admin).
GRANT EXECUTE ON FUNCTION
    pgbroker.watch(regclass, interval, text),
    pgbroker.unwatch(regclass, interval),
    pgbroker.lease_history_prune(interval),
    pgbroker.name_grant(text, text, regrole, text),
    pgbroker.name_revoke(text, text, regrole),
    pgbroker.upkeep_set(interval)
TO pgbroker_admin;

-- pgbroker_admin has every privilege of the three others, whether or not it
-- could be made their member (see above).
DO $admin_direct$
DECLARE
    v_object text;
BEGIN
    FOR v_object IN
        SELECT DISTINCT p.oid::regprocedure::text
          FROM pg_catalog.pg_proc p, aclexplode(p.proacl) a
         WHERE p.pronamespace = 'pgbroker'::regnamespace
           AND a.grantee IN (SELECT r.oid FROM pg_catalog.pg_roles r
                              WHERE r.rolname IN ('pgbroker_broker', 'pgbroker_reader', 'pgbroker_user')
                                AND NOT pg_catalog.pg_has_role('pgbroker_admin', r.oid, 'USAGE'))
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO pgbroker_admin', v_object);
    END LOOP;
    FOR v_object IN
        SELECT DISTINCT c.oid::regclass::text
          FROM pg_catalog.pg_class c, aclexplode(c.relacl) a
         WHERE c.relnamespace = 'pgbroker'::regnamespace AND a.privilege_type = 'SELECT'
           AND a.grantee IN (SELECT r.oid FROM pg_catalog.pg_roles r
                              WHERE r.rolname IN ('pgbroker_broker', 'pgbroker_reader', 'pgbroker_user')
                                AND NOT pg_catalog.pg_has_role('pgbroker_admin', r.oid, 'USAGE'))
    LOOP
        EXECUTE format('GRANT SELECT ON %s TO pgbroker_admin', v_object);
    END LOOP;
END
$admin_direct$;
