"""No lock leak: claims that fail, time out, are cancelled, roll back or
sit in a failed transaction leave no advisory lock of their backend, and
the lease stays claimable by another session at once."""

from __future__ import annotations

import time

import psycopg
import pytest
from conftest import advisory_locks
from lease_util import Background, claim, lease_row, release, wait_until, waiting
from psycopg import errors


@pytest.fixture
def connect(connect):
    def _connect(*args, **kwargs) -> psycopg.Connection:
        conn = connect(*args, **kwargs)
        conn.execute("SET statement_timeout = '15s'")
        return conn

    return _connect


def _no_locks(observer: psycopg.Connection, conn: psycopg.Connection) -> None:
    assert advisory_locks(observer, conn.info.backend_pid) == []


def _claimable_by_another(connect, name: str = "default") -> None:
    other = connect("other")
    assert claim(other, name) > 0
    assert release(other, name)


def test_refused_claim(connect):
    a, b, obs = connect("A"), connect("B"), connect("obs")
    claim(a)
    with pytest.raises(errors.LockNotAvailable):
        claim(b)
    _no_locks(obs, b)
    release(a)
    _claimable_by_another(connect)
    assert claim(b) > 0


def test_timed_out_claim(connect):
    a, b, obs = connect("A"), connect("B"), connect("obs")
    claim(a)
    with pytest.raises(errors.LockNotAvailable):
        claim(b, wait="250ms")
    _no_locks(obs, b)
    release(a)
    _claimable_by_another(connect)


def test_refused_claim_in_a_transaction_with_another_lease(connect):
    a, b, obs = connect("A"), connect("B"), connect("obs")
    claim(a)
    with pytest.raises(errors.LockNotAvailable), b.transaction():
        claim(b, "mine")
        claim(b)  # refused: the whole transaction rolls back, "mine" too
    _no_locks(obs, b)
    _claimable_by_another(connect, "mine")


@pytest.mark.parametrize("how", ["cancel", "statement_timeout"])
@pytest.mark.parametrize("in_transaction", [False, True], ids=["autocommit", "transaction"])
def test_cancelled_claim_while_waiting_forever(connect, how, in_transaction):
    a, b, obs = connect("A"), connect("B"), connect("obs")
    claim(a)
    if how == "statement_timeout":
        b.execute("SET statement_timeout = '400ms'")
    if in_transaction:
        b.execute("BEGIN")
        claim(b, "mine")
    call = Background(lambda: claim(b, wait=None))
    wait_until(lambda: waiting(obs, b.info.backend_pid), what="B to block")
    if how == "cancel":
        b.cancel_safe()
    with pytest.raises(errors.QueryCanceled):
        call.result()
    if in_transaction:
        assert b.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
        b.execute("ROLLBACK")
    _no_locks(obs, b)
    assert lease_row(obs)["holder_pid"] == a.info.backend_pid
    release(a)
    _claimable_by_another(connect)
    _claimable_by_another(connect, "mine")
    b.execute("SET statement_timeout = '15s'")
    assert claim(b) > 0  # and B itself can claim again


def test_rolled_back_claim(connect):
    b, obs = connect("B"), connect("obs")
    b.execute("BEGIN")
    claim(b)
    claim(b, "second")
    assert len(advisory_locks(obs, b.info.backend_pid)) == 2
    b.execute("ROLLBACK")
    _no_locks(obs, b)
    assert lease_row(obs) is None  # the first claim's row went too
    _claimable_by_another(connect)
    _claimable_by_another(connect, "second")


def test_rolled_back_claim_of_an_existing_lease(connect):
    a, b, obs = connect("A"), connect("B"), connect("obs")
    epoch = claim(a)
    release(a)
    b.execute("BEGIN")
    assert claim(b) > epoch
    b.execute("ROLLBACK")
    _no_locks(obs, b)
    row = lease_row(obs)
    assert (row["epoch"], row["state"], row["holder_pid"]) == (epoch, "released", a.info.backend_pid)
    _claimable_by_another(connect)


def test_claim_in_a_failed_transaction(connect):
    b, obs = connect("B"), connect("obs")
    b.execute("BEGIN")
    claim(b)
    with pytest.raises(errors.DivisionByZero):
        b.execute("SELECT 1/0")
    with pytest.raises(errors.InFailedSqlTransaction):
        claim(b, "again")
    b.execute("ROLLBACK")
    _no_locks(obs, b)
    _claimable_by_another(connect)


def test_claim_in_a_failing_statement(connect):
    b, obs = connect("B"), connect("obs")
    with pytest.raises(errors.DivisionByZero):
        b.execute("SELECT pgbroker.broker_claim(), 1/0")
    _no_locks(obs, b)
    assert lease_row(obs) is None
    _claimable_by_another(connect)


def test_claim_whose_commit_fails_is_swept_by_the_next_claim(connect):
    """A deferred constraint of the user's that fails at COMMIT after the
    claim's commit-time trigger ran (deferred triggers fire in queue order):
    like SET CONSTRAINTS ALL IMMEDIATE + ROLLBACK, a session lock is left
    behind, and the session's next claim sweeps it."""
    a, b, obs = connect("A"), connect("B"), connect("obs")
    obs.execute("CREATE TABLE guard (id int PRIMARY KEY, ref int REFERENCES guard DEFERRABLE INITIALLY DEFERRED)")
    claim(a)
    release(a)
    b.execute("BEGIN")
    claim(b)
    b.execute("INSERT INTO guard VALUES (1, 42)")  # fails only at commit
    with pytest.raises(errors.ForeignKeyViolation):
        b.execute("COMMIT")
    assert lease_row(obs)["state"] == "released"
    assert len(advisory_locks(obs, b.info.backend_pid)) == 1  # the leak
    assert claim(b, "other") > 0
    assert [lock[1] for lock in advisory_locks(obs, b.info.backend_pid)] == [
        obs.execute("SELECT lock_key FROM pgbroker.lease WHERE name = 'other'").fetchone()[0]
    ]
    _claimable_by_another(connect)


def test_cancelled_first_claim_waiting_for_a_concurrent_first_claim(connect):
    a, b, obs = connect("A"), connect("B"), connect("obs")
    a.execute("BEGIN")
    claim(a, "fresh")
    b.execute("SET statement_timeout = '300ms'")
    started = time.monotonic()
    with pytest.raises((errors.QueryCanceled, errors.LockNotAvailable)):
        claim(b, "fresh", wait=None)
    assert time.monotonic() - started < 5
    _no_locks(obs, b)
    a.execute("ROLLBACK")
    _claimable_by_another(connect, "fresh")


# ---------------------------------------------------------------------------
# SET CONSTRAINTS ALL IMMEDIATE + ROLLBACK: the commit-time trigger ran and
# the transaction still rolled back.  A session lock leaks (by design); the
# next broker_claim of that session, for any name, sweeps it.


@pytest.mark.parametrize("existing", [False, True], ids=["first-claim", "existing-lease"])
def test_set_constraints_immediate_rollback_leak_is_swept(connect, existing):
    a, b, obs = connect("A"), connect("B"), connect("obs")
    if existing:
        claim(b)
        release(b)
    a.execute("BEGIN")
    claim(a)
    a.execute("SET CONSTRAINTS ALL IMMEDIATE")
    a.execute("ROLLBACK")
    leaked = advisory_locks(obs, a.info.backend_pid)
    assert len(leaked) == 1, "expected the documented leak"
    if existing:  # the stray lock blocks others, with a clear message
        with pytest.raises(errors.LockNotAvailable, match="not its recorded holder"):
            claim(b)
    assert claim(a, "unrelated") > 0  # sweeps the stray lock
    assert [lock[1] for lock in advisory_locks(obs, a.info.backend_pid)] != [leaked[0][1]]
    assert len(advisory_locks(obs, a.info.backend_pid)) == 1  # only "unrelated"
    assert claim(b) > 0


def test_set_constraints_immediate_rollback_sweep_keeps_held_leases(connect):
    a, obs = connect("A"), connect("obs")
    held = claim(a, "held", owner="a")
    a.execute("BEGIN")
    claim(a)
    a.execute("SET CONSTRAINTS ALL IMMEDIATE")
    a.execute("ROLLBACK")
    assert len(advisory_locks(obs, a.info.backend_pid)) == 2
    assert claim(a, "held", owner="a") == held  # a re-claim sweeps too, and keeps what is held
    assert len(advisory_locks(obs, a.info.backend_pid)) == 1
    row = lease_row(obs, "held")
    assert (row["epoch"], row["alive"]) == (held, True)


def test_set_constraints_immediate_rollback_of_a_release(connect):
    """The reverse: the trigger dropped the lock and the release rolled back.
    The row says A holds it but the lock is gone; pgbroker must not pretend."""
    a, b, obs = connect("A"), connect("B"), connect("obs")
    epoch = claim(a)
    a.execute("BEGIN")
    release(a)
    a.execute("SET CONSTRAINTS ALL IMMEDIATE")
    a.execute("ROLLBACK")
    _no_locks(obs, a)
    assert lease_row(obs)["alive"] is False
    with pytest.raises(psycopg.Error) as info:
        obs.execute("SELECT pgbroker.broker_assert('default', %s)", (epoch,))
    assert info.value.sqlstate == "PB002"
    again = claim(a)
    assert again > epoch
    assert len(advisory_locks(obs, a.info.backend_pid)) == 1
    with pytest.raises(errors.LockNotAvailable):
        claim(b)
