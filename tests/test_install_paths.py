"""The two ways into an existing project, end to end, with a real alembic project made by ``alembic init``:

(a) ``pgbroker migrate`` beside the application's own alembic (two version tables);
(b) pgbroker's revisions inside the application's alembic environment
    (``version_locations`` + ``depends_on``, then ``alembic upgrade heads``).

In both, ``pgbroker status``, ``pgbroker migrate`` and ``install.installed_version()``
recognise the installed schema.  Also: what pgbroker's own ``alembic`` prints and
leaves behind on a database without pgbroker, and the schema version constant.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from alembic.script import ScriptDirectory
from test_cli import pgbroker

from pgbroker import install

REPO = Path(__file__).resolve().parent.parent

APP_ITEMS = '''"""app: the application's own table.

Revision ID: app_0001_items
Revises:
"""

from alembic import op

revision = "app_0001_items"
down_revision = None
branch_labels = ("app",)
depends_on = {depends_on!r}


def upgrade() -> None:
    op.execute("CREATE SCHEMA app")
    op.execute("CREATE TABLE app.items (id integer PRIMARY KEY, name text NOT NULL)")
    op.execute("INSERT INTO app.items VALUES (1, 'one'), (2, 'two')")


def downgrade() -> None:
    op.execute("DROP TABLE app.items")
    op.execute("DROP SCHEMA app")
'''

APP_WATCH = '''"""app: pgbroker watches app.items.

Revision ID: app_0002_watch
Revises: app_0001_items
"""

from alembic import op

revision = "app_0002_watch"
down_revision = "app_0001_items"
branch_labels = None
depends_on = {depends_on!r}


def upgrade() -> None:
    op.execute("SELECT pgbroker.watch('app.items')")


def downgrade() -> None:
    op.execute("SELECT pgbroker.unwatch('app.items')")
'''


def core_revision() -> str:
    """The head of pgbroker's revisions: one line, the initech revision a step in it (a no-op with -x initech=no)."""
    script = ScriptDirectory(str(install.migrations_path()))
    heads = script.get_heads()
    assert len(heads) == 1, heads
    return heads[0]


def _execute(url: str, query: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(query)


def _scalar(url: str, query: str, *params: object) -> object:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(query, params or None).fetchone()[0]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "DATABASE_URL" and not k.startswith("PG")}


def alembic(project: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``alembic ARGS`` run in ``project`` (a directory with an alembic.ini), as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "alembic", *args],
        cwd=project,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, f"{result.args} failed:\n{result.stdout}\n{result.stderr}"
    return result


def make_project(tmp_path: Path, url: str, *, with_pgbroker: bool, depends_on: str | None = None) -> Path:
    """``alembic init`` an application project; with_pgbroker: pgbroker's revisions in its version_locations."""
    project = tmp_path / "app"
    project.mkdir()
    ok(alembic(project, "init", "migrations"))
    ini = project / "alembic.ini"
    text = ini.read_text()
    text = text.replace(
        "sqlalchemy.url = driver://user:pass@localhost/dbname", f"sqlalchemy.url = {install.sqlalchemy_url(url)}"
    )
    if with_pgbroker:
        versions_path = ok(pgbroker("versions-path")).stdout.strip()
        assert "path_separator = os" in text
        locations = os.pathsep.join(["%(here)s/migrations/versions", versions_path])
        text = text.replace("[alembic]\n", f"[alembic]\nversion_locations = {locations}\n", 1)
    ini.write_text(text)
    versions = project / "migrations" / "versions"
    (versions / "app_0001_items.py").write_text(APP_ITEMS.format(depends_on=None))
    if with_pgbroker:
        (versions / "app_0002_watch.py").write_text(APP_WATCH.format(depends_on=depends_on))
    return project


def app_versions(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        return {r[0] for r in conn.execute("SELECT version_num FROM public.alembic_version")}


# ---------------------------------------------------------------------------
# The schema's version


def test_core_revision_is_the_head_of_the_core():
    script = ScriptDirectory(str(install.migrations_path()))
    assert script.get_revision(install.CORE_REVISION).down_revision is None
    # Every later core revision comes after it: depending on it means "after the core is installed".
    assert install.CORE_REVISION in {r.revision for r in script.iterate_revisions(core_revision(), "base")}


def test_installed_version_reads_the_schema(db_url, empty_db):
    assert _scalar(db_url, "SELECT pgbroker.schema_version()") == install.SCHEMA_VERSION
    assert install.installed_version(db_url) == install.SCHEMA_VERSION
    assert install.installed_version(empty_db) is None
    # Looking does not create anything.
    assert _scalar(empty_db, "SELECT to_regnamespace('pgbroker')") is None


# ---------------------------------------------------------------------------
# (a) pgbroker migrate beside the application's alembic


def test_pgbroker_migrate_beside_the_applications_alembic(empty_db, tmp_path):
    project = make_project(tmp_path, empty_db, with_pgbroker=False)
    ok(alembic(project, "upgrade", "head"))
    assert app_versions(empty_db) == {"app_0001_items"}

    done = ok(pgbroker("migrate", "--url", empty_db))
    assert f"schema version {install.SCHEMA_VERSION}" in done.stdout
    # Two version tables side by side; the application's is untouched.
    assert app_versions(empty_db) == {"app_0001_items"}
    assert set(install.current_revision(empty_db)) == set(ScriptDirectory(str(install.migrations_path())).get_heads())
    assert install.installed_version(empty_db) == install.SCHEMA_VERSION
    assert "app_0001_items (head)" in ok(alembic(project, "current")).stdout

    status = ok(pgbroker("status", "--url", empty_db))
    assert "(up to date)" in status.stdout and f"schema version: {install.SCHEMA_VERSION}" in status.stdout
    again = ok(pgbroker("migrate", "--url", empty_db))
    assert f"schema version {install.SCHEMA_VERSION}" in again.stdout

    # The application can use it.
    assert _scalar(empty_db, "SELECT pgbroker.watch('app.items')") is not None

    # pgbroker downgrade removes pgbroker only; the application's alembic still works.
    _execute(empty_db, "SELECT pgbroker.unwatch('app.items')")
    ok(pgbroker("downgrade", "--url", empty_db))
    assert _scalar(empty_db, "SELECT to_regnamespace('pgbroker')") is None
    assert app_versions(empty_db) == {"app_0001_items"}
    ok(alembic(project, "downgrade", "base"))
    assert _scalar(empty_db, "SELECT to_regclass('app.items')") is None


# ---------------------------------------------------------------------------
# (b) pgbroker's revisions inside the application's alembic environment


def test_pgbroker_inside_the_applications_alembic(empty_db, tmp_path):
    project = make_project(tmp_path, empty_db, with_pgbroker=True, depends_on=install.CORE_REVISION)
    heads = ok(alembic(project, "heads")).stdout
    assert "app_0002_watch" in heads and "pgbroker" in heads

    upgraded = ok(alembic(project, "upgrade", "heads"))
    # pgbroker's core ran before the application's revision that watches its table.
    ran = [line for line in upgraded.stderr.splitlines() if "Running upgrade" in line]

    def step(revision: str) -> int:
        return next(i for i, line in enumerate(ran) if line.split(",")[0].endswith(f"-> {revision}"))

    assert step(install.CORE_REVISION) < step("app_0002_watch"), upgraded.stderr
    watched = "SELECT count(*) FROM pgbroker.watched_tables WHERE \"table\" = 'app.items'::regclass"
    assert _scalar(empty_db, watched) == 1

    # Recorded in the application's version table; pgbroker has none of its own.
    pgbroker_heads = set(ScriptDirectory(str(install.migrations_path())).get_heads())
    assert app_versions(empty_db) == {"app_0002_watch", *pgbroker_heads}
    assert _scalar(empty_db, "SELECT to_regclass('pgbroker.alembic_version')") is None

    # Recognised all the same.
    assert install.installed_version(empty_db) == install.SCHEMA_VERSION
    status = ok(pgbroker("status", "--url", empty_db))
    says = f"schema version: {install.SCHEMA_VERSION} (up to date), installed through another alembic environment"
    assert says in status.stdout
    migrated = ok(pgbroker("migrate", "--url", empty_db))
    assert "installed through another alembic environment" in migrated.stdout and "nothing to do" in migrated.stdout
    assert _scalar(empty_db, "SELECT to_regclass('pgbroker.alembic_version')") is None
    refused = pgbroker("downgrade", "--url", empty_db)
    assert refused.returncode == 1 and "alembic downgrade" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr

    # pgbroker's own alembic environment (from the checkout) sees it too, and does not install it twice.
    own = {**_env(), "DATABASE_URL": empty_db}
    current = ok(alembic(REPO, "current", env=own))
    assert f"pgbroker schema version {install.SCHEMA_VERSION} is installed" in current.stderr
    twice = alembic(REPO, "upgrade", "head", env=own)
    assert twice.returncode == 1 and "run alembic there" in twice.stderr and "Traceback" not in twice.stderr

    # The broker works against it.
    assert _scalar(empty_db, "SELECT pgbroker.broker_claim('app')") == 1

    # alembic downgrade base removes pgbroker (and the application's tables).
    ok(alembic(project, "downgrade", "base"))
    assert _scalar(empty_db, "SELECT to_regnamespace('pgbroker')") is None
    assert _scalar(empty_db, "SELECT to_regnamespace('app')") is None
    assert app_versions(empty_db) == set()
    assert install.installed_version(empty_db) is None


def test_an_older_schema_installed_elsewhere_is_not_upgraded_here(empty_db, tmp_path):
    project = make_project(tmp_path, empty_db, with_pgbroker=True, depends_on=install.CORE_REVISION)
    ok(alembic(project, "upgrade", "heads"))
    # A schema that says it is an older version (as one installed by an older release would).
    _execute(
        empty_db,
        "CREATE OR REPLACE FUNCTION pgbroker.schema_version() RETURNS text LANGUAGE sql AS $$ SELECT '0.0.9' $$",
    )
    result = pgbroker("migrate", "--url", empty_db)
    assert result.returncode == 1
    assert "schema version 0.0.9" in result.stderr and "alembic upgrade heads" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    status = ok(pgbroker("status", "--url", empty_db))
    assert "run alembic upgrade heads" in status.stdout


# ---------------------------------------------------------------------------
# pgbroker's own alembic environment on a database without pgbroker


def test_alembic_current_without_pgbroker_prints_a_line_and_leaves_nothing(empty_db):
    env = {**_env(), "DATABASE_URL": empty_db}
    current = ok(alembic(REPO, "current", env=env))
    assert "pgbroker is not installed in database" in current.stderr
    assert "Traceback" not in current.stdout + current.stderr
    assert _scalar(empty_db, "SELECT to_regnamespace('pgbroker')") is None

    upgraded = ok(alembic(REPO, "upgrade", "head", env=env))
    assert f"Running upgrade  -> {install.CORE_REVISION}" in upgraded.stderr
    assert install.installed_version(empty_db) == install.SCHEMA_VERSION
    head = ScriptDirectory(str(install.migrations_path())).get_current_head()
    assert f"{head} (head)" in ok(alembic(REPO, "current", env=env)).stdout

    downgraded = ok(alembic(REPO, "downgrade", "base", env=env))
    assert f"Running downgrade {install.CORE_REVISION} -> " in downgraded.stderr
    assert _scalar(empty_db, "SELECT to_regnamespace('pgbroker')") is None


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql://postgres@127.0.0.1:1/nowhere", "pgbroker: cannot connect to database nowhere on 127.0.0.1:1: "),
        ("mysql://root@localhost/app", "pgbroker: not a PostgreSQL URL: 'mysql://root@localhost/app'"),
        ("postgresql://u:secret@localhost:port/app", "port 'port' is not a number"),
    ],
)
def test_alembic_with_a_bad_database_says_so_in_one_line(url, says):
    result = alembic(REPO, "upgrade", "head", env={**_env(), "DATABASE_URL": url})
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if not line.startswith("INFO ")]
    assert len(errors) == 1 and says in errors[0], result.stderr
    assert "secret" not in result.stderr


def test_alembic_with_a_missing_database_says_so_in_one_line(pg_server):
    result = alembic(REPO, "current", env={**_env(), "DATABASE_URL": pg_server.url_for("no_such_db")})
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pgbroker: cannot connect to database no_such_db on ")
    assert 'database "no_such_db" does not exist' in lines[0]
