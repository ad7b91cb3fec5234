"""Fault: the broker's connection freezes (a hung middlebox: sockets open, nothing forwarded).

A TCP proxy between the Python broker and the server stops forwarding in
both directions and keeps both sockets open, so both kernels keep
acknowledging and answering keepalives: TCP never notices.  Only
application-level timeouts can: the broker's ``guard`` (no heartbeat
confirmed for ``guard`` seconds: ``check()`` raises) and, server side, the
broker session's ``idle_session_timeout`` (``dead_man``), which ends the
session and frees the lease.  ``guard < dead_man`` is enforced by the
Broker, so the holder steps down before the server can free its lock, and a
successor waiting on the lease cannot act before that.  Without ``dead_man``
nothing would ever free the lease: the server's keepalives are answered.
And ``close()`` returns while the connection is still frozen: the stuck
heartbeat holds the connection's lock, so after ``keepalive.user_timeout``
+ 1 s the broker shuts its socket down.  The history (claims,
fenced writes, the step-down) is checked against ``pgbroker.lease_history``
and the fenced rows on the server.
"""

from __future__ import annotations

import asyncio
import threading
import time

import psycopg
from fault_util import (
    check_lease,
    check_writes_present,
    create_fenced_table,
    fenced_rows,
    fenced_write,
    server_history,
)
from history import History, now_ns
from lease_util import backend_gone, wait_until
from tcp_proxy import TcpProxy

from pgbroker import AsyncBroker, Broker, Keepalive, LeaseLost

NAME = "frozen"
DEAD_MAN = 2.0
HEARTBEAT = 0.2
USER_TIMEOUT = 2.5


def test_frozen_connection_broker_steps_down_before_the_server_frees_the_lease(pg_server, db_name, connect, tmp_path):
    obs = connect("observer")
    create_fenced_table(obs)
    history = History(tmp_path / "history")
    rec_a, rec_b = history.recorder("A"), history.recorder("B")
    lost: list[tuple[int, LeaseLost]] = []
    with TcpProxy(pg_server.host, pg_server.port) as proxy:
        broker = Broker(
            proxy.url(db_name),
            NAME,
            heartbeat_interval=HEARTBEAT,
            dead_man=DEAD_MAN,
            keepalive=Keepalive(user_timeout=USER_TIMEOUT),
            on_lost=lambda exc: lost.append((now_ns(), exc)),
        )
        try:
            with rec_a.call("claim", NAME) as call:
                epoch_a = broker.claim()
                call.ok(token=epoch_a)
            a_pid = broker.pid
            a_writes = connect("A writes")  # fenced writes of A go on a direct connection
            stepped_down: list[int] = []

            def a_loop() -> None:
                seq = 0
                while True:
                    seq += 1
                    try:
                        broker.check()
                    except LeaseLost as exc:
                        with rec_a.call("step_down", NAME) as call:
                            stepped_down.append(now_ns())
                            call.ok(why=str(exc))
                        return
                    fenced_write(a_writes, rec_a, NAME, epoch_a, seq)
                    time.sleep(0.02)

            a_thread = threading.Thread(target=a_loop, daemon=True)
            a_thread.start()
            time.sleep(0.5)  # a few heartbeats and writes through the proxy

            b_done: dict[str, int] = {}
            b_conn = connect("B")

            def b_claims() -> None:
                with rec_b.call("claim", NAME) as call:
                    epoch_b = b_conn.execute(
                        "SELECT pgbroker.broker_claim(%s, wait => '20 s', owner => 'B')", (NAME,)
                    ).fetchone()[0]
                    call.ok(token=epoch_b)
                b_done["claimed"] = now_ns()
                for seq in range(1, 6):
                    assert fenced_write(b_conn, rec_b, NAME, epoch_b, seq)
                b_done["epoch"] = epoch_b

            frozen_at = now_ns()
            proxy.freeze()
            b_thread = threading.Thread(target=b_claims, daemon=True)
            b_thread.start()
            wait_until(lambda: backend_gone(obs, a_pid), timeout=15, what="the server to end A's session")
            server_gone = now_ns()
            b_thread.join(15)
            a_thread.join(5)
            assert "epoch" in b_done and stepped_down, "B never took over, or A never stepped down"
            lost_during_freeze = list(lost)
            # Still frozen: close() must not wait forever for the stuck heartbeat (it holds the
            # connection's lock): after keepalive.user_timeout + 1 s it shuts the socket down.
            closing = threading.Thread(target=broker.close, daemon=True)
            close_started = time.monotonic()
            closing.start()
            closing.join(broker.keepalive.user_timeout + 5)
            close_s = time.monotonic() - close_started
            assert not closing.is_alive(), "close() hangs behind the frozen connection"
        finally:
            proxy.reset()  # RST: whatever still waits on the proxy fails now
            broker.close()

    detection_ms = (stepped_down[0] - frozen_at) / 1e6
    successor_ms = (b_done["claimed"] - frozen_at) / 1e6
    server_ms = (server_gone - frozen_at) / 1e6
    print(
        f"\nFIGURE connection frozen: detection {detection_ms:.0f} ms (guard {broker.guard * 1000:.0f} ms, heartbeat "
        f"{HEARTBEAT * 1000:.0f} ms); server ended the session ~{server_ms:.0f} ms (dead_man {DEAD_MAN * 1000:.0f} ms);"
        f" successor held the lease {successor_ms:.0f} ms after the freeze; on_lost during the freeze:"
        f" {len(lost_during_freeze)}; close() while frozen took {close_s * 1000:.0f} ms (user_timeout"
        f" {USER_TIMEOUT * 1000:.0f} ms + 1 s, then the socket is shut down) and fired on_lost"
        f" {len(lost) - len(lost_during_freeze)} time(s)"
    )
    # A steps down before the server frees the lock, hence before B can claim.
    assert stepped_down[0] < b_done["claimed"]
    assert detection_ms < DEAD_MAN * 1000
    assert b_done["epoch"] > epoch_a
    assert not lost_during_freeze  # no confirmed loss while frozen: check() and its guard are the step-down
    assert broker.lost and len(lost) == 1  # close() cut the stuck connection: a certain loss, on_lost once

    rec_a.close()
    rec_b.close()
    ops = history.load()
    a_ok = [o for o in ops if o.process == "A" and o.op == "write" and o.result == "ok"]
    assert a_ok and all(o.complete < b_done["claimed"] for o in a_ok)
    rows = server_history(obs, NAME)
    assert [(r["event"], r["epoch"]) for r in rows] == [("claim", epoch_a), ("claim", b_done["epoch"])]
    violations = check_lease(ops, rows, NAME, release="step_down")
    violations += check_writes_present(ops, fenced_rows(obs))
    assert not violations, "\n".join(map(str, violations))
    # Nothing fenced with A's epoch reached the server after B's claim: A's rows all precede B's.
    last_a, first_b = obs.execute(
        "SELECT max(at) FILTER (WHERE writer = 'A'), min(at) FILTER (WHERE writer = 'B') FROM public.fenced_writes"
    ).fetchone()
    assert last_a < first_b
    # A's session is gone; its epoch no longer passes the fence.
    try:
        obs.execute("SELECT pgbroker.broker_assert(%s, %s)", (NAME, epoch_a))
        raise AssertionError("the old epoch still passes broker_assert")
    except psycopg.Error as exc:
        assert exc.sqlstate == "PB002"


def test_frozen_connection_async_broker_steps_down_and_closes(pg_server, db_name, connect):
    """The asyncio flavour: check() raises within its guard, and close() returns while still frozen."""
    obs = connect("observer")
    lost: list[LeaseLost] = []

    async def scenario() -> tuple[float, float, int]:
        with TcpProxy(pg_server.host, pg_server.port) as proxy:
            broker = AsyncBroker(
                proxy.url(db_name),
                "afrozen",
                heartbeat_interval=HEARTBEAT,
                dead_man=DEAD_MAN,
                keepalive=Keepalive(user_timeout=USER_TIMEOUT),
                on_lost=lost.append,
            )
            try:
                await broker.claim()
                pid = broker.pid
                await asyncio.sleep(0.3)
                frozen_at = time.monotonic()
                proxy.freeze()
                while True:
                    try:
                        broker.check()
                    except LeaseLost:
                        detected = time.monotonic() - frozen_at
                        break
                    await asyncio.sleep(0.005)
                assert not lost
                started = time.monotonic()
                await asyncio.wait_for(broker.close(), USER_TIMEOUT + 5)
                return detected, time.monotonic() - started, pid
            finally:
                proxy.reset()
                await broker.close()

    detected, close_s, pid = asyncio.run(scenario())
    print(
        f"\nFIGURE connection frozen (asyncio): detection {detected * 1000:.0f} ms; close() while frozen took"
        f" {close_s * 1000:.0f} ms"
    )
    assert detected < DEAD_MAN and len(lost) == 1
    wait_until(lambda: backend_gone(obs, pid), timeout=10, what="the server to end the session")
    rows = server_history(obs, "afrozen")
    assert [r["event"] for r in rows] == ["claim"] and not check_lease([], rows, "afrozen")
