"""The console at size: 100,000 clients, 1,000,000 subscriptions and 100,000 KV entries; how long each page takes.

    python3 tests/benchmarks/bench_console.py            # --quick: 10,000 clients, 100,000 subscriptions, 10,000 keys
    python3 tests/benchmarks/bench_console.py --out tests/benchmarks/results/console.md

On its own PostgreSQL (durable settings, as the other benchmarks), one broker holds lease "big" with the clients
and subscriptions; the KV store holds keys "cfg/<0..99>/<i>".  A `pgbroker console` process (a role with
pgbroker_reader and pgbroker_user) serves the pages; each page is requested ROUNDS times over HTTP and the median
and worst times are reported, with the console process's CPU per request.  Pages read at most 200 rows by keyset
(never OFFSET), so the first, a middle and the last page cost the same; the background counts (broker_overview:
clients and subscriptions counted, read at most every 5 s) are timed on their own.  Where Chromium and
chromedriver exist, the time from navigation to a filled clients table and KV table is measured in the browser
too.  Run it under `flock /work/bench.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psycopg  # noqa: E402

from pgbroker import install  # noqa: E402
from pgbroker._embedded import EmbeddedPostgres, free_port  # noqa: E402

DURABLE = (
    "-c fsync=on -c synchronous_commit=on -c full_page_writes=on -c shared_buffers=512MB -c max_wal_size=4GB"
    " -c checkpoint_timeout=30min"
)
ROUNDS = 9
TARGET_S = 1.0

HOLDER = """
import sys, time, psycopg
url, lease, n, per = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
conn = psycopg.connect(url, autocommit=True, application_name="bench-holder")
epoch = conn.execute("SELECT pgbroker.broker_claim(%s, wait => NULL)", (lease,)).fetchone()[0]
for lo in range(0, n, 10000):
    hi = min(n, lo + 10000)
    conn.execute("SELECT pgbroker.client_register_many(ARRAY(SELECT 'client-' || lpad(i::text, 6, '0')"
                 " FROM generate_series(%s::integer, %s::integer) i), name => %s)", (lo, hi - 1, lease))
    conn.execute("SELECT pgbroker.subscribe_many(ARRAY(SELECT 'client-' || lpad(i::text, 6, '0')"
                 " FROM generate_series(%s::integer, %s::integer) i, generate_series(0, %s::integer) j ORDER BY i, j),"
                 " 'initech.objects', ARRAY(SELECT to_jsonb((i + j) %% %s::integer + 1)"
                 " FROM generate_series(%s::integer, %s::integer) i, generate_series(0, %s::integer) j ORDER BY i, j),"
                 " name => %s)", (lo, hi - 1, per - 1, n, lo, hi - 1, per - 1, lease))
print(conn.info.backend_pid, epoch, flush=True)
while True:
    time.sleep(1)
    conn.execute("SELECT pgbroker.broker_heartbeat(%s)", (lease,))
"""


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _get(base: str, path: str) -> dict:
    with urllib.request.urlopen(base + path, timeout=60) as response:
        assert response.status == 200, path
        return json.loads(response.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    clients = 10_000 if args.quick else 100_000
    per = 10
    keys = 10_000 if args.quick else 100_000

    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    with EmbeddedPostgres(postgres_options=DURABLE) as pg:
        install.migrate(pg.url)
        with psycopg.connect(pg.url, autocommit=True) as conn:
            version = conn.execute("SHOW server_version").fetchone()[0]
            conn.execute("CREATE ROLE console_bench LOGIN")
            conn.execute("GRANT pgbroker_reader, pgbroker_user TO console_bench")
            started = time.monotonic()
            holder = subprocess.Popen(
                [sys.executable, "-c", HOLDER, pg.url, "big", str(clients), str(per)], stdout=subprocess.PIPE, text=True
            )
            holder.stdout.readline()
            for lo in range(0, keys, 10_000):
                conn.execute(
                    "SELECT pgbroker.kv_set('cfg/' || (i %% 100) || '/' || lpad(i::text, 6, '0'), to_jsonb(i))"
                    " FROM generate_series(%s::integer, %s::integer) i",
                    (lo, min(keys, lo + 10_000) - 1),
                )
            conn.execute("SELECT pgbroker.counter_add('jobs/' || i, i) FROM generate_series(1, 1000) i")
            conn.execute("VACUUM ANALYZE")
            loaded = time.monotonic() - started
            n_clients, n_subs = conn.execute(
                "SELECT count(*), sum(subscriptions) FROM pgbroker.clients WHERE name = 'big'"
            ).fetchone()
            n_keys = conn.execute("SELECT count(*) FROM pgbroker.kv").fetchone()[0]
            counted = []
            for _ in range(3):
                t = time.perf_counter()
                conn.execute("SELECT * FROM pgbroker.broker_overview").fetchall()
                counted.append(time.perf_counter() - t)
            health = []
            for _ in range(3):
                t = time.perf_counter()
                conn.execute("SELECT * FROM pgbroker.health").fetchall()
                health.append(time.perf_counter() - t)

        port = free_port()
        log = tempfile.NamedTemporaryFile("w+", prefix="pgbroker-console-bench-", suffix=".log")  # noqa: SIM115
        console = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pgbroker.cli",
                "console",
                "--url",
                pg.url_for("postgres", user="console_bench"),
                "--port",
                str(port),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(OSError):
                    _get(base, "/api/info")
                    break
                assert time.monotonic() < deadline and console.poll() is None, Path(log.name).read_text()
                time.sleep(0.2)
            mid = f"client-{clients // 2:06d}"
            last = f"client-{clients - 20:06d}"
            pages = [
                ("brokers", "/api/brokers"),
                ("lease history", "/api/history?name=big"),
                ("clients, first page", "/api/clients?name=big"),
                ("clients, a middle page", f"/api/clients?name=big&after={mid}"),
                ("clients, the last page", f"/api/clients?name=big&after={last}"),
                ("clients, search by id prefix", "/api/clients?name=big&prefix=client-0077"),
                ("clients, search finding nothing", "/api/clients?name=big&prefix=nobody"),
                # sorts before every id: the index is read to its end, the worst a search can cost
                ("clients, search finding nothing (scans all)", "/api/clients?name=big&prefix=a"),
                ("a client's subscriptions", f"/api/subscriptions?name=big&client={mid}"),
                ("KV tree, the root level", "/api/kv/tree?limit=100"),
                ("KV tree, cfg/ (100 folders, one probe each)", "/api/kv/tree?prefix=cfg/&limit=100"),
                ("KV tree, cfg/42/ (its first 100 keys)", "/api/kv/tree?prefix=cfg/42/&limit=100"),
                ("KV, first page (100 rows)", "/api/kv?limit=100"),
                ("KV, a folder (cfg/42/)", "/api/kv?prefix=cfg/42/&limit=100"),
                ("KV, a middle page", "/api/kv?after=cfg/5&limit=100"),
                ("KV, prefix finding nothing", "/api/kv?prefix=zzz/&limit=100"),
                ("KV, prefix finding nothing (scans all)", "/api/kv?prefix=a&limit=100"),
                ("locks", "/api/locks"),
                ("semaphores", "/api/semaphores"),
                ("squatters", "/api/unaccounted"),
                ("counters", "/api/counters"),
                ("rate limits", "/api/rate_limits"),
                ("name grants", "/api/grants"),
                ("doctor (health, cached 5 s)", "/api/health"),
            ]
            say(f"# The console at size ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
            say()
            say(
                f"PostgreSQL {version}, {os.cpu_count()} CPUs; lease 'big' with {n_clients:,} clients and "
                f"{n_subs:,} subscriptions, {n_keys:,} KV entries, 1,000 counters (loaded in {loaded:.0f} s)."
            )
            say(
                f"Each page requested {ROUNDS} times over HTTP from `pgbroker console` (read-only, pgbroker_reader "
                f"and pgbroker_user); target: every page under {TARGET_S:.0f} s."
            )
            say()
            say("| page | rows | median | worst | console CPU per request |")
            say("|---|---|---|---|---|")
            worst_all = 0.0
            for label, path in pages:
                times = []
                cpu0 = _cpu_s(console.pid)
                for _ in range(ROUNDS):
                    t = time.perf_counter()
                    body = _get(base, path)
                    times.append(time.perf_counter() - t)
                cpu = (_cpu_s(console.pid) - cpu0) / ROUNDS
                worst_all = max(worst_all, max(times))
                say(
                    f"| {label} | {len(body.get('rows', []))} | {statistics.median(times) * 1000:.1f} ms | "
                    f"{max(times) * 1000:.1f} ms | {cpu * 1000:.1f} ms |"
                )
            say()
            say(
                f"Worst page: {worst_all * 1000:.0f} ms ({'under' if worst_all < TARGET_S else 'OVER'} the "
                f"{TARGET_S:.0f} s target)."
            )
            say(
                f"Background counts (broker_overview: every client's subscriptions counted; read at most every 5 s, "
                f"shown with their age): median {statistics.median(counted) * 1000:.0f} ms. The health view (the "
                f"doctor page, cached 5 s): median {statistics.median(health) * 1000:.0f} ms."
            )
            browser = _browser_times(base)
            if browser:
                say()
                say("In headless Chromium, navigation to a filled table (median of 5):")
                for label, seconds in browser:
                    say(f"- {label}: {seconds * 1000:.0f} ms")
            with psycopg.connect(pg.url, autocommit=True) as conn:
                sessions = conn.execute(
                    "SELECT application_name, count(*) FROM pg_stat_activity"
                    " WHERE application_name LIKE 'pgbroker console%' GROUP BY 1 ORDER BY 1"
                ).fetchall()
            say()
            say("Database sessions of the console: " + ", ".join(f"{n} x {a!r}" for a, n in sessions) + ".")
        finally:
            console.terminate()
            console.wait(15)
            holder.kill()
            holder.wait(10)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


def _browser_times(base: str) -> list[tuple[str, float]]:
    if not (os.access("/usr/bin/chromium", os.X_OK) and os.access("/usr/bin/chromedriver", os.X_OK)):
        print("(no Chromium: the in-browser times are left out)")
        return []
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="pgbroker-console-bench-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    found = []
    try:
        for label, tab, selector, rows in (
            ("Brokers tab, holder and timeline", "brokers", "#timeline g.tl-event", 1),
            ("Clients tab, first 50 clients", "clients", "#clients tbody tr[data-client]", 50),
            ("Key-value tab, the tree's root", "kv", "#kv tbody tr[data-key]", 1),
        ):
            times = []
            for _ in range(5):
                driver.get("about:blank")
                t = time.perf_counter()
                driver.get(f"{base}/#{tab}")
                deadline = time.monotonic() + 30
                while len(driver.find_elements("css selector", selector)) < rows:
                    assert time.monotonic() < deadline, label
                    time.sleep(0.01)
                times.append(time.perf_counter() - t)
            found.append((label, statistics.median(times)))
    finally:
        driver.quit()
    return found


if __name__ == "__main__":
    main()
