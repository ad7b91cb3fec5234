"""What each role may execute and read is exactly the role table of sql/README.md.

sql/README.md ("Roles and privileges") lists, per pgbroker role, the functions it may execute
and the views it may read; "all of the above" in the admin row means the
reader's and the broker's.  The catalog must agree, for login roles granted
each pgbroker role (tests/conftest.py) and for PUBLIC (a role granted nothing).
"""

from __future__ import annotations

import re

from conftest import TEST_ROLES
from docs_util import REPO, section

SQL_README = REPO / "sql" / "README.md"


def role_table() -> dict[str, tuple[set[str], set[str]]]:
    text = section(SQL_README.read_text(), "## Roles and privileges")
    table: dict[str, tuple[set[str], set[str]]] = {}
    above_exec: set[str] = set()
    above_read: set[str] = set()
    for line in text.splitlines():
        m = re.match(r"^\| (`pgbroker_\w+`|PUBLIC) \| (.*?) \| (.*?) \|$", line)
        if not m:
            if table and not line.startswith("|"):
                break
            continue
        role = m.group(1).strip("`")
        execs = set(re.findall(r"`(\w+)", m.group(2)))
        reads = set(re.findall(r"`(\w+)`", m.group(3)))
        if "all of the above" in m.group(2):
            execs |= above_exec
        if "all of the above" in m.group(3):
            reads |= above_read
        table[role] = (execs, reads)
        if role != "PUBLIC":
            above_exec |= execs
            above_read |= reads
    return table


def _catalog(conn, login: str) -> tuple[set[str], set[str]]:
    execs = {
        r[0]
        for r in conn.execute(
            """SELECT p.proname FROM pg_proc p
                WHERE p.pronamespace = 'pgbroker'::regnamespace AND has_function_privilege(%s, p.oid, 'EXECUTE')""",
            (login,),
        )
    }
    reads = {
        r[0]
        for r in conn.execute(
            """SELECT c.relname FROM pg_class c
                WHERE c.relnamespace = 'pgbroker'::regnamespace AND has_table_privilege(%s, c.oid, 'SELECT')""",
            (login,),
        )
    }
    return execs, reads


def test_the_role_table_is_complete():
    table = role_table()
    assert set(table) == {"pgbroker_reader", "pgbroker_broker", "pgbroker_user", "pgbroker_admin", "PUBLIC"}
    assert "broker_claim" in table["pgbroker_admin"][0] and "brokers" in table["pgbroker_admin"][1]


def test_each_role_may_do_what_the_role_table_says_and_nothing_else(connect):
    obs = connect("obs")
    table = role_table()
    login_of = {granted or "PUBLIC": login for login, granted in TEST_ROLES.items()}
    for role, (execs, reads) in table.items():
        got_execs, got_reads = _catalog(obs, login_of[role])
        expected_execs = execs | table["PUBLIC"][0]
        assert got_execs == expected_execs, (
            f"{role}: executable but not in the role table: {sorted(got_execs - expected_execs)}; "
            f"in the role table but not executable: {sorted(expected_execs - got_execs)}"
        )
        assert got_reads == reads, f"{role}: readable {sorted(got_reads)}, the role table says {sorted(reads)}"
        assert not any(name.startswith("_") for name in got_execs), f"{role} may execute internal functions"
