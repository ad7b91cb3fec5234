"""Links between the documentation's markdown files resolve, and every file can be reached from README.md.

A relative link must name a file or directory of the repository; with an
``#anchor`` it must name a markdown file with a heading of that anchor
(GitHub's slugs: tests/docs_util.py).  No two headings of a file may share an
anchor, so that a link cannot land on the wrong one.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from docs_util import HEADING, REPO, anchors, markdown_files, rel, slug, without_code

LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(path: Path) -> list[str]:
    return LINK.findall(without_code(path.read_text()))


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """Each relative link of ``path`` that does not resolve inside ``root``, with why."""
    problems = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if resolved != root and root not in resolved.parents:
            problems.append(f"{target}: outside the repository")
        elif not resolved.exists():
            problems.append(f"{target}: no such file")
        elif anchor:
            if resolved.suffix != ".md":
                problems.append(f"{target}: an anchor into a file that is not markdown")
            elif anchor not in anchors(resolved.read_text()):
                problems.append(f"{target}: no heading with that anchor")
    return problems


def test_every_relative_link_resolves():
    problems = {rel(path): broken_links(path) for path in markdown_files()}
    assert not any(problems.values()), {name: found for name, found in problems.items() if found}


def test_the_checker_finds_a_broken_link_and_a_missing_anchor(tmp_path):
    (tmp_path / "README.md").write_text((REPO / "sql" / "README.md").read_text())
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\nSee [the lease](README.md#the-broker-lease), [nothing](README.md#no-such-heading), "
        "[gone](no-such-file.md), [up](../elsewhere.md), [here](#page) and `[code](not-a-link.md)`.\n"
    )
    assert broken_links(page, root=tmp_path) == [
        "README.md#no-such-heading: no heading with that anchor",
        "no-such-file.md: no such file",
        "../elsewhere.md: outside the repository",
    ]


def test_no_two_headings_of_a_file_share_an_anchor():
    for path in markdown_files():
        counts = Counter(slug(heading) for _, heading in HEADING.findall(without_code(path.read_text())))
        assert not [a for a, n in counts.items() if n > 1], f"{rel(path)}: headings sharing an anchor"


def test_every_markdown_file_can_be_reached_from_the_readme():
    start = REPO / "README.md"
    seen, todo = {start}, [start]
    while todo:
        path = todo.pop()
        for target in links(path):
            file_part = target.partition("#")[0]
            if not file_part or re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            resolved = (path.parent / file_part).resolve()
            if resolved.suffix == ".md" and resolved.exists() and resolved not in seen:
                seen.add(resolved)
                todo.append(resolved)
    unreachable = [rel(p) for p in markdown_files() if p not in seen]
    assert not unreachable, f"no chain of links leads from README.md to {unreachable}"
