"""Fault: the broker is asleep and its LISTEN connection is stuck inside a long transaction.

PostgreSQL keeps every NOTIFY in one cluster-wide queue (8 GB at most) until
every listening backend has read it, and a backend inside a transaction
reads nothing: one stuck listener pins the queue.  The worst case for
pgbroker: the broker went to sleep (``broker_sleep``: every writer's commit
then NOTIFYs its channel), and its listener sits in an open transaction for
~12 s while writers commit watched changes.

Must hold: writers never fail and never stall (every writer commits in
every second of the run); ``pg_notification_queue_usage()`` stays low; once
the listener's transaction ends it gets its NOTIFYs, and the broker then
fetches every change that was committed (acknowledged writes: all there; no
duplicates).  Figures: the highest queue usage, writer commits per second
with a healthy broker (before; its draining shares the CPU with the writers) and
with the stuck listener (during; the broker parked).
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import psycopg
from fanout_util import ack, fetch, listen, sleep, wake
from fault_util import server_history
from history import OK, History, Recorder, check_lease_history, check_tokens, now_ns

NAME = "stuck"
TABLE = "public.events"
WRITERS = 2
BEFORE = 3.0
DURING = 12.0


def _writer(url: str, recorder: Recorder, number: int, stop: threading.Event, commits: list[int]) -> None:
    with psycopg.connect(url, autocommit=True, application_name=f"writer {number}") as conn:
        i = 0
        while not stop.is_set():
            i += 1
            key = number * 10_000_000 + i
            with recorder.call("write", str(key)) as call:
                conn.execute(f"INSERT INTO {TABLE} (id, writer) VALUES (%s, %s)", (key, number))
                call.ok()
            commits.append(now_ns())


def _drain_all(conn: psycopg.Connection) -> list[int]:
    keys: list[int] = []
    while rows := fetch(conn, NAME):
        keys += [r["key"] for r in rows]
        ack(conn, [r["id"] for r in rows], NAME)
    return keys


def test_stuck_listener_never_stalls_writers_and_the_broker_catches_up(
    pg_server, db_name, connect, tmp_path, watch_mode
):
    url = pg_server.url_for(db_name)
    obs = connect("observer")
    obs.execute(f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, writer integer NOT NULL)")
    obs.execute("SELECT pgbroker.watch(%s, mode => %s)", (TABLE, watch_mode))
    history = History(tmp_path / "history")
    rec = history.recorder("broker")
    broker, listener = connect("stuck broker"), connect("stuck listener")
    with rec.call("claim", NAME) as call:
        epoch = broker.execute("SELECT pgbroker.broker_claim(%s, owner => 'stuck')", (NAME,)).fetchone()[0]
        call.ok(token=epoch)
    broker.execute("SELECT pgbroker.client_register('c', '{}', %s)", (NAME,))
    broker.execute("SELECT pgbroker.subscribe('c', %s::regclass, NULL, name => %s)", (TABLE, NAME))
    listen(listener, NAME)

    delivered: list[int] = []
    healthy = threading.Event()
    healthy.set()
    draining = threading.Lock()  # one drain at a time: two would fetch the same rows
    stop_consumer, stop_writers = threading.Event(), threading.Event()

    def consumer() -> None:
        """The healthy broker: awake, draining every 20 ms; parks asleep when told."""
        wake(broker, NAME)
        while not stop_consumer.is_set():
            with draining:
                if healthy.is_set():
                    delivered.extend(_drain_all(broker))
            time.sleep(0.02)

    commits: list[int] = []
    consumer_thread = threading.Thread(target=consumer, daemon=True)
    consumer_thread.start()
    writers = [
        threading.Thread(target=_writer, args=(url, history.recorder(f"w{n}"), n, stop_writers, commits), daemon=True)
        for n in range(WRITERS)
    ]
    usage: list[float] = []
    try:
        for t in writers:
            t.start()
        time.sleep(BEFORE)
        # The broker goes to sleep (outbox drained) and its listener gets stuck in a transaction.
        with draining:
            healthy.clear()
        while sleep(broker, NAME, "0 ms") != "asleep":
            delivered.extend(_drain_all(broker))
        listener.execute("BEGIN")
        listener.execute("SELECT 1")
        stuck_at = now_ns()
        while now_ns() - stuck_at < DURING * 1e9:
            usage.append(obs.execute("SELECT pg_notification_queue_usage()").fetchone()[0])
            time.sleep(0.1)
        unstuck_at = now_ns()
        usage.append(obs.execute("SELECT pg_notification_queue_usage()").fetchone()[0])
    finally:
        stop_writers.set()
        for t in writers:
            t.join(10)
    listener.execute("COMMIT")
    notifies = list(listener.notifies(timeout=1.0))
    delivered.extend(_drain_all(broker))  # the broker wakes up and catches up
    stop_consumer.set()
    consumer_thread.join(5)
    after_usage = obs.execute("SELECT pg_notification_queue_usage()").fetchone()[0]

    started = min(commits)
    before = [t for t in commits if started <= t < stuck_at]
    during = [t for t in commits if stuck_at <= t < unstuck_at]
    tps_before = len(before) / ((stuck_at - started) / 1e9)
    tps_during = len(during) / ((unstuck_at - stuck_at) / 1e9)
    per_second = Counter(int((t - stuck_at) // 1e9) for t in during)
    rec.close()
    ops = history.load()
    writes = [o for o in ops if o.op == "write"]
    latencies = sorted((o.complete - o.invoke) / 1e6 for o in writes if o.complete is not None)
    dupes = sum(n - 1 for n in Counter(delivered).values() if n > 1)
    print(
        f"\nFIGURE NOTIFY queue pressure: max queue usage {max(usage):.2e} (of 1.0; {after_usage:.1e} after; full after"
        f" ~{DURING / max(usage) / 3600:.0f} h stuck at this rate), "
        f"writer tps before {tps_before:.0f}, during {tps_during:.0f} (ratio {tps_during / tps_before:.2f}), "
        f"commit latency max {latencies[-1]:.1f} ms (p99 {latencies[int(len(latencies) * 0.99)]:.1f} ms); "
        f"{len(writes)} writes, {len(during)} while stuck, {len(notifies)} NOTIFYs read by the listener after, "
        f"{len(delivered)} delivered, {dupes} duplicates"
    )
    assert all(o.result == OK for o in writes)  # no writer ever failed
    assert all(per_second[s] > 0 for s in range(int(DURING))), f"a writer stalled: commits per second {per_second}"
    assert max(usage) < 0.01
    assert len(notifies) >= 1  # the stuck listener is woken once its transaction ends
    committed = {int(o.key) for o in writes}
    assert sorted(delivered) == sorted(committed), "committed minus delivered / duplicates"
    violations = check_tokens(ops) + check_lease_history(server_history(obs, NAME), ops, name=NAME)
    assert not violations, "\n".join(map(str, violations))
