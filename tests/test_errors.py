"""pgbroker.errors, the one place that maps SQLSTATEs: every entry of the map
against an error the real server raised, LeaseHeld's holder fields from a real
refused claim (DETAIL is a JSON object by contract), what loses a broker its
session, and the start-up schema check (SchemaMissing / SchemaMismatch)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from psycopg import errors as pgerrors

from pgbroker import AsyncBroker, Broker, errors, install
from pgbroker.errors import (
    InvalidArgument,
    LeaseHeld,
    NotHolder,
    NotWatchable,
    NotWatched,
    OwnerMismatch,
    PermissionDenied,
    PgBrokerError,
    ReadCommittedRequired,
    SchemaMismatch,
    SchemaMissing,
    StaleEpoch,
    TableBusy,
    UnknownClient,
    translate,
)

Connect = Callable[..., psycopg.Connection]


def server_error(conn: psycopg.Connection, statement: str) -> psycopg.Error:
    """Run ``statement``; it must fail.  Returns the driver's error."""
    with pytest.raises(psycopg.Error) as info:
        conn.execute(statement)
    return info.value


def holder(connect: Connect, name: str = "default") -> psycopg.Connection:
    """A session holding lease ``name``, with client c1 registered."""
    conn = connect("holder")
    conn.execute("SELECT pgbroker.broker_claim(%s)", (name,))
    conn.execute("SELECT pgbroker.client_register('c1', '{}', %s)", (name,))
    return conn


# Each case: (SQLSTATE, class, setup, user, the statement that fails).  setup is SQL the
# superuser runs first, or "claimed" (another session holds the lease) or "holder"; "holder"
# as setup or user runs the statement from a session that holds the lease with client c1.
CASES = [
    ("55P03", LeaseHeld, "claimed", "postgres", "SELECT pgbroker.broker_claim()"),
    ("PB003", OwnerMismatch, "holder", "holder", "SELECT pgbroker.broker_claim()"),
    ("PB001", NotHolder, None, "postgres", "SELECT pgbroker.broker_heartbeat()"),
    ("PB002", StaleEpoch, None, "postgres", "SELECT pgbroker.broker_assert('default', 99)"),
    ("42501", PermissionDenied, None, "t_none", "SELECT pgbroker.broker_claim()"),
    ("22023", InvalidArgument, None, "postgres", "SELECT pgbroker.broker_claim('')"),
    ("22004", InvalidArgument, None, "postgres", "SELECT pgbroker.broker_claim(NULL)"),
    (
        "22003",
        InvalidArgument,
        "SELECT pgbroker.counter_add('big', 9223372036854775807)",
        "postgres",
        "SELECT pgbroker.counter_add('big', 1)",
    ),
    ("22P02", InvalidArgument, "holder", "postgres", "SELECT pgbroker.subscribe('c1', 'initech.objects', '\"x\"')"),
    ("42602", InvalidArgument, "holder", "postgres", "SELECT pgbroker.subscribe('c1', '\"bad', '1')"),
    ("PB010", UnknownClient, "holder", "postgres", "SELECT pgbroker.client_update('nobody', '{}')"),
    (
        "PB011",
        ReadCommittedRequired,
        "holder",
        "holder",
        "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT pgbroker.client_unregister('c1')",
    ),
    ("PB020", NotWatchable, "CREATE TABLE public.nokey (a int)", "postgres", "SELECT pgbroker.watch('public.nokey')"),
    ("42809", NotWatchable, "CREATE VIEW public.v AS SELECT 1 AS a", "postgres", "SELECT pgbroker.watch('public.v')"),
    ("42P01", NotWatchable, None, "postgres", "SELECT pgbroker.watch('public.no_such_table')"),
    # Filters (issue 43): an unknown column, too many combinations of values, a column with no equality.
    (
        "42703",
        InvalidArgument,
        "holder",
        "holder",
        """SELECT pgbroker.subscribe('c1', 'initech.objects', filter => '{"nosuch": 1}')""",
    ),
    (
        "54000",
        InvalidArgument,
        "holder",
        "holder",
        "SELECT pgbroker.subscribe('c1', 'initech.objects', filter => jsonb_build_object("
        "'id', jsonb_build_object('in', (SELECT jsonb_agg(i) FROM generate_series(1, 40) i)),"
        "'name', jsonb_build_object('in', (SELECT jsonb_agg(i::text) FROM generate_series(1, 40) i))))",
    ),
    (
        "PB023",
        InvalidArgument,
        "CREATE TABLE public.withjson (id int PRIMARY KEY, doc json); SELECT pgbroker.watch('public.withjson')",
        "holder",
        """SELECT pgbroker.subscribe('c1', 'public.withjson', filter => '{"doc": {"eq": 1}}')""",
    ),
    (
        "PB021",
        NotWatched,
        "CREATE TABLE public.unwatched (id int PRIMARY KEY)",
        "holder",
        "SELECT pgbroker.subscribe('c1', 'public.unwatched', '1')",
    ),
]


def test_every_sqlstate_of_the_map_has_a_case():
    # PB022 has a test of its own below (it needs an open writer transaction).
    assert {case[0] for case in CASES} | {"PB022"} == set(errors._BY_SQLSTATE)


@pytest.mark.parametrize(("sqlstate", "cls", "setup", "user", "statement"), CASES, ids=[c[0] for c in CASES])
def test_server_error_translates_to_its_class(connect: Connect, sqlstate, cls, setup, user, statement):
    admin = connect("admin")
    if setup == "claimed":
        holder(connect)
    elif setup and setup != "holder":
        admin.execute(setup)
    conn = holder(connect) if "holder" in (setup, user) else connect("caller", user=user)
    exc = server_error(conn, statement)
    assert exc.sqlstate == sqlstate, exc
    new = translate(exc)
    assert type(new) is cls
    assert new.sqlstate == sqlstate and new.__cause__ is exc
    assert str(new) == exc.diag.message_primary
    assert (new.detail, new.hint) == (exc.diag.message_detail, exc.diag.message_hint)


def test_pb022_table_busy_when_a_writer_stays_open(connect: Connect):
    broker = holder(connect)
    writer = connect("writer", autocommit=False)
    writer.execute("INSERT INTO initech.objects (id, name) VALUES (1, 'a')")  # past its trigger, still open
    exc = server_error(broker, "SELECT pgbroker.subscribe('c1', 'initech.objects', '1', wait => '50 ms')")
    writer.rollback()
    assert exc.sqlstate == "PB022"
    new = translate(exc)
    assert type(new) is TableBusy and new.__cause__ is exc


def test_errors_of_other_sqlstates_are_database_errors(connect: Connect):
    """No raw psycopg error leaves the public API: an SQLSTATE no class names is a DatabaseError."""
    exc = server_error(connect(), "SELECT 1/0")
    new = translate(exc)
    assert type(new) is errors.DatabaseError and isinstance(new, PgBrokerError)
    assert (new.sqlstate, str(new), new.__cause__) == ("22012", "division by zero", exc)
    closed = connect()
    closed.close()
    with pytest.raises(psycopg.OperationalError) as info:
        closed.execute("SELECT 1")
    lost = translate(info.value)
    assert type(lost) is errors.DatabaseError and lost.sqlstate is None


# ---------------------------------------------------------------------------
# LeaseHeld: the holder, from the JSON DETAIL (the SQL's contract)


def test_lease_held_names_the_recorded_holder(connect: Connect):
    a = connect("first-app")
    a.execute("SELECT pgbroker.broker_claim('solo', info => 'node-a')")
    a.execute("SELECT pgbroker.broker_heartbeat('solo')")
    exc = server_error(connect("second"), "SELECT pgbroker.broker_claim('solo')")
    held = translate(exc)
    assert isinstance(held, LeaseHeld)
    expected = ("solo", a.info.backend_pid, "first-app", "127.0.0.1", "postgres", "node-a", 1)
    assert (held.name, held.pid, held.application, held.address, held.user, held.info, held.epoch) == expected
    claimed_at, heartbeat_at = a.execute(
        "SELECT claimed_at, heartbeat_at FROM pgbroker.brokers WHERE name = 'solo'"
    ).fetchone()
    assert (held.since, held.heartbeat_at) == (claimed_at, heartbeat_at)
    assert held.recorded_pid is None and held.state is None
    assert held.detail == exc.diag.message_detail


def test_lease_held_names_a_session_that_is_not_the_recorded_holder(connect: Connect):
    """A stray lock (the documented SET CONSTRAINTS ALL IMMEDIATE + ROLLBACK leak; see test_no_leak.py)."""
    a, b = connect("A"), connect("B")
    b.execute("SELECT pgbroker.broker_claim()")
    b.execute("SELECT pgbroker.broker_release()")
    a.execute("BEGIN")
    a.execute("SELECT pgbroker.broker_claim()")
    a.execute("SET CONSTRAINTS ALL IMMEDIATE")
    a.execute("ROLLBACK")
    held = translate(server_error(b, "SELECT pgbroker.broker_claim()"))
    assert isinstance(held, LeaseHeld)
    assert (held.name, held.pid, held.state, held.epoch) == ("default", a.info.backend_pid, "released", 1)
    assert held.recorded_pid in (None, b.info.backend_pid)
    assert held.since is None and held.application is None


def test_broker_claim_raises_lease_held_with_the_holder(db_url):
    with Broker(db_url, "solo", info="node-a") as a:
        with pytest.raises(LeaseHeld) as info:
            Broker(db_url, "solo").claim()
        assert (info.value.pid, info.value.info, info.value.epoch) == (a.pid, "node-a", a.epoch)
        assert info.value.heartbeat_at is not None

        async def refused() -> LeaseHeld:
            with pytest.raises(LeaseHeld) as ainfo:
                await AsyncBroker(db_url, "solo").claim()
            return ainfo.value

        assert asyncio.run(refused()).pid == a.pid


@pytest.mark.parametrize("detail", [None, "", "holder_pid=1 epoch=2", "[1, 2]", '{"pid": "7", "since": "yesterday"}'])
def test_lease_held_tolerates_a_detail_that_is_not_the_json_object(detail):
    held = LeaseHeld("held", sqlstate="55P03", detail=detail)
    assert held.detail == detail
    assert [held.name, held.pid, held.epoch, held.since, held.heartbeat_at, held.recorded_pid] == [None] * 6


def test_lease_held_reads_timestamps_of_any_precision():
    held = LeaseHeld(
        "held", detail='{"since": "2026-12-01T01:57:03.69+00:00", "heartbeat_at": "2026-12-01T02:00:00+01"}'
    )
    assert held.since == datetime(2026, 12, 1, 1, 57, 3, 690000, tzinfo=timezone.utc)
    assert held.heartbeat_at == datetime(2026, 12, 1, 2, tzinfo=timezone(timedelta(hours=1)))


# ---------------------------------------------------------------------------
# Which errors mean the broker session is gone


def test_session_lost_for_a_terminated_backend_not_for_an_sql_error(connect: Connect):
    victim, other = connect("victim"), connect("other")
    stale = server_error(victim, "SELECT pgbroker.broker_assert('default', 99)")
    assert not errors.is_session_lost(victim, stale)
    not_holder = server_error(victim, "SELECT pgbroker.broker_heartbeat()")
    assert errors.is_session_lost(victim, not_holder)  # PB001: the lease is not this session's
    other.execute("SELECT pg_terminate_backend(%s)", (victim.info.backend_pid,))
    gone = server_error(victim, "SELECT 1")
    assert errors.is_session_lost(victim, gone)


# ---------------------------------------------------------------------------
# The start-up check: pgbroker.schema_version()


def test_installed_schema_passes_the_check(db_url):
    assert install.SCHEMA_VERSION
    with Broker(db_url, "checked") as b:
        assert b.epoch == 1


def test_database_without_pgbroker_is_schema_missing(empty_db):
    with pytest.raises(SchemaMissing) as info:
        Broker(empty_db).claim()
    err = info.value
    assert type(err) is SchemaMissing and isinstance(err, PgBrokerError)
    assert err.sqlstate == "3F000" and isinstance(err.__cause__, pgerrors.InvalidSchemaName)
    assert "not installed" in str(err) and "pgbroker migrate" in str(err)

    async def refused() -> SchemaMissing:
        with pytest.raises(SchemaMissing) as ainfo:
            await AsyncBroker(empty_db).claim()
        return ainfo.value

    assert asyncio.run(refused()).sqlstate == "3F000"


def test_schema_without_the_version_function_is_schema_missing(empty_db):
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA pgbroker")
    with pytest.raises(SchemaMissing) as info:
        Broker(empty_db).claim()
    assert info.value.sqlstate == "42883" and "pgbroker migrate" in str(info.value)


def test_a_call_with_mistyped_arguments_is_not_schema_missing(connect, empty_db):
    """42883 also means "no signature takes these types" (PgJDBC's varchar for a jsonb): never SchemaMissing,
    and the catalog tells the two apart, as sql/README.md ("SQLSTATEs") says."""
    conn = connect("typed")
    mistyped = server_error(conn, "SELECT pgbroker.kv_set('k'::varchar, '{}'::varchar)")
    assert mistyped.sqlstate == "42883"
    new = translate(mistyped)
    assert type(new) is errors.DatabaseError and new.sqlstate == "42883" and new.__cause__ is mistyped
    assert conn.execute(
        "SELECT pgbroker.schema_version() IS NOT NULL, to_regproc('pgbroker.kv_set') IS NOT NULL"
    ).fetchone() == (True, True)
    assert conn.execute("SELECT count(*) FROM pgbroker.kv").fetchone() == (0,)
    with psycopg.connect(empty_db, autocommit=True) as bare:
        missing = server_error(bare, "SELECT pgbroker.schema_version()")
        assert bare.execute("SELECT to_regnamespace('pgbroker'), to_regproc('pgbroker.kv_set')").fetchone() == (
            None,
            None,
        )
    assert type(errors.schema_error(missing, "empty")) is SchemaMissing


def test_other_schema_version_is_schema_mismatch(empty_db):
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA pgbroker")
        conn.execute("CREATE FUNCTION pgbroker.schema_version() RETURNS text LANGUAGE sql AS $$ SELECT 'nope' $$")
    with pytest.raises(SchemaMismatch) as info:
        Broker(empty_db).claim()
    message = str(info.value)
    assert "nope" in message and install.SCHEMA_VERSION in message and "pgbroker migrate" in message
    assert isinstance(info.value, SchemaMissing)


def test_no_right_to_the_version_function_is_permission_denied(empty_db, pg_server, template_db):
    dbname = psycopg.conninfo.conninfo_to_dict(empty_db)["dbname"]
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA pgbroker")
        conn.execute("CREATE FUNCTION pgbroker.schema_version() RETURNS text LANGUAGE sql AS $$ SELECT 'x' $$")
        conn.execute("GRANT USAGE ON SCHEMA pgbroker TO PUBLIC")
        conn.execute("REVOKE EXECUTE ON FUNCTION pgbroker.schema_version() FROM PUBLIC")
    with pytest.raises(PermissionDenied) as info:
        Broker(pg_server.url_for(dbname, user="t_none")).claim()
    assert info.value.sqlstate == "42501"
