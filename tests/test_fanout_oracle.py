"""Oracle test: random clients, subscriptions and write mixes, each write at a random isolation level; the outbox
equals a plain Python model."""

from __future__ import annotations

from collections import Counter

import psycopg
from fanout_util import drain, register, renew, subscribe, unsubscribe, watch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

TABLE = "public.oracle_t"
COLUMNS = ("id", "a", "b", "j")  # in attnum order
BROKERS = ("a", "b")
KEYS = st.integers(min_value=1, max_value=8)
KEY_SETS = st.sets(KEYS, min_size=1, max_size=6).map(sorted)
A_VALUES = st.integers(min_value=0, max_value=2)
B_VALUES = st.sampled_from(["x", "y"])
# json has no equality operator: changes are detected on its text (so spacing counts).
J_VALUES = st.sampled_from(['{"a":1}', '{"a": 1}', '{"a":2}'])

Row = dict[str, object]
FILL_FIRST, FILL_ROWS = 101, 100
FILL_KEYS = f"{FILL_FIRST}, {FILL_FIRST + FILL_ROWS - 1}"

OPS = st.one_of(
    st.tuples(st.just("insert"), KEY_SETS, A_VALUES),
    st.tuples(st.just("upsert"), KEY_SETS, A_VALUES),
    st.tuples(st.just("update"), KEY_SETS, st.just("a"), A_VALUES),
    st.tuples(st.just("update"), KEY_SETS, st.just("b"), B_VALUES),
    st.tuples(st.just("update"), KEY_SETS, st.just("j"), J_VALUES),
    st.tuples(st.just("update2"), KEY_SETS, A_VALUES, B_VALUES),
    st.tuples(st.just("update_all"), A_VALUES),
    st.tuples(st.just("rekey"), KEYS, KEYS),
    # Statements of more than 64 rows run the triggers' bulk plans.
    st.tuples(st.just("fill")),
    st.tuples(st.just("shift")),
    st.tuples(st.just("unfill")),
    st.tuples(st.just("delete"), KEY_SETS),
    st.tuples(st.just("subscribe"), st.integers(0, 4), st.one_of(st.none(), KEYS)),
    st.tuples(st.just("unsubscribe"), st.integers(0, 4), st.one_of(st.none(), KEYS)),
)

RC = "read committed"
ISOLATION = st.sampled_from([RC, "repeatable read", "serializable"])

SCENARIOS = st.fixed_dictionaries(
    {
        "clients": st.lists(st.sampled_from(BROKERS), min_size=1, max_size=5),
        "rows": st.dictionaries(KEYS, st.tuples(A_VALUES, B_VALUES, J_VALUES), max_size=6),
        "subs": st.lists(st.tuples(st.integers(0, 4), st.one_of(st.none(), KEYS)), max_size=10),
        # REPEATABLE READ and SERIALIZABLE writers leave their rows' clients to the fetch (600_triggers.sql).
        "ops": st.lists(st.tuples(OPS, ISOLATION), min_size=1, max_size=8),
    }
)


class Model:
    """What the outbox must contain: the table, the clients and their subscriptions."""

    def __init__(self, clients: dict[str, str]) -> None:
        self.clients = clients  # client id -> broker
        self.rows: dict[int, Row] = {}
        self.subs: set[tuple[str, int | None]] = set()

    def targets(self, key: int | None, op: str, changed: tuple[str, ...] | None) -> Counter:
        out: Counter = Counter()
        for broker in BROKERS:
            who = frozenset(
                c
                for c, k in self.subs
                if self.clients[c] == broker and (key is None and op == "T" or k is None or k == key)
            )
            if who:
                out[(broker, op, key, changed, who)] += 1
        return out

    def insert(self, key: int, row: Row) -> Counter:
        self.rows[key] = row
        return self.targets(key, "I", None)

    def delete(self, key: int) -> Counter:
        del self.rows[key]
        return self.targets(key, "D", None)

    def update(self, key: int, values: Row) -> Counter:
        old = self.rows[key]
        changed = tuple(c for c in COLUMNS if c in values and values[c] != old[c])
        old.update(values)
        return self.targets(key, "U", changed) if changed else Counter()


def outbox(conns: dict[str, psycopg.Connection]) -> Counter:
    got: Counter = Counter()
    for broker, conn in conns.items():
        for r in drain(conn, broker):
            changed = None if r["changed"] is None else tuple(r["changed"])
            got[(broker, r["op"], r["key"], changed, frozenset(r["clients"]))] += 1
    return got


def apply(op: tuple, writer: psycopg.Connection, model: Model, conns: dict[str, psycopg.Connection]) -> Counter:
    """Run one statement (or subscription change) and return the outbox rows the model expects."""
    kind = op[0]
    want: Counter = Counter()
    if kind == "insert":
        _, keys, a = op
        writer.execute(
            f"INSERT INTO {TABLE} SELECT k, %s, 'x', '{{}}' FROM unnest(%s::int[]) k ON CONFLICT DO NOTHING", (a, keys)
        )
        for k in keys:
            if k not in model.rows:
                want += model.insert(k, {"id": k, "a": a, "b": "x", "j": "{}"})
    elif kind == "upsert":
        _, keys, a = op
        writer.execute(
            f"INSERT INTO {TABLE} SELECT k, %s, 'x', '{{}}' FROM unnest(%s::int[]) k "
            "ON CONFLICT (id) DO UPDATE SET a = excluded.a",
            (a, keys),
        )
        for k in keys:
            if k in model.rows:
                want += model.update(k, {"a": a})
            else:
                want += model.insert(k, {"id": k, "a": a, "b": "x", "j": "{}"})
    elif kind == "update":
        _, keys, col, value = op
        cast = {"a": "int", "b": "text", "j": "json"}[col]
        writer.execute(f"UPDATE {TABLE} SET {col} = %s::{cast} WHERE id IN (SELECT unnest(%s::int[]))", (value, keys))
        for k in keys:
            if k in model.rows:
                want += model.update(k, {col: value})
    elif kind == "update2":
        _, keys, a, b = op
        writer.execute(f"UPDATE {TABLE} SET a = %s, b = %s WHERE id = ANY (%s)", (a, b, keys))
        for k in keys:
            if k in model.rows:
                want += model.update(k, {"a": a, "b": b})
    elif kind == "update_all":
        _, a = op
        writer.execute(f"UPDATE {TABLE} SET a = %s", (a,))
        for k in list(model.rows):
            want += model.update(k, {"a": a})
    elif kind == "rekey":
        _, old, new = op
        if old in model.rows and new not in model.rows:
            writer.execute(f"UPDATE {TABLE} SET id = %s WHERE id = %s", (new, old))
            row = dict(model.rows[old], id=new)
            want += model.delete(old)
            want += model.insert(new, row)
    elif kind == "fill":  # 100 rows that no row subscription names (keys 101-200)
        writer.execute(
            f"INSERT INTO {TABLE} SELECT k, 0, 'x', '{{}}' FROM generate_series({FILL_KEYS}) k ON CONFLICT DO NOTHING"
        )
        for k in range(FILL_FIRST, FILL_FIRST + FILL_ROWS):
            if k not in model.rows:
                want += model.insert(k, {"id": k, "a": 0, "b": "x", "j": "{}"})
    elif kind == "shift":  # a bulk key change: every key above 100 moves up by 1,000
        moving = sorted(k for k in model.rows if k > 100)
        # Only onto free keys: a row moving onto the key of one that moves away (fill, shift, fill, shift) makes
        # the UPDATE succeed or fail on the unique key by the order of the heap, and pairs no row with its key.
        if not any(k + 1000 in model.rows for k in moving):
            writer.execute(f"UPDATE {TABLE} SET id = id + 1000 WHERE id > 100")
            rows = {k: dict(model.rows[k], id=k + 1000) for k in moving}
            for k in moving:
                want += model.delete(k)
            for k in moving:
                want += model.insert(k + 1000, rows[k])
    elif kind == "unfill":
        writer.execute(f"DELETE FROM {TABLE} WHERE id > 100")
        for k in [k for k in model.rows if k > 100]:
            want += model.delete(k)
    elif kind == "delete":
        _, keys = op
        writer.execute(f"DELETE FROM {TABLE} WHERE id = ANY (%s)", (keys,))
        for k in keys:
            if k in model.rows:
                want += model.delete(k)
    elif kind in ("subscribe", "unsubscribe"):
        _, i, key = op
        client = sorted(model.clients)[i % len(model.clients)]
        broker = model.clients[client]
        if kind == "subscribe":
            assert subscribe(conns[broker], client, TABLE, key, broker) is ((client, key) not in model.subs)
            model.subs.add((client, key))
        else:
            assert unsubscribe(conns[broker], client, TABLE, key, broker) is ((client, key) in model.subs)
            model.subs.discard((client, key))
    else:  # pragma: no cover
        raise AssertionError(kind)
    return want


def test_outbox_matches_model(connect, watch_mode):
    admin = connect("admin")
    admin.execute(f"CREATE TABLE {TABLE} (id int PRIMARY KEY, a int NOT NULL, b text NOT NULL, j json NOT NULL)")
    watch(admin, TABLE, watch_mode)
    conns = {name: connect(f"broker {name}") for name in BROKERS}
    writer = connect("writer")

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(SCENARIOS)
    # Keys 101-200 filled twice around a shift: the second shift would move rows onto keys others leave.
    @example({"clients": ["a"], "rows": {}, "subs": [(0, None)], "ops": [(("fill",), RC), (("shift",), RC)] * 2})
    def check(scenario: dict) -> None:
        # A new epoch for each broker wipes the clients, subscriptions and outbox of the last example.
        for name, conn in conns.items():
            renew(conn, name)
        writer.execute(f"DELETE FROM {TABLE}")
        assert admin.execute("SELECT count(*) FROM pgbroker.outbox").fetchone() == (0,)
        clients = {f"k{i}": broker for i, broker in enumerate(scenario["clients"])}
        model = Model(clients)
        for key, (a, b, j) in scenario["rows"].items():
            model.rows[key] = {"id": key, "a": a, "b": b, "j": j}
        writer.execute(
            f"INSERT INTO {TABLE} SELECT * FROM unnest(%s::int[], %s::int[], %s::text[], %s::json[])",
            [list(col) for col in zip(*[(k, *v) for k, v in scenario["rows"].items()], strict=True)]
            or [[], [], [], []],
        )
        for client, broker in clients.items():
            register(conns[broker], client, broker)
        for i, key in scenario["subs"]:
            apply(("subscribe", i, key), writer, model, conns)
        assert outbox(conns) == Counter()
        for op, isolation in scenario["ops"]:
            writer.execute(f"SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL {isolation}")
            try:
                want = apply(op, writer, model, conns)
            finally:  # a failed op must not leave the next example's writer at another level
                writer.execute("SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED")
            assert outbox(conns) == want, (op, isolation)
        table = {
            r[0]: {"id": r[0], "a": r[1], "b": r[2], "j": r[3]}
            for r in writer.execute(f"SELECT id, a, b, j::text FROM {TABLE}")
        }
        assert table == model.rows

    check()
