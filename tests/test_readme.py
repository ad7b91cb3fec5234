"""Every SQL example of the README runs as shown on a fresh install.

Each ```sql block runs top to bottom, statement by statement, in autocommit
connections.  Inside a block, a comment line ``-- session N`` switches to
session N (opened on first use); a statement followed by a comment line
``-- ERROR: ...`` must fail; a statement whose trailing comment starts with a
simple value (``-- 1``, ``-- true``, ``-- 'asleep': ...``) must return it.
"""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
import pytest

README = Path(__file__).resolve().parent.parent / "README.md"

_SESSION = re.compile(r"^--\s*session (\d+)")
_VALUE = re.compile(r"^--\s*(?:'(\w+)'|(\d+|true|false)\b)")


def sql_blocks() -> list[str]:
    return re.findall(r"^```sql\n(.*?)^```", README.read_text(), flags=re.MULTILINE | re.DOTALL)


def steps(block: str) -> list[tuple[int, str, str | None, bool]]:
    """(session, statement, expected first value or None, must fail) for each statement of a block."""
    out: list[tuple[int, str, str | None, bool]] = []
    session, pending = 1, ""
    for line in block.splitlines():
        stripped = line.strip()
        if not pending.strip() and stripped.startswith("--"):
            if m := _SESSION.match(stripped):
                session = int(m.group(1))
            elif stripped.startswith("-- ERROR:") and out:
                s, stmt, _, _ = out[-1]
                out[-1] = (s, stmt, None, True)
            continue
        code, _, comment = line.partition("--")
        pending += code + "\n"
        if code.rstrip().endswith(";"):
            m = _VALUE.match("--" + comment) if comment else None
            out.append((session, pending.strip(), (m.group(1) or m.group(2)) if m else None, False))
            pending = ""
    assert not pending.strip(), f"unterminated statement in README: {pending!r}"
    return out


def test_readme_has_sql_examples():
    blocks = sql_blocks()
    assert len(blocks) >= 3
    assert any("broker_claim" in b for b in blocks)


@pytest.mark.parametrize("index", range(len(sql_blocks())))
def test_readme_sql_block_runs_as_shown(db_url, index):
    block = sql_blocks()[index]
    sessions: dict[int, psycopg.Connection] = {}
    try:
        for session, statement, expected, must_fail in steps(block):
            conn = sessions.get(session)
            if conn is None:
                conn = sessions[session] = psycopg.connect(db_url, autocommit=True, application_name="psql")
            if must_fail:
                with pytest.raises(psycopg.Error):
                    conn.execute(statement)
                continue
            try:
                cur = conn.execute(statement)
            except psycopg.Error as exc:
                raise AssertionError(f"README statement failed: {statement}\n{exc}") from exc
            if expected is not None and cur.description:
                row = cur.fetchone()
                got = None if row is None else row[0]
                shown = str(got).lower() if isinstance(got, bool) else str(got)
                assert shown == expected, f"{statement}: README says {expected}, got {got!r}"
    finally:
        for conn in sessions.values():
            conn.close()
        with psycopg.connect(db_url, autocommit=True) as admin:
            for role in re.findall(r"CREATE ROLE (\w+)", block):
                admin.execute(f"DROP OWNED BY {role}")
                admin.execute(f"DROP ROLE {role}")
