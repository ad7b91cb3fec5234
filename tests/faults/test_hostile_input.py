"""Hostile input: forged NOTIFYs, large values in watched rows, functions named
like pgbroker's internals.  None of it may change what pgbroker does."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from fanout_util import OBJECTS, channel, drain, register, seed_objects, subscribe
from psycopg import sql

from pgbroker import Broker


def test_a_forged_notify_causes_only_a_harmless_reread(db_url, connect):
    """Anyone may NOTIFY on the broker's channel: the broker then reads the outbox, finds nothing, and goes on."""
    with Broker(db_url, heartbeat_interval=0.2) as broker:
        forger, writer = connect("forger"), connect("writer")
        seed_objects(writer, [1])
        broker.register("c1")
        broker.subscribe("c1", OBJECTS, 1)
        ch = channel(forger)
        got: list = []

        def consume() -> None:
            for batch in broker.notifications(poll_interval=5.0, linger=0.0):
                got.extend(batch)
                if any(n.op == "U" for n in batch):
                    return

        t = threading.Thread(target=consume)
        t.start()
        time.sleep(0.3)  # the broker sleeps on LISTEN
        for payload in ("", "default", "x" * 7000, "'; DROP TABLE pgbroker.lease; --"):
            forger.execute(sql.SQL("SELECT pg_notify({}, {})").format(sql.Literal(ch), sql.Literal(payload)))
        time.sleep(0.3)
        assert got == [], "a forged NOTIFY delivered something"
        writer.execute("UPDATE initech.objects SET name = 'real' WHERE id = 1")
        t.join(10)
        assert [(n.op, n.key, n.clients) for n in got] == [("U", 1, ["c1"])]
        assert broker.check() > 0  # still the holder
    # The forged notifications changed nothing about the lease: one claim, one release.
    events = forger.execute("SELECT event FROM pgbroker.lease_history ORDER BY id").fetchall()
    assert events == [("claim",), ("release",)]


@pytest.mark.parametrize("size", [100_000, 5_000_000])
def test_large_values_in_a_watched_row_never_fail_the_write(connect, size, watch_mode):
    """The outbox carries the key and the names of changed columns, never values."""
    broker, writer = connect("broker"), connect("writer")
    broker.execute("SELECT pgbroker.broker_claim()")
    seed_objects(writer, [1])
    register(broker, "c1")
    subscribe(broker, "c1", key=1)
    big = "x" * size
    update = "UPDATE initech.objects SET name = %s, config = jsonb_build_object('blob', %s::text) WHERE id = 1"
    writer.execute(update, (big, big))
    writer.execute("INSERT INTO initech.objects (id, name) VALUES (2, %s)", (big,))
    # The pending outbox row is small whatever the row holds.
    widest = broker.execute("SELECT max(pg_column_size(o.*)) FROM pgbroker.outbox o").fetchone()[0]
    assert widest is not None and widest < 500, widest
    rows = drain(broker)
    assert [(r["op"], r["key"], sorted(r["changed"] or [])) for r in rows] == [("U", 1, ["config", "name"])]


def test_a_temporary_function_named_like_an_internal_cannot_capture_a_call(connect):
    """pg_temp comes first in a hostile search_path; every pgbroker call is qualified or pinned."""
    conn = connect("hostile")
    conn.execute("CREATE FUNCTION pg_temp._check_name(text) RETURNS text LANGUAGE sql AS 'SELECT ''hijacked'''")
    conn.execute("CREATE FUNCTION pg_temp._lock_class() RETURNS integer LANGUAGE sql AS 'SELECT 1'")
    conn.execute("CREATE FUNCTION pg_temp.pg_advisory_lock(integer, integer) RETURNS void LANGUAGE sql AS ''")
    conn.execute("SET search_path = pg_temp, pgbroker, public, pg_catalog")
    epoch = conn.execute("SELECT broker_claim('hostile')").fetchone()[0]
    assert conn.execute("SELECT lock_acquire('hostile-lock')").fetchone()[0] is True
    obs = connect("obs")
    row = obs.execute("SELECT name, epoch, alive FROM pgbroker.brokers WHERE name = 'hostile'").fetchone()
    assert row == ("hostile", epoch, True)
    assert obs.execute("SELECT count(*) FROM pgbroker.locks WHERE name = 'hostile-lock'").fetchone()[0] == 1
    with pytest.raises(psycopg.Error) as bad:
        conn.execute("SELECT broker_claim('')")  # the real check ran
    assert bad.value.sqlstate == "22023"
