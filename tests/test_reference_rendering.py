"""The generated triggers of initech.objects, rendered in both modes, equal the committed reference files.

``sql/reference/initech_objects_triggers.sql`` (statement mode, the default)
and ``sql/reference/initech_objects_triggers_row.sql`` (``mode => 'row'``) show
what pgbroker.watch() generates for a real table (sql/600_triggers.sql holds
the templates), so that every change to the generator shows up in review as a
diff of real trigger code.  After changing the templates, rewrite them with::

    PGBROKER_UPDATE_REFERENCE=1 python -m pytest tests/test_reference_rendering.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REFERENCES = Path(__file__).resolve().parent.parent / "sql" / "reference"
FILES = {"statement": "initech_objects_triggers.sql", "row": "initech_objects_triggers_row.sql"}
CALLS = {"statement": "pgbroker.watch('initech.objects')", "row": "pgbroker.watch('initech.objects', mode => 'row')"}

HEADER = """\
-- Reference rendering (generated; do not edit): what {call} installs.
--
-- The templates are in sql/600_triggers.sql; tests/test_reference_rendering.py
-- renders them on a fresh install and compares with this file.  After changing
-- the templates: PGBROKER_UPDATE_REFERENCE=1 python -m pytest tests/test_reference_rendering.py
"""


def render(conn, mode: str) -> str:
    conn.execute(f"SELECT {CALLS[mode]}")
    conn.execute("SET search_path = pg_catalog")  # names come out schema-qualified, whatever the database's setting
    parts = [HEADER.format(call=CALLS[mode])]
    rows = conn.execute(
        """
        SELECT t.tgname, pg_get_triggerdef(t.oid), pg_get_functiondef(t.tgfoid)
          FROM pg_trigger t
         WHERE t.tgrelid = 'initech.objects'::regclass AND t.tgname LIKE '\\_pgbroker\\_watch\\_%'
         ORDER BY array_position(ARRAY['_pgbroker_watch_ins', '_pgbroker_watch_upd', '_pgbroker_watch_del',
                                       '_pgbroker_watch_trunc'], t.tgname::text)
        """
    ).fetchall()
    assert [r[0] for r in rows] == ["_pgbroker_watch_ins", "_pgbroker_watch_upd", "_pgbroker_watch_del",
                                    "_pgbroker_watch_trunc"]  # fmt: skip
    for name, trigger, function in rows:
        parts.append(f"\n-- {'-' * 75}\n-- {name}\n\n{trigger};\n\n{function.rstrip()};\n")
    return "".join(parts)


@pytest.mark.parametrize("mode", list(FILES))
def test_the_reference_rendering_of_initech_objects_is_current(connect, mode):
    rendered = render(connect("admin"), mode)
    reference = REFERENCES / FILES[mode]
    if os.environ.get("PGBROKER_UPDATE_REFERENCE"):
        reference.write_text(rendered)
    assert reference.exists(), f"{reference} is missing: see this module's docstring"
    assert reference.read_text() == rendered, (
        f"{reference.name} differs from what the templates render: review the change, then rewrite it "
        "(PGBROKER_UPDATE_REFERENCE=1 python -m pytest tests/test_reference_rendering.py)"
    )
