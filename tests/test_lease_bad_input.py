"""Bad input: a clear error with a documented SQLSTATE, and nothing changed."""

from __future__ import annotations

import psycopg
import pytest
from conftest import advisory_locks
from lease_util import claim, history, lease_row
from psycopg import errors

BAD_CLAIMS = [
    pytest.param({"name": None}, "22004", "must not be NULL", id="null-name"),
    pytest.param({"name": ""}, "22023", "must not be empty", id="empty-name"),
    pytest.param({"name": "x" * 64}, "22023", "64 bytes, at most 63", id="64-byte-name"),
    pytest.param({"name": "é" * 32}, "22023", "64 bytes, at most 63", id="64-byte-multibyte-name"),
    pytest.param({"wait": "-1s"}, "22023", "wait must not be negative", id="negative-wait"),
    pytest.param({"wait": "25 days"}, "22023", "wait is too long", id="wait-over-24-days"),
    pytest.param({"stale_after": "0"}, "22023", "stale_after must be positive", id="zero-stale-after"),
    pytest.param({"stale_after": "-5s"}, "22023", "stale_after must be positive", id="negative-stale-after"),
    pytest.param({"takeover": None}, "22004", "takeover must not be NULL", id="null-takeover"),
]


def _snapshot(conn: psycopg.Connection) -> tuple:
    return (
        conn.execute("SELECT * FROM pgbroker.lease ORDER BY name").fetchall(),
        conn.execute("SELECT count(*) FROM pgbroker.lease_event").fetchone()[0],
        conn.execute("SELECT * FROM pgbroker.state ORDER BY name, key").fetchall(),
        advisory_locks(conn),
    )


@pytest.mark.parametrize("held", [False, True], ids=["free", "held"])
@pytest.mark.parametrize(("args", "sqlstate", "message"), BAD_CLAIMS)
def test_bad_claim_changes_nothing(connect, args, sqlstate, message, held):
    obs, caller = connect("obs"), connect("caller", user="t_broker")
    if held:
        holder = connect("holder")
        claim(holder)
        holder.execute("SELECT pgbroker.broker_state_set('default', 'k', '1')")
    before = _snapshot(obs)
    kwargs = {"name": "default", **args}
    with pytest.raises(psycopg.Error) as info:
        claim(caller, **kwargs)
    assert info.value.sqlstate == sqlstate
    assert message in info.value.diag.message_primary
    assert _snapshot(obs) == before
    assert advisory_locks(obs, caller.info.backend_pid) == []
    if held:
        assert lease_row(obs)["alive"] is True


@pytest.mark.parametrize(("args", "sqlstate", "message"), BAD_CLAIMS)
def test_bad_claim_from_the_holder_keeps_its_lease(connect, args, sqlstate, message):
    holder, obs = connect("holder"), connect("obs")
    epoch = claim(holder)
    before = _snapshot(obs)
    with pytest.raises(psycopg.Error) as info:
        claim(holder, **{"name": "default", **args})
    assert info.value.sqlstate == sqlstate
    assert _snapshot(obs) == before
    row = lease_row(obs)
    assert (row["epoch"], row["alive"]) == (epoch, True)


def test_longest_and_odd_names_are_fine(connect):
    a, b = connect("A"), connect("B")
    names = ["x" * 63, "é" * 31 + "x", " ", "a'b\"c; DROP TABLE pgbroker.lease; --", "%s %(name)s", "Default"]
    epochs = [claim(a, name) for name in names]
    assert len(set(epochs)) == len(names)
    assert len(advisory_locks(b, a.info.backend_pid)) == len(names)
    for name in names:
        with pytest.raises(errors.LockNotAvailable):
            claim(b, name)
        assert lease_row(b, name)["holder_pid"] == a.info.backend_pid
    assert claim(b, "default") > 0  # "Default" is another name


@pytest.mark.parametrize(
    ("sql", "sqlstate"),
    [
        ("SELECT pgbroker.broker_release(NULL)", "22004"),
        ("SELECT pgbroker.broker_release('')", "22023"),
        ("SELECT pgbroker.broker_heartbeat(repeat('x', 64))", "22023"),
        ("SELECT pgbroker.broker_assert(NULL, 1)", "22004"),
        ("SELECT pgbroker.broker_assert('default', NULL)", "22004"),
        ("SELECT pgbroker.broker_state_set('default', NULL, '1')", "22004"),
        ("SELECT pgbroker.broker_state_set('default', 'k', NULL)", "22004"),
        ("SELECT pgbroker.broker_state_set('', 'k', '1')", "22023"),
        ("SELECT pgbroker.lease_history_prune(NULL)", "22023"),
        ("SELECT pgbroker.lease_history_prune('-1 day')", "22023"),
    ],
)
def test_bad_input_to_the_rest_of_the_api(connect, sql, sqlstate):
    holder, obs = connect("holder"), connect("obs")
    claim(holder)
    holder.execute("SELECT pgbroker.broker_state_set('default', 'k', '1')")
    before = _snapshot(obs)
    with pytest.raises(psycopg.Error) as info:
        holder.execute(sql)
    assert info.value.sqlstate == sqlstate
    assert _snapshot(obs) == before
    assert [e["event"] for e in history(obs)] == ["claim"]
