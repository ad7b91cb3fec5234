"""The lease against real processes stopped and killed by real signals:
stale takeover of a paused holder, crash hand-over, and a claim race."""

from __future__ import annotations

import signal
import time

import pytest
from lease_util import Helper, backend_gone, claim, history, lease_row, wait_until, waiting
from psycopg import errors


@pytest.fixture
def url_for(pg_server, db_name):
    return lambda user="postgres": pg_server.url_for(db_name, user=user)


def _start_holder(url: str, heartbeat_ms: int = 200) -> tuple[Helper, int, int]:
    holder = Helper(url, "hold", "default", str(heartbeat_ms))
    word, epoch, pid = holder.readline()
    assert word == "CLAIMED"
    return holder, int(epoch), int(pid)


def test_stale_takeover_of_a_paused_holder(connect, url_for):
    """A holder process paused with SIGSTOP keeps its backend and its lock;
    a plain pgbroker_broker claim with stale_after takes over once the
    heartbeat is older than that, while it waits."""
    b, watch = connect("B", user="t_broker"), connect("watch")
    holder, epoch, victim = _start_holder(url_for("t_broker"))
    try:
        time.sleep(0.5)  # a few heartbeats
        assert lease_row(watch)["heartbeat_age"].total_seconds() < 0.5
        holder.signal(signal.SIGSTOP)
        paused = time.monotonic()
        assert claim(b, stale_after="1s", wait="5s") == epoch + 1
        elapsed = time.monotonic() - paused
        assert 0.7 <= elapsed < 3.0, elapsed
        assert backend_gone(watch, victim)
        row = lease_row(watch)
        assert (row["holder_pid"], row["alive"]) == (b.info.backend_pid, True)
        last = history(watch)[-1]
        assert last["event"] == "stale_takeover" and last["previous_pid"] == victim
        assert f"heartbeat of pid {victim} (epoch {epoch}) was" in last["reason"]
        assert "stale_after 00:00:01" in last["reason"]
        assert last["db_user"] == "t_broker"
    finally:
        holder.close()


def test_stale_takeover_without_waiting_when_already_stale(connect, url_for):
    b, watch = connect("B", user="t_broker"), connect("watch")
    holder, epoch, victim = _start_holder(url_for("t_broker"))
    try:
        holder.signal(signal.SIGSTOP)
        time.sleep(1.3)
        started = time.monotonic()
        assert claim(b, stale_after="1s") == epoch + 1  # wait => '0'
        assert time.monotonic() - started < 2
        assert backend_gone(watch, victim)
        assert history(watch)[-1]["event"] == "stale_takeover"
    finally:
        holder.close()


def test_paused_holder_blocks_a_waiter_without_stale_after(connect, url_for):
    b, watch = connect("B", user="t_broker"), connect("watch")
    holder, epoch, victim = _start_holder(url_for("t_broker"))
    try:
        holder.signal(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(errors.LockNotAvailable, match=f"pid {victim}"):
            claim(b, wait="1500ms")
        assert time.monotonic() - started >= 1.4
        row = lease_row(watch)
        assert (row["epoch"], row["holder_pid"], row["alive"]) == (epoch, victim, True)
        assert [e["event"] for e in history(watch)] == ["claim"]
    finally:
        holder.close()


def test_a_heartbeating_holder_is_not_stale(connect, url_for):
    b, watch = connect("B", user="t_broker"), connect("watch")
    holder, epoch, victim = _start_holder(url_for("t_broker"), heartbeat_ms=150)
    try:
        with pytest.raises(errors.LockNotAvailable):
            claim(b, stale_after="1s", wait="1800ms")
        row = lease_row(watch)
        assert (row["epoch"], row["holder_pid"], row["alive"]) == (epoch, victim, True)
        assert holder.proc.poll() is None
    finally:
        holder.close()


def test_sigkill_of_the_holder_hands_over_to_a_waiting_process(connect, url_for):
    watcher = connect("watch")
    holder, epoch, victim = _start_holder(url_for("t_broker"))
    waiter = Helper(url_for("t_broker"), "wait", "default")
    try:
        word, waiter_pid = waiter.readline()
        waiter_pid = int(waiter_pid)
        wait_until(lambda: waiting(watcher, waiter_pid), what="the waiter to block")
        time.sleep(0.2)
        assert lease_row(watcher)["waiting"] == 1
        holder.signal(signal.SIGKILL)
        killed = time.monotonic()
        word, new_epoch, pid = waiter.readline(timeout=10)
        took = time.monotonic() - killed
        assert (word, int(new_epoch), int(pid)) == ("CLAIMED", epoch + 1, waiter_pid)
        assert took < 3, took
        assert holder.proc.wait(5) == -signal.SIGKILL
        row = lease_row(watcher)
        assert (row["holder_pid"], row["holder_application"], row["alive"]) == (waiter_pid, "lease-waiter", True)
        last = history(watcher)[-1]
        assert last["event"] == "claim" and last["previous_pid"] == victim
        assert last["reason"] == f"session of pid {victim} (epoch {epoch}) ended"
    finally:
        holder.close()
        waiter.close()


def test_sigkill_of_the_holder_frees_the_lease(connect, url_for):
    b = connect("B")
    holder, epoch, victim = _start_holder(url_for("t_broker"))
    try:
        holder.signal(signal.SIGKILL)
        holder.proc.wait(5)
        wait_until(lambda: backend_gone(b, victim), timeout=3, what="the holder's backend to exit")
        assert lease_row(b)["alive"] is False
        assert claim(b) == epoch + 1
        assert history(b)[-1]["reason"] == f"session of pid {victim} (epoch {epoch}) ended"
    finally:
        holder.close()


@pytest.mark.slow
def test_race_of_six_processes(connect, url_for):
    """Six processes claim and give up the lease in a loop for 4 s; each
    logs its tenure while holding.  No two tenures overlap, epochs are
    unique and grow with time, and lease_history tells the same story."""
    db = connect("check")
    db.execute(
        "CREATE TABLE race_log (epoch bigint PRIMARY KEY, pid integer NOT NULL,"
        " started timestamptz NOT NULL, ended timestamptz)"
    )
    workers = [Helper(url_for(), "race", "default", "4") for _ in range(6)]
    try:
        tenures = 0
        for worker in workers:
            word, count = worker.readline(timeout=30)
            assert word == "DONE"
            tenures += int(count)
            assert worker.proc.wait(10) == 0
    finally:
        for worker in workers:
            worker.close()
    rows = db.execute("SELECT epoch, pid, started, ended FROM race_log ORDER BY epoch").fetchall()
    assert len(rows) == tenures >= 12, tenures
    assert all(ended is not None and ended >= started for _, _, started, ended in rows)
    assert [r[0] for r in sorted(rows, key=lambda r: r[2])] == [r[0] for r in rows], "epochs do not grow with time"
    for prev, nxt in zip(rows, rows[1:], strict=False):
        assert prev[3] <= nxt[2], f"tenures overlap: {prev} and {nxt}"
    assert len({pid for _, pid, _, _ in rows}) >= 4  # many backends held it in turn
    events = history(db)
    claims = [(e["epoch"], e["pid"]) for e in events if e["event"] != "release"]
    assert claims == [(epoch, pid) for epoch, pid, _, _ in rows]
    assert {e["event"] for e in events} == {"claim", "release"}
    by_epoch = {epoch: pid for epoch, pid, _, _ in rows}
    releases = [e for e in events if e["event"] == "release"]
    assert releases and all(by_epoch[e["epoch"]] == e["pid"] for e in releases)
    for e in events:
        if e["event"] == "claim" and e["previous_epoch"] is not None:
            assert e["reason"] in (
                f"epoch {e['previous_epoch']} was released",
                f"session of pid {e['previous_pid']} (epoch {e['previous_epoch']}) ended",
            )
    assert db.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone()[0] == 0
