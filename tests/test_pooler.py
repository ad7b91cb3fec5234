"""Leases behind a real pgbouncer.

Session pooling is safe: when the client goes, pgbouncer resets the server
connection (DISCARD ALL), which frees the advisory lock.  Transaction pooling
is not: the lock stays on a server connection that pgbouncer keeps and shares.
These tests show both, and that stale_after recovers the second case.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import psycopg
import pytest
from pgbouncer_util import bouncers, requires_pgbouncer

pytestmark = requires_pgbouncer

HOLDER = """
import sys, time, psycopg
conn = psycopg.connect(sys.argv[1], autocommit=True, application_name="pooled-holder")
print(conn.execute("SELECT pgbroker.broker_claim('pooled')").fetchone()[0], flush=True)
time.sleep(600)
"""


@pytest.fixture
def bouncer(pg_server, db_name) -> Iterator[Callable[..., str]]:
    with bouncers(pg_server.port, db_name) as start:
        yield start


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
