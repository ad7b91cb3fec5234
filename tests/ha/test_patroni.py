"""pgbroker under Patroni, as users run it: failovers and switchovers of a real cluster (issue 26).

A two-node Patroni cluster with a Raft controller (tests/ha/patroni_util.py), pgbroker installed while the
replica streams, then, through the libpq multi-host URL
``postgresql://postgres@n1,n2/app?target_session_attrs=read-write``:

- a broker loop: a ``Broker`` that registers 100 clients and 1,000 subscriptions (``register_many``,
  ``subscribe_many``) and reads ``notifications()``; when the lease is lost it claims again, and re-registers
  and re-subscribes, on whichever node is primary;
- four application writers updating ``initech.objects`` (watched) and recording each acknowledged write in
  ``public.acked`` in the same statement, reconnecting through the same URL when their server goes.

Then the leader dies (SIGKILL of its Patroni, its postmaster and the postmaster's children) or is switched
over (``patronictl switchover --force``).  Checked: the lease is claimed again on the new primary with a
greater epoch that carries the new timeline; the old epoch is fenced (``broker_assert`` -> PB002); no write
to the watched table fails on the new primary; every (change, client) pair of the changes committed after
the re-subscribe is delivered; with synchronous replication no acknowledged write is lost; the old leader
comes back as a replica (pg_rewind) and a ``Broker`` aimed at it is refused with 25006.  Measured and
printed: kill to promotion, promotion to re-claim, kill to the first write served.

Runs when the ``ha`` extra is installed (``pip install -e '.[ha]'``); ``.ci/run`` installs it and runs these
tests in a step of their own, with PGBROKER_REQUIRE_HA=1 so that a missing Patroni fails instead of skipping.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from patroni_util import Node, PatroniCluster, patroni_missing

import pgbroker
from pgbroker import Broker

_missing = patroni_missing()
if _missing:
    if os.environ.get("PGBROKER_REQUIRE_HA"):
        raise RuntimeError(f"PGBROKER_REQUIRE_HA is set and the HA tests cannot run: {_missing}")
    pytest.skip(_missing, allow_module_level=True)

pytestmark = pytest.mark.slow

DB = "app"
ROWS = 100
CLIENTS = [f"c{i}" for i in range(100)]
# Client i subscribes to 10 rows; every row has 10 subscribers.
PAIRS = [(f"c{i}", (i * 10 + j) % ROWS + 1) for i in range(100) for j in range(10)]
SUBSCRIBERS: dict[int, set[str]] = {}
for _client, _key in PAIRS:
    SUBSCRIBERS.setdefault(_key, set()).add(_client)
WRITERS = 4
WRITE_SQL = (
    "WITH u AS (UPDATE initech.objects SET name = %s WHERE id = %s RETURNING id)"
    " INSERT INTO public.acked (writer, seq, key) SELECT %s, %s, id FROM u RETURNING at"
)
_RUNS = itertools.count(1)
SCENARIO_TIMEOUT = 120.0  # seconds for the lease to come back after a disruption


def _prepare(cluster: PatroniCluster) -> None:
    leader = cluster.leader()
    assert leader is not None
    with psycopg.connect(leader.url(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {DB}")
    url = cluster.multihost_url(DB)
    pgbroker.migrate(url)  # with the replica streaming: what broke PostgreSQL 15's unlogged sequence
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE public.acked (writer integer NOT NULL, seq integer NOT NULL, key bigint NOT NULL,"
            " at timestamptz NOT NULL DEFAULT statement_timestamp(), PRIMARY KEY (writer, seq))"
        )
        conn.execute(
            "INSERT INTO initech.objects (id, name) SELECT i, 'obj ' || i FROM generate_series(1, %s) i", (ROWS,)
        )


def _cluster(synchronous: bool):
    cluster = PatroniCluster(synchronous=synchronous)
    cluster.start()
    try:
        _prepare(cluster)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def cluster():
    yield from _cluster(synchronous=False)


@pytest.fixture(scope="module")
def sync_cluster():
    yield from _cluster(synchronous=True)


# -- the application: a broker loop and writers --------------------------------------------------------


@dataclass
class Epoch:
    epoch: int
    port: int
    claimed: float  # time.monotonic()
    resubscribed: float
    server_resubscribed: Any  # the server's clock_timestamp() once re-subscribed


class BrokerLoop(threading.Thread):
    """The broker as the docs give it: :func:`pgbroker.run_broker` holds the lease, re-claims after every loss on
    whichever node is primary, re-registers and re-subscribes the clients; this records what is delivered.
    Any error but a lost lease (a raw driver error among them) ends the loop and fails the test."""

    def __init__(self, url: str) -> None:
        super().__init__(name="broker-loop", daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.epochs: list[Epoch] = []
        self.losses: list[tuple[float, str]] = []
        self.delivered: dict[int, dict[tuple[int, Any], set[str]]] = {}  # epoch -> (key, at) -> clients
        self.changed = threading.Condition()
        self.error: BaseException | None = None

    def run(self) -> None:
        subscriptions: dict[str, list[tuple[str, Any]]] = {c: [] for c in CLIENTS}
        for client, key in PAIRS:
            subscriptions[client].append(("initech.objects", key))
        try:
            pgbroker.run_broker(
                self.url,
                "default",
                on_start=self._serve,
                on_lost=lambda exc: self.losses.append((time.monotonic(), f"LeaseLost (cause: {exc.__cause__!r})")),
                clients=lambda: subscriptions,
                report_interval=0.2,
                retry_delay=0.02,
                heartbeat_interval=0.25,
                connect_timeout=2,
            )
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def _serve(self, broker: Broker) -> None:
        claimed = time.monotonic()
        with psycopg.connect(self.url, autocommit=True) as conn:
            port = int(conn.info.port)
            now = conn.execute("SELECT clock_timestamp()").fetchone()[0]
        seen = self.delivered.setdefault(broker.epoch, {})
        with self.changed:
            self.epochs.append(Epoch(broker.epoch, port, claimed, time.monotonic(), now))
            self.changed.notify_all()
        for batch in broker.notifications(poll_interval=0.2):
            with self.changed:
                for n in batch:
                    seen.setdefault((n.key, n.at), set()).update(n.clients)
                self.changed.notify_all()
            if self.stop.is_set():
                return

    def wait(self, check: Callable[[], bool], what: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not check():
                if self.error is not None:
                    raise AssertionError(f"the broker loop failed: {self.error!r}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for {what}; losses: {self.losses[-5:]}")
                self.changed.wait(min(left, 0.05))
        return time.monotonic()


@dataclass
class Writes:
    ok: list[tuple[int, int, int, Any, int, float]] = field(default_factory=list)  # writer, seq, key, at, port, t
    failed: list[tuple[int, int, float, str]] = field(default_factory=list)  # writer, port, t, error


def _writer(url: str, number: int, stop: threading.Event, writes: Writes) -> None:
    rng = random.Random(number)
    conn: psycopg.Connection | None = None
    seq = 0
    deadline = time.monotonic() + 900
    while not stop.is_set() and time.monotonic() < deadline:
        if conn is None:
            try:
                conn = psycopg.connect(url, autocommit=True)
            except psycopg.OperationalError:
                time.sleep(0.05)
                continue
        seq += 1
        key = rng.randint(1, ROWS)
        port = int(conn.info.port)
        started = time.monotonic()
        try:
            at = conn.execute(WRITE_SQL, (f"w{number} {seq}", key, number, seq)).fetchone()[0]
            writes.ok.append((number, seq, key, at, port, started))
        except psycopg.Error as exc:
            writes.failed.append((number, port, started, f"{exc.sqlstate}: {str(exc).strip()[:200]}"))
            if conn.broken or conn.closed:
                conn.close()
                conn = None
        time.sleep(0.004)
    if conn is not None:
        conn.close()


class _PromotionWatcher(threading.Thread):
    """When ``node`` leaves recovery: polled every 10 ms on a session opened while it is a replica (a session
    survives the promotion; a new connection per poll would be late by its connection time)."""

    def __init__(self, node: Node) -> None:
        super().__init__(name="promotion-watcher", daemon=True)
        self.conn = psycopg.connect(node.url(DB), autocommit=True)
        self.promoted: float | None = None

    def run(self) -> None:
        deadline = time.monotonic() + SCENARIO_TIMEOUT
        try:
            while time.monotonic() < deadline:
                if not self.conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]:
                    self.promoted = time.monotonic()
                    return
                time.sleep(0.01)
        finally:
            self.conn.close()


# -- one disruption, and what must hold after it ---------------------------------------------------------


def _scenario(cluster: PatroniCluster, disrupt: Callable[[Node], None], label: str) -> dict[str, Any]:
    cluster.wait_for(cluster.healthy, "a healthy cluster (a leader and a streaming replica)")
    old = cluster.leader()
    assert old is not None
    new = cluster.other(old)
    url = cluster.multihost_url(DB)
    loop = BrokerLoop(url)
    writes = Writes()
    stop_writers = threading.Event()
    run = next(_RUNS)  # writer numbers are unique across the scenarios that share a cluster
    writers = [
        threading.Thread(target=_writer, args=(url, run * 100 + n, stop_writers, writes), daemon=True)
        for n in range(WRITERS)
    ]
    loop.start()
    try:
        loop.wait(lambda: len(loop.epochs) >= 1, "the first claim", 60)
        first = loop.epochs[0]
        assert first.port == old.pg_port
        for t in writers:
            t.start()
        time.sleep(1.5)

        watcher = _PromotionWatcher(new)
        watcher.start()
        disrupted = time.monotonic()
        disrupt(old)
        watcher.join(SCENARIO_TIMEOUT)
        assert watcher.promoted is not None, f"{new.name} was not promoted\n{cluster.logs()}"
        promoted = watcher.promoted
        reclaimed = loop.wait(
            lambda: any(e.port == new.pg_port for e in loop.epochs), "the re-claim on the new primary", SCENARIO_TIMEOUT
        )
        final = next(e for e in loop.epochs if e.port == new.pg_port)
        time.sleep(2.0)  # writers and the broker on the new primary
        stop_writers.set()
        for t in writers:
            t.join(30)

        with psycopg.connect(new.url(DB), autocommit=True) as conn:
            acked_after = conn.execute(
                "SELECT key, at FROM public.acked WHERE at > %s", (final.server_resubscribed,)
            ).fetchall()
            server_acked = set(conn.execute("SELECT writer, seq FROM public.acked").fetchall())
            version = conn.info.server_version // 10000
            timeline = int(conn.execute("SELECT substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8)").fetchone()[0], 16)
            with pytest.raises(psycopg.Error) as stale:
                conn.execute("SELECT pgbroker.broker_assert('default', %s)", (first.epoch,))
            assert stale.value.sqlstate == "PB002"

        def missing_pairs() -> int:
            seen = loop.delivered.get(final.epoch, {})
            return sum(len(SUBSCRIBERS[k] - seen.get((k, at), set())) for k, at in acked_after)

        with contextlib.suppress(AssertionError):  # the assertion below says how many are missing
            loop.wait(lambda: missing_pairs() == 0, "every change after the re-subscribe delivered", 20)
        missing = missing_pairs()
    finally:
        stop_writers.set()
        loop.stop.set()
        for t in writers:
            if t.is_alive():
                t.join(30)
        with psycopg.connect(cluster.multihost_url(DB), autocommit=True) as conn:  # a batch, so the loop sees stop
            conn.execute("UPDATE initech.objects SET name = 'stop' WHERE id = 1")
        loop.join(30)

    failed_after = [f for f in writes.failed if f[1] == new.pg_port]
    first_served = min((w[5] for w in writes.ok if w[4] == new.pg_port and w[5] >= disrupted), default=None)
    lost = {(w[0], w[1]) for w in writes.ok} - server_acked
    figures = {
        "disrupt_to_promotion": promoted - disrupted,
        # run_broker calls on_start once it has claimed and re-subscribed every client: an upper bound of both.
        "promotion_to_serving": final.resubscribed - promoted,
        "disrupt_to_first_write": (first_served - disrupted) if first_served else None,
        "disrupt_to_reclaim": reclaimed - disrupted,
    }
    print(
        f"\nPostgreSQL {version}, {label}: {old.name} -> {new.name}; "
        f"epochs {first.epoch:#x} -> {final.epoch:#x} (timeline {timeline}); "
        f"{figures['disrupt_to_promotion']:.2f} s to the promotion, re-claimed with clients and subscriptions back "
        f"{figures['promotion_to_serving']:.3f} s after it, first write "
        f"served {figures['disrupt_to_first_write'] or float('nan'):.2f} s after the {label}; writes: "
        f"{len(writes.ok)} acknowledged, {len(writes.failed)} failed (all on the old leader: "
        f"{len(failed_after) == 0}), {len(lost)} acknowledged and lost; {len(acked_after)} changes after the "
        f"re-subscribe, {len(acked_after) * 10} (change, client) pairs, {missing} missing"
    )
    print("  lease losses seen by the broker loop: " + "; ".join(sorted({text[:160] for _, text in loop.losses})))
    assert loop.error is None, loop.error
    assert final.epoch > first.epoch
    assert final.epoch >> 40 == timeline - 1 and timeline >= 2
    assert failed_after == [], failed_after[:5]
    assert len(acked_after) > 0
    assert missing == 0
    figures["lost"] = len(lost)
    return figures


def _refused_on(node: Node) -> None:
    """A Broker aimed straight at a replica: refused with 25006 (read_only_sql_transaction) and a hint."""
    with (
        pytest.raises(Exception) as refused,  # noqa: B017 - the SQLSTATE is what is checked
        Broker(node.url(DB), "default", wait=0, connect_timeout=2),
    ):
        pass
    exc = refused.value
    sqlstate = getattr(exc, "sqlstate", None) or getattr(exc.__cause__, "sqlstate", None)
    assert sqlstate == "25006", repr(exc)
    print(f"  a Broker on the replica {node.name}: {type(exc).__name__} {sqlstate}: {exc}")


def _rejoin(cluster: PatroniCluster, node: Node) -> None:
    cluster.start_node(node)
    cluster.wait_for(node.is_streaming_replica, f"{node.name} to rejoin as a replica", 120)


def test_failover_by_sigkill_of_the_leader(cluster):
    figures = _scenario(cluster, cluster.kill_node, "SIGKILL of the leader")
    old = next(n for n in cluster.nodes if n.process is None or n.process.poll() is not None)
    _rejoin(cluster, old)
    _refused_on(old)
    assert figures["promotion_to_serving"] < 30  # a bound, not a speed target (those are printed)


def test_planned_switchover(cluster):
    def switchover(leader: Node) -> None:
        done = cluster.patronictl(
            "switchover", "--leader", leader.name, "--candidate", cluster.other(leader).name, "--force"
        )
        assert done.returncode == 0, done.stdout + done.stderr

    cluster.wait_for(cluster.healthy, "a healthy cluster")
    old = cluster.leader()
    _scenario(cluster, switchover, "switchover")
    cluster.wait_for(old.is_streaming_replica, f"{old.name} to follow the new leader", 120)
    _refused_on(old)


def test_failover_in_synchronous_mode_loses_no_acknowledged_write(sync_cluster):
    figures = _scenario(sync_cluster, sync_cluster.kill_node, "SIGKILL of the synchronous leader")
    assert figures["lost"] == 0
    old = next(n for n in sync_cluster.nodes if n.process is None or n.process.poll() is not None)
    _rejoin(sync_cluster, old)
    _refused_on(old)
