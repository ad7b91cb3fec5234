"""What the two flavours of the coordination primitives share, with no I/O of its own.

The statements (``*_SQL``), the result types, the argument conversions and the
pooler verdict.  The flavours are :mod:`pgbroker._primitives_async` (the
source) and :mod:`pgbroker._primitives_sync` (generated from it by
:mod:`pgbroker._gen_sync`); :mod:`pgbroker.primitives` gathers the public names.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from pgbroker._core import _interval

# Every statement the primitives run: schema-qualified, parameters bound.
LOCK_ACQUIRE_SQL = (
    "SELECT pgbroker.lock_acquire(name => %(name)s, wait => %(wait)s, shared => %(shared)s, xact => %(xact)s)"
)
LOCK_RELEASE_SQL = "SELECT pgbroker.lock_release(name => %(name)s, shared => %(shared)s)"
# The key of a name, the version of the name grants it was allowed under, and
# whether lock names have grants (then every acquire asks lock_acquire, which
# judges role memberships as they are now: the key is not cached).
LOCK_KEY_SQL = (
    "SELECT pgbroker.lock_key(name => %(name)s), v.version, 'lock' = ANY (v.kinds) FROM pgbroker.name_grants_version v"
)
# A session lock on a name whose key is known (pgbroker.lock_key): the very
# advisory lock lock_acquire() takes, without the function call around it,
# taken only while the name grants are those the key was handed out under
# (NULL otherwise: a grant or revoke since; lock_acquire then decides).
LOCK_CLASS = 1885823596  # pgbroker._lock_class_lock() ('pgbl'); a test compares them
_GRANTS_UNCHANGED = "(SELECT version FROM pgbroker.name_grants_version) = %(version)s"
RAW_LOCK_SQL = {
    # (shared, try once)
    (False, False): f"SELECT CASE WHEN {_GRANTS_UNCHANGED}"
    f" THEN pg_catalog.pg_advisory_lock({LOCK_CLASS}, %(key)s) IS NULL END",
    (True, False): f"SELECT CASE WHEN {_GRANTS_UNCHANGED}"
    f" THEN pg_catalog.pg_advisory_lock_shared({LOCK_CLASS}, %(key)s) IS NULL END",
    (
        False,
        True,
    ): f"SELECT CASE WHEN {_GRANTS_UNCHANGED} THEN pg_catalog.pg_try_advisory_lock({LOCK_CLASS}, %(key)s) END",
    (True, True): f"SELECT CASE WHEN {_GRANTS_UNCHANGED}"
    f" THEN pg_catalog.pg_try_advisory_lock_shared({LOCK_CLASS}, %(key)s) END",
}
# Does this session hold the lock of key %(key)s in this mode?  After a wait
# that failed (a session lock_timeout, a cancel): PostgreSQL may grant the
# lock at the very moment the error is raised, and a session lock outlives
# the error (issue 41).  The session did not hold it before (a wait on a lock
# it holds in that mode is granted at once), so a hold now is the wait's.
RAW_HELD_SQL = {
    shared: "SELECT EXISTS (SELECT FROM pg_catalog.pg_locks l WHERE l.locktype = 'advisory'"
    " AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database())"
    f" AND l.classid = {LOCK_CLASS}::oid AND l.objid = %(key)s::integer::oid AND l.objsubid = 2"
    " AND l.pid = pg_catalog.pg_backend_pid() AND l.granted"
    f" AND l.mode = '{mode}')"
    for shared, mode in ((False, "ExclusiveLock"), (True, "ShareLock"))
}
RAW_UNLOCK_SQL = {
    False: f"SELECT pg_catalog.pg_advisory_unlock({LOCK_CLASS}, %(key)s)",
    True: f"SELECT pg_catalog.pg_advisory_unlock_shared({LOCK_CLASS}, %(key)s)",
}
SEMAPHORE_CHANNEL_SQL = "SELECT pgbroker.semaphore_channel(name => %(name)s)"
SEMAPHORE_TRY_SQL = 'SELECT pgbroker.semaphore_acquire(name => %(name)s, "limit" => %(limit)s, wait => %(wait)s)'
SEMAPHORE_RELEASE_SQL = "SELECT pgbroker.semaphore_release(name => %(name)s)"
KV_CHANNEL_SQL = "SELECT pgbroker.kv_channel()"
KV_WATCH_BEGIN_SQL = "SELECT pgbroker.kv_watch_begin()"
KV_WATCH_END_SQL = "SELECT pgbroker.kv_watch_end()"
KV_GET_SQL = "SELECT value, version, expires_at FROM pgbroker.kv_get(key => %(key)s)"
KV_SET_SQL = "SELECT pgbroker.kv_set(key => %(key)s, value => %(value)s, version => %(version)s, ttl => %(ttl)s)"
KV_DELETE_SQL = "SELECT pgbroker.kv_delete(key => %(key)s, version => %(version)s)"
# What a watch reads first: the live entries under a prefix (every one for
# prefix '') changed after a version, oldest change first.
KV_SCAN_SQL = (
    "SELECT key, value, version, expires_at FROM pgbroker.kv"
    " WHERE pg_catalog.starts_with(key, %(prefix)s) AND version > %(after)s ORDER BY version"
)
COUNTER_ADD_SQL = "SELECT pgbroker.counter_add(name => %(name)s, delta => %(delta)s)"
COUNTER_GET_SQL = "SELECT pgbroker.counter_get(name => %(name)s)"
COUNTER_SET_SQL = "SELECT pgbroker.counter_set(name => %(name)s, value => %(value)s, expected => %(expected)s)"
COUNTER_DELETE_SQL = "SELECT pgbroker.counter_delete(name => %(name)s, expected => %(expected)s)"
RATE_LIMIT_SQL = (
    "SELECT allowed, retry_after, remaining FROM pgbroker.rate_limit(name => %(name)s, rate => %(rate)s,"
    " per => %(per)s, burst => %(burst)s, cost => %(cost)s)"
)

# A blocking Semaphore.acquire() retries at least this often (seconds): the
# bound for a crashed holder's permit (which sends no NOTIFY) to reach a
# waiter that LISTENs.  A graceful release wakes the waiter at once.
SEMAPHORE_FALLBACK = 0.25


class KVEntry(NamedTuple):
    """A live entry of the key-value store."""

    value: Any
    version: int
    expires_at: datetime | None


class KVChange(NamedTuple):
    """A change a watch saw: the key's new value and version, or ``deleted`` (value None)."""

    key: str
    value: Any
    version: int
    deleted: bool = False


@dataclass(frozen=True)
class RateLimitResult:
    """One decision of a rate limit; true when the call is allowed.

    ``retry_after``: 0.0 when allowed, else the seconds until a call of the
    same cost can be allowed (if nobody else calls meanwhile).
    ``remaining``: how many calls of cost 1 would be allowed right after this one.
    """

    allowed: bool
    retry_after: float
    remaining: int

    def __bool__(self) -> bool:
        return self.allowed


class _Unset:
    """The default of ``acquire(timeout=...)``: use the object's own timeout."""

    def __repr__(self) -> str:
        return "<the object's timeout>"


UNSET: Any = _Unset()


def wait_param(timeout: float | timedelta | None) -> timedelta | None:
    """A ``timeout`` (seconds, a timedelta, or None: forever) as the SQL ``wait`` interval."""
    return _interval(timeout, "timeout")


def seconds(timeout: float | timedelta | None) -> float | None:
    """A ``timeout`` in seconds (None stays None)."""
    return timeout.total_seconds() if isinstance(timeout, timedelta) else timeout


def parse_kv_payload(payload: str) -> tuple[str, int, bool] | None:
    """(key, version, deleted) of a notification on the key-value channel; None when it is not one."""
    try:
        data = json.loads(payload)
        key, version = data["key"], data["version"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(key, str) or not isinstance(version, int):
        return None
    return key, version, bool(data.get("deleted", False))


# The pooler verdict of each connection, found once per connection: None when
# its session stays on one backend, else why it may not.
_VERDICTS: weakref.WeakKeyDictionary[Any, tuple[str, str] | None] = weakref.WeakKeyDictionary()


# The lock keys of names, per connection, as pgbroker.lock_key() gave them,
# with the version of the name grants they were handed out under: only keys
# of committed registrations, while lock names have no grant; a grant or
# revoke since, or a pgbroker.maintain() that found names idle (it bumps the
# same version before it may forget a name, whose next use then gets a new
# key), makes the fast path step aside (RAW_LOCK_SQL).  Bounded: cleared when it
# grows past LOCK_KEYS_MAX names.
_LOCK_KEYS: weakref.WeakKeyDictionary[Any, dict[str, tuple[int, int]]] = weakref.WeakKeyDictionary()
LOCK_KEYS_MAX = 10_000


def lock_keys(conn: Any) -> dict[str, tuple[int, int]]:
    """The cached lock keys of ``conn`` (name -> (key, name grants version))."""
    keys = _LOCK_KEYS.get(conn)
    if keys is None:
        keys = _LOCK_KEYS[conn] = {}
    elif len(keys) >= LOCK_KEYS_MAX:
        keys.clear()
    return keys


def pooler_error_text(what: str, reason: str) -> str:
    return (
        f"a session-scoped {what} needs a connection that keeps its server session, and {reason}. "
        "Use a transaction-scoped lock (xact=True, inside a transaction), connect directly, "
        "or, through a pooler in session mode, pass session_pooler=True"
    )
