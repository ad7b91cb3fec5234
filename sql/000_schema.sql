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
AS $$ SELECT '0.1.0+4'::text $$;
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
