"""Fault: a standby attached before the install, promoted without a restartpoint (issue 26).

This is what a Patroni failover did to pgbroker on PostgreSQL 15: the outbox is
UNLOGGED, and its ids came from an identity column, whose sequence is UNLOGGED
too (PostgreSQL 15 and later).  A standby that replayed the creation of an
unlogged sequence and made no restartpoint since is promoted with an all-zero
sequence page, and every nextval() fails with "bad magic number in sequence"
(XX000): every write to a watched table failed.  The outbox's ids now come from
a LOGGED sequence (sql/500_outbox.sql).

The standby streams from the primary before pgbroker is installed, restartpoints
are kept away (checkpoint_timeout of an hour, and the test checks the standby's
last restartpoint is older than the install), the primary dies, the standby is
promoted; then, on the new primary: a broker claims a greater epoch, the old one
is fenced, a client registers and subscribes, writes to the watched table all
commit and are all delivered, and a rate limit decides.  A control table made in
the same window the old way (UNLOGGED with an identity column) shows whether the
server at hand has the bug: PostgreSQL 15.18 breaks it here; 15.20 and 18.6 bring
it through intact, and the test then warns that the control showed nothing.
pgbroker's side is proved on every version.
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from pathlib import Path

import psycopg
import pytest
from fanout_util import claim, drain, register, seed_objects, subscribe, wake
from standby_util import PRIMARY_OPTIONS, Standby, stop_immediately, wait_for

from pgbroker import install
from pgbroker._embedded import EmbeddedPostgres

# No timed checkpoint (so no restartpoint on the standby) within the test.
NO_CHECKPOINTS = "-c checkpoint_timeout=1h -c max_wal_size=4GB"
WRITES = 200


@pytest.fixture
def primary():
    server = EmbeddedPostgres(f"{PRIMARY_OPTIONS} {NO_CHECKPOINTS}")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _replayed(standby_url: str, lsn: str) -> bool:
    with psycopg.connect(standby_url, autocommit=True) as conn:
        return conn.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,)).fetchone()[0]


@pytest.mark.slow
def test_writes_and_claims_work_on_a_standby_promoted_without_a_restartpoint(primary):
    with psycopg.connect(primary.url, autocommit=True) as conn:
        conn.execute("CREATE DATABASE app")
    url = primary.url_for("app")
    directory = Path(tempfile.mkdtemp(prefix="pgbroker-standby-"))  # the server's OS user must reach it
    standby = Standby(primary, directory, options=NO_CHECKPOINTS)
    standby.start()
    try:
        with psycopg.connect(primary.url, autocommit=True) as conn:
            wait_for(
                lambda: (
                    conn.execute("SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'").fetchone()
                    == (1,)
                ),
                "the standby to stream",
            )
        with psycopg.connect(url, autocommit=True) as conn:
            before_install = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]
        install.migrate(url)  # with the standby attached

        with psycopg.connect(url, autocommit=True) as old:
            # The control: what the outbox was, an UNLOGGED table with an identity column.
            old.execute("CREATE UNLOGGED TABLE public.control (id bigint GENERATED ALWAYS AS IDENTITY, v integer)")
            old.execute("INSERT INTO public.control (v) VALUES (1)")
            old_epoch = claim(old)
            seed_objects(old, range(1, 11))
            register(old, "c1")
            subscribe(old, "c1", key=1)
            wake(old)
            old.execute("UPDATE initech.objects SET name = 'on the old primary' WHERE id = 1")
            assert [r["key"] for r in drain(old)] == [1]
            assert old.execute("SELECT allowed FROM pgbroker.rate_limit('api', 10, '1 s')").fetchone() == (True,)
            # The insert position: with synchronous_commit off (the test servers) the last commit records may
            # still be past the write position, and a standby replayed to that would not see them committed.
            lsn = old.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0]
        wait_for(lambda: _replayed(standby.url_for("app"), lsn), "the standby to replay the install")
        with psycopg.connect(standby.url_for("app"), autocommit=True) as conn:
            persistence = dict(
                conn.execute(
                    "SELECT relname, relpersistence::text FROM pg_class"
                    " WHERE relname IN ('outbox', 'outbox_id_seq', 'rate_limit_state', 'control_id_seq')"
                ).fetchall()
            )
            assert persistence == {
                "outbox": "u",
                "outbox_id_seq": "p",
                "rate_limit_state": "u",
                "control_id_seq": "u",
            }
            # No restartpoint since before the install: the standby's last one is older.
            redo = conn.execute("SELECT redo_lsn::text FROM pg_control_checkpoint()").fetchone()[0]
            assert conn.execute("SELECT %s::pg_lsn < %s::pg_lsn", (redo, before_install)).fetchone() == (True,)
            version = conn.execute("SHOW server_version").fetchone()[0].split()[0]

        stop_immediately(primary)
        standby.pg_ctl("promote", "-w")
        new_url = standby.url_for("app")
        wait_for(
            lambda: not psycopg.connect(new_url, autocommit=True).execute("SELECT pg_is_in_recovery()").fetchone()[0],
            "the promotion",
        )
        with psycopg.connect(new_url, autocommit=True) as conn:
            try:
                conn.execute("INSERT INTO public.control (v) VALUES (2)")
                control = "works"
            except psycopg.Error as exc:
                control = f"{exc.sqlstate}: {exc.diag.message_primary}"
            # The control says what this server does; pgbroker's side below is proved on every version.  The
            # bug the outbox's logged sequence avoids was seen here on 15.18; 15.20 and 18.6 no longer have it.
            print(f"\nPostgreSQL {version}: an UNLOGGED identity column after the promotion: {control}")
            if control == "works":
                warnings.warn(
                    f"PostgreSQL {version} brings an UNLOGGED identity sequence through a promotion without a "
                    "restartpoint intact: it does not have the bug the outbox's LOGGED sequence avoids, so the "
                    "control shows nothing here",
                    stacklevel=1,
                )
            else:
                assert control.startswith("XX000: bad magic number in sequence"), control

            new_epoch = claim(conn)
            assert new_epoch > old_epoch
            with pytest.raises(psycopg.Error) as stale:
                conn.execute("SELECT pgbroker.broker_assert('default', %s)", (old_epoch,))
            assert stale.value.sqlstate == "PB002"
            assert conn.execute("SELECT count(*) FROM pgbroker.outbox").fetchone() == (0,)  # UNLOGGED: empty
            register(conn, "c1")
            subscribe(conn, "c1")
            wake(conn)
            failed = []
            for n in range(WRITES):
                try:
                    conn.execute("UPDATE initech.objects SET name = %s WHERE id = %s", (f"write {n}", n % 10 + 1))
                except psycopg.Error as exc:
                    failed.append(f"{exc.sqlstate}: {exc}")
            conn.execute("INSERT INTO initech.objects (id, name) VALUES (11, 'new')")
            assert failed == [], failed[:3]
            rows = drain(conn)
            assert len(rows) == WRITES + 1
            assert all(r["clients"] == ["c1"] for r in rows)
            assert [r["id"] for r in rows] == sorted(r["id"] for r in rows)
            assert conn.execute("SELECT allowed FROM pgbroker.rate_limit('api', 10, '1 s')").fetchone() == (True,)
            assert conn.execute("SELECT count(*) FROM pgbroker.rate_limits").fetchone() == (1,)
    finally:
        standby.kill()
        shutil.rmtree(directory, ignore_errors=True)
