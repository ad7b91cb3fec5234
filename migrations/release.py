"""Freeze a release of pgbroker's schema: record the sha256 of every revision file it ships.

    python3 migrations/release.py 0.1.0     # freeze (or, before its tag, re-freeze) release 0.1.0
    python3 migrations/release.py --verify  # exit 1 when a released revision file differs from its checksum

A release is a package version whose schema version (what
``pgbroker.schema_version()`` returns after its migrations) is that version.
Before running it, the version must be set in the three places that say it:
``pyproject.toml``'s ``version``, ``pgbroker.install.SCHEMA_VERSION`` and
``sql/000_schema.sql``'s ``schema_version()``; this script checks them and
changes nothing when one differs.

* **The first release (0.1.0)** regenerates the baseline revisions from
  ``sql/`` (``migrations/build_baseline.py``), then records them.  Until the
  git tag ``v0.1.0`` exists it may be run again (after more changes to
  ``sql/``): it regenerates and re-records.  Once the tag exists it refuses.
* **A later release** regenerates nothing: the revisions made since the last
  release (``migrations/README.md``, "Revisions") are recorded as they are,
  and the newest must set ``schema_version`` to the release's version.

``migrations/released.json`` lists, per release, its version, its head
revision and the sha256 of every revision file (``*.py``, ``*.sql``) it
froze.  ``build_baseline.py`` refuses to write a file listed there, and
``tests/test_migrations.py`` fails when one differs from its checksum.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VERSIONS = HERE / "versions"
RELEASED = HERE / "released.json"
_RELEASE = re.compile(r"\d+\.\d+\.\d+")


def _module(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load() -> list[dict[str, Any]]:
    """The releases recorded so far, oldest first."""
    if not RELEASED.exists():
        return []
    return json.loads(RELEASED.read_text())["releases"]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def revision_files(versions: Path = VERSIONS) -> list[Path]:
    return sorted(p for p in versions.iterdir() if p.is_file() and p.suffix in (".py", ".sql"))


def verify(releases: list[dict[str, Any]], versions: Path = VERSIONS) -> list[str]:
    """One line per released revision file that is gone or differs from its recorded checksum."""
    problems = []
    for release in releases:
        for name, digest in release["files"].items():
            path = versions / name
            if not path.is_file():
                problems.append(f"{name} (released in {release['version']}) is gone")
            elif sha256(path) != digest:
                problems.append(
                    f"{name} was released in {release['version']} and has changed since: released revisions never "
                    "change; restore it (git checkout v" + release["version"] + f" -- migrations/versions/{name}) and "
                    'make a new revision instead (migrations/README.md, "Revisions")'
                )
    return problems


def chain(versions: Path = VERSIONS) -> list[Any]:
    """The revision modules, base first (one branch: each revises the one before)."""
    modules = {}
    for path in sorted(versions.glob("*.py")):
        module = _module(path, f"pgbroker_revision_{path.stem}")
        modules[module.revision] = module
    order, down = [], None
    while True:
        nxt = [m for m in modules.values() if m.down_revision == down]
        if not nxt:
            break
        if len(nxt) > 1:
            raise SystemExit(f"several revisions revise {down}: {[m.revision for m in nxt]}")
        order.append(nxt[0])
        down = nxt[0].revision
    if len(order) != len(modules):
        raise SystemExit(f"revisions outside the chain: {sorted(set(modules) - {m.revision for m in order})}")
    return order


def schema_version_at(modules: list[Any]) -> str | None:
    """The schema version the last of ``modules`` leaves (the newest ``schema_version`` that is not None)."""
    versions = [m.schema_version for m in modules if getattr(m, "schema_version", None) is not None]
    return versions[-1] if versions else None


def _stated_versions() -> dict[str, str]:
    """Where the version is written down, and what each says."""
    pyproject = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    install = re.search(r'^SCHEMA_VERSION = "([^"]+)"', (ROOT / "pgbroker" / "install.py").read_text(), re.MULTILINE)
    build = _module(HERE / "build_baseline.py", "build_baseline")
    return {
        "pyproject.toml version": pyproject.group(1) if pyproject else "(none)",
        "pgbroker/install.py SCHEMA_VERSION": install.group(1) if install else "(none)",
        "sql/000_schema.sql schema_version()": build.schema_version(),
    }


def _tagged(version: str) -> bool:
    try:
        out = subprocess.run(
            ["git", "tag", "--list", f"v{version}"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return False
    return bool(out.strip())


def release(version: str) -> int:
    if not _RELEASE.fullmatch(version):
        print(f"release.py: {version!r} is not a release version (X.Y.Z)", file=sys.stderr)
        return 2
    stated = {where: said for where, said in _stated_versions().items() if said != version}
    if stated:
        for where, said in stated.items():
            print(f"release.py: {where} says {said}, not {version}: set it first", file=sys.stderr)
        return 1
    releases = load()
    known = [r["version"] for r in releases]
    first = not releases or known == [version]
    if version in known and (not first or _tagged(version)):
        print(f"release.py: {version} is released (tag v{version}): it never changes", file=sys.stderr)
        return 1
    problems = verify([r for r in releases if r["version"] != version])
    if problems:
        print("release.py: " + "\nrelease.py: ".join(problems), file=sys.stderr)
        return 1
    if first:
        build = subprocess.run([sys.executable, str(HERE / "build_baseline.py"), "--release"], cwd=ROOT)
        if build.returncode != 0:
            return build.returncode
    modules = chain()
    at = schema_version_at(modules)
    if at != version:
        print(
            f"release.py: the newest revisions leave schema_version() at {at}, not {version}: make a revision that "
            'sets it (migrations/README.md, "Revisions")',
            file=sys.stderr,
        )
        return 1
    frozen = {name for r in releases if r["version"] != version for name in r["files"]}
    files = {p.name: sha256(p) for p in revision_files() if p.name not in frozen}
    entry = {"version": version, "schema_version": version, "head": modules[-1].revision, "files": files}
    releases = [r for r in releases if r["version"] != version] + [entry]
    RELEASED.write_text(json.dumps({"releases": releases}, indent=2) + "\n")
    print(f"release.py: {version} frozen: {len(files)} revision files recorded in migrations/released.json")
    return 0


def main(argv: list[str]) -> int:
    if argv == ["--verify"]:
        problems = verify(load())
        for line in problems:
            print(f"release.py: {line}", file=sys.stderr)
        return 1 if problems else 0
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    return release(argv[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
