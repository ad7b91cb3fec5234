"""Who may do what: pgbroker_reader reads, pgbroker_broker claims,
pgbroker_admin takes over, nobody else does anything; and the API is not
fooled by a hostile search_path."""

from __future__ import annotations

import psycopg
import pytest
from conftest import advisory_locks
from lease_util import claim, history, lease_row
from psycopg import errors

from pgbroker import install

VIEWS = ["pgbroker.brokers", "pgbroker.lease_history", "pgbroker.broker_state"]
TABLES = ["pgbroker.lease", "pgbroker.lease_event", "pgbroker.state", "pgbroker.installed"]
API_CALLS = [
    "SELECT pgbroker.broker_claim()",
    "SELECT pgbroker.broker_release()",
    "SELECT pgbroker.broker_heartbeat()",
    "SELECT pgbroker.broker_assert('default', 1)",
    "SELECT pgbroker.broker_state_set('default', 'k', '1')",
    "SELECT pgbroker.broker_state_delete('default', 'k')",
]
INTERNAL_CALLS = [
    "SELECT pgbroker._lease_takeover('default')",
    "SELECT pgbroker._lease_terminate('default', pg_backend_pid())",
    "SELECT pgbroker._lease_takeover_stale('default', '1 microsecond')",
    "SELECT pgbroker._lease_sweep()",
    "SELECT pgbroker._set_database_search_path(false)",
    "SELECT pgbroker.lease_history_prune('0')",
]


def _denied(conn: psycopg.Connection, sql: str) -> str:
    with pytest.raises(errors.InsufficientPrivilege) as info:
        conn.execute(sql)
    assert info.value.sqlstate == "42501"
    return info.value.diag.message_primary


@pytest.fixture
def held(connect):
    """Lease 'default' held by a superuser session, with some state."""
    holder = connect("holder")
    epoch = claim(holder)
    holder.execute("SELECT pgbroker.broker_state_set('default', 'k', '1')")
    return holder, epoch


def test_reader_reads_the_views_and_nothing_else(connect, held):
    holder, epoch = held
    reader = connect("reader", user="t_reader")
    row = lease_row(reader)
    assert (row["epoch"], row["holder_pid"], row["alive"]) == (epoch, holder.info.backend_pid, True)
    assert [e["event"] for e in history(reader)] == ["claim"]
    assert reader.execute("SELECT key, value FROM pgbroker.broker_state").fetchall() == [("k", 1)]
    for sql in API_CALLS + INTERNAL_CALLS:
        assert "permission denied" in _denied(reader, sql), sql
    for table in TABLES:
        assert "permission denied" in _denied(reader, f"SELECT * FROM {table}")
    _denied(reader, "INSERT INTO pgbroker.lease (name) VALUES ('x')")
    assert advisory_locks(holder, reader.info.backend_pid) == []
    assert lease_row(holder)["epoch"] == epoch


def test_a_role_without_pgbroker_roles_can_do_nothing(connect, held):
    nobody = connect("nobody", user="t_none")
    for sql in [f"SELECT * FROM {v}" for v in VIEWS + TABLES] + API_CALLS + INTERNAL_CALLS:
        assert "permission denied for " in _denied(nobody, sql), sql
    # PUBLIC has USAGE on the schema, so an unqualified call finds the function
    # and the role is told it lacks the right to call it, not that it is missing.
    assert "permission denied for function broker_claim" in _denied(nobody, "SELECT broker_claim()")
    assert nobody.execute("SELECT pgbroker.schema_version()").fetchone()[0] == install.SCHEMA_VERSION


def test_broker_claims_releases_heartbeats_and_asserts(connect):
    broker, other = connect("broker", user="t_broker"), connect("other", user="t_broker")
    epoch = claim(broker, owner="b-1")
    assert claim(broker, wait="1s", stale_after="1h", info="host-1", owner="b-1") == epoch
    assert broker.execute("SELECT pgbroker.broker_heartbeat()").fetchone()[0] is not None
    broker.execute("SELECT pgbroker.broker_assert('default', %s)", (epoch,))
    other.execute("SELECT pgbroker.broker_assert('default', %s)", (epoch,))
    broker.execute("SELECT pgbroker.broker_state_set('default', 'k', '1')")
    assert broker.execute("SELECT pgbroker.broker_state_delete('default', 'k')").fetchone()[0] is True
    with pytest.raises(errors.LockNotAvailable):
        claim(other)
    assert broker.execute("SELECT pgbroker.broker_release('default', 'b-1')").fetchone()[0] is True
    assert claim(other) == epoch + 1
    for table in TABLES:
        _denied(broker, f"SELECT * FROM {table}")
    _denied(broker, "UPDATE pgbroker.lease SET holder_pid = 1")
    for sql in INTERNAL_CALLS:
        assert "permission denied" in _denied(broker, sql), sql


def test_broker_cannot_take_over(connect, held):
    holder, epoch = held
    broker, obs = connect("broker", user="t_broker"), connect("obs")
    before = history(obs)
    message = _denied(broker, "SELECT pgbroker.broker_claim(takeover => true)")
    assert 'take over lease "default"' in message and "pgbroker_admin" in message
    _denied(broker, "SELECT pgbroker.broker_claim('default', NULL, true)")  # positional, wait forever
    _denied(broker, "SELECT pgbroker.broker_claim('nobody-holds-this', takeover => true)")
    # Nothing changed: the holder is alive and still holds the same epoch.
    assert holder.execute("SELECT 1").fetchone() == (1,)
    row = lease_row(obs)
    assert (row["epoch"], row["holder_pid"], row["alive"]) == (epoch, holder.info.backend_pid, True)
    assert history(obs) == before
    assert lease_row(obs, "nobody-holds-this") is None
    assert advisory_locks(obs, broker.info.backend_pid) == []
    # Nor through the internal function that takeover => true uses.
    _denied(broker, "SELECT pgbroker._lease_takeover('default')")
    assert holder.execute("SELECT 1").fetchone() == (1,)


def test_broker_cannot_forge_a_takeover_through_the_internal_claim(connect, held):
    """_lease_claim(..., p_terminated) records a takeover of that pid: no pgbroker role may call it."""
    holder, epoch = held
    broker, obs = connect("broker", user="t_broker"), connect("obs")
    before = history(obs)
    for sql in [
        "SELECT pgbroker._lease_claim('default', '0', pg_backend_pid(), NULL, 'forged', NULL, NULL, false)",
        "SELECT pgbroker._lease_claim('default', '0', NULL, '-1 hour', NULL, NULL, NULL, true)",
    ]:
        assert "permission denied for function _lease_claim" in _denied(broker, sql)
    assert holder.execute("SELECT 1").fetchone() == (1,)
    assert lease_row(holder)["epoch"] == epoch
    assert history(obs) == before


def test_admin_can_do_everything(connect, held):
    holder, epoch = held
    admin = connect("admin", user="t_admin")
    assert lease_row(admin)["epoch"] == epoch
    assert claim(admin, takeover=True) == epoch + 1
    admin.execute("SELECT pgbroker.broker_heartbeat()")
    assert admin.execute("SELECT pgbroker.lease_history_prune('1 day')").fetchone()[0] == 0
    assert admin.execute("SELECT pgbroker.lease_history_prune('0')").fetchone()[0] == 2
    assert history(admin) == []


def test_public_has_no_rights(connect):
    obs = connect("obs")
    rows = obs.execute(
        """
        SELECT p.oid::regprocedure::text FROM pg_proc p
         WHERE p.pronamespace = 'pgbroker'::regnamespace AND has_function_privilege('t_none', p.oid, 'EXECUTE')
        """
    ).fetchall()
    assert rows == [("schema_version()",)]  # and USAGE on the schema, so that denials name the function
    assert obs.execute("SELECT has_schema_privilege('t_none', 'pgbroker', 'USAGE')").fetchone()[0] is True
    assert obs.execute("SELECT has_schema_privilege('t_none', 'pgbroker', 'CREATE')").fetchone()[0] is False
    definers = obs.execute(
        """
        SELECT p.oid::regprocedure::text, p.proconfig FROM pg_proc p
         WHERE p.pronamespace = 'pgbroker'::regnamespace AND p.prosecdef
        """
    ).fetchall()
    assert definers
    for name, config in definers:
        # search_path pinned; the only other settings: the quiet unlock of lock_release/semaphore_release,
        # outbox_fetch's plan made once, the outbox readers' plans held to its indexes, the set-based calls' plans
        # made for each call's arrays (hash joins), the fixed key encoding of some watched tables' triggers, and the
        # upkeep's short lock timeout (a part that would wait is left for the next call).
        assert config[0] == "search_path=pg_catalog, pg_temp", name
        allowed = {"client_min_messages=error", "plan_cache_mode=force_generic_plan"}
        if name.split(".")[-1].startswith(("client_register_many(", "subscribe_many(")):
            allowed |= {"plan_cache_mode=force_custom_plan", "enable_mergejoin=off"}
        if name.split(".")[-1].startswith(("outbox_fetch(", "outbox_ack(", "broker_sleep(")):
            allowed |= {"enable_seqscan=off", "enable_bitmapscan=off"}  # plans held to the outbox's indexes
        if name.split(".")[-1] == "maintain(integer)":
            allowed |= {"lock_timeout=100ms"}
        if name.startswith("pgbroker._watch_"):
            allowed |= {"TimeZone=UTC", "IntervalStyle=postgres", "extra_float_digits=1", "bytea_output=hex",
                        "lc_monetary=C"}  # fmt: skip
        assert set(config[1:]) <= allowed, name


# ---------------------------------------------------------------------------
# Hostile search_path


@pytest.fixture
def evil(connect):
    """Schema evil with shadows of what the API uses, usable by t_broker."""
    admin = connect("setup")
    admin.execute(
        """
        CREATE SCHEMA evil;
        GRANT USAGE ON SCHEMA evil TO PUBLIC;
        CREATE TABLE evil.lease (LIKE pgbroker.lease);
        CREATE TABLE evil.lease_event (LIKE pgbroker.lease_event);
        CREATE FUNCTION evil.pg_backend_pid() RETURNS integer LANGUAGE sql AS 'SELECT 0';
        CREATE FUNCTION evil.clock_timestamp() RETURNS timestamptz LANGUAGE sql AS $$SELECT '2000-01-01'::timestamptz$$;
        CREATE FUNCTION evil.pg_try_advisory_xact_lock(integer, integer) RETURNS boolean LANGUAGE sql AS 'SELECT true';
        CREATE FUNCTION evil.pg_advisory_xact_lock(integer, integer) RETURNS void LANGUAGE sql AS '';
        CREATE FUNCTION evil.pg_advisory_lock(integer, integer) RETURNS void LANGUAGE sql AS '';
        CREATE FUNCTION evil.nextval(regclass) RETURNS bigint LANGUAGE sql AS 'SELECT 1';
        CREATE FUNCTION evil._check_name(text) RETURNS text LANGUAGE sql AS 'SELECT $1';
        CREATE FUNCTION evil.has_function_privilege(text, text) RETURNS boolean LANGUAGE sql AS 'SELECT true';
        GRANT ALL ON ALL TABLES IN SCHEMA evil TO PUBLIC;
        """
    )
    return admin


@pytest.mark.parametrize(
    "search_path",
    ["evil, pg_catalog, pgbroker", "evil, pg_temp, pg_catalog", "pg_temp, evil", "''"],
)
def test_hostile_search_path_changes_nothing(connect, evil, search_path):
    a, b = connect("A", user="t_broker"), connect("B", user="t_broker")
    for conn in (a, b):
        # pg_temp shadows too: temporary tables named like pgbroker's and pg_catalog's.
        conn.execute("CREATE TEMP TABLE lease (LIKE evil.lease)")
        conn.execute("CREATE TEMP TABLE pg_locks (pid integer, granted boolean)")
        conn.execute(f"SET search_path = {search_path}")
    epoch = a.execute("SELECT pgbroker.broker_claim(owner => 'a')").fetchone()[0]
    assert epoch == 1
    assert a.execute("SELECT pgbroker.broker_claim(owner => 'a')").fetchone()[0] == epoch
    with pytest.raises(errors.LockNotAvailable):  # the lock is real
        b.execute("SELECT pgbroker.broker_claim()")
    with pytest.raises(errors.InsufficientPrivilege):  # and takeover still checked
        b.execute("SELECT pgbroker.broker_claim(takeover => true)")
    a.execute("SELECT pgbroker.broker_heartbeat()")
    b.execute("SELECT pgbroker.broker_assert('default', %s)", (epoch,))
    row = lease_row(evil)
    assert (row["holder_pid"], row["alive"]) == (a.info.backend_pid, True)
    assert row["claimed_at"].year > 2000
    assert len(advisory_locks(evil, a.info.backend_pid)) == 1
    assert a.execute("SELECT pgbroker.broker_release(owner => 'a')").fetchone()[0] is True
    assert advisory_locks(evil, a.info.backend_pid) == []
    assert b.execute("SELECT pgbroker.broker_claim()").fetchone()[0] == epoch + 1
    for conn in (a, b):
        assert conn.execute("SELECT count(*) FROM pg_temp.lease").fetchone()[0] == 0
    assert evil.execute("SELECT count(*) FROM evil.lease").fetchone()[0] == 0
    assert evil.execute("SELECT count(*) FROM evil.lease_event").fetchone()[0] == 0
    assert [e["event"] for e in history(evil)] == ["claim", "release", "claim"]


def test_forged_session_cache_does_not_make_another_session_the_holder(connect):
    """pgbroker.session holds this session's identity (pid and first call); a forged value, even the holder's
    very own, cannot make another session the holder: the pid in it must be the session's."""
    holder = connect("holder", user="t_broker")
    other = connect("other", user="t_broker")
    assert claim(holder, "forged") >= 1
    admin = connect("admin")
    start = admin.execute(
        "SELECT (extract(epoch FROM holder_backend_start) * 1000000)::bigint FROM pgbroker.lease WHERE name = 'forged'"
    ).fetchone()[0]
    assert holder.execute("SELECT current_setting('pgbroker.session')").fetchone()[0] == (
        f"{holder.info.backend_pid}@{start}"
    )
    for pid in (holder.info.backend_pid, other.info.backend_pid):
        other.execute("SELECT set_config('pgbroker.session', %s, false)", (f"{pid}@{start}",))
        for sql in (
            "SELECT pgbroker.broker_heartbeat('forged')",
            "SELECT pgbroker.broker_state_set('forged', 'k', '1')",
        ):
            with pytest.raises(psycopg.Error) as caught:
                other.execute(sql)
            assert caught.value.sqlstate == "PB001"
        assert other.execute("SELECT pgbroker.broker_release('forged')").fetchone()[0] is False
    # The real holder is unaffected.
    assert holder.execute("SELECT pgbroker.broker_heartbeat('forged')").fetchone()[0] is not None
