"""Fault: callers behind pgbouncer in transaction mode (pools of 1 and 2).

Several clients share the pool's server sessions, so a claim can land on the
server session where another client's lease lives.  Never two holders: such a
claim is refused (PB003) unless it carries the claim's owner token.  And a
TTL lease, bound to an owner token rather than a session, works through the
pooler: claim, renew, fenced writes, expiry, release.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import psycopg
import pytest
from pgbouncer_util import bouncers, requires_pgbouncer

from pgbroker import Broker, PoolerNotSupported

pytestmark = requires_pgbouncer

CLIENTS = 4


@pytest.fixture
def bouncer(pg_server, db_name) -> Iterator[Callable[..., str]]:
    with bouncers(pg_server.port, db_name) as start:
        yield start


def _sqlstate(conn: psycopg.Connection, sql: str, params: tuple = ()) -> str | None:
    try:
        conn.execute(sql, params)
    except psycopg.Error as exc:
        return exc.sqlstate
    return None


@pytest.mark.parametrize("pool_size", [1, 2])
@pytest.mark.parametrize("owner", [False, True], ids=["bare", "owner"])
def test_never_two_holders_through_a_transaction_pooler(bouncer, connect, pool_size, owner):
    url = bouncer("transaction", pool_size=pool_size)
    clients = [psycopg.connect(url, autocommit=True, prepare_threshold=None) for _ in range(CLIENTS)]
    direct = connect("direct")
    try:
        told: list[tuple[int, int]] = []  # (client, epoch) for every "you hold it"
        refused: dict[str, int] = {}
        for _ in range(3):
            for i, conn in enumerate(clients):
                args = (f"c{i}",) if owner else ()
                sql = (
                    "SELECT pgbroker.broker_claim('pooled', owner => %s)"
                    if owner
                    else "SELECT pgbroker.broker_claim('pooled')"
                )
                try:
                    told.append((i, conn.execute(sql, args).fetchone()[0]))
                except psycopg.Error as exc:
                    refused[exc.sqlstate] = refused.get(exc.sqlstate, 0) + 1
        holders = {client for client, _ in told}
        epochs = {epoch for _, epoch in told}
        tokens = "with" if owner else "without"
        print(
            f"\npool of {pool_size}, {CLIENTS} clients x 3 rounds ({tokens} owner tokens): told holder {len(told)} "
            f"times, clients {sorted(holders)}, epochs {sorted(epochs)}, refused {refused}"
        )
        assert len(holders) == 1, f"two callers were told they hold the lease: {told}"
        assert len(epochs) == 1
        # Refused: by the lock (55P03, another server session holds it) or on the
        # holder's own server session (PB003, another caller).
        assert set(refused) <= {"55P03", "PB003"} and "PB003" in refused
        row = direct.execute("SELECT alive, epoch FROM pgbroker.brokers WHERE name = 'pooled'").fetchone()
        assert row == (True, epochs.pop())
    finally:
        for conn in clients:
            conn.close()


@pytest.mark.parametrize("pool_size", [1, 2])
def test_ttl_lease_works_through_a_transaction_pooler(bouncer, connect, pool_size):
    url = bouncer("transaction", pool_size=pool_size)
    a, b = (psycopg.connect(url, autocommit=True, prepare_threshold=None) for _ in range(2))
    direct = connect("direct")
    claim = "SELECT pgbroker.broker_claim('ttl', owner => %s, ttl => %s)"
    try:
        epoch = a.execute(claim, ("worker-a", "1 s")).fetchone()[0]
        assert _sqlstate(b, claim, ("worker-b", "1 s")) == "55P03"  # held by a, whatever session b lands on
        assert a.execute(claim, ("worker-a", "1 s")).fetchone()[0] == epoch  # the same owner renews
        a.execute("SELECT pgbroker.broker_renew('ttl', 'worker-a')")
        # Work fenced with the epoch, from any pooled session, and delivery-free client calls.
        with a.transaction():
            a.execute("SELECT pgbroker.broker_assert('ttl', %s)", (epoch,))
            a.execute("SELECT pgbroker.client_register('c1', '{}', 'ttl', %s)", (epoch,))
        assert direct.execute("SELECT alive FROM pgbroker.brokers WHERE name = 'ttl'").fetchone()[0] is True
        # a stops renewing: b's claim waits for the expiry and gets a new epoch.
        started = time.monotonic()
        new = b.execute(
            "SELECT pgbroker.broker_claim('ttl', wait => '5 s', owner => 'worker-b', ttl => '10 s')"
        ).fetchone()[0]
        waited = time.monotonic() - started
        print(f"\npool of {pool_size}: TTL 1 s lease taken over {waited * 1000:.0f} ms after the claim began waiting")
        assert new > epoch and waited < 2.5
        assert _sqlstate(a, "SELECT pgbroker.broker_renew('ttl', 'worker-a')") == "PB002"
        assert _sqlstate(a, "SELECT pgbroker.broker_assert('ttl', %s)", (epoch,)) == "PB002"
        assert direct.execute("SELECT count(*) FROM pgbroker.clients WHERE name = 'ttl'").fetchone()[0] == 0
        reason = direct.execute(
            "SELECT reason FROM pgbroker.lease_history WHERE name = 'ttl' AND epoch = %s", (new,)
        ).fetchone()[0]
        assert "expired" in reason
        assert a.execute("SELECT pgbroker.broker_release('ttl', 'worker-a')").fetchone()[0] is False
        assert b.execute("SELECT pgbroker.broker_release('ttl', 'worker-b')").fetchone()[0] is True
        assert direct.execute("SELECT alive FROM pgbroker.brokers WHERE name = 'ttl'").fetchone()[0] is False
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("pool_size", [1, 2])
def test_python_broker_refuses_a_transaction_pooler(bouncer, connect, pool_size):
    """The Broker holds a session lease: through a pooler it refuses before claiming, with a clear error."""
    url = bouncer("transaction", pool_size=pool_size)
    with pytest.raises(PoolerNotSupported) as refused, Broker(url, "pooled-py", heartbeat_interval=0.2):
        pass
    assert "TTL lease" in str(refused.value) and "pooler" in str(refused.value)
    direct = connect("direct")
    assert direct.execute("SELECT count(*) FROM pgbroker.lease WHERE name = 'pooled-py'").fetchone()[0] == 0


def test_python_broker_through_a_session_pooler_with_session_pooler(bouncer, connect):
    url = bouncer("session")
    with pytest.raises(PoolerNotSupported), Broker(url, "session-py", heartbeat_interval=0.2):
        pass
    with Broker(url, "session-py", heartbeat_interval=0.2, session_pooler=True) as broker:
        sql = "SELECT alive, epoch FROM pgbroker.brokers WHERE name = 'session-py'"
        assert connect("direct").execute(sql).fetchone() == (True, broker.epoch)
