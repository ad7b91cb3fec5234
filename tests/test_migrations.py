"""Migrations: alembic-built and sql/-built databases are the same, and the
install can be removed again.

* ``alembic upgrade heads`` on one empty database and ``sql/*.sql`` (in name
  order) on another give the same normalised catalog.
* One head; the base revision carries the branch label ``pgbroker``.
* upgrade -> downgrade base -> upgrade works, and ``downgrade base`` leaves the
  database as it found it (schemas, search_path setting, default ACLs, roles).
* ``alembic upgrade head`` from the repo root with ``DATABASE_URL`` works, and
  then ``SELECT broker_claim()`` works unqualified from psql.
* Every object in schema pgbroker is documented, SECURITY DEFINER functions pin
  ``search_path``, and PUBLIC has no privilege on anything.
* The wheel ships the migrations and sql/, and ``pgbroker migrate`` from it works.

Everything iterates over whatever is in sql/, migrations/versions and the
catalog, so new areas and revisions are covered without editing this file.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy
from alembic.script import ScriptDirectory

from pgbroker import install
from pgbroker._embedded import EmbeddedPostgres, psql_path

REPO = Path(__file__).resolve().parent.parent
PGBROKER_SCHEMA = "pgbroker"
PGBROKER_ROLES = ("pgbroker_admin", "pgbroker_broker", "pgbroker_reader", "pgbroker_user")
# Objects that exist only in an alembic-built database.
EXCLUDED_RELATIONS = {(PGBROKER_SCHEMA, "alembic_version")}

# Schemas that belong to PostgreSQL itself; every other schema is compared.
_USER_SCHEMA = """
    n.nspname NOT IN ('pg_catalog', 'information_schema')
    AND n.nspname NOT LIKE 'pg\\_toast%' AND n.nspname NOT LIKE 'pg\\_temp\\_%'
"""


# ---------------------------------------------------------------------------
# Helpers


def _execute(url: str, *statements: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


def _create_database(server: EmbeddedPostgres, name: str) -> str:
    _execute(server.url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)", f"CREATE DATABASE {name}")
    return server.url_for(name)


def _drop_database(server: EmbeddedPostgres, name: str) -> None:
    _execute(server.url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def sql_files() -> list[Path]:
    files = sorted(install.sql_path().glob("*.sql"))
    assert files, f"no SQL files in {install.sql_path()}"
    return files


def load_sql(url: str) -> None:
    """Build pgbroker straight from sql/: each file's text, as it is, in name order."""
    with psycopg.connect(url, autocommit=True) as conn:
        for path in sql_files():
            try:
                conn.execute(path.read_text())  # no parameters: sent as it is
            except psycopg.Error as exc:
                raise AssertionError(f"{path.name} failed: {exc}") from exc


def script_directory() -> ScriptDirectory:
    return ScriptDirectory(str(install.migrations_path()))


# Catalog look-ups run with search_path = pg_catalog, so that regclass and
# regprocedure output is schema-qualified.
def _scalar(url: str, query: str, params: Any = None) -> Any:
    with psycopg.connect(url, autocommit=True, options="-c search_path=pg_catalog") as conn:
        row = conn.execute(query, params).fetchone()
        return None if row is None else row[0]


def _rows(url: str, query: str, params: Any = None) -> list[tuple]:
    with psycopg.connect(url, autocommit=True, options="-c search_path=pg_catalog") as conn:
        return conn.execute(query, params).fetchall()


# ---------------------------------------------------------------------------
# The normalised catalog
#
# Each query returns (key..., field...) rows; the number says how many leading
# columns identify the object, the first two of which are (schema, relation)
# where EXCLUDED_RELATIONS applies.  A NULL ACL is shown as the default it
# stands for (acldefault), so PUBLIC's implicit privileges show up in a diff.
# Run with search_path = pg_catalog so that every pg_get_*def output is
# schema-qualified the same way in both databases.

CATALOG: dict[str, tuple[int, str]] = {
    "schema": (
        1,
        f"""
        SELECT n.nspname, pg_get_userbyid(n.nspowner) AS owner,
               coalesce(n.nspacl, acldefault('n', n.nspowner))::text[] AS acl,
               obj_description(n.oid, 'pg_namespace') AS comment
          FROM pg_namespace n WHERE {_USER_SCHEMA}
        """,
    ),
    "function": (
        3,
        f"""
        SELECT n.nspname, p.proname, pg_get_function_identity_arguments(p.oid) AS identity_args,
               pg_get_function_arguments(p.oid) AS arguments, pg_get_function_result(p.oid) AS result,
               l.lanname AS language, p.prokind AS kind, p.prosrc AS body,
               CASE WHEN p.prosqlbody IS NOT NULL THEN pg_get_functiondef(p.oid) END AS sql_body_definition,
               p.prosecdef AS security_definer, p.proconfig AS config, p.provolatile AS volatility,
               p.proparallel AS parallel, p.proisstrict AS strict, p.proleakproof AS leakproof,
               p.procost AS cost, p.prorows AS rows, pg_get_userbyid(p.proowner) AS owner,
               coalesce(p.proacl, acldefault('f', p.proowner))::text[] AS acl,
               obj_description(p.oid, 'pg_proc') AS comment
          FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace JOIN pg_language l ON l.oid = p.prolang
         WHERE {_USER_SCHEMA}
        """,
    ),
    "relation": (
        2,
        f"""
        SELECT n.nspname, c.relname, c.relkind AS kind, pg_get_userbyid(c.relowner) AS owner,
               coalesce(c.relacl, acldefault(CASE c.relkind WHEN 'S' THEN 's' ELSE 'r' END::"char", c.relowner))
                   ::text[] AS acl,
               c.relpersistence AS persistence, c.reloptions AS options,
               c.relrowsecurity AS row_security, c.relforcerowsecurity AS force_row_security,
               c.relreplident AS replica_identity, c.relispartition AS is_partition,
               CASE WHEN c.relkind = 'p' THEN pg_get_partkeydef(c.oid) END AS partition_key,
               obj_description(c.oid, 'pg_class') AS comment
          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE {_USER_SCHEMA} AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f', 'c')
        """,
    ),
    "column": (
        3,
        f"""
        SELECT n.nspname, c.relname, a.attname,
               row_number() OVER (PARTITION BY c.oid ORDER BY a.attnum) AS position,
               format_type(a.atttypid, a.atttypmod) AS type, a.attnotnull AS not_null,
               pg_get_expr(d.adbin, d.adrelid) AS default, a.attidentity AS identity,
               a.attgenerated AS generated,
               CASE WHEN a.attcollation <> t.typcollation THEN a.attcollation::regcollation::text END AS collation,
               a.attacl::text[] AS acl, col_description(c.oid, a.attnum) AS comment
          FROM pg_attribute a
          JOIN pg_class c ON c.oid = a.attrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
          JOIN pg_type t ON t.oid = a.atttypid
          LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE {_USER_SCHEMA} AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'c')
           AND a.attnum > 0 AND NOT a.attisdropped
        """,
    ),
    "sequence": (
        2,
        f"""
        SELECT n.nspname, c.relname, format_type(s.seqtypid, NULL) AS type, s.seqstart AS start,
               s.seqincrement AS increment, s.seqmin AS min, s.seqmax AS max, s.seqcache AS cache,
               s.seqcycle AS cycle,
               (SELECT od.refobjid::regclass::text || '.' || a.attname
                  FROM pg_depend od JOIN pg_attribute a ON a.attrelid = od.refobjid AND a.attnum = od.refobjsubid
                 WHERE od.classid = 'pg_class'::regclass AND od.objid = c.oid
                   AND od.refclassid = 'pg_class'::regclass AND od.deptype IN ('a', 'i')) AS owned_by
          FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE {_USER_SCHEMA}
        """,
    ),
    "constraint": (
        3,
        f"""
        SELECT n.nspname, coalesce(c.relname, ty.typname) AS relname, con.conname,
               con.contype AS type, pg_get_constraintdef(con.oid) AS definition,
               obj_description(con.oid, 'pg_constraint') AS comment
          FROM pg_constraint con
          JOIN pg_namespace n ON n.oid = con.connamespace
          LEFT JOIN pg_class c ON c.oid = con.conrelid
          LEFT JOIN pg_type ty ON ty.oid = con.contypid
         WHERE {_USER_SCHEMA}
        """,
    ),
    "index": (
        3,
        f"""
        SELECT n.nspname, c.relname, ic.relname AS index_name, pg_get_indexdef(i.indexrelid) AS definition,
               obj_description(ic.oid, 'pg_class') AS comment
          FROM pg_index i
          JOIN pg_class c ON c.oid = i.indrelid
          JOIN pg_class ic ON ic.oid = i.indexrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE {_USER_SCHEMA}
        """,
    ),
    # Triggers on any table of the database (a user table may carry one that
    # calls a pgbroker function).
    "trigger": (
        3,
        f"""
        SELECT n.nspname, c.relname, t.tgname, pg_get_triggerdef(t.oid) AS definition,
               t.tgenabled AS enabled, obj_description(t.oid, 'pg_trigger') AS comment
          FROM pg_trigger t
          JOIN pg_class c ON c.oid = t.tgrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
          JOIN pg_proc p ON p.oid = t.tgfoid
          JOIN pg_namespace pn ON pn.oid = p.pronamespace
         WHERE NOT t.tgisinternal
           AND ({_USER_SCHEMA} OR pn.nspname NOT IN ('pg_catalog', 'information_schema'))
        """,
    ),
    "view": (
        2,
        f"""
        SELECT n.nspname, c.relname, pg_get_viewdef(c.oid, true) AS definition
          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE {_USER_SCHEMA} AND c.relkind IN ('v', 'm')
        """,
    ),
    "rule": (
        3,
        f"""
        SELECT n.nspname, c.relname, r.rulename, pg_get_ruledef(r.oid) AS definition,
               obj_description(r.oid, 'pg_rewrite') AS comment
          FROM pg_rewrite r JOIN pg_class c ON c.oid = r.ev_class JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE {_USER_SCHEMA} AND r.rulename <> '_RETURN'
        """,
    ),
    "policy": (
        3,
        f"""
        SELECT n.nspname, c.relname, p.polname, p.polcmd AS command, p.polpermissive AS permissive,
               ARRAY(SELECT CASE WHEN r = 0 THEN 'PUBLIC' ELSE pg_get_userbyid(r)::text END
                       FROM unnest(p.polroles) r ORDER BY 1) AS roles,
               pg_get_expr(p.polqual, p.polrelid) AS using_expr,
               pg_get_expr(p.polwithcheck, p.polrelid) AS check_expr
          FROM pg_policy p JOIN pg_class c ON c.oid = p.polrelid JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE {_USER_SCHEMA}
        """,
    ),
    "type": (
        2,
        f"""
        SELECT n.nspname, t.typname, t.typtype AS kind,
               CASE WHEN t.typtype = 'd' THEN format_type(t.typbasetype, t.typtypmod) END AS base_type,
               t.typnotnull AS not_null, t.typdefault AS default,
               ARRAY(SELECT e.enumlabel::text FROM pg_enum e WHERE e.enumtypid = t.oid ORDER BY e.enumsortorder)
                   AS labels,
               pg_get_userbyid(t.typowner) AS owner, coalesce(t.typacl, acldefault('T', t.typowner))::text[] AS acl,
               obj_description(t.oid, 'pg_type') AS comment
          FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
         WHERE {_USER_SCHEMA} AND t.typtype IN ('d', 'e', 'r', 'm')
        """,
    ),
    "extension": (
        1,
        """
        SELECT e.extname, n.nspname AS schema, e.extversion AS version
          FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace
        """,
    ),
    "event_trigger": (
        1,
        """
        SELECT e.evtname, e.evtevent AS event, e.evtfoid::regprocedure::text AS function,
               e.evtenabled AS enabled, e.evttags AS tags
          FROM pg_event_trigger e
        """,
    ),
    "default_acl": (
        3,
        """
        SELECT pg_get_userbyid(d.defaclrole) AS role, coalesce(n.nspname, '(all schemas)') AS nspname,
               d.defaclobjtype AS object_type, d.defaclacl::text[] AS acl
          FROM pg_default_acl d LEFT JOIN pg_namespace n ON n.oid = d.defaclnamespace
        """,
    ),
    # Settings of this database (ALTER DATABASE ... SET, for all roles or one).
    "database_setting": (
        1,
        """
        SELECT CASE WHEN s.setrole = 0 THEN '(all roles)' ELSE pg_get_userbyid(s.setrole)::text END AS role,
               s.setconfig AS settings
          FROM pg_db_role_setting s
         WHERE s.setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database())
        """,
    ),
    # Roles are cluster-wide: the pgbroker ones and their memberships.
    "role": (
        1,
        """
        SELECT r.rolname, r.rolcanlogin AS login, r.rolsuper AS superuser, r.rolinherit AS inherit,
               r.rolcreaterole AS createrole, r.rolcreatedb AS createdb, r.rolbypassrls AS bypassrls,
               ARRAY(SELECT pg_get_userbyid(m.roleid)::text || CASE WHEN m.admin_option THEN ' (admin)' ELSE '' END
                       FROM pg_auth_members m WHERE m.member = r.oid ORDER BY 1) AS member_of,
               ARRAY(SELECT pg_get_userbyid(m.member)::text FROM pg_auth_members m
                      WHERE m.roleid = r.oid ORDER BY 1) AS members
          FROM pg_roles r WHERE r.rolname LIKE 'pgbroker\\_%'
        """,
    ),
}

Snapshot = dict[str, dict[tuple, dict[str, Any]]]


def _normalise(value: Any, dbname: str) -> Any:
    if isinstance(value, str):
        return value.replace(dbname, "<database>")
    if isinstance(value, list):
        items = [_normalise(v, dbname) for v in value]
        # ACLs and option lists: the order of the items carries no meaning.
        return sorted(items, key=str)
    return value


def snapshot(url: str) -> Snapshot:
    """The normalised catalog of every non-system schema of the database at ``url``."""
    result: Snapshot = {}
    with psycopg.connect(url, autocommit=True, options="-c search_path=pg_catalog") as conn:
        dbname = conn.execute("SELECT current_database()").fetchone()[0]
        for category, (nkeys, query) in CATALOG.items():
            cur = conn.execute(query)
            names = [d.name for d in cur.description]
            objects: dict[tuple, dict[str, Any]] = {}
            for row in cur:
                key = tuple(_normalise(v, dbname) for v in row[:nkeys])
                if category != "role" and key[:2] in EXCLUDED_RELATIONS:
                    continue
                fields = {name: _normalise(v, dbname) for name, v in zip(names[nkeys:], row[nkeys:], strict=True)}
                assert key not in objects, f"duplicate {category} key {key}"
                objects[key] = fields
            result[category] = objects
    return result


def _show(value: Any) -> str:
    return repr(value) if not isinstance(value, str) else value


def _label(category: str, key: tuple) -> str:
    if category == "function":
        return f"{key[0]}.{key[1]}({key[2]})"
    return ".".join(str(k) for k in key)


def diff_snapshots(a: Snapshot, b: Snapshot, a_name: str, b_name: str, skip: tuple[str, ...] = ()) -> str:
    """A readable report of how two snapshots differ ('' when they are equal)."""
    out: list[str] = []
    for category in CATALOG:
        if category in skip:
            continue
        left, right = a.get(category, {}), b.get(category, {})
        for key in sorted(set(left) | set(right), key=str):
            label = f"{category} {_label(category, key)}"
            if key not in right:
                out.append(f"- {label}: only in {a_name}")
                continue
            if key not in left:
                out.append(f"+ {label}: only in {b_name}")
                continue
            for field, lval in left[key].items():
                rval = right[key][field]
                if lval == rval:
                    continue
                if isinstance(lval, str) and isinstance(rval, str) and ("\n" in lval or "\n" in rval):
                    body = difflib.unified_diff(lval.splitlines(), rval.splitlines(), a_name, b_name, lineterm="", n=2)
                    out.append(f"~ {label}: {field} differs:\n    " + "\n    ".join(body))
                else:
                    out.append(f"~ {label}: {field}\n    {a_name}: {_show(lval)}\n    {b_name}: {_show(rval)}")
    return "\n".join(out)


# ---------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def built_dbs(pg_server: EmbeddedPostgres) -> Iterator[dict[str, str]]:
    """Two databases: one built by ``alembic upgrade heads``, one from sql/."""
    names = {"migrations": f"mig_built_{os.getpid()}", "sql": f"sql_built_{os.getpid()}"}
    urls = {kind: _create_database(pg_server, name) for kind, name in names.items()}
    try:
        install.migrate(urls["migrations"])
        load_sql(urls["sql"])
        yield urls
    finally:
        for name in names.values():
            _drop_database(pg_server, name)


@pytest.fixture(scope="module")
def private_server() -> Iterator[EmbeddedPostgres]:
    """A cluster of our own: role tests need one where no pgbroker role exists yet."""
    server = EmbeddedPostgres(postgres_options=os.environ.get("PGBROKER_TEST_PG_OPTIONS", ""))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def private_cluster(private_server: EmbeddedPostgres) -> Iterator[Callable[[str], str]]:
    """Create databases in the private cluster; drop them and every pgbroker role afterwards."""
    created: list[str] = []

    def _new(name: str) -> str:
        created.append(name)
        return _create_database(private_server, name)

    assert _existing_roles(private_server.url) == set(), "a previous test left pgbroker roles behind"
    try:
        yield _new
    finally:
        for name in created:
            _drop_database(private_server, name)
        _execute(private_server.url, *(f"DROP ROLE IF EXISTS {r}" for r in (*PGBROKER_ROLES, "app_login")))


@pytest.fixture
def notices() -> Iterator[list[str]]:
    """NOTICE messages the server sends to any SQLAlchemy connection (alembic's) during the test."""
    seen: list[str] = []

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.add_notice_handler(lambda diag: seen.append(diag.message_primary or ""))

    sqlalchemy.event.listen(sqlalchemy.pool.Pool, "connect", on_connect)
    try:
        yield seen
    finally:
        sqlalchemy.event.remove(sqlalchemy.pool.Pool, "connect", on_connect)


def _is_role_kept(notice: str) -> bool:
    return notice.startswith("role ") and "kept" in notice


def _existing_roles(url: str) -> set[str]:
    return {r[0] for r in _rows(url, "SELECT rolname FROM pg_roles WHERE rolname = ANY(%s)", (list(PGBROKER_ROLES),))}


def _installed_roles(url: str) -> set[str]:
    """The roles this database's installation recorded as created by it (and will try to drop)."""
    if _scalar(url, "SELECT to_regclass('pgbroker.installed')") is not None:
        return {r[0] for r in _rows(url, "SELECT object FROM pgbroker.installed WHERE kind = 'role'")}
    return {r[0] for r in _rows(url, "SELECT rolname FROM pgbroker.installed_role")}


def _db_search_path(url: str) -> list[str] | None:
    return _scalar(
        url,
        """
        SELECT s.setconfig FROM pg_db_role_setting s
         WHERE s.setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database()) AND s.setrole = 0
        """,
    )


# ---------------------------------------------------------------------------
# alembic-built == sql/-built


def test_sql_files_exist_and_are_ordered():
    names = [p.name for p in sql_files()]
    assert names == sorted(names)
    assert any(n.startswith("000_") for n in names), names


def _psql() -> str:
    return psql_path()


def test_sql_loads_with_psql_and_defines_each_function_once(pg_server, empty_db):
    """psql -v ON_ERROR_STOP=1 with check_function_bodies on, file by file in name
    order, into an empty database: no error, and no function created twice (an
    event trigger records every CREATE FUNCTION, OR REPLACE included)."""
    _execute(
        empty_db,
        "CREATE SCHEMA audit",
        "CREATE TABLE audit.created (file text, identity text)",
        """CREATE FUNCTION audit.record() RETURNS event_trigger LANGUAGE plpgsql AS $$
           BEGIN
               INSERT INTO audit.created
               SELECT current_setting('audit.file', true), c.object_identity
                 FROM pg_event_trigger_ddl_commands() c WHERE c.command_tag = 'CREATE FUNCTION';
           END $$""",
        "CREATE EVENT TRIGGER record_functions ON ddl_command_end EXECUTE FUNCTION audit.record()",
    )
    env = {**_clean_env(), "PGOPTIONS": "-c check_function_bodies=on"}
    for path in sql_files():
        env["PGOPTIONS"] = f"-c check_function_bodies=on -c audit.file={path.name}"
        done = subprocess.run(
            [_psql(), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", empty_db, "-f", str(path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"{path.name} failed to load:\n{done.stderr}"
    rows = _rows(empty_db, "SELECT identity, array_agg(file ORDER BY file) FROM audit.created GROUP BY 1")
    assert rows, "no function was created?"
    twice = {identity: files for identity, files in rows if len(files) > 1}
    assert not twice, f"functions created more than once: {twice}"


_DEFINES = re.compile(r"^CREATE (?:UNLOGGED )?(?:TABLE|VIEW|SEQUENCE|FUNCTION) pgbroker\.(\w+)", re.MULTILINE)
_REFERS = re.compile(r"pgbroker\.(\w+)")


def _code(text: str) -> str:
    """SQL without comments, COMMENT ON statements and quoted literals (prose may point anywhere)."""
    text = re.sub(r"^COMMENT ON .*?(?:\$\$;|';)$", "", text, flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"--[^\n]*", "", text)
    return re.sub(r"'(?:[^']|'')*'", "''", text)


def test_sql_files_never_refer_forward():
    """sql/ reads top to bottom: a file refers only to pgbroker objects defined in it or in files before it."""
    files = sql_files()
    defined_in = {}
    for i, path in enumerate(files):
        for name in _DEFINES.findall(path.read_text()):
            defined_in.setdefault(name, i)
    forward = []
    for i, path in enumerate(files):
        for name in set(_REFERS.findall(_code(path.read_text()))):
            if name.endswith("_") or name == "alembic_version":  # format() templates; alembic's table
                continue
            # An identity column's sequence (<table>_<column>_seq) comes with its table.
            where = defined_in.get(name, defined_in.get(name.rsplit("_", 2)[0]) if name.endswith("_seq") else None)
            if where is None or where > i:
                later = files[where].name if where is not None else "nowhere"
                forward.append(f"{path.name} refers to pgbroker.{name}, defined in {later}")
    assert not forward, "\n".join(sorted(forward))


def test_catalog_migrations_equal_sql(built_dbs):
    migrated = snapshot(built_dbs["migrations"])
    from_sql = snapshot(built_dbs["sql"])
    assert migrated["function"], "nothing installed?"
    assert {k[0] for k in migrated["schema"]} >= {PGBROKER_SCHEMA}
    report = diff_snapshots(migrated, from_sql, "alembic upgrade heads", "sql/*.sql")
    assert not report, (
        "a database built by the migrations differs from one built from sql/:\n"
        + report
        + "\n(sql/ holds the current definitions: add a revision that brings the migrations there, drafted by "
        + 'python3 migrations/new_revision.py "what changed" (migrations/README.md, "Revisions"), or fix sql/)'
    )


def test_the_catalog_comparison_sees_each_kind_of_change(db_url):
    """What "the same catalog" covers: a change of each kind shows up in the report, named."""
    before = snapshot(db_url)
    _execute(
        db_url,
        # a function's body, and another's comment and grant
        "CREATE OR REPLACE FUNCTION pgbroker.schema_version() RETURNS text LANGUAGE sql IMMUTABLE"
        " SET search_path = pg_catalog, pg_temp AS $$ SELECT '9.9.9'::text $$",
        "COMMENT ON FUNCTION pgbroker.lock_key(text) IS 'changed'",
        "GRANT EXECUTE ON FUNCTION pgbroker.lock_key(text) TO pgbroker_reader",
        # a table's column, its comment, an index, a trigger, a table grant
        "ALTER TABLE pgbroker.installed ADD COLUMN note text",
        "COMMENT ON COLUMN pgbroker.installed.object IS 'changed'",
        "CREATE INDEX installed_at ON pgbroker.installed (installed_at)",
        "CREATE TRIGGER practice AFTER INSERT ON pgbroker.installed FOR EACH STATEMENT"
        " EXECUTE FUNCTION suppress_redundant_updates_trigger()",
        "GRANT SELECT ON pgbroker.installed TO pgbroker_reader",
    )
    report = diff_snapshots(before, snapshot(db_url), "before", "after")
    for says in (
        "~ function pgbroker.schema_version(): body",
        "~ function pgbroker.lock_key(name text): comment",
        "~ function pgbroker.lock_key(name text): acl",
        "+ column pgbroker.installed.note: only in after",
        "~ column pgbroker.installed.object: comment",
        "+ index pgbroker.installed.installed_at: only in after",
        "+ trigger pgbroker.installed.practice: only in after",
        "~ relation pgbroker.installed: acl",
    ):
        assert says in report, f"{says!r} not in:\n{report}"


def test_catalog_roles_and_search_path(built_dbs):
    """Both builds create the roles, make admin a member of the others and append pgbroker to search_path."""
    for kind, url in built_dbs.items():
        snap = snapshot(url)
        roles = snap["role"]
        assert {k[0] for k in roles} >= set(PGBROKER_ROLES), kind
        for (name,), role in roles.items():
            if name in PGBROKER_ROLES:
                assert not role["login"] and not role["superuser"], (kind, name, role)
        assert set(roles[("pgbroker_admin",)]["member_of"]) >= {"pgbroker_broker", "pgbroker_reader"}, kind
        setting = snap["database_setting"][("(all roles)",)]["settings"]
        search_path = [s for s in setting if s.startswith("search_path=")]
        assert search_path and search_path[0].endswith(", pgbroker"), (kind, setting)


# ---------------------------------------------------------------------------
# Revisions


def test_single_head_and_branch_label():
    script = script_directory()
    heads = script.get_heads()
    assert len(heads) == 1, f"several alembic heads: {heads} (alembic upgrade head would fail)"
    bases = script.get_bases()
    assert len(bases) == 1, f"several base revisions: {bases}"
    base = script.get_revision(bases[0])
    assert "pgbroker" in base.branch_labels, f"base revision {base.revision} lacks the branch label 'pgbroker'"
    assert install.BRANCH_LABEL == "pgbroker"
    # The branch label resolves to the head, which is what a host project's
    # `alembic upgrade pgbroker@head` uses.
    assert script.get_revision("pgbroker@head").revision == heads[0]


def _mentions_live_sql(source: str) -> bool:
    """Whether code (not comments or docstrings) refers to the live sql/ directory."""
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Name) and node.id == "sql_path") or (
            isinstance(node, ast.Attribute) and node.attr == "sql_path"
        ):
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value.strip()
            if text in ("sql", "../sql") or text.startswith(("sql/", "../sql/")):
                return True
    return False


def test_revisions_run_frozen_sql_beside_them():
    """Each revision runs its own frozen SQL files, never the live sql/ directory."""
    for rev in script_directory().walk_revisions():
        module = Path(rev.path)
        source = module.read_text()
        assert not _mentions_live_sql(source), f"{module.name} reads sql/ at run time"
        if "run_revision_sql" in source:
            base = module.with_suffix("")
            for suffix in (".sql", ".downgrade.sql"):
                frozen = base.with_name(base.name + suffix)
                assert frozen.is_file(), f"{module.name}: {frozen.name} is missing"


# Released revisions never change: a change to the schema is a new revision.
# migrations/released.json holds the sha256 of every revision file of every
# release (migrations/release.py wrote it at the release).


def _module_from(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _release_module():
    return _module_from(REPO / "migrations" / "release.py", "pgbroker_release")


def _build_baseline_module():
    return _module_from(REPO / "migrations" / "build_baseline.py", "build_baseline")


def test_released_revisions_are_unchanged():
    release = _release_module()
    releases = release.load()
    assert [r["version"] for r in releases][:1] == ["0.1.0"], "0.1.0 is released: migrations/released.json lists it"
    problems = release.verify(releases, install.versions_path())
    assert not problems, "\n".join(problems)


def test_the_checksum_test_fails_on_an_edited_revision(tmp_path):
    """verify() (what the test above runs) reports one changed byte and a removed file of a released revision."""
    release = _release_module()
    releases = release.load()
    copy = tmp_path / "versions"
    shutil.copytree(install.versions_path(), copy)
    assert release.verify(releases, copy) == []
    target = copy / "0001_baseline.sql"
    target.write_text(target.read_text().replace("pgbroker", "pgbrokeR", 1))
    (copy / "0002_initech.py").unlink()
    problems = release.verify(releases, copy)
    assert len(problems) == 2, problems
    assert "0001_baseline.sql was released in 0.1.0 and has changed" in problems[0]
    assert "0002_initech.py (released in 0.1.0) is gone" in problems[1]


def test_build_baseline_refuses_to_rewrite_a_released_revision():
    done = subprocess.run(
        [sys.executable, str(REPO / "migrations" / "build_baseline.py")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and "were released and never change" in done.stderr, done.stderr
    assert release_problems() == []


def release_problems() -> list[str]:
    release = _release_module()
    return release.verify(release.load(), install.versions_path())


def test_each_release_is_a_revision_of_the_chain_and_its_schema_version():
    """Each release names its head revision, and the revisions up to it leave schema_version() at its version."""
    release = _release_module()
    chain = release.chain(install.versions_path())
    ids = [m.revision for m in chain]
    for entry in release.load():
        assert entry["head"] in ids, entry
        upto = chain[: ids.index(entry["head"]) + 1]
        assert release.schema_version_at(upto) == entry["schema_version"] == entry["version"]
    # The newest revisions leave what this package and sql/ say.
    assert release.schema_version_at(chain) == install.SCHEMA_VERSION == _build_baseline_module().schema_version()


_SETS_VERSION = re.compile(r"FUNCTION pgbroker\.schema_version\(\)[^;]*?AS \$(\w*)\$ SELECT '([^']*)'::text \$\1\$")


def schema_version_problems(versions: Path) -> list[str]:
    """Revisions whose module's ``schema_version`` is not what their SQL sets pgbroker.schema_version() to."""
    problems = []
    for path in sorted(versions.glob("*.py")):
        module = _module_from(path, f"rev_{path.stem}")
        declared = getattr(module, "schema_version", "missing")
        if declared == "missing":
            problems.append(f"{path.name} does not say which schema_version it leaves (None: unchanged)")
            continue
        sql = path.with_suffix(".sql").read_text() if path.with_suffix(".sql").exists() else ""
        sets = [m.group(2) for m in _SETS_VERSION.finditer(sql)]
        if sets != ([] if declared is None else [declared]):
            problems.append(f"{path.name} says schema_version = {declared!r}, its SQL sets {sets}")
    return problems


def test_each_revision_sets_the_schema_version_it_declares():
    """A revision whose module says schema_version = X replaces pgbroker.schema_version() to return X."""
    assert schema_version_problems(install.versions_path()) == []


def test_schema_version_is_the_packages(built_dbs):
    for url in built_dbs.values():
        assert _scalar(url, "SELECT pgbroker.schema_version()") == install.SCHEMA_VERSION
    assert install.compare_schema(install.SCHEMA_VERSION).state == "same"


# ---------------------------------------------------------------------------
# upgrade -> downgrade base -> upgrade

CUSTOM_SEARCH_PATHS = {
    "default": None,
    "custom": 'app, "$user", public',
    "quoted": '"we""ird, name", public',
}


@pytest.mark.parametrize("search_path", list(CUSTOM_SEARCH_PATHS.values()), ids=list(CUSTOM_SEARCH_PATHS))
def test_upgrade_downgrade_upgrade(pg_server, empty_db, search_path):
    url = empty_db
    dbname = _scalar(url, "SELECT current_database()")
    if search_path is not None:
        _execute(pg_server.url, f"ALTER DATABASE {dbname} SET search_path = {search_path}")
    before = snapshot(url)
    setting_before = _db_search_path(url)
    head = script_directory().get_current_head()

    install.migrate(url)
    assert install.current_revision(url) == (head,)
    first = snapshot(url)
    installed = _db_search_path(url)
    assert installed is not None and installed[0].endswith(", pgbroker"), installed
    if search_path is not None:
        # The user's own entries are kept, in order, in front of pgbroker.
        assert installed == [f"search_path={search_path}, pgbroker"], installed

    install.downgrade(url, "base")
    assert install.current_revision(url) == ()
    after = snapshot(url)
    report = diff_snapshots(before, after, "before upgrade", "after downgrade base")
    assert not report, "downgrade base left the database different from before the upgrade:\n" + report
    assert _db_search_path(url) == setting_before
    assert _leftovers(url) == []

    install.migrate(url)
    again = snapshot(url)
    report = diff_snapshots(first, again, "first upgrade", "upgrade after downgrade")
    assert not report, "upgrade -> downgrade -> upgrade gives a different catalog:\n" + report
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT broker_claim('roundtrip')").fetchone()[0] == 1


def test_each_downgrade_step_gives_back_the_revision_before_it(empty_db):
    # Every revision's downgrade is exact on its own, not only all the way to
    # base, with a watched table of the user's in place.
    url = empty_db
    chain = [r.revision for r in reversed(list(script_directory().walk_revisions()))]
    install.migrate(url, chain[0])
    _execute(url, "CREATE TABLE public.pairs (a integer, b text, v integer, PRIMARY KEY (a, b))")
    _execute(url, "SELECT pgbroker.watch('public.pairs')")
    at = {chain[0]: snapshot(url)}
    for revision in chain[1:]:
        install.migrate(url, revision)
        at[revision] = snapshot(url)
    for before, after in reversed(list(zip(chain[:-1], chain[1:], strict=True))):
        install.downgrade(url, before)
        assert install.current_revision(url) == (before,)
        report = diff_snapshots(at[before], snapshot(url), f"upgrade to {before}", f"downgrade from {after}")
        assert not report, f"downgrading {after} does not give back {before}:\n" + report


def _leftovers(url: str) -> list[str]:
    """Anything in the database that still mentions pgbroker."""
    return [
        f"{kind}: {name}"
        for kind, name in _rows(
            url,
            """
            SELECT 'schema', nspname::text FROM pg_namespace WHERE nspname = 'pgbroker'
            UNION ALL
            SELECT 'function', p.oid::regprocedure::text FROM pg_proc p
             WHERE p.pronamespace <> 'pg_catalog'::regnamespace
               AND (p.prosrc ILIKE '%pgbroker%' OR p.proname ILIKE '%broker%')
            UNION ALL
            SELECT 'relation', c.oid::regclass::text FROM pg_class c
             WHERE c.relnamespace <> 'pg_catalog'::regnamespace AND c.relnamespace <> 'pg_toast'::regnamespace
               AND (c.relname ILIKE '%broker%'
                    OR (c.relkind IN ('v', 'm') AND pg_get_viewdef(c.oid) ILIKE '%pgbroker%'))
            UNION ALL
            SELECT 'trigger', t.tgname::text FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
             WHERE NOT t.tgisinternal AND (p.prosrc ILIKE '%pgbroker%' OR t.tgname ILIKE '%broker%')
            UNION ALL
            SELECT 'default acl', d.oid::text FROM pg_default_acl d
             WHERE d.defaclnamespace <> 0
               AND NOT EXISTS (SELECT FROM pg_namespace n WHERE n.oid = d.defaclnamespace)
            UNION ALL
            SELECT 'setting', s FROM pg_db_role_setting r, unnest(r.setconfig) s
             WHERE r.setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND s ILIKE '%pgbroker%'
            """,
        )
    ]


# Roles are cluster-wide, so these tests use a cluster of their own.


def test_downgrade_drops_the_roles_it_created(private_cluster, notices):
    url = private_cluster("roles_alone")
    install.migrate(url)
    assert _existing_roles(url) == set(PGBROKER_ROLES)
    assert _installed_roles(url) == set(PGBROKER_ROLES)
    install.downgrade(url, "base")
    assert _existing_roles(url) == set()
    assert not [n for n in notices if _is_role_kept(n)], notices


def test_downgrade_keeps_roles_it_did_not_create(private_cluster):
    url = private_cluster("roles_preexisting")
    # The DBA created one role beforehand and granted it to an application role.
    _execute(
        url, "CREATE ROLE pgbroker_reader NOLOGIN", "CREATE ROLE app_login LOGIN", "GRANT pgbroker_reader TO app_login"
    )
    install.migrate(url)
    assert _installed_roles(url) == {"pgbroker_admin", "pgbroker_broker", "pgbroker_user"}
    install.downgrade(url, "base")
    assert _existing_roles(url) == {"pgbroker_reader"}
    members = _rows(
        url,
        "SELECT pg_get_userbyid(member)::text FROM pg_auth_members WHERE roleid = 'pgbroker_reader'::regrole",
    )
    assert members == [("app_login",)]


def test_downgrade_keeps_roles_another_database_uses(private_cluster, notices):
    first = private_cluster("roles_first")
    second = private_cluster("roles_second")
    install.migrate(first)  # creates the roles and records them
    install.migrate(second)  # finds them: records nothing
    assert _installed_roles(first) == set(PGBROKER_ROLES)
    assert _installed_roles(second) == set()
    _execute(first, "CREATE ROLE app_login LOGIN", "GRANT pgbroker_broker TO app_login")

    install.downgrade(first, "base")
    # DROP ROLE fails (the second database still grants to them): kept, with a NOTICE each.
    assert _existing_roles(first) == set(PGBROKER_ROLES)
    kept = sorted(n for n in notices if _is_role_kept(n))
    assert len(kept) == len(PGBROKER_ROLES) and all(any(r in n for n in kept) for r in PGBROKER_ROLES), notices

    # The second database is untouched and works for a login role.
    host_url = second.replace("postgres@", "app_login@", 1)
    with psycopg.connect(host_url, autocommit=True) as conn:
        assert conn.execute("SELECT broker_claim('other')").fetchone()[0] == 1

    # Its downgrade only tries to drop roles recorded in its own installed_role
    # (none), so the roles stay.  (Current design: nobody records them any more.)
    notices.clear()
    install.downgrade(second, "base")
    assert _existing_roles(second) == set(PGBROKER_ROLES)
    assert not [n for n in notices if _is_role_kept(n)], notices


# ---------------------------------------------------------------------------
# The documented command line: alembic in the repo root with DATABASE_URL.


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG") and k != "DATABASE_URL"}
    env.update(extra)
    return env


def _alembic_command() -> list[str]:
    beside = Path(sys.executable).with_name("alembic")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("alembic")
    return [found] if found else [sys.executable, "-m", "alembic"]


def test_alembic_cli_and_unqualified_psql_call(empty_db):
    env = _clean_env(DATABASE_URL=empty_db)
    up = subprocess.run(
        [*_alembic_command(), "upgrade", "head"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert up.returncode == 0, f"alembic upgrade head failed:\n{up.stdout}\n{up.stderr}"
    assert install.current_revision(empty_db) == (script_directory().get_current_head(),)

    psql = psql_path()
    # A plain psql session, default settings (-X: no ~/.psqlrc).
    claim = subprocess.run(
        [psql, "-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", empty_db, "-c", "SELECT broker_claim()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert claim.returncode == 0, claim.stderr
    assert claim.stdout.strip() == "1", claim.stdout

    down = subprocess.run(
        [*_alembic_command(), "downgrade", "base"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert down.returncode == 0, f"alembic downgrade base failed:\n{down.stdout}\n{down.stderr}"
    assert _leftovers(empty_db) == []


def test_alembic_core_only_without_initech(empty_db):
    """migrations/README.md: `alembic -x initech=no upgrade head` installs the core without initech.objects."""
    env = _clean_env(DATABASE_URL=empty_db)
    up = subprocess.run(
        [*_alembic_command(), "-x", "initech=no", "upgrade", "head"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert up.returncode == 0, f"{up.stdout}\n{up.stderr}"
    assert install.current_revision(empty_db) == (script_directory().get_current_head(),)
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT to_regnamespace('initech')").fetchone()[0] is None
        assert conn.execute("SELECT count(*) FROM pgbroker.watched").fetchone()[0] == 0
    down = subprocess.run(
        [*_alembic_command(), "downgrade", "base"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert down.returncode == 0, f"{down.stdout}\n{down.stderr}"
    assert _leftovers(empty_db) == []


# ---------------------------------------------------------------------------
# Documentation and privileges of everything in schema pgbroker, for both builds.


@pytest.fixture(params=["migrations", "sql"])
def built_url(request, built_dbs) -> str:
    return built_dbs[request.param]


def test_everything_has_a_comment(built_url):
    missing = [
        f"{kind} {name}"
        for kind, name in _rows(
            built_url,
            """
            SELECT 'function', p.oid::regprocedure::text FROM pg_proc p
             WHERE p.pronamespace = 'pgbroker'::regnamespace AND obj_description(p.oid, 'pg_proc') IS NULL
            UNION ALL
            SELECT CASE c.relkind WHEN 'v' THEN 'view' WHEN 'm' THEN 'materialized view' ELSE 'table' END,
                   c.oid::regclass::text
              FROM pg_class c
             WHERE c.relnamespace = 'pgbroker'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
               AND c.relname <> 'alembic_version' AND obj_description(c.oid, 'pg_class') IS NULL
            UNION ALL
            SELECT 'column', c.oid::regclass::text || '.' || quote_ident(a.attname)
              FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid
             WHERE c.relnamespace = 'pgbroker'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
               AND c.relname <> 'alembic_version' AND a.attnum > 0 AND NOT a.attisdropped
               AND col_description(c.oid, a.attnum) IS NULL
            UNION ALL
            SELECT 'schema', n.nspname::text FROM pg_namespace n
             WHERE n.nspname = 'pgbroker' AND obj_description(n.oid, 'pg_namespace') IS NULL
            ORDER BY 1, 2
            """,
        )
    ]
    assert not missing, f"{len(missing)} objects in schema pgbroker have no COMMENT:\n  " + "\n  ".join(missing)


def test_security_definer_functions_pin_search_path(built_url):
    bad = _rows(
        built_url,
        """
        SELECT p.oid::regprocedure::text, p.proconfig FROM pg_proc p
         WHERE p.pronamespace = 'pgbroker'::regnamespace AND p.prosecdef
           AND NOT coalesce('search_path=pg_catalog, pg_temp' = ANY(p.proconfig), false)
         ORDER BY 1
        """,
    )
    assert not bad, "SECURITY DEFINER functions without SET search_path = pg_catalog, pg_temp:\n  " + "\n  ".join(
        f"{name}: {config}" for name, config in bad
    )


def test_public_has_no_privilege(built_url):
    """PUBLIC (grantee 0) has nothing on the schema, its relations, or its functions."""
    granted = _rows(
        built_url,
        """
        SELECT 'schema ' || n.nspname, a.privilege_type
          FROM pg_namespace n, aclexplode(coalesce(n.nspacl, acldefault('n', n.nspowner))) a
         WHERE n.nspname = 'pgbroker' AND a.grantee = 0
        UNION ALL
        SELECT 'relation ' || c.oid::regclass::text, a.privilege_type
          FROM pg_class c,
               aclexplode(coalesce(c.relacl, acldefault(CASE WHEN c.relkind = 'S' THEN 's' ELSE 'r' END::"char",
                                                        c.relowner))) a
         WHERE c.relnamespace = 'pgbroker'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')
           AND a.grantee = 0
        UNION ALL
        SELECT 'function ' || p.oid::regprocedure::text, a.privilege_type
          FROM pg_proc p, aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
         WHERE p.pronamespace = 'pgbroker'::regnamespace AND a.grantee = 0
        ORDER BY 1, 2
        """,
    )
    # PUBLIC has USAGE on the schema (so that a role without pgbroker rights is
    # told it lacks the right to call a function, not that there is none) and
    # may ask for the schema's version; nothing else.
    granted = [
        g for g in granted if g not in (("schema pgbroker", "USAGE"), ("function pgbroker.schema_version()", "EXECUTE"))
    ]
    assert not granted, "PUBLIC has privileges in schema pgbroker:\n  " + "\n  ".join(
        f"{obj}: {priv}" for obj, priv in granted
    )
    # proacl NULL means the default (EXECUTE for PUBLIC) was never revoked.
    default_acl = _rows(
        built_url,
        """
        SELECT p.oid::regprocedure::text FROM pg_proc p
         WHERE p.pronamespace = 'pgbroker'::regnamespace
           AND (p.proacl IS NULL OR EXISTS (SELECT FROM unnest(p.proacl::text[]) i WHERE i LIKE '=%X%/%'))
           AND p.oid <> 'pgbroker.schema_version()'::regprocedure
        """,
    )
    assert not default_acl, f"functions still executable by PUBLIC: {default_acl}"


def test_default_privileges_do_not_grant_to_public(built_url):
    """No default ACL in a pgbroker schema hands anything to PUBLIC."""
    rows = _rows(
        built_url,
        """
        SELECT coalesce(d.defaclnamespace::regnamespace::text, '(all)'), d.defaclobjtype, d.defaclacl::text[]
          FROM pg_default_acl d
         WHERE EXISTS (SELECT FROM aclexplode(d.defaclacl) a WHERE a.grantee = 0)
        """,
    )
    assert not rows, f"default privileges granting to PUBLIC: {rows}"
