"""sql/README.md's function reference is what the catalog says.

Per-function documentation lives in ``COMMENT ON`` (sql/), so that
``\\df+ pgbroker.*`` and the reference say the same thing.  The section
between the "function reference" markers of sql/README.md is rendered from a
freshly migrated database: every public (not ``_``-prefixed) function of the
schema ``pgbroker`` with its signature and comment, and every view with its
comment and its columns' comments.  After changing a comment in sql/, rewrite
the section with::

    PGBROKER_UPDATE_REFERENCE=1 python -m pytest tests/test_sql_reference.py
"""

from __future__ import annotations

import os
import re

from docs_util import REPO, generated, with_generated

SQL_README = REPO / "sql" / "README.md"
SECTION = "function reference"


def _text(comment: str | None, what: str) -> str:
    """A catalog comment as markdown: its lines joined into one paragraph, nothing read as markup."""
    assert comment, f"{what} has no COMMENT"
    lines = []
    for line in comment.strip().splitlines():
        line = re.sub(r"([*`|<\\])", r"\\\1", line.strip())
        lines.append(re.sub(r"^([#>+-]|\d+\.)", r"\\\1", line))
    return "\n".join(lines)


def render(conn) -> str:
    conn.execute("SET search_path = pg_catalog")  # type names come out schema-qualified where they need it
    functions = conn.execute(
        """
        SELECT p.proname, pg_get_function_arguments(p.oid), pg_get_function_result(p.oid),
               obj_description(p.oid, 'pg_proc')
          FROM pg_proc p
         WHERE p.pronamespace = 'pgbroker'::regnamespace AND p.proname !~ '^_'
         ORDER BY p.proname, pg_get_function_identity_arguments(p.oid)
        """
    ).fetchall()
    views = conn.execute(
        """
        SELECT c.oid, c.relname, obj_description(c.oid, 'pg_class')
          FROM pg_class c
         WHERE c.relnamespace = 'pgbroker'::regnamespace AND c.relkind = 'v' AND c.relname !~ '^_'
         ORDER BY c.relname
        """
    ).fetchall()
    names = [name for name, *_ in functions]
    assert len(names) == len(set(names)), "an overloaded function: give the reference's headings a signature"
    out = ["\n### Functions\n\n"]
    out.append(" · ".join(f"[{name}](#{name})" for name in names) + "\n")
    for name, arguments, result, comment in functions:
        out.append(f"\n#### {name}\n\n```text\npgbroker.{name}({arguments})\n  RETURNS {result}\n```\n\n")
        out.append(_text(comment, f"function pgbroker.{name}") + "\n")
    out.append("\n### Views\n\n")
    out.append(" · ".join(f"[{name}](#{name}-view)" for _, name, _ in views) + "\n")
    for oid, name, comment in views:
        out.append(f"\n#### {name} (view)\n\n{_text(comment, f'view pgbroker.{name}')}\n\n")
        out.append("| column | type | what |\n|---|---|---|\n")
        columns = conn.execute(
            """
            SELECT a.attname, format_type(a.atttypid, a.atttypmod), col_description(a.attrelid, a.attnum)
              FROM pg_attribute a
             WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped
             ORDER BY a.attnum
            """,
            (oid,),
        ).fetchall()
        for column, type_, column_comment in columns:
            text = _text(column_comment, f"column pgbroker.{name}.{column}").replace("\n", " ")
            out.append(f"| `{column}` | `{type_}` | {text} |\n")
    return "".join(out)


def test_the_function_reference_of_sql_readme_is_current(connect):
    rendered = render(connect("admin"))
    text = SQL_README.read_text()
    if os.environ.get("PGBROKER_UPDATE_REFERENCE"):
        text = with_generated(text, SECTION, rendered)
        SQL_README.write_text(text)
    assert generated(text, SECTION) == rendered, (
        "sql/README.md's function reference differs from the catalog's comments: "
        "PGBROKER_UPDATE_REFERENCE=1 python -m pytest tests/test_sql_reference.py rewrites it"
    )
