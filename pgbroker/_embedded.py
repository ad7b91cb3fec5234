"""A throwaway PostgreSQL server for the demo (standard library only).

``initdb`` and ``pg_ctl`` refuse to run as root, so when we are root every
``pg_ctl`` call goes through a tiny wrapper script (:func:`pg_ctl_command`)
that drops to an unprivileged OS user (``postgres`` by default) with
``runuser``, and the server's directory is handed to that user.  Everything
else (connecting, creating databases) happens over TCP on loopback and does
not care who started the server.

The test suite starts its servers with pytest-postgresql's executor, through
the same :func:`pg_ctl_command` wrapper (see ``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["EmbeddedPostgres", "ServerError", "find_pg_bin", "pg_ctl_command", "SERVER_OPTIONS"]

SUPERUSER = "postgres"
OS_USER = "postgres"
# Settings for a throwaway server: fast, not durable.
SERVER_OPTIONS = (
    "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200 -c shared_buffers=128MB"
)
TIMEOUT = 120  # seconds pg_ctl may take to start or stop the server


class ServerError(RuntimeError):
    """The throwaway server could not be started or stopped; the message says why."""


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


def pg_ctl_command(directory: Path, os_user: str = OS_USER) -> str:
    """The ``pg_ctl`` to run for a server that lives in ``directory``.

    Not root: ``pg_ctl`` itself.  Root: ``directory`` is handed to ``os_user``
    and a wrapper script ``directory/pg_ctl`` runs ``pg_ctl`` as that user
    through ``runuser``; the wrapper is returned.
    """
    pg_ctl = str(find_pg_bin() / "pg_ctl")
    if os.geteuid() != 0:
        return pg_ctl
    if shutil.which("runuser") is None:
        raise ServerError("running as root needs runuser (Debian: apt-get install util-linux) to start PostgreSQL")
    try:
        pw = pwd.getpwnam(os_user)
    except KeyError:
        raise ServerError(
            f"running as root: PostgreSQL must run as an unprivileged OS user, and user {os_user!r} does not exist "
            "(Debian's postgresql package creates it)"
        ) from None
    os.chown(directory, pw.pw_uid, pw.pw_gid)
    wrapper = directory / "pg_ctl"
    wrapper.write_text(f'#!/bin/sh\nexec runuser -u {os_user} -- {pg_ctl} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedPostgres:
    """A private PostgreSQL cluster in a temporary directory, started with ``pg_ctl``.

    Use it as a context manager (or call :meth:`start` and :meth:`stop`);
    :meth:`stop` removes the directory.  ``os_user`` runs the server when the
    current process is root; it is ignored otherwise.
    """

    def __init__(
        self,
        postgres_options: str = "",
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        os_user: str = OS_USER,
    ) -> None:
        self.postgres_options = postgres_options
        self.port = port if port is not None else free_port()
        self.host = host
        self.os_user = os_user
        self.directory: Path | None = None
        self._pg_ctl: str | None = None

    # -- where things are

    @property
    def url(self) -> str:
        return self.url_for("postgres")

    def url_for(self, dbname: str, user: str = SUPERUSER) -> str:
        return f"postgresql://{user}@{self.host}:{self.port}/{dbname}"

    def _dir(self) -> Path:
        if self.directory is None:
            raise ServerError("the server has not been started")
        return self.directory

    @property
    def datadir(self) -> Path:
        return self._dir() / "data"

    @property
    def logfile(self) -> Path:
        return self._dir() / "postgresql.log"

    # -- life cycle

    def _run(self, *args: str) -> None:
        assert self._pg_ctl is not None
        env = {**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"}
        env.pop("PGDATA", None)
        try:
            done = subprocess.run(
                [self._pg_ctl, *args], capture_output=True, text=True, env=env, timeout=TIMEOUT, cwd="/"
            )
        except subprocess.TimeoutExpired:
            raise ServerError(f"pg_ctl {args[0]} did not finish within {TIMEOUT} s") from None
        if done.returncode != 0:
            log = ""
            with contextlib.suppress(OSError):
                log = "\n" + "\n".join(self.logfile.read_text().splitlines()[-10:])
            raise ServerError(f"pg_ctl {args[0]} failed: {(done.stderr or done.stdout).strip()}{log}")

    def _start_server(self) -> None:
        options = f"-F -p {self.port} -c listen_addresses={self.host} -c unix_socket_directories={self._dir()} "
        options += f"{SERVER_OPTIONS} {self.postgres_options}".strip()
        self._run("start", "-w", "-t", str(TIMEOUT), "-D", str(self.datadir), "-l", str(self.logfile), "-o", options)

    def start(self) -> EmbeddedPostgres:
        """Create the cluster (first call) and start the server; after a crash, start it again on its data."""
        if self.directory is not None:
            self._start_server()
            return self
        with contextlib.ExitStack() as undo:
            self.directory = Path(tempfile.mkdtemp(prefix="pgbroker-pg-"))
            undo.callback(self._forget)
            undo.callback(self._kill_postmaster)  # runs first: a half-started server is stopped
            self._pg_ctl = pg_ctl_command(self.directory, self.os_user)
            self._run("initdb", "-D", str(self.datadir), "-o", f"--username={SUPERUSER} --auth=trust --no-sync")
            self._start_server()
            undo.pop_all()
        return self

    def restart(self) -> None:
        """Stop the server (fast mode) and start it again on the same data."""
        self._run("stop", "-w", "-D", str(self.datadir), "-m", "fast")
        self._start_server()

    def stop(self) -> None:
        """Stop the server and remove its directory (killing the postmaster if ``pg_ctl stop`` fails)."""
        if self.directory is None:
            return
        try:
            if (self.datadir / "postmaster.pid").exists():
                self._run("stop", "-w", "-D", str(self.datadir), "-m", "fast")
        except ServerError:
            self._kill_postmaster()
            raise
        finally:
            self._forget()

    def _kill_postmaster(self) -> None:
        """Immediate shutdown by signal (its children follow), for when pg_ctl cannot stop it."""
        with contextlib.suppress(ValueError, OSError, IndexError):
            pid = int((self.datadir / "postmaster.pid").read_text().split()[0])
            os.kill(pid, signal.SIGQUIT)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                os.kill(pid, 0)  # OSError once it is gone
                time.sleep(0.05)

    def _forget(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
        self.directory = None
        self._pg_ctl = None

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
