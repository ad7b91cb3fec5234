"""Fault: failover to an asynchronous standby that missed claims.

A primary and a streaming standby (``pg_basebackup -R``).  The standby stops
receiving, the primary hands out 100 more epochs, then dies; the standby is
promoted.  Every epoch claimed after the promotion must compare greater than
every epoch the old primary handed out (the WAL timeline sits in the epoch's
high bits), and the old epochs must fail ``broker_assert``.  A claim on the
standby, before the promotion, fails with a clear error.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import psycopg
import pytest
from standby_util import PRIMARY_OPTIONS, Standby, stop_immediately, wait_for

from pgbroker import install
from pgbroker._embedded import EmbeddedPostgres

MISSED = 100


@pytest.fixture
def primary():
    server = EmbeddedPostgres(PRIMARY_OPTIONS)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _claim_and_release(url: str, name: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        epoch = conn.execute("SELECT pgbroker.broker_claim(%s)", (name,)).fetchone()[0]
        conn.execute("SELECT pgbroker.broker_release(%s)", (name,))
        return epoch


def test_epochs_after_failover_compare_greater_than_every_lost_one(primary):
    admin = primary.url_for("postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("CREATE DATABASE app")
    url = primary.url_for("app")
    install.migrate(url)
    seen = [_claim_and_release(url, "default") for _ in range(5)]

    # Not under pytest's tmp_path: the server's OS user must be able to reach it.
    directory = Path(tempfile.mkdtemp(prefix="pgbroker-standby-"))
    standby = Standby(primary, directory)
    standby.start()
    try:
        wait_for(
            lambda: (
                psycopg.connect(standby.url_for("app"), autocommit=True)
                .execute("SELECT epoch FROM pgbroker.lease WHERE name = 'default'")
                .fetchone()[0]
                == seen[-1]
            ),
            "the standby to replay the first claims",
        )
        # On a standby a claim fails with a clear error, whatever it has replayed.
        with psycopg.connect(standby.url_for("app"), autocommit=True) as conn:
            with pytest.raises(psycopg.errors.ReadOnlySqlTransaction) as refused:
                conn.execute("SELECT pgbroker.broker_claim()")
            assert "on a standby" in refused.value.diag.message_primary

        # The standby stops receiving; the primary hands out MISSED more epochs and dies.
        standby.pg_ctl("stop", "-w", "-m", "fast")
        lost = [_claim_and_release(url, "default") for _ in range(MISSED)]
        assert lost == sorted(lost) and lost[0] > seen[-1]
        stop_immediately(primary)

        standby.start()
        standby.pg_ctl("promote", "-w")
        new_url = standby.url_for("app")
        wait_for(
            lambda: not psycopg.connect(new_url, autocommit=True).execute("SELECT pg_is_in_recovery()").fetchone()[0],
            "the promotion",
        )
        with psycopg.connect(new_url, autocommit=True) as conn:
            # What the promoted standby knew: only the first claims.
            assert conn.execute("SELECT epoch FROM pgbroker.lease WHERE name = 'default'").fetchone()[0] == seen[-1]
            after = [conn.execute("SELECT pgbroker.broker_claim('default')").fetchone()[0]]
            conn.execute("SELECT pgbroker.broker_release('default')")
            after.append(conn.execute("SELECT pgbroker.broker_claim('default')").fetchone()[0])
            other = conn.execute("SELECT pgbroker.broker_claim('other')").fetchone()[0]
            print(
                f"\nfailover: {len(seen)} epochs the standby saw (up to {seen[-1]}), {len(lost)} it missed "
                f"(up to {max(lost)}); after promotion: {after[0]}, {after[1]} and {other} (lease 'other')"
            )
            assert min(after[0], other) > max(lost), "an epoch after failover does not exceed the lost ones"
            assert after[1] > after[0]
            for old in [*seen, *lost]:
                with pytest.raises(psycopg.Error) as stale:
                    conn.execute("SELECT pgbroker.broker_assert('default', %s)", (old,))
                assert stale.value.sqlstate == "PB002", old
            conn.execute("SELECT pgbroker.broker_assert('default', %s)", (after[1],))
            timeline = conn.execute("SELECT substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8)").fetchone()[0]
            assert int(timeline, 16) == 2 and after[0] >> 40 == 1
    finally:
        standby.kill()
        shutil.rmtree(directory, ignore_errors=True)
