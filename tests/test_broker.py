"""pgbroker.Broker / AsyncBroker against a real PostgreSQL: claim, refusal,
waiting, takeover, loss detection (terminated backend, wedged heartbeat,
paused process, server restart), broker state, thread safety."""

from __future__ import annotations

import asyncio
import inspect
import io
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import tokenize
from typing import Any

import psycopg
import pytest
from conftest import advisory_locks

from pgbroker import AsyncBroker, Broker, Keepalive
from pgbroker.errors import (
    InvalidArgument,
    LeaseHeld,
    LeaseLost,
    PermissionDenied,
    PgBrokerError,
    StaleEpoch,
    translate,
)


def wait_until(predicate: Any, timeout: float = 5.0, step: float = 0.01) -> float:
    """Poll until predicate() is true; return the seconds it took."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(step)
    return time.monotonic() - started


def row(conn: psycopg.Connection, name: str) -> dict[str, Any] | None:
    cur = conn.execute("SELECT * FROM pgbroker.brokers WHERE name = %s", (name,))
    values = cur.fetchone()
    return None if values is None else dict(zip([d.name for d in cur.description], values, strict=True))


def sessions(conn: psycopg.Connection, application: str) -> int:
    return conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND datname = current_database()",
        (application,),
    ).fetchone()[0]


# ---------------------------------------------------------------------------
# Claim, epoch, release


def test_sync_claim_epoch_release(db_url, connect):
    watch = connect("watch")
    with Broker(db_url, "orders", info="node-1") as b:
        assert b.epoch == 1
        assert b.held and not b.lost
        assert 0 < b.check() <= b.guard
        r = row(watch, "orders")
        assert (r["epoch"], r["state"], r["alive"], r["holder_pid"]) == (1, "held", True, b.pid)
        assert (r["holder_application"], r["holder_info"]) == ("pgbroker", "node-1")
        assert b.status()["holder_pid"] == b.pid
        assert [lock[0] for lock in advisory_locks(watch)] == [b.pid]
    # Leaving the block released the lease and closed the connection.
    r = row(watch, "orders")
    assert (r["state"], r["alive"]) == ("released", False)
    assert advisory_locks(watch) == []
    wait_until(lambda: sessions(watch, "pgbroker") == 0)
    with pytest.raises(LeaseLost):
        b.check()
    # Epochs strictly increase; an explicit release() returns True.
    b2 = Broker(db_url, "orders")
    assert b2.claim() == 2
    assert b2.release() is True
    with pytest.raises(LeaseLost, match="released"):
        b2.check()
    b2.close()
    wait_until(lambda: sessions(watch, "pgbroker") == 0)
    with pytest.raises(PgBrokerError, match="claims once"):
        b2.claim()


def test_default_info_names_host_and_process(db_url, connect):
    with Broker(db_url, "info") as b:
        assert row(connect(), "info")["holder_info"] == f"{socket.gethostname()} pid {os.getpid()}"
        assert b.info == f"{socket.gethostname()} pid {os.getpid()}"


def test_async_claim_epoch_heartbeat_release(db_url, connect):
    watch = connect("watch")

    async def scenario() -> None:
        async with AsyncBroker(db_url, "async", heartbeat_interval=0.1) as b:
            assert b.epoch == 1
            first = b.heartbeat_at
            await asyncio.sleep(0.35)
            assert b.heartbeat_at > first  # the heartbeat task runs
            assert b.check() > 0
            r = await b.status()
            assert (r["epoch"], r["alive"], r["holder_pid"]) == (1, True, b.pid)
            assert r["heartbeat_at"] == b.heartbeat_at
        assert row(watch, "async")["state"] == "released"
        async with AsyncBroker(db_url, "async") as b2:
            assert b2.epoch == 2
            assert await b2.release() is True
        with pytest.raises(LeaseLost):
            b2.check()

    asyncio.run(scenario())
    wait_until(lambda: sessions(watch, "pgbroker") == 0)


def test_session_keepalives_and_dead_man_are_set(db_url):
    keepalive = Keepalive(idle=7, interval=2, count=4, user_timeout=8.5)
    with Broker(db_url, "ka", keepalive=keepalive, dead_man=3.0, heartbeat_interval=0.5) as b:
        server = {
            setting: b._execute(f"SHOW {setting}")[0][0]
            for setting in ("tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count")
        }
        assert server == {"tcp_keepalives_idle": "7", "tcp_keepalives_interval": "2", "tcp_keepalives_count": "4"}
        assert b._execute("SHOW tcp_user_timeout")[0][0] == "8500"
        assert b._execute("SHOW idle_session_timeout")[0][0] == "3s"
        assert b._execute("SHOW statement_timeout")[0][0] == "0"
        client = b._conn.info.get_parameters()
        assert (client["keepalives"], client["keepalives_idle"], client["tcp_user_timeout"]) == ("1", "7", "8500")
        assert b.guard == pytest.approx(1.5)  # 3 heartbeats, below dead_man and the keepalive bound


def test_settings_that_break_the_bound_are_refused(db_url):
    with pytest.raises(ValueError, match="guard"):
        Broker(db_url, guard=6.0)  # later than the server may drop a silent session (keepalive idle 5 s)
    with pytest.raises(ValueError, match="heartbeat_interval"):
        Broker(db_url, dead_man=1.0)  # a 1 s heartbeat cannot keep a 1 s dead-man switch quiet
    with pytest.raises(ValueError):
        Broker(db_url, heartbeat_interval=0)
    with pytest.raises(TypeError):
        Broker(db_url, wait="5s")
    b = Broker(db_url, dead_man=1.0, heartbeat_interval=0.25)
    assert b.heartbeat_interval < b.guard < 1.0


def test_bad_name_is_a_clear_error_and_leaves_nothing(db_url, connect):
    watch = connect("watch")
    with pytest.raises(InvalidArgument) as info:
        Broker(db_url, "").claim()
    assert info.value.sqlstate == "22023"
    with pytest.raises(InvalidArgument):
        Broker(db_url, "x" * 64).claim()
    wait_until(lambda: sessions(watch, "pgbroker") == 0)
    assert watch.execute("SELECT count(*) FROM pgbroker.brokers").fetchone()[0] == 0


# ---------------------------------------------------------------------------
# Exclusion: refused, waiting, takeover


def test_second_broker_is_refused_with_the_holder_in_detail(db_url, connect):
    watch = connect("watch")
    with Broker(db_url, "solo", info="first-node") as a:
        started = time.monotonic()
        with pytest.raises(LeaseHeld) as info:
            Broker(db_url, "solo", application_name="second").claim()
        assert time.monotonic() - started < 1.0
        err = info.value
        assert err.sqlstate == "55P03"
        assert f"pid {a.pid}" in str(err)
        assert (err.name, err.pid, err.info, err.epoch, err.application) == ("solo", a.pid, "first-node", 1, "pgbroker")
        assert err.since is not None and err.heartbeat_at is not None
        assert json.loads(err.detail)["pid"] == a.pid
        assert err.hint and "wait" in err.hint
        assert isinstance(err.__cause__, psycopg.errors.LockNotAvailable)
        # The refused broker left no session and no lock; A is untouched.
        wait_until(lambda: sessions(watch, "second") == 0)
        assert [lock[0] for lock in advisory_locks(watch)] == [a.pid]
        assert a.check() > 0

        async def async_refused() -> LeaseHeld:
            with pytest.raises(LeaseHeld) as ainfo:
                await AsyncBroker(db_url, "solo").claim()
            return ainfo.value

        assert asyncio.run(async_refused()).pid == a.pid


def test_wait_with_timeout_then_refused(db_url):
    with Broker(db_url, "timed") as a:
        started = time.monotonic()
        with pytest.raises(LeaseHeld, match=f"pid {a.pid}"):
            Broker(db_url, "timed", wait=0.3).claim()
        assert 0.28 <= time.monotonic() - started < 2.0


def test_waiting_broker_takes_over_when_the_first_closes(db_url, connect):
    watch = connect("watch")
    a = Broker(db_url, "handover", application_name="A")
    assert a.claim() == 1
    b = Broker(db_url, "handover", wait=None, application_name="B")
    got: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: got.update(epoch=b.claim(), at=time.monotonic()))
    thread.start()
    try:
        wait_until(lambda: row(watch, "handover")["waiting"] == 1)
        assert not got  # still blocked
        closed_at = time.monotonic()
        a.close()
        thread.join(5)
        assert got["epoch"] == 2 and b.epoch == 2
        assert got["at"] - closed_at < 1.0
        r = row(watch, "handover")
        assert (r["epoch"], r["holder_pid"], r["holder_application"], r["alive"]) == (2, b.pid, "B", True)
        reasons = [h[0] for h in watch.execute("SELECT reason FROM pgbroker.lease_history ORDER BY id")]
        assert reasons[-1] == "epoch 1 was released"
    finally:
        thread.join(5)
        b.close()


def test_wait_forever_is_not_cut_short_by_a_default_statement_timeout(db_url, db_name, connect):
    connect().execute(f"ALTER DATABASE {db_name} SET statement_timeout = '200ms'")
    a = Broker(db_url, "patient")
    a.claim()
    b = Broker(db_url, "patient", wait=None)
    got: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: got.update(epoch=b.claim()))
    thread.start()
    try:
        time.sleep(0.6)  # three statement_timeouts
        assert thread.is_alive() and not got
        a.close()
        thread.join(5)
        assert got == {"epoch": 2}
    finally:
        a.close()
        thread.join(5)
        b.close()


def test_takeover_terminates_the_holder_which_notices_at_once(db_url, connect, pg_server, db_name):
    lost = threading.Event()
    calls: list[LeaseLost] = []

    def on_lost(exc: LeaseLost) -> None:
        calls.append(exc)
        lost.set()

    a = Broker(db_url, "coup", on_lost=on_lost, heartbeat_interval=2.0)
    a.claim()
    # A role with only pgbroker_broker may not take over.
    with pytest.raises(PermissionDenied) as info:
        Broker(pg_server.url_for(db_name, user="t_broker"), "coup", takeover=True).claim()
    assert info.value.sqlstate == "42501"
    assert a.check() > 0
    # The superuser may.
    with Broker(db_url, "coup", takeover=True, application_name="usurper") as b:
        assert b.epoch == 2
        assert lost.wait(1.0), "the old holder did not notice within 1 s (its heartbeat interval is 2 s)"
        assert len(calls) == 1 and isinstance(calls[0], LeaseLost)
        assert a.lost and a.lost_reason is calls[0]
        with pytest.raises(LeaseLost):
            a.check()
        # Its own connection is dead, and fenced writes elsewhere are refused.
        with pytest.raises(LeaseLost):
            a.state_set("k", 1)
        other = connect("writer")
        with pytest.raises(LeaseLost), other.transaction():
            a.assert_epoch(other)
        with other.transaction():
            b.assert_epoch(other)
        with pytest.raises(psycopg.Error) as info, other.transaction():
            other.execute("SELECT pgbroker.broker_assert(%s, %s)", ("coup", a.epoch))
        assert isinstance(translate(info.value), StaleEpoch)
        events = [e[0] for e in other.execute("SELECT event FROM pgbroker.lease_history ORDER BY id")]
        assert events == ["claim", "takeover"]
    a.close()
    assert len(calls) == 1


# ---------------------------------------------------------------------------
# Loss detection


def test_terminated_backend_is_noticed_at_once(db_url, connect):
    watch = connect("watch")
    lost = threading.Event()
    calls: list[tuple[float, LeaseLost]] = []
    b = Broker(
        db_url, "victim", heartbeat_interval=2.0, on_lost=lambda e: (calls.append((time.monotonic(), e)), lost.set())
    )
    b.claim()
    try:
        started = time.monotonic()
        assert watch.execute("SELECT pg_terminate_backend(%s)", (b.pid,)).fetchone()[0] is True
        assert lost.wait(1.0)
        # Documented: as fast as the server's message reaches the socket, not a heartbeat interval later.
        assert calls[0][0] - started < 0.5
        exc = calls[0][1]
        assert exc.sqlstate == "57P01"  # admin_shutdown: terminating connection due to administrator command
        assert isinstance(exc.__cause__, psycopg.errors.AdminShutdown)
        with pytest.raises(LeaseLost) as info:
            b.check()
        assert info.value.__cause__ is exc
        time.sleep(0.2)
        assert len(calls) == 1  # called once
        # The lease is free: someone else claims the next epoch.
        with Broker(db_url, "victim") as c:
            assert c.epoch == 2
    finally:
        b.close()


def test_async_broker_notices_termination_and_awaits_on_lost(db_url, connect):
    watch = connect("watch")

    async def scenario() -> None:
        noticed = asyncio.Event()
        seen: list[LeaseLost] = []

        async def on_lost(exc: LeaseLost) -> None:
            seen.append(exc)
            noticed.set()

        async with AsyncBroker(db_url, "avictim", heartbeat_interval=2.0, on_lost=on_lost) as b:
            await asyncio.to_thread(watch.execute, "SELECT pg_terminate_backend(%s)", (b.pid,))
            await asyncio.wait_for(noticed.wait(), 1.0)
            assert b.lost and seen == [b.lost_reason]
            with pytest.raises(LeaseLost):
                b.check()
            with pytest.raises(LeaseLost):
                await b.state_set("k", 1)
        assert len(seen) == 1

    asyncio.run(scenario())


def test_check_raises_within_guard_when_heartbeats_hang(db_url, connect):
    """A heartbeat stuck behind a row lock: check() raises after guard, and recovers after."""
    blocker = connect("blocker", autocommit=False)
    calls: list[LeaseLost] = []
    with Broker(db_url, "wedged", heartbeat_interval=0.1, guard=0.5, on_lost=calls.append) as b:
        blocker.execute("SELECT * FROM pgbroker.lease WHERE name = 'wedged' FOR UPDATE")
        blocked_at = time.monotonic()

        def raises() -> bool:
            try:
                b.check()
            except LeaseLost:
                return True
            return False

        took = wait_until(raises, timeout=3.0)
        # The guard counts from the last good heartbeat, sent at most one interval before the block.
        assert took <= b.guard + 0.2, took
        assert time.monotonic() - blocked_at >= b.guard - b.heartbeat_interval - 0.05
        assert not b.lost and calls == []  # not a confirmed loss: the session still holds the lease
        blocker.rollback()
        wait_until(lambda: not raises(), timeout=2.0)
        assert b.check() > 0
    assert calls == []


HOLDER_SCRIPT = textwrap.dedent(
    """
    import sys, threading
    from pgbroker import Broker
    from pgbroker.errors import LeaseLost

    lock = threading.Lock()

    def say(*words):
        # on_lost runs in the heartbeat thread: keep whole lines apart.
        with lock:
            print(*words, flush=True)
            sys.stdout.flush()

    def on_lost(exc):
        say("ON_LOST", exc.sqlstate)

    with Broker(sys.argv[1], sys.argv[2], dead_man=1.0, heartbeat_interval=0.2, on_lost=on_lost) as b:
        say("CLAIMED", b.epoch, b.pid, b.guard)
        for line in sys.stdin:
            try:
                b.check()
                say("CHECK ok")
            except LeaseLost as exc:
                say("CHECK lost")
    """
)


@pytest.mark.slow
def test_paused_holder_stops_before_anyone_else_can_claim(db_url, connect):
    """SIGSTOP the holder: the dead-man switch frees the lease, and the holder's
    check() raises as soon as it runs again, because guard < dead_man."""
    watch = connect("watch")
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER_SCRIPT, db_url, "paused"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        first = proc.stdout.readline().split()
        assert first[0] == "CLAIMED", first
        epoch, pid, guard = int(first[1]), int(first[2]), float(first[3])
        assert guard < 1.0
        proc.stdin.write("check\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "CHECK ok"

        os.kill(proc.pid, signal.SIGSTOP)
        paused_at = time.monotonic()
        with Broker(db_url, "paused", wait=10) as b:
            waited = time.monotonic() - paused_at
            assert b.epoch == epoch + 1
        # The server ended the idle session after dead_man (1 s) of silence, never before guard.
        assert guard <= waited < 4.0, waited
        assert watch.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()[0] == 0

        os.kill(proc.pid, signal.SIGCONT)
        proc.stdin.write("check\n")
        proc.stdin.flush()
        lines = {proc.stdout.readline().strip() for _ in range(2)}
        assert "CHECK lost" in lines, lines
        assert any(line.startswith("ON_LOST") for line in lines), lines
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(5)
        proc.stdin.close()
        proc.stdout.close()


@pytest.mark.slow
def test_server_restart_is_noticed(db_url, pg_server):
    lost = threading.Event()
    b = Broker(db_url, "restart", heartbeat_interval=2.0, on_lost=lambda exc: lost.set())
    b.claim()
    try:
        started = time.monotonic()
        pg_server.restart()
        assert lost.wait(5.0)
        with pytest.raises(LeaseLost):
            b.check()
        assert b.lost_reason.sqlstate == "57P01" or b.lost_reason.sqlstate is None
        assert time.monotonic() - started < 10
        with Broker(db_url, "restart") as again:
            assert again.epoch == 2
    finally:
        b.close()


# ---------------------------------------------------------------------------
# Broker state


def test_state_is_visible_and_hidden_by_the_next_claim_then_swept(db_url, connect):
    watch = connect("watch")

    def state() -> list[tuple]:
        return watch.execute(
            "SELECT epoch, key, value FROM pgbroker.broker_state WHERE name = 'st' ORDER BY key"
        ).fetchall()

    with Broker(db_url, "st") as a:
        a.state_set("clients", {"count": 3, "ids": [1, 2, 3]})
        a.state_set("mode", "active")
        assert state() == [(1, "clients", {"count": 3, "ids": [1, 2, 3]}), (1, "mode", "active")]
        a.state_set("mode", "draining")
        assert state()[1] == (1, "mode", "draining")
        assert a.state_delete("mode") is True
        assert a.state_delete("mode") is False
        assert state() == [(1, "clients", {"count": 3, "ids": [1, 2, 3]})]
    # Released, not yet reclaimed: still readable.  A new claim hides it at once, and the
    # Broker's sweeper deletes it soon after.
    with Broker(db_url, "st") as b:
        assert b.epoch == 2
        assert state() == []
        deadline = time.monotonic() + 10
        while watch.execute("SELECT count(*) FROM pgbroker.state WHERE name = 'st'").fetchone()[0]:
            assert time.monotonic() < deadline, "the Broker did not sweep what epoch 1 left"
            time.sleep(0.02)

    async def async_state() -> None:
        async with AsyncBroker(db_url, "st") as c:
            await c.state_set("k", [1])
            assert await c.state_delete("nope") is False

    asyncio.run(async_state())
    assert state() == [(3, "k", [1])]


def test_many_threads_share_one_broker(db_url, connect):
    """Calls from many threads interleave with fast heartbeats without errors."""
    errors: list[BaseException] = []
    with Broker(db_url, "busy", heartbeat_interval=0.02, guard=0.5) as b:

        def work(n: int) -> None:
            try:
                for i in range(40):
                    b.check()
                    b.state_set(f"t{n}", i)
            except BaseException as exc:  # collected and asserted below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == []
        values = dict(connect().execute("SELECT key, value FROM pgbroker.broker_state WHERE name = 'busy'").fetchall())
        assert values == {f"t{n}": 39 for n in range(8)}
        assert not b.lost and b.check() > 0


# ---------------------------------------------------------------------------
# One implementation: the threaded Broker is generated from AsyncBroker


def test_sync_broker_is_generated_from_the_async_source():
    """pgbroker/_broker_sync.py is exactly what `python3 -m pgbroker._gen_sync` makes of _broker_async.py."""
    from pgbroker import _gen_sync

    wanted = _gen_sync.generate(_gen_sync.SOURCE.read_text())
    assert _gen_sync.TARGET.read_text() == wanted, "run: python3 -m pgbroker._gen_sync"
    # The transformation did its job: no asyncio left in the code, the same public methods on both classes.
    names = {tok.string for tok in tokenize.generate_tokens(io.StringIO(wanted).readline) if tok.type == tokenize.NAME}
    assert not names & {"async", "await", "asyncio", "AsyncBroker", "AsyncConnection"}
    public = {name for name in dir(AsyncBroker) if not name.startswith("_")}
    assert public == {name for name in dir(Broker) if not name.startswith("_")}
    for name in public:
        a, s = getattr(AsyncBroker, name), getattr(Broker, name)
        if callable(a):
            assert inspect.signature(a).parameters.keys() == inspect.signature(s).parameters.keys(), name
