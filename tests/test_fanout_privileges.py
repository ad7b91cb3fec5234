"""Who may do what in the fan-out area (sql/900_privileges.sql, second part)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from fanout_util import claim, drain, listen, notifies, register, seed_objects, sleep, subscribe, wake

VIEWS = ("clients", "subscriptions", "watched_tables", "outbox_pending")
BROKER_CALLS = (
    "SELECT pgbroker.client_register('x')",
    "SELECT pgbroker.client_update('x', '{}')",
    "SELECT pgbroker.client_unregister('x')",
    "SELECT pgbroker.client_unregister_many(ARRAY['x'])",
    "SELECT pgbroker.subscribe('x', 'initech.objects', '1')",
    "SELECT pgbroker.unsubscribe('x', 'initech.objects', '1')",
    "SELECT pgbroker.subscribe('x', 'initech.objects', filter => '{\"kind\": \"a\"}')",
    "SELECT pgbroker.subscribe_filters(ARRAY['x'], 'initech.objects', ARRAY['{\"kind\": \"a\"}'::jsonb])",
    "SELECT pgbroker.unsubscribe('x', 'initech.objects', filter => '{\"kind\": \"a\"}')",
    "SELECT * FROM pgbroker.outbox_fetch('default', 10)",
    "SELECT pgbroker.outbox_ack('default', '{1}')",
    "SELECT pgbroker.broker_wake()",
    "SELECT pgbroker.broker_sleep()",
)
TABLES = ("outbox", "client", "subscription", "interest", "watched")


def denied(conn: psycopg.Connection, statement: str) -> str:
    with pytest.raises(psycopg.Error) as err:
        conn.execute(statement)
    return err.value.sqlstate


@pytest.fixture
def populated(connect):
    """A live broker with a client subscribed to row 1 and one pending notification."""
    broker, admin = connect("broker"), connect("admin")
    claim(broker)
    seed_objects(admin, [1, 2])
    register(broker, "c1", info={"addr": "10.1.1.1"})
    subscribe(broker, "c1", key=1)
    admin.execute("UPDATE initech.objects SET name = 'changed' WHERE id = 1")
    return broker


@pytest.fixture
def writer_role(pg_server, connect) -> Iterator[str]:
    """A login role with rights on initech.objects only."""
    role = f"t_writer_{uuid.uuid4().hex[:8]}"
    admin = connect("admin")
    admin.execute(f"CREATE ROLE {role} LOGIN")
    admin.execute(f"GRANT USAGE ON SCHEMA initech TO {role}")
    admin.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON initech.objects TO {role}")
    try:
        yield role
    finally:
        admin.execute(f"DROP OWNED BY {role}")
        admin.execute(f"DROP ROLE {role}")


def test_reader_sees_the_views_and_nothing_else(connect, populated):
    reader = connect("frontend", user="t_reader")
    assert reader.execute("SELECT name, client_id, info, subscriptions FROM pgbroker.clients").fetchall() == [
        ("default", "c1", {"addr": "10.1.1.1"}, 1)
    ]
    assert reader.execute('SELECT client_id, "table"::text, key FROM pgbroker.subscriptions').fetchall() == [
        ("c1", "initech.objects", 1)
    ]
    assert reader.execute('SELECT "table"::text, key_columns FROM pgbroker.watched_tables').fetchall() == [
        ("initech.objects", ["id"])
    ]
    assert reader.execute("SELECT name, pending FROM pgbroker.outbox_pending").fetchall() == [("default", 1)]
    for call in BROKER_CALLS:
        assert denied(reader, call) == "42501", call
    for table in TABLES:
        assert denied(reader, f"SELECT * FROM pgbroker.{table}") == "42501", table
    # Nor the admin or internal functions (EXECUTE is revoked from PUBLIC).
    for call in (
        "SELECT pgbroker.watch('initech.objects')",
        "SELECT pgbroker.unwatch('initech.objects')",
        "SELECT pgbroker._awake_held(1)",
        "SELECT pgbroker._interest_shrink('{1}', '{1}', '{default}', '{1}', '{x}')",
        "SELECT * FROM pgbroker._outbox_fetch_departed('default', 1, 0, 10, NULL)",
        "SELECT pgbroker._acting_epoch('default', 1)",
    ):
        assert denied(reader, call) == "42501", call


def test_role_without_pgbroker_rights_sees_nothing(connect, populated):
    nobody = connect("nobody", user="t_none")
    for view in VIEWS:
        assert denied(nobody, f"SELECT * FROM pgbroker.{view}") == "42501", view
    assert denied(nobody, "SELECT pgbroker.client_register('x')") == "42501"


def test_writer_role_triggers_run_but_it_cannot_read_the_outbox(connect, populated, writer_role, watch_mode):
    broker = populated
    drain(broker)
    listen(broker)
    writer = connect("app", user=writer_role)
    writer.execute("UPDATE initech.objects SET config = '{\"v\": 1}' WHERE id = 1")
    writer.execute("INSERT INTO initech.objects (id) VALUES (3)")
    writer.execute("DELETE FROM initech.objects WHERE id = 1")
    # Two transactions had subscribers (the INSERT of row 3 had none): two wake-ups.
    assert [n.payload for n in notifies(broker, 0.5)] == ["default", "default"]
    assert [(r["op"], r["key"], r["changed"], r["clients"]) for r in drain(broker)] == [
        ("U", 1, ["config"], ["c1"]),
        ("D", 1, None, ["c1"]),
    ]
    for table in TABLES:
        assert denied(writer, f"SELECT * FROM pgbroker.{table}") == "42501", table
    assert denied(writer, "SELECT * FROM pgbroker.outbox_fetch('default', 10)") == "42501"
    assert denied(writer, "SELECT pgbroker._watch_1_upd()") == "42501"
    assert denied(writer, "SELECT pgbroker._awake_held(1)") == "42501"
    # A writer in REPEATABLE READ goes through the same (privileged) check.
    with writer.transaction():
        writer.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        writer.execute("INSERT INTO initech.objects (id) VALUES (1)")
    assert [(r["op"], r["key"]) for r in drain(broker)] == [("I", 1)]


def test_writer_role_moves_rows_in_and_out_of_filters(connect, writer_role, watch_mode):
    """Filters (issue 43): the triggers of a table with filters run with pgbroker's rights, not the writer's."""
    broker = connect("broker", user="t_broker")
    claim(broker)
    register(broker, "gears")
    broker.execute("""SELECT pgbroker.subscribe('gears', 'initech.objects', filter => '{"kind": "gear"}')""")
    writer = connect("app", user=writer_role)
    writer.execute("INSERT INTO initech.objects (id, kind) VALUES (1, 'gear'), (2, 'bolt')")
    writer.execute("UPDATE initech.objects SET kind = 'nut'")
    assert [(r["op"], r["key"], r["clients"], r["left"]) for r in drain(broker)] == [
        ("I", 1, ["gears"], None),
        ("U", 1, ["gears"], ["gears"]),
    ]
    for table in (*TABLES, "filter_shape"):
        assert denied(writer, f"SELECT * FROM pgbroker.{table}") == "42501", table


def test_broker_role_runs_the_broker_but_cannot_watch(connect, writer_role):
    broker = connect("broker", user="t_broker")
    admin = connect("admin")
    seed_objects(admin, [1])
    epoch = claim(broker)
    assert register(broker, "c1") is True
    assert subscribe(broker, "c1", key=1) is True
    listen(broker)
    wake(broker)
    admin.execute("UPDATE initech.objects SET name = 'n'")
    assert sleep(broker) == "pending"
    assert [(r["op"], r["key"]) for r in drain(broker)] == [("U", 1)]
    assert sleep(broker) == "asleep"
    assert broker.execute("SELECT pgbroker.unsubscribe('c1', 'initech.objects', '1')").fetchone() == (True,)
    assert broker.execute("SELECT pgbroker.client_unregister('c1', epoch => %s)", (epoch,)).fetchone() == (True,)
    admin.execute("CREATE TABLE public.other (id int PRIMARY KEY)")
    assert denied(broker, "SELECT pgbroker.watch('public.other')") == "42501"
    assert denied(broker, "SELECT pgbroker.unwatch('initech.objects')") == "42501"
    for table in TABLES:
        assert denied(broker, f"SELECT * FROM pgbroker.{table}") == "42501", table


def test_admin_can_watch_and_unwatch(connect):
    admin = connect("admin", user="t_admin")
    su = connect("superuser")
    su.execute("CREATE TABLE public.other (id int PRIMARY KEY, v text)")
    watch_id = admin.execute("SELECT pgbroker.watch('public.other')").fetchone()[0]
    assert admin.execute("SELECT pgbroker.watch('public.other')").fetchone() == (watch_id,)  # idempotent
    triggers = su.execute(
        "SELECT tgname FROM pg_trigger WHERE tgrelid = 'public.other'::regclass ORDER BY 1"
    ).fetchall()
    assert [t[0] for t in triggers] == [
        "_pgbroker_watch_del",
        "_pgbroker_watch_ins",
        "_pgbroker_watch_trunc",
        "_pgbroker_watch_upd",
    ]
    # An admin is a broker too.
    claim(admin)
    register(admin, "c")
    subscribe(admin, "c", "public.other")
    su.execute("INSERT INTO public.other VALUES (1, 'a')")
    assert [(r["table"], r["op"], r["key"]) for r in drain(admin)] == [("public.other", "I", 1)]
    assert admin.execute("SELECT pgbroker.unwatch('public.other')").fetchone() == (True,)
    assert admin.execute("SELECT pgbroker.unwatch('public.other')").fetchone() == (False,)
    assert su.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid = 'public.other'::regclass").fetchone() == (0,)
    assert su.execute(
        "SELECT count(*) FROM pg_proc WHERE proname LIKE %s", (f"\\_watch\\_{watch_id}\\_%",)
    ).fetchone() == (0,)
    assert su.execute("SELECT count(*) FROM pgbroker.subscription").fetchone() == (0,)
    su.execute("INSERT INTO public.other VALUES (2, 'b')")
    assert drain(admin) == []
