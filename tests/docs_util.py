"""Reading the project's markdown files, for the tests that check the documentation.

Every markdown file of the repository is documentation (README.md and the
folder READMEs, the runbook), except what a tool generates
(tests/benchmarks/results/) and what is not ours (hidden directories, virtual
environments, build output).  Code blocks are fenced with ``` at the start
of a line; a generated section sits between the lines
``<!-- BEGIN generated NAME ... -->`` and ``<!-- END generated NAME -->``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NOT_DOCUMENTATION = {REPO / "tests" / "benchmarks" / "results"}
_SKIPPED_DIRS = {"build", "dist", "node_modules", "__pycache__"}

FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", flags=re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", flags=re.MULTILINE)


def markdown_files() -> list[Path]:
    """Every markdown file of the repository that is documentation, README.md first."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(REPO):
        here = Path(dirpath)
        dirnames[:] = sorted(
            name
            for name in dirnames
            if not name.startswith(".")
            and name not in _SKIPPED_DIRS
            and not name.endswith(".egg-info")
            and not (here / name / "pyvenv.cfg").exists()
            and here / name not in NOT_DOCUMENTATION
        )
        found += [here / name for name in sorted(filenames) if name.endswith(".md")]
    return sorted(found, key=lambda p: (p != REPO / "README.md", str(p.relative_to(REPO))))


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def code_blocks(text: str, language: str | None = None) -> list[str]:
    """The fenced code blocks of ``text`` (of one language when given), in order."""
    return [body for lang, body in FENCE.findall(text) if language is None or lang == language]


def without_code(text: str) -> str:
    """``text`` with its fenced code blocks and inline code spans blanked out."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return re.sub(r"`[^`\n]*`", "``", text)


def section(text: str, heading: str) -> str:
    """From the line ``heading`` (for example ``## From Python``) to the next heading of its level or above."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.rstrip() == heading]
    assert len(starts) == 1, f"expected one heading {heading!r}, found {len(starts)}"
    out = [lines[starts[0]]]
    fenced = False
    for line in lines[starts[0] + 1 :]:
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"^(#{1,6})[ \t]", line)
        if m and len(m.group(1)) <= level:
            break
        out.append(line)
    return "".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: links and code marks dropped, lower case,
    punctuation other than - and _ removed, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a markdown text's headings, numbered as GitHub numbers repeated ones."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, heading in HEADING.findall(without_code(text)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def _markers(name: str) -> re.Pattern[str]:
    return re.compile(
        rf"^(<!-- BEGIN generated {re.escape(name)}\b[^\n]*-->\n)(.*?)^(<!-- END generated {re.escape(name)} -->)$",
        flags=re.MULTILINE | re.DOTALL,
    )


def generated(text: str, name: str) -> str:
    """The generated section ``name`` of ``text`` (between its markers)."""
    found = _markers(name).findall(text)
    assert len(found) == 1, f"expected one generated section {name!r} between its BEGIN and END markers"
    return found[0][1]


def with_generated(text: str, name: str, content: str) -> str:
    """``text`` with the generated section ``name`` replaced by ``content``."""
    generated(text, name)  # exactly one
    return _markers(name).sub(lambda m: m.group(1) + content + m.group(3), text)
