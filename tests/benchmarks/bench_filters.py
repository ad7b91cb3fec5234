"""Benchmark of subscriptions by filter (issue 43; run on demand).

    python tests/benchmarks/bench_filters.py [--scale 1.0] [--updates 40000] [--out results/filters.json]

Starts its own throwaway PostgreSQL with fsync, synchronous_commit and
full_page_writes ON, installs pgbroker, and measures, each ratio against a
floor measured in the same run on the same server:

a) a watched single-row UPDATE of a row matching no filter, on a table with
   100,000 filter subscriptions on 10,000 other values, against the same
   UPDATE on a twin table with no filter subscriptions (ten rounds of both,
   interleaved, the interest vacuumed first as autovacuum keeps it):
   throughput and the writing backend's CPU per UPDATE (from
   /proc/<pid>/stat), each ratio the median of the rounds' (on a shared
   2-core machine, whole runs of the same code gave CPU ratios from 1.03
   to 1.25).  Targets: at least 0.9x the throughput, at most 1.1x the CPU
   per UPDATE;
b) the CPU per UPDATE of a row matching k = 1, 10 and 100 filter
   subscriptions, with 1,000, 10,000 and 100,000 filter subscriptions in
   all: the cost must follow k, not the number of subscriptions (target: at
   100,000 at most 1.5x the cost at 1,000, for each k).  Each k has rows of
   its own, moved into team -k beforehand; the UPDATEs timed change another
   column, so each matches k clients before and after; ROUNDS rounds of
   every k, interleaved, summed (the CPU clock ticks every 10 ms);
c) bulk filter subscription: ``Broker.subscribe_filters()`` of 100,000
   filters (ten clients on each of 10,000 values, the pairs given client
   after client; each client's ten values are those of nine other clients,
   so the pairs fall into 1,000 sets of ten clients and ten values), its
   defaults: batches of 10,000 grouped by filter and by the clients the
   filters share, two at a time on two registry connections; the whole
   call timed, the grouping too, the clients registered first (a
   ``pgbroker.Broker`` holds the lease of (a) and (c)).
   Target: at least 50,000 filters/s;
b') the same with range filters (``{"team": {"gte": -k, "lte": -k}}``; the
   others ``{"team": {"gte": v, "lt": v + 1}}``) on a twin table, the same
   clients: an SP-GiST probe among all the ranges of the column (target as b);
d) the peer design, beside (b): a trigger that evaluates every filter
   subscription row by row for each changed row (what Supabase Realtime's
   WALRUS does per change), at 1,000, 10,000 and 100,000 subscriptions:
   its CPU per UPDATE grows with the number of subscriptions;
e) delivery latency: a Python ``pgbroker.Broker`` (its defaults) with one
   client subscribed by filter (``{"team": 7}``), beside 100,000 filter
   subscriptions of other clients on 10,000 other values, consumes
   ``Broker.notifications()`` in a thread while a writer in this process
   moves rows into the filter (``team = 7``) and out of it (``team = 8``,
   delivered with the client in ``left``), one autocommit UPDATE every 5 ms,
   4,000 changes (half in, half out).  Latency: from the writer's commit
   returning to the batch that carries the change reaching the handler
   (``time.perf_counter`` in both threads, as bench_fanout.py's part 3
   does), p50 / p99 / max for each direction.  Target: p99 at most 10 ms
   each.  Run first, on the freshly started server, so that nothing of the
   other parts (autovacuum after their deletes) runs beside it.

(b) and (d): a broker session holds the lease, awake (``broker_wake``), and
acknowledges the outbox between rounds, so writers pay no NOTIFY (nothing of
(a) reaches the outbox).
``--scale`` multiplies every size and the number of changes of (e) (at least
100) (``--scale 0.01 --updates 50``: a smoke run of a few seconds).  Writes
the figures to ``--out`` (JSON), which ``report.py --on-demand`` turns into
the report's "Filters" section.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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

if str(Path(__file__).resolve().parent) not in sys.path:  # bench_fanout, imported from any directory
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg  # noqa: E402
from bench_fanout import _percentile  # noqa: E402

from pgbroker import Broker, install  # noqa: E402
from pgbroker._core import SUBSCRIBE_FILTERS_SQL, batches, grouped, subscribe_filters_params  # noqa: E402
from pgbroker._embedded import EmbeddedPostgres  # noqa: E402

DURABLE = (
    "-c fsync=on -c synchronous_commit=on -c full_page_writes=on -c shared_buffers=512MB -c max_wal_size=4GB"
    " -c checkpoint_timeout=30min"
)
LEASE = "filters"
ROWS = 10_000
SUBSCRIPTIONS = 100_000
VALUES = 10_000
BATCH = 10_000
SIZES = (1_000, 10_000, 100_000)
KS = (1, 10, 100)
ROUNDS = 5
NO_MATCH_ROUNDS = 10  # of (a), each --updates / 10 UPDATEs of either table
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "filters.json"
LATENCY_LEASE = "filters_latency"  # a lease of its own: nothing of the other parts for its sweeper
LATENCY_CHANGES = 4_000  # UPDATEs of (e) at scale 1, half moving a row into the filter, half out of it
LATENCY_PERIOD = 0.005  # seconds between the writer's UPDATEs
LATENCY_TEAM, LATENCY_OTHER = 7, 8  # the watched client's filter value; where a row goes when it leaves
TARGETS = {"throughput_ratio": 0.9, "cpu_ratio": 1.1, "size_ratio": 1.5, "bulk_per_s": 50_000, "latency_p99_ms": 10.0}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pid(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT pg_backend_pid()").fetchone()[0]


def _value(i: int, clients: int, values: int) -> int:
    """The value of filter ``i`` of ``clients`` clients (client ``i % clients``, its filter ``i // clients``) on
    ``values`` values: each client's filters on values of their own, each value shared by as many clients."""
    return (i % clients + i // clients * max(1, values // 10)) % values


def _table(admin: psycopg.Connection, name: str, rows: int) -> None:
    admin.execute(f"CREATE TABLE bench.{name} (id integer PRIMARY KEY, team integer NOT NULL, v integer NOT NULL)")
    admin.execute(f"INSERT INTO bench.{name} SELECT i, 0, 0 FROM generate_series(1, {rows}) i")
    admin.execute(f"ANALYZE bench.{name}")
    admin.execute(f"SELECT pgbroker.watch('bench.{name}')")


def _register(broker: psycopg.Connection, ids: list[str]) -> None:
    for s in range(0, len(ids), BATCH):
        broker.execute("SELECT pgbroker.client_register_many(%s::text[], name => %s)", (ids[s : s + BATCH], LEASE))


def _subscribe(broker: psycopg.Connection, table: str, pairs: list[tuple[str, dict]]) -> None:
    """subscribe_filters in batches on the lease session, grouped as Broker.subscribe_filters() groups them, one at
    a time (the set-up of (b), untimed)."""
    for batch in batches(grouped(pairs), BATCH):
        params = subscribe_filters_params(LEASE, f"bench.{table}", batch, None)
        broker.execute(SUBSCRIBE_FILTERS_SQL, {**params, "epoch": None})


def _drain(broker: psycopg.Connection) -> None:
    while rows := broker.execute("SELECT id FROM pgbroker.outbox_fetch(%s, 10000)", (LEASE,)).fetchall():
        broker.execute("SELECT pgbroker.outbox_ack(%s, %s)", (LEASE, [r[0] for r in rows]))


def _updates(writer: psycopg.Connection, table: str, ids: list[int], team: int | None = None) -> tuple[float, float]:
    """Single-row autocommit UPDATEs of rows ``ids`` (v only, or team too): (seconds, backend CPU seconds)."""
    pid = _pid(writer)
    cpu, t = _cpu_s(pid), time.perf_counter()
    if team is None:
        for i in ids:
            writer.execute(f"UPDATE bench.{table} SET v = v + 1 WHERE id = %s", (i,))
    else:
        for i in ids:
            writer.execute(f"UPDATE bench.{table} SET v = v + 1, team = %s WHERE id = %s", (team, i))
    return time.perf_counter() - t, _cpu_s(pid) - cpu


def no_match(url: str, scale: float, updates: int) -> dict[str, Any]:
    """(a) A row matching no filter, 100,000 filter subscriptions on 10,000 values, against no filters."""
    subs, values, rows = int(SUBSCRIPTIONS * scale), max(1, int(VALUES * scale)), max(10, int(ROWS * scale))
    # The lease held by a pgbroker.Broker (its defaults, no sweeper): (c) is its subscribe_filters().  Nothing
    # of (a) reaches the outbox, so the broker need not be awake.
    with psycopg.connect(url, autocommit=True) as admin, Broker(url, LEASE, sweep=False) as broker:
        admin.execute("CREATE SCHEMA bench")
        _table(admin, "plain", rows)
        _table(admin, "filtered", rows)
        ids = [f"c{i}" for i in range(subs // 10)]
        broker.register_many(ids)
        pairs = [(ids[i % len(ids)], {"team": 1 + _value(i, len(ids), values)}) for i in range(subs)]  # 0: nobody's
        t = time.perf_counter()
        assert broker.subscribe_filters(pairs, "bench.filtered", batch_size=BATCH) == subs
        bulk_s = time.perf_counter() - t
        # The steady state, as autovacuum keeps it: the batches appended to each interest row ten times.
        admin.execute("VACUUM ANALYZE pgbroker.interest")
        per_round = max(1, updates // NO_MATCH_ROUNDS)
        totals = {"plain": [0.0, 0.0], "filtered": [0.0, 0.0]}
        rounds: list[dict[str, tuple[float, float]]] = []
        with psycopg.connect(url, autocommit=True) as writer:
            _updates(writer, "plain", list(range(1, 51)))  # warm both plans
            _updates(writer, "filtered", list(range(1, 51)))
            for r in range(NO_MATCH_ROUNDS):
                rounds.append({})
                for table in ("plain", "filtered") if r % 2 == 0 else ("filtered", "plain"):
                    wall, cpu = _updates(writer, table, [1 + (j % rows) for j in range(per_round)])
                    rounds[-1][table] = (wall, cpu)
                    totals[table][0] += wall
                    totals[table][1] += cpu
        n = per_round * NO_MATCH_ROUNDS
        assert admin.execute("SELECT count(*) FROM pgbroker.outbox").fetchone()[0] == 0, "a no-match UPDATE wrote"
        out = {
            table: {"updates_per_s": n / wall, "cpu_us_per_update": cpu / n * 1e6}
            for table, (wall, cpu) in totals.items()
        }
        # The median of the rounds' ratios: a burst of the machine's other load lands in one round, not in all.
        out["throughput_ratio"] = statistics.median(x["plain"][0] / x["filtered"][0] for x in rounds)
        out["cpu_ratio"] = statistics.median(x["filtered"][1] / max(x["plain"][1], 1e-9) for x in rounds)
        out["rounds"] = len(rounds)
        out["subscriptions"], out["values"], out["updates"] = subs, values, n
        out["bulk"] = {"filters": subs, "s": bulk_s, "filters_per_s": subs / bulk_s}
        admin.execute("DROP SCHEMA bench CASCADE")
    return out


def latency(url: str, scale: float) -> dict[str, Any]:
    """(e) Commit to ``Broker.notifications()`` for rows moving into and out of a client's filter."""
    subs, values = int(SUBSCRIPTIONS * scale), max(1, int(VALUES * scale))
    changes = max(100, int(LATENCY_CHANGES * scale)) // 2 * 2
    pairs_n = changes // 2  # row i moves in (change 2i), then out (change 2i + 1): (key, way) names one change
    watcher = "watcher"
    committed: dict[tuple[int, str], float] = {}
    seen: dict[tuple[int, str], float] = {}
    errors: list[BaseException] = []
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("CREATE SCHEMA bench")
        _table(admin, "lat", pairs_n)
    table = "bench.lat"
    with Broker(url, name=LATENCY_LEASE) as broker:
        broker.register(watcher)
        assert broker.subscribe(watcher, table, filter={"team": LATENCY_TEAM})
        others = [f"o{i}" for i in range(max(1, subs // 10))]
        broker.register_many(others)
        # The others: other values (1000 and up), as in (a); neither 0, 7 nor 8 is one of them.
        broker.subscribe_filters(
            ((others[i % len(others)], {"team": 1000 + _value(i, len(others), values)}) for i in range(subs)),
            table,
            batch_size=BATCH,
        )
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute("ANALYZE pgbroker.interest")
            admin.execute(f"ANALYZE {table}")
            admin.execute("CHECKPOINT")
        stop = threading.Event()

        def consume() -> None:
            try:
                for batch in broker.notifications():
                    now = time.perf_counter()
                    for n in batch:
                        if n.table == table and n.op == "U" and watcher in n.clients:
                            seen.setdefault((int(n.key), "out" if watcher in n.left else "in"), now)
                    if stop.is_set() or len(seen) >= changes:
                        break
            except BaseException as exc:  # reported below (not the end of a loop given up on: close() ends it)
                if not stop.is_set():
                    errors.append(exc)

        thread = threading.Thread(target=consume, name="filters-latency", daemon=True)
        thread.start()
        time.sleep(0.5)  # the loop is listening, and asleep: the first change wakes it as any later one
        load_start = os.getloadavg()
        with psycopg.connect(url, autocommit=True) as writer:
            writer.execute(f"UPDATE {table} SET v = v + 1 WHERE id = 0")  # no row: plans cached
            next_at = time.perf_counter()
            for i in range(changes):
                key, way = 1 + i // 2, "in" if i % 2 == 0 else "out"
                team = LATENCY_TEAM if way == "in" else LATENCY_OTHER
                writer.execute(f"UPDATE {table} SET team = %s, v = v + 1 WHERE id = %s", (team, key))
                committed[(key, way)] = time.perf_counter()
                next_at = max(next_at + LATENCY_PERIOD, time.perf_counter())
                time.sleep(max(0.0, next_at - time.perf_counter()))
        deadline = time.monotonic() + 10
        while len(seen) < changes and not errors and time.monotonic() < deadline:
            time.sleep(0.01)
        load_end = os.getloadavg()
        stop.set()
        thread.join(2)  # the loop stops at its next batch; closing the broker ends a wait for one
        if not thread.is_alive():  # the last batch, not acknowledged by a loop that stopped: (a) counts the outbox
            while batch := broker.fetch(1000):
                broker.ack([n.id for n in batch])
    thread.join(5)
    if errors:
        raise RuntimeError("Broker.notifications() failed") from errors[0]
    if len(seen) < changes:
        missing = sorted(set(committed) - set(seen))[:5]
        raise RuntimeError(f"latency: Broker.notifications() saw {len(seen)} of {changes} changes, missing {missing}")
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("DROP SCHEMA bench CASCADE")
    out: dict[str, Any] = {"changes": changes, "period_ms": LATENCY_PERIOD * 1000, "subscriptions": subs,
                           "values": values, "filter": {"team": LATENCY_TEAM}}  # fmt: skip
    ms = {k: (seen[k] - t) * 1000 for k, t in committed.items()}
    for way in ("in", "out", "all"):
        samples = [v for (_key, w), v in ms.items() if way in ("all", w)]
        out[way] = {"n": len(samples), "p50_ms": _percentile(samples, 0.5), "p99_ms": _percentile(samples, 0.99),
                    "max_ms": max(samples)}  # fmt: skip
    out["negative"] = sum(1 for v in ms.values() if v < 0)  # the handler ran before the commit call returned
    out["load_start"], out["load_end"] = load_start, load_end
    return out


PEER_SQL = """
CREATE TABLE bench.peer_sub (client_id text NOT NULL, col text NOT NULL, val text NOT NULL);
CREATE UNLOGGED TABLE bench.peer_out (client_id text, row_key integer, op text);
CREATE FUNCTION bench.peer_fanout() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    s record;
    n jsonb := to_jsonb(NEW);
    o jsonb := to_jsonb(OLD);
BEGIN
    -- Every subscription, row by row, against the old and the new row.
    FOR s IN SELECT * FROM bench.peer_sub LOOP
        IF n ->> s.col = s.val OR o ->> s.col = s.val THEN
            INSERT INTO bench.peer_out VALUES (s.client_id, NEW.id, TG_OP);
        END IF;
    END LOOP;
    RETURN NULL;
END $$;
"""


def by_size(url: str, scale: float, updates: int) -> dict[str, Any]:
    """(b) pgbroker and (d) the peer: CPU per UPDATE matching k subscriptions, at each total size."""
    out: dict[str, Any] = {"pgbroker": {}, "ranges": {}, "peer": {}}
    with psycopg.connect(url, autocommit=True) as admin, psycopg.connect(url, autocommit=True) as broker:
        broker.execute("SELECT pgbroker.broker_claim(%s)", (LEASE,))
        broker.execute("SELECT pgbroker.broker_wake(%s)", (LEASE,))
        for size in SIZES:
            n_subs = max(sum(KS) + 10, int(size * scale))
            out.setdefault("subscriptions", {})[str(size)] = n_subs
            admin.execute("DROP SCHEMA IF EXISTS bench CASCADE")
            admin.execute("CREATE SCHEMA bench")
            _table(admin, "t", 1000)
            _table(admin, "r", 1000)
            admin.execute("CREATE TABLE bench.p (id integer PRIMARY KEY, team integer NOT NULL, v integer NOT NULL)")
            admin.execute("INSERT INTO bench.p SELECT i, 0, 0 FROM generate_series(1, 1000) i")
            admin.execute(PEER_SQL)
            admin.execute("CREATE TRIGGER peer AFTER INSERT OR UPDATE ON bench.p FOR EACH ROW EXECUTE FUNCTION "
                          "bench.peer_fanout()")  # fmt: skip
            ids = [f"s{size}_{i}" for i in range(n_subs)]
            _register(broker, ids)
            # Team -k is subscribed by k clients; the rest spread over teams 1000 and up, 10 a value.
            pairs: list[tuple[str, dict]] = []
            pos = 0
            for k in KS:
                pairs += [(ids[pos + j], {"team": -k}) for j in range(k)]
                pos += k
            pairs += [(ids[i], {"team": 1000 + i // 10}) for i in range(pos, n_subs)]
            _subscribe(broker, "t", pairs)
            # The same clients by ranges on bench.r: team -k in the ranges [-k, -k] of k clients, the others in
            # ranges of their own, [1000 + i // 10, 1001 + i // 10) (one SP-GiST line, boxes side by side).
            ranges = [
                (
                    c,
                    {
                        "team": {"gte": f["team"], "lte": f["team"]}
                        if f["team"] < 0
                        else {"gte": f["team"], "lt": f["team"] + 1}
                    },
                )
                for c, f in pairs
            ]
            _subscribe(broker, "r", ranges)
            with admin.cursor() as cur, cur.copy("COPY bench.peer_sub FROM STDIN") as copy:
                for c, f in pairs:
                    copy.write_row((c, "team", str(f["team"])))
            admin.execute("ANALYZE pgbroker.interest")
            admin.execute("ANALYZE bench.peer_sub")
            n = max(5, updates // 10 // ROUNDS)  # UPDATEs a round, per k
            peer_n = max(3, min(n, int(400_000 / n_subs)))  # the peer is slow at size: fewer updates
            rows = {k: list(range(1 + 300 * i, 301 + 300 * i)) for i, k in enumerate(KS)}  # team -k: k clients
            totals = {(design, k): [0.0, 0.0, 0] for design in ("pgbroker", "ranges", "peer") for k in KS}
            with psycopg.connect(url, autocommit=True) as writer:
                for k in KS:
                    for table in ("t", "r", "p"):
                        writer.execute(f"UPDATE bench.{table} SET team = %s WHERE id = ANY (%s)", (-k, rows[k]))
                    _updates(writer, "t", rows[k][:2])  # the plans, warm
                    _updates(writer, "r", rows[k][:2])
                _drain(broker)
                admin.execute("TRUNCATE bench.peer_out")
                for _ in range(ROUNDS):
                    for k in KS:
                        for design, table, count in (("pgbroker", "t", n), ("ranges", "r", n), ("peer", "p", peer_n)):
                            wall, cpu = _updates(writer, table, [rows[k][j % len(rows[k])] for j in range(count)])
                            total = totals[(design, k)]
                            total[0] += wall
                            total[1] += cpu
                            total[2] += count
                        _drain(broker)
                        admin.execute("TRUNCATE bench.peer_out")
            for (design, k), (wall, cpu, count) in totals.items():
                out[design].setdefault(str(k), {})[str(size)] = {"cpu_us": cpu / count * 1e6, "ms": wall / count * 1e3}
            broker.execute("SELECT pgbroker.client_unregister_many(%s::text[], name => %s)", (ids, LEASE))
            print(f"size {size}: pgbroker {out['pgbroker']} ranges {out['ranges']} peer {out['peer']}", flush=True)
        broker.execute("SELECT pgbroker.broker_release(%s)", (LEASE,))
        admin.execute("DROP SCHEMA bench CASCADE")
    return out


def verdicts(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the issue: name, value, target, how (">=" or "<="), met."""
    a = data["no_match"]
    out = [
        ("no-match UPDATE throughput, filtered / plain", a["throughput_ratio"], TARGETS["throughput_ratio"], ">="),
        ("no-match UPDATE CPU, filtered / plain", a["cpu_ratio"], TARGETS["cpu_ratio"], "<="),
        ("bulk filter subscription, filters/s", a["bulk"]["filters_per_s"], TARGETS["bulk_per_s"], ">="),
    ]
    small, large = str(SIZES[0]), str(SIZES[-1])
    for design, what in (("pgbroker", "subscriptions"), ("ranges", "range subscriptions")):
        for k, by in data["by_size"].get(design, {}).items():
            ratio = by[large]["cpu_us"] / max(by[small]["cpu_us"], 1e-9)
            out.append((f"k={k}: CPU per UPDATE at {int(large):,} / at {int(small):,} {what}", ratio,
                        TARGETS["size_ratio"], "<="))  # fmt: skip
    if "latency" in data:
        for way in ("in", "out"):
            out.append((f"commit to Broker.notifications(), row moving {way}, p99 (ms)",
                        data["latency"][way]["p99_ms"], TARGETS["latency_p99_ms"], "<="))  # fmt: skip
    return [{"name": n, "value": v, "target": t, "how": how, "met": v >= t if how == ">=" else v <= t}
            for n, v, t, how in out]  # fmt: skip


def run(scale: float, updates: int) -> dict[str, Any]:
    with EmbeddedPostgres(postgres_options=DURABLE) as server:
        with psycopg.connect(server.url, autocommit=True) as admin:
            admin.execute("CREATE DATABASE filters")
            version = admin.execute("SHOW server_version").fetchone()[0]
        url = server.url_for("filters")
        install.migrate(url)
        data: dict[str, Any] = {"server": version, "cpus": os.cpu_count(), "load_start": os.getloadavg()}
        data["latency"] = latency(url, scale)  # first: nothing of the other parts runs beside it
        print("latency:", data["latency"], flush=True)
        data["no_match"] = no_match(url, scale, updates)
        print("no match:", data["no_match"], flush=True)
        data["by_size"] = by_size(url, scale, updates)
    data["load_end"] = os.getloadavg()
    data["settings"] = {"scale": scale, "updates": updates, "subscriptions": SUBSCRIPTIONS, "values": VALUES,
                        "sizes": SIZES, "ks": KS, "batch": BATCH, "latency_changes": LATENCY_CHANGES,
                        "latency_period_ms": LATENCY_PERIOD * 1000}  # fmt: skip
    data["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        data["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        check=True, cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    data["verdicts"] = verdicts(data)
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every size (0.01: a smoke run)")
    parser.add_argument(
        "--updates",
        type=int,
        default=40_000,
        help="UPDATEs of each table in (a), in ten rounds (default 40,000: the CPU clock ticks every 10 ms)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the JSON results")
    args = parser.parse_args()
    data = run(args.scale, args.updates)
    for v in data["verdicts"]:
        print(f"{v['name']}: {v['value']:.3f} (target {v['target']}) {'met' if v['met'] else 'MISSED'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
