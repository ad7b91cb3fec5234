"""The coordination primitives (sql/650..680, their views and grants) and their Python wrappers.

SQL first, on raw connections: named locks (exclusive, shared, stacking,
transaction scope, ``wait => '0'`` never blocking), semaphores (the bound,
different limits), the key-value store (compare-and-set, expiry, versions),
counters, the views as ``pgbroker_reader``, privileges and bad input.  Then
the Python objects, the lost-wake-up windows forced step by step, crash
safety with SIGKILLed holders, and the generated sync flavour.
"""

from __future__ import annotations

import asyncio
import inspect
import io
import json
import signal
import subprocess
import sys
import threading
import time
import tokenize
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

import pgbroker
from pgbroker import (
    KV,
    AsyncCounter,
    AsyncKV,
    AsyncLock,
    AsyncSemaphore,
    Counter,
    DatabaseError,
    InvalidArgument,
    KVChange,
    Lock,
    NotAcquired,
    PgBrokerError,
    Semaphore,
    primitives,
)
from pgbroker._core import pooler_verdict
from pgbroker._primitives_core import LOCK_CLASS, lock_keys

Connect = Callable[..., psycopg.Connection]


def one(conn: psycopg.Connection, query: str, *params: Any) -> Any:
    row = conn.execute(query, params).fetchone()
    return None if row is None else row[0]


def acquire(
    conn: psycopg.Connection, name: str, wait: str | None = "0", shared: bool = False, xact: bool = False
) -> bool:
    return one(conn, "SELECT pgbroker.lock_acquire(%s, %s::interval, %s, %s)", name, wait, shared, xact)


def release(conn: psycopg.Connection, name: str, shared: bool = False) -> bool:
    return one(conn, "SELECT pgbroker.lock_release(%s, %s)", name, shared)


def sem(conn: psycopg.Connection, name: str, limit: int, wait: str | None = "0") -> int | None:
    return one(conn, "SELECT pgbroker.semaphore_acquire(%s, %s, %s::interval)", name, limit, wait)


def primitive_rows(conn: psycopg.Connection) -> dict[str, int]:
    """How many rows each primitive's table has, and how many advisory locks they hold (as the superuser)."""
    return {
        table: one(conn, f"SELECT count(*) FROM pgbroker.{table}")
        for table in ("lock_name", "semaphore_permit", "kv_entry", "counter")
    } | {
        "advisory": one(
            conn, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid IN (1885823596, 1885823597)"
        )
    }


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run fn in a thread; the dict gets 'value' or 'error', and 'at' (monotonic time it returned)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc
        out["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def blocked(admin: psycopg.Connection, pid: int) -> bool:
    return bool(one(admin, "SELECT EXISTS (SELECT FROM pg_locks WHERE pid = %s AND NOT granted)", pid))


def wait_for(predicate: Callable[[], Any], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


# ---------------------------------------------------------------------------
# Named locks in SQL


def test_exclusive_and_shared_locks(connect: Connect):
    a, b, c = connect("A", user="t_user"), connect("B", user="t_user"), connect("C", user="t_user")
    assert acquire(a, "jobs") is True
    assert acquire(b, "jobs") is False
    assert acquire(b, "jobs", shared=True) is False
    assert acquire(b, "other") is True  # another name is another lock
    assert release(a, "jobs") is True
    assert acquire(b, "jobs", shared=True) is True
    assert acquire(c, "jobs", shared=True) is True  # shared holders coexist
    assert acquire(a, "jobs") is False  # but exclude an exclusive one
    reader = connect("R", user="t_reader")
    rows = reader.execute("SELECT name, mode, holder_pid FROM pgbroker.locks ORDER BY name, holder_pid").fetchall()
    assert rows == sorted(
        [
            ("jobs", "shared", b.info.backend_pid),
            ("jobs", "shared", c.info.backend_pid),
            ("other", "exclusive", b.info.backend_pid),
        ]
    )
    assert release(a, "jobs", shared=True) is False  # a holds nothing
    assert release(b, "jobs") is False  # b holds it shared, not exclusive


def test_locks_stack_and_release_matches(connect: Connect):
    a, b = connect("A", user="t_user"), connect("B", user="t_user")
    assert acquire(a, "stack") and acquire(a, "stack")
    assert release(a, "stack") is True
    assert acquire(b, "stack") is False  # still held once
    assert release(a, "stack") is True
    assert release(a, "stack") is False  # no third hold
    assert acquire(b, "stack") is True


def test_wait_times_out_and_never_collides_with_plain_advisory_locks(connect: Connect):
    a, b = connect("A", user="t_user"), connect("B")
    assert acquire(a, "w")
    started = time.monotonic()
    assert acquire(b, "w", wait="150 ms") is False
    assert 0.1 < time.monotonic() - started < 2
    key = one(b, "SELECT key FROM pgbroker.lock_name WHERE name = 'w'")
    # Other code's single-bigint advisory lock with the same number is another lock.
    assert one(b, "SELECT pg_try_advisory_lock(%s)", key) is True
    assert one(b, "SELECT pg_try_advisory_lock(%s)", 1885823596 * 2**32 + key) is True


def test_views_count_blocked_waiters(connect: Connect):
    a, b, c, admin = connect("A", user="t_user"), connect("B", user="t_user"), connect("C", user="t_user"), connect()
    reader = connect("R", user="t_reader")
    assert acquire(a, "busy") and sem(a, "busy-sem", 1) == 1
    lock_waiter, lock_out = in_thread(lambda: acquire(b, "busy", wait="5 s"))
    sem_waiter, sem_out = in_thread(lambda: sem(c, "busy-sem", 1, wait="5 s"))
    wait_for(lambda: blocked(admin, b.info.backend_pid) and blocked(admin, c.info.backend_pid))
    query = "SELECT holder_pid, waiting, waiting_since IS NOT NULL FROM pgbroker.locks WHERE name = 'busy'"
    row = reader.execute(query)
    assert row.fetchone() == (a.info.backend_pid, 1, True)
    assert one(reader, "SELECT waiting FROM pgbroker.semaphores WHERE name = 'busy-sem'") == 1
    assert release(a, "busy") and one(a, "SELECT pgbroker.semaphore_release('busy-sem')")
    lock_waiter.join(5)
    sem_waiter.join(5)
    assert lock_out["value"] is True and sem_out["value"] == 1


def test_transaction_scoped_lock_ends_with_commit_and_rollback(connect: Connect):
    a, b = connect("A", user="t_user"), connect("B", user="t_user")
    for end in ("COMMIT", "ROLLBACK"):
        a.execute("BEGIN")
        assert acquire(a, "tx", xact=True) is True
        assert acquire(b, "tx") is False
        assert release(a, "tx") is False  # cannot be released early
        assert acquire(b, "tx") is False
        a.execute(end)
        assert acquire(b, "tx") is True, end
        assert release(b, "tx") is True


def test_wait_zero_never_blocks_on_a_name_another_transaction_is_registering(connect: Connect):
    a, b = connect("A", user="t_user"), connect("B", user="t_user")
    a.execute("BEGIN")
    assert acquire(a, "brand-new", xact=True) is True  # registers the name, uncommitted
    assert sem(a, "brand-new-sem", 2) == 1  # registers the permits, uncommitted
    started = time.monotonic()
    assert acquire(b, "brand-new") is False
    assert sem(b, "brand-new-sem", 2) is None
    assert time.monotonic() - started < 0.5
    started = time.monotonic()
    assert acquire(b, "brand-new", wait="200 ms") is False  # bounded too
    assert 0.15 < time.monotonic() - started < 2
    a.execute("COMMIT")
    assert acquire(b, "brand-new") is True
    assert sem(b, "brand-new-sem", 2) == 2  # a still holds permit 1 (session scope)


# ---------------------------------------------------------------------------
# Semaphores in SQL


def test_semaphore_bound_release_and_notify(connect: Connect):
    conns = [connect(f"S{i}", user="t_user") for i in range(3)]
    assert [sem(c, "pool", 2) for c in conns] == [1, 2, None]
    listener = connect("L", user="t_user")
    channel = one(listener, "SELECT pgbroker.semaphore_channel('pool')")
    listener.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel)))
    assert one(conns[0], "SELECT pgbroker.semaphore_release('pool')") is True
    notes = list(listener.notifies(timeout=2, stop_after=1))
    assert [(n.channel, n.payload) for n in notes] == [(channel, "1")]
    assert one(conns[0], "SELECT pgbroker.semaphore_release('pool')") is False  # holds none now
    assert sem(conns[2], "pool", 2) == 1
    reader = connect("R", user="t_reader")
    row = reader.execute(
        "SELECT permits, held, holders, waiting FROM pgbroker.semaphores WHERE name = 'pool'"
    ).fetchone()
    assert row == (2, 2, [conns[2].info.backend_pid, conns[1].info.backend_pid], 0)


def test_pgbroker_user_may_call_semaphore_channel(connect: Connect):
    conn = connect("U", user="t_user")
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        conn.execute("SELECT pgbroker.semaphore_channel('')")
    assert one(conn, "SELECT pgbroker.semaphore_channel('x')").startswith("pgbroker_semaphore_")


def test_semaphore_different_limits_compete_for_their_first_permits(connect: Connect):
    """The rule of sql/660: a caller with limit L competes for permits 1..L only."""
    a, b, c, d, e = (connect(x, user="t_user") for x in "ABCDE")
    assert sem(a, "mixed", 1) == 1
    assert sem(b, "mixed", 3) == 2
    assert sem(c, "mixed", 1) is None  # its only permit is taken
    assert sem(d, "mixed", 2) is None  # permits 1 and 2 are taken
    assert sem(e, "mixed", 3) == 3
    assert one(a, "SELECT pgbroker.semaphore_release('mixed')") is True
    assert sem(d, "mixed", 2) == 1
    held = one(connect("R", user="t_reader"), "SELECT held FROM pgbroker.semaphores WHERE name = 'mixed'")
    assert held == 3  # never more than the largest limit in use


# ---------------------------------------------------------------------------
# Key-value store and counters in SQL


def kv_set(conn: psycopg.Connection, key: str, value: Any, version: int | None = None, ttl: str | None = None) -> Any:
    return one(conn, "SELECT pgbroker.kv_set(%s, %s, %s, %s::interval)", key, Jsonb(value), version, ttl)


def test_kv_compare_and_set(connect: Connect):
    conn = connect("kv", user="t_user")
    v1 = kv_set(conn, "cfg", {"a": 1}, version=0)  # 0: must not exist
    assert v1 is not None
    assert kv_set(conn, "cfg", {"a": 2}, version=0) is None
    assert kv_set(conn, "cfg", {"a": 2}, version=v1 + 100) is None
    assert conn.execute("SELECT value, version FROM pgbroker.kv_get('cfg')").fetchone() == ({"a": 1}, v1)
    v2 = kv_set(conn, "cfg", {"a": 2}, version=v1)
    assert v2 > v1
    assert kv_set(conn, "cfg", {"a": 3}, version=v1) is None  # stale version
    assert one(conn, "SELECT pgbroker.kv_delete('cfg', %s)", v1) is False
    assert one(conn, "SELECT pgbroker.kv_delete('cfg', %s)", v2) is True
    assert conn.execute("SELECT * FROM pgbroker.kv_get('cfg')").fetchall() == []
    assert one(conn, "SELECT pgbroker.kv_delete('cfg')") is False
    v3 = kv_set(conn, "cfg", "again", version=0)
    assert v3 > v2 + 1  # the delete took a version too: versions grow across delete and set
    assert kv_set(conn, "cfg", None if False else "x") > v3  # plain set always writes


def test_python_lock_wait_cut_off_by_statement_timeout_leaves_no_hold(connect: Connect):
    """The Lock's wait by cached key, cut off by statement_timeout: an error, and no hold left behind."""
    a, b, admin = connect("A", user="t_user"), connect("B", user="t_user"), connect("admin")
    lock = Lock(a, "cut")
    assert lock.acquire() is True
    lock.release()
    assert "cut" in lock_keys(a)  # the next acquire waits by key
    assert acquire(b, "cut") is True
    a.execute("SET statement_timeout = '200ms'")
    with pytest.raises(DatabaseError) as cut:
        Lock(a, "cut").acquire()
    assert cut.value.sqlstate == "57014"
    assert one(admin, "SELECT count(*) FROM pg_locks WHERE pid = %s AND locktype = 'advisory'", a.info.backend_pid) == 0


def test_kv_set_that_waited_for_the_key_takes_a_greater_version(connect: Connect):
    """Issue 41, forced: a set that waits for the row takes its version after the wait, so it is
    greater than every version of the key that committed meanwhile (also after a delete)."""
    a = connect("A", user="t_user", autocommit=False)
    b, admin = connect("B", user="t_user"), connect("admin")
    kv_set(b, "hot", 0)
    first = kv_set(a, "hot", 1)  # a holds the row
    thread, out = in_thread(lambda: kv_set(b, "hot", 2))
    wait_for(lambda: blocked(admin, b.info.backend_pid))
    second = kv_set(a, "hot", 3)  # a version taken after b began
    a.commit()
    thread.join(5)
    assert "value" in out, out
    assert first < second < out["value"]
    assert b.execute("SELECT value, version FROM pgbroker.kv_get('hot')").fetchone() == (2, out["value"])
    # A set that waits for a delete of the key inserts a new row, numbered after what committed meanwhile.
    assert one(a, "SELECT pgbroker.kv_delete('hot')") is True
    thread, out = in_thread(lambda: kv_set(b, "hot", 4))
    wait_for(lambda: blocked(admin, b.info.backend_pid))
    meanwhile = kv_set(a, "elsewhere", 5)
    a.commit()
    thread.join(5)
    assert "value" in out, out
    assert out["value"] > meanwhile > second


def test_timed_lock_waits_hold_what_they_say(connect: Connect):
    """A transaction-scope wait ends holding the lock for its transaction only; a wait cut off by
    statement_timeout leaves no hold behind."""
    a, b, admin = connect("A", user="t_user"), connect("B", user="t_user", autocommit=False), connect("admin")
    assert acquire(a, "waited") is True
    thread, out = in_thread(lambda: acquire(b, "waited", wait="5 s", xact=True))
    wait_for(lambda: blocked(admin, b.info.backend_pid))
    assert release(a, "waited") is True
    thread.join(5)
    assert out.get("value") is True, out
    assert acquire(a, "waited") is False  # held for b's transaction ...
    b.commit()
    assert acquire(a, "waited") is True  # ... and no session hold of b's left behind
    b.autocommit = True
    b.execute("SET statement_timeout = '200ms'")
    for wait in (None, "5 s"):
        with pytest.raises(psycopg.errors.QueryCanceled):
            acquire(b, "waited", wait=wait)
    assert one(admin, "SELECT count(*) FROM pg_locks WHERE pid = %s AND locktype = 'advisory'", b.info.backend_pid) == 0


def test_kv_expiry_counts_as_absent(connect: Connect):
    conn = connect("kv", user="t_user")
    v1 = kv_set(conn, "tmp", 1, ttl="80 ms")
    value, version, expires_at = conn.execute("SELECT * FROM pgbroker.kv_get('tmp')").fetchone()
    assert (value, version) == (1, v1) and expires_at is not None
    time.sleep(0.12)
    assert conn.execute("SELECT * FROM pgbroker.kv_get('tmp')").fetchall() == []
    assert one(connect("R", user="t_reader"), "SELECT count(*) FROM pgbroker.kv WHERE key = 'tmp'") == 0
    assert kv_set(conn, "tmp", 2, version=v1) is None  # an expired entry has no version to match
    assert one(conn, "SELECT pgbroker.kv_delete('tmp')") is False  # nothing live to delete
    assert kv_set(conn, "tmp2", 1, ttl="80 ms") is not None
    time.sleep(0.12)
    v2 = kv_set(conn, "tmp2", 2, version=0)  # expired counts as absent
    assert v2 is not None
    assert conn.execute("SELECT value, expires_at FROM pgbroker.kv_get('tmp2')").fetchone() == (2, None)


def test_counters(connect: Connect):
    conn = connect("c", user="t_user")
    assert one(conn, "SELECT pgbroker.counter_get('hits')") == 0
    assert one(conn, "SELECT pgbroker.counter_set('hits', 5, 1)") is False  # absent is 0, not 1
    assert one(conn, "SELECT pgbroker.counter_set('hits', 5, 0)") is True  # expected 0 matches absent
    assert one(conn, "SELECT pgbroker.counter_set('hits', 7, 0)") is False
    assert one(conn, "SELECT pgbroker.counter_add('hits')") == 6
    assert one(conn, "SELECT pgbroker.counter_add('hits', -10)") == -4
    assert one(conn, "SELECT pgbroker.counter_set('hits', 1, -4)") is True
    assert one(conn, "SELECT pgbroker.counter_set('hits', 9)") is True
    assert one(conn, "SELECT pgbroker.counter_get('hits')") == 9
    with pytest.raises(psycopg.errors.NumericValueOutOfRange):
        conn.execute("SELECT pgbroker.counter_add('hits', 9223372036854775807)")
    assert one(conn, "SELECT pgbroker.counter_get('hits')") == 9
    rows = connect("R", user="t_reader").execute("SELECT name, value FROM pgbroker.counters").fetchall()
    assert rows == [("hits", 9)]


def test_a_counter_is_deleted_only_when_asked(connect: Connect):
    conn, owner = connect("c", user="t_user"), connect("owner")
    assert one(conn, "SELECT pgbroker.counter_add('order/7', 3)") == 3
    assert one(conn, "SELECT pgbroker.counter_delete('order/7', 2)") is False  # not its value: kept
    assert one(conn, "SELECT pgbroker.counter_get('order/7')") == 3
    assert one(conn, "SELECT pgbroker.counter_delete('order/7', 3)") is True
    assert one(owner, "SELECT count(*) FROM pgbroker.counter WHERE name = 'order/7'") == 0  # no row left behind
    assert one(conn, "SELECT pgbroker.counter_get('order/7')") == 0
    assert one(conn, "SELECT pgbroker.counter_delete('order/7')") is False  # nothing to delete
    assert one(conn, "SELECT pgbroker.counter_add('order/7')") == 1  # starts again at 0
    assert one(conn, "SELECT pgbroker.counter_delete('order/7')") is True
    # maintain() never removes a counter, however long it sat unused.
    assert one(conn, "SELECT pgbroker.counter_add('kept')") == 1
    owner.execute("UPDATE pgbroker.counter SET updated_at = now() - interval '1 year' WHERE name = 'kept'")
    owner.execute("SELECT pgbroker.maintain()")
    assert one(conn, "SELECT pgbroker.counter_get('kept')") == 1


def test_kv_view_shows_values_only_to_members_of_pgbroker_user(connect: Connect):
    """Readers see keys and versions; members of pgbroker_user (t_user, t_admin) see the values too."""
    kv_set(connect("w", user="t_user"), "secret", {"token": "s3"})
    for user in ("t_user", "t_admin"):
        rows = connect(user, user=user).execute("SELECT key, value FROM pgbroker.kv").fetchall()
        assert rows == [("secret", {"token": "s3"})], user
    reader_rows = connect("R", user="t_reader").execute("SELECT key, value, version FROM pgbroker.kv").fetchall()
    assert reader_rows[0][:2] == ("secret", None) and reader_rows[0][2] > 0
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        connect("B", user="t_broker").execute("SELECT * FROM pgbroker.kv")


# ---------------------------------------------------------------------------
# Privileges and bad input

CALLS = [
    "SELECT pgbroker.lock_acquire('p', '0')",
    "SELECT pgbroker.lock_release('p')",
    "SELECT pgbroker.semaphore_acquire('p', 1)",
    "SELECT pgbroker.semaphore_release('p')",
    "SELECT pgbroker.semaphore_channel('p')",
    "SELECT pgbroker.lock_key('p')",
    "SELECT * FROM pgbroker.kv_get('p')",
    "SELECT pgbroker.kv_set('p', '1')",
    "SELECT pgbroker.kv_delete('p')",
    "SELECT pgbroker.kv_channel()",
    "SELECT pgbroker.counter_add('p')",
    "SELECT pgbroker.counter_get('p')",
    "SELECT pgbroker.counter_set('p', 1)",
    "SELECT pgbroker.counter_delete('p')",
]


@pytest.mark.parametrize("role", ["t_broker", "t_none", "t_reader"])
def test_only_pgbroker_user_may_call_the_primitives(connect: Connect, role: str):
    conn = connect(role, user=role)
    for call in CALLS:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(call)
    if role == "t_reader":
        for view in ("locks", "semaphores", "kv", "counters"):
            conn.execute(f"SELECT * FROM pgbroker.{view}")
    else:
        for view in ("locks", "semaphores", "kv", "counters"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(f"SELECT * FROM pgbroker.{view}")
    assert primitive_rows(connect("admin")) == dict.fromkeys(
        ("lock_name", "semaphore_permit", "kv_entry", "counter", "advisory"), 0
    )


LONG = "x" * 201
BAD_INPUT = [
    ("SELECT pgbroker.lock_acquire(NULL, '0')", ()),
    ("SELECT pgbroker.lock_acquire('', '0')", ()),
    ("SELECT pgbroker.lock_acquire(%s, '0')", (LONG,)),
    ("SELECT pgbroker.lock_acquire(%s, '0')", ("é" * 100 + "x",)),  # 201 bytes, 101 characters
    ("SELECT pgbroker.lock_acquire('ok', '-1 s')", ()),
    ("SELECT pgbroker.lock_acquire('ok', '0', NULL)", ()),
    ("SELECT pgbroker.lock_release('')", ()),
    ("SELECT pgbroker.lock_key(NULL)", ()),
    ("SELECT pgbroker.lock_key(%s)", (LONG,)),
    ("SELECT pgbroker.semaphore_acquire('ok', 0)", ()),
    ("SELECT pgbroker.semaphore_acquire('ok', -1)", ()),
    ("SELECT pgbroker.semaphore_acquire('ok', 1001)", ()),
    ("SELECT pgbroker.semaphore_acquire('ok', NULL)", ()),
    ("SELECT pgbroker.semaphore_acquire('ok', 1, '-1 ms')", ()),
    ("SELECT pgbroker.semaphore_acquire(%s, 1)", (LONG,)),
    ("SELECT pgbroker.kv_set(NULL, '1')", ()),
    ("SELECT pgbroker.kv_set(%s, '1')", (LONG,)),
    ("SELECT pgbroker.kv_set('ok', NULL)", ()),
    ("SELECT pgbroker.kv_set('ok', '1', NULL, '-1 s')", ()),
    ("SELECT pgbroker.kv_set('ok', '1', NULL, '0')", ()),
    ("SELECT pgbroker.kv_set('ok', '1', -1)", ()),
    ("SELECT pgbroker.kv_delete('')", ()),
    ("SELECT * FROM pgbroker.kv_get('')", ()),
    ("SELECT pgbroker.counter_add('')", ()),
    ("SELECT pgbroker.counter_add('ok', NULL)", ()),
    ("SELECT pgbroker.counter_add('ok', 9223372036854775807)", ()),  # created, then added: fine once...
    ("SELECT pgbroker.counter_set('ok', NULL)", ()),
    ("SELECT pgbroker.counter_get(%s)", (LONG,)),
    ("SELECT pgbroker.counter_delete(%s)", (LONG,)),
    ("SELECT pgbroker.counter_delete('')", ()),
]


def test_bad_input_fails_clearly_and_changes_nothing(connect: Connect):
    conn, admin = connect("bad", user="t_user"), connect("admin")
    empty = primitive_rows(admin)
    for query, params in BAD_INPUT:
        if "9223372036854775807" in query:
            continue  # checked below with an existing counter
        with pytest.raises(psycopg.DataError) as info:
            conn.execute(query, params)
        assert info.value.sqlstate in ("22023", "22004"), (query, info.value.sqlstate)
        assert info.value.diag.message_primary, query
        assert primitive_rows(admin) == empty, query
    # 200 bytes is fine
    assert acquire(conn, "é" * 100) is True
    # overflow: 22003 and the counter keeps its value
    assert one(conn, "SELECT pgbroker.counter_add('big', 9223372036854775000)") == 9223372036854775000
    with pytest.raises(psycopg.errors.NumericValueOutOfRange):
        conn.execute("SELECT pgbroker.counter_add('big', 9223372036854775807)")
    with pytest.raises(psycopg.errors.NumericValueOutOfRange):
        conn.execute("SELECT pgbroker.counter_add('big', 808)")
    assert one(conn, "SELECT pgbroker.counter_get('big')") == 9223372036854775000


def test_lock_key_is_the_lock_of_committed_names_only(connect: Connect):
    """lock_key(name): the key lock_acquire locks, NULL before the first use and inside the registering transaction."""
    a, b, admin = connect("A", user="t_user"), connect("B", user="t_user"), connect("admin")
    assert one(a, "SELECT pgbroker.lock_key('k1')") is None
    with a.transaction():
        assert acquire(a, "k1") is True
        assert one(a, "SELECT pgbroker.lock_key('k1')") is None  # a rollback would void it
    key = one(a, "SELECT pgbroker.lock_key('k1')")
    assert key == one(admin, "SELECT key FROM pgbroker.lock_name WHERE name = 'k1'")
    assert one(b, "SELECT pgbroker.lock_key('k1')") == key
    assert release(a, "k1") is True
    # The same lock as lock_acquire's: taken raw by key, lock_acquire sees it held, and the view names it.
    assert one(admin, "SELECT pgbroker._lock_class_lock()") == LOCK_CLASS  # the Python Lock's fast path takes it
    b.execute("SELECT pg_advisory_lock(1885823596, %s)", (key,))
    assert acquire(a, "k1") is False
    assert one(admin, "SELECT holder_pid FROM pgbroker.locks WHERE name = 'k1'") == b.info.backend_pid
    assert release(b, "k1") is True
    assert acquire(a, "k1") is True
    with pytest.raises(psycopg.errors.DivisionByZero), a.transaction():
        assert acquire(a, "k2") is True
        a.execute("SELECT 1/0")
    assert one(a, "SELECT pgbroker.lock_key('k2')") is None  # rolled back: never registered


# ---------------------------------------------------------------------------
# Python: Lock


def test_python_lock(connect: Connect):
    a, b = connect("A", user="t_user"), connect("B", user="t_user")
    with Lock(a, "py") as held:
        assert held.locked
        other = Lock(b, "py", timeout=0)
        assert other.acquire() is False and not other.locked
        with pytest.raises(NotAcquired), Lock(b, "py", timeout=0.05):
            pass
        assert Lock(b, "py", shared=True).acquire(timeout=timedelta(0)) is False
    assert not held.locked
    assert other.acquire() is True
    assert other.acquire() is True  # stacks
    other.release()
    assert Lock(a, "py", timeout=0).acquire() is False
    other.release()
    with pytest.raises(PgBrokerError):
        other.release()
    with pgbroker.lock(a, "py", timeout=0) as held:
        assert held.locked and acquire(b, "py") is False
    with pytest.raises(InvalidArgument):
        Lock(a, "").acquire()
    with pytest.raises(InvalidArgument):
        Lock(a, "py").acquire(timeout=-1)


def test_python_lock_by_cached_key(connect: Connect):
    """After a name's first use the Lock takes the same advisory lock by its key, with the same semantics."""
    a, b, admin = connect("A", user="t_user"), connect("B", user="t_user"), connect("admin")
    lock = Lock(a, "cached")
    assert lock.acquire() is True
    lock.release()
    key = one(admin, "SELECT key FROM pgbroker.lock_name WHERE name = 'cached'")
    assert lock_keys(a) == {"cached": (key, 0)}  # the name grants' version: none yet
    statements: list[str] = []
    a.add_notice_handler(lambda diag: statements.append(str(diag.message_primary)))
    with Lock(a, "cached", timeout=0) as held:
        assert held.locked and acquire(b, "cached") is False
        assert one(admin, "SELECT holder_pid FROM pgbroker.locks WHERE name = 'cached'") == a.info.backend_pid
    assert acquire(b, "cached") is True
    assert Lock(a, "cached", timeout=0).acquire() is False
    assert Lock(a, "cached", shared=True, timeout=0).acquire() is False
    assert release(b, "cached") is True
    # shared holds by key stack and exclude exclusive ones
    s1, s2 = Lock(a, "cached", shared=True), Lock(a, "cached", shared=True)
    assert s1.acquire() is True and s2.acquire() is True
    assert acquire(b, "cached", shared=True) is True and acquire(b, "cached") is False
    assert release(b, "cached", shared=True) is True
    s1.release()
    assert acquire(b, "cached") is False
    s2.release()
    assert acquire(b, "cached") is True
    # A session lock_timeout does not turn "wait as long as it takes" into an error.
    a.execute("SET lock_timeout = '50ms'")
    thread, out = in_thread(Lock(a, "cached").acquire)
    wait_for(lambda: blocked(admin, a.info.backend_pid))
    time.sleep(0.2)
    assert thread.is_alive()
    released_at = time.monotonic()
    assert release(b, "cached") is True
    thread.join(5)
    assert out.get("value") is True and out["at"] >= released_at, out
    assert acquire(b, "cached") is False
    assert statements == []  # no "you don't own a lock" warnings on the way


def test_python_lock_caches_no_key_of_a_rolled_back_registration(connect: Connect):
    a, b = connect("A", user="t_user"), connect("B", user="t_user")
    with pytest.raises(psycopg.errors.DivisionByZero), a.transaction():
        assert Lock(a, "gone", timeout=0).acquire() is True
        a.execute("SELECT 1/0")
    assert "gone" not in lock_keys(a)
    assert acquire(b, "gone") is True  # registered afresh, with a new key
    assert Lock(a, "gone", timeout=0).acquire() is False
    assert lock_keys(a)["gone"][0] == one(b, "SELECT pgbroker.lock_key('gone')")
    assert Lock(a, "gone", timeout=0).acquire() is False  # by key now: the same lock
    assert release(b, "gone") is True
    assert Lock(a, "gone", timeout=0).acquire() is True and acquire(b, "gone") is False


def test_python_transaction_scoped_lock(connect: Connect):
    a, b = connect("A", user="t_user"), connect("B", user="t_user")
    with pytest.raises(PgBrokerError, match="open transaction"):
        Lock(a, "tx", xact=True).acquire()
    with a.transaction():
        with Lock(a, "tx", xact=True) as held:
            assert held.locked and acquire(b, "tx") is False
        with pytest.raises(PgBrokerError, match="transaction-scoped"):
            held.release()
        assert acquire(b, "tx") is False  # still held: it ends with the transaction
    assert acquire(b, "tx") is True
    # A non-autocommit connection: the lock is taken in the transaction psycopg opens.
    c = connect("C", user="t_user", autocommit=False)
    assert Lock(c, "tx2", xact=True, timeout=0).acquire() is True
    assert acquire(b, "tx2") is False
    c.rollback()
    assert acquire(b, "tx2") is True


def test_python_session_lock_taken_and_released_inside_a_transaction(connect: Connect):
    """A name first used inside the caller's transaction: released there, or rolled back, nothing stays held."""
    a, b = connect("A", user="t_user"), connect("B", user="t_user")
    with a.transaction():
        with Lock(a, "fresh", timeout=0) as held:
            assert held.locked
        assert Lock(a, "fresh", timeout=0).acquire() is True  # and again, kept past the commit
    assert acquire(b, "fresh") is False
    assert release(a, "fresh") is True
    assert acquire(b, "fresh") is True and release(b, "fresh")
    with pytest.raises(psycopg.errors.DivisionByZero), a.transaction():
        assert Lock(a, "fresh2", timeout=0).acquire() is True
        a.execute("SELECT 1/0")
    assert acquire(b, "fresh2") is True  # the rollback took the registration and the hold


def test_python_lock_on_a_non_autocommit_connection_commits_its_own_calls(connect: Connect):
    c, b = connect("C", user="t_user", autocommit=False), connect("B", user="t_user")
    lock = Lock(c, "nac", timeout=0)
    assert lock.acquire() is True
    assert c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE  # no transaction left open
    assert acquire(b, "nac") is False
    lock.release()
    assert acquire(b, "nac") is True


# ---------------------------------------------------------------------------
# Python: Semaphore, with the lost-wake-up window forced


def test_python_semaphore(connect: Connect):
    a, b, c = (connect(x, user="t_user") for x in "ABC")
    with Semaphore(a, "sem", limit=2) as s1:
        assert s1.permit == 1 and s1.locked
        s2 = Semaphore(b, "sem", limit=2)
        assert s2.acquire() == 2
        s3 = Semaphore(c, "sem", limit=2, timeout=0)
        assert s3.acquire() is None
        started = time.monotonic()
        assert s3.acquire(timeout=0.1) is None
        assert time.monotonic() - started >= 0.1
        with pytest.raises(PgBrokerError, match="already holds"):
            s1.acquire()
        # A blocked waiter is woken by a release in another session, at once.
        thread, out = in_thread(lambda: s3.acquire(timeout=5))
        time.sleep(0.05)
        released = time.monotonic()
        s2.release()
        thread.join(5)
        assert out["value"] == 2
        assert out["at"] - released < 0.1, "woken by the notification, not the 0.25 s fallback"
    assert not s1.locked
    s3.release()
    with pytest.raises(PgBrokerError):
        s3.release()
    with pytest.raises(InvalidArgument):
        Semaphore(a, "sem", limit=0).acquire()
    with pytest.raises(InvalidArgument):
        Semaphore(a, "sem", limit=1).acquire(timeout=-1)
    # UNLISTENed when done
    assert one(c, "SELECT count(*) FROM pg_listening_channels()") == 0


def test_semaphore_release_between_failed_try_and_wait_still_wakes(connect: Connect):
    """The lost-wake-up window, forced: LISTEN, fail, THEN the holder releases, THEN wait."""
    holder, waiter_conn = connect("H", user="t_user"), connect("W", user="t_user")
    held = Semaphore(holder, "window", limit=1)
    assert held.acquire(timeout=0) == 1  # a try needs no channel
    waiter = Semaphore(waiter_conn, "window", limit=1)
    channel = waiter._listen()
    try:
        assert waiter._try() is None
        held.release()  # sends its NOTIFY now, before the waiter waits
        started = time.monotonic()
        assert waiter._wait(1.0) is True  # the notification, not a timeout
        elapsed = time.monotonic() - started
        assert elapsed < 0.1
        assert waiter._try() == 1
    finally:
        waiter._unlisten(channel)
    print(f"semaphore wake-up after a release in the window: {elapsed * 1000:.2f} ms")


def test_sql_semaphore_window_with_raw_listen(connect: Connect):
    """The documented SQL recipe: LISTEN before the try; a release in between is queued for the waiter."""
    holder, waiter = connect("H", user="t_user"), connect("W", user="t_user")
    assert sem(holder, "raw", 1) == 1
    channel = one(waiter, "SELECT pgbroker.semaphore_channel('raw')")
    waiter.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel)))
    assert sem(waiter, "raw", 1) is None
    assert one(holder, "SELECT pgbroker.semaphore_release('raw')") is True
    notes = list(waiter.notifies(timeout=0.1, stop_after=1))
    assert [n.payload for n in notes] == ["1"]
    assert sem(waiter, "raw", 1) == 1


# ---------------------------------------------------------------------------
# Python: KV and its watch


def kv_notes(conn: psycopg.Connection) -> list[tuple[str, int]]:
    """The (key, version) of the key-value notifications queued for conn, in commit order."""
    return [
        (json.loads(n.payload)["key"], json.loads(n.payload)["version"])
        for n in conn.notifies(timeout=0.5, stop_after=100)
        if n.channel == "pgbroker_kv"
    ]


def test_kv_changes_are_announced_only_while_a_session_watches(connect: Connect):
    """Unwatched writes send no NOTIFY; registered watchers (kv_watch_begin .. kv_watch_end) get every change.

    Notifications arrive in commit order, so a change announced after an
    unannounced one proves the first was not announced (no timing involved).
    """
    writer, listener, watcher = (connect(n, user="t_user") for n in ("W", "L", "V"))
    listener.execute("LISTEN pgbroker_kv")  # listens, never registers
    watcher.execute("LISTEN pgbroker_kv")
    quiet = one(writer, "SELECT pgbroker.kv_set('a', '1')")
    assert one(writer, "SELECT pgbroker.kv_delete('a')") is True
    watcher.execute("SELECT pgbroker.kv_watch_begin()")
    loud = one(writer, "SELECT pgbroker.kv_set('b', '1')")
    assert kv_notes(listener) == [("b", loud)] and kv_notes(watcher) == [("b", loud)]
    assert loud > quiet
    # the watcher's own writes reach it too
    own = one(watcher, "SELECT pgbroker.kv_set('own', '1')")
    assert kv_notes(watcher) == [("own", own)] and kv_notes(listener) == [("own", own)]
    assert one(watcher, "SELECT pgbroker.kv_watch_end()") is True
    assert one(watcher, "SELECT pgbroker.kv_watch_end()") is False
    quiet2 = one(writer, "SELECT pgbroker.kv_set('c', '1')")
    watcher.execute("SELECT pgbroker.kv_watch_begin()")
    loud2 = one(writer, "SELECT pgbroker.kv_set('d', '1')")
    assert kv_notes(listener) == [("d", loud2)] and loud2 > quiet2
    watcher.close()  # a watcher's registration ends with its session
    wait_for(lambda: one(writer, "SELECT count(*) FROM pg_locks WHERE classid = 1885823595 AND objid = 1") == 0)
    one(writer, "SELECT pgbroker.kv_set('e', '1')")
    listener.execute("SELECT pgbroker.kv_watch_begin()")
    last = one(writer, "SELECT pgbroker.kv_set('f', '1')")
    assert kv_notes(listener) == [("f", last)]


def test_kv_watch_begin_waits_for_writes_in_flight(connect: Connect):
    """The lost-wake-up window, forced: a write that looked for watchers before one registered is not announced,
    so the registration waits for its commit and the watcher's read sees it; writes meanwhile are not held up.
    """
    writer = connect("W", user="t_user", autocommit=False)
    other, watcher, admin = connect("O", user="t_user"), connect("V", user="t_user"), connect("admin")
    version = one(writer, "SELECT pgbroker.kv_set('win', '1')")  # in flight: no watcher yet, not announced
    watcher.execute("LISTEN pgbroker_kv")
    thread, out = in_thread(lambda: watcher.execute("SELECT pgbroker.kv_watch_begin()"))
    wait_for(lambda: blocked(admin, watcher.info.backend_pid))
    # Writes do not wait for the registering watcher; they announce themselves while it registers.
    wthread, wout = in_thread(lambda: one(other, "SELECT pgbroker.kv_set('meanwhile', '2')"))
    wthread.join(5)
    assert "value" in wout, wout
    assert thread.is_alive() and blocked(admin, watcher.info.backend_pid)
    writer.commit()
    thread.join(5)
    assert "error" not in out and "at" in out, out
    assert one(watcher, "SELECT version FROM pgbroker.kv_get('win')") == version
    assert kv_notes(watcher) == [("meanwhile", wout["value"])]
    # From now on the writer's changes are announced.
    again = one(writer, "SELECT pgbroker.kv_set('win', '3')")
    writer.commit()
    assert kv_notes(watcher) == [("win", again)]


def test_python_kv_watch_sees_a_write_in_flight_when_it_starts(connect: Connect):
    writer = connect("W", user="t_user", autocommit=False)
    watch_conn, admin = connect("V", user="t_user"), connect("admin")
    version = one(writer, "SELECT pgbroker.kv_set('pw', '{\"n\": 1}')")
    watch = KV(watch_conn).watch(key="pw", timeout=10)
    thread, out = in_thread(lambda: next(watch))
    wait_for(lambda: blocked(admin, watch_conn.info.backend_pid))
    writer.commit()
    thread.join(10)
    assert out.get("value") == KVChange("pw", {"n": 1}, version), out
    later = one(writer, "SELECT pgbroker.kv_set('pw', '2')")
    writer.commit()
    assert next(watch) == KVChange("pw", 2, later)
    watch.close()
    assert one(watch_conn, "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND classid = 1885823595") == 0


def test_python_kv(connect: Connect):
    kv = KV(connect("kv", user="t_user"))
    assert kv.get("k") is None
    v1 = kv.cas("k", {"n": 1}, 0)
    assert v1 is not None and kv.cas("k", {"n": 1}, 0) is None
    entry = kv.get("k")
    assert entry == ({"n": 1}, v1, None) and entry.version == v1
    v2 = kv.set("k", [1, 2], ttl=60)
    assert v2 > v1 and kv.get("k").expires_at is not None
    assert kv.cas("k", "x", v1) is None and kv.get("k").value == [1, 2]
    v3 = kv.cas("k", "x", v2)
    assert v3 > v2
    assert kv.delete("k", version=v2) is False
    assert kv.delete("k") is True and kv.get("k") is None
    assert kv.set("k", None) > v3  # JSON null is a value
    assert kv.get("k").value is None
    with pytest.raises(InvalidArgument):
        kv.set("", 1)
    with pytest.raises(InvalidArgument):
        kv.set("k", 1, ttl=-1)


def test_kv_watch_sees_a_change_made_before_it_waits(connect: Connect):
    """The lost-wake-up window for watches: a write between the read and the wait is yielded."""
    watcher, writer = KV(connect("watcher", user="t_user")), KV(connect("writer", user="t_user"))
    v1 = writer.set("w/a", 1)
    # A reader reads version v1, the key changes before the watch starts: the watch yields it.
    assert watcher.get("w/a").version == v1
    v2 = writer.set("w/a", 2)
    changes = watcher.watch("w/a", after_version=v1, timeout=1)
    assert next(changes) == KVChange("w/a", 2, v2)
    # The watch has read and yielded; a write lands before it waits again: yielded, at once.
    v3 = writer.set("w/a", 3)
    started = time.monotonic()
    assert next(changes) == KVChange("w/a", 3, v3)
    assert time.monotonic() - started < 0.1
    writer.set("w/other", 0)  # another key: not this watch's
    v4 = writer.set("w/a", 4)
    assert next(changes) == KVChange("w/a", 4, v4)
    assert writer.delete("w/a")
    change = next(changes)
    assert change.deleted and change.key == "w/a" and change.value is None and change.version > v4
    started = time.monotonic()
    assert list(changes) == []  # ends after 1 s without a change
    assert 0.9 < time.monotonic() - started < 3
    assert one(watcher.conn, "SELECT count(*) FROM pg_listening_channels()") == 0


def test_kv_watch_prefix_in_a_thread(connect: Connect):
    # A prefix watch reads the view pgbroker.kv first, which pgbroker_user may.
    watcher, writer = KV(connect("watcher", user="t_user")), KV(connect("writer", user="t_user"))
    old = writer.set("cfg/old", 0)
    seen: list[KVChange] = []

    def watch() -> None:
        for change in watcher.watch(prefix="cfg/", after_version=old, timeout=0.5):
            seen.append(change)

    thread, _ = in_thread(watch)
    time.sleep(0.1)
    va = writer.set("cfg/a", "A")
    writer.set("app/x", "X")
    vb = writer.cas("cfg/b", "B", 0)
    thread.join(5)
    assert seen == [KVChange("cfg/a", "A", va), KVChange("cfg/b", "B", vb)]


# ---------------------------------------------------------------------------
# Python: Counter, and the asyncio flavour


def test_python_counter(connect: Connect):
    counter = Counter(connect("c", user="t_user"), "n")
    assert counter.get() == 0
    assert counter.set(3, expected=0) is True
    assert counter.add() == 4 and counter.add(-5) == -1
    assert counter.set(10, expected=4) is False and counter.get() == -1
    assert counter.set(10) is True and counter.get() == 10
    with pytest.raises(InvalidArgument) as info:
        counter.add(2**63 - 1)
    assert info.value.sqlstate == "22003" and counter.get() == 10
    assert counter.delete(expected=9) is False and counter.get() == 10
    assert counter.delete() is True and counter.get() == 0 and counter.delete() is False
    with pytest.raises(InvalidArgument):
        Counter(counter.conn, "").add()


def test_async_flavour(db_url: str, connect: Connect):
    other = connect("other", user="t_user")
    url = db_url.replace("postgres@", "t_user@", 1)

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            async with AsyncLock(conn, "alock") as held:
                assert held.locked and acquire(other, "alock") is False
            assert acquire(other, "alock") is True and release(other, "alock")
            async with pgbroker.async_lock(conn, "alock", shared=True):
                assert acquire(other, "alock", shared=True) is True
            async with AsyncSemaphore(conn, "asem", limit=1) as s:
                assert s.permit == 1 and sem(other, "asem", 1) is None
            kv = AsyncKV(conn)
            v1 = await kv.set("ak", {"x": 1})
            assert await kv.get("ak") == ({"x": 1}, v1, None)
            assert await kv.cas("ak", 2, v1) > v1 and await kv.cas("ak", 3, v1) is None
            counter = AsyncCounter(conn, "ac")
            assert await counter.add(2) == 2 and await counter.get() == 2
            assert await counter.set(0, expected=2) is True
            assert await counter.delete(expected=0) is True and await counter.delete() is False
            # A blocking acquire woken by a release from another session.
            assert sem(other, "asem", 1) == 1
            waiter = AsyncSemaphore(conn, "asem", limit=1, timeout=5)
            task = asyncio.ensure_future(waiter.acquire())
            await asyncio.sleep(0.05)
            released = time.monotonic()
            await asyncio.to_thread(one, other, "SELECT pgbroker.semaphore_release('asem')")
            assert await task == 1
            assert time.monotonic() - released < 0.1
            await waiter.release()
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            watch = AsyncKV(conn).watch("ak", timeout=1)
            first = await watch.__anext__()
            assert first.key == "ak" and first.value == 2
            v = await asyncio.to_thread(lambda: KV(other).set("ak", "later"))
            assert await watch.__anext__() == KVChange("ak", "later", v)
            await watch.aclose()

    asyncio.run(scenario())


# ---------------------------------------------------------------------------
# Crash safety: SIGKILL a holder, a blocked waiter proceeds at once

HOLDER = """
import sys, time, psycopg
conn = psycopg.connect(sys.argv[1], autocommit=True, application_name="primitive-holder")
if sys.argv[2] == "lock":
    assert conn.execute("SELECT pgbroker.lock_acquire('crash', '0')").fetchone()[0]
else:
    assert conn.execute("SELECT pgbroker.semaphore_acquire('crash', 1)").fetchone()[0] == 1
print(conn.info.backend_pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(
    "kind, wait_sql",
    [
        ("lock", "SELECT pgbroker.lock_acquire('crash', wait => '10 s')"),
        ("semaphore", "SELECT pgbroker.semaphore_acquire('crash', 1, '10 s') = 1"),
    ],
)
def test_sigkilled_holder_frees_at_once(db_url: str, connect: Connect, kind: str, wait_sql: str):
    url = db_url.replace("postgres@", "t_user@", 1)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, url, kind], stdout=subprocess.PIPE, text=True)
    try:
        holder_pid = int(holder.stdout.readline())
        waiter, admin = connect("waiter", user="t_user"), connect("admin")
        waiter_pid = waiter.info.backend_pid
        thread, out = in_thread(lambda: one(waiter, wait_sql))
        wait_for(lambda: blocked(admin, waiter_pid))
        killed = time.monotonic()
        holder.send_signal(signal.SIGKILL)
        thread.join(10)
        assert out.get("value") is True, out
        elapsed = out["at"] - killed
        print(f"{kind}: SIGKILL of the holder (backend {holder_pid}) -> waiter holds it after {elapsed * 1000:.1f} ms")
        assert elapsed < 0.5
    finally:
        holder.kill()
        holder.wait(10)


def test_sigkilled_permit_holder_reaches_a_listening_waiter_within_the_fallback(db_url: str, connect: Connect):
    """A crashed holder sends no NOTIFY: a Python waiter gets the permit at its next fallback retry (<= 0.25 s)."""
    url = db_url.replace("postgres@", "t_user@", 1)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, url, "semaphore"], stdout=subprocess.PIPE, text=True)
    try:
        holder_pid = int(holder.stdout.readline())
        waiter = Semaphore(connect("waiter", user="t_user"), "crash", limit=1, timeout=5)
        thread, out = in_thread(waiter.acquire)
        admin = connect("admin")
        time.sleep(0.15)  # the waiter has tried and waits
        assert "value" not in out and "error" not in out
        killed = time.monotonic()
        holder.send_signal(signal.SIGKILL)
        wait_for(lambda: one(admin, "SELECT NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = %s)", holder_pid))
        thread.join(5)
        assert out.get("value") == 1, out
        elapsed = out["at"] - killed
        print(f"semaphore: SIGKILLed holder -> LISTENing Python waiter holds the permit after {elapsed * 1000:.0f} ms")
        assert elapsed < primitives.SEMAPHORE_FALLBACK + 0.3
    finally:
        holder.kill()
        holder.wait(10)


def test_pooler_verdict():
    """Direct: the login pid runs every transaction; a pooler: another pid; transaction pooling: two pids."""
    assert pooler_verdict(100, [100, 100]) is None
    assert pooler_verdict(100, [100]) is None
    kind, why = pooler_verdict(7, [100, 100])
    assert kind == "pooler" and "100" in why and "7" in why
    kind, why = pooler_verdict(7, [100, 101])
    assert kind == "transaction" and "transaction mode" in why


# ---------------------------------------------------------------------------
# One implementation: the sync primitives are generated from the async source


def test_sync_primitives_are_generated_from_the_async_source():
    from pgbroker import _gen_sync, _primitives_async, _primitives_sync

    wanted = _gen_sync.generate_primitives(_gen_sync.PRIMITIVES_SOURCE.read_text())
    assert _gen_sync.PRIMITIVES_TARGET.read_text() == wanted, "run: python3 -m pgbroker._gen_sync"
    names = {tok.string for tok in tokenize.generate_tokens(io.StringIO(wanted).readline) if tok.type == tokenize.NAME}
    assert not names & {"async", "await", "asyncio", "AsyncConnection", "AsyncLock", "AsyncKV", "async_lock"}
    pairs = [("AsyncLock", "Lock"), ("AsyncSemaphore", "Semaphore"), ("AsyncKV", "KV"), ("AsyncCounter", "Counter")]
    for async_name, sync_name in pairs:
        a, s = getattr(_primitives_async, async_name), getattr(_primitives_sync, sync_name)
        public = {n for n in dir(a) if not n.startswith("_")}
        assert public == {n for n in dir(s) if not n.startswith("_")}
        for name in public:
            if inspect.isfunction(getattr(a, name)):
                assert inspect.signature(getattr(a, name)).parameters.keys() == (
                    inspect.signature(getattr(s, name)).parameters.keys()
                ), name
    assert _gen_sync.main(["--check"]) == 0
