"""Bad input to watch / subscribe / the registry: a clear SQLSTATE and nothing half-installed."""

from __future__ import annotations

import psycopg
import pytest
from fanout_util import claim, pgbroker_state_counts, register, watch

STATEMENTS_WATCH = [
    ("SELECT pgbroker.watch('public.nokey')", "PB020"),
    ("SELECT pgbroker.watch('public.a_view')", "42809"),
    ("SELECT pgbroker.watch('public.does_not_exist')", "42P01"),
    ("""SELECT pgbroker.watch('public."no such"" table"')""", "42P01"),
    ("""SELECT pgbroker.watch('pub"lic. x y')""", "42602"),
    ("SELECT pgbroker.watch(NULL)", "22004"),
    ("SELECT pgbroker.watch('pgbroker.outbox')", "42809"),
    ("SELECT pgbroker.watch('initech.objects', mode => 'rows')", "22023"),
    ("SELECT pgbroker.watch('initech.objects', mode => NULL)", "22023"),
]


def error_of(conn: psycopg.Connection, statement: str, params: tuple = ()) -> str:
    with pytest.raises(psycopg.Error) as err:
        conn.execute(statement, params)
    return err.value.sqlstate


def generated(conn: psycopg.Connection) -> tuple[int, int]:
    """pgbroker triggers in the database and generated trigger functions."""
    triggers = conn.execute("SELECT count(*) FROM pg_trigger WHERE tgname LIKE '\\_pgbroker\\_watch\\_%'").fetchone()[0]
    functions = conn.execute(
        "SELECT count(*) FROM pg_proc WHERE pronamespace = 'pgbroker'::regnamespace AND proname ~ '^_watch_[0-9]+_'"
    ).fetchone()[0]
    return triggers, functions


@pytest.mark.parametrize(("statement", "code"), STATEMENTS_WATCH)
def test_watch_rejects_bad_tables_and_installs_nothing(connect, statement, code):
    admin = connect("admin", user="t_admin")
    su = connect("superuser")
    su.execute("CREATE TABLE public.nokey (a int, b text)")
    su.execute("CREATE VIEW public.a_view AS SELECT * FROM initech.objects")
    before = generated(su), pgbroker_state_counts(su)
    assert error_of(admin, statement) == code
    assert (generated(su), pgbroker_state_counts(su)) == before
    assert before[0] == (4, 4)  # initech.objects only
    assert su.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid = 'public.nokey'::regclass").fetchone() == (0,)
    assert su.execute("SELECT mode FROM pgbroker.watched_tables").fetchall() == [("statement",)]


def test_unwatch_of_an_unwatched_table_is_false(connect):
    su = connect("superuser")
    su.execute("CREATE TABLE public.plain (id int PRIMARY KEY)")
    assert su.execute("SELECT pgbroker.unwatch('public.plain')").fetchone() == (False,)
    assert generated(su) == (4, 4)


@pytest.fixture
def broker(connect):
    su = connect("superuser")
    su.execute("CREATE TABLE public.unwatched (id int PRIMARY KEY)")
    su.execute("CREATE TABLE public.pair (region text, n int, PRIMARY KEY (region, n))")
    su.execute("SELECT pgbroker.watch('public.pair')")
    conn = connect("broker")
    claim(conn)
    register(conn, "c1")
    return conn


SUBSCRIBE_CASES = [
    (("nobody", "initech.objects", "1"), "PB010"),  # unknown client
    (("c1", "public.unwatched", "1"), "PB021"),  # table not watched
    (("c1", "public.missing", "1"), "42P01"),
    (("c1", "initech.objects", "[1]"), "22023"),  # array for a one-column key
    (("c1", "initech.objects", '{"id": 1}'), "22023"),
    (("c1", "initech.objects", '"abc"'), "22P02"),  # does not cast to bigint
    (("c1", "initech.objects", "1.5"), "22P02"),
    (("c1", "public.pair", '"eu"'), "22023"),  # scalar for a composite key
    (("c1", "public.pair", '["eu"]'), "22023"),  # too short
    (("c1", "public.pair", '["eu", 1, 2]'), "22023"),  # too long
    (("c1", "public.pair", '["eu", null]'), "22023"),
    (("c1", "public.pair", '["eu", "x"]'), "22P02"),
    ((None, "initech.objects", "1"), "PB010"),
    (("c1", None, "1"), "22004"),
]


@pytest.mark.parametrize(("args", "code"), SUBSCRIBE_CASES)
def test_subscribe_rejects_bad_input_and_leaves_nothing(connect, broker, args, code):
    su = connect("superuser")
    before = pgbroker_state_counts(su)
    assert error_of(broker, "SELECT pgbroker.subscribe(%s, %s::regclass, %s::jsonb)", args) == code
    assert error_of(broker, "SELECT pgbroker.unsubscribe(%s, %s::regclass, %s::jsonb)", args) == code
    assert pgbroker_state_counts(su) == before
    assert before["subscription"] == 0 and before["interest"] == 0


def test_registry_and_delivery_reject_bad_arguments(connect, broker):
    cases = [
        ("SELECT pgbroker.client_register(NULL)", "22004"),
        ("SELECT pgbroker.client_register('')", "22023"),
        ("SELECT pgbroker.client_register(repeat('x', 201))", "22023"),
        ("SELECT pgbroker.client_register('c2', name => NULL)", "22004"),
        ("SELECT pgbroker.client_register('c2', name => 'not held')", "PB001"),
        ("SELECT pgbroker.client_update('nobody', '{}')", "PB010"),
        ("SELECT * FROM pgbroker.outbox_fetch('default', 0)", "22023"),
        ("SELECT * FROM pgbroker.outbox_fetch('default', NULL)", "22023"),
        ("SELECT * FROM pgbroker.outbox_fetch('not held', 10)", "PB001"),
        ("SELECT pgbroker.outbox_ack('not held', '{1}')", "PB001"),
        ("SELECT pgbroker.broker_sleep('default', '-1 s')", "22023"),
    ]
    for statement, code in cases:
        assert error_of(broker, statement) == code, statement
    assert broker.execute("SELECT client_id FROM pgbroker.clients").fetchall() == [("c1",)]
    assert broker.execute("SELECT pgbroker.client_unregister('nobody')").fetchone() == (False,)
    assert broker.execute("SELECT pgbroker.wakeup_channel('never claimed')").fetchone() == (None,)


def test_subscribe_refuses_a_table_whose_triggers_are_gone_or_disabled(connect, watch_mode):
    su, broker = connect("superuser"), connect("broker")
    su.execute("CREATE TABLE public.fragile (id int PRIMARY KEY, v int)")
    watch(su, "public.fragile", watch_mode)
    claim(broker)
    register(broker, "c")
    before = pgbroker_state_counts(su)
    for broken, mend in (
        ("ALTER TABLE public.fragile DISABLE TRIGGER _pgbroker_watch_upd",
         "ALTER TABLE public.fragile ENABLE TRIGGER _pgbroker_watch_upd"),
        ("DROP TRIGGER _pgbroker_watch_del ON public.fragile",
         f"SELECT pgbroker.watch('public.fragile', mode => '{watch_mode}')"),
    ):  # fmt: skip
        su.execute(broken)
        assert error_of(broker, "SELECT pgbroker.subscribe('c', 'public.fragile', '1')") == "PB021"
        assert pgbroker_state_counts(su) == before
        su.execute(mend)
        assert broker.execute("SELECT pgbroker.subscribe('c', 'public.fragile', '1')").fetchone() == (True,)
        assert broker.execute("SELECT pgbroker.unsubscribe('c', 'public.fragile', '1')").fetchone() == (True,)


def test_a_dropped_watched_table_is_unwatched_by_its_old_oid(connect):
    # A table dropped without unwatch() leaves its watch behind; unwatch() takes its old oid.
    su, broker = connect("superuser"), connect("broker")
    su.execute("CREATE TABLE public.gone (id int PRIMARY KEY)")
    oid = su.execute("SELECT pgbroker.watch('public.gone'), 'public.gone'::regclass::oid").fetchone()[1]
    claim(broker)
    register(broker, "c")
    broker.execute("SELECT pgbroker.subscribe('c', 'public.gone', '1')")
    su.execute("DROP TABLE public.gone")
    assert su.execute("SELECT pgbroker.unwatch(%s::oid::regclass)", (oid,)).fetchone() == (True,)
    assert generated(su) == (4, 4)  # initech.objects' only
    assert su.execute("SELECT count(*) FROM pgbroker.subscription").fetchone() == (0,)
