"""pgbroker.maintain(): idle names cost nothing, data stays, nobody waits, and a forgotten name never gives
two sessions different keys for one name at the same time (sql/650_locks.sql, "Forgetting idle names")."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable

import psycopg
import pytest

from pgbroker.errors import PgBrokerError
from pgbroker.primitives import Lock

Connect = Callable[..., psycopg.Connection]


def maintain(conn: psycopg.Connection, max_rows: int = 5000) -> dict[str, tuple[int, int | None]]:
    return {r[0]: (r[1], r[2]) for r in conn.execute("SELECT * FROM pgbroker.maintain(max_rows => %s)", (max_rows,))}


def count(conn: psycopg.Connection, table: str) -> int:
    return conn.execute(f"SELECT count(*) FROM pgbroker.{table}").fetchone()[0]


def key_of(conn: psycopg.Connection, name: str) -> int | None:
    row = conn.execute("SELECT key FROM pgbroker.lock_name WHERE name = %s", (name,)).fetchone()
    return row[0] if row else None


def test_idle_names_and_full_buckets_leave_no_row_and_data_stays(connect: Connect) -> None:
    user, admin = connect("U", user="t_user"), connect("A")
    for i in range(50):
        assert user.execute("SELECT pgbroker.lock_acquire(%s)", (f"order/{i}",)).fetchone()[0]
        assert user.execute("SELECT pgbroker.lock_release(%s)", (f"order/{i}",)).fetchone()[0]
        assert user.execute("SELECT pgbroker.semaphore_acquire(%s, 3)", (f"tenant/{i}",)).fetchone()[0] == 1
        assert user.execute("SELECT pgbroker.semaphore_release(%s)", (f"tenant/{i}",)).fetchone()[0]
        assert user.execute("SELECT allowed FROM pgbroker.rate_limit(%s, 1000, '1 s')", (f"api/{i}",)).fetchone()[0]
    user.execute("SELECT pgbroker.kv_set('short', '1', ttl => '1 ms'), pgbroker.kv_set('kept', '2')")
    user.execute("SELECT pgbroker.counter_add('hits', 5)")
    assert count(admin, "lock_name") == 50 and count(admin, "semaphore_permit") == 150
    time.sleep(0.05)  # the buckets refill (1000 per second: 1 ms each) and the TTL runs out

    first = maintain(admin)
    assert list(first) == ["sweep", "lock names", "semaphores", "rate limits", "kv expired", "lease history"]
    assert first["rate limits"] == (50, 0) and first["kv expired"] == (1, 0)
    # The first pass only finds the names idle; the second forgets them.
    assert first["lock names"] == (0, 50) and first["semaphores"] == (0, 150)
    assert user.execute("SELECT pgbroker.lock_key('order/0')").fetchone()[0] is None  # no key while retired
    second = maintain(admin)
    assert second["lock names"] == (50, 0) and second["semaphores"] == (150, 0)
    assert count(admin, "lock_name") == count(admin, "semaphore_permit") == count(admin, "rate_limit_state") == 0
    # Data stays: the live entry and the counter.
    assert user.execute("SELECT value FROM pgbroker.kv_get('kept')").fetchone()[0] == 2
    assert user.execute("SELECT count(*) FROM pgbroker.kv_get('short')").fetchone()[0] == 0
    assert user.execute("SELECT pgbroker.counter_get('hits')").fetchone()[0] == 5
    # The view keeps the report, the metrics and the health check show it.
    rows = {
        r[0]: r[1:]
        for r in connect("R", user="t_reader").execute(
            "SELECT part, last_removed, removed_total, remaining FROM pgbroker.upkeep"
        )
    }
    assert rows["lock names"] == (50, 50, 0) and rows["rate limits"] == (0, 50, 0)
    metrics = dict(
        admin.execute(
            "SELECT labels->>'part', value FROM pgbroker.metrics WHERE metric = 'pgbroker_upkeep_removed_total'"
        )
    )
    assert metrics["semaphores"] == 150
    ok, detail = admin.execute("SELECT ok, detail FROM pgbroker.health WHERE \"check\" = 'upkeep'").fetchone()
    assert ok and "0 row(s) left" in detail
    # A forgotten name works as a new one, with a new key.
    assert user.execute("SELECT pgbroker.lock_acquire('order/0', '0')").fetchone()[0]
    assert key_of(admin, "order/0") > 50  # keys are never reused


def test_a_name_in_use_keeps_its_key(connect: Connect) -> None:
    holder, waiter, sem, admin = connect("H", user="t_user"), connect("W", user="t_user"), connect("S"), connect("A")
    holder.execute("SELECT pgbroker.lock_acquire('held'), pgbroker.lock_acquire('waited')")
    holder.execute("SELECT pgbroker.lock_acquire('shared', shared => true)")
    sem.execute("SELECT pgbroker.semaphore_acquire('sem', 2)")
    key_held, key_waited = key_of(admin, "held"), key_of(admin, "waited")
    waiting = threading.Thread(target=lambda: waiter.execute("SELECT pgbroker.lock_acquire('waited')"))
    waiting.start()
    deadline = time.monotonic() + 10
    while not admin.execute("SELECT waiting FROM pgbroker.locks WHERE name = 'waited'").fetchone()[0]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for _ in range(3):
        report = maintain(admin)
        assert report["lock names"] == (0, 0) and report["semaphores"][0] == 0
    assert key_of(admin, "held") == key_held and key_of(admin, "waited") == key_waited
    assert count(admin, "semaphore_permit") == 2  # held permit 1 keeps its free sibling
    holder.execute("SELECT pgbroker.lock_release('waited')")
    waiting.join(10)
    assert admin.execute("SELECT holder_pid FROM pgbroker.locks WHERE name = 'waited'").fetchone()[0] == (
        waiter.info.backend_pid
    )
    assert admin.execute("SELECT count(*) FROM pgbroker.unaccounted_locks").fetchone()[0] == 0


def test_a_snapshot_older_than_the_retirement_keeps_the_row(connect: Connect) -> None:
    user, old, admin = connect("U", user="t_user"), connect("O", user="t_user", autocommit=False), connect("A")
    user.execute("SELECT pgbroker.lock_acquire('n'), pgbroker.lock_release('n')")
    old.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    assert old.execute("SELECT count(*) FROM pgbroker.locks").fetchone()[0] == 0  # takes its snapshot
    maintain(admin)  # retires 'n'
    assert maintain(admin)["lock names"] == (0, 1)  # the old snapshot may still see it in use
    # That transaction takes the lock on the key it sees: the row must still be there, with that key.
    assert old.execute("SELECT pgbroker.lock_acquire('n', '0')").fetchone()[0]
    old.commit()
    assert maintain(admin)["lock names"][0] == 0  # now held
    assert old.execute("SELECT pgbroker.lock_release('n')").fetchone()[0]
    old.commit()
    assert maintain(admin)["lock names"] == (1, 0)  # still retired, free, and every snapshot is newer


def test_cached_keys_step_aside_and_mutual_exclusion_survives_forgetting(connect: Connect) -> None:
    """Sessions take a few names over and over (the Python Lock with its cached key, lock_acquire by name,
    shared and exclusive) while maintain() runs in a loop and forgets every name the moment it is idle; in
    each critical section the session checks that nobody else is inside."""
    names = [f"hot/{i}" for i in range(12)]
    inside = {name: [0, 0] for name in names}  # exclusive holders, shared holders
    guard = threading.Lock()
    errors: list[str] = []
    done = {"holds": 0, "cached": 0}
    stop = time.monotonic() + 8.0

    def enter(name: str, shared: bool) -> None:
        with guard:
            ex, sh = inside[name]
            if ex or (sh and not shared):
                errors.append(f"{name}: {'shared' if shared else 'exclusive'} entered while {ex} excl, {sh} shared")
            inside[name][1 if shared else 0] += 1
            done["holds"] += 1

    def leave(name: str, shared: bool) -> None:
        with guard:
            inside[name][1 if shared else 0] -= 1

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        conn = connect(f"w{seed}", user="t_user")
        locks = {(n, s): Lock(conn, n, shared=s) for n in names for s in (False, True)}
        while time.monotonic() < stop and not errors:
            name, shared = rng.choice(names[: rng.choice([3, 12])]), rng.random() < 0.3
            if rng.random() < 0.5:
                lock = locks[name, shared]
                cached = name in __import__("pgbroker._primitives_core", fromlist=["x"]).lock_keys(conn)
                if not lock.acquire(timeout=rng.choice([None, 0])):
                    continue
                done["cached"] += cached
                enter(name, shared)
                time.sleep(rng.uniform(0, 0.002))
                leave(name, shared)
                lock.release()
            else:
                if not conn.execute(
                    "SELECT pgbroker.lock_acquire(%s, %s, %s)", (name, rng.choice([None, "0", "5 ms"]), shared)
                ).fetchone()[0]:
                    continue
                enter(name, shared)
                time.sleep(rng.uniform(0, 0.002))
                leave(name, shared)
                assert conn.execute("SELECT pgbroker.lock_release(%s, %s)", (name, shared)).fetchone()[0]
            time.sleep(rng.uniform(0, 0.005))  # idle now and then: the upkeep may forget the name
        conn.close()

    forgotten = 0

    def upkeep() -> None:
        nonlocal forgotten
        conn = connect("upkeep")
        while time.monotonic() < stop and not errors:
            forgotten += maintain(conn, 100)["lock names"][0]
        conn.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(5)] + [threading.Thread(target=upkeep)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors[:5]
    # Not trivial: many holds, many by a cached key, and names really forgotten (and keys renewed) meanwhile.
    assert done["holds"] > 500 and done["cached"] > 100 and forgotten >= 10, (done, forgotten)
    admin = connect("A")
    assert admin.execute("SELECT max(key) FROM pgbroker.lock_name").fetchone()[0] > 12 + 10


def test_semaphore_bound_survives_forgetting(connect: Connect) -> None:
    pools = ["pool/0", "pool/1", "pool/2", "pool/3"]
    inside, peak, errors = dict.fromkeys(pools, 0), dict.fromkeys(pools, 0), []
    guard = threading.Lock()
    stop = time.monotonic() + 5.0

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        conn = connect(f"s{seed}", user="t_user")
        while time.monotonic() < stop:
            pool = rng.choice(pools[: rng.choice([1, 4])])
            if (
                conn.execute(
                    "SELECT pgbroker.semaphore_acquire(%s, 2, %s)", (pool, rng.choice(["0", "5 ms"]))
                ).fetchone()[0]
                is None
            ):
                continue
            with guard:
                inside[pool] += 1
                peak[pool] = max(peak[pool], inside[pool])
                if inside[pool] > 2:
                    errors.append((pool, inside[pool]))
            time.sleep(rng.uniform(0, 0.002))
            with guard:
                inside[pool] -= 1
            assert conn.execute("SELECT pgbroker.semaphore_release(%s)", (pool,)).fetchone()[0]
            time.sleep(rng.uniform(0, 0.006))
        conn.close()

    removed = [0]

    def upkeep() -> None:
        conn = connect("upkeep")
        while time.monotonic() < stop:
            removed[0] += maintain(conn, 100)["semaphores"][0]
        conn.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)] + [threading.Thread(target=upkeep)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and peak["pool/0"] == 2 and removed[0] >= 4, (errors, peak, removed)


def test_lease_history_past_the_retention_goes(connect: Connect) -> None:
    broker, admin, user = connect("B", user="t_broker"), connect("A", user="t_admin"), connect("U", user="t_user")
    broker.execute("SELECT pgbroker.broker_claim('h', '30 s')")
    broker.execute("SELECT pgbroker.broker_release('h')")
    assert maintain(admin)["lease history"] == (0, 0)
    admin.execute("SELECT pgbroker.upkeep_set(history_retention => '0')")
    assert (
        admin.execute("SELECT retention FROM pgbroker.upkeep WHERE part = 'lease history'")
        .fetchone()[0]
        .total_seconds()
        == 0
    )
    assert maintain(admin)["lease history"] == (2, 0)
    assert count(connect("S"), "lease_event") == 0
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        user.execute("SELECT pgbroker.maintain()")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        broker.execute("SELECT pgbroker.upkeep_set('1 day')")


@pytest.mark.parametrize(
    "call",
    [
        "maintain(max_rows => 0)",
        "maintain(max_rows => NULL)",
        "maintain(max_rows => 1000001)",
        "upkeep_set(NULL)",
        "upkeep_set('-1 s')",
    ],
)
def test_bad_input_is_refused_and_changes_nothing(connect: Connect, call: str) -> None:
    admin = connect("A", user="t_admin")
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        admin.execute(f"SELECT pgbroker.{call}")
    assert admin.execute("SELECT count(*) FROM pgbroker.upkeep WHERE last_run_at IS NOT NULL").fetchone()[0] == 0
    assert admin.execute("SELECT retention FROM pgbroker.upkeep WHERE part = 'lease history'").fetchone()[0].days == 30


def test_a_second_maintain_returns_at_once(connect: Connect) -> None:
    first, second = connect("1", autocommit=False), connect("2")
    first.execute("SELECT * FROM pgbroker.maintain()")
    started = time.monotonic()
    assert second.execute("SELECT * FROM pgbroker.maintain()").fetchall() == []
    assert time.monotonic() - started < 5
    first.commit()
    assert len(maintain(second)) == 6


def test_nobody_waits_for_the_upkeep(connect: Connect) -> None:
    """A caller holding a rate limit's row (its transaction open) makes maintain() skip that row, not wait."""
    user, admin = connect("U", user="t_user", autocommit=False), connect("A")
    user.execute("SELECT pgbroker.rate_limit('busy', 1000, '1 s')")
    user.commit()
    user.execute("SELECT pgbroker.rate_limit('busy', 1000, '1 s')")  # its row stays locked: the transaction is open
    time.sleep(0.01)
    started = time.monotonic()
    assert maintain(admin)["rate limits"] == (0, 1)
    assert time.monotonic() - started < 5
    user.commit()
    assert maintain(admin)["rate limits"] == (1, 0)


def test_python_lock_after_its_name_was_forgotten(connect: Connect) -> None:
    user, other, admin = connect("U", user="t_user"), connect("O", user="t_user"), connect("A")
    lock = Lock(user, "cached")
    lock.acquire()
    lock.release()
    lock.acquire()  # by the cached key now
    lock.release()
    old = key_of(admin, "cached")
    maintain(admin)
    maintain(admin)
    assert key_of(admin, "cached") is None
    assert other.execute("SELECT pgbroker.lock_acquire('cached')").fetchone()[0]
    assert key_of(admin, "cached") != old
    assert not lock.acquire(timeout=0)  # the cache stepped aside: the lock is the other session's
    assert other.execute("SELECT pgbroker.lock_release('cached')").fetchone()[0]
    assert lock.acquire(timeout=0)
    lock.release()
    with pytest.raises(PgBrokerError):
        lock.release()


def test_the_cli_runs_it_until_nothing_is_left(pg_server, db_name: str, connect: Connect) -> None:
    from test_cli import pgbroker

    user = connect("U", user="t_user")
    for i in range(30):
        user.execute("SELECT pgbroker.lock_acquire(%s), pgbroker.lock_release(%s)", (f"o/{i}", f"o/{i}"))
    result = pgbroker("maintain", "--max-rows", "7", "--json", "--url", pg_server.url_for(db_name, user="t_broker"))
    assert result.returncode == 0, result.stderr
    report = {r["part"]: r for r in json.loads(result.stdout)}
    assert report["lock names"] == {"part": "lock names", "removed": 30, "remaining": 0}
    assert count(connect("A"), "lock_name") == 0
    result = pgbroker("maintain", "--url", pg_server.url_for(db_name, user="t_user"))
    assert result.returncode == 1 and "permission denied" in result.stderr
    result = pgbroker("maintain", "--max-rows", "0", "--url", pg_server.url_for(db_name))
    assert result.returncode == 2


def test_a_python_broker_runs_the_upkeep_by_itself(db_url: str, connect: Connect) -> None:
    from pgbroker import Broker

    admin = connect("A")
    admin.execute("SELECT pgbroker.rate_limit('idle', 1000, '1 ms')")
    with Broker(db_url, "upkept"):
        deadline = time.monotonic() + 20
        while admin.execute("SELECT count(*) FROM pgbroker.rate_limit_state").fetchone()[0]:
            assert time.monotonic() < deadline, "the broker did not run maintain()"
            time.sleep(0.05)
        assert admin.execute("SELECT last_run_at IS NOT NULL FROM pgbroker.upkeep WHERE part = 'sweep'").fetchone()[0]


def test_a_python_broker_forgets_idle_names_without_waiting_a_minute(db_url: str, connect: Connect) -> None:
    """The first call marks the names idle, the next (MAINTAIN_SOON later, not a minute) deletes them."""
    from pgbroker import Broker
    from pgbroker._core import MAINTAIN_EVERY, MAINTAIN_SOON

    assert MAINTAIN_SOON * 3 < MAINTAIN_EVERY
    admin = connect("A")
    for name in ("order/1", "order/2", "order/3"):
        assert admin.execute("SELECT pgbroker.lock_acquire(%s)", (name,)).fetchone()[0] is True
        assert admin.execute("SELECT pgbroker.lock_release(%s)", (name,)).fetchone()[0] is True
    with Broker(db_url, "upkept"):
        deadline = time.monotonic() + MAINTAIN_SOON * 3
        while count(admin, "lock_name"):
            assert time.monotonic() < deadline, "the broker left the idle names for its next minute"
            time.sleep(0.1)
        assert admin.execute("SELECT removed_total FROM pgbroker.upkeep WHERE part = 'lock names'").fetchone()[0] == 3


def test_the_upkeep_cadence() -> None:
    """After a full batch: at once (a pause as long as the call); rows left for a later call: soon; else: a minute."""
    from pgbroker._core import MAINTAIN_EVERY, MAINTAIN_SOON, SWEEP_BATCH, maintain_pause

    idle = [("sweep", 0, 0), ("lock names", 0, 0), ("rate limits", 3, 0)]
    assert maintain_pause(idle, 0.2) == MAINTAIN_EVERY
    assert maintain_pause([*idle, ("lock names", 12, 40)], 0.2) == MAINTAIN_SOON  # marked, not yet deletable
    assert maintain_pause([*idle, ("kv expired", 0, None)], 0.2) == MAINTAIN_SOON  # skipped: a row was busy
    assert maintain_pause([*idle, ("rate limits", SWEEP_BATCH, 900)], 0.2) == 0.2
