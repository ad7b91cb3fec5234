"""Benchmark of the coordination primitives against raw SQL floors and peers (run on demand).

    python tests/benchmarks/bench_primitives.py            # about 6 minutes
    python tests/benchmarks/bench_primitives.py --quick    # shorter runs, for a smoke test
    python tests/benchmarks/bench_primitives.py --only ratelimit   # one part (repeatable): locks, semaphores,
                                                                   # counters, peers, breakdown, ratelimit,
                                                                   # authority
    python -m pytest tests/benchmarks/bench_primitives.py -s -p no:cacheprovider

Starts its own throwaway PostgreSQL with fsync, synchronous_commit and
full_page_writes ON (the test fixtures turn them off), installs pgbroker with
its migrations, and measures, in the same run, each against a floor measured
alternately with it (ratio = pgbroker's throughput / the floor's):

1. Named lock acquire+release cycles/s through the Python API
   (``Lock(conn, 'n')``: ``acquire()`` / ``release()``, which take the lock by
   its cached key), and through the SQL functions
   (``SELECT pgbroker.lock_acquire('n')`` / ``SELECT pgbroker.lock_release('n')``),
   against ``pg_advisory_lock(1)`` / ``pg_advisory_unlock(1)``, 1 process and
   8 processes contending on one name.  Target: at least 0.9x.
2. Semaphore acquire+release, limit 4, 8 processes: ``semaphore_acquire('s', 4,
   NULL)`` (waiting in the server), and a retry loop of ``semaphore_acquire('s', 4,
   '0')``, against a retry loop of one statement that tries 4 slot keys with
   ``pg_try_advisory_lock``.  Target: at least 0.7x.  Also release -> next waiter
   holding a permit (p50/p99), waiting in ``semaphore_acquire(..., NULL)`` and by
   LISTEN on ``semaphore_channel()`` + retry, against a waiter blocked in
   ``pg_advisory_lock``.  Target: p99 under 5 ms.
3. ``counter_add('c')`` against ``INSERT ... ON CONFLICT DO UPDATE ... RETURNING`` on a
   one-row table, 1 and 8 processes; KV compare-and-set (``kv_set(key, value,
   version)`` naming the version the previous one returned) against ``UPDATE ...
   WHERE key = $1 AND version = $2 RETURNING version``, 1 process and 8 processes
   on a key each, without a watcher (no NOTIFY) and, 8 processes, while a
   session watches (``kv_watch_begin``: every change announced).  Target: at
   least 0.8x.
4. Peers, where installed (skipped with the reason otherwise; not installed by CI):
   postgresql-lock (0.1.9 on Python 3.11), pals, tooz's PostgreSQL driver, and
   python-redis-lock against a local ``redis-server`` (Debian: ``apt-get install
   redis-server``), on the lock cycle of 1., each against the raw floor measured
   alternately with it (for redis, right after it).
5. Where the lock cycle's time goes: the same cycle as bare PL/pgSQL functions
   around the advisory lock, with SECURITY DEFINER + SET search_path, and with the
   name lookup, 1 process.
6. Rate limits (``--only ratelimit`` runs this part alone, about a minute):
   ``pgbroker.rate_limit(name, 1000, '1 s')`` decisions/s on one name (mostly
   denied: the processes ask for far more than 1000/s) and on 1,000 names (each
   under its limit), 1 and 8 processes, against the raw floor: one prepared
   ``INSERT ... ON CONFLICT DO UPDATE ... RETURNING`` on an UNLOGGED table doing
   the same GCRA arithmetic (``RL_FLOOR``).  Target: at least 0.8x.  Also the
   Python ``RateLimiter.allow()``, and peers on one name at 1000/s, each against
   the same floor: pyrate-limiter's PostgresBucket, rate-sync's PostgreSQL
   engine *re-created* from its source (rate-sync needs Python 3.12; see
   ``kind_ratesync``), and limits' moving window on a local redis-server.

7. Authority per name (``--only authority``, about 100 s): the lock cycle through
   SQL, KV compare-and-set and ``counter_add``, 1 process, by a login role that
   is a member of pgbroker_user, on names a grant covers, with 0, 1 and 1,000
   grants of that kind defined (three databases of the same server, measured
   alternately).  Target: with 1,000 grants, at least 0.9x of the same call
   without grants.

Every figure also gives the CPU per operation: the client processes' CPU time
plus the server's (the postmaster and all its children, from /proc), divided by
the operations done.  Loopback only; every measurement bounded in time.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psycopg  # noqa: E402

from pgbroker import install  # noqa: E402
from pgbroker._embedded import EmbeddedPostgres  # noqa: E402

DURABLE = "-c fsync=on -c synchronous_commit=on -c full_page_writes=on -c checkpoint_timeout=30min -c max_wal_size=4GB"
LOCK_TARGET = 0.9
SEMAPHORE_TARGET = 0.7
COUNTER_TARGET = 0.8
RATE_LIMIT_TARGET = 0.8
AUTHORITY_TARGET = 0.9
WAKE_P99_TARGET_MS = 5.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Settings:
    seconds: float = 2.0  # per round and variant
    rounds: int = 2  # alternating rounds per variant
    wakeups: int = 40  # release -> waiter samples per variant
    rl_seconds: float = 1.0  # per round and variant, rate limits (part 6)
    auth_rounds: int = 5  # alternating rounds per variant, authority (part 7): its differences are a few percent

    @classmethod
    def quick(cls) -> Settings:
        return cls(seconds=0.7, rounds=1, wakeups=10, rl_seconds=0.5, auth_rounds=1)


@dataclass
class Rate:
    ops: int
    seconds: float
    cpu: float  # client + server CPU seconds

    @property
    def per_second(self) -> float:
        return self.ops / self.seconds if self.seconds else 0.0

    @property
    def cpu_us(self) -> float:
        return self.cpu / self.ops * 1e6 if self.ops else float("nan")

    def __add__(self, other: Rate) -> Rate:
        return Rate(self.ops + other.ops, self.seconds + other.seconds, self.cpu + other.cpu)

    def cell(self) -> str:
        return f"{self.per_second:,.0f}/s, {self.cpu_us:,.0f} us CPU/op"


@dataclass
class Results:
    rows: list[tuple[str, str, str, str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)
    missed: list[str] = field(default_factory=list)

    def add(self, metric: str, ours: str, floor: str, ratio: str, target: str) -> None:
        self.rows.append((metric, ours, floor, ratio, target))
        print(f"  {metric}: {ours} | floor {floor} | {ratio} {target}", flush=True)

    def compare(self, metric: str, ours: Rate, floor: Rate, target: float | None, key: str) -> float:
        ratio = ours.per_second / floor.per_second
        self.figures[key] = ratio
        verdict = ""
        if target is not None:
            verdict = f">= {target}x " + ("ok" if ratio >= target else "MISSED")
            if ratio < target:
                self.missed.append(metric)
        self.add(metric, ours.cell(), floor.cell(), f"{ratio:.2f}x", verdict)
        return ratio

    def table(self) -> str:
        header = ("metric", "pgbroker", "floor", "ratio", "target")
        widths = [max(len(r[i]) for r in [header, *self.rows]) for i in range(5)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *self.rows]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


# ---------------------------------------------------------------------------
# The cycles.  Each kind makes, in the worker process, (cycle, close).

Cycle = Callable[[], None]


def _conn(url: str) -> psycopg.Connection:
    return psycopg.connect(url, autocommit=True)


def _sql_pair(url: str, first: str, second: str, params: tuple = ()) -> tuple[Cycle, Callable[[], None]]:
    conn = _conn(url)

    def cycle() -> None:
        conn.execute(first, params, prepare=True).fetchone()
        conn.execute(second, params, prepare=True).fetchone()

    return cycle, conn.close


def kind_lock(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    return _sql_pair(url, "SELECT pgbroker.lock_acquire('n')", "SELECT pgbroker.lock_release('n')")


def kind_py_lock(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    from pgbroker.primitives import Lock

    conn = _conn(url)
    lock = Lock(conn, "n")

    def cycle() -> None:
        lock.acquire()
        lock.release()

    return cycle, conn.close


def kind_lock_floor(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    return _sql_pair(url, "SELECT pg_advisory_lock(1)", "SELECT pg_advisory_unlock(1)")


def kind_bare(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    return _sql_pair(url, "SELECT bench_bare_lock()", "SELECT bench_bare_unlock()")


def kind_bare_definer(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    return _sql_pair(url, "SELECT bench_definer_lock()", "SELECT bench_definer_unlock()")


def kind_lookup(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    return _sql_pair(url, "SELECT bench_lookup_lock('n')", "SELECT bench_lookup_unlock('n')")


def kind_lookup_definer(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    return _sql_pair(url, "SELECT bench_lookup_definer_lock('n')", "SELECT bench_lookup_definer_unlock('n')")


def kind_two_int(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    return _sql_pair(url, "SELECT pg_advisory_lock(1885823596, 1)", "SELECT pg_advisory_unlock(1885823596, 1)")


def kind_lease(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    """bench_lease.py's claim + release cycle (for bench_installs.py), on a lease name per process."""
    return _sql_pair(
        url, f"SELECT pgbroker.broker_claim('bench{idx}')", f"SELECT pgbroker.broker_release('bench{idx}')"
    )


LEASE_FLOOR_TABLE = (
    "CREATE TABLE bench_lease (name text PRIMARY KEY, epoch bigint NOT NULL, holder_pid integer,"
    " claimed_at timestamptz)"
)
LEASE_FLOOR_UPDATE = (
    "UPDATE bench_lease SET epoch = epoch + 1, holder_pid = pg_backend_pid(), claimed_at = now() WHERE name = %s"
)


def kind_lease_floor(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    """bench_lease.py's floor: try-lock, UPDATE the lease row, unlock (bench_lease as LEASE_FLOOR_TABLE makes it)."""
    conn = _conn(url)
    conn.execute("INSERT INTO bench_lease VALUES (%s, 0, NULL, NULL) ON CONFLICT DO NOTHING", (f"bench{idx}",))

    def cycle() -> None:
        conn.execute("SELECT pg_try_advisory_lock(1, %s)", (idx,), prepare=True)
        conn.execute(LEASE_FLOOR_UPDATE, (f"bench{idx}",), prepare=True)
        conn.execute("SELECT pg_advisory_unlock(1, %s)", (idx,), prepare=True)

    return cycle, conn.close


def kind_sem_wait(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    return _sql_pair(url, "SELECT pgbroker.semaphore_acquire('s', 4, NULL)", "SELECT pgbroker.semaphore_release('s')")


def kind_sem_try(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    conn = _conn(url)

    def cycle() -> None:
        while conn.execute("SELECT pgbroker.semaphore_acquire('s', 4, '0')", prepare=True).fetchone()[0] is None:
            pass
        conn.execute("SELECT pgbroker.semaphore_release('s')", prepare=True)

    return cycle, conn.close


def kind_sem_listen(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    conn = _conn(url)
    channel = conn.execute("SELECT pgbroker.semaphore_channel('s')").fetchone()[0]
    conn.execute(f'LISTEN "{channel}"')

    def cycle() -> None:
        while conn.execute("SELECT pgbroker.semaphore_acquire('s', 4, '0')", prepare=True).fetchone()[0] is None:
            for _ in conn.notifies(timeout=0.1, stop_after=1):
                pass
        conn.execute("SELECT pgbroker.semaphore_release('s')", prepare=True)

    return cycle, conn.close


SLOT_TRY = "SELECT k FROM generate_series(1, 4) AS k WHERE pg_try_advisory_lock(2, k) LIMIT 1"


def kind_sem_floor(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    conn = _conn(url)

    def cycle() -> None:
        while (row := conn.execute(SLOT_TRY, prepare=True).fetchone()) is None:
            pass
        conn.execute("SELECT pg_advisory_unlock(2, %s)", (row[0],), prepare=True)

    return cycle, conn.close


def kind_counter(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    return _counter_add(url, "c")


def _counter_add(url: str, name: str) -> tuple[Cycle, Callable[[], None]]:
    conn = _conn(url)
    return (lambda: conn.execute("SELECT pgbroker.counter_add(%s)", (name,), prepare=True).fetchone()), conn.close


COUNTER_FLOOR = (
    "INSERT INTO bench_counter AS c (name, value) VALUES ('c', 1) ON CONFLICT (name)"
    " DO UPDATE SET value = c.value + excluded.value, updated_at = clock_timestamp() RETURNING c.value"
)


def kind_counter_floor(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    conn = _conn(url)
    return (lambda: conn.execute(COUNTER_FLOOR, prepare=True).fetchone()), conn.close


def kind_kv(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    return _kv_cas(url, f"k{idx}")


def _kv_cas(url: str, key: str) -> tuple[Cycle, Callable[[], None]]:
    """Compare-and-set cycles on KEY, by a single writer."""
    conn = _conn(url)
    version = [conn.execute("SELECT pgbroker.kv_set(%s, '{\"n\": 0}')", (key,)).fetchone()[0]]
    value = psycopg.types.json.Jsonb({"n": 1})

    def cycle() -> None:
        new = conn.execute("SELECT pgbroker.kv_set(%s, %s, %s)", (key, value, version[0]), prepare=True).fetchone()[0]
        assert new is not None, "compare-and-set failed with a single writer"
        version[0] = new

    return cycle, conn.close


KV_FLOOR = (
    "UPDATE bench_kv SET value = %s, version = version + 1, updated_at = clock_timestamp()"
    " WHERE key = %s AND version = %s RETURNING version"
)


def kind_kv_floor(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    conn = _conn(url)
    key = f"k{idx}"
    conn.execute("INSERT INTO bench_kv VALUES (%s, '{}', 0) ON CONFLICT (key) DO UPDATE SET version = 0", (key,))
    version = [0]
    value = psycopg.types.json.Jsonb({"n": 1})

    def cycle() -> None:
        row = conn.execute(KV_FLOOR, (value, key, version[0]), prepare=True).fetchone()
        assert row is not None
        version[0] = row[0]

    return cycle, conn.close


def kind_kv_no_notify(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    """kv_set's compare-and-set without its pg_notify (a copy in PL/pgSQL, SECURITY DEFINER, same sequence)."""
    conn = _conn(url)
    key = f"k{idx}"
    version = [conn.execute("SELECT pgbroker.kv_set(%s, '{\"n\": 0}')", (key,)).fetchone()[0]]
    value = psycopg.types.json.Jsonb({"n": 1})

    def cycle() -> None:
        new = conn.execute("SELECT bench_kv_cas_no_notify(%s, %s, %s)", (key, value, version[0]), prepare=True)
        version[0] = new.fetchone()[0]
        assert version[0] is not None

    return cycle, conn.close


KV_FLOOR_NOTIFY = (
    "WITH u AS (UPDATE bench_kv SET value = %s, version = version + 1, updated_at = clock_timestamp()"
    " WHERE key = %s AND version = %s RETURNING key, version)"
    " SELECT version, pg_notify('bench_kv', json_build_object('key', key, 'version', version)::text) FROM u"
)


def kind_kv_floor_notify(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    """The raw UPDATE floor plus a pg_notify in the same statement."""
    conn = _conn(url)
    key = f"k{idx}"
    conn.execute("INSERT INTO bench_kv VALUES (%s, '{}', 0) ON CONFLICT (key) DO UPDATE SET version = 0", (key,))
    version = [0]
    value = psycopg.types.json.Jsonb({"n": 1})

    def cycle() -> None:
        row = conn.execute(KV_FLOOR_NOTIFY, (value, key, version[0]), prepare=True).fetchone()
        assert row is not None
        version[0] = row[0]

    return cycle, conn.close


def kind_postgresql_lock(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    from postgresql_lock import Lock

    conn = _conn(url)
    lock = Lock(conn, "n", interface="psycopg3")

    def cycle() -> None:
        lock.acquire()
        lock.release()

    return cycle, conn.close


def kind_pals(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    import pals

    locker = pals.Locker("bench", db_url=url.replace("postgresql://", "postgresql+psycopg://"))
    lock = locker.lock("n")

    def cycle() -> None:
        assert lock.acquire()
        lock.release()

    return cycle, locker.engine.dispose


def kind_tooz(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    from tooz import coordination

    coord = coordination.get_coordinator(url, f"bench-{idx}".encode())
    coord.start()
    lock = coord.get_lock(b"n")

    def cycle() -> None:
        assert lock.acquire(blocking=True)
        lock.release()

    return cycle, coord.stop


def kind_redis_lock(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    import redis
    import redis_lock

    client = redis.Redis.from_url(url)
    lock = redis_lock.Lock(client, "n", expire=60)

    def cycle() -> None:
        lock.acquire(blocking=True)
        lock.release()

    return cycle, client.close


def kind_redis_floor(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    """Not a floor for the table: the raw SET NX / DEL round trips python-redis-lock builds on."""
    import redis

    client = redis.Redis.from_url(url)

    def cycle() -> None:
        while not client.set("raw", "1", nx=True, ex=60):
            pass
        client.delete("raw")

    return cycle, client.close


# Rate limits: every variant decides calls of 1 against 1000 per second (burst 1000) on one name, or on
# 1,000 names taken in turn (each process starting at its own offset).
RL_RATE = 1000
RL_PER = timedelta(seconds=1)
RL_KEYS = 1000
RL_SQL = "SELECT allowed, retry_after, remaining FROM pgbroker.rate_limit(%s, %s, %s, %s, %s)"
# The floor: the least a correct rate limiter on the server's clock does, the same GCRA in femtoseconds with
# the same outputs, as one prepared statement on an UNLOGGED table with the same fill factor.  What it skips:
# the PL/pgSQL call, SECURITY DEFINER with its pinned search_path, the checks of the name and parameters.
RL_FLOOR = """
INSERT INTO bench_rl AS s (name, tat, lim, t, allowed, denied, last_allowed, updated_at)
SELECT %(name)s, v.now + %(cost)s * v.t, v.now + (coalesce(%(burst)s, %(rate)s) - %(cost)s) * v.t, v.t, 1, 0, true,
       clock_timestamp()
  FROM (SELECT EXTRACT(epoch FROM clock_timestamp()) * 1000000000000000 AS now,
               div(EXTRACT(epoch FROM %(per)s::interval) * 1000000000000000 + %(rate)s - 1, %(rate)s::numeric) AS t) v
ON CONFLICT (name) DO UPDATE
   SET tat = CASE WHEN s.tat <= excluded.lim THEN greatest(s.tat, excluded.tat - %(cost)s * excluded.t)
                                                  + %(cost)s * excluded.t
                  ELSE s.tat END,
       allowed = s.allowed + (s.tat <= excluded.lim)::integer,
       denied = s.denied + (s.tat > excluded.lim)::integer,
       last_allowed = s.tat <= excluded.lim,
       lim = excluded.lim, t = excluded.t, updated_at = excluded.updated_at
RETURNING s.last_allowed,
          CASE WHEN s.last_allowed THEN interval '0'
               ELSE make_interval(secs => ceil((s.tat - s.lim) / 1000000000) / 1000000) END,
          greatest(div(s.lim + %(cost)s * s.t - s.tat, s.t), 0)::integer
"""


def _rl_names(idx: int, many: bool) -> Callable[[], str]:
    """The name of each next call: always 'rl', or 1,000 names in turn from an offset per process."""
    if not many:
        return lambda: "rl"
    state = [idx * (RL_KEYS // 8)]

    def name() -> str:
        state[0] = (state[0] + 1) % RL_KEYS
        return f"rl{state[0]}"

    return name


def _rl(url: str, idx: int, many: bool) -> tuple[Cycle, Callable[[], None]]:
    conn, name = _conn(url), _rl_names(idx, many)
    return (lambda: conn.execute(RL_SQL, (name(), RL_RATE, RL_PER, None, 1), prepare=True).fetchone()), conn.close


def _rl_floor(url: str, idx: int, many: bool) -> tuple[Cycle, Callable[[], None]]:
    conn, name = _conn(url), _rl_names(idx, many)

    def cycle() -> None:
        params = {"name": name(), "rate": RL_RATE, "per": RL_PER, "burst": None, "cost": 1}
        conn.execute(RL_FLOOR, params, prepare=True).fetchone()

    return cycle, conn.close


def kind_rl(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    return _rl(url, idx, False)


def kind_rl_keys(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    return _rl(url, idx, True)


def kind_rl_floor(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    return _rl_floor(url, idx, False)


def kind_rl_floor_keys(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    return _rl_floor(url, idx, True)


def kind_rl_py(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    from pgbroker.primitives import RateLimiter

    conn = _conn(url)
    limiter = RateLimiter(conn, "rl", RL_RATE, RL_PER)
    return limiter.allow, conn.close


def kind_rl_bare(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    """rate_limit()'s body as a plain PL/pgSQL function: no SECURITY DEFINER, no SET search_path."""
    conn = _conn(url)
    sql = "SELECT allowed, retry_after, remaining FROM bench_rl_bare(%s, %s, %s, %s, %s)"
    return (lambda: conn.execute(sql, ("rl", RL_RATE, RL_PER, None, 1), prepare=True).fetchone()), conn.close


def kind_pyrate(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    """pyrate-limiter's PostgresBucket: per decision a clock query, then LOCK TABLE ... NOWAIT, a windowed count
    and an INSERT per allowed call, in one transaction."""
    from psycopg_pool import ConnectionPool
    from pyrate_limiter import Duration, Limiter, PostgresBucket, Rate

    pool = ConnectionPool(url, min_size=1, max_size=1, open=True)
    limiter = Limiter(PostgresBucket(pool, "bench_rl", [Rate(RL_RATE, Duration.SECOND)]))

    def close() -> None:
        limiter.close()
        pool.close()

    return (lambda: limiter.try_acquire("rl", blocking=False)), close


RATESYNC_TABLE = """
CREATE TABLE IF NOT EXISTS rate_limiter_state (
    group_id VARCHAR(255) PRIMARY KEY,
    last_acquisition_at TIMESTAMPTZ NOT NULL,
    concurrent_count INTEGER NOT NULL DEFAULT 0,
    version BIGINT NOT NULL DEFAULT 1
);
CREATE INDEX IF NOT EXISTS idx_rate_limiter_state_group ON rate_limiter_state(group_id);
"""


def kind_ratesync(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    """rate-sync's PostgreSQL engine, re-created (rate-sync 0.4 needs Python 3.12; this machine has 3.11).

    Re-created from zyc/rate-sync, src/ratesync/engines/postgres.py
    (``PostgresRateLimiter._try_acquire_token_bucket`` with timeout 0, its default 10 ms ``timing_margin_ms``,
    its table as ``_create_table_if_not_exists`` makes it), with psycopg in autocommit instead of an asyncpg
    pool: ``SELECT ... FOR UPDATE NOWAIT`` of the group's row, then, when the client's clock says at least
    1/rate - 10 ms passed since the last acquisition (always, at 1000/s), an ``UPDATE ... WHERE version = $4``.
    A row locked by another caller (55P03, which rate-sync lets through as an exception) counts as a denied call.
    """
    conn = _conn(url)
    interval, margin = 1.0 / RL_RATE, 0.010

    def cycle() -> None:
        now_ts = time.time()
        try:
            row = conn.execute(
                "SELECT last_acquisition_at, concurrent_count, version FROM rate_limiter_state"
                " WHERE group_id = %s FOR UPDATE NOWAIT",
                ("rl",),
                prepare=True,
            ).fetchone()
        except psycopg.errors.LockNotAvailable:
            return
        if row is None:
            with suppress(psycopg.errors.UniqueViolation):
                conn.execute(
                    "INSERT INTO rate_limiter_state (group_id, last_acquisition_at, concurrent_count, version)"
                    " VALUES (%s, to_timestamp(%s), 0, 1)",
                    ("rl", now_ts),
                )
            return
        if now_ts - row[0].timestamp() >= interval - margin:
            conn.execute(
                "UPDATE rate_limiter_state SET last_acquisition_at = to_timestamp(%s), concurrent_count = %s,"
                " version = version + 1 WHERE group_id = %s AND version = %s",
                (now_ts, row[1], "rl", row[2]),
                prepare=True,
            )

    return cycle, conn.close


def kind_limits_redis(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    """limits' moving window (exact, a Lua script per hit) on redis: 1000 per second on one key."""
    from limits import RateLimitItemPerSecond
    from limits.storage import RedisStorage
    from limits.strategies import MovingWindowRateLimiter

    limiter = MovingWindowRateLimiter(RedisStorage(url))
    item = RateLimitItemPerSecond(RL_RATE)
    return (lambda: limiter.hit(item, "rl")), lambda: None


# Authority per name (part 7): calls on names under 'svc7/', granted to the
# group bench_team (of which the login role bench_svc is a member) in the
# databases with grants.


def kind_auth_lock(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    return _sql_pair(url, "SELECT pgbroker.lock_acquire('svc7/n')", "SELECT pgbroker.lock_release('svc7/n')")


def kind_auth_kv(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    return _kv_cas(url, f"svc7/k{idx}")


def kind_auth_counter(url: str, idx: int) -> tuple[Cycle, Callable[[], None]]:
    return _counter_add(url, "svc7/c")


KINDS: dict[str, Callable[[str, int], tuple[Cycle, Callable[[], None]]]] = {
    name[len("kind_") :]: fn for name, fn in globals().items() if name.startswith("kind_")
}


AUTHORITY_KINDS = ("lock", "kv", "counter")
AUTHORITY_GRANTS = (0, 1, 1000)


def setup_authority(server: EmbeddedPostgres) -> dict[int, str]:
    """A database per number of grants, each granting 'svc7/' of every kind measured to bench_team (and, with
    1,000, 'svc0/' to 'svc999/' to as many roles); the URLs, as bench_svc, by number of grants."""
    with psycopg.connect(server.url, autocommit=True) as admin:
        admin.execute("CREATE ROLE bench_team NOLOGIN")
        admin.execute("CREATE ROLE bench_svc LOGIN IN ROLE pgbroker_user, bench_team")
        admin.execute(
            "DO $$ BEGIN FOR i IN 0 .. 999 LOOP EXECUTE format('CREATE ROLE bench_r%s NOLOGIN', i); END LOOP; END $$"
        )
    urls = {}
    for grants in AUTHORITY_GRANTS:
        with psycopg.connect(server.url, autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE bench_auth{grants}")
        install.migrate(server.url_for(f"bench_auth{grants}"))
        with psycopg.connect(server.url_for(f"bench_auth{grants}"), autocommit=True) as conn:
            for kind in AUTHORITY_KINDS:
                for i in range(grants if grants > 1 else 0):
                    role = "bench_team" if i == 7 else f"bench_r{i}"
                    conn.execute("SELECT pgbroker.name_grant(%s, %s, %s)", (kind, f"svc{i}/", role))
                if grants == 1:
                    conn.execute("SELECT pgbroker.name_grant(%s, 'svc7/', 'bench_team')", (kind,))
            count = conn.execute("SELECT count(*) FROM pgbroker.name_grant").fetchone()[0]
            assert count == grants * len(AUTHORITY_KINDS), count
        urls[grants] = server.url_for(f"bench_auth{grants}", user="bench_svc")
    return urls


def bench_authority(server: EmbeddedPostgres, cfg: Settings, server_cpu: ServerCpu, results: Results) -> None:
    """Part 7: each call with 0, 1 and 1,000 grants of its kind, alternately; the ratios against 0 grants."""
    urls = setup_authority(server)
    cfg = dataclasses.replace(cfg, rounds=cfg.auth_rounds)
    labels = {"lock": "lock acquire+release, SQL functions", "kv": "kv_set compare-and-set", "counter": "counter_add"}
    for kind in AUTHORITY_KINDS:
        none, one, many = alternate(
            [f"auth_{kind}"] * len(AUTHORITY_GRANTS), [urls[g] for g in AUTHORITY_GRANTS], 1, cfg, server_cpu
        )
        results.compare(f"{labels[kind]}, 1 grant (against 0 grants), 1 proc", one, none, None, f"auth_{kind}_1")
        results.compare(
            f"{labels[kind]}, 1,000 grants (against 0 grants), 1 proc", many, none, AUTHORITY_TARGET,
            f"auth_{kind}_1000",
        )  # fmt: skip


# ---------------------------------------------------------------------------
# Processes and CPU


def _proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(rest[11]) + int(rest[12])) / CLK_TCK


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except OSError:
                continue
    return found


class ServerCpu:
    """CPU seconds of the server processes: the postmaster and all its children (and redis when running)."""

    def __init__(self, postmaster: int) -> None:
        self.pids = [postmaster]

    def __call__(self) -> float:
        return sum(_proc_cpu(p) for root in self.pids for p in [root, *_children(root)])


def _worker(kind: str, url: str, idx: int, seconds: float, start: Any, done: Any, leave: Any, out: Any) -> None:
    cycle, close = KINDS[kind](url, idx)
    try:
        for _ in range(20):  # warm-up: statements prepared, names registered
            cycle()
        start.wait()
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        deadline = t0 + seconds
        n = 0
        while time.perf_counter() < deadline:
            cycle()
            n += 1
        elapsed = time.perf_counter() - t0
        out.put((n, elapsed, time.process_time() - cpu0))
        done.wait()
        leave.wait(60)
    finally:
        close()


def measure(kind: str, url: str, procs: int, seconds: float, server_cpu: ServerCpu) -> Rate:
    """``procs`` spawned processes run ``kind`` for ``seconds``: ops, wall time, client + server CPU."""
    ctx = multiprocessing.get_context("spawn")
    start, done, leave, out = ctx.Barrier(procs + 1), ctx.Barrier(procs + 1), ctx.Event(), ctx.Queue()
    workers = [
        ctx.Process(target=_worker, args=(kind, url, i, seconds, start, done, leave, out), daemon=True)
        for i in range(procs)
    ]
    for w in workers:
        w.start()
    try:
        start.wait(timeout=60)
        s0 = server_cpu()
        done.wait(timeout=seconds + 120)
        s1 = server_cpu()
        leave.set()
        results = [out.get(timeout=10) for _ in workers]
        for w in workers:
            w.join(30)
        if any(w.exitcode != 0 for w in workers):
            raise RuntimeError(f"a {kind} worker failed")
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
    ops = sum(r[0] for r in results)
    wall = statistics.fmean(r[1] for r in results)
    return Rate(ops, wall, sum(r[2] for r in results) + (s1 - s0))


def alternate(
    kinds: Sequence[str],
    url: str | Sequence[str],
    procs: int,
    cfg: Settings,
    server_cpu: ServerCpu,
    seconds: float | None = None,
) -> list[Rate]:
    """Rounds alternating the order of the kinds; the summed rate of each.

    ``url``: one for every kind, or one per kind; ``seconds``: per round (default ``cfg.seconds``).
    """
    urls = [url] * len(kinds) if isinstance(url, str) else list(url)
    totals = [Rate(0, 0.0, 0.0) for _ in kinds]
    for r in range(cfg.rounds):
        order = list(range(len(kinds)))
        if r % 2:
            order.reverse()
        for i in order:
            totals[i] = totals[i] + measure(kinds[i], urls[i], procs, seconds or cfg.seconds, server_cpu)
    return totals


class KVWatcher:
    """A session registered as a key-value watcher (every change announced), draining its notifications."""

    def __init__(self, url: str) -> None:
        self.conn = _conn(url)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._drain, daemon=True)

    def _drain(self) -> None:
        while not self.stop.is_set():
            for _ in self.conn.notifies(timeout=0.2):
                pass

    def __enter__(self) -> KVWatcher:
        self.conn.execute("LISTEN pgbroker_kv")
        self.conn.execute("SELECT pgbroker.kv_watch_begin()")
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
        self.conn.close()


# ---------------------------------------------------------------------------
# Release -> next waiter


def _percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _blocked(monitor: psycopg.Connection, pid: int) -> bool:
    return monitor.execute(
        "SELECT EXISTS (SELECT FROM pg_locks WHERE pid = %s AND locktype = 'advisory' AND NOT granted)", (pid,)
    ).fetchone()[0]


def wake_latencies(url: str, variant: str, n: int) -> list[float]:
    """ms from a holder's release returning to a waiter holding the permit (variant: sql, listen, floor)."""
    limit = 1 if variant == "floor" else 4
    holders = [_conn(url) for _ in range(limit)]
    waiter, monitor = _conn(url), _conn(url)
    channel = monitor.execute("SELECT pgbroker.semaphore_channel('lat')").fetchone()[0]
    if variant == "listen":
        waiter.execute(f'LISTEN "{channel}"')
    rng = random.Random(7)
    samples: list[float] = []
    try:
        for h in holders:
            got = h.execute(
                "SELECT pg_advisory_lock(3, 1)" if variant == "floor" else "SELECT pgbroker.semaphore_acquire('lat', 4)"
            ).fetchone()
            assert variant == "floor" or got[0] is not None
        for _ in range(n):
            got_at: list[float] = []
            ready = threading.Event()

            def wait(
                waiter: psycopg.Connection = waiter, ready: threading.Event = ready, got_at: list = got_at
            ) -> None:
                if variant == "floor":
                    ready.set()
                    waiter.execute("SELECT pg_advisory_lock(3, 1)")
                elif variant == "sql":
                    ready.set()
                    assert waiter.execute("SELECT pgbroker.semaphore_acquire('lat', 4, '5 s')").fetchone()[0]
                else:
                    while waiter.execute("SELECT pgbroker.semaphore_acquire('lat', 4, '0')").fetchone()[0] is None:
                        ready.set()
                        for _ in waiter.notifies(timeout=5, stop_after=1):
                            pass
                got_at.append(time.perf_counter())

            thread = threading.Thread(target=wait)
            thread.start()
            ready.wait(10)
            deadline = time.monotonic() + 10
            while variant != "listen" and not _blocked(monitor, waiter.info.backend_pid):
                assert time.monotonic() < deadline, "waiter never blocked"
                time.sleep(0.001)
            time.sleep(rng.uniform(0.005, 0.03))  # release at a random phase of the waiter's wait
            victim = rng.randrange(len(holders))
            t0 = time.perf_counter()
            holders[victim].execute(
                "SELECT pg_advisory_unlock(3, 1)" if variant == "floor" else "SELECT pgbroker.semaphore_release('lat')"
            )
            thread.join(15)
            samples.append((got_at[0] - t0) * 1000)
            # The waiter becomes the holder in the victim's place.
            holders[victim], waiter = waiter, holders[victim]
            if variant == "listen":
                waiter.execute(f'LISTEN "{channel}"')
                for _ in waiter.notifies(timeout=0, stop_after=100):  # drop old notifications
                    pass
    finally:
        for c in [*holders, waiter, monitor]:
            c.close()
    return samples


# ---------------------------------------------------------------------------
# Set-up


BREAKDOWN_SQL = """
CREATE FUNCTION bench_bare_lock() RETURNS void LANGUAGE plpgsql AS
  $$ BEGIN PERFORM pg_advisory_lock(1885823596, 1); END $$;
CREATE FUNCTION bench_bare_unlock() RETURNS boolean LANGUAGE plpgsql AS
  $$ BEGIN RETURN pg_advisory_unlock(1885823596, 1); END $$;
CREATE FUNCTION bench_definer_lock() RETURNS void LANGUAGE plpgsql SECURITY DEFINER
  SET search_path = pg_catalog, pg_temp AS $$ BEGIN PERFORM pg_advisory_lock(1885823596, 1); END $$;
CREATE FUNCTION bench_definer_unlock() RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER
  SET search_path = pg_catalog, pg_temp AS $$ BEGIN RETURN pg_advisory_unlock(1885823596, 1); END $$;
CREATE FUNCTION bench_lookup_lock(p_name text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_advisory_lock(1885823596, (SELECT key FROM pgbroker.lock_name WHERE name = p_name)); END $$;
CREATE FUNCTION bench_lookup_unlock(p_name text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN RETURN pg_advisory_unlock(1885823596, (SELECT key FROM pgbroker.lock_name WHERE name = p_name)); END $$;
CREATE FUNCTION bench_lookup_definer_lock(p_name text) RETURNS void LANGUAGE plpgsql SECURITY DEFINER
  SET search_path = pg_catalog, pg_temp AS $$
BEGIN PERFORM pg_advisory_lock(1885823596, (SELECT key FROM pgbroker.lock_name WHERE name = p_name)); END $$;
CREATE FUNCTION bench_lookup_definer_unlock(p_name text) RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER
  SET search_path = pg_catalog, pg_temp AS $$
BEGIN RETURN pg_advisory_unlock(1885823596, (SELECT key FROM pgbroker.lock_name WHERE name = p_name)); END $$;
CREATE FUNCTION bench_kv_cas_no_notify(p_key text, p_value jsonb, p_version bigint) RETURNS bigint
  LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE v_new bigint;
BEGIN
    UPDATE pgbroker.kv_entry AS e
       SET value = p_value, version = nextval('pgbroker.kv_version_seq'), updated_at = clock_timestamp()
     WHERE e.key = p_key AND e.version = p_version AND (e.expires_at IS NULL OR e.expires_at > clock_timestamp())
    RETURNING e.version INTO v_new;
    RETURN v_new;
END $$;
CREATE TABLE bench_counter (name text PRIMARY KEY, value bigint NOT NULL,
                            updated_at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE bench_kv (key text PRIMARY KEY, value jsonb NOT NULL, version bigint NOT NULL,
                       updated_at timestamptz NOT NULL DEFAULT clock_timestamp(), expires_at timestamptz);
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peer_available(module: str) -> str | None:
    try:
        __import__(module)
    except ImportError as exc:
        return f"{exc}"
    return None


def bench_peers(url: str, cfg: Settings, server_cpu: ServerCpu, results: Results) -> None:
    """Each peer's lock cycle against the raw floor measured alternately with it."""
    peers = [
        ("postgresql-lock", "postgresql_lock", "postgresql_lock", url),
        ("pals", "pals", "pals", url),
        ("tooz (pgsql driver)", "tooz.drivers.pgsql", "tooz", url),
    ]
    for label, module, kind, peer_url in peers:
        missing = _peer_available(module)
        if missing:
            results.notes.append(f"{label} skipped: {missing}")
            print(f"  {label} skipped: {missing}", flush=True)
            continue
        for procs in (1, 8):
            rate, floor = alternate([kind, "lock_floor"], peer_url, procs, cfg, server_cpu)
            results.compare(f"peer {label}, lock cycles, {procs} proc", rate, floor, None, f"{kind}_{procs}")
    missing = _peer_available("redis_lock") or _peer_available("redis")
    redis = shutil.which("redis-server")
    if missing or redis is None:
        reason = missing or "no redis-server on PATH (Debian: apt-get install redis-server)"
        results.notes.append(f"python-redis-lock skipped: {reason}")
        return
    with redis_server(redis, server_cpu) as redis_url:
        for procs in (1, 8):
            rate, floor = alternate(["redis_lock", "lock_floor"], [redis_url, url], procs, cfg, server_cpu)
            results.compare(f"peer python-redis-lock, lock cycles, {procs} proc", rate, floor, None, f"redis_{procs}")
        results.notes.append("redis-server without persistence (--save '' --appendonly no)")


@contextmanager
def redis_server(executable: str, server_cpu: ServerCpu) -> Iterator[str]:
    """A local redis-server without persistence on a free port, its CPU counted as the server's; yields its URL."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="pgbr-redis-") as tmp:
        proc = subprocess.Popen(
            [executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "redis-server did not start"
                    time.sleep(0.05)
            server_cpu.pids.append(proc.pid)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            if proc.pid in server_cpu.pids:
                server_cpu.pids.remove(proc.pid)
            proc.terminate()
            proc.wait(10)


RATE_LIMIT_SETUP = """
CREATE UNLOGGED TABLE bench_rl (name text PRIMARY KEY, tat numeric NOT NULL, lim numeric NOT NULL, t numeric NOT NULL,
                                allowed bigint NOT NULL, denied bigint NOT NULL, last_allowed boolean NOT NULL,
                                updated_at timestamptz NOT NULL) WITH (fillfactor = 50);
"""


def setup_rate_limits(url: str) -> None:
    """The floor's table, rate_limit()'s body as a plain function (for the breakdown), rate-sync's table, and every
    name used once (by pgbroker and by the floor), so that the rounds measure updates, not first inserts."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(RATE_LIMIT_SETUP)
        conn.execute(RATESYNC_TABLE)
        definition = conn.execute("SELECT pg_get_functiondef('pgbroker.rate_limit'::regproc)").fetchone()[0]
        lines = [
            line for line in definition.splitlines() if line.strip() not in ("SECURITY DEFINER",)
            and not line.strip().startswith("SET search_path")
        ]  # fmt: skip
        bare = "\n".join(lines).replace("FUNCTION pgbroker.rate_limit(", "FUNCTION public.bench_rl_bare(", 1)
        conn.execute(re.sub(r"\brate_limit\.", "bench_rl_bare.", bare))
        for many in (False, True):
            names = _rl_names(0, many)
            for _ in range(RL_KEYS if many else 1):
                name = names()
                conn.execute(RL_SQL, (name, RL_RATE, RL_PER, None, 1))
                conn.execute(RL_FLOOR, {"name": name, "rate": RL_RATE, "per": RL_PER, "burst": None, "cost": 1})


def bench_rate_limits(url: str, cfg: Settings, server_cpu: ServerCpu, results: Results) -> None:
    """Part 6: rate_limit() against its floor, on one name and on 1,000; the Python object; the peers."""
    seconds = cfg.rl_seconds
    setup_rate_limits(url)
    ours: dict[int, Rate] = {}
    for procs in (1, 8):
        sql, py, floor = alternate(["rl", "rl_py", "rl_floor"], url, procs, cfg, server_cpu, seconds)
        ours[procs] = sql
        results.compare(f"rate_limit, 1 name, {procs} proc", sql, floor, RATE_LIMIT_TARGET, f"rl_{procs}")
        results.compare(
            f"rate_limit, Python RateLimiter.allow(), 1 name, {procs} proc", py, floor, None, f"rl_py_{procs}"
        )
    for procs in (1, 8):
        sql, floor = alternate(["rl_keys", "rl_floor_keys"], url, procs, cfg, server_cpu, seconds)
        results.compare(f"rate_limit, 1,000 names, {procs} proc", sql, floor, RATE_LIMIT_TARGET, f"rl_keys_{procs}")
    bare, floor = alternate(["rl_bare", "rl_floor"], url, 1, cfg, server_cpu, seconds)
    results.compare(
        "breakdown: rate_limit() without SECURITY DEFINER and SET search_path, 1 name, 1 proc", bare, floor, None,
        "breakdown_rl_bare",
    )  # fmt: skip

    def peer(label: str, kind: str, procs: int, rate: Rate, floor: Rate) -> None:
        """A peer's row: its decisions against the floor; the target: below pgbroker's ratio to its own floor."""
        ratio = rate.per_second / floor.per_second
        results.figures[f"{kind}_{procs}"] = ratio
        mine = results.figures[f"rl_{procs}"]
        slower = ratio < mine
        if not slower:
            results.missed.append(f"faster than {label}, {procs} proc")
        results.add(
            f"peer {label}, rate limit decisions, 1 name, {procs} proc",
            rate.cell(),
            floor.cell(),
            f"{ratio:.2f}x",
            f"pgbroker {mine:.2f}x, faster {'ok' if slower else 'MISSED'}",
        )

    for label, module, kind in (
        ("pyrate-limiter PostgresBucket", "pyrate_limiter", "pyrate"),
        ("rate-sync PostgreSQL engine (re-created)", None, "ratesync"),
    ):
        missing = _peer_available(module) or _peer_available("psycopg_pool") if module else None
        if missing:
            results.notes.append(f"{label} skipped: {missing}")
            print(f"  {label} skipped: {missing}", flush=True)
            continue
        for procs in (1, 8):
            rate, floor = alternate([kind, "rl_floor"], url, procs, cfg, server_cpu, seconds)
            peer(label, kind, procs, rate, floor)
    results.notes.append(
        "rate-sync (0.4.2, Python >= 3.12) is not installable on this Python: its PostgreSQL engine's try_acquire is"
        " re-created from its source (zyc/rate-sync, src/ratesync/engines/postgres.py) on psycopg; its default"
        " 10 ms timing margin lets every call at 1000/s pass, so each decision is a SELECT ... FOR UPDATE NOWAIT and"
        " an UPDATE, with the client's clock"
    )
    missing = _peer_available("limits") or _peer_available("redis")
    redis = shutil.which("redis-server")
    if missing or redis is None:
        reason = missing or "no redis-server on PATH (Debian: apt-get install redis-server)"
        results.notes.append(f"limits on redis skipped: {reason}")
        print(f"  limits on redis skipped: {reason}", flush=True)
        return
    with redis_server(redis, server_cpu) as redis_url:
        for procs in (1, 8):
            rate, floor = alternate(["limits_redis", "rl_floor"], [redis_url, url], procs, cfg, server_cpu, seconds)
            ratio = rate.per_second / floor.per_second
            results.figures[f"limits_redis_{procs}"] = ratio
            results.add(
                f"peer limits moving window on redis, rate limit decisions, 1 name, {procs} proc",
                rate.cell(),
                floor.cell(),
                f"{ratio:.2f}x",
                f"pgbroker {results.figures[f'rl_{procs}']:.2f}x",
            )


PARTS = ("locks", "semaphores", "counters", "peers", "breakdown", "ratelimit", "authority")


def run(cfg: Settings, only: Sequence[str] = ()) -> Results:
    """Every part of the benchmark, or those named in ``only`` (see PARTS)."""
    unknown = set(only) - set(PARTS)
    assert not unknown, f"unknown parts {sorted(unknown)}: choose from {PARTS}"

    def want(part: str) -> bool:
        return not only or part in only

    results = Results()
    started = time.monotonic()
    with EmbeddedPostgres(postgres_options=DURABLE) as server:
        with psycopg.connect(server.url, autocommit=True) as admin:
            admin.execute("CREATE DATABASE bench")
        url = server.url_for("bench")
        install.migrate(url)
        postmaster = int((server.datadir / "postmaster.pid").read_text().split()[0])
        server_cpu = ServerCpu(postmaster)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(BREAKDOWN_SQL)
            assert conn.execute("SELECT pgbroker.lock_acquire('n')").fetchone()[0] is True
            assert conn.execute("SELECT pgbroker.lock_release('n')").fetchone()[0] is True
            assert conn.execute("SELECT key FROM pgbroker.lock_name WHERE name = 'n'").fetchone()[0] == 1
            settings = {
                name: conn.execute(f"SHOW {name}").fetchone()[0]
                for name in ("server_version", "fsync", "synchronous_commit", "full_page_writes")
            }
        print(
            "server: PostgreSQL {server_version}, fsync={fsync}, synchronous_commit={synchronous_commit}, "
            "full_page_writes={full_page_writes}; ".format(**settings)
            + f"{os.cpu_count()} CPUs; {cfg.rounds} rounds x {cfg.seconds} s per variant;"
            + " load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()),
            flush=True,
        )
        assert settings["fsync"] == "on" and settings["synchronous_commit"] == "on", settings

        if want("locks"):
            for procs in (1, 8):
                py, ours, floor = alternate(["py_lock", "lock", "lock_floor"], url, procs, cfg, server_cpu)
                results.compare(
                    f"lock acquire+release, Python Lock, {procs} proc", py, floor, LOCK_TARGET, f"py_lock_{procs}"
                )
                results.compare(
                    f"lock acquire+release, SQL functions, {procs} proc", ours, floor, LOCK_TARGET, f"lock_{procs}"
                )

        if want("semaphores"):
            for kind, label in (("sem_wait", "wait NULL"), ("sem_try", "retry '0'"), ("sem_listen", "LISTEN+retry")):
                ours, floor = alternate([kind, "sem_floor"], url, 8, cfg, server_cpu)
                results.compare(f"semaphore limit 4, 8 proc, {label}", ours, floor, SEMAPHORE_TARGET, kind)

            for variant in ("sql", "listen"):
                samples = wake_latencies(url, variant, cfg.wakeups)
                floor_samples = wake_latencies(url, "floor", cfg.wakeups)
                p50, p99 = _percentile(samples, 0.5), _percentile(samples, 0.99)
                f50, f99 = _percentile(floor_samples, 0.5), _percentile(floor_samples, 0.99)
                results.figures[f"wake_{variant}_p99_ms"] = p99
                ok = p99 < WAKE_P99_TARGET_MS
                if not ok:
                    results.missed.append(f"release -> waiter ({variant})")
                results.add(
                    f"release -> next waiter, {'semaphore_acquire wait' if variant == 'sql' else 'LISTEN + retry'}"
                    f" (n={len(samples)})",
                    f"p50 {p50:.2f} ms, p99 {p99:.2f} ms",
                    f"p50 {f50:.2f} ms, p99 {f99:.2f} ms",
                    f"{p99 / f99:.1f}x" if f99 > 0 else "-",
                    f"p99 < {WAKE_P99_TARGET_MS:.0f} ms {'ok' if ok else 'MISSED'}",
                )

        if want("counters"):
            for procs in (1, 8):
                ours, floor = alternate(["counter", "counter_floor"], url, procs, cfg, server_cpu)
                results.compare(f"counter_add, {procs} proc", ours, floor, COUNTER_TARGET, f"counter_{procs}")
            for procs in (1, 8):
                ours, floor = alternate(["kv", "kv_floor"], url, procs, cfg, server_cpu)
                label = "1 proc" if procs == 1 else f"{procs} proc, a key each"
                results.compare(f"kv_set compare-and-set, {label}", ours, floor, COUNTER_TARGET, f"kv_{procs}")
            with KVWatcher(url):
                ours, floor = alternate(["kv", "kv_floor"], url, 8, cfg, server_cpu)
            results.compare(
                "kv_set compare-and-set, 8 proc, a key each, while a session watches",
                ours,
                floor,
                COUNTER_TARGET,
                "kv_8w",
            )

        if want("peers"):
            bench_peers(url, cfg, server_cpu, results)

        if want("breakdown"):
            # Where the lock cycle's time goes (1 process), each against the same raw floor.
            for kind, label in (
                ("two_int", "raw pg_advisory_lock(int4, int4)"),
                ("bare", "PL/pgSQL around the lock"),
                ("bare_definer", "... + SECURITY DEFINER, SET search_path"),
                ("lookup", "PL/pgSQL + name lookup"),
                ("lookup_definer", "... + SECURITY DEFINER, SET search_path"),
            ):
                ours, floor = alternate([kind, "lock_floor"], url, 1, cfg, server_cpu)
                results.compare(f"breakdown: {label}, 1 proc", ours, floor, None, f"breakdown_{kind}")
            # Where kv_set's time goes, 8 processes on a key each: its NOTIFY (one lock for the whole cluster,
            # held through the commit's WAL flush) against the same CAS without it, and the floor with one.
            for kind, label in (
                ("kv_no_notify", "kv_set CAS without pg_notify"),
                ("kv_floor_notify", "raw UPDATE + pg_notify"),
            ):
                ours, floor = alternate([kind, "kv_floor"], url, 8, cfg, server_cpu)
                results.compare(f"breakdown: {label}, 8 proc, a key each", ours, floor, None, f"breakdown_{kind}")

        if want("ratelimit"):
            bench_rate_limits(url, cfg, server_cpu, results)

        if want("authority"):
            bench_authority(server, cfg, server_cpu, results)
    results.figures["seconds"] = time.monotonic() - started
    results.notes.append(
        "load average at the end: {:.2f} {:.2f} {:.2f} (other work on the machine shows as noise)".format(
            *os.getloadavg()
        )
    )
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (a smoke test, noisier figures)")
    parser.add_argument(
        "--only", action="append", choices=PARTS, default=[], help="run only this part (repeatable; default: all)"
    )
    args = parser.parse_args(argv)
    results = run(Settings.quick() if args.quick else Settings(), args.only)
    print()
    print(results.table())
    print(
        f"\n(ratio: pgbroker's throughput / the floor's, measured alternately in this run; CPU = client + server;"
        f" whole run {results.figures['seconds']:.0f} s; targets missed: {', '.join(results.missed) or 'none'})"
    )
    return 0


def test_bench_primitives() -> None:
    """pytest entry point (tests/benchmarks is ignored by the default run): prints the table."""
    results = run(Settings.quick())
    print()
    print(results.table())
    assert results.figures["lock_1"] > 0 and results.figures["counter_1"] > 0 and results.figures["rl_1"] > 0


if __name__ == "__main__":
    sys.exit(main())
