"""Rate limits (sql/690_rate_limit.sql): pgbroker.rate_limit(), the view pgbroker.rate_limits, the metrics, and the
Python RateLimiter / AsyncRateLimiter.

The contract: at most RATE per PER on average and BURST at once, judged on the
server's clock; exact under contention (real processes hammering one name are
never allowed more than BURST + RATE x elapsed, and get most of it); bad input
is 22023 and changes nothing; a crash forgets the state (every limit starts
full), a clean restart keeps it.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from pgbouncer_util import bouncers, requires_pgbouncer

import pgbroker
from pgbroker import (
    AsyncRateLimiter,
    InvalidArgument,
    NotAcquired,
    PermissionDenied,
    PgBrokerError,
    RateLimiter,
    RateLimitResult,
    install,
)
from pgbroker._embedded import EmbeddedPostgres, find_pg_bin

Connect = Callable[..., psycopg.Connection]

DECIDE = "SELECT allowed, retry_after, remaining FROM pgbroker.rate_limit(%s, %s, %s, %s, %s)"
STATE = "SELECT * FROM pgbroker.rate_limit_state ORDER BY name"


def decide(
    conn: psycopg.Connection, name: str, rate: int, per: str | timedelta, burst: int | None = None, cost: int = 1
) -> tuple[bool, timedelta, int]:
    return conn.execute(DECIDE, (name, rate, per, burst, cost)).fetchone()


def view(conn: psycopg.Connection, name: str) -> dict[str, Any]:
    cur = conn.execute("SELECT * FROM pgbroker.rate_limits WHERE name = %s", (name,))
    row = cur.fetchone()
    assert row is not None, name
    return dict(zip([c.name for c in cur.description], row, strict=True))


# ---------------------------------------------------------------------------
# The contract


def test_burst_then_one_per_interval_on_the_server_clock(connect: Connect):
    conn = connect("rl", user="t_user")
    zero = timedelta(0)
    # 5 per second, burst NULL (= 5): five at once, counting down.
    assert [decide(conn, "api", 5, "1 s") for _ in range(5)] == [(True, zero, n) for n in (4, 3, 2, 1, 0)]
    allowed, retry_after, remaining = decide(conn, "api", 5, "1 s")
    assert (allowed, remaining) == (False, 0)
    assert timedelta(0) < retry_after <= timedelta(milliseconds=200)  # one emission interval, less what passed
    # Denied calls use nothing up: hammering does not push the next slot back.
    for _ in range(50):
        assert decide(conn, "api", 5, "1 s")[0] is False
    time.sleep(retry_after.total_seconds())
    assert decide(conn, "api", 5, "1 s") == (True, zero, 0)
    again = decide(conn, "api", 5, "1 s")
    assert again[0] is False and timedelta(milliseconds=100) < again[1] <= timedelta(milliseconds=200)
    # After a full period the whole burst is back.
    time.sleep(1.0)
    assert decide(conn, "api", 5, "1 s") == (True, zero, 4)


def test_explicit_burst_cost_and_independent_names(connect: Connect):
    conn = connect("rl", user="t_user")
    zero = timedelta(0)
    # 1 per 10 seconds on average, 3 at once.
    assert [decide(conn, "b", 1, "10 s", 3) for _ in range(3)] == [(True, zero, n) for n in (2, 1, 0)]
    allowed, retry_after, _ = decide(conn, "b", 1, "10 s", 3)
    assert allowed is False and timedelta(seconds=9) < retry_after <= timedelta(seconds=10)
    # Another name is untouched.
    assert decide(conn, "c", 1, "10 s", 3) == (True, zero, 2)
    # Costs: 10 per 10 seconds, a call of 4 takes 4.
    assert decide(conn, "w", 10, "10 s", cost=4) == (True, zero, 6)
    assert decide(conn, "w", 10, "10 s", cost=4) == (True, zero, 2)
    allowed, retry_after, remaining = decide(conn, "w", 10, "10 s", cost=4)
    assert (allowed, remaining) == (False, 2)  # two of cost 1 would still pass
    assert timedelta(seconds=1) < retry_after <= timedelta(seconds=2)  # two more units of 1 s each
    assert decide(conn, "w", 10, "10 s", cost=2) == (True, zero, 0)
    # A call whose cost is the whole burst, on a fresh name.
    assert decide(conn, "whole", 7, "1 min", cost=7) == (True, zero, 0)


def test_rates_and_periods_from_a_million_per_second_to_one_a_day(connect: Connect):
    conn = connect("rl", user="t_user")
    zero = timedelta(0)
    # A million per second: the whole burst at once, then about one per microsecond.
    assert decide(conn, "fast", 1_000_000, "1 s", cost=1_000_000) == (True, zero, 0)
    allowed, retry_after, _ = decide(conn, "fast", 1_000_000, "1 s")
    assert allowed is True or retry_after <= timedelta(microseconds=1)
    time.sleep(0.01)
    allowed, _, remaining = decide(conn, "fast", 1_000_000, "1 s", cost=5000)
    assert allowed is True and 4_000 <= remaining <= 1_000_000
    # Three per millisecond.
    assert [decide(conn, "ms", 3, "1 ms")[0] for _ in range(3)] == [True, True, True]
    time.sleep(0.002)
    assert decide(conn, "ms", 3, "1 ms")[0] is True
    # One a day.
    assert decide(conn, "daily", 1, "1 day") == (True, zero, 0)
    allowed, retry_after, remaining = decide(conn, "daily", 1, "1 day")
    assert (allowed, remaining) == (False, 0)
    assert timedelta(hours=23, minutes=59) < retry_after <= timedelta(days=1)
    # The emission interval is PER / RATE rounded up to a femtosecond: never more than asked for.
    assert conn.execute("SELECT per, rate FROM pgbroker.rate_limits WHERE name = 'daily'").fetchone() == (
        timedelta(days=1),
        1,
    )
    admin = connect("admin")
    t = admin.execute("SELECT pgbroker._rate_limit_interval(3, '1 second')").fetchone()[0]
    assert t == 333_333_333_333_334 and t * 3 >= 10**15


def test_parameters_of_a_name_may_change_between_calls(connect: Connect):
    """Each call is judged by its own parameters; what was used stays counted."""
    conn = connect("rl", user="t_user")
    assert all(decide(conn, "p", 10, "100 s")[0] for _ in range(10))
    assert decide(conn, "p", 10, "100 s")[0] is False
    # A larger burst on the same name: what the first ten used still counts against it.
    assert [decide(conn, "p", 10, "100 s", 15)[0] for _ in range(6)] == [True] * 5 + [False]
    row = view(conn, "p")
    assert (row["rate"], row["per"], row["burst"]) == (10, timedelta(seconds=100), 15)
    assert (row["allowed"], row["denied"]) == (15, 2)


BAD = [
    pytest.param(None, 5, "1 s", None, 1, id="name NULL"),
    pytest.param("", 5, "1 s", None, 1, id="name empty"),
    pytest.param("x" * 201, 5, "1 s", None, 1, id="name 201 bytes"),
    pytest.param("é" * 101, 5, "1 s", None, 1, id="name 202 bytes in 101 characters"),
    pytest.param("k", None, "1 s", None, 1, id="rate NULL"),
    pytest.param("k", 0, "1 s", None, 1, id="rate 0"),
    pytest.param("k", -5, "1 s", None, 1, id="rate negative"),
    pytest.param("k", 5, None, None, 1, id="per NULL"),
    pytest.param("k", 5, "0", None, 1, id="per 0"),
    pytest.param("k", 5, "-1 s", None, 1, id="per negative"),
    pytest.param("k", 5, "1 day -48 hours", None, 1, id="per negative in sum"),
    pytest.param("k", 5, "1 s", 0, 1, id="burst 0"),
    pytest.param("k", 5, "1 s", -1, 1, id="burst negative"),
    pytest.param("k", 5, "1 s", None, None, id="cost NULL"),
    pytest.param("k", 5, "1 s", None, 0, id="cost 0"),
    pytest.param("k", 5, "1 s", None, -1, id="cost negative"),
    pytest.param("k", 5, "1 s", None, 6, id="cost above rate (burst NULL)"),
    pytest.param("k", 5, "1 s", 3, 4, id="cost above burst"),
]


@pytest.mark.parametrize("name, rate, per, burst, cost", BAD)
def test_bad_input_is_22023_and_changes_nothing(connect: Connect, name, rate, per, burst, cost):
    conn, admin = connect("rl", user="t_user"), connect("admin")
    assert decide(conn, "k", 5, "1 s")[0] is True
    before = admin.execute(STATE).fetchall()
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        conn.execute(DECIDE, (name, rate, per, burst, cost))
    assert admin.execute(STATE).fetchall() == before
    # Through Python: InvalidArgument, with the SQLSTATE.
    with pytest.raises(InvalidArgument) as info:
        RateLimiter(conn, name, rate, per if per is None else _seconds(admin, per), burst).allow(cost)
    assert info.value.sqlstate == "22023"
    assert admin.execute(STATE).fetchall() == before


def _seconds(conn: psycopg.Connection, per: str) -> float:
    return float(conn.execute("SELECT EXTRACT(epoch FROM %s::interval)", (per,)).fetchone()[0])


def test_privileges(connect: Connect):
    user, reader, nobody = connect("u", user="t_user"), connect("r", user="t_reader"), connect("n", user="t_none")
    assert decide(user, "priv", 2, "1 s")[0] is True
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        decide(reader, "priv", 2, "1 s")
    with pytest.raises(PermissionDenied):
        RateLimiter(reader, "priv", 2, 1).allow()
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        decide(nobody, "priv", 2, "1 s")
    for conn in (user, reader):
        assert view(conn, "priv")["allowed"] == 1
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT * FROM pgbroker.rate_limit_state")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        nobody.execute("SELECT * FROM pgbroker.rate_limits")


def test_a_hostile_search_path_changes_nothing(connect: Connect):
    conn = connect("rl", user="t_user")
    conn.execute(
        "CREATE FUNCTION pg_temp.clock_timestamp() RETURNS timestamptz LANGUAGE sql AS $$SELECT timestamptz 'epoch'$$"
    )
    conn.execute("CREATE TEMP TABLE rate_limit_state (name text)")
    conn.execute("SET search_path = pg_temp, public")
    assert [decide(conn, "h", 2, "1 s")[0] for _ in range(3)] == [True, True, False]


def test_the_view_and_the_metrics(connect: Connect):
    conn, reader = connect("rl", user="t_user"), connect("r", user="t_reader")
    for _ in range(4):
        decide(conn, "v", 2, "10 s")
    decide(conn, "quiet", 100, "100 s")
    decide(conn, "brief", 1000, "1 s")
    row = view(reader, "v")
    assert (row["rate"], row["per"], row["burst"]) == (2, timedelta(seconds=10), 2)
    assert (row["allowed"], row["denied"], row["last_allowed"], row["available"]) == (2, 2, False, 0)
    now = reader.execute("SELECT clock_timestamp()").fetchone()[0]
    assert timedelta(seconds=9) < row["full_at"] - now <= timedelta(seconds=10)  # two units of 5 s, one since
    quiet = view(reader, "quiet")
    assert quiet["available"] == 99 and quiet["full_at"] is not None and quiet["last_allowed"] is True
    time.sleep(0.02)  # 20 emission intervals of "brief"
    brief = view(reader, "brief")
    assert brief["available"] == 1000 and brief["full_at"] is None

    metrics = dict(
        reader.execute("SELECT metric, value FROM pgbroker.metrics WHERE metric LIKE 'pgbroker_rate_limit%'").fetchall()
    )
    assert metrics == {
        "pgbroker_rate_limit_keys": 3,
        "pgbroker_rate_limit_allowed_total": 4,
        "pgbroker_rate_limit_denied_total": 2,
    }


# ---------------------------------------------------------------------------
# Exact under contention: real processes on one name

RATE, PER, BURST = 40, 1.0, 10


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["allow", "wait"])
def test_many_processes_on_one_name_never_get_more_than_the_limit(db_url: str, connect: Connect, mode: str):
    """8 processes for 3 s: the allowed calls within any window [a, b] of their own timings are at most
    BURST + RATE x (b - a) / PER (time.time() is the server's clock too: the same machine), and the whole run
    gets at least 80 % of what it could."""
    url = db_url.replace("postgres@", "t_user@", 1)
    procs, seconds = 8, 3.0
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(procs + 1), ctx.Queue()
    workers = [ctx.Process(target=_hammer_calls, args=(url, mode, seconds, start, out)) for _ in range(procs)]
    for w in workers:
        w.start()
    try:
        start.wait(60)
        calls = [c for _ in workers for c in out.get(timeout=seconds + 60)]
        for w in workers:
            w.join(30)
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
    allowed = sorted((t0, t1) for t0, t1, ok in calls if ok)
    denied = sum(1 for *_, ok in calls if not ok)
    first, last = min(c[0] for c in calls), max(c[1] for c in calls)
    print(f"{mode}: {len(calls)} calls, {len(allowed)} allowed, {denied} denied in {last - first:.3f} s")
    # Any window: starts at a call's start, ends at a later call's end.
    ends = sorted(t1 for _, t1 in allowed)
    worst = float("-inf")
    for i, (a, _) in enumerate(allowed):
        inside = [t1 for t0, t1 in allowed[i:] if t0 >= a]
        inside.sort()
        for n, b in enumerate(inside, 1):
            bound = BURST + RATE * (b - a) / PER
            worst = max(worst, n - bound)
            assert n <= bound + 1e-9, f"{n} allowed within [{a}, {b}]: more than {bound:.3f}"
    assert ends
    possible = BURST + RATE * (last - first) / PER
    print(f"worst window: {worst:+.3f} against the bound; allowed {len(allowed)} of {possible:.1f} possible")
    assert len(allowed) >= 0.8 * possible
    state = connect("admin").execute("SELECT allowed, denied FROM pgbroker.rate_limit_state WHERE name = 'hot'")
    in_table = state.fetchone()
    assert in_table[0] == len(allowed)
    if mode == "allow":
        assert in_table[1] == denied > len(allowed)  # every call counted; the processes did hammer


def _hammer_calls(url: str, mode: str, seconds: float, start: Any, out: Any) -> None:
    """A spawned process: wait() calls that would run past the deadline raise NotAcquired and end the loop."""
    conn = psycopg.connect(url, autocommit=True)
    limiter = RateLimiter(conn, "hot", RATE, PER, BURST)
    calls: list[tuple[float, float, bool]] = []
    start.wait()
    deadline = time.time() + seconds
    try:
        while time.time() < deadline:
            t0 = time.time()
            if mode == "allow":
                ok = limiter.allow().allowed
            else:
                try:
                    ok = limiter.wait(timeout=deadline - time.time()).allowed
                except NotAcquired:
                    break
            calls.append((t0, time.time(), ok))
    finally:
        conn.close()
        out.put(calls)


# ---------------------------------------------------------------------------
# Python: RateLimiter and AsyncRateLimiter


def test_python_rate_limiter(connect: Connect):
    conn = connect("py", user="t_user")
    limiter = RateLimiter(conn, "py", 5, timedelta(seconds=1), burst=2)  # one every 200 ms
    first = limiter.allow()
    assert first == RateLimitResult(True, 0.0, 1) and bool(first) is True
    assert limiter.allow() == RateLimitResult(True, 0.0, 0)
    denied = limiter.allow()
    assert not denied and denied.remaining == 0 and 0 < denied.retry_after <= 0.2
    # wait() sleeps what the server said, then is allowed.
    t0 = time.monotonic()
    result = limiter.wait()
    elapsed = time.monotonic() - t0
    assert result.allowed and denied.retry_after - 0.02 < elapsed < 0.5, (elapsed, denied)
    # A timeout shorter than the wait raises at once, without sleeping.
    t0 = time.monotonic()
    with pytest.raises(NotAcquired, match="rate limit 'py'"):
        limiter.wait(timeout=0.01)
    with pytest.raises(NotAcquired):
        limiter.wait(timeout=0)
    assert time.monotonic() - t0 < 0.05
    # A cost above the burst is the server's 22023.
    with pytest.raises(InvalidArgument):
        limiter.allow(3)
    # per in seconds, as a float.
    assert RateLimiter(conn, "float", 1000, 0.5).allow().remaining == 999
    # wait() refuses to sleep inside a transaction (the decision's row lock would block everyone).
    with conn.transaction(), pytest.raises(PgBrokerError, match="outside a transaction"):
        limiter.wait()
    # allow() inside the caller's transaction is part of it.
    with conn.transaction():
        assert limiter.allow().allowed in (True, False)
    with pytest.raises(TypeError):
        RateLimiter(conn, "bad", 1, "1 s")  # type: ignore[arg-type]


def test_decorator_and_context_manager_space_the_calls(connect: Connect):
    limiter = RateLimiter(connect("py", user="t_user"), "deco", 20, 1.0, burst=1)  # one every 50 ms
    times: list[float] = []

    @limiter
    def work(x: int) -> int:
        """Docstring kept."""
        times.append(time.monotonic())
        return x * 2

    assert [work(i) for i in range(4)] == [0, 2, 4, 6]
    assert work.__doc__ == "Docstring kept." and work.__name__ == "work"
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert all(g > 0.045 for g in gaps), gaps
    with limiter as decision:
        assert decision.allowed and time.monotonic() - times[-1] > 0.045  # waited for the slot after work()'s
    # The object's timeout bounds the decorator's and the context manager's waits.
    strict = RateLimiter(limiter.conn, "deco-strict", 1, 60, timeout=0)
    assert strict.allow().allowed
    with pytest.raises(NotAcquired), strict:
        pass

    @strict
    def never() -> None:
        raise AssertionError("called")

    with pytest.raises(NotAcquired):
        never()


def test_threads_share_a_limiter(connect: Connect):
    limiter = RateLimiter(connect("py", user="t_user"), "threads", 50, 1.0, burst=5)
    done: list[float] = []
    t0 = time.monotonic()

    def run() -> None:
        for _ in range(5):
            limiter.wait()
            done.append(time.monotonic() - t0)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    # 15 calls: 5 at once, then one every 20 ms.
    assert len(done) == 15 and 0.18 < max(done) < 3, sorted(done)


def test_async_rate_limiter(db_url: str):
    url = db_url.replace("postgres@", "t_user@", 1)

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            limiter = AsyncRateLimiter(conn, "async", 10, timedelta(seconds=1), burst=1)  # one every 100 ms
            assert await limiter.allow() == RateLimitResult(True, 0.0, 0)
            denied = await limiter.allow()
            assert not denied and 0 < denied.retry_after <= 0.1
            t0 = time.monotonic()
            assert (await limiter.wait()).allowed
            assert denied.retry_after - 0.02 < time.monotonic() - t0 < 0.5
            with pytest.raises(NotAcquired):
                await limiter.wait(timeout=0.001)

            calls: list[float] = []

            @limiter
            async def work(x: int) -> int:
                calls.append(time.monotonic())
                return x + 1

            assert [await work(i) for i in range(3)] == [1, 2, 3]
            assert all(b - a > 0.095 for a, b in zip(calls, calls[1:], strict=False)), calls
            async with limiter as decision:
                assert decision.allowed and decision.retry_after == 0.0
            with pytest.raises(TypeError, match="coroutine function"):
                limiter(lambda: None)  # type: ignore[arg-type]

    asyncio.run(scenario())


def test_the_sync_limiter_is_generated_from_the_async_one():
    from pgbroker import _primitives_async, _primitives_sync

    a, s = _primitives_async.AsyncRateLimiter, _primitives_sync.RateLimiter
    public = {n for n in dir(a) if not n.startswith("_")}
    assert public == {n for n in dir(s) if not n.startswith("_")} == {"allow", "wait"}
    assert pgbroker.primitives.RateLimiter is s and pgbroker.primitives.AsyncRateLimiter is a


@requires_pgbouncer
@pytest.mark.parametrize("pool_size", [1, 2])
def test_through_pgbouncer_in_transaction_mode(pg_server, db_name: str, pool_size: int):
    """One statement per decision, no session state: the limit holds whichever server session runs each call."""
    with bouncers(pg_server.port, db_name) as start:
        url = start("transaction", pool_size=pool_size, user="t_user")
        with (
            psycopg.connect(url, autocommit=True, prepare_threshold=None) as a,
            psycopg.connect(url, autocommit=True, prepare_threshold=None) as b,
        ):
            limiters = [RateLimiter(c, "pooled", 1, 60, burst=4) for c in (a, b)]
            results = [limiters[i % 2].allow().allowed for i in range(7)]
            assert results == [True] * 4 + [False] * 3
            assert limiters[1].allow().remaining == 0


# ---------------------------------------------------------------------------
# A crash forgets the state: every limit starts full (fail open); a clean restart keeps it


@pytest.mark.slow
def test_a_crash_forgets_every_limit_and_a_clean_restart_keeps_them():
    server = EmbeddedPostgres()
    server.start()
    try:
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("CREATE DATABASE ratecrash")
        url = server.url_for("ratecrash")
        install.migrate(url)

        def exhaust() -> None:
            with psycopg.connect(url, autocommit=True) as conn:
                assert [decide(conn, "crash", 3, "1 hour")[0] for _ in range(4)] == [True, True, True, False]

        exhaust()
        server.restart()  # a clean shutdown keeps UNLOGGED tables
        with psycopg.connect(url, autocommit=True) as conn:
            assert decide(conn, "crash", 3, "1 hour")[0] is False
            assert conn.execute("SELECT allowed, denied FROM pgbroker.rate_limits").fetchone() == (3, 2)
            conn.execute("CHECKPOINT")  # the state is on disk: only crash recovery removes it
        pg_ctl = server.datadir.parent / "pg_ctl" if os.geteuid() == 0 else find_pg_bin() / "pg_ctl"
        subprocess.run([str(pg_ctl), "stop", "-D", str(server.datadir), "-m", "immediate"], check=True, timeout=60)
        server.start()  # on the same data: crash recovery
        assert "not properly shut down" in server.logfile.read_text()
        with psycopg.connect(url, autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM pgbroker.rate_limits").fetchone() == (0,)
            assert decide(conn, "crash", 3, "1 hour") == (True, timedelta(0), 2)  # full again
            assert [decide(conn, "crash", 3, "1 hour")[0] for _ in range(3)] == [True, True, False]
    finally:
        server.stop()
