"""The ``pgbroker`` console script, run as a real subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from pgbroker import Broker, install

SCRIPT = Path(sys.executable).with_name("pgbroker")
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [shutil.which("pgbroker") or "pgbroker"]


def pgbroker(*args: str, env_url: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    if env_url is not None:
        env["DATABASE_URL"] = env_url
    return subprocess.run([*COMMAND, *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_versions_path_prints_the_revisions_directory():
    result = pgbroker("versions-path")
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.strip())
    assert path == install.versions_path()
    assert sorted(p.name for p in path.glob("*.py")) == sorted(
        Path(install_script().get_revision(r).path).name for r in install_heads_and_ancestors()
    )


def test_version_names_the_package_and_its_schema_version():
    result = pgbroker("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"pgbroker {pgbroker_package_version()} (schema version {install.SCHEMA_VERSION})"


def test_migrate_status_downgrade_on_an_empty_database(empty_db):
    # Not installed yet: status says so and fails.
    result = pgbroker("status", "--url", empty_db)
    assert result.returncode == 1
    assert "not installed" in result.stderr

    # migrate, with the URL from DATABASE_URL.
    result = pgbroker("migrate", env_url=empty_db)
    assert result.returncode == 0, result.stderr
    revisions = install.current_revision(empty_db)
    assert revisions and f"revision {', '.join(revisions)}" in result.stdout

    result = pgbroker("status", env_url=empty_db)
    assert result.returncode == 0, result.stderr
    assert f"revision: {', '.join(revisions)} (up to date)" in result.stdout
    assert f"schema version: {install.SCHEMA_VERSION}" in result.stdout
    assert "no lease has been claimed yet" in result.stdout

    with Broker(empty_db, "cli-lease", application_name="cli-test", info="box-7") as b:
        result = pgbroker("status", "--url", empty_db)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        header = next(line for line in lines if line.startswith("name"))
        assert header.split()[:5] == ["name", "epoch", "state", "alive", "pid"]
        lease = next(line for line in lines if line.startswith("cli-lease"))
        assert lease.split()[:7] == ["cli-lease", "1", "held", "yes", str(b.pid), "cli-test", "127.0.0.1"]
        assert "box-7" in lease

    # downgrade to base removes the schema.
    result = pgbroker("downgrade", "--url", empty_db)
    assert result.returncode == 0, result.stderr
    assert "pgbroker removed" in result.stdout
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT to_regnamespace('pgbroker')").fetchone()[0] is None


@pytest.mark.parametrize("command", ["migrate", "downgrade", "status"])
def test_no_url_is_a_usage_error(command):
    result = pgbroker(command)
    assert result.returncode == 2
    assert "DATABASE_URL" in result.stderr and "--url" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("command", ["migrate", "status", "downgrade"])
def test_unreachable_server_fails_cleanly(command):
    result = pgbroker(command, "--url", "postgresql://postgres@127.0.0.1:1/nowhere", timeout=30)
    assert result.returncode == 1
    assert result.stderr.startswith(f"pgbroker {command}: cannot connect to database nowhere on 127.0.0.1:1: ")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("command", ["migrate", "status"])
def test_missing_database_fails_cleanly(command, pg_server):
    url = pg_server.url_for("no_such_database")
    result = pgbroker(command, "--url", url, timeout=30)
    assert result.returncode == 1
    assert result.stderr.startswith(f"pgbroker {command}: cannot connect to database no_such_database on ")
    assert 'database "no_such_database" does not exist' in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("command", ["migrate", "status"])
@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("mysql://root@localhost/app", "not a PostgreSQL URL: 'mysql://root@localhost/app'"),
        ("postgresql://u:secret@localhost:port/app", "port 'port' is not a number"),
    ],
)
def test_bad_url_gives_the_same_error_in_every_command(command, url, says):
    result = pgbroker(command, "--url", url, timeout=30)
    assert result.returncode == 1
    assert result.stderr.startswith(f"pgbroker {command}: ")
    assert says in result.stderr and "expected postgresql://" in result.stderr
    assert "secret" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_migrate_core_only_without_initech(empty_db):
    result = pgbroker("migrate", "--url", empty_db, "--no-initech")
    assert result.returncode == 0, result.stderr
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT to_regclass('initech.objects')").fetchone()[0] is None
        assert conn.execute("SELECT to_regprocedure('pgbroker.watch(regclass)')").fetchone()[0] is not None
        # Every revision is recorded, so later upgrades keep working.
        assert conn.execute("SELECT version_num FROM pgbroker.alembic_version").fetchone()[0] == install_head()
    result = pgbroker("downgrade", "--url", empty_db)
    assert result.returncode == 0, result.stderr


def install_script():
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(install.migrations_path()))


def install_head() -> str:
    return install_script().get_current_head()


def install_heads_and_ancestors() -> list[str]:
    return [script.revision for script in install_script().walk_revisions()]


def pgbroker_package_version() -> str:
    from importlib.metadata import version

    return version("pgbroker")
