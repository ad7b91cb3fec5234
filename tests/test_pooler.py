"""Leases behind a real pgbouncer.

Session pooling is safe: when the client goes, pgbouncer resets the server
connection (DISCARD ALL), which frees the advisory lock.  Transaction pooling
is not: the lock stays on a server connection that pgbouncer keeps and shares.
These tests show both, and that stale_after recovers the second case.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"

pytestmark = pytest.mark.skipif(
    not os.path.exists(PGBOUNCER) and os.environ.get("CI") != "true",
    reason="pgbouncer is not installed (apt-get install pgbouncer); .ci/run installs it",
)

HOLDER = """
import sys, time, psycopg
conn = psycopg.connect(sys.argv[1], autocommit=True, application_name="pooled-holder")
print(conn.execute("SELECT pgbroker.broker_claim('pooled')").fetchone()[0], flush=True)
time.sleep(600)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_pgbouncer(pg_port: int, pool_mode: str) -> tuple[subprocess.Popen, int, Path]:
    tmp = Path(tempfile.mkdtemp(prefix="pgbroker-bouncer-"))
    port = _free_port()
    (tmp / "users.txt").write_text('"postgres" ""\n')
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
default_pool_size = 2
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
    raise RuntimeError(f"pgbouncer did not start: {(tmp / 'pgbouncer.log').read_text()}")


@pytest.fixture
def bouncer(pg_server, db_name) -> Iterator[Callable[[str], str]]:
    started: list[tuple[subprocess.Popen, Path]] = []

    def _bouncer(pool_mode: str) -> str:
        proc, port, tmp = _start_pgbouncer(pg_server.port, pool_mode)
        started.append((proc, tmp))
        return f"postgresql://postgres@127.0.0.1:{port}/{db_name}"

    try:
        yield _bouncer
    finally:
        for proc, tmp in started:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
            shutil.rmtree(tmp, ignore_errors=True)


def _holder(url: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, url], stdout=subprocess.PIPE, text=True)
    epoch = proc.stdout.readline().strip()
    assert epoch == "1", f"holder did not claim through the pooler: {epoch!r}"
    return proc


def test_session_pooling_frees_the_lease_when_the_client_dies(bouncer, connect):
    url = bouncer("session")
    holder = _holder(url)
    direct = connect("direct")
    try:
        row = direct.execute("SELECT alive, holder_application FROM pgbroker.brokers WHERE name = 'pooled'").fetchone()
        assert row == (True, "pooled-holder")
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        started = time.monotonic()
        # pgbouncer runs DISCARD ALL on the server connection, freeing the lock.
        epoch = direct.execute("SELECT pgbroker.broker_claim('pooled', wait => '10 s')").fetchone()[0]
        assert epoch == 2
        assert time.monotonic() - started < 5
    finally:
        holder.kill()


def test_transaction_pooling_strands_the_lock_and_stale_after_recovers_it(bouncer, connect):
    url = bouncer("transaction")
    holder = _holder(url)
    direct = connect("direct")
    try:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        # The lock stays on pgbouncer's server connection, which outlives the client.
        with pytest.raises(psycopg.errors.LockNotAvailable):
            direct.execute("SELECT pgbroker.broker_claim('pooled', wait => '1 s')")
        assert direct.execute("SELECT alive FROM pgbroker.brokers WHERE name = 'pooled'").fetchone()[0] is True
        # No heartbeat comes from a dead client: a stale takeover ends that server session.
        time.sleep(1.2)
        epoch = direct.execute(
            "SELECT pgbroker.broker_claim('pooled', wait => '5 s', stale_after => '1 s')"
        ).fetchone()[0]
        assert epoch == 2
        event = direct.execute(
            "SELECT event FROM pgbroker.lease_history WHERE name = 'pooled' AND epoch = 2"
        ).fetchone()[0]
        assert event == "stale_takeover"
    finally:
        holder.kill()
