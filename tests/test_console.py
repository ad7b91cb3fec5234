"""The console views (sql/750_console.sql): broker_overview, health, metrics, and the
postgres_exporter queries of pgbroker/queries.yaml, read by a pgbroker_reader login."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import pgbroker

QUERIES = Path(pgbroker.__file__).with_name("queries.yaml")


def _busy_broker(connect, name: str = "console"):
    """A live broker with one client subscribed to row 7 of initech.objects, and one undelivered change."""
    broker = connect("console-broker")
    epoch = broker.execute("SELECT pgbroker.broker_claim(%s)", (name,)).fetchone()[0]
    broker.execute("SELECT pgbroker.client_register('c1', '{}', %s)", (name,))
    broker.execute("SELECT pgbroker.client_register('c2', '{}', %s)", (name,))
    broker.execute("SELECT pgbroker.subscribe('c1', 'initech.objects', '7', %s)", (name,))
    broker.execute("SELECT pgbroker.subscribe('c2', 'initech.objects', '7', %s)", (name,))
    broker.execute("SELECT pgbroker.subscribe('c2', 'initech.objects', NULL, %s)", (name,))
    app = connect("app")
    app.execute("INSERT INTO initech.objects (id, kind, name) VALUES (7, 'k', 'seven')")
    return broker, epoch


def test_broker_overview_counts_clients_subscriptions_backlog_and_takeovers(connect):
    broker, epoch = _busy_broker(connect)
    reader = connect("reader", user="t_reader")
    row = reader.execute(
        "SELECT epoch, alive, clients, subscriptions, takeovers, outbox_backlog, outbox_oldest_age > interval '0'"
        "  FROM pgbroker.broker_overview WHERE name = 'console'"
    ).fetchone()
    pending = reader.execute("SELECT pending FROM pgbroker.outbox_pending WHERE name = 'console'").fetchone()[0]
    assert pending >= 1
    assert row == (epoch, True, 2, 3, 0, pending, True)

    # A forced takeover is counted; the new holder has no clients yet and the old epoch's outbox is gone.
    admin = connect("admin", user="t_admin")
    admin.execute("SELECT pgbroker.broker_claim('console', takeover => true)")
    row = reader.execute(
        "SELECT epoch, alive, clients, subscriptions, takeovers, outbox_backlog, outbox_oldest_age"
        "  FROM pgbroker.broker_overview WHERE name = 'console'"
    ).fetchone()
    takeovers = reader.execute(
        "SELECT count(*) FROM pgbroker.lease_history WHERE name = 'console' AND event IN ('takeover', 'stale_takeover')"
    ).fetchone()[0]
    assert takeovers == 1
    assert row == (epoch + 1, True, 0, 0, 1, 0, None)


def _health(reader) -> dict[tuple[str, str], tuple[bool, str, str | None]]:
    rows = reader.execute('SELECT "check", subject, ok, detail, fix FROM pgbroker.health').fetchall()
    return {(check, subject): (ok, detail, fix) for check, subject, ok, detail, fix in rows}


def test_health_reports_disabled_triggers_and_dead_brokers_with_the_fix(connect):
    broker, _ = _busy_broker(connect)
    reader = connect("reader", user="t_reader")
    health = _health(reader)
    assert all(ok for ok, _, _ in health.values()), health
    assert health[("watch_triggers", "initech.objects")][0]
    assert health[("broker_alive", "console")][0]
    assert health[("outbox_lag", "console")][0]
    assert health[("notify_queue", "")][0]

    owner = connect("owner")
    owner.execute("ALTER TABLE initech.objects DISABLE TRIGGER _pgbroker_watch_upd")
    owner.execute("DROP TRIGGER _pgbroker_watch_del ON initech.objects")
    pid = broker.info.backend_pid
    owner.execute("SELECT pg_terminate_backend(%s)", (pid,))
    owner.execute("SELECT pg_sleep(0.2)")
    health = _health(reader)
    ok, detail, trigger_fix = health[("watch_triggers", "initech.objects")]
    assert not ok
    assert detail == "missing or disabled: _pgbroker_watch_del, _pgbroker_watch_upd"
    assert trigger_fix == "reinstall them as pgbroker_admin: SELECT pgbroker.watch('initech.objects');"
    ok, detail, fix = health[("broker_alive", "console")]
    assert not ok and f"pid {pid}, which is gone" in detail and "start one" in fix

    # The fix works.
    owner.execute(trigger_fix.split(": ", 1)[1])
    assert _health(reader)[("watch_triggers", "initech.objects")][0]


def test_outbox_lag_fails_after_a_minute(connect):
    _busy_broker(connect)
    reader = connect("reader", user="t_reader")
    assert _health(reader)[("outbox_lag", "console")][0]
    # Age the pending rows by a minute (the outbox table is internal: the superuser edits it here).
    connect("owner").execute("UPDATE pgbroker.outbox SET at = at - interval '61 s' WHERE name = 'console'")
    ok, detail, fix = _health(reader)[("outbox_lag", "console")]
    assert not ok and "pending notification(s), the oldest 00:01:01" in detail and "outbox_fetch" in fix


def _metrics(reader) -> dict[tuple[str, str], tuple[float, str]]:
    rows = reader.execute("SELECT metric, labels, value, help FROM pgbroker.metrics").fetchall()
    samples = {
        (metric, labels.get("name", labels.get("part", ""))): (value, help) for metric, labels, value, help in rows
    }
    assert len(samples) == len(rows), "a metric and label set appear twice"
    return samples


def _exporter_samples(reader) -> dict[tuple[str, str], tuple[float, str]]:
    """What postgres_exporter makes of queries.yaml: <query>_<column>{labels} value, with the description as HELP."""
    config = yaml.safe_load(QUERIES.read_text())
    samples: dict[tuple[str, str], tuple[float, str]] = {}
    for query_name, query in config.items():
        cur = reader.execute(query["query"])
        columns = [c.name for c in cur.description]
        usage = {name: spec for item in query["metrics"] for name, spec in item.items()}
        assert set(usage) == set(columns), f"{query_name}: columns {columns}, metrics {sorted(usage)}"
        labels = [c for c in columns if usage[c]["usage"] == "LABEL"]
        assert all(usage[c]["usage"] in ("LABEL", "GAUGE", "COUNTER") for c in columns)
        for row in cur.fetchall():
            values = dict(zip(columns, row, strict=True))
            label = ",".join(str(values[c]) for c in labels)
            for column in columns:
                if column not in labels and values[column] is not None:
                    samples[(f"{query_name}_{column}", label)] = (values[column], usage[column]["description"])
    return samples


def test_metrics_view_and_queries_yaml_agree(connect):
    _busy_broker(connect)
    connect("other").execute("SELECT pgbroker.broker_claim('second')")
    reader = connect("reader", user="t_reader")
    view = _metrics(reader)
    exporter = _exporter_samples(reader)
    assert set(view) == set(exporter)
    for key, (value, help_text) in view.items():
        assert exporter[key][1] == help_text, key
        if key[0].endswith("_age_seconds"):
            assert exporter[key][0] == pytest.approx(value, abs=5), key
        else:
            assert exporter[key][0] == value, key

    # Everything the issue asks for, per broker, and the NOTIFY queue.
    for name in ("console", "second"):
        for metric in (
            "epoch",
            "alive",
            "heartbeat_age_seconds",
            "takeovers",
            "clients",
            "subscriptions",
            "outbox_backlog",
            "outbox_oldest_age_seconds",
        ):
            assert (f"pgbroker_broker_{metric}", name) in view
    assert view[("pgbroker_broker_clients", "console")][0] == 2
    assert view[("pgbroker_broker_subscriptions", "console")][0] == 3
    assert view[("pgbroker_broker_outbox_backlog", "console")][0] >= 1
    assert view[("pgbroker_broker_outbox_backlog", "second")][0] == 0
    assert view[("pgbroker_broker_alive", "second")][0] == 1
    assert 0 <= view[("pgbroker_notify_queue_usage", "")][0] < 1


def test_a_role_without_pgbroker_reader_cannot_read_the_console(connect):
    nobody = connect("nobody", user="t_none")
    for view in ("broker_overview", "health", "metrics"):
        with pytest.raises(Exception, match="permission denied"):
            nobody.execute(f"SELECT * FROM pgbroker.{view}")


def test_a_stale_takeover_of_a_hung_broker_process_shows_in_the_console(pgbroker_process, pgbroker_db):
    """With the pytest plugin's fixtures: a broker process is SIGSTOPped and replaced after stale_after."""
    import psycopg

    from pgbroker import Broker

    hung = pgbroker_process("orders", heartbeat_interval=0.2)
    with psycopg.connect(pgbroker_db, autocommit=True) as obs:
        assert obs.execute("SELECT alive, takeovers FROM pgbroker.broker_overview").fetchall() == [(True, 0)]
        hung.stop()  # SIGSTOP: its session stays open, its heartbeats stop
        with Broker(pgbroker_db, "orders", wait=10, stale_after=1.0) as standby:
            assert standby.epoch > hung.epoch
            row = obs.execute("SELECT epoch, alive, takeovers, holder_pid FROM pgbroker.broker_overview").fetchone()
            assert row == (standby.epoch, True, 1, standby.pid)
            samples = dict(obs.execute("SELECT metric, value FROM pgbroker.metrics WHERE labels->>'name' = 'orders'"))
            assert samples["pgbroker_broker_takeovers"] == 1 and samples["pgbroker_broker_alive"] == 1
            events = [r[0] for r in obs.execute("SELECT event FROM pgbroker.lease_history ORDER BY id")]
            assert events == ["claim", "stale_takeover"]
