"""Draft the next alembic revision from what sql/ changed since the newest revision.

    python3 migrations/new_revision.py "filtered subscriptions"
    python3 migrations/new_revision.py "release 0.2.0" --schema-version 0.2.0   # before release.py 0.2.0

sql/ is the truth; a revision brings a database built by the revisions so
far to what sql/ builds.  This script, run from a checkout with the ``test``
extra installed (it starts a throwaway PostgreSQL and reuses the catalog
comparison of tests/test_migrations.py):

1. numbers the revision (``pgbroker_0003_filtered_subscriptions`` after
   ``0002``) and gives it the schema version ``<last release>+<number>``
   (``0.1.0+3``), written into ``sql/000_schema.sql``'s ``schema_version()``
   and ``pgbroker.install.SCHEMA_VERSION``;
2. builds one database from the revisions so far and one from sql/, and
   compares their functions: a new or changed function is written as
   ``CREATE OR REPLACE`` (with its comment and grants when new; ``DROP`` and
   ``CREATE`` when its result type changed), a removed one as ``DROP``; the
   downgrade does the reverse, from the revisions' definitions;
3. lists everything else that differs (tables, columns, indexes, triggers,
   grants, comments of other objects) as ``-- TODO`` lines at the top of the
   upgrade: write those statements by hand, with their downgrade.

Then ``python3 -m pytest tests/test_migrations.py tests/test_upgrade.py``:
the catalog test fails until the revision builds exactly what sql/ builds,
and the upgrade test runs it from every release under load.  Statements
that lock a table writers use go last, so the upgrade holds those locks for
the shortest time (migrations/README.md, "Upgrading").
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VERSIONS = HERE / "versions"

FUNCTIONS_SQL = """
SELECT p.oid::regprocedure::text AS identity, pg_get_functiondef(p.oid) AS definition,
       pg_get_function_result(p.oid) AS result, obj_description(p.oid, 'pg_proc') AS comment,
       ARRAY(SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END
               || ' ' || a.privilege_type
               FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
              WHERE a.grantee <> p.proowner ORDER BY 1) AS grants
  FROM pg_proc p WHERE p.pronamespace = 'pgbroker'::regnamespace
"""

REVISION_PY = '''"""{message}

Revision ID: {revision}
Revises: {down_revision}

Drafted by migrations/new_revision.py; the SQL it runs lives beside it
({stem}.sql, {stem}.downgrade.sql).  Once released it never changes.
"""

from pgbroker.install import run_revision_sql

revision = "{revision}"
down_revision = "{down_revision}"
branch_labels = None
depends_on = None
# What pgbroker.schema_version() returns once this revision ran.
schema_version = "{schema_version}"


def upgrade() -> None:
    run_revision_sql(__file__, "upgrade")


def downgrade() -> None:
    run_revision_sql(__file__, "downgrade")
'''


def _slug(message: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", message.lower()).strip("_")[:40] or "change"


def _literal(text: str | None) -> str:
    return "NULL" if text is None else "'" + text.replace("'", "''") + "'"


def _grants(identity: str, grants: list[str]) -> list[str]:
    out = []
    for grant in grants:
        grantee, privilege = grant.rsplit(" ", 1)
        out.append(f"GRANT {privilege} ON FUNCTION {identity} TO {grantee};")
    return out


def _create(identity: str, f: dict[str, Any]) -> list[str]:
    """A new function: its definition, comment and grants (PUBLIC's default EXECUTE revoked)."""
    return [
        f["definition"].rstrip() + ";",
        f"COMMENT ON FUNCTION {identity} IS {_literal(f['comment'])};",
        f"REVOKE ALL ON FUNCTION {identity} FROM PUBLIC;",
        *_grants(identity, f["grants"]),
    ]


def _change(identity: str, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The statements that take function ``identity`` from ``old`` to ``new``."""
    out = []
    if old["result"] != new["result"]:
        out.append(f"DROP FUNCTION {identity};  -- its result type changed: dropped and created again")
        return out + _create(identity, new)
    if old["definition"] != new["definition"]:
        out.append(new["definition"].rstrip() + ";")
    if old["comment"] != new["comment"]:
        out.append(f"COMMENT ON FUNCTION {identity} IS {_literal(new['comment'])};")
    if old["grants"] != new["grants"]:
        for grant in sorted(set(old["grants"]) - set(new["grants"])):
            grantee, privilege = grant.rsplit(" ", 1)
            out.append(f"REVOKE {privilege} ON FUNCTION {identity} FROM {grantee};")
        out += _grants(identity, sorted(set(new["grants"]) - set(old["grants"])))
    return out


def function_statements(head: dict[str, dict], target: dict[str, dict]) -> list[str]:
    """Statements that take the functions of ``head`` to those of ``target`` (identity -> fields)."""
    out: list[str] = []
    for identity in sorted(set(head) - set(target)):
        out.append(f"DROP FUNCTION {identity};")
    for identity in sorted(set(target) - set(head)):
        out += _create(identity, target[identity])
    for identity in sorted(set(head) & set(target)):
        out += _change(identity, head[identity], target[identity])
    return out


def _functions(url: str) -> dict[str, dict[str, Any]]:
    import psycopg
    from psycopg.rows import dict_row

    with (
        psycopg.connect(url, autocommit=True, options="-c search_path=pg_catalog") as conn,
        conn.cursor(row_factory=dict_row) as cur,
    ):
        return {row.pop("identity"): row for row in cur.execute(FUNCTIONS_SQL)}


def _set_schema_version(version: str) -> None:
    """Write ``version`` into sql/000_schema.sql's schema_version() and pgbroker/install.py's SCHEMA_VERSION."""
    schema = ROOT / "sql" / "000_schema.sql"
    text, n = re.subn(
        r"(FUNCTION pgbroker\.schema_version\(\)[^;]*?AS \$\$ SELECT ')[^']*('::text \$\$;)",
        lambda m: m.group(1) + version + m.group(2),
        schema.read_text(),
    )
    assert n == 1, "sql/000_schema.sql: schema_version() not found"
    schema.write_text(text)
    module = ROOT / "pgbroker" / "install.py"
    text, n = re.subn(r'^SCHEMA_VERSION = "[^"]*"', f'SCHEMA_VERSION = "{version}"', module.read_text(), flags=re.M)
    assert n == 1, "pgbroker/install.py: SCHEMA_VERSION not found"
    module.write_text(text)


def main(argv: list[str]) -> int:
    release_version = None
    if len(argv) == 3 and argv[1] == "--schema-version":
        argv, release_version = argv[:1], argv[2]
    if len(argv) != 1 or argv[0].startswith("-"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    sys.path[:0] = [str(HERE), str(ROOT / "tests"), str(ROOT)]
    import psycopg
    import release
    import test_migrations

    from pgbroker import install
    from pgbroker._embedded import EmbeddedPostgres

    message = argv[0]
    chain = release.chain()
    releases = release.load()
    if not releases:
        print("new_revision.py: nothing is released yet: run migrations/release.py first", file=sys.stderr)
        return 1
    number = len(chain) + 1
    stem = f"{number:04d}_{_slug(message)}"
    revision = f"pgbroker_{stem}"
    version = release_version or f"{releases[-1]['version']}+{number}"
    _set_schema_version(version)

    with EmbeddedPostgres() as server:
        urls = {}
        for name in ("head", "target"):
            # Names no comment contains: the catalog comparison writes a database's name as <database>.
            dbname = f"pgbroker_new_revision_{name}_db"
            with psycopg.connect(server.url, autocommit=True) as conn:
                conn.execute(f"CREATE DATABASE {dbname}")
            urls[name] = server.url_for(dbname)
        install.migrate(urls["head"], initech=True)
        test_migrations.load_sql(urls["target"])
        head, target = _functions(urls["head"]), _functions(urls["target"])
        rest = test_migrations.diff_snapshots(
            test_migrations.snapshot(urls["head"]),
            test_migrations.snapshot(urls["target"]),
            "revisions so far",
            "sql/",
            skip=("function",),
        )

    todo = [f"-- TODO {line}" for line in rest.splitlines()]
    templates = [i for i in set(head) | set(target) if i.startswith(("pgbroker._watch_", "pgbroker._render("))]
    if any(head.get(i) != target.get(i) for i in templates):
        todo.append(
            "-- TODO the watch triggers' templates changed: the trigger functions of tables already watched keep "
            "the old rendering until re-rendered (their functions only: CREATE OR REPLACE takes no table lock)"
        )
    header = (
        f"-- {revision}: {message}.\n"
        "-- Drafted by migrations/new_revision.py from sql/; review it, then complete the TODOs.\n"
    )
    upgrade = header + "\n".join([*todo, "", *function_statements(head, target)]) + "\n"
    downgrade = (
        f"-- Undo {revision}.\n"
        + ("-- TODO undo the TODOs of the upgrade\n" if todo else "")
        + "\n".join(function_statements(target, head))
        + "\n"
    )
    (VERSIONS / f"{stem}.py").write_text(
        REVISION_PY.format(
            message=f"pgbroker: {message}.",
            revision=revision,
            down_revision=chain[-1].revision,
            stem=stem,
            schema_version=version,
        )
    )
    (VERSIONS / f"{stem}.sql").write_text(upgrade)
    (VERSIONS / f"{stem}.downgrade.sql").write_text(downgrade)
    print(f"new_revision.py: wrote migrations/versions/{stem}.py, .sql and .downgrade.sql (schema version {version})")
    for line in todo:
        print(f"new_revision.py: {line[3:]}")
    print("new_revision.py: then run python3 -m pytest tests/test_migrations.py tests/test_upgrade.py")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
