"""A throwaway PostgreSQL server for the demo and the test suite.

The server is started with pytest-postgresql's ``PostgreSQLExecutor`` (which
drives ``pg_ctl``).  ``initdb`` and ``pg_ctl`` refuse to run as root, so when
we are root every ``pg_ctl`` call goes through a tiny wrapper script that
drops to an unprivileged OS user (``postgres`` by default) with ``runuser``,
and the data directory is handed to that user.  Everything else (connecting,
creating databases) happens over TCP on loopback and does not care who
started the server.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from pytest_postgresql.executors import PostgreSQLExecutor

__all__ = ["EmbeddedPostgres", "find_pg_bin"]

SUPERUSER = "postgres"


def find_pg_bin() -> Path:
    """Find the directory holding ``pg_ctl`` (PostgreSQL 15 or newer).

    Order: ``$PGBROKER_PG_BIN``, the newest ``/usr/lib/postgresql/*/bin``,
    then ``pg_ctl`` on ``PATH``.
    """
    env = os.environ.get("PGBROKER_PG_BIN")
    if env:
        return Path(env)
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
        key=lambda p: int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0,
    )
    if candidates:
        return Path(candidates[-1]).parent
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    raise FileNotFoundError(
        "pg_ctl not found: install PostgreSQL 15+ server binaries "
        "(Debian: apt-get install postgresql) or set PGBROKER_PG_BIN"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EmbeddedPostgres:
    """Start and stop a private PostgreSQL cluster in a temporary directory.

    ``os_user`` is the unprivileged account that runs the server when the
    current process is root; it is ignored otherwise.
    """

    os_user: str = "postgres"
    postgres_options: str = ""
    port: int = field(default_factory=_free_port)
    host: str = "127.0.0.1"
    _tmp: Path | None = None
    _executor: PostgreSQLExecutor | None = None

    @property
    def url(self) -> str:
        return self.url_for("postgres")

    def url_for(self, dbname: str, user: str = SUPERUSER) -> str:
        return f"postgresql://{user}@{self.host}:{self.port}/{dbname}"

    def _pg_ctl(self, tmp: Path) -> str:
        pg_ctl = str(find_pg_bin() / "pg_ctl")
        if os.geteuid() != 0:
            return pg_ctl
        # Root: hand the directory to the unprivileged user and run pg_ctl as it.
        pw = pwd.getpwnam(self.os_user)
        os.chown(tmp, pw.pw_uid, pw.pw_gid)
        wrapper = tmp / "pg_ctl"
        wrapper.write_text(f'#!/bin/sh\nexec runuser -u {self.os_user} -- {pg_ctl} "$@"\n')
        wrapper.chmod(0o755)
        return str(wrapper)

    def start(self) -> EmbeddedPostgres:
        tmp = Path(tempfile.mkdtemp(prefix="pgbroker-pg-"))
        self._tmp = tmp
        executable = self._pg_ctl(tmp)
        options = (
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
            "-c max_connections=200 -c shared_buffers=128MB "
            f"{self.postgres_options}"
        ).strip()
        self._executor = PostgreSQLExecutor(
            executable=executable,
            host=self.host,
            port=self.port,
            datadir=str(tmp / "data"),
            unixsocketdir=str(tmp),
            logfile=str(tmp / "postgresql.log"),
            startparams="-w",
            dbname="postgres",
            user=SUPERUSER,
            postgres_options=options,
            timeout=120,
        )
        self._executor.start()
        return self

    @property
    def logfile(self) -> Path:
        assert self._tmp is not None
        return self._tmp / "postgresql.log"

    @property
    def datadir(self) -> Path:
        assert self._tmp is not None
        return self._tmp / "data"

    def stop(self) -> None:
        if self._executor is not None:
            try:
                self._executor.stop()
            finally:
                self._executor = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def restart(self) -> None:
        """Stop the server (fast mode) and start it again on the same data."""
        assert self._executor is not None
        self._executor.stop()
        self._executor.start()

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
