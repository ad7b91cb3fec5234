"""SQLSTATE -> exception class mapping.  The one place that interprets errors.

Every error pgbroker's SQL raises carries a documented SQLSTATE (sql/README.md,
"SQLSTATEs").  :func:`translate` turns a psycopg error into the matching
:class:`PgBrokerError` subclass, chained to the original, without ever parsing
message text (the structured fields read are the DETAIL of :class:`LeaseHeld` and
:class:`PermissionDenied`, JSON objects by contract).  :func:`is_session_lost` says which errors mean
the broker session (and so its lease) is gone, and :func:`schema_error` what
a failed ``pgbroker.schema_version()`` means.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

import psycopg

__all__ = [
    "PgBrokerError",
    "LeaseHeld",
    "OwnerMismatch",
    "SchemaMissing",
    "SchemaMismatch",
    "TableBusy",
    "NotHolder",
    "StaleEpoch",
    "LeaseLost",
    "LeaseInDoubt",
    "PermissionDenied",
    "InvalidArgument",
    "UnknownClient",
    "ReadCommittedRequired",
    "NotWatchable",
    "NotWatched",
    "NotAcquired",
    "PoolerNotSupported",
    "DatabaseError",
    "translate",
    "is_session_lost",
    "schema_error",
    "schema_mismatch",
]


class PgBrokerError(Exception):
    """Base class.  ``sqlstate`` is the server's code; ``detail``/``hint`` its extra text."""

    sqlstate: str | None = None

    def __init__(
        self, message: str, *, sqlstate: str | None = None, detail: str | None = None, hint: str | None = None
    ):
        super().__init__(message)
        if sqlstate is not None:
            self.sqlstate = sqlstate
        self.detail = detail
        self.hint = hint


class LeaseHeld(PgBrokerError):
    """55P03: another session holds the lease (and the wait, if any, ran out).

    The holder, from the JSON object in ``detail``: ``name`` (the lease),
    ``pid``, ``application``, ``address``, ``user``, ``info``, ``epoch``,
    ``since`` and ``heartbeat_at`` (datetimes).  When the lock is held by a
    session that is not the recorded holder (a claim committing right now, or
    a stray lock), ``pid`` is that session, ``recorded_pid`` and ``state`` are
    the recorded holder's, and the holder's other fields are None.  Every
    field is None when ``detail`` is not such an object.
    """

    name: str | None
    pid: int | None
    application: str | None
    address: str | None
    user: str | None
    info: str | None
    epoch: int | None
    since: datetime | None
    heartbeat_at: datetime | None
    recorded_pid: int | None
    state: str | None

    def __init__(
        self, message: str, *, sqlstate: str | None = None, detail: str | None = None, hint: str | None = None
    ):
        super().__init__(message, sqlstate=sqlstate, detail=detail, hint=hint)
        fields = _json_object(detail)
        self.name = _typed(fields.get("name"), str)
        self.pid = _typed(fields.get("pid"), int)
        self.application = _typed(fields.get("application"), str)
        self.address = _typed(fields.get("address"), str)
        self.user = _typed(fields.get("user"), str)
        self.info = _typed(fields.get("info"), str)
        self.epoch = _typed(fields.get("epoch"), int)
        self.since = _timestamp(fields.get("since"))
        self.heartbeat_at = _timestamp(fields.get("heartbeat_at"))
        self.recorded_pid = _typed(fields.get("recorded_pid"), int)
        self.state = _typed(fields.get("state"), str)


class NotHolder(PgBrokerError):
    """PB001: this session does not hold the lease it tried to act on."""


class StaleEpoch(PgBrokerError):
    """PB002: broker_assert() failed: the epoch is not current or its holder is gone."""


class LeaseLost(PgBrokerError):
    """The Python Broker lost its lease (connection lost, backend terminated, heartbeat failed).

    Two kinds, told apart by ``final`` (and by the subclass :class:`LeaseInDoubt`):

    - ``final`` True (this class): the lease is gone for this broker object, for
      good: its session ended, the server said it does not hold the lease, a
      newer epoch exists, or it was released.  ``__cause__`` is the driver or
      server error that proved it, when there was one.  Create a new broker
      (or let :func:`pgbroker.run_broker` do it) to claim again.
    - ``final`` False (:class:`LeaseInDoubt`): no heartbeat was confirmed for
      ``guard`` seconds, so the server *may* free the lock soon; the lease is
      not known to be lost.  Stop acting as the holder until a later heartbeat
      is confirmed (``check()`` then passes again) or the loss becomes final.
    """

    final: bool = True


class LeaseInDoubt(LeaseLost):
    """``check()`` found no heartbeat confirmed for ``guard`` seconds: the lease may be lost, it is not known to be.

    Not sticky: a later confirmed heartbeat clears it.  ``final`` is False.
    """

    final = False


class PermissionDenied(PgBrokerError):
    """42501: the role lacks the pgbroker role the operation needs (for example takeover), or a name
    grant refuses it the name.

    For a name grant's refusal, from the JSON object in ``detail``: ``kind``
    (lease, lock, semaphore, kv, counter, rate_limit), ``name``, ``role`` (the
    session's login role) and ``rights`` (``read`` or ``write``, what it
    lacked); all None for the other refusals.
    """

    kind: str | None
    name: str | None
    role: str | None
    rights: str | None

    def __init__(
        self, message: str, *, sqlstate: str | None = None, detail: str | None = None, hint: str | None = None
    ):
        super().__init__(message, sqlstate=sqlstate, detail=detail, hint=hint)
        fields = _json_object(detail)
        self.kind = _typed(fields.get("kind"), str)
        self.name = _typed(fields.get("name"), str)
        self.role = _typed(fields.get("role"), str)
        self.rights = _typed(fields.get("rights"), str)


class InvalidArgument(PgBrokerError):
    """22023 / 22004 / 22P02 / 22003 / 42602 / 42703 / 54000 / PB023: a bad argument (empty or long name, negative
    wait, NULL, bad identifier; a bad filter: not an object, unknown column, value of the wrong type, too many
    values, a column with no equality)."""


class UnknownClient(PgBrokerError):
    """PB010: no such client is registered with this broker."""


class ReadCommittedRequired(PgBrokerError):
    """PB011: ``client_unregister`` (or ``client_unregister_many``) in a REPEATABLE READ or SERIALIZABLE transaction,
    whose snapshot would hide subscriptions made since it began.  The :class:`Broker` runs its calls at READ
    COMMITTED; this comes from SQL run in a transaction of the caller's."""


class NotWatchable(PgBrokerError):
    """PB020 / 42809 / 42P01: the table cannot be watched (no primary key, a view, missing)."""


class NotWatched(PgBrokerError):
    """PB021: the table is not watched, so nobody can subscribe to it."""


class TableBusy(PgBrokerError):
    """PB022: ``subscribe`` could not take the table's watch lock within its ``wait`` (a writer stayed open)."""


class NotAcquired(PgBrokerError, TimeoutError):
    """A ``with`` block's lock or semaphore permit was not acquired within its ``timeout``, or a rate limiter's
    ``wait()`` would outlast its ``timeout``."""


class PoolerNotSupported(PgBrokerError):
    """A session-scoped lock or semaphore on a connection whose session may not stay on one server backend.

    Raised by the Python layer (no SQLSTATE) when the connection goes through a
    pooler (a transaction-mode pooler moves the session between transactions).
    """


class OwnerMismatch(LeaseHeld):
    """PB003: this server session already holds the lease for another owner token (or a bare claim).

    Behind a pooler in transaction mode that is another caller whose claim
    landed on the same server session; ``pid``, ``epoch`` and ``since`` name it.
    """


class SchemaMissing(PgBrokerError):
    """pgbroker is not installed in the database (no ``pgbroker.schema_version()``): run ``pgbroker migrate``."""


class SchemaMismatch(SchemaMissing):
    """The installed schema is a version this package does not work with, or lacks a function this package calls
    because its version differs from this package's (a raw 42883 never leaves the Broker for that).

    ``installed`` and ``expected``: the two schema versions (the message names both, and the command that fixes
    it).  No SQLSTATE of its own (``sqlstate`` is 42883 when a missing function revealed it).
    """

    installed: str | None = None
    expected: str | None = None


class DatabaseError(PgBrokerError):
    """Any other error of PostgreSQL or of the connection to it, which no class above names: an SQLSTATE
    pgbroker's SQL does not raise itself (``sqlstate``, ``detail`` and ``hint`` as the server gave them), or a
    connection that failed or closed (``sqlstate`` of class 08, or None).  The driver's error is its
    ``__cause__``; no raw psycopg error leaves the public API.
    """


_BY_SQLSTATE: dict[str, type[PgBrokerError]] = {
    "55P03": LeaseHeld,
    "PB003": OwnerMismatch,
    "22003": InvalidArgument,
    "PB001": NotHolder,
    "PB002": StaleEpoch,
    "42501": PermissionDenied,
    "22023": InvalidArgument,
    "22004": InvalidArgument,
    "22P02": InvalidArgument,
    "42602": InvalidArgument,
    "42703": InvalidArgument,
    "54000": InvalidArgument,
    "PB023": InvalidArgument,
    "PB010": UnknownClient,
    "PB011": ReadCommittedRequired,
    "PB020": NotWatchable,
    "42809": NotWatchable,
    "42P01": NotWatchable,
    "PB021": NotWatched,
    "PB022": TableBusy,
}

# What a failed ``SELECT pgbroker.schema_version()`` means beyond the map
# above (42501 there is still PermissionDenied).  Only for that statement:
# elsewhere 3F000 can be the schema of a table the caller named.
_SCHEMA_MISSING_SQLSTATES = frozenset({"42883", "3F000"})  # undefined_function, invalid_schema_name

# The session, and so the lease, is gone or not ours: PB001 not_holder,
# class 08 (connection exception), class 57P (operator intervention:
# terminated, shutting down, cannot connect now, idle_session_timeout).
_LOSS_SQLSTATE = re.compile(r"PB001$|08|57P")


def translate(exc: psycopg.Error) -> Exception:
    """The pgbroker exception for a psycopg error (:class:`DatabaseError` for one no other class names)."""
    sqlstate = getattr(exc, "sqlstate", None)
    cls = _BY_SQLSTATE.get(sqlstate or "", DatabaseError)
    diag = exc.diag
    message = diag.message_primary or str(exc).strip() or type(exc).__name__
    new = cls(message, sqlstate=sqlstate, detail=diag.message_detail, hint=diag.message_hint)
    new.__cause__ = exc
    return new


def is_session_lost(conn: psycopg.BaseConnection[Any], exc: psycopg.Error) -> bool:
    """Does this error, on the broker's own connection, mean its session (and so the lease) is gone or not ours?"""
    sqlstate = getattr(exc, "sqlstate", None) or ""
    return bool(conn.broken or conn.closed or _LOSS_SQLSTATE.match(sqlstate))


def schema_error(exc: psycopg.Error, database: str) -> Exception:
    """The exception for a failed ``SELECT pgbroker.schema_version()`` in ``database``."""
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate not in _SCHEMA_MISSING_SQLSTATES:
        return translate(exc)
    new = SchemaMissing(
        f'pgbroker is not installed in database "{database}" (or is older than pgbroker.schema_version()): '
        "run `pgbroker migrate` (or `alembic upgrade head`) on it",
        sqlstate=sqlstate,
        detail=exc.diag.message_primary,
    )
    new.__cause__ = exc
    return new


def schema_mismatch(
    database: str, installed: str, expected: str | None, cause: psycopg.Error | None = None
) -> SchemaMismatch | None:
    """The error when ``database`` has schema version ``installed`` and this package expects ``expected``.

    Without ``cause`` (the start-up check): None when this package works with that version
    (``pgbroker.install.compare_schema``).  With ``cause`` (a 42883 from a pgbroker call): None when the versions
    are equal (then the 42883 is the caller's: a misspelt name or mistyped argument).
    """
    from pgbroker.install import compare_schema

    if expected is None or installed == expected:
        return None
    check = compare_schema(installed, expected)
    if cause is None and check.usable:
        return None
    if cause is not None:
        why = (cause.diag.message_primary or str(cause)).strip()
        message = f'database "{database}": {why}: {check.message}: run {check.fix}'
    else:
        message = f'database "{database}": {check.message}: run {check.fix}'
    error = SchemaMismatch(message, sqlstate=getattr(cause, "sqlstate", None))
    error.installed, error.expected = installed, expected
    error.__cause__ = cause
    return error


def _json_object(detail: str | None) -> dict[str, Any]:
    try:
        value = json.loads(detail or "")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _typed(value: Any, kind: type) -> Any:
    """``value`` if it is a ``kind`` (bool is not an int here), else None."""
    return value if isinstance(value, kind) and not isinstance(value, bool) else None


def _timestamp(value: Any) -> datetime | None:
    """A timestamptz as PostgreSQL's JSON writes it (``2026-12-01T01:57:03.6939+00:00``), or None."""
    if not isinstance(value, str):
        return None
    # Python 3.10's fromisoformat wants 0, 3 or 6 fraction digits and a +HH:MM offset.
    text = re.sub(r"\.(\d{1,6})", lambda m: "." + m.group(1).ljust(6, "0"), value, count=1)
    text = re.sub(r"([+-]\d\d)$", r"\1:00", text)
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None
