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
