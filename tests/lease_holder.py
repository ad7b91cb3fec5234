"""Helper process for the lease tests (run with sys.executable, never imported).

lease_holder.py URL hold NAME [HEARTBEAT_MS]
    claim NAME (fail fast), print "CLAIMED <epoch> <backend pid>", then
    heartbeat every HEARTBEAT_MS (default 200) until killed.
lease_holder.py URL wait NAME
    print "WAITING <backend pid>", claim NAME with wait => NULL, print
    "CLAIMED <epoch> <backend pid>", then sleep until killed.
lease_holder.py URL race NAME SECONDS
    claim NAME (wait 200ms) and give it up again in a loop for SECONDS;
    while holding, log (epoch, pid, started) and (ended) into race_log;
    every 4th tenure ends by closing the connection instead of releasing.
    Prints "DONE <tenures>".
"""

from __future__ import annotations

import random
import sys
import time

import psycopg
from psycopg import errors


def _connect(url: str, app: str) -> psycopg.Connection:
    return psycopg.connect(url, autocommit=True, application_name=app)


def hold(url: str, name: str, heartbeat_ms: int = 200) -> None:
    conn = _connect(url, "lease-holder")
    epoch = conn.execute("SELECT pgbroker.broker_claim(%s)", (name,)).fetchone()[0]
    print(f"CLAIMED {epoch} {conn.info.backend_pid}", flush=True)
    while True:
        time.sleep(heartbeat_ms / 1000)
        conn.execute("SELECT pgbroker.broker_heartbeat(%s)", (name,))


def wait(url: str, name: str) -> None:
    conn = _connect(url, "lease-waiter")
    print(f"WAITING {conn.info.backend_pid}", flush=True)
    epoch = conn.execute("SELECT pgbroker.broker_claim(%s, wait => NULL)", (name,)).fetchone()[0]
    print(f"CLAIMED {epoch} {conn.info.backend_pid}", flush=True)
    while True:
        time.sleep(1)


def race(url: str, name: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    conn = _connect(url, "lease-race")
    tenures = 0
    while time.monotonic() < deadline:
        try:
            epoch = conn.execute("SELECT pgbroker.broker_claim(%s, %s)", (name, "200ms")).fetchone()[0]
        except errors.LockNotAvailable:
            continue
        tenures += 1
        with conn.transaction():
            conn.execute("SELECT pgbroker.broker_assert(%s, %s)", (name, epoch))
            conn.execute(
                "INSERT INTO race_log (epoch, pid, started) VALUES (%s, pg_backend_pid(), clock_timestamp())",
                (epoch,),
            )
        time.sleep(random.uniform(0, 0.004))
        conn.execute("UPDATE race_log SET ended = clock_timestamp() WHERE epoch = %s", (epoch,))
        if tenures % 4 == 0:
            conn.close()  # the session ends: the server frees the lock
            conn = _connect(url, "lease-race")
        else:
            released = conn.execute("SELECT pgbroker.broker_release(%s)", (name,)).fetchone()[0]
            assert released, "release of a held lease returned false"
    print(f"DONE {tenures}", flush=True)


def main(argv: list[str]) -> None:
    url, mode, name, *rest = argv
    if mode == "hold":
        hold(url, name, *(int(x) for x in rest))
    elif mode == "wait":
        wait(url, name)
    elif mode == "race":
        race(url, name, float(rest[0]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
