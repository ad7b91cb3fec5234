"""pgbroker's pytest plugin: test your own broker against a real PostgreSQL.

Registered through the ``pytest11`` entry point, so pytest loads it in any
environment where pgbroker is installed; nothing else imports it.  It needs
pytest-postgresql (``pip install pytest-postgresql``), which is not one of
pgbroker's runtime dependencies: it is imported only when a fixture below is
used, and a test that uses one without it fails with a message saying so.

Fixtures:

``pgbroker_postgresql_proc`` (session)
    A throwaway PostgreSQL server run by pytest-postgresql's
    ``PostgreSQLExecutor`` (as the ``postgres`` OS user when pytest runs as
    root, since ``initdb`` and ``pg_ctl`` refuse root).  Override it to use a
    server of your own; it must have ``url_for(dbname, user=...)``, ``host``,
    ``port`` and ``user``.
``pgbroker_template`` (session)
    The name of a database migrated once with ``pgbroker.migrate`` and used
    as a template.
``pgbroker_db`` (function)
    The URL of a fresh database cloned from the template (``CREATE DATABASE
    ... TEMPLATE``, through pytest-postgresql's ``DatabaseJanitor``: a few
    milliseconds, not a migration), dropped after the test.
``pgbroker_broker`` (function)
    A :class:`pgbroker.Broker` holding the lease ``pgbroker_lease_name``
    (default ``"default"``) on ``pgbroker_db``, released after the test.
``pgbroker_process`` (function)
    A factory ``spawn(name="default", **broker_kwargs) -> BrokerProcess``: a
    child process that claims the lease with :class:`pgbroker.Broker` and
    holds it (heartbeats running) until the test kills it
    (``.kill()``: SIGKILL, ``.stop()``/``.cont()``: SIGSTOP/SIGCONT).  Every
    child is killed after the test.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pgbroker import Broker

__all__ = ["BrokerProcess", "PgBrokerPostgres", "requires_pytest_postgresql"]

MISSING = (
    "pgbroker's pytest fixtures need pytest-postgresql, which is not installed: "
    "pip install pytest-postgresql (or pgbroker[test])"
)
TEMPLATE = "pgbroker_template"
_databases = itertools.count()


def requires_pytest_postgresql() -> Any:
    """Import pytest-postgresql, or fail the test with :data:`MISSING`."""
    try:
        import pytest_postgresql.executors
        import pytest_postgresql.janitor
    except ImportError:
        pytest.fail(MISSING, pytrace=False)
    return pytest_postgresql


class PgBrokerPostgres:
    """A PostgreSQL server run by pytest-postgresql's ``PostgreSQLExecutor`` in a temporary directory."""

    user = "postgres"
    host = "127.0.0.1"

    def __init__(self, postgres_options: str = "") -> None:
        self.postgres_options = postgres_options
        self.executor: Any = None
        self.directory: Path | None = None

    @property
    def port(self) -> int:
        return int(self.executor.port)

    def url_for(self, dbname: str, user: str | None = None) -> str:
        return f"postgresql://{user or self.user}@{self.host}:{self.port}/{dbname}"

    def start(self) -> PgBrokerPostgres:
        requires_pytest_postgresql()
        from pytest_postgresql.executors import PostgreSQLExecutor

        from pgbroker._embedded import SERVER_OPTIONS, TIMEOUT, free_port, pg_ctl_command, wait_until_accepting

        self.directory = Path(tempfile.mkdtemp(prefix="pgbroker-pytest-"))
        try:
            self.executor = PostgreSQLExecutor(
                executable=pg_ctl_command(self.directory),
                host=self.host,
                port=free_port(),
                datadir=str(self.directory / "data"),
                unixsocketdir=str(self.directory),
                logfile=str(self.directory / "postgresql.log"),
                startparams="-w",
                dbname="postgres",
                user=self.user,
                postgres_options=f"{SERVER_OPTIONS} {self.postgres_options}".strip(),
                timeout=TIMEOUT,
            )
            self.executor.start()
            wait_until_accepting(self.url_for("postgres"))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        try:
            if self.executor is not None and self.executor.running():
                self.executor.stop()
        finally:
            self.executor = None
            if self.directory is not None:
                shutil.rmtree(self.directory, ignore_errors=True)
                self.directory = None


@pytest.fixture(scope="session")
def pgbroker_postgresql_proc() -> Iterator[PgBrokerPostgres]:
    server = PgBrokerPostgres().start()
    try:
        yield server
    finally:
        server.stop()


def _janitor(server: Any, dbname: str, template: str | None = None) -> Any:
    from pytest_postgresql.janitor import DatabaseJanitor

    return DatabaseJanitor(
        user=server.user,
        host=server.host,
        port=server.port,
        dbname=dbname,
        template_dbname=template,
    )


@pytest.fixture(scope="session")
def pgbroker_template(pgbroker_postgresql_proc: Any) -> Iterator[str]:
    from pgbroker import install

    requires_pytest_postgresql()
    janitor = _janitor(pgbroker_postgresql_proc, TEMPLATE)
    janitor.init()
    try:
        install.migrate(pgbroker_postgresql_proc.url_for(TEMPLATE))
        yield TEMPLATE
    finally:
        janitor.drop()


def _copy_database_settings(server: Any, template: str, name: str) -> None:
    """CREATE DATABASE ... TEMPLATE copies no ALTER DATABASE ... SET (pgbroker sets the search_path): copy them."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(server.url_for("postgres"), autocommit=True) as conn:
        row = conn.execute(
            "SELECT s.setconfig FROM pg_db_role_setting s JOIN pg_database d ON d.oid = s.setdatabase"
            " WHERE d.datname = %s AND s.setrole = 0",
            (template,),
        ).fetchone()
        for setting in row[0] if row else []:
            key, value = setting.split("=", 1)
            conn.execute(
                sql.SQL("ALTER DATABASE {} SET {} TO {}").format(
                    sql.Identifier(name), sql.Identifier(key), sql.SQL(value)
                )
            )


@pytest.fixture
def pgbroker_db(pgbroker_postgresql_proc: Any, pgbroker_template: str) -> Iterator[str]:
    name = f"pgbroker_test_{os.getpid()}_{next(_databases)}"
    janitor = _janitor(pgbroker_postgresql_proc, name, template=pgbroker_template)
    janitor.init()
    _copy_database_settings(pgbroker_postgresql_proc, pgbroker_template, name)
    try:
        yield pgbroker_postgresql_proc.url_for(name)
    finally:
        janitor.drop()


@pytest.fixture
def pgbroker_lease_name() -> str:
    return "default"


@pytest.fixture
def pgbroker_broker(pgbroker_db: str, pgbroker_lease_name: str) -> Iterator[Broker]:
    from pgbroker import Broker

    with Broker(pgbroker_db, pgbroker_lease_name, application_name="pytest-broker") as broker:
        yield broker


# The child: claim with the given Broker arguments, print what it holds, then hold until killed.
_CHILD = """\
import json, sys, time
from pgbroker import Broker
url, name, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
broker = Broker(url, name, **kwargs)
epoch = broker.claim()
print(json.dumps({"epoch": epoch, "backend_pid": broker.pid}), flush=True)
while True:
    time.sleep(3600)
"""


class BrokerProcess:
    """A broker in a child process, holding a lease until it is killed."""

    def __init__(self, url: str, name: str, timeout: float = 60, **broker_kwargs: Any) -> None:
        self.url = url
        self.name = name
        kwargs = {"application_name": "pytest-broker-process", **broker_kwargs}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, url, name, json.dumps(kwargs)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=timeout)
            raise RuntimeError(f"the broker process did not claim {name!r}: {err.strip()}")
        held = json.loads(line)
        self.epoch: int = held["epoch"]
        self.backend_pid: int = held["backend_pid"]

    @property
    def pid(self) -> int:
        """The child's OS process id."""
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: the process dies at once; the server frees its lock when it notices the closed socket."""
        self._signal(signal.SIGKILL)
        self.proc.wait(timeout=60)

    def stop(self) -> None:
        """SIGSTOP: the process hangs (no heartbeats), its session stays open."""
        self._signal(signal.SIGSTOP)

    def cont(self) -> None:
        """SIGCONT: resume a stopped process."""
        self._signal(signal.SIGCONT)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._signal(signal.SIGCONT)
            self._signal(signal.SIGKILL)
        self.proc.wait(timeout=60)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def pgbroker_process(pgbroker_db: str) -> Iterator[Callable[..., BrokerProcess]]:
    started: list[BrokerProcess] = []

    def spawn(name: str = "default", *, url: str | None = None, **broker_kwargs: Any) -> BrokerProcess:
        process = BrokerProcess(url or pgbroker_db, name, **broker_kwargs)
        started.append(process)
        return process

    try:
        yield spawn
    finally:
        for process in started:
            process.close()
