"""Subscriptions by column value (filters, issue 43): who is told, move-in and move-out (``left``), both trigger
modes, resolution at fetch, unsubscribe, the view, bad input and hostile column names."""

from __future__ import annotations

import itertools
import random
import re
import threading
import time
from collections import Counter

import psycopg
import pytest
from fanout_util import claim, drain, register, sqlstate, watch
from psycopg.types.json import Jsonb

TABLE = "public.tickets"


def _setup(conn: psycopg.Connection, mode: str, clients: list[str]) -> None:
    conn.execute(
        "CREATE TABLE tickets (id integer PRIMARY KEY, team integer, status text, kind text, doc json, data jsonb)"
    )
    watch(conn, TABLE, mode)
    claim(conn)
    for c in clients:
        register(conn, c)


def subscribe(conn: psycopg.Connection, client: str, flt: object, table: str = TABLE) -> bool:
    return conn.execute(
        "SELECT pgbroker.subscribe(%s, %s::regclass, filter => %s)", (client, table, Jsonb(flt))
    ).fetchone()[0]


def unsubscribe(conn: psycopg.Connection, client: str, flt: object, table: str = TABLE) -> bool:
    return conn.execute(
        "SELECT pgbroker.unsubscribe(%s, %s::regclass, filter => %s)", (client, table, Jsonb(flt))
    ).fetchone()[0]


def told(conn: psycopg.Connection) -> list[tuple]:
    """The outbox as (op, key, clients, left), in order."""
    return [(r["op"], r["key"], tuple(sorted(r["clients"])), tuple(sorted(r["left"] or ()))) for r in drain(conn)]


def test_equality_in_null_and_several_columns(connect, watch_mode):
    conn = connect()
    _setup(conn, watch_mode, ["team7", "open", "team7open", "nokind", "key1"])
    assert subscribe(conn, "team7", {"team": 7})
    assert subscribe(conn, "open", {"status": {"in": ["open", "pending"]}})
    assert subscribe(conn, "team7open", {"team": "7", "status": {"eq": "open"}})  # "7" casts to the integer 7
    assert subscribe(conn, "nokind", {"kind": None})
    assert not subscribe(conn, "team7", {"team": {"in": [7]}})  # the same point: nothing new
    conn.execute("SELECT pgbroker.subscribe('key1', %s::regclass, '1')", (TABLE,))

    conn.execute("INSERT INTO tickets (id, team, status, kind) VALUES (1, 7, 'open', 'x'), (2, 8, 'closed', NULL)")
    assert told(conn) == [
        ("I", 1, ("key1", "open", "team7", "team7open"), ()),
        ("I", 2, ("nokind",), ()),
    ]
    # Leaving team 7: team7 and team7open are told it left; open still matches.
    conn.execute("UPDATE tickets SET team = 9 WHERE id = 1")
    assert told(conn) == [("U", 1, ("key1", "open", "team7", "team7open"), ("team7", "team7open"))]
    # Back into team 7 with another status: team7 told (moved in), open told it left.
    conn.execute("UPDATE tickets SET team = 7, status = 'closed' WHERE id = 1")
    assert told(conn) == [("U", 1, ("key1", "open", "team7"), ("open",))]
    # Row 2 has no kind; once it has one, it left nokind; then no filter matches it, before or after: nothing.
    conn.execute("UPDATE tickets SET status = 'done' WHERE id = 2")
    conn.execute("UPDATE tickets SET kind = 'y' WHERE id = 2")
    assert told(conn) == [("U", 2, ("nokind",), ()), ("U", 2, ("nokind",), ("nokind",))]
    conn.execute("UPDATE tickets SET status = 'new' WHERE id = 2")
    assert told(conn) == []
    # A delete tells the clients whose filters matched the row (it is a D, not a departure).
    conn.execute("DELETE FROM tickets")
    assert told(conn) == [("D", 1, ("key1", "team7"), ())]
    # A key change is a D of the old key and an I of the new one.
    conn.execute("INSERT INTO tickets (id, team) VALUES (5, 7)")
    assert told(conn)[0] == ("I", 5, ("nokind", "team7"), ())
    conn.execute("UPDATE tickets SET id = 6 WHERE id = 5")
    assert sorted(told(conn)) == [("D", 5, ("nokind", "team7"), ()), ("I", 6, ("nokind", "team7"), ())]


def test_resolved_at_fetch_under_repeatable_read(connect, watch_mode):
    conn, writer = connect(), connect()
    _setup(conn, watch_mode, ["team7", "key1"])
    subscribe(conn, "team7", {"team": 7})
    conn.execute("INSERT INTO tickets (id, team) VALUES (1, 7), (2, 3)")
    drain(conn)
    with writer.transaction():
        writer.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        writer.execute("UPDATE tickets SET team = 8 WHERE id = 1")
        writer.execute("UPDATE tickets SET team = 7 WHERE id = 2")
        writer.execute("UPDATE tickets SET status = 'x' WHERE id = 2")
    assert conn.execute("SELECT count(*) FROM pgbroker.outbox WHERE clients IS NULL").fetchone()[0] == 3
    assert told(conn) == [
        ("U", 1, ("team7",), ("team7",)),
        ("U", 2, ("team7",), ()),
        ("U", 2, ("team7",), ()),
    ]


def test_unsubscribe_by_filter_and_the_view(connect, watch_mode):
    conn = connect()
    _setup(conn, watch_mode, ["a", "b"])
    subscribe(conn, "a", {"status": {"in": ["open", "pending"]}, "team": 7})
    subscribe(conn, "b", {"team": 7})
    rows = conn.execute("SELECT client_id, key, filter FROM pgbroker.subscriptions ORDER BY 1, 3::text").fetchall()
    assert rows == [
        ("a", None, {"status": "open", "team": 7}),
        ("a", None, {"status": "pending", "team": 7}),
        ("b", None, {"team": 7}),
    ]
    assert unsubscribe(conn, "a", {"team": 7, "status": {"in": ["open", "pending"]}})
    assert not unsubscribe(conn, "a", {"team": 7, "status": "open"})
    conn.execute("INSERT INTO tickets (id, team, status) VALUES (1, 7, 'open')")
    assert told(conn) == [("I", 1, ("b",), ())]
    assert conn.execute("SELECT count(*) FROM pgbroker.interest WHERE clients @> '{a}'").fetchone()[0] == 0


def test_subscribe_filters_in_bulk(connect, watch_mode):
    conn = connect()
    _setup(conn, watch_mode, [f"c{i}" for i in range(100)])
    n = conn.execute(
        "SELECT pgbroker.subscribe_filters(%s, %s::regclass, %s)",
        ([f"c{i}" for i in range(100)], TABLE, [Jsonb({"team": i % 10}) for i in range(100)]),
    ).fetchone()[0]
    assert n == 100
    conn.execute("INSERT INTO tickets (id, team) VALUES (1, 3)")
    assert told(conn) == [("I", 1, tuple(sorted(f"c{i}" for i in range(3, 100, 10))), ())]


def test_a_bulk_of_several_shapes_subscribes_each_filter_as_given(connect):
    """_filter_points reads a bulk first as every filter on the first one's column: a bulk that is not takes the
    other paths, whichever filter breaks the pattern, and a bad filter anywhere is named."""
    conn = connect()
    filters = [
        {"team": 1},
        {"team": "2"},  # a JSON string, compared as the column's type
        {"team": None},
        {"status": "open"},  # another column
        {"team": 3, "status": "x"},  # two columns
        {"team": {"in": [4, 5]}},
    ]
    clients = [f"c{i}" for i in range(len(filters))]
    _setup(conn, "row", clients)
    n = conn.execute(
        "SELECT pgbroker.subscribe_filters(%s, %s::regclass, %s)", (clients, TABLE, [Jsonb(f) for f in filters])
    ).fetchone()[0]
    assert n == 7
    rows = conn.execute("SELECT client_id, filter FROM pgbroker.subscriptions ORDER BY 1, 2::text").fetchall()
    assert rows == [
        ("c0", {"team": 1}),
        ("c1", {"team": 2}),
        ("c2", {"team": None}),
        ("c3", {"status": "open"}),
        ("c4", {"status": "x", "team": 3}),
        ("c5", {"team": 4}),
        ("c5", {"team": 5}),
    ]
    conn.execute("INSERT INTO tickets (id, team, status) VALUES (1, 2, 'open'), (2, NULL, 'x'), (3, 5, NULL)")
    assert told(conn) == [("I", 1, ("c1", "c3"), ()), ("I", 2, ("c2",), ()), ("I", 3, ("c5",), ())]
    for second, state in [
        (["team"], "22023"),
        ("team", "22023"),
        ({}, "22023"),
        ({"nope": 1}, "42703"),
        ({"team": "x"}, "22P02"),
        ({"team": [1]}, "22023"),
        ({"team": 1, "nope": 2}, "42703"),
    ]:
        with pytest.raises(psycopg.Error) as exc:
            conn.execute(
                "SELECT pgbroker.subscribe_filters(%s, %s::regclass, %s)",
                (["c0", "c1", "c2"], TABLE, [Jsonb({"team": 9}), Jsonb(second), Jsonb({"team": 10})]),
            )
        assert sqlstate(exc) == state and "filters[2]" in str(exc.value), (second, exc.value)
    assert conn.execute("SELECT count(*) FROM pgbroker.subscription").fetchone()[0] == 7


def test_ranges_of_each_class_move_rows_in_and_out(connect, watch_mode):
    conn = connect()
    conn.execute(
        "CREATE TABLE prices (id integer PRIMARY KEY, team integer, price numeric, at timestamptz, day date,"
        " ts timestamp, f float8, r real)"
    )
    watch(conn, "public.prices", watch_mode)
    claim(conn)
    filters = {
        "cheap": {"price": {"lt": "10.5"}},
        "mid7": {"team": 7, "price": {"gte": 10.5, "lte": 20}},
        "recent": {"at": {"gt": "2026-06-01T00:00:00+02:00"}},
        "june": {"day": {"gte": "2026-06-01", "lt": "2026-07-01"}},
        "late": {"ts": {"gte": "2026-06-01 12:00"}},
        "half": {"f": {"gte": 0.5, "lte": 0.5}},
        "small": {"r": {"lt": 0.1}},
    }
    for client, flt in filters.items():
        register(conn, client)
        assert subscribe(conn, client, flt, table="public.prices")
    view = dict(conn.execute("SELECT client_id, filter FROM pgbroker.subscriptions").fetchall())
    assert view["mid7"] == {"team": 7, "price": {"gte": 10.5, "lte": 20}}
    assert view["recent"] == {"at": {"gt": "2026-05-31T22:00:00+00:00"}}
    conn.execute(
        "INSERT INTO prices VALUES (1, 7, 10.5, '2026-05-31 22:00+00', '2026-06-30', '2026-06-01 12:00', 0.5, 0.1),"
        " (2, 8, 10.4999, '2026-05-31 22:00:00.000001+00', '2026-07-01', '2026-06-01 11:59:59', 0.5000001, 0.099),"
        " (3, 7, NULL, NULL, NULL, NULL, NULL, NULL)"
    )
    assert told(conn) == [
        ("I", 1, ("half", "june", "late", "mid7"), ()),
        ("I", 2, ("cheap", "recent", "small"), ()),
    ]
    conn.execute("UPDATE prices SET price = 20 WHERE id = 1")  # still in mid7 (lte), cheap still out
    conn.execute("UPDATE prices SET price = 20.000001 WHERE id = 1")  # leaves mid7
    conn.execute("UPDATE prices SET team = 7, price = 15 WHERE id = 2")  # leaves cheap, enters mid7
    conn.execute("UPDATE prices SET price = 1 WHERE id = 3")  # enters cheap
    assert told(conn) == [
        ("U", 1, ("half", "june", "late", "mid7"), ()),
        ("U", 1, ("half", "june", "late", "mid7"), ("mid7",)),
        ("U", 2, ("cheap", "mid7", "recent", "small"), ("cheap",)),
        ("U", 3, ("cheap",), ()),
    ]
    assert unsubscribe(conn, "mid7", {"team": 7, "price": {"lte": 20, "gte": "10.50"}}, table="public.prices")
    assert not unsubscribe(conn, "cheap", {"price": {"lte": "10.5"}}, table="public.prices")
    conn.execute("DELETE FROM prices WHERE id = 2")
    assert told(conn) == [("D", 2, ("recent", "small"), ())]
    assert conn.execute("SELECT count(*) FROM pgbroker.interest WHERE range_box IS NOT NULL").fetchone()[0] == 6


def test_a_change_probes_only_the_ranges_of_its_point(connect):
    """10,000 ranges of 1,000 teams: a change reads the ranges of its own team through the SP-GiST index."""
    conn = connect()
    _setup(conn, "row", [f"c{i}" for i in range(1000)])
    conn.execute(
        "SELECT pgbroker.subscribe_filters(array_agg('c' || i % 1000), 'public.tickets',"
        " array_agg(jsonb_build_object('status', 's' || i % 1000, 'team', jsonb_build_object('gte', i / 1000,"
        " 'lt', i / 1000 + 3))))"
        " FROM generate_series(0, 9999) i"
    )
    conn.execute("ANALYZE pgbroker.interest")
    conn.execute("INSERT INTO tickets (id, team, status) VALUES (1, 4, 's7')")
    assert told(conn) == [("I", 1, ("c7",), ())]  # i = 2007, 3007, 4007: teams [2, 5), [3, 6), [4, 7)
    probe = "jsonb_build_object('', jsonb_build_array('team', 4, 'numeric'), 'status', 's7', 'team', 4)"
    watch_id = "(SELECT w.watch_id FROM pgbroker.watched w WHERE w.relid = 'public.tickets'::regclass)"
    # _filter_keys's probe, at the planner's default settings: the SP-GiST index, for the candidates of team 4's box
    # (status s7 and team 4 as the triggers make it)
    plan = "\n".join(
        r[0]
        for r in conn.execute(
            f"EXPLAIN (ANALYZE, COSTS OFF) SELECT j.row_key FROM pgbroker.interest j"
            f" WHERE j.range_box @> pgbroker._range_probe({watch_id}, {probe}) AND j.watch_id = {watch_id}"
        )
    )
    # 4 candidates of 10,000 (a box is closed: [1, 4) is one), 3 kept by the exact comparison
    # (PostgreSQL 18 prints rows=4.00)
    assert "Index Scan on interest_range (actual" in plan and re.search(r"rows=4(\.00)? loops=1", plan), plan
    keys = conn.execute(f"SELECT pgbroker._filter_keys({watch_id}, ARRAY[{probe}])").fetchone()[0]
    assert sorted(k["team"]["gte"] for k in keys) == [2, 3, 4], plan


BAD = [
    ([], "22023"),
    ("team", "22023"),
    ({}, "22023"),
    ({"nosuch": 1}, "42703"),
    ({"Team": 1}, "42703"),
    ({'team"; DROP TABLE tickets; --': 1}, "42703"),
    ({"team": {"gt": 1, "gte": 2}}, "22023"),
    ({"team": {"lt": 1, "lte": 2}}, "22023"),
    ({"team": {"gt": 5, "lt": 3}}, "22023"),
    ({"team": {"gt": 3, "lte": 3}}, "22023"),
    ({"team": {"eq": 1, "lt": 3}}, "22023"),
    ({"team": {"gte": None}}, "22023"),
    ({"team": {"lt": [1]}}, "22023"),
    ({"team": {"gte": 1}, "id": {"lt": 3}}, "22023"),
    ({"team": {"gte": "x"}}, "22P02"),
    ({"team": {"gte": 99999999999}}, "22003"),
    ({"status": {"gte": "a"}}, "PB023"),
    ({"team": {"like": "x"}}, "22023"),
    ({"team": {"nope": 3}}, "22023"),
    ({"team": {"in": []}}, "22023"),
    ({"team": {"in": 3}}, "22023"),
    ({"team": [1, 2]}, "22023"),
    ({"team": "seven"}, "22P02"),
    ({"team": 99999999999}, "22003"),
    ({"doc": {"eq": {"a": 1}}}, "PB023"),
    ({"team": {"in": list(range(40))}, "status": {"in": [str(i) for i in range(40)]}}, "54000"),
]


@pytest.mark.parametrize("flt, state", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_filters_are_refused_and_subscribe_nothing(connect, flt, state):
    conn = connect()
    _setup(conn, "statement", ["c"])
    with pytest.raises(psycopg.Error) as exc:
        subscribe(conn, "c", flt)
    assert sqlstate(exc) == state, exc.value
    assert "filter" in str(exc.value)
    assert conn.execute("SELECT count(*) FROM pgbroker.subscription").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM pgbroker.filter_shape").fetchone()[0] == 0
    assert conn.execute("SELECT to_regclass('public.tickets')").fetchone()[0] == "tickets"


def test_bulk_errors_name_the_filter(connect):
    conn = connect()
    _setup(conn, "statement", ["a", "b"])
    with pytest.raises(psycopg.Error) as exc:
        conn.execute(
            "SELECT pgbroker.subscribe_filters(%s, %s::regclass, %s)",
            (["a", "b"], TABLE, [Jsonb({"team": 1}), Jsonb({"team": "x"})]),
        )
    assert sqlstate(exc) == "22P02" and "filters[2]" in str(exc.value)
    with pytest.raises(psycopg.Error) as exc:
        conn.execute(
            "SELECT pgbroker.subscribe_filters(%s, %s::regclass, %s)",
            (["a", "nobody"], TABLE, [Jsonb({"team": 1}), Jsonb({"team": 2})]),
        )
    assert sqlstate(exc) == "PB010" and "client_ids[2]" in str(exc.value)
    with pytest.raises(psycopg.Error) as exc:
        conn.execute("SELECT pgbroker.subscribe('a', %s::regclass, '1', filter => '{\"team\": 1}')", (TABLE,))
    assert sqlstate(exc) == "22023"


def test_hostile_column_names_are_only_compared_with_the_catalog(connect, watch_mode):
    conn = connect()
    conn.execute('CREATE TABLE "we""ird" (id integer PRIMARY KEY, "a""b; DROP TABLE x --" integer, "A" text)')
    conn.execute("CREATE TABLE x (i integer)")
    watch(conn, 'public."we""ird"', watch_mode)
    claim(conn)
    register(conn, "c")
    assert subscribe(conn, "c", {'a"b; DROP TABLE x --': 1, "A": "z"}, table='public."we""ird"')
    conn.execute("INSERT INTO \"we\"\"ird\" VALUES (1, 1, 'z'), (2, 1, 'y')")
    assert told(conn) == [("I", 1, ("c",), ())]
    assert conn.execute("SELECT to_regclass('public.x')").fetchone()[0] == "x"


def test_a_table_whose_key_is_one_jsonb_column_refuses_filters(connect):
    conn = connect()
    conn.execute("CREATE TABLE j (k jsonb PRIMARY KEY, v integer)")
    watch(conn, "public.j")
    claim(conn)
    register(conn, "c")
    with pytest.raises(psycopg.Error) as exc:
        subscribe(conn, "c", {"v": 1}, table="public.j")
    assert sqlstate(exc) == "PB023"


@pytest.mark.slow
def test_subscribe_by_filter_then_read_misses_no_change_under_hot_writers(connect, watch_mode):
    """Gap-free: a client that subscribes by filter, then reads the table, is told of every change committed after
    its read that its filter matched before or after, while writers move rows between filter values (the first
    filter of each shape, IN, IN and equality, a range, renders the triggers again under the writers)."""
    admin, broker = connect("admin"), connect("broker")
    admin.execute(
        "CREATE TABLE hot (id integer PRIMARY KEY, g integer NOT NULL, h integer NOT NULL, v bigint NOT NULL)"
    )
    admin.execute("CREATE TABLE hot_log (seq bigserial PRIMARY KEY, row_id integer, g integer, h integer, v bigint)")
    admin.execute("INSERT INTO hot SELECT i, i % 4, i % 2, 0 FROM generate_series(1, 12) i")
    watch(admin, "public.hot", watch_mode)
    claim(broker)
    counter = itertools.count(1)
    stop = threading.Event()
    errors: list[BaseException] = []
    commits = [0]

    def writer(n: int) -> None:
        rnd = random.Random(n)
        try:
            with connect(f"writer {n}", autocommit=False) as conn:
                while not stop.is_set():
                    row, g, h, v = rnd.randint(1, 12), rnd.randint(0, 3), rnd.randint(0, 1), next(counter)
                    conn.execute("UPDATE hot SET g = %s, h = %s, v = %s WHERE id = %s", (g, h, v, row))
                    conn.execute("INSERT INTO hot_log (row_id, g, h, v) VALUES (%s, %s, %s, %s)", (row, g, h, v))
                    if rnd.random() < 0.5:
                        time.sleep(rnd.random() * 0.003)
                    conn.commit()
                    commits[0] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    subs = []
    rnd = random.Random(7)
    try:
        time.sleep(0.2)
        deadline = time.monotonic() + 3.0
        i = 0
        while time.monotonic() < deadline:
            client = f"c{i}"
            gs = sorted(rnd.sample(range(4), rnd.randint(1, 2)))
            flt: dict = {"g": {"in": gs}}
            hs = None
            if i % 3 == 1:  # a second shape
                hs = rnd.randint(0, 1)
                flt["h"] = hs
            elif i % 3 == 2:  # a third: a range
                lo = rnd.randint(0, 3)
                gs = list(range(lo, rnd.randint(lo, 3) + 1))
                flt = {"g": {"gte": lo, "lte": gs[-1]}}
            register(broker, client)
            assert subscribe(broker, client, flt, table="public.hot") is True
            seen = dict(broker.execute("SELECT id, v FROM hot"))
            subs.append((client, gs, hs, seen))
            i += 1
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors
    assert len(subs) >= 10 and commits[0] >= 100, (len(subs), commits)
    history: dict[int, list[tuple[int, int, int]]] = {r: [(r % 4, r % 2, 0)] for r in range(1, 13)}
    for row, g, h, v in admin.execute("SELECT row_id, g, h, v FROM hot_log ORDER BY seq"):
        history[row].append((g, h, v))
    notes: Counter = Counter(
        (c, key)
        for key, c in broker.execute(
            "SELECT f.key::integer, c FROM pgbroker.outbox_fetch('default', 1000000) f, unnest(f.clients) c"
        )
    )

    def matches(g: int, h: int, gs: list[int], hs: int | None) -> bool:
        return g in gs and (hs is None or h == hs)

    total_due = 0
    for client, gs, hs, seen in subs:
        for row, versions in history.items():
            at = [v for _, _, v in versions].index(seen[row])
            due = sum(
                1
                for (g0, h0, _), (g1, h1, _) in itertools.pairwise(versions[at:])
                if matches(g0, h0, gs, hs) or matches(g1, h1, gs, hs)
            )
            assert notes[(client, row)] >= due, (client, gs, hs, row, due, notes[(client, row)])
            total_due += due
    assert total_due > 0
    print(f"subscriptions={len(subs)} commits={commits[0]} changes due={total_due}")


def test_a_table_has_at_most_32_shapes(connect):
    conn = connect()
    columns = ", ".join(f"c{i} integer" for i in range(6))
    conn.execute(f"CREATE TABLE wide (id integer PRIMARY KEY, {columns})")
    watch(conn, "public.wide")
    claim(conn)
    register(conn, "c")
    subsets = [s for n in (1, 2, 3) for s in itertools.combinations(range(6), n)]  # 6 + 15 + 20 shapes
    for subset in subsets[:32]:
        assert subscribe(conn, "c", {f"c{i}": 1 for i in subset}, table="public.wide")
    with pytest.raises(psycopg.Error) as exc:
        subscribe(conn, "c", {f"c{i}": 1 for i in subsets[32]}, table="public.wide")
    assert sqlstate(exc) == "54000" and "32" in str(exc.value)
    assert conn.execute("SELECT count(*) FROM pgbroker.filter_shape").fetchone()[0] == 32
