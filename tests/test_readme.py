"""Every SQL example of the documentation runs as shown on a fresh install, and so does README.md's Python example;
every Python block compiles.

Every ```sql block of every markdown file (tests/docs_util.py says which
files) runs top to bottom, statement by statement, in autocommit
connections.  Inside a block, a comment line ``-- session N`` switches to
session N (opened on first use); a statement followed by a comment line
``-- ERROR: ...`` must fail; a statement whose trailing comment starts with a
simple value (``-- 1``, ``-- true``, ``-- 'asleep': ...``) must return it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from docs_util import REPO, code_blocks, markdown_files, rel, section

_SESSION = re.compile(r"^--\s*session (\d+)")
_VALUE = re.compile(r"^--\s*(?:'(\w+)'|(\d+|true|false)\b)")


def sql_blocks() -> list[tuple[Path, int, str]]:
    """(file, index in the file, block) for every ```sql block of the documentation."""
    return [
        (path, i, block) for path in markdown_files() for i, block in enumerate(code_blocks(path.read_text(), "sql"))
    ]


BLOCKS = sql_blocks()


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
    assert not pending.strip(), f"unterminated statement: {pending!r}"
    return out


def test_the_documentation_has_its_sql_examples():
    files = {rel(path) for path, _, _ in BLOCKS}
    assert {"README.md", "sql/README.md", "sql/runbook.md"} <= files, files
    assert any("broker_claim" in block for path, _, block in BLOCKS if rel(path) == "README.md")


def test_no_sql_block_escapes_the_tests():
    """A fence that does not start its line (indented in a list) would not be found: keep them at the margin."""
    for path in markdown_files():
        indented = [n for n, line in enumerate(path.read_text().splitlines(), 1) if re.match(r"^\s+```", line)]
        assert not indented, f"{rel(path)}: indented code fences at lines {indented}"


def test_every_python_block_of_the_documentation_compiles():
    """Fragments that no test runs whole are at least valid Python."""
    for path in markdown_files():
        for i, block in enumerate(code_blocks(path.read_text(), "python")):
            compile(block, f"{rel(path)} python block {i}", "exec")


@pytest.mark.parametrize(("path", "index", "block"), BLOCKS, ids=[f"{rel(p)}#{i}" for p, i, _ in BLOCKS])
def test_sql_block_runs_as_shown(db_url, path, index, block):
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
                raise AssertionError(f"{rel(path)}: statement failed: {statement}\n{exc}") from exc
            if expected is not None and cur.description:
                row = cur.fetchone()
                got = None if row is None else row[0]
                shown = str(got).lower() if isinstance(got, bool) else str(got)
                assert shown == expected, f"{rel(path)}: {statement}: the text says {expected}, got {got!r}"
    finally:
        for conn in sessions.values():
            conn.close()
        with psycopg.connect(db_url, autocommit=True) as admin:
            for role in re.findall(r"CREATE ROLE (\w+)", block):
                admin.execute(f"DROP OWNED BY {role}")
                admin.execute(f"DROP ROLE {role}")


def test_readme_python_example_prints_what_the_readme_shows(db_url, tmp_path):
    """README.md, "From Python": the ```python block, run as a script, prints the ```text block after it."""
    text = section((REPO / "README.md").read_text(), "## From Python")
    (example,) = code_blocks(text, "python")
    (shown,) = code_blocks(text, "text")
    script = tmp_path / "example.py"
    script.write_text(example)
    env = dict(os.environ, DATABASE_URL=db_url)
    done = subprocess.run(
        [sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == shown
