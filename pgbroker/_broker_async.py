"""The asyncio broker, :class:`AsyncBroker`, and the one source of both flavours.

:mod:`pgbroker._broker_sync` (the threaded :class:`~pgbroker.broker.Broker`) is
generated from this file by ``python3 -m pgbroker._gen_sync``, so a fix lands
once: edit this file, run the generator, commit both (a test fails when they
differ).  The generator drops ``async`` and ``await``, swaps asyncio names for
their threading twins (``asyncio.Lock`` -> ``threading.Lock``, ``asyncio.sleep``
-> ``time.sleep``, ``AsyncConnection`` -> ``Connection`` ...), keeps only the
``else:`` branch of an ``if True:  # ASYNC`` block, drops a line ending in
``# ASYNC`` and replaces a line ending in ``# sync: CODE`` with ``CODE``.
Everything without I/O (statements, settings, state, :meth:`check`) is in
:mod:`pgbroker._core`.
"""

from __future__ import annotations

import asyncio  # ASYNC
import contextlib  # ASYNC
import inspect  # ASYNC
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable  # sync: from collections.abc import Iterable, Iterator
from typing import Any

import psycopg
import psycopg.sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from pgbroker._core import (
    _MIN_WAKE_GAP,
    ACK_SQL,
    ASSERT_SQL,
    BACKEND_PID_SQL,
    CHANNEL_SQL,
    CLAIM_SQL,
    CLIENT_UPDATE_SQL,
    DEAD_MAN_SQL,
    FETCH_SQL,
    HEARTBEAT_SQL,
    MAINTAIN_EVERY,
    MAINTAIN_SQL,
    REGISTER_MANY_SQL,
    REGISTER_SQL,
    RELEASE_SQL,
    SCHEMA_VERSION_SQL,
    SESSION_SQL,
    SLEEP_SQL,
    STATE_DELETE_SQL,
    STATE_SET_SQL,
    STATUS_SQL,
    SUBSCRIBE_MANY_SQL,
    SUBSCRIBE_SQL,
    SWEEP_BATCH,
    SWEEP_SQL,
    UNREGISTER_SQL,
    UNSUBSCRIBE_SQL,
    WAKE_SQL,
    Notification,
    _BrokerBase,
    _interval,
    _key_param,
    _ms,
    _raise_translated,
    _Waiter,
    batches,
    register_params,
    subscribe_params,
)
from pgbroker.errors import LeaseLost, PgBrokerError, schema_error

__all__ = ["AsyncBroker"]

log = logging.getLogger("pgbroker.broker")


class AsyncBroker(_BrokerBase):
    """Hold the broker lease ``name`` from a dedicated connection.

    ``url``: a ``postgresql://`` URL.  ``wait``: seconds to wait for the
    holder (0: fail at once with :class:`LeaseHeld`; None: until the holder's
    session ends).  ``takeover``: terminate the holder first (pgbroker_admin
    only).  ``stale_after``: seconds; terminate a holder whose heartbeat is
    older.  ``info``: recorded with the holder (default ``"<hostname> pid
    <pid>"``).  ``heartbeat_interval``: seconds between heartbeats.
    ``guard``: seconds without a confirmed heartbeat after which
    :meth:`check` raises (default ``min(3 * heartbeat_interval, 0.8 * T)``,
    see the module docstring of :mod:`pgbroker.broker` for *T*).
    ``dead_man``: seconds; sets ``idle_session_timeout`` on the broker
    session, so the server ends it when the process stops sending heartbeats
    (paused, hung).  ``keepalive``: TCP settings for both ends.
    ``on_lost(exc)``: called once, from the thread or task that noticed the
    loss (usually the heartbeat runner); keep it short.  In the asyncio
    flavour it may also be a coroutine function.  ``application_name`` is
    recorded as ``holder_application``; ``connect_timeout`` is in seconds.
    ``sweep``: after the claim, delete what earlier epochs of the lease left
    (``broker_sweep``), on a connection of its own, in batches that take at
    most about half of one CPU, until nothing is left (they are invisible
    from the claim on; this only frees their space); then, on that connection,
    the upkeep (``pgbroker.maintain()``) every minute while the lease is held,
    and again, after a pause as long as the call took, while a part of a call
    removed a full batch.

    The connection must reach a real session (direct, or a pooler in session
    mode): the lease is a session-level advisory lock.

    Entering the context manager claims (:meth:`claim`); leaving it releases
    the lease and closes the connection (:meth:`close`).  Timing guarantees:
    see the module docstring of :mod:`pgbroker.broker` ("The timing bound").

    The two flavours have the same arguments, methods and guarantees.  In the
    asyncio one the methods that talk to the server are coroutines (and
    :meth:`notifications` an asynchronous iterator), and heartbeats run in an
    asyncio task that waits for the socket in a worker thread; in the
    threaded one they run in a daemon thread.  :meth:`check` does no I/O and
    is a plain method in both.
    """

    _conn: psycopg.AsyncConnection[Any] | None
    _runner: asyncio.Task[None] | None  # sync: _runner: threading.Thread | None
    _sweeper: asyncio.Task[None] | None  # sync: _sweeper: threading.Thread | None

    def _setup(self) -> None:
        self._conn = None
        self._lock = asyncio.Lock()
        self._runner = None
        self._sweeper = None
        self._sweep_stop = asyncio.Event()  # sync: self._sweep_stop = threading.Event()

    # -- lifecycle -------------------------------------------------------------

    async def claim(self) -> int:
        """Connect, claim the lease and start heartbeats; return the epoch.

        First checks that the database has the schema version this package
        installs (:class:`SchemaMissing`, :class:`SchemaMismatch`: run
        ``pgbroker migrate``).  Raises :class:`LeaseHeld` (the holder in its
        attributes and ``detail``), :class:`PermissionDenied`,
        :class:`InvalidArgument`, or a psycopg error for connection problems.
        """
        if self._state != "new":
            raise PgBrokerError(f"a {type(self).__name__} claims once; this one is {self._state}")
        conn = await psycopg.AsyncConnection.connect(self.url, **self._connect_params())
        try:
            try:
                cur = await conn.execute(SCHEMA_VERSION_SQL)
            except psycopg.Error as exc:
                _raise_translated(exc, schema_error(exc, conn.info.dbname))
            self._check_schema(conn.info.dbname, await cur.fetchone())
            pids = []
            for _ in range(2):  # two transactions (autocommit): a transaction pooler may move us between them
                cur = await conn.execute(BACKEND_PID_SQL)
                pids.append((await cur.fetchone())[0])
            self._check_session(conn.info.backend_pid, pids)
            await conn.execute(SESSION_SQL, self._session_params())
            if self.dead_man is not None:
                await conn.execute(DEAD_MAN_SQL, {"ms": str(_ms(self.dead_man))})
            cur = await conn.execute(CLAIM_SQL, self._claim_params())
            row = await cur.fetchone()
            assert row is not None
            sent = time.monotonic()
            cur = await conn.execute(HEARTBEAT_SQL, {"name": self.name})
            hb = await cur.fetchone()
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
        if self.sweep:
            self._start_sweeper()
        return self._epoch

    async def release(self) -> bool:
        """Hand the lease over cleanly (``broker_release``); False if the server says it was not ours.

        Heartbeats stop first.  The connection stays open until :meth:`close`.
        """
        if self._state != "held":
            raise LeaseLost(f'lease "{self.name}" is not held by this broker (it is {self._state})')
        await self._stop_heartbeats()
        try:
            released = await self._scalar(RELEASE_SQL, {"name": self.name, "owner": self.owner})
        except BaseException:
            if self._state == "held":
                self._start_heartbeats()
            raise
        self._state = "released"
        return bool(released)

    async def close(self) -> None:
        """Release the lease if held (best effort) and close the connection.  Idempotent."""
        await self._stop_sweeper()
        await self._stop_heartbeats()
        if self._state == "held":
            try:
                await self.release()
            except Exception as exc:  # the connection may be gone; closing frees the lock anyway
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

    # -- the API ---------------------------------------------------------------

    async def assert_epoch(self, conn: psycopg.AsyncConnection[Any] | psycopg.AsyncCursor[Any]) -> None:
        """Fence a write made on another connection: run ``pgbroker.broker_assert(name, epoch)`` on ``conn``.

        Call it inside the transaction that does the write (``with
        conn.transaction(): broker.assert_epoch(conn); ...``).  It first runs
        :meth:`check` (no I/O), then raises :class:`StaleEpoch` when a newer
        epoch exists or this broker's session is gone; until that transaction
        ends, no new claim of the lease can commit.
        """
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
        return bool(await self._scalar(STATE_DELETE_SQL, {"name": self.name, "key": key}))

    async def status(self) -> dict[str, Any] | None:
        """This lease's row of the view ``pgbroker.brokers`` (read on the broker connection)."""
        rows = await self._execute(STATUS_SQL, {"name": self.name}, dict_rows=True)
        return rows[0] if rows else None

    # -- clients, subscriptions, notifications ---------------------------------

    async def register(self, client_id: str, info: Any = None) -> bool:
        """Register a client of this broker (``client_register``); True when it is new."""
        params = {"client_id": client_id, "info": Jsonb(info or {}), "name": self.name}
        return bool(await self._scalar(REGISTER_SQL, params))

    async def register_many(self, clients: Iterable[str | tuple[str, Any]], *, batch_size: int = 10_000) -> int:
        """Register many clients, ``batch_size`` per statement (``client_register_many``); returns how many were new.

        Each item is a client id, or a ``(client_id, info)`` pair.  One round
        trip per batch, the reconnect path after a restart: a broker whose
        clients come back registers them all, then :meth:`subscribe_many`.
        Each batch commits on its own: when one fails (an invalid id, its
        position in the batch named in the message), the batches before it
        are kept and nothing of it is.
        """
        new = 0
        for batch in batches(clients, batch_size):
            new += int(await self._scalar(REGISTER_MANY_SQL, register_params(self.name, batch)))
        return new

    async def subscribe_many(
        self,
        subscriptions: Iterable[tuple[str, Any]],
        table: str,
        *,
        wait: float = 5.0,
        batch_size: int = 10_000,
    ) -> int:
        """Subscribe many ``(client_id, key)`` pairs to rows of ``table`` (key None: the whole table).

        ``batch_size`` per statement (``subscribe_many``): one round trip and
        one wait for the table's writers per batch, with the guarantee of
        :meth:`subscribe` (no gap: read the rows after this returns).  Returns
        how many subscriptions were new.  Each batch commits on its own: when
        one fails (:class:`UnknownClient`, a bad key; the message names the
        position in the batch), the batches before it are kept.
        """
        new = 0
        for batch in batches(subscriptions, batch_size):
            params = subscribe_params(self.name, table, batch, _interval(wait, "wait"))
            new += int(await self._scalar(SUBSCRIBE_MANY_SQL, params))
        return new

    async def update_client(self, client_id: str, info: Any) -> None:
        """Replace a registered client's info; :class:`UnknownClient` when it is not registered."""
        await self._execute(CLIENT_UPDATE_SQL, {"client_id": client_id, "info": Jsonb(info or {}), "name": self.name})

    async def unregister(self, client_id: str) -> bool:
        """Unregister a client and drop its subscriptions; False when it was not registered."""
        return bool(await self._scalar(UNREGISTER_SQL, {"client_id": client_id, "name": self.name}))

    async def subscribe(self, client_id: str, table: str, key: Any = None, *, wait: float = 5.0) -> bool:
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
        return bool(await self._scalar(SUBSCRIBE_SQL, params))

    async def unsubscribe(self, client_id: str, table: str, key: Any = None) -> bool:
        """Drop one subscription; False when there was none."""
        params = {"client_id": client_id, "table": table, "key": _key_param(key), "name": self.name}
        return bool(await self._scalar(UNSUBSCRIBE_SQL, params))

    async def fetch(self, max_rows: int = 1000, *, ack: list[int] | None = None) -> list[Notification]:
        """Pending notifications, oldest first (``outbox_fetch``); they stay until acknowledged.

        ``ack``: ids to acknowledge first, in the same round trip (see :meth:`ack`).
        """
        params = {"name": self.name, "max_rows": max_rows, "ack": ack}
        return [Notification(*row) for row in await self._execute(FETCH_SQL, params)]

    async def ack(self, ids: list[int]) -> int:
        """Acknowledge delivered notifications (``outbox_ack``); returns how many were removed."""
        return int(await self._scalar(ACK_SQL, {"name": self.name, "ids": list(ids)})) if ids else 0

    async def notifications(
        self,
        *,
        poll_interval: float = 1.0,
        max_rows: int = 1000,
        linger: float = 0.005,
        batch_delay: float = 0.002,
    ) -> AsyncIterator[list[Notification]]:
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
        channel = await self._scalar(CHANNEL_SQL, {"name": self.name})
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
                state = await self._scalar(SLEEP_SQL, {"name": self.name})
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
        """Run one statement on the broker connection and return its rows.

        Serialised with the heartbeats; errors come out translated, and a
        lost session as :class:`LeaseLost` (after ``on_lost`` ran).
        """
        async with self._lock:
            result = await self._execute_locked(query, params, dict_rows)
        if isinstance(result, Exception):
            await self._fire_on_lost()
            raise result
        return result

    async def _scalar(self, query: str, params: Any) -> Any:
        """The first column of the first row of :meth:`_execute`."""
        rows = await self._execute(query, params)
        return rows[0][0]

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
            result = callback(self._lost)  # sync: callback(self._lost)
            if inspect.isawaitable(result):  # ASYNC
                await result  # ASYNC
        except Exception:
            log.exception("on_lost callback of %r failed", self)

    def _start_heartbeats(self) -> None:
        assert self._conn is not None
        self._stopping = False
        self._waiter = _Waiter(self._conn.fileno())
        runner_name = f"pgbroker-heartbeat-{self.name}"
        if True:  # ASYNC
            self._runner = asyncio.get_running_loop().create_task(self._heartbeat_main(), name=runner_name)
        else:
            self._runner = threading.Thread(target=self._heartbeat_main, name=runner_name, daemon=True)
            self._runner.start()

    async def _stop_heartbeats(self) -> None:
        runner, waiter = self._runner, self._waiter
        if runner is None or waiter is None:
            return
        self._stopping = True
        waiter.wake()
        # A heartbeat stuck on a dead network ends within keepalive.user_timeout.
        # One stuck behind a hung middlebox (TCP alive, nothing forwarded) never
        # does, and it holds the lock every other call needs: shut the socket
        # down, so that it fails at once (tests/faults/test_connection_frozen.py).
        if True:  # ASYNC
            if runner is not asyncio.current_task():
                done, _ = await asyncio.wait({runner}, timeout=self.keepalive.user_timeout + 1.0)
                if not done:
                    self._shutdown_socket()
                    done, _ = await asyncio.wait({runner}, timeout=1.0)
                if not done:
                    runner.cancel()
        else:
            if runner is not threading.current_thread():
                runner.join(self.keepalive.user_timeout + 1.0)
                if runner.is_alive():
                    self._shutdown_socket()
                    runner.join(1.0)
        waiter.close()
        self._runner = self._waiter = None

    def _start_sweeper(self) -> None:
        self._sweep_stop.clear()
        sweeper_name = f"pgbroker-sweep-{self.name}"
        if True:  # ASYNC
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_main(), name=sweeper_name)
        else:
            self._sweeper = threading.Thread(target=self._sweep_main, name=sweeper_name, daemon=True)
            self._sweeper.start()

    async def _stop_sweeper(self) -> None:
        sweeper, self._sweeper = self._sweeper, None
        if sweeper is None:
            return
        self._sweep_stop.set()
        if True:  # ASYNC
            if sweeper is not asyncio.current_task():
                await asyncio.wait({sweeper}, timeout=self.connect_timeout + 5.0)
        else:
            if sweeper is not threading.current_thread():
                sweeper.join(self.connect_timeout + 5.0)

    async def _sweep_main(self) -> None:
        """Delete what earlier epochs of the lease left, a batch per ``broker_sweep()`` call, on a connection of
        its own; pause as long as each batch took, so it never takes more than about half of one CPU."""
        try:
            conn = await psycopg.AsyncConnection.connect(self.url, **self._connect_params())
        except psycopg.Error as exc:
            log.warning("sweeper of %r could not connect: %s", self, exc)
            return
        try:
            swept = 0
            while self._state == "held" and not self._sweep_stop.is_set():
                started = time.monotonic()
                cur = await conn.execute(SWEEP_SQL, {"name": self.name, "max_rows": SWEEP_BATCH})
                row = await cur.fetchone()
                if not row or not row[0]:
                    break
                swept += row[0]
                pause = time.monotonic() - started
                if True:  # ASYNC
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._sweep_stop.wait(), timeout=pause)
                else:
                    self._sweep_stop.wait(pause)
            if swept:
                log.info("%r swept %d rows of earlier epochs", self, swept)
            # The upkeep (pgbroker.maintain), on the same connection, while the lease is held.
            while self._state == "held" and not self._sweep_stop.is_set():
                started = time.monotonic()
                cur = await conn.execute(MAINTAIN_SQL, {"max_rows": SWEEP_BATCH})
                rows = await cur.fetchall()
                more = any(removed >= SWEEP_BATCH for _part, removed, _remaining in rows)  # a full batch: more
                pause = time.monotonic() - started if more else MAINTAIN_EVERY
                if True:  # ASYNC
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._sweep_stop.wait(), timeout=pause)
                else:
                    self._sweep_stop.wait(pause)
        except psycopg.Error as exc:
            log.warning("sweeper of %r stopped: %s", self, exc)
        finally:
            await conn.close()

    async def _heartbeat_main(self) -> None:
        try:
            await self._heartbeat_loop()
        except Exception:  # a bug: check() still stops the holder once guard runs out
            log.exception("heartbeat runner of %r crashed", self)

    async def _heartbeat_loop(self) -> None:
        waiter = self._waiter
        assert waiter is not None
        next_due = time.monotonic() + self.heartbeat_interval
        last_attempt = time.monotonic()
        while not self._stopping and self._state == "held":
            ops = self._ops
            timeout = next_due - time.monotonic()
            why = await asyncio.to_thread(waiter.wait, timeout)  # sync: why = waiter.wait(timeout)
            if why == "stop" or self._stopping:
                return
            if why == "data":
                # Unsolicited data (a FATAL message, EOF, a NOTICE) or the reply
                # to an API call that another caller is reading right now.
                gap = _MIN_WAKE_GAP - (time.monotonic() - last_attempt)
                if gap > 0:
                    await asyncio.sleep(gap)
            async with self._lock:
                if self._stopping:
                    return
                if why == "data" and self._ops != ops:
                    continue  # an API call consumed it; it would have seen a loss too
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
