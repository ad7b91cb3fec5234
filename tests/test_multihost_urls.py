"""libpq multi-host URLs, as an HA setup gives them, everywhere pgbroker takes a URL (issue 26).

Both forms libpq takes: ``postgresql://u@h1:p1,h2:p2,h3:p3/db?target_session_attrs=read-write`` and
``postgresql://u@/db?host=h1,h2,h3&port=p1,p2,p3&target_session_attrs=read-write``.  The hosts, in
order: a port nobody listens on, a server that accepts sessions but is read-only (as a standby is, to
libpq's ``target_session_attrs``), and the test server, the only one that is read-write.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy
from test_cli import pgbroker as run_cli

import pgbroker
from pgbroker import KV, Broker, install
from pgbroker._embedded import EmbeddedPostgres
from pgbroker._url import create_engine, hosts, to_sqlalchemy

DEAD = ("127.0.0.1", "1")


@pytest.fixture(scope="module")
def read_only_server() -> Iterator[EmbeddedPostgres]:
    server = EmbeddedPostgres("-c default_transaction_read_only=on")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _urls(server: EmbeddedPostgres, read_only: EmbeddedPostgres, dbname: str) -> dict[str, str]:
    with psycopg.connect(read_only.url, autocommit=True) as conn:  # the database exists there too
        conn.execute("SET default_transaction_read_only = off")
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,)).fetchone():
            conn.execute(f'CREATE DATABASE "{dbname}"')
    triples = [DEAD, (read_only.host, str(read_only.port)), (server.host, str(server.port))]
    return {
        "hosts": "postgresql://postgres@"
        + ",".join(f"{h}:{p}" for h, p in triples)
        + f"/{dbname}?target_session_attrs=read-write&connect_timeout=5",
        "query": f"postgresql://postgres@/{dbname}?host="
        + ",".join(h for h, _ in triples)
        + "&port="
        + ",".join(p for _, p in triples)
        + "&target_session_attrs=read-write&connect_timeout=5",
    }


@pytest.fixture(params=["hosts", "query"])
def multihost(request, pg_server, read_only_server, empty_db) -> str:
    dbname = empty_db.rsplit("/", 1)[1]
    return _urls(pg_server, read_only_server, dbname)[request.param]


def _port(conn: psycopg.Connection) -> int:
    return int(conn.info.port)


def test_the_url_forms_name_every_host_in_order():
    expected = [("h1", "5432"), ("h2", "5433")]
    assert hosts("postgresql://u@h1:5432,h2:5433/db") == expected
    assert hosts("postgresql://u@/db?host=h1,h2&port=5432,5433") == expected
    assert hosts("postgresql://u@h1,h2:5433/db") == [("h1", ""), ("h2", "5433")]
    assert hosts("postgresql://u@h1/db") == [("h1", "")]
    assert install.describe("postgresql://u:secret@h1:5432,h2:5433/app") == "database app on h1:5432, h2:5433"
    for url in ("postgresql://u:p%40ss@h1:5432,h2:5433/db?target_session_attrs=read-write",
                "postgresql://u:p%40ss@/db?host=h1,h2&port=5432,5433&target_session_attrs=read-write"):  # fmt: skip
        converted = install.sqlalchemy_url(url)
        assert converted == (
            "postgresql+psycopg://u:p%40ss@/db?host=h1%3A5432&host=h2%3A5433&target_session_attrs=read-write"
        )
        engine = sqlalchemy.create_engine(converted)
        args = engine.dialect.create_connect_args(engine.url)[1]
        assert {k: args[k] for k in ("host", "port", "user", "password", "dbname", "target_session_attrs")} == {
            "host": "h1,h2", "port": "5432,5433", "user": "u", "password": "p@ss", "dbname": "db",
            "target_session_attrs": "read-write",
        }  # fmt: skip
    # One host: the URL as it was, with SQLAlchemy's scheme.
    assert install.sqlalchemy_url("postgresql://u@h1:5432/db") == "postgresql+psycopg://u@h1:5432/db"
    # IPv6 hosts do not fit SQLAlchemy's form: a clear error, and create_engine takes them.
    with pytest.raises(install.InstallError, match="IPv6"):
        install.sqlalchemy_url("postgresql://u@[::1]:5432,[::1]:5433/db")
    with pytest.raises(ValueError, match="IPv6"):
        to_sqlalchemy("postgresql://u@[::1]:5432,[::1]:5433/db")


def test_create_engine_connects_to_the_writable_host(multihost, pg_server):
    engine = create_engine(multihost, poolclass=sqlalchemy.pool.NullPool)
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT current_setting('port')::int").scalar() == pg_server.port
            assert conn.exec_driver_sql("SELECT pg_is_in_recovery()").scalar() is False
    finally:
        engine.dispose()
    converted = sqlalchemy.create_engine(install.sqlalchemy_url(multihost), poolclass=sqlalchemy.pool.NullPool)
    try:
        with converted.connect() as conn:
            assert conn.exec_driver_sql("SELECT current_setting('port')::int").scalar() == pg_server.port
    finally:
        converted.dispose()


def test_migrate_broker_and_primitives_through_a_multihost_url(multihost, pg_server):
    done = pgbroker.migrate(multihost)
    assert done.schema_version == install.SCHEMA_VERSION
    assert install.installed_version(multihost) == install.SCHEMA_VERSION
    with Broker(multihost, "multi") as broker:
        assert broker.epoch > 0
        with psycopg.connect(multihost, autocommit=True) as conn:
            assert _port(conn) == pg_server.port
            with conn.transaction():
                broker.assert_epoch(conn)
            kv = KV(conn)
            version = kv.set("k", {"v": 1})
            assert kv.get("k").version == version
    install.downgrade(multihost)
    assert install.installed_version(multihost) is None


def test_every_cli_command_takes_a_multihost_url(multihost, pg_server, read_only_server):
    where = f"127.0.0.1:1, 127.0.0.1:{read_only_server.port}, 127.0.0.1:{pg_server.port}"
    done = run_cli("migrate", "--url", multihost)
    assert done.returncode == 0, done.stderr
    assert f"on {where} is at revision" in done.stdout
    status = run_cli("status", "--json", "--url", multihost)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["database"].endswith(f"on {where}")
    # Every other command, once (the URL reaches them all the same way): with the first form.
    others = (
        ["history"],
        ["clients"],
        ["subscriptions"],
        ["metrics"],
        ["watch", "public.things"],
        ["unwatch", "public.things"],
        ["prune", "--older-than", "1 day"],
        ["sweep", "--name", "default"],
        ["doctor", "--json"],
    )
    for command in others if multihost.startswith("postgresql://postgres@127") else ():
        if command[0] == "watch":
            with psycopg.connect(multihost, autocommit=True) as conn:
                conn.execute("CREATE TABLE IF NOT EXISTS public.things (id bigint PRIMARY KEY)")
        result = run_cli(*command, "--url", multihost)
        assert result.returncode in (0, 1), (command, result.stderr)
        assert "invalid literal" not in result.stderr and "Traceback" not in result.stderr, (command, result.stderr)
        if command[0] != "doctor":  # doctor exits 1 when it finds something to fix on a test server
            assert result.returncode == 0, (command, result.stderr)
    down = run_cli("downgrade", "--url", multihost)
    assert down.returncode == 0, down.stderr


def test_library_calls_raise_install_error_not_system_exit(pg_server):
    """pgbroker's alembic environment ends the alembic command line with SystemExit; pgbroker.migrate raises."""
    missing = pg_server.url_for("no_such_database")
    # The environment itself, on a database that does not exist (what a server gone between checks looks like).
    with pytest.raises(install.InstallError, match="cannot connect to database no_such_database"):
        install._run_alembic(missing, lambda cfg: __import__("alembic.command").command.upgrade(cfg, "heads"))
    with pytest.raises(install.InstallError, match="cannot connect"):
        pgbroker.migrate(missing)
    with pytest.raises(install.InstallError, match="cannot connect"):
        pgbroker.migrate("postgresql://postgres@127.0.0.1:1,127.0.0.1:1/app?connect_timeout=2")
