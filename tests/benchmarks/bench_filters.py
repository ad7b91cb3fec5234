"""Benchmark of subscriptions by filter (issue 43; run on demand).

    python tests/benchmarks/bench_filters.py [--scale 1.0] [--updates 5000] [--out results/filters.json]

Starts its own throwaway PostgreSQL with fsync, synchronous_commit and
full_page_writes ON, installs pgbroker, and measures, each ratio against a
floor measured in the same run on the same server:

a) a watched single-row UPDATE of a row matching no filter, on a table with
   100,000 filter subscriptions on 10,000 other values, against the same
   UPDATE on a twin table with no filter subscriptions (rounds of both,
   interleaved): throughput and the writing backend's CPU per UPDATE (from
   /proc/<pid>/stat).  Targets: at least 0.9x the throughput, at most 1.1x
   the CPU per UPDATE;
b) the CPU per UPDATE of a row matching k = 1, 10 and 100 filter
   subscriptions, with 1,000, 10,000 and 100,000 filter subscriptions in
   all: the cost must follow k, not the number of subscriptions (target: at
   100,000 at most 1.5x the cost at 1,000, for each k);
c) bulk filter subscription: ``subscribe_filters`` of 100,000 filters in
   batches of 10,000 (the clients registered first).  Target: at least
   50,000 filters/s;
d) the peer design, beside (b): a trigger that evaluates every filter
   subscription row by row for each changed row (what Supabase Realtime's
   WALRUS does per change), at 1,000, 10,000 and 100,000 subscriptions:
   its CPU per UPDATE grows with the number of subscriptions.

A broker session holds the lease, awake (``broker_wake``), and acknowledges
the outbox between rounds, so writers pay no NOTIFY.  ``--scale`` multiplies
every size (``--scale 0.01 --updates 50``: a smoke run of a few seconds).
Writes the figures to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
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
LEASE = "filters"
ROWS = 10_000
SUBSCRIPTIONS = 100_000
VALUES = 10_000
BATCH = 10_000
SIZES = (1_000, 10_000, 100_000)
KS = (1, 10, 100)
ROUNDS = 5
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "filters.json"
TARGETS = {"throughput_ratio": 0.9, "cpu_ratio": 1.1, "size_ratio": 1.5, "bulk_per_s": 50_000}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pid(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT pg_backend_pid()").fetchone()[0]


def _table(admin: psycopg.Connection, name: str, rows: int) -> None:
    admin.execute(f"CREATE TABLE bench.{name} (id integer PRIMARY KEY, team integer NOT NULL, v integer NOT NULL)")
    admin.execute(f"INSERT INTO bench.{name} SELECT i, 0, 0 FROM generate_series(1, {rows}) i")
    admin.execute(f"ANALYZE bench.{name}")
    admin.execute(f"SELECT pgbroker.watch('bench.{name}')")


def _register(broker: psycopg.Connection, ids: list[str]) -> None:
    for s in range(0, len(ids), BATCH):
        broker.execute("SELECT pgbroker.client_register_many(%s::text[], name => %s)", (ids[s : s + BATCH], LEASE))


def _subscribe(broker: psycopg.Connection, table: str, pairs: list[tuple[str, dict]]) -> float:
    """subscribe_filters in batches; returns the seconds it took."""
    t = time.perf_counter()
    for s in range(0, len(pairs), BATCH):
        batch = pairs[s : s + BATCH]
        broker.execute(
            "SELECT pgbroker.subscribe_filters(%s::text[], %s::regclass, %s::jsonb[], name => %s)",
            ([c for c, _ in batch], f"bench.{table}", [json.dumps(f) for _, f in batch], LEASE),
        )
    return time.perf_counter() - t


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
    with psycopg.connect(url, autocommit=True) as admin, psycopg.connect(url, autocommit=True) as broker:
        admin.execute("CREATE SCHEMA bench")
        _table(admin, "plain", rows)
        _table(admin, "filtered", rows)
        broker.execute("SELECT pgbroker.broker_claim(%s)", (LEASE,))
        broker.execute("SELECT pgbroker.broker_wake(%s)", (LEASE,))
        ids = [f"c{i}" for i in range(subs // 10)]
        _register(broker, ids)
        pairs = [(ids[i % len(ids)], {"team": 1 + i % values}) for i in range(subs)]  # team 0: nobody's
        bulk_s = _subscribe(broker, "filtered", pairs)
        admin.execute("ANALYZE pgbroker.interest")
        per_round = max(1, updates // ROUNDS)
        totals = {"plain": [0.0, 0.0], "filtered": [0.0, 0.0]}
        with psycopg.connect(url, autocommit=True) as writer:
            _updates(writer, "plain", list(range(1, 51)))  # warm both plans
            _updates(writer, "filtered", list(range(1, 51)))
            for r in range(ROUNDS):
                for table in ("plain", "filtered") if r % 2 == 0 else ("filtered", "plain"):
                    wall, cpu = _updates(writer, table, [1 + (j % rows) for j in range(per_round)])
                    totals[table][0] += wall
                    totals[table][1] += cpu
        n = per_round * ROUNDS
        assert broker.execute("SELECT count(*) FROM pgbroker.outbox").fetchone()[0] == 0, "a no-match UPDATE wrote"
        out = {
            table: {"updates_per_s": n / wall, "cpu_us_per_update": cpu / n * 1e6}
            for table, (wall, cpu) in totals.items()
        }
        out["throughput_ratio"] = out["filtered"]["updates_per_s"] / out["plain"]["updates_per_s"]
        out["cpu_ratio"] = out["filtered"]["cpu_us_per_update"] / max(out["plain"]["cpu_us_per_update"], 1e-9)
        out["subscriptions"], out["values"], out["updates"] = subs, values, n
        out["bulk"] = {"filters": subs, "s": bulk_s, "filters_per_s": subs / bulk_s}
        broker.execute("SELECT pgbroker.broker_release(%s)", (LEASE,))
        admin.execute("DROP SCHEMA bench CASCADE")
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
    out: dict[str, Any] = {"pgbroker": {}, "peer": {}}
    with psycopg.connect(url, autocommit=True) as admin, psycopg.connect(url, autocommit=True) as broker:
        broker.execute("SELECT pgbroker.broker_claim(%s)", (LEASE,))
        broker.execute("SELECT pgbroker.broker_wake(%s)", (LEASE,))
        for size in SIZES:
            n_subs = max(sum(KS) + 10, int(size * scale))
            admin.execute("DROP SCHEMA IF EXISTS bench CASCADE")
            admin.execute("CREATE SCHEMA bench")
            _table(admin, "t", 1000)
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
            with admin.cursor() as cur, cur.copy("COPY bench.peer_sub FROM STDIN") as copy:
                for c, f in pairs:
                    copy.write_row((c, "team", str(f["team"])))
            admin.execute("ANALYZE pgbroker.interest")
            admin.execute("ANALYZE bench.peer_sub")
            n = max(5, updates // 10)
            peer_n = max(3, min(n, int(2_000_000 / n_subs)))  # the peer is slow at size: fewer updates
            with psycopg.connect(url, autocommit=True) as writer:
                for k in KS:
                    _updates(writer, "t", [1, 2], team=-k)
                    _drain(broker)
                    wall, cpu = _updates(writer, "t", [1 + (j % 1000) for j in range(n)], team=-k)
                    _drain(broker)
                    out["pgbroker"].setdefault(str(k), {})[str(size)] = {"cpu_us": cpu / n * 1e6, "ms": wall / n * 1e3}
                    wall, cpu = _updates(writer, "p", [1 + (j % 1000) for j in range(peer_n)], team=-k)
                    out["peer"].setdefault(str(k), {})[str(size)] = {"cpu_us": cpu / peer_n * 1e6,
                                                                     "ms": wall / peer_n * 1e3}  # fmt: skip
                    admin.execute("TRUNCATE bench.peer_out")
            broker.execute("SELECT pgbroker.client_unregister_many(%s::text[], name => %s)", (ids, LEASE))
            print(f"size {size}: pgbroker {out['pgbroker']} peer {out['peer']}", flush=True)
        broker.execute("SELECT pgbroker.broker_release(%s)", (LEASE,))
        admin.execute("DROP SCHEMA bench CASCADE")
    return out


def verdicts(data: dict[str, Any]) -> list[dict[str, Any]]:
    a = data["no_match"]
    out = [
        ("no-match UPDATE throughput, filtered / plain", a["throughput_ratio"], TARGETS["throughput_ratio"], ">="),
        ("no-match UPDATE CPU, filtered / plain", a["cpu_ratio"], TARGETS["cpu_ratio"], "<="),
        ("bulk filter subscription, filters/s", a["bulk"]["filters_per_s"], TARGETS["bulk_per_s"], ">="),
    ]
    small, large = str(SIZES[0]), str(SIZES[-1])
    for k, by in data["by_size"]["pgbroker"].items():
        ratio = by[large]["cpu_us"] / max(by[small]["cpu_us"], 1e-9)
        out.append((f"k={k}: CPU per UPDATE at {large} / at {small} subscriptions", ratio, TARGETS["size_ratio"], "<="))
    return [{"name": n, "value": v, "target": t, "met": v >= t if how == ">=" else v <= t} for n, v, t, how in out]


def run(scale: float, updates: int) -> dict[str, Any]:
    with EmbeddedPostgres(postgres_options=DURABLE) as server:
        with psycopg.connect(server.url, autocommit=True) as admin:
            admin.execute("CREATE DATABASE filters")
            version = admin.execute("SHOW server_version").fetchone()[0]
        url = server.url_for("filters")
        install.migrate(url)
        data: dict[str, Any] = {"server": version, "cpus": os.cpu_count(), "load_start": os.getloadavg()}
        data["no_match"] = no_match(url, scale, updates)
        print("no match:", data["no_match"], flush=True)
        data["by_size"] = by_size(url, scale, updates)
    data["load_end"] = os.getloadavg()
    data["settings"] = {"scale": scale, "updates": updates, "subscriptions": SUBSCRIPTIONS, "values": VALUES,
                        "sizes": SIZES, "ks": KS}  # fmt: skip
    data["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        data["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        check=True, cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    data["verdicts"] = verdicts(data)
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every size (0.01: a smoke run)")
    parser.add_argument("--updates", type=int, default=5000, help="UPDATEs per measurement of (a) (default 5000)")
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
