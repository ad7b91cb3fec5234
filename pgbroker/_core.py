"""What :class:`~pgbroker.broker.Broker` and :class:`~pgbroker.broker.AsyncBroker` share, with no I/O of its own.

Every statement the Python layer runs (``*_SQL``), the parameters it binds,
the settings and their checks, the lease's state and :meth:`_BrokerBase.check`.
The flavours are in :mod:`pgbroker._broker_async` (the source) and
:mod:`pgbroker._broker_sync` (generated from it by :mod:`pgbroker._gen_sync`).
"""

from __future__ import annotations

import abc
import contextlib
import logging
import math
import os
import selectors
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn

import psycopg
import psycopg.sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from pgbroker.errors import (
    LeaseInDoubt,
    LeaseLost,
    PgBrokerError,
    PoolerNotSupported,
    is_session_lost,
    schema_mismatch,
    translate,
)
from pgbroker.install import SCHEMA_VERSION, compare_schema, libpq_url, version_key

log = logging.getLogger("pgbroker.broker")

# Every statement the Python layer runs.  Always schema-qualified, always with
# bound parameters.  The broker session turns statement_timeout off: the
# claim's ``wait`` is its only time limit (wait => NULL must mean forever),
# and runs its calls at READ COMMITTED whatever the database's default
# (client_unregister refuses the other levels, PB011).
SESSION_SQL = """\
SELECT pg_catalog.set_config('tcp_keepalives_idle', %(idle)s, false),
       pg_catalog.set_config('tcp_keepalives_interval', %(interval)s, false),
       pg_catalog.set_config('tcp_keepalives_count', %(count)s, false),
       pg_catalog.set_config('tcp_user_timeout', %(user_timeout)s, false),
       pg_catalog.set_config('statement_timeout', '0', false),
       pg_catalog.set_config('default_transaction_isolation', 'read committed', false)"""
# The registry connections commit without waiting for the WAL flush: a
# server crash (or a failover) that loses their last commits also ends the
# epoch they belong to (the lease session dies with the server), and a new
# epoch starts with an empty registry anyway.  Visibility to other sessions is
# at commit, as ever.  It halves a new client's attach + subscribe.
REGISTRY_SESSION_SQL = "SELECT pg_catalog.set_config('synchronous_commit', 'off', false)"
# The start-up check: which schema version is installed (errors.schema_error
# says what it means when the function is missing).
SCHEMA_VERSION_SQL = "SELECT pgbroker.schema_version()"
DEAD_MAN_SQL = "SELECT pg_catalog.set_config('idle_session_timeout', %(ms)s, false)"
CLAIM_SQL = (
    "SELECT pgbroker.broker_claim(name => %(name)s, wait => %(wait)s, takeover => %(takeover)s,"
    " stale_after => %(stale_after)s, info => %(info)s, owner => %(owner)s)"
)
HEARTBEAT_SQL = "SELECT pgbroker.broker_heartbeat(name => %(name)s)"
RELEASE_SQL = "SELECT pgbroker.broker_release(name => %(name)s, owner => %(owner)s)"
ASSERT_SQL = "SELECT pgbroker.broker_assert(name => %(name)s, epoch => %(epoch)s)"
STATE_SET_SQL = "SELECT pgbroker.broker_state_set(name => %(name)s, key => %(key)s, value => %(value)s)"
STATE_DELETE_SQL = "SELECT pgbroker.broker_state_delete(name => %(name)s, key => %(key)s)"
STATUS_SQL = "SELECT * FROM pgbroker.brokers WHERE name = %(name)s"
# The registry calls all pass ``epoch``: NULL on the broker's own session (it
# holds the lease), the held epoch on the registry connections (checked as
# broker_assert() checks it: PB002 once the epoch is over).
REGISTER_SQL = (
    "SELECT pgbroker.client_register(client_id => %(client_id)s, info => %(info)s, name => %(name)s,"
    " epoch => %(epoch)s)"
)
# The set-based calls take their arrays in the cheapest forms to send: the
# ids as a binary text[], the infos and keys as one JSON document each, made
# into a jsonb[] by the server (a list of Jsonb costs a json.dumps per item:
# 8x the time for 10,000 keys).
REGISTER_MANY_SQL = (
    "SELECT pgbroker.client_register_many(client_ids => %(client_ids)b::text[],"
    " infos => ARRAY(SELECT e FROM pg_catalog.jsonb_array_elements(%(infos)s::jsonb) WITH ORDINALITY AS t(e, i)"
    " ORDER BY i), name => %(name)s, epoch => %(epoch)s)"
)
CLIENT_UPDATE_SQL = (
    "SELECT pgbroker.client_update(client_id => %(client_id)s, info => %(info)s, name => %(name)s, epoch => %(epoch)s)"
)
UNREGISTER_SQL = "SELECT pgbroker.client_unregister(client_id => %(client_id)s, name => %(name)s, epoch => %(epoch)s)"
UNREGISTER_MANY_SQL = (
    "SELECT pgbroker.client_unregister_many(client_ids => %(client_ids)b::text[], name => %(name)s, epoch => %(epoch)s)"
)
SUBSCRIBE_SQL = (
    'SELECT pgbroker.subscribe(client_id => %(client_id)s, "table" => %(table)s::regclass, key => %(key)s,'
    " name => %(name)s, epoch => %(epoch)s, wait => %(wait)s)"
)
SUBSCRIBE_MANY_SQL = (
    'SELECT pgbroker.subscribe_many(client_ids => %(client_ids)b::text[], "table" => %(table)s::regclass,'
    " keys => ARRAY(SELECT e FROM pg_catalog.jsonb_array_elements(%(keys)s::jsonb) WITH ORDINALITY AS t(e, i)"
    " ORDER BY i), name => %(name)s, epoch => %(epoch)s, wait => %(wait)s)"
)
# By filter (schema 0.1.0+4 and later; the key forms above work on every supported schema).
SUBSCRIBE_FILTER_SQL = (
    'SELECT pgbroker.subscribe(client_id => %(client_id)s, "table" => %(table)s::regclass, filter => %(filter)s,'
    " name => %(name)s, epoch => %(epoch)s, wait => %(wait)s)"
)
SUBSCRIBE_FILTERS_SQL = (
    'SELECT pgbroker.subscribe_filters(client_ids => %(client_ids)b::text[], "table" => %(table)s::regclass,'
    " filters => ARRAY(SELECT e FROM pg_catalog.jsonb_array_elements(%(filters)s::jsonb) WITH ORDINALITY AS t(e, i)"
    " ORDER BY i), name => %(name)s, epoch => %(epoch)s, wait => %(wait)s)"
)
UNSUBSCRIBE_FILTER_SQL = (
    'SELECT pgbroker.unsubscribe(client_id => %(client_id)s, "table" => %(table)s::regclass, filter => %(filter)s,'
    " name => %(name)s, epoch => %(epoch)s)"
)
SWEEP_SQL = "SELECT pgbroker.broker_sweep(name => %(name)s, max_rows => %(max_rows)s)"
MAINTAIN_SQL = "SELECT part, removed, remaining FROM pgbroker.maintain(max_rows => %(max_rows)s)"
UNSUBSCRIBE_SQL = (
    'SELECT pgbroker.unsubscribe(client_id => %(client_id)s, "table" => %(table)s::regclass, key => %(key)s,'
    " name => %(name)s, epoch => %(epoch)s)"
)
FETCH_SQL = (
    'SELECT id, "table", op, key, changed, clients, at FROM pgbroker.outbox_fetch(%(name)s, %(max_rows)s, %(ack)s)'
)
# With "left" (schema 0.1.0+4, filters): a broker that claimed on such a schema.  Each form names its columns, so
# a prepared statement keeps its result type when an upgrade replaces outbox_fetch under a running broker (one
# that claimed on an older schema keeps FETCH_SQL, and its Notification.left stays empty, until it claims again).
FETCH_LEFT_SQL = (
    'SELECT id, "table", op, key, changed, clients, at, "left"'
    " FROM pgbroker.outbox_fetch(%(name)s, %(max_rows)s, %(ack)s)"
)
LEFT_SCHEMA = version_key("0.1.0+4")
ACK_SQL = "SELECT pgbroker.outbox_ack(%(name)s, %(ids)s)"
# A fetch or an ack is one statement in autocommit: a deadlock (40P01) or a
# serialization failure (40001) rolled all of it back, acknowledgements
# included, so it runs again, this many times more, after a random pause of up
# to 10 ms times the attempt.  A conflict is another session holding outbox
# rows while it waits on ones the broker holds (an operator's transaction that
# locks or deletes outbox rows): rare, and over once one side gives way.
CONFLICT_SQLSTATES = frozenset({"40P01", "40001"})
CONFLICT_RETRIES = 3
# undefined_function: a pgbroker function this package calls is missing, or has another signature, in the
# installed schema (its version is then not this package's: SchemaMismatch), or the caller's types are wrong.
UNDEFINED_FUNCTION = "42883"
WAKE_SQL = "SELECT pgbroker.broker_wake(%(name)s)"
SLEEP_SQL = "SELECT pgbroker.broker_sleep(%(name)s)"
CHANNEL_SQL = "SELECT pgbroker.wakeup_channel(%(name)s)"
BROKERS_SQL = "SELECT * FROM pgbroker.brokers ORDER BY name"
HISTORY_SQL = """\
SELECT * FROM pgbroker.lease_history
 WHERE (%(name)s::text IS NULL OR name = %(name)s::text) AND id > %(after_id)s
 ORDER BY id"""

# A table's name and primary-key columns in key order (what pgbroker.watch()
# takes as the key: sql/300_watched_tables.sql), for reading its rows by key
# (rows_query); %(table)s is the "table" text of an outbox row (qualified).
# From the catalog, which every role may read (the view watched_tables needs
# pgbroker_reader).
TABLE_KEY_SQL = """\
SELECT n.nspname, c.relname, array_agg(a.attname::text ORDER BY k.ord)
  FROM pg_catalog.pg_class c
  JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
  JOIN pg_catalog.pg_index i ON i.indrelid = c.oid AND i.indisprimary
 CROSS JOIN LATERAL pg_catalog.unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
  JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.attnum
 WHERE c.oid = %(table)s::regclass
 GROUP BY n.nspname, c.relname"""


# A range's operators in a filter, and their SQL.
RANGE_OPERATORS = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<="}


def filter_rows_query(
    schema: str, table: str, key_columns: list[str], flt: dict[str, Any]
) -> tuple[psycopg.sql.Composed, dict[str, Any]]:
    """One statement that reads the rows of ``schema.table`` matching filter ``flt`` (as ``subscribe``'s), in key
    order, as ``jsonb``; and its parameters.

    Each column's values are cast to its type by ``jsonb_populate_record`` on the table's own row type (``"7"`` is 7
    of an integer column, as in the filter's subscription); a JSON null matches NULL, and no range.  Column names
    are only ever quoted identifiers; an unknown one is the server's 42703.
    """
    from pgbroker.errors import InvalidArgument

    if not isinstance(flt, dict) or not flt:
        raise InvalidArgument("a filter must be a non-empty JSON object of column names and values")
    tbl = psycopg.sql.Identifier(schema, table)
    conds, params = [], {}
    for n, (column, condition) in enumerate(sorted(flt.items())):
        col = psycopg.sql.Identifier(column)
        if isinstance(condition, dict) and condition and set(condition) <= set(RANGE_OPERATORS):
            # A range: each bound cast as the values are; NULL is in no range.
            for op, bound in sorted(condition.items()):
                conds.append(
                    psycopg.sql.SQL(
                        "t.{col} {op} (pg_catalog.jsonb_populate_record(NULL::{tbl},"
                        " pg_catalog.jsonb_build_object({name}, {param}::jsonb))).{col}"
                    ).format(
                        col=col,
                        op=psycopg.sql.SQL(RANGE_OPERATORS[op]),
                        tbl=tbl,
                        name=psycopg.sql.Literal(column),
                        param=psycopg.sql.Placeholder(f"v{n}{op}"),
                    )
                )
                params[f"v{n}{op}"] = Jsonb(bound)
            continue
        if isinstance(condition, dict):
            if list(condition) == ["in"] and isinstance(condition["in"], list) and condition["in"]:
                values = condition["in"]
            elif list(condition) == ["eq"]:
                values = [condition["eq"]]
            else:
                raise InvalidArgument(
                    f"column {column}: a condition is a value, {{'eq': value}}, {{'in': [...]}} or a range"
                    " ({'gte': 10, 'lt': 20})"
                )
        elif isinstance(condition, list):
            raise InvalidArgument(
                f"column {column}: several values are {{'in': [...]}}, an array value {{'eq': [...]}}"
            )
        else:
            values = [condition]
        cond = psycopg.sql.SQL(
            "t.{col} = ANY (ARRAY(SELECT (pg_catalog.jsonb_populate_record(NULL::{tbl},"
            " pg_catalog.jsonb_build_object({name}, v.v))).{col} FROM pg_catalog.jsonb_array_elements({param}::jsonb)"
            " AS v(v)))"
        ).format(col=col, tbl=tbl, name=psycopg.sql.Literal(column), param=psycopg.sql.Placeholder(f"v{n}"))
        if any(v is None for v in values):
            cond = psycopg.sql.SQL("({} OR t.{} IS NULL)").format(cond, col)
        conds.append(cond)
        params[f"v{n}"] = Jsonb([v for v in values if v is not None])
    query = psycopg.sql.SQL("SELECT pg_catalog.to_jsonb(t) FROM {tbl} AS t WHERE {conds} ORDER BY {keys}").format(
        tbl=tbl,
        conds=psycopg.sql.SQL(" AND ").join(conds),
        keys=psycopg.sql.SQL(", ").join(psycopg.sql.SQL("t.{}").format(psycopg.sql.Identifier(c)) for c in key_columns),
    )
    return query, params


def rows_query(tables: list[tuple[str, str, list[str]]]) -> psycopg.sql.Composed:
    """One statement that reads, for each ``(schema, table, key_columns)``, the rows whose keys are in its parameter.

    Parameter ``k<g>`` of part ``g`` is a JSON array of keys as the outbox
    encodes them (a scalar, or an array in key order); each key is cast to
    the columns' types by ``jsonb_populate_record`` on the table's own row
    type, so the join is an index probe per key.  Returns ``(g, i, row)``:
    ``i`` the key's position (from 1), ``row`` the row as ``jsonb`` or NULL
    when no row has that key.
    """
    parts = []
    for g, (schema, table, columns) in enumerate(tables):
        ident = psycopg.sql.Identifier(schema, table)
        if len(columns) == 1:
            fields = [psycopg.sql.SQL("{}, k.key").format(psycopg.sql.Literal(columns[0]))]
        else:
            fields = [
                psycopg.sql.SQL("{}, k.key -> {}").format(psycopg.sql.Literal(c), psycopg.sql.Literal(i))
                for i, c in enumerate(columns)
            ]
        join = psycopg.sql.SQL(" AND ").join(
            psycopg.sql.SQL("t.{c} = r.{c}").format(c=psycopg.sql.Identifier(c)) for c in columns
        )
        parts.append(
            psycopg.sql.SQL(
                "SELECT {g}::integer, k.i, pg_catalog.to_jsonb(t)"
                " FROM pg_catalog.jsonb_array_elements({param}::jsonb) WITH ORDINALITY AS k(key, i)"
                " CROSS JOIN LATERAL pg_catalog.jsonb_populate_record(NULL::{tbl},"
                " pg_catalog.jsonb_build_object({fields})) AS r"
                " LEFT JOIN {tbl} AS t ON {join}"
            ).format(
                g=psycopg.sql.Literal(g),
                param=psycopg.sql.Placeholder(f"k{g}"),
                tbl=ident,
                fields=psycopg.sql.SQL(", ").join(fields),
                join=join,
            )
        )
    return psycopg.sql.SQL(" UNION ALL ").join(parts)


# Pause between two heartbeats triggered by unsolicited data on the socket
# (NOTICEs, NOTIFYs), so that a stream of them cannot turn into a busy loop.
_MIN_WAKE_GAP = 0.05

# The sweeper (see _BrokerBase, sweep=): rows per broker_sweep() call.
SWEEP_BATCH = 5000
# ... then the upkeep (pgbroker.maintain), while the lease is held: again after a pause as long as the call
# took while a part of a call removed a full batch of SWEEP_BATCH; after MAINTAIN_SOON seconds while a part left
# rows that only a later call can remove (names it marked idle, deleted once no older snapshot is left, or a
# part skipped because a row it needed was busy); otherwise after MAINTAIN_EVERY seconds.
MAINTAIN_EVERY = 60.0
MAINTAIN_SOON = 5.0


def maintain_pause(rows: Iterable[tuple[str, int, int | None]], took: float) -> float:
    """Seconds until the next upkeep call, after one that took TOOK seconds and returned ROWS."""
    rows = list(rows)
    if any(removed >= SWEEP_BATCH for _part, removed, _remaining in rows):
        return took
    if any(remaining is None or remaining > 0 for _part, _removed, remaining in rows):
        return MAINTAIN_SOON
    return MAINTAIN_EVERY


def batches(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """``items`` in lists of at most ``size``."""
    if size < 1:
        raise ValueError(f"batch_size must be at least 1, not {size!r}")
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def grouped(pairs: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``(client_id, key or filter)`` pairs with each key's (or filter's) pairs together, and the keys that share a
    client together, each set where its first pair came.

    The interest (sql/400_subscriptions.sql) holds one row per key (per point
    of a filter) with the ids of all its clients: a batch writes each row it
    touches once, however many of the batch's clients it gains.  Ten clients
    of a filter spread over ten batches rewrite its row ten times; together,
    once.  And a batch locks each of its clients' rows once (``FOR KEY
    SHARE``, against an unregister): a client whose keys are spread over ten
    batches is locked ten times.  So the keys are grouped by the clients they
    share (the connected parts of the graph of clients and keys: a team's
    members and the team's filters), and each key's pairs within its part.
    Where every key shares a client with another, this is one part, in the
    order of each key's first pair.  bench_filters (100,000 filters, ten
    clients on each of 10,000 values, given client after client; the graph
    falls into 1,000 parts of ten clients and ten values) took 0.66x the
    backend CPU grouped by key than in the order given, and 0.63-0.73x that
    again grouped by part (three runs).  The parts cost Python about 15% more
    than the keys alone (0.13 s per million pairs here).  Keys compare as
    Python sees them (``repr``): equal values written differently (``1``,
    ``1.0``) are only grouped less well.
    """
    index: dict[str, int] = {}  # a key's group
    groups: list[list[tuple[str, Any]]] = []
    parent: list[int] = []  # union-find over the groups: a part's root is its first group
    first: dict[str, int] = {}  # a client's first group

    def root(g: int) -> int:
        while parent[g] != g:
            parent[g] = g = parent[parent[g]]
        return g

    for pair in pairs:
        key = repr(pair[1])
        g = index.get(key)
        if g is None:
            g = index[key] = len(groups)
            groups.append([pair])
            parent.append(g)
        else:
            groups[g].append(pair)
        try:
            f = first.setdefault(pair[0], g)
        except TypeError:  # not a client id (a list, a dict): the statement refuses it, as without grouping
            continue
        if f != g and parent[f] != parent[g]:  # (one parent: one part, the common case, tested cheaply)
            a, b = root(f), root(g)
            if a > b:
                a, b = b, a
            parent[b] = parent[f] = parent[g] = a
    parts: dict[int, list[list[tuple[str, Any]]]] = {}
    for g, group in enumerate(groups):
        parts.setdefault(root(g), []).append(group)
    return [pair for part in parts.values() for group in part for pair in group]


def register_params(name: str, batch: list[Any]) -> dict[str, Any]:
    """Parameters of REGISTER_MANY_SQL for a batch of client ids or ``(client_id, info)`` pairs (info None: ``{}``)."""
    ids: list[Any] = []
    infos: list[Any] = []
    for item in batch:
        client_id, info = (item, None) if isinstance(item, str) or not isinstance(item, tuple | list) else item
        ids.append(client_id)
        infos.append({} if info is None else info)
    return {"client_ids": ids, "infos": Jsonb(infos), "name": name}


def subscribe_filters_params(
    name: str, table: str, batch: list[tuple[str, Any]], wait: timedelta | None
) -> dict[str, Any]:
    """Parameters of SUBSCRIBE_FILTERS_SQL for a batch of ``(client_id, filter)`` pairs."""
    return {
        "client_ids": [client_id for client_id, _ in batch],
        "table": table,
        "filters": Jsonb([flt for _, flt in batch]),
        "name": name,
        "wait": wait,
    }


def subscribe_params(name: str, table: str, batch: list[tuple[str, Any]], wait: timedelta | None) -> dict[str, Any]:
    """Parameters of SUBSCRIBE_MANY_SQL for a batch of ``(client_id, key)`` pairs (key None: the whole table)."""
    ids: list[Any] = []
    keys: list[Any] = []
    for client_id, key in batch:
        ids.append(client_id)
        keys.append(key)
    return {"client_ids": ids, "table": table, "keys": Jsonb(keys), "name": name, "wait": wait}


BACKEND_PID_SQL = "SELECT pg_catalog.pg_backend_pid()"


def pooler_verdict(login_pid: int, pids: list[int]) -> tuple[str, str] | None:
    """Why session scope is unsafe on a connection given ``login_pid`` at login whose statements ran on ``pids``.

    ``pids``: ``pg_backend_pid()`` read in two separate transactions (one when
    the caller's transaction was open).  A direct connection runs on the
    backend whose pid it was given at login.  Through a pooler the login pid
    is the pooler's own number: a different backend between two transactions
    proves transaction pooling; the same one proves nothing (a pooler in
    transaction mode reuses an idle server connection), so any pooler is
    refused unless the caller says it keeps sessions (``session_pooler=True``).
    Returns None (safe), ``("transaction", why)`` or ``("pooler", why)``.
    """
    if len(set(pids)) > 1:
        return "transaction", (
            f"the connection ran two transactions on two server backends (pids {pids[0]} and {pids[1]}): "
            "it goes through a pooler in transaction mode"
        )
    if pids[0] != login_pid:
        return "pooler", (
            f"the connection runs on server backend {pids[0]}, not on the pid {login_pid} it was given at login: "
            "it goes through a pooler, which may move it to another backend between transactions"
        )
    return None


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
    (updates only); ``clients`` the client ids to tell (never empty; it may
    name a client unregistered a moment ago: skip ids you no longer know).
    ``at`` (a timezone-aware datetime) is when the *writer's statement*
    started (``statement_timestamp()`` in the writing session), not its
    commit: changes of one transaction share their statement's ``at``, and
    ``at`` of later rows can be earlier than that of earlier ones.  ``id``
    grows; for any one row in commit order.

    ``left``: those of ``clients`` that the row *left*: subscribed by a
    filter that matched the row before this update and with no subscription
    (key, whole table or filter) that matches it after; drop the row from
    what they show.  Empty for inserts, deletes and truncates (the op says
    it), and for every change of a table nobody filters (sql/README.md,
    "Filters").

    The row's values are not carried: read the row, or ask
    ``notifications(rows=True)`` for ``row``: the row as it is now (a dict of
    its columns, as ``to_jsonb`` gives them), read by key after the fetch,
    or None when no row has that key any more (deleted; always None for a
    truncate, and without ``rows=True``).
    """

    id: int
    table: str
    op: str
    key: Any
    changed: list[str] | None
    clients: list[str]
    at: Any
    row: Any = None
    left: list[str] = field(default_factory=list)

    @classmethod
    def from_row(cls, row: Any) -> Notification:
        """A row of ``outbox_fetch`` (id, table, op, key, changed, clients, at[, left])."""
        return cls(*row[:7], left=list(row[7] or ()) if len(row) > 7 else [])


@dataclass(frozen=True)
class Registration:
    """One registration of a client, made by ``attach()``.

    ``token`` names this registration: ``unregister(client_id, token=token)``
    removes the client only while this is still its latest registration, so
    the late clean-up of an old connection cannot undo a newer one.
    """

    client_id: str
    token: str


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


def _clamped_wait(wait: float | timedelta | None, left: float) -> timedelta:
    """A registry call's ``wait`` (seconds, a timedelta or None: as long as allowed), never more than ``left``."""
    asked = _interval(wait, "wait")
    limit = timedelta(seconds=max(0.0, left))
    return limit if asked is None or asked > limit else asked


def _raise_translated(exc: psycopg.Error, new: Exception | None = None) -> NoReturn:
    """Raise ``new``, by default the pgbroker exception for ``exc``, chained to ``exc`` (or ``exc`` itself)."""
    new = translate(exc) if new is None else new
    if new is exc:
        raise exc
    raise new from exc


def _default_info() -> str:
    return f"{socket.gethostname()} pid {os.getpid()}"


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
    """What :class:`Broker` and :class:`AsyncBroker` share: settings, state, :meth:`check` (no I/O)."""

    def __init__(
        self,
        url: str,
        name: str = "default",
        *,
        wait: float | timedelta | None = 0,
        takeover: bool = False,
        stale_after: float | timedelta | None = None,
        info: str | None = None,
        owner: str | None = None,
        session_pooler: bool = False,
        heartbeat_interval: float = 1.0,
        guard: float | None = None,
        dead_man: float | None = None,
        keepalive: Keepalive | None = None,
        on_lost: Callable[[LeaseLost], Any] | None = None,
        application_name: str = "pgbroker",
        connect_timeout: int = 10,
        sweep: bool = True,
        registry_connections: int = 4,
    ):
        self.url = libpq_url(url)
        self.name = name
        self.wait = _interval(wait, "wait")
        self.takeover = takeover
        self.stale_after = _interval(stale_after, "stale_after")
        self.info = _default_info() if info is None else info
        # The owner token binds the lease to this Broker object, not to the
        # server session: a claim from another caller that lands on the same
        # session (a pooler in transaction mode) is refused with PB003.
        self.owner = uuid.uuid4().hex if owner is None else owner
        self.session_pooler = session_pooler
        self.keepalive = keepalive or Keepalive()
        self.dead_man = dead_man
        self.heartbeat_interval = float(heartbeat_interval)
        self.on_lost = on_lost
        self.application_name = application_name
        self.connect_timeout = connect_timeout
        self.sweep = sweep
        if type(registry_connections) is not int or registry_connections < 0:
            raise ValueError(f"registry_connections must be a whole number >= 0, not {registry_connections!r}")
        self.registry_connections = registry_connections

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

        # The installed schema's version, read by claim() (install.compare_schema says how it stands).
        self.schema_version: str | None = None
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

        Raises :class:`LeaseLost` (``final`` True) when the lease was lost or
        released, and its subclass :class:`LeaseInDoubt` (``final`` False)
        when no heartbeat was confirmed for ``guard`` seconds (not sticky: a
        later good heartbeat clears it).  Returns the seconds left before the guard runs out; keep
        each action shorter than that.  No I/O: call it as often as you like.
        """
        if self._lost is not None:
            raise LeaseLost(str(self._lost), sqlstate=self._lost.sqlstate) from self._lost
        if self._state != "held":
            raise LeaseLost(f'lease "{self.name}" is not held by this broker (it is {self._state})')
        age = time.monotonic() - self._last_ok
        if age >= self.guard:
            raise LeaseInDoubt(
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
            "owner": self.owner,
        }

    def _classify(self, conn: psycopg.BaseConnection[Any], exc: psycopg.Error) -> Exception:
        """The exception to raise for a failed statement; marks the broker lost when it is."""
        if self._state == "held" and is_session_lost(conn, exc):
            return self._mark_lost(f"{exc}".strip(), getattr(exc, "sqlstate", None), exc)
        if self._lost is not None and is_session_lost(conn, exc):
            error = LeaseLost(str(self._lost), sqlstate=self._lost.sqlstate)
            error.__cause__ = exc
            return error
        return translate(exc)

    def _classify_registry(self, exc: psycopg.Error) -> Exception:
        """The exception for a failed call on a registry connection (fenced by ``epoch``, not the lease session).

        PB002 (the epoch is over: a newer one exists, or its holder's session
        is gone) is the final loss of the lease; a lost registry connection
        is not (the lease session is another one): :class:`DatabaseError`.
        """
        if getattr(exc, "sqlstate", None) == "PB002":
            if self._state == "held":
                return self._mark_lost(f"{exc}".strip(), "PB002", exc)
            error = LeaseLost(str(self._lost or exc), sqlstate="PB002")
            error.__cause__ = exc
            return error
        return translate(exc)

    def _check_session(self, login_pid: int, pids: list[int]) -> None:
        """Refuse a connection that does not keep its server session (a pooler; see ``pooler_verdict``).

        ``pids``: ``pg_backend_pid()`` read in two separate transactions.  A
        pooler in session mode is allowed with ``session_pooler=True``; one
        seen moving the session between transactions never is.
        """
        verdict = pooler_verdict(login_pid, pids)
        if verdict is None or (self.session_pooler and verdict[0] == "pooler"):
            return
        raise PoolerNotSupported(
            f"the Broker holds a session lease, and {verdict[1]}. Connect directly, or through a pooler in session "
            "mode with session_pooler=True; behind transaction pooling use a TTL lease "
            "(broker_claim(ttl => ..., owner => ...), broker_renew)"
        )

    def _check_schema(self, database: str, row: Any) -> None:
        """Raise :class:`SchemaMismatch` unless this package works with ``row`` (of ``SCHEMA_VERSION_SQL``).

        A schema older or newer than this package's that it works with (``install.compare_schema``) is logged
        as a warning naming both versions and the command that fixes it; ``schema_version`` keeps it.
        """
        self.schema_version = row[0]
        error = schema_mismatch(database, row[0], SCHEMA_VERSION)
        if error is not None:
            raise error
        check = compare_schema(row[0])
        if check.state != "same":
            log.warning('%r: database "%s": %s: run %s', self, database, check.message, check.fix)

    def _fetch_sql(self) -> str:
        """The fetch statement for the schema this broker claimed on (``left`` from 0.1.0+4)."""
        have = version_key(self.schema_version)
        return FETCH_LEFT_SQL if have is not None and LEFT_SCHEMA is not None and have >= LEFT_SCHEMA else FETCH_SQL

    def _missing_function(self, database: str, exc: psycopg.Error, row: Any) -> Exception:
        """The exception for a 42883 from a pgbroker call, ``row`` being ``SCHEMA_VERSION_SQL``'s result now.

        :class:`SchemaMismatch` naming both versions when the installed schema is not this package's (upgraded or
        downgraded since the claim, or a newer one that dropped what this package calls); otherwise the
        caller's 42883 (:class:`DatabaseError`).
        """
        return schema_mismatch(database, row[0], SCHEMA_VERSION, exc) or translate(exc)

    def _mark_lost(self, why: str, sqlstate: str | None, cause: BaseException | None) -> LeaseLost:
        """Record the loss (the first one wins) and return it."""
        lost = LeaseLost(f'lease "{self.name}" (epoch {self._epoch}) lost: {why}', sqlstate=sqlstate)
        lost.__cause__ = cause
        with self._flag_lock:
            if self._lost is None:
                self._lost = lost
                self._state = "lost"
            return self._lost

    def _shutdown_socket(self) -> None:
        """Shut the broker connection's socket down (both ways) without closing it.

        A thread or task blocked reading it wakes up at once with end-of-file,
        and its statement fails (the session counts as lost); the connection
        is closed later as usual.
        """
        conn = getattr(self, "_conn", None)
        if conn is None or conn.closed:
            return
        with contextlib.suppress(OSError, ValueError):
            sock = socket.socket(fileno=os.dup(conn.fileno()))
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.close()

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
