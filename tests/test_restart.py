"""Restart at size: a takeover hides what the old epoch left at once (never delivered, counted or waited for
while broker_sweep() deletes it), and clients come back many per call (client_register_many, subscribe_many),
with the validation, errors and gap-free guarantee of the one-row calls."""

from __future__ import annotations

import asyncio
import threading
import time

import psycopg
import pytest
from fanout_util import (
    claim,
    connect_in_gate,
    count,
    drain,
    fetch,
    pgbroker_state_counts,
    register,
    seed_objects,
    subscribe,
    summary,
    wait_until,
)
from psycopg.types.json import Jsonb
from test_fanout_bad_input import SUBSCRIBE_CASES, error_of
from test_fanout_bad_input import broker as broker  # noqa: F401  (the fixture)

from pgbroker import AsyncBroker, Broker, InvalidArgument, TableBusy, UnknownClient

REGISTER_MANY = "SELECT pgbroker.client_register_many(%s::text[], %s::jsonb[], name => %s, epoch => %s)"
SUBSCRIBE_MANY = "SELECT pgbroker.subscribe_many(%s::text[], %s::regclass, %s::jsonb[], name => %s, epoch => %s)"


def register_many(conn, ids, infos=None, name="default", epoch=None):
    infos = None if infos is None else [None if i is None else Jsonb(i) for i in infos]
    return conn.execute(REGISTER_MANY, (ids, infos, name, epoch)).fetchone()[0]


def subscribe_many(conn, ids, keys, table="initech.objects", name="default", epoch=None):
    keys = [None if k is None else Jsonb(k) for k in keys]
    return conn.execute(SUBSCRIBE_MANY, (ids, table, keys, name, epoch)).fetchone()[0]


def registry(conn) -> list[tuple]:
    """Subscriptions and interest rows, comparable (superuser)."""
    subs = conn.execute(
        "SELECT c.name, c.epoch, c.client_id, s.watch_id, s.row_key FROM pgbroker.subscription s"
        " JOIN pgbroker.client c USING (client_key) ORDER BY 1, 2, 3, 4, s.row_key::text"
    ).fetchall()
    interest = conn.execute(
        "SELECT watch_id, row_key, name, epoch, lock_key, ARRAY(SELECT c FROM unnest(clients) c ORDER BY c)"
        " FROM pgbroker.interest ORDER BY 1, row_key::text, 3, 4"
    ).fetchall()  # each client once, in no particular order
    clients = conn.execute("SELECT name, epoch, client_id, info FROM pgbroker.client ORDER BY 1, 2, 3").fetchall()
    return [clients, subs, interest]


# ---------------------------------------------------------------------------
# client_register_many


def test_client_register_many_registers_replaces_info_and_counts_the_new(connect):
    broker, reader = connect("broker"), connect("reader", user="t_reader")
    claim(broker)
    register(broker, "a", info={"v": 0})
    new = register_many(broker, ["a", "b", "c", "b"], [{"v": 1}, {"v": 2}, None, {"v": 3}])
    assert new == 2  # b and c; b given twice counts once and keeps its last info
    rows = reader.execute("SELECT client_id, info FROM pgbroker.clients ORDER BY client_id").fetchall()
    assert rows == [("a", {"v": 1}), ("b", {"v": 3}), ("c", {})]
    assert register_many(broker, ["d", "e"]) == 2  # infos NULL: '{}'
    assert register_many(broker, []) == 0
    assert reader.execute("SELECT info FROM pgbroker.clients WHERE client_id = 'e'").fetchone() == ({},)


REGISTER_MANY_CASES = [
    ((None, None), "22004", "client_ids must not be NULL"),
    ((["ok", "ok2", None], None), "22004", "client_ids[3] must not be NULL"),
    ((["ok", "ok2", ""], None), "22023", "client_ids[3] must be 1 to 200 bytes long, got 0 bytes"),
    ((["ok", "ok2", "x" * 201], None), "22023", "client_ids[3] must be 1 to 200 bytes long, got 201 bytes"),
    ((["ok", "ok2"], [None]), "22023", "client_ids has 2 elements and infos has 1"),
    (([["a", "b"], ["c", "d"]], None), "22023", "must be one-dimensional arrays"),
]


@pytest.mark.parametrize(("args", "code", "message"), REGISTER_MANY_CASES)
def test_client_register_many_rejects_bad_input_and_keeps_nothing(connect, args, code, message):
    broker, su = connect("broker"), connect("superuser")
    claim(broker)
    register(broker, "old")
    before = registry(su)
    with pytest.raises(psycopg.Error) as info:
        register_many(broker, *args)
    assert info.value.sqlstate == code
    assert message in info.value.diag.message_primary
    assert registry(su) == before


def test_the_set_based_calls_belong_to_the_holder_or_its_current_epoch(connect):
    holder, other, su = connect("holder"), connect("other"), connect("superuser")
    epoch = claim(holder)
    register(holder, "c")
    before = registry(su)
    for statement, params in (
        (REGISTER_MANY, (["x"], None, "default", None)),
        (REGISTER_MANY, (["x"], None, "default", epoch - 1)),
        (SUBSCRIBE_MANY, (["c"], "initech.objects", [Jsonb(1)], "default", None)),
        (SUBSCRIBE_MANY, (["c"], "initech.objects", [Jsonb(1)], "default", epoch - 1)),
    ):
        with pytest.raises(psycopg.Error) as info:
            other.execute(statement, params)
        assert info.value.sqlstate == ("PB001" if params[-1] is None else "PB002")
    assert registry(su) == before
    # With the holder's current epoch, from any session.
    assert register_many(other, ["x"], epoch=epoch) == 1
    assert subscribe_many(other, ["x"], [1], epoch=epoch) == 1


# ---------------------------------------------------------------------------
# subscribe_many


def test_subscribe_many_leaves_what_the_one_row_calls_leave(connect, pg_server):
    """The same subscriptions made one call at a time and in one set-based call give the same registry."""
    results = []
    for many in (False, True):
        su = connect("superuser")
        su.execute(
            "TRUNCATE pgbroker.subscription, pgbroker.interest, pgbroker.client, pgbroker.lease"
            " RESTART IDENTITY CASCADE"
        )
        su.execute("CREATE TABLE IF NOT EXISTS public.pair (region text, n int, PRIMARY KEY (region, n))")
        su.execute("SELECT pgbroker.watch('public.pair')")
        su.execute("DELETE FROM initech.objects WHERE id IN (1, 2, 3)")
        su.execute("DELETE FROM public.pair")
        broker = connect("broker")
        su.execute("ALTER SEQUENCE pgbroker.lease_epoch_seq RESTART")
        claim(broker)
        ids = ["a", "b", "c"]
        register_many(broker, ids)
        pairs = [("a", 1), ("b", 1), ("a", "2"), ("c", None), ("b", 1), ("c", 2), ("b", None)]
        composite = [("a", ["eu", 1]), ("b", ["eu", "1"]), ("c", ["us", 7])]
        if many:
            assert subscribe_many(broker, [i for i, _ in pairs], [k for _, k in pairs]) == 6
            assert subscribe_many(broker, [i for i, _ in composite], [k for _, k in composite], "public.pair") == 3
            assert subscribe_many(broker, ["a", "b"], [1, 1]) == 0  # all there already
        else:
            assert [subscribe(broker, i, key=k) for i, k in pairs] == [True] * 4 + [False, True, True]
            assert [subscribe(broker, i, "public.pair", k) for i, k in composite] == [True] * 3
        results.append(registry(su))
        summary_rows = summary(drain_after_writes(su, broker))
        results.append(summary_rows)
        broker.close()
    assert results[0] == results[2]
    assert results[1] == results[3]
    assert [c for w, k, _, _, _, c in results[2][2] if (w, k) == (1, 1)] == [["a", "b"]]
    assert [c for w, k, _, _, _, c in results[2][2] if (w, k) == (1, None)] == [["b", "c"]]


def drain_after_writes(su, broker) -> list[dict]:
    su.execute("INSERT INTO initech.objects (id, name) VALUES (1, 'a'), (2, 'b'), (3, 'c')")
    su.execute("INSERT INTO public.pair VALUES ('eu', 1), ('us', 7), ('us', 8)")
    return sorted(drain(broker), key=lambda r: (r["table"], str(r["key"])))


@pytest.mark.parametrize(("args", "code"), SUBSCRIBE_CASES)
def test_subscribe_many_rejects_what_subscribe_rejects_naming_the_position(connect, broker, args, code):  # noqa: F811
    """Each bad argument of the one-row cases, third among good ones: the same SQLSTATE, its position named,
    and nothing of the call kept."""
    su = connect("superuser")
    register(broker, "c2")
    client, table, key = args
    ids, keys = ["c1", "c2", client], ["1", None, key]  # keys as JSON text
    if table == "public.pair":
        keys = ['["eu", 1]', None, key]
    before = pgbroker_state_counts(su)
    with pytest.raises(psycopg.Error) as info:
        broker.execute("SELECT pgbroker.subscribe_many(%s::text[], %s::regclass, %s::jsonb[])", (ids, table, keys))
    assert info.value.sqlstate == code
    if code not in ("PB021", "42P01", "22004"):  # the table's errors have no position
        where = "client_ids[3]" if client != "c1" else "keys[3]"
        assert where in info.value.diag.message_primary, info.value.diag.message_primary
    assert pgbroker_state_counts(su) == before
    assert before["subscription"] == 0 and before["interest"] == 0


def test_subscribe_many_rejects_bad_arrays(connect, broker):  # noqa: F811
    cases = [
        ("SELECT pgbroker.subscribe_many(NULL, 'initech.objects', '{1}')", "22004"),
        ("SELECT pgbroker.subscribe_many('{c1}', 'initech.objects', NULL)", "22004"),
        ("SELECT pgbroker.subscribe_many('{c1,c1}', 'initech.objects', '{1}')", "22023"),
        ("SELECT pgbroker.subscribe_many('{{c1,c1}}', 'initech.objects', '{{1,2}}')", "22023"),
        ("SELECT pgbroker.subscribe_many('{c1}', NULL, '{1}')", "22004"),
        ("SELECT pgbroker.subscribe_many('{c1}', 'initech.objects', '{1}', wait => '-1 s')", "22023"),
    ]
    for statement, code in cases:
        assert error_of(broker, statement) == code, statement
    assert broker.execute("SELECT pgbroker.subscribe_many('{}', 'initech.objects', '{}')").fetchone() == (0,)
    assert broker.execute("SELECT count(*) FROM pgbroker.subscriptions").fetchone() == (0,)


def test_subscribe_many_finds_one_bad_key_among_thousands(connect, broker):  # noqa: F811
    ids = ["c1"] * 5000
    keys = [str(i) for i in range(5000)]
    keys[3210] = '"not a number"'
    with pytest.raises(psycopg.Error) as info:
        broker.execute("SELECT pgbroker.subscribe_many(%s::text[], 'initech.objects', %s::jsonb[])", (ids, keys))
    assert info.value.sqlstate == "22P02"
    assert info.value.diag.message_primary.startswith("keys[3211]: ")


def test_subscribe_many_waits_for_a_writer_past_its_trigger_and_misses_nothing(connect):
    """One wait for the table's writers per call, as subscribe() waits: a writer that ran its trigger before
    the subscriptions existed commits first; every later change reaches every new subscriber."""
    broker, admin = connect("broker"), connect("admin")
    # In the last gate of the watch lock: subscribe_many, which takes the gates in order, holds every other one
    # while it waits for it, so the other writer below goes on past it whatever its own gate.
    writer = connect_in_gate(connect, 15, "open writer", autocommit=False)
    claim(broker)
    seed_objects(admin, range(1, 4))
    register_many(broker, ["a", "b"])
    writer.execute("UPDATE initech.objects SET name = 'open' WHERE id = 1")  # past its trigger, left open
    with pytest.raises(psycopg.Error) as busy:
        broker.execute("SELECT pgbroker.subscribe_many('{a,b}', 'initech.objects', '{1,2}', wait => '100 ms')")
    assert busy.value.sqlstate == "PB022"
    assert count(broker, "SELECT count(*) FROM pgbroker.subscriptions") == 0
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(subscribe_many(broker, ["a", "b", "b"], [1, 2, 1])))
    t.start()
    wait_until(lambda: admin.execute(
        "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (broker.info.backend_pid,)
    ).fetchone()[0], what="subscribe_many waiting for the writer")  # fmt: skip
    other = connect("other writer")
    other.execute("SET statement_timeout = '2s'")  # writers never queue behind it
    other.execute("UPDATE initech.objects SET name = 'during' WHERE id = 2")
    writer.commit()
    t.join(10)
    assert result == [3]
    other.execute("UPDATE initech.objects SET name = 'after' WHERE id IN (1, 2)")
    got = sorted((r["key"], tuple(sorted(r["clients"]))) for r in drain(broker))
    # The change made while it waited reaches its subscriber (resolved at fetch); those after, exactly.
    assert got == [(1, ("a", "b")), (2, ("b",)), (2, ("b",))]


# ---------------------------------------------------------------------------
# Takeovers at size: hidden at once, swept later, never in anyone's way


def _pairs(clients: int, per_client: int, rows: int) -> tuple[list[str], list[str], list[int]]:
    ids = [f"client-{i}" for i in range(clients)]
    sub_ids = [cid for cid in ids for _ in range(per_client)]
    keys = [(i * 7 + j * 13) % rows + 1 for i in range(clients) for j in range(per_client)]
    return ids, sub_ids, keys


@pytest.mark.slow
def test_two_takeovers_in_a_row_with_writers_throughout(connect, watch_mode):
    """Broker A has 2,000 clients x 5 subscriptions; it is killed and B takes over, then C from B, while
    writers update the table throughout and sweeps run beside them.  Nothing of an earlier epoch is ever
    delivered (every fetched row names only the fetching broker's own clients), counted as a client, or makes a
    writer wait (each writer statement has a 2 s statement_timeout and a 100 ms lock_timeout)."""
    rows = 200
    admin, reader = connect("admin"), connect("reader", user="t_reader")
    seed_objects(admin, range(1, rows + 1))
    stop = threading.Event()
    errors: list[BaseException] = []
    written = [0]

    def write() -> None:
        try:
            with psycopg.connect(admin.info.dsn, autocommit=True) as w:
                w.execute("SET statement_timeout = '2s'")
                w.execute("SET lock_timeout = '100ms'")
                n = 0
                while not stop.is_set():
                    n += 1
                    w.execute("UPDATE initech.objects SET name = %s WHERE id = %s", (f"w{n}", n % rows + 1))
                    written[0] += 1
        except BaseException as exc:  # noqa: BLE001  (reported by the test)
            errors.append(exc)

    writers = [threading.Thread(target=write) for _ in range(2)]
    for t in writers:
        t.start()
    try:
        epochs = []
        previous = None
        for tag in ("A", "B", "C"):
            broker = connect(f"broker {tag}")
            epochs.append(claim(broker) if previous is None else _take_over(broker, previous))
            # Nothing of the earlier epochs is visible, counted or fetched.
            assert count(reader, "SELECT count(*) FROM pgbroker.clients") == 0
            assert count(reader, "SELECT count(*) FROM pgbroker.subscriptions") == 0
            assert fetch(broker) == []
            ids, sub_ids, keys = _pairs(2000, 5, rows)
            ids = [f"{tag}-{i}" for i in ids]
            sub_ids = [f"{tag}-{i}" for i in sub_ids]
            # A sweep of what the earlier epochs left runs beside the re-registration and the writers.
            sweeper = threading.Thread(target=_sweep_all, args=(admin.info.dsn,))
            sweeper.start()
            assert register_many(broker, ids) == 2000
            assert subscribe_many(broker, sub_ids, keys) == len(set(zip(sub_ids, keys, strict=True)))
            assert count(reader, "SELECT count(*) FROM pgbroker.clients") == 2000
            wait_until(lambda b=broker, t=tag: _delivered(b, t), what=f"changes delivered to broker {tag}")
            sweeper.join(60)
            assert not sweeper.is_alive()
            previous = broker
            assert not errors, errors
        assert epochs == sorted(epochs) and len(set(epochs)) == 3
        # The sweep left only C's epoch.
        assert count(admin, "SELECT count(DISTINCT epoch) FROM pgbroker.client") == 1
        assert count(reader, "SELECT sweep_backlog FROM pgbroker.broker_overview") == 0
    finally:
        stop.set()
        for t in writers:
            t.join(10)
    assert not errors, errors
    assert written[0] > 0


def _take_over(broker: psycopg.Connection, holder: psycopg.Connection) -> int:
    """Kill the holder's backend (as a crash would) and claim."""
    broker.execute("SELECT pg_terminate_backend(%s)", (holder.info.backend_pid,))
    return broker.execute("SELECT pgbroker.broker_claim(wait => '10 s')").fetchone()[0]


def _delivered(broker: psycopg.Connection, tag: str) -> bool:
    rows = drain(broker)
    for r in rows:
        assert all(c.startswith(f"{tag}-") for c in r["clients"]), r  # never a client of an earlier epoch
    return bool(rows)


def _sweep_all(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        while conn.execute("SELECT pgbroker.broker_sweep(max_rows => 500)").fetchone()[0]:
            pass


# ---------------------------------------------------------------------------
# Python: register_many, subscribe_many, and the sweep after a claim


def test_broker_register_many_and_subscribe_many_batch_and_count(db_url, connect):
    admin = connect("admin")
    seed_objects(admin, range(1, 11))
    with Broker(db_url, "py", heartbeat_interval=0.2) as broker:
        clients = ["a", ("b", {"v": 1}), ["c", None], "d", "e"]
        assert broker.register_many(clients, batch_size=2) == 5
        assert broker.register_many(iter(["a", "f"]), batch_size=10) == 1
        info = dict(admin.execute("SELECT client_id, info FROM pgbroker.clients WHERE name = 'py'").fetchall())
        assert info == {"a": {}, "b": {"v": 1}, "c": {}, "d": {}, "e": {}, "f": {}}
        pairs = ((cid, k) for cid in "abcdef" for k in (1, 2, None))
        assert broker.subscribe_many(pairs, "initech.objects", batch_size=4) == 18
        assert count(admin, "SELECT count(*) FROM pgbroker.subscriptions WHERE name = 'py'") == 18
        with pytest.raises(UnknownClient):
            broker.subscribe_many([("a", 3), ("nobody", 3)], "initech.objects", batch_size=1)
        assert count(admin, "SELECT count(*) FROM pgbroker.subscriptions WHERE name = 'py'") == 19  # (a, 3) kept
        with pytest.raises(InvalidArgument):
            broker.register_many(["ok", ""])
        with pytest.raises(ValueError):
            broker.register_many(["x"], batch_size=0)
        admin.execute("UPDATE initech.objects SET name = 'x' WHERE id = 1")
        got = [n for batch in _first(broker.notifications(poll_interval=0.1)) for n in batch]
        assert sorted(got[0].clients) == list("abcdef")


def test_broker_sends_the_pairs_of_one_key_or_filter_in_one_batch(db_url, connect):
    """subscribe_many and subscribe_filters group their pairs by key (by filter): each key's clients are subscribed
    by one statement, so its interest row is written once, not once per batch (bench_filters, part c)."""
    admin = connect("admin")
    seed_objects(admin, range(1, 4))
    with Broker(db_url, "grp", heartbeat_interval=0.2) as broker:
        broker.register_many(list("abcdef"))
        pairs = [(c, k) for c, k in zip("abcdef", [1, 2, 3, 1, 2, 3], strict=True)]
        assert broker.subscribe_many(pairs, "initech.objects", batch_size=2) == 6
        kinds = [(c, {"kind": k}) for c, k in zip("abcdef", ["gear", "bolt", "nut"] * 2, strict=True)]
        assert broker.subscribe_filters(kinds, "initech.objects", batch_size=2) == 6
        # One transaction per key: its subscriptions' and its interest row's xmin (never updated since).
        rows = admin.execute(
            """SELECT i.row_key, i.clients, i.xmin::text, array_agg(DISTINCT s.xmin::text)
                 FROM pgbroker.interest i
                 JOIN pgbroker.subscription s ON s.watch_id = i.watch_id AND s.row_key = i.row_key
                WHERE i.name = 'grp' GROUP BY i.row_key, i.clients, i.xmin::text ORDER BY i.row_key::text"""
        ).fetchall()
        assert [(r[0], sorted(r[1])) for r in rows] == [
            (1, ["a", "d"]),
            (2, ["b", "e"]),
            (3, ["c", "f"]),
            ({"kind": "bolt"}, ["b", "e"]),
            ({"kind": "gear"}, ["a", "d"]),
            ({"kind": "nut"}, ["c", "f"]),
        ]
        assert all(r[3] == [r[2]] for r in rows), rows
        assert len({r[2] for r in rows}) == 6


def test_broker_sends_the_keys_that_share_clients_in_one_batch(db_url, connect):
    """The keys (filters) that share clients go together: each client is locked by one statement, not by one per
    batch that has one of its keys.  Given client after client, grouped by key alone, each batch of four would have
    held all four clients."""
    admin = connect("admin")
    seed_objects(admin, range(1, 5))
    with Broker(db_url, "part", heartbeat_interval=0.2) as broker:
        broker.register_many(list("abcd"))
        # a and c share keys 1 and 2, b and d keys 3 and 4; the pairs come client after client.
        keys = {"a": (1, 2), "b": (3, 4), "c": (1, 2), "d": (3, 4)}
        pairs = [(c, keys[c][n]) for n in range(2) for c in "abcd"]
        assert broker.subscribe_many(pairs, "initech.objects", batch_size=4) == 8
        teams = {"a": ("gear", "bolt"), "b": ("nut", "cog"), "c": ("gear", "bolt"), "d": ("nut", "cog")}
        filters = [(c, {"kind": teams[c][n]}) for n in range(2) for c in "abcd"]
        assert broker.subscribe_filters(filters, "initech.objects", batch_size=4) == 8
        rows = admin.execute(
            """SELECT c.client_id, jsonb_typeof(s.row_key) = 'object', array_agg(DISTINCT s.xmin::text)
                 FROM pgbroker.subscription s JOIN pgbroker.client c USING (client_key)
                WHERE c.name = 'part' GROUP BY 1, 2 ORDER BY 1, 2"""
        ).fetchall()
        assert [(r[0], r[1], len(r[2])) for r in rows] == [(c, f, 1) for c in "abcd" for f in (False, True)], rows
        # Two batches per call: a and c in one, b and d in the other.
        by_client = {(r[0], r[1]): r[2][0] for r in rows}
        for f in (False, True):
            assert by_client["a", f] == by_client["c", f] != by_client["b", f] == by_client["d", f]
        # A client id that cannot be one (a list) is still refused by the statement, not by the grouping.
        with pytest.raises(InvalidArgument, match="one-dimensional"):
            broker.subscribe_many([(["a"], 1), (["a"], 2)], "initech.objects")


def _waiting_for_the_watch_lock(admin, application: str) -> int:
    return count(admin, """SELECT count(*) FROM pg_stat_activity
                            WHERE application_name = %s AND wait_event_type = 'Lock' AND wait_event = 'advisory'""",
                 (application,))  # fmt: skip


@pytest.mark.parametrize("flavour", ["threads", "asyncio"])
def test_broker_runs_two_batches_of_a_bulk_subscribe_at_once(db_url, connect, flavour):
    """The batches of subscribe_many and subscribe_filters run two at a time, on two registry connections: while
    one holds the table's watch lock, the next gets ready.  Seen here as two of the broker's sessions waiting for
    the lock of a writer left open; with one registry connection, one."""
    admin = connect("admin")
    seed_objects(admin, range(1, 9))
    with Broker(db_url, "shape") as first:  # the filters' shape, known before (a new one waits for the writers)
        first.register("z")
        first.subscribe("z", "initech.objects", filter={"kind": "k0"})
    writer = connect_in_gate(connect, 15, "open writer", autocommit=False)
    pairs = [(c, k) for c in "abcd" for k in range(1, 9)]
    filters = [(c, {"kind": f"k{k}"}) for c in "abcd" for k in range(1, 9)]

    def run(connections: int, method: str) -> int:
        """The call (the default guard: its waits are not cut), its 4 batches held up by the open writer until two
        (or one) of them wait for it."""
        application = f"bulk{connections}{method[-4:]}"
        items = pairs if method == "subscribe_many" else filters
        result: list = []

        def call() -> None:
            if flavour == "threads":
                with Broker(db_url, application, application_name=application,
                            registry_connections=connections) as broker:  # fmt: skip
                    broker.register_many(list("abcd"))
                    result.append(getattr(broker, method)(items, "initech.objects", batch_size=8, wait=30))
                return

            async def main() -> int:
                async with AsyncBroker(db_url, application, application_name=application,
                                       registry_connections=connections) as broker:  # fmt: skip
                    await broker.register_many(list("abcd"))
                    return await getattr(broker, method)(items, "initech.objects", batch_size=8, wait=30)

            result.append(asyncio.run(main()))

        writer.execute("UPDATE initech.objects SET name = 'open' WHERE id = 1")  # past its trigger, left open
        thread = threading.Thread(target=call)
        thread.start()
        wait_until(lambda: _waiting_for_the_watch_lock(admin, application) == min(connections, 2),
                   what=f"{min(connections, 2)} batches waiting for the writer")  # fmt: skip
        time.sleep(0.2)  # and no more
        assert _waiting_for_the_watch_lock(admin, application) == min(connections, 2)
        writer.commit()
        thread.join(30)
        assert not thread.is_alive()
        return result[0]

    assert run(4, "subscribe_many") == 32
    assert run(4, "subscribe_filters") == 32
    assert run(1, "subscribe_filters") == 32
    subscribed = (
        "SELECT count(*) FROM pgbroker.subscription JOIN pgbroker.client USING (client_key) WHERE name LIKE 'bulk%'"
    )
    assert count(admin, subscribed) == 96


def test_a_bulk_batch_that_waited_for_the_other_one_runs_again_alone(db_url, connect):
    """Two batches at once: the one that waits for the other's watch lock may see its wait run out (TableBusy)
    with no writer to blame; it runs again, alone, after the others.  A writer left open is still TableBusy, and
    nothing of the call is kept then."""
    admin = connect("admin")
    seed_objects(admin, range(1, 9))
    # Each batch holds the watch lock 0.6 s (its inserts, slowed), longer than the other's wait of 0.3 s.
    admin.execute("""CREATE FUNCTION public.slow_batch() RETURNS trigger LANGUAGE plpgsql AS
                     $$BEGIN PERFORM pg_sleep(0.6); RETURN NULL; END$$""")  # fmt: skip
    admin.execute("""CREATE TRIGGER slow AFTER INSERT ON pgbroker.subscription
                     FOR EACH STATEMENT EXECUTE FUNCTION public.slow_batch()""")  # fmt: skip
    with Broker(db_url, "again") as broker:  # (the default guard: waits of 0.3 s, not less)
        broker.register_many(list("abcd"))
        filters = [(c, {"kind": f"k{k}"}) for c in "abcd" for k in range(1, 5)]
        assert broker.subscribe_filters(filters, "initech.objects", batch_size=8, wait=0.3) == 16
        admin.execute("DROP TRIGGER slow ON pgbroker.subscription")
        writer = connect_in_gate(connect, 15, "open writer", autocommit=False)
        writer.execute("UPDATE initech.objects SET name = 'open' WHERE id = 1")
        started = time.monotonic()
        with pytest.raises(TableBusy):
            broker.subscribe_many([(c, k) for c in "abcd" for k in range(1, 5)], "initech.objects", batch_size=8,
                                  wait=0.3)  # fmt: skip
        assert time.monotonic() - started < 5
        writer.rollback()
    assert count(admin, "SELECT count(*) FROM pgbroker.subscription") == 16


def test_a_failed_bulk_batch_raises_its_error_and_stops_the_call(db_url, connect):
    """Once a batch fails, no batch starts; the error raised is the first failed batch's, in the call's order."""
    admin = connect("admin")
    seed_objects(admin, range(1, 9))
    with Broker(db_url, "stop", heartbeat_interval=0.2) as broker:
        broker.register_many(list("abc"))
        # Four batches of one filter's pairs: the second's filter names no column of the table, the third's
        # client is not registered.
        filters = [("a", {"kind": "x"}), ("b", {"nope": 1}), ("nobody", {"kind": "y"}), ("c", {"kind": "z"})]
        with pytest.raises(InvalidArgument, match="nope"):
            broker.subscribe_filters(filters, "initech.objects", batch_size=1)
        rows = admin.execute("SELECT client_id FROM pgbroker.subscriptions WHERE name = 'stop'").fetchall()
        # The first batch ran beside the second; the fourth never started (the third may have, and failed).
        assert rows == [("a",)]


def _first(iterator):
    for batch in iterator:
        yield batch
        return


def test_async_broker_register_many_and_subscribe_many(db_url, connect):
    admin = connect("admin")

    async def main() -> tuple[int, int]:
        async with AsyncBroker(db_url, "apy", heartbeat_interval=0.2) as broker:
            new = await broker.register_many([f"c{i}" for i in range(25)], batch_size=10)
            subs = await broker.subscribe_many([(f"c{i}", i) for i in range(25)], "initech.objects", batch_size=7)
            return new, subs

    assert asyncio.run(main()) == (25, 25)
    assert count(admin, "SELECT count(*) FROM pgbroker.subscription") == 25


def test_the_broker_sweeps_what_earlier_epochs_left_after_its_claim(db_url, connect):
    admin = connect("admin")
    with Broker(db_url, "sw", heartbeat_interval=0.2) as a:
        a.register_many([f"c{i}" for i in range(3000)])
        a.subscribe_many([(f"c{i}", i % 50) for i in range(3000)], "initech.objects")
    before = count(admin, "SELECT count(*) FROM pgbroker.client WHERE name = 'sw'")
    assert before == 3000
    with Broker(db_url, "sw", heartbeat_interval=0.2, sweep=False) as b:
        time.sleep(0.3)
        assert count(admin, "SELECT clients FROM pgbroker.sweep_backlog WHERE name = 'sw'") == 3000
        assert b.epoch > 0
    with Broker(db_url, "sw", heartbeat_interval=0.2):
        wait_until(
            lambda: count(admin, "SELECT count(*) FROM pgbroker.client WHERE name = 'sw'") == 0,
            what="the broker's sweep", timeout=30,
        )  # fmt: skip
        assert count(admin, "SELECT count(*) FROM pgbroker.subscription") == 0
        assert count(admin, "SELECT count(*) FROM pgbroker.interest WHERE name = 'sw'") == 0
