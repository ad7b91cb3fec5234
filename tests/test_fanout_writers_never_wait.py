"""Writers of a watched table never wait for pgbroker's bookkeeping, and write nothing for a broker that is gone.

- subscribe() waits for writer transactions already past their trigger, but
  writers that come while it waits go on (their changes are written for every
  live broker, the clients resolved when fetched, once it holds their gate of
  the watch lock; before, it waits for them too): no gap, no stall;
- watch() and unwatch() take the table's lock in short tries, so a writer
  transaction left open makes them retry and give up (PB022), never queue the
  table's other writers behind them;
- while no session holds a broker's lease its interest costs writers nothing:
  no outbox rows, nothing for the next claim to delete.

Each writer that must not wait runs with a statement_timeout: a writer that
queued would fail with 57014, so no timing is asserted.
"""

from __future__ import annotations

import threading

import psycopg
import pytest

from tests.fanout_util import OBJECTS, claim, connect_in_gate, count, drain, register, seed_objects, subscribe
from tests.lease_util import wait_until


def _waiting(admin: psycopg.Connection, pid: int) -> bool:
    return bool(admin.execute("SELECT cardinality(pg_blocking_pids(%s)) > 0", (pid,)).fetchone()[0])


def test_writers_go_on_while_a_subscribe_waits_and_none_is_missed(connect, watch_mode):
    admin, broker = connect("admin"), connect("broker")
    # In the last gate: subscribe, which takes the gates in order, holds every other one while it waits for it.
    slow = connect_in_gate(connect, 15, "slow batch", autocommit=False)
    claim(broker)
    seed_objects(admin, range(1, 11))
    register(broker, "c")
    slow.execute("UPDATE initech.objects SET name = 'batch' WHERE id = 10")  # past its trigger, left open
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(subscribe(broker, "c", key=5)))
    t.start()
    wait_until(lambda: _waiting(admin, broker.info.backend_pid), what="subscribe waiting for the open writer")
    # Other writers of the table, while subscribe waits: none queues behind it.
    writer = connect("writer")
    writer.execute("SET statement_timeout = '2s'")
    writer.execute("UPDATE initech.objects SET name = 'during' WHERE id = 5")  # the row being subscribed
    writer.execute("UPDATE initech.objects SET name = 'other' WHERE id = 6")  # nobody's
    writer.execute("INSERT INTO initech.objects (id, name) VALUES (11, 'new')")
    assert result == [] and t.is_alive()
    slow.commit()
    t.join(10)
    assert result == [True]
    writer.execute("UPDATE initech.objects SET name = 'after' WHERE id = 5")
    got = [(r["op"], r["key"], r["clients"]) for r in drain(broker)]
    # The slow writer's change came before anyone subscribed: nothing.  The
    # change made while subscribe waited reaches the new subscriber (it
    # committed before subscribe returned, so once more than needed); the
    # others resolve to nobody and are dropped; the change after it is exact.
    assert got == [("U", 5, ["c"]), ("U", 5, ["c"])]
    assert count(admin, "SELECT count(*) FROM pgbroker.outbox") == 0


def test_watch_on_a_busy_table_retries_and_gives_up_without_stalling_its_writers(connect):
    admin = connect("admin")
    admin.execute("CREATE TABLE public.busy (id integer PRIMARY KEY, v integer)")
    admin.execute("INSERT INTO public.busy SELECT g, 0 FROM generate_series(1, 10) g")
    slow = connect("slow batch", autocommit=False)
    slow.execute("UPDATE public.busy SET v = 1 WHERE id = 1")
    failure: list[psycopg.Error] = []

    def watch() -> None:
        try:
            connect("admin 2").execute("SELECT pgbroker.watch('public.busy', wait => '1.5 s')")
        except psycopg.Error as exc:
            failure.append(exc)

    t = threading.Thread(target=watch)
    t.start()
    writer = connect("writer")
    writer.execute("SET statement_timeout = '2s'")
    done = 0
    while t.is_alive():  # every write while watch() retries goes through
        writer.execute("UPDATE public.busy SET v = v + 1 WHERE id = 2")
        done += 1
    t.join()
    assert done > 10
    assert [e.sqlstate for e in failure] == ["PB022"]
    assert "public.busy is busy" in failure[0].diag.message_primary
    # Nothing changed: not watched, no trigger.
    assert count(admin, "SELECT count(*) FROM pgbroker.watched WHERE relid = 'public.busy'::regclass") == 0
    assert count(admin, "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'public.busy'::regclass") == 0
    slow.commit()
    assert admin.execute("SELECT pgbroker.watch('public.busy', wait => '1 s')").fetchone()[0] > 0
    # unwatch() takes the lock the same way.
    slow.execute("UPDATE public.busy SET v = 1 WHERE id = 1")
    with pytest.raises(psycopg.Error) as busy:
        admin.execute("SELECT pgbroker.unwatch('public.busy', wait => '200 ms')")
    assert busy.value.sqlstate == "PB022"
    slow.commit()
    assert admin.execute("SELECT pgbroker.unwatch('public.busy')").fetchone()[0] is True


def test_a_watch_with_a_negative_wait_is_refused(connect):
    admin = connect("admin")
    admin.execute("CREATE TABLE public.neg (id integer PRIMARY KEY)")
    with pytest.raises(psycopg.Error) as bad:
        admin.execute("SELECT pgbroker.watch('public.neg', wait => '-1 s')")
    assert bad.value.sqlstate == "22023"
    assert count(admin, "SELECT count(*) FROM pgbroker.watched WHERE relid = 'public.neg'::regclass") == 0


def test_nothing_is_written_for_a_broker_whose_session_is_gone(connect, watch_mode):
    admin, writer = connect("admin"), connect("writer")
    seed_objects(admin, range(1, 201))
    broker = connect("broker")
    claim(broker)
    register(broker, "c")
    for key in range(1, 201):
        subscribe(broker, "c", key=key)
    writer.execute("UPDATE initech.objects SET name = 'held' WHERE id <= 3")
    assert count(admin, "SELECT count(*) FROM pgbroker.outbox") == 3
    broker.close()
    wait_until(lambda: count(admin, "SELECT count(*) FROM pgbroker.brokers WHERE alive") == 0, what="the holder gone")
    before = count(admin, "SELECT count(*) FROM pgbroker.outbox")
    for _ in range(5):
        writer.execute("UPDATE initech.objects SET name = name || '.'")  # 200 rows, all subscribed
        writer.execute("UPDATE initech.objects SET name = 'one' WHERE id = 7")
    writer.execute("DELETE FROM initech.objects WHERE id > 150")
    writer.execute(f"TRUNCATE {OBJECTS}")
    assert count(admin, "SELECT count(*) FROM pgbroker.outbox") == before
    # The next holder starts a new epoch with nothing of the old one to deliver.
    successor = connect("successor")
    claim(successor)
    assert drain(successor) == []


def test_nothing_is_written_for_a_ttl_lease(connect, watch_mode):
    # A TTL lease has no session that could fetch: its interest costs writers nothing either.
    admin, worker, writer = connect("admin"), connect("worker"), connect("writer")
    seed_objects(admin, [1])
    epoch = worker.execute("SELECT pgbroker.broker_claim('ttl', owner => 'w', ttl => '30 s')").fetchone()[0]
    assert worker.execute("SELECT pgbroker.client_register('c', '{}', 'ttl', %s)", (epoch,)).fetchone()[0] is True
    assert (
        worker.execute("SELECT pgbroker.subscribe('c', 'initech.objects', '1', 'ttl', %s)", (epoch,)).fetchone()[0]
        is True
    )
    assert count(admin, "SELECT count(*) FROM pgbroker.interest WHERE name = 'ttl'") == 1
    writer.execute("UPDATE initech.objects SET name = 'x' WHERE id = 1")
    assert count(admin, "SELECT count(*) FROM pgbroker.outbox") == 0
