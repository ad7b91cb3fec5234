"""The broker lease from Python: :class:`Broker` (threads) and :class:`AsyncBroker` (asyncio).

A broker object owns one dedicated, autocommit psycopg connection.  It claims
the lease with ``pgbroker.broker_claim()``, keeps it alive with
``pgbroker.broker_heartbeat()`` and releases it with
``pgbroker.broker_release()``; every rule lives in that SQL.  Python only
opens the connection, calls the functions, watches the connection and turns
SQLSTATEs into exceptions (:func:`pgbroker.errors.translate`).

    with Broker(url, "orders", wait=None, dead_man=2.0, heartbeat_interval=0.25) as broker:
        while True:
            broker.check()                  # raises LeaseLost: stop acting
            with other_conn.transaction():
                broker.assert_epoch(other_conn)   # fences the write below
                other_conn.execute("UPDATE ...")

How loss is noticed
-------------------
A watcher (a thread for :class:`Broker`; a task that waits in a worker thread
for :class:`AsyncBroker`) sleeps on the connection's socket between
heartbeats.  Anything the server sends unasked -- above all the FATAL message
and end-of-file of a terminated backend or a shut-down server -- wakes it at
once; it then runs a heartbeat, which fails.  A failed heartbeat (connection
gone, SQLSTATE classes 08 / 57P, or PB001 "this session does not hold the
lease") marks the broker lost: ``lost`` becomes true, ``on_lost(exc)`` is
called once (from the thread or task that noticed it), and :meth:`check`
raises :class:`~pgbroker.errors.LeaseLost` from then on.  A broker claims
once: after a loss, create a new one.

The timing bound
----------------
Let *t0* be the moment (client clock) the last successful heartbeat was
*sent*.  :meth:`check` raises once ``guard`` seconds have passed since *t0*,
even if the watcher is wedged, so a holder that calls ``check()`` before each
action stops acting in bounded time.  The lease can change hands in two ways:

1. **The server stops hearing from the holder** (process paused by SIGSTOP, a
   VM freeze or a long GC; network partition; half-dead peer).  The server
   then frees the lock no earlier than *T* seconds after *t0*, where *T* is
   the smallest of: ``keepalive.idle`` (server-side TCP keepalive, set on the
   session), ``keepalive.user_timeout`` (server-side TCP_USER_TIMEOUT),
   ``dead_man`` (``idle_session_timeout`` on the broker session, if given),
   and the ``stale_after`` another claimant passes to ``broker_claim()``.
   The constructor enforces ``heartbeat_interval < guard < T`` for the first
   three (``stale_after`` is the claimant's choice: use one larger than the
   holders' ``guard``).  So in this case :meth:`check` raises **before** any
   other session can have claimed the lease: the holder stops first.  (It
   returns the seconds left; an action that may outlast them needs the
   fencing of case 2.)
   The holder's own side notices a dead peer too: a heartbeat into a dead
   connection fails after ``keepalive.user_timeout`` (client-side
   TCP_USER_TIMEOUT), and an idle one after keepalive probes fail
   (``idle + interval * count``), which fires ``on_lost``.

2. **The server ends the holder's session** while the holder is healthy
   (``takeover => true``, ``pg_terminate_backend``, server shutdown or
   crash).  The lock is freed at once and a waiting claimant may commit its
   claim within milliseconds.  The holder learns it as fast as the server's
   message reaches its socket (the watcher wakes at once: measured about
   3 ms after ``pg_terminate_backend`` on loopback; at worst ``guard`` if
   the watcher is wedged), but there is no "before": for that short window
   both may believe they hold the lease.
   This is why the epoch exists.  Statements on the broker's own connection
   fail at once (its backend is gone), and writes made on *other*
   connections must be fenced: call :meth:`Broker.assert_epoch` (``SELECT
   pgbroker.broker_assert(name, epoch)``) inside the writing transaction.  It
   fails with :class:`~pgbroker.errors.StaleEpoch` once a newer epoch exists
   or the holder's session is gone, and it blocks a concurrent claim until
   the fenced transaction ends.

Thread safety: one lock serialises every use of the connection, so the
heartbeat thread and any number of caller threads may share a :class:`Broker`.
The client-registry, subscription and delivery methods go through
:meth:`Broker._execute` / :meth:`AsyncBroker._execute` too, which do the
locking, the loss detection and the error translation;
:meth:`Broker.notifications` listens on a second connection of its own.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import inspect
import logging
import math
import os
import selectors
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import psycopg
import psycopg.sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from pgbroker.errors import LeaseLost, PgBrokerError, translate
from pgbroker.install import libpq_url

__all__ = ["AsyncBroker", "Broker", "Keepalive", "Notification", "list_brokers", "lease_history"]

log = logging.getLogger("pgbroker.broker")

# Every statement the Python layer runs.  Always schema-qualified, always with
# bound parameters.  The broker session turns statement_timeout off: the
# claim's ``wait`` is its only time limit (wait => NULL must mean forever).
SESSION_SQL = """\
SELECT pg_catalog.set_config('tcp_keepalives_idle', %(idle)s, false),
       pg_catalog.set_config('tcp_keepalives_interval', %(interval)s, false),
       pg_catalog.set_config('tcp_keepalives_count', %(count)s, false),
       pg_catalog.set_config('tcp_user_timeout', %(user_timeout)s, false),
       pg_catalog.set_config('statement_timeout', '0', false)"""
DEAD_MAN_SQL = "SELECT pg_catalog.set_config('idle_session_timeout', %(ms)s, false)"
CLAIM_SQL = (
    "SELECT pgbroker.broker_claim(name => %(name)s, wait => %(wait)s, takeover => %(takeover)s,"
    " stale_after => %(stale_after)s, info => %(info)s)"
)
HEARTBEAT_SQL = "SELECT pgbroker.broker_heartbeat(name => %(name)s)"
RELEASE_SQL = "SELECT pgbroker.broker_release(name => %(name)s)"
ASSERT_SQL = "SELECT pgbroker.broker_assert(name => %(name)s, epoch => %(epoch)s)"
STATE_SET_SQL = "SELECT pgbroker.broker_state_set(name => %(name)s, key => %(key)s, value => %(value)s)"
STATE_DELETE_SQL = "SELECT pgbroker.broker_state_delete(name => %(name)s, key => %(key)s)"
STATUS_SQL = "SELECT * FROM pgbroker.brokers WHERE name = %(name)s"
REGISTER_SQL = "SELECT pgbroker.client_register(client_id => %(client_id)s, info => %(info)s, name => %(name)s)"
CLIENT_UPDATE_SQL = "SELECT pgbroker.client_update(client_id => %(client_id)s, info => %(info)s, name => %(name)s)"
UNREGISTER_SQL = "SELECT pgbroker.client_unregister(client_id => %(client_id)s, name => %(name)s)"
SUBSCRIBE_SQL = (
    'SELECT pgbroker.subscribe(client_id => %(client_id)s, "table" => %(table)s::regclass, key => %(key)s,'
    " name => %(name)s, wait => %(wait)s)"
)
UNSUBSCRIBE_SQL = (
    'SELECT pgbroker.unsubscribe(client_id => %(client_id)s, "table" => %(table)s::regclass, key => %(key)s,'
    " name => %(name)s)"
)
FETCH_SQL = (
    'SELECT id, "table", op, key, changed, clients, at FROM pgbroker.outbox_fetch(%(name)s, %(max_rows)s, %(ack)s)'
)
ACK_SQL = "SELECT pgbroker.outbox_ack(%(name)s, %(ids)s)"
WAKE_SQL = "SELECT pgbroker.broker_wake(%(name)s)"
SLEEP_SQL = "SELECT pgbroker.broker_sleep(%(name)s)"
CHANNEL_SQL = "SELECT pgbroker.wakeup_channel(%(name)s)"
BROKERS_SQL = "SELECT * FROM pgbroker.brokers ORDER BY name"
HISTORY_SQL = """\
SELECT * FROM pgbroker.lease_history
 WHERE (%(name)s::text IS NULL OR name = %(name)s::text) AND id > %(after_id)s
 ORDER BY id"""

# Pause between two heartbeats triggered by unsolicited data on the socket
# (NOTICEs, NOTIFYs), so that a stream of them cannot turn into a busy loop.
_MIN_WAKE_GAP = 0.05


@dataclass(frozen=True)
class Keepalive:
    """TCP liveness settings, applied to both ends of the broker connection.

    Client side they are libpq parameters (``keepalives_idle`` ...,
    ``tcp_user_timeout``); server side the session settings
    ``tcp_keepalives_idle`` ..., ``tcp_user_timeout``.  Over a Unix socket
    both ends ignore them (there is no network to fail).

    ``idle``, ``interval`` (seconds) and ``count``: probe a silent connection
    after ``idle`` seconds, every ``interval`` seconds, and drop it after
    ``count`` unanswered probes.  ``user_timeout`` (seconds): drop the
    connection when sent data stays unacknowledged that long.
    """

    idle: int = 5
    interval: int = 1
    count: int = 3
    user_timeout: float = 5.0

    def __post_init__(self) -> None:
        if self.idle < 1 or self.interval < 1 or self.count < 1 or self.user_timeout <= 0:
            raise ValueError(f"keepalive settings must be positive: {self}")

    @property
    def server_bound(self) -> float:
        """The earliest the server can drop a silent connection of this session (seconds)."""
        return float(min(self.idle, self.user_timeout))

    def libpq_params(self) -> dict[str, Any]:
        return {
            "keepalives": 1,
            "keepalives_idle": self.idle,
            "keepalives_interval": self.interval,
            "keepalives_count": self.count,
            "tcp_user_timeout": _ms(self.user_timeout),
        }


@dataclass(frozen=True)
class Notification:
    """One outbox row: a change of a watched row and the clients that must hear of it.

    ``op`` is ``"I"``, ``"U"``, ``"D"`` or ``"T"`` (truncate); ``key`` the
    row's primary key as decoded JSON (a scalar, or a list for a composite
    key; None for a truncate); ``changed`` the names of the changed columns
    (updates only); ``clients`` the client ids to tell.  The row's values are
    not carried: read the row.
    """

    id: int
    table: str
    op: str
    key: Any
    changed: list[str] | None
    clients: list[str]
    at: Any


def _key_param(key: Any) -> Jsonb | None:
    return None if key is None else Jsonb(key)


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


def _interval(seconds: float | timedelta | None, what: str) -> timedelta | None:
    if seconds is None or isinstance(seconds, timedelta):
        return seconds
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"{what} must be seconds (a number), a timedelta or None, not {seconds!r}")
    return timedelta(seconds=seconds)


def _raise_translated(exc: psycopg.Error) -> NoReturn:
    """Raise the pgbroker exception for ``exc`` (chained to it), or ``exc`` itself."""
    new = translate(exc)
    if new is exc:
        raise exc
    raise new from exc


def _default_info() -> str:
    return f"{socket.gethostname()} pid {os.getpid()}"


def _is_loss(conn: psycopg.BaseConnection[Any], exc: psycopg.Error) -> bool:
    """Does this error mean the session (and so the lease) is gone or not ours?"""
    sqlstate = getattr(exc, "sqlstate", None) or ""
    return bool(
        conn.broken or conn.closed or sqlstate == "PB001" or sqlstate.startswith("08") or sqlstate.startswith("57P")
    )


class _Waiter:
    """Sleep until data arrives on the connection's socket, a timeout, or :meth:`wake`."""

    def __init__(self, fd: int):
        self._rsock, self._wsock = socket.socketpair()
        self._rsock.setblocking(False)
        self._wsock.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._rsock, selectors.EVENT_READ, "stop")
        self._selector.register(fd, selectors.EVENT_READ, "data")

    def wait(self, timeout: float) -> str:
        """``"stop"``, ``"data"`` or ``"timeout"``."""
        try:
            events = self._selector.select(max(0.0, timeout))
        except (OSError, ValueError):  # the socket went away under us
            return "data"
        kinds = {key.data for key, _ in events}
        if "stop" in kinds:
            return "stop"
        return "data" if kinds else "timeout"

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wsock.send(b"x")

    def close(self) -> None:
        self._selector.close()
        self._rsock.close()
        self._wsock.close()


class _BrokerBase(abc.ABC):
    """What :class:`Broker` and :class:`AsyncBroker` share: settings, state, :meth:`check`."""

    def __init__(
        self,
        url: str,
        name: str = "default",
        *,
        wait: float | timedelta | None = 0,
        takeover: bool = False,
        stale_after: float | timedelta | None = None,
        info: str | None = None,
        heartbeat_interval: float = 1.0,
        guard: float | None = None,
        dead_man: float | None = None,
        keepalive: Keepalive | None = None,
        on_lost: Callable[[LeaseLost], Any] | None = None,
        application_name: str = "pgbroker",
        connect_timeout: int = 10,
    ):
        self.url = libpq_url(url)
        self.name = name
        self.wait = _interval(wait, "wait")
        self.takeover = takeover
        self.stale_after = _interval(stale_after, "stale_after")
        self.info = _default_info() if info is None else info
        self.keepalive = keepalive or Keepalive()
        self.dead_man = dead_man
        self.heartbeat_interval = float(heartbeat_interval)
        self.on_lost = on_lost
        self.application_name = application_name
        self.connect_timeout = connect_timeout

        if dead_man is not None and dead_man <= 0:
            raise ValueError(f"dead_man must be positive seconds, not {dead_man!r}")
        if self.heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval must be positive, not {heartbeat_interval!r}")
        limit = self.keepalive.server_bound
        if dead_man is not None:
            limit = min(limit, float(dead_man))
        self.guard = float(guard) if guard is not None else min(3 * self.heartbeat_interval, 0.8 * limit)
        if not self.heartbeat_interval < self.guard < limit:
            raise ValueError(
                f"need heartbeat_interval < guard < {limit:g} s (the earliest the server may end a silent "
                f"session: keepalive idle / user_timeout / dead_man); got heartbeat_interval="
                f"{self.heartbeat_interval:g}, guard={self.guard:g}"
            )

        self._epoch: int | None = None
        self._pid: int | None = None
        self._state = "new"  # new -> held -> released | lost | closed
        self._lost: LeaseLost | None = None
        self._lost_fired = False
        self._flag_lock = threading.Lock()
        self._last_ok = 0.0  # time.monotonic() when the last good heartbeat was sent
        self._heartbeat_at: Any = None  # server time of that heartbeat
        self._ops = 0  # statements completed by API calls (see the watcher)
        self._stopping = False
        self._waiter: _Waiter | None = None
        self._setup()

    @abc.abstractmethod
    def _setup(self) -> None:
        """The flavour's connection, lock and heartbeat runner."""

    # -- read-only view of the lease ---------------------------------------

    @property
    def epoch(self) -> int:
        """The fencing token returned by ``broker_claim()``."""
        if self._epoch is None:
            raise PgBrokerError(f'lease "{self.name}" has not been claimed yet')
        return self._epoch

    @property
    def pid(self) -> int | None:
        """Backend pid of the broker session (``holder_pid`` in ``pgbroker.brokers``)."""
        return self._pid

    @property
    def held(self) -> bool:
        """Claimed, not released, not known to be lost (see :meth:`check` for the time guard)."""
        return self._state == "held"

    @property
    def lost(self) -> bool:
        """True once the broker learnt that its session or lease is gone."""
        return self._lost is not None

    @property
    def lost_reason(self) -> LeaseLost | None:
        """The :class:`LeaseLost` passed to ``on_lost`` (its ``__cause__`` is the driver error)."""
        return self._lost

    @property
    def heartbeat_at(self) -> Any:
        """Server time (datetime) of the last successful heartbeat."""
        return self._heartbeat_at

    def check(self) -> float:
        """Raise :class:`LeaseLost` unless this broker may still act as the holder.

        Raises when the lease was lost or released, and when no heartbeat was
        confirmed for ``guard`` seconds (not sticky: a later good heartbeat
        clears it).  Returns the seconds left before the guard runs out; keep
        each action shorter than that.  No I/O: call it as often as you like.
        """
        if self._lost is not None:
            raise LeaseLost(str(self._lost), sqlstate=self._lost.sqlstate) from self._lost
        if self._state != "held":
            raise LeaseLost(f'lease "{self.name}" is not held by this broker (it is {self._state})')
        age = time.monotonic() - self._last_ok
        if age >= self.guard:
            raise LeaseLost(
                f'lease "{self.name}" (epoch {self._epoch}): no heartbeat confirmed for {age:.2f} s '
                f"(guard {self.guard:g} s); the server may free the lock soon, stop acting"
            )
        return self.guard - age

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} epoch={self._epoch} pid={self._pid} {self._state}>"

    # -- plumbing shared by both flavours ------------------------------------

    def _connect_params(self) -> dict[str, Any]:
        return {
            "autocommit": True,
            "application_name": self.application_name,
            "connect_timeout": self.connect_timeout,
            **self.keepalive.libpq_params(),
        }

    def _session_params(self) -> dict[str, str]:
        k = self.keepalive
        return {
            "idle": str(k.idle),
            "interval": str(k.interval),
            "count": str(k.count),
            "user_timeout": str(_ms(k.user_timeout)),
        }

    def _claim_params(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "wait": self.wait,
            "takeover": self.takeover,
            "stale_after": self.stale_after,
            "info": self.info,
        }

    def _classify(self, conn: psycopg.BaseConnection[Any], exc: psycopg.Error) -> Exception:
        """The exception to raise for a failed statement; marks the broker lost when it is."""
        if self._state == "held" and _is_loss(conn, exc):
            return self._mark_lost(f"{exc}".strip(), getattr(exc, "sqlstate", None), exc)
        return translate(exc)

    def _mark_lost(self, why: str, sqlstate: str | None, cause: BaseException | None) -> LeaseLost:
        """Record the loss (the first one wins) and return it."""
        lost = LeaseLost(f'lease "{self.name}" (epoch {self._epoch}) lost: {why}', sqlstate=sqlstate)
        lost.__cause__ = cause
        with self._flag_lock:
            if self._lost is None:
                self._lost = lost
                self._state = "lost"
            return self._lost

    def _not_open(self) -> LeaseLost:
        """The error for a call on a connection that is gone (closed by us, or dropped)."""
        if self._state == "held":
            return self._mark_lost("the broker connection is closed", None, None)
        if self._lost is not None:
            error = LeaseLost(str(self._lost), sqlstate=self._lost.sqlstate)
            error.__cause__ = self._lost
            return error
        return LeaseLost(f'lease "{self.name}": the broker connection is not open (it is {self._state})')

    def _take_on_lost(self) -> Callable[[LeaseLost], Any] | None:
        """The callback to run now, once per broker, if the broker is lost."""
        with self._flag_lock:
            if self._lost is None or self._lost_fired:
                return None
            self._lost_fired = True
        return self.on_lost or (lambda exc: log.warning("%s", exc))


class Broker(_BrokerBase):
    """Hold the broker lease ``name`` from a dedicated connection (threads).

    ``url``: a ``postgresql://`` URL.  ``wait``: seconds to wait for the
    holder (0: fail at once with :class:`LeaseHeld`; None: until the holder's
    session ends).  ``takeover``: terminate the holder first (pgbroker_admin
    only).  ``stale_after``: seconds; terminate a holder whose heartbeat is
    older.  ``info``: recorded with the holder (default ``"<hostname> pid
    <pid>"``).  ``heartbeat_interval``: seconds between heartbeats.
    ``guard``: seconds without a confirmed heartbeat after which
    :meth:`check` raises (default ``min(3 * heartbeat_interval, 0.8 * T)``,
    see the module docstring for *T*).  ``dead_man``: seconds; sets
    ``idle_session_timeout`` on the broker session, so the server ends it
    when the process stops sending heartbeats (paused, hung).
    ``keepalive``: TCP settings for both ends.  ``on_lost(exc)``: called once,
    from the thread that noticed the loss (usually the heartbeat thread);
    keep it short.  ``application_name`` is recorded as
    ``holder_application``; ``connect_timeout`` is in seconds.

    The connection must reach a real session (direct, or a pooler in session
    mode): the lease is a session-level advisory lock.

    Entering the context manager claims (:meth:`claim`); leaving it releases
    the lease and closes the connection (:meth:`close`).  Timing guarantees:
    see the module docstring ("The timing bound").
    """

    _conn: psycopg.Connection[Any] | None
    _thread: threading.Thread | None

    def _setup(self) -> None:
        self._conn = None
        self._lock = threading.Lock()
        self._thread = None

    # -- lifecycle -------------------------------------------------------------

    def claim(self) -> int:
        """Connect, claim the lease and start heartbeats; return the epoch.

        Raises :class:`LeaseHeld` (with the holder in ``detail``),
        :class:`PermissionDenied`, :class:`InvalidArgument`, or a psycopg
        error for connection problems.
        """
        if self._state != "new":
            raise PgBrokerError(f"a {type(self).__name__} claims once; this one is {self._state}")
        conn = psycopg.connect(self.url, **self._connect_params())
        try:
            conn.execute(SESSION_SQL, self._session_params())
            if self.dead_man is not None:
                conn.execute(DEAD_MAN_SQL, {"ms": str(_ms(self.dead_man))})
            row = conn.execute(CLAIM_SQL, self._claim_params()).fetchone()
            assert row is not None
            sent = time.monotonic()
            hb = conn.execute(HEARTBEAT_SQL, {"name": self.name}).fetchone()
            assert hb is not None
        except psycopg.Error as exc:
            conn.close()
            _raise_translated(exc)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._epoch = int(row[0])
        self._pid = conn.info.backend_pid
        self._last_ok, self._heartbeat_at = sent, hb[0]
        self._state = "held"
        self._start_heartbeats()
        return self._epoch

    def release(self) -> bool:
        """Hand the lease over cleanly (``broker_release``); False if the server says it was not ours.

        Heartbeats stop first.  The connection stays open until :meth:`close`.
        """
        if self._state != "held":
            raise LeaseLost(f'lease "{self.name}" is not held by this broker (it is {self._state})')
        self._stop_heartbeats()
        try:
            (released,) = self._execute(RELEASE_SQL, {"name": self.name})[0]
        except BaseException:
            if self._state == "held":
                self._start_heartbeats()
            raise
        self._state = "released"
        return bool(released)

    def close(self) -> None:
        """Release the lease if held (best effort) and close the connection.  Idempotent."""
        self._stop_heartbeats()
        if self._state == "held":
            try:
                self.release()
            except Exception as exc:  # the connection may be gone; closing frees the lock anyway
                log.debug("release on close failed: %s", exc)
            self._stop_heartbeats()  # release() restarts them when it fails
        if self._conn is not None:
            self._conn.close()
        if self._state in ("held", "released", "new"):
            self._state = "closed"

    def __enter__(self) -> Broker:
        self.claim()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the API ---------------------------------------------------------------

    def assert_epoch(self, conn: psycopg.Connection[Any] | psycopg.Cursor[Any]) -> None:
        """Fence a write made on another connection: run ``pgbroker.broker_assert(name, epoch)`` on ``conn``.

        Call it inside the transaction that does the write (``with
        conn.transaction(): broker.assert_epoch(conn); ...``).  It first runs
        :meth:`check` (no I/O), then raises :class:`StaleEpoch` when a newer
        epoch exists or this broker's session is gone; until that transaction
        ends, no new claim of the lease can commit.
        """
        self.check()
        try:
            conn.execute(ASSERT_SQL, {"name": self.name, "epoch": self.epoch})
        except psycopg.Error as exc:
            _raise_translated(exc)

    def state_set(self, key: str, value: Any) -> None:
        """Set ``key`` to ``value`` (anything JSON can hold) in this lease's broker state."""
        self._execute(STATE_SET_SQL, {"name": self.name, "key": key, "value": Jsonb(value)})

    def state_delete(self, key: str) -> bool:
        """Delete ``key`` from this lease's broker state; False when it was not set."""
        return bool(self._execute(STATE_DELETE_SQL, {"name": self.name, "key": key})[0][0])

    def status(self) -> dict[str, Any] | None:
        """This lease's row of the view ``pgbroker.brokers`` (read on the broker connection)."""
        rows = self._execute(STATUS_SQL, {"name": self.name}, dict_rows=True)
        return rows[0] if rows else None

    # -- clients, subscriptions, notifications (issue: fan-out) ---------------

    def register(self, client_id: str, info: Any = None) -> bool:
        """Register a client of this broker (``client_register``); True when it is new."""
        params = {"client_id": client_id, "info": Jsonb(info or {}), "name": self.name}
        return bool(self._execute(REGISTER_SQL, params)[0][0])

    def update_client(self, client_id: str, info: Any) -> None:
        """Replace a registered client's info; :class:`UnknownClient` when it is not registered."""
        self._execute(CLIENT_UPDATE_SQL, {"client_id": client_id, "info": Jsonb(info or {}), "name": self.name})

    def unregister(self, client_id: str) -> bool:
        """Unregister a client and drop its subscriptions; False when it was not registered."""
        return bool(self._execute(UNREGISTER_SQL, {"client_id": client_id, "name": self.name})[0][0])

    def subscribe(self, client_id: str, table: str, key: Any = None, *, wait: float = 5.0) -> bool:
        """Subscribe ``client_id`` to the row of ``table`` with primary key ``key`` (None: the whole table).

        ``key`` is a scalar for a one-column key, a list in key order for a
        composite one.  Once this returns, every later change is delivered:
        read the row *after* subscribing.  False when already subscribed.
        """
        params = {
            "client_id": client_id,
            "table": table,
            "key": _key_param(key),
            "name": self.name,
            "wait": _interval(wait, "wait"),
        }
        return bool(self._execute(SUBSCRIBE_SQL, params)[0][0])

    def unsubscribe(self, client_id: str, table: str, key: Any = None) -> bool:
        """Drop one subscription; False when there was none."""
        params = {"client_id": client_id, "table": table, "key": _key_param(key), "name": self.name}
        return bool(self._execute(UNSUBSCRIBE_SQL, params)[0][0])

    def fetch(self, max_rows: int = 1000, *, ack: list[int] | None = None) -> list[Notification]:
        """Pending notifications, oldest first (``outbox_fetch``); they stay until acknowledged.

        ``ack``: ids to acknowledge first, in the same round trip (see :meth:`ack`).
        """
        params = {"name": self.name, "max_rows": max_rows, "ack": ack}
        return [Notification(*row) for row in self._execute(FETCH_SQL, params)]

    def ack(self, ids: list[int]) -> int:
        """Acknowledge delivered notifications (``outbox_ack``); returns how many were removed."""
        return int(self._execute(ACK_SQL, {"name": self.name, "ids": list(ids)})[0][0]) if ids else 0

    def notifications(
        self,
        *,
        poll_interval: float = 1.0,
        max_rows: int = 1000,
        linger: float = 0.005,
        batch_delay: float = 0.002,
    ) -> Iterator[list[Notification]]:
        """Yield batches of notifications for as long as the lease is held.

        A batch is acknowledged when you ask for the next one, so a batch whose
        handling raised (or after which you stopped iterating) is delivered
        again: at-least-once.  The loop drains the outbox while it is awake
        (``broker_wake``: writers then send no NOTIFY), keeps polling for
        ``linger`` seconds once it is empty, then goes to sleep
        (``broker_sleep``) and waits on ``LISTEN`` for at most
        ``poll_interval`` seconds, so a missed NOTIFY delays a row by no more
        than that.  Under load, after a batch smaller than ``max_rows`` it
        waits ``batch_delay`` seconds before fetching again, so that rows
        arrive in fewer, larger batches (fewer round trips and less CPU
        taken from the writers, for at most that much latency).  Raises
        :class:`LeaseLost` when the lease is lost.
        """
        channel = self._execute(CHANNEL_SQL, {"name": self.name})[0][0]
        listener = psycopg.connect(self.url, **self._connect_params())
        try:
            listener.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel)))
            self._execute(WAKE_SQL, {"name": self.name})
            idle_since: float | None = None
            done: list[int] | None = None  # handled, not yet acknowledged
            while True:
                self.check()
                batch = self.fetch(max_rows, ack=done)
                done = None
                if batch:
                    yield batch
                    done = [n.id for n in batch]
                    idle_since = None
                    if len(batch) < max_rows and batch_delay > 0:
                        time.sleep(batch_delay)
                    continue
                now = time.monotonic()
                if idle_since is None:
                    idle_since = now
                if now - idle_since < linger:
                    time.sleep(min(0.001, linger))
                    continue
                state = self._execute(SLEEP_SQL, {"name": self.name})[0][0]
                if state != "pending":
                    timeout = poll_interval if state == "asleep" else min(poll_interval, 0.05)
                    for _ in listener.notifies(timeout=min(timeout, self.guard / 2), stop_after=1):
                        pass
                    self._execute(WAKE_SQL, {"name": self.name})
                idle_since = None
        finally:
            listener.close()

    # -- plumbing --------------------------------------------------------------

    def _execute(self, query: str, params: Any = None, *, dict_rows: bool = False) -> list[Any]:
        """Run one statement on the broker connection and return its rows.

        Serialised with the heartbeats; errors come out translated, and a
        lost session as :class:`LeaseLost` (after ``on_lost`` ran).
        """
        with self._lock:
            result = self._execute_locked(query, params, dict_rows)
        if isinstance(result, Exception):
            self._fire_on_lost()
            raise result
        return result

    def _execute_locked(self, query: str, params: Any, dict_rows: bool) -> Any:
        conn = self._conn
        if conn is None or conn.closed:
            return self._not_open()
        try:
            cur = conn.cursor(row_factory=dict_row) if dict_rows else conn.cursor()
            with cur:
                cur.execute(query, params)
                return cur.fetchall() if cur.description is not None else []
        except psycopg.Error as exc:
            return self._classify(conn, exc)
        finally:
            self._ops += 1

    def _fire_on_lost(self) -> None:
        callback = self._take_on_lost()
        if callback is None:
            return
        assert self._lost is not None
        try:
            callback(self._lost)
        except Exception:
            log.exception("on_lost callback of %r failed", self)

    def _start_heartbeats(self) -> None:
        assert self._conn is not None
        self._stopping = False
        self._waiter = _Waiter(self._conn.fileno())
        self._thread = threading.Thread(
            target=self._heartbeat_main, name=f"pgbroker-heartbeat-{self.name}", daemon=True
        )
        self._thread.start()

    def _stop_heartbeats(self) -> None:
        thread, waiter = self._thread, self._waiter
        if thread is None or waiter is None:
            return
        self._stopping = True
        waiter.wake()
        if thread is not threading.current_thread():
            # A heartbeat stuck on a dead network ends within keepalive.user_timeout.
            thread.join(self.keepalive.user_timeout + 1.0)
        waiter.close()
        self._thread = self._waiter = None

    def _heartbeat_main(self) -> None:
        try:
            self._heartbeat_loop()
        except Exception:  # a bug: check() still stops the holder once guard runs out
            log.exception("heartbeat thread of %r crashed", self)

    def _heartbeat_loop(self) -> None:
        waiter = self._waiter
        assert waiter is not None
        next_due = time.monotonic() + self.heartbeat_interval
        last_attempt = time.monotonic()
        while not self._stopping and self._state == "held":
            ops = self._ops
            why = waiter.wait(next_due - time.monotonic())
            if why == "stop" or self._stopping:
                return
            if why == "data":
                # Unsolicited data (a FATAL message, EOF, a NOTICE) or the reply
                # to an API call that another thread is reading right now.
                gap = _MIN_WAKE_GAP - (time.monotonic() - last_attempt)
                if gap > 0:
                    time.sleep(gap)
            with self._lock:
                if self._stopping:
                    return
                if why == "data" and self._ops != ops:
                    continue  # an API call consumed it; it would have seen a loss too
                last_attempt = time.monotonic()
                result = self._execute_locked(HEARTBEAT_SQL, {"name": self.name}, False)
            if isinstance(result, Exception):
                if self._lost is not None:
                    self._fire_on_lost()
                    return
                log.warning("heartbeat of %r failed (will retry): %s", self, result)
            else:
                self._last_ok, self._heartbeat_at = last_attempt, result[0][0]
            next_due = time.monotonic() + self.heartbeat_interval


class AsyncBroker(_BrokerBase):
    """The asyncio twin of :class:`Broker`: same arguments, same guarantees.

    Methods that talk to the server are coroutines; :meth:`check` is not (it
    does no I/O).  Heartbeats run in an asyncio task, which waits for the
    socket in a worker thread between heartbeats.  ``on_lost`` may be a
    plain function or a coroutine function; it runs in that task (or in the
    API call that noticed the loss).

        async with AsyncBroker(url, "orders") as broker:
            ...
    """

    _conn: psycopg.AsyncConnection[Any] | None
    _task: asyncio.Task[None] | None

    def _setup(self) -> None:
        self._conn = None
        self._lock = asyncio.Lock()
        self._task = None

    async def claim(self) -> int:
        """Connect, claim the lease and start heartbeats; return the epoch (see :meth:`Broker.claim`)."""
        if self._state != "new":
            raise PgBrokerError(f"a {type(self).__name__} claims once; this one is {self._state}")
        conn = await psycopg.AsyncConnection.connect(self.url, **self._connect_params())
        try:
            await conn.execute(SESSION_SQL, self._session_params())
            if self.dead_man is not None:
                await conn.execute(DEAD_MAN_SQL, {"ms": str(_ms(self.dead_man))})
            row = await (await conn.execute(CLAIM_SQL, self._claim_params())).fetchone()
            assert row is not None
            sent = time.monotonic()
            hb = await (await conn.execute(HEARTBEAT_SQL, {"name": self.name})).fetchone()
            assert hb is not None
        except psycopg.Error as exc:
            await conn.close()
            _raise_translated(exc)
        except BaseException:
            await conn.close()
            raise
        self._conn = conn
        self._epoch = int(row[0])
        self._pid = conn.info.backend_pid
        self._last_ok, self._heartbeat_at = sent, hb[0]
        self._state = "held"
        self._start_heartbeats()
        return self._epoch

    async def release(self) -> bool:
        """Hand the lease over cleanly; see :meth:`Broker.release`."""
        if self._state != "held":
            raise LeaseLost(f'lease "{self.name}" is not held by this broker (it is {self._state})')
        await self._stop_heartbeats()
        try:
            (released,) = (await self._execute(RELEASE_SQL, {"name": self.name}))[0]
        except BaseException:
            if self._state == "held":
                self._start_heartbeats()
            raise
        self._state = "released"
        return bool(released)

    async def close(self) -> None:
        """Release the lease if held (best effort) and close the connection.  Idempotent."""
        await self._stop_heartbeats()
        if self._state == "held":
            try:
                await self.release()
            except Exception as exc:
                log.debug("release on close failed: %s", exc)
            await self._stop_heartbeats()  # release() restarts them when it fails
        if self._conn is not None:
            await self._conn.close()
        if self._state in ("held", "released", "new"):
            self._state = "closed"

    async def __aenter__(self) -> AsyncBroker:
        await self.claim()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def assert_epoch(self, conn: psycopg.AsyncConnection[Any] | psycopg.AsyncCursor[Any]) -> None:
        """Fence a write made on another connection; see :meth:`Broker.assert_epoch`."""
        self.check()
        try:
            await conn.execute(ASSERT_SQL, {"name": self.name, "epoch": self.epoch})
        except psycopg.Error as exc:
            _raise_translated(exc)

    async def state_set(self, key: str, value: Any) -> None:
        """Set ``key`` to ``value`` (anything JSON can hold) in this lease's broker state."""
        await self._execute(STATE_SET_SQL, {"name": self.name, "key": key, "value": Jsonb(value)})

    async def state_delete(self, key: str) -> bool:
        """Delete ``key`` from this lease's broker state; False when it was not set."""
        return bool((await self._execute(STATE_DELETE_SQL, {"name": self.name, "key": key}))[0][0])

    async def status(self) -> dict[str, Any] | None:
        """This lease's row of the view ``pgbroker.brokers``."""
        rows = await self._execute(STATUS_SQL, {"name": self.name}, dict_rows=True)
        return rows[0] if rows else None

    # -- clients, subscriptions, notifications ---------------------------------

    async def register(self, client_id: str, info: Any = None) -> bool:
        """See :meth:`Broker.register`."""
        params = {"client_id": client_id, "info": Jsonb(info or {}), "name": self.name}
        return bool((await self._execute(REGISTER_SQL, params))[0][0])

    async def update_client(self, client_id: str, info: Any) -> None:
        """See :meth:`Broker.update_client`."""
        await self._execute(CLIENT_UPDATE_SQL, {"client_id": client_id, "info": Jsonb(info or {}), "name": self.name})

    async def unregister(self, client_id: str) -> bool:
        """See :meth:`Broker.unregister`."""
        return bool((await self._execute(UNREGISTER_SQL, {"client_id": client_id, "name": self.name}))[0][0])

    async def subscribe(self, client_id: str, table: str, key: Any = None, *, wait: float = 5.0) -> bool:
        """See :meth:`Broker.subscribe`."""
        params = {
            "client_id": client_id,
            "table": table,
            "key": _key_param(key),
            "name": self.name,
            "wait": _interval(wait, "wait"),
        }
        return bool((await self._execute(SUBSCRIBE_SQL, params))[0][0])

    async def unsubscribe(self, client_id: str, table: str, key: Any = None) -> bool:
        """See :meth:`Broker.unsubscribe`."""
        params = {"client_id": client_id, "table": table, "key": _key_param(key), "name": self.name}
        return bool((await self._execute(UNSUBSCRIBE_SQL, params))[0][0])

    async def fetch(self, max_rows: int = 1000, *, ack: list[int] | None = None) -> list[Notification]:
        """See :meth:`Broker.fetch`."""
        rows = await self._execute(FETCH_SQL, {"name": self.name, "max_rows": max_rows, "ack": ack})
        return [Notification(*row) for row in rows]

    async def ack(self, ids: list[int]) -> int:
        """See :meth:`Broker.ack`."""
        return int((await self._execute(ACK_SQL, {"name": self.name, "ids": list(ids)}))[0][0]) if ids else 0

    async def notifications(
        self,
        *,
        poll_interval: float = 1.0,
        max_rows: int = 1000,
        linger: float = 0.005,
        batch_delay: float = 0.002,
    ) -> AsyncIterator[list[Notification]]:
        """The asyncio twin of :meth:`Broker.notifications` (``async for batch in broker.notifications()``)."""
        channel = (await self._execute(CHANNEL_SQL, {"name": self.name}))[0][0]
        listener = await psycopg.AsyncConnection.connect(self.url, **self._connect_params())
        try:
            await listener.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel)))
            await self._execute(WAKE_SQL, {"name": self.name})
            idle_since: float | None = None
            done: list[int] | None = None  # handled, not yet acknowledged
            while True:
                self.check()
                batch = await self.fetch(max_rows, ack=done)
                done = None
                if batch:
                    yield batch
                    done = [n.id for n in batch]
                    idle_since = None
                    if len(batch) < max_rows and batch_delay > 0:
                        await asyncio.sleep(batch_delay)
                    continue
                now = time.monotonic()
                if idle_since is None:
                    idle_since = now
                if now - idle_since < linger:
                    await asyncio.sleep(min(0.001, linger))
                    continue
                state = (await self._execute(SLEEP_SQL, {"name": self.name}))[0][0]
                if state != "pending":
                    timeout = poll_interval if state == "asleep" else min(poll_interval, 0.05)
                    async for _ in listener.notifies(timeout=min(timeout, self.guard / 2), stop_after=1):
                        pass
                    await self._execute(WAKE_SQL, {"name": self.name})
                idle_since = None
        finally:
            await listener.close()

    # -- plumbing --------------------------------------------------------------

    async def _execute(self, query: str, params: Any = None, *, dict_rows: bool = False) -> list[Any]:
        """Run one statement on the broker connection; see :meth:`Broker._execute`."""
        async with self._lock:
            result = await self._execute_locked(query, params, dict_rows)
        if isinstance(result, Exception):
            await self._fire_on_lost()
            raise result
        return result

    async def _execute_locked(self, query: str, params: Any, dict_rows: bool) -> Any:
        conn = self._conn
        if conn is None or conn.closed:
            return self._not_open()
        try:
            cur = conn.cursor(row_factory=dict_row) if dict_rows else conn.cursor()
            async with cur:
                await cur.execute(query, params)
                return await cur.fetchall() if cur.description is not None else []
        except psycopg.Error as exc:
            return self._classify(conn, exc)
        finally:
            self._ops += 1

    async def _fire_on_lost(self) -> None:
        callback = self._take_on_lost()
        if callback is None:
            return
        assert self._lost is not None
        try:
            result = callback(self._lost)
            if inspect.isawaitable(result):
                await result
        except Exception:
            log.exception("on_lost callback of %r failed", self)

    def _start_heartbeats(self) -> None:
        assert self._conn is not None
        self._stopping = False
        self._waiter = _Waiter(self._conn.fileno())
        self._task = asyncio.get_running_loop().create_task(
            self._heartbeat_main(), name=f"pgbroker-heartbeat-{self.name}"
        )

    async def _stop_heartbeats(self) -> None:
        task, waiter = self._task, self._waiter
        if task is None or waiter is None:
            return
        self._stopping = True
        waiter.wake()
        if task is not asyncio.current_task():
            # A heartbeat stuck on a dead network ends within keepalive.user_timeout.
            done, _ = await asyncio.wait({task}, timeout=self.keepalive.user_timeout + 1.0)
            if not done:
                task.cancel()
        waiter.close()
        self._task = self._waiter = None

    async def _heartbeat_main(self) -> None:
        try:
            await self._heartbeat_loop()
        except Exception:  # a bug: check() still stops the holder once guard runs out
            log.exception("heartbeat task of %r crashed", self)

    async def _heartbeat_loop(self) -> None:
        waiter = self._waiter
        assert waiter is not None
        next_due = time.monotonic() + self.heartbeat_interval
        last_attempt = time.monotonic()
        while not self._stopping and self._state == "held":
            ops = self._ops
            why = await asyncio.to_thread(waiter.wait, next_due - time.monotonic())
            if why == "stop" or self._stopping:
                return
            if why == "data":
                gap = _MIN_WAKE_GAP - (time.monotonic() - last_attempt)
                if gap > 0:
                    await asyncio.sleep(gap)
            async with self._lock:
                if self._stopping:
                    return
                if why == "data" and self._ops != ops:
                    continue
                last_attempt = time.monotonic()
                result = await self._execute_locked(HEARTBEAT_SQL, {"name": self.name}, False)
            if isinstance(result, Exception):
                if self._lost is not None:
                    await self._fire_on_lost()
                    return
                log.warning("heartbeat of %r failed (will retry): %s", self, result)
            else:
                self._last_ok, self._heartbeat_at = last_attempt, result[0][0]
            next_due = time.monotonic() + self.heartbeat_interval


def list_brokers(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    """Every row of the view ``pgbroker.brokers``, as dicts (needs ``pgbroker_reader``)."""
    try:
        with conn.cursor(row_factory=dict_row) as cur:
            return cur.execute(BROKERS_SQL).fetchall()
    except psycopg.Error as exc:
        _raise_translated(exc)


def lease_history(conn: psycopg.Connection[Any], name: str | None = None, after_id: int = 0) -> list[dict[str, Any]]:
    """Rows of ``pgbroker.lease_history`` (of one lease name if given) with ``id > after_id``, oldest first."""
    try:
        with conn.cursor(row_factory=dict_row) as cur:
            return cur.execute(HISTORY_SQL, {"name": name, "after_id": after_id}).fetchall()
    except psycopg.Error as exc:
        _raise_translated(exc)
