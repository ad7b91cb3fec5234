"""The coordination primitives under 8 real processes, each on its own
connection, checked over recorded histories (tests/history.py).

Every process calls the SQL API through plain psycopg and records each call
(invoke and complete times on CLOCK_MONOTONIC, outcome, return values).  The
checkers then verify mutual exclusion, the semaphore bound, counter sums and
compare-and-set chains; each test also asserts that the history is
non-trivial (contention really happened).  Bounded: a fixed number of
operations per process and a deadline.
"""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from history import (
    OK,
    History,
    Op,
    Unresolved,
    check_cas,
    check_counter,
    check_locks,
    check_semaphore,
    lock_holds,
    permit_holds,
)

PROCESSES = 8
DEADLINE = 20.0  # seconds: a worker stops early rather than run past this
pytestmark = pytest.mark.slow


def _connect(url: str, process: str) -> psycopg.Connection:
    return psycopg.connect(url, autocommit=True, application_name=f"conc-{process}")


def _hold(rng: random.Random, max_ms: float = 2.0) -> None:
    time.sleep(rng.uniform(0, max_ms) / 1000)


# ---------------------------------------------------------------------------
# Workers (run in spawned processes)


def lock_worker(url: str, directory: str, process: str, barrier: Any, ops: int, mode: str) -> None:
    """mode: 'exclusive', 'mixed' (60% shared), or 'xact' (transaction scope in autocommit: the lock
    ends with the acquire's own statement, so holds overlap: a control that the checker sees it)."""
    rng = random.Random(process)
    with _connect(url, process) as conn, History(directory).recorder(process) as rec:
        barrier.wait()
        stop = time.monotonic() + DEADLINE
        for _ in range(ops):
            if time.monotonic() > stop:
                break
            shared = mode == "mixed" and rng.random() < 0.6
            xact = mode == "xact"
            with rec.call("acquire", "job", shared=shared) as c:
                acquired = conn.execute(
                    "SELECT pgbroker.lock_acquire('job', '5 s', %s, %s)", (shared, xact)
                ).fetchone()[0]
                c.ok(acquired=acquired)
            if not acquired:
                continue
            _hold(rng)
            if xact:
                with rec.call("release", "job", shared=shared) as c:
                    c.ok()  # nothing to release: it ended with its statement
                continue
            with rec.call("release", "job", shared=shared) as c:
                c.ok(released=conn.execute("SELECT pgbroker.lock_release('job', %s)", (shared,)).fetchone()[0])


def semaphore_worker(url: str, directory: str, process: str, barrier: Any, ops: int, wait: str) -> None:
    rng = random.Random(process)
    with _connect(url, process) as conn, History(directory).recorder(process) as rec:
        barrier.wait()
        stop = time.monotonic() + DEADLINE
        for _ in range(ops):
            if time.monotonic() > stop:
                break
            with rec.call("acquire", "pool", limit=3, wait=wait) as c:
                permit = conn.execute("SELECT pgbroker.semaphore_acquire('pool', 3, %s)", (wait,)).fetchone()[0]
                c.ok(permit=permit)
            if permit is None:
                _hold(rng, 0.5)
                continue
            _hold(rng)
            with rec.call("release", "pool") as c:
                c.ok(released=conn.execute("SELECT pgbroker.semaphore_release('pool')").fetchone()[0])


def counter_add_worker(url: str, directory: str, process: str, barrier: Any, ops: int) -> None:
    rng = random.Random(process)
    with _connect(url, process) as conn, History(directory).recorder(process) as rec:
        barrier.wait()
        stop = time.monotonic() + DEADLINE
        for _ in range(ops):
            if time.monotonic() > stop:
                break
            delta = rng.randint(1, 3)
            with rec.call("add", "hits", delta=delta) as c:
                c.ok(value=conn.execute("SELECT pgbroker.counter_add('hits', %s)", (delta,)).fetchone()[0])


def counter_cas_worker(url: str, directory: str, process: str, barrier: Any, ops: int) -> None:
    with _connect(url, process) as conn, History(directory).recorder(process) as rec:
        barrier.wait()
        stop = time.monotonic() + DEADLINE
        for _ in range(ops):
            if time.monotonic() > stop:
                break
            with rec.call("read", "seq") as c:
                seen = conn.execute("SELECT pgbroker.counter_get('seq')").fetchone()[0]
                c.ok(value=seen)
            with rec.call("cas", "seq", expected=seen) as c:
                done = conn.execute("SELECT pgbroker.counter_set('seq', %s, %s)", (seen + 1, seen)).fetchone()[0]
                c.ok(new=seen + 1 if done else None)


def kv_cas_worker(url: str, directory: str, process: str, barrier: Any, ops: int) -> None:
    with _connect(url, process) as conn, History(directory).recorder(process) as rec:
        barrier.wait()
        stop = time.monotonic() + DEADLINE
        for _ in range(ops):
            if time.monotonic() > stop:
                break
            with rec.call("read", "cfg") as c:
                row = conn.execute("SELECT value, version FROM pgbroker.kv_get('cfg')").fetchone()
                value, version = row if row else ({"n": 0}, 0)
                c.ok(value=value, version=version)
            with rec.call("cas", "cfg", expected=version, n=value["n"] + 1) as c:
                new = conn.execute(
                    "SELECT pgbroker.kv_set('cfg', %s::jsonb, %s)",
                    (psycopg.types.json.Jsonb({"n": value["n"] + 1}), version),
                ).fetchone()[0]
                c.ok(new=new)


# ---------------------------------------------------------------------------
# Running them


def run_processes(tmp_path: Path, target: Callable[..., None], url: str, *args: Any) -> tuple[list[Op], float]:
    """PROCESSES spawned workers started together; their merged history and the wall time."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(PROCESSES + 1)
    directory = tmp_path / target.__name__
    History(directory)
    procs = [
        ctx.Process(target=target, args=(url, str(directory), f"p{i}", barrier, *args), daemon=True)
        for i in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout=60)
        started = time.monotonic()
        for p in procs:
            p.join(DEADLINE + 20)
        elapsed = time.monotonic() - started
        assert [p.exitcode for p in procs] == [0] * PROCESSES, "a worker failed (its traceback is above)"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return History(directory).load(), elapsed


def figure(what: str, ops: list[Op], elapsed: float, violations: list, extra: str = "") -> None:
    print(
        f"\n{what}: {len(ops)} ops by {PROCESSES} processes in {elapsed:.2f} s, violations = {len(violations)}{extra}"
    )


def _fail_message(violations: list) -> str:
    return "\n".join(str(v) for v in violations[:10])


# ---------------------------------------------------------------------------
# Tests


def test_exclusive_lock_mutual_exclusion(tmp_path: Path, db_url: str) -> None:
    ops, elapsed = run_processes(tmp_path, lock_worker, db_url, 120, "exclusive")
    unresolved = Unresolved()
    violations = check_locks(ops, unresolved)
    acquired = [o for o in ops if o.op == "acquire" and o.values.get("acquired")]
    waited = [o for o in acquired if o.complete - o.invoke > 2_000_000]  # longer than any single hold
    figure("lock exclusive", ops, elapsed, violations, f", {len(acquired)} holds, {len(waited)} waited > 2 ms")
    assert violations == [], _fail_message(violations)
    assert all(o.result == OK for o in ops) and unresolved.ops == []
    assert len(acquired) == PROCESSES * 120  # wait '5 s' never ran out
    assert len(waited) > PROCESSES * 10  # contention happened


def test_shared_and_exclusive_lock_mutual_exclusion(tmp_path: Path, db_url: str) -> None:
    ops, elapsed = run_processes(tmp_path, lock_worker, db_url, 120, "mixed")
    violations = check_locks(ops)
    acquired = [o for o in ops if o.op == "acquire" and o.values.get("acquired")]
    shared = [o for o in acquired if o.args["shared"]]
    shared_holds = sorted((h for h in lock_holds(ops) if h.shared), key=lambda h: h.start)
    together = sum(
        1 for a, b in zip(shared_holds, shared_holds[1:], strict=False) if b.start <= a.end and a.holder != b.holder
    )
    figure(
        "lock shared/exclusive",
        ops,
        elapsed,
        violations,
        f", {len(shared)} shared + {len(acquired) - len(shared)} exclusive holds, {together} shared overlaps",
    )
    assert violations == [], _fail_message(violations)
    assert len(acquired) == PROCESSES * 120
    assert 0 < len(shared) < len(acquired) and together > 0  # shared holders did hold together


def test_checker_sees_overlaps_of_xact_locks_believed_held_past_their_statement(tmp_path: Path, db_url: str) -> None:
    """Control: the same loop with xact => true in autocommit, where the lock ends with the
    acquire's statement; the 'holds' the clients believe in overlap, and the checker must say so."""
    ops, elapsed = run_processes(tmp_path, lock_worker, db_url, 40, "xact")
    violations = check_locks(ops)
    figure("lock xact in autocommit (control)", ops, elapsed, violations)
    assert len(violations) > 0 and {v.kind for v in violations} == {"exclusive-overlap"}


def test_semaphore_bound(tmp_path: Path, db_url: str, connect: Callable[..., psycopg.Connection]) -> None:
    # The server's own view of the holders, sampled while the workers run.
    monitor = connect("monitor")
    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            row = monitor.execute("SELECT held FROM pgbroker.semaphores WHERE name = 'pool'").fetchone()
            samples.append(row[0] if row else 0)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        ops, elapsed = run_processes(tmp_path, semaphore_worker, db_url, 80, "5 s")
    finally:
        done.set()
        sampler.join()
    violations = check_semaphore(ops, limit=3)
    holds = permit_holds(ops)
    acquires = [o for o in ops if o.op == "acquire"]
    waited = [o for o in acquires if o.complete - o.invoke > 2_000_000]  # longer than any hold
    permits = sorted({h.token for h in holds})
    figure(
        "semaphore limit 3, wait 5 s",
        ops,
        elapsed,
        violations,
        f", {len(holds)} holds of permits {permits}, {len(waited)} waited > 2 ms,"
        f" server saw at most {max(samples)} held",
    )
    assert violations == [], _fail_message(violations)
    assert len(holds) == PROCESSES * 80 and permits == [1, 2, 3]
    assert len(waited) > 0  # some acquire waited for a release
    assert max(samples) <= 3 and len(samples) > 10


def test_semaphore_bound_without_waiting(tmp_path: Path, db_url: str) -> None:
    ops, elapsed = run_processes(tmp_path, semaphore_worker, db_url, 150, "0")
    violations = check_semaphore(ops, limit=3)
    refused = [o for o in ops if o.op == "acquire" and o.values.get("permit") is None]
    holds = permit_holds(ops)
    figure("semaphore limit 3, wait 0", ops, elapsed, violations, f", {len(holds)} holds, {len(refused)} refused")
    assert violations == [], _fail_message(violations)
    assert len(refused) > 0 and len(holds) > PROCESSES * 10  # contention, and progress
    assert all(o.complete - o.invoke < 1_000_000_000 for o in ops if o.op == "acquire")  # '0' never blocks


def test_counter_add_sum(tmp_path: Path, db_url: str, connect: Callable[..., psycopg.Connection]) -> None:
    ops, elapsed = run_processes(tmp_path, counter_add_worker, db_url, 300)
    final = connect().execute("SELECT pgbroker.counter_get('hits')").fetchone()[0]
    violations = check_counter(ops, final=final)
    figure("counter_add", ops, elapsed, violations, f", final {final}")
    assert violations == [], _fail_message(violations)
    assert len(ops) == PROCESSES * 300 and final == sum(o.args["delta"] for o in ops)


def test_counter_set_compare_and_set(tmp_path: Path, db_url: str, connect: Callable[..., psycopg.Connection]) -> None:
    ops, elapsed = run_processes(tmp_path, counter_cas_worker, db_url, 150)
    final = connect().execute("SELECT pgbroker.counter_get('seq')").fetchone()[0]
    violations = check_cas(ops, initial=0, final=final)
    wins = [o for o in ops if o.op == "cas" and o.values["new"] is not None]
    lost = [o for o in ops if o.op == "cas" and o.values["new"] is None]
    figure("counter_set CAS", ops, elapsed, violations, f", {len(wins)} won, {len(lost)} lost, final {final}")
    assert violations == [], _fail_message(violations)
    assert final == len(wins) > 0 and len(lost) > 0  # contention happened, and no lost update


def test_kv_compare_and_set(tmp_path: Path, db_url: str, connect: Callable[..., psycopg.Connection]) -> None:
    ops, elapsed = run_processes(tmp_path, kv_cas_worker, db_url, 150)
    value, version = connect().execute("SELECT value, version FROM pgbroker.kv_get('cfg')").fetchone()
    violations = check_cas(ops, initial=0, final=version)
    wins = [o for o in ops if o.op == "cas" and o.values["new"] is not None]
    lost = [o for o in ops if o.op == "cas" and o.values["new"] is None]
    figure("kv_set CAS", ops, elapsed, violations, f", {len(wins)} won, {len(lost)} lost, final {value} v{version}")
    assert violations == [], _fail_message(violations)
    assert value == {"n": len(wins)} and len(wins) > 0 and len(lost) > 0
    # Each win wrote the count it read plus one, so the values written are exactly 1..wins.
    assert sorted(o.args["n"] for o in wins) == list(range(1, len(wins) + 1))


# ---------------------------------------------------------------------------
# A name (or permit) first registered inside a transaction that rolls back:
# the registration is gone, and so is the hold that transaction took on it
# (it was a transaction-level lock, to become a session lock at commit), so
# the name never has two holders under two keys.


def test_lock_first_acquired_in_a_rolled_back_transaction_is_not_held(
    connect: Callable[..., psycopg.Connection],
) -> None:
    a, b = connect("A"), connect("B")
    a.execute("BEGIN")
    assert a.execute("SELECT pgbroker.lock_acquire('fresh', '0')").fetchone()[0] is True
    a.execute("ROLLBACK")  # the registration and the hold go together
    assert a.execute("SELECT pgbroker.lock_release('fresh')").fetchone()[0] is False
    assert b.execute("SELECT pgbroker.lock_acquire('fresh', '0')").fetchone()[0] is True
    assert a.execute("SELECT pgbroker.lock_acquire('fresh', '0')").fetchone()[0] is False, "two holders of 'fresh'"
    holders = b.execute("SELECT holder_pid FROM pgbroker.locks WHERE name = 'fresh'").fetchall()
    assert holders == [(b.info.backend_pid,)]
    # Committed, the same hold becomes a session lock that outlives the transaction.
    a.execute("BEGIN")
    assert a.execute("SELECT pgbroker.lock_acquire('kept', '0')").fetchone()[0] is True
    a.execute("COMMIT")
    assert b.execute("SELECT pgbroker.lock_acquire('kept', '0')").fetchone()[0] is False
    assert a.execute("SELECT pgbroker.lock_release('kept')").fetchone()[0] is True
    assert b.execute("SELECT pgbroker.lock_acquire('kept', '0')").fetchone()[0] is True


def test_semaphore_first_acquired_in_a_rolled_back_transaction_keeps_its_bound(
    connect: Callable[..., psycopg.Connection],
) -> None:
    a, b = connect("A"), connect("B")
    a.execute("BEGIN")
    assert a.execute("SELECT pgbroker.semaphore_acquire('fresh', 1)").fetchone()[0] == 1
    a.execute("ROLLBACK")
    assert b.execute("SELECT pgbroker.semaphore_acquire('fresh', 1)").fetchone()[0] == 1
    assert a.execute("SELECT pgbroker.semaphore_acquire('fresh', 1)").fetchone()[0] is None, "two holders, limit 1"
    assert a.execute("SELECT pgbroker.semaphore_release('fresh')").fetchone()[0] is False
    a.execute("BEGIN")
    assert a.execute("SELECT pgbroker.semaphore_acquire('kept', 1)").fetchone()[0] == 1
    a.execute("COMMIT")
    assert b.execute("SELECT pgbroker.semaphore_acquire('kept', 1)").fetchone()[0] is None
    assert a.execute("SELECT pgbroker.semaphore_release('kept')").fetchone()[0] is True
    assert b.execute("SELECT pgbroker.semaphore_acquire('kept', 1)").fetchone()[0] == 1
