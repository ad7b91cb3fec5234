"""The lease SQL contract between sessions: exclusion, waiting, takeover,
epochs, bound parameters, release, heartbeat, broker_assert, broker state."""

from __future__ import annotations

import json
import time
from datetime import datetime

import psycopg
import pytest
from conftest import advisory_locks
from lease_util import Background, backend_gone, claim, history, lease_row, release, wait_until, waiting
from psycopg import errors


@pytest.fixture
def connect(connect):
    """Every connection gets a statement_timeout, so that a broken contract
    fails the test instead of hanging it."""

    def _connect(*args, **kwargs) -> psycopg.Connection:
        conn = connect(*args, **kwargs)
        conn.execute("SET statement_timeout = '15s'")
        if not conn.autocommit:
            conn.commit()
        return conn

    return _connect


# ---------------------------------------------------------------------------
# Exclusion


def test_fail_fast_names_the_holder(connect):
    a, b = connect("holder-A"), connect("B")
    epoch = claim(a)
    since = lease_row(b)["claimed_at"]
    started = time.monotonic()
    with pytest.raises(errors.LockNotAvailable) as info:
        claim(b, wait="0")
    assert time.monotonic() - started < 0.5
    err = info.value
    assert err.sqlstate == "55P03"
    text = f"{err.diag.message_primary}\n{err.diag.message_detail}"
    pid = a.info.backend_pid
    assert f"pid {pid}" in err.diag.message_primary
    assert '"holder-A"' in err.diag.message_primary
    assert "127.0.0.1" in err.diag.message_primary
    assert f"epoch {epoch}" in err.diag.message_primary
    # DETAIL is a JSON object naming the holder (a documented machine format).
    detail = json.loads(err.diag.message_detail)
    assert detail["pid"] == pid and detail["application"] == "holder-A"
    assert detail["address"] == "127.0.0.1" and detail["epoch"] == epoch and detail["name"] == "default"
    assert datetime.fromisoformat(detail["since"]) == since
    assert str(since.year) in text and f"{since.minute:02d}:{since.second:02d}" in text
    # Nothing changed: A still holds it, B holds no lock.
    row = lease_row(b)
    assert (row["epoch"], row["holder_pid"], row["alive"]) == (epoch, pid, True)
    assert advisory_locks(b, b.info.backend_pid) == []
    assert [e["event"] for e in history(b)] == ["claim"]


def test_wait_with_timeout_fails_after_about_that_long(connect):
    a, b = connect("A"), connect("B")
    claim(a)
    started = time.monotonic()
    with pytest.raises(errors.LockNotAvailable, match=f"pid {a.info.backend_pid}"):
        claim(b, wait="300ms")
    elapsed = time.monotonic() - started
    assert 0.28 <= elapsed < 1.5, elapsed
    assert advisory_locks(b, b.info.backend_pid) == []


def test_wait_forever_until_the_holder_disconnects(connect):
    a, b, watcher = connect("A"), connect("B"), connect("watch")
    first = claim(a)
    a_pid = a.info.backend_pid
    call = Background(lambda: claim(b, wait=None))
    wait_until(lambda: waiting(watcher, b.info.backend_pid), what="B to block")
    time.sleep(0.3)
    assert not call.done(), "wait => NULL returned while the holder was alive"
    a.close()
    assert call.result() == first + 1
    row = lease_row(watcher)
    assert (row["holder_pid"], row["holder_application"], row["alive"]) == (b.info.backend_pid, "B", True)
    last = history(watcher)[-1]
    assert last["event"] == "claim" and last["previous_pid"] == a_pid
    assert f"session of pid {a_pid}" in last["reason"] and "ended" in last["reason"]


def test_reclaim_by_the_same_owner_returns_the_same_epoch_without_stacking(connect):
    a, b = connect("A"), connect("B")
    pid = a.info.backend_pid
    epoch = claim(a, owner="a-1")
    assert claim(a, owner="a-1") == epoch
    assert claim(a, owner="a-1", wait=None) == epoch
    with a.transaction():
        assert claim(a, owner="a-1") == epoch
    assert advisory_locks(b, pid) == [(pid, advisory_locks(b)[0][1], True)]
    assert [e["event"] for e in history(b)] == ["claim"]
    assert release(a) is False  # the claim gave an owner: a bare release is another caller's
    assert a.execute("SELECT pgbroker.broker_release('default', 'a-1')").fetchone()[0] is True
    assert advisory_locks(b, pid) == []
    assert claim(b) == epoch + 1


@pytest.mark.parametrize("first, again", [(None, None), (None, "x"), ("x", None), ("x", "y")])
def test_reclaim_that_cannot_prove_the_same_caller_is_refused(connect, first, again):
    """A server session may carry several callers (a pooler in transaction mode):
    a re-claim without the claim's owner token is refused with PB003, naming the
    holder, and changes nothing."""
    a, b = connect("A"), connect("B")
    epoch = claim(a, **({"owner": first} if first else {}))
    with pytest.raises(psycopg.Error) as info:
        claim(a, **({"owner": again} if again else {}))
    assert info.value.sqlstate == "PB003"
    assert "already held by this server session" in info.value.diag.message_primary
    assert json.loads(info.value.diag.message_detail)["epoch"] == epoch
    row = lease_row(b)
    assert (row["epoch"], row["alive"]) == (epoch, True)
    assert [e["event"] for e in history(b)] == ["claim"]


def test_reclaim_after_the_session_lost_its_lock_claims_anew(connect):
    """pg_advisory_unlock_all() (or DISCARD ALL in a pooler) drops the
    session lock behind pgbroker's back: a re-claim must not report the
    lease as held without a lock."""
    a, b = connect("A"), connect("B")
    pid = a.info.backend_pid
    epoch = claim(a)
    a.execute("SELECT pg_advisory_unlock_all()")
    assert advisory_locks(b, pid) == []
    assert lease_row(b)["alive"] is False
    with pytest.raises(psycopg.Error) as info:
        b.execute("SELECT pgbroker.broker_assert('default', %s)", (epoch,))
    assert info.value.sqlstate == "PB002"
    again = claim(a)
    assert again > epoch
    assert len(advisory_locks(b, pid)) == 1
    with pytest.raises(errors.LockNotAvailable):
        claim(b)


def test_takeover_by_admin_terminates_the_holder(connect):
    holder, admin = connect("victim", user="t_broker"), connect("admin", user="t_admin")
    epoch = claim(holder)
    victim = holder.info.backend_pid
    started = time.monotonic()
    assert claim(admin, takeover=True) == epoch + 1
    assert time.monotonic() - started < 5
    assert backend_gone(admin, victim)
    with pytest.raises(psycopg.OperationalError):
        holder.execute("SELECT 1")
    row = lease_row(admin)
    assert (row["holder_pid"], row["holder_user"], row["alive"]) == (admin.info.backend_pid, "t_admin", True)
    last = history(admin)[-1]
    assert last["event"] == "takeover" and last["epoch"] == epoch + 1
    assert last["previous_pid"] == victim and last["previous_epoch"] == epoch
    assert f"terminated pid {victim}" in last["reason"] and "t_admin" in last["reason"]


def test_takeover_of_a_free_lease_is_a_plain_claim(connect):
    admin = connect("admin", user="t_admin")
    assert claim(admin, takeover=True) == 1
    assert history(admin)[-1]["event"] == "claim"


def test_epochs_strictly_increase_and_are_never_reused(connect):
    a, b = connect("A"), connect("B")
    seen: list[int] = []  # every epoch any claim returned, committed or not
    committed: list[int] = []
    for i in range(3):
        conn = (a, b)[i % 2]
        e = claim(conn)
        seen.append(e)
        committed.append(e)
        with pytest.raises(errors.LockNotAvailable):
            claim((b, a)[i % 2])  # refused claims use no epoch
        # A claim rolled back after it returned its epoch.
        assert release(conn)
        with conn.transaction(force_rollback=True):
            seen.append(claim(conn))
        # A claim whose transaction fails later.
        with pytest.raises(errors.DivisionByZero), conn.transaction():
            seen.append(claim(conn))
            conn.execute("SELECT 1/0")
    assert committed == sorted(committed) and len(set(committed)) == len(committed)
    assert len(set(seen)) == len(seen), f"an epoch was handed out twice: {seen}"
    assert seen == sorted(seen)
    last = claim(a)
    assert last > max(seen)
    events = history(a)
    assert [e["epoch"] for e in events if e["event"] == "claim"] == [*committed, last]


# ---------------------------------------------------------------------------
# Bound parameters (extended protocol) and explicit transactions


@pytest.mark.parametrize("prepare", [False, True], ids=["extended", "prepared"])
def test_bound_parameters_behave_like_literal_sql(connect, prepare):
    a, b, c = connect("A"), connect("B"), connect("C", autocommit=False)
    sql = "SELECT pgbroker.broker_claim(%s, %s)"
    epoch = a.execute(sql, ("bound", "0"), prepare=prepare).fetchone()[0]
    with pytest.raises(psycopg.Error) as reclaim:  # a bare re-claim: refused, nothing changed
        a.execute(sql, ("bound", "0"), prepare=prepare)
    assert reclaim.value.sqlstate == "PB003"
    assert len(advisory_locks(b, a.info.backend_pid)) == 1
    for _ in range(2):  # a prepared statement is really used from the second run on
        with pytest.raises(errors.LockNotAvailable):
            b.execute(sql, ("bound", "0"), prepare=prepare)
    started = time.monotonic()
    with pytest.raises(errors.LockNotAvailable):
        b.execute(sql, ("bound", "200ms"), prepare=prepare)
    assert time.monotonic() - started >= 0.18
    assert advisory_locks(b, b.info.backend_pid) == []
    assert a.execute("SELECT pgbroker.broker_release(%s)", ("bound",), prepare=prepare).fetchone()[0]

    # Explicit transaction (autocommit off): the claim takes effect at commit.
    e2 = c.execute(sql, ("bound", "0"), prepare=prepare).fetchone()[0]
    assert e2 == epoch + 1
    assert lease_row(b, "bound")["state"] == "released"  # not committed yet
    with pytest.raises(errors.LockNotAvailable):
        b.execute(sql, ("bound", "0"), prepare=prepare)
    c.commit()
    row = lease_row(b, "bound")
    assert (row["epoch"], row["holder_pid"], row["alive"]) == (e2, c.info.backend_pid, True)
    assert len(advisory_locks(b, c.info.backend_pid)) == 1
    assert c.execute("SELECT pgbroker.broker_release(%s)", ("bound",), prepare=prepare).fetchone()[0]
    c.commit()

    # ... and ROLLBACK drops it.
    e3 = c.execute(sql, ("bound", "0"), prepare=prepare).fetchone()[0]
    assert e3 > e2
    assert len(advisory_locks(b, c.info.backend_pid)) == 1
    c.rollback()
    assert advisory_locks(b, c.info.backend_pid) == []
    assert lease_row(b, "bound")["state"] == "released"
    assert b.execute(sql, ("bound", "0"), prepare=prepare).fetchone()[0] > e3


def test_fail_fast_while_another_transaction_claims_an_existing_lease(connect):
    """An uncommitted claim must not turn wait => '0' into an unbounded wait."""
    a, b, c = connect("A"), connect("B"), connect("C")
    claim(a)
    release(a)
    with a.transaction():
        claim(a)
        started = time.monotonic()
        with pytest.raises(errors.LockNotAvailable):
            claim(b, wait="0")
        with pytest.raises(errors.LockNotAvailable):
            claim(c, wait="200ms")
        assert time.monotonic() - started < 2


def test_fail_fast_while_another_transaction_claims_a_new_name(connect):
    a, b = connect("A"), connect("B")
    with a.transaction():
        claim(a, "brand-new")
        started = time.monotonic()
        with pytest.raises(errors.LockNotAvailable):
            claim(b, "brand-new", wait="0")
        with pytest.raises(errors.LockNotAvailable):
            claim(b, "brand-new", wait="200ms")
        assert time.monotonic() - started < 2
    assert lease_row(b, "brand-new")["holder_pid"] == a.info.backend_pid


def test_fail_fast_while_the_holder_heartbeats_in_an_open_transaction(connect):
    a, b = connect("A"), connect("B")
    claim(a)
    with a.transaction():
        a.execute("SELECT pgbroker.broker_heartbeat()")
        started = time.monotonic()
        with pytest.raises(errors.LockNotAvailable):
            claim(b, wait="0")
        assert time.monotonic() - started < 1


def test_waiter_gets_a_lease_claimed_in_a_rolled_back_transaction(connect):
    a, b, watcher = connect("A"), connect("B"), connect("watch")
    with a.transaction(force_rollback=True):
        claim(a)
        call = Background(lambda: claim(b, wait="10s"))
        wait_until(lambda: waiting(watcher, b.info.backend_pid), what="B to block")
    epoch = call.result()
    assert lease_row(watcher)["holder_pid"] == b.info.backend_pid
    assert history(watcher)[-1]["epoch"] == epoch


# ---------------------------------------------------------------------------
# Release


def test_release_hands_over_at_once(connect):
    a, b, watcher = connect("A"), connect("B"), connect("watch")
    epoch = claim(a)
    call = Background(lambda: claim(b, wait="5s"))
    wait_until(lambda: waiting(watcher, b.info.backend_pid), what="B to block")
    released_at = time.monotonic()
    assert release(a) is True
    assert call.result() == epoch + 1
    assert call.finished_at - released_at < 0.5
    assert advisory_locks(watcher, a.info.backend_pid) == []
    events = history(watcher)
    assert [e["event"] for e in events] == ["claim", "release", "claim"]
    assert events[1]["epoch"] == epoch and events[2]["reason"] == f"epoch {epoch} was released"
    assert lease_row(watcher)["state"] == "held"


def test_release_by_a_non_holder_returns_false(connect):
    a, b = connect("A"), connect("B")
    assert release(b) is False  # no such lease
    epoch = claim(a)
    assert release(b) is False
    assert release(b, "other") is False
    row = lease_row(b)
    assert (row["epoch"], row["state"], row["alive"]) == (epoch, "held", True)
    assert release(a) is True
    assert release(a) is False  # already released


def test_release_rolled_back_keeps_the_lease(connect):
    a, b = connect("A"), connect("B")
    epoch = claim(a)
    with a.transaction(force_rollback=True):
        assert release(a) is True
    assert len(advisory_locks(b, a.info.backend_pid)) == 1
    row = lease_row(b)
    assert (row["epoch"], row["state"], row["alive"]) == (epoch, "held", True)
    with pytest.raises(errors.LockNotAvailable):
        claim(b)
    assert release(a) is True
    assert claim(b) == epoch + 1


def test_claim_and_release_in_one_transaction_leave_no_lock(connect):
    a, b = connect("A"), connect("B")
    with a.transaction():
        epoch = claim(a)
        assert release(a) is True
    assert advisory_locks(b, a.info.backend_pid) == []
    assert lease_row(b)["state"] == "released"
    assert claim(b) == epoch + 1


def test_release_and_claim_again_in_one_transaction_keeps_one_lock(connect):
    a, b = connect("A"), connect("B")
    epoch = claim(a)
    with a.transaction():
        assert release(a) is True
        again = claim(a)
    assert again > epoch
    assert len(advisory_locks(b, a.info.backend_pid)) == 1
    assert release(a) is True
    assert advisory_locks(b, a.info.backend_pid) == []


def test_claim_rolled_back_to_a_savepoint_leaves_no_lock(connect):
    a, b = connect("A"), connect("B")
    with a.transaction():
        a.execute("SELECT 1")
        with a.transaction(force_rollback=True):  # SAVEPOINT ... ROLLBACK TO
            claim(a)
        assert advisory_locks(b, a.info.backend_pid) == []
    assert advisory_locks(b, a.info.backend_pid) == []
    assert claim(b) >= 1


# ---------------------------------------------------------------------------
# Heartbeat


def test_heartbeat_updates_heartbeat_at(connect):
    a, b = connect("A"), connect("B")
    claim(a)
    before = lease_row(b)["heartbeat_at"]
    time.sleep(0.05)
    at = a.execute("SELECT pgbroker.broker_heartbeat()").fetchone()[0]
    assert at > before
    assert lease_row(b)["heartbeat_at"] == at


def test_heartbeat_from_a_non_holder_is_pb001(connect):
    a, b = connect("A"), connect("B")
    with pytest.raises(psycopg.Error) as info:
        b.execute("SELECT pgbroker.broker_heartbeat()")
    assert info.value.sqlstate == "PB001"
    claim(a)
    before = lease_row(b)["heartbeat_at"]
    with pytest.raises(psycopg.Error) as info:
        b.execute("SELECT pgbroker.broker_heartbeat()")
    assert info.value.sqlstate == "PB001"
    assert lease_row(b)["heartbeat_at"] == before
    release(a)
    with pytest.raises(psycopg.Error) as info:
        a.execute("SELECT pgbroker.broker_heartbeat()")
    assert info.value.sqlstate == "PB001"


# ---------------------------------------------------------------------------
# broker_assert


def _assert(conn: psycopg.Connection, epoch: int, name: str = "default") -> None:
    conn.execute("SELECT pgbroker.broker_assert(%s, %s)", (name, epoch))


def _assert_fails(conn: psycopg.Connection, epoch: int, name: str = "default") -> str:
    with pytest.raises(psycopg.Error) as info:
        _assert(conn, epoch, name)
    assert info.value.sqlstate == "PB002"
    return info.value.diag.message_primary


def test_assert_passes_for_the_live_current_epoch(connect):
    a, other = connect("A"), connect("other", user="t_broker")
    epoch = claim(a)
    _assert(a, epoch)
    _assert(other, epoch)  # from any session, e.g. the broker's second connection
    with other.transaction():
        _assert(other, epoch)
        other.execute("SELECT 1")


def test_assert_fails_for_stale_released_or_dead(connect):
    a, b, other = connect("A"), connect("B"), connect("other")
    assert "never been claimed" in _assert_fails(other, 1)
    epoch = claim(a)
    assert "stale" in _assert_fails(other, epoch - 1)
    assert "stale" in _assert_fails(other, epoch + 1)
    release(a)
    assert "released" in _assert_fails(other, epoch)
    epoch = claim(b)
    _assert(other, epoch)
    b.close()
    wait_until(lambda: not lease_row(other)["alive"], what="B's lock to go")
    assert "gone" in _assert_fails(other, epoch)
    with pytest.raises(errors.NullValueNotAllowed):
        other.execute("SELECT pgbroker.broker_assert('default', NULL)")


def test_assert_holds_back_a_concurrent_claim_until_commit(connect):
    """T1 asserts epoch N; the holder dies; a claimant must not commit N+1
    before T1 commits."""
    a, b, t1, watcher = connect("A"), connect("B"), connect("T1"), connect("watch")
    epoch = claim(a)
    with t1.transaction():
        _assert(t1, epoch)
        a_pid = a.info.backend_pid
        a.close()
        wait_until(lambda: backend_gone(watcher, a_pid), what="A to exit")
        call = Background(lambda: claim(b, wait="10s"))
        wait_until(lambda: waiting(watcher, b.info.backend_pid), what="the claim to block on T1")
        time.sleep(0.3)
        assert not call.done(), "the claim committed a new epoch while T1 still relied on the old one"
        assert lease_row(watcher)["epoch"] == epoch
        t1.execute("SELECT 1")  # T1's fenced write would go here
        committed_at = time.monotonic()
    assert call.result() == epoch + 1
    assert call.finished_at >= committed_at


def test_assert_started_after_a_claim_waits_then_fails(connect):
    a, b, t1, watcher = connect("A"), connect("B"), connect("T1"), connect("watch")
    epoch = claim(a)
    a_pid = a.info.backend_pid
    a.close()
    wait_until(lambda: backend_gone(watcher, a_pid), what="A to exit")
    with b.transaction():
        new = claim(b)
        assert new == epoch + 1
        call = Background(lambda: _assert(t1, epoch))
        wait_until(lambda: waiting(watcher, t1.info.backend_pid), what="the assert to block on the claim")
        time.sleep(0.2)
        assert not call.done()
    with pytest.raises(psycopg.Error) as info:
        call.result()
    assert info.value.sqlstate == "PB002" and "stale" in info.value.diag.message_primary
    _assert(t1, new)


def test_assert_after_a_rolled_back_claim_keeps_the_old_epoch(connect):
    a, b, t1, watcher = connect("A"), connect("B"), connect("T1"), connect("watch")
    epoch = claim(a)
    release(a)
    with b.transaction(force_rollback=True):
        claim(b)
        call = Background(lambda: _assert(t1, epoch))
        wait_until(lambda: waiting(watcher, t1.info.backend_pid), what="the assert to block on the claim")
    with pytest.raises(psycopg.Error, match="released"):
        call.result()


# ---------------------------------------------------------------------------
# Broker state


def test_broker_state_belongs_to_the_holder_and_is_hidden_by_the_next_claim_then_swept(connect):
    a, b, reader = connect("A"), connect("B"), connect("reader", user="t_reader")
    epoch = claim(a)
    a.execute("SELECT pgbroker.broker_state_set('default', 'clients', '[1, 2]')")
    a.execute("SELECT pgbroker.broker_state_set('default', 'mode', '\"primary\"')")
    a.execute("SELECT pgbroker.broker_state_set('default', 'clients', '[1, 2, 3]')")
    rows = reader.execute("SELECT key, value, epoch FROM pgbroker.broker_state ORDER BY key").fetchall()
    assert rows == [("clients", [1, 2, 3], epoch), ("mode", "primary", epoch)]
    with pytest.raises(psycopg.Error) as info:
        b.execute("SELECT pgbroker.broker_state_set('default', 'mode', '\"rogue\"')")
    assert info.value.sqlstate == "PB001"
    with pytest.raises(psycopg.Error) as info:
        b.execute("SELECT pgbroker.broker_state_delete('default', 'mode')")
    assert info.value.sqlstate == "PB001"
    assert a.execute("SELECT pgbroker.broker_state_delete('default', 'mode')").fetchone()[0] is True
    assert a.execute("SELECT pgbroker.broker_state_delete('default', 'mode')").fetchone()[0] is False
    a.close()
    new = claim(b, wait="5s")
    assert new == epoch + 1
    assert reader.execute("SELECT count(*) FROM pgbroker.broker_state").fetchone()[0] == 0
    # Hidden at once, deleted by the sweep; the new epoch writes beside it meanwhile.
    assert reader.execute("SELECT state FROM pgbroker.sweep_backlog").fetchone()[0] == 1
    b.execute("SELECT pgbroker.broker_state_set('default', 'clients', '\"new\"')")
    assert reader.execute("SELECT key, value, epoch FROM pgbroker.broker_state").fetchall() == [("clients", "new", new)]
    assert b.execute("SELECT pgbroker.broker_sweep('default')").fetchone()[0] == 1
    assert b.execute("SELECT pgbroker.broker_sweep('default')").fetchone()[0] == 0
    assert b.execute("SELECT epoch FROM pgbroker.state").fetchall() == [(new,)]
    b.execute("SELECT pgbroker.broker_state_set('default', 'mode', '\"primary\"')")
    assert reader.execute("SELECT key, epoch FROM pgbroker.broker_state ORDER BY key").fetchall() == [
        ("clients", new),
        ("mode", new),
    ]


def test_broker_state_of_another_name_survives(connect):
    a, b = connect("A"), connect("B")
    claim(a, "one")
    claim(b, "two")
    a.execute("SELECT pgbroker.broker_state_set('one', 'k', '1')")
    b.execute("SELECT pgbroker.broker_state_set('two', 'k', '2')")
    a.close()
    claim(b, "one", wait="5s")
    rows = b.execute("SELECT name, value FROM pgbroker.broker_state ORDER BY name").fetchall()
    assert rows == [("two", 2)]
