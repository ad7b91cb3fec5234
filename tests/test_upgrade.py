"""Upgrading a live install: each release's revisions, exactly as released, upgraded to HEAD under load.

* For every release in migrations/released.json: its files are checked
  against their checksums, the database is built by its revisions, and it is
  upgraded to HEAD while a Broker drains, three writers (READ COMMITTED,
  REPEATABLE READ, SERIALIZABLE) write to a watched table and three clients
  are subscribed, with a long transaction holding a lock the upgrade needs.
  Checked: the upgrade gave way and retried, the writers' longest stall is
  within the documented bound (lock_timeout plus the revision's run time,
  checked generously), no (change, client) pair is missing, the Broker kept
  its lease and epoch, the catalog equals a fresh install of HEAD, and the
  downgrade gives back the release's catalog.
* Right after 0.1.0, HEAD *is* 0.1.0, so the test adds a **practice revision
  that lives only here** (a copy of migrations/ with one more revision): it
  replaces a function the watch triggers call on every write
  (``pgbroker._epoch_alive``) and adds an index to ``pgbroker.outbox``, whose
  ShareLock every writer's trigger conflicts with, and sets schema_version()
  to the next number after HEAD's (``0.1.0+4`` after revision 0003), as
  migrations/new_revision.py would.  The real revisions take the same path.
* A long transaction the upgrade cannot get past: it gives up after its
  retries with one line, nothing changed, and writers were never queued
  behind it.
* Version mismatch both ways: this package against a newer schema (the
  practice revision's) works, with a warning, and a function it calls that
  a newer schema dropped is SchemaMismatch naming both versions, never 42883;
  against an older schema it does not support, SchemaMismatch at claim();
  doctor and the console's health page say so, with the command that fixes
  it.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psycopg
import pytest
from alembic import command
from test_cli import pgbroker as pgbroker_cli
from test_migrations import _module_from, diff_snapshots, snapshot

import pgbroker
from pgbroker import install
from pgbroker._embedded import free_port
from pgbroker.errors import SchemaMismatch
from tests.lease_util import wait_until

REPO = Path(__file__).resolve().parent.parent
LOCK_TIMEOUT = 0.5
# The practice revision's number and schema version: one after HEAD's, as new_revision.py numbers them.
PRACTICE_NUMBER = len(list((REPO / "migrations" / "versions").glob("[0-9][0-9][0-9][0-9]_*.py"))) + 1
ITEMS = "CREATE TABLE public.items (id bigint PRIMARY KEY, v integer)"


def _release_module():
    return _module_from(REPO / "migrations" / "release.py", "pgbroker_release")


RELEASES = _release_module().load()
PRACTICE_VERSION = f"{RELEASES[-1]['schema_version']}+{PRACTICE_NUMBER}"


def _execute(url: str, *statements: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


def _scalar(url: str, query: str) -> object:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(query).fetchone()[0]


def _practice_migrations(tmp_path: Path, url_with_release: str, down_revision: str) -> Path:
    """A copy of migrations/ plus one revision: _epoch_alive replaced, an index on the outbox, PRACTICE_VERSION."""
    where = tmp_path / "migrations"
    shutil.copytree(install.migrations_path(), where, ignore=shutil.ignore_patterns("__pycache__"))
    definition = _scalar(
        url_with_release, "SELECT pg_get_functiondef('pgbroker._epoch_alive(integer, bigint)'::regprocedure)"
    )
    assert isinstance(definition, str) and definition.rstrip().endswith("$function$")
    replaced = definition.rstrip()[: -len("$function$")] + "-- replaced by the practice revision\n$function$"
    version_sql = (
        "CREATE OR REPLACE FUNCTION pgbroker.schema_version()\nRETURNS text\nLANGUAGE sql IMMUTABLE\n"
        "SET search_path = pg_catalog, pg_temp\nAS $$ SELECT '{}'::text $$;\n"
    )
    versions = where / "versions"
    stem = f"{PRACTICE_NUMBER:04d}_practice"
    (versions / f"{stem}.py").write_text(
        f'''"""practice: replace _epoch_alive, index the outbox by watch_id (a test's revision)."""

from pgbroker.install import run_revision_sql

revision = "pgbroker_{stem}"
down_revision = {down_revision!r}
branch_labels = None
depends_on = None
schema_version = {PRACTICE_VERSION!r}


def upgrade() -> None:
    run_revision_sql(__file__, "upgrade")


def downgrade() -> None:
    run_revision_sql(__file__, "downgrade")
'''
    )
    (versions / f"{stem}.sql").write_text(
        "CREATE INDEX outbox_watch_id ON pgbroker.outbox (watch_id);\n"
        "COMMENT ON INDEX pgbroker.outbox_watch_id IS 'The practice revision''s index.';\n"
        f"{replaced};\n" + version_sql.format(PRACTICE_VERSION)
    )
    (versions / f"{stem}.downgrade.sql").write_text(
        f"DROP INDEX pgbroker.outbox_watch_id;\n{definition.rstrip()};\n" + version_sql.format(install.SCHEMA_VERSION)
    )
    return where


def _cfg(url: str, migrations: Path, **attributes: object):
    cfg = install._config(url, lock_timeout=LOCK_TIMEOUT)
    cfg.set_main_option("script_location", str(migrations))
    cfg.attributes.update(attributes)
    return cfg


class Writer(threading.Thread):
    """Inserts one row per transaction into public.items at one isolation level; records each one's duration."""

    def __init__(self, url: str, isolation: str, first_id: int, stop: threading.Event):
        super().__init__(daemon=True)
        self.url, self.isolation, self.next_id, self.stop = url, isolation, first_id, stop
        self.committed: list[int] = []
        self.longest = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.url, autocommit=True, application_name=f"writer {self.isolation}") as conn:
                conn.execute("SET statement_timeout = '30s'")
                while not self.stop.is_set():
                    started = time.monotonic()
                    try:
                        conn.execute(f"BEGIN ISOLATION LEVEL {self.isolation}")
                        conn.execute("INSERT INTO public.items (id, v) VALUES (%s, 0)", (self.next_id,))
                        conn.execute("COMMIT")
                    except psycopg.errors.SerializationFailure:
                        conn.execute("ROLLBACK")
                        continue
                    self.longest = max(self.longest, time.monotonic() - started)
                    self.committed.append(self.next_id)
                    self.next_id += 1
                    time.sleep(0.005)
        except BaseException as exc:  # reported by the test
            self.error = exc


class Drainer(threading.Thread):
    """The Broker's loop: fetch, acknowledge, record (key, client) pairs, until told to stop."""

    def __init__(self, broker: pgbroker.Broker):
        super().__init__(daemon=True)
        self.broker = broker
        self.pairs: set[tuple[int, str]] = set()
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        ack: list[int] = []
        try:
            while not self.stop.is_set():
                got = self.broker.fetch(1000, ack=ack)
                ack = [n.id for n in got]
                for n in got:
                    self.pairs.update((n.key, c) for c in n.clients)
                if not got:
                    time.sleep(0.01)
            if ack:
                self.broker.ack(ack)
        except BaseException as exc:
            self.error = exc


def _stop_and_check(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(30)
        assert not t.is_alive(), f"{t} did not stop"
        assert getattr(t, "error", None) is None, f"{t}: {t.error!r}"


@pytest.mark.parametrize("release", RELEASES, ids=[r["version"] for r in RELEASES])
def test_upgrade_each_release_to_head_under_load_then_downgrade(release, pg_server, empty_db, tmp_path, caplog):
    url = empty_db
    # 0.1.0's revisions exactly as released: every file as its checksum says.
    assert _release_module().verify([release], install.versions_path()) == []
    migrations = _practice_migrations_after(tmp_path, pg_server, release)
    command.upgrade(_cfg(url, migrations), release["head"])
    assert install.installed_version(url) == release["schema_version"]
    at_release = snapshot(url)

    _execute(
        url, "CREATE TABLE public.items (id bigint PRIMARY KEY, v integer)", "SELECT pgbroker.watch('public.items')"
    )
    broker = pgbroker.Broker(url, name="upgrade", heartbeat_interval=0.2)
    epoch = broker.claim()
    clients = ["c1", "c2", "c3"]
    for client in clients:
        broker.register(client)
        broker.subscribe(client, "public.items")
    drainer = Drainer(broker)
    stop = threading.Event()
    writers = [
        Writer(url, level, start, stop)
        for level, start in (("READ COMMITTED", 1), ("REPEATABLE READ", 1_000_000), ("SERIALIZABLE", 2_000_000))
    ]
    drainer.start()
    for w in writers:
        w.start()
    wait_until(lambda: all(len(w.committed) >= 5 for w in writers), timeout=30, what="writers under way")

    # A long transaction that wrote to the watched table: it holds RowExclusiveLock on pgbroker.outbox, which the
    # practice revision's CREATE INDEX needs ShareLock on.  It commits after 4 s, well past lock_timeout.
    long = psycopg.connect(url, application_name="long transaction")
    long.execute("INSERT INTO public.items (id, v) VALUES (-1, 0)")
    timer = threading.Timer(4.0, long.commit)
    timer.start()
    caplog.set_level(logging.WARNING, logger="alembic.env")
    try:
        command.upgrade(_cfg(url, migrations), "heads")
    finally:
        timer.join()
        long.close()
    time.sleep(1.0)  # writers and the broker go on against the new schema
    stop.set()
    _stop_and_check(list(writers))

    committed = {-1, *(i for w in writers for i in w.committed)}
    expected = {(key, c) for key in committed for c in clients}
    wait_until(lambda: expected <= drainer.pairs, timeout=60, what="every committed pair delivered")
    drainer.stop.set()
    _stop_and_check([drainer])

    retries = [r for r in caplog.records if "rolled back, writers go on" in r.getMessage()]
    assert retries, "the long transaction should have made the upgrade give way at least once"
    # The documented bound: lock_timeout per lock the revision waits for (one here), plus the revision's run time
    # while it holds it (milliseconds); checked with 2 s to spare for a loaded machine.  Without the lock_timeout
    # the writers would have queued behind the upgrade for the long transaction's 4 s.
    longest = max(w.longest for w in writers)
    assert longest < LOCK_TIMEOUT + 2.0, f"a writer stalled {longest:.2f} s"
    assert not expected - drainer.pairs, f"{len(expected - drainer.pairs)} pairs missing"
    # The broker kept its lease, its epoch and its connection: no claim, no loss.
    assert broker.epoch == epoch
    broker.check()
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT epoch FROM pgbroker.brokers WHERE name = 'upgrade'").fetchone()[0] == epoch
    assert install.installed_version(url) == PRACTICE_VERSION
    broker.release()
    broker.close()

    # The catalog is a fresh install of HEAD's (once the test's own table is gone).
    _execute(url, "SELECT pgbroker.unwatch('public.items')", "DROP TABLE public.items")
    fresh = pg_server.url_for(_fresh_db(pg_server, "fresh_head"))
    command.upgrade(_cfg(fresh, migrations), "heads")
    report = diff_snapshots(snapshot(fresh), snapshot(url), "fresh install of HEAD", f"{release['version']} upgraded")
    assert not report, report

    # And back to the release.
    command.downgrade(_cfg(url, migrations), release["head"])
    assert install.installed_version(url) == release["schema_version"]
    report = diff_snapshots(at_release, snapshot(url), f"{release['version']} installed", "downgraded again")
    assert not report, report


def _fresh_db(pg_server, name: str) -> str:
    _execute(pg_server.url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)", f"CREATE DATABASE {name}")
    return name


def _practice_migrations_after(tmp_path: Path, pg_server, release: dict) -> Path:
    """The practice copy of migrations/, its revision after HEAD; _epoch_alive's text read from a HEAD install."""
    scratch = pg_server.url_for(_fresh_db(pg_server, "practice_source"))
    install.migrate(scratch)
    heads = install.current_revision(scratch)
    assert len(heads) == 1
    try:
        return _practice_migrations(tmp_path, scratch, heads[0])
    finally:
        install.downgrade(scratch, "base")


def test_a_long_transaction_makes_the_upgrade_give_up_without_stopping_writers(pg_server, empty_db, tmp_path):
    url = empty_db
    migrations = _practice_migrations_after(tmp_path, pg_server, RELEASES[-1])
    command.upgrade(_cfg(url, migrations), RELEASES[-1]["head"])
    _execute(
        url, "CREATE TABLE public.items (id bigint PRIMARY KEY, v integer)", "SELECT pgbroker.watch('public.items')"
    )
    with psycopg.connect(url, autocommit=True) as broker:
        broker.execute("SELECT pgbroker.broker_claim('upgrade')")
        broker.execute("SELECT pgbroker.client_register('c1', name => 'upgrade')")
        broker.execute("SELECT pgbroker.subscribe('c1', 'public.items'::regclass, name => 'upgrade')")
        long = psycopg.connect(url, application_name="long transaction")
        long.execute("INSERT INTO public.items (id, v) VALUES (-1, 0)")  # RowExclusiveLock on the outbox, kept
        stop = threading.Event()
        writer = Writer(url, "READ COMMITTED", 1, stop)
        writer.start()
        try:
            with pytest.raises(install.InstallError) as failed:
                install._run_alembic(
                    url, lambda cfg: command.upgrade(cfg, "heads"), _cfg(url, migrations, lock_retries=2)
                )
        finally:
            stop.set()
            writer.join(30)
            long.rollback()
            long.close()
        message = str(failed.value)
        assert "gave way 3 times" in message and "nothing was changed" in message, message
        assert len(message.splitlines()) == 1
        assert install.installed_version(url) == RELEASES[-1]["schema_version"]
        assert _scalar(url, "SELECT to_regclass('pgbroker.outbox_watch_id')") is None
        # The writer was never queued behind the upgrade for longer than the bound.
        assert writer.error is None and len(writer.committed) > 0
        assert writer.longest < LOCK_TIMEOUT + 2.0, f"the writer stalled {writer.longest:.2f} s"


# ---------------------------------------------------------------------------
# Version mismatch, both ways


def test_this_package_against_a_newer_schema_works_with_a_warning(pg_server, empty_db, tmp_path, caplog):
    url = empty_db
    migrations = _practice_migrations_after(tmp_path, pg_server, RELEASES[-1])
    command.upgrade(_cfg(url, migrations), "heads")
    assert install.installed_version(url) == PRACTICE_VERSION
    caplog.set_level(logging.WARNING, logger="pgbroker.broker")
    with pgbroker.Broker(url, name="old package") as broker:
        said = [r.getMessage() for r in caplog.records if r.name == "pgbroker.broker"]
        assert any(
            f"schema version {PRACTICE_VERSION} is newer than this package's {install.SCHEMA_VERSION}" in m
            and "pip install -U pgbroker" in m
            for m in said
        ), said
        assert broker.schema_version == PRACTICE_VERSION
        broker.register("c1")
        assert broker.subscribe("c1", "initech.objects", 1)
        _execute(url, "INSERT INTO initech.objects (id, name) VALUES (1, 'one')")
        assert [(n.op, n.key, n.clients) for n in broker.fetch()] == [("I", 1, ["c1"])]
        # A later schema that dropped a function this package calls: SchemaMismatch naming both versions.
        _execute(url, "DROP FUNCTION pgbroker.client_update(text, jsonb, text, bigint)")
        with pytest.raises(SchemaMismatch) as mismatch:
            broker.update_client("c1", {"x": 1})
        assert mismatch.value.installed == PRACTICE_VERSION and mismatch.value.expected == install.SCHEMA_VERSION
        assert PRACTICE_VERSION in str(mismatch.value) and install.SCHEMA_VERSION in str(mismatch.value)
        assert "pip install -U pgbroker" in str(mismatch.value) and mismatch.value.sqlstate == "42883"
    # The same for the primitives, on a connection outside a transaction of the caller's.
    _execute(url, "DROP FUNCTION pgbroker.counter_get(text)")
    with psycopg.connect(url, autocommit=True) as conn, pytest.raises(SchemaMismatch) as mismatch:
        pgbroker.Counter(conn, "visits").get()
    assert mismatch.value.installed == PRACTICE_VERSION and "pip install -U pgbroker" in str(mismatch.value)
    # pgbroker migrate with this package leaves a newer schema alone, saying so.
    refused = pgbroker_cli("migrate", "--url", url)
    assert refused.returncode == 1 and "newer than this package's" in refused.stderr, refused.stderr
    assert "nothing was changed" in refused.stderr


def test_a_missing_function_of_the_packages_own_version_stays_the_callers_42883(db_url):
    with pgbroker.Broker(db_url, name="same") as broker:
        broker.register("c1")
        _execute(db_url, "DROP FUNCTION pgbroker.client_update(text, jsonb, text, bigint)")
        with pytest.raises(pgbroker.DatabaseError) as error:
            broker.update_client("c1", {"x": 1})
        assert not isinstance(error.value, SchemaMismatch) and error.value.sqlstate == "42883"


def _pretend_schema(url: str, version: str) -> None:
    _execute(
        url,
        "CREATE OR REPLACE FUNCTION pgbroker.schema_version() RETURNS text LANGUAGE sql IMMUTABLE"
        f" SET search_path = pg_catalog, pg_temp AS $$ SELECT '{version}'::text $$",
    )


@pytest.mark.parametrize(
    ("installed", "says"),
    [
        (
            "0.0.9",
            f"is older than this package's {install.SCHEMA_VERSION}, and older than the oldest it works with (0.1.0)",
        ),
        ("pgbroker_0001_baseline", "is not a release's (a development install from before 0.1.0?)"),
    ],
)
def test_this_package_against_a_schema_it_does_not_support_is_schema_mismatch(db_url, installed, says):
    _pretend_schema(db_url, installed)
    with pytest.raises(SchemaMismatch) as mismatch:
        pgbroker.Broker(db_url, name="new package").claim()
    assert says in str(mismatch.value) and installed in str(mismatch.value)
    assert mismatch.value.installed == installed and mismatch.value.expected == install.SCHEMA_VERSION
    doctor = pgbroker_cli("doctor", "--url", db_url)
    assert doctor.returncode == 3 and says in doctor.stdout, doctor.stdout
    fix = "run: pgbroker migrate" if installed == "0.0.9" else "run: DROP SCHEMA pgbroker CASCADE"
    assert fix in doctor.stdout


def test_the_consoles_health_page_names_both_versions(db_url, pg_server, tmp_path):
    for module in ("starlette", "uvicorn", "psycopg_pool"):
        pytest.importorskip(module, reason="the console's extra (pip install -e '.[test]')")
    _pretend_schema(db_url, "0.0.9")
    port = free_port()
    log = (tmp_path / "console.log").open("w")
    url = db_url.replace("postgres@", "t_reader@", 1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pgbroker.cli", "console", "--url", url, "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    try:

        def health() -> dict | None:
            assert proc.poll() is None, (tmp_path / "console.log").read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=10) as response:
                    return json.loads(response.read())
            except OSError:
                return None

        rows = wait_until(health, timeout=60, what="the console's health page")["rows"]
    finally:
        proc.terminate()
        proc.wait(15)
    schema = next(r for r in rows if r["check"] == "schema")
    assert schema["ok"] is False
    assert "schema version 0.0.9 is older than this package's 0.1.0" in schema["detail"]
    assert schema["fix"].startswith("run: pgbroker migrate")


def test_compare_schema_older_and_newer():
    older = install.compare_schema("0.1.0", expected="0.2.0", oldest="0.1.0")
    assert (older.state, older.usable) == ("older", True)
    assert older.message == "installed pgbroker schema version 0.1.0 is older than this package's 0.2.0"
    assert older.fix is not None and older.fix.startswith("pgbroker migrate")
    newer = install.compare_schema("0.1.0+3", expected="0.1.0", oldest="0.1.0")
    assert (newer.state, newer.usable) == ("newer", True) and "pip install -U pgbroker" in (newer.fix or "")
    assert install.compare_schema("0.1.0+3", expected="0.1.0+4").state == "older"
    assert install.compare_schema("0.2.0", expected="0.1.0+4").state == "newer"
    assert install.compare_schema("0.1.0", expected="0.1.0").fix is None
