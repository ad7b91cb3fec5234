"""The same calls on installs made differently, measured in one run (run on demand).

    python3 tests/benchmarks/bench_installs.py                          # superuser against least privilege
    python3 tests/benchmarks/bench_installs.py --baseline fb81540^      # ... and the install of an earlier revision
    python3 tests/benchmarks/bench_installs.py --quick                  # shorter rounds, for a smoke test

Starts its own throwaway PostgreSQL (fsync, synchronous_commit and
full_page_writes on) with a database per install:

- ``superuser``: installed and called by the bootstrap superuser, as every
  other benchmark does;
- ``least privilege``: installed by a role with only ``LOGIN CREATEDB
  CREATEROLE`` that owns the database (profile b of
  ``tests/test_least_privilege.py``: no ``pg_signal_backend``, no
  ``pg_read_all_stats``), and called by a login role holding only
  ``pgbroker_broker`` and ``pgbroker_user``;
- ``baseline`` (with ``--baseline REV``): the tree of the git revision REV
  (``git archive``) installed and called by the superuser, to compare a
  change's hot paths with what came before it.

Each hot path of ``bench_lease.py`` and ``bench_primitives.py`` (their
``kind_*`` cycles: the lease cycle, locks, a semaphore, a counter, a KV
compare-and-set, rate limits) runs against its floor in the same database, in
rounds that alternate every (install, cycle) pair.  Per install: the ratio
of the call's throughput to its floor's, and the CPU per operation (client +
server); then the least-privilege install's ratio against the superuser
install's, and the superuser install's (this tree) against the baseline's.
Target: neither more than 5% below (>= 0.95x).
Writes ``tests/benchmarks/results/installs.json`` (``--out``), which
``report.py`` turns into a section.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
if str(Path(__file__).resolve().parent) not in sys.path:  # the benchmarks' modules, as report.py imports them
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg  # noqa: E402
from bench_endurance import checkout_commit, write_json  # noqa: E402
from bench_primitives import (  # noqa: E402
    BREAKDOWN_SQL,
    DURABLE,
    LEASE_FLOOR_TABLE,
    Rate,
    ServerCpu,
    Settings,
    alternate,
    setup_rate_limits,
)

from pgbroker import install  # noqa: E402
from pgbroker._embedded import EmbeddedPostgres  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEFAULT_OUT = HERE / "results" / "installs.json"
TARGET = 0.95
# (label, cycle, its floor, processes, needs this checkout's Python layer)
CALLS = [
    ("lease claim + release (bench_lease), 1 proc", "lease", "lease_floor", 1, False),
    ("lock acquire + release, SQL functions, 1 proc", "lock", "lock_floor", 1, False),
    ("lock acquire + release, Python Lock, 1 proc", "py_lock", "lock_floor", 1, True),
    ("lock acquire + release, SQL functions, 8 proc", "lock", "lock_floor", 8, False),
    ("semaphore limit 4, retry '0', 8 proc", "sem_try", "sem_floor", 8, False),
    ("counter_add, 1 proc", "counter", "counter_floor", 1, False),
    ("kv_set compare-and-set, 1 proc", "kv", "kv_floor", 1, False),
    ("rate_limit, one name, 1 proc", "rl", "rl_floor", 1, False),
    ("rate_limit, 1,000 names, 1 proc", "rl_keys", "rl_floor_keys", 1, False),
]


@dataclass
class Install:
    name: str
    db: str
    owner_url: str  # who installed it (and makes the floors' tables)
    caller_url: str  # who calls it
    python_layer: bool  # this checkout's Python layer matches its schema


def _floors(install_: Install) -> None:
    """The floors' tables in the install's database, owned by its installer and usable by its caller."""
    with psycopg.connect(install_.owner_url, autocommit=True) as conn:
        conn.execute(BREAKDOWN_SQL)
        conn.execute(LEASE_FLOOR_TABLE)
    setup_rate_limits(install_.owner_url)
    with psycopg.connect(install_.owner_url, autocommit=True) as conn:
        caller = conn.execute("SELECT %s::text", (psycopg.conninfo.conninfo_to_dict(install_.caller_url)["user"],))
        role = caller.fetchone()[0]
        if role != conn.info.user:
            conn.execute(f'GRANT ALL ON ALL TABLES IN SCHEMA public TO "{role}"')


def _install_revision(revision: str, url: str) -> str:
    """Install the tree of git revision REVISION into URL, by that tree's own pgbroker.install; its commit."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{revision}^{{commit}}"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="pgbroker-baseline-") as tree:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
        code = (
            "import sys; sys.path.insert(0, sys.argv[1]); import pgbroker;"
            " assert pgbroker.__file__.startswith(sys.argv[1]), pgbroker.__file__;"
            " from pgbroker import install; install.migrate(sys.argv[2])"
        )
        subprocess.run([sys.executable, "-c", code, tree, url], check=True, cwd=tree)
    return commit


def make_installs(server: EmbeddedPostgres, baseline: str | None) -> tuple[list[Install], str | None]:
    with psycopg.connect(server.url, autocommit=True) as su:
        su.execute("CREATE DATABASE bench_su")
        su.execute("CREATE ROLE bench_installer LOGIN CREATEDB CREATEROLE")
        su.execute("CREATE DATABASE bench_lp OWNER bench_installer")
    installs = [Install("superuser", "bench_su", server.url_for("bench_su"), server.url_for("bench_su"), True)]
    install.migrate(installs[0].owner_url)
    installer = server.url_for("bench_lp", user="bench_installer")
    install.migrate(installer)
    with psycopg.connect(installer, autocommit=True) as conn:
        conn.execute("CREATE ROLE bench_caller LOGIN")
        conn.execute("GRANT pgbroker_broker, pgbroker_user TO bench_caller")
    installs.append(
        Install("least privilege", "bench_lp", installer, server.url_for("bench_lp", user="bench_caller"), True)
    )
    commit = None
    if baseline is not None:
        with psycopg.connect(server.url, autocommit=True) as su:
            su.execute("CREATE DATABASE bench_base")
        url = server.url_for("bench_base")
        commit = _install_revision(baseline, url)
        installs.append(Install(f"baseline {commit[:10]}", "bench_base", url, url, False))
    for each in installs:
        _floors(each)
    return installs, commit


def _cell(rate: Rate, floor: Rate) -> dict[str, float]:
    return {
        "per_second": rate.per_second,
        "cpu_us": rate.cpu_us,
        "floor_per_second": floor.per_second,
        "floor_cpu_us": floor.cpu_us,
        "ratio": rate.per_second / floor.per_second,
    }


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per call: the least-privilege install's ratio against the superuser install's (not slower than a
    superuser's), and the superuser install's (this tree) against the baseline's (not slower than before)."""
    out = []
    for row in result["rows"]:
        cells = row["installs"]
        su = cells["superuser"]["ratio"]
        for name, cell in cells.items():
            if name == "superuser":
                continue
            if name.startswith("baseline"):
                target, value = f"{row['call']}: this tree / {name}", su / cell["ratio"]
            else:
                target, value = f"{row['call']}: {name} / superuser", cell["ratio"] / su
            out.append({"target": target, "install": name, "call": row["call"], "value": value,
                        "limit": TARGET, "ok": value >= TARGET})  # fmt: skip
    return out


def run(cfg: Settings, baseline: str | None = None, out: Path = DEFAULT_OUT) -> dict[str, Any]:
    started = time.monotonic()
    result: dict[str, Any] = {
        "settings": {"seconds": cfg.seconds, "rounds": cfg.rounds}, "target": TARGET, "rows": [],
        "commit": checkout_commit(),
    }  # fmt: skip
    with EmbeddedPostgres(postgres_options=DURABLE) as server:
        installs, commit = make_installs(server, baseline)
        result["installs"] = [i.name for i in installs]
        result["baseline"] = commit
        server_cpu = ServerCpu(int((server.datadir / "postmaster.pid").read_text().split()[0]))
        with psycopg.connect(server.url) as conn:
            result["server"] = conn.execute("SHOW server_version").fetchone()[0]
        result["load_start"] = os.getloadavg()
        for label, cycle, floor, procs, python_layer in CALLS:
            measured = [i for i in installs if i.python_layer or not python_layer]
            kinds = [k for _ in measured for k in (cycle, floor)]
            urls = [i.caller_url for i in measured for _ in (cycle, floor)]
            rates = alternate(kinds, urls, procs, cfg, server_cpu)
            cells = {i.name: _cell(rates[2 * n], rates[2 * n + 1]) for n, i in enumerate(measured)}
            row = {"call": label, "procs": procs, "installs": cells}
            result["rows"].append(row)
            print(
                f"  {label}: "
                + "; ".join(
                    f"{name} {c['ratio']:.2f}x of its floor ({c['cpu_us']:,.0f} us CPU/op)" for name, c in cells.items()
                ),
                flush=True,
            )
        result["load_end"] = os.getloadavg()
    result["verdicts"] = verdicts(result)
    result["seconds"] = time.monotonic() - started
    missed = [v["target"] for v in result["verdicts"] if not v["ok"]]
    print(f"whole run {result['seconds']:.0f} s; targets missed: {', '.join(missed) or 'none'}")
    return write_json(out, result)


def test_bench_installs(tmp_path: Path) -> None:
    """pytest entry point (tests/benchmarks is ignored by the default run): every install measured, every call."""
    result = run(Settings.quick(), out=tmp_path / "installs.json")
    assert len(result["rows"]) == len(CALLS)
    assert all(c["per_second"] > 0 for row in result["rows"] for c in row["installs"].values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter rounds (a smoke test, noisier figures)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds per variant (default 4)")
    parser.add_argument("--baseline", metavar="REV", help="also install git revision REV's tree, and compare")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the JSON file (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    cfg = Settings.quick() if args.quick else Settings(rounds=args.rounds)
    run(cfg, args.baseline, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
