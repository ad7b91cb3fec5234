"""Benchmark figures quoted in the documentation are the committed report's.

tests/benchmarks/results/report.md is written by tests/benchmarks/report.py
from one run of the benchmarks.  The prose that quotes it (README.md's
"Numbers" section and tests/benchmarks/README.md) must not retype figures
from elsewhere: every figure with a unit there (``0.65x``, ``2.37 ms``,
``54.3 µs``, ``3,387/s``, ``2,267 tps``, ``1%``) must be one of the report's,
and README.md must name the machine and date the report was made on.
"""

from __future__ import annotations

import re

from docs_util import REPO, section

REPORT = REPO / "tests" / "benchmarks" / "results" / "report.md"
QUOTING = {
    "README.md": lambda text: section(text, "## Numbers"),
    "tests/benchmarks/README.md": lambda text: text,
}

FIGURE = re.compile(r"(?<![\w.,/])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?[ \u00a0]?(x|ms|µs|us|s|/s|tps|%)(?![\w/])")


def figures(text: str) -> set[str]:
    """Figures with a unit, written one way: no space before the unit, µs as us."""
    return {f"{whole}{frac}{'us' if unit == 'µs' else unit}" for whole, frac, unit in FIGURE.findall(text)}


def not_in_report(text: str, report: str) -> list[str]:
    return sorted(figures(text) - figures(report))


def test_benchmark_figures_in_the_docs_come_from_the_report():
    report = REPORT.read_text()
    for name, quoted in QUOTING.items():
        text = quoted((REPO / name).read_text())
        assert figures(text), f"{name} quotes no figure: is this test looking at the right text?"
        assert not not_in_report(text, report), f"{name}: figures not in {REPORT.name}: {not_in_report(text, report)}"


def test_the_readme_names_the_machine_and_date_of_the_report():
    report = REPORT.read_text()
    numbers = section((REPO / "README.md").read_text(), "## Numbers")
    date = re.search(r"date (\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC)", report).group(1)
    cpu = re.search(r"^- CPU: (.+)$", report, flags=re.MULTILINE).group(1)
    postgres = re.search(r"\(PostgreSQL\) (\d+\.\d+)", report).group(1)
    for fact in (date, cpu, f"PostgreSQL {postgres}"):
        assert fact in numbers, f"README.md's Numbers section does not say {fact!r} (from {REPORT.name})"


def test_the_check_finds_figures_the_report_does_not_have():
    report = "| semaphore limit 4, 8 proc, retry '0' | 3,629/s, 545 us CPU/op | 7,076/s | 0.51x |"
    prose = "Semaphores reach 3,629/s (0.51x), 545 µs of CPU each; 3,614/s was printed as 0.42x, at 12.5 ms."
    assert not_in_report(prose, report) == ["0.42x", "12.5ms", "3,614/s"]
