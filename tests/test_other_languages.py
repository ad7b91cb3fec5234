"""The broker loop of sql/README.md ("The loop from any language") in four languages: psql alone
(one psql session claims, LISTENs and drains the outbox turn after turn while an application writes),
Node.js with the pg package (the README's block), Go with lib/pq and Java with PgJDBC (the programs in
tests/other_languages/).  Where a toolchain is missing the test says why and skips; in CI (CI=true,
where .ci/run installs them all) that is a failure."""

from __future__ import annotations

import inspect
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest
from docs_util import REPO, code_blocks, section
from fanout_util import seed_objects
from lease_util import wait_until

from pgbroker import AsyncBroker, Broker
from pgbroker._embedded import psql_path

SQL_README = REPO / "sql" / "README.md"
SECTION = "### The loop from any language"
PSQL = psql_path()


def readme_loop() -> tuple[str, str]:
    """The ```psql block, as (setup, one turn of the loop)."""
    (block,) = code_blocks(section(SQL_README.read_text(), SECTION), "psql")
    setup, turn = block.split("-- turn:", 1)
    return setup, "-- turn:" + turn


class Psql:
    """One interactive psql session fed through a pipe; its output read line by line."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen(
            [str(PSQL), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.pending = ""

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text if text.endswith("\n") else text + "\n")
        self.proc.stdin.flush()

    def read_until(self, prefix: str, timeout: float = 30) -> list[str]:
        """Lines printed up to and including the first that starts with ``prefix``."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        lines: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            while "\n" in self.pending:
                line, self.pending = self.pending.split("\n", 1)
                lines.append(line)
                if line.startswith(prefix):
                    return lines
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(fd, 65536) if ready else b""
            if not chunk:
                raise AssertionError(f"psql printed no line starting with {prefix!r}; it printed {lines}")
            self.pending += chunk.decode()

    def close(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        code = self.proc.wait(timeout=30)
        self.proc.stdout.close()
        return code


@pytest.mark.skipif(PSQL is None, reason="psql is not installed (Debian: apt-get install postgresql-client)")
def test_the_readme_broker_loop_runs_in_psql_alone(db_url, connect):
    setup, turn = readme_loop()
    psql = Psql(db_url)
    try:
        psql.send(setup)
        psql.send(turn)
        lines = psql.read_until("sleep: ")
        assert "batch: " in lines and lines[-1] == "sleep: asleep", lines

        obs = connect("obs")
        holder = obs.execute("SELECT holder_application, alive FROM pgbroker.brokers WHERE name = 'psql-broker'")
        assert holder.fetchone() == ("psql", True)

        app = connect("app")
        app.execute("INSERT INTO initech.objects (id, name) VALUES (7, 'seven'), (8, 'eight')")
        app.execute("UPDATE initech.objects SET name = 'new' WHERE id = 7")

        # The broker was asleep: the writer woke it.  psql shows the notification after its next command.
        channel = obs.execute("SELECT pgbroker.wakeup_channel('psql-broker')").fetchone()[0]
        psql.send("SELECT 'poll';")
        lines = psql.read_until("Asynchronous notification")
        assert lines[-1].startswith(f'Asynchronous notification "{channel}" with payload "psql-broker" received')

        psql.send(turn)
        lines = psql.read_until("sleep: ")
        assert "batch: I 7 {c1}; U 7 {c1}" in lines and lines[-1] == "sleep: asleep", lines
        assert obs.execute("SELECT count(*) FROM pgbroker.outbox_pending WHERE name = 'psql-broker'").fetchone()[0] == 0

        psql.send(turn)
        lines = psql.read_until("sleep: ")
        assert "batch: " in lines and lines[-1] == "sleep: asleep", lines

        # Writers at every isolation level, the turns fed back to back: every change of row 7 reaches c1.
        app.execute("INSERT INTO initech.objects (id, name) VALUES (9, 'nine')")  # nobody subscribes to it
        told: list[str] = []
        committed: Counter = Counter()
        writers = threading.Thread(target=lambda: committed.update(write_at_every_isolation_level(connect, [7], [9])))
        writers.start()
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, "psql did not drain the outbox"
            # Drained means an empty batch from a turn that began after the last commit: a turn under way
            # while the writers finish may miss their last one.
            writers_done = not writers.is_alive()
            psql.send(turn)
            told += [line for line in psql.read_until("sleep: ") if line.startswith("batch: ")]
            if writers_done and told[-1:] == ["batch: "]:
                break
        writers.join()
        rows = [row for line in told for row in line.removeprefix("batch: ").split("; ") if row]
        assert committed[7] > 0 and rows == ["U 7 {c1}"] * committed[7], (committed, Counter(rows))
    finally:
        code = psql.close()
    assert code == 0
    # The session ended: so did the lease (once the server has seen it end).
    wait_until(
        lambda: obs.execute("SELECT alive FROM pgbroker.brokers WHERE name = 'psql-broker'").fetchone() == (False,),
        timeout=30,
        what="the psql session's lease to end with it",
    )


def _skip(reason: str) -> None:
    """Skip, saying why; in CI (CI=true, where .ci/run installs every toolchain) that is a failure."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run this broker loop: {reason}")
    print(f"skipped: {reason}")
    pytest.skip(reason)


class Program:
    """A broker program run as a child process: its stdout, one JSON object a line, read by a thread."""

    def __init__(self, argv: list[str], *, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[dict[str, Any]] = []
        self.err: str | None = None
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(json.loads(line))
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def first(self, key: str, timeout: float = 60) -> dict[str, Any]:
        """The first line with ``key``, waiting for it."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                found = [line for line in self.lines if key in line]
                if found:
                    return found[0]
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self.reader.is_alive()):
                    raise AssertionError(f"{self.argv[0]} printed no {key!r} line: {self.lines[-5:]} {self.stderr()}")
                self.changed.wait(min(left, 0.2))

    def rows(self) -> list[dict[str, Any]]:
        """The notifications it printed so far."""
        with self.changed:
            return [line for line in self.lines if "op" in line]

    def stderr(self) -> str:
        """What it printed on stderr, once it has ended."""
        if self.err is None and self.proc.poll() is not None and self.proc.stderr is not None:
            self.err = self.proc.stderr.read()
        return self.err or ""

    def stop(self, sig: int | None = signal.SIGTERM) -> int:
        """Its exit code, once it has ended: sent ``sig`` if still running (None: let it end by itself)."""
        if sig is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout=60)
        self.reader.join(10)
        self.stderr()
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        return code


ISOLATIONS = ("READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE")


def write_at_every_isolation_level(
    connect: Any, subscribed: list[int], others: list[int], seconds: float = 3.0
) -> Counter:
    """Three writers, one per isolation level, each committing UPDATEs of a subscribed row of initech.objects
    with a row nobody is subscribed to, as an application writes them; the committed changes per key."""
    committed: Counter = Counter()
    errors: list[BaseException] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def write(n: int) -> None:
        rnd = random.Random(n)
        try:
            with connect(f"writer {n}", autocommit=False) as conn:
                while time.monotonic() < stop:
                    keys = sorted({rnd.choice(subscribed), rnd.choice(others)})
                    try:
                        conn.execute(f"BEGIN ISOLATION LEVEL {ISOLATIONS[n % 3]}")
                        conn.execute("UPDATE initech.objects SET name = random()::text WHERE id = ANY (%s)", [keys])
                        conn.commit()
                    except (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected):
                        conn.rollback()
                        continue
                    with lock:
                        committed.update(keys)
                    time.sleep(rnd.random() * 0.004)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert all(committed[k] for k in subscribed), committed
    return committed


def assert_every_pair_told(program: Program, subscribers: dict[int, set[str]], committed: Counter) -> None:
    """Every committed change of a subscribed row reached each of its subscribers once, and nobody else."""

    def told() -> Counter:
        pairs: Counter = Counter()
        for row in program.rows():
            for client in row["clients"]:
                pairs[(row["key"], client)] += 1
        return pairs

    deadline = time.monotonic() + 30
    while any(told()[(k, c)] < committed[k] for k, cs in subscribers.items() for c in cs):
        if time.monotonic() > deadline or program.proc.poll() is not None:
            break
        time.sleep(0.05)
    rows = program.rows()
    bad = [row for row in rows if not row["clients"] or row["key"] not in subscribers]
    assert bad == [], f"{len(bad)} rows without clients or for rows nobody is subscribed to, e.g. {bad[:5]}"
    pairs = told()
    missing = {(k, c): committed[k] - pairs[(k, c)] for k, cs in subscribers.items() for c in cs}
    assert all(v == 0 for v in missing.values()), f"(change, client) pairs missing (or doubled, < 0): {missing}"
    strays = {pair for pair in pairs if pair[1] not in subscribers.get(pair[0], ())}
    assert strays == set(), f"clients told of rows they are not subscribed to: {strays}"


NODE = shutil.which("node")


def readme_node_broker() -> str:
    """The ```js block."""
    (block,) = code_blocks(section(SQL_README.read_text(), SECTION), "js")
    return block


def node_broker(db_url: str, tmp_path: Path, *args: str) -> Program:
    if NODE is None:
        _skip("node is not installed (Debian: apt-get install nodejs), so the Node.js broker loop is not run")
    found = subprocess.run([NODE, "-e", "require.resolve('pg')"], capture_output=True, timeout=60)
    if found.returncode != 0:
        _skip("node's pg package is not installed (npm install pg, and NODE_PATH=<its node_modules>)")
    script = tmp_path / "broker.js"
    script.write_text(readme_node_broker())
    return Program([NODE, str(script), db_url, *args])


def test_the_readme_broker_loop_runs_in_node(db_url, connect, tmp_path):
    app = connect("app")
    app.execute("INSERT INTO initech.objects (id, name) VALUES (9, 'nine')")  # nobody subscribes to it
    broker = node_broker(db_url, tmp_path, "60")
    try:
        ready = broker.first("ready")
        obs = connect("obs")
        row = obs.execute("SELECT epoch, holder_application, alive FROM pgbroker.brokers WHERE name = 'node-broker'")
        assert row.fetchone() == (ready["epoch"], "node-broker", True)

        app.execute("INSERT INTO initech.objects (id, name) VALUES (7, 'seven'), (8, 'eight')")
        app.execute("UPDATE initech.objects SET name = 'new' WHERE id = 7")
        app.execute("DELETE FROM initech.objects WHERE id = 8")
        wait_until(lambda: len(broker.rows()) >= 2, timeout=30, what="the Node.js broker's first two rows")
        assert broker.rows() == [{"op": "I", "key": 7, "clients": ["c1"]}, {"op": "U", "key": 7, "clients": ["c1"]}]

        # Writers at every isolation level: every change of row 7 reaches c1, none of row 9 is fetched.
        committed = write_at_every_isolation_level(connect, [7], [9])
        committed[7] += 2  # the INSERT and the UPDATE above
        assert_every_pair_told(broker, {7: {"c1"}}, committed)

        # The broker acknowledges with its next fetch: the outbox empties.
        wait_until(
            lambda: (
                obs.execute("SELECT count(*) FROM pgbroker.outbox_pending WHERE name = 'node-broker'").fetchone()
                == (0,)
            ),
            timeout=10,
            what="the Node.js broker to acknowledge its batch",
        )
        assert broker.proc.poll() is None, broker.stderr()
    finally:
        broker.stop()


def test_the_node_loop_keeps_a_wakeup_that_arrives_while_it_sweeps(db_url, connect, tmp_path):
    """A NOTIFY that reaches the Node.js broker between its broker_sleep and its wait (here: while its
    broker_sweep is held up) still wakes it: with a 60 s poll interval the row arrives at once."""
    broker = node_broker(db_url, tmp_path, "90", "60000")
    try:
        broker.first("ready")
        obs, app = connect("obs"), connect("app")
        # Asleep: it has called broker_sleep, and waits for a NOTIFY.
        wait_until(
            lambda: (
                obs.execute(
                    "SELECT state = 'idle' AND query LIKE '%broker_sweep%' FROM pg_stat_activity"
                    " WHERE application_name = 'node-broker'"
                ).fetchone()
                == (True,)
            ),
            timeout=30,
            what="the Node.js broker asleep",
        )
        blocker = connect("blocker", autocommit=False)
        blocker.execute("LOCK TABLE pgbroker.state IN ACCESS EXCLUSIVE MODE")  # its next sweep waits here
        app.execute("INSERT INTO initech.objects (id, name) VALUES (7, 'seven')")  # wakes it: it sweeps
        wait_until(
            lambda: (
                obs.execute(
                    "SELECT wait_event_type = 'Lock' AND query LIKE '%broker_sweep%' FROM pg_stat_activity"
                    " WHERE application_name = 'node-broker'"
                ).fetchone()
                == (True,)
            ),
            timeout=30,
            what="the Node.js broker's sweep to wait for the lock",
        )
        app.execute("UPDATE initech.objects SET name = 'new' WHERE id = 7")  # notifies, during the sweep
        time.sleep(0.2)
        blocker.rollback()
        wait_until(lambda: len(broker.rows()) >= 2, timeout=20, what="the change notified during the sweep")
        assert [(r["op"], r["key"]) for r in broker.rows()] == [("I", 7), ("U", 7)]
    finally:
        broker.stop()


PROGRAMS = REPO / "tests" / "other_languages"
GOPATH = Path("/usr/share/gocode")  # Debian's golang-github-lib-pq-dev
PGJDBC = Path("/usr/share/java/postgresql.jar")  # Debian's libpostgresql-jdbc-java


class Built:
    """A broker program, built: its command line and the URL form its driver takes."""

    def __init__(self, language: str, argv: list[str]) -> None:
        self.language, self.argv = language, argv

    def url(self, pg_server: Any, db_name: str) -> str:
        host, port = pg_server.host, pg_server.port
        if self.language == "go":  # lib/pq asks for TLS unless told otherwise, unlike libpq
            return f"postgresql://postgres@{host}:{port}/{db_name}?sslmode=disable"
        return f"jdbc:postgresql://{host}:{port}/{db_name}?user=postgres"

    def start(self, pg_server: Any, db_name: str, *args: str) -> Program:
        return Program([*self.argv, self.url(pg_server, db_name), *args])


@pytest.fixture(scope="module", params=["go", "java"])
def program(request, tmp_path_factory) -> Built:
    """The Go and the Java broker programs of tests/other_languages/, built once per module, offline."""
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "go":
        go = shutil.which("go")
        if go is None or not (GOPATH / "src/github.com/lib/pq").is_dir():
            _skip("go or lib/pq is not installed (Debian: apt-get install golang-go golang-github-lib-pq-dev)")
        # GOPATH mode on Debian's packaged sources: nothing is downloaded.
        env = {**os.environ, "GO111MODULE": "off", "GOPATH": str(GOPATH), "GOCACHE": str(out / "cache"), "GOFLAGS": ""}
        binary = out / "broker"
        subprocess.run([go, "build", "-o", str(binary), str(PROGRAMS / "broker.go")], env=env, check=True, timeout=600)
        return Built("go", [str(binary)])
    java, javac = shutil.which("java"), shutil.which("javac")
    if java is None or javac is None or not PGJDBC.is_file():
        _skip("javac or PgJDBC is not installed (Debian: apt-get install default-jdk-headless libpostgresql-jdbc-java)")
    subprocess.run([javac, "-d", str(out), "-cp", str(PGJDBC), str(PROGRAMS / "Broker.java")], check=True, timeout=600)
    return Built("java", [java, "-cp", f"{out}:{PGJDBC}", "Broker"])


def test_a_broker_in_go_and_java_claims_refuses_drains_and_takes_over(program, pg_server, db_name, connect):
    """The program claims; a second instance is refused (55P03, naming the first); against writers of every
    isolation level it tells every subscribed client of every committed change and nobody else; a standby
    that waits takes over once the first is SIGKILLed, and delivers."""
    admin = connect("admin")
    seed_objects(admin, range(1, 9))
    subscribers = {1: {"a"}, 2: {"a", "b"}, 3: {"b"}, 4: {"c"}}  # rows 5 to 8: nobody
    subs = [f"{c}={k}" for k, cs in subscribers.items() for c in sorted(cs)]
    first = program.start(pg_server, db_name, "lang-broker", "0", "300", *subs)
    standby: Program | None = None
    try:
        ready = first.first("ready")
        row = admin.execute("SELECT epoch, holder_pid, alive FROM pgbroker.brokers WHERE name = 'lang-broker'")
        assert row.fetchone() == (ready["epoch"], ready["pid"], True)

        second = program.start(pg_server, db_name, "lang-broker", "0", "10", *subs)
        refused = second.first("refused")
        assert second.stop(None) == 3
        assert refused["refused"] == "55P03" and refused["holder"]["pid"] == ready["pid"], refused

        committed = write_at_every_isolation_level(connect, list(subscribers), [5, 6, 7, 8])
        assert_every_pair_told(first, subscribers, committed)
        wait_until(  # the last batch is acknowledged by the fetch after it
            lambda: admin.execute("SELECT count(*) FROM pgbroker.outbox WHERE name = 'lang-broker'").fetchone() == (0,),
            timeout=10,
            what="the broker to acknowledge its last batch",
        )

        standby = program.start(pg_server, db_name, "lang-broker", "60 s", "300", *subs)
        wait_until(
            lambda: admin.execute("SELECT waiting FROM pgbroker.brokers WHERE name = 'lang-broker'").fetchone()[0],
            timeout=60,
            what="the standby to wait for the lease",
        )
        killed = time.monotonic()
        first.stop(signal.SIGKILL)
        took = standby.first("ready")
        print(f"{program.language}: took over {1000 * (time.monotonic() - killed):.0f} ms after the SIGKILL")
        assert took["epoch"] > ready["epoch"]
        row = admin.execute("SELECT epoch, holder_pid, alive FROM pgbroker.brokers WHERE name = 'lang-broker'")
        assert row.fetchone() == (took["epoch"], took["pid"], True)
        admin.execute("UPDATE initech.objects SET name = 'after' WHERE id IN (4, 5)")
        wait_until(standby.rows, timeout=30, what="the new broker's first row")
        assert [(r["op"], r["key"], r["clients"]) for r in standby.rows()] == [("U", 4, ["c"])]
    finally:
        first.stop(signal.SIGKILL)
        if standby is not None:
            standby.stop()


def test_the_primitives_from_go_and_java(program, pg_server, db_name, connect):
    """A lock, a key-value compare-and-set (won, then lost), a counter and a rate limit, and a bad argument
    caught by its SQLSTATE; what they did is in the database."""
    done = program.start(pg_server, db_name, "primitives")
    result = done.first("bad")
    assert done.stop(None) == 0, done.stderr()
    first, second, third_won = result["kv"]
    assert result["lock"] == [True, True]
    assert second > first and third_won is False
    assert result["counter"] == 5 and result["rate_limit"] == [True, 1] and result["bad"] == "22023"
    obs = connect("obs")
    assert obs.execute("SELECT value, version FROM pgbroker.kv_get('lang/key')").fetchone() == ({"n": 2}, second)
    assert obs.execute("SELECT pgbroker.counter_get('lang/counter')").fetchone() == (5,)
    row = obs.execute("SELECT allowed, denied FROM pgbroker.rate_limits WHERE name = 'lang/rate'").fetchone()
    assert row == (1, 0)
    assert obs.execute("SELECT count(*) FROM pgbroker.locks WHERE name = 'lang/lock'").fetchone() == (0,)
    if program.language == "java":
        # PgJDBC sends a String as varchar: uncast, kv_set's jsonb is not found (42883) though pgbroker is installed.
        assert result["uncast"] == "42883"
        assert result["installed"] == obs.execute("SELECT pgbroker.schema_version()").fetchone()[0]
        assert obs.execute("SELECT count(*) FROM pgbroker.kv WHERE key = 'lang/other'").fetchone() == (0,)


def test_every_loop_runs_the_python_brokers_constants(connect):
    """sql/README.md's loop, the Node.js block and the Go and Java programs use the constants the Python
    Broker.notifications() runs with: when one changes, this says which text to change with it."""
    params = inspect.signature(Broker.notifications).parameters
    assert inspect.signature(AsyncBroker.notifications).parameters.keys() == params.keys()
    source = inspect.getsource(AsyncBroker.notifications)
    python = {
        "max_rows": params["max_rows"].default,
        "batch_delay": round(params["batch_delay"].default * 1000),
        "linger": round(params["linger"].default * 1000),
        "linger_step": 1 if "min(0.001, linger)" in source else None,
        "busy": 50 if "min(poll_interval, 0.05)" in source else None,
        "poll": round(params["poll_interval"].default * 1000),
    }
    assert python == {"max_rows": 1000, "batch_delay": 2, "linger": 5, "linger_step": 1, "busy": 50, "poll": 1000}
    sleep_args = connect("obs").execute("SELECT pg_get_function_arguments('pgbroker.broker_sleep'::regproc)")
    assert "'00:00:00.02'::interval" in sleep_args.fetchone()[0]  # the loop's "its wait: 20 ms"

    readme = section(SQL_README.read_text(), "### The loop, exactly")
    (loop,) = code_blocks(readme, "text")
    for text in (
        f"outbox_fetch(name, {python['max_rows']}, ack => ack)",
        f"if fewer than {python['max_rows']} rows: pause {python['batch_delay']} ms",
        f"< {python['linger']} ms: pause {python['linger_step']} ms",
        "its wait: 20 ms",
        f"at most {python['poll'] // 1000} s ('asleep') or {python['busy']} ms ('busy')",
    ):
        assert text in loop, f"sql/README.md's loop should say {text!r}"

    def numbers(text: str, pattern: str) -> dict[str, int]:
        return {name.lower(): int(value) for name, value in re.findall(pattern, text)}

    node = numbers(readme_node_broker(), r"\b([A-Z_]+) = (\d+)")
    node["poll"] = int(re.search(r"Number\(process\.argv\[4\] \|\| (\d+)\)", readme_node_broker()).group(1))
    go = numbers((PROGRAMS / "broker.go").read_text(), r"\b(\w+)\s+= (\d+)(?: \* time\.Millisecond)?\b")
    java = numbers((PROGRAMS / "Broker.java").read_text(), r"\b([A-Z_]+) = (\d+)")
    for language, found, names in (
        (
            "Node.js",
            node,
            {
                "max_rows": "max_rows",
                "batch_delay": "batch_delay",
                "linger": "linger",
                "linger_step": "linger_step",
                "busy": "busy_wait",
                "poll": "poll",
            },
        ),
        (
            "Go",
            go,
            {
                "max_rows": "maxrows",
                "batch_delay": "batchdelay",
                "linger": "linger",
                "linger_step": "lingerstep",
                "busy": "busywait",
                "poll": "pollwait",
            },
        ),
        (
            "Java",
            java,
            {
                "max_rows": "max_rows",
                "batch_delay": "batch_delay",
                "linger": "linger",
                "linger_step": "linger_step",
                "busy": "busy_wait",
                "poll": "poll_wait",
            },
        ),
    ):
        got = {ours: found.get(theirs) for ours, theirs in names.items()}
        assert got == {ours: python[ours] for ours in names}, f"the {language} loop's constants: {got}"
