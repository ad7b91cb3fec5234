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
import dataclasses
import inspect  # ASYNC
import logging
import random
import threading
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable, Iterable  # noqa: E501  # sync: from collections.abc import Callable, Iterable, Iterator
from typing import Any

import psycopg
import psycopg.errors
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
    CONFLICT_RETRIES,
    CONFLICT_SQLSTATES,
    DEAD_MAN_SQL,
    HEARTBEAT_SQL,
    MAINTAIN_SQL,
    REGISTER_MANY_SQL,
    REGISTER_SQL,
    REGISTRY_SESSION_SQL,
    RELEASE_SQL,
    SCHEMA_VERSION_SQL,
    SESSION_SQL,
    SLEEP_SQL,
    STATE_DELETE_SQL,
    STATE_SET_SQL,
    STATUS_SQL,
    SUBSCRIBE_FILTER_SQL,
    SUBSCRIBE_FILTERS_SQL,
    SUBSCRIBE_MANY_SQL,
    SUBSCRIBE_SQL,
    SWEEP_BATCH,
    SWEEP_SQL,
    TABLE_KEY_SQL,
    UNDEFINED_FUNCTION,
    UNREGISTER_MANY_SQL,
    UNREGISTER_SQL,
    UNSUBSCRIBE_FILTER_SQL,
    UNSUBSCRIBE_SQL,
    WAKE_SQL,
    Notification,
    Registration,
    _BrokerBase,
    _clamped_wait,
    _interval,
    _key_param,
    _ms,
    _raise_translated,
    _Waiter,
    batches,
    filter_rows_query,
    grouped,
    maintain_pause,
    register_params,
    rows_query,
    subscribe_filters_params,
    subscribe_params,
)
from pgbroker.errors import (
    LeaseHeld,
    LeaseInDoubt,
    LeaseLost,
    NotWatched,
    PgBrokerError,
    TableBusy,
    schema_error,
    translate,
)

__all__ = ["AsyncBroker", "async_run_broker"]

# Locks that order the registry statements of one client id (attach, unregister with a token), by hash.
_CLIENT_LOCKS = 64

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
    the upkeep (``pgbroker.maintain()``) while the lease is held: every
    minute, every 5 seconds while a call left rows that only a later call can
    remove (names it marked idle), and again, after a pause as long as the
    call took, while a part of a call removed a full batch.
    ``registry_connections``: the registry calls (register, attach,
    subscribe, their ``_many`` forms, update_client, unregister,
    unsubscribe) run on up to this many connections of their own, opened on
    first use and fenced by the held epoch, so that a call that waits never
    holds up the heartbeats or the delivery loop (a bulk subscribe takes two,
    for two batches at a time); 0 runs them on the broker connection.  Rows
    (:meth:`read_rows`, ``notifications(rows=True)``) are read on one more
    connection, and :meth:`notifications` listens on one.

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
        self._registry_idle: list[psycopg.AsyncConnection[Any]] = []
        self._registry_slots = asyncio.Semaphore(max(1, self.registry_connections))
        self._reader: psycopg.AsyncConnection[Any] | None = None
        self._reader_lock = asyncio.Lock()
        self._table_keys: dict[str, tuple[str, str, list[str]]] = {}
        self._tokens: dict[str, str] = {}  # client id -> the token of its latest attach()
        self._client_locks = [asyncio.Lock() for _ in range(_CLIENT_LOCKS)]
        self._listen_retry_at = 0.0

    # -- lifecycle -------------------------------------------------------------

    async def claim(self) -> int:
        """Connect, claim the lease and start heartbeats; return the epoch.

        First reads the installed schema version (:class:`SchemaMissing`: run ``pgbroker migrate``): one this
        package does not work with is :class:`SchemaMismatch`; an older or newer one it works with is logged as a
        warning naming both versions and the command that fixes it (``install.compare_schema``).
        Raises :class:`LeaseHeld` (the holder in its attributes and ``detail``), :class:`PermissionDenied`,
        :class:`InvalidArgument`, or :class:`DatabaseError` for connection problems (the server unreachable, a
        replica: SQLSTATE 25006; the psycopg error as ``__cause__``).
        """
        if self._state != "new":
            raise PgBrokerError(f"a {type(self).__name__} claims once; this one is {self._state}")
        try:
            conn = await psycopg.AsyncConnection.connect(self.url, **self._connect_params())
        except psycopg.Error as exc:
            _raise_translated(exc)
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
            try:
                cur = await conn.execute(CLAIM_SQL, self._claim_params())
            except psycopg.Error as exc:
                if exc.sqlstate != UNDEFINED_FUNCTION:
                    raise
                raise await self._schema_now(conn, exc) from exc
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
        idle, self._registry_idle = self._registry_idle, []
        for conn in idle:
            await self._close_quietly(conn)
        if self._reader is not None:
            await self._close_quietly(self._reader)
            self._reader = None
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
    #
    # The registry calls run on registry connections of their own (up to
    # ``registry_connections`` of them, opened on first use), fenced by the
    # held epoch (``epoch =>``, checked like broker_assert()), so that a call
    # that waits (a subscribe waiting for an open writer transaction) never
    # holds up the heartbeats or the delivery loop, which share the lease
    # session.  With ``registry_connections=0`` they run on the lease session.

    async def register(self, client_id: str, info: Any = None) -> bool:
        """Register a client of this broker (``client_register``); True when it is new."""
        params = {"client_id": client_id, "info": Jsonb(info or {}), "name": self.name}
        return bool(await self._registry_scalar(REGISTER_SQL, params))

    async def attach(self, client_id: str, info: Any = None) -> Registration:
        """Register ``client_id`` (as :meth:`register`) and return this registration, with a new ``token``.

        Give the token to :meth:`unregister` when the connection it stands
        for ends: the client is then unregistered only if no later
        :meth:`attach` of the same id (a reconnect) happened since, so the
        late clean-up of an old connection cannot undo a newer one.  Calls for
        one client id are run in the order they are made.  Tokens live in
        this object (and :func:`async_run_broker` hands them on to the next
        epoch's broker).
        """
        token = uuid.uuid4().hex
        async with self._client_lock(client_id):
            self._tokens[client_id] = token
            await self.register(client_id, info)
        return Registration(client_id, token)

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
            new += int(await self._registry_scalar(REGISTER_MANY_SQL, register_params(self.name, batch)))
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
        how many subscriptions were new.  The pairs of one key go in one batch
        where they fit, and the keys that share clients together (grouped:
        each set where its first pair came), so a key's interest is written
        once, not once per batch that has one of its clients, and a client is
        locked by few batches.  Two batches run at a time, on two registry
        connections (``registry_connections`` of 2 or more): while one holds
        the table's watch lock, the next gets ready.  Each batch commits on
        its own: when one fails (:class:`UnknownClient`, a bad key; the
        message names the client, or the key and its position in the batch),
        no other starts, its error is raised, and the batches that committed
        are kept (those before it, and perhaps the one that ran beside it).
        ``wait`` is per batch, and never more than the guard has left (see
        :meth:`subscribe`); a batch that found the table busy while the other
        batch ran beside it runs again, alone, at the end (a writer left open
        holds the call up to twice ``wait``).
        """
        params = (subscribe_params(self.name, table, b, None) for b in batches(grouped(subscriptions), batch_size))
        return await self._subscribe_batches(SUBSCRIBE_MANY_SQL, params, wait=wait)

    async def update_client(self, client_id: str, info: Any) -> None:
        """Replace a registered client's info; :class:`UnknownClient` when it is not registered."""
        params = {"client_id": client_id, "info": Jsonb(info or {}), "name": self.name}
        await self._registry_scalar(CLIENT_UPDATE_SQL, params)

    async def unregister(self, client_id: str, *, token: str | None = None) -> bool:
        """Unregister a client and drop its subscriptions; False when it was not registered.

        ``token`` (of :meth:`attach`): only if that is still the client's
        latest registration; False, and nothing changes, when a later
        :meth:`attach` replaced it.
        """
        params = {"client_id": client_id, "name": self.name}
        if token is None:
            return bool(await self._registry_scalar(UNREGISTER_SQL, params))
        async with self._client_lock(client_id):
            if self._tokens.get(client_id) != token:
                return False
            removed = bool(await self._registry_scalar(UNREGISTER_SQL, params))
            if self._tokens.get(client_id) == token:
                del self._tokens[client_id]
            return removed

    async def unregister_many(self, client_ids: Iterable[str], *, batch_size: int = 10_000) -> int:
        """Unregister many clients with their subscriptions, ``batch_size`` per statement (``client_unregister_many``).

        Returns how many were registered.  One round trip per batch, the
        mass departure (a deploy, a frontend that lost its connections):
        10,000 clients cost what they own, whatever the registry and the
        outbox backlog hold.  Each batch commits on its own: when one fails
        (an invalid id, its position in the batch named in the message), the
        batches before it are kept and nothing of it is.  As :meth:`unregister`
        without a token: the latest registration of each id goes.
        """
        gone = 0
        for batch in batches(client_ids, batch_size):
            params = {"client_ids": batch, "name": self.name}
            gone += int(await self._registry_scalar(UNREGISTER_MANY_SQL, params))
        return gone

    async def subscribe(
        self, client_id: str, table: str, key: Any = None, *, filter: dict[str, Any] | None = None, wait: float = 5.0
    ) -> bool:
        """Subscribe ``client_id`` to the row of ``table`` with primary key ``key`` (None: the whole table).

        ``key`` is a scalar for a one-column key, a list in key order for a
        composite one.  Once this returns, every later change is delivered:
        read the row *after* subscribing (:meth:`read_rows`).  False when
        already subscribed.

        ``filter`` (instead of a key): the rows whose columns have these
        values, ``{"team": 7}``, ``{"status": {"in": ["open", "pending"]}}``,
        ``{"closed_at": None}`` (NULL), several columns all matching; a row
        that leaves the filter is still told, in :attr:`Notification.left`.
        Read the filter's rows after subscribing (``SELECT ... WHERE`` the
        same condition).  A bad filter is :class:`InvalidArgument` (SQLSTATEs
        in sql/README.md, "Filters").

        A write transaction left open on ``table`` makes it wait, up to
        ``wait`` seconds and never longer than the guard has left
        (:meth:`check`), then :class:`TableBusy`: only this call waits, on a
        registry connection of its own; heartbeats, delivery and the other
        clients go on (the writers' changes meanwhile are delivered to
        whoever is subscribed when they are fetched).
        """
        if filter is not None:
            params = {"client_id": client_id, "table": table, "filter": Jsonb(filter), "name": self.name}
            if key is not None:
                raise TypeError("subscribe() takes a key or a filter, not both")
            return bool(await self._registry_scalar(SUBSCRIBE_FILTER_SQL, params, wait=wait))
        params = {"client_id": client_id, "table": table, "key": _key_param(key), "name": self.name}
        return bool(await self._registry_scalar(SUBSCRIBE_SQL, params, wait=wait))

    async def subscribe_filters(
        self,
        subscriptions: Iterable[tuple[str, dict[str, Any]]],
        table: str,
        *,
        wait: float = 5.0,
        batch_size: int = 10_000,
    ) -> int:
        """Subscribe many ``(client_id, filter)`` pairs to the rows of ``table`` matching each filter.

        As :meth:`subscribe_many` (``subscribe_filters``: one statement per
        batch, set-based, the pairs of one filter in one batch where they
        fit, the filters that share clients together, two batches at a
        time); returns how many subscriptions were new (a filter with ``in``
        counts one per value).
        """
        params = (
            subscribe_filters_params(self.name, table, b, None) for b in batches(grouped(subscriptions), batch_size)
        )
        return await self._subscribe_batches(SUBSCRIBE_FILTERS_SQL, params, wait=wait)

    async def unsubscribe(
        self,
        client_id: str,
        table: str,
        key: Any = None,
        *,
        filter: dict[str, Any] | None = None,
    ) -> bool:
        """Drop one subscription (by key, whole table, or every point of ``filter``); False when there was none."""
        if filter is not None:
            if key is not None:
                raise TypeError("unsubscribe() takes a key or a filter, not both")
            params = {"client_id": client_id, "table": table, "filter": Jsonb(filter), "name": self.name}
            return bool(await self._registry_scalar(UNSUBSCRIBE_FILTER_SQL, params))
        params = {"client_id": client_id, "table": table, "key": _key_param(key), "name": self.name}
        return bool(await self._registry_scalar(UNSUBSCRIBE_SQL, params))

    async def read_rows(self, table: str, keys: list[Any]) -> list[Any]:
        """The current rows of watched ``table`` with these keys, in order (None where no row has the key).

        One statement on the broker's row-reading connection, the one
        ``notifications(rows=True)`` reads with, one statement after another:
        a read that returns later saw every change an earlier one saw.  So a
        new subscriber's snapshot ordered against the loop's rows is: subscribe,
        ``read_rows``, and send the snapshot (in asyncio: before the next
        ``await``) ahead of every row the loop yields from then on; rows the
        loop yielded before that are older than the snapshot, drop them.
        Rows are dicts, as ``to_jsonb`` gives them.
        """
        return await self._read_rows_for([(table, key) for key in keys])

    async def fetch(self, max_rows: int = 1000, *, ack: list[int] | None = None) -> list[Notification]:
        """Pending notifications, oldest first (``outbox_fetch``); they stay until acknowledged.

        ``ack``: ids to acknowledge first, in the same round trip (see :meth:`ack`).

        A deadlock or serialization failure (40P01, 40001) with another
        session holding outbox rows rolls the call back whole, the
        acknowledgements too; it runs again, up to three times more, before
        the error is raised.
        """
        params = {"name": self.name, "max_rows": max_rows, "ack": ack}
        rows = await self._execute_again_on_conflict(self._fetch_sql(), params)
        return [Notification.from_row(row) for row in rows]

    async def ack(self, ids: list[int]) -> int:
        """Acknowledge delivered notifications (``outbox_ack``); returns how many were removed.

        Run again on a deadlock or serialization failure, as :meth:`fetch` is.
        """
        if not ids:
            return 0
        rows = await self._execute_again_on_conflict(ACK_SQL, {"name": self.name, "ids": list(ids)})
        return int(rows[0][0])

    async def notifications(
        self,
        *,
        poll_interval: float = 1.0,
        max_rows: int = 1000,
        linger: float = 0.005,
        batch_delay: float = 0.002,
        rows: bool = False,
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
        taken from the writers, for at most that much latency).

        ``rows=True``: each notification comes with ``row``, the row as it is
        now, read by key after the fetch in one statement per batch (None when
        deleted; see :meth:`read_rows` for a new subscriber's snapshot).

        It heals itself: when its own ``LISTEN`` connection fails (terminated,
        a network error), it reconnects and goes on, fetching first (the
        outbox is the source of truth: nothing is lost meanwhile), polling
        every 50 ms until the connection is back.  While :meth:`check` is in
        doubt (no heartbeat confirmed for ``guard`` seconds, the loss not
        known) it waits instead of fetching, and goes on when a heartbeat
        is confirmed.  It raises only:

        - :class:`LeaseLost` (``final`` True) when the lease is really lost
          (session gone, released, a newer epoch), ``__cause__`` the error
          that proved it;
        - another :class:`PgBrokerError` for any other failure (a row it
          could not read, an unexpected server error: :class:`DatabaseError`),
          ``__cause__`` the driver's error.  The lease may still be held.
        """
        channel = await self._scalar(CHANNEL_SQL, {"name": self.name})
        listener: psycopg.AsyncConnection[Any] | None = None
        try:
            listener = await self._listen(channel)
            await self._execute(WAKE_SQL, {"name": self.name})
            idle_since: float | None = None
            done: list[int] | None = None  # handled, not yet acknowledged
            while True:
                await self._until_held()
                if listener is None or listener.closed:
                    listener = await self._listen(channel)
                batch = await self.fetch(max_rows, ack=done)
                done = None
                if batch:
                    if rows:
                        batch = await self._with_rows(batch)
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
                    timeout = min(timeout, self.guard / 2)
                    if listener is None:
                        await asyncio.sleep(min(timeout, 0.05))
                    else:
                        try:
                            async for _ in listener.notifies(timeout=timeout, stop_after=1):
                                pass
                        except psycopg.Error as exc:
                            log.warning("the LISTEN connection of %r failed (reconnecting): %s", self, exc)
                            await self._close_quietly(listener)
                            listener = None
                    await self._execute(WAKE_SQL, {"name": self.name})
                idle_since = None
        finally:
            if listener is not None:
                await self._close_quietly(listener)

    # -- registry connections, the row reader, the listener --------------------

    def _client_lock(self, client_id: str) -> Any:
        return self._client_locks[zlib.crc32(client_id.encode()) % _CLIENT_LOCKS]

    async def _subscribe_batches(self, query: str, params: Iterable[dict[str, Any]], *, wait: float) -> int:
        """Run a bulk subscribe, one statement per batch (``params``), and return the sum of their counts.

        Two batches at a time, on two registry connections (one at a time
        with fewer).  The batches of a table take its watch lock in turn:
        while one holds it (its inserts, its commit), the next expands its
        filters and looks its clients up, which take no lock; a third would
        only queue for it.  Broker.subscribe_filters of bench_filters' bulk
        (100,000 filters, batches of 10,000; a 2-core machine, medians of 4):
        1.50x the filters per second of one batch at a time, for 0.99x the
        server's CPU; three at a time (raw connections): 0.97x two.

        Each batch commits on its own.  Once one fails, no other starts, the
        one beside it ends, and the error of the first failed batch (in the
        call's order) is raised.  A batch that found the table busy
        (:class:`TableBusy`) while another ran beside it may have waited for
        that one rather than for a writer: it runs again, alone, after the
        others (so a writer left open makes the call wait up to twice
        ``wait``).
        """
        todo = iter(enumerate(params))
        new = 0
        if self.registry_connections < 2:
            for _, batch in todo:
                new += int(await self._registry_scalar(query, batch, wait=wait))
            return new
        lock = threading.Lock()  # the state below (in the threaded flavour, the workers are threads)
        started = running = 0
        failed: list[tuple[int, BaseException]] = []  # (batch number, its error)
        again: list[tuple[int, dict[str, Any]]] = []  # batches to run once more, alone
        stop = threading.Event()

        async def worker() -> None:
            nonlocal new, started, running
            while True:
                with lock:
                    if failed or stop.is_set():
                        return
                    try:
                        item = next(todo, None)
                    except Exception as exc:  # a batch's parameters (batch_size < 1)
                        failed.append((started, exc))
                        return
                    if item is None:
                        return
                    started += 1
                    running += 1
                    mine, alone = started, running == 1
                try:
                    count = int(await self._registry_scalar(query, item[1], wait=wait))
                except Exception as exc:
                    with lock:
                        running -= 1
                        if isinstance(exc, TableBusy) and not (alone and started == mine):
                            again.append(item)
                        else:
                            failed.append((item[0], exc))
                    continue
                with lock:
                    running -= 1
                    new += count

        if True:  # ASYNC
            await asyncio.gather(worker(), worker())
        else:
            other = threading.Thread(target=worker, name=f"pgbroker-subscribe-{self.name}", daemon=True)
            other.start()
            try:
                worker()
            finally:
                stop.set()
                other.join()
        if failed:
            raise min(failed, key=lambda f: f[0])[1]
        for _, batch in sorted(again, key=lambda a: a[0]):
            new += int(await self._registry_scalar(query, batch, wait=wait))
        return new

    async def _registry_scalar(self, query: str, params: dict[str, Any], *, wait: Any = None) -> Any:
        """Run one registry statement (see above) and return its scalar; ``wait`` (seconds) for the table lock."""
        if self.registry_connections == 0:
            if "wait" in query:
                params["wait"] = _interval(wait, "wait")
            return await self._scalar(query, {**params, "epoch": None})
        left = self.check()  # LeaseLost, LeaseInDoubt
        if "wait" in query:
            params["wait"] = _clamped_wait(wait, left)
        params["epoch"] = self.epoch
        conn = await self._registry_take()
        reuse = False
        try:
            cur = await conn.execute(query, params)
            row = await cur.fetchone()
            reuse = True
        except psycopg.Error as exc:
            reuse = not conn.broken
            if exc.sqlstate == UNDEFINED_FUNCTION and reuse:
                raise await self._schema_now(conn, exc) from exc
            error = self._classify_registry(exc)
            if isinstance(error, LeaseLost):
                await self._fire_on_lost()
            raise error from exc
        finally:
            await self._registry_give(conn, reuse)
        assert row is not None
        return row[0]

    async def _registry_take(self) -> psycopg.AsyncConnection[Any]:
        await self._registry_slots.acquire()
        try:
            if self._registry_idle:
                return self._registry_idle.pop()
            conn = await psycopg.AsyncConnection.connect(self.url, **self._connect_params())
            try:
                await conn.execute(SESSION_SQL, self._session_params())
                await conn.execute(REGISTRY_SESSION_SQL)
            except BaseException:
                await conn.close()
                raise
            return conn
        except psycopg.Error as exc:
            self._registry_slots.release()
            raise translate(exc) from exc
        except BaseException:
            self._registry_slots.release()
            raise

    async def _registry_give(self, conn: psycopg.AsyncConnection[Any], reuse: bool) -> None:
        try:
            if reuse and not conn.closed and self._state == "held":
                self._registry_idle.append(conn)
            else:
                await self._close_quietly(conn)
        finally:
            self._registry_slots.release()

    async def read_filter(self, table: str, filter: dict[str, Any]) -> list[Any]:
        """The current rows of watched ``table`` matching ``filter`` (as :meth:`subscribe`'s), in key order.

        One statement on the row-reading connection, as :meth:`read_rows`: a new filter subscriber's snapshot, taken
        after :meth:`subscribe` returned, misses no change the loop yields later.  Rows are dicts, as ``to_jsonb``
        gives them.  :class:`InvalidArgument` for a bad filter (an unknown column: the server's 42703).
        """
        async with self._reader_lock:
            conn = self._reader
            try:
                if conn is None or conn.closed:
                    conn = self._reader = await psycopg.AsyncConnection.connect(self.url, **self._connect_params())
                if table not in self._table_keys:
                    cur = await conn.execute(TABLE_KEY_SQL, {"table": table})
                    found = await cur.fetchone()
                    if found is None:
                        raise NotWatched(f"table {table} has no primary key: it is not watched")
                    self._table_keys[table] = (found[0], found[1], list(found[2]))
                query, params = filter_rows_query(*self._table_keys[table], filter)
                cur = await conn.execute(query, params)
                return [row for (row,) in await cur.fetchall()]
            except psycopg.Error as exc:
                self._table_keys.clear()
                if conn is not None and conn.broken:
                    await self._close_quietly(conn)
                    self._reader = None
                raise translate(exc) from exc

    async def _read_rows_for(self, pairs: list[tuple[str, Any]]) -> list[Any]:
        """The current row for each ``(table, key)`` (None for a key None or no such row), in one statement."""
        out: list[Any] = [None] * len(pairs)
        groups: dict[str, list[int]] = {}
        for i, (table, key) in enumerate(pairs):
            if key is not None:
                groups.setdefault(table, []).append(i)
        if not groups:
            return out
        async with self._reader_lock:
            conn = self._reader
            try:
                if conn is None or conn.closed:
                    conn = self._reader = await psycopg.AsyncConnection.connect(self.url, **self._connect_params())
                parts = []
                for table in groups:
                    if table not in self._table_keys:
                        cur = await conn.execute(TABLE_KEY_SQL, {"table": table})
                        found = await cur.fetchone()
                        if found is None:
                            raise NotWatched(f"table {table} has no primary key: its rows cannot be read by key")
                        self._table_keys[table] = (found[0], found[1], list(found[2]))
                    parts.append(self._table_keys[table])
                positions = list(groups.values())
                params = {f"k{g}": Jsonb([pairs[i][1] for i in idx]) for g, idx in enumerate(positions)}
                cur = await conn.execute(rows_query(parts), params)
                for g, i, row in await cur.fetchall():
                    out[positions[g][i - 1]] = row
            except psycopg.Error as exc:
                self._table_keys.clear()  # a table watched again may have another key
                if conn is not None and conn.broken:
                    await self._close_quietly(conn)
                    self._reader = None
                raise translate(exc) from exc
        return out

    async def _with_rows(self, batch: list[Notification]) -> list[Notification]:
        found = await self._read_rows_for([(n.table, None if n.op == "T" else n.key) for n in batch])
        return [dataclasses.replace(n, row=row) for n, row in zip(batch, found, strict=True)]

    async def _listen(self, channel: str) -> psycopg.AsyncConnection[Any] | None:
        """A new connection that LISTENs on ``channel``, or None (logged) when that fails; at most one try per 0.5 s."""
        now = time.monotonic()
        if now < self._listen_retry_at:
            return None
        self._listen_retry_at = now + 0.5
        conn = None
        try:
            conn = await psycopg.AsyncConnection.connect(self.url, **self._connect_params())
            await conn.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel)))
        except psycopg.Error as exc:
            log.warning("%r could not LISTEN (polling meanwhile): %s", self, exc)
            if conn is not None:
                await self._close_quietly(conn)
            return None
        return conn

    async def _close_quietly(self, conn: psycopg.AsyncConnection[Any]) -> None:
        try:
            await conn.close()
        except (psycopg.Error, OSError) as exc:
            log.debug("closing a connection of %r failed: %s", self, exc)

    async def _until_held(self) -> None:
        """Return while :meth:`check` passes; wait while it is in doubt; raise :class:`LeaseLost` once lost.

        The heartbeat runner ends the doubt either way (a confirmed heartbeat,
        or a failed one that proves the loss); only if it is gone (a bug: it
        logged why) is the lease taken as lost.
        """
        while True:
            try:
                self.check()
                return
            except LeaseInDoubt as doubt:
                if not self._runner_alive():
                    lost = self._mark_lost("in doubt, and the heartbeat runner stopped", None, doubt)
                    await self._fire_on_lost()
                    raise lost from doubt
            await asyncio.sleep(min(0.05, self.heartbeat_interval / 4))

    def _runner_alive(self) -> bool:
        runner = self._runner
        if True:  # ASYNC
            return runner is not None and not runner.done()
        else:
            return runner is not None and runner.is_alive()

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

    async def _execute_again_on_conflict(self, query: str, params: Any) -> list[Any]:
        """:meth:`_execute` of a statement that is a whole transaction, run again on a conflict (CONFLICT_RETRIES)."""
        for attempt in range(1, CONFLICT_RETRIES + 2):
            try:
                return await self._execute(query, params)
            except PgBrokerError as exc:
                if exc.sqlstate not in CONFLICT_SQLSTATES or attempt > CONFLICT_RETRIES:
                    raise
                log.warning("%r: %s (%s), running it again", self, str(exc).strip(), exc.sqlstate)
            await asyncio.sleep(random.uniform(0, 0.01 * attempt))
        raise AssertionError("unreachable")

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
            if exc.sqlstate == UNDEFINED_FUNCTION and not conn.closed:
                return await self._schema_now(conn, exc)
            return self._classify(conn, exc)
        finally:
            self._ops += 1

    async def _schema_now(self, conn: psycopg.AsyncConnection[Any], exc: psycopg.Error) -> Exception:
        """A 42883 from a pgbroker call: :class:`SchemaMismatch` when the schema's version is not this package's."""
        try:
            cur = await conn.execute(SCHEMA_VERSION_SQL)
            row = await cur.fetchone()
        except psycopg.Error:
            return self._classify(conn, exc)
        return self._missing_function(conn.info.dbname, exc, row)

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
                pause = maintain_pause(await cur.fetchall(), time.monotonic() - started)
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


# Errors of a claim that a leadership loop waits out and tries again: no server (yet), a server that is
# not the primary (25006 read_only_sql_transaction: a replica, after a failover), one shutting down.
def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, psycopg.OperationalError | psycopg.errors.ReadOnlySqlTransaction):
        return True
    sqlstate = getattr(exc, "sqlstate", None) or ""
    return sqlstate.startswith(("08", "57P")) or sqlstate == "25006"


async def _call(callback: Callable[..., Any] | None, *args: Any) -> None:
    if callback is None:
        return
    result = callback(*args)  # sync: callback(*args)
    if inspect.isawaitable(result):  # ASYNC
        await result  # ASYNC


def _setter(event: Any) -> Callable[[LeaseLost], None]:
    """An ``on_lost`` that sets ``event``."""
    return lambda exc: event.set()


async def async_run_broker(
    url: str,
    name: str = "default",
    *,
    on_start: Callable[[AsyncBroker], Any],
    on_waiting: Callable[[LeaseHeld], Any] | None = None,
    on_lost: Callable[[LeaseLost], Any] | None = None,
    clients: Callable[[], dict[str, Iterable[tuple[str, Any]]]] | None = None,
    report_interval: float = 1.0,
    retry_delay: float = 0.5,
    max_terms: int | None = None,
    **broker_args: Any,
) -> None:
    """Lead lease ``name`` whenever this process can: wait, claim, serve, and after a loss wait and claim again.

    Each *term*: an :class:`AsyncBroker` claims, waiting ``report_interval``
    seconds at a time and calling ``on_waiting(held)`` after each wait with the
    :class:`LeaseHeld` that names the holder (``pid``, ``application``,
    ``info``, ``epoch``, ``since``); it takes over the moment the holder's
    session ends.  Once it holds the lease it re-registers the clients
    ``clients()`` returns (a dict: client id -> its ``(table, key)``
    subscriptions) with ``register_many`` and subscribes them with
    ``subscribe_many`` (one statement per table and 10,000; a writer
    transaction left open on a table makes it wait, and try again after each
    :class:`TableBusy`), then calls
    ``on_start(broker)``: serve, with ``broker.epoch`` the epoch this term
    serves (its ``notifications()`` raise :class:`LeaseLost` when it ends).
    When the lease is lost (``on_start`` raises :class:`LeaseLost`, or, in
    the asyncio flavour, the broker learns it lost the lease: ``on_start`` is
    then cancelled), ``on_lost(exc)`` is called, the broker closed, and after
    ``retry_delay`` seconds the next term begins.  When ``on_start`` returns,
    the lease is released and this returns.

    No server, a server that is not the primary (25006, as a replica is
    after a failover) or one shutting down: logged, and tried again after
    ``retry_delay``; with a multi-host URL (``host=h1,h2`` or
    ``postgresql://u@h1:p1,h2:p2/db?target_session_attrs=read-write``) libpq
    finds the new primary.  Other errors (a missing schema, a refused
    privilege, a bug in ``on_start``) are raised.  ``max_terms``: stop after
    that many terms (None: never).  ``broker_args`` go to :class:`AsyncBroker`
    (``heartbeat_interval``, ``dead_man``, ``stale_after`` ...; not ``wait``
    nor ``on_lost``).  Callbacks may be coroutine functions in the asyncio
    flavour.  Tokens of :meth:`AsyncBroker.attach` carry over from one term
    to the next.
    """
    tokens: dict[str, str] = {}
    terms = 0
    while max_terms is None or terms < max_terms:
        lost_now = asyncio.Event()  # ASYNC
        broker_args["on_lost"] = _setter(lost_now)  # ASYNC
        broker = AsyncBroker(url, name, wait=report_interval, **broker_args)
        broker._tokens = tokens
        try:
            await broker.claim()
        except LeaseHeld as held:
            await broker.close()
            await _call(on_waiting, held)
            continue
        except Exception as exc:
            await broker.close()
            if not _retryable(exc) and not _retryable(exc.__cause__ or exc):
                raise
            log.warning("lease %r: cannot claim now (retrying in %g s): %s", name, retry_delay, exc)
            await asyncio.sleep(retry_delay)
            continue
        terms += 1
        log.info("lease %r: holding epoch %d", name, broker.epoch)
        try:
            if clients is not None:
                wanted = clients()
                await broker.register_many(wanted)
                by_table: dict[str, list[tuple[str, Any]]] = {}
                for client_id, subscriptions in wanted.items():
                    for table, key in subscriptions:
                        by_table.setdefault(table, []).append((client_id, key))
                for table, pairs in by_table.items():
                    while True:  # a writer transaction left open on the table: wait for it, a guard at a time
                        try:
                            await broker.subscribe_many(pairs, table)
                            break
                        except TableBusy as exc:
                            log.warning("lease %r: re-subscribing to %s waits for a writer: %s", name, table, exc)
            if True:  # ASYNC
                serving = asyncio.ensure_future(_call(on_start, broker))
                watcher = asyncio.ensure_future(lost_now.wait())
                try:
                    await asyncio.wait({serving, watcher}, return_when=asyncio.FIRST_COMPLETED)
                finally:  # also when this task is cancelled: the serving task goes with it
                    watcher.cancel()
                    if not serving.done():
                        serving.cancel()
                        with contextlib.suppress(asyncio.CancelledError, LeaseLost):
                            await serving
                if serving.cancelled():
                    raise broker.lost_reason or LeaseLost(f'lease "{name}" lost')
                serving.result()
            else:
                _call(on_start, broker)
            return
        except LeaseLost as exc:
            log.warning("lease %r: epoch %d ended: %s", name, broker.epoch, exc)
            await _call(on_lost, exc)
        finally:
            await broker.close()
        await asyncio.sleep(retry_delay)
