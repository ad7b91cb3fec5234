"""pgbroker/README.md's command-line reference is what ``pgbroker --help`` prints.

The section between the "CLI reference" markers of pgbroker/README.md holds
``pgbroker --help`` and ``pgbroker COMMAND --help`` for every command, as
they print on a terminal at least 100 columns wide.  After changing the
command line, rewrite the section with::

    PGBROKER_UPDATE_REFERENCE=1 python -m pytest tests/test_cli_reference.py
"""

from __future__ import annotations

import os

import click
from click.testing import CliRunner
from docs_util import REPO, generated, with_generated

from pgbroker.cli import cli

PACKAGE_README = REPO / "pgbroker" / "README.md"
SECTION = "CLI reference"
WIDTH = 98  # click's help width on a terminal of 100 columns or more (max_content_width 100, less 2)


def help_of(*command: str) -> str:
    result = CliRunner().invoke(cli, [*command, "--help"], prog_name="pgbroker", terminal_width=WIDTH)
    assert result.exit_code == 0, result.output
    return result.output


def render() -> str:
    ctx = click.Context(cli, info_name="pgbroker")
    out = [f"\n```text\n$ pgbroker --help\n{help_of()}```\n"]
    for name in cli.list_commands(ctx):
        out.append(f"\n#### pgbroker {name}\n\n```text\n$ pgbroker {name} --help\n{help_of(name)}```\n")
    return "".join(out)


def test_the_cli_reference_of_the_package_readme_is_current():
    rendered = render()
    text = PACKAGE_README.read_text()
    if os.environ.get("PGBROKER_UPDATE_REFERENCE"):
        text = with_generated(text, SECTION, rendered)
        PACKAGE_README.write_text(text)
    assert generated(text, SECTION) == rendered, (
        "pgbroker/README.md's command-line reference differs from pgbroker --help: "
        "PGBROKER_UPDATE_REFERENCE=1 python -m pytest tests/test_cli_reference.py rewrites it"
    )
