"""The Python Broker's client registry, subscriptions and notification iterator (sync and asyncio)."""

from __future__ import annotations

import asyncio
import threading
import time

import psycopg
import pytest

from pgbroker import AsyncBroker, Broker, LeaseLost, NotWatched, UnknownClient
from tests.lease_util import Background, wait_until, waiting


def _seed(conn: psycopg.Connection, n: int = 10) -> None:
    conn.execute("INSERT INTO initech.objects (id, name) SELECT g, 'o' || g FROM generate_series(1, %s) g", (n,))


def test_register_subscribe_and_iterate(db_url, connect, watch_mode):
    writer = connect("writer")
    _seed(writer)
    with Broker(db_url, heartbeat_interval=0.2) as broker:
        assert broker.register("c1", {"addr": "10.0.0.1"}) is True
        assert broker.register("c1", {"addr": "10.0.0.2"}) is False  # re-register replaces info
        assert broker.register("c2") is True
        assert broker.subscribe("c1", "initech.objects", 3) is True
        assert broker.subscribe("c1", "initech.objects", 3) is False
        assert broker.subscribe("c2", "initech.objects") is True  # whole table
        with pytest.raises(UnknownClient):
            broker.subscribe("nobody", "initech.objects", 1)
        with pytest.raises(NotWatched):
            broker.subscribe("c1", "pgbroker.lease", "x")

        info = writer.execute("SELECT info FROM pgbroker.clients WHERE client_id = 'c1'").fetchone()[0]
        assert info == {"addr": "10.0.0.2"}

        writer.execute("UPDATE initech.objects SET name = 'changed' WHERE id IN (3, 4)")
        seen = []
        for batch in broker.notifications(poll_interval=0.2):
            seen.extend(batch)
            if len(seen) >= 2:
                break
        by_key = {n.key: n for n in seen}
        assert set(by_key) == {3, 4}
        assert by_key[3].op == "U" and by_key[3].changed == ["name"] and sorted(by_key[3].clients) == ["c1", "c2"]
        assert by_key[4].clients == ["c2"]
        assert by_key[3].table == "initech.objects"

        # Leaving the loop before asking for the next batch: not acknowledged, delivered again.
        again = broker.fetch()
        assert {n.id for n in again} == {n.id for n in seen}
        broker.ack([n.id for n in again])
        assert broker.fetch() == []

        assert broker.unsubscribe("c2", "initech.objects") is True
        assert broker.unregister("c1") is True
        assert broker.unregister("c1") is False
        assert writer.execute("SELECT count(*) FROM pgbroker.subscriptions").fetchone()[0] == 0


def test_failed_handler_gets_the_batch_again(db_url, connect):
    writer = connect("writer")
    _seed(writer)
    with Broker(db_url, heartbeat_interval=0.2) as broker:
        broker.register("c1")
        broker.subscribe("c1", "initech.objects", 1)
        writer.execute("UPDATE initech.objects SET name = 'x' WHERE id = 1")

        class Boom(Exception):
            pass

        with pytest.raises(Boom):
            for _batch in broker.notifications(poll_interval=0.2):
                raise Boom
        redelivered = next(iter(broker.notifications(poll_interval=0.2)))
        assert [(n.op, n.key) for n in redelivered] == [("U", 1)]


def test_iterator_wakes_on_notify_and_acknowledges(db_url, connect, watch_mode):
    """An idle broker is woken by the writer's NOTIFY well before the poll interval."""
    writer = connect("writer")
    _seed(writer)
    latencies = []
    with Broker(db_url, heartbeat_interval=0.2) as broker:
        broker.register("c1")
        broker.subscribe("c1", "initech.objects", 1)

        def write() -> None:
            for i in range(5):
                time.sleep(0.3)  # let the broker fall asleep
                sent.append(time.monotonic())
                writer.execute("UPDATE initech.objects SET name = %s WHERE id = 1", (f"v{i}",))

        sent: list[float] = []
        thread = threading.Thread(target=write)
        thread.start()
        received = 0
        for batch in broker.notifications(poll_interval=5.0):
            latencies.append(time.monotonic() - sent[received])
            received += len(batch)
            if received >= 5:
                break
        thread.join()
    # Poll interval is 5 s: only a NOTIFY can explain sub-second delivery.
    assert max(latencies) < 1.0, latencies
    assert writer.execute("SELECT count(*) FROM pgbroker.outbox").fetchone()[0] <= 1  # the last batch is not acked


def test_a_fetch_that_deadlocks_runs_again_and_acknowledges(db_url, connect, caplog):
    """A session holding outbox rows while it waits on one an ack holds: the server aborts one side (40P01).

    The broker's call is the one aborted (it waited first: its 1 s deadlock_timeout fires before the
    holder's 30 s), and being one statement in autocommit, nothing of it stays: it runs again, waits for
    the holder to commit, and acknowledges both rows.  Raised DatabaseError (40P01) before.
    """
    writer, holder, probe = connect("writer"), connect("holder"), connect("probe")
    _seed(writer, 2)
    with Broker(db_url) as broker:
        broker.register("c1")
        broker.subscribe("c1", "initech.objects")
        writer.execute("UPDATE initech.objects SET name = 'x'")
        first, second = sorted(n.id for n in broker.fetch())

        with holder.transaction():
            holder.execute("SET LOCAL deadlock_timeout = '30s'")
            holder.execute("SELECT 1 FROM pgbroker.outbox WHERE id = %s FOR UPDATE", (second,))
            acking = Background(lambda: broker.ack([first, second]))
            wait_until(lambda: waiting(probe, broker.pid), what="the ack to hold FIRST and wait for SECOND")
            holder.execute("SELECT 1 FROM pgbroker.outbox WHERE id = %s FOR UPDATE", (first,))  # the cycle
            wait_until(lambda: waiting(probe, broker.pid), what="the ack, aborted and run again, to wait")
        assert acking.result() == 2
    assert [r for r in caplog.records if "40P01" in r.getMessage()], "the conflict is logged"
    assert writer.execute("SELECT count(*) FROM pgbroker.outbox").fetchone()[0] == 0


def test_iterator_stops_when_the_lease_is_lost(db_url, connect):
    admin = connect("admin")
    with Broker(db_url, heartbeat_interval=0.2) as broker:
        broker.register("c1")
        admin.execute("SELECT pg_terminate_backend(%s)", (broker.pid,))
        with pytest.raises(LeaseLost):
            for _batch in broker.notifications(poll_interval=0.2):
                pass


def test_async_iterator(db_url, connect):
    writer = connect("writer")
    _seed(writer)

    async def main() -> list:
        async with AsyncBroker(db_url, heartbeat_interval=0.2) as broker:
            assert await broker.register("c1", {"v": 1})
            assert await broker.subscribe("c1", "initech.objects", [2])  # a one-element list is not a scalar
            raise AssertionError("a list key for a one-column primary key must be refused")

    from pgbroker import InvalidArgument

    with pytest.raises(InvalidArgument):
        asyncio.run(main())

    async def main2() -> list:
        async with AsyncBroker(db_url, heartbeat_interval=0.2) as broker:
            await broker.register("c1")
            await broker.subscribe("c1", "initech.objects", 2)
            writer.execute("DELETE FROM initech.objects WHERE id = 2")
            out = []
            async for batch in broker.notifications(poll_interval=0.2):
                out.extend(batch)
                break
            assert await broker.unregister("c1")
            return out

    got = asyncio.run(main2())
    assert [(n.op, n.key, n.clients) for n in got] == [("D", 2, ["c1"])]


def test_subscribe_by_filter_and_left(db_url, connect, watch_mode):
    """Broker.subscribe(filter=...), subscribe_filters, unsubscribe(filter=...) and Notification.left (issue 43)."""
    from pgbroker import InvalidArgument

    writer = connect("writer")
    writer.execute("INSERT INTO initech.objects (id, name, kind) VALUES (1, 'a', 'gear'), (2, 'b', 'bolt')")
    with Broker(db_url, heartbeat_interval=0.2) as broker:
        broker.register("gears")
        broker.register("many")
        assert broker.subscribe("gears", "initech.objects", filter={"kind": "gear"}) is True
        assert broker.subscribe("gears", "initech.objects", filter={"kind": {"in": ["gear"]}}) is False
        assert broker.subscribe_filters([("many", {"kind": {"in": ["bolt", "nut"]}})], "initech.objects") == 2
        with pytest.raises(InvalidArgument):
            broker.subscribe("gears", "initech.objects", filter={"nosuch": 1})
        with pytest.raises(InvalidArgument):
            broker.subscribe("gears", "initech.objects", filter={"kind": {"gte": "a"}})
        writer.execute("UPDATE initech.objects SET kind = 'bolt' WHERE id = 1")
        got = broker.fetch()
        assert [(n.op, n.key, sorted(n.clients), n.left) for n in got] == [("U", 1, ["gears", "many"], ["gears"])]
        broker.ack([n.id for n in got])
        assert broker.unsubscribe("many", "initech.objects", filter={"kind": {"in": ["bolt", "nut"]}}) is True
        writer.execute("UPDATE initech.objects SET name = 'c' WHERE id = 2")
        assert broker.fetch() == []

    async def main() -> list:
        async with AsyncBroker(db_url, heartbeat_interval=0.2) as broker:
            await broker.register("bolts")
            assert await broker.subscribe("bolts", "initech.objects", filter={"kind": "bolt"})
            writer.execute("UPDATE initech.objects SET kind = 'nut' WHERE id = 2")
            out = []
            async for batch in broker.notifications(poll_interval=0.2):
                out.extend(batch)
                break
            assert await broker.unsubscribe("bolts", "initech.objects", filter={"kind": "bolt"})
            return out

    got = asyncio.run(main())
    assert [(n.op, n.key, n.clients, n.left) for n in got] == [("U", 2, ["bolts"], ["bolts"])]


def test_read_filter_gives_a_filter_subscribers_snapshot(db_url, connect):
    """Broker.read_filter: the rows a filter matches now, cast as the filter's subscription casts, NULL included."""
    from pgbroker import InvalidArgument

    writer = connect("writer")
    writer.execute(
        "INSERT INTO initech.objects (id, name, kind) VALUES (1, 'a', 'gear'), (2, 'b', 'bolt'), (3, 'c', 'gear'),"
        " (4, 'd', 'nut')"
    )
    with Broker(db_url, heartbeat_interval=0.2) as broker:
        broker.register("c")
        flt = {"kind": {"in": ["gear", "nut"]}, "id": {"in": ["1", 4, None]}}
        assert broker.subscribe("c", "initech.objects", filter=flt)
        rows = broker.read_filter("initech.objects", flt)
        assert [(r["id"], r["kind"]) for r in rows] == [(1, "gear"), (4, "nut")]
        assert [r["id"] for r in broker.read_filter("initech.objects", {"kind": {"eq": "gear"}})] == [1, 3]
        with pytest.raises(InvalidArgument):
            broker.read_filter("initech.objects", {'kind"; DROP TABLE initech.objects; --': 1})
        with pytest.raises(InvalidArgument):
            broker.read_filter("initech.objects", {"kind": {"like": "a"}})
        # Ranges: bounds cast as values are; with equality on another column.
        assert [r["id"] for r in broker.read_filter("initech.objects", {"id": {"gte": "2", "lt": 4}})] == [2, 3]
        gears = {"kind": "gear", "id": {"gt": 1}}
        assert broker.subscribe("c", "initech.objects", filter=gears)
        assert [r["id"] for r in broker.read_filter("initech.objects", gears)] == [3]
        assert writer.execute("SELECT count(*) FROM initech.objects").fetchone()[0] == 4
