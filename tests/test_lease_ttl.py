"""TTL leases: bound to an owner token and a time to live instead of a session lock."""

from __future__ import annotations

import json
import time

import psycopg
import pytest
from lease_util import claim, history, lease_row


def _fails(conn: psycopg.Connection, sql: str, params: tuple | dict = ()) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as info:
        conn.execute(sql, params)
    return info.value


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ttl": "10 s"},  # no owner
        {"ttl": "0 s", "owner": "x"},
        {"ttl": "-1 s", "owner": "x"},
        {"owner": ""},
        {"owner": "x" * 201},
    ],
)
def test_bad_ttl_claims_fail_clearly_and_change_nothing(connect, kwargs):
    a = connect("A")
    exc = _fails(a, "SELECT pgbroker.broker_claim('t', " + ", ".join(f"{k} => %({k})s" for k in kwargs) + ")", kwargs)
    assert exc.sqlstate == "22023", exc
    assert lease_row(a, "t") is None
    assert _fails(a, "SELECT pgbroker.broker_renew('t', 'x', '-1 s')").sqlstate == "22023"


def test_ttl_lease_holds_renews_expires_and_fences(connect):
    a, b, obs = connect("A"), connect("B"), connect("obs")
    epoch = claim(a, "t", owner="a", ttl="1 s")
    row = lease_row(obs, "t")
    assert (row["epoch"], row["alive"]) == (epoch, True)
    # No session lock: the holder's session may go away and the lease stays.
    a.close()
    assert lease_row(obs, "t")["alive"] is True
    held = _fails(b, "SELECT pgbroker.broker_claim('t', owner => 'b', ttl => '1 s')")
    assert held.sqlstate == "55P03" and "held until" in held.diag.message_primary
    detail = json.loads(held.diag.message_detail)
    assert detail["epoch"] == epoch and detail["expires_at"] and "owner" not in detail  # the token stays secret
    assert _fails(b, "SELECT pgbroker.broker_claim('t')").sqlstate == "55P03"  # a session claim too
    # The owner renews from any session, and fences its writes with the epoch.
    expires = b.execute("SELECT pgbroker.broker_renew('t', 'a', '2 s')").fetchone()[0]
    assert expires > row["claimed_at"]
    b.execute("SELECT pgbroker.broker_assert('t', %s)", (epoch,))
    assert b.execute("SELECT pgbroker.client_register('c1', '{}', 't', %s)", (epoch,)).fetchone()[0] is True
    assert _fails(b, "SELECT pgbroker.broker_renew('t', 'not-a')").sqlstate == "PB002"
    assert b.execute("SELECT pgbroker.broker_release('t', 'not-a')").fetchone()[0] is False
    # Expiry: renew, assert and the old epoch's clients are gone with the next claim.
    time.sleep(2.1)
    assert lease_row(obs, "t")["alive"] is False
    assert _fails(b, "SELECT pgbroker.broker_renew('t', 'a')").sqlstate == "PB002"
    assert _fails(b, "SELECT pgbroker.broker_assert('t', %s)", (epoch,)).sqlstate == "PB002"
    new = claim(b, "t", owner="b", ttl="5 s")
    assert new > epoch
    assert obs.execute("SELECT count(*) FROM pgbroker.clients WHERE name = 't'").fetchone()[0] == 0
    # The claim noticed the expiry first: an expired event, then its own.
    assert [e["event"] for e in history(obs, "t")] == ["claim", "expired", "claim"]
    assert [e["epoch"] for e in history(obs, "t")] == [epoch, epoch, new]
    assert "expired" in history(obs, "t")[-1]["reason"]
    assert b.execute("SELECT pgbroker.broker_release('t', 'b')").fetchone()[0] is True
    assert lease_row(obs, "t")["alive"] is False


def test_session_and_ttl_claims_exclude_each_other(connect):
    a, b = connect("A"), connect("B")
    epoch = claim(a, "mixed")
    assert _fails(b, "SELECT pgbroker.broker_claim('mixed', owner => 'b', ttl => '5 s')").sqlstate == "55P03"
    # The holding session cannot turn its session lease into a TTL one.
    assert _fails(a, "SELECT pgbroker.broker_claim('mixed', owner => 'a', ttl => '5 s')").sqlstate == "PB003"
    assert a.execute("SELECT pgbroker.broker_release('mixed')").fetchone()[0] is True
    ttl_epoch = claim(b, "mixed", owner="b", ttl="5 s")
    assert ttl_epoch > epoch
    started = time.monotonic()
    assert _fails(a, "SELECT pgbroker.broker_claim('mixed', wait => '300 ms')").sqlstate == "55P03"
    assert time.monotonic() - started >= 0.28  # it waited for the TTL lease


def test_admin_takes_over_a_ttl_lease(connect):
    worker, admin, obs = connect("worker"), connect("admin", user="t_admin"), connect("obs")
    epoch = claim(worker, "t", owner="w", ttl="1 hour")
    assert _fails(
        connect("broker", user="t_broker"), "SELECT pgbroker.broker_claim('t', takeover => true)"
    ).sqlstate == ("42501")
    new = claim(admin, "t", takeover=True)
    assert new > epoch
    assert history(obs, "t")[-1]["event"] == "takeover"
    assert "TTL lease" in history(obs, "t")[-1]["reason"]
    assert _fails(worker, "SELECT pgbroker.broker_renew('t', 'w')").sqlstate == "PB002"


def test_holder_only_calls_need_a_session_lease(connect):
    """A TTL lease has no session: the claiming session is not its holder for heartbeats, state or delivery."""
    a = connect("A")
    epoch = claim(a, "t", owner="a", ttl="5 s")
    for sql in (
        "SELECT pgbroker.broker_heartbeat('t')",
        "SELECT pgbroker.broker_state_set('t', 'k', '1')",
        "SELECT pgbroker.client_register('c1', '{}', 't')",
        "SELECT * FROM pgbroker.outbox_fetch('t')",
    ):
        assert _fails(a, sql).sqlstate == "PB001", sql
    assert a.execute("SELECT pgbroker.client_register('c1', '{}', 't', %s)", (epoch,)).fetchone()[0] is True
