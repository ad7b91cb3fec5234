"""Benchmark of a broker restart at size (run on demand).

    python tests/benchmarks/bench_scale.py [--sizes 1000,10000,30000,100000] [--quick]

Starts its own throwaway PostgreSQL with fsync, synchronous_commit and
full_page_writes ON, installs pgbroker, and for N clients with 10
subscriptions each on ``initech.objects`` (N rows, each subscribed by 10
clients, so that a changed row has the same subscribers at every size)
measures, in the same run:

a) the takeover claim: a holder process with N x 10 subscriptions (and what
   earlier rounds left behind, never swept in between) is SIGKILLed while a
   waiter is blocked in ``broker_claim(wait => NULL)``; time from the kill to
   the claim returning, 3 rounds per size.  Floor: the same with a lease
   that has no state at all.  Target: at 30k x 10, at most 2x the floor.
b) re-registration: every client and subscription again, into a new epoch,
   one autocommit call each (measured on a sample of clients, the total
   extrapolated), and batched with ``client_register_many`` /
   ``subscribe_many`` (10,000 per call) from plain SQL (arrays bound as
   parameters) and through ``Broker.register_many`` / ``subscribe_many``.
   Floor: a plain ``INSERT ... SELECT FROM unnest(...)`` of the same rows, in
   the same batches, into a table with the subscriptions' indexes.  Targets:
   at least 50,000 subscriptions/s, within 3x of the floor.
c) end to end: the holder is SIGKILLed; a Python ``Broker`` waiting to claim
   takes over, registers and subscribes everyone (batched), and an UPDATE of a
   subscribed row is fetched: time from the kill to that row in hand.  The
   new broker's sweeper runs meanwhile, as it does in production.  Target:
   under 10 s at 30k x 10.
d) steady state, after the sweep and a VACUUM: a watched single-row UPDATE
   (1,000 distinct rows a round, 10 subscribers each) and the broker's fetch
   per delivered row, as the CPU time of their server backends (their wall
   time, with ``synchronous_commit = off``, in the notes); their ratio to the
   smallest size.  Target: at 100k x 10, within 1.2x of 1k x 10.  Also the
   on-disk bytes per subscription (clients, subscriptions, interest, with
   their indexes) and the sweep's rows per second.
e) registry events while nobody watches: the test every client and
   subscription call makes (is a watcher registered?), timed in a server-side
   loop against an empty loop, beside what a ``client_register`` call costs
   its backend.  Target: nothing measurable (well under 1% of the call).

Loopback only; bounded in count and time (a few minutes at the default
sizes).  Prints a table, one block per size.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psycopg  # noqa: E402
from psycopg.types.json import Jsonb  # noqa: E402

from pgbroker import Broker, install  # noqa: E402
from pgbroker._embedded import EmbeddedPostgres  # noqa: E402

DURABLE = (
    "-c fsync=on -c synchronous_commit=on -c full_page_writes=on -c shared_buffers=512MB -c max_wal_size=4GB"
    " -c checkpoint_timeout=30min"
)
LEASE = "scale"
PER_CLIENT = 10
BATCH = 10_000
TAKEOVERS = 3
EMPTY_CLAIMS = 10
ONE_CALL_SAMPLE = 500  # clients registered and subscribed one autocommit call each
UPDATES = 1000  # single-row UPDATEs per round (each row once; the same number at every size)
STEADY_ROUNDS = 9
BATCHED_ROUNDS = 3  # alternating rounds of the batched re-registration and its floor (1 at 100k)
TARGET_CLAIM_RATIO = 2.0  # at 30k x 10
TARGET_RATE = 50_000  # subscriptions/s, batched
TARGET_FLOOR_RATIO = 3.0
TARGET_E2E_S = 10.0  # at 30k x 10
TARGET_STEADY_RATIO = 1.2  # at 100k x 10 against 1k x 10

# A holder process: claim, register N clients with 10 subscriptions each (the arrays made by the server), then
# print its pid and epoch and wait to be killed.
HOLDER = """
import sys, time, psycopg
url, lease, n, per = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
conn = psycopg.connect(url, autocommit=True, application_name="bench-holder")
epoch = conn.execute("SELECT pgbroker.broker_claim(%s, wait => NULL)", (lease,)).fetchone()[0]
for lo in range(0, n, 10000):
    hi = min(n, lo + 10000)
    conn.execute("SELECT pgbroker.client_register_many(ARRAY(SELECT 'client-' || i"
                 " FROM generate_series(%s::integer, %s::integer) i), name => %s)", (lo, hi - 1, lease))
    conn.execute("SELECT pgbroker.subscribe_many(ARRAY(SELECT 'client-' || i"
                 " FROM generate_series(%s::integer, %s::integer) i, generate_series(0, %s::integer) j ORDER BY i, j),"
                 " 'initech.objects', ARRAY(SELECT to_jsonb((i + j) %% %s::integer + 1)"
                 " FROM generate_series(%s::integer, %s::integer) i, generate_series(0, %s::integer) j ORDER BY i, j),"
                 " name => %s)", (lo, hi - 1, per - 1, n, lo, hi - 1, per - 1, lease))
print(conn.info.backend_pid, epoch, flush=True)
time.sleep(3600)
"""


@dataclass
class Results:
    rows: list[tuple[str, str, str, str, str]] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    series: dict[str, dict[int, float]] = field(default_factory=dict)

    def add(self, metric: str, ours: str, floor: str, ratio: str, target: str) -> None:
        self.rows.append((metric, ours, floor, ratio, target))

    def point(self, series: str, size: int, value: float) -> None:
        self.series.setdefault(series, {})[size] = value

    def table(self) -> str:
        header = ("metric", "pgbroker", "floor", "ratio", "target")
        widths = [max(len(r[i]) for r in [header, *self.rows]) for i in range(5)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *self.rows]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n // 1000}k x {PER_CLIENT}" if n >= 1000 else f"{n} x {PER_CLIENT}"


def _ids(lo: int, hi: int) -> list[str]:
    return [f"client-{i}" for i in range(lo, hi)]


def _pairs(n: int, lo: int, hi: int) -> tuple[list[str], list[int]]:
    """Client ids and keys of clients lo..hi-1: client i subscribes to rows (i + j) mod n + 1, j < 10."""
    ids, keys = [], []
    for i in range(lo, hi):
        for j in range(PER_CLIENT):
            ids.append(f"client-{i}")
            keys.append((i + j) % n + 1)
    return ids, keys


# ---------------------------------------------------------------------------
# a) takeover


class Holder:
    """A child process that claims LEASE with n clients x 10 subscriptions, then waits to be killed."""

    def __init__(self, url: str, lease: str, n: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, url, lease, str(n), str(PER_CLIENT)], stdout=subprocess.PIPE, text=True
        )
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.strip():
            self.close()
            raise RuntimeError("the holder process did not claim and register")
        pid, epoch = line.split()
        self.backend_pid, self.epoch = int(pid), int(epoch)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


def _wait_until_blocked(monitor: psycopg.Connection, pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if monitor.execute(
            "SELECT EXISTS (SELECT FROM pg_locks WHERE pid = %s AND locktype = 'advisory' AND NOT granted)", (pid,)
        ).fetchone()[0]:
            return
        time.sleep(0.002)
    raise TimeoutError(f"pid {pid} never blocked on the lease")


def _takeover(url: str, lease: str, n: int, waiter: psycopg.Connection, monitor: psycopg.Connection) -> float:
    """Seconds from the SIGKILL of a holder with n x 10 subscriptions to the waiter's claim returning."""
    holder = Holder(url, lease, n)
    try:
        done: dict[str, Any] = {}

        def claim() -> None:
            try:
                done["epoch"] = waiter.execute("SELECT pgbroker.broker_claim(%s, wait => NULL)", (lease,)).fetchone()[0]
                done["at"] = time.perf_counter()
            except BaseException as exc:  # noqa: BLE001  (re-raised below)
                done["error"] = exc

        thread = threading.Thread(target=claim, daemon=True)
        thread.start()
        _wait_until_blocked(monitor, waiter.info.backend_pid)
        killed = time.perf_counter()
        holder.kill()
        thread.join(60)
        if "error" in done:
            raise done["error"]
        if "at" not in done:
            raise TimeoutError("the waiter did not claim within 60 s of the kill")
        assert done["epoch"] > holder.epoch
        return done["at"] - killed
    finally:
        holder.close()
        waiter.execute("SELECT pgbroker.broker_release(%s)", (lease,))


# ---------------------------------------------------------------------------
# b) re-registration


def _one_call_each(conn: psycopg.Connection, n: int, count: int) -> float:
    """Calls per second of register + 10 subscribes, one autocommit call each, for ``count`` clients."""
    ids, keys = _pairs(n, 0, count)
    start = time.perf_counter()
    for cid in _ids(0, count):
        conn.execute("SELECT pgbroker.client_register(%s, name => %s)", (cid, LEASE))
    for cid, key in zip(ids, keys, strict=True):
        conn.execute("SELECT pgbroker.subscribe(%s, 'initech.objects', %s, name => %s)", (cid, Jsonb(key), LEASE))
    return (count + len(ids)) / (time.perf_counter() - start)


# How any client sends the arrays cheaply: the ids as a text[] (binary), the keys as one JSON document made
# into a jsonb[] by the server.  The floor below receives its rows the same way.
JSONB_ARRAY = "ARRAY(SELECT e FROM jsonb_array_elements(%s::jsonb) WITH ORDINALITY AS t(e, i) ORDER BY i)"


def _batched_sql(conn: psycopg.Connection, n: int) -> float:
    """Seconds to register n clients and subscribe n x 10, BATCH per call, arrays bound as parameters."""
    start = time.perf_counter()
    for lo in range(0, n, BATCH):
        conn.execute(
            "SELECT pgbroker.client_register_many(%b::text[], name => %s)", (_ids(lo, min(n, lo + BATCH)), LEASE)
        )
    per_call = BATCH // PER_CLIENT
    for lo in range(0, n, per_call):
        ids, keys = _pairs(n, lo, min(n, lo + per_call))
        conn.execute(
            f"SELECT pgbroker.subscribe_many(%b::text[], 'initech.objects', {JSONB_ARRAY}, name => %s)",
            (ids, Jsonb(keys), LEASE),
        )
    return time.perf_counter() - start


def _batched_python(url: str, n: int) -> tuple[float, float]:
    """(seconds, server backend CPU seconds) for Broker.register_many + subscribe_many of everyone (claim and
    release not counted)."""
    with Broker(url, LEASE, wait=None, sweep=False) as broker:
        assert broker.pid is not None
        cpu, start = _pid_cpu(broker.pid), time.perf_counter()
        broker.register_many(f"client-{i}" for i in range(n))
        broker.subscribe_many(
            ((f"client-{i}", (i + j) % n + 1) for i in range(n) for j in range(PER_CLIENT)), "initech.objects"
        )
        return time.perf_counter() - start, _pid_cpu(broker.pid) - cpu


def _floor_insert(conn: psycopg.Connection, n: int) -> float:
    """Seconds to INSERT ... SELECT FROM unnest() the same n x 10 rows, in the same batches, into a table with
    the subscriptions' index (primary key (client_key, watch_id, row_key))."""
    conn.execute(
        "CREATE TABLE floor_subscription (client_key bigint NOT NULL, watch_id integer NOT NULL,"
        " row_key jsonb NOT NULL, subscribed_at timestamptz NOT NULL DEFAULT clock_timestamp(),"
        " PRIMARY KEY (client_key, watch_id, row_key))"
    )
    per_call = BATCH // PER_CLIENT
    start = time.perf_counter()
    for lo in range(0, n, per_call):
        hi = min(n, lo + per_call)
        client_keys = [i for i in range(lo, hi) for _ in range(PER_CLIENT)]
        keys = [(i + j) % n + 1 for i in range(lo, hi) for j in range(PER_CLIENT)]
        conn.execute(
            "INSERT INTO floor_subscription (client_key, watch_id, row_key)"
            f" SELECT c, 1, k FROM unnest(%b::bigint[], {JSONB_ARRAY}) AS u(c, k)",
            (client_keys, Jsonb(keys)),
        )
    return time.perf_counter() - start


# ---------------------------------------------------------------------------
# c) end to end


def _end_to_end(url: str, n: int, admin: psycopg.Connection, monitor: psycopg.Connection) -> float:
    """Seconds from SIGKILL of the holder to the first change, after everyone re-subscribed, in the new broker's
    hands."""
    holder = Holder(url, LEASE, n)
    broker = Broker(url, LEASE, wait=None, heartbeat_interval=0.5)
    claimed: dict[str, Any] = {}

    def claim() -> None:
        try:
            broker.claim()
        except BaseException as exc:  # noqa: BLE001  (re-raised below)
            claimed["error"] = exc

    try:
        thread = threading.Thread(target=claim, daemon=True)
        thread.start()
        pid = None
        deadline = time.monotonic() + 30
        while pid is None and time.monotonic() < deadline:
            row = monitor.execute(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                " AND classid = 1885823602::oid LIMIT 1"
            ).fetchone()
            pid = row[0] if row else None
            time.sleep(0.002)
        if pid is None:
            raise TimeoutError("the new broker never waited for the lease")
        killed = time.perf_counter()
        holder.kill()
        thread.join(60)
        if "error" in claimed:
            raise claimed["error"]
        broker.register_many(f"client-{i}" for i in range(n))
        broker.subscribe_many(
            ((f"client-{i}", (i + j) % n + 1) for i in range(n) for j in range(PER_CLIENT)), "initech.objects"
        )
        admin.execute("UPDATE initech.objects SET name = 'changed' WHERE id = 1")
        while True:
            rows = broker.fetch()
            if rows:
                assert len(rows[0].clients) == PER_CLIENT, rows[0]
                broker.ack([r.id for r in rows])
                return time.perf_counter() - killed
            time.sleep(0.001)
    finally:
        broker.close()
        holder.close()


# ---------------------------------------------------------------------------
# d) steady state


def _sweep_all(conn: psycopg.Connection) -> tuple[int, float]:
    """(rows, seconds) of sweeping everything earlier epochs left."""
    rows, start = 0, time.perf_counter()
    while done := conn.execute("SELECT pgbroker.broker_sweep(max_rows => 10000)").fetchone()[0]:
        rows += done
    return rows, time.perf_counter() - start


_TICK = os.sysconf("SC_CLK_TCK")


def _backend_cpu(conn: psycopg.Connection) -> float:
    """CPU seconds the server backend of CONN has used."""
    return _pid_cpu(conn.info.backend_pid)


def _pid_cpu(pid: int) -> float:
    """CPU seconds process PID has used: the scheduler's nanosecond count where the kernel shows it
    (/proc/PID/sched), else user + system time in clock ticks (10 ms each: too coarse for a fetch)."""
    try:
        for line in Path(f"/proc/{pid}/sched").read_text().splitlines():
            if line.startswith("se.sum_exec_runtime"):
                return float(line.split(":")[1]) / 1000  # milliseconds
    except OSError:
        pass
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _steady(url: str, n: int, admin: psycopg.Connection) -> tuple[float, float, float, float, float]:
    """With n x 10 subscriptions of the current epoch and nothing left to sweep: (µs of the writer's backend
    CPU per watched single-row UPDATE, µs of the broker's backend CPU per fetched row, bytes per subscription,
    and the same two in wall time).  CPU time is what the statement costs the server; the wall time of a
    statement this short moves with everything else on the machine."""
    with psycopg.connect(url, autocommit=True) as broker, psycopg.connect(url, autocommit=True) as writer:
        broker.execute("SELECT pgbroker.broker_claim(%s, wait => NULL)", (LEASE,))
        _batched_sql(broker, n)
        _sweep_all(admin)
        # Nothing left for autovacuum to do while we measure: every table vacuumed, then a checkpoint.
        admin.execute("VACUUM ANALYZE")
        admin.execute("CHECKPOINT")
        size = admin.execute(
            "SELECT sum(pg_total_relation_size(c)) FROM unnest(ARRAY['pgbroker.client', 'pgbroker.subscription',"
            " 'pgbroker.interest']::regclass[]) c"
        ).fetchone()[0]
        writer.execute("SET synchronous_commit = off")
        rng = random.Random(n)
        update_cpu, fetch_cpu, update_wall, fetch_wall = [], [], [], []
        broker.execute("SELECT pgbroker.broker_wake(%s)", (LEASE,))
        for r in range(STEADY_ROUNDS):
            ids = rng.sample(range(1, n + 1), UPDATES)  # each row once: every UPDATE changes it
            for i in ids[:100]:  # warm the statement's plan and the pages it reads
                writer.execute("UPDATE initech.objects SET name = %s WHERE id = %s", (f"w{r}", i))
            _drain(broker)
            cpu, start = _backend_cpu(writer), time.perf_counter()
            for i in ids:
                writer.execute("UPDATE initech.objects SET name = %s WHERE id = %s", (f"v{r}", i))
            update_wall.append((time.perf_counter() - start) / len(ids) * 1e6)
            update_cpu.append((_backend_cpu(writer) - cpu) / len(ids) * 1e6)
            cpu, start = _backend_cpu(broker), time.perf_counter()
            rows = _drain(broker)
            fetch_wall.append((time.perf_counter() - start) / rows * 1e6)
            fetch_cpu.append((_backend_cpu(broker) - cpu) / rows * 1e6)
            assert rows == len(ids), (rows, len(ids))
        broker.execute("SELECT pgbroker.broker_release(%s)", (LEASE,))
    return (statistics.median(update_cpu), statistics.median(fetch_cpu), size / (n * PER_CLIENT),
            statistics.median(update_wall), statistics.median(fetch_wall))  # fmt: skip


def _drain(broker: psycopg.Connection) -> int:
    total, ack = 0, None
    while True:
        ids = [r[0] for r in broker.execute("SELECT id FROM pgbroker.outbox_fetch(%s, 1000, %s)", (LEASE, ack))]
        total += len(ids)
        if not ids:
            return total
        ack = ids


# ---------------------------------------------------------------------------


@dataclass
class Context:
    url: str
    admin: psycopg.Connection
    waiter: psycopg.Connection
    monitor: psycopg.Connection
    empty_ms: float
    quick: bool
    smallest: int
    baseline: dict[str, float] = field(default_factory=dict)


def _verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def _measure(ctx: Context, n: int, results: Results) -> None:
    """Every measurement at n clients x 10 subscriptions."""
    label, admin, waiter = _size(n), ctx.admin, ctx.waiter
    print(f"== {label}", flush=True)
    admin.execute("TRUNCATE initech.objects")
    admin.execute("INSERT INTO initech.objects (id, name) SELECT i, 'row ' || i FROM generate_series(1, %s) i", (n,))
    admin.execute("VACUUM ANALYZE initech.objects")

    # a) takeovers; what each holder registered is left behind (swept only after them all)
    rounds = 1 if ctx.quick else TAKEOVERS
    claim_ms = statistics.median(_takeover(ctx.url, LEASE, n, waiter, ctx.monitor) * 1000 for _ in range(rounds))
    left = admin.execute("SELECT sum(subscriptions) FROM pgbroker.sweep_backlog").fetchone()[0]
    ratio = claim_ms / ctx.empty_ms
    target = f"<= {TARGET_CLAIM_RATIO:g}x {_verdict(ratio <= TARGET_CLAIM_RATIO)}" if n == 30_000 else ""
    results.add(f"{label}: takeover claim after SIGKILL (median of {rounds})", f"{claim_ms:.1f} ms",
                f"{ctx.empty_ms:.1f} ms", f"{ratio:.2f}x", target)  # fmt: skip
    results.point("takeover claim (ms)", n, claim_ms)
    results.point("empty-state claim (ms)", n, ctx.empty_ms)
    swept, sweep_s = _sweep_all(admin)
    results.notes.append(f"{label}: the takeovers left {left:,} subscriptions behind; the sweep deleted {swept:,} rows"
                         f" in {sweep_s:.1f} s ({swept / max(sweep_s, 1e-9):,.0f} rows/s)")  # fmt: skip

    # b) re-registration into a new epoch, each way, and the floor, in alternating rounds (each round re-registers
    # everyone into a new epoch); nothing left for autovacuum meanwhile
    admin.execute("VACUUM ANALYZE")
    admin.execute("CHECKPOINT")
    waiter.execute("SELECT pgbroker.broker_claim(%s, wait => NULL)", (LEASE,))
    sample = min(n, 100 if ctx.quick else ONE_CALL_SAMPLE)
    calls_per_s = _one_call_each(waiter, n, sample)
    waiter.execute("SELECT pgbroker.broker_release(%s)", (LEASE,))
    rounds = 1 if ctx.quick or n > 30_000 else BATCHED_ROUNDS
    timings: dict[str, list[tuple[float, float]]] = {"SQL arrays": [], "Broker.*_many": [], "floor": []}

    def sql_arrays() -> tuple[float, float]:
        waiter.execute("SELECT pgbroker.broker_claim(%s, wait => NULL)", (LEASE,))
        cpu = _backend_cpu(waiter)
        seconds = _batched_sql(waiter, n)
        cpu = _backend_cpu(waiter) - cpu
        waiter.execute("SELECT pgbroker.broker_release(%s)", (LEASE,))
        return seconds, cpu

    def floor() -> tuple[float, float]:
        cpu = _backend_cpu(admin)
        seconds = _floor_insert(admin, n)
        cpu = _backend_cpu(admin) - cpu
        admin.execute("DROP TABLE floor_subscription")
        return seconds, cpu

    plan = [("SQL arrays", sql_arrays), ("Broker.*_many", lambda: _batched_python(ctx.url, n)), ("floor", floor)]
    for r in range(rounds):
        for how, measure in plan if r % 2 == 0 else reversed(plan):
            timings[how].append(measure())
        admin.execute("VACUUM")
    subs = n * PER_CLIENT
    one_call_s = (n + subs) / calls_per_s
    results.add(f"{label}: register + subscribe, one call each ({sample} clients; total estimated)",
                f"{calls_per_s:,.0f} calls/s ({one_call_s:.0f} s)", "", "", "(info)")  # fmt: skip
    results.point("one call each (calls/s)", n, calls_per_s)
    floor_s = statistics.median(t[0] for t in timings["floor"])
    floor_cpu = statistics.median(t[1] for t in timings["floor"])
    for how in ("SQL arrays", "Broker.*_many"):
        seconds = statistics.median(t[0] for t in timings[how])
        cpu = statistics.median(t[1] for t in timings[how])
        rate, ratio = subs / seconds, seconds / floor_s
        ok = rate >= TARGET_RATE and ratio <= TARGET_FLOOR_RATIO
        target = f">= {TARGET_RATE:,}/s, <= {TARGET_FLOOR_RATIO:g}x {_verdict(ok)}"
        results.add(f"{label}: register + subscribe, batched ({how}, median of {rounds})",
                    f"{rate:,.0f} subs/s ({seconds:.2f} s)", f"{subs / floor_s:,.0f} rows/s ({floor_s:.2f} s)",
                    f"{ratio:.2f}x", target)  # fmt: skip
        results.add("  its server backend CPU per subscription", f"{cpu / subs * 1e6:.1f} us",
                    f"{floor_cpu / subs * 1e6:.1f} us", f"{cpu / floor_cpu:.2f}x", "(info)")  # fmt: skip
        results.point(f"batched, {how} (subs/s)", n, rate)
    results.point("floor INSERT ... SELECT (rows/s)", n, subs / floor_s)
    _sweep_all(admin)

    # c) end to end
    e2e = _end_to_end(ctx.url, n, admin, ctx.monitor)
    target = f"< {TARGET_E2E_S:g} s {_verdict(e2e < TARGET_E2E_S)}" if n == 30_000 else ""
    results.add(f"{label}: SIGKILL -> claim -> all re-subscribed -> change delivered", f"{e2e:.2f} s",
                f"{one_call_s:.0f} s one call each", f"{e2e / one_call_s:.2f}x", target)  # fmt: skip
    results.point("end to end (s)", n, e2e)
    _sweep_all(admin)

    # d) steady state
    update_us, fetch_us, per_sub, update_wall, fetch_wall = _steady(ctx.url, n, admin)
    results.notes.append(f"{label}: wall time per watched UPDATE {update_wall:.0f} us, per fetched row"
                         f" {fetch_wall:.1f} us (synchronous_commit off)")  # fmt: skip
    for key, what, value in (("update", "watched single-row UPDATE, backend CPU", update_us),
                             ("fetch", "fetch per delivered row, backend CPU", fetch_us)):  # fmt: skip
        base = ctx.baseline.setdefault(key, value)
        ratio = value / base
        target = f"<= {TARGET_STEADY_RATIO:g}x {_verdict(ratio <= TARGET_STEADY_RATIO)}" if n == 100_000 else ""
        results.add(f"{label}: {what}", f"{value:.1f} us", f"{base:.1f} us at {_size(ctx.smallest)}",
                    f"{ratio:.2f}x", target)  # fmt: skip
        results.point(f"{what} (us)", n, value)
    results.add(f"{label}: bytes on disk per subscription", f"{per_sub:,.0f} B", "", "", "(info)")
    results.point("bytes per subscription", n, per_sub)


def run(sizes: tuple[int, ...] = (1_000, 10_000, 30_000, 100_000), *, quick: bool = False) -> Results:
    results = Results()
    started = time.monotonic()
    with EmbeddedPostgres(postgres_options=DURABLE) as server:
        with psycopg.connect(server.url, autocommit=True) as admin:
            admin.execute("CREATE DATABASE bench")
        url = server.url_for("bench")
        install.migrate(url)
        with (
            psycopg.connect(url, autocommit=True) as admin,
            psycopg.connect(url, autocommit=True) as waiter,
            psycopg.connect(url, autocommit=True) as monitor,
        ):
            version = admin.execute("SHOW server_version").fetchone()[0]
            assert admin.execute("SHOW fsync").fetchone()[0] == "on"
            print(f"server: PostgreSQL {version}, fsync and synchronous_commit on")
            empty = [_takeover(url, "empty", 0, waiter, monitor) for _ in range(3 if quick else EMPTY_CLAIMS)]
            empty_ms = statistics.median(empty) * 1000
            results.figures["empty_claim_ms"] = empty_ms
            _registry_test_cost(admin, waiter, results)
            ctx = Context(url, admin, waiter, monitor, empty_ms, quick, sizes[0])
            for n in sizes:
                _measure(ctx, n, results)
    results.figures["seconds"] = time.monotonic() - started
    return results


def _registry_test_cost(admin: psycopg.Connection, broker: psycopg.Connection, results: Results) -> None:
    """e) the registry-event test of a call while nobody watches, against a whole client_register call."""
    loops = 200_000
    timed = """
        DO $$ DECLARE t0 timestamptz; w boolean; BEGIN
            t0 := clock_timestamp();
            FOR i IN 1 .. {loops} LOOP {body} END LOOP;
            RAISE NOTICE '%', extract(epoch FROM clock_timestamp() - t0);
        END $$"""
    notes: list[str] = []
    admin.add_notice_handler(lambda d: notes.append(d.message_primary or ""))
    for body in ("w := i > 0;", "w := pgbroker._registry_watched('bench');"):
        admin.execute(timed.format(loops=loops, body=body))
    empty, with_test = (float(n) for n in notes[-2:])
    test_us = max(with_test - empty, 0.0) / loops * 1e6
    broker.execute("SELECT pgbroker.broker_claim('registry-cost')")
    cpu = _backend_cpu(broker)
    calls = 2000
    for i in range(calls):
        broker.execute("SELECT pgbroker.client_register(%s, name => 'registry-cost')", (f"c{i}",))
    call_us = (_backend_cpu(broker) - cpu) / calls * 1e6
    broker.execute("SELECT pgbroker.broker_release('registry-cost')")
    results.add("registry-event test per call while nobody watches (server CPU)", f"{test_us:.2f} us",
                f"{call_us:.0f} us a client_register", f"{test_us / call_us:.4f}x",
                f"<< 0.01x {_verdict(test_us / call_us < 0.01)}")  # fmt: skip


def _parse_sizes(text: str) -> tuple[int, ...]:
    return tuple(int(s.replace("_", "").replace("k", "000")) for s in text.split(","))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=_parse_sizes, default=(1_000, 10_000, 30_000, 100_000))
    parser.add_argument("--quick", action="store_true", help="one takeover per size, smaller samples")
    args = parser.parse_args(argv)
    results = run(args.sizes, quick=args.quick)
    print()
    print(results.table())
    for note in results.notes:
        print(f"- {note}")
    print(f"\n(whole run {results.figures['seconds']:.0f} s)")
    return 0


def test_bench_scale() -> None:
    """pytest entry point (tests/benchmarks is ignored by the default run): a quick run at two sizes."""
    results = run((1_000, 5_000), quick=True)
    print()
    print(results.table())
    assert results.figures["empty_claim_ms"] > 0 and len(results.rows) >= 8


if __name__ == "__main__":
    sys.exit(main())
