"""Shared helpers of the lease tests: claiming, polling and helper processes."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

HELPER = Path(__file__).with_name("lease_holder.py")


def claim(conn: psycopg.Connection, name: str = "default", **kwargs: Any) -> int:
    """broker_claim(name, key => value, ...) with bound parameters."""
    args = "".join(f", {key} => %({key})s" for key in kwargs)
    row = conn.execute(f"SELECT pgbroker.broker_claim(%(name)s{args})", {"name": name, **kwargs}).fetchone()
    return row[0]


def release(conn: psycopg.Connection, name: str = "default") -> bool:
    return conn.execute("SELECT pgbroker.broker_release(%s)", (name,)).fetchone()[0]


def lease_row(conn: psycopg.Connection, name: str = "default") -> dict | None:
    cur = conn.execute("SELECT * FROM pgbroker.brokers WHERE name = %s", (name,))
    row = cur.fetchone()
    return None if row is None else dict(zip([d.name for d in cur.description], row, strict=True))


def history(conn: psycopg.Connection, name: str = "default") -> list[dict]:
    cur = conn.execute("SELECT * FROM pgbroker.lease_history WHERE name = %s ORDER BY id", (name,))
    cols = [d.name for d in cur.description]
    return [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]


def waiting(conn: psycopg.Connection, pid: int) -> bool:
    """Whether backend pid is blocked on a lock (pg_locks, not granted)."""
    return conn.execute("SELECT EXISTS (SELECT FROM pg_locks WHERE pid = %s AND NOT granted)", (pid,)).fetchone()[0]


def wait_until(predicate: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def backend_gone(conn: psycopg.Connection, pid: int) -> bool:
    return not conn.execute("SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = %s)", (pid,)).fetchone()[0]


class Background:
    """Run fn() in a thread; .result() re-raises its exception."""

    def __init__(self, fn: Callable[[], Any]):
        self._value: Any = None
        self._error: BaseException | None = None
        self.finished_at: float | None = None

        def run() -> None:
            try:
                self._value = fn()
            except BaseException as exc:  # noqa: BLE001 - handed back to the test
                self._error = exc
            self.finished_at = time.monotonic()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def done(self) -> bool:
        return not self.thread.is_alive()

    def result(self, timeout: float = 10.0) -> Any:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise AssertionError("background call did not finish in time")
        if self._error is not None:
            raise self._error
        return self._value


class Helper:
    """A lease_holder.py subprocess; always SIGCONT + SIGKILL + reaped by close()."""

    def __init__(self, url: str, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, str(HELPER), url, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def readline(self, timeout: float = 10.0) -> list[str]:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise AssertionError(f"helper printed nothing in {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"helper exited ({self.proc.wait()}): {self.proc.stderr.read()}")
        return line.split()

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(self.proc.pid, sig)
                except ProcessLookupError:
                    break
        self.proc.wait(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            stream.close()

    def __enter__(self) -> Helper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
