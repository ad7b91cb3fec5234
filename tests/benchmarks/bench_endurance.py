"""Endurance: a service's steady traffic for half an hour, minute by minute (run on demand).

    python3 tests/benchmarks/bench_endurance.py                 # 30 minutes (the targets are judged on it)
    python3 tests/benchmarks/bench_endurance.py --minutes 2     # a quick look
    python3 tests/benchmarks/bench_endurance.py --no-data       # no kv_set / counter_add (size target 2)
    python3 tests/benchmarks/bench_endurance.py --in-memory     # the server's files on /dev/shm (no disk waits)

Starts its own throwaway PostgreSQL (fsync, synchronous_commit and
full_page_writes on), installs pgbroker, watches ``bench.items`` (10,000
rows) and runs, all at once:

- 4 writers, each an autocommit connection UPDATE-ing a random row of
  ``bench.items`` in a loop;
- a Python ``Broker`` in a process of its own (its memory is measured): 1,000
  clients subscribed to 10 rows each, fetching and acknowledging what the
  writers cause, and churning subscriptions (a client unregistered and another
  registered and subscribed to 10 rows, 10 times a second, on a connection
  of its own in the broker's epoch).  It runs the upkeep,
  ``pgbroker.maintain()``, by itself, as every Python Broker does (every
  minute, every 5 seconds while names it marked idle wait); nothing else is
  scheduled;
- a thread cycling through ``lock_acquire``/``lock_release``, ``kv_set``,
  ``counter_add`` and ``rate_limit`` (1,000 per second, burst 10), each call
  on a name drawn from a space of 1,000,000 (``--names``): a lock per order, a
  rate limit per user.

A run with data starts a year in: before the clock starts, every name of the
space gets its KV entry and its counter (``--no-prefill``: none), so the
traffic updates data a service keeps rather than adding to it.

Every minute it records the throughput of each part, pgbroker's total size and
each of its tables' (``pg_total_relation_size``), their dead tuples, the
outbox backlog, the WAL written and its fsyncs' time, the CPU time the server
and the broker process have used, and the broker's RSS, and writes everything
as JSON to ``tests/benchmarks/results/endurance.json`` (see default_out for
``--no-data`` and ``--in-memory``; ``--out``); ``report.py`` turns each file
into a section with a plot.  With ``--in-memory`` the server's files are on a
tmpfs: fsync is still called and returns at once, so the throughput is what
the CPU allows rather than what the disk's fsync time does.  Targets, judged
on the last ten minutes against the first ten (on the last and first thirds of
a shorter run, where they are only indicative): throughput >= 0.95x for the
writes and each primitive; the peak of pgbroker's total size rises by less
than 5% in the last ten minutes; with ``--no-data``, its peak stays under 2x
its size after the first minute (see _peak_growth for why the peak).  With
data, the growth is also given less ``kv_entry`` and ``counter``: with
``--no-prefill``, ``kv_set`` and ``counter_add`` on names new to them add rows
that are data, kept until deleted or expired, so the total grows by what they
write.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psycopg  # noqa: E402

from pgbroker import install  # noqa: E402
from pgbroker._embedded import EmbeddedPostgres  # noqa: E402

HERE = Path(__file__).resolve().parent
DURABLE = (
    "-c fsync=on -c synchronous_commit=on -c full_page_writes=on -c shared_buffers=256MB -c max_wal_size=2GB"
    " -c track_wal_io_timing=on"  # the WAL's fsync time per minute: what a durable commit waits for
)
# The WAL's fsyncs and their time (ms) so far: in pg_stat_wal up to PostgreSQL 17, in pg_stat_io from 18.
WAL_BYTES_SQL = "SELECT (pg_current_wal_lsn() - '0/0')::bigint"  # WAL written so far
WAL_SYNC_SQL = "SELECT wal_sync, wal_sync_time FROM pg_stat_wal"
WAL_SYNC_SQL_18 = "SELECT sum(fsyncs)::bigint, sum(fsync_time) FROM pg_stat_io WHERE object = 'wal'"
ROWS = 10_000
CLIENTS = 1_000
PER_CLIENT = 10
WRITERS = 4
CHURN_PER_S = 10
TARGET_SPEED = 0.95
TARGET_GROWTH = 0.05
TARGET_NO_DATA = 2.0
DATA_TABLES = ("kv_entry", "counter")  # what kv_set and counter_add write: data, kept until deleted
OPERATIONS = ("writes", "locks", "kv_set", "counter_add", "rate_limit")  # what CPU per operation divides by
IN_MEMORY = "/dev/shm"  # --in-memory: the server's directory on this tmpfs

# The broker process: claim, subscribe CLIENTS clients, then fetch + ack and churn until stdin closes; prints
# a JSON line of its running totals every second.
BROKER = """
import json, random, sys, threading, time
import psycopg
from pgbroker import Broker
url, clients, per, rows, churn = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
rng = random.Random(1)
totals = {"fetched": 0, "churned": 0}
with Broker(url, "endurance") as broker:
    live = [f"c{i}" for i in range(clients)]
    broker.register_many(live)
    broker.subscribe_many([(c, rng.randint(1, rows)) for c in live for _ in range(per)], "bench.items")

    def churner():  # on a connection of its own, in the broker's epoch, as a broker's other workers would
        with psycopg.connect(url, autocommit=True) as conn:
            serial, next_at = clients, time.monotonic()
            while not stop.is_set():
                time.sleep(max(0.0, next_at - time.monotonic()))
                next_at += 1 / churn
                old = live.pop(rng.randrange(len(live)))
                serial += 1
                new = f"c{serial}"
                live.append(new)
                conn.execute("SELECT pgbroker.client_unregister(%s, 'endurance', %s)", (old, broker.epoch))
                conn.execute("SELECT pgbroker.client_register(%s, '{}', 'endurance', %s)", (new, broker.epoch))
                conn.execute("SELECT pgbroker.subscribe_many(%s, 'bench.items', %s::jsonb[], 'endurance', %s)",
                             ([new] * per, [str(rng.randint(1, rows)) for _ in range(per)], broker.epoch))
                totals["churned"] += 1

    threading.Thread(target=churner, daemon=True).start()
    last_print = time.monotonic()
    ack = None
    while not stop.is_set():
        batch = broker.fetch(1000, ack=ack)
        ack = [n.id for n in batch]
        totals["fetched"] += len(batch)
        if time.monotonic() - last_print >= 1:
            print(json.dumps(totals), flush=True)
            last_print = time.monotonic()
        if not batch:
            time.sleep(0.005)
    if ack:
        broker.ack(ack)
"""


class Counter:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}

    def add(self, part: str, n: int = 1) -> None:
        with self.lock:
            self.counts[part] = self.counts.get(part, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counts)


def _writer(url: str, counter: Counter, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    with psycopg.connect(url, autocommit=True, application_name="endurance-writer") as conn:
        while not stop.is_set():
            conn.execute("UPDATE bench.items SET v = v + 1 WHERE id = %s", (rng.randint(1, ROWS),), prepare=True)
            counter.add("writes")


def _primitives(url: str, counter: Counter, stop: threading.Event, names: int, data: bool) -> None:
    rng = random.Random(7)
    with psycopg.connect(url, autocommit=True, application_name="endurance-primitives") as conn:
        while not stop.is_set():
            name = f"order/{rng.randrange(names)}"
            conn.execute("SELECT pgbroker.lock_acquire(%s, '0')", (name,), prepare=True)
            conn.execute("SELECT pgbroker.lock_release(%s)", (name,), prepare=True)
            counter.add("locks")
            if data:
                conn.execute("SELECT pgbroker.kv_set(%s, '1')", (f"kv/{rng.randrange(names)}",), prepare=True)
                counter.add("kv_set")
                conn.execute("SELECT pgbroker.counter_add(%s)", (f"count/{rng.randrange(names)}",), prepare=True)
                counter.add("counter_add")
            conn.execute(
                "SELECT allowed FROM pgbroker.rate_limit(%s, 1000, '1 s', 10)",
                (f"api/user/{rng.randrange(names)}",),
                prepare=True,
            )
            counter.add("rate_limit")


def checkout_commit() -> str:
    """The checkout's commit, with "+changes" when tracked files differ from it (what a run measured)."""
    root = HERE.parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()  # fmt: skip
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+changes" if changed else "")


def write_json(out: Path, result: dict[str, Any]) -> dict[str, Any]:
    """Write a run's RESULT to OUT (for report.py), say so, and return it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return result


def _cpu_s(pid: int, reaped: bool = False) -> float:
    """CPU seconds (user + system) PID has used, with those of its children it reaped when REAPED."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # fields[0] is field 3, the state
    ticks = sum(int(f) for f in fields[11 : 15 if reaped else 13])  # utime, stime (, cutime, cstime)
    return ticks / os.sysconf("SC_CLK_TCK")


def _server_cpu_s(postmaster: int) -> float:
    """CPU seconds the server has used: the postmaster's, its live children's (backends, autovacuum, WAL writer...)
    and those of the children it reaped (a child's time moves from the one to the other when it exits)."""
    total = _cpu_s(postmaster, reaped=True)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == postmaster:
                total += _cpu_s(int(stat.parent.name))
        except (OSError, ValueError):  # gone meanwhile: its time is in the postmaster's reaped total
            continue
    return total


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


SIZES_SQL = """
SELECT c.relname, pg_total_relation_size(c.oid), coalesce(s.n_dead_tup, 0)
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
  LEFT JOIN pg_stat_all_tables s ON s.relid = c.oid
 WHERE n.nspname = 'pgbroker' AND c.relkind = 'r'
 ORDER BY 2 DESC"""


# The outbox's indexes, apart: a queue table's indexes bloat when its readers stop scanning them (sql/500_outbox.sql).
OUTBOX_INDEXES_SQL = """
SELECT c.relname, pg_relation_size(c.oid)
  FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
 WHERE i.indrelid = 'pgbroker.outbox'::regclass
 ORDER BY 1"""


def _sample(monitor: psycopg.Connection, broker_pid: int, postmaster: int) -> dict[str, Any]:
    tables = {r[0]: {"bytes": r[1], "dead": r[2]} for r in monitor.execute(SIZES_SQL)}
    syncs, sync_ms = monitor.execute(
        WAL_SYNC_SQL_18 if monitor.info.server_version >= 180000 else WAL_SYNC_SQL
    ).fetchone()
    return {
        "pgbroker_bytes": sum(t["bytes"] for t in tables.values()),
        "tables": tables,
        "outbox_backlog": monitor.execute("SELECT count(*) FROM pgbroker.outbox").fetchone()[0],
        "outbox_index_bytes": dict(monitor.execute(OUTBOX_INDEXES_SQL).fetchall()),
        "wal_bytes": monitor.execute(WAL_BYTES_SQL).fetchone()[0],
        "wal_syncs": syncs,
        "wal_sync_ms": float(sync_ms or 0),
        "broker_rss_kb": _rss_kb(broker_pid),
        "server_cpu_s": _server_cpu_s(postmaster),
        "broker_cpu_s": _cpu_s(broker_pid),
        "upkeep": {
            r[0]: {"removed_total": r[1], "remaining": r[2]}
            for r in monitor.execute("SELECT part, removed_total, remaining FROM pgbroker.upkeep")
        },
    }


def cpu_ms_per_op(minutes: list[dict[str, Any]], previous: dict[str, Any] | None) -> float | None:
    """The server's CPU milliseconds per operation (a watched write or a primitive call) over MINUTES, which follow
    PREVIOUS (None: from the first minute's end; None when the run recorded no CPU)."""
    if previous is None:
        previous, minutes = minutes[0], minutes[1:]
    if not minutes or "server_cpu_s" not in previous or "seconds" not in minutes[0]:
        return None
    ops = sum(sum(m["rates"].get(p, 0) for p in OPERATIONS) * m["seconds"] for m in minutes)
    return (minutes[-1]["server_cpu_s"] - previous["server_cpu_s"]) * 1e3 / ops if ops else None


def _window(minutes: list[dict[str, Any]]) -> int:
    """Minutes compared at each end: ten, or a third of a shorter run (at least one)."""
    return 10 if len(minutes) >= 20 else max(1, len(minutes) // 3)


def _peak_growth(minutes: list[dict[str, Any]], w: int, size: Any) -> float:
    """How much the peak of SIZE rose in the last W minutes: the largest sample of the run over the largest before
    them, less 1.  Between two autovacuum passes (a minute apart by default) the tables hold the dead rows of a
    minute of churn, so a single minute's sample swings by some 10% with where it falls in that cycle; the peak is
    what the disk must hold and, once the churn's free space is there, it stops rising."""
    before = minutes[:-w] if len(minutes) > w else minutes[:1]
    return max(size(m) for m in minutes) / max(size(m) for m in before) - 1


def verdicts(minutes: list[dict[str, Any]], data: bool) -> list[dict[str, Any]]:
    """The targets, judged on the recorded minutes."""
    if len(minutes) < 2:
        return []
    w = _window(minutes)
    first, last = minutes[:w], minutes[-w:]
    out = []
    for part in ("writes", "fetched", "locks", "rate_limit", *(("kv_set", "counter_add") if data else ())):
        a = sum(m["rates"].get(part, 0) for m in first) / w
        b = sum(m["rates"].get(part, 0) for m in last) / w
        ratio = b / a if a else 0.0
        out.append(
            {
                "target": f"{part}/s, last {w} min / first {w} min",
                "value": ratio,
                "limit": TARGET_SPEED,
                "ok": ratio >= TARGET_SPEED,
            }
        )

    def total(m: dict[str, Any]) -> int:
        return m["pgbroker_bytes"]

    # kv_set and counter_add on names drawn from --names make new rows that are data and stay (only a delete or a
    # TTL removes them): what is left once they are set aside is what the upkeep keeps flat.
    def kept(m: dict[str, Any]) -> int:
        return m["pgbroker_bytes"] - sum(m["tables"].get(t, {"bytes": 0})["bytes"] for t in DATA_TABLES)

    for size, what in ((total, ""), *(((kept, f", less the data ({', '.join(DATA_TABLES)})"),) if data else ())):
        growth = _peak_growth(minutes, w, size)
        out.append(
            {
                "target": f"pgbroker size{what}: its peak, growth over the last {w} min",
                "value": growth,
                "limit": TARGET_GROWTH,
                "ok": growth < TARGET_GROWTH,
            }
        )
    # What the server spends per operation, apart from how long its disk takes to fsync: shown, not judged.
    before, after = cpu_ms_per_op(first, None), cpu_ms_per_op(last, minutes[-w - 1] if len(minutes) > w else None)
    if before and after:
        out.append(
            {
                "target": f"server CPU per operation, last {w} min / first {w} min (not judged: the disk's part"
                " is not in it)",
                "value": after / before,
                "limit": None,
                "ok": None,
            }
        )
    # The same at the two ends only: shown, not judged (a sample lands anywhere in a vacuum's cycle).
    start = minutes[-w - 1] if len(minutes) > w else minutes[0]
    out.append(
        {
            "target": f"pgbroker size, last minute / {w} min before (not judged: it swings with the vacuum cycle)",
            "value": total(minutes[-1]) / total(start) - 1,
            "limit": None,
            "ok": None,
        }
    )
    if not data:
        ratio = max(m["pgbroker_bytes"] for m in minutes) / minutes[0]["pgbroker_bytes"]
        out.append(
            {
                "target": "pgbroker size at its peak / its size after the first minute",
                "value": ratio,
                "limit": TARGET_NO_DATA,
                "ok": ratio < TARGET_NO_DATA,
            }
        )
    return out


def default_out(data: bool = True, in_memory: bool = False) -> Path:
    """Where a run's JSON goes unless --out says: endurance[_no_data][_in_memory].json in results/."""
    return HERE / "results" / f"endurance{'' if data else '_no_data'}{'_in_memory' if in_memory else ''}.json"


def run(
    minutes: float = 30,
    names: int = 1_000_000,
    data: bool = True,
    out: Path | None = None,
    prefill: bool = True,
    in_memory: bool = False,
) -> dict[str, Any]:
    prefill = prefill and data
    out = out or default_out(data, in_memory)
    result: dict[str, Any] = {
        "settings": {
            "minutes": minutes,
            "names": names,
            "data": data,
            "prefilled": prefill,
            "in_memory": in_memory,
            "writers": WRITERS,
            "rows": ROWS,
            "clients": CLIENTS,
            "per_client": PER_CLIENT,
            "churn_per_s": CHURN_PER_S,
        },
        "minutes": [],
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_start": os.getloadavg(),
        "commit": checkout_commit(),
    }
    with EmbeddedPostgres(postgres_options=DURABLE, parent=IN_MEMORY if in_memory else None) as server:
        with psycopg.connect(server.url, autocommit=True) as admin:
            admin.execute("CREATE DATABASE bench")
        url = server.url_for("bench")
        install.migrate(url)
        with psycopg.connect(url, autocommit=True) as monitor:
            result["server"] = monitor.execute("SHOW server_version").fetchone()[0]
            monitor.execute("CREATE SCHEMA bench")
            monitor.execute("CREATE TABLE bench.items (id integer PRIMARY KEY, v bigint NOT NULL DEFAULT 0)")
            monitor.execute("INSERT INTO bench.items (id) SELECT g FROM generate_series(1, %s) g", (ROWS,))
            monitor.execute("SELECT pgbroker.watch('bench.items')")
            if prefill:  # a year in: every name of the space has its KV entry and its counter, settled by a vacuum
                began = time.monotonic()
                monitor.execute("SELECT count(pgbroker.kv_set('kv/' || g, '1')) FROM generate_series(0, %s) g",
                                (names - 1,))  # fmt: skip
                monitor.execute("SELECT count(pgbroker.counter_add('count/' || g)) FROM generate_series(0, %s) g",
                                (names - 1,))  # fmt: skip
                monitor.execute("VACUUM ANALYZE pgbroker.kv_entry, pgbroker.counter")
                result["prefill_s"] = time.monotonic() - began
                print(f"prefilled {names:,} KV entries and counters in {result['prefill_s']:.0f} s", flush=True)
            broker = subprocess.Popen(
                [sys.executable, "-c", BROKER, url, str(CLIENTS), str(PER_CLIENT), str(ROWS), str(CHURN_PER_S)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            counter = Counter()
            postmaster = int((server.datadir / "postmaster.pid").read_text().split()[0])

            def read_broker() -> None:
                assert broker.stdout is not None
                for line in broker.stdout:
                    totals = json.loads(line)
                    with counter.lock:
                        counter.counts.update(totals)

            threading.Thread(target=read_broker, daemon=True).start()
            deadline = time.monotonic() + 300
            while "fetched" not in counter.snapshot():  # subscribed and fetching
                if broker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the broker process did not start")
                time.sleep(0.2)
            stop = threading.Event()
            threads = [threading.Thread(target=_writer, args=(url, counter, stop, i)) for i in range(WRITERS)]
            threads.append(threading.Thread(target=_primitives, args=(url, counter, stop, names, data)))
            for t in threads:
                t.start()
            started = time.monotonic()
            before, at = counter.snapshot(), started
            try:
                for minute in range(1, int(minutes) + 1):
                    time.sleep(max(0.0, started + 60 * minute - time.monotonic()))
                    now, totals = time.monotonic(), counter.snapshot()
                    rates = {k: (v - before.get(k, 0)) / (now - at) for k, v in totals.items()}
                    sample = {"minute": minute, "seconds": now - at, "rates": rates,
                              **_sample(monitor, broker.pid, postmaster)}  # fmt: skip
                    result["minutes"].append(sample)
                    before, at = totals, now
                    print(
                        f"minute {minute}: "
                        + ", ".join(f"{k} {v:,.0f}/s" for k, v in sorted(rates.items()))
                        + f"; pgbroker {sample['pgbroker_bytes'] / 1e6:.1f} MB, outbox {sample['outbox_backlog']},"
                        f" broker RSS {sample['broker_rss_kb'] / 1024:.0f} MB",
                        flush=True,
                    )
            finally:
                stop.set()
                for t in threads:
                    t.join(30)
                assert broker.stdin is not None
                broker.stdin.close()
                try:
                    broker.wait(60)
                except subprocess.TimeoutExpired:
                    broker.kill()
                    broker.wait(10)
    result["load_end"] = os.getloadavg()
    result["verdicts"] = verdicts(result["minutes"], data)
    for v in result["verdicts"]:
        verdict = "shown" if v["ok"] is None else "ok" if v["ok"] else "MISSED"
        print(f"  {v['target']}: {v['value']:.3f} (target {v['limit']}) {verdict}")
    return write_json(out, result)


def test_endurance_quick(tmp_path: Path) -> None:
    """Two minutes (on demand, like every benchmark): every part makes progress and the report is complete."""
    result = run(minutes=2, names=1_000_000, out=tmp_path / "endurance.json")
    assert len(result["minutes"]) == 2 and all(m["rates"]["writes"] > 0 for m in result["minutes"])
    assert result["verdicts"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=int, default=30, help="how long (default 30; the targets need 30)")
    parser.add_argument("--names", type=int, default=1_000_000, help="size of the name space (default 1,000,000)")
    parser.add_argument("--no-data", action="store_true", help="no kv_set nor counter_add (only what is forgotten)")
    parser.add_argument(
        "--no-prefill", action="store_true", help="start with no KV entries nor counters (default: one per name)"
    )
    parser.add_argument(
        "--in-memory", action="store_true", help=f"the server's files on the tmpfs {IN_MEMORY}: fsync returns at once"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help=f"the JSON file (default {default_out()}; with --no-data, --in-memory:"
        f" {default_out(False, True).name} and the like beside it)",
    )
    args = parser.parse_args(argv)
    if args.minutes < 1 or args.names < 1:
        parser.error("--minutes and --names must be at least 1")
    run(args.minutes, args.names, not args.no_data, args.out, prefill=not args.no_prefill, in_memory=args.in_memory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
