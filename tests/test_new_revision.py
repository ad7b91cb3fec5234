"""The path of a schema change after a release, end to end, in a copy of the checkout.

sql/ changes (a new function with its comment and grant, a new index with its
comment); ``migrations/new_revision.py`` drafts the revision: the functions
written for it (``schema_version()`` included, at ``0.1.0+N``, N its number), the index
left as a TODO line; the TODO is written by hand, as a developer would; then
the copy's revisions, from the last release up, build the same catalog as
the copy's sql/, and the downgrade gives back the release's catalog.  The
copy's package, which now expects 0.1.0+N, then works against the 0.1.0
schema (a new package before ``pgbroker migrate``), with a warning.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import psycopg
from alembic import command
from test_migrations import _module_from, diff_snapshots, schema_version_problems, snapshot

from pgbroker import install

REPO = Path(__file__).resolve().parent.parent

CHANGE = """
CREATE INDEX outbox_watch_id ON pgbroker.outbox (watch_id);
COMMENT ON INDEX pgbroker.outbox_watch_id IS 'The outbox rows of one watched table.';
CREATE FUNCTION pgbroker.outbox_size()
RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$ SELECT count(*) FROM pgbroker.outbox $$;
COMMENT ON FUNCTION pgbroker.outbox_size() IS 'How many rows the outbox holds.';
REVOKE ALL ON FUNCTION pgbroker.outbox_size() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgbroker.outbox_size() TO pgbroker_reader;
"""


NEW_PACKAGE_BROKER = """
import sys
import psycopg
import pgbroker
url = sys.argv[1]
with pgbroker.Broker(url, name="new package") as broker:
    broker.register("c1")
    broker.subscribe("c1", "initech.objects", 7)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("INSERT INTO initech.objects (id, name) VALUES (7, 'seven')")
    print(pgbroker.__file__, broker.schema_version, [(n.op, n.key, n.clients) for n in broker.fetch()], sep="|")
"""


def _database(server, name: str) -> str:
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    return server.url_for(name)


def test_a_schema_change_becomes_a_revision(pg_server, tmp_path):
    copy = tmp_path / "checkout"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "console.png")
    for part in ("migrations", "sql", "pgbroker"):
        shutil.copytree(REPO / part, copy / part, ignore=ignore)
    (copy / "tests").mkdir()
    shutil.copy(REPO / "tests" / "test_migrations.py", copy / "tests")
    outbox = copy / "sql" / "500_outbox.sql"
    outbox.write_text(outbox.read_text() + CHANGE)

    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    drafted = subprocess.run(
        [sys.executable, str(copy / "migrations" / "new_revision.py"), "outbox size"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert drafted.returncode == 0, drafted.stdout + drafted.stderr
    versions = copy / "migrations" / "versions"
    revisions = sorted(versions.glob("[0-9][0-9][0-9][0-9]_*.py"))
    number = len(revisions)  # the drafted one's; unreleased revisions may come before it
    head = _module_from(revisions[-2], "head_revision").revision
    stem = f"{number:04d}_outbox_size"
    version = f"0.1.0+{number}"
    upgrade = (versions / f"{stem}.sql").read_text()
    assert "CREATE OR REPLACE FUNCTION pgbroker.outbox_size()" in upgrade
    assert "GRANT EXECUTE ON FUNCTION pgbroker.outbox_size() TO pgbroker_reader;" in upgrade
    assert f"SELECT '{version}'::text" in upgrade  # schema_version(), rewritten in sql/000 and install.py too
    assert not [line for line in upgrade.splitlines() if "<database>" in line], upgrade
    assert f'SCHEMA_VERSION = "{version}"' in (copy / "pgbroker" / "install.py").read_text()
    todo = [line for line in upgrade.splitlines() if line.startswith("-- TODO")]
    assert any("outbox_watch_id: only in sql/" in line for line in todo), upgrade
    assert "DROP FUNCTION pgbroker.outbox_size();" in (versions / f"{stem}.downgrade.sql").read_text()
    assert schema_version_problems(versions) == []
    module = _module_from(versions / f"{stem}.py", "drafted_revision")
    assert (module.revision, module.down_revision, module.schema_version) == (
        f"pgbroker_{stem}",
        head,
        version,
    )

    # The developer writes the TODO's statements by hand, with their downgrade.
    index = "CREATE INDEX outbox_watch_id ON pgbroker.outbox (watch_id);\n"
    index += "COMMENT ON INDEX pgbroker.outbox_watch_id IS 'The outbox rows of one watched table.';\n"
    (versions / f"{stem}.sql").write_text(upgrade + index)
    downgrade = versions / f"{stem}.downgrade.sql"
    downgrade.write_text(downgrade.read_text() + "DROP INDEX pgbroker.outbox_watch_id;\n")

    built = _database(pg_server, "new_revision_built")
    from_sql = _database(pg_server, "new_revision_sql")
    cfg = install._config(built)
    cfg.set_main_option("script_location", str(copy / "migrations"))
    command.upgrade(cfg, "pgbroker_0002_initech")
    at_release = snapshot(built)
    command.upgrade(cfg, "heads")
    with psycopg.connect(from_sql, autocommit=True) as conn:
        for path in sorted((copy / "sql").glob("*.sql")):
            conn.execute(path.read_text())
    report = diff_snapshots(snapshot(from_sql), snapshot(built), "the copy's sql/", "its revisions")
    assert not report, report
    command.downgrade(cfg, "pgbroker_0002_initech")
    report = diff_snapshots(at_release, snapshot(built), "0.1.0", "downgraded from the new revision")
    assert not report, report

    # The copy's package expects 0.1.0+N: against the 0.1.0 schema (before `pgbroker migrate` in a deploy) its
    # Broker works, with a warning naming both versions and the command that fixes it.
    newer_package = subprocess.run(
        [sys.executable, "-c", NEW_PACKAGE_BROKER, built],
        cwd=copy,
        env={**env, "PYTHONPATH": str(copy)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert newer_package.returncode == 0, newer_package.stdout + newer_package.stderr
    said = newer_package.stdout.strip().split("|")
    assert said == [str(copy / "pgbroker" / "__init__.py"), "0.1.0", "[('I', 7, ['c1'])]"], said
    says = f"installed pgbroker schema version 0.1.0 is older than this package's {version}: run pgbroker migrate"
    assert says in newer_package.stderr, newer_package.stderr
