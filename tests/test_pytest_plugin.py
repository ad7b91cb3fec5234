"""pgbroker's pytest plugin (pgbroker/pytest_plugin.py), run by pytester in a pytest of its own:
the example test file of pgbroker/README.md passes, and without pytest-postgresql the fixtures say what is missing."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

from docs_util import code_blocks, section

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parent.parent


def _plugin_args() -> list[str]:
    """Load the plugin by name where its entry point is not installed (a checkout run without pip install -e)."""
    registered = any(ep.value == "pgbroker.pytest_plugin" for ep in entry_points(group="pytest11"))
    return [] if registered else ["-p", "pgbroker.pytest_plugin"]


def readme_example() -> str:
    """The ```python block of pgbroker/README.md's "Testing your broker with pytest"."""
    text = section((REPO / "pgbroker" / "README.md").read_text(), "## Testing your broker with pytest")
    (example,) = code_blocks(text, "python")
    return example


def test_the_entry_point_is_declared():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '[project.entry-points.pytest11]\npgbroker = "pgbroker.pytest_plugin"' in pyproject


def test_the_readme_example_passes(pytester):
    pytester.makepyfile(test_example=readme_example())
    # Twice per fixture use: a second test proves each test gets a database of its own.
    pytester.makepyfile(
        test_isolation="""
import psycopg

def test_first_writes(pgbroker_db):
    with psycopg.connect(pgbroker_db, autocommit=True) as conn:
        conn.execute("SELECT pgbroker.counter_add('isolated', 5)")
        assert conn.execute("SELECT pgbroker.counter_get('isolated')").fetchone()[0] == 5

def test_second_sees_a_fresh_database(pgbroker_db):
    with psycopg.connect(pgbroker_db, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM pgbroker.counters").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM pgbroker.lease_history").fetchone()[0] == 0
        # the template's search_path came along
        assert conn.execute("SELECT to_regproc('broker_alive') IS NOT NULL").fetchone()[0]
"""
    )
    result = pytester.runpytest_subprocess(*_plugin_args(), "-p", "no:cacheprovider", "-q", timeout=300)
    result.assert_outcomes(passed=5)


def test_without_pytest_postgresql_the_fixtures_say_what_is_missing(pytester):
    pytester.makeconftest(
        """
import sys
for name in ("pytest_postgresql", "pytest_postgresql.executors", "pytest_postgresql.janitor"):
    sys.modules[name] = None  # as if it were not installed
"""
    )
    pytester.makepyfile(
        test_missing="""
def test_needs_a_database(pgbroker_db):
    pass

def test_without_fixtures_runs():
    assert True
"""
    )
    result = pytester.runpytest_subprocess(*_plugin_args(), "-p", "no:pytest_postgresql", "-q", timeout=120)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*pgbroker's pytest fixtures need pytest-postgresql, which is not installed*"])
