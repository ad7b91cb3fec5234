"""pgbroker installed by roles that are not superusers, as on every managed service, and called by login roles
that hold only pgbroker's roles (issue 25).

One server of its own (roles are cluster-wide, so the session server's pgbroker roles, made by a superuser,
must not be there).  Each profile of installing role is set up in turn, installed, smoke-tested and removed:

- a: LOGIN CREATEDB CREATEROLE, member of pg_signal_backend and pg_monitor, owns its database (like RDS);
- b: LOGIN CREATEDB CREATEROLE, owns its database, nothing else;
- c: b plus pg_signal_backend;
- d: a, the four pgbroker_* roles created beforehand by a superuser;
- e: a, the database owned by another role, the installer granted CREATE on it.

Profile b, the least, is also driven through every public function, view, Python class and CLI command (those
tests take the fixture with the one parameter b).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import psycopg
import pytest
from psycopg.rows import dict_row

import pgbroker
from pgbroker import install
from pgbroker._embedded import EmbeddedPostgres

PROFILES = {
    "a": {"member_of": ("pg_signal_backend", "pg_monitor"), "owns_db": True, "roles_first": False},
    "b": {"member_of": (), "owns_db": True, "roles_first": False},
    "c": {"member_of": ("pg_signal_backend",), "owns_db": True, "roles_first": False},
    "d": {"member_of": ("pg_signal_backend", "pg_monitor"), "owns_db": True, "roles_first": True},
    "e": {"member_of": ("pg_signal_backend", "pg_monitor"), "owns_db": False, "roles_first": False},
}
PGBROKER_ROLES = ("pgbroker_reader", "pgbroker_broker", "pgbroker_user", "pgbroker_admin")


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedPostgres]:
    with EmbeddedPostgres() as srv:
        yield srv


def _su(srv: EmbeddedPostgres, *statements: str, db: str = "postgres") -> None:
    with psycopg.connect(srv.url_for(db), autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


@dataclass
class Profile:
    name: str
    srv: EmbeddedPostgres
    installer: str
    db: str
    version: int
    reported: list[install.Right] = field(default_factory=list)

    def url(self, user: str | None = None) -> str:
        return self.srv.url_for(self.db, user=user or self.installer)

    def login(self, role: str) -> str:
        """The login role holding only pgbroker_<role>."""
        return f"lp_{self.name}_{role}"

    def connect(self, role: str | None, application: str = "lp") -> psycopg.Connection:
        user = self.installer if role is None else self.login(role)
        return psycopg.connect(self.url(user), autocommit=True, application_name=application)

    @property
    def can_signal(self) -> bool:
        return "pg_signal_backend" in PROFILES[self.name]["member_of"]


@pytest.fixture(scope="module", params=sorted(PROFILES))
def profile(request: pytest.FixtureRequest, server: EmbeddedPostgres) -> Iterator[Profile]:
    name = request.param
    spec = PROFILES[name]
    installer, db = f"inst_{name}", f"app_{name}"
    in_roles = f" IN ROLE {', '.join(spec['member_of'])}" if spec["member_of"] else ""
    statements = [f"CREATE ROLE {installer} LOGIN CREATEDB CREATEROLE{in_roles}"]
    if spec["roles_first"]:
        statements += [f"CREATE ROLE {r} NOLOGIN" for r in PGBROKER_ROLES]
    if spec["owns_db"]:
        statements.append(f"CREATE DATABASE {db} OWNER {installer}")
    else:
        statements += [
            f"CREATE ROLE owner_{name} NOLOGIN",
            f"CREATE DATABASE {db} OWNER owner_{name}",
            f"GRANT CREATE ON DATABASE {db} TO {installer}",
        ]
    _su(server, *statements)
    with psycopg.connect(server.url) as conn:
        version = conn.info.server_version
    prof = Profile(name, server, installer, db, version)
    try:
        pgbroker.migrate(prof.url(), report=prof.reported.append)
        logins = [(prof.login(r.removeprefix("pgbroker_")), r) for r in PGBROKER_ROLES] + [(prof.login("none"), None)]
        with psycopg.connect(prof.url(), autocommit=True) as conn:
            for login, _ in logins:
                conn.execute(f"CREATE ROLE {login} LOGIN")
        # The installer grants pgbroker's roles when it may (it created them, or PostgreSQL 15's CREATEROLE);
        # on 16+ roles a superuser made are granted by a superuser.
        granter = server.url_for(db) if spec["roles_first"] and version >= 160000 else prof.url()
        with psycopg.connect(granter, autocommit=True) as conn:
            for login, granted in logins:
                if granted:
                    conn.execute(f"GRANT {granted} TO {login}")
        yield prof
        # A downgrade by the installer removes what the install created: the schema, and the roles it made.
        install.downgrade(prof.url())
        with psycopg.connect(server.url_for(db), autocommit=True) as su:
            assert su.execute("SELECT to_regnamespace('pgbroker')").fetchone()[0] is None
            left = {r[0] for r in su.execute("SELECT rolname FROM pg_roles WHERE rolname LIKE 'pgbroker%'")}
        assert left == (set(PGBROKER_ROLES) if spec["roles_first"] else set())
    finally:
        _su(server, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        drops = [f"DROP ROLE IF EXISTS lp_{name}_{r}" for r in ("reader", "broker", "user", "admin", "none", "owner")]
        drops += [f"DROP ROLE IF EXISTS {r}" for r in PGBROKER_ROLES]
        drops += [f"DROP ROLE IF EXISTS owner_{name}", f"DROP ROLE IF EXISTS {installer}"]
        _su(server, *drops)


def _sqlstate(conn: psycopg.Connection, sql: str, params: object = None) -> str | None:
    try:
        conn.execute(sql, params)
    except psycopg.Error as exc:
        return exc.sqlstate
    return None


def _fails(conn: psycopg.Connection, sql: str) -> bool:
    """Whether SQL fails on CONN, with a SQLSTATE or without: a session ended while psycopg was sending leaves the
    connection neither closed nor usable, each later query failing client-side ("another command is already in
    progress", no SQLSTATE)."""
    try:
        conn.execute(sql)
    except psycopg.Error:
        return True
    return False


def _expect_42501(conn: psycopg.Connection, sql: str, params: object = None) -> psycopg.Error:
    with pytest.raises(psycopg.errors.InsufficientPrivilege) as caught:
        conn.execute(sql, params)
    return caught.value


def _lease(conn: psycopg.Connection, name: str) -> dict:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute("SELECT * FROM pgbroker.brokers WHERE name = %s", (name,)).fetchone()


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _cli(prof: Profile, *args: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pgbroker.cli", *args, "--url", prof.url(user)],
        capture_output=True,
        text=True,
        timeout=120,
    )


# ---------------------------------------------------------------------------
# Every profile.


def test_install_says_which_rights_are_missing(profile: Profile):
    missing = {r.right for r in profile.reported}
    assert all(not r.held and not r.essential for r in profile.reported)
    assert ("pg_signal_backend" in missing) == (not profile.can_signal)
    assert ("pg_read_all_stats" in missing) == (profile.name in ("b", "c"))
    assert any(m.startswith("ownership of database") for m in missing) == (profile.name == "e")
    admin_lines = {m for m in missing if m.startswith("ADMIN OPTION")}
    assert bool(admin_lines) == (profile.name == "d" and profile.version >= 160000)
    with psycopg.connect(profile.srv.url_for(profile.db), autocommit=True) as su:
        setting = su.execute(
            "SELECT setconfig FROM pg_db_role_setting WHERE setrole = 0"
            " AND setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchone()
        owner = su.execute("SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'pgbroker'").fetchone()[0]
    assert owner == profile.installer
    # The database's search_path gets pgbroker only when the installer owns the database.
    assert (setting is not None and "pgbroker" in setting[0][0]) == (profile.name != "e")
    check = _cli(profile, "migrate", "--check")
    assert check.returncode == 0, check.stderr
    for right in missing:
        assert right in check.stdout
    doctor = _cli(profile, "doctor", "--json", user=profile.login("admin"))
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    rights = [f for f in json.loads(doctor.stdout)["findings"] if f["check"] == "rights"]
    assert {f["status"] for f in rights} == ({"warn"} if missing else {"ok"})


def test_lease_fanout_primitives_and_squatters(profile: Profile):
    with contextlib.ExitStack() as stack:
        broker = stack.enter_context(profile.connect("broker", "holder"))
        reader = stack.enter_context(profile.connect("reader"))
        user = stack.enter_context(profile.connect("user"))
        admin = stack.enter_context(profile.connect("admin"))
        owner = stack.enter_context(profile.connect(None))
        epoch = broker.execute("SELECT pgbroker.broker_claim('smoke', owner => 'b')").fetchone()[0]
        assert broker.execute("SELECT pgbroker.broker_heartbeat('smoke')").fetchone()[0] is not None
        broker.execute("SELECT pgbroker.broker_assert('smoke', %s)", (epoch,))
        row = _lease(reader, "smoke")
        assert (row["holder_pid"], row["alive"], row["holder_user"]) == (
            broker.info.backend_pid,
            True,
            profile.login("broker"),
        )
        assert reader.execute("SELECT pgbroker.broker_alive('smoke')").fetchone()[0] is True
        # Fan-out: initech.objects, watched by the install, written by its owner.
        broker.execute("SELECT pgbroker.client_register('c1', name => 'smoke')")
        broker.execute("SELECT pgbroker.subscribe('c1', 'initech.objects', '7', name => 'smoke')")
        owner.execute("INSERT INTO initech.objects (id, name) VALUES (7, 'x')")
        rows = broker.execute("SELECT * FROM pgbroker.outbox_fetch('smoke')").fetchall()
        assert len(rows) == 1
        # Primitives.
        assert user.execute("SELECT pgbroker.lock_acquire('l1', '1 s')").fetchone()[0] is True
        assert user.execute("SELECT pgbroker.kv_set('k1', '1')").fetchone()[0] >= 1
        assert user.execute("SELECT pgbroker.counter_add('n1')").fetchone()[0] == 1
        assert user.execute("SELECT allowed FROM pgbroker.rate_limit('r1', 5, '1 s')").fetchone()[0] is True
        assert user.execute("SELECT pgbroker.semaphore_acquire('s1', 2)").fetchone()[0] is not None
        with reader.cursor(row_factory=dict_row) as cur:
            locks = cur.execute("SELECT * FROM pgbroker.locks").fetchall()
        assert [(r["name"], r["holder_pid"]) for r in locks] == [("l1", user.info.backend_pid)]
        # A squatter: a session of another role holding a broker's drain lock by hand, idle.
        squat = stack.enter_context(profile.connect("user", "squatter"))
        squat.execute("SELECT pg_advisory_lock(1885823607, 424242)")
        audit = reader.execute(
            "SELECT pid, session_state, lock_class FROM pgbroker.unaccounted_locks WHERE key = 424242"
        ).fetchall()
        assert audit == [(squat.info.backend_pid, "idle", "broker drain")]
        # Takeover and stale_after: they end the holder's session with pg_signal_backend, or fail before
        # doing anything with a 42501 that names it.
        time.sleep(0.05)
        if profile.can_signal:
            assert admin.execute("SELECT pgbroker.broker_claim('smoke', takeover => true)").fetchone()[0] > epoch
            assert _lease(reader, "smoke")["holder_pid"] == admin.info.backend_pid
        else:
            for sql in (
                "SELECT pgbroker.broker_claim('smoke', takeover => true)",
                "SELECT pgbroker.broker_claim('smoke', stale_after => '1 ms', wait => '1 s')",
            ):
                error = _expect_42501(admin, sql)
                assert "pg_signal_backend" in error.diag.message_primary
                assert f"GRANT pg_signal_backend TO {profile.installer}" in error.diag.message_hint
                row = _lease(reader, "smoke")
                assert (row["epoch"], row["holder_pid"], row["alive"]) == (epoch, broker.info.backend_pid, True)
            broker.execute("SELECT pgbroker.broker_assert('smoke', %s)", (epoch,))
            events = reader.execute("SELECT event FROM pgbroker.lease_history WHERE name = 'smoke'").fetchall()
            assert events == [("claim",)]
            # A holder of the installer's own role can be ended without pg_signal_backend.
            broker.close()
            mine = stack.enter_context(profile.connect(None, "mine"))
            mine_epoch = mine.execute("SELECT pgbroker.broker_claim('own')").fetchone()[0]
            assert admin.execute("SELECT pgbroker.broker_claim('own', takeover => true)").fetchone()[0] > mine_epoch
            assert _wait_for(lambda: mine.closed or _fails(mine, "SELECT 1"))


def test_watch_a_table_of_another_owner(profile: Profile):
    with profile.connect(None) as owner, profile.connect("admin") as admin, profile.connect("broker") as broker:
        su = psycopg.connect(profile.srv.url_for(profile.db), autocommit=True)
        with su:
            su.execute(f"CREATE ROLE lp_{profile.name}_owner NOLOGIN")
            su.execute(f"CREATE SCHEMA app AUTHORIZATION lp_{profile.name}_owner")
            su.execute("CREATE TABLE app.items (id int PRIMARY KEY, v text)")
            su.execute(f"ALTER TABLE app.items OWNER TO lp_{profile.name}_owner")
            # The callers name the table (regclass): they need USAGE on its schema themselves.
            su.execute(f"GRANT USAGE ON SCHEMA app TO {profile.login('admin')}, {profile.login('broker')}")
            error = _expect_42501(admin, "SELECT pgbroker.watch('app.items')")
            assert "USAGE on schema app" in error.diag.message_primary
            assert f"GRANT USAGE ON SCHEMA app TO {profile.installer}" in error.diag.message_hint
            su.execute(f"GRANT USAGE ON SCHEMA app TO {profile.installer}")
            error = _expect_42501(admin, "SELECT pgbroker.watch('app.items')")
            assert "TRIGGER and UPDATE" in error.diag.message_primary
            assert f"GRANT TRIGGER, UPDATE ON app.items TO {profile.installer}" in error.diag.message_hint
            assert owner.execute("SELECT count(*) FROM pgbroker.watched").fetchone()[0] == 1  # initech only
            su.execute(f"GRANT ALL ON app.items TO {profile.installer}")
            assert admin.execute("SELECT pgbroker.watch('app.items')").fetchone()[0] > 0
            epoch = broker.execute("SELECT pgbroker.broker_claim('w')").fetchone()[0]
            broker.execute("SELECT pgbroker.client_register('c', name => 'w')")
            broker.execute("SELECT pgbroker.subscribe('c', 'app.items', name => 'w')")
            su.execute("INSERT INTO app.items VALUES (1, 'a')")
            assert len(broker.execute("SELECT * FROM pgbroker.outbox_fetch('w')").fetchall()) == 1
            # By filter (issue 43): a new shape re-renders the triggers of a table the installer does not own.
            broker.execute("SELECT pgbroker.broker_sleep('w')")
            broker.execute("SELECT pgbroker.unsubscribe('c', 'app.items', name => 'w')")
            broker.execute("""SELECT pgbroker.subscribe('c', 'app.items', filter => '{"v": "b"}', name => 'w')""")
            su.execute("INSERT INTO app.items VALUES (2, 'b'), (3, 'x')")
            su.execute("UPDATE app.items SET v = 'c' WHERE id = 2")
            rows = broker.execute("SELECT op, key, clients, \"left\" FROM pgbroker.outbox_fetch('w')").fetchall()
            assert [r for r in rows if r[1] != 1] == [("I", 2, ["c"], None), ("U", 2, ["c"], ["c"])]
            # A range: a new shape too, and the interest's SP-GiST probe, as the broker's role.
            broker.execute(
                """SELECT pgbroker.subscribe('c', 'app.items', filter => '{"id": {"gte": 10}}', name => 'w')"""
            )
            su.execute("INSERT INTO app.items VALUES (10, 'z'), (9, 'z')")
            rows = broker.execute("SELECT op, key, clients, \"left\" FROM pgbroker.outbox_fetch('w')").fetchall()
            assert [r for r in rows if r[1] in (9, 10)] == [("I", 10, ["c"], None)]
            # Dropping its triggers needs ownership: a second watch and unwatch say so, and change nothing.
            for sql in ("SELECT pgbroker.watch('app.items', mode => 'row')", "SELECT pgbroker.unwatch('app.items')"):
                error = _expect_42501(admin, sql)
                assert "does not own it" in error.diag.message_primary
                assert f"ALTER TABLE app.items OWNER TO {profile.installer}" in error.diag.message_hint
            assert owner.execute("SELECT mode FROM pgbroker.watched WHERE table_name = 'app.items'").fetchone() == (
                "statement",
            )
            su.execute(f"ALTER TABLE app.items OWNER TO {profile.installer}")
            assert admin.execute("SELECT pgbroker.unwatch('app.items')").fetchone()[0] is True
            broker.execute("SELECT pgbroker.broker_release('w')")
            assert epoch > 0
            su.execute("DROP SCHEMA app CASCADE")
            su.execute(f"DROP OWNED BY lp_{profile.name}_owner")


# ---------------------------------------------------------------------------
# Profile b: everything, by login roles holding only pgbroker's roles.

# Each public function with a call, by the pgbroker role that may make it (in this order, on one connection
# per role; {epoch} is the broker's epoch).
CALLS: list[tuple[str, str]] = [
    ("none", "SELECT pgbroker.schema_version()"),
    ("broker", "SELECT pgbroker.broker_claim('all', info => 'x', owner => 'o')"),
    ("broker", "SELECT pgbroker.broker_heartbeat('all')"),
    ("broker", "SELECT pgbroker.broker_assert('all', {epoch})"),
    ("broker", "SELECT pgbroker.broker_state_set('all', 'k', '1')"),
    ("broker", "SELECT pgbroker.broker_state_delete('all', 'k')"),
    ("broker", "SELECT pgbroker.lease_channel()"),
    ("broker", "SELECT pgbroker.wakeup_channel('all')"),
    ("broker", "SELECT pgbroker.client_register('c1', name => 'all')"),
    ("broker", "SELECT pgbroker.client_register_many(ARRAY['c2', 'c3'], name => 'all')"),
    ("broker", "SELECT pgbroker.client_update('c1', '{\"a\": 1}', 'all')"),
    ("broker", "SELECT pgbroker.subscribe('c1', 'initech.objects', '1', 'all')"),
    ("broker", "SELECT pgbroker.subscribe_many(ARRAY['c2'], 'initech.objects', ARRAY['2'::jsonb], 'all')"),
    ("broker", "SELECT pgbroker.unsubscribe('c2', 'initech.objects', '2', 'all')"),
    ("broker", "SELECT pgbroker.subscribe('c1', 'initech.objects', name => 'all', filter => '{\"kind\": \"gear\"}')"),
    (
        "broker",
        "SELECT pgbroker.subscribe_filters(ARRAY['c2'], 'initech.objects', ARRAY['{\"kind\": \"x\"}'::jsonb], 'all')",
    ),
    ("broker", "SELECT pgbroker.unsubscribe('c2', 'initech.objects', name => 'all', filter => '{\"kind\": \"x\"}')"),
    ("broker", "SELECT count(*) FROM pgbroker.outbox_fetch('all')"),
    ("broker", "SELECT pgbroker.outbox_ack('all', ARRAY[]::bigint[])"),
    ("broker", "SELECT pgbroker.broker_wake('all')"),
    ("broker", "SELECT pgbroker.broker_sleep('all')"),
    ("broker", "SELECT pgbroker.client_unregister('c3', 'all')"),
    ("broker", "SELECT pgbroker.client_unregister_many(ARRAY['c2'], 'all')"),
    ("broker", "SELECT pgbroker.broker_sweep('all')"),
    ("broker", "SELECT pgbroker.broker_claim('ttl', owner => 't', ttl => '10 s')"),
    ("broker", "SELECT pgbroker.broker_renew('ttl', 't')"),
    ("broker", "SELECT pgbroker.broker_release('ttl', 't')"),
    ("reader", "SELECT pgbroker.broker_alive('all')"),
    ("reader", "SELECT pgbroker.lease_expiry_check()"),
    ("reader", "SELECT pgbroker.registry_channel('all')"),
    ("reader", "SELECT pgbroker.registry_watch_begin('all')"),
    ("reader", "SELECT pgbroker.registry_watch_end('all')"),
    ("reader", "SELECT pgbroker.name_allowed('lock', 'x')"),
    ("reader", "SELECT count(*) FROM pgbroker.lock_audit()"),
    ("user", "SELECT pgbroker.lock_acquire('l', '1 s')"),
    ("user", "SELECT pgbroker.lock_key('l')"),
    ("user", "SELECT pgbroker.lock_release('l')"),
    ("user", "SELECT pgbroker.semaphore_acquire('s', 2)"),
    ("user", "SELECT pgbroker.semaphore_channel('s')"),
    ("user", "SELECT pgbroker.semaphore_release('s')"),
    ("user", "SELECT pgbroker.kv_set('k', '1')"),
    ("user", "SELECT pgbroker.kv_get('k')"),
    ("user", "SELECT pgbroker.kv_channel()"),
    ("user", "SELECT pgbroker.kv_watch_begin()"),
    ("user", "SELECT pgbroker.kv_watch_end()"),
    ("user", "SELECT pgbroker.kv_delete('k')"),
    ("user", "SELECT pgbroker.counter_add('n', 2)"),
    ("user", "SELECT pgbroker.counter_get('n')"),
    ("user", "SELECT pgbroker.counter_set('n', 5)"),
    ("user", "SELECT pgbroker.counter_delete('n')"),
    ("user", "SELECT * FROM pgbroker.rate_limit('r', 10, '1 s')"),
    ("admin", "SELECT pgbroker.name_grant('counter', 'g/', 'pgbroker_user')"),
    ("admin", "SELECT pgbroker.name_revoke('counter', 'g/', 'pgbroker_user')"),
    ("admin", "SELECT pgbroker.watch('initech.objects', mode => 'row')"),
    ("admin", "SELECT pgbroker.watch('initech.objects')"),
    ("admin", "SELECT pgbroker.lease_history_prune('30 days')"),
    ("admin", "SELECT pgbroker.upkeep_set('30 days')"),
    ("broker", "SELECT count(*) FROM pgbroker.maintain()"),
    ("admin", "SELECT pgbroker.unwatch('initech.objects')"),
    ("admin", "SELECT pgbroker.watch('initech.objects')"),
    ("broker", "SELECT pgbroker.broker_release('all', 'o')"),
]


@pytest.mark.parametrize("profile", ["b"], indirect=True)
def test_every_public_function_and_view_by_login_roles(profile: Profile):
    with contextlib.ExitStack() as stack:
        conns = {r: stack.enter_context(profile.connect(r, f"all-{r}")) for r in ("reader", "broker", "user", "admin")}
        conns["none"] = stack.enter_context(profile.connect("none"))
        called = set()
        epoch = None
        for role, sql in CALLS:
            try:
                row = conns[role].execute(sql.replace("{epoch}", str(epoch))).fetchone()
            except psycopg.Error as exc:
                pytest.fail(f"{role}: {sql}: {exc.sqlstate} {exc.diag.message_primary}")
            if "broker_claim('all'" in sql:
                epoch = row[0]
            called.add(sql.split("pgbroker.", 1)[1].split("(", 1)[0])
        public = {
            r[0]
            for r in conns["admin"].execute(
                "SELECT DISTINCT proname FROM pg_proc WHERE pronamespace = 'pgbroker'::regnamespace"
                " AND proname !~ '^_' AND prokind = 'f'"
            )
        }
        assert public - called == set()
        views = [
            r[0]
            for r in conns["admin"].execute(
                "SELECT c.relname FROM pg_class c WHERE c.relnamespace = 'pgbroker'::regnamespace AND c.relkind = 'v'"
            )
        ]
        assert len(views) > 10
        for view in views:
            conns["reader"].execute(f"SELECT * FROM pgbroker.{view}").fetchall()
        # No view shows a holder's session as gone or fails because pg_stat_activity hides it.
        conns["broker"].execute("SELECT pgbroker.broker_claim('view')")
        assert _lease(conns["reader"], "view")["alive"] is True


@pytest.mark.parametrize("profile", ["b"], indirect=True)
def test_python_classes_by_login_roles(profile: Profile):
    url = profile.url(profile.login("broker"))
    with pgbroker.Broker(url, "py", application_name="py-broker") as broker:
        epoch = broker.epoch
        broker.state_set("k", {"a": 1})
        assert broker.register("c1") is True
        assert broker.subscribe("c1", "initech.objects", 3) is True
        with profile.connect(None) as owner:
            owner.execute("INSERT INTO initech.objects (id) VALUES (3)")
        assert [n.key for n in broker.fetch()] == [3]
        with profile.connect("broker") as other:
            broker.assert_epoch(other)
        # status() reads the view brokers: pgbroker_reader's, which a pgbroker_broker login lacks.
        with pytest.raises(pgbroker.PermissionDenied):
            broker.status()
        broker.check()
        with profile.connect("reader") as reader:
            states = pgbroker.observe(reader, "py", poll_interval=0.2)
            first = next(states)
            assert (first.epoch, first.alive) == (epoch, True)
            states.close()
        with profile.connect("reader") as reader:
            feed = pgbroker.registry_feed(reader, "py", poll_interval=0.2)
            registry, _ = next(feed)
            assert "c1" in registry.clients
            feed.close()
        with pytest.raises(pgbroker.LeaseHeld):
            pgbroker.Broker(url, "py").claim()
    admin_url = profile.url(profile.login("admin"))
    # A takeover this installer may not make is a PermissionDenied, the holder untouched.
    with pgbroker.Broker(url, "py2") as holder:
        with pytest.raises(pgbroker.PermissionDenied) as denied:
            pgbroker.Broker(admin_url, "py2", takeover=True).claim()
        assert "pg_signal_backend" in (denied.value.hint or "")
        holder.check()

    async def run_async() -> int:
        async with pgbroker.AsyncBroker(url, "py-async") as abroker:
            return abroker.epoch

    assert asyncio.run(run_async()) > 0
    with profile.connect("user") as user:
        with pgbroker.Lock(user, "pl", timeout=1):
            pass
        with pgbroker.Semaphore(user, "ps", limit=2, timeout=1):
            pass
        kv = pgbroker.KV(user)
        version = kv.set("pk", {"v": 1})
        assert kv.cas("pk", {"v": 2}, version) is not None
        assert kv.get("pk").value == {"v": 2}
        counter = pgbroker.Counter(user, "pc")
        assert counter.add(3) == 3
        assert pgbroker.RateLimiter(user, "pr", 10, 1.0).allow().allowed is True


@pytest.mark.parametrize("profile", ["b"], indirect=True)
@pytest.mark.parametrize(
    ("role", "args"),
    [
        ("reader", ["status"]),
        ("reader", ["history"]),
        ("reader", ["clients"]),
        ("reader", ["subscriptions"]),
        ("reader", ["metrics"]),
        ("admin", ["doctor"]),
        ("admin", ["watch", "initech.objects", "--mode", "row"]),
        ("admin", ["unwatch", "initech.objects"]),
        ("admin", ["watch", "initech.objects"]),
        ("admin", ["prune"]),
        ("broker", ["sweep"]),
        (None, ["migrate", "--check"]),
        (None, ["migrate"]),
    ],
)
def test_cli_commands_by_login_roles(profile: Profile, role: str | None, args: list[str]):
    done = _cli(profile, *args, user=None if role is None else profile.login(role))
    # doctor exits 3 when it finds something to fix (here: the brokers earlier tests left dead).
    assert done.returncode in ((0, 3) if args == ["doctor"] else (0,)), done.stdout + done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("profile", ["b"], indirect=True)
def test_the_cli_shows_a_refusal_with_its_hint(profile: Profile):
    _su(
        profile.srv,
        "CREATE SCHEMA cli",
        "CREATE TABLE cli.t (id int PRIMARY KEY)",
        f"GRANT USAGE ON SCHEMA cli TO {profile.installer}, {profile.login('admin')}",
        db=profile.db,
    )
    try:
        done = _cli(profile, "watch", "cli.t", user=profile.login("admin"))
        assert done.returncode == 1
        assert "PermissionDenied" in done.stderr
        assert f"HINT:  As the table's owner: GRANT TRIGGER, UPDATE ON cli.t TO {profile.installer};" in done.stderr
        assert "Traceback" not in done.stderr
    finally:
        _su(profile.srv, "DROP SCHEMA cli CASCADE", db=profile.db)


# ---------------------------------------------------------------------------
# Installing: refused before anything is changed, and a failed install leaves nothing behind.


def _pgbroker_roles(srv: EmbeddedPostgres) -> set[str]:
    with psycopg.connect(srv.url, autocommit=True) as su:
        return {r[0] for r in su.execute("SELECT rolname FROM pg_roles WHERE rolname LIKE 'pgbroker%'")}


def test_an_install_without_a_required_right_changes_nothing(server: EmbeddedPostgres):
    _su(server, "CREATE ROLE inst_x LOGIN", "CREATE DATABASE app_x")
    roles_before = _pgbroker_roles(server)  # another profile's may exist: roles are cluster-wide
    try:
        url = server.url_for("app_x", user="inst_x")
        check = subprocess.run(
            [sys.executable, "-m", "pgbroker.cli", "migrate", "--check", "--url", url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert check.returncode == 1
        assert "missing (required): CREATE on database app_x" in check.stdout
        assert "GRANT CREATE ON DATABASE app_x TO inst_x;" in check.stdout
        assert ("missing (required): CREATEROLE" in check.stdout) == (len(roles_before) < 4)
        with pytest.raises(install.InstallError) as refused:
            install.migrate(url)
        assert "Nothing was changed" in str(refused.value)
        alembic = subprocess.run(
            [sys.executable, "-m", "alembic", "upgrade", "head"],
            cwd=install.migrations_path().parent,
            env={"DATABASE_URL": url, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert alembic.returncode != 0
        assert "missing (required): CREATE on database app_x" in alembic.stderr
        # A failure in the middle (the schema initech is someone else's) rolls back everything.
        _su(server, "GRANT CREATE ON DATABASE app_x TO inst_x", "ALTER ROLE inst_x CREATEROLE")
        _su(server, "CREATE ROLE someone NOLOGIN", "CREATE SCHEMA initech AUTHORIZATION someone", db="app_x")
        with pytest.raises(install.InstallError) as failed:
            install.migrate(url)
        assert failed.value.sqlstate == "42501"
        with psycopg.connect(server.url_for("app_x"), autocommit=True) as su:
            assert su.execute("SELECT to_regnamespace('pgbroker')").fetchone()[0] is None
        assert _pgbroker_roles(server) == roles_before
    finally:
        _su(server, "DROP DATABASE IF EXISTS app_x WITH (FORCE)")
        _su(server, "DROP ROLE IF EXISTS someone", "DROP ROLE IF EXISTS inst_x")


@pytest.mark.parametrize("profile", ["b"], indirect=True)
def test_no_thread_or_connection_left(profile: Profile):
    """The module's own hygiene: every connection it opened as a login role is closed."""
    with psycopg.connect(profile.srv.url_for(profile.db), autocommit=True) as su:
        assert _wait_for(
            lambda: (
                su.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND usename LIKE 'lp_%%'"
                ).fetchone()[0]
                == 0
            )
        )
    assert all(t.daemon or t is threading.main_thread() for t in threading.enumerate())


@pytest.mark.parametrize("profile", ["a", "b"], indirect=True)
def test_maintain_forgets_idle_names_only_when_it_can_see_every_snapshot(profile: Profile):
    """maintain() deletes an idle lock name only once every snapshot that could still see its key is gone, also
    when the installer may not read other roles' rows of pg_stat_activity (profile b): backend_xmin is one of
    the columns PostgreSQL shows every role.  Once that snapshot has ended, the next calls delete it."""

    with profile.connect("user", "lp-idle") as user, profile.connect("broker", "lp-upkeep") as broker:
        for i in range(3):
            user.execute("SELECT pgbroker.lock_acquire(%s, '1 s')", (f"idle/{i}",))
            user.execute("SELECT pgbroker.lock_release(%s)", (f"idle/{i}",))
        with profile.connect("reader", "lp-open") as other:
            other.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            other.execute("SELECT count(*) FROM pgbroker.brokers").fetchone()
            for _ in range(3):
                broker.execute("SELECT * FROM pgbroker.maintain()").fetchall()
            held_back = broker.execute(
                "SELECT removed, remaining FROM pgbroker.maintain() WHERE part = 'lock names'"
            ).fetchone()
            other.execute("COMMIT")
        for _ in range(3):
            broker.execute("SELECT * FROM pgbroker.maintain()").fetchall()
        left = broker.execute("SELECT remaining FROM pgbroker.maintain() WHERE part = 'lock names'").fetchone()
    print(f"profile {profile.name}: while another role's transaction was open {held_back}; after it {left}")
    assert held_back[0] == 0 and held_back[1] >= 3  # nothing deleted while that snapshot was open
    assert left == (0,)
