"""Helpers shared by the fault-matrix tests: fenced writes recorded in a history, and checks against the server."""

from __future__ import annotations

from typing import Any

import psycopg
from history import (
    OK,
    Op,
    Recorder,
    Violation,
    check_exclusion,
    check_fencing,
    check_lease_history,
    check_tokens,
    lease_holds,
)

FENCED_TABLE = "public.fenced_writes"


def create_fenced_table(conn: psycopg.Connection) -> None:
    conn.execute(
        f"CREATE TABLE {FENCED_TABLE} (writer text NOT NULL, seq integer NOT NULL, epoch bigint NOT NULL,"
        " at timestamptz NOT NULL DEFAULT clock_timestamp(), PRIMARY KEY (writer, seq))"
    )


def fenced_write(conn: psycopg.Connection, recorder: Recorder, name: str, epoch: int, seq: int) -> bool:
    """One write fenced by ``broker_assert`` in its transaction, recorded as op ``write``.

    ok: committed; failed: refused by the fence (PB002) or never sent; unknown: the connection
    broke (the commit may or may not have happened).  Returns whether it was acknowledged.
    """
    with recorder.call("write", name, token=epoch, seq=seq) as call:
        try:
            with conn.transaction():
                conn.execute("SELECT pgbroker.broker_assert(%s, %s)", (name, epoch))
                conn.execute(
                    f"INSERT INTO {FENCED_TABLE} (writer, seq, epoch) VALUES (%s, %s, %s)",
                    (recorder.process, seq, epoch),
                )
        except psycopg.Error as exc:
            if exc.sqlstate == "PB002":
                call.fail(sqlstate=exc.sqlstate)
                return False
            raise
        call.ok()
        return True


def server_history(conn: psycopg.Connection, name: str) -> list[dict[str, Any]]:
    cur = conn.execute("SELECT * FROM pgbroker.lease_history WHERE name = %s ORDER BY id", (name,))
    cols = [d.name for d in cur.description]
    return [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]


def fenced_rows(conn: psycopg.Connection) -> dict[tuple[str, int], int]:
    """(writer, seq) -> epoch of every committed fenced write."""
    return {(w, s): e for w, s, e in conn.execute(f"SELECT writer, seq, epoch FROM {FENCED_TABLE}").fetchall()}


def check_writes_present(ops: list[Op], rows: dict[tuple[str, int], int]) -> list[Violation]:
    """Every acknowledged write is on the server, under the epoch it was fenced with."""
    violations = []
    for o in ops:
        if o.op == "write" and o.result == OK and rows.get((o.process, o.args["seq"])) != o.args["token"]:
            violations.append(Violation("acknowledged-write-missing", f"{o.process} seq {o.args['seq']}", (o,)))
    return violations


def check_lease(ops: list[Op], rows: list[dict[str, Any]], name: str, release: str = "release") -> list[Violation]:
    """Tokens, fencing, exclusion of holds (a hold ends at the op named ``release``) and the server's history."""
    return (
        check_tokens(ops)
        + check_fencing(ops)
        + check_exclusion(lease_holds(ops, release=release))
        + check_lease_history(rows, ops, name=name)
    )
