"""Fixtures: one throwaway PostgreSQL per test session, a migrated template
database, and a fresh clone of it per test.

The session server is started by pytest-postgresql's ``PostgreSQLExecutor``
(a test dependency), through :func:`pgbroker._embedded.pg_ctl_command`, which
runs ``pg_ctl`` as an unprivileged OS user when we run as root.  It has the
interface of :class:`pgbroker._embedded.EmbeddedPostgres` (the demo's
standard-library server, which some tests also start for a cluster of their
own).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from pathlib import Path

import psycopg
import pytest
from pytest_postgresql.executors import PostgreSQLExecutor

from pgbroker import install
from pgbroker._embedded import (
    SERVER_OPTIONS,
    SUPERUSER,
    TIMEOUT,
    EmbeddedPostgres,
    pg_ctl_command,
    wait_until_accepting,
)

# pgbroker's own pytest plugin (pgbroker/pytest_plugin.py), for the tests that use its fixtures
# (pgbroker_db, pgbroker_broker, pgbroker_process).  An installed pgbroker loads it through its
# pytest11 entry point; a checkout that is not installed loads it here.
if not any(ep.value == "pgbroker.pytest_plugin" for ep in entry_points(group="pytest11")):
    pytest_plugins = ["pgbroker.pytest_plugin"]

TEMPLATE = "pgbroker_tmpl"
_counter = itertools.count()

# Login roles for privilege tests: name -> pgbroker role granted (None: nothing).
TEST_ROLES = {
    "t_reader": "pgbroker_reader",
    "t_broker": "pgbroker_broker",
    "t_user": "pgbroker_user",
    "t_admin": "pgbroker_admin",
    "t_none": None,
}


class ExecutorPostgres(EmbeddedPostgres):
    """:class:`EmbeddedPostgres`'s interface (url, url_for, port, host, datadir, logfile,
    restart, stop), with the server run by pytest-postgresql's executor."""

    executor: PostgreSQLExecutor | None = None

    def start(self) -> ExecutorPostgres:
        with contextlib.ExitStack() as undo:
            self.directory = Path(tempfile.mkdtemp(prefix="pgbroker-test-pg-"))
            undo.callback(shutil.rmtree, self.directory, ignore_errors=True)
            undo.callback(self._kill_postmaster)  # runs first: a half-started server is stopped
            self.executor = PostgreSQLExecutor(
                executable=pg_ctl_command(self.directory, self.os_user),
                host=self.host,
                port=self.port,
                datadir=str(self.datadir),
                unixsocketdir=str(self.directory),
                logfile=str(self.logfile),
                startparams="-w",
                dbname="postgres",
                user=SUPERUSER,
                postgres_options=f"{SERVER_OPTIONS} {self.postgres_options}".strip(),
                timeout=TIMEOUT,
            )
            self.executor.start()
            wait_until_accepting(self.url)
            undo.pop_all()
        return self

    def restart(self) -> None:
        assert self.executor is not None
        self.executor.stop()
        self.executor.start()
        wait_until_accepting(self.url)

    def stop(self) -> None:
        try:
            if self.executor is not None:
                self.executor.stop()
        finally:
            self.executor = None
            self._forget()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[EmbeddedPostgres]:
    with ExecutorPostgres(postgres_options=os.environ.get("PGBROKER_TEST_PG_OPTIONS", "")) as server:
        yield server


def admin_execute(server: EmbeddedPostgres, *statements: str) -> None:
    with psycopg.connect(server.url, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


@pytest.fixture(scope="session")
def template_db(pg_server: EmbeddedPostgres) -> str:
    """A database migrated with ``alembic upgrade heads``; tests get clones of it."""
    admin_execute(pg_server, f"CREATE DATABASE {TEMPLATE}")
    url = pg_server.url_for(TEMPLATE)
    install.migrate(url)
    statements = []
    for role, granted in TEST_ROLES.items():
        statements.append(f"CREATE ROLE {role} LOGIN")
        if granted:
            statements.append(f"GRANT {granted} TO {role}")
    admin_execute(pg_server, *statements)
    return url


# The fan-out tests run once per trigger mode of pgbroker.watch() (sql/600_triggers.sql): a test that asks for the
# fixture watch_mode gets a database whose initech.objects is watched in that mode, and watches its own tables
# with fanout_util.watch(conn, table, watch_mode).
WATCH_MODES = ("statement", "row")


@pytest.fixture(scope="session")
def template_db_row(pg_server: EmbeddedPostgres, template_db: str) -> str:
    """A copy of the template whose initech.objects is watched in row mode; returns its name."""
    name = f"{TEMPLATE}_row"
    admin_execute(pg_server, f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
    with psycopg.connect(pg_server.url_for(name), autocommit=True) as conn:
        conn.execute("SELECT pgbroker.watch('initech.objects', mode => 'row')")
    return name


@pytest.fixture(params=WATCH_MODES)
def watch_mode(request: pytest.FixtureRequest) -> str:
    """The trigger mode this run of a fan-out test uses (initech.objects is watched in it)."""
    return request.param


def new_database(server: EmbeddedPostgres, template: str | None = TEMPLATE) -> str:
    name = f"t{os.getpid()}_{next(_counter)}"
    clause = f" TEMPLATE {template}" if template else ""
    admin_execute(server, f"CREATE DATABASE {name}{clause}")
    if template:
        # Database settings are not copied by CREATE DATABASE ... TEMPLATE.
        admin_execute(server, f'ALTER DATABASE {name} SET search_path = "$user", public, pgbroker')
    return name


@pytest.fixture
def db_name(request: pytest.FixtureRequest, pg_server: EmbeddedPostgres, template_db: str) -> Iterator[str]:
    template = TEMPLATE
    if "watch_mode" in request.fixturenames and request.getfixturevalue("watch_mode") == "row":
        template = request.getfixturevalue("template_db_row")
    name = new_database(pg_server, template)
    try:
        yield name
    finally:
        admin_execute(pg_server, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def empty_db(pg_server: EmbeddedPostgres) -> Iterator[str]:
    """A database with nothing installed (for migration tests); yields its URL."""
    name = new_database(pg_server, template=None)
    try:
        yield pg_server.url_for(name)
    finally:
        admin_execute(pg_server, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def db_url(pg_server: EmbeddedPostgres, db_name: str) -> str:
    """URL of a fresh migrated database, as the superuser."""
    return pg_server.url_for(db_name)


@pytest.fixture
def connect(pg_server: EmbeddedPostgres, db_name: str) -> Iterator[Callable[..., psycopg.Connection]]:
    """Open autocommit connections to the test database; all closed at the end.

    ``connect("A")`` sets application_name A; ``user=`` picks a login role.
    """
    opened: list[psycopg.Connection] = []

    def _connect(application: str = "test", *, user: str = "postgres", autocommit: bool = True) -> psycopg.Connection:
        conn = psycopg.connect(
            pg_server.url_for(db_name, user=user), autocommit=autocommit, application_name=application
        )
        opened.append(conn)
        return conn

    try:
        yield _connect
    finally:
        for conn in opened:
            conn.close()


def advisory_locks(conn: psycopg.Connection, pid: int | None = None) -> list[tuple]:
    """pgbroker advisory locks in this database (of one backend when pid is given)."""
    rows = conn.execute(
        """
        SELECT pid, objid::integer, granted FROM pg_locks
         WHERE locktype = 'advisory' AND classid = pgbroker._lock_class()::oid AND objsubid = 2
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND (%(pid)s::integer IS NULL OR pid = %(pid)s::integer)
        """,
        {"pid": pid},
    ).fetchall()
    return rows
