"""Benchmark of client churn at size (issue 45; run on demand).

    python tests/benchmarks/bench_churn.py [--minutes 5] [--out tests/benchmarks/results/churn.json]

Starts its own throwaway PostgreSQL with fsync, synchronous_commit and
full_page_writes ON, installs pgbroker, and measures:

a) client_unregister of a client with 10 subscriptions (median of 20
   autocommit calls, wall time and the server backend's CPU), just after a
   bulk ``client_register_many`` / ``subscribe_many`` with no ANALYZE
   (autovacuum off on pgbroker's tables so that the statistics stay stale):
   at 1,000 x 10, at 30,000 x 10, and at 30,000 x 10 with 100,000 outbox rows
   pending.  Targets: 30,000 x 10 at most 2x 1,000 x 10; with the backlog at
   most 2x without; under 2 ms everywhere.
b) mass departure: ``client_unregister_many`` of 10,000 of those clients in
   one call, the 100,000 rows still pending.  Target: under 1 s.
c) churn: in a new database, 30,000 clients x 10 subscriptions loaded with
   ``client_register_many`` / ``subscribe_many`` and no ANALYZE (autovacuum
   on, as in production), then for ``--minutes`` a writer updating subscribed
   rows, the broker draining (fetch with ack), and 200 clients a second
   leaving and coming back (unregister, register, subscribe_many of 10, read
   the 10 rows), from another session passing the epoch.  Per minute: the
   registry calls' p50 / p99, the delivery p99 (a change's statement start to
   its row fetched), the churning backends' CPU per registry call.  Then a
   mass departure of 10,000 clients.  Targets: registry p99 under 10 ms,
   delivery p99 under 20 ms, the mass departure under 1 s.

Writes the figures to ``--out`` (JSON), which ``report.py --on-demand`` turns
into the report's "Churn" section.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psycopg  # noqa: E402

from pgbroker import install  # noqa: E402
from pgbroker._embedded import EmbeddedPostgres  # noqa: E402

DURABLE = (
    "-c fsync=on -c synchronous_commit=on -c full_page_writes=on -c shared_buffers=512MB -c max_wal_size=4GB"
    " -c checkpoint_timeout=30min"
)
LEASE = "churn"
PER_CLIENT = 10
CLIENTS = 30_000
BACKLOG = 100_000
MASS = 10_000
CHURN_RATE = 200  # clients a second leaving and coming back
CHURNERS = 2  # sessions churning, CHURN_RATE / CHURNERS each
WRITE_RATE = 200  # single-row UPDATEs a second
SAMPLES = 20
TABLES = ("client", "subscription", "interest", "outbox", "outbox_departed")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "churn.json"
TARGETS = {"size_ratio": 2.0, "backlog_ratio": 2.0, "unregister_ms": 2.0, "mass_s": 1.0, "registry_p99_ms": 10.0,
           "delivery_p99_ms": 20.0}  # fmt: skip


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pid(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT pg_backend_pid()").fetchone()[0]


def _keys(i: int, rows: int) -> list[int]:
    return [(i * PER_CLIENT + j) % rows for j in range(PER_CLIENT)]


def load(conn: psycopg.Connection, first: int, last: int, rows: int) -> None:
    """Clients c<first>..c<last - 1> with 10 subscriptions each (each row of initech.objects: 10 subscribers)."""
    ids = [f"c{i}" for i in range(first, last)]
    for s in range(0, len(ids), 10_000):
        conn.execute("SELECT pgbroker.client_register_many(%s::text[], name => %s)", (ids[s : s + 10_000], LEASE))
    pairs = [(f"c{i}", k) for i in range(first, last) for k in _keys(i, rows)]
    for s in range(0, len(pairs), 10_000):
        batch = pairs[s : s + 10_000]
        conn.execute(
            "SELECT pgbroker.subscribe_many(%s::text[], 'initech.objects', %s::jsonb[], name => %s)",
            ([p[0] for p in batch], [json.dumps(p[1]) for p in batch], LEASE),
        )


def backlog(conn: psycopg.Connection, rows: int) -> int:
    for _ in range(BACKLOG // 25_000):
        conn.execute("UPDATE initech.objects SET name = md5(random()::text) WHERE id < 25000")
    return conn.execute("SELECT count(*) FROM pgbroker.outbox WHERE name = %s", (LEASE,)).fetchone()[0]


def unregisters(conn: psycopg.Connection, ids: list[str]) -> dict[str, float]:
    """Median wall time and mean server CPU of one client_unregister, over ids."""
    pid = _pid(conn)
    times = []
    cpu = _cpu_s(pid)
    for client_id in ids:
        t = time.perf_counter()
        assert conn.execute("SELECT pgbroker.client_unregister(%s, name => %s)", (client_id, LEASE)).fetchone()[0]
        times.append(time.perf_counter() - t)
    return {"ms": statistics.median(times) * 1000, "cpu_ms": (_cpu_s(pid) - cpu) / len(ids) * 1000}


def mass_departure(conn: psycopg.Connection, ids: list[str]) -> dict[str, float]:
    pid = _pid(conn)
    cpu = _cpu_s(pid)
    t = time.perf_counter()
    gone = conn.execute("SELECT pgbroker.client_unregister_many(%s::text[], name => %s)", (ids, LEASE)).fetchone()[0]
    wall = time.perf_counter() - t
    assert gone == len(ids), gone
    return {"clients": len(ids), "s": wall, "cpu_s": _cpu_s(pid) - cpu}


def micro(url: str) -> dict[str, Any]:
    """a) and b), in one database whose pgbroker tables keep the statistics of before the loads."""
    with psycopg.connect(url, autocommit=True) as conn:
        for table in TABLES:
            conn.execute(f"ALTER TABLE pgbroker.{table} SET (autovacuum_enabled = off)")
        conn.execute("INSERT INTO initech.objects (id) SELECT g FROM generate_series(0, %s) g", (CLIENTS - 1,))
        conn.execute("SELECT pgbroker.broker_claim(%s)", (LEASE,))
        load(conn, 0, 1_000, 1_000)
        conn.execute("SELECT pgbroker.client_unregister('c999', name => %s)", (LEASE,))  # plans cached
        used = [f"c{i}" for i in range(0, 40 * SAMPLES, 40)]
        small = unregisters(conn, used)
        load(conn, 1_000, CLIENTS, CLIENTS)
        ids = [f"c{i}" for i in range(1_001, CLIENTS, CLIENTS // SAMPLES)]
        large = unregisters(conn, ids)
        pending = backlog(conn, CLIENTS)
        ids2 = [f"c{i}" for i in range(1_002, CLIENTS, CLIENTS // SAMPLES)]
        with_backlog = unregisters(conn, ids2)
        gone = {*used, *ids, *ids2}
        left = [c for c in (f"c{i}" for i in range(1_003, CLIENTS)) if c not in gone][:MASS]
        mass = mass_departure(conn, left)
        mass["pending"] = conn.execute("SELECT count(*) FROM pgbroker.outbox WHERE name = %s", (LEASE,)).fetchone()[0]
        conn.execute("SELECT pgbroker.broker_release(%s)", (LEASE,))
    return {"small": small, "large": large, "backlog": with_backlog, "pending": pending, "mass": mass}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def churn(url: str, minutes: float) -> dict[str, Any]:
    """c): the churn run, minute by minute, then the mass departure."""
    stop = threading.Event()
    lock = threading.Lock()
    registry: list[tuple[float, float]] = []  # (when, seconds) per registry call
    delivery: list[tuple[float, float]] = []  # (when, seconds) per fetched row
    errors: list[str] = []
    broker = psycopg.connect(url, autocommit=True, application_name="broker")
    setup = psycopg.connect(url, autocommit=True)
    setup.execute("INSERT INTO initech.objects (id) SELECT g FROM generate_series(0, %s) g", (CLIENTS - 1,))
    epoch = broker.execute("SELECT pgbroker.broker_claim(%s)", (LEASE,)).fetchone()[0]
    load(broker, 0, CLIENTS, CLIENTS)  # the restart: no ANALYZE after it
    broker.execute("SELECT pgbroker.broker_wake(%s)", (LEASE,))
    start = time.monotonic()

    def drain() -> None:
        ack: list[int] | None = None
        while not stop.is_set():
            rows = broker.execute(
                "SELECT id, clock_timestamp() - at FROM pgbroker.outbox_fetch(%s, 1000, %s)", (LEASE, ack)
            ).fetchall()
            now = time.monotonic()
            with lock:
                delivery.extend((now, r[1].total_seconds()) for r in rows)
            ack = [r[0] for r in rows] or None
            if not rows:
                time.sleep(0.002)

    def write() -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            rng = random.Random(1)
            while not stop.is_set():
                t = time.monotonic()
                conn.execute("UPDATE initech.objects SET name = md5(random()::text) WHERE id = %s",
                             (rng.randrange(CLIENTS),))  # fmt: skip
                time.sleep(max(0.0, 1 / WRITE_RATE - (time.monotonic() - t)))

    cpu: list[float] = [0.0] * CHURNERS
    calls: list[int] = [0] * CHURNERS

    def churner(k: int) -> None:
        rng = random.Random(100 + k)
        with psycopg.connect(url, autocommit=True, application_name=f"churn{k}") as conn:
            pid = _pid(conn)
            c0 = _cpu_s(pid)
            period = CHURNERS / CHURN_RATE
            next_at = time.monotonic()
            while not stop.is_set():
                i = rng.randrange(k, CLIENTS, CHURNERS)
                cid = f"c{i}"
                keys = _keys(i, CLIENTS)
                steps = [
                    ("SELECT pgbroker.client_unregister(%s, name => %s, epoch => %s)", (cid, LEASE, epoch)),
                    ("SELECT pgbroker.client_register(%s, name => %s, epoch => %s)", (cid, LEASE, epoch)),
                    ("SELECT pgbroker.subscribe_many(%s::text[], 'initech.objects', %s::jsonb[], name => %s,"
                     " epoch => %s)", ([cid] * PER_CLIENT, [json.dumps(x) for x in keys], LEASE, epoch)),
                ]  # fmt: skip
                try:
                    for sql, params in steps:
                        t = time.perf_counter()
                        conn.execute(sql, params).fetchone()
                        with lock:
                            registry.append((time.monotonic(), time.perf_counter() - t))
                        calls[k] += 1
                    conn.execute("SELECT id, name FROM initech.objects WHERE id = ANY (%s)", (keys,)).fetchall()
                except psycopg.Error as exc:  # counted, and the run goes on
                    errors.append(f"{type(exc).__name__}: {exc}")
                cpu[k] = _cpu_s(pid) - c0
                next_at += period
                time.sleep(max(0.0, next_at - time.monotonic()))

    threads = [threading.Thread(target=drain), threading.Thread(target=write)]
    threads += [threading.Thread(target=churner, args=(k,)) for k in range(CHURNERS)]
    for t in threads:
        t.start()
    per_minute = []
    minute_cpu, minute_calls = 0.0, 0
    for m in range(int(minutes * 60 // 60) or 1):
        time.sleep(min(60.0, minutes * 60))
        end = time.monotonic()
        lo = start + m * 60
        with lock:
            reg = [s for w, s in registry if lo <= w < end]
            dlv = [s for w, s in delivery if lo <= w < end]
        c, n = sum(cpu), sum(calls)
        per_minute.append({
            "minute": m + 1, "registry_calls": len(reg), "registry_p50_ms": _pct(reg, 0.5) * 1000,
            "registry_p99_ms": _pct(reg, 0.99) * 1000, "delivered": len(dlv), "delivery_p99_ms": _pct(dlv, 0.99) * 1000,
            "cpu_per_call_ms": (c - minute_cpu) / max(1, n - minute_calls) * 1000,
        })  # fmt: skip
        minute_cpu, minute_calls = c, n
        print(f"minute {m + 1}: {per_minute[-1]}", flush=True)
    stop.set()
    for t in threads:
        t.join(30)
    ids = [f"c{i}" for i in range(0, CLIENTS, CLIENTS // MASS)][:MASS]
    pending = broker.execute("SELECT count(*) FROM pgbroker.outbox WHERE name = %s", (LEASE,)).fetchone()[0]
    mass = mass_departure(broker, ids)
    mass["pending"] = pending
    broker.close()
    setup.close()
    return {"minutes": per_minute, "mass": mass, "errors": len(errors), "first_errors": errors[:3]}


def verdicts(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the issue: name, value, target, met."""
    m = data["micro"]
    out = [
        ("unregister at 30,000 x 10 over 1,000 x 10", m["large"]["ms"] / m["small"]["ms"], TARGETS["size_ratio"]),
        ("unregister with 100,000 pending over none", m["backlog"]["ms"] / m["large"]["ms"], TARGETS["backlog_ratio"]),
        ("unregister, slowest median (ms)", max(m[k]["ms"] for k in ("small", "large", "backlog")),
         TARGETS["unregister_ms"]),
        ("mass departure of 10,000, 100,000 pending (s)", m["mass"]["s"], TARGETS["mass_s"]),
        ("churn: mass departure of 10,000 (s)", data["churn"]["mass"]["s"], TARGETS["mass_s"]),
        ("churn: worst minute's registry p99 (ms)", max(x["registry_p99_ms"] for x in data["churn"]["minutes"]),
         TARGETS["registry_p99_ms"]),
        ("churn: worst minute's delivery p99 (ms)", max(x["delivery_p99_ms"] for x in data["churn"]["minutes"]),
         TARGETS["delivery_p99_ms"]),
    ]  # fmt: skip
    return [{"name": n, "value": v, "target": t, "met": v < t or (t == 2.0 and v <= t)} for n, v, t in out]


def run(minutes: float) -> dict[str, Any]:
    with EmbeddedPostgres(postgres_options=DURABLE) as server:
        with psycopg.connect(server.url, autocommit=True) as admin:
            admin.execute("CREATE DATABASE micro")
            admin.execute("CREATE DATABASE churn")
            version = admin.execute("SHOW server_version").fetchone()[0]
        install.migrate(server.url_for("micro"))
        install.migrate(server.url_for("churn"))
        data: dict[str, Any] = {"server": version, "cpus": os.cpu_count(), "load_start": os.getloadavg()}
        data["micro"] = micro(server.url_for("micro"))
        print("micro:", data["micro"], flush=True)
        data["churn"] = churn(server.url_for("churn"), minutes)
    data["load_end"] = os.getloadavg()
    data["settings"] = {"clients": CLIENTS, "per_client": PER_CLIENT, "backlog": BACKLOG, "churn_rate": CHURN_RATE,
                        "write_rate": WRITE_RATE, "minutes": minutes}  # fmt: skip
    data["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        data["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        check=True, cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    data["verdicts"] = verdicts(data)
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="length of the churn run (default 5)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the JSON results")
    args = parser.parse_args()
    data = run(args.minutes)
    for v in data["verdicts"]:
        print(f"{v['name']}: {v['value']:.3f} (target {v['target']}) {'met' if v['met'] else 'MISSED'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
