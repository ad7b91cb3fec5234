"""The gates of the watch and drain locks (sql/300_watched_tables.sql): every writer of a watched table takes its
own gate of each, one of 16 by its pid, so that no two writers meet on a lock tag unless their pids do modulo 16;
subscribe() and broker_sleep() take every gate, and the key itself, which the triggers rendered before gates took."""

from __future__ import annotations

import psycopg
import pytest
from fanout_util import claim, fetch, register, seed_objects, sleep, subscribe, wake

GATES = 16


def writers_in_distinct_gates(connect, count: int) -> list[psycopg.Connection]:
    """COUNT connections (not autocommit) whose backends' pids differ modulo 16: each writer's gate is its own."""
    chosen: dict[int, psycopg.Connection] = {}
    for _ in range(200):
        conn = connect("writer", autocommit=False)
        gate = conn.info.backend_pid % GATES
        if gate not in chosen:
            chosen[gate] = conn
            if len(chosen) == count:
                return list(chosen.values())
        else:
            conn.close()
    raise AssertionError(f"no {count} backends with distinct pids modulo {GATES}")


def held_advisory(conn: psycopg.Connection, pid: int) -> set[tuple[int, int, str]]:
    return set(
        conn.execute(
            "SELECT classid::bigint, objid::bigint, mode FROM pg_locks"
            " WHERE locktype = 'advisory' AND pid = %s AND granted AND objsubid = 2",
            (pid,),
        ).fetchall()
    )


def test_two_writers_of_a_subscribed_table_hold_no_lock_tag_in_common(connect, watch_mode):
    broker, admin = connect("broker"), connect("admin")
    claim(broker)
    seed_objects(admin, [1, 2])
    register(broker, "c")
    subscribe(broker, "c", key=1)
    subscribe(broker, "c", key=2)
    wake(broker)
    first, second = writers_in_distinct_gates(connect, 2)
    first.execute("UPDATE initech.objects SET name = 'a' WHERE id = 1")
    second.execute("UPDATE initech.objects SET name = 'b' WHERE id = 2")
    watch_class, drain_class, watch_id, lock_key = admin.execute(
        "SELECT pgbroker._lock_class_watch(), pgbroker._lock_class_drain(), w.watch_id, l.lock_key"
        "  FROM pgbroker.watched w, pgbroker.lease l"
        " WHERE w.relid = 'initech.objects'::regclass AND l.name = 'default'"
    ).fetchone()
    held = {}
    for writer in (first, second):
        pid = writer.info.backend_pid
        # Its gate of the watch lock and of the broker's drain lock, shared, to commit; nothing else.
        assert held_advisory(admin, pid) == {
            (watch_class, watch_id * GATES + pid % GATES, "ShareLock"),
            (drain_class, lock_key * GATES + pid % GATES, "ShareLock"),
        }
        held[pid] = held_advisory(admin, pid)
    assert not set.intersection(*held.values())
    first.commit()
    second.commit()
    assert sorted(r["key"] for r in fetch(broker)) == [1, 2]


def test_subscribe_waits_for_a_writer_in_any_gate_and_writers_meanwhile_leave_clients_to_the_fetch(connect, watch_mode):
    broker, admin = connect("broker"), connect("admin")
    epoch = claim(broker)
    seed_objects(admin, range(1, 5))
    register(broker, "c")
    register(broker, "d")
    subscribe(broker, "c", key=1)
    wake(broker)
    writers = writers_in_distinct_gates(connect, 3)
    for n, writer in enumerate(writers):  # each holds its own gate of the watch lock
        writer.execute("UPDATE initech.objects SET name = %s WHERE id = 1", (f"open {n}",))
        with pytest.raises(psycopg.Error) as busy:
            broker.execute("SELECT pgbroker.subscribe('d', 'initech.objects', '2', wait => '100 ms')")
        assert busy.value.sqlstate == "PB022"
        writer.commit()
    # A subscribe under way holds every gate: a writer in any gate leaves its change's clients to the fetch.
    subscriber = connect("subscriber", autocommit=False)
    subscriber.execute("SELECT pgbroker.subscribe('d', 'initech.objects', '2', epoch => %s)", (epoch,))
    for n, writer in enumerate(writers):
        writer.execute("UPDATE initech.objects SET name = %s WHERE id = 2", (f"during {n}",))
        writer.commit()
    unresolved = admin.execute("SELECT count(*) FROM pgbroker.outbox WHERE row_key = '2' AND clients IS NULL")
    assert unresolved.fetchone()[0] == len(writers)
    subscriber.commit()
    rows = [r for r in fetch(broker) if r["key"] == 2]
    assert [r["clients"] for r in rows] == [["d"]] * len(writers)


def test_sleep_waits_for_a_writer_in_any_gate(connect, watch_mode):
    broker, admin = connect("broker"), connect("admin")
    claim(broker)
    seed_objects(admin, [1])
    register(broker, "c")
    subscribe(broker, "c", key=1)
    wake(broker)
    for n, writer in enumerate(writers_in_distinct_gates(connect, 3)):
        writer.execute("UPDATE initech.objects SET name = %s WHERE id = 1", (f"open {n}",))  # saw the broker awake
        assert sleep(broker, wait="50 ms") == "busy"
        writer.commit()
        assert sleep(broker) == "pending"  # no NOTIFY came: it looks again and finds the row
        assert [r["key"] for r in fetch(broker)] == [1]
        broker.execute("SELECT pgbroker.outbox_ack('default', ARRAY(SELECT id FROM pgbroker.outbox))")
        wake(broker)


def test_subscribe_and_sleep_wait_for_a_writer_of_the_triggers_before_gates(connect):
    """A writer that ran the triggers rendered before gates holds the watch and drain keys themselves (a
    transaction open across the upgrade to revision 0004): subscribe() and broker_sleep() wait for it too."""
    broker = connect("broker")
    claim(broker)
    register(broker, "c")
    wake(broker)
    old = connect("writer of 0.1.0's triggers", autocommit=False)
    old.execute(
        "SELECT pg_advisory_xact_lock_shared(pgbroker._lock_class_watch(), w.watch_id),"
        "       pg_advisory_xact_lock_shared(pgbroker._lock_class_drain(), l.lock_key)"
        "  FROM pgbroker.watched w, pgbroker.lease l"
        " WHERE w.relid = 'initech.objects'::regclass AND l.name = 'default'"
    )
    with pytest.raises(psycopg.Error) as busy:
        broker.execute("SELECT pgbroker.subscribe('c', 'initech.objects', '1', wait => '100 ms')")
    assert busy.value.sqlstate == "PB022"
    assert sleep(broker, wait="50 ms") == "busy"
    old.commit()
    assert subscribe(broker, "c", key=1) is True
    assert sleep(broker) == "asleep"


def test_gate_keys_stay_within_int4(connect):
    admin = connect("admin")
    keys = admin.execute(
        "SELECT min(pgbroker._lock_gate_key(k, g)), max(pgbroker._lock_gate_key(k, g)), count(DISTINCT (k, g)),"
        "       count(DISTINCT pgbroker._lock_gate_key(k, g))"
        "  FROM unnest(ARRAY[1, 2, 134217727, 134217728, 2147483647]) k, generate_series(0, 15) g"
    ).fetchone()
    assert keys[0] >= 0 and keys[1] <= 2147483647
    assert keys[2] == 80 and keys[3] == 64  # keys 2^27 apart share their gates: 2^27 - 1 and 2^31 - 1 here
    assert admin.execute("SELECT pgbroker._lock_gate(7) = 7 * 16 + pg_backend_pid() % 16").fetchone()[0] is True
