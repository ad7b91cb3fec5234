"""The console's server: the role check, the read-only pool, the one LISTEN connection, the JSON pages and SSE.

See :mod:`pgbroker.console` for what it shows and why it is safe to leave running.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ipaddress
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from pgbroker import install
from pgbroker.errors import PgBrokerError, translate

__all__ = ["MAX_PAGE", "ConsoleRefused", "RoleCheck", "check_role", "create_app", "serve"]

log = logging.getLogger("pgbroker.console")

STATIC = Path(__file__).with_name("static")
MAX_PAGE = 200  # rows per request, whatever the page asks
DEFAULT_PAGE = 50
LAG_SAMPLE_S = 2.0  # how often the outbox backlog is sampled for the chart
LAG_WINDOW_S = 600.0  # ... and how much of it is kept
COUNTS_MIN_S = 5.0  # clients/subscriptions/sweep counts are re-read at most this often (and 10x their time)...
COUNTS_MAX_S = 30.0  # ... and at least this often
HEALTH_TTL_S = 5.0
BACKOFF = (0.25, 0.5, 1.0, 2.0, 4.0)  # seconds between reconnection attempts of the LISTEN connection
STATEMENT_TIMEOUT_MS = 5000

ROLE_SQL = """\
SELECT current_user AS role, r.rolsuper AS superuser,
       pg_catalog.pg_has_role(current_user, 'pgbroker_reader', 'USAGE') AS reader,
       pg_catalog.pg_has_role(current_user, 'pgbroker_user', 'USAGE') AS user,
       pg_catalog.pg_has_role(current_user, 'pgbroker_admin', 'USAGE') AS admin,
       pgbroker.schema_version() AS schema_version
  FROM pg_catalog.pg_roles r WHERE r.rolname = current_user"""
ROLES_EXIST_SQL = "SELECT count(*) FROM pg_catalog.pg_roles WHERE rolname = 'pgbroker_reader'"

BROKERS_SQL = """\
SELECT name, epoch, state, holder_pid, holder_application, pg_catalog.host(holder_address) AS holder_address,
       holder_user, holder_info, claimed_at, heartbeat_at, EXTRACT(epoch FROM heartbeat_age)::float8 AS heartbeat_age_s,
       released_at, alive, waiting
  FROM pgbroker.brokers WHERE name > %(after)s ORDER BY name LIMIT %(limit)s"""
BROKER_NAMES_SQL = "SELECT name FROM pgbroker.brokers ORDER BY name LIMIT 1000"
COUNTS_SQL = """\
SELECT name, clients, subscriptions, takeovers, sweep_backlog FROM pgbroker.broker_overview ORDER BY name LIMIT 1000"""
LAG_SQL = """\
SELECT name, pending, EXTRACT(epoch FROM pg_catalog.clock_timestamp() - oldest)::float8 AS lag_s
  FROM pgbroker.outbox_pending ORDER BY name LIMIT 1000"""
HISTORY_SQL = """\
SELECT id, name, epoch, event, at, pid, db_user, application, pg_catalog.host(address) AS address, info,
       previous_epoch, previous_pid, previous_application, reason
  FROM pgbroker.lease_history WHERE name = %(name)s AND id < %(before)s ORDER BY id DESC LIMIT %(limit)s"""
EPOCH_SQL = "SELECT epoch FROM pgbroker.brokers WHERE name = %(name)s"
# The lease's epoch is read first and passed as a constant: the index (name, epoch, client_id) then gives the
# clients in order, and a page reads its rows and no more.
CLIENTS_SQL = """\
SELECT client_id, info, registered_at, updated_at, subscriptions
  FROM pgbroker.clients
 WHERE name = %(name)s AND epoch = %(epoch)s AND client_id > %(after)s
   AND client_id >= %(prefix)s AND pg_catalog.starts_with(client_id, %(prefix)s)
 ORDER BY client_id LIMIT %(limit)s"""
# filter: one point of a subscription by filter (schema 0.1.0+4; read through to_jsonb so that an older schema,
# whose view has no such column, gives NULL); cursor: the key or the point as text, the page's order.
CLIENT_SUBSCRIPTIONS_SQL = """\
SELECT "table", key, filter, subscribed_at, cursor
  FROM (SELECT s."table"::text AS "table", s.key, pg_catalog.to_jsonb(s) -> 'filter' AS filter, s.subscribed_at,
               COALESCE(s.key::text, (pg_catalog.to_jsonb(s) -> 'filter')::text, '') AS cursor
          FROM pgbroker.subscriptions s
         WHERE s.name = %(name)s AND s.client_id = %(client)s) x
 WHERE ("table", cursor) > (%(after_table)s, %(after_key)s)
 ORDER BY "table", cursor LIMIT %(limit)s"""
LOCKS_SQL = """\
SELECT name, mode, holder_pid, application, holder_since, waiting, waiting_since
  FROM pgbroker.locks WHERE name > %(after)s OR (name = %(after)s AND holder_pid > %(after_pid)s)
 ORDER BY name, holder_pid LIMIT %(limit)s"""
SEMAPHORES_SQL = """\
SELECT name, permits, held, holders, waiting FROM pgbroker.semaphores WHERE name > %(after)s
 ORDER BY name LIMIT %(limit)s"""
UNACCOUNTED_SQL = """\
SELECT pid, role::text AS role, application, session_state, lock_class, key, mode, why
  FROM pgbroker.unaccounted_locks ORDER BY pid, lock_class, key LIMIT %(limit)s"""
KV_SQL = """\
SELECT key, version, updated_at, expires_at, value
  FROM pgbroker.kv
 WHERE key > %(after)s AND key >= %(prefix)s AND pg_catalog.starts_with(key, %(prefix)s)
 ORDER BY key LIMIT %(limit)s"""
# The tree of the key-value store, a level at a time ("folders" end in /), the way Consul lists keys with a separator:
# a skip scan, one index probe per child, which needs the keys in byte order (a C or C.UTF-8 collation, where the
# keys that begin with a prefix are contiguous); in other collations the page groups a flat page of keys instead.
KV_BYTE_ORDER_SQL = """\
SELECT CASE WHEN c.collname = 'default'
            THEN (d.datlocprovider = 'c' AND d.datcollate IN ('C', 'POSIX', 'C.UTF-8', 'C.utf8'))
                 OR d.datlocprovider = 'b'
            ELSE c.collname IN ('C', 'POSIX') END AS byte_order
  FROM pg_catalog.pg_attribute a
  JOIN pg_catalog.pg_collation c ON c.oid = a.attcollation
  JOIN pg_catalog.pg_database d ON d.datname = pg_catalog.current_database()
 WHERE a.attrelid = 'pgbroker.kv'::regclass AND a.attname = 'key'"""
_KV_CHILD = """CASE WHEN pg_catalog.strpos(pg_catalog.substr({k}, %(n)s + 1), '/') > 0
            THEN %(prefix)s || pg_catalog.left(pg_catalog.substr({k}, %(n)s + 1),
                                              pg_catalog.strpos(pg_catalog.substr({k}, %(n)s + 1), '/'))
            ELSE {k} END"""
KV_TREE_SQL = f"""\
WITH RECURSIVE c(child) AS (
    (SELECT {_KV_CHILD.format(k="e.key")} AS child FROM pgbroker.kv e
      WHERE e.key >= %(first)s AND e.key < %(upper)s
      ORDER BY e.key LIMIT 1)   -- e.key: a bare "key" would name the CASE, which PostgreSQL calls after its ELSE
  UNION ALL
    SELECT (SELECT {_KV_CHILD.format(k="k.key")} FROM pgbroker.kv k
             WHERE k.key >= CASE WHEN pg_catalog.right(c.child, 1) = '/'
                                 THEN pg_catalog.left(c.child, -1) || '0'   -- past every key of the folder
                                 ELSE c.child || pg_catalog.chr(1) END      -- the next key after this one
               AND k.key < %(upper)s
             ORDER BY k.key LIMIT 1)
      FROM c WHERE c.child IS NOT NULL
)
SELECT child FROM c WHERE child IS NOT NULL LIMIT %(limit)s"""
KV_ENTRIES_SQL = "SELECT key, version, updated_at, expires_at, value FROM pgbroker.kv WHERE key = ANY(%(keys)s)"
COUNTERS_SQL = (
    "SELECT name, value, updated_at FROM pgbroker.counters WHERE name > %(after)s ORDER BY name LIMIT %(limit)s"
)
RATE_LIMITS_SQL = """\
SELECT name, rate, EXTRACT(epoch FROM per)::float8 AS per_s, burst, available, full_at, allowed, denied,
       last_allowed, updated_at
  FROM pgbroker.rate_limits WHERE name > %(after)s ORDER BY name LIMIT %(limit)s"""
GRANTS_SQL = """\
SELECT kind, prefix, role::text AS role, rights, granted_at FROM pgbroker.name_grants
 WHERE (kind, prefix, role::text) > (%(after_kind)s, %(after_prefix)s, %(after_role)s)
 ORDER BY kind, prefix, role::text LIMIT %(limit)s"""
HEALTH_SQL = 'SELECT "check", subject, ok, detail, fix FROM pgbroker.health ORDER BY ok, "check", subject'
TAKEOVER_SQL = "SELECT pgbroker.broker_claim(%(name)s, wait => '10 s', takeover => true, info => %(info)s)"
RELEASE_SQL = "SELECT pgbroker.broker_release(%(name)s)"
REVOKE_SQL = "SELECT pgbroker.name_revoke(%(kind)s, %(prefix)s, %(role)s::regrole)"
LEASE_CHANNEL_SQL = "SELECT pgbroker.lease_channel()"
REGISTRY_CHANNEL_SQL = "SELECT pgbroker.registry_channel(%s)"
WATCH_BEGIN_SQL = "SELECT pgbroker.registry_watch_begin(%s)"


class ConsoleRefused(PgBrokerError):
    """The console will not run with this role (a superuser without ``allow_superuser``, no pgbroker_reader, or
    ``admin`` without pgbroker_admin), or cannot reach the database when it starts."""


@dataclass(frozen=True)
class RoleCheck:
    """Who the console connects as, and what it may do: what it says at start and on the page."""

    role: str
    superuser: bool
    reader: bool
    user: bool
    admin: bool
    schema_version: str

    def describe(self, admin_mode: bool) -> str:
        rights = [
            r
            for r, ok in (
                ("pgbroker_reader", self.reader),
                ("pgbroker_user", self.user),
                ("pgbroker_admin", self.admin),
            )
            if ok
        ]
        what = "superuser" if self.superuser else f"a member of {', '.join(rights) or 'no pgbroker role'}"
        mode = "admin: hand-over and revoke enabled" if admin_mode else "read-only"
        values = "" if self.user or self.superuser else "; KV values hidden (not a member of pgbroker_user)"
        return f"role {self.role} ({what}), {mode}{values}"


def _judge(row: dict[str, Any], *, admin: bool, allow_superuser: bool) -> RoleCheck:
    check = RoleCheck(**{k: row[k] for k in ("role", "superuser", "reader", "user", "admin", "schema_version")})
    if check.superuser and not allow_superuser:
        raise ConsoleRefused(
            f"refusing to run as {check.role}, a superuser: the console needs only pgbroker_reader "
            f"(GRANT pgbroker_reader TO a login role and connect as it), or pass --allow-superuser"
        )
    if not check.reader:
        raise ConsoleRefused(
            f"{check.role} is not a member of pgbroker_reader, which the console needs to read the views: "
            f"GRANT pgbroker_reader TO {check.role};"
        )
    if admin and not check.admin:
        raise ConsoleRefused(
            f"--admin needs a role with pgbroker_admin, and {check.role} is not a member: "
            f"GRANT pgbroker_admin TO {check.role}; or run without --admin (read-only)"
        )
    return check


def check_role(url: str, *, admin: bool = False, allow_superuser: bool = False) -> RoleCheck:
    """Connect once and judge the role: :class:`ConsoleRefused` unless the console may run with it."""
    try:
        with psycopg.connect(install.check_url(url), autocommit=True, connect_timeout=10) as conn:
            if not conn.execute(ROLES_EXIST_SQL).fetchone()[0]:
                raise ConsoleRefused(f"pgbroker is not installed in {install.describe(url)} (run: pgbroker migrate)")
            if conn.execute("SELECT to_regprocedure('pgbroker.schema_version()')").fetchone()[0] is None:
                raise ConsoleRefused(f"pgbroker is not installed in {install.describe(url)} (run: pgbroker migrate)")
            with conn.cursor(row_factory=dict_row) as cur:
                row = cur.execute(ROLE_SQL).fetchone()
    except psycopg.OperationalError as exc:
        raise install.connection_error(url, exc) from None
    assert row is not None
    return _judge(row, admin=admin, allow_superuser=allow_superuser)


# ---------------------------------------------------------------------------
# JSON


def _json_default(value: Any) -> Any:
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(
        value, ipaddress.IPv4Address | ipaddress.IPv6Address | ipaddress.IPv4Interface | ipaddress.IPv6Interface
    ):
        return str(value)
    if isinstance(value, bytes | memoryview):
        return bytes(value).hex()
    return str(value)


def _dumps(value: Any) -> str:
    return json.dumps(value, default=_json_default, separators=(",", ":"))


class _JSON(JSONResponse):
    def render(self, content: Any) -> bytes:
        return _dumps(content).encode()


def _limit(request: Request) -> int:
    try:
        value = int(request.query_params.get("limit", DEFAULT_PAGE))
    except ValueError:
        raise _BadRequest("limit must be an integer") from None
    return max(1, min(MAX_PAGE, value))


def _param(request: Request, name: str, default: str = "") -> str:
    value = request.query_params.get(name, default)
    if len(value) > 1000:
        raise _BadRequest(f"{name} is longer than 1000 characters")
    if "\x00" in value:
        raise _BadRequest(f"{name} contains a NUL character")
    return value


def _int_param(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise _BadRequest(f"{name} must be an integer, got {raw[:40]!r}") from None


class _BadRequest(Exception):
    pass


# ---------------------------------------------------------------------------
# Server-Sent Events


class _Hub:
    """Fans messages out to every open page; a page that lags is told to reload instead of being waited for."""

    def __init__(self) -> None:
        self.queues: set[asyncio.Queue[str | None]] = set()

    def close(self) -> None:
        """End every stream (the server is stopping): uvicorn waits for open responses before it stops."""
        for queue in list(self.queues):
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(None)

    def publish(self, message: dict[str, Any]) -> None:
        data = _dumps(message)
        for queue in list(self.queues):
            try:
                queue.put_nowait(data)
            except asyncio.QueueFull:
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(_dumps({"type": "reload", "why": "the page fell behind"}))

    @contextlib.contextmanager
    def subscribe(self) -> Any:
        queue: asyncio.Queue[str | None] = asyncio.Queue(maxsize=1000)
        self.queues.add(queue)
        try:
            yield queue
        finally:
            self.queues.discard(queue)


class Console:
    """The application's state: the pool, the LISTEN task, the samples and caches."""

    def __init__(self, url: str, check: RoleCheck, *, admin: bool, pool_size: int = 4) -> None:
        self.url = install.check_url(url)
        self.check = check
        self.admin = admin
        self.pool_size = pool_size
        self.csrf = secrets.token_urlsafe(32)
        self.hub = _Hub()
        self.pool: AsyncConnectionPool | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.db: dict[str, Any] = {"state": "connecting", "since": time.time(), "error": None}
        self.names: set[str] = set()  # lease names whose registry the LISTEN connection watches
        self.lag: deque[dict[str, Any]] = deque(maxlen=int(LAG_WINDOW_S / LAG_SAMPLE_S))
        self.counts: dict[str, Any] = {"at": None, "rows": {}}
        self.counts_dirty = asyncio.Event()
        self.registry_pending: dict[str, list[dict[str, Any]]] = {}
        self.registry_counts: dict[str, int] = {}
        self.health: dict[str, Any] = {"at": 0.0, "rows": None}
        self.health_lock = asyncio.Lock()
        self.lease_events = 0
        self.kv_byte_order: bool | None = None  # whether the keys sort in byte order (KV_BYTE_ORDER_SQL)

    # -- life cycle

    async def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("SET default_transaction_read_only = on")
        await conn.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}")

    async def start(self) -> None:
        self.pool = AsyncConnectionPool(
            self.url,
            min_size=1,
            max_size=self.pool_size,
            open=False,
            timeout=3.0,
            reconnect_timeout=0,  # a failed connect is given up at once; the next request tries again
            kwargs={
                "autocommit": True,
                "application_name": "pgbroker console",
                "connect_timeout": 3,
                "keepalives_idle": 5,
                "keepalives_interval": 1,
                "keepalives_count": 3,
            },
            configure=self._configure,
            check=AsyncConnectionPool.check_connection,
            name="pgbroker-console",
        )
        await self.pool.open(wait=False)
        for job in (self._listen, self._sample_lag, self._refresh_counts, self._flush_registry):
            self.tasks.append(asyncio.create_task(self._forever(job), name=f"pgbroker console {job.__name__}"))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.pool is not None:
            await self.pool.close(timeout=2.0)

    async def _forever(self, job: Callable[[], Any]) -> None:
        """Run a background job again after a failure (the database going away), never faster than BACKOFF."""
        attempt = 0
        while True:
            started = time.monotonic()
            try:
                await job()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the database restarting, failing over, refusing
                if job == self._listen:
                    self._set_db("reconnecting", exc)
                log.debug("%s failed: %s", job.__name__, exc)
            if time.monotonic() - started > 10:
                attempt = 0
            await asyncio.sleep(BACKOFF[min(attempt, len(BACKOFF) - 1)])
            attempt += 1

    def _set_db(self, state: str, error: BaseException | None = None) -> None:
        message = str(error).strip().splitlines()[0] if error is not None and str(error).strip() else None
        if state != self.db["state"]:
            self.db = {"state": state, "since": time.time(), "error": message}
            log.info("database %s%s", state, f": {message}" if message else "")
            self.hub.publish({"type": "db", **self.db})
        elif message != self.db["error"]:
            self.db["error"] = message

    async def rows(self, sql: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        assert self.pool is not None
        async with self.pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(sql, params)
            return await cur.fetchall()

    # -- the LISTEN connection

    async def _listen(self) -> None:
        conn = await psycopg.AsyncConnection.connect(
            self.url,
            autocommit=True,
            application_name="pgbroker console (listen)",
            connect_timeout=3,
            keepalives_idle=5,
            keepalives_interval=1,
            keepalives_count=3,
            tcp_user_timeout=5000,
        )
        try:
            await conn.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}")
            channel = (await (await conn.execute(LEASE_CHANNEL_SQL)).fetchone())[0]
            await conn.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel)))
            self.names = set()
            channels: dict[str, str] = {}
            await self._watch_names(conn, channels)
            self._set_db("connected")
            self.hub.publish({"type": "reload", "why": "connected to the database"})
            self.counts_dirty.set()
            last_ping = time.monotonic()
            while True:
                fresh: set[str] = set()
                # aclosing: leaving the loop early must give the connection back at once (notifies() holds it)
                async with contextlib.aclosing(conn.notifies(timeout=1.0)) as notes:
                    async for note in notes:
                        if note.channel == channel:
                            try:
                                event = json.loads(note.payload)
                            except ValueError:
                                continue  # a forged NOTIFY: LISTEN channels carry anyone's payloads
                            if not isinstance(event, dict) or not isinstance(event.get("name"), str):
                                continue
                            self.lease_events += 1
                            self.hub.publish({"type": "lease", "event": event, "received": time.time()})
                            self.counts_dirty.set()
                            if event["name"] not in self.names:
                                fresh.add(event["name"])
                                break
                        else:
                            name = channels.get(note.channel)
                            if name is None:
                                continue
                            try:
                                event = json.loads(note.payload)
                            except ValueError:
                                continue
                            self.registry_counts[name] = self.registry_counts.get(name, 0) + 1
                            pending = self.registry_pending.setdefault(name, [])
                            if len(pending) < 20:
                                pending.append(event)
                if fresh:  # a new lease name (read back from brokers: anyone may NOTIFY on the channel)
                    await self._watch_names(conn, channels)
                if time.monotonic() - last_ping > 5:
                    await conn.execute("SELECT 1")  # a connection the network lost fails here
                    last_ping = time.monotonic()
                    await self._watch_names(conn, channels)  # names claimed while we were away
        finally:
            with contextlib.suppress(Exception):
                await conn.close()

    async def _watch_names(
        self, conn: psycopg.AsyncConnection[Any], channels: dict[str, str], names: set[str] | None = None
    ) -> None:
        if names is None:
            names = {row[0] for row in await (await conn.execute(BROKER_NAMES_SQL)).fetchall()}
        for name in sorted(names - self.names):
            channel = (await (await conn.execute(REGISTRY_CHANNEL_SQL, (name,))).fetchone())[0]
            await conn.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel)))
            await conn.execute(WATCH_BEGIN_SQL, (name,))
            channels[channel] = name
            self.names.add(name)

    async def _flush_registry(self) -> None:
        """Registry changes go to the pages at most four times a second, per broker: a restarting broker
        registers its clients by the ten thousand."""
        while True:
            await asyncio.sleep(0.25)
            if not self.registry_counts:
                continue
            counts, self.registry_counts = self.registry_counts, {}
            pending, self.registry_pending = self.registry_pending, {}
            for name, count in counts.items():
                self.hub.publish({"type": "registry", "name": name, "changes": count, "events": pending.get(name, [])})
            self.counts_dirty.set()

    # -- samples and caches

    async def _sample_lag(self) -> None:
        while True:
            rows = await self.rows(LAG_SQL)
            sample = {
                "t": time.time(),
                "brokers": {r["name"]: {"pending": r["pending"], "lag_s": r["lag_s"]} for r in rows},
            }
            self.lag.append(sample)
            self.hub.publish({"type": "lag", "sample": sample})
            await asyncio.sleep(LAG_SAMPLE_S)

    async def _refresh_counts(self) -> None:
        """Clients, subscriptions, takeovers and the sweep backlog per broker (broker_overview): counting a
        million subscriptions takes a while, so they are read in the background, after a change, at most every
        COUNTS_MIN_S, and shown with their age."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.counts_dirty.wait(), COUNTS_MAX_S)
            self.counts_dirty.clear()
            started = time.monotonic()
            rows = await self.rows(COUNTS_SQL)
            self.counts = {
                "at": time.time(),
                "took_s": time.monotonic() - started,
                "rows": {r["name"]: r for r in rows},
            }
            self.hub.publish({"type": "counts", **self.counts})
            # At least COUNTS_MIN_S apart, and ten times as long as the count took: a count that reads a million
            # subscriptions keeps one backend busy for at most a tenth of the time.
            await asyncio.sleep(max(COUNTS_MIN_S, 10 * self.counts["took_s"]))

    async def health_rows(self) -> dict[str, Any]:
        async with self.health_lock:
            if self.health["rows"] is None or time.time() - self.health["at"] > HEALTH_TTL_S:
                rows = await self.rows(HEALTH_SQL)
                self.health = {"at": time.time(), "rows": rows}
        return self.health

    # -- admin actions: a connection of their own, closed at once (whatever it held goes with it)

    async def admin_connection(self) -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(
            self.url, autocommit=True, application_name="pgbroker console (admin)", connect_timeout=5
        )


# ---------------------------------------------------------------------------
# Routes


def _console(request: Request) -> Console:
    return request.app.state.console


def _page(rows: list[dict[str, Any]], limit: int, **extra: Any) -> dict[str, Any]:
    return {"rows": rows, "more": len(rows) == limit, **extra}


def _handler(func: Callable[[Request], Any]) -> Callable[[Request], Any]:
    """Turn errors into JSON: 400 for bad arguments, 403/4xx for SQL refusals, 503 while the database is away."""

    async def run(request: Request) -> Response:
        try:
            return _JSON(await func(request))
        except _BadRequest as exc:
            return _JSON({"error": "InvalidArgument", "message": str(exc)}, status_code=400)
        except (psycopg.OperationalError, psycopg.InterfaceError, OSError, asyncio.TimeoutError) as exc:
            return _JSON({"error": "DatabaseUnavailable", "message": _first_line(exc)}, status_code=503)
        except Exception as exc:
            from psycopg_pool import PoolTimeout

            if isinstance(exc, PoolTimeout):
                return _JSON({"error": "DatabaseUnavailable", "message": _first_line(exc)}, status_code=503)
            if isinstance(exc, psycopg.Error):
                error = translate(exc)
                status = 403 if exc.sqlstate == "42501" else 409 if (exc.sqlstate or "").startswith("55") else 400
                return _JSON(
                    {"error": type(error).__name__, "sqlstate": exc.sqlstate, "message": _first_line(error)},
                    status_code=status,
                )
            raise

    run.__name__ = func.__name__
    return run


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


async def index(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})


@_handler
async def info(request: Request) -> dict[str, Any]:
    c = _console(request)
    return {
        "database": install.describe(c.url),
        "role": c.check.role,
        "rights": asdict(c.check),
        "describe": c.check.describe(c.admin),
        "admin": c.admin,
        "values_visible": c.check.user or c.check.superuser,
        "csrf": c.csrf,
        "db": c.db,
        "version": install.SCHEMA_VERSION,
        "max_page": MAX_PAGE,
    }


@_handler
async def brokers(request: Request) -> dict[str, Any]:
    c = _console(request)
    limit = _limit(request)
    rows = await c.rows(BROKERS_SQL, {"after": _param(request, "after"), "limit": limit})
    return _page(rows, limit, counts=c.counts, lag=list(c.lag), db=c.db)


@_handler
async def history(request: Request) -> dict[str, Any]:
    c = _console(request)
    limit = _limit(request)
    params = {
        "name": _param(request, "name", "default"),
        "before": _int_param(request, "before", 2**63 - 1),
        "limit": limit,
    }
    return _page(await c.rows(HISTORY_SQL, params), limit)


@_handler
async def clients(request: Request) -> dict[str, Any]:
    c = _console(request)
    limit = _limit(request)
    name = _param(request, "name", "default")
    found = await c.rows(EPOCH_SQL, {"name": name})
    if not found:
        return _page([], limit, epoch=None)
    epoch = found[0]["epoch"]
    params = {
        "name": name,
        "epoch": epoch,
        "after": _param(request, "after"),
        "prefix": _param(request, "prefix"),
        "limit": limit,
    }
    return _page(await c.rows(CLIENTS_SQL, params), limit, epoch=epoch)


@_handler
async def subscriptions(request: Request) -> dict[str, Any]:
    c = _console(request)
    limit = _limit(request)
    params = {
        "name": _param(request, "name", "default"),
        "client": _param(request, "client"),
        "after_table": _param(request, "after_table"),
        "after_key": _param(request, "after_key"),
        "limit": limit,
    }
    return _page(await c.rows(CLIENT_SUBSCRIPTIONS_SQL, params), limit)


@_handler
async def locks(request: Request) -> dict[str, Any]:
    c = _console(request)
    limit = _limit(request)
    params = {"after": _param(request, "after"), "after_pid": _int_param(request, "after_pid", -1), "limit": limit}
    return _page(await c.rows(LOCKS_SQL, params), limit)


@_handler
async def semaphores(request: Request) -> dict[str, Any]:
    c = _console(request)
    limit = _limit(request)
    return _page(await c.rows(SEMAPHORES_SQL, {"after": _param(request, "after"), "limit": limit}), limit)


@_handler
async def unaccounted(request: Request) -> dict[str, Any]:
    c = _console(request)
    limit = _limit(request)
    return _page(await c.rows(UNACCOUNTED_SQL, {"limit": limit}), limit)


@_handler
async def kv(request: Request) -> dict[str, Any]:
    c = _console(request)
    limit = _limit(request)
    params = {"after": _param(request, "after"), "prefix": _param(request, "prefix"), "limit": limit}
    return _page(await c.rows(KV_SQL, params), limit, values_visible=c.check.user or c.check.superuser)


def _upper(prefix: str) -> str:
    """The least string, in byte order, greater than every string that begins with PREFIX (U+10FFFF... for '')."""
    for i in range(len(prefix) - 1, -1, -1):
        code = ord(prefix[i]) + 1
        if code == 0xD800:
            code = 0xE000  # surrogates are no characters
        if code <= 0x10FFFF:
            return prefix[:i] + chr(code)
    return "\U0010ffff" * 8


@_handler
async def kv_tree(request: Request) -> dict[str, Any]:
    """One level of the key-value store under PREFIX (which ends with / or is empty): its folders and keys."""
    c = _console(request)
    limit = _limit(request)
    prefix = _param(request, "prefix")
    if prefix and not prefix.endswith("/"):
        raise _BadRequest("prefix must end with / (a folder), or be empty")
    if c.kv_byte_order is None:
        c.kv_byte_order = bool((await c.rows(KV_BYTE_ORDER_SQL))[0]["byte_order"])
    if not c.kv_byte_order:
        return {"supported": False, "rows": [], "more": False}
    after = _param(request, "after") or prefix
    if not after.startswith(prefix):
        raise _BadRequest("after must begin with prefix")
    # past the child AFTER: past every key of a folder, else the next key
    first = after[:-1] + "0" if after != prefix and after.endswith("/") else after + "\x01"
    params = {"prefix": prefix, "n": len(prefix), "first": first, "upper": _upper(prefix), "limit": limit}
    children = [r["child"] for r in await c.rows(KV_TREE_SQL, params)]
    leaves = [child for child in children if not child.endswith("/")]
    entries = {r["key"]: r for r in await c.rows(KV_ENTRIES_SQL, {"keys": leaves})} if leaves else {}
    rows = []
    for child in children:
        entry = entries.get(child, {})
        rows.append({"child": child, "folder": child.endswith("/"), **{k: v for k, v in entry.items() if k != "key"}})
    return _page(rows, limit, supported=True, values_visible=c.check.user or c.check.superuser)


@_handler
async def counters(request: Request) -> dict[str, Any]:
    c = _console(request)
    limit = _limit(request)
    return _page(await c.rows(COUNTERS_SQL, {"after": _param(request, "after"), "limit": limit}), limit)


@_handler
async def rate_limits(request: Request) -> dict[str, Any]:
    c = _console(request)
    limit = _limit(request)
    return _page(await c.rows(RATE_LIMITS_SQL, {"after": _param(request, "after"), "limit": limit}), limit)


@_handler
async def grants(request: Request) -> dict[str, Any]:
    c = _console(request)
    limit = _limit(request)
    params = {
        "after_kind": _param(request, "after_kind"),
        "after_prefix": _param(request, "after_prefix"),
        "after_role": _param(request, "after_role"),
        "limit": limit,
    }
    return _page(await c.rows(GRANTS_SQL, params), limit)


@_handler
async def health(request: Request) -> dict[str, Any]:
    c = _console(request)
    found = await c.health_rows()
    check = install.compare_schema(c.check.schema_version)
    schema = {
        "check": "schema",
        "subject": "",
        "ok": check.state == "same",
        "detail": check.message,
        "fix": None if check.fix is None else f"run: {check.fix}",
    }
    return {
        "rows": [schema, *found["rows"]],
        "at": found["at"],
        "note": "pgbroker doctor also checks keepalives, poolers and grants from a client's side",
    }


async def _admin_request(request: Request) -> tuple[Console, dict[str, Any]]:
    c = _console(request)
    if not c.admin:
        raise _Refused(403, "the console is read-only: write actions need pgbroker console --admin")
    if not secrets.compare_digest(request.headers.get("x-csrf-token", ""), c.csrf):
        raise _Refused(403, "missing or wrong CSRF token: reload the page")
    origin = request.headers.get("origin")
    if origin is not None and origin.split("://", 1)[-1] != request.headers.get("host"):
        raise _Refused(403, f"cross-origin request from {origin[:100]} refused")
    try:
        body = await request.json()
    except ValueError:
        raise _Refused(400, "the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise _Refused(400, "the body must be a JSON object")
    return c, body


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _who(request: Request, c: Console) -> str:
    client = request.client
    return f"{c.check.role} via the console from {client.host if client else 'unknown'}"


async def _admin_action(
    request: Request,
    parse: Callable[[dict[str, Any]], dict[str, Any]],
    act: Callable[[Console, str, dict[str, Any]], Awaitable[dict[str, Any]]],
) -> Response:
    """An admin action: the request checked (_admin_request), its body parsed (PARSE raises _Refused), then ACT
    done by the console's admin connection as WHO, its errors answered as every handler's are."""
    try:
        c, body = await _admin_request(request)
        args = parse(body)
    except _Refused as exc:
        return _JSON({"error": "Refused", "message": str(exc)}, status_code=exc.status)

    @_handler
    async def run(_: Request) -> dict[str, Any]:
        return await act(c, _who(request, c), args)

    return await run(request)


def _takeover_args(body: dict[str, Any]) -> dict[str, Any]:
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise _Refused(400, "name: the lease to hand over")
    if body.get("confirm") != name:
        raise _Refused(400, f"type the lease name {name!r} to confirm the hand-over")
    return {"name": name}


async def _takeover(c: Console, who: str, args: dict[str, Any]) -> dict[str, Any]:
    name = args["name"]
    async with await c.admin_connection() as conn:
        epoch = (await (await conn.execute(TAKEOVER_SQL, {"name": name, "info": f"hand-over by {who}"})).fetchone())[0]
        released = (await (await conn.execute(RELEASE_SQL, {"name": name})).fetchone())[0]
    log.warning(
        "AUDIT hand-over of lease %r by %s: claimed epoch %s with takeover, released: %s", name, who, epoch, released
    )
    return {"name": name, "epoch": epoch, "released": released}


async def takeover(request: Request) -> Response:
    """Hand a lease over: terminate its holder (recorded as a takeover in lease_history), then release, so that a
    waiting standby claims with the next epoch."""
    return await _admin_action(request, _takeover_args, _takeover)


def _revoke_args(body: dict[str, Any]) -> dict[str, Any]:
    kind, prefix, role = body.get("kind"), body.get("prefix"), body.get("role")
    if not all(isinstance(v, str) for v in (kind, prefix, role)) or not kind or not role:
        raise _Refused(400, "kind, prefix and role: the grant to revoke")
    expected = f"{kind}:{prefix}:{role}"
    if body.get("confirm") != expected:
        raise _Refused(400, f"type {expected!r} to confirm the revoke")
    return {"kind": kind, "prefix": prefix, "role": role}


async def _revoke(c: Console, who: str, args: dict[str, Any]) -> dict[str, Any]:
    async with await c.admin_connection() as conn:
        revoked = (await (await conn.execute(REVOKE_SQL, args)).fetchone())[0]
    log.warning("AUDIT name_revoke(%r, %r, %r) by %s: %s", args["kind"], args["prefix"], args["role"], who, revoked)
    return {"revoked": revoked}


async def revoke(request: Request) -> Response:
    """Take back a name grant (name_revoke)."""
    return await _admin_action(request, _revoke_args, _revoke)


async def events(request: Request) -> Response:
    c = _console(request)

    async def stream() -> AsyncIterator[str]:
        with c.hub.subscribe() as queue:
            yield "retry: 1000\n\n"
            yield f"data: {_dumps({'type': 'hello', 'db': c.db})}\n\n"
            while True:
                try:
                    data = await asyncio.wait_for(queue.get(), 15.0)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                if data is None:
                    return
                yield f"data: {data}\n\n"

    return StreamingResponse(
        stream(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


class _SecurityHeaders:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [(k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def create_app(
    url: str,
    check: RoleCheck,
    *,
    admin: bool = False,
    allowed_hosts: list[str] | None = None,
    pool_size: int = 4,
) -> Starlette:
    """The console as an ASGI application (``check``: from :func:`check_role`)."""
    console = Console(url, check, admin=admin, pool_size=pool_size)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await console.start()
        try:
            yield
        finally:
            await console.stop()

    api = [
        Route("/api/info", info),
        Route("/api/brokers", brokers),
        Route("/api/history", history),
        Route("/api/clients", clients),
        Route("/api/subscriptions", subscriptions),
        Route("/api/locks", locks),
        Route("/api/semaphores", semaphores),
        Route("/api/unaccounted", unaccounted),
        Route("/api/kv", kv),
        Route("/api/kv/tree", kv_tree),
        Route("/api/counters", counters),
        Route("/api/rate_limits", rate_limits),
        Route("/api/grants", grants),
        Route("/api/health", health),
        Route("/api/admin/takeover", takeover, methods=["POST"]),
        Route("/api/admin/revoke", revoke, methods=["POST"]),
        Route("/events", events),
    ]
    app = Starlette(
        routes=[Route("/", index), *api, Mount("/static", StaticFiles(directory=STATIC), name="static")],
        middleware=[
            Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts or ["127.0.0.1", "localhost"]),
            Middleware(_SecurityHeaders),
        ],
        lifespan=lifespan,
    )
    app.state.console = console
    return app


def serve(
    url: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8710,
    admin: bool = False,
    allow_superuser: bool = False,
    announce: Callable[[str], None] = print,
) -> None:
    """Check the role, then serve the console until interrupted."""
    import uvicorn

    check = check_role(url, admin=admin, allow_superuser=allow_superuser)
    hosts = sorted({host, "127.0.0.1", "localhost"} if host in ("127.0.0.1", "localhost", "::1") else {host})
    if host in ("0.0.0.0", "::"):
        hosts = ["*"]
    app = create_app(url, check, admin=admin, allowed_hosts=hosts)
    shown = f"[{host}]" if ":" in host else host
    announce(f"pgbroker console: {install.describe(url)} as {check.describe(admin)}")
    announce(f"pgbroker console: http://{shown}:{port}/  (Ctrl-C stops it)")
    if host not in ("127.0.0.1", "localhost", "::1"):
        announce(
            f"pgbroker console: warning: listening on {host}: the console has no login of its own; anyone who "
            "reaches this address sees what the role sees (put it behind an authenticating proxy)"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)  # an outage is said once, as "database reconnecting"
    hub = app.state.console.hub

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().call_soon_threadsafe(hub.close)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2, access_log=False
    )
    Server(config).run()
