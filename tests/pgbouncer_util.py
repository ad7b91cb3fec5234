"""A real pgbouncer for the tests: started on a free loopback port, stopped at the end.

Used by tests/test_pooler.py (leases) and tests/test_primitives_pooler.py.
A test module defines its ``bouncer`` fixture with :func:`bouncers` and
skips as :data:`requires_pgbouncer` says.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"

requires_pgbouncer = pytest.mark.skipif(
    not os.path.exists(PGBOUNCER) and os.environ.get("CI") != "true",
    reason="pgbouncer is not installed (apt-get install pgbouncer); .ci/run installs it",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_pgbouncer(
    pg_port: int, pool_mode: str, pool_size: int = 2, users: Sequence[str] = ("postgres",)
) -> tuple[subprocess.Popen, int, Path]:
    """Start pgbouncer in front of 127.0.0.1:pg_port (trust auth for ``users``); (process, port, directory)."""
    tmp = Path(tempfile.mkdtemp(prefix="pgbroker-bouncer-"))
    port = free_port()
    (tmp / "users.txt").write_text("".join(f'"{user}" ""\n' for user in users))
    (tmp / "pgbouncer.ini").write_text(
        f"""[databases]
* = host=127.0.0.1 port={pg_port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {tmp}/users.txt
pool_mode = {pool_mode}
default_pool_size = {pool_size}
server_reset_query = DISCARD ALL
ignore_startup_parameters = extra_float_digits,options
logfile = {tmp}/pgbouncer.log
pidfile = {tmp}/pgbouncer.pid
"""
    )
    cmd = [PGBOUNCER, str(tmp / "pgbouncer.ini")]
    if os.geteuid() == 0:  # pgbouncer refuses to run as root
        pw = pwd.getpwnam("postgres")
        for path in (tmp, *tmp.iterdir()):
            os.chown(path, pw.pw_uid, pw.pw_gid)
        cmd = ["runuser", "-u", "postgres", "--", *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port, tmp
        except OSError:
            time.sleep(0.05)
    proc.kill()
    log = tmp / "pgbouncer.log"
    raise RuntimeError(f"pgbouncer did not start: {log.read_text() if log.exists() else '(no log)'}")


def stop_pgbouncer(proc: subprocess.Popen, tmp: Path) -> None:
    """Stop it at once: SIGTERM to pgbouncer itself (as root its parent, runuser, would pass it on 2 s late)."""
    try:
        os.kill(int((tmp / "pgbouncer.pid").read_text()), signal.SIGTERM)
    except (OSError, ValueError):
        proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def bouncers(pg_port: int, db_name: str) -> Iterator[Callable[..., str]]:
    """A factory ``start(pool_mode, pool_size=2, user="postgres")`` -> URL of ``db_name`` through a new pgbouncer;
    every pgbouncer it started is stopped at the end (a test module's ``bouncer`` fixture yields it)."""
    started: list[tuple[subprocess.Popen, Path]] = []

    def _bouncer(pool_mode: str, pool_size: int = 2, user: str = "postgres") -> str:
        proc, port, tmp = start_pgbouncer(pg_port, pool_mode, pool_size, users=(user,))
        started.append((proc, tmp))
        return f"postgresql://{user}@127.0.0.1:{port}/{db_name}"

    try:
        yield _bouncer
    finally:
        for proc, tmp in started:
            stop_pgbouncer(proc, tmp)
