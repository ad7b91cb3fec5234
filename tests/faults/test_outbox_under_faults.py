"""Fault: watched writes keep committing through the faults that keep the broker's epoch.

The Python broker reaches the server through a TCP proxy (its connection
and its LISTEN connection); writers commit watched inserts directly.  While
they run, the proxy freezes shorter than the broker's guard, the LISTEN
connection alone is reset (the iterator reconnects it and goes on, raising
nothing), and the consumer "crashes" in the middle of a batch (it handled
half of it and stops; what it did not acknowledge is delivered again).

Must hold: the epoch never changes (one claim in ``lease_history``, the
broker never lost nor past its guard), and within it, committed minus
delivered is empty once the writers stop: no change lost; duplicates (the
at-least-once redeliveries) are counted.  Figures: rows, lost, duplicates.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import psycopg
from fault_util import server_history
from history import OK, History, Recorder, check_lease_history, check_tokens
from lease_util import wait_until
from tcp_proxy import TcpProxy

from pgbroker import Broker, LeaseLost, PgBrokerError

NAME = "outbox"
TABLE = "public.out_events"
WRITERS = 2
FREEZE = 0.4
GUARD = 1.5


def _writer(url: str, recorder: Recorder, number: int, stop: threading.Event) -> None:
    with psycopg.connect(url, autocommit=True, application_name=f"writer {number}") as conn:
        i = 0
        while not stop.is_set():
            i += 1
            key = number * 10_000_000 + i
            with recorder.call("write", str(key)) as call:
                conn.execute(f"INSERT INTO {TABLE} (id) VALUES (%s)", (key,))
                call.ok()
            # Bursts of 150 ms, pauses of 100 ms: the broker goes to sleep, and LISTENs, between them.
            time.sleep(0.1 if time.monotonic() % 0.25 > 0.15 else 0.001)


def test_outbox_loses_nothing_through_faults_that_keep_the_epoch(pg_server, db_name, connect, tmp_path, watch_mode):
    url = pg_server.url_for(db_name)
    obs = connect("observer")
    obs.execute(f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY)")
    obs.execute("SELECT pgbroker.watch(%s, mode => %s)", (TABLE, watch_mode))
    history = History(tmp_path / "history")
    rec = history.recorder("broker")
    delivered: list[int] = []
    faults: Counter = Counter()
    crash_mid_batch = threading.Event()
    stop_consumer, stop_writers = threading.Event(), threading.Event()
    lost: list[LeaseLost] = []
    guard_misses: list[float] = []
    raised: list[BaseException] = []

    with TcpProxy(pg_server.host, pg_server.port) as proxy:
        broker = Broker(proxy.url(db_name), NAME, heartbeat_interval=0.2, guard=GUARD, on_lost=lost.append)
        with rec.call("claim", NAME) as call:
            epoch = broker.claim()
            call.ok(token=epoch)
        broker_links = proxy.open_links()  # the broker's own connection; any later one is a LISTEN connection
        broker.register("c")
        broker.subscribe("c", TABLE)

        def consumer() -> None:
            while not stop_consumer.is_set():
                try:
                    for batch in broker.notifications(poll_interval=0.2):
                        if crash_mid_batch.is_set() and len(batch) > 1:
                            crash_mid_batch.clear()
                            delivered.extend(n.key for n in batch[: len(batch) // 2])
                            faults["consumer crashed mid-batch"] += 1
                            break  # half handled, none acknowledged
                        delivered.extend(n.key for n in batch)
                        if stop_consumer.is_set():
                            break
                except (psycopg.Error, PgBrokerError) as exc:  # the iterator heals a lost LISTEN connection itself
                    raised.append(exc)

        def guard_watch() -> None:
            while not stop_consumer.is_set():
                try:
                    broker.check()
                except LeaseLost as exc:
                    guard_misses.append(time.monotonic())
                    if broker.lost:
                        raise AssertionError("the broker lost its lease") from exc
                time.sleep(0.01)

        threads = [threading.Thread(target=consumer, daemon=True), threading.Thread(target=guard_watch, daemon=True)]
        writers = [
            threading.Thread(target=_writer, args=(url, history.recorder(f"w{n}"), n, stop_writers), daemon=True)
            for n in range(WRITERS)
        ]
        try:
            for t in threads + writers:
                t.start()
            for round_ in range(3):
                time.sleep(0.7)
                proxy.freeze()
                time.sleep(FREEZE)
                proxy.thaw()
                faults[f"proxy frozen {FREEZE * 1000:.0f} ms"] += 1
                time.sleep(0.7)
                listeners = [n for n in proxy.open_links() if n not in broker_links]
                faults["LISTEN connection reset"] += proxy.reset(listeners) > 0
                time.sleep(0.7)
                if round_ < 2:
                    crash_mid_batch.set()
            time.sleep(0.5)
        finally:
            stop_writers.set()
            for t in writers:
                t.join(10)
        rec_ops = history.load()
        committed = {int(o.key) for o in rec_ops if o.op == "write" and o.result == OK}
        try:
            wait_until(lambda: committed <= set(delivered), timeout=10, what="the broker to deliver every write")
        finally:
            stop_consumer.set()
            obs.execute(f"INSERT INTO {TABLE} (id) VALUES (0)")  # a last batch: the iterator sees the stop
            for t in threads:
                t.join(10)
            still_held = broker.held and not broker.lost
            final_epoch = broker.epoch
            broker.close()

    rec.close()
    ops = history.load()
    writes = [o for o in ops if o.op == "write"]
    counts = Counter(k for k in delivered if k != 0)
    missing = committed - set(counts)
    dupes = sum(n - 1 for n in counts.values() if n > 1)
    print(
        f"\nFIGURE outbox under faults: {len(committed)} rows committed, {len(counts)} delivered, lost {len(missing)},"
        f" duplicates {dupes}, phantom {len(set(counts) - committed)}; faults {dict(faults)}; guard misses"
        f" {len(guard_misses)}; epoch {epoch} -> {final_epoch}"
    )
    assert faults["LISTEN connection reset"] >= 1 and faults["consumer crashed mid-batch"] >= 1
    assert not raised, raised
    assert all(o.result == OK for o in writes)
    assert not missing and set(counts) <= committed
    # The epoch was kept: one claim, never lost, never past the guard.
    assert still_held and final_epoch == epoch and not lost and not guard_misses
    rows = server_history(obs, NAME)
    assert [(r["event"], r["epoch"]) for r in rows] == [("claim", epoch), ("release", epoch)]
    violations = check_tokens(ops) + check_lease_history(rows, ops, name=NAME)
    assert not violations, "\n".join(map(str, violations))
