"""Fault: the broker's connection freezes (a hung middlebox: sockets open, nothing forwarded).

A TCP proxy between the Python broker and the server stops forwarding in
both directions and keeps both sockets open, so both kernels keep
acknowledging and answering keepalives: TCP never notices.  Only
application-level timeouts can: the broker's ``guard`` (no heartbeat
confirmed for ``guard`` seconds: ``check()`` raises) and, server side, the
broker session's ``idle_session_timeout`` (``dead_man``), which ends the
session and frees the lease.  ``guard < dead_man`` is enforced by the
Broker, so the holder steps down before the server can free its lock, and a
successor waiting on the lease cannot act before that.  The history (claims,
fenced writes, the step-down) is checked against ``pgbroker.lease_history``
and the fenced rows on the server.
"""

from __future__ import annotations

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

from pgbroker import Broker, LeaseLost

NAME = "frozen"
DEAD_MAN = 2.0
HEARTBEAT = 0.2


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
        finally:
            proxy.reset()  # RST: the broker's stuck heartbeat fails now, and close() does not wait
            broker.close()

    detection_ms = (stepped_down[0] - frozen_at) / 1e6
    successor_ms = (b_done["claimed"] - frozen_at) / 1e6
    server_ms = (server_gone - frozen_at) / 1e6
    print(
        f"\nFIGURE connection frozen: detection {detection_ms:.0f} ms (guard {broker.guard * 1000:.0f} ms, heartbeat "
        f"{HEARTBEAT * 1000:.0f} ms); server ended the session ~{server_ms:.0f} ms (dead_man {DEAD_MAN * 1000:.0f} ms);"
        f" successor held the lease {successor_ms:.0f} ms after the freeze; on_lost during the freeze:"
        f" {len(lost_during_freeze)}, after the proxy reset it: {len(lost) - len(lost_during_freeze)}"
    )
    # A steps down before the server frees the lock, hence before B can claim.
    assert stepped_down[0] < b_done["claimed"]
    assert detection_ms < DEAD_MAN * 1000
    assert b_done["epoch"] > epoch_a
    assert broker.lost and len(lost) == 1  # the reset made the loss certain: on_lost once

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
