"""The ``pgbroker`` console script, run as a real subprocess."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from pgbouncer_util import bouncers, requires_pgbouncer

from pgbroker import Broker, install

SCRIPT = Path(sys.executable).with_name("pgbroker")
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [shutil.which("pgbroker") or "pgbroker"]


def pgbroker(*args: str, env_url: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    if env_url is not None:
        env["DATABASE_URL"] = env_url
    return subprocess.run([*COMMAND, *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_versions_path_prints_the_revisions_directory():
    result = pgbroker("versions-path")
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.strip())
    assert path == install.versions_path()
    assert sorted(p.name for p in path.glob("*.py")) == sorted(
        Path(install_script().get_revision(r).path).name for r in install_heads_and_ancestors()
    )


def test_version_names_the_package_and_its_schema_version():
    result = pgbroker("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"pgbroker {pgbroker_package_version()} (schema version {install.SCHEMA_VERSION})"


def test_migrate_status_downgrade_on_an_empty_database(empty_db):
    # Not installed yet: status says so and fails.
    result = pgbroker("status", "--url", empty_db)
    assert result.returncode == 1
    assert "not installed" in result.stderr

    # migrate, with the URL from DATABASE_URL.
    result = pgbroker("migrate", env_url=empty_db)
    assert result.returncode == 0, result.stderr
    revisions = install.current_revision(empty_db)
    assert revisions and f"revision {', '.join(revisions)}" in result.stdout

    result = pgbroker("status", env_url=empty_db)
    assert result.returncode == 0, result.stderr
    assert f"revision: {', '.join(revisions)} (up to date)" in result.stdout
    assert f"schema version: {install.SCHEMA_VERSION}" in result.stdout
    assert "no lease has been claimed yet" in result.stdout

    with Broker(empty_db, "cli-lease", application_name="cli-test", info="box-7") as b:
        result = pgbroker("status", "--url", empty_db)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        header = next(line for line in lines if line.startswith("name"))
        assert header.split()[:5] == ["name", "epoch", "state", "alive", "pid"]
        lease = next(line for line in lines if line.startswith("cli-lease"))
        assert lease.split()[:7] == ["cli-lease", "1", "held", "yes", str(b.pid), "cli-test", "127.0.0.1"]
        assert "box-7" in lease

    # downgrade to base removes the schema.
    result = pgbroker("downgrade", "--url", empty_db)
    assert result.returncode == 0, result.stderr
    assert "pgbroker removed" in result.stdout
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT to_regnamespace('pgbroker')").fetchone()[0] is None


@pytest.mark.parametrize("command", ["migrate", "downgrade", "status"])
def test_no_url_is_a_usage_error(command):
    result = pgbroker(command)
    assert result.returncode == 2
    assert "DATABASE_URL" in result.stderr and "--url" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("command", ["migrate", "status", "downgrade"])
def test_unreachable_server_fails_cleanly(command):
    result = pgbroker(command, "--url", "postgresql://postgres@127.0.0.1:1/nowhere", timeout=30)
    assert result.returncode == 1
    assert result.stderr.startswith(f"pgbroker {command}: cannot connect to database nowhere on 127.0.0.1:1: ")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("command", ["migrate", "status"])
def test_missing_database_fails_cleanly(command, pg_server):
    url = pg_server.url_for("no_such_database")
    result = pgbroker(command, "--url", url, timeout=30)
    assert result.returncode == 1
    assert result.stderr.startswith(f"pgbroker {command}: cannot connect to database no_such_database on ")
    assert 'database "no_such_database" does not exist' in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("command", ["migrate", "status"])
@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("mysql://root@localhost/app", "not a PostgreSQL URL: 'mysql://root@localhost/app'"),
        ("postgresql://u:secret@localhost:port/app", "port 'port' is not a number"),
    ],
)
def test_bad_url_gives_the_same_error_in_every_command(command, url, says):
    result = pgbroker(command, "--url", url, timeout=30)
    assert result.returncode == 1
    assert result.stderr.startswith(f"pgbroker {command}: ")
    assert says in result.stderr and "expected postgresql://" in result.stderr
    assert "secret" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_migrate_core_only_without_initech(empty_db):
    result = pgbroker("migrate", "--url", empty_db, "--no-initech")
    assert result.returncode == 0, result.stderr
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT to_regclass('initech.objects')").fetchone()[0] is None
        watch = "SELECT to_regprocedure('pgbroker.watch(regclass, interval, text)')"
        assert conn.execute(watch).fetchone()[0] is not None
        # Every revision is recorded, so later upgrades keep working.
        assert conn.execute("SELECT version_num FROM pgbroker.alembic_version").fetchone()[0] == install_head()
    result = pgbroker("downgrade", "--url", empty_db)
    assert result.returncode == 0, result.stderr


def install_script():
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(install.migrations_path()))


def install_head() -> str:
    return install_script().get_current_head()


def install_heads_and_ancestors() -> list[str]:
    return [script.revision for script in install_script().walk_revisions()]


def pgbroker_package_version() -> str:
    from importlib.metadata import version

    return version("pgbroker")


# ---------------------------------------------------------------------------
# The operator's commands: status, history, clients, subscriptions, watch,
# unwatch, prune, metrics and doctor.  They read the views psql shows.

NEW_COMMANDS = [
    ["history"],
    ["clients"],
    ["subscriptions"],
    ["metrics"],
    ["prune"],
    ["maintain"],
    ["doctor"],
    ["watch", "initech.objects"],
    ["unwatch", "initech.objects"],
]


@pytest.mark.parametrize("command", NEW_COMMANDS, ids=lambda c: c[0])
def test_new_commands_need_a_url_and_fail_cleanly(command):
    result = pgbroker(*command)
    assert result.returncode == 2
    assert "DATABASE_URL" in result.stderr and "--url" in result.stderr and result.stdout == ""
    result = pgbroker(*command, "--url", "postgresql://postgres@127.0.0.1:1/nowhere", timeout=30)
    assert result.returncode == 1
    assert result.stderr.startswith(f"pgbroker {command[0]}: cannot connect to database nowhere on 127.0.0.1:1: ")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("command", [c for c in NEW_COMMANDS if c[0] != "doctor"], ids=lambda c: c[0])
def test_new_commands_say_when_pgbroker_is_not_installed(command, empty_db):
    result = pgbroker(*command, "--url", empty_db)
    assert result.returncode == 1
    assert result.stderr.strip().endswith("(run: pgbroker migrate)"), result.stderr
    assert result.stderr.startswith(f"pgbroker {command[0]}: pgbroker is not installed in database ")


def _busy_broker(connect, name: str = "cli-fan") -> tuple[psycopg.Connection, int]:
    """A live broker with client c1 subscribed to row 7 of initech.objects and c2 to the whole table; row 7 inserted."""
    broker = connect("cli-broker")
    epoch = broker.execute("SELECT pgbroker.broker_claim(%s, info => 'rack-3')", (name,)).fetchone()[0]
    broker.execute("""SELECT pgbroker.client_register('c1', '{"v": 1}', %s)""", (name,))
    broker.execute("SELECT pgbroker.client_register('c2', '{}', %s)", (name,))
    broker.execute("SELECT pgbroker.subscribe('c1', 'initech.objects', '7', %s)", (name,))
    broker.execute("SELECT pgbroker.subscribe('c2', 'initech.objects', NULL, %s)", (name,))
    connect("app").execute("INSERT INTO initech.objects (id, kind, name) VALUES (7, 'k', 'seven')")
    return broker, epoch


def test_status_shows_clients_and_outbox_per_broker_and_json(db_url, connect):
    broker, epoch = _busy_broker(connect)
    obs = connect("obs")
    pending = obs.execute("SELECT pending FROM pgbroker.outbox_pending WHERE name = 'cli-fan'").fetchone()[0]
    assert pending >= 1

    result = pgbroker("status", "--url", db_url)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    heading = lines.index("clients and outbox per broker")
    assert lines[heading + 1].split() == [
        "name",
        "clients",
        "subscriptions",
        "takeovers",
        "outbox",
        "backlog",
        "oldest",
        "age",
        "to",
        "sweep",
    ]
    row = next(line for line in lines[heading:] if line.startswith("cli-fan"))
    assert row.split()[:5] == ["cli-fan", "2", "2", "0", str(pending)]
    assert row.split()[5:] == [row.split()[5], "s", "0"]  # the oldest row's age, nothing to sweep

    result = pgbroker("status", "--json", "--url", db_url)
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["up_to_date"] is True and status["schema_version"] == install.SCHEMA_VERSION
    [lease] = status["brokers"]
    assert {k: lease[k] for k in ("name", "epoch", "state", "alive", "holder_pid", "holder_info")} == {
        "name": "cli-fan",
        "epoch": epoch,
        "state": "held",
        "alive": True,
        "holder_pid": broker.info.backend_pid,
        "holder_info": "rack-3",
    }
    assert (lease["clients"], lease["subscriptions"], lease["takeovers"], lease["outbox_backlog"]) == (2, 2, 0, pending)
    assert lease["outbox_oldest_age"] > 0 and lease["heartbeat_age"] >= 0
    assert lease["holder_address"] == "127.0.0.1"


def test_status_watch_refreshes_until_interrupted(db_url, connect):
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    proc = subprocess.Popen(
        [*COMMAND, "status", "--json", "--watch", "0.2", "--url", db_url],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = json.loads(proc.stdout.readline())
        assert first["brokers"] == []
        connect("late").execute("SELECT pgbroker.broker_claim('late-lease')")
        for _ in range(50):  # refreshes until it shows the new lease
            names = [b["name"] for b in json.loads(proc.stdout.readline())["brokers"]]
            if names:
                break
        assert names == ["late-lease"]
        proc.send_signal(signal.SIGINT)
        # communicate(), not wait(): it keeps reading the pipes, so the process never blocks writing its last lines.
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_history_clients_and_subscriptions_read_the_views(pg_server, db_name, connect):
    _busy_broker(connect)
    connect("admin", user="t_admin").execute("SELECT pgbroker.broker_claim('cli-fan', takeover => true)")
    reader_url = pg_server.url_for(db_name, user="t_reader")
    obs = connect("obs")

    # A reader sees the status too (the schema version stands for the alembic revisions it may not read).
    result = pgbroker("status", "--url", reader_url)
    assert result.returncode == 0, result.stderr
    assert f"schema version: {install.SCHEMA_VERSION} (up to date; this role may not read" in result.stdout
    assert any(line.startswith("cli-fan") for line in result.stdout.splitlines())

    result = pgbroker("history", "--json", "--url", reader_url)
    assert result.returncode == 0, result.stderr
    events = json.loads(result.stdout)
    assert [(e["name"], e["epoch"], e["event"]) for e in events] == [
        ("cli-fan", 1, "claim"),
        ("cli-fan", 2, "takeover"),
    ]
    assert [e["id"] for e in events] == [r[0] for r in obs.execute("SELECT id FROM pgbroker.lease_history ORDER BY id")]
    result = pgbroker("history", "--limit", "1", "--url", reader_url)
    assert result.returncode == 0, result.stderr
    [last] = [line for line in result.stdout.splitlines() if "cli-fan" in line]
    assert " takeover " in last and f" {events[-1]['id']} " in f" {last}"

    # The takeover wiped the old epoch's clients: the new holder registers its own.
    new_broker = connect("cli-broker-2")
    other_epoch = new_broker.execute("SELECT pgbroker.broker_claim('other')").fetchone()[0]
    new_broker.execute("""SELECT pgbroker.client_register('c9', '{"ip": "10.0.0.9"}', 'other')""")
    new_broker.execute("SELECT pgbroker.subscribe('c9', 'initech.objects', '7', 'other')")
    new_broker.execute("SELECT pgbroker.subscribe('c9', 'initech.objects', NULL, 'other')")
    result = pgbroker("clients", "--json", "--url", reader_url)
    assert result.returncode == 0, result.stderr
    assert [(c["name"], c["client_id"], c["subscriptions"], c["info"]) for c in json.loads(result.stdout)] == [
        ("other", "c9", 2, {"ip": "10.0.0.9"})
    ]
    result = pgbroker("clients", "--url", reader_url)
    assert result.returncode == 0, result.stderr
    assert next(line for line in result.stdout.splitlines() if line.startswith("other")).split()[:4] == [
        "other",
        str(other_epoch),
        "c9",
        "2",
    ]
    result = pgbroker("clients", "--name", "cli-fan", "--url", reader_url)
    assert (result.returncode, result.stdout.strip()) == (0, "no clients")

    result = pgbroker("subscriptions", "--json", "--url", reader_url)
    assert result.returncode == 0, result.stderr
    assert [(s["name"], s["client_id"], s["table"], s["key"]) for s in json.loads(result.stdout)] == [
        ("other", "c9", "initech.objects", None),
        ("other", "c9", "initech.objects", 7),
    ]


def test_watch_unwatch_and_prune(pg_server, db_name, db_url, connect):
    obs = connect("obs")
    obs.execute("CREATE TABLE public.gadgets (shop text, id integer, PRIMARY KEY (shop, id))")

    # A reader may not: one line, the SQLSTATE's exception, exit code 1.
    result = pgbroker("watch", "public.gadgets", "--url", pg_server.url_for(db_name, user="t_reader"))
    assert result.returncode == 1
    assert result.stderr.startswith("pgbroker watch: PermissionDenied: "), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1

    admin_url = pg_server.url_for(db_name, user="t_admin")
    result = pgbroker("watch", "public.gadgets", "--url", admin_url)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("pgbroker: watching public.gadgets (key: shop, id) in statement mode, watch id ")
    watched = "SELECT key_columns, mode FROM pgbroker.watched_tables WHERE \"table\" = 'gadgets'::regclass"
    assert obs.execute(watched).fetchone() == (["shop", "id"], "statement")
    result = pgbroker("watch", "public.gadgets", "--mode", "row", "--url", admin_url)  # switches the triggers
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("pgbroker: watching public.gadgets (key: shop, id) in row mode, watch id ")
    assert obs.execute(watched).fetchone() == (["shop", "id"], "row")
    result = pgbroker("watch", "no_such_table", "--url", admin_url)
    assert result.returncode == 1 and result.stderr.startswith("pgbroker watch: ")
    assert 'relation "no_such_table" does not exist' in result.stderr

    result = pgbroker("unwatch", "public.gadgets", "--url", admin_url)
    assert (result.returncode, result.stdout.strip()) == (0, "pgbroker: public.gadgets is no longer watched")
    assert (
        obs.execute("SELECT count(*) FROM pgbroker.watched_tables WHERE \"table\" = 'gadgets'::regclass").fetchone()[0]
        == 0
    )
    result = pgbroker("unwatch", "public.gadgets", "--url", admin_url)
    assert (result.returncode, result.stdout.strip()) == (0, "pgbroker: public.gadgets was not watched")

    # prune: events older than the interval go; younger ones stay.
    for _ in range(3):
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("SELECT pgbroker.broker_claim('pruned')")
    events = obs.execute("SELECT count(*) FROM pgbroker.lease_history").fetchone()[0]
    assert events == 3
    result = pgbroker("prune", "--url", admin_url)
    assert (result.returncode, result.stdout.strip()) == (
        0,
        "pgbroker: pruned 0 lease history event(s) older than 30 days",
    )
    result = pgbroker("prune", "--older-than", "0 s", "--url", admin_url)
    assert (result.returncode, result.stdout.strip()) == (0, "pgbroker: pruned 3 lease history event(s) older than 0 s")
    assert obs.execute("SELECT count(*) FROM pgbroker.lease_history").fetchone()[0] == 0
    result = pgbroker("prune", "--older-than", "soon", "--url", admin_url)
    assert result.returncode == 1 and "invalid input syntax for type interval" in result.stderr


def test_metrics_prints_the_view_in_prometheus_text_format(db_url, connect):
    _busy_broker(connect)
    result = pgbroker("metrics", "--url", db_url)
    assert result.returncode == 0, result.stderr
    samples, helps, types = {}, {}, {}
    for line in result.stdout.splitlines():
        if line.startswith("# HELP "):
            name, text = line[len("# HELP ") :].split(" ", 1)
            helps[name] = text
        elif line.startswith("# TYPE "):
            name, kind = line[len("# TYPE ") :].split(" ")
            types[name] = kind
        else:
            series, value = line.rsplit(" ", 1)
            samples[series] = float(value)
    rows = connect("obs").execute("SELECT metric, labels, value, help FROM pgbroker.metrics").fetchall()
    assert len(samples) == len(rows)
    for metric, labels, value, help_text in rows:
        series = metric + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
        assert series in samples, series
        if not metric.endswith("_age_seconds"):
            assert samples[series] == value, series
        assert helps[metric] == help_text and types[metric] == "gauge"
    assert samples['pgbroker_broker_clients{name="cli-fan"}'] == 2


def _doctor(url: str) -> tuple[int, dict]:
    result = pgbroker("doctor", "--json", "--url", url)
    assert result.returncode in (0, 3), result.stderr
    return result.returncode, json.loads(result.stdout)


def _failed(report: dict) -> dict[str, dict]:
    return {f"{f['check']}:{f['subject']}": f for f in report["findings"] if f["status"] == "FAIL"}


def test_doctor_finds_nothing_wrong_in_a_fresh_database(db_url):
    code, report = _doctor(db_url)
    assert code == 0 and report["ok"] is True and _failed(report) == {}
    checks = {f["check"]: f for f in report["findings"]}
    assert {"schema", "roles", "grants", "keepalives", "connection", "notify_queue", "watch_triggers"} <= set(checks)
    assert checks["connection"]["detail"].startswith("direct: ")
    result = pgbroker("doctor", "--url", db_url)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith("no problem found")


def test_doctor_says_what_to_fix_and_exits_3(pg_server, db_name, db_url, connect, empty_db):
    broker = connect("doomed")
    broker.execute("SELECT pgbroker.broker_claim('doomed')")
    owner = connect("owner")
    owner.execute("ALTER TABLE initech.objects DISABLE TRIGGER _pgbroker_watch_ins")
    owner.execute("GRANT EXECUTE ON FUNCTION pgbroker.broker_heartbeat(text) TO PUBLIC")
    owner.execute("SELECT pg_terminate_backend(%s)", (broker.info.backend_pid,))

    code, report = _doctor(db_url)
    assert code == 3 and report["ok"] is False
    failed = _failed(report)
    assert set(failed) == {"watch_triggers:initech.objects", "broker_alive:doomed", "grants:PUBLIC"}
    assert failed["watch_triggers:initech.objects"]["fix"].endswith("SELECT pgbroker.watch('initech.objects');")
    assert failed["grants:PUBLIC"]["detail"] == "PUBLIC may execute pgbroker.broker_heartbeat(name text)"
    revoke = failed["grants:PUBLIC"]["fix"].split(" (")[0]
    assert revoke == "REVOKE EXECUTE ON FUNCTION pgbroker.broker_heartbeat(name text) FROM PUBLIC;"

    result = pgbroker("doctor", "--url", db_url)
    assert result.returncode == 3
    assert "What to fix:" in result.stdout and result.stdout.rstrip().endswith("3 problem(s) found")
    assert "- [FAIL] watch_triggers initech.objects: reinstall them as pgbroker_admin: " in result.stdout

    # The fixes it prints work.
    owner.execute(revoke)
    owner.execute(failed["watch_triggers:initech.objects"]["fix"].split(": ", 1)[1])
    code, report = _doctor(db_url)
    assert code == 3 and set(_failed(report)) == {"broker_alive:doomed"}

    # A login without any pgbroker role is told which to grant.
    code, report = _doctor(pg_server.url_for(db_name, user="t_none"))
    assert code == 3
    assert (
        _failed(report)["roles:t_none"]["fix"]
        == "GRANT pgbroker_reader (or pgbroker_broker, pgbroker_admin) TO t_none;"
    )

    # Not installed.
    code, report = _doctor(empty_db)
    assert code == 3 and _failed(report)["schema:"]["fix"] == "run: pgbroker migrate"


@requires_pgbouncer
def test_doctor_sees_a_transaction_pooler(pg_server, db_name):
    with bouncers(pg_server.port, db_name) as start:
        code, report = _doctor(start("transaction"))
        connection = next(f for f in report["findings"] if f["check"] == "connection")
        assert code == 3 and connection["status"] == "FAIL", connection
        assert "pooler in transaction mode" in connection["detail"] and "TTL leases" in connection["fix"]

        code, report = _doctor(start("session"))
        connection = next(f for f in report["findings"] if f["check"] == "connection")
        assert connection["status"] == "warn" and "session_pooler=True" in connection["fix"], connection
        assert code == 0, report


def _on_a_terminal(args: list[str], env: dict[str, str]) -> str:
    """Run the command on a pseudo-terminal; its output."""
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen(args, stdin=follower, stdout=follower, stderr=follower, env=env, close_fds=True)
    os.close(follower)
    chunks = []
    try:
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(leader)
        proc.wait(timeout=60)
    assert proc.returncode == 0, b"".join(chunks)
    return b"".join(chunks).decode()


def test_tables_are_drawn_with_colours_on_a_terminal_and_plain_otherwise(db_url, connect):
    _busy_broker(connect)
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "NO_COLOR", "FORCE_COLOR", "TERM")}
    env.update(COLUMNS="200", TERM="xterm-256color")
    shown = _on_a_terminal([*COMMAND, "status", "--url", db_url], env)
    assert "┃" in shown and "━" in shown  # rich's table
    assert "\x1b[32mheld" in shown  # a held lease in green
    assert "cli-fan" in shown

    shown = _on_a_terminal([*COMMAND, "status", "--url", db_url], {**env, "NO_COLOR": "1"})
    assert "┃" in shown and "\x1b[32m" not in shown

    plain = pgbroker("status", "--url", db_url).stdout
    assert "┃" not in plain and "\x1b[" not in plain and "cli-fan" in plain


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["no-such-command"], "No such command 'no-such-command'"),
        (["status", "--watch", "0"], "--watch"),
        (["history", "--limit", "none"], "--limit"),
        (["watch"], "Missing argument 'TABLE'"),
    ],
)
def test_usage_errors_exit_2_with_the_usage(args, says):
    result = pgbroker(*args, env_url="postgresql://postgres@127.0.0.1:1/nowhere")
    assert result.returncode == 2, result
    assert says in result.stderr and "Usage: pgbroker" in result.stderr
    assert result.stdout == ""


def test_help_lists_every_command_and_the_exit_codes():
    result = pgbroker("--help")
    assert result.returncode == 0, result.stderr
    commands = result.stdout[result.stdout.index("Commands:") :].split()
    for command in ("migrate", "downgrade", "status", "history", "clients", "subscriptions", "watch", "unwatch"):
        assert command in commands
    for command in ("prune", "metrics", "doctor", "demo", "versions-path"):
        assert command in commands
    assert "Exit codes: 0 success, 1 failure, 2 usage error" in " ".join(result.stdout.split())
