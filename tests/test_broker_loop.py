"""The broker a live-connection server needs (issue 29): registry calls that never stall delivery or heartbeats, a
delivery loop that heals its LISTEN connection, LeaseLost's two kinds, rows read by key, registrations a late
clean-up cannot undo, and the leadership loop (run_broker / async_run_broker), multi-host URL included."""

from __future__ import annotations

import asyncio
import socket
import statistics
import threading
import time

import psycopg
import pytest

from pgbroker import (
    AsyncBroker,
    Broker,
    DatabaseError,
    LeaseHeld,
    LeaseInDoubt,
    LeaseLost,
    PgBrokerError,
    TableBusy,
    async_run_broker,
    run_broker,
)


def _seed(conn: psycopg.Connection, n: int = 10) -> None:
    conn.execute("INSERT INTO initech.objects (id, name) SELECT g, 'o' || g FROM generate_series(1, %s) g", (n,))


def _listener_pids(conn: psycopg.Connection) -> list[int]:
    return [
        r[0]
        for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND query LIKE 'LISTEN %'"
        )
    ]


class Loop:
    """broker.notifications() in a thread: every notification with the time it was yielded, and what it raised."""

    def __init__(self, broker: Broker, **kwargs):
        self.seen: list[tuple[float, object]] = []
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(broker, kwargs), daemon=True)
        self.thread.start()

    def _run(self, broker: Broker, kwargs: dict) -> None:
        try:
            for batch in broker.notifications(**kwargs):
                now = time.monotonic()
                self.seen.extend((now, n) for n in batch)
                if self.stop.is_set():
                    return
        except BaseException as exc:  # noqa: BLE001 - recorded for the test to look at
            self.error = exc

    def wait_for_more(self, before: int, timeout: float) -> float | None:
        """When the loop yielded notification number ``before`` (counting from 0), waiting up to ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.seen) > before:
                return self.seen[before][0]
            if self.error is not None:
                raise AssertionError(f"the loop raised {self.error!r}") from self.error
            time.sleep(0.002)
        return None

    def close(self, broker_write) -> None:
        self.stop.set()
        broker_write()  # one more change, so the loop wakes and sees stop
        self.thread.join(5)


def test_killing_the_listen_session_loses_nothing_and_raises_nothing(db_url, connect):
    writer, admin = connect("writer"), connect("admin")
    _seed(writer)
    with Broker(db_url, heartbeat_interval=0.2) as broker:
        broker.register("c1")
        broker.subscribe("c1", "initech.objects", 1)
        loop = Loop(broker, poll_interval=5.0)
        try:
            for i in range(3):
                deadline = time.monotonic() + 5
                while not _listener_pids(admin) and time.monotonic() < deadline:
                    time.sleep(0.02)
                (pid,) = _listener_pids(admin)
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
                time.sleep(0.1)  # the loop is asleep on a dead connection
                before = len(loop.seen)
                written = time.monotonic()
                writer.execute("UPDATE initech.objects SET name = %s WHERE id = 1", (f"after kill {i}",))
                delivered = loop.wait_for_more(before, 2.0)
                assert delivered is not None, "not delivered within 2 s of the write"
                print(f"kill {i}: delivered {1000 * (delivered - written):.1f} ms after the write")
                assert loop.error is None and broker.held
        finally:
            loop.close(lambda: writer.execute("UPDATE initech.objects SET name = 'bye' WHERE id = 1"))
        assert loop.error is None


def test_an_open_transaction_stalls_only_the_new_subscriber(db_url, connect):
    """An application transaction left open on the watched table: the new client's subscribe waits (and gives up
    before the guard runs out), the existing client's changes keep flowing, and the lease is never reported lost."""
    writer, holder = connect("writer"), connect("app", autocommit=False)
    _seed(writer, 200)
    lost: list[LeaseLost] = []
    with Broker(db_url, on_lost=lost.append) as broker:  # default heartbeat 1 s, guard 3 s
        broker.register("old")
        broker.subscribe("old", "initech.objects", 1)
        loop = Loop(broker)
        latencies: list[float] = []
        try:
            for trial in range(3):
                holder.execute("UPDATE initech.objects SET name = 'held open' WHERE id = 100 + %s", (trial,))
                outcome: list[object] = []

                def subscribe_new(trial=trial, outcome=outcome) -> None:
                    started = time.monotonic()
                    broker.register(f"new-{trial}")
                    try:
                        outcome.append(broker.subscribe(f"new-{trial}", "initech.objects", 50, wait=5.0))
                    except PgBrokerError as exc:
                        outcome.append(exc)
                    outcome.append(time.monotonic() - started)

                subscriber = threading.Thread(target=subscribe_new)
                subscriber.start()
                time.sleep(0.1)
                for i in range(40):  # 2 s of changes to the old client's row while the subscribe waits
                    if not subscriber.is_alive():
                        break
                    before = len(loop.seen)
                    written = time.monotonic()
                    writer.execute("UPDATE initech.objects SET name = %s WHERE id = 1", (f"t{trial}-{i}",))
                    delivered = loop.wait_for_more(before, 2.0)
                    assert delivered is not None, "a change to an existing client's row was not delivered"
                    latencies.append(delivered - written)
                    time.sleep(max(0.0, 0.05 - (time.monotonic() - written)))
                subscriber.join(10)
                assert not subscriber.is_alive()
                result, took = outcome
                # It waited for the open transaction, and gave up before the guard ran out.
                assert isinstance(result, TableBusy), result
                assert took < broker.guard + 0.5, took
                holder.rollback()
                assert broker.subscribe(f"new-{trial}", "initech.objects", 50) is True
                assert broker.held and not lost
                broker.check()
        finally:
            loop.close(lambda: writer.execute("UPDATE initech.objects SET name = 'bye' WHERE id = 1"))
        assert loop.error is None and not lost
        latencies.sort()
        p50 = statistics.median(latencies)
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        print(f"{len(latencies)} deliveries while a subscribe waited: p50 {1000 * p50:.1f} ms, p99 {1000 * p99:.1f} ms")
        assert len(latencies) >= 60


def test_a_stalled_heartbeat_is_in_doubt_not_lost_and_the_loop_waits(db_url, connect):
    """A heartbeat blocked on the lease row (another transaction holds it FOR UPDATE): check() raises LeaseInDoubt
    (final False), the loop waits instead of raising, and both go on once the heartbeat gets through."""
    writer, blocker = connect("writer"), connect("blocker", autocommit=False)
    _seed(writer)
    with Broker(db_url, heartbeat_interval=0.2) as broker:
        broker.register("c1")
        broker.subscribe("c1", "initech.objects", 1)
        loop = Loop(broker, poll_interval=0.2)
        try:
            blocker.execute("SELECT 1 FROM pgbroker.lease WHERE name = 'default' FOR UPDATE")
            time.sleep(broker.guard + 0.3)
            with pytest.raises(LeaseInDoubt) as doubt:
                broker.check()
            assert doubt.value.final is False and isinstance(doubt.value, LeaseLost)
            with pytest.raises(LeaseInDoubt):
                broker.register("c2")  # a registry call in doubt does not act
            assert loop.error is None and broker.held
            blocker.rollback()
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                try:
                    broker.check()
                    break
                except LeaseInDoubt:
                    time.sleep(0.05)
            broker.check()
            before = len(loop.seen)
            writer.execute("UPDATE initech.objects SET name = 'after doubt' WHERE id = 1")
            assert loop.wait_for_more(before, 2.0) is not None
        finally:
            loop.close(lambda: writer.execute("UPDATE initech.objects SET name = 'bye' WHERE id = 1"))
        assert loop.error is None


def test_losing_the_lease_session_ends_the_loop_with_a_final_lease_lost(db_url, connect):
    admin = connect("admin")
    with Broker(db_url, heartbeat_interval=0.2) as broker:
        loop = Loop(broker, poll_interval=5.0)
        time.sleep(0.3)
        admin.execute("SELECT pg_terminate_backend(%s)", (broker.pid,))
        loop.thread.join(5)
        assert isinstance(loop.error, LeaseLost) and loop.error.final is True
        assert isinstance(loop.error.__cause__, LeaseLost | psycopg.Error)
        with pytest.raises(LeaseLost) as info:
            broker.register("c1")
        assert info.value.final is True


def test_a_lost_registry_connection_is_a_driver_error_and_the_next_call_reconnects(db_url, connect):
    admin = connect("admin")
    with Broker(db_url, heartbeat_interval=0.2, registry_connections=1) as broker:
        broker.register("c1")
        (pid,) = [
            r[0]
            for r in admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND query LIKE '%client_register%'"
            )
        ]
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        time.sleep(0.1)
        with pytest.raises(DatabaseError) as info:
            broker.register("c2")
        assert isinstance(info.value.__cause__, psycopg.OperationalError)
        assert broker.held
        assert broker.register("c2") is True  # a new registry connection
        broker.check()


def test_a_stale_epoch_on_the_registry_connection_is_a_final_loss(db_url, connect):
    """The registry connection is fenced by the epoch: once a newer epoch exists its calls fail, as LeaseLost."""
    admin = connect("admin")
    broker = Broker(db_url)
    broker.claim()
    try:
        broker.register("c1")
        broker._stop_heartbeats()  # so that the registry call, not the heartbeat, is the first to hear of it
        admin.execute("SELECT pg_terminate_backend(%s)", (broker.pid,))
        with Broker(db_url, wait=5) as successor:
            with pytest.raises(LeaseLost) as info:
                broker.register("c2")
            assert info.value.final is True and info.value.sqlstate == "PB002"
            assert broker.lost and not broker.held
            assert successor.epoch > broker.epoch
    finally:
        broker.close()


def test_rows_come_with_the_notifications_and_read_rows_reads_a_snapshot(db_url, connect):
    writer = connect("writer")
    _seed(writer, 5)
    writer.execute("CREATE TABLE public.pairs (region text, n integer, label text, PRIMARY KEY (region, n))")
    writer.execute("SELECT pgbroker.watch('public.pairs')")
    writer.execute("INSERT INTO public.pairs VALUES ('eu', 1, 'one'), ('us', 2, 'two')")
    with Broker(db_url, heartbeat_interval=0.2) as broker:
        broker.register("c1")
        broker.subscribe("c1", "initech.objects")
        broker.subscribe("c1", "public.pairs")
        assert broker.read_rows("public.pairs", [["eu", 1], ["us", 9], ["us", 2]]) == [
            {"region": "eu", "n": 1, "label": "one"},
            None,
            {"region": "us", "n": 2, "label": "two"},
        ]
        snapshot = broker.read_rows("initech.objects", [2, 3])
        assert [r["name"] for r in snapshot] == ["o2", "o3"]
        with writer.transaction():
            writer.execute("UPDATE initech.objects SET name = 'two' WHERE id = 2")
            writer.execute("DELETE FROM initech.objects WHERE id = 3")
            writer.execute("UPDATE public.pairs SET label = 'uno' WHERE region = 'eu'")
        seen = []
        for batch in broker.notifications(poll_interval=0.2, rows=True):
            seen.extend(batch)
            if len(seen) >= 3:
                break
        by = {(n.table, str(n.key)): n for n in seen}
        assert by[("initech.objects", "2")].row["name"] == "two"
        assert by[("initech.objects", "3")].op == "D" and by[("initech.objects", "3")].row is None
        assert by[("public.pairs", str(["eu", 1]))].row == {"region": "eu", "n": 1, "label": "uno"}
        # One statement per batch once the tables' keys are known.
        assert len(broker._table_keys) == 2


def test_a_broker_role_alone_reads_rows_and_makes_registry_calls(pg_server, db_name, connect):
    """Only pgbroker_broker (and SELECT on the table, which the initech migration grants it): the registry
    connections' epoch-fenced calls and the row reads need nothing more."""
    writer = connect("writer")
    _seed(writer, 3)
    with Broker(pg_server.url_for(db_name, user="t_broker"), heartbeat_interval=0.2) as broker:
        broker.attach("c1")
        broker.subscribe_many([("c1", 1), ("c1", 2)], "initech.objects")
        assert [r["name"] for r in broker.read_rows("initech.objects", [1, 2])] == ["o1", "o2"]
        writer.execute("UPDATE initech.objects SET name = 'one' WHERE id = 1")
        batch = next(iter(broker.notifications(poll_interval=0.2, rows=True)))
        assert [(n.key, n.row["name"], n.clients) for n in batch] == [(1, "one", ["c1"])]


def test_a_late_clean_up_cannot_undo_a_newer_registration(db_url, connect):
    reader = connect("reader")
    with Broker(db_url, heartbeat_interval=0.2) as broker:
        old = broker.attach("c1", {"socket": 1})
        broker.subscribe("c1", "initech.objects", 1)
        new = broker.attach("c1", {"socket": 2})  # the client reconnected before its old socket was cleaned up
        assert new.token != old.token
        assert broker.unregister("c1", token=old.token) is False  # the old socket's clean-up: nothing happens
        assert reader.execute("SELECT info FROM pgbroker.clients WHERE client_id = 'c1'").fetchone() == ({"socket": 2},)
        assert reader.execute("SELECT count(*) FROM pgbroker.subscriptions").fetchone() == (1,)
        assert broker.unregister("c1", token=new.token) is True
        assert reader.execute("SELECT count(*) FROM pgbroker.clients").fetchone() == (0,)


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_run_broker_reports_the_holder_takes_over_and_claims_again_after_a_loss(pg_server, db_name, connect):
    """Through a multi-host URL whose first host is down: waits (reporting the holder), takes over when the holder
    ends, re-registers and re-subscribes its clients, and after its session is terminated claims again."""
    writer, admin = connect("writer"), connect("admin")
    _seed(writer)
    direct = pg_server.url_for(db_name)
    info = psycopg.conninfo.conninfo_to_dict(direct)
    url = (
        f"postgresql://{info['user']}@127.0.0.1:{_dead_port()},{info['host']}:{info['port']}/{db_name}"
        "?target_session_attrs=read-write"
    )
    waiting: list[LeaseHeld] = []
    epochs: list[int] = []
    losses: list[LeaseLost] = []
    errors: list[BaseException] = []
    holder = Broker(direct, "orders")
    holder.claim()

    def on_start(broker: Broker) -> None:
        epochs.append(broker.epoch)
        if len(epochs) == 1:
            writer.execute("UPDATE initech.objects SET name = %s WHERE id = 1", (f"term {len(epochs)}",))
        for batch in broker.notifications(poll_interval=0.2):
            if any(n.key == 1 and n.clients == ["c1"] for n in batch) and len(epochs) == 2:
                return  # the second term got a change for its re-subscribed client: done
            if len(epochs) == 1 and batch:
                admin.execute("SELECT pg_terminate_backend(%s)", (broker.pid,))

    def run() -> None:
        try:
            run_broker(
                url,
                "orders",
                on_start=on_start,
                on_waiting=waiting.append,
                on_lost=losses.append,
                clients=lambda: {"c1": [("initech.objects", 1)]},
                report_interval=0.2,
                retry_delay=0.1,
                max_terms=2,
                heartbeat_interval=0.2,
            )
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 5
    while not waiting and time.monotonic() < deadline:
        time.sleep(0.02)
    assert waiting and waiting[0].pid == holder.pid and waiting[0].epoch == holder.epoch
    holder.close()
    deadline = time.monotonic() + 10
    while len(epochs) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(epochs) == 2, (epochs, losses, errors)
    writer.execute("UPDATE initech.objects SET name = 'term 2' WHERE id = 1")
    thread.join(10)
    assert not thread.is_alive() and not errors
    assert epochs[0] > holder.epoch and epochs[1] > epochs[0]
    assert len(losses) == 1 and losses[0].final


def test_async_run_broker_cancels_the_serving_task_when_the_lease_is_lost(db_url, connect):
    admin = connect("admin")

    async def main() -> tuple[list[int], list[LeaseLost]]:
        epochs: list[int] = []
        losses: list[LeaseLost] = []

        async def on_start(broker: AsyncBroker) -> None:
            epochs.append(broker.epoch)
            if len(epochs) == 1:
                await asyncio.to_thread(admin.execute, "SELECT pg_terminate_backend(%s)", (broker.pid,))
                await asyncio.sleep(30)  # serving something that is not the notifications: cancelled on the loss
            # the second term returns at once: run_broker releases and returns

        await asyncio.wait_for(
            async_run_broker(db_url, on_start=on_start, on_lost=losses.append, retry_delay=0.1, heartbeat_interval=0.2),
            10,
        )
        return epochs, losses

    epochs, losses = asyncio.run(main())
    assert len(epochs) == 2 and epochs[1] > epochs[0]
    assert len(losses) == 1 and losses[0].final
