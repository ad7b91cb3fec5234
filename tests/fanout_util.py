"""Shared helpers of the fan-out tests: clients, subscriptions, the outbox and wake-ups."""

from __future__ import annotations

from typing import Any

import psycopg
from lease_util import wait_until  # noqa: F401  (re-exported for the fan-out tests)
from psycopg import sql
from psycopg.types.json import Jsonb

OBJECTS = "initech.objects"


def watch(conn: psycopg.Connection, table: str, mode: str = "statement") -> int:
    """pgbroker.watch() TABLE in trigger MODE (the fan-out tests' watch_mode fixture)."""
    return conn.execute("SELECT pgbroker.watch(%s::regclass, mode => %s)", (table, mode)).fetchone()[0]


def claim(conn: psycopg.Connection, name: str = "default") -> int:
    return conn.execute("SELECT pgbroker.broker_claim(%s)", (name,)).fetchone()[0]


def renew(conn: psycopg.Connection, name: str = "default") -> int:
    """Release and claim again from the same session: a new epoch, earlier state wiped."""
    conn.execute("SELECT pgbroker.broker_release(%s)", (name,))
    return claim(conn, name)


def register(
    conn: psycopg.Connection, client: str, name: str = "default", info: dict | None = None, epoch: int | None = None
) -> bool:
    return conn.execute(
        "SELECT pgbroker.client_register(%s, %s, name => %s, epoch => %s)",
        (client, Jsonb(info or {}), name, epoch),
    ).fetchone()[0]


def unregister(conn: psycopg.Connection, client: str, name: str = "default", epoch: int | None = None) -> bool:
    return conn.execute(
        "SELECT pgbroker.client_unregister(%s, name => %s, epoch => %s)", (client, name, epoch)
    ).fetchone()[0]


def _key(key: Any) -> Jsonb | None:
    return None if key is None else Jsonb(key)


def subscribe(
    conn: psycopg.Connection,
    client: str,
    table: str = OBJECTS,
    key: Any = None,
    name: str = "default",
    epoch: int | None = None,
) -> bool:
    return conn.execute(
        "SELECT pgbroker.subscribe(%s, %s::regclass, %s, name => %s, epoch => %s)",
        (client, table, _key(key), name, epoch),
    ).fetchone()[0]


def unsubscribe(conn: psycopg.Connection, client: str, table: str = OBJECTS, key: Any = None, name: str = "default"):
    return conn.execute(
        "SELECT pgbroker.unsubscribe(%s, %s::regclass, %s, name => %s)", (client, table, _key(key), name)
    ).fetchone()[0]


def fetch(conn: psycopg.Connection, name: str = "default", max_rows: int = 10000) -> list[dict]:
    cur = conn.execute("SELECT * FROM pgbroker.outbox_fetch(%s, %s)", (name, max_rows))
    cols = [d.name for d in cur.description]
    return [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]


def ack(conn: psycopg.Connection, ids: list[int], name: str = "default") -> int:
    return conn.execute("SELECT pgbroker.outbox_ack(%s, %s)", (name, ids)).fetchone()[0]


def drain(conn: psycopg.Connection, name: str = "default") -> list[dict]:
    """Fetch and acknowledge everything pending for lease NAME, batch after batch until none is left (a fast
    server lets a test's writers queue more than one fetch's max_rows)."""
    rows: list[dict] = []
    while batch := fetch(conn, name):
        ack(conn, [r["id"] for r in batch], name)
        rows += batch
    return rows


def summary(rows: list[dict]) -> list[tuple]:
    """Outbox rows as comparable tuples (op, key, changed, sorted clients), in id order."""
    return [(r["op"], r["key"], r["changed"], tuple(sorted(r["clients"]))) for r in rows]


def channel(conn: psycopg.Connection, name: str = "default") -> str:
    return conn.execute("SELECT pgbroker.wakeup_channel(%s)", (name,)).fetchone()[0]


def listen(conn: psycopg.Connection, name: str = "default") -> str:
    ch = channel(conn, name)
    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(ch)))
    return ch


def notifies(conn: psycopg.Connection, timeout: float = 0.5) -> list[psycopg.Notify]:
    """Notifications received within TIMEOUT seconds (from the moment of the call)."""
    return list(conn.notifies(timeout=timeout))


def sleep(conn: psycopg.Connection, name: str = "default", wait: str = "20 ms") -> str:
    return conn.execute("SELECT pgbroker.broker_sleep(%s, %s::interval)", (name, wait)).fetchone()[0]


def wake(conn: psycopg.Connection, name: str = "default") -> None:
    conn.execute("SELECT pgbroker.broker_wake(%s)", (name,))


def raw_outbox(conn: psycopg.Connection) -> list[tuple]:
    """Every outbox row (superuser): (name, epoch, op, row_key, changed, client ids)."""
    return conn.execute(
        """
        SELECT o.name, o.epoch, o.op::text, o.row_key, o.changed,
               ARRAY(SELECT k FROM unnest(o.clients) k ORDER BY 1)
          FROM pgbroker.outbox o ORDER BY o.id
        """
    ).fetchall()


def count(conn: psycopg.Connection, query: str, params: Any = None) -> int:
    return conn.execute(query, params).fetchone()[0]


def sqlstate(exc_info: Any) -> str | None:
    return exc_info.value.sqlstate


def connect_in_gate(connect: Any, gate: int, application: str = "writer", **kwargs: Any) -> psycopg.Connection:
    """A connection (from the CONNECT fixture) whose backend's pid is GATE modulo 16: the gate of the watch and
    drain locks its writes take (sql/300_watched_tables.sql)."""
    for _ in range(500):
        conn = connect(application, **kwargs)
        if conn.info.backend_pid % 16 == gate:
            return conn
        conn.close()
    raise AssertionError(f"no backend with pid {gate} modulo 16 in 500 connections")


def seed_objects(conn: psycopg.Connection, ids: range | list[int]) -> None:
    conn.execute(
        "INSERT INTO initech.objects (id, name) SELECT i, 'obj ' || i FROM unnest(%s::bigint[]) i",
        (list(ids),),
    )


def pgbroker_state_counts(conn: psycopg.Connection) -> dict[str, int]:
    """Rows in each fan-out table (superuser)."""
    return {
        t: count(conn, f"SELECT count(*) FROM pgbroker.{t}")
        for t in ("client", "subscription", "interest", "outbox", "watched")
    }
