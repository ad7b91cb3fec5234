"""The primitives behind a real pgbouncer.

In transaction mode (pools of 1 and 2 server connections) a client's
transactions may run on different server sessions: transaction-scoped locks
still exclude each other, counters and the key-value store work, and the
Python layer refuses session-scoped locks, semaphores and watches with
:class:`~pgbroker.errors.PoolerNotSupported`.  In session mode they work once
the caller says the pooler keeps sessions (``session_pooler=True``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from pgbouncer_util import bouncers, requires_pgbouncer

from pgbroker import KV, Counter, Lock, PoolerNotSupported, Semaphore

pytestmark = requires_pgbouncer


@pytest.fixture
def bouncer(pg_server, db_name) -> Iterator[Callable[..., str]]:
    with bouncers(pg_server.port, db_name) as start:
        yield start


@pytest.fixture
def pooled(bouncer) -> Iterator[Callable[..., psycopg.Connection]]:
    """``pooled(url)``: an autocommit connection through the pooler, closed at the end."""
    opened: list[psycopg.Connection] = []

    def _open(url: str) -> psycopg.Connection:
        conn = psycopg.connect(url, autocommit=True, prepare_threshold=None)
        opened.append(conn)
        return conn

    yield _open
    for conn in opened:
        conn.close()


def one(conn: psycopg.Connection, query: str, *params: Any) -> Any:
    return conn.execute(query, params).fetchone()[0]


@pytest.mark.parametrize("pool_size", [1, 2])
def test_transaction_pooling_xact_locks_exclude_each_other(bouncer, pooled, pool_size: int):
    url = bouncer("transaction", pool_size=pool_size, user="t_user")
    a, b = pooled(url), pooled(url)
    got: dict[str, float] = {}

    def b_acquires() -> None:
        with b.transaction():
            assert one(b, "SELECT pgbroker.lock_acquire('jobs', wait => '5 s', xact => true)") is True
            got["b"] = time.monotonic()

    with a.transaction():
        assert one(a, "SELECT pgbroker.lock_acquire('jobs', wait => '0', xact => true)") is True
        thread = threading.Thread(target=b_acquires, daemon=True)
        thread.start()
        time.sleep(0.3)  # b waits: in the lock manager (pool of 2) or for a server connection (pool of 1)
        assert "b" not in got
        released = time.monotonic()
    thread.join(10)
    assert got["b"] >= released
    # Through the Python layer: a transaction-scoped Lock.
    with a.transaction(), Lock(a, "jobs", xact=True, timeout=0) as held:
        assert held.locked
        if pool_size == 2:  # a second client gets the other server connection and is refused at once
            with b.transaction():
                assert Lock(b, "jobs", xact=True, timeout=0).acquire() is False
    with b.transaction():
        assert Lock(b, "jobs", xact=True, timeout=0).acquire() is True


@pytest.mark.parametrize("pool_size", [1, 2])
def test_transaction_pooling_counters_and_kv_work(bouncer, pooled, pool_size: int):
    url = bouncer("transaction", pool_size=pool_size, user="t_user")
    a, b = pooled(url), pooled(url)
    for _ in range(5):
        Counter(a, "hits").add()
        Counter(b, "hits").add(2)
    assert Counter(a, "hits").get() == 15
    assert Counter(b, "hits").set(0, expected=15) is True
    v1 = KV(a).cas("cfg", {"on": True}, 0)
    assert v1 is not None and KV(b).cas("cfg", {"on": False}, 0) is None
    v2 = KV(b).cas("cfg", {"on": False}, v1)
    assert v2 is not None and v2 > v1
    assert KV(a).get("cfg") == ({"on": False}, v2, None)
    assert KV(a).delete("cfg", version=v2) is True


@pytest.mark.parametrize("pool_size", [1, 2])
def test_transaction_pooling_refuses_session_scope(bouncer, pooled, pool_size: int):
    url = bouncer("transaction", pool_size=pool_size, user="t_user")
    conn = pooled(url)
    with pytest.raises(PoolerNotSupported, match="pooler"):
        Lock(conn, "session").acquire()
    with pytest.raises(PoolerNotSupported, match="session_pooler=True"), Semaphore(conn, "sem", limit=2):
        pass
    with pytest.raises(PoolerNotSupported):
        next(KV(conn).watch("k"))
    # Nothing was taken on any server session.
    assert one(conn, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'") == 0


def test_session_pooling_works_when_the_caller_says_so(bouncer, pooled, connect):
    url = bouncer("session", pool_size=2, user="postgres")
    conn, other = pooled(url), connect("direct")
    with pytest.raises(PoolerNotSupported, match="session_pooler=True"):
        Lock(conn, "s").acquire()
    with Lock(conn, "s", timeout=0, session_pooler=True) as held:
        assert held.locked
        assert one(other, "SELECT pgbroker.lock_acquire('s', '0')") is False
    with Semaphore(conn, "sem", limit=1, timeout=1, session_pooler=True) as permit:
        assert permit.permit == 1
        assert one(other, "SELECT pgbroker.semaphore_acquire('sem', 1)") is None
    assert one(other, "SELECT pgbroker.lock_acquire('s', '0')") is True
    # A direct connection needs no flag.
    with Lock(other, "d", timeout=0):
        pass
