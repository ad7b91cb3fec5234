"""Fault: the broker is left idle inside a transaction.

A holder that opens a transaction and then stops (a hung event loop, a
forgotten BEGIN) keeps its session and so its lease.  With
``idle_in_transaction_session_timeout`` the server ends that session, which
frees the lease at once: a waiting successor takes over with the next epoch.
"""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from lease_util import claim, history

TIMEOUT_MS = 300


def test_idle_in_transaction_holder_is_ended_and_a_successor_takes_over(connect):
    holder, successor, obs = connect("idle holder"), connect("successor"), connect("obs")
    epoch = claim(holder, "idle", owner="h")
    holder.execute(f"SET idle_in_transaction_session_timeout = '{TIMEOUT_MS}ms'")
    result: dict[str, float | int] = {}

    def wait_for_it() -> None:
        result["epoch"] = claim(successor, "idle", wait="10 s")
        result["at"] = time.monotonic()

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    time.sleep(0.1)  # the successor is blocked on the lease's lock
    holder.execute("BEGIN")
    holder.execute("SELECT 1")
    idle_since = time.monotonic()  # the holder now sits idle in its transaction
    waiter.join(10)
    assert not waiter.is_alive(), "the successor never got the lease"
    detection_ms = (result["at"] - idle_since) * 1000
    print(f"\nidle in transaction: timeout {TIMEOUT_MS} ms, successor held the lease {detection_ms:.0f} ms after")
    assert result["epoch"] > epoch
    assert TIMEOUT_MS * 0.9 <= detection_ms < TIMEOUT_MS + 1500
    events = history(obs, "idle")
    assert [e["event"] for e in events] == ["claim", "claim"] and "ended" in events[-1]["reason"]
    # The old holder finds its session gone; its epoch no longer passes broker_assert.
    with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):  # 25P03, told on its next statement
        holder.execute("SELECT 1")
    with pytest.raises(psycopg.Error) as stale:
        obs.execute("SELECT pgbroker.broker_assert('idle', %s)", (epoch,))
    assert stale.value.sqlstate == "PB002"
