"""Lease and registry events for asyncio, and the one source of both flavours.

:mod:`pgbroker._events_sync` (``observe``, ``registry_feed``) is generated from
this file by ``python3 -m pgbroker._gen_sync`` (see :mod:`pgbroker._broker_async`
for the rules of the transformation).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from pgbroker._core import _raise_translated

__all__ = ["LeaseState", "Registry", "RegistryEvent", "async_observe", "async_registry_feed"]

LEASE_CHANNEL = "pgbroker_lease"
LEASE_SQL = (
    "SELECT epoch, state, holder_pid, holder_application, holder_info, alive"
    " FROM pgbroker.brokers WHERE name = %(name)s"
)
CHANNEL_SQL = "SELECT pgbroker.registry_channel(%(name)s)"
WATCH_BEGIN_SQL = "SELECT pgbroker.registry_watch_begin(%(name)s)"
WATCH_END_SQL = "SELECT pgbroker.registry_watch_end(%(name)s)"
EXPIRY_SQL = "SELECT pgbroker.lease_expiry_check(%(name)s)"
CLIENTS_SQL = "SELECT epoch, client_id, info FROM pgbroker.clients WHERE name = %(name)s"
# key: a subscription by filter has its point (a JSON object: 0.1.0+4; read so that older schemas work), as events say.
SUBSCRIPTIONS_SQL = (
    'SELECT client_id, "table"::text AS "table",'
    " COALESCE(key, NULLIF(pg_catalog.to_jsonb(s) -> 'filter', 'null')) AS key"
    " FROM pgbroker.subscriptions s WHERE name = %(name)s"
)

# Lease events after which the lease has a live holder.
_HOLDING = {"claim", "takeover", "stale_takeover"}


@dataclass(frozen=True)
class LeaseState:
    """Who holds lease ``name``: ``holder_pid`` and ``alive`` (a live holder), its epoch and state.

    ``event`` is the lease event that made it so (``claim``, ``release``, ``takeover``, ``stale_takeover``,
    ``expired``), or None for a state read rather than announced (the first one, and a holder found gone).
    """

    name: str
    epoch: int
    state: str
    holder_pid: int | None
    application: str | None
    info: str | None
    alive: bool
    event: str | None = None
    at: datetime | str | None = None


@dataclass(frozen=True)
class RegistryEvent:
    """A change to a broker's registry, as announced on ``registry_channel(name)``."""

    event: str  # register, update, unregister, subscribe, unsubscribe
    name: str
    epoch: int
    client_id: str
    info: Any = None  # register, update (None when it was too large to announce)
    table: str | None = None  # subscribe, unsubscribe
    key: Any = None  # subscribe, unsubscribe (None: the whole table; a dict: one point of a filter, {"kind": "x"})


@dataclass
class Registry:
    """A live copy of a broker's registry: ``clients`` (id -> info) and ``subscriptions`` (id -> [(table, key)]),
    of epoch ``epoch`` (0 when no live broker holds the lease)."""

    name: str
    epoch: int = 0
    clients: dict[str, Any] = field(default_factory=dict)
    subscriptions: dict[str, list[tuple[str, Any]]] = field(default_factory=dict)

    def apply(self, event: RegistryEvent) -> bool:
        """Apply an event of this epoch; False (changing nothing) for one of another epoch."""
        if event.epoch != self.epoch:
            return False
        if event.event in ("register", "update"):
            if event.info is not None or event.client_id not in self.clients:
                self.clients[event.client_id] = event.info
            self.subscriptions.setdefault(event.client_id, [])
        elif event.event == "unregister":
            self.clients.pop(event.client_id, None)
            self.subscriptions.pop(event.client_id, None)
        elif event.event == "subscribe":
            subs = self.subscriptions.setdefault(event.client_id, [])
            if (event.table, event.key) not in subs:
                subs.append((event.table or "", event.key))
        elif event.event == "unsubscribe":
            subs = self.subscriptions.get(event.client_id, [])
            if (event.table, event.key) in subs:
                subs.remove((event.table or "", event.key))
        return True


def _require_autocommit(conn: psycopg.AsyncConnection[Any]) -> None:
    if not conn.autocommit:
        raise ValueError("events need a connection in autocommit mode: LISTEN takes effect at commit")


async def _listen(conn: psycopg.AsyncConnection[Any], channel: str) -> None:
    await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))


async def _read_lease(conn: psycopg.AsyncConnection[Any], name: str) -> LeaseState:
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(LEASE_SQL, {"name": name})
        row = await cur.fetchone()
    if row is None:
        return LeaseState(name, 0, "new", None, None, None, False)
    return LeaseState(name, row["epoch"], row["state"], row["holder_pid"], row["holder_application"],
                      row["holder_info"], bool(row["alive"]))  # fmt: skip


async def async_observe(
    conn: psycopg.AsyncConnection[Any], name: str = "default", *, poll_interval: float = 1.0
) -> AsyncIterator[LeaseState]:
    """Yield who holds lease ``name`` at once, then at every change, gap-free.

    ``conn``: an autocommit connection of the caller's (``pgbroker_reader`` is enough), used for this alone; it
    LISTENs on ``lease_channel()`` before it reads ``pgbroker.brokers``, so no change between the two is missed.
    Each announced claim, release, takeover, stale takeover or expiry yields a :class:`LeaseState` (its ``event``
    says which) as soon as it commits.  A session lease's holder that dies is announced by its successor's claim;
    meanwhile every ``poll_interval`` seconds the state is read again, and a holder found gone is yielded with
    ``event=None``.  When a TTL lease's time runs out unrenewed, this asks the server to record the expiry
    (``lease_expiry_check``), which every observer then hears.
    """
    _require_autocommit(conn)
    try:
        await _listen(conn, LEASE_CHANNEL)
        current = await _read_lease(conn, name)
    except psycopg.Error as exc:
        _raise_translated(exc)
    yield current
    while True:
        # One wait may bring several notifications (those of one packet): each counts.
        payloads = []
        async for notify in conn.notifies(timeout=poll_interval, stop_after=1):
            payloads.append(json.loads(notify.payload))
        for payload in payloads:
            if payload.get("name") != name or payload["epoch"] < current.epoch:
                continue  # another lease, or a change the first read already showed
            event = payload["event"]
            holding = event in _HOLDING
            state = "held" if holding else ("expired" if event == "expired" else "released")
            new = LeaseState(name, payload["epoch"], state, payload["pid"] if holding else current.holder_pid,
                             payload.get("application"), payload.get("info"), holding, event,
                             payload.get("at"))  # fmt: skip
            if (new.epoch, new.state) != (current.epoch, current.state):
                current = new
                yield current
        if payloads:
            continue
        # Quiet for poll_interval: a TTL lease may have lapsed, a session holder may have died.
        try:
            await conn.execute(EXPIRY_SQL, {"name": name})
            polled = await _read_lease(conn, name)
        except psycopg.Error as exc:
            _raise_translated(exc)
        if (polled.epoch, polled.state, polled.alive) != (current.epoch, current.state, current.alive):
            if polled.epoch == current.epoch and polled.state == "expired":
                continue  # the expiry just recorded is announced: it arrives as an event
            current = polled
            yield current


async def _read_registry(conn: psycopg.AsyncConnection[Any], name: str) -> Registry:
    registry = Registry(name, (await _read_lease(conn, name)).epoch)
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(CLIENTS_SQL, {"name": name})
        rows = await cur.fetchall()
        registry.clients = {r["client_id"]: r["info"] for r in rows}
        registry.subscriptions = {r["client_id"]: [] for r in rows}
        await cur.execute(SUBSCRIPTIONS_SQL, {"name": name})
        for r in await cur.fetchall():
            registry.subscriptions.setdefault(r["client_id"], []).append((r["table"], r["key"]))
    return registry


async def async_registry_feed(
    conn: psycopg.AsyncConnection[Any], name: str = "default", *, poll_interval: float = 1.0
) -> AsyncIterator[tuple[Registry, RegistryEvent | None]]:
    """Follow the registry of broker ``name`` live: yield ``(registry, None)`` with a fresh copy at once, then
    ``(registry, event)`` after applying each change; a new epoch (a lease event) yields a fresh copy again.

    ``conn``: an autocommit connection of the caller's (``pgbroker_reader`` is enough), used for this alone.  It
    LISTENs on ``registry_channel(name)`` and ``lease_channel()``, registers as a watcher
    (``registry_watch_begin``, so that changes are announced at all), then reads the views ``clients`` and
    ``subscriptions``: gap-free.  The same :class:`Registry` object is updated in place and yielded each time.
    A holder that dies without a successor leaves its clients in the copy until the next poll
    (``poll_interval`` seconds) finds the lease no longer alive.
    """
    _require_autocommit(conn)
    try:
        channel = (await (await conn.execute(CHANNEL_SQL, {"name": name})).fetchone())[0]
        await _listen(conn, channel)
        await _listen(conn, LEASE_CHANNEL)
        await conn.execute(WATCH_BEGIN_SQL, {"name": name})
        registry = await _read_registry(conn, name)
    except psycopg.Error as exc:
        _raise_translated(exc)
    try:
        yield registry, None
        alive = (await _read_lease(conn, name)).alive
        while True:
            # One wait may bring several notifications (those of one packet): each is applied in turn.
            payloads = []
            async for notify in conn.notifies(timeout=poll_interval, stop_after=1):
                payloads.append((notify.channel, json.loads(notify.payload)))
            if not payloads:
                now_alive = (await _read_lease(conn, name)).alive
                if now_alive != alive:
                    alive = now_alive
                    fresh = await _read_registry(conn, name)
                    registry.epoch, registry.clients, registry.subscriptions = (
                        fresh.epoch, fresh.clients, fresh.subscriptions)  # fmt: skip
                    yield registry, None
                continue
            for which, data in payloads:
                if which == LEASE_CHANNEL:
                    if data.get("name") == name and data["epoch"] >= registry.epoch:
                        fresh = await _read_registry(conn, name)
                        registry.epoch, registry.clients, registry.subscriptions = (
                            fresh.epoch, fresh.clients, fresh.subscriptions)  # fmt: skip
                        alive = data["event"] in _HOLDING
                        yield registry, None
                    continue
                event = RegistryEvent(data["event"], data["name"], data["epoch"], data["client_id"],
                                      data.get("info"), data.get("table"), data.get("key"))  # fmt: skip
                if registry.apply(event):
                    yield registry, event
    finally:
        if not conn.closed:
            with contextlib.suppress(psycopg.Error):  # the session may be gone: its watch went with it
                await conn.execute(WATCH_END_SQL, {"name": name})
