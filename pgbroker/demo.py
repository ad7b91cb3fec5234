"""``pgbroker demo``: the singleton lease at work, in a few seconds.

Broker A (a separate Python process) claims the lease; broker B is refused
and told who holds it; B then waits; A is killed with SIGKILL; B takes over
with the next epoch, and the time from the kill to B's claim is measured.
A write fenced with A's old epoch is then refused.  Then B registers a client
and subscribes it to a row of initech.objects: an application's UPDATE of
that row reaches B through the outbox.  Finally the brokers view and the
lease history are printed.

With no URL a throwaway PostgreSQL is started in a temporary directory
(:class:`pgbroker._embedded.EmbeddedPostgres`; as the ``postgres`` OS user
when run as root) and removed afterwards.  With a URL the demo installs
pgbroker there if needed, uses a lease name of its own
(``pgbroker-demo-<random>``) and at the end removes everything it wrote under
that name (the lease, its history, broker state, clients, subscriptions and
outbox rows) and its row of initech.objects; without initech.objects it says
that it skips the fan-out step.  Everything it started is stopped on the way
out, also on Ctrl-C, SIGTERM or an error.

``python -m pgbroker.demo --holder URL --name NAME`` is broker A: it claims,
prints ``CLAIMED <epoch> <backend pid>``, and holds the lease until its
standard input closes (so it never outlives the demo).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from pgbroker.install import InstallError

__all__ = ["run_demo"]

LEASE_NAME = "pgbroker-demo"
STEP_TIMEOUT = 15.0  # seconds any one step may take before the demo gives up

BROKERS_COLUMNS = [
    ("name", "name"),
    ("epoch", "epoch"),
    ("state", "state"),
    ("alive", "alive"),
    ("holder_pid", "pid"),
    ("holder_application", "application"),
    ("holder_info", "info"),
    ("claimed_at", "claimed at"),
    ("heartbeat_age", "heartbeat age"),
    ("waiting", "waiting"),
]
HISTORY_COLUMNS = [
    ("id", "id"),
    ("epoch", "epoch"),
    ("event", "event"),
    ("at", "at"),
    ("pid", "pid"),
    ("application", "application"),
    ("reason", "reason"),
]


class DemoError(Exception):
    pass


def _say(text: str = "") -> None:
    print(text, flush=True)


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """One line of the child's stdout, or DemoError after ``timeout`` seconds or at EOF."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise DemoError(f"broker A (process {proc.pid}) did not answer within {timeout:g} s")
    line = proc.stdout.readline()
    if not line:
        raise DemoError(f"broker A (process {proc.pid}) exited with code {proc.wait()} before claiming")
    return line.strip()


def _wait_for(predicate: Any, what: str, timeout: float = STEP_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise DemoError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.005)


def _on_exit(cleanup: contextlib.ExitStack, action: Callable[[], object], what: str) -> None:
    """Run ``action`` when the demo ends, whatever happens; a failure is reported, not raised."""

    def run() -> None:
        try:
            action()
        except Exception as exc:
            print(f"pgbroker demo: cleanup step failed ({what}): {type(exc).__name__}: {exc}", file=sys.stderr)

    cleanup.callback(run)


def _remove_demo_rows(conninfo: str, name: str) -> None:
    """Delete every row pgbroker keeps under the lease name ``name`` (the demo's own, unique name).

    The tables of schema pgbroker with a ``name`` column (lease, history, broker
    state, clients, interest, outbox; subscriptions go with their clients) are
    found in the catalog, so the list follows the schema.  The lease row goes last.
    """
    import psycopg
    from psycopg import sql

    with psycopg.connect(conninfo, application_name="pgbroker-demo-cleanup") as conn, conn.transaction():
        tables = conn.execute(
            """
            SELECT c.relname FROM pg_catalog.pg_class c
              JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attname = 'name' AND NOT a.attisdropped
             WHERE c.relnamespace = 'pgbroker'::regnamespace AND c.relkind IN ('r', 'p')
             ORDER BY c.relname = 'lease', c.relname
            """
        ).fetchall()
        for (table,) in tables:
            conn.execute(sql.SQL("DELETE FROM {} WHERE name = %s").format(sql.Identifier("pgbroker", table)), (name,))
    _say(f'Removed what the demo wrote under lease "{name}" (lease, history, clients, subscriptions).')


def _demo(url: str, name: str, cleanup: contextlib.ExitStack, *, own_server: bool) -> None:
    import psycopg

    from pgbroker import install
    from pgbroker.broker import ASSERT_SQL, Broker, lease_history, list_brokers
    from pgbroker.cli import format_table
    from pgbroker.errors import LeaseHeld, StaleEpoch, translate

    before = install.installed_version(url)
    now = install.migrate(url).schema_version
    if before is None:
        how = "" if own_server else " (remove it with: pgbroker downgrade --url ...)"
        _say(f"  installed pgbroker (schema version {now}){how}")
    else:
        _say(f"  pgbroker is installed (schema version {now})")
    conninfo = install.libpq_url(url)
    if not own_server:
        _on_exit(cleanup, lambda: _remove_demo_rows(conninfo, name), "remove the demo's rows")
    with psycopg.connect(conninfo, autocommit=True, application_name="pgbroker-demo-observer") as admin:
        _say()

        # 1. Broker A, in a process of its own.
        holder = subprocess.Popen(
            [sys.executable, "-m", "pgbroker.demo", "--holder", url, "--name", name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        _on_exit(cleanup, lambda: _stop_process(holder), "stop broker A")
        line = _read_line(holder, STEP_TIMEOUT)
        if not line.startswith("CLAIMED "):
            raise DemoError(f"broker A said {line!r}")
        _, epoch_a_text, pid_a_text = line.split()
        epoch_a, pid_a = int(epoch_a_text), int(pid_a_text)
        _say(f'1. Broker A (process {holder.pid}, backend pid {pid_a}) claims lease "{name}": epoch {epoch_a}.')

        # 2. Broker B is refused.
        _say("2. Broker B claims with wait => 0 and is refused at once:")
        try:
            Broker(conninfo, name, application_name="pgbroker-demo-B", sweep=False).claim()
        except LeaseHeld as exc:
            _say(f"     LeaseHeld (SQLSTATE {exc.sqlstate}): {exc}")
            _say(f"     detail: {exc.detail}")
        else:
            raise DemoError("broker B was not refused")

        # 3. Broker B waits.
        # The demo's brokers neither sweep nor run the upkeep (sweep=False): on a database of yours they change
        # nothing but what the demo itself wrote, which it removes at the end.
        b = Broker(conninfo, name, wait=None, application_name="pgbroker-demo-B", sweep=False)
        _on_exit(cleanup, b.close, "close broker B")
        claimed: dict[str, Any] = {}

        def claim_b() -> None:
            try:
                b.claim()
                claimed["at"] = time.monotonic()
            except BaseException as exc:  # reported by the main thread
                claimed["error"] = exc

        waiter = threading.Thread(target=claim_b, name="pgbroker-demo-B", daemon=True)
        waiter.start()

        def b_is_waiting() -> bool:
            if claimed:
                return True
            return any(row["name"] == name and row["waiting"] >= 1 for row in list_brokers(admin))

        _wait_for(b_is_waiting, "broker B to block")
        if "error" in claimed:
            raise DemoError(f"broker B failed: {claimed['error']!r}")
        _say("3. Broker B claims with wait => NULL: it blocks, waiting for A (brokers.waiting = 1).")

        # 4. Kill A.
        killed_at = time.monotonic()
        os.kill(holder.pid, signal.SIGKILL)
        _say(f"4. kill -9 {holder.pid}: broker A dies without a word to the server.")
        waiter.join(STEP_TIMEOUT)
        if "at" not in claimed:
            raise DemoError(f"broker B did not take over: {claimed.get('error', 'still waiting')!r}")
        took_ms = (claimed["at"] - killed_at) * 1000
        holder.wait(STEP_TIMEOUT)

        # 5. B holds it, with the next epoch.
        _say(
            f"5. Broker B (backend pid {b.pid}) took over: epoch {b.epoch} (A had {epoch_a}), "
            f"{took_ms:.1f} ms after the kill."
        )

        # 6. Fencing: A's epoch no longer passes broker_assert().
        try:
            with admin.transaction():
                admin.execute(ASSERT_SQL, {"name": name, "epoch": epoch_a})
        except psycopg.Error as exc:
            error = translate(exc)
            if not isinstance(error, StaleEpoch):
                raise
            _say(f"6. A write fenced with A's epoch {epoch_a} is refused: StaleEpoch (SQLSTATE {error.sqlstate}):")
            _say(f"     {error}")
        else:
            raise DemoError(f"broker_assert accepted the stale epoch {epoch_a}")
        with admin.transaction():
            b.assert_epoch(admin)
        _say(f"   The same write fenced with B's epoch {b.epoch} passes.")

        # 7. Fan-out: the database tells broker B which client must hear of a change.
        if admin.execute("SELECT to_regclass('initech.objects')").fetchone()[0] is not None:
            _fan_out(admin, b)
        else:
            _say(
                "7. Skipped: the fan-out step subscribes a client to a row of initech.objects, and this database "
                "has no such table (pgbroker was installed without it: --no-initech or -x initech=no)."
            )

        _say()
        _say("pgbroker.brokers:")
        _say(format_table([r for r in list_brokers(admin) if r["name"] == name], BROKERS_COLUMNS, indent="  "))
        _say()
        _say("pgbroker.lease_history (this run):")
        _say(format_table(lease_history(admin, name), HISTORY_COLUMNS, indent="  "))
        _say()
        _say(f"Takeover after SIGKILL of the holder: {took_ms:.1f} ms.")


def _fan_out(admin: Any, b: Any) -> None:
    """Step 7: a client subscribes to a row of initech.objects; an application's UPDATE reaches broker B."""
    row_id = -4242  # a demo row, removed again at the end
    created = admin.execute(
        "INSERT INTO initech.objects (id, name) VALUES (%s, 'pgbroker demo row') ON CONFLICT (id) DO NOTHING",
        (row_id,),
    ).rowcount
    try:
        b.register("demo-client", {"addr": "127.0.0.1:9000"})
        b.subscribe("demo-client", "initech.objects", row_id)
        _say(f'7. Broker B registers client "demo-client" and subscribes it to initech.objects row {row_id}.')
        started = time.monotonic()
        admin.execute("UPDATE initech.objects SET name = 'changed by the application' WHERE id = %s", (row_id,))
        batch = next(iter(b.notifications(poll_interval=1.0)))
        took = (time.monotonic() - started) * 1000
        for n in batch:
            _say(f"   An application UPDATEs that row; B is woken and reads from the outbox, {took:.1f} ms later:")
            _say(f"     op {n.op}, table {n.table}, key {n.key}, changed {n.changed}, tell {n.clients}")
        b.ack([n.id for n in batch])
        b.unregister("demo-client")
    finally:
        if created:
            admin.execute("DELETE FROM initech.objects WHERE id = %s", (row_id,))


def _stop_process(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(5)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()


class _Signals:
    """SIGINT and SIGTERM stop the demo (KeyboardInterrupt / SystemExit), except
    inside :meth:`deferred` blocks (server start-up, clean-up), where they wait
    until the block ends, so that nothing is left half started."""

    def __init__(self) -> None:
        self._depth = 0
        self._pending: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._depth:
            self._pending.append(signum)
        else:
            self._raise(signum)

    @staticmethod
    def _raise(signum: int) -> None:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    @contextlib.contextmanager
    def deferred(self, *, then_raise: bool = True) -> Iterator[None]:
        """Hold signals back during the block; then act on the first one (or drop them)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if not self._depth and self._pending:
            signum = self._pending[0]
            self._pending.clear()
            if then_raise:
                self._raise(signum)


def run_demo(url: str | None = None, name: str | None = None) -> int:
    """Run the demo; return the exit code (0: it all worked, 130: interrupted, 143: terminated).

    ``name`` is the lease name: ``pgbroker-demo`` on a throwaway server, a fresh
    ``pgbroker-demo-<random>`` in a given database (so that no one else's lease is touched).
    """
    started = time.monotonic()
    code = 1
    with _Signals() as signals:
        cleanup = contextlib.ExitStack()
        try:
            _say("pgbroker demo: one broker at a time, whatever happens to it.")
            own_server = url is None
            if url is None:
                from pgbroker._embedded import EmbeddedPostgres

                server = EmbeddedPostgres()
                with signals.deferred():
                    server.start()  # removes what it made if it fails
                    _on_exit(cleanup, server.stop, "stop the throwaway PostgreSQL")
                url = server.url
                name = name or LEASE_NAME
                import psycopg

                with psycopg.connect(url) as conn:
                    version = conn.execute("SHOW server_version").fetchone()[0].split()[0]
                _say(f"  started a throwaway PostgreSQL {version} from {server.bin_dir}")
                _say(f"  at {url} (data in {server.datadir})")
            else:
                from pgbroker.install import describe

                name = name or f"{LEASE_NAME}-{secrets.token_hex(4)}"
                _say(f"  using {describe(url)}, lease name {name!r}")
            _demo(url, name, cleanup, own_server=own_server)
            code = 0
        except KeyboardInterrupt:
            print("pgbroker demo: interrupted; cleaning up", file=sys.stderr)
            code = 130
        except SystemExit as exc:
            print("pgbroker demo: terminated; cleaning up", file=sys.stderr)
            code = exc.code if isinstance(exc.code, int) else 1
        except DemoError as exc:
            print(f"pgbroker demo failed: {exc}", file=sys.stderr)
        except InstallError as exc:  # bad URL, unreachable server, missing database
            print(f"pgbroker demo failed: {exc}", file=sys.stderr)
        except Exception as exc:
            print(f"pgbroker demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            with signals.deferred(then_raise=False):  # we are on our way out anyway
                cleanup.close()
    if code == 0:
        _say(f"Done in {time.monotonic() - started:.1f} s; everything the demo started is stopped.")
    return code


def _holder(url: str, name: str) -> int:
    """Broker A: claim, report, hold until stdin closes."""
    from pgbroker.broker import Broker

    with Broker(url, name, application_name="pgbroker-demo-A", sweep=False) as broker:
        print(f"CLAIMED {broker.epoch} {broker.pid}", flush=True)
        sys.stdin.read()  # EOF when the demo ends or dies
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pgbroker.demo")
    parser.add_argument("--url", help="run against this database (default: a throwaway PostgreSQL)")
    parser.add_argument("--holder", metavar="URL", help="internal: be broker A against URL")
    parser.add_argument("--name", help=f"lease name (default: {LEASE_NAME}, or {LEASE_NAME}-<random> with --url)")
    args = parser.parse_args(argv)
    if args.holder:
        return _holder(args.holder, args.name)
    return run_demo(args.url, args.name)


if __name__ == "__main__":
    sys.exit(main())
