"""The broker loop of sql/README.md ("The loop from any language"), run by psql
alone (one psql session claims, LISTENs and drains the outbox turn after turn while an
application writes) and by Node.js with the pg package (skipped, saying why, where node or pg
is not installed)."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import time

import pytest
from docs_util import REPO, code_blocks, section

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
        assert "batch: I 7; U 7" in lines and lines[-1] == "sleep: asleep", lines
        assert obs.execute("SELECT count(*) FROM pgbroker.outbox_pending WHERE name = 'psql-broker'").fetchone()[0] == 0

        psql.send(turn)
        lines = psql.read_until("sleep: ")
        assert "batch: " in lines and lines[-1] == "sleep: asleep", lines
    finally:
        code = psql.close()
    assert code == 0
    # The session ended: so did the lease.
    assert obs.execute("SELECT alive FROM pgbroker.brokers WHERE name = 'psql-broker'").fetchone()[0] is False


NODE = shutil.which("node")


def readme_node_broker() -> str:
    """The ```js block."""
    (block,) = code_blocks(section(SQL_README.read_text(), SECTION), "js")
    return block


def _skip(reason: str) -> None:
    """Skip, saying why; in CI (CI=true, where .ci/run installs node and pg) that is a failure."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the Node.js broker loop: {reason}")
    print(f"skipped: {reason}")
    pytest.skip(reason)


def test_the_readme_broker_loop_runs_in_node(db_url, connect, tmp_path):
    if NODE is None:
        _skip("node is not installed (Debian: apt-get install nodejs), so the Node.js broker loop is not run")
    env = dict(os.environ)
    found = subprocess.run([NODE, "-e", "require.resolve('pg')"], env=env, capture_output=True, timeout=60)
    if found.returncode != 0:
        _skip("node's pg package is not installed (npm install pg, and NODE_PATH=<its node_modules>)")
    script = tmp_path / "broker.js"
    script.write_text(readme_node_broker())
    proc = subprocess.Popen([NODE, str(script), db_url, "60"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        ready = json.loads(proc.stdout.readline() or "null")
        assert ready is not None and ready["ready"] is True, proc.stderr.read()
        obs = connect("obs")
        row = obs.execute("SELECT epoch, holder_application, alive FROM pgbroker.brokers WHERE name = 'node-broker'")
        assert row.fetchone() == (ready["epoch"], "node-broker", True)

        app = connect("app")
        app.execute("INSERT INTO initech.objects (id, name) VALUES (7, 'seven'), (8, 'eight')")
        app.execute("UPDATE initech.objects SET name = 'new' WHERE id = 7")
        app.execute("DELETE FROM initech.objects WHERE id = 8")
        delivered = [json.loads(proc.stdout.readline()) for _ in range(2)]
        assert delivered == [{"op": "I", "key": 7}, {"op": "U", "key": 7}]

        # The broker acknowledges with its next fetch: the outbox empties.
        deadline = time.monotonic() + 10
        while obs.execute("SELECT count(*) FROM pgbroker.outbox_pending WHERE name = 'node-broker'").fetchone()[0]:
            assert time.monotonic() < deadline, "the Node.js broker did not acknowledge its batch"
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
