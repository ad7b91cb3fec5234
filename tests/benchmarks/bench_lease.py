"""Benchmark of the broker lease against raw advisory-lock floors (run on demand).

    python tests/benchmarks/bench_lease.py
    python -m pytest tests/benchmarks -s -p no:cacheprovider

Starts its own throwaway PostgreSQL with fsync, synchronous_commit and
full_page_writes ON (the test fixtures turn them off), installs pgbroker with
its migrations, and measures, in the same run:

a) claim+release cycles per second for one client, autocommit:
   ``broker_claim('bench')`` then ``broker_release('bench')``, against a floor
   done in plain SQL: ``pg_try_advisory_lock(1,1)``, an UPDATE of a lease row,
   ``pg_advisory_unlock(1,1)``.  Rounds alternate to spread noise; with
   psycopg, and with pgbench when it is installed.  Target: pgbroker's time per
   cycle within 1.3x of the floor's.
b) takeover latency: a holder process holds the lease, a waiter is blocked in
   ``broker_claim(wait => NULL)``; the holder gets SIGKILL; time from the kill
   to the waiter's claim returning.  Floor: a waiter blocked in
   ``pg_advisory_lock(1,2)``.  Target: p95 under 50 ms.  Meanwhile an
   observer (``pgbroker.observe``, on a connection of its own) waits for the
   lease event; its delay from the waiter's claim returning to the event in
   its hands (both clocks are this process's monotonic clock).  Target: p99
   under 10 ms.

Loopback only; bounded in count and time (about a minute).  Prints a table.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psycopg  # noqa: E402

from pgbroker import install, observe  # noqa: E402
from pgbroker._embedded import EmbeddedPostgres, find_pg_bin  # noqa: E402

DURABLE = "-c fsync=on -c synchronous_commit=on -c full_page_writes=on"
CYCLE_ROUNDS = 3  # alternating rounds per variant
CYCLE_SECONDS = 1.5  # per round and variant
PGBENCH_ROUNDS = 2
PGBENCH_SECONDS = 2
TAKEOVERS = 30  # per variant
TAKEOVER_BUDGET = 60.0  # seconds for all takeovers together
CYCLE_TARGET = 1.3
TAKEOVER_P95_TARGET_MS = 50.0
OBSERVER_P99_TARGET_MS = 10.0

CLAIM = "SELECT pgbroker.broker_claim('bench')"
RELEASE = "SELECT pgbroker.broker_release('bench')"
FLOOR_LOCK = "SELECT pg_try_advisory_lock(1, 1)"
FLOOR_UPDATE = (
    "UPDATE bench_lease SET epoch = epoch + 1, holder_pid = pg_backend_pid(), claimed_at = now() WHERE name = 'bench'"
)
FLOOR_UNLOCK = "SELECT pg_advisory_unlock(1, 1)"

# The holder: claim, say which backend holds it, then sit idle until killed.
HOLDER = """
import sys, time, psycopg
conn = psycopg.connect(sys.argv[1], autocommit=True)
conn.execute(sys.argv[2])
print(conn.info.backend_pid, flush=True)
time.sleep(600)
"""


@dataclass
class Results:
    rows: list[tuple[str, str, str, str, str]] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)

    def add(self, metric: str, ours: str, floor: str, ratio: str, target: str) -> None:
        self.rows.append((metric, ours, floor, ratio, target))

    def table(self) -> str:
        header = ("metric", "pgbroker", "floor", "ratio", "target")
        widths = [max(len(r[i]) for r in [header, *self.rows]) for i in range(5)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *self.rows]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# a) claim+release cycles


def _pgbroker_cycle(conn: psycopg.Connection) -> None:
    conn.execute(CLAIM)
    conn.execute(RELEASE)


def _floor_cycle(conn: psycopg.Connection) -> None:
    conn.execute(FLOOR_LOCK)
    conn.execute(FLOOR_UPDATE)
    conn.execute(FLOOR_UNLOCK)


Cycle = Callable[[psycopg.Connection], None]


def _run_for(conn: psycopg.Connection, cycle: Cycle, seconds: float) -> tuple[int, float]:
    n = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        cycle(conn)
        n += 1
    return n, time.perf_counter() - start


def bench_cycles(url: str) -> tuple[float, float]:
    """Cycles per second (pgbroker, floor), alternating rounds on one connection each."""
    with psycopg.connect(url, autocommit=True) as ours, psycopg.connect(url, autocommit=True) as floor:
        # Sanity and warm-up (also lets psycopg prepare the statements).
        first = ours.execute(CLAIM).fetchone()[0]
        assert ours.execute(RELEASE).fetchone()[0] is True
        assert ours.execute(CLAIM).fetchone()[0] == first + 1
        ours.execute(RELEASE)
        assert floor.execute(FLOOR_LOCK).fetchone()[0] is True
        assert floor.execute(FLOOR_UPDATE).rowcount == 1
        assert floor.execute(FLOOR_UNLOCK).fetchone()[0] is True
        _run_for(ours, _pgbroker_cycle, 0.3)
        _run_for(floor, _floor_cycle, 0.3)
        totals = {"ours": [0, 0.0], "floor": [0, 0.0]}
        for i in range(CYCLE_ROUNDS):
            order = [("ours", ours, _pgbroker_cycle), ("floor", floor, _floor_cycle)]
            for key, conn, cycle in order if i % 2 == 0 else reversed(order):
                n, elapsed = _run_for(conn, cycle, CYCLE_SECONDS)
                totals[key][0] += n
                totals[key][1] += elapsed
    return totals["ours"][0] / totals["ours"][1], totals["floor"][0] / totals["floor"][1]


def _pgbench() -> str | None:
    beside = find_pg_bin() / "pgbench"
    return str(beside) if beside.exists() else shutil.which("pgbench")


def bench_pgbench(server: EmbeddedPostgres, dbname: str) -> tuple[float, float] | None:
    """The same two cycles driven by pgbench (one client, simple protocol): (pgbroker, floor) per second."""
    pgbench = _pgbench()
    if pgbench is None:
        return None
    with tempfile.TemporaryDirectory(prefix="pgbroker-bench-") as tmp:
        scripts = {
            "ours": Path(tmp, "ours.sql"),
            "floor": Path(tmp, "floor.sql"),
        }
        scripts["ours"].write_text(f"{CLAIM};\n{RELEASE};\n")
        scripts["floor"].write_text(f"{FLOOR_LOCK};\n{FLOOR_UPDATE};\n{FLOOR_UNLOCK};\n")
        tps: dict[str, list[float]] = {"ours": [], "floor": []}
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        for i in range(PGBENCH_ROUNDS):
            keys = ["ours", "floor"] if i % 2 == 0 else ["floor", "ours"]
            for key in keys:
                cmd = [pgbench, "-n", "-c", "1", "-T", str(PGBENCH_SECONDS), "-f", str(scripts[key])]
                cmd += ["-h", server.host, "-p", str(server.port), "-U", "postgres", dbname]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
                match = re.search(r"tps = ([0-9.]+)", out.stdout)
                if out.returncode != 0 or match is None:
                    print(f"pgbench failed ({key}):\n{out.stdout}\n{out.stderr}", file=sys.stderr)
                    return None
                tps[key].append(float(match.group(1)))
    return statistics.fmean(tps["ours"]), statistics.fmean(tps["floor"])


# ---------------------------------------------------------------------------
# b) takeover latency after SIGKILL of the holder


def _wait_until_blocked(monitor: psycopg.Connection, pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        blocked = monitor.execute(
            "SELECT EXISTS (SELECT FROM pg_locks WHERE pid = %s AND locktype = 'advisory' AND NOT granted)", (pid,)
        ).fetchone()[0]
        if blocked:
            return
        time.sleep(0.002)
    raise TimeoutError(f"waiter pid {pid} never blocked on the lock")


class Observer:
    """pgbroker.observe() of the lease 'takeover' in a thread: the monotonic time each claim event arrived."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True)
        self.claims: dict[int, float] = {}
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _run(self) -> None:
        try:
            for state in observe(self.conn, "takeover", poll_interval=0.5):
                self.ready.set()
                if state.event == "claim":
                    self.claims[state.epoch] = time.monotonic()
        except psycopg.Error:
            pass  # closed at the end

    def heard(self, epoch: int, timeout: float = 5.0) -> float:
        deadline = time.monotonic() + timeout
        while epoch not in self.claims and time.monotonic() < deadline:
            time.sleep(0.0005)
        return self.claims[epoch]

    def close(self) -> None:
        self.conn.close()


def _one_takeover(
    url: str, waiter: psycopg.Connection, monitor: psycopg.Connection, hold: str, wait: str,
    observer: Observer | None = None, delays: list[float] | None = None,
) -> float:  # fmt: skip
    """Seconds from SIGKILL of a holder process to the blocked waiter's call returning (and, with an observer,
    the delay from that return to the observer's event, appended to ``delays``)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, url, hold], stdout=subprocess.PIPE, text=True)
    try:
        line = holder.stdout.readline() if holder.stdout else ""
        if not line.strip():
            raise RuntimeError("holder process did not claim")
        done: dict[str, object] = {}

        def block() -> None:
            try:
                done["value"] = waiter.execute(wait).fetchone()[0]
                done["at"] = time.perf_counter()
                done["mono"] = time.monotonic()
            except BaseException as exc:  # reported by the main thread
                done["error"] = exc

        thread = threading.Thread(target=block, daemon=True)
        thread.start()
        _wait_until_blocked(monitor, waiter.info.backend_pid)
        killed_at = time.perf_counter()
        os.kill(holder.pid, signal.SIGKILL)
        thread.join(30)
        if "error" in done:
            raise done["error"]  # type: ignore[misc]
        if "at" not in done:
            raise TimeoutError("the waiter did not get the lock within 30 s of the holder's death")
        if observer is not None and delays is not None:
            delays.append(observer.heard(int(done["value"])) - float(done["mono"]))  # type: ignore[arg-type]
        return float(done["at"]) - killed_at  # type: ignore[arg-type]
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()
        if holder.stdout:
            holder.stdout.close()


def bench_takeover(url: str) -> tuple[list[float], list[float], list[float]]:
    """Takeover latencies in seconds: (pgbroker, floor, the observer's delay after pgbroker's), alternating."""
    ours: list[float] = []
    floor: list[float] = []
    heard: list[float] = []
    variants = [
        (ours, "SELECT pgbroker.broker_claim('takeover')", "SELECT pgbroker.broker_claim('takeover', wait => NULL)",
         "SELECT pgbroker.broker_release('takeover')"),
        (floor, "SELECT pg_advisory_lock(1, 2)", "SELECT pg_advisory_lock(1, 2)", "SELECT pg_advisory_unlock(1, 2)"),
    ]  # fmt: skip
    budget_end = time.monotonic() + TAKEOVER_BUDGET
    observer = Observer(url)
    try:
        with psycopg.connect(url, autocommit=True) as waiter, psycopg.connect(url, autocommit=True) as monitor:
            for _ in range(TAKEOVERS):
                if time.monotonic() > budget_end:
                    break
                for samples, hold, wait, release in variants:
                    watching = samples is ours
                    samples.append(_one_takeover(url, waiter, monitor, hold, wait, observer if watching else None,
                                                 heard if watching else None))  # fmt: skip
                    waiter.execute(release)
    finally:
        observer.close()
    return ours, floor, heard


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


# ---------------------------------------------------------------------------


def run() -> Results:
    results = Results()
    started = time.monotonic()
    with EmbeddedPostgres(postgres_options=DURABLE) as server:
        with psycopg.connect(server.url, autocommit=True) as admin:
            admin.execute("CREATE DATABASE bench")
        url = server.url_for("bench")
        install.migrate(url)
        with psycopg.connect(url, autocommit=True) as conn:
            settings = {
                name: conn.execute(f"SHOW {name}").fetchone()[0]
                for name in ("server_version", "fsync", "synchronous_commit", "full_page_writes")
            }
            conn.execute(
                "CREATE TABLE bench_lease (name text PRIMARY KEY, epoch bigint NOT NULL, holder_pid integer,"
                " claimed_at timestamptz)"
            )
            conn.execute("INSERT INTO bench_lease VALUES ('bench', 0, NULL, NULL)")
        print(
            "server: PostgreSQL {server_version}, fsync={fsync}, synchronous_commit={synchronous_commit}, "
            "full_page_writes={full_page_writes}".format(**settings)
        )
        assert settings["fsync"] == "on" and settings["synchronous_commit"] == "on", settings

        ours_rate, floor_rate = bench_cycles(url)
        ratio = floor_rate / ours_rate
        results.figures.update(cycle_rate=ours_rate, cycle_floor_rate=floor_rate, cycle_ratio=ratio)
        results.add(
            "claim+release cycles/s (psycopg)",
            f"{ours_rate:,.0f}/s ({1000 / ours_rate:.2f} ms)",
            f"{floor_rate:,.0f}/s ({1000 / floor_rate:.2f} ms)",
            f"{ratio:.2f}x",
            f"<= {CYCLE_TARGET}x {'ok' if ratio <= CYCLE_TARGET else 'MISSED'}",
        )
        by_pgbench = bench_pgbench(server, "bench")
        if by_pgbench is not None:
            ours_tps, floor_tps = by_pgbench
            ratio = floor_tps / ours_tps
            results.figures.update(pgbench_rate=ours_tps, pgbench_floor_rate=floor_tps, pgbench_ratio=ratio)
            results.add(
                "claim+release cycles/s (pgbench)",
                f"{ours_tps:,.0f}/s ({1000 / ours_tps:.2f} ms)",
                f"{floor_tps:,.0f}/s ({1000 / floor_tps:.2f} ms)",
                f"{ratio:.2f}x",
                f"<= {CYCLE_TARGET}x {'ok' if ratio <= CYCLE_TARGET else 'MISSED'}",
            )

        ours, floor, heard = bench_takeover(url)
        for label, q in (("p50", 0.5), ("p95", 0.95), ("max", 1.0)):
            a, b = _percentile(ours, q) * 1000, _percentile(floor, q) * 1000
            results.figures[f"takeover_{label}_ms"] = a
            results.figures[f"takeover_floor_{label}_ms"] = b
            target = ""
            if label == "p95":
                target = f"< {TAKEOVER_P95_TARGET_MS:.0f} ms {'ok' if a < TAKEOVER_P95_TARGET_MS else 'MISSED'}"
            results.add(
                f"takeover after SIGKILL {label} (n={len(ours)})",
                f"{a:.1f} ms",
                f"{b:.1f} ms",
                f"{a / b:.2f}x" if b > 0 else "-",
                target,
            )
        p50, p99 = _percentile(heard, 0.5) * 1000, _percentile(heard, 0.99) * 1000
        results.figures.update(observer_p50_ms=p50, observer_p99_ms=p99)
        ok = p99 < OBSERVER_P99_TARGET_MS
        results.add(
            f"observer hears of the successor, after its claim returned (n={len(heard)})",
            f"p50 {p50:.2f} ms, p99 {p99:.2f} ms",
            "",
            "",
            f"p99 < {OBSERVER_P99_TARGET_MS:.0f} ms {'ok' if ok else 'MISSED'}",
        )
    results.figures["seconds"] = time.monotonic() - started
    return results


def main() -> int:
    results = run()
    print()
    print(results.table())
    print(f"\n(ratio: pgbroker's time per operation / the floor's; whole run {results.figures['seconds']:.0f} s)")
    return 0


def test_bench_lease() -> None:
    """pytest entry point (tests/benchmarks is ignored by the default run): prints the table."""
    results = run()
    print()
    print(results.table())
    assert results.figures["cycle_rate"] > 0 and results.figures["takeover_p50_ms"] > 0


if __name__ == "__main__":
    sys.exit(main())
