"""Benchmark of change fan-out (watched tables, outbox, wake-ups) against unwatched floors (run on demand).

    python tests/benchmarks/bench_fanout.py            # about 9 minutes
    python tests/benchmarks/bench_fanout.py --quick    # shorter runs, for a smoke test
    python tests/benchmarks/bench_fanout.py --explain  # also print the trigger queries' plans (auto_explain)
    python -m pytest tests/benchmarks/bench_fanout.py -s -p no:cacheprovider

Starts its own throwaway PostgreSQL with fsync, synchronous_commit and
full_page_writes ON (the test fixtures turn them off), installs pgbroker with
its migrations, and measures, in the same run, against floors measured
alternately with it:

1. UPDATE throughput (pgbench, one row per transaction) on a watched table
   (1,000 rows, 1,000 clients on one broker, 10,000 subscriptions: 10 per row),
   watched in statement mode and, a copy, in row mode, against an identical
   unwatched table, at 1 and at 8 writers, with a real broker draining
   concurrently; beside them, on copies of the table each with its own consumer,
   the four designs users write instead (issue 22; see PEERS): a trigger that
   writes the list of clients to a table and NOTIFYs, a pg_notify of JSON per
   row, a transactional outbox, and the throwaway prototype of
   ../shared/reference/fanout-prototype.md.  CPU per transaction counts the
   server's processes and this one (the consumers' loops).  Targets: statement
   mode at least 0.75x of unwatched, CPU at most 1.5x; row mode at least 0.9x of
   the transactional outbox's throughput, CPU at most 1.15x of its.  Also the
   NOTIFYs the broker received (wake-ups must not be one per writing
   transaction), and at 8 writers what the writers' backends wait for (sampled).
2. One 10,000-row UPDATE statement: with 1% of the rows subscribed, against the
   same statement on an unwatched table (target: at most 1.5x); with every row
   subscribed, the extra cost per outbox row against a plain INSERT ... SELECT of
   the same outbox-shaped rows into an UNLOGGED table of the outbox's shape
   (target: within 1.5x).  Medians of alternating repetitions.
   The 10,000-row statements once more on tables watched in row mode (info: what
   a bulk write costs there).  Also one 100,000-row UPDATE with 1% of the rows
   subscribed, at the server's default JIT settings (info: large statements once
   paid for JIT compilation).
3. Commit-to-handler latency: a writer updates a subscribed row 50 times a
   second in each mode; the time from its commit returning to the broker's outbox_fetch()
   returning the row (same process, time.perf_counter).  Floor: an UPDATE plus
   pg_notify() in one transaction, received by a plain LISTENing connection.
   Target: p99 under 10 ms.
4. Scale: single-row UPDATE cost with 100 clients / 2,000 subscriptions against
   10,000 clients / 200,000 subscriptions (a fresh epoch; the updated rows have
   two subscribers in both cases).  Target: about 1x.
5. Only with --only guarantees (about 6 minutes more): what each guarantee of
   row mode costs a single-row UPDATE.  Copies of the row-mode table whose
   UPDATE trigger has the guarantees taken out one at a time, cumulatively
   (SECURITY DEFINER with its pinned search_path; the watch try-lock; the
   isolation test; the whole-table probe; the drain lock and awake test), run
   in the rounds of part 1 beside unwatched and the transactional outbox; then
   the writer backend's own CPU per UPDATE in one session with
   synchronous_commit off (no WAL flush, no consumers in the figure), in
   alternating rounds.  Diagnostic only: the stripped triggers are not correct.
6. Only with --only shared (half a minute, run first): what a watched single-row UPDATE
   shares with every other writer's (issue 44), in row and statement mode,
   the transactional outbox and the prototype: the lock tags that two writers
   (in two gates of the watch and drain locks) both hold, from pg_locks, and
   the try-locks that fail on every writer while the broker drains (each an
   operation on the tag's lock-manager partition); and the pages each UPDATE
   reads and writes per relation (pg_statio, 2,000 UPDATEs), of which the
   outbox's, its indexes' and its sequence's are written by every writer.
   Target: row mode's lock-manager operations on shared tags at most the
   prototype's.
7. Only with --only fetch (about 2 minutes): the consumer's half of part 1's
   CPU per transaction.  A broker of its own (lease fetchbench, 1,000 clients,
   10 subscribers per row of a table watched in row mode) fetches batches of 6
   and of 20 rows (what part 1's batches held at 1 and at 8 writers), each
   acknowledging the one before, beside the transactional outbox's consumer
   (its DELETE ... RETURNING on a copy of peer c), the bare acknowledging
   statement (outbox_fetch's last statement alone: no fence, no checks) and
   that statement in a function made as outbox_fetch is (PL/pgSQL, SECURITY
   DEFINER, the same pinned settings), in alternating rounds: the backend's
   CPU per fetch, the loop's (psycopg), and an empty fetch's.  Diagnostic only.

The broker is a thread holding the lease on its own connection.  Its loop is
plain psycopg calls to the SQL API: broker_wake(); outbox_fetch(max 1000, ack =>
the previous batch) until the outbox stays empty for LINGER seconds (polled every
millisecond); broker_sleep(); then wait on LISTEN for a NOTIFY or POLL seconds.

Loopback only; bounded in count and time.  Prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psycopg  # noqa: E402

from pgbroker import install  # noqa: E402
from pgbroker._embedded import EmbeddedPostgres, find_pg_bin  # noqa: E402

DURABLE = (
    "-c fsync=on -c synchronous_commit=on -c full_page_writes=on "
    # Keep a timed checkpoint out of the measurements; the run is shorter than this.
    "-c checkpoint_timeout=30min -c max_wal_size=4GB"
)
BROKER = "default"
LINGER = 0.005  # seconds the broker keeps polling an empty outbox before it sleeps
BATCH_DELAY = 0.002  # seconds the broker waits after a short batch (as Broker.notifications() does)
POLL = 0.2  # seconds the sleeping broker waits for a NOTIFY before polling anyway

TPS_TARGET = 0.75  # statement mode against unwatched
CPU_TARGET = 1.5  # CPU per watched single-row transaction against unwatched
PEER_TPS_TARGET = 0.9  # row mode against the transactional outbox (issue 22)
PEER_CPU_TARGET = 1.15
FETCH_CPU_TARGET_US = 12  # broker backend CPU per delivered row
BULK_TARGET = 1.5
PER_ROW_TARGET = 1.5
LATENCY_P99_TARGET_MS = 10.0
SCALE_TARGET = 1.2  # "about 1x": the large set-up may cost at most this much more


PARTS = ("throughput", "bulk", "huge", "latency", "scale", "guarantees", "shared", "fetch")
OPT_IN = ("guarantees", "shared", "fetch")  # parts run only when named


@dataclass
class Settings:
    tps_seconds: float = 4.0  # per pgbench run
    tps_rounds: int = 5  # rounds of every design, in rotated order, per writer count (this machine is noisy)
    writers: tuple[int, ...] = (1, 8)  # pgbench clients of the throughput part; its waits are sampled at the last
    bulk_reps: int = 9  # alternating repetitions; the median of each (this machine is noisy)
    huge_reps: int = 5  # the same for the 100,000-row statement
    latency_rate: float = 50.0  # writes per second (each for pgbroker and the floor)
    latency_seconds: float = 5.0
    scale_seconds: float = 4.0
    scale_rounds: int = 4  # alternating watched / unwatched pgbench runs per phase (the tps form is noisy)
    scale_statements: int = 1000
    explain: bool = False
    only: tuple[str, ...] = ()  # parts to run (all but OPT_IN when empty): see PARTS

    def runs(self, part: str) -> bool:
        return part in self.only or (not self.only and part not in OPT_IN)

    @classmethod
    def quick(cls) -> Settings:
        return cls(tps_seconds=2.0, tps_rounds=1, bulk_reps=3, huge_reps=1, latency_seconds=2.0, scale_seconds=2.0,
                   scale_rounds=2, scale_statements=300)  # fmt: skip


@dataclass
class Results:
    rows: list[tuple[str, str, str, str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)
    missed: list[str] = field(default_factory=list)

    def add(self, metric: str, ours: str, floor: str, ratio: str, target: str) -> None:
        self.rows.append((metric, ours, floor, ratio, target))
        if target.endswith("MISSED"):
            self.missed.append(metric)

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"  {text}", flush=True)

    def table(self) -> str:
        header = ("metric", "pgbroker", "floor", "ratio", "target")
        widths = [max(len(r[i]) for r in [header, *self.rows]) for i in range(5)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *self.rows]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def _percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


# ---------------------------------------------------------------------------
# The broker: a thread holding the lease and draining the outbox.


class DrainingBroker(threading.Thread):
    """Holds lease ``name`` on its own connection and drains its outbox until stopped."""

    def __init__(self, url: str, name: str = BROKER, linger: float = LINGER, poll: float = POLL):
        super().__init__(name=f"broker-{name}", daemon=True)
        self.lease = name
        self.linger = linger
        self.poll = poll
        self.conn = psycopg.connect(url, autocommit=True)
        self.backend_pid = self.conn.info.backend_pid
        self.epoch: int = self.conn.execute("SELECT pgbroker.broker_claim(%s)", (name,)).fetchone()[0]
        self.channel: str = self.conn.execute("SELECT pgbroker.wakeup_channel(%s)", (name,)).fetchone()[0]
        assert re.fullmatch(r"pgbroker_wakeup_[0-9]+", self.channel), self.channel
        self.on_rows: Callable[[list[tuple[Any, ...]], float], None] | None = None
        self._halt = threading.Event()
        self.paused = threading.Event()  # while set: stays awake (no NOTIFYs) but does not fetch
        self.error: BaseException | None = None
        # Counters (written by this thread only).
        self.notifies = 0  # NOTIFYs received
        self.timeouts = 0  # sleeps that ended by the poll timeout
        self.wakes = 0  # broker_wake() calls
        self.fetches = 0  # non-empty fetches
        self.delivered = 0  # outbox rows fetched and acknowledged
        self.sleep_results: Counter[str] = Counter()

    def counters(self) -> dict[str, int]:
        return {
            "notifies": self.notifies,
            "timeouts": self.timeouts,
            "wakes": self.wakes,
            "fetches": self.fetches,
            "delivered": self.delivered,
            "asleep": self.sleep_results["asleep"],
            "pending": self.sleep_results["pending"],
            "busy": self.sleep_results["busy"],
        }

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def _loop(self) -> None:
        conn = self.conn
        conn.execute(f"LISTEN {self.channel}")
        while not self._halt.is_set():
            conn.execute("SELECT pgbroker.broker_wake(%s)", (self.lease,))
            self.wakes += 1
            self._drain()
            status = conn.execute("SELECT pgbroker.broker_sleep(%s)", (self.lease,)).fetchone()[0]
            self.sleep_results[status] += 1
            if status != "asleep":
                continue  # still awake: 'pending' (rows arrived) or 'busy' (a writer still open)
            received = wait_notified(conn, self.poll)
            self.notifies += received
            if not received:
                self.timeouts += 1

    def _drain(self) -> None:
        conn = self.conn
        empty_since: float | None = None
        done: list[int] | None = None  # handled rows, acknowledged by the next fetch (one round trip)
        while not self._halt.is_set():
            if self.paused.is_set():
                if done:
                    conn.execute("SELECT pgbroker.outbox_ack(%s, %s)", (self.lease, done))
                    done = None
                time.sleep(0.01)
                continue
            rows = conn.execute("SELECT * FROM pgbroker.outbox_fetch(%s, 1000, %s)", (self.lease, done)).fetchall()
            done = None
            if rows:
                now = time.perf_counter()
                if self.on_rows is not None:
                    self.on_rows(rows, now)
                self.fetches += 1
                self.delivered += len(rows)
                done = [r[0] for r in rows]
                empty_since = None
                if len(rows) < 1000:
                    time.sleep(BATCH_DELAY)
                continue
            now = time.perf_counter()
            if empty_since is None:
                empty_since = now
            elif now - empty_since >= self.linger:
                return
            time.sleep(0.001)

    def stop(self, release: bool = True) -> None:
        self._halt.set()
        self.join(self.poll + 10)
        if self.is_alive():
            raise RuntimeError("the broker thread did not stop")
        if release:
            self.conn.execute("SELECT pgbroker.broker_release(%s)", (self.lease,))
        self.conn.close()
        if self.error is not None:
            raise RuntimeError("the broker thread failed") from self.error

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError("the broker thread failed") from self.error
        if not self.is_alive():
            raise RuntimeError("the broker thread is gone")


def wait_notified(conn: psycopg.Connection, timeout: float) -> int:
    """Wait up to TIMEOUT for a notification on CONN; returns how many were received, counting those that came
    while the consumer was busy (psycopg keeps them: each would otherwise end a later wait at once)."""
    received = sum(1 for _ in conn.notifies(timeout=timeout, stop_after=1))
    return received + sum(1 for _ in conn.notifies(timeout=0))


def wait_drained(conn: psycopg.Connection, broker: DrainingBroker, timeout: float = 30.0) -> None:
    """Wait until the outbox of the broker's lease is empty."""
    deadline = time.monotonic() + timeout
    while True:
        broker.check()
        left = conn.execute("SELECT count(*) FROM pgbroker.outbox WHERE name = %s", (broker.lease,)).fetchone()[0]
        if left == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{left} outbox rows still pending after {timeout} s")
        time.sleep(0.01)


# ---------------------------------------------------------------------------
# Comparison variants: what users write instead of pgbroker (issue 22's table), each on its own copy of the
# 1,000-row table with 10 subscribers per row and its own consumer, which drains as DrainingBroker does (same
# batch size, linger, batch delay and poll).  Kept small on purpose: none has pgbroker's guarantees (gap-free
# subscribe, exact wake-ups at every isolation level, changed columns, several brokers, epochs, bulk paths).


def subscribers_of(row: int) -> list[str]:
    """The clients subscribed to ROW in every variant: client k has rows (10k + j) % 1000 + 1, j < 10."""
    return [f"c{k}" for k in range(1000) for j in range(10) if (k * 10 + j) % 1000 + 1 == row]


class Consumer(threading.Thread):
    """A comparison variant's consumer: FETCH takes a batch off its queue (returns how many changes), after which
    it sleeps on LISTEN CHANNEL, or for POLL when it has none (a polled queue)."""

    channel: str | None = None
    fetch_sql = ""

    def __init__(self, url: str, label: str):
        super().__init__(name=label, daemon=True)
        self.label = label
        self.conn = psycopg.connect(url, autocommit=True)
        self.backend_pid = self.conn.info.backend_pid
        self.subs = {row: subscribers_of(row) for row in range(1, 1001)}  # for consumers that resolve clients
        self.delivered = 0
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            if self.channel:
                self.conn.execute(f"LISTEN {self.channel}")
            while not self._halt.is_set():
                self.drain()
                if self.going_to_sleep():
                    self.sleep()
        except BaseException as exc:  # reported by check()
            self.error = exc

    def fetch(self) -> int:
        rows = self.conn.execute(self.fetch_sql, prepare=True).fetchall()
        told = [(key, self.subs[key]) for (key,) in rows]  # clients resolved by the consumer
        return len(told)

    def drain(self) -> None:
        empty_since: float | None = None
        while not self._halt.is_set():
            n = self.fetch()
            if n:
                self.delivered += n
                empty_since = None
                if n < 1000:
                    time.sleep(BATCH_DELAY)
                continue
            now = time.perf_counter()
            if empty_since is None:
                empty_since = now
            elif now - empty_since >= LINGER:
                return
            time.sleep(0.001)

    def going_to_sleep(self) -> bool:
        return True

    def sleep(self) -> None:
        if self.channel:
            wait_notified(self.conn, POLL)
        else:
            self._halt.wait(POLL)

    def pending(self, conn: psycopg.Connection) -> int:
        return 0

    def check(self) -> None:
        if self.error is not None or not self.is_alive():
            raise RuntimeError(f"consumer {self.label} failed") from self.error

    def stop(self) -> None:
        self._halt.set()
        self.join(POLL + 10)
        self.conn.close()
        if self.error is not None or self.is_alive():
            raise RuntimeError(f"consumer {self.label} failed or did not stop") from self.error


class ClientListConsumer(Consumer):
    """(a) "A trigger writes the list of clients to a table, then NOTIFY": a logged row per client, a NOTIFY
    per transaction; the consumer deletes what it reads."""

    channel = "bench_peer_a"
    fetch_sql = (
        "DELETE FROM bench.peer_a_note WHERE id = ANY (ARRAY(SELECT id FROM bench.peer_a_note ORDER BY id LIMIT 1000"
        " FOR UPDATE SKIP LOCKED)) RETURNING object_id, client_id"
    )
    setup = """
        CREATE TABLE bench.peer_a_subs (object_id bigint, client_id text, PRIMARY KEY (object_id, client_id));
        INSERT INTO bench.peer_a_subs
        SELECT mod(k * 10 + j, 1000) + 1, 'c' || k FROM generate_series(0, 999) k, generate_series(0, 9) j;
        CREATE TABLE bench.peer_a_note (id bigserial PRIMARY KEY, object_id bigint NOT NULL, client_id text NOT NULL);
        CREATE FUNCTION bench.peer_a() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO bench.peer_a_note (object_id, client_id)
            SELECT NEW.id, s.client_id FROM bench.peer_a_subs s WHERE s.object_id = NEW.id;
            IF FOUND THEN
                PERFORM pg_notify('bench_peer_a', NEW.id::text);
            END IF;
            RETURN NULL;
        END $$;
        CREATE TRIGGER peer_a AFTER UPDATE ON bench.peer_a FOR EACH ROW EXECUTE FUNCTION bench.peer_a();
    """

    def fetch(self) -> int:
        rows = self.conn.execute(self.fetch_sql, prepare=True).fetchall()
        told: dict[int, list[str]] = {}
        for key, client in rows:
            told.setdefault(key, []).append(client)
        return len(told)

    def pending(self, conn: psycopg.Connection) -> int:
        return conn.execute("SELECT count(*) FROM bench.peer_a_note").fetchone()[0]


class NotifyJsonConsumer(Consumer):
    """(b) A row trigger sending pg_notify(channel, json) per change; the listener resolves the clients."""

    channel = "bench_peer_b"
    setup = """
        CREATE FUNCTION bench.peer_b() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('bench_peer_b', json_build_object('id', NEW.id, 'op', TG_OP)::text);
            RETURN NULL;
        END $$;
        CREATE TRIGGER peer_b AFTER UPDATE ON bench.peer_b FOR EACH ROW EXECUTE FUNCTION bench.peer_b();
    """

    last = 0.0

    def drain(self) -> None:
        for n in self.conn.notifies(timeout=POLL):
            self.delivered += bool(self.subs[json.loads(n.payload)["id"]])
            self.last = time.monotonic()
            if self._halt.is_set():
                return

    def sleep(self) -> None:
        pass

    def pending(self, conn: psycopg.Connection) -> int:
        return int(time.monotonic() - self.last < 0.1)  # (caught up: nothing came for 100 ms)


class OutboxConsumer(Consumer):
    """(c) Transactional outbox: a row trigger inserts one logged row with to_jsonb(NEW); the consumer polls it
    and resolves the clients."""

    fetch_sql = (
        "DELETE FROM bench.peer_c_outbox WHERE id = ANY (ARRAY(SELECT id FROM bench.peer_c_outbox ORDER BY id"
        " LIMIT 1000 FOR UPDATE SKIP LOCKED)) RETURNING payload"
    )
    setup = """
        CREATE TABLE bench.peer_c_outbox (id bigserial PRIMARY KEY, payload jsonb NOT NULL);
        CREATE FUNCTION bench.peer_c() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO bench.peer_c_outbox (payload) VALUES (to_jsonb(NEW));
            RETURN NULL;
        END $$;
        CREATE TRIGGER peer_c AFTER UPDATE ON bench.peer_c FOR EACH ROW EXECUTE FUNCTION bench.peer_c();
    """

    def fetch(self) -> int:
        rows = self.conn.execute(self.fetch_sql, prepare=True).fetchall()
        told = [(payload["id"], self.subs[payload["id"]]) for (payload,) in rows]
        return len(told)

    def pending(self, conn: psycopg.Connection) -> int:
        return conn.execute("SELECT count(*) FROM bench.peer_c_outbox").fetchone()[0]


class PrototypeConsumer(Consumer):
    """(d) The throwaway prototype of ../shared/reference/fanout-prototype.md: a row trigger copies a precomputed
    client array into an UNLOGGED outbox and notifies a consumer whose "sleeping" flag it reads."""

    channel = "bench_peer_d"
    fetch_sql = (
        "DELETE FROM bench.peer_d_outbox WHERE ctid = ANY (ARRAY(SELECT ctid FROM bench.peer_d_outbox ORDER BY id"
        " LIMIT 1000 FOR UPDATE SKIP LOCKED)) RETURNING object_id, client_ids"
    )
    setup = """
        CREATE TABLE bench.peer_d_agg (object_id bigint PRIMARY KEY, client_ids int[] NOT NULL);
        INSERT INTO bench.peer_d_agg SELECT mod(k * 10 + j, 1000) + 1, array_agg(k)
          FROM generate_series(0, 999) k, generate_series(0, 9) j GROUP BY 1;
        CREATE UNLOGGED TABLE bench.peer_d_outbox (id bigserial PRIMARY KEY, object_id bigint NOT NULL,
            version bigint NOT NULL, client_ids int[] NOT NULL, created_at timestamptz NOT NULL DEFAULT now());
        CREATE TABLE bench.peer_d_state (k text PRIMARY KEY, sleeping boolean NOT NULL);
        INSERT INTO bench.peer_d_state VALUES ('fl', false);
        CREATE FUNCTION bench.peer_d() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO bench.peer_d_outbox (object_id, version, client_ids)
            SELECT NEW.id, NEW.val, a.client_ids FROM bench.peer_d_agg a WHERE a.object_id = NEW.id;
            PERFORM pg_advisory_xact_lock_shared(4242);
            IF coalesce((SELECT sleeping FROM bench.peer_d_state WHERE k = 'fl'), true) THEN
                PERFORM pg_notify('bench_peer_d', '');
            END IF;
            RETURN NULL;
        END $$;
        CREATE TRIGGER peer_d AFTER UPDATE ON bench.peer_d FOR EACH ROW EXECUTE FUNCTION bench.peer_d();
    """

    def fetch(self) -> int:
        rows = self.conn.execute(self.fetch_sql, prepare=True).fetchall()
        told: dict[int, list[int]] = {}
        for key, clients in rows:
            told.setdefault(key, []).extend(clients)
        return len(rows)

    def going_to_sleep(self) -> bool:
        with self.conn.transaction():  # flag set, then wait for writers that read it unset
            self.conn.execute("UPDATE bench.peer_d_state SET sleeping = true WHERE k = 'fl'")
            self.conn.execute("SELECT pg_advisory_xact_lock(4242)")
        if self.conn.execute("SELECT EXISTS (SELECT FROM bench.peer_d_outbox)").fetchone()[0]:
            self.conn.execute("UPDATE bench.peer_d_state SET sleeping = false WHERE k = 'fl'")
            return False
        return True

    def sleep(self) -> None:
        super().sleep()
        self.conn.execute("UPDATE bench.peer_d_state SET sleeping = false WHERE k = 'fl'")

    def pending(self, conn: psycopg.Connection) -> int:
        return conn.execute("SELECT count(*) FROM bench.peer_d_outbox").fetchone()[0]


PEERS: dict[str, type[Consumer]] = {
    "peer_a": ClientListConsumer,
    "peer_b": NotifyJsonConsumer,
    "peer_c": OutboxConsumer,
    "peer_d": PrototypeConsumer,
}
LABELS = {
    "plain": "unwatched",
    "statement": "pgbroker, statement mode",
    "row": "pgbroker, row mode",
    "peer_a": "peer a: trigger writes the client list, then NOTIFY",
    "peer_b": "peer b: pg_notify(json) per row",
    "peer_c": "peer c: transactional outbox",
    "peer_d": "peer d: the throwaway prototype",
}


def settle(
    conn: psycopg.Connection, consumer: Consumer | None, broker: DrainingBroker, results: Results, what: str
) -> None:
    """Wait for CONSUMER's queue (None: the broker's outbox) to empty; one that is still behind after the wait is
    noted and left to catch up (on many cores a consumer can fall hundreds of thousands of changes behind)."""
    try:
        if consumer:
            wait_consumed(conn, consumer)
        else:
            wait_drained(conn, broker)
    except TimeoutError as exc:
        results.note(f"{what}: the consumer fell behind ({exc})")
        print(f"   {what}: the consumer fell behind ({exc})", flush=True)


def wait_consumed(conn: psycopg.Connection, consumer: Consumer, timeout: float = 30.0) -> None:
    """Wait until a comparison variant's queue is empty."""
    deadline = time.monotonic() + timeout
    while consumer.pending(conn):
        consumer.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{consumer.label}: {consumer.pending(conn)} changes still pending after {timeout} s")
        time.sleep(0.01)


# ---------------------------------------------------------------------------
# Set-up helpers.


def make_table(conn: psycopg.Connection, table: str, rows: int) -> None:
    conn.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, val integer NOT NULL DEFAULT 0, payload text)")
    conn.execute(
        f"INSERT INTO {table} (id, val, payload) SELECT g, 0, md5(g::text) || md5((g + 1)::text)"
        " FROM generate_series(1, %s) g",
        (rows,),
    )


def register_clients(conn: psycopg.Connection, lease: str, epoch: int, prefix: str, first: int, last: int) -> float:
    """Register clients prefix||first .. prefix||last with the API (from another session, with the epoch)."""
    start = time.perf_counter()
    batch = 2000
    for lo in range(first, last + 1, batch):
        hi = min(last, lo + batch - 1)
        with conn.transaction():
            n = conn.execute(
                "SELECT count(*) FILTER (WHERE r) FROM generate_series(%s::int, %s::int) g,"
                " LATERAL pgbroker.client_register(%s || g, jsonb_build_object('n', g), %s, %s) r",
                (lo, hi, prefix, lease, epoch),
            ).fetchone()[0]
        assert n == hi - lo + 1, (n, lo, hi)
    return time.perf_counter() - start


def subscribe_all(conn: psycopg.Connection, lease: str, epoch: int, table: str, pairs_sql: str,
                  ranges: Sequence[tuple[int, int]]) -> tuple[int, float]:  # fmt: skip
    """Subscribe with the API, one transaction per range: pairs_sql(lo, hi) yields (client_id text, row_id bigint)."""
    start = time.perf_counter()
    total = 0
    for lo, hi in ranges:
        with conn.transaction():
            total += conn.execute(
                f"SELECT count(*) FILTER (WHERE s) FROM ({pairs_sql}) p(client_id, row_id),"
                f" LATERAL pgbroker.subscribe(p.client_id, %s::regclass, to_jsonb(p.row_id), %s, %s) s",
                (lo, hi, table, lease, epoch),
            ).fetchone()[0]
    return total, time.perf_counter() - start


def split(first: int, last: int, parts: int) -> list[tuple[int, int]]:
    step = -(-(last - first + 1) // parts)
    return [(lo, min(last, lo + step - 1)) for lo in range(first, last + 1, step)]


_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int, children: bool = False) -> float:
    """CPU seconds (user + system) of process PID, with its reaped children's when CHILDREN."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12]) + ((int(fields[13]) + int(fields[14])) if children else 0)
    return ticks / _TICK


def server_cpu(datadir: Path) -> float:
    """CPU seconds of a PostgreSQL server: the postmaster, its live children, and the children it reaped
    (backends of connections that closed, such as pgbench's)."""
    postmaster = int((datadir / "postmaster.pid").read_text().split()[0])
    total = _proc_cpu(postmaster, children=True)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == postmaster:
                    total += _proc_cpu(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile: its time is in the postmaster's reaped children now
    return total


def vacuum(conn: psycopg.Connection, *tables: str) -> None:
    conn.execute(f"VACUUM {', '.join(tables)}")


# ---------------------------------------------------------------------------
# pgbench


def _pgbench() -> str | None:
    beside = find_pg_bin() / "pgbench"
    return str(beside) if beside.exists() else shutil.which("pgbench")


class PgBench:
    def __init__(self, server: EmbeddedPostgres, dbname: str, tmp: Path):
        exe = _pgbench()
        if exe is None:
            raise FileNotFoundError("pgbench not found (install postgresql-contrib / the server package)")
        self.exe = exe
        self.server = server
        self.dbname = dbname
        self.tmp = tmp
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}

    def tps(self, name: str, script: str, clients: int, seconds: float) -> float:
        path = self.tmp / f"{name}.sql"
        path.write_text(script)
        server = ["-h", self.server.host, "-p", str(self.server.port), "-U", "postgres", self.dbname]
        duration = str(max(1, round(seconds)))
        cmd = [self.exe, "-n", "-c", str(clients), "-j", str(clients), "-T", duration, "-f", str(path), *server]
        out = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=seconds + 60)
        match = re.search(r"tps = ([0-9.]+)", out.stdout)
        if out.returncode != 0 or match is None:
            raise RuntimeError(f"pgbench failed ({name}):\n{out.stdout}\n{out.stderr}")
        return float(match.group(1))


def update_script(table: str, rows: int) -> str:
    return f"\\set id random(1, {rows})\nUPDATE {table} SET val = val + 1 WHERE id = :id;\n"


# ---------------------------------------------------------------------------
# 1. UPDATE throughput: unwatched, pgbroker's two modes and the comparison variants, each with its consumer.

VARIANTS = ("plain", "statement", "row", *PEERS)
TABLES = {"plain": "bench.plain", "statement": "bench.watched", "row": "bench.watched_row"} | {
    p: f"bench.{p}" for p in PEERS
}


def _cpu_now(server: EmbeddedPostgres, consumer_pid: int | None) -> tuple[float, float, float]:
    """(server CPU, this process's CPU, the consumer backend's CPU), in seconds."""
    return server_cpu(server.datadir), time.process_time(), _proc_cpu(consumer_pid) if consumer_pid else 0.0


def _sample_waits(url: str, stop: threading.Event, into: Counter[str]) -> None:
    """Sample the wait events of pgbench's backends every 10 ms until STOP (a running backend counts as CPU)."""
    with psycopg.connect(url, autocommit=True) as conn:
        while not stop.is_set():
            for event_type, event in conn.execute(
                "SELECT wait_event_type, wait_event FROM pg_stat_activity"
                " WHERE application_name = 'pgbench' AND state = 'active'"
            ):
                into[f"{event_type}:{event}" if event_type else "CPU"] += 1
            stop.wait(0.01)


def bench_throughput(
    url: str,
    conn: psycopg.Connection,
    broker: DrainingBroker,
    consumers: dict[str, Consumer],
    pgbench: PgBench,
    cfg: Settings,
    results: Results,
) -> None:
    print("1. UPDATE throughput, 1,000 rows, 10 subscribers per row, each design with its consumer", flush=True)
    server = pgbench.server
    for writers in cfg.writers:
        s = "s" if writers > 1 else ""
        tps: dict[str, list[float]] = {k: [] for k in VARIANTS}
        cpu: dict[str, list[float]] = {k: [] for k in VARIANTS}  # CPU seconds per transaction
        consumer_cpu: dict[str, list[float]] = {k: [] for k in VARIANTS}  # of that, the consumer's backend and loop
        fetch_cpu: list[float] = []  # broker backend CPU seconds per delivered row
        counts: Counter[str] = Counter()
        transactions = 0.0
        for r in range(cfg.tps_rounds):
            for variant in VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]:
                vacuum(conn, *TABLES.values(), "pgbroker.outbox")
                consumer = consumers.get(variant)
                pid = consumer.backend_pid if consumer else broker.backend_pid if variant != "plain" else None
                before = broker.counters()
                cpu0 = _cpu_now(server, pid)
                script = update_script(TABLES[variant], 1000)
                value = pgbench.tps(f"{variant}{writers}", script, writers, cfg.tps_seconds)
                # pgbench's backends exit after it does: count their CPU once the postmaster has reaped them, and
                # the consumer's once it has caught up.
                deadline = time.monotonic() + 10
                while (
                    time.monotonic() < deadline
                    and conn.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pgbench'"
                    ).fetchone()[0]
                ):
                    time.sleep(0.01)
                settle(conn, consumer, broker, results, f"{writers} writer{s} {variant}")
                time.sleep(0.05)
                cpu1 = _cpu_now(server, pid)
                txns = max(value * cfg.tps_seconds, 1)
                tps[variant].append(value)
                # Server processes (writers' backends, consumers' backends) plus this process (the consumers' loops).
                cpu[variant].append((cpu1[0] - cpu0[0] + cpu1[1] - cpu0[1]) / txns)
                consumer_cpu[variant].append((cpu1[2] - cpu0[2] + cpu1[1] - cpu0[1]) / txns)
                after = broker.counters()
                if variant in ("statement", "row"):
                    if after["delivered"] > before["delivered"]:
                        fetch_cpu.append((cpu1[2] - cpu0[2]) / (after["delivered"] - before["delivered"]))
                    counts.update({k: after[k] - before[k] for k in after})
                    transactions += txns
                print(f"   {writers} writer{s} {variant:10s} {value:8.0f} tps", flush=True)
        med = {k: statistics.median(tps[k]) for k in VARIANTS}
        med_cpu = {k: statistics.median(cpu[k]) for k in VARIANTS}
        for variant in VARIANTS[1:]:
            label = LABELS[variant]
            ratio = med[variant] / med["plain"]
            results.figures[f"tps_ratio_{writers}_{variant}"] = ratio
            target = f">= {TPS_TARGET}x {_verdict(ratio >= TPS_TARGET)}" if variant == "statement" else "(info)"
            results.add(
                f"UPDATE tps, {writers} writer{s}: {label}",
                f"{med[variant]:,.0f} tps",
                f"{med['plain']:,.0f} tps",
                f"{ratio:.2f}x",
                target,
            )
            ratio = med_cpu[variant] / med_cpu["plain"]
            results.figures[f"cpu_ratio_{writers}_{variant}"] = ratio
            target = f"<= {CPU_TARGET}x {_verdict(ratio <= CPU_TARGET)}" if variant == "statement" else "(info)"
            results.add(
                f"  CPU per transaction, {writers} writer{s}: {label}",
                f"{med_cpu[variant] * 1e6:,.0f} us",
                f"{med_cpu['plain'] * 1e6:,.0f} us",
                f"{ratio:.2f}x",
                target,
            )
        results.figures[f"tps_ratio_{writers}"] = results.figures[f"tps_ratio_{writers}_statement"]
        # Issue 22's targets: row mode against the transactional outbox, the design it competes with.
        ratio = med["row"] / med["peer_c"]
        target = f">= {PEER_TPS_TARGET}x {_verdict(ratio >= PEER_TPS_TARGET)}"
        results.add(
            f"row mode vs transactional outbox, tps, {writers} writer{s}",
            f"{med['row']:,.0f} tps",
            f"{med['peer_c']:,.0f} tps",
            f"{ratio:.2f}x",
            target,
        )
        ratio = med_cpu["row"] / med_cpu["peer_c"]
        target = f"<= {PEER_CPU_TARGET}x {_verdict(ratio <= PEER_CPU_TARGET)}"
        results.add(
            f"row mode vs transactional outbox, CPU per transaction, {writers} writer{s}",
            f"{med_cpu['row'] * 1e6:,.0f} us",
            f"{med_cpu['peer_c'] * 1e6:,.0f} us",
            f"{ratio:.2f}x",
            target,
        )
        if fetch_cpu:
            per_row = statistics.median(fetch_cpu) * 1e6
            results.add(
                f"  broker backend CPU per delivered row, {writers} writer{s}",
                f"{per_row:,.1f} us",
                "",
                "",
                f"<= {FETCH_CPU_TARGET_US} us {_verdict(per_row <= FETCH_CPU_TARGET_US)}",
            )
        seconds = cfg.tps_seconds * cfg.tps_rounds * 2
        results.add(
            f"  NOTIFYs received while draining, {writers} writer{s}",
            f"{counts['notifies']:,} ({counts['notifies'] / seconds:,.1f}/s)",
            f"~{transactions:,.0f} txns",
            f"{counts['notifies'] / max(transactions, 1):.4f}/txn",
            "<< 1/txn",
        )
        results.note(
            f"{writers} writer{s}, CPU per transaction in the consumer (its backend and its loop), unwatched"
            f" {statistics.median(cpu['plain']) * 1e6:,.0f} us in all: "
            + "; ".join(f"{k} {statistics.median(consumer_cpu[k]) * 1e6:,.0f} us" for k in VARIANTS[1:])
        )
        results.note(
            f"{writers} writer{s}, tps per round: "
            + "; ".join(f"{k} {', '.join(f'{v:,.0f}' for v in vals)}" for k, vals in tps.items())
        )
        results.note(
            f"{writers} writer{s}, pgbroker's runs: delivered {counts['delivered']:,} outbox rows in"
            f" {counts['fetches']:,} fetches ({counts['delivered'] / max(counts['fetches'], 1):.1f} rows/fetch);"
            f" {counts['wakes']:,} wakes, sleeps asleep/pending/busy {counts['asleep']:,}/{counts['pending']:,}"
            f"/{counts['busy']:,}, poll timeouts {counts['timeouts']:,}"
        )
    # What the writers wait for at the largest writer count (one more run of each, sampled: the sampling costs CPU
    # of its own).
    writers = cfg.writers[-1]
    for variant in ("plain", "statement", "row", "peer_c", "peer_d"):
        waits: Counter[str] = Counter()
        stop = threading.Event()
        sampler = threading.Thread(target=_sample_waits, args=(url, stop, waits))
        sampler.start()
        try:
            pgbench.tps(f"waits_{variant}", update_script(TABLES[variant], 1000), writers, cfg.tps_seconds)
        finally:
            stop.set()
            sampler.join(10)
        settle(conn, consumers.get(variant), broker, results, f"{writers} writers {variant}, sampled")
        total = max(sum(waits.values()), 1)
        results.note(
            f"{writers} writers, {LABELS[variant]}: what active writer backends were doing"
            f" (share of {total:,} samples): " + ", ".join(f"{k} {v / total:.1%}" for k, v in waits.most_common(6))
        )


# ---------------------------------------------------------------------------
# 2. One 10,000-row UPDATE statement.

BULK_ROWS = 10_000


def _timed_statement(conn: psycopg.Connection, sql: str) -> tuple[float, int]:
    """Run one statement in its own transaction; seconds for the statement alone (not the commit), rowcount."""
    with conn.transaction():
        start = time.perf_counter()
        cur = conn.execute(sql)
        elapsed = time.perf_counter() - start
    return elapsed, cur.rowcount


def bench_bulk(conn: psycopg.Connection, broker: DrainingBroker, watch_ids: dict[str, int], cfg: Settings,
               results: Results) -> None:  # fmt: skip
    print("2. one 10,000-row UPDATE statement", flush=True)
    floor_sql = (
        "INSERT INTO bench.floor_outbox (name, epoch, watch_id, op, row_key, changed, clients)"
        f" SELECT '{BROKER}', {broker.epoch}, {watch_ids['bench.bulk_dense']}, 'U', to_jsonb(b.id), ARRAY['val'],"
        " ARRAY['c' || mod(b.id, 1000)] FROM bench.bulk_plain b"
    )
    variants = {
        "plain": ("UPDATE bench.bulk_plain SET val = val + 1", "bench.bulk_plain", 0),
        "sparse": ("UPDATE bench.bulk_sparse SET val = val + 1", "bench.bulk_sparse", BULK_ROWS // 100),
        "dense": ("UPDATE bench.bulk_dense SET val = val + 1", "bench.bulk_dense", BULK_ROWS),
        "floor": (floor_sql, "bench.floor_outbox", None),
        "sparse_row": ("UPDATE bench.bulk_sparse_row SET val = val + 1", "bench.bulk_sparse_row", BULK_ROWS // 100),
        "dense_row": ("UPDATE bench.bulk_dense_row SET val = val + 1", "bench.bulk_dense_row", BULK_ROWS),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for rep in range(cfg.bulk_reps + 1):  # the first is a warm-up
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for key in order:
            sql, table, outbox_rows = variants[key]
            before = broker.delivered
            elapsed, rowcount = _timed_statement(conn, sql)
            assert rowcount == BULK_ROWS, (key, rowcount)
            if key == "floor":
                conn.execute("DELETE FROM bench.floor_outbox")
            else:
                wait_drained(conn, broker)
                got = broker.delivered - before
                assert got == outbox_rows, f"{key}: {got} outbox rows delivered, expected {outbox_rows}"
            vacuum(conn, table, "pgbroker.outbox")
            if rep > 0:
                times[key].append(elapsed)
    med = {k: statistics.median(v) for k, v in times.items()}
    print("   medians: " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in med.items()), flush=True)
    ratio = med["sparse"] / med["plain"]
    results.figures["bulk_sparse_ratio"] = ratio
    results.add(
        "10k-row UPDATE, 1% rows subscribed",
        f"{med['sparse'] * 1000:.1f} ms",
        f"{med['plain'] * 1000:.1f} ms",
        f"{ratio:.2f}x",
        f"<= {BULK_TARGET}x {_verdict(ratio <= BULK_TARGET)}",
    )
    ratio = med["dense"] / med["plain"]
    results.add(
        "10k-row UPDATE, every row subscribed",
        f"{med['dense'] * 1000:.1f} ms",
        f"{med['plain'] * 1000:.1f} ms",
        f"{ratio:.2f}x",
        "(info)",
    )
    for key in ("sparse_row", "dense_row"):
        ratio = med[key] / med["plain"]
        results.figures[f"bulk_{key}_ratio"] = ratio
        results.add(
            f"10k-row UPDATE, {'1% of' if key == 'sparse_row' else 'every'} row subscribed, row mode",
            f"{med[key] * 1000:.1f} ms",
            f"{med['plain'] * 1000:.1f} ms",
            f"{ratio:.2f}x",
            "(info: statement mode is for bulk)",
        )
    per_row = (med["dense"] - med["plain"]) / BULK_ROWS
    floor_per_row = med["floor"] / BULK_ROWS
    ratio = per_row / floor_per_row
    results.figures["bulk_per_row_ratio"] = ratio
    results.add(
        "  cost per outbox row (dense-plain vs INSERT..SELECT)",
        f"{per_row * 1e6:.2f} us",
        f"{floor_per_row * 1e6:.2f} us",
        f"{ratio:.2f}x",
        f"<= {PER_ROW_TARGET}x {_verdict(ratio <= PER_ROW_TARGET)}",
    )


HUGE_ROWS = 100_000


def bench_huge(conn: psycopg.Connection, broker: DrainingBroker, cfg: Settings, results: Results) -> None:
    jit = conn.execute("SELECT current_setting('jit')::boolean AND pg_jit_available()").fetchone()[0]
    print(f"2b. one 100,000-row UPDATE statement, 1% of rows subscribed (JIT {'on' if jit else 'unavailable'})",
          flush=True)  # fmt: skip
    variants = {
        "plain": ("UPDATE bench.huge_plain SET val = val + 1", "bench.huge_plain", 0),
        "sparse": ("UPDATE bench.huge_sparse SET val = val + 1", "bench.huge_sparse", HUGE_ROWS // 100),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for rep in range(cfg.huge_reps + 1):  # the first is a warm-up
        for key in list(variants)[:: 1 if rep % 2 else -1]:
            sql, table, outbox_rows = variants[key]
            before = broker.delivered
            elapsed, rowcount = _timed_statement(conn, sql)
            assert rowcount == HUGE_ROWS, (key, rowcount)
            wait_drained(conn, broker)
            assert broker.delivered - before == outbox_rows, key
            vacuum(conn, table, "pgbroker.outbox")
            if rep > 0:
                times[key].append(elapsed)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["sparse"] / med["plain"]
    results.figures["huge_sparse_ratio"] = ratio
    results.add(
        f"100k-row UPDATE, 1% rows subscribed (JIT {'on' if jit else 'n/a'})",
        f"{med['sparse'] * 1000:.1f} ms",
        f"{med['plain'] * 1000:.1f} ms",
        f"{ratio:.2f}x",
        "(info)",
    )


# ---------------------------------------------------------------------------
# 3. Commit-to-handler latency.


def bench_latency(url: str, conn: psycopg.Connection, broker: DrainingBroker, cfg: Settings, results: Results) -> None:
    print(f"3. commit-to-handler latency, {cfg.latency_rate:.0f} writes/s for {cfg.latency_seconds:.0f} s", flush=True)
    count = min(1000, round(cfg.latency_rate * cfg.latency_seconds))
    modes = {"statement": "bench.watched", "row": "bench.watched_row"}
    committed: dict[str, dict[int, float]] = {m: {} for m in modes}
    seen: dict[str, dict[int, float]] = {t: {} for t in modes.values()}
    floor_committed: dict[int, float] = {}
    floor_seen: dict[int, float] = {}

    def on_rows(rows: list[tuple[Any, ...]], now: float) -> None:
        for row in rows:  # id, table, op, key, changed, clients, at
            if row[1] in seen and row[2] == "U":
                seen[row[1]].setdefault(int(row[3]), now)

    # The Python Broker (pgbroker.broker.Broker.notifications(), when it exists) on its own lease "py",
    # whose one client is subscribed to the same rows: every write reaches both brokers.
    api_seen: dict[int, float] = {}
    api = _start_api_consumer(url, count, api_seen)

    listener = psycopg.connect(url, autocommit=True)
    listener.execute("LISTEN bench_floor")
    listening = threading.Event()
    stop = threading.Event()

    def listen() -> None:
        listening.set()
        while not stop.is_set() and len(floor_seen) < count:
            for n in listener.notifies(timeout=0.2):
                floor_seen.setdefault(int(n.payload), time.perf_counter())

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    listening.wait(5)
    wait_drained(conn, broker)
    before = broker.counters()
    broker.on_rows = on_rows
    period = 1.0 / cfg.latency_rate
    try:
        with psycopg.connect(url, autocommit=True) as writer, psycopg.connect(url) as floor_writer:
            next_at = time.perf_counter()
            for i in range(count):
                key = i + 1
                # pgbroker, in each mode: an autocommit UPDATE of a row with 10 subscribers.
                for mode, table in modes.items():
                    writer.execute(f"UPDATE {table} SET val = val + 1 WHERE id = %s", (key,))
                    committed[mode][key] = time.perf_counter()
                    time.sleep(period / 3)
                # Floor: the same UPDATE on the unwatched table plus a NOTIFY, one transaction.
                floor_writer.execute("UPDATE bench.plain SET val = val + 1 WHERE id = %s", (key,))
                floor_writer.execute("SELECT pg_notify('bench_floor', %s)", (str(key),))
                floor_writer.commit()
                floor_committed[key] = time.perf_counter()
                next_at += period
                time.sleep(max(0.0, next_at - time.perf_counter()))
        deadline = time.monotonic() + 5
        while (
            min(map(len, seen.values())) < count or len(floor_seen) < count or (api and len(api_seen) < count)
        ) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        if api is not None:
            api()
        broker.on_rows = None
        stop.set()
        thread.join(5)
        listener.close()
    after = broker.counters()
    if min(map(len, seen.values())) < count or len(floor_seen) < count:
        got = ", ".join(f"{t} {len(v)}" for t, v in seen.items())
        raise RuntimeError(f"latency: broker saw {got} of {count}, floor listener {len(floor_seen)}/{count}")
    floor = [(floor_seen[k] - floor_committed[k]) * 1000 for k in floor_committed]
    negative = 0
    for mode, table in modes.items():
        ours = [(seen[table][k] - committed[mode][k]) * 1000 for k in committed[mode]]
        negative += sum(1 for v in ours if v < 0)
        for label, q in (("p50", 0.5), ("p99", 0.99), ("max", 1.0)):
            a, b = _percentile(ours, q), _percentile(floor, q)
            results.figures[f"latency_{label}_ms" if mode == "statement" else f"latency_{mode}_{label}_ms"] = a
            target = ""
            if label == "p99":
                target = f"< {LATENCY_P99_TARGET_MS:.0f} ms {_verdict(a < LATENCY_P99_TARGET_MS)}"
            results.add(
                f"commit-to-handler latency {label} (n={count}), {mode} mode",
                f"{a:.2f} ms",
                f"{b:.2f} ms",
                f"{a / b:.2f}x" if b > 0 else "-",
                target,
            )
    if api is not None:
        if len(api_seen) < count:
            raise RuntimeError(f"latency: Broker.notifications() saw {len(api_seen)}/{count}")
        via_api = [(api_seen[k] - committed["statement"][k]) * 1000 for k in committed["statement"]]
        for label, q in (("p50", 0.5), ("p99", 0.99)):
            a, b = _percentile(via_api, q), _percentile(floor, q)
            results.figures[f"latency_api_{label}_ms"] = a
            target = f"< {LATENCY_P99_TARGET_MS:.0f} ms {_verdict(a < LATENCY_P99_TARGET_MS)}" if label == "p99" else ""
            results.add(
                f"  same via Broker.notifications() {label}, statement mode",
                f"{a:.2f} ms",
                f"{b:.2f} ms",
                f"{a / b:.2f}x" if b > 0 else "-",
                target,
            )
    results.note(
        f"latency run: {after['notifies'] - before['notifies']} NOTIFYs received and"
        f" {after['timeouts'] - before['timeouts']} poll timeouts for {2 * count} writes (an idle broker is woken by"
        " each);"
        f" {negative} samples negative (handler ran before the writer's commit call returned)"
    )


def _start_api_consumer(url: str, count: int, seen: dict[int, float]) -> Callable[[], None] | None:
    """Consume lease "py" with pgbroker.broker.Broker.notifications() in a thread; returns a stop function."""
    try:
        from pgbroker.broker import Broker
    except ImportError:
        return None
    if not hasattr(Broker, "notifications"):
        return None
    broker = Broker(url, name="py")
    broker.claim()
    broker.register("py-client")
    with psycopg.connect(url, autocommit=True) as conn:
        epoch = broker.epoch
        pairs = "SELECT 'py-client', g FROM generate_series(%s::int, %s::int) g"
        subscribe_all(conn, "py", epoch, "bench.watched", pairs, [(1, count)])
    stop = threading.Event()
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            for batch in broker.notifications(poll_interval=POLL, linger=LINGER):
                now = time.perf_counter()
                for n in batch:
                    if n.table == "bench.watched" and n.op == "U":
                        seen.setdefault(int(n.key), now)
                if stop.is_set() or len(seen) >= count:
                    break
        except BaseException as exc:  # reported by stop
            errors.append(exc)

    thread = threading.Thread(target=consume, name="broker-py", daemon=True)
    thread.start()

    def finish() -> None:
        stop.set()
        thread.join(POLL + 5)
        broker.close()
        if errors:
            raise RuntimeError("Broker.notifications() failed") from errors[0]

    return finish


# ---------------------------------------------------------------------------
# 4. Scale: cost of a single-row update with few vs many clients.

SCALE_ROWS = 100_000


def _statement_latencies(conn: psycopg.Connection, tables: Sequence[str], n: int) -> dict[str, list[float]]:
    """Seconds per single-row UPDATE statement, tables interleaved (each its own transaction, commit not timed)."""
    out: dict[str, list[float]] = {t: [] for t in tables}
    rng = random.Random(42)
    for _ in range(n):
        key = rng.randint(1, 1000)
        for table in tables:
            with conn.transaction():
                start = time.perf_counter()
                conn.execute(f"UPDATE {table} SET val = val + 1 WHERE id = %s", (key,))
                out[table].append(time.perf_counter() - start)
    return out


def bench_scale(url: str, conn: psycopg.Connection, pgbench: PgBench, cfg: Settings, results: Results) -> None:
    print("4. scale: 100 clients / 2,000 subscriptions vs 10,000 clients / 200,000 subscriptions", flush=True)
    broker = DrainingBroker(url, BROKER)  # a new epoch: the clients of parts 1-3 are invisible, then swept
    broker.start()
    try:
        while conn.execute("SELECT pgbroker.broker_sweep(%s)", (BROKER,)).fetchone()[0]:
            pass
        left = conn.execute(
            "SELECT count(*), count(s.*) FROM pgbroker.client c LEFT JOIN pgbroker.subscription s USING (client_key)"
            " WHERE c.name = %s",
            (BROKER,),
        ).fetchone()
        assert left == (0, 0), f"the sweep left clients/subscriptions of earlier epochs behind: {left}"
        vacuum(conn, "pgbroker.client", "pgbroker.subscription", "pgbroker.interest", "pgbroker.outbox")
        scripts = {"scale": update_script("bench.scale", 1000), "plain": update_script("bench.plain", 1000)}
        measured: dict[str, dict[str, float]] = {}
        for phase, first, last in (("small", 0, 99), ("large", 100, 9999)):
            seconds = register_clients(conn, BROKER, broker.epoch, "s", first, last)
            # Client k subscribes to 20 rows; the first 100 clients cover rows 1..1000 twice,
            # the others rows 1001..100000 twice: every subscribed row has two subscribers.
            pairs = (
                "SELECT 's' || k, CASE WHEN k < 100 THEN mod(k * 20 + j, 1000) + 1"
                " ELSE 1001 + mod((k - 100) * 20 + j, 99000) END"
                " FROM generate_series(%s::int, %s::int) k, generate_series(0, 19) j"
            )
            ranges = split(first, last, max(1, (last - first + 1) // 250))  # ~5,000 subscriptions per transaction
            subs, sub_seconds = subscribe_all(conn, BROKER, broker.epoch, "bench.scale", pairs, ranges)
            totals = conn.execute(
                "SELECT (SELECT count(*) FROM pgbroker.client), (SELECT count(*) FROM pgbroker.subscription),"
                " (SELECT count(*) FROM pgbroker.interest)"
            ).fetchone()
            results.note(
                f"{phase}: registered {last - first + 1:,} clients in {seconds:.1f} s, subscribed {subs:,} in"
                f" {sub_seconds:.1f} s ({subs / sub_seconds:,.0f}/s); now {totals[0]:,} clients,"
                f" {totals[1]:,} subscriptions, {totals[2]:,} interest rows (all brokers)"
            )
            vacuum(conn, "pgbroker.client", "pgbroker.subscription", "pgbroker.interest", "bench.scale")
            conn.execute("ANALYZE pgbroker.client, pgbroker.subscription, pgbroker.interest")
            conn.execute("CHECKPOINT")
            tables = ("bench.scale", "bench.plain")
            _statement_latencies(conn, tables, 50)  # warm-up
            lat = _statement_latencies(conn, tables, cfg.scale_statements)
            wait_drained(conn, broker)
            tps: dict[str, list[float]] = {"scale": [], "plain": []}
            for r in range(cfg.scale_rounds):
                for key in ("scale", "plain") if r % 2 == 0 else ("plain", "scale"):
                    vacuum(conn, "bench.scale", "bench.plain", "pgbroker.outbox")
                    tps[key].append(pgbench.tps(f"scale_{phase}_{key}", scripts[key], 1, cfg.scale_seconds))
                    wait_drained(conn, broker)
            stmt, stmt_plain = statistics.median(lat["bench.scale"]), statistics.median(lat["bench.plain"])
            tps_scale, tps_plain = statistics.fmean(tps["scale"]), statistics.fmean(tps["plain"])
            measured[phase] = {"stmt": stmt, "extra": stmt - stmt_plain, "tps": tps_scale, "rel": tps_scale / tps_plain}
            print(f"   {phase}: UPDATE statement p50 {stmt * 1000:.3f} ms (unwatched {stmt_plain * 1000:.3f} ms),"
                  f" {tps_scale:,.0f} tps at 1 writer (unwatched {tps_plain:,.0f})", flush=True)  # fmt: skip
        small, large = measured["small"], measured["large"]
        ratio = large["stmt"] / small["stmt"]
        results.figures["scale_stmt_ratio"] = ratio
        results.add(
            "single-row UPDATE p50, 10k vs 100 clients",
            f"{large['stmt'] * 1000:.3f} ms",
            f"{small['stmt'] * 1000:.3f} ms",
            f"{ratio:.2f}x",
            f"~1x (<= {SCALE_TARGET}x) {_verdict(ratio <= SCALE_TARGET)}",
        )
        results.add(
            "  its extra over the unwatched UPDATE",
            f"{large['extra'] * 1000:.3f} ms",
            f"{small['extra'] * 1000:.3f} ms",
            f"{large['extra'] / small['extra']:.2f}x" if small["extra"] > 0 else "-",
            "(info)",
        )
        ratio = large["rel"] / small["rel"]
        results.figures["scale_tps_ratio"] = ratio
        results.add(
            "UPDATE tps at 1 writer / unwatched tps, 10k vs 100",
            f"{large['rel']:.2f} ({large['tps']:,.0f} tps)",
            f"{small['rel']:.2f} ({small['tps']:,.0f} tps)",
            f"{ratio:.2f}x",
            f"~1x (>= {1 / SCALE_TARGET:.2f}x) {_verdict(ratio >= 1 / SCALE_TARGET)}",
        )
    finally:
        broker.stop()


# ---------------------------------------------------------------------------
# 5. What each guarantee of row mode costs (--only guarantees; diagnostic: the stripped triggers are not correct).

GUARANTEES = (  # (key, what is taken out, cumulatively), in this order
    ("every", "row mode, every guarantee"),
    ("definer", "without SECURITY DEFINER and its pinned search_path"),
    ("watchlock", "... and the watch try-lock (gap-free subscribe)"),
    ("isolation", "... and the isolation test (exact at REPEATABLE READ)"),
    ("whole", "... and the whole-table probe"),
    ("wakeup", "... and the drain lock and awake test (exact wake-up, nothing for a dead broker)"),
)


def strip_guarantees(conn: psycopg.Connection, watch_id: int, upto: int) -> None:
    """Replace the row-mode UPDATE trigger function of watch WATCH_ID with one without the first UPTO guarantees."""
    src = conn.execute("SELECT pg_get_functiondef(%s::regprocedure)", (f"pgbroker._watch_{watch_id}_upd()",))
    src = src.fetchone()[0]
    cuts = [
        (" SECURITY DEFINER\n", "\n"),
        (" SET search_path TO 'pg_catalog', 'pg_temp'\n", "\n"),
        (f"pg_try_advisory_xact_lock_shared(pgbroker._lock_class_watch(), {watch_id})", "true"),
        ("current_setting('transaction_isolation') = 'read committed'", "true"),
        (f"NOT EXISTS (SELECT FROM pgbroker.interest WHERE watch_id = {watch_id} AND row_key = 'null'::jsonb)", "true"),
    ][: {0: 0, 1: 2, 2: 3, 3: 4}.get(upto, 5)]
    for old, new in cuts:
        assert old in src, (old, src)
        src = src.replace(old, new, 1)
    if upto >= 5:  # the fast path's wake-up test: WHERE CASE ... END; of its INSERT
        start = src.index("WHERE CASE")
        src = src[:start] + ";" + src[src.index("END;", start) + 4 :]
    conn.execute(src)


def bench_guarantees(url: str, conn: psycopg.Connection, broker: DrainingBroker, outbox: Consumer, pgbench: PgBench,
                     cfg: Settings, results: Results) -> None:  # fmt: skip
    print("5. what each guarantee of row mode costs a single-row UPDATE", flush=True)
    tables = {key: f"bench.g_{key}" for key, _ in GUARANTEES}
    for n, (key, _) in enumerate(GUARANTEES):
        make_table(conn, tables[key], 1000)
        watch_id = conn.execute("SELECT pgbroker.watch(%s, mode => 'row')", (tables[key],)).fetchone()[0]
        subscribe_all(
            conn, BROKER, broker.epoch, tables[key],
            "SELECT 'c' || k, mod(k * 10 + j, 1000) + 1 FROM generate_series(%s::int, %s::int) k,"
            " generate_series(0, 9) j",
            [(0, 999)],
        )  # fmt: skip
        strip_guarantees(conn, watch_id, n)
    conn.execute("VACUUM ANALYZE")
    tables |= {"plain": TABLES["plain"], "peer_c": TABLES["peer_c"]}
    variants = ("plain", "peer_c", *(key for key, _ in GUARANTEES))
    server = pgbench.server
    for writers in (1, 8):
        s = "s" if writers > 1 else ""
        tps: dict[str, list[float]] = {k: [] for k in variants}
        cpu: dict[str, list[float]] = {k: [] for k in variants}
        for r in range(cfg.tps_rounds):
            for variant in variants[r % len(variants) :] + variants[: r % len(variants)]:
                vacuum(conn, *tables.values(), "pgbroker.outbox")
                pid = outbox.backend_pid if variant == "peer_c" else broker.backend_pid if variant != "plain" else None
                cpu0 = _cpu_now(server, pid)
                value = pgbench.tps(f"g_{variant}{writers}", update_script(tables[variant], 1000), writers,
                                    cfg.tps_seconds)  # fmt: skip
                deadline = time.monotonic() + 10
                while (
                    time.monotonic() < deadline
                    and conn.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pgbench'"
                    ).fetchone()[0]
                ):
                    time.sleep(0.01)
                if variant == "peer_c":
                    wait_consumed(conn, outbox)
                else:
                    wait_drained(conn, broker)
                time.sleep(0.05)
                cpu1 = _cpu_now(server, pid)
                tps[variant].append(value)
                cpu[variant].append((cpu1[0] - cpu0[0] + cpu1[1] - cpu0[1]) / max(value * cfg.tps_seconds, 1))
                print(f"   {writers} writer{s} {variant:10s} {value:8.0f} tps", flush=True)
        med = {k: statistics.median(tps[k]) for k in variants}
        med_cpu = {k: statistics.median(cpu[k]) * 1e6 for k in variants}
        previous = None
        for key, label in GUARANTEES:
            step = "" if previous is None else f"; this step {med_cpu[key] - med_cpu[previous]:+,.0f} us"
            results.add(
                f"{'  ' if previous else ''}guarantees, {writers} writer{s}: {label}",
                f"{med[key]:,.0f} tps, {med_cpu[key]:,.0f} us CPU/txn",
                f"{med['peer_c']:,.0f} tps, {med_cpu['peer_c']:,.0f} us CPU/txn",
                f"{med[key] / med['peer_c']:.2f}x",
                f"(info: vs the outbox; CPU {med_cpu[key] / med_cpu['peer_c']:.2f}x{step})",
            )
            previous = key
        results.note(
            f"guarantees, {writers} writer{s}: unwatched {med['plain']:,.0f} tps, {med_cpu['plain']:,.0f} us CPU/txn;"
            " tps per round: " + "; ".join(f"{k} {', '.join(f'{v:,.0f}' for v in vals)}" for k, vals in tps.items())
        )
    # One session with synchronous_commit off: the writer's backend CPU per UPDATE, which neither the WAL flush nor
    # the consumers blur (a step of the rounds above is within their noise on this machine).
    updates = int(cfg.tps_seconds * 1250)
    us: dict[str, list[float]] = {k: [] for k in variants}
    with psycopg.connect(url, autocommit=True) as session:
        session.execute("SET synchronous_commit = off")
        pid = session.info.backend_pid
        for r in range(cfg.tps_rounds):
            for variant in variants[r % len(variants) :] + variants[: r % len(variants)]:
                vacuum(conn, *tables.values(), "pgbroker.outbox")
                sql = f"UPDATE {tables[variant]} SET val = val + 1 WHERE id = %s"
                ids = [random.randint(1, 1000) for _ in range(updates)]
                cpu0 = _proc_cpu(pid)
                for row in ids:
                    session.execute(sql, (row,), prepare=True)
                us[variant].append((_proc_cpu(pid) - cpu0) / updates * 1e6)
                if variant == "peer_c":
                    wait_consumed(conn, outbox)
                elif variant != "plain":
                    wait_drained(conn, broker)
    med_us = {k: statistics.median(v) for k, v in us.items()}
    previous = None
    for key, label in GUARANTEES:
        step = "" if previous is None else f"; this step {med_us[key] - med_us[previous]:+,.1f} us"
        results.add(
            f"{'  ' if previous else ''}guarantees, one session (synchronous_commit off): {label}",
            f"{med_us[key]:,.1f} us backend CPU/UPDATE",
            f"{med_us['peer_c']:,.1f} us backend CPU/UPDATE",
            f"{med_us[key] / med_us['peer_c']:.2f}x",
            f"(info: CPU vs the outbox; unwatched {med_us['plain']:,.1f} us{step})",
        )
        previous = key
    results.note(
        f"guarantees, one session: {updates:,} UPDATEs per round, backend CPU per UPDATE (us) per round: "
        + "; ".join(f"{k} {', '.join(f'{v:,.1f}' for v in vals)}" for k, vals in us.items())
    )


# ---------------------------------------------------------------------------
# What every writer touches (issue 44): the lock tags and pages that a watched single-row UPDATE shares with every
# other writer's, against the transactional outbox and the prototype.  Counted, not timed.

SHARED_VARIANTS = ("row", "statement", "peer_c", "peer_d")
SHARED_UPDATES = 2000


def _held_lock_tags(url: str, table: str) -> list[str]:
    """The lock tags that two writers, each after a single-row UPDATE of a different row of TABLE, both hold in the
    shared lock table (not fast-path): every such tag is an operation on a lock-manager partition that every writer
    makes, at the acquisition and again at commit."""
    held = []
    sessions: list[psycopg.Connection] = []
    while len(sessions) < 2:  # in two gates (sql/300_watched_tables.sql): pids apart modulo 16, as most pairs are
        conn = psycopg.connect(url)
        if sessions and sessions[0].info.backend_pid % 16 == conn.info.backend_pid % 16:
            conn.close()
            continue
        sessions.append(conn)
    try:
        for n, session in enumerate(sessions):
            session.execute(f"UPDATE {table} SET val = val + 1 WHERE id = %s", (n * 500 + 1,))
            held.append({
                f"{locktype}:{rel or ''}:{classid or ''}:{objid or ''}:{objsubid or ''}:{mode}"
                for locktype, rel, classid, objid, objsubid, mode in session.execute(
                    "SELECT locktype, relation::regclass::text, classid, objid, objsubid, mode FROM pg_locks"
                    " WHERE pid = pg_backend_pid() AND NOT fastpath AND locktype NOT IN ('virtualxid', 'transactionid')"
                )
            })  # fmt: skip
        return sorted(held[0] & held[1])
    finally:
        for session in sessions:
            session.rollback()
            session.close()


def _failed_tries(conn: psycopg.Connection, table: str) -> int:
    """Try-locks of a table's UPDATE trigger function that fail on every writer while the broker drains (its awake
    lock): not held, so not in pg_locks, each one more lock-manager operation per broker.  Counted in the installed
    function's fast path (the first INSERT's wake-up test)."""
    source = conn.execute(
        "SELECT coalesce(string_agg(pg_get_functiondef(t.tgfoid), ''), '') FROM pg_trigger t"
        " WHERE t.tgrelid = %s::regclass AND NOT t.tgisinternal AND t.tgname LIKE '%%upd%%'",
        (table,),
    ).fetchone()[0]
    test = source[source.find("WHERE CASE") : source.find("END;", source.find("WHERE CASE"))]
    return test.count("pg_try_advisory_lock_shared(")


def _pages_per_update(url: str, conn: psycopg.Connection, table: str, n: int) -> dict[str, float]:
    """Buffer accesses per single-row UPDATE of TABLE (random rows, autocommit), per relation other than TABLE and
    its index: what the trigger reads and writes."""
    query = """
        SELECT relid::regclass::text, coalesce(heap_blks_hit, 0) + coalesce(heap_blks_read, 0)
          FROM pg_statio_all_tables WHERE schemaname IN ('pgbroker', 'bench')
        UNION ALL
        SELECT indexrelid::regclass::text, coalesce(idx_blks_hit, 0) + coalesce(idx_blks_read, 0)
          FROM pg_statio_all_indexes WHERE schemaname IN ('pgbroker', 'bench')
        UNION ALL
        SELECT relid::regclass::text, coalesce(blks_hit, 0) + coalesce(blks_read, 0)
          FROM pg_statio_all_sequences WHERE schemaname IN ('pgbroker', 'bench')"""

    def snapshot() -> dict[str, int]:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        return dict(conn.execute(query).fetchall())

    rng = random.Random(44)
    with psycopg.connect(url, autocommit=True) as writer:
        writer.execute("SELECT pg_stat_force_next_flush()")
        writer.execute("SELECT 1")
        time.sleep(0.2)
        before = snapshot()
        for _ in range(n):
            writer.execute(f"UPDATE {table} SET val = val + 1 WHERE id = %s", (rng.randint(1, 1000),), prepare=True)
        writer.execute("SELECT pg_stat_force_next_flush()")
        writer.execute("SELECT 1")
    time.sleep(0.5)
    after = snapshot()
    own = {table, f"{table}_pkey"}
    return {
        rel: (after[rel] - before.get(rel, 0)) / n
        for rel in after
        if rel not in own and after[rel] > before.get(rel, 0)
    }


def bench_shared(url: str, conn: psycopg.Connection, broker: DrainingBroker, results: Results) -> None:
    print("6. what a watched single-row UPDATE shares with every other writer (lock tags, pages)", flush=True)
    broker.paused.set()  # awake, not fetching: the broker's own reads stay out of the counts
    try:
        conn.execute(f"UPDATE {TABLES['row']} SET val = val + 1 WHERE id = 1")  # wakes the broker if it sleeps
        deadline = time.monotonic() + 10
        while not conn.execute(
            "SELECT EXISTS (SELECT FROM pg_locks WHERE pid = %s AND locktype = 'advisory' AND granted"
            " AND classid = pgbroker._lock_class_awake()::oid)",
            (broker.backend_pid,),
        ).fetchone()[0]:
            assert time.monotonic() < deadline, "the broker did not wake"
            time.sleep(0.05)
        ops: dict[str, int] = {}
        written: dict[str, float] = {}
        for variant in SHARED_VARIANTS:
            table = TABLES[variant]
            tags = _held_lock_tags(url, table)
            tries = _failed_tries(conn, table) if variant in ("row", "statement") else 0
            pages = _pages_per_update(url, conn, table, SHARED_UPDATES)
            ops[variant] = 2 * len(tags) + tries
            # What every writer writes: the outbox's pages (its last heap page, its indexes' rightmost leaves) and
            # its id sequence's; the rest of what the trigger touches it reads (the interest, by key).
            written[variant] = sum(v for rel, v in pages.items() if "outbox" in rel)
            results.note(
                f"shared, {LABELS[variant]}: lock tags both writers hold {', '.join(tags) or 'none'}; failed tries per"
                f" broker {tries}; pages per UPDATE by relation: "
                + ", ".join(f"{rel} {v:.2f}" for rel, v in sorted(pages.items(), key=lambda kv: -kv[1]))
            )
            results.figures[f"shared_lock_ops_{variant}"] = ops[variant]
            results.figures[f"shared_pages_written_{variant}"] = written[variant]
        floor = "peer_d"
        for variant in ("row", "statement", "peer_c"):
            ok = ops[variant] <= ops[floor]
            results.add(
                f"lock-manager operations per UPDATE on tags every writer shares: {LABELS[variant]}",
                str(ops[variant]),
                f"{ops[floor]} (prototype)",
                "",
                f"<= prototype {_verdict(ok)}" if variant == "row" else "(info)",
            )
        for variant in ("row", "statement", "peer_c"):
            ratio = written[variant] / written[floor]
            results.add(
                f"pages every writer writes per UPDATE (outbox, its indexes, its sequence): {LABELS[variant]}",
                f"{written[variant]:.2f}",
                f"{written[floor]:.2f} (prototype)",
                f"{ratio:.2f}x",
                "(info)",
            )
    finally:
        broker.paused.clear()
    wait_drained(conn, broker)


# ---------------------------------------------------------------------------
# 7. What the broker pays per fetch (issue 44): the consumer's half of part 1's CPU per transaction.

FETCH_LEASE = "fetchbench"
FETCH_SIZES = (6, 20)  # rows per fetch: what the broker's batches held in part 1, at 1 and at 8 writers
FETCH_CALLS = 600  # fetches per variant and round
FETCH_ROUNDS = 5
# The least an acknowledging fetch of these rows does: the previous batch deleted by id, the next one read, in one
# statement, as outbox_fetch's last statement does, without the holder's fence, the checks for rows awaiting their
# clients, departed clients and name grants, the floor's upkeep and the table's name.  Sent as it is ("bare"), and
# in a function made as outbox_fetch is ("wrapped": PL/pgSQL, SECURITY DEFINER, its pinned settings), which shows
# what being a function costs, apart from what outbox_fetch checks.
_ACK_AND_READ = (
    "WITH acked AS (DELETE FROM pgbroker.outbox b WHERE b.name = {name} AND b.epoch = {epoch} AND b.id = ANY ({ack}))"
    " SELECT o.id, o.watch_id, o.op, o.row_key, o.changed, o.clients, o.at, o.left_clients FROM pgbroker.outbox o"
    " WHERE o.name = {name} AND o.epoch = {epoch} AND o.id > {floor} AND ({ack} IS NULL OR o.id <> ALL ({ack}))"
    " ORDER BY o.id LIMIT 1000"
)
BARE_FETCH = _ACK_AND_READ.format(name="%(name)s", epoch="%(epoch)s", ack="%(ack)s::bigint[]", floor="%(floor)s")
WRAPPED_FETCH = f"""
    CREATE FUNCTION bench.bare_fetch(p_name text, p_epoch bigint, p_ack bigint[], p_floor bigint)
    RETURNS TABLE (id bigint, watch_id integer, op "char", row_key jsonb, changed text[], clients text[],
                   at timestamptz, left_clients text[])
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp SET plan_cache_mode = force_generic_plan
    SET enable_seqscan = off SET enable_bitmapscan = off
    AS $$
    BEGIN
        RETURN QUERY {_ACK_AND_READ.format(name="p_name", epoch="p_epoch", ack="p_ack", floor="p_floor")};
    END
    $$"""


def _backend_cpu_ns(pid: int) -> int:
    """Nanoseconds on CPU of process PID (the scheduler's count: finer than /proc/PID/stat's ticks)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def _fetch(variant: str, session: psycopg.Connection, ack: list[int] | None, floor: int, epoch: int,
           peer_sql: str) -> list[tuple[Any, ...]]:  # fmt: skip
    """One fetch of VARIANT (pgbroker, wrapped, bare or peer) on SESSION, acknowledging ACK (the peer deletes the
    rows it reads)."""
    if variant == "pgbroker":
        return session.execute("SELECT * FROM pgbroker.outbox_fetch(%s, 1000, %s)", (FETCH_LEASE, ack)).fetchall()
    if variant == "bare":
        args = {"name": FETCH_LEASE, "epoch": epoch, "ack": ack, "floor": floor}
        return session.execute(BARE_FETCH, args, prepare=True).fetchall()
    if variant == "wrapped":
        return session.execute(
            "SELECT * FROM bench.bare_fetch(%s, %s, %s, %s)", (FETCH_LEASE, epoch, ack, floor), prepare=True
        ).fetchall()
    return session.execute(peer_sql, prepare=True).fetchall()


def bench_fetch(url: str, conn: psycopg.Connection, results: Results) -> None:
    print("7. what the broker pays per fetch: outbox_fetch against the outbox peer's consumer", flush=True)
    make_table(conn, "bench.fetch_row", 1000)
    make_table(conn, "bench.fetch_peer", 1000)
    conn.execute("SELECT pgbroker.watch('bench.fetch_row', mode => 'row')")
    conn.execute(OutboxConsumer.setup.replace("peer_c", "fetch_peer"))
    conn.execute(WRAPPED_FETCH)
    peer_sql = OutboxConsumer.fetch_sql.replace("peer_c", "fetch_peer")
    with (
        psycopg.connect(url, autocommit=True) as ours,
        psycopg.connect(url, autocommit=True) as peer,
        psycopg.connect(url, autocommit=True) as writer,
    ):
        writer.execute("SET synchronous_commit = off")  # the writes only fill the outboxes: no flush to wait for
        for setting in ("plan_cache_mode = force_generic_plan", "enable_seqscan = off", "enable_bitmapscan = off"):
            ours.execute(f"SET {setting}")  # the bare statement planned as outbox_fetch's statements are
        epoch = ours.execute("SELECT pgbroker.broker_claim(%s)", (FETCH_LEASE,)).fetchone()[0]
        register_clients(conn, FETCH_LEASE, epoch, "f", 0, 999)
        n, _ = subscribe_all(
            conn, FETCH_LEASE, epoch, "bench.fetch_row",
            "SELECT 'f' || k, mod(k * 10 + j, 1000) + 1 FROM generate_series(%s::int, %s::int) k,"
            " generate_series(0, 9) j",
            [(0, 999)],
        )  # fmt: skip
        assert n == 10_000, n
        ours.execute("SELECT pgbroker.broker_wake(%s)", (FETCH_LEASE,))
        conn.execute("VACUUM ANALYZE bench.fetch_row, bench.fetch_peer, pgbroker.outbox")
        rng = random.Random(7)
        variants = ("pgbroker", "wrapped", "bare", "peer")
        for size in FETCH_SIZES:
            backend: dict[str, list[float]] = {v: [] for v in variants}  # us per fetch
            loop: dict[str, list[float]] = {v: [] for v in variants}
            empty: dict[str, list[float]] = {v: [] for v in variants}
            for r in range(FETCH_ROUNDS):
                for variant in variants[r % len(variants) :] + variants[: r % len(variants)]:
                    session, table = (peer, "bench.fetch_peer") if variant == "peer" else (ours, "bench.fetch_row")
                    vacuum(conn, "pgbroker.outbox", "bench.fetch_peer_outbox")  # as part 1 does before each run
                    pid = session.info.backend_pid
                    floor = conn.execute("SELECT pg_sequence_last_value('pgbroker.outbox_id_seq')").fetchone()[0] or 0

                    done: list[int] | None = None
                    cpu_ns = loop_s = 0.0
                    for _ in range(FETCH_CALLS):
                        for _ in range(size):
                            writer.execute(f"UPDATE {table} SET val = val + 1 WHERE id = %s", (rng.randint(1, 1000),),
                                           prepare=True)  # fmt: skip
                        c0, t0 = _backend_cpu_ns(pid), time.thread_time()
                        rows = _fetch(variant, session, done, floor, epoch, peer_sql)
                        loop_s += time.thread_time() - t0
                        cpu_ns += _backend_cpu_ns(pid) - c0
                        assert len(rows) == size, (variant, len(rows))
                        if variant != "peer":
                            if done:
                                floor = min(done) - 1
                            done = [row[0] for row in rows]
                    _fetch(variant, session, done, floor, epoch, peer_sql)  # the last batch's acknowledgement
                    backend[variant].append(cpu_ns / FETCH_CALLS / 1e3)
                    loop[variant].append(loop_s / FETCH_CALLS * 1e6)
                    c0 = _backend_cpu_ns(pid)
                    for _ in range(FETCH_CALLS):
                        assert not _fetch(variant, session, None, floor, epoch, peer_sql)
                    empty[variant].append((_backend_cpu_ns(pid) - c0) / FETCH_CALLS / 1e3)
            med = {v: statistics.median(backend[v]) for v in variants}
            med_loop = {v: statistics.median(loop[v]) for v in variants}
            med_empty = {v: statistics.median(empty[v]) for v in variants}
            for variant, label in (("pgbroker", "pgbroker.outbox_fetch (acknowledges by id, fenced, checked)"),
                                   ("wrapped", "the bare statement in a function made as outbox_fetch is"),
                                   ("bare", "the bare acknowledging statement (no fence, no checks)")):  # fmt: skip
                results.add(
                    f"fetch of {size} rows, backend CPU: {label}",
                    f"{med[variant]:,.0f} us",
                    f"{med['peer']:,.0f} us",
                    f"{med[variant] / med['peer']:.2f}x",
                    "(info: vs the outbox peer's DELETE ... RETURNING)",
                )
            results.add(
                f"  fetch of {size} rows, the consumer loop's CPU (psycopg, Python)",
                f"{med_loop['pgbroker']:,.0f} us",
                f"{med_loop['peer']:,.0f} us",
                f"{med_loop['pgbroker'] / med_loop['peer']:.2f}x",
                "(info)",
            )
            results.add(
                f"  empty fetch, backend CPU (size {size} rounds)",
                f"{med_empty['pgbroker']:,.0f} us",
                f"{med_empty['peer']:,.0f} us",
                f"{med_empty['pgbroker'] / med_empty['peer']:.2f}x",
                f"(info: wrapped {med_empty['wrapped']:,.0f} us, bare {med_empty['bare']:,.0f} us)",
            )
            extra = (med["pgbroker"] + med_loop["pgbroker"] - med["peer"] - med_loop["peer"]) / size
            results.figures[f"fetch_extra_us_per_row_{size}"] = extra
            results.note(
                f"fetch, {size} rows a fetch: the broker's backend and loop cost {extra:,.1f} us per delivered row more"
                f" than the outbox peer's consumer; the bare acknowledging statement's backend"
                f" {(med['bare'] - med['peer']) / size:,.1f} us per row more than the peer's; per round, backend us per"
                " fetch: "
                + "; ".join(f"{v} {', '.join(f'{x:,.0f}' for x in backend[v])}" for v in variants)
                + "; loop us per fetch: "
                + "; ".join(f"{v} {', '.join(f'{x:,.0f}' for x in loop[v])}" for v in variants)
            )
        ours.execute("SELECT pgbroker.broker_release(%s)", (FETCH_LEASE,))


# ---------------------------------------------------------------------------
# Plans of the generated trigger functions' queries (--explain).


def explain_triggers(conn: psycopg.Connection) -> None:
    """Print auto_explain plans of the nested statements run by the watch triggers (changes rolled back)."""
    print("\n--- auto_explain of the trigger queries (each statement rolled back) ---", flush=True)
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    conn.execute("LOAD 'auto_explain'")
    for setting, value in (("log_min_duration", "0"), ("log_analyze", "on"), ("log_nested_statements", "on"),
                           ("log_buffers", "on"), ("log_timing", "on"), ("log_level", "notice")):  # fmt: skip
        conn.execute(f"SET auto_explain.{setting} = '{value}'")
    for label, sql in (
        ("single-row UPDATE, 10 subscribers", "UPDATE bench.watched SET val = val + 1 WHERE id = 7"),
        ("the same in row mode", "UPDATE bench.watched_row SET val = val + 1 WHERE id = 7"),
        ("10k-row UPDATE, 1% subscribed", "UPDATE bench.bulk_sparse SET val = val + 1"),
        ("10k-row UPDATE, every row subscribed", "UPDATE bench.bulk_dense SET val = val + 1"),
    ):
        notices.clear()
        try:
            with conn.transaction():
                conn.execute(sql)
                raise psycopg.Rollback()
        except psycopg.Rollback:
            pass
        print(f"\n### {label}: {sql}")
        for text in notices:
            if "pgbroker.outbox" in text or "pgbroker.interest" in text:
                print(text)
    conn.execute("RESET ALL")


# ---------------------------------------------------------------------------


def setup_fixture(conn: psycopg.Connection, broker: DrainingBroker) -> tuple[dict[str, int], list[str]]:
    notes = []
    conn.execute("CREATE SCHEMA bench")
    for table, rows in (("bench.plain", 1000), ("bench.watched", 1000), ("bench.watched_row", 1000),
                        ("bench.bulk_plain", BULK_ROWS), ("bench.bulk_sparse", BULK_ROWS),
                        ("bench.bulk_sparse_row", BULK_ROWS), ("bench.bulk_dense", BULK_ROWS),
                        ("bench.bulk_dense_row", BULK_ROWS),
                        ("bench.scale", SCALE_ROWS), ("bench.huge_plain", HUGE_ROWS),
                        ("bench.huge_sparse", HUGE_ROWS), *((f"bench.{p}", 1000) for p in PEERS)):  # fmt: skip
        make_table(conn, table, rows)
    conn.execute("CREATE UNLOGGED TABLE bench.floor_outbox (LIKE pgbroker.outbox INCLUDING ALL)")
    watch_ids = {
        t: conn.execute("SELECT pgbroker.watch(%s, mode => %s)", (t, "row" if t.endswith("_row") else "statement"))
        .fetchone()[0]
        for t in ("bench.watched", "bench.watched_row", "bench.bulk_sparse", "bench.bulk_sparse_row",
                  "bench.bulk_dense", "bench.bulk_dense_row", "bench.scale", "bench.huge_sparse")
    }  # fmt: skip
    for peer in PEERS.values():
        conn.execute(peer.setup)
    seconds = register_clients(conn, BROKER, broker.epoch, "c", 0, 999)
    # bench.watched(_row): client k subscribes to rows (10k + j) % 1000 + 1, j < 10: 10 subscribers per row.
    subs = sub_seconds = 0.0
    for table in ("bench.watched", "bench.watched_row"):
        n, elapsed = subscribe_all(
            conn, BROKER, broker.epoch, table,
            "SELECT 'c' || k, mod(k * 10 + j, 1000) + 1 FROM generate_series(%s::int, %s::int) k,"
            " generate_series(0, 9) j",
            split(0, 999, 2),
        )  # fmt: skip
        assert n == 10_000, n
        subs, sub_seconds = subs + n, sub_seconds + elapsed
    # bench.bulk_sparse(_row): rows 100, 200, ... (1%) one subscriber each; bench.bulk_dense: every row one.
    sparse = 0
    for table in ("bench.bulk_sparse", "bench.bulk_sparse_row"):
        n, _ = subscribe_all(
            conn, BROKER, broker.epoch, table,
            "SELECT 'c' || mod(r, 1000), r FROM generate_series(%s::int, %s::int) r WHERE mod(r, 100) = 0",
            [(1, BULK_ROWS)],
        )  # fmt: skip
        assert n == BULK_ROWS // 100, n
        sparse += n
    dense = dense_seconds = 0.0
    for table in ("bench.bulk_dense", "bench.bulk_dense_row"):
        n, elapsed = subscribe_all(
            conn, BROKER, broker.epoch, table,
            "SELECT 'c' || mod(r, 1000), r FROM generate_series(%s::int, %s::int) r",
            split(1, BULK_ROWS, 2),
        )  # fmt: skip
        assert n == BULK_ROWS, n
        dense, dense_seconds = dense + n, dense_seconds + elapsed
    huge, _ = subscribe_all(
        conn, BROKER, broker.epoch, "bench.huge_sparse",
        "SELECT 'c' || mod(r, 1000), r FROM generate_series(%s::int, %s::int) r WHERE mod(r, 100) = 0",
        [(1, HUGE_ROWS)],
    )  # fmt: skip
    assert huge == HUGE_ROWS // 100, huge
    notes.append(
        f"set-up: 1,000 clients registered in {seconds:.1f} s; {subs + sparse + dense:,.0f} subscriptions in"
        f" {sub_seconds + dense_seconds:.1f} s+"
    )
    conn.execute("VACUUM ANALYZE")
    conn.execute("CHECKPOINT")
    return watch_ids, notes


def run(cfg: Settings) -> Results:
    results = Results()
    started = time.monotonic()
    with EmbeddedPostgres(postgres_options=DURABLE) as server, tempfile.TemporaryDirectory(prefix="pgbr-fan-") as tmp:
        with psycopg.connect(server.url, autocommit=True) as admin:
            admin.execute("CREATE DATABASE bench")
        url = server.url_for("bench")
        install.migrate(url)
        pgbench = PgBench(server, "bench", Path(tmp))
        with psycopg.connect(url, autocommit=True) as conn:
            settings = {
                name: conn.execute(f"SHOW {name}").fetchone()[0]
                for name in ("server_version", "fsync", "synchronous_commit", "full_page_writes")
            }
            print(
                "server: PostgreSQL {server_version}, fsync={fsync}, synchronous_commit={synchronous_commit}, "
                "full_page_writes={full_page_writes}; ".format(**settings)
                + f"{os.cpu_count()} CPUs; broker linger {LINGER * 1000:.0f} ms, poll {POLL * 1000:.0f} ms",
                flush=True,
            )
            assert settings["fsync"] == "on" and settings["synchronous_commit"] == "on", settings
            broker = DrainingBroker(url, BROKER)
            watch_ids, notes = setup_fixture(conn, broker)
            for text in notes:
                results.note(text)
            consumers = (
                {name: peer(url, name) for name, peer in PEERS.items()}
                if cfg.runs("throughput")
                else {"peer_c": PEERS["peer_c"](url, "peer_c")}
                if cfg.runs("guarantees")
                else {}
            )
            broker.start()
            try:
                if cfg.runs("shared"):  # first, while no other consumer reads (pg_statio counts every session)
                    bench_shared(url, conn, broker, results)
                if cfg.runs("fetch"):  # before the other consumers poll
                    bench_fetch(url, conn, results)
            except BaseException:
                broker.stop()
                raise
            for consumer in consumers.values():
                consumer.start()
            try:
                if cfg.runs("throughput"):
                    bench_throughput(url, conn, broker, consumers, pgbench, cfg, results)
                if cfg.runs("bulk"):
                    bench_bulk(conn, broker, watch_ids, cfg, results)
                if cfg.runs("huge"):
                    bench_huge(conn, broker, cfg, results)
                if cfg.runs("latency"):
                    bench_latency(url, conn, broker, cfg, results)
                if cfg.runs("guarantees"):
                    bench_guarantees(url, conn, broker, consumers["peer_c"], pgbench, cfg, results)
                if cfg.explain:
                    explain_triggers(conn)
            finally:
                broker.stop()
                for consumer in consumers.values():
                    consumer.stop()
            if cfg.runs("scale"):
                bench_scale(url, conn, pgbench, cfg, results)
    results.figures["seconds"] = time.monotonic() - started
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (a smoke test, noisier figures)")
    parser.add_argument("--explain", action="store_true", help="also print auto_explain plans of the trigger queries")
    parser.add_argument("--only", action="append", choices=PARTS, default=[],
                        help="run only this part (repeatable; default: all but guarantees)")  # fmt: skip
    parser.add_argument("--writers", default=None,
                        help="pgbench clients of the throughput part, comma-separated (default 1,8; waits sampled at"
                        " the last)")  # fmt: skip
    parser.add_argument("--tps-rounds", type=int, default=None, help="rounds of every design per writer count")
    parser.add_argument("--tps-seconds", type=float, default=None, help="seconds per pgbench run")
    args = parser.parse_args(argv)
    cfg = Settings.quick() if args.quick else Settings()
    if args.writers:
        cfg.writers = tuple(int(w) for w in args.writers.split(","))
    if args.tps_rounds:
        cfg.tps_rounds = args.tps_rounds
    if args.tps_seconds:
        cfg.tps_seconds = args.tps_seconds
    cfg.explain = args.explain
    cfg.only = tuple(args.only)
    results = run(cfg)
    print()
    print(results.table())
    print(
        f"\n(floor: the same work unwatched, or the plain SQL named in the metric; whole run"
        f" {results.figures['seconds']:.0f} s; targets missed: {', '.join(results.missed) or 'none'})"
    )
    return 0


def test_bench_fanout() -> None:
    """pytest entry point (tests/benchmarks is ignored by the default run): prints the table."""
    results = run(Settings.quick())
    print()
    print(results.table())
    assert results.figures["tps_ratio_1"] > 0 and results.figures["latency_p50_ms"] > 0


if __name__ == "__main__":
    sys.exit(main())
