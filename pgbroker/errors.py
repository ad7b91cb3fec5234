"""SQLSTATE -> exception class mapping.  The one place that interprets errors.

Every error pgbroker's SQL raises carries a documented SQLSTATE (README,
"SQLSTATEs").  :func:`translate` turns a psycopg error into the matching
:class:`PgBrokerError` subclass, chained to the original, without ever parsing
message text.
"""

from __future__ import annotations

import psycopg

__all__ = [
    "PgBrokerError",
    "LeaseHeld",
    "NotHolder",
    "StaleEpoch",
    "LeaseLost",
    "PermissionDenied",
    "InvalidArgument",
    "UnknownClient",
    "NotWatchable",
    "NotWatched",
    "translate",
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
    """55P03: another session holds the lease (and the wait, if any, ran out)."""


class NotHolder(PgBrokerError):
    """PB001: this session does not hold the lease it tried to act on."""


class StaleEpoch(PgBrokerError):
    """PB002: broker_assert() failed: the epoch is not current or its holder is gone."""


class LeaseLost(PgBrokerError):
    """The Python Broker lost its lease (connection lost, backend terminated, heartbeat failed)."""


class PermissionDenied(PgBrokerError):
    """42501: the role lacks the pgbroker role the operation needs (for example takeover)."""


class InvalidArgument(PgBrokerError):
    """22023 / 22004 / 22P02 / 42602: a bad argument (empty or long name, negative wait, NULL, bad identifier)."""


class UnknownClient(PgBrokerError):
    """PB010: no such client is registered with this broker."""


class NotWatchable(PgBrokerError):
    """PB020 / 42809 / 42P01: the table cannot be watched (no primary key, a view, missing)."""


class NotWatched(PgBrokerError):
    """PB021: the table is not watched, so nobody can subscribe to it."""


_BY_SQLSTATE: dict[str, type[PgBrokerError]] = {
    "55P03": LeaseHeld,
    "PB001": NotHolder,
    "PB002": StaleEpoch,
    "42501": PermissionDenied,
    "22023": InvalidArgument,
    "22004": InvalidArgument,
    "22P02": InvalidArgument,
    "42602": InvalidArgument,
    "PB010": UnknownClient,
    "PB020": NotWatchable,
    "42809": NotWatchable,
    "42P01": NotWatchable,
    "PB021": NotWatched,
}


def translate(exc: psycopg.Error) -> Exception:
    """The pgbroker exception for a psycopg error, or the error itself when it is not one of ours."""
    sqlstate = getattr(exc, "sqlstate", None)
    cls = _BY_SQLSTATE.get(sqlstate or "")
    if cls is None:
        return exc
    diag = exc.diag
    new = cls(diag.message_primary or str(exc), sqlstate=sqlstate, detail=diag.message_detail, hint=diag.message_hint)
    new.__cause__ = exc
    return new
