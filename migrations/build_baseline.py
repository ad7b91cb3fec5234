"""Generate the baseline alembic revisions from sql/.

    python3 migrations/release.py 0.1.0            # the release: runs this, then records checksums

Until pgbroker's first release its schema was one baseline revision,
generated here from ``sql/``.  0.1.0 froze them: once
``migrations/released.json`` lists their files this script refuses to write
them (``migrations/release.py`` re-freezes 0.1.0 with ``--release`` until the
tag ``v0.1.0`` exists).

* ``pgbroker_0001_baseline``: every file of ``sql/`` except the reference
  table, in name order.  Its downgrade removes what the upgrade created and
  nothing else: every watched table's triggers, then each object that
  ``sql/`` documents with ``COMMENT ON`` (a test makes sure every object
  has a comment), in the reverse order of its creation, then the roles
  this installation created and its entry in the database's ``search_path``.
* ``pgbroker_0002_initech``: ``sql/950_initech.sql``, the optional
  reference table ``initech.objects`` (skipped with ``-x initech=no``).

Every later change to ``sql/`` comes with a new revision (see
migrations/README.md, "Revisions").
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SQL = ROOT / "sql"
VERSIONS = Path(__file__).resolve().parent / "versions"

CORE = "pgbroker_0001_baseline"
INITECH = "pgbroker_0002_initech"
INITECH_FILE = "950_initech.sql"

GENERATED = "-- Generated from sql/ by migrations/build_baseline.py: do not edit.\n"

REVISION_PY = '''"""{title}

Revision ID: {revision}
Revises: {down_revision}

Generated from sql/ by migrations/build_baseline.py; the SQL it runs lives
beside it ({stem}.sql, {stem}.downgrade.sql).  Released in 0.1.0: it never
changes again (migrations/released.json holds its checksums).
"""

{imports}
revision = {revision}
down_revision = {down_revision}
branch_labels = {branch_labels}
depends_on = None
# What pgbroker.schema_version() returns once this revision ran (None: it does not change it).
schema_version = {schema_version}

{body}'''

CORE_BODY = """
def upgrade() -> None:
    run_revision_sql(__file__, "upgrade")


def downgrade() -> None:
    run_revision_sql(__file__, "downgrade")
"""

INITECH_BODY = '''
def _wanted() -> bool:
    """False with ``alembic -x initech=no`` or ``pgbroker migrate --no-initech``: core only."""
    value = context.config.attributes.get("initech")
    if value is None:
        value = context.get_x_argument(as_dictionary=True).get("initech", "yes")
    return str(value).lower() not in ("no", "false", "0", "off")


def upgrade() -> None:
    if _wanted():
        run_revision_sql(__file__, "upgrade")


def downgrade() -> None:
    run_revision_sql(__file__, "downgrade")
'''

# Before the generated DROPs: take the triggers off every watched table (and
# drop their generated functions), and take pgbroker out of search_path.
CORE_DOWNGRADE_HEAD = """-- Remove everything pgbroker_0001_baseline created, and nothing else.
SELECT pgbroker.unwatch(relid::regclass) FROM pgbroker.watched WHERE to_regclass(relid::regclass::text) IS NOT NULL;
DELETE FROM pgbroker.watched;
SELECT pgbroker._set_database_search_path(false);
"""

# After them: the roles this installation created (kept when another database
# of the cluster still uses them), the record of them, and the schema when no
# alembic version table of pgbroker's own environment is left in it.
CORE_DOWNGRADE_TAIL = """
REVOKE ALL ON SCHEMA pgbroker FROM PUBLIC, pgbroker_broker, pgbroker_reader, pgbroker_user, pgbroker_admin;
DO $roles$
DECLARE
    v_role name;
BEGIN
    FOR v_role IN SELECT object FROM pgbroker.installed WHERE kind = 'role' ORDER BY object LOOP
        BEGIN
            EXECUTE format('DROP ROLE %I', v_role);
        EXCEPTION WHEN dependent_objects_still_exist THEN
            RAISE NOTICE 'role % kept: it still has privileges in another database', v_role;
        END;
    END LOOP;
END
$roles$;
DROP TABLE pgbroker.installed;
DROP FUNCTION pgbroker._set_database_search_path(boolean), pgbroker._search_path_elements(text);

-- Outside pgbroker's own alembic environment (whose env.py drops the schema
-- after removing its version table) the schema goes here.
DO $schema$
BEGIN
    IF to_regclass('pgbroker.alembic_version') IS NULL THEN
        DROP SCHEMA pgbroker;
    END IF;
END
$schema$;
"""

INITECH_DOWNGRADE = """-- Undo pgbroker_0002_initech: stop watching initech.objects; drop it (and
-- the schema) only if this installation created them.
SELECT pgbroker.unwatch(to_regclass('initech.objects')) WHERE to_regclass('initech.objects') IS NOT NULL;
DO $initech$
BEGIN
    IF EXISTS (SELECT FROM pgbroker.installed WHERE kind = 'table' AND object = 'initech.objects') THEN
        DROP TABLE IF EXISTS initech.objects;
        DELETE FROM pgbroker.installed WHERE kind = 'table' AND object = 'initech.objects';
    END IF;
    IF EXISTS (SELECT FROM pgbroker.installed WHERE kind = 'schema' AND object = 'initech') THEN
        BEGIN
            IF to_regnamespace('initech') IS NOT NULL THEN
                REVOKE USAGE ON SCHEMA initech FROM pgbroker_broker;
            END IF;
            DROP SCHEMA IF EXISTS initech;
            DELETE FROM pgbroker.installed WHERE kind = 'schema' AND object = 'initech';
        EXCEPTION WHEN dependent_objects_still_exist THEN
            RAISE NOTICE 'schema initech kept: it holds objects pgbroker did not create';
        END;
    END IF;
END
$initech$;
"""

# Objects the tail drops itself (the roles loop reads pgbroker.installed).
KEPT_FOR_TAIL = {
    ("TABLE", "pgbroker.installed"),
    ("FUNCTION", "pgbroker._set_database_search_path(boolean)"),
    ("FUNCTION", "pgbroker._search_path_elements(text)"),
}

_COMMENT = re.compile(
    r"^COMMENT ON (TABLE|VIEW|SEQUENCE|FUNCTION|TRIGGER) (\S+?(?:\([^)]*\))?(?: ON \S+)?) IS", re.MULTILINE
)


_SCHEMA_VERSION = re.compile(r"FUNCTION pgbroker\.schema_version\(\)[^;]*?AS \$\$ SELECT '([^']*)'::text \$\$;")


def schema_version() -> str:
    """What sql/000_schema.sql's pgbroker.schema_version() returns."""
    m = _SCHEMA_VERSION.search((SQL / "000_schema.sql").read_text())
    if m is None:
        raise SystemExit("sql/000_schema.sql: cannot find what pgbroker.schema_version() returns")
    return m.group(1)


def released_files() -> set[str]:
    """The revision files a release froze (migrations/released.json): never written again."""
    path = Path(__file__).resolve().parent / "released.json"
    if not path.exists():
        return set()
    return {name for release in json.loads(path.read_text())["releases"] for name in release["files"]}


def core_files() -> list[Path]:
    return [p for p in sorted(SQL.glob("*.sql")) if p.name != INITECH_FILE]


def documented_objects(text: str) -> list[tuple[str, str]]:
    """(kind, name) of every table, view, sequence, function and trigger a ``COMMENT ON`` names, in order."""
    return [(m.group(1), m.group(2)) for m in _COMMENT.finditer(text)]


def core_upgrade() -> str:
    parts = [GENERATED]
    for path in core_files():
        parts.append(f"\n-- ===== sql/{path.name} =====\n\n{path.read_text().strip()}\n")
    return "".join(parts)


def core_downgrade() -> str:
    objects = []
    for path in core_files():
        objects.extend(documented_objects(path.read_text()))
    drops = []
    for kind, name in reversed(objects):
        if (kind, name) in KEPT_FOR_TAIL:
            continue
        drops.append(f"DROP {kind} {name};")
    return GENERATED + CORE_DOWNGRADE_HEAD + "\n" + "\n".join(drops) + "\n" + CORE_DOWNGRADE_TAIL


def _py(value: object) -> str:
    """A Python literal as ruff formats it (double quotes)."""
    return repr(value).replace("'", '"')


def revision_files() -> dict[str, str]:
    """File name (in migrations/versions/) -> text, for every generated revision."""
    core_py = REVISION_PY.format(
        title="pgbroker baseline: the whole core schema, generated from sql/.",
        revision=_py(CORE),
        down_revision=_py(None),
        branch_labels=_py(("pgbroker",)),
        stem="0001_baseline",
        schema_version=_py(schema_version()),
        imports="from pgbroker.install import run_revision_sql\n",
        body=CORE_BODY,
    )
    initech_py = REVISION_PY.format(
        title="pgbroker: the reference table initech.objects, watched (skipped with -x initech=no).",
        revision=_py(INITECH),
        down_revision=_py(CORE),
        branch_labels=_py(None),
        stem="0002_initech",
        schema_version=_py(None),
        imports="from alembic import context\n\nfrom pgbroker.install import run_revision_sql\n",
        body=INITECH_BODY,
    )
    return {
        "0001_baseline.py": core_py,
        "0001_baseline.sql": core_upgrade(),
        "0001_baseline.downgrade.sql": core_downgrade(),
        "0002_initech.py": initech_py,
        "0002_initech.sql": GENERATED + "\n" + (SQL / INITECH_FILE).read_text().strip() + "\n",
        "0002_initech.downgrade.sql": GENERATED + INITECH_DOWNGRADE,
    }


def main(argv: list[str]) -> int:
    check = "--check" in argv
    wanted = revision_files()
    frozen = sorted(released_files() & set(wanted))
    if frozen and "--release" not in argv:
        # Only migrations/release.py, re-freezing the first release before its tag, passes --release.
        print(
            f"migrations/versions/{frozen[0]} (and {len(frozen) - 1} more) were released and never change: "
            'make a new revision instead (migrations/README.md, "Revisions")',
            file=sys.stderr,
        )
        return 1
    present = {p.name for p in VERSIONS.iterdir() if p.is_file() and p.suffix in (".py", ".sql")}
    stale = sorted(present - set(wanted))
    differ = sorted(
        n for n, text in wanted.items() if not (VERSIONS / n).exists() or (VERSIONS / n).read_text() != text
    )
    if check:
        for name in differ:
            print(f"migrations/versions/{name} differs from what sql/ generates", file=sys.stderr)
        for name in stale:
            print(f"migrations/versions/{name} is not generated from sql/", file=sys.stderr)
        if differ or stale:
            print("run: python3 migrations/build_baseline.py", file=sys.stderr)
            return 1
        return 0
    for name in stale:
        (VERSIONS / name).unlink()
    for name, text in wanted.items():
        (VERSIONS / name).write_text(text)
    print(f"wrote {len(wanted)} files to migrations/versions/ ({len(stale)} removed)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
