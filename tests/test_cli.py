"""The ``pgbroker`` console script, run as a real subprocess."""

from __future__ import annotations

import os
import re
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
    assert (path / "0001_lease.py").is_file()


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


def test_unreachable_database_fails_cleanly():
    result = pgbroker("status", "--url", "postgresql://postgres@127.0.0.1:1/nowhere", timeout=30)
    assert result.returncode == 1
    assert result.stderr.startswith("pgbroker status: ")
    assert "Traceback" not in result.stderr


def test_demo_against_a_given_database(db_url, connect):
    result = pgbroker("demo", "--url", db_url)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "refused at once" in out and "LeaseHeld (SQLSTATE 55P03)" in out
    assert re.search(r"took over: epoch 2 \(A had 1\), [0-9.]+ ms after the kill", out), out
    assert "StaleEpoch (SQLSTATE PB002)" in out
    assert "op U, table initech.objects, key -4242, changed ['name'], tell ['demo-client']" in out
    # It cleaned up: B released the lease, no demo session is left.
    watch = connect("watch")
    epoch, state = watch.execute("SELECT epoch, state FROM pgbroker.brokers WHERE name = 'pgbroker-demo'").fetchone()
    assert (epoch, state) == (2, "released")
    left = watch.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'pgbroker-demo%'")
    assert left.fetchone()[0] == 0
    events = watch.execute("SELECT event FROM pgbroker.lease_history WHERE name = 'pgbroker-demo' ORDER BY id")
    assert [e[0] for e in events] == ["claim", "claim", "release"]


@pytest.mark.slow
def test_demo_with_a_throwaway_server():
    result = pgbroker("demo", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    match = re.search(r"Takeover after SIGKILL of the holder: ([0-9.]+) ms", out)
    assert match, out
    assert float(match.group(1)) < 5000
    assert re.search(r"kill -9 \d+", out)
    assert "took over: epoch 2 (A had 1)" in out
    # The server and its data directory are gone.
    datadir = re.search(r"data in (\S+)\)", out).group(1)
    assert not Path(datadir).exists()
    assert "everything the demo started is stopped" in out


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


def install_head() -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(install.migrations_path())).get_current_head()
