"""The primitives checked for linearizability against the real server, as etcd and Jepsen check a
coordination service: concurrent client sessions call the SQL API, every call and return is
timed (tests/history.py records them), sessions are killed with ``pg_terminate_backend`` or the
server is restarted with ``pg_ctl restart -m immediate`` meanwhile, and each history is checked
by tests/linearizability.py against a sequential model of the primitive, key by key.

Workloads: the key-value store (get, set, compare-and-set by version, delete; the model includes
"the version grows on every change"), counters (add, get, set with expected), a mutex with
``wait => '0'`` and with short waits, shared and exclusive locks, a semaphore of 2 permits, and
the session lease (claim with and without a wait, release).  A call cut off by a kill or the
crash is indeterminate: it may have taken effect at any time after its invocation, up to the end
of its session, or never.  A killed session ends (its locks, permits and lease are free) no later
than its pid leaves ``pg_stat_activity``; the crash, before ``pg_ctl restart`` returns.

A failing check saves the history (history.json) and its picture (history.html) under
$PGBROKER_ARTIFACTS (or a temporary directory) and names them in the assertion.  A last test
plants faults in real, linearizable histories (a lock result flipped, a version made to go
down) and shows that the checker rejects them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from history import History, Recorder
from linearizability import (
    UNKNOWN,
    CounterModel,
    KVModel,
    LeaseModel,
    LockModel,
    Model,
    Operation,
    SemaphoreModel,
    assert_linearizable,
    check,
    from_history,
)

from pgbroker import install
from pgbroker._embedded import EmbeddedPostgres, find_pg_bin

pytestmark = pytest.mark.slow

CLIENTS = 6
RUN_SECONDS = 2.5  # of load per workload (a restart adds its own time)
MAX_OPS = 400  # per client
TEMPLATE = "lin_tmpl"


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedPostgres]:
    # synchronous_commit on: an acknowledged commit survives the crash (fsync off is harmless:
    # only PostgreSQL dies, not the OS).
    with EmbeddedPostgres("-c synchronous_commit=on") as pg:
        with psycopg.connect(pg.url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {TEMPLATE}")
        install.migrate(pg.url_for(TEMPLATE))
        yield pg


_databases = iter(range(10**6))


@pytest.fixture
def db_url(server: EmbeddedPostgres) -> str:
    name = f"lin{next(_databases)}"
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
    return server.url_for(name)


def restart_immediate(server: EmbeddedPostgres) -> None:
    """``pg_ctl restart -m immediate``: every backend dies at once, then crash recovery."""
    pg_ctl = server.datadir.parent / "pg_ctl" if os.geteuid() == 0 else find_pg_bin() / "pg_ctl"
    done = subprocess.run(
        [str(pg_ctl), "restart", "-w", "-m", "immediate", "-D", str(server.datadir), "-l", str(server.logfile)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr or done.stdout


SESSION_SQL = """
SELECT pg_backend_pid(), a.backend_start, extract(epoch FROM pg_postmaster_start_time())::text
  FROM pg_stat_activity a WHERE a.pid = pg_backend_pid()
"""


# ---------------------------------------------------------------------------
# Clients


class Client:
    """One client: a connection (a server session, named '<pid>.<backend start>@<server start>')
    that it opens again after a kill or the crash, and its recorder."""

    def __init__(self, name: str, url: str, history: History, registry: Registry, seed: str) -> None:
        self.name = name
        self.url = url
        self.rec: Recorder = history.recorder(name)
        self.registry = registry
        self.rng = random.Random(seed)
        self.conn: psycopg.Connection | None = None
        self.session = ""
        self.state: dict[str, Any] = {}  # what the workload believes (held locks, versions seen)

    def connected(self) -> bool:
        if self.conn is not None:
            return True
        try:
            conn = psycopg.connect(self.url, autocommit=True, connect_timeout=3, application_name=f"lin-{self.name}")
            pid, started, server = conn.execute(SESSION_SQL).fetchone()
        except psycopg.Error:
            time.sleep(0.02)  # the server is restarting
            return False
        self.conn = conn
        self.session = f"{pid}.{started.timestamp()}@{server}"
        self.state = {}  # a new session holds nothing
        self.registry.sessions[self.name] = (pid, started, self.session)
        return True

    def lost(self) -> None:
        """Close the connection; its session ends (an ``end_session`` operation, ending when the
        pid has left pg_stat_activity, or indeterminate when the server cannot tell)."""
        live = self.registry.sessions.pop(self.name, None)
        if self.conn is None:
            return
        assert live is not None
        pid, started, session = live
        with self.rec.call("end_session", None, session=f"closer-{self.name}", ended=session) as call:
            with contextlib.suppress(Exception):
                self.conn.close()
            self.conn = None
            if wait_gone(self.url, pid, started):
                call.ok(output=None)
            else:
                call.unknown()

    def call(
        self,
        kind: str,
        key: str,
        run: Callable[[psycopg.Connection], Any],
        expected_errors: tuple[tuple[type[Exception], Any], ...] = (),
        **args: Any,
    ) -> Any:
        """Run one operation and record it; UNKNOWN when its outcome cannot be known."""
        assert self.conn is not None
        with self.rec.call(kind, key, session=self.session, **args) as call:
            try:
                output = run(self.conn)
            except Exception as exc:
                for error, output in expected_errors:
                    if isinstance(exc, error):
                        call.ok(output=output)
                        return output
                call.unknown(error=f"{type(exc).__name__}: {str(exc).strip()[:200]}")
                self.lost()
                return UNKNOWN
            call.ok(output=output)
            return output


@dataclasses.dataclass
class Registry:
    """The clients' live sessions, for the killer: name -> (pid, backend start, session)."""

    sessions: dict[str, tuple[int, Any, str]] = dataclasses.field(default_factory=dict)


def wait_gone(url: str, pid: int, started: Any) -> bool:
    """Until the backend (pid, backend start) has left pg_stat_activity (it has released its locks
    by then: they go before its entry); False when the server cannot be asked."""
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=3) as admin:
            while admin.execute(
                "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND backend_start = %s", (pid, started)
            ).fetchone():
                time.sleep(0.001)
        return True
    except psycopg.Error:
        return False


def one(conn: psycopg.Connection, sql: str, params: tuple = ()) -> Any:
    return conn.execute(sql, params).fetchone()[0]


# ---------------------------------------------------------------------------
# Workloads: one operation of a client


KV_KEYS = ("k0", "k1")


def kv_step(c: Client, n: int) -> None:
    key = c.rng.choice(KV_KEYS)
    r = c.rng.random()
    value = f"{c.name}-{n}"
    if r < 0.3:

        def get(conn: psycopg.Connection) -> Any:
            row = conn.execute("SELECT value, version FROM pgbroker.kv_get(%s)", (key,)).fetchone()
            return None if row is None else [row[0], row[1]]

        got = c.call("get", key, get)
        if got not in (None, UNKNOWN):
            c.state[key] = got[1]
    elif r < 0.65:
        slow = c.rng.random() < 0.4

        def set_(conn: psycopg.Connection) -> Any:
            if not slow:
                return one(conn, "SELECT pgbroker.kv_set(%s, to_jsonb(%s::text))", (key, value))
            # In a transaction that holds the row a little before it commits.
            with conn.transaction():
                version = one(conn, "SELECT pgbroker.kv_set(%s, to_jsonb(%s::text))", (key, value))
                time.sleep(c.rng.uniform(0, 0.004))
            return version

        got = c.call("set", key, set_, value=value)
        if isinstance(got, int):
            c.state[key] = got
    elif r < 0.9:
        expected = c.state.get(key, 0) if c.rng.random() < 0.85 else 0
        got = c.call(
            "cas",
            key,
            lambda conn: one(conn, "SELECT pgbroker.kv_set(%s, to_jsonb(%s::text), %s)", (key, value, expected)),
            value=value,
            expected=expected,
        )
        if isinstance(got, int):
            c.state[key] = got
    else:
        c.call("delete", key, lambda conn: one(conn, "SELECT pgbroker.kv_delete(%s)", (key,)))


COUNTER_KEYS = ("c0", "c1")


def counter_step(c: Client, n: int) -> None:
    key = c.rng.choice(COUNTER_KEYS)
    r = c.rng.random()
    if r < 0.55:
        delta = c.rng.randint(1, 3)
        got = c.call(
            "add", key, lambda conn: one(conn, "SELECT pgbroker.counter_add(%s, %s)", (key, delta)), delta=delta
        )
        if isinstance(got, int):
            c.state[key] = got
    elif r < 0.8:
        got = c.call("get", key, lambda conn: one(conn, "SELECT pgbroker.counter_get(%s)", (key,)))
        if isinstance(got, int):
            c.state[key] = got
    else:
        expected = c.state.get(key, 0) if c.rng.random() < 0.8 else None
        value = c.rng.randint(0, 100)
        c.call(
            "set",
            key,
            lambda conn: one(conn, "SELECT pgbroker.counter_set(%s, %s, %s)", (key, value, expected)),
            value=value,
            expected=expected,
        )


LOCK_KEYS = ("m0", "m1")


def lock_step(waits: tuple[str, ...], shared_share: float, hold_ms: float) -> Callable[[Client, int], None]:
    def step(c: Client, n: int) -> None:
        key = c.rng.choice(LOCK_KEYS)
        held = c.state.get(key)
        if held is not None:
            time.sleep(c.rng.uniform(0, hold_ms) / 1000)
            c.call(
                "release",
                key,
                lambda conn: one(conn, "SELECT pgbroker.lock_release(%s, %s)", (key, held)),
                shared=held,
            )
            c.state.pop(key, None)
            return
        shared = c.rng.random() < shared_share
        wait = c.rng.choice(waits)
        got = c.call(
            "acquire",
            key,
            lambda conn: one(conn, "SELECT pgbroker.lock_acquire(%s, %s::interval, %s)", (key, wait, shared)),
            shared=shared,
            wait=wait,
        )
        if got is True:
            c.state[key] = shared

    return step


SEMAPHORE_LIMIT = 2


def semaphore_step(c: Client, n: int) -> None:
    key = "s0"
    if c.state.get(key):
        time.sleep(c.rng.uniform(0, 0.004))
        c.call("release", key, lambda conn: one(conn, "SELECT pgbroker.semaphore_release(%s)", (key,)))
        c.state.pop(key, None)
        return
    wait = c.rng.choice(("0", "5 ms", "20 ms"))
    got = c.call(
        "acquire",
        key,
        lambda conn: one(conn, "SELECT pgbroker.semaphore_acquire(%s, %s, %s::interval)", (key, SEMAPHORE_LIMIT, wait)),
        wait=wait,
    )
    if isinstance(got, int):
        c.state[key] = got


def lease_step(c: Client, n: int) -> None:
    key = "L0"
    if c.state.get(key):
        time.sleep(c.rng.uniform(0, 0.004))
        c.call("release", key, lambda conn: one(conn, "SELECT pgbroker.broker_release(%s)", (key,)))
        c.state.pop(key, None)
        return
    wait = c.rng.choice(("0", "10 ms"))
    got = c.call(
        "claim",
        key,
        lambda conn: one(conn, "SELECT pgbroker.broker_claim(%s, wait => %s::interval)", (key, wait)),
        expected_errors=((psycopg.errors.LockNotAvailable, "held"),),
        wait=wait,
    )
    if isinstance(got, int):
        c.state[key] = got


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    step: Callable[[Client, int], None]
    model: Callable[[str | None], Model]
    setup: tuple[str, ...] = ()


WORKLOADS = {
    w.name: w
    for w in (
        Workload("kv", kv_step, lambda key: KVModel()),
        Workload("counter", counter_step, lambda key: CounterModel()),
        Workload(
            "mutex_try",
            lock_step(("0",), 0.0, 3),
            lambda key: LockModel(),
            tuple(f"SELECT pgbroker.lock_acquire('{k}'), pgbroker.lock_release('{k}')" for k in LOCK_KEYS),
        ),
        Workload(
            "mutex_wait",
            lock_step(("2 ms", "5 ms", "10 ms"), 0.0, 10),
            lambda key: LockModel(),
            tuple(f"SELECT pgbroker.lock_acquire('{k}'), pgbroker.lock_release('{k}')" for k in LOCK_KEYS),
        ),
        Workload(
            "shared_lock",
            lock_step(("0", "5 ms"), 0.6, 5),
            lambda key: LockModel(),
            tuple(f"SELECT pgbroker.lock_acquire('{k}'), pgbroker.lock_release('{k}')" for k in LOCK_KEYS),
        ),
        Workload(
            "semaphore",
            semaphore_step,
            lambda key: SemaphoreModel(SEMAPHORE_LIMIT),
            ("SELECT pgbroker.semaphore_acquire('s0', 2), pgbroker.semaphore_release('s0')",),
        ),
        Workload(
            "lease",
            lease_step,
            lambda key: LeaseModel(),
            ("SELECT pgbroker.broker_claim('L0'), pgbroker.broker_release('L0')",),
        ),
    )
}


# ---------------------------------------------------------------------------
# Faults


KILLS = 3  # at least, per run with faults "kills": the clients go on past MAX_OPS until then


def killer(url: str, history: History, registry: Registry, stop: threading.Event, seed: int, kills: list[int]) -> None:
    """Terminate a random client's session every 50-250 ms (the first KILLS within 10-50 ms each: a fast
    workload may be done in half a second); the op ends when its pid is gone; ``kills[0]`` counts them."""
    rng = random.Random(seed)
    rec = history.recorder("killer")
    with psycopg.connect(url, autocommit=True) as admin:
        while not stop.wait(rng.uniform(0.01, 0.05) if kills[0] < KILLS else rng.uniform(0.05, 0.25)):
            live = list(registry.sessions.values())
            if not live:
                continue
            pid, started, session = rng.choice(live)
            with rec.call("end_session", None, session="killer", ended=session) as call:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = %s AND backend_start = %s",
                    (pid, started),
                )
                while admin.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND backend_start = %s", (pid, started)
                ).fetchone():
                    time.sleep(0.001)
                call.ok(output=None)
            kills[0] += 1
    rec.close()


def crasher(
    server: EmbeddedPostgres, url: str, history: History, stop: threading.Event, ready: Callable[[], bool]
) -> None:
    """Once, when ``ready()`` (a third of the load done): ``pg_ctl restart -m immediate``."""
    rec = history.recorder("crasher")
    while not ready():
        if stop.wait(0.01):
            return
    with psycopg.connect(url, autocommit=True) as admin:
        started = one(admin, "SELECT extract(epoch FROM pg_postmaster_start_time())::text")
    with rec.call("crash", None, session="crasher", server=started) as call:
        restart_immediate(server)
        call.ok(output=None)
    rec.close()


# ---------------------------------------------------------------------------
# Running a workload


def run(
    server: EmbeddedPostgres, url: str, workload: Workload, faults: str, directory: Path, seconds: float = RUN_SECONDS
) -> list[Operation]:
    with psycopg.connect(url, autocommit=True) as conn:
        for statement in workload.setup:  # names registered beforehand: first use is not what is checked
            conn.execute(statement)
    history = History(directory)
    registry = Registry()
    stop = threading.Event()
    clients = [Client(f"c{i}", url, history, registry, seed=f"{workload.name}-{faults}-{i}") for i in range(CLIENTS)]
    errors: list[BaseException] = []

    done = [0]  # operations so far, all clients (approximate: a trigger only)
    kills = [KILLS if faults != "kills" else 0]  # sessions the killer ended
    started = time.monotonic()

    def client_loop(c: Client) -> None:
        try:
            n = 0
            while not stop.is_set() and (n < MAX_OPS or kills[0] < KILLS):
                if c.connected():
                    workload.step(c, n)
                    n += 1
                    done[0] += 1
        except BaseException as exc:  # a bug of the test: fail the test with it
            errors.append(exc)
        finally:
            c.lost()
            c.rec.close()

    threads = [threading.Thread(target=client_loop, args=(c,), daemon=True) for c in clients]
    if faults == "kills":
        threads.append(threading.Thread(target=killer, args=(url, history, registry, stop, 7, kills), daemon=True))
    crash = None
    if faults == "restart":
        third = CLIENTS * MAX_OPS // 3

        def ready() -> bool:
            return done[0] >= third or time.monotonic() - started >= seconds / 3

        crash = threading.Thread(target=crasher, args=(server, url, history, stop, ready), daemon=True)
        threads.append(crash)
    for t in threads:
        t.start()
    time.sleep(seconds)
    if crash is not None:
        crash.join(90)  # the load runs on after the restart too
        time.sleep(seconds / 3)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return from_history(history.load())


def describe(ops: list[Operation]) -> str:
    kinds: dict[str, int] = {}
    for o in ops:
        label = o.kind + ("?" if o.indeterminate else "")
        kinds[label] = kinds.get(label, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))


@pytest.mark.parametrize("faults", ["kills", "restart"])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_linearizable(server: EmbeddedPostgres, db_url: str, tmp_path: Path, name: str, faults: str) -> None:
    workload = WORKLOADS[name]
    ops = run(server, db_url, workload, faults, tmp_path / "history")
    started = time.monotonic()
    with psycopg.connect(db_url) as conn:
        version = conn.info.server_version // 10000
    result = assert_linearizable(workload.model, ops, f"{name}-{faults}-pg{version}")
    print(
        f"\nFIGURE linearizability {name} with {faults}: {len(ops)} operations ({describe(ops)}), "
        f"{sum(k.steps for k in result.keys)} search steps, checked in {time.monotonic() - started:.2f} s"
    )
    # Not trivial: the clients contended, and the fault happened.
    outputs = [o.output for o in ops if o.kind in ("acquire", "claim", "cas")]
    if name in ("mutex_try", "mutex_wait", "shared_lock", "semaphore", "lease", "kv"):
        assert any(out in (False, None, "held") for out in outputs), "no call ever lost a race"
    if faults == "kills":
        assert sum(o.client == "killer" for o in ops) >= KILLS
    else:
        assert [o.kind for o in ops if o.kind == "crash"] == ["crash"]
        assert len({o.session.rpartition("@")[2] for o in ops if o.kind not in ("crash", "end_session")}) == 2


# ---------------------------------------------------------------------------
# Planted faults: the checker rejects real histories made wrong


def _renumber(ops: list[Operation], key: str, old: int, new: int) -> list[Operation]:
    """Every mention of version ``old`` of ``key`` (returned, read, named by a CAS) made ``new``."""
    out = []
    for o in ops:
        if o.key == key:
            if o.output == old and o.kind in ("set", "cas"):
                o = dataclasses.replace(o, output=new)
            elif o.kind == "get" and isinstance(o.output, list) and o.output[1] == old:
                o = dataclasses.replace(o, output=[o.output[0], new])
            if o.kind == "cas" and o.args["expected"] == old:
                o = dataclasses.replace(o, args={**o.args, "expected": new})
        out.append(o)
    return out


def test_planted_faults_are_found_in_real_histories(server: EmbeddedPostgres, db_url: str, tmp_path: Path) -> None:
    # A lock result flipped: the first acquire that got the lock reports false.
    ops = run(server, db_url, WORKLOADS["mutex_try"], "none", tmp_path / "locks", seconds=1.0)
    assert check(LockModel(), ops).ok
    won = next(o for o in ops if o.kind == "acquire" and o.output is True)
    flipped = [dataclasses.replace(o, output=False) if o is won else o for o in ops]
    assert not check(LockModel(), flipped).ok

    # A version made to go down: a set's version renumbered (everywhere it appears) below the
    # version of a set that completed before it began.  Only the ordering promise rejects it.
    ops = run(server, db_url, WORKLOADS["kv"], "none", tmp_path / "kv", seconds=1.0)
    assert check(KVModel(), ops).ok
    sets = [o for o in ops if o.kind in ("set", "cas") and isinstance(o.output, int)]
    # The first such pair with a version below the earlier set's that no set of the key returned (the versions
    # come from one sequence for every key: a key's first sets can have taken every number below theirs).
    later, lower = next(
        (b, max(free))
        for a in sets
        for b in sets
        if a.key == b.key and a.ret is not None and a.ret < b.call
        for free in [[v for v in range(1, a.output) if v not in {o.output for o in sets if o.key == a.key}]]
        if free
    )
    planted = _renumber(ops, later.key, later.output, lower)
    assert check(KVModel(versions_grow=False), planted).ok
    assert not check(KVModel(), planted).ok
