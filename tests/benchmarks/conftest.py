"""Benchmarks run on demand only.

The project's pytest configuration ignores tests/benchmarks
(``--ignore=tests/benchmarks``); naming it explicitly still runs it:

    python -m pytest tests/benchmarks -s -p no:cacheprovider
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    # Collect bench_*.py files as test modules.
    config.addinivalue_line("python_files", "bench_*.py")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # Undo --ignore=tests/benchmarks when this directory was asked for by name.
    if collection_path == HERE or HERE in collection_path.parents:
        requested = [Path(arg.split("::")[0]).resolve() for arg in config.args]
        if any(p == HERE or HERE in p.parents for p in requested):
            return False
    return None
