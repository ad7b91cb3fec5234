"""Fault: the server crashes (``pg_ctl restart -m immediate``) under load.

A server of the test's own (the shared session server is never crashed),
with ``synchronous_commit = on`` so that an acknowledged commit survives the
crash (``fsync = off`` is harmless here: only PostgreSQL dies, not the OS).
Writers update watched rows; a Python broker consumes the notifications of
a subscriber that keeps a copy of the table (re-read after subscribing, and
each notified row re-read).  Then the server is killed and restarted.

Must hold: the lease rows and the epochs survive (every claim the broker
was told is still in ``lease_history``); the broker notices, re-claims with
a greater epoch, re-registers and re-subscribes its subscriber, which
re-reads the table and then misses nothing: once the writers stop, its copy
equals the table, and every acknowledged write is in the table unless a
later write to the same row replaced it.  Figure: crash -> new holder ms.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
from fault_util import server_history
from history import OK, UNKNOWN, History, Recorder, check_lease_history, check_tokens, now_ns
from lease_util import wait_until

from pgbroker import Broker, install
from pgbroker._embedded import EmbeddedPostgres, find_pg_bin

NAME = "crash"
TABLE = "initech.objects"
WRITERS = 2
KEYS_PER_WRITER = 10


@pytest.fixture
def server() -> Iterator[EmbeddedPostgres]:
    with EmbeddedPostgres("-c synchronous_commit=on") as pg:
        yield pg


def _restart_immediate(server: EmbeddedPostgres) -> None:
    pg_ctl = server.datadir.parent / "pg_ctl" if os.geteuid() == 0 else find_pg_bin() / "pg_ctl"
    done = subprocess.run(
        [str(pg_ctl), "restart", "-w", "-m", "immediate", "-D", str(server.datadir), "-l", str(server.logfile)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr or done.stdout


def _writer(url: str, recorder: Recorder, number: int, stop: threading.Event) -> None:
    conn: psycopg.Connection | None = None
    i = 0
    while not stop.is_set():
        key = number * KEYS_PER_WRITER + i % KEYS_PER_WRITER + 1
        value = f"w{number}:{i}"
        try:
            if conn is None:
                conn = psycopg.connect(url, autocommit=True, connect_timeout=5)
            with recorder.call("write", str(key), value=value) as call:
                conn.execute(f"UPDATE {TABLE} SET name = %s WHERE id = %s", (value, key))
                call.ok()
            i += 1
        except psycopg.OperationalError:
            if conn is not None:
                conn.close()
            conn = None
            time.sleep(0.02)
    if conn is not None:
        conn.close()


class Subscriber:
    """The broker and its one subscriber "copy": a copy of the table kept by re-reading notified rows."""

    def __init__(self, url: str, recorder: Recorder, stop: threading.Event) -> None:
        self.url = url
        self.recorder = recorder
        self.stop = stop
        self.copy: dict[int, str] = {}
        self.claims: list[tuple[int, int]] = []  # (epoch, when claimed, ns)
        self.delivered = 0
        self.errors: list[str] = []

    def run(self) -> None:
        reader: psycopg.Connection | None = None
        while not self.stop.is_set():
            broker = Broker(self.url, NAME, wait=5, heartbeat_interval=0.2, connect_timeout=2)
            try:
                with self.recorder.call("claim", NAME) as call:
                    epoch = broker.claim()
                    call.ok(token=epoch)
                self.claims.append((epoch, now_ns()))
                if reader is None or reader.closed:
                    reader = psycopg.connect(self.url, autocommit=True, connect_timeout=2)
                # A new epoch starts with no clients: register, subscribe, then read.
                broker.register("copy")
                broker.subscribe("copy", TABLE)
                self.copy = dict(reader.execute(f"SELECT id, name FROM {TABLE}").fetchall())
                for batch in broker.notifications(poll_interval=0.2):
                    for note in batch:
                        row = reader.execute(f"SELECT name FROM {TABLE} WHERE id = %s", (note.key,)).fetchone()
                        self.copy[note.key] = row[0]
                        self.delivered += 1
                    if self.stop.is_set():
                        break
            except (psycopg.Error, Exception) as exc:  # the crash: LeaseLost, connection errors
                self.errors.append(f"{type(exc).__name__}: {exc}".splitlines()[0])
                if reader is not None:
                    reader.close()
                reader = None
                time.sleep(0.05)
            finally:
                broker.close()
        if reader is not None:
            reader.close()


def test_crash_restart_under_load(server, tmp_path, watch_mode):
    admin = server.url
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("CREATE DATABASE crash")
    url = server.url_for("crash")
    install.migrate(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pgbroker.watch(%s, mode => %s)", (TABLE, watch_mode))
        conn.execute(
            f"INSERT INTO {TABLE} (id, name) SELECT g, 'seed' FROM generate_series(1, %s) g",
            (WRITERS * KEYS_PER_WRITER,),
        )
    history = History(tmp_path / "history")
    stop_writers, stop_sub = threading.Event(), threading.Event()
    sub = Subscriber(url, history.recorder("broker"), stop_sub)
    threads = [threading.Thread(target=sub.run, daemon=True)]
    threads += [
        threading.Thread(target=_writer, args=(url, history.recorder(f"w{n}"), n, stop_writers), daemon=True)
        for n in range(WRITERS)
    ]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: sub.claims and sub.delivered > 50, timeout=20, what="the broker to deliver")
        with psycopg.connect(url, autocommit=True) as conn:
            before = server_history(conn, NAME)
        crashed_at = now_ns()
        _restart_immediate(server)
        up_at = now_ns()
        wait_until(lambda: len(sub.claims) >= 2, timeout=30, what="the broker to claim again")
        delivered_after = sub.delivered
        wait_until(lambda: sub.delivered > delivered_after + 50, timeout=20, what="deliveries after the restart")
    finally:
        stop_writers.set()
        for t in threads[1:]:
            t.join(20)
    with psycopg.connect(url, autocommit=True) as conn:
        table = dict(conn.execute(f"SELECT id, name FROM {TABLE}").fetchall())
        try:
            # The writers have stopped: the subscriber catches up with the table.
            wait_until(lambda: sub.copy == table, timeout=10, what="the subscriber's copy to equal the table")
        finally:
            stop_sub.set()
            threads[0].join(20)
        after = server_history(conn, NAME)
    assert "not properly shut down" in server.logfile.read_text()  # a real crash recovery ran

    (epoch1, _), (epoch2, claimed_again) = sub.claims[0], sub.claims[1]
    holder_ms = (claimed_again - crashed_at) / 1e6
    ready_ms = (claimed_again - up_at) / 1e6
    ops = history.load()
    writes = [o for o in ops if o.op == "write"]
    unknown = sum(1 for o in writes if o.result == UNKNOWN)
    print(
        f"\nFIGURE server crash-restart: crash -> new holder {holder_ms:.0f} ms (server accepting connections -> "
        f"new holder {ready_ms:.0f} ms); epochs {epoch1} -> {epoch2}; {len(writes)} writes ({unknown} unknown at the"
        f" crash), {sub.delivered} notifications; broker errors seen: {sorted(set(e[:60] for e in sub.errors))}"
    )
    assert epoch2 > epoch1 and len(sub.claims) == 2
    # Lease rows and epochs survive the crash: the history before it is a prefix of the one after.
    assert before and after[: len(before)] == before
    violations = check_tokens(ops) + check_lease_history(after, ops, name=NAME)
    assert not violations, "\n".join(map(str, violations))
    # Every acknowledged write survived, unless a later write to its row (acknowledged or not) replaced it.
    last: dict[str, list] = {}
    for o in sorted(writes, key=lambda o: o.invoke):
        if o.result == OK:
            last[o.key] = [o.args["value"]]
        elif o.result == UNKNOWN:
            last.setdefault(o.key, []).append(o.args["value"])
    for key, allowed in last.items():
        assert table[int(key)] in allowed, (key, table[int(key)], allowed)
