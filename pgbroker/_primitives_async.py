"""The coordination primitives for asyncio, and the one source of both flavours.

:mod:`pgbroker._primitives_sync` (``Lock``, ``Semaphore``, ``KV``, ``Counter``,
``lock``) is generated from this file by ``python3 -m pgbroker._gen_sync``:
edit this file, run the generator, commit both (a test fails when they
differ).  Every rule is in the SQL functions of ``pgbroker``; these classes
call them on the caller's psycopg connection and turn SQLSTATEs into the
exceptions of :mod:`pgbroker.errors`.

Connections: an autocommit connection is the usual choice.  On a
non-autocommit connection a call made outside a transaction runs in a
transaction of its own, committed at once; a call made inside the caller's
transaction is part of it.  An object does not serialise concurrent use of
its connection: share a connection between threads or tasks only as psycopg
allows.
"""

from __future__ import annotations

import asyncio  # ASYNC
import functools
import inspect  # ASYNC
import time
from collections.abc import AsyncIterator, Awaitable, Callable  # sync: from collections.abc import Callable, Iterator
from datetime import timedelta
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

import psycopg
import psycopg.sql
from psycopg import pq
from psycopg.abc import Query
from psycopg.types.json import Jsonb

from pgbroker._core import (
    BACKEND_PID_SQL,
    SCHEMA_VERSION_SQL,
    UNDEFINED_FUNCTION,
    _interval,
    _raise_translated,
    pooler_verdict,
)
from pgbroker._primitives_core import (
    _VERDICTS,
    COUNTER_ADD_SQL,
    COUNTER_DELETE_SQL,
    COUNTER_GET_SQL,
    COUNTER_SET_SQL,
    KV_CHANNEL_SQL,
    KV_DELETE_SQL,
    KV_GET_SQL,
    KV_SCAN_SQL,
    KV_SET_SQL,
    KV_WATCH_BEGIN_SQL,
    KV_WATCH_END_SQL,
    LOCK_ACQUIRE_SQL,
    LOCK_KEY_SQL,
    LOCK_RELEASE_SQL,
    RATE_LIMIT_SQL,
    RAW_HELD_SQL,
    RAW_LOCK_SQL,
    RAW_UNLOCK_SQL,
    SEMAPHORE_CHANNEL_SQL,
    SEMAPHORE_FALLBACK,
    SEMAPHORE_RELEASE_SQL,
    SEMAPHORE_TRY_SQL,
    UNSET,
    KVChange,
    KVEntry,
    RateLimitResult,
    lock_keys,
    parse_kv_payload,
    pooler_error_text,
    seconds,
    wait_param,
)
from pgbroker.errors import NotAcquired, PgBrokerError, PoolerNotSupported, schema_mismatch, translate
from pgbroker.install import SCHEMA_VERSION

__all__ = ["AsyncCounter", "AsyncKV", "AsyncLock", "AsyncRateLimiter", "AsyncSemaphore", "async_lock"]

Timeout = float | timedelta | None
P = ParamSpec("P")
R = TypeVar("R")
Limited = Callable[P, Awaitable[R]]  # sync: Limited = Callable[P, R]


def _in_transaction(conn: psycopg.AsyncConnection[Any]) -> bool:
    return conn.info.transaction_status != pq.TransactionStatus.IDLE


async def _rows(conn: psycopg.AsyncConnection[Any], query: Query, params: Any = None) -> list[Any]:
    """Run one statement and return its rows (errors translated).

    On a non-autocommit connection outside a transaction it runs in a transaction of its own, committed at once.
    """
    try:
        if conn.autocommit or _in_transaction(conn):
            cur = await conn.execute(query, params)
            return await cur.fetchall() if cur.description is not None else []
        async with conn.transaction():
            cur = await conn.execute(query, params)
            return await cur.fetchall() if cur.description is not None else []
    except psycopg.Error as exc:
        if exc.sqlstate == UNDEFINED_FUNCTION and not conn.closed and not _in_transaction(conn):
            _raise_translated(exc, await _schema_now(conn, exc))
        _raise_translated(exc)


async def _schema_now(conn: psycopg.AsyncConnection[Any], exc: psycopg.Error) -> Exception:
    """A 42883 outside a transaction of the caller's: :class:`SchemaMismatch` when the schema is of another version."""
    try:
        cur = await conn.execute(SCHEMA_VERSION_SQL)
        row = await cur.fetchone()
    except psycopg.Error:
        return translate(exc)
    return schema_mismatch(conn.info.dbname, row[0], SCHEMA_VERSION, exc) or translate(exc)


def _listen_sql(verb: str, channel: str) -> psycopg.sql.Composed:
    return psycopg.sql.SQL(verb + " {}").format(psycopg.sql.Identifier(channel))


async def _scalar(conn: psycopg.AsyncConnection[Any], query: Query, params: Any = None) -> Any:
    rows = await _rows(conn, query, params)
    return rows[0][0]


async def _check_session(conn: psycopg.AsyncConnection[Any], what: str, session_pooler: bool) -> None:
    """Raise :class:`PoolerNotSupported` unless ``conn`` keeps one server session (checked once per connection).

    Reads ``pg_backend_pid()`` in two separate transactions (one, inside the
    caller's open transaction) and compares them with the pid the connection
    was given at login (see :func:`pgbroker._primitives_core.pooler_verdict`).
    """
    if conn not in _VERDICTS:
        pids = [await _scalar(conn, BACKEND_PID_SQL)]
        if not _in_transaction(conn):
            pids.append(await _scalar(conn, BACKEND_PID_SQL))
        _VERDICTS[conn] = pooler_verdict(conn.info.backend_pid, pids)
    verdict = _VERDICTS[conn]
    if verdict is None or (session_pooler and verdict[0] == "pooler"):
        return
    raise PoolerNotSupported(pooler_error_text(what, verdict[1]))


class AsyncLock:
    """The named lock ``name`` (any text of 1 to 200 bytes), held by this object's connection.

    ``shared``: a shared lock (many holders) instead of an exclusive one.
    ``timeout``: how long :meth:`acquire` waits by default, in seconds or a
    timedelta (None: as long as it takes; 0: try once).  ``xact``: a
    transaction-scoped lock, taken inside the caller's open transaction and
    released by its commit or rollback (works through a pooler in transaction
    mode); otherwise session scope, held until :meth:`release` or the session
    ends, which needs a connection that keeps its server session
    (:class:`~pgbroker.errors.PoolerNotSupported` otherwise; pass
    ``session_pooler=True`` for a pooler in session mode).

    Holds stack as PostgreSQL advisory locks do: acquired twice, held until
    released twice.  As a context manager it acquires (raising
    :class:`~pgbroker.errors.NotAcquired` when ``timeout`` runs out) and
    releases one hold.
    """

    def __init__(
        self,
        conn: psycopg.AsyncConnection[Any],
        name: str,
        shared: bool = False,
        timeout: Timeout = None,
        xact: bool = False,
        *,
        session_pooler: bool = False,
    ) -> None:
        self.conn = conn
        self.name = name
        self.shared = shared
        self.timeout = timeout
        self.xact = xact
        self.session_pooler = session_pooler
        self._holds = 0

    def __repr__(self) -> str:
        mode = "shared" if self.shared else "exclusive"
        return f"<{type(self).__name__} {self.name!r} {mode} holds={self._holds}>"

    @property
    def locked(self) -> bool:
        """Whether this object holds the lock (once or more)."""
        return self._holds > 0

    async def acquire(self, timeout: Timeout = UNSET) -> bool:
        """Take the lock; True when acquired, False when ``timeout`` (default: the object's) ran out."""
        wait = wait_param(self.timeout if timeout is UNSET else timeout)
        params = {"name": self.name, "wait": wait, "shared": self.shared, "xact": self.xact}
        if self.xact:
            if self.conn.autocommit and not _in_transaction(self.conn):
                raise PgBrokerError(
                    "a transaction-scoped lock (xact=True) needs an open transaction: "
                    "acquire it inside `with conn.transaction():`"
                )
            try:
                cur = await self.conn.execute(LOCK_ACQUIRE_SQL, params)
                row = await cur.fetchone()
            except psycopg.Error as exc:
                _raise_translated(exc)
            acquired = bool(row and row[0])
        else:
            await _check_session(self.conn, "lock", self.session_pooler)
            acquired = await self._acquire_by_key(wait)
            if acquired is None:
                acquired = bool(await _scalar(self.conn, LOCK_ACQUIRE_SQL, params))
                await self._learn_key()
        if acquired:
            self._holds += 1
        return acquired

    def _key(self) -> tuple[int, int] | None:
        """The cached key of the name and the name grants' version it was allowed under, on an autocommit
        connection outside a transaction (else None)."""
        if not self.conn.autocommit or _in_transaction(self.conn):
            return None
        return lock_keys(self.conn).get(self.name)

    async def _acquire_by_key(self, wait: timedelta | None) -> bool | None:
        """Take the lock by its cached key (waiting forever, or trying once); None: use ``lock_acquire``.

        The same advisory lock ``lock_acquire`` takes, without the function
        call around it.  A session ``lock_timeout`` makes a wait that runs out
        fail with 55P03; ``lock_acquire`` then waits as documented (forever),
        unless the lock was granted just as the wait ran out (it is then held:
        acquired).  A cancel or ``statement_timeout`` during the wait gives
        such a grant back before it is raised.
        """
        cached = self._key()
        if cached is None or not (wait is None or wait == timedelta(0)):
            return None
        key, version = cached
        try:
            cur = await self.conn.execute(
                RAW_LOCK_SQL[self.shared, wait is not None], {"key": key, "version": version}, prepare=True
            )
            row = await cur.fetchone()
        except psycopg.errors.LockNotAvailable:
            return True if await self._held_now(key) else None
        except psycopg.errors.QueryCanceled as exc:  # a cancel or statement_timeout, during the wait
            if wait is None and await self._held_now(key):
                await self.conn.execute(RAW_UNLOCK_SQL[self.shared], {"key": key})
            _raise_translated(exc)
        except psycopg.Error as exc:
            _raise_translated(exc)
        if row is None or row[0] is None:  # the name grants changed: lock_acquire decides, and the key is learnt again
            lock_keys(self.conn).pop(self.name, None)
            return None
        return wait is None or bool(row[0])

    async def _held_now(self, key: int) -> bool:
        """Whether this session holds the lock of ``key`` in this object's mode (``pg_locks``)."""
        try:
            cur = await self.conn.execute(RAW_HELD_SQL[self.shared], {"key": key})
            row = await cur.fetchone()
        except psycopg.Error as exc:
            _raise_translated(exc)
        return bool(row and row[0])

    async def _learn_key(self) -> None:
        """Cache the name's key once it is registered by a committed transaction, while lock names have no grant
        (see ``pgbroker.lock_key``)."""
        if self.conn.autocommit and not _in_transaction(self.conn) and self.name not in lock_keys(self.conn):
            try:
                cur = await self.conn.execute(LOCK_KEY_SQL, {"name": self.name})
                row = await cur.fetchone()
            except psycopg.Error as exc:
                _raise_translated(exc)
            if row is not None and row[0] is not None and not row[2]:
                lock_keys(self.conn)[self.name] = (row[0], row[1])

    async def release(self) -> None:
        """Give back one hold of a session-scoped lock (a transaction-scoped one ends with its transaction)."""
        if self.xact:
            raise PgBrokerError(
                f"lock {self.name!r} is transaction-scoped: it is released by the commit or rollback of its transaction"
            )
        if self._holds == 0:
            raise PgBrokerError(f"lock {self.name!r} is not held by this object")
        self._holds -= 1
        cached = self._key()
        if cached is not None:  # giving back a hold needs no grant
            try:
                cur = await self.conn.execute(RAW_UNLOCK_SQL[self.shared], {"key": cached[0]}, prepare=True)
                row = await cur.fetchone()
            except psycopg.Error as exc:
                _raise_translated(exc)
            released = bool(row and row[0])
        else:
            released = await _scalar(self.conn, LOCK_RELEASE_SQL, {"name": self.name, "shared": self.shared})
        if not released:
            raise PgBrokerError(f"lock {self.name!r} was not held by this session any more")

    async def __aenter__(self) -> AsyncLock:
        if not await self.acquire():
            raise NotAcquired(f"lock {self.name!r} was not acquired within {self.timeout!r} seconds")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.xact:
            self._holds = 0  # ends with the caller's transaction
        elif not self.conn.closed and not self.conn.broken:
            await self.release()


def async_lock(
    conn: psycopg.AsyncConnection[Any],
    name: str,
    shared: bool = False,
    timeout: Timeout = None,
    xact: bool = False,
    *,
    session_pooler: bool = False,
) -> AsyncLock:
    """A lock to use as a context manager: ``async with async_lock(conn, "jobs"): ...``."""
    return AsyncLock(conn, name, shared, timeout, xact, session_pooler=session_pooler)


class AsyncSemaphore:
    """A permit of the counting semaphore ``name``: at most ``limit`` (1 to 1000) sessions hold one at a time.

    Session scope (a crashed holder's permit is free at once), so it needs a
    connection that keeps its server session, as a session-scoped
    :class:`AsyncLock` does.  One object holds at most one permit.

    A blocking :meth:`acquire` waits without polling: it LISTENs on
    ``pgbroker.semaphore_channel(name)`` *before* its first try
    (``semaphore_acquire(name, limit, '0')``), then waits for a notification
    and tries again, so a release between a failed try and the wait still
    wakes it.  A crashed holder sends no notification: the waiter also
    retries every ``SEMAPHORE_FALLBACK`` (0.25) seconds, the bound for such a
    permit to reach it.  The wait consumes the connection's notifications:
    use a connection that LISTENs to nothing else.  Waiters are not served in
    order.
    """

    def __init__(
        self,
        conn: psycopg.AsyncConnection[Any],
        name: str,
        limit: int = 3,
        timeout: Timeout = None,
        *,
        session_pooler: bool = False,
    ) -> None:
        self.conn = conn
        self.name = name
        self.limit = limit
        self.timeout = timeout
        self.session_pooler = session_pooler
        self.permit: int | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} limit={self.limit} permit={self.permit}>"

    @property
    def locked(self) -> bool:
        """Whether this object holds a permit."""
        return self.permit is not None

    async def acquire(self, timeout: Timeout = UNSET) -> int | None:
        """Take a permit and return its number (1..limit); None when ``timeout`` (default: the object's) ran out."""
        if self.permit is not None:
            raise PgBrokerError(f"this object already holds permit {self.permit} of semaphore {self.name!r}")
        await _check_session(self.conn, "semaphore", self.session_pooler)
        budget = seconds(self.timeout if timeout is UNSET else timeout)
        if budget is not None and budget <= 0:
            return await self._try(wait_param(budget))  # 0: try once; negative: 22023 from SQL
        if _in_transaction(self.conn):
            raise PgBrokerError(
                "a blocking Semaphore.acquire() waits for notifications, which arrive only between transactions: "
                "call it outside a transaction (or with timeout=0)"
            )
        channel = await self._listen()
        try:
            deadline = None if budget is None else time.monotonic() + budget
            while True:
                permit = await self._try()
                if permit is not None:
                    return permit
                remaining = SEMAPHORE_FALLBACK if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    return None
                await self._wait(min(remaining, SEMAPHORE_FALLBACK))
        finally:
            await self._unlisten(channel)

    async def release(self) -> None:
        """Give back the permit (the next waiter is notified at once)."""
        if self.permit is None:
            raise PgBrokerError(f"this object holds no permit of semaphore {self.name!r}")
        self.permit = None
        if not await _scalar(self.conn, SEMAPHORE_RELEASE_SQL, {"name": self.name}):
            raise PgBrokerError(f"semaphore {self.name!r}: this session held no permit any more")

    async def __aenter__(self) -> AsyncSemaphore:
        if await self.acquire() is None:
            raise NotAcquired(f"no permit of semaphore {self.name!r} within {self.timeout!r} seconds")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.permit is not None and not self.conn.closed and not self.conn.broken:
            await self.release()

    # The steps of a blocking acquire (a test runs them one by one).

    async def _listen(self) -> str:
        channel: str = await _scalar(self.conn, SEMAPHORE_CHANNEL_SQL, {"name": self.name})
        await _rows(self.conn, _listen_sql("LISTEN", channel))
        return channel

    async def _try(self, wait: timedelta = timedelta(0)) -> int | None:
        params = {"name": self.name, "limit": self.limit, "wait": wait}
        permit = await _scalar(self.conn, SEMAPHORE_TRY_SQL, params)
        self.permit = permit
        return permit

    async def _wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a notification; whether one came."""
        async for _ in self.conn.notifies(timeout=timeout, stop_after=1):
            return True
        return False

    async def _unlisten(self, channel: str) -> None:
        if not self.conn.closed and not self.conn.broken and not _in_transaction(self.conn):
            await _rows(self.conn, _listen_sql("UNLISTEN", channel))


class AsyncKV:
    """The key-value store: jsonb values, a version per key that grows on every change, optional expiry.

    Keys are text of 1 to 200 bytes; values anything ``json`` can encode.
    ``ttl`` is in seconds or a timedelta (None: never expires).  Reads and
    writes work through any pooler; :meth:`watch` LISTENs, so it needs a
    connection that keeps its server session (``session_pooler`` as for
    :class:`AsyncLock`).
    """

    def __init__(self, conn: psycopg.AsyncConnection[Any], *, session_pooler: bool = False) -> None:
        self.conn = conn
        self.session_pooler = session_pooler

    async def get(self, key: str) -> KVEntry | None:
        """(value, version, expires_at) of ``key``; None when it is absent or expired."""
        rows = await _rows(self.conn, KV_GET_SQL, {"key": key})
        return KVEntry(*rows[0]) if rows else None

    async def set(self, key: str, value: Any, ttl: Timeout = None) -> int:
        """Set ``key`` to ``value`` and return its new version."""
        version: int = await self._set(key, value, None, ttl)
        return version

    async def cas(self, key: str, value: Any, version: int, ttl: Timeout = None) -> int | None:
        """Set ``key`` only if its version is ``version`` (0: absent or expired); the new version, or None."""
        if version is None:
            raise TypeError("cas() needs the version to compare with (0: the key must not exist)")
        result: int | None = await self._set(key, value, version, ttl)
        return result

    async def delete(self, key: str, version: int | None = None) -> bool:
        """Delete ``key`` (only at ``version`` when given); whether a live entry was deleted."""
        return bool(await _scalar(self.conn, KV_DELETE_SQL, {"key": key, "version": version}))

    async def _set(self, key: str, value: Any, version: int | None, ttl: Timeout) -> Any:
        params = {"key": key, "value": Jsonb(value), "version": version, "ttl": wait_param(ttl)}
        return await _scalar(self.conn, KV_SET_SQL, params)

    async def watch(
        self, key: str | None = None, prefix: str | None = None, after_version: int = 0, timeout: Timeout = None
    ) -> AsyncIterator[KVChange]:
        """Yield the changes of ``key`` (or of the keys starting with ``prefix``; of all keys when neither is given)
        past ``after_version``, as they commit, without polling.  (A prefix
        watch first reads the view ``pgbroker.kv``: its role needs
        ``pgbroker_reader`` besides ``pgbroker_user``.)

        It LISTENs on ``pgbroker.kv_channel()`` first, registers as a watcher
        (``pgbroker.kv_watch_begin()``: changes are announced only while some
        session watches; it waits for key-value writes in flight), then reads the current
        entries (yielding those newer than ``after_version``), then waits for
        notifications and re-reads each changed key, so no change committed
        after the read is missed.  A deletion is yielded as it happens
        (``deleted=True``), with the version it took; an entry that is absent
        when the watch starts, or that expires, is not announced.  Versions
        only grow, and each key's change is yielded once.  ``timeout``: stop
        after that long without a change (None: never).  Close the iterator
        to UNLISTEN at once.  It consumes the connection's
        notifications: give it a connection of its own.
        """
        if key is not None and prefix is not None:
            raise TypeError("watch() takes key or prefix, not both")
        if _in_transaction(self.conn):
            raise PgBrokerError("watch() waits for notifications, which arrive only between transactions")
        await _check_session(self.conn, "watch (LISTEN)", self.session_pooler)
        wait = seconds(timeout)
        channel: str = await _scalar(self.conn, KV_CHANNEL_SQL)
        await _rows(self.conn, _listen_sql("LISTEN", channel))
        try:
            await _rows(self.conn, KV_WATCH_BEGIN_SQL)
        except BaseException:
            await _rows(self.conn, _listen_sql("UNLISTEN", channel))
            raise
        seen: dict[str, int] = {}

        def wanted(k: str, version: int) -> bool:
            matches = k == key if key is not None else k.startswith(prefix or "")
            return matches and version > max(after_version, seen.get(k, 0))

        try:
            if key is not None:
                entry = await self.get(key)
                first = [(key, *entry)] if entry is not None else []
            else:
                first = await _rows(self.conn, KV_SCAN_SQL, {"prefix": prefix or "", "after": after_version})
            for k, value, version, _ in first:
                if wanted(k, version):
                    seen[k] = version
                    yield KVChange(k, value, version)
            quiet_since = time.monotonic()
            while True:
                remaining = None if wait is None else quiet_since + wait - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return
                changes: list[tuple[str, int, bool]] = []
                async for note in self.conn.notifies(timeout=remaining, stop_after=1):
                    parsed = parse_kv_payload(note.payload) if note.channel == channel else None
                    if parsed is not None:
                        changes.append(parsed)
                for k, version, deleted in changes:
                    if not wanted(k, version):
                        continue
                    if deleted:
                        seen[k] = version
                        yield KVChange(k, None, version, True)
                        quiet_since = time.monotonic()
                        continue
                    entry = await self.get(k)
                    if entry is None or not wanted(k, entry.version):
                        seen[k] = max(version, seen.get(k, 0))  # changed again since: that change is announced too
                        continue
                    seen[k] = entry.version
                    yield KVChange(k, entry.value, entry.version)
                    quiet_since = time.monotonic()
        finally:
            if not self.conn.closed and not self.conn.broken and not _in_transaction(self.conn):
                await _rows(self.conn, KV_WATCH_END_SQL)
                await _rows(self.conn, _listen_sql("UNLISTEN", channel))


class AsyncCounter:
    """The atomic counter ``name`` (absent reads as 0; bigint range, 22003 beyond it)."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], name: str) -> None:
        self.conn = conn
        self.name = name

    async def add(self, delta: int = 1) -> int:
        """Add ``delta`` (may be negative) in one atomic statement; the new value."""
        value: int = await _scalar(self.conn, COUNTER_ADD_SQL, {"name": self.name, "delta": delta})
        return value

    async def get(self) -> int:
        """The current value (0 when it does not exist)."""
        value: int = await _scalar(self.conn, COUNTER_GET_SQL, {"name": self.name})
        return value

    async def set(self, value: int, expected: int | None = None) -> bool:
        """Set the value; with ``expected``, only if the current value is that (absent counts as 0)."""
        params = {"name": self.name, "value": value, "expected": expected}
        return bool(await _scalar(self.conn, COUNTER_SET_SQL, params))

    async def delete(self, expected: int | None = None) -> bool:
        """Delete the counter (it reads as 0 again); with ``expected``, only if its value is that.  False when
        it did not exist or its value differed."""
        params = {"name": self.name, "expected": expected}
        return bool(await _scalar(self.conn, COUNTER_DELETE_SQL, params))


class AsyncRateLimiter:
    """The rate limit ``name``: at most ``rate`` calls per ``per`` on average, ``burst`` (None: ``rate``) at once.

    One limit for every process that uses the same name, decided by
    ``pgbroker.rate_limit()`` on the database server's clock (GCRA), one
    statement per decision with no session state: it works through any
    pooler, transaction mode included.  ``per`` is in seconds or a timedelta.
    Callers that pass different parameters for one name are each judged by
    their own.

    :meth:`allow` decides one call and returns a :class:`RateLimitResult`
    (true when allowed).  :meth:`wait` sleeps until a call is allowed.  As a
    decorator (``@limiter`` above a function) it waits before each call of
    the function; as a context manager (``async with limiter:``) it waits on
    entry and gives the decision.  ``timeout`` is their default bound on
    waiting (None: no bound).

    A decision holds the name's row lock until its transaction ends: on a
    connection in a transaction, commit soon, or other callers of the name
    wait for it.  :meth:`wait` refuses to sleep inside a transaction.
    """

    def __init__(
        self,
        conn: psycopg.AsyncConnection[Any],
        name: str,
        rate: int,
        per: float | timedelta,
        burst: int | None = None,
        *,
        timeout: Timeout = None,
    ) -> None:
        self.conn = conn
        self.name = name
        self.rate = rate
        self.per = _interval(per, "per")
        self.burst = burst
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.rate} per {self.per} burst={self.burst}>"

    async def allow(self, cost: int = 1) -> RateLimitResult:
        """Decide one call of ``cost`` (1 to burst): allowed (it counts), or denied with ``retry_after`` seconds."""
        params = {"name": self.name, "rate": self.rate, "per": self.per, "burst": self.burst, "cost": cost}
        rows = await _rows(self.conn, RATE_LIMIT_SQL, params)
        allowed, retry_after, remaining = rows[0]
        return RateLimitResult(bool(allowed), retry_after.total_seconds(), remaining)

    async def wait(self, cost: int = 1, timeout: Timeout = UNSET) -> RateLimitResult:
        """Sleep until a call of ``cost`` is allowed, and return that decision.

        Each denied try sleeps the ``retry_after`` the server gave, then tries
        again (another caller may have taken the slot).  ``timeout`` (default:
        the object's; None: no bound; 0: one try) raises
        :class:`~pgbroker.errors.NotAcquired` as soon as a denied try's
        ``retry_after`` would take it past the timeout, without sleeping first.
        """
        # (A statement of another thread on a shared autocommit connection shows as ACTIVE: not a transaction.)
        if self.conn.info.transaction_status in (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR):
            raise PgBrokerError(
                "RateLimiter.wait() sleeps between tries, and inside a transaction each try keeps the name's row "
                "locked, which blocks every other caller of the name: call it outside a transaction"
            )
        budget = seconds(self.timeout if timeout is UNSET else timeout)
        deadline = None if budget is None else time.monotonic() + budget
        while True:
            result = await self.allow(cost)
            if result.allowed:
                return result
            if deadline is not None and time.monotonic() + result.retry_after > deadline:
                raise NotAcquired(
                    f"rate limit {self.name!r}: a call of cost {cost} is allowed in {result.retry_after:.6f} s,"
                    f" after the timeout of {budget!r} s"
                )
            await asyncio.sleep(result.retry_after)

    def __call__(self, func: Limited[P, R]) -> Limited[P, R]:
        """Decorate ``func`` so that each call first waits (:meth:`wait`, with the object's timeout)."""
        if not inspect.iscoroutinefunction(func):  # ASYNC
            raise TypeError(f"{func!r} is not a coroutine function: decorate it with a RateLimiter")  # ASYNC

        @functools.wraps(func)
        async def limited(*args: P.args, **kwargs: P.kwargs) -> R:
            await self.wait()
            return await func(*args, **kwargs)

        return limited

    async def __aenter__(self) -> RateLimitResult:
        return await self.wait()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None
