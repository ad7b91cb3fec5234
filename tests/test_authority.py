"""Authority per name (sql/050_authority.sql), with real login roles.

For each kind of name: a role granted on a prefix may, a role without a
grant is refused with 42501 naming the kind and the name and nothing
changes, SET ROLE and SECURITY DEFINER wrappers do not widen what the
login role may do, a revocation bites at the next call, the longest covering
prefix decides, views show only what the reader may read, and names made to
look alike cannot reach another prefix.  What PostgreSQL cannot prevent
(taking an advisory lock by hand) is reported by lock_audit().
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from conftest import admin_execute
from lease_util import wait_until
from psycopg import sql

from pgbroker import Lock, PermissionDenied
from pgbroker._primitives_core import LOCK_CLASS, lock_keys

_roles = itertools.count()


@dataclass(frozen=True)
class Roles:
    """Login roles billing and reports (pgbroker_broker and pgbroker_user), billing a member of the group
    team (NOLOGIN); viewer, a pgbroker_reader; outsider, a login role in no pgbroker role."""

    team: str
    billing: str
    reports: str
    viewer: str
    outsider: str


@pytest.fixture
def roles(pg_server) -> Iterator[Roles]:
    p = f"ta{os.getpid()}_{next(_roles)}"
    r = Roles(f"{p}_team", f"{p}_billing", f"{p}_reports", f"{p}_viewer", f"{p}_outsider")
    admin_execute(
        pg_server,
        f"CREATE ROLE {r.team} NOLOGIN",
        f"CREATE ROLE {r.billing} LOGIN IN ROLE pgbroker_broker, pgbroker_user, {r.team}",
        f"CREATE ROLE {r.reports} LOGIN IN ROLE pgbroker_broker, pgbroker_user",
        f"CREATE ROLE {r.viewer} LOGIN IN ROLE pgbroker_reader",
        f"CREATE ROLE {r.outsider} LOGIN",
    )
    try:
        yield r
    finally:
        admin_execute(
            pg_server, *(f"DROP ROLE IF EXISTS {role}" for role in (r.billing, r.reports, r.viewer, r.outsider, r.team))
        )


@pytest.fixture
def admin(connect):
    return connect("admin", user="t_admin")


def grant(admin, kind: str, prefix: str, role: str, rights: str = "write") -> None:
    admin.execute("SELECT pgbroker.name_grant(%s, %s, %s, %s)", (kind, prefix, role, rights))


def revoke(admin, kind: str, prefix: str, role: str) -> bool:
    return admin.execute("SELECT pgbroker.name_revoke(%s, %s, %s)", (kind, prefix, role)).fetchone()[0]


def refused(conn: psycopg.Connection, sql: str, params: dict, kind: str, name: str, rights: str = "write") -> None:
    """``sql`` fails with 42501 naming the kind and the name (and, in DETAIL, the login role and the rights)."""
    with pytest.raises(psycopg.errors.InsufficientPrivilege) as info:
        conn.execute(sql, params)
    message = info.value.diag.message_primary
    assert kind.replace("_", " ") in message and f'"{name}"' in message, message
    detail = json.loads(info.value.diag.message_detail)
    assert detail == {"kind": kind, "name": name, "role": conn.info.user, "rights": rights}


@dataclass(frozen=True)
class Kind:
    """How to use a name of one kind: a call that writes it, one that only reads it (None: the kind has
    none but its view), its view's rows about the name, all pgbroker records of it (as a superuser), and a
    call that deletes it (None: the kind has none; the upkeep forgets it)."""

    write: str
    read: str | None
    view: str
    state: str
    delete: str | None = None


KINDS = {
    "lease": Kind(
        write="SELECT pgbroker.broker_claim(%(n)s)",
        read="SELECT pgbroker.broker_alive(%(n)s)",
        view="SELECT name FROM pgbroker.brokers WHERE name = %(n)s",
        state="SELECT l.state, l.epoch, l.holder_pid,"
        " (SELECT count(*) FROM pgbroker.lease_event e WHERE e.name = l.name)"
        " FROM pgbroker.lease l WHERE l.name = %(n)s",
    ),
    "lock": Kind(
        write="SELECT pgbroker.lock_acquire(%(n)s, wait => '0')",
        read=None,
        view="SELECT name FROM pgbroker.locks WHERE name = %(n)s",
        state="SELECT n.key, (SELECT count(*) FROM pg_locks k WHERE k.locktype = 'advisory' AND k.objid = n.key::oid"
        f" AND k.classid = {LOCK_CLASS}::oid) FROM pgbroker.lock_name n WHERE n.name = %(n)s",
    ),
    "semaphore": Kind(
        write="SELECT pgbroker.semaphore_acquire(%(n)s, 2)",
        read="SELECT pgbroker.semaphore_channel(%(n)s)",
        view="SELECT name FROM pgbroker.semaphores WHERE name = %(n)s",
        state="SELECT permit, key, (SELECT count(*) FROM pg_locks k WHERE k.locktype = 'advisory'"
        " AND k.objid = p.key::oid AND k.granted)"
        " FROM pgbroker.semaphore_permit p WHERE p.name = %(n)s ORDER BY permit",
    ),
    "kv": Kind(
        write="SELECT pgbroker.kv_set(%(n)s, '1')",
        delete="SELECT pgbroker.kv_delete(%(n)s)",
        read="SELECT * FROM pgbroker.kv_get(%(n)s)",
        view="SELECT key FROM pgbroker.kv WHERE key = %(n)s",
        state="SELECT value, version FROM pgbroker.kv_entry WHERE key = %(n)s",
    ),
    "counter": Kind(
        write="SELECT pgbroker.counter_add(%(n)s, 1)",
        delete="SELECT pgbroker.counter_delete(%(n)s)",
        read="SELECT pgbroker.counter_get(%(n)s)",
        view="SELECT name FROM pgbroker.counters WHERE name = %(n)s",
        state="SELECT value FROM pgbroker.counter WHERE name = %(n)s",
    ),
    "rate_limit": Kind(
        write="SELECT * FROM pgbroker.rate_limit(%(n)s, 1000, '1 s')",
        read=None,
        view="SELECT name FROM pgbroker.rate_limits WHERE name = %(n)s",
        state="SELECT tat, allowed, denied FROM pgbroker.rate_limit_state WHERE name = %(n)s",
    ),
}
kinds = pytest.mark.parametrize("kind", list(KINDS))


def state(su, kind: str, name: str) -> list[tuple]:
    return su.execute(KINDS[kind].state, {"n": name}).fetchall()


@kinds
def test_a_granted_role_may_and_another_is_refused_with_nothing_changed(kind, roles, admin, connect):
    k = KINDS[kind]
    su = connect("superuser")
    billing, reports = connect("billing", user=roles.billing), connect("reports", user=roles.reports)
    grant(admin, kind, "billing/", roles.team)

    billing.execute(k.write, {"n": "billing/x"})  # through the group the login role is a member of
    before = state(su, kind, "billing/x")
    assert before
    refused(reports, k.write, {"n": "billing/x"}, kind, "billing/x")
    if k.read is not None:
        refused(reports, k.read, {"n": "billing/x"}, kind, "billing/x", rights="read")
        billing.execute(k.read, {"n": "billing/x"})
    assert state(su, kind, "billing/x") == before
    # A name never used is not created by a refused call either.
    refused(reports, k.write, {"n": "billing/never"}, kind, "billing/never")
    assert state(su, kind, "billing/never") == []
    # A name no grant covers is anyone's, as without grants.
    reports.execute(k.write, {"n": "reports/x"})
    assert state(su, kind, "reports/x")
    if k.delete is not None:  # deleting is writing: refused too, and the row stays
        refused(reports, k.delete, {"n": "billing/x"}, kind, "billing/x")
        assert state(su, kind, "billing/x") == before
        billing.execute(k.delete, {"n": "billing/x"})
        assert state(su, kind, "billing/x") == []


@kinds
def test_read_rights_read_but_do_not_write(kind, roles, admin, connect):
    k = KINDS[kind]
    su = connect("superuser")
    billing, reports = connect("billing", user=roles.billing), connect("reports", user=roles.reports)
    grant(admin, kind, "billing/", roles.team)
    grant(admin, kind, "billing/", roles.reports, "read")
    billing.execute(k.write, {"n": "billing/x"})
    before = state(su, kind, "billing/x")

    if k.read is not None:
        reports.execute(k.read, {"n": "billing/x"})
    if kind != "lease":  # pgbroker_broker reads no view
        assert reports.execute(k.view, {"n": "billing/x"}).fetchall() == [("billing/x",)]
    refused(reports, k.write, {"n": "billing/x"}, kind, "billing/x")
    assert state(su, kind, "billing/x") == before
    # Granting again replaces the rights.
    grant(admin, kind, "billing/", roles.reports, "write")
    reports.execute(k.write, {"n": "billing/y"})


@kinds
def test_views_show_only_the_rows_a_role_may_read(kind, roles, admin, connect):
    k = KINDS[kind]
    billing = connect("billing", user=roles.billing)
    viewer, reports = connect("viewer", user=roles.viewer), connect("reports", user=roles.reports)
    grant(admin, kind, "billing/", roles.team)
    billing.execute(k.write, {"n": "billing/x"})
    billing.execute(k.write, {"n": "open/x"})

    for conn in (viewer, reports):  # a reader, and a user of the primitives (who reads their views)
        if kind == "lease" and conn is reports:
            continue  # pgbroker_broker reads no view
        assert conn.execute(k.view, {"n": "open/x"}).fetchall() == [("open/x",)]
        assert conn.execute(k.view, {"n": "billing/x"}).fetchall() == []
    grant(admin, kind, "billing/", roles.viewer, "read")
    assert viewer.execute(k.view, {"n": "billing/x"}).fetchall() == [("billing/x",)]
    assert viewer.execute("SELECT pgbroker.name_allowed(%s, 'billing/x')", (kind,)).fetchone() == (True,)
    assert viewer.execute("SELECT pgbroker.name_allowed(%s, 'billing/x', 'write')", (kind,)).fetchone() == (False,)


@kinds
def test_set_role_and_definer_wrappers_do_not_widen(kind, roles, admin, connect):
    """Membership is judged on the login role: SET ROLE to a role it may become, or a SECURITY DEFINER
    function owned by a granted role, leaves it refused; a granted login role that narrows its current role
    keeps its rights."""
    k = KINDS[kind]
    su = connect("superuser")
    grant(admin, kind, "billing/", roles.team)
    capability = "pgbroker_broker" if kind == "lease" else "pgbroker_user"
    reports = connect("reports", user=roles.reports)
    reports.execute(f"SET ROLE {capability}")
    refused(reports, k.write, {"n": "billing/x"}, kind, "billing/x")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        reports.execute(f"SET ROLE {roles.team}")  # not a member: PostgreSQL refuses

    # A definer function owned by billing (a member of the team), callable by reports.
    su.execute(f"GRANT CREATE ON SCHEMA public TO {roles.billing}")
    try:
        fn = f"public.{roles.billing}_wrapper"
        body = sql.SQL("BEGIN EXECUTE format({}, n); RETURN current_user; END").format(
            sql.Literal(k.write.replace("%(n)s", "%L"))
        )
        su.execute(
            sql.SQL(
                "CREATE FUNCTION {}(n text) RETURNS text LANGUAGE plpgsql SECURITY DEFINER"
                " SET search_path = pg_catalog AS {}"
            ).format(sql.SQL(fn), sql.Literal(body.as_string(su)))
        )
        su.execute(f"ALTER FUNCTION {fn}(text) OWNER TO {roles.billing}")
        su.execute(f"GRANT EXECUTE ON FUNCTION {fn}(text) TO {roles.reports}")
        billing = connect("billing", user=roles.billing)
        assert billing.execute(f"SELECT {fn}('billing/by-definer')").fetchone() == (roles.billing,)
        reports.execute("RESET ROLE")
        before = state(su, kind, "billing/x")
        refused(reports, f"SELECT {fn}(%(n)s)", {"n": "billing/x"}, kind, "billing/x")
        assert state(su, kind, "billing/x") == before

        billing.execute(f"SET ROLE {capability}")  # narrower current role, same login role
        billing.execute(k.write, {"n": "billing/y"})
    finally:
        su.execute(f"DROP FUNCTION IF EXISTS public.{roles.billing}_wrapper(text)")
        su.execute(f"REVOKE CREATE ON SCHEMA public FROM {roles.billing}")


@kinds
def test_a_revocation_bites_at_the_next_call(kind, roles, admin, connect):
    k = KINDS[kind]
    billing = connect("billing", user=roles.billing)
    grant(admin, kind, "billing/", roles.team)
    grant(admin, kind, "billing/", roles.reports)
    billing.execute(k.write, {"n": "billing/x"})
    assert revoke(admin, kind, "billing/", roles.team) is True
    assert revoke(admin, kind, "billing/", roles.team) is False  # nothing left to take back
    refused(billing, k.write, {"n": "billing/y"}, kind, "billing/y")
    # The last grant covering a name gone, the name is anyone's again.
    assert revoke(admin, kind, "billing/", roles.reports) is True
    billing.execute(k.write, {"n": "billing/y"})


@kinds
def test_the_longest_covering_prefix_decides(kind, roles, admin, connect):
    k = KINDS[kind]
    billing, reports = connect("billing", user=roles.billing), connect("reports", user=roles.reports)
    grant(admin, kind, "billing/", roles.team)
    grant(admin, kind, "billing/audit/", roles.reports)
    reports.execute(k.write, {"n": "billing/audit/x"})
    refused(billing, k.write, {"n": "billing/audit/x"}, kind, "billing/audit/x")
    refused(reports, k.write, {"n": "billing/x"}, kind, "billing/x")
    billing.execute(k.write, {"n": "billing/x"})
    # '' covers every name: names no longer prefix covers become the grantee's alone.
    grant(admin, kind, "", roles.reports)
    reports.execute(k.write, {"n": "misc/x"})
    refused(billing, k.write, {"n": "misc/x"}, kind, "misc/x")
    billing.execute(k.write, {"n": "billing/z"})  # 'billing/' is longer than ''


HOSTILE = [
    # (the prefix the intruder is granted, the name it tries) with 'billing/' the team's
    ("billing", "billing/x"),  # a shorter prefix of the same text loses to the longer one
    ("b%", "billing/x"),  # LIKE wildcards are plain characters
    ("b_lling/", "billing/x"),
    ("%", "billing/x"),
    ("Billing/", "billing/x"),  # no case folding
    ("b\u0456lling/", "billing/x"),  # CYRILLIC SMALL LETTER BYELORUSSIAN-UKRAINIAN I
    ("billing\u2215", "billing/x"),  # DIVISION SLASH
    ("billing/x\u200b", "billing/x"),  # a longer prefix with an invisible character covers other names
]


@pytest.mark.parametrize("kind", ["kv", "lock", "lease"])
@pytest.mark.parametrize(("prefix", "name"), HOSTILE, ids=[repr(p) for p, _ in HOSTILE])
def test_hostile_names_do_not_reach_another_prefix(kind, prefix, name, roles, admin, connect):
    k = KINDS[kind]
    su = connect("superuser")
    reports = connect("reports", user=roles.reports)
    grant(admin, kind, "billing/", roles.team)
    grant(admin, kind, prefix, roles.reports)
    before = state(su, kind, name)
    refused(reports, k.write, {"n": name}, kind, name)
    assert state(su, kind, name) == before
    assert su.execute("SELECT pgbroker.name_allowed(%s, %s, 'write', %s)", (kind, name, roles.reports)).fetchone() == (
        False,
    )


def test_look_alike_names_are_other_names(roles, admin, connect):
    """A name that looks like a covered one is a different name: usable by whoever its own prefix allows,
    and touching nothing of the covered one's."""
    su = connect("superuser")
    billing, reports = connect("billing", user=roles.billing), connect("reports", user=roles.reports)
    grant(admin, "kv", "billing/", roles.team)
    billing.execute("SELECT pgbroker.kv_set('billing/limit', '10')")
    composed = "billing/caf\u00e9"
    decomposed = unicodedata.normalize("NFD", composed)
    billing.execute("SELECT pgbroker.kv_set(%s, '1')", (composed,))
    for name in ("Billing/limit", "b\u0456lling/limit", "billing\u2215limit", "billing", "billing%", "billing_limit"):
        reports.execute("SELECT pgbroker.kv_set(%s, '666')", (name,))
    # The decomposed spelling is still under 'billing/': refused.
    refused(reports, "SELECT pgbroker.kv_set(%(n)s, '666')", {"n": decomposed}, "kv", decomposed)
    rows = dict(su.execute("SELECT key, value FROM pgbroker.kv_entry WHERE key LIKE 'billing/%'").fetchall())
    assert rows == {"billing/limit": 10, composed: 1}


def test_a_lease_name_covers_claim_stale_takeover_clients_and_delivery(roles, admin, connect):
    su = connect("superuser")
    billing, reports = connect("billing", user=roles.billing), connect("reports", user=roles.reports)
    grant(admin, "lease", "billing/", roles.team)
    grant(admin, "lease", "billing/", roles.reports, "read")
    epoch = billing.execute("SELECT pgbroker.broker_claim('billing/broker')").fetchone()[0]
    billing.execute("SELECT pgbroker.client_register('c1', '{}', 'billing/broker')")
    before = state(su, "lease", "billing/broker")

    # stale_after would terminate the holder: refused before anything is judged.
    refused(
        reports,
        "SELECT pgbroker.broker_claim(%(n)s, stale_after => '0.001 s', wait => '0')",
        {"n": "billing/broker"},
        "lease",
        "billing/broker",
    )
    assert state(su, "lease", "billing/broker") == before
    assert reports.execute("SELECT pgbroker.broker_alive('billing/broker')").fetchone() == (True,)
    # Takeover needs pgbroker_admin on top of the name grant: t_admin has no grant on billing/.
    refused(
        admin,
        "SELECT pgbroker.broker_claim(%(n)s, takeover => true)",
        {"n": "billing/broker"},
        "lease",
        "billing/broker",
    )
    assert state(su, "lease", "billing/broker") == before

    # The holder loses its grant: every holder call is refused from the next one; releasing needs none.
    assert revoke(admin, "lease", "billing/", roles.team)
    for call in (
        "SELECT pgbroker.broker_heartbeat(%(n)s)",
        "SELECT pgbroker.broker_renew(%(n)s, NULL)",
        "SELECT pgbroker.client_register('c2', '{}', %(n)s)",
        "SELECT pgbroker.client_register_many(ARRAY['c3'], NULL, %(n)s)",
        "SELECT pgbroker.client_update('c1', '{}', %(n)s)",
        "SELECT pgbroker.client_unregister('c1', %(n)s)",
        "SELECT pgbroker.client_unregister_many(ARRAY['c1'], %(n)s)",
        "SELECT pgbroker.broker_state_set(%(n)s, 'k', '1')",
        "SELECT * FROM pgbroker.outbox_fetch(%(n)s)",
        "SELECT pgbroker.outbox_ack(%(n)s, '{}')",
        "SELECT pgbroker.broker_wake(%(n)s)",
    ):
        refused(billing, call, {"n": "billing/broker"}, "lease", "billing/broker")
    assert su.execute(
        "SELECT client_id FROM pgbroker.client WHERE name = 'billing/broker' AND epoch = %s", (epoch,)
    ).fetchall() == [("c1",)]
    assert billing.execute("SELECT pgbroker.broker_release('billing/broker')").fetchone() == (True,)


def test_name_grant_and_revoke_check_their_arguments_and_callers(roles, admin, connect):
    su = connect("superuser")
    user = connect("user", user="t_user")
    version = su.execute("SELECT version FROM pgbroker.name_grants_version").fetchone()[0]
    bad = [
        (("nope", "x", roles.team, "write"), psycopg.errors.InvalidParameterValue, 'unknown kind "nope"'),
        (("kv", "x", roles.team, "admin"), psycopg.errors.InvalidParameterValue, "rights must be read or write"),
        (("kv", "x", roles.team, None), psycopg.errors.InvalidParameterValue, "rights must be read or write"),
        ((None, "x", roles.team, "write"), psycopg.errors.NullValueNotAllowed, "must not be NULL"),
        (("kv", None, roles.team, "write"), psycopg.errors.NullValueNotAllowed, "must not be NULL"),
        (("kv", "x" * 201, roles.team, "write"), psycopg.errors.InvalidParameterValue, "prefix is too long"),
    ]
    for args, error, message in bad:
        with pytest.raises(error, match=message):
            admin.execute("SELECT pgbroker.name_grant(%s, %s, %s, %s)", args)
    with pytest.raises(psycopg.errors.UndefinedObject):
        admin.execute("SELECT pgbroker.name_grant('kv', 'x', 'no_such_role_at_all')")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):  # not pgbroker_admin
        user.execute("SELECT pgbroker.name_grant('kv', '', %s)", (roles.reports,))
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        user.execute("SELECT pgbroker.name_revoke('kv', '', %s)", (roles.reports,))
    with pytest.raises(psycopg.errors.InvalidParameterValue, match='unknown kind "locks"'):
        admin.execute("SELECT pgbroker.name_revoke('locks', '', %s)", (roles.reports,))
    assert su.execute("SELECT count(*) FROM pgbroker.name_grant").fetchone() == (0,)
    assert su.execute("SELECT version FROM pgbroker.name_grants_version").fetchone()[0] == version

    grant(admin, "kv", "billing/", roles.team, "read")
    viewer = connect("viewer", user=roles.viewer)
    rows = viewer.execute("SELECT kind, prefix, role::text, rights FROM pgbroker.name_grants").fetchall()
    assert rows == [("kv", "billing/", roles.team, "read")]
    assert viewer.execute("SELECT version, kinds FROM pgbroker.name_grants_version").fetchone() == (version + 1, ["kv"])


def test_a_dropped_roles_grant_admits_nobody(pg_server, roles, admin, connect):
    gone = f"{roles.team}_gone"
    admin_execute(pg_server, f"CREATE ROLE {gone} NOLOGIN")
    grant(admin, "counter", "billing/", gone)
    admin_execute(pg_server, f"DROP ROLE {gone}")
    billing = connect("billing", user=roles.billing)
    refused(billing, "SELECT pgbroker.counter_add(%(n)s)", {"n": "billing/x"}, "counter", "billing/x")
    viewer = connect("viewer", user=roles.viewer)
    assert viewer.execute("SELECT prefix, role::text ~ '^[0-9]+$' FROM pgbroker.name_grants").fetchall() == [
        ("billing/", True)
    ]


def test_python_raises_permission_denied_with_the_name(roles, admin, connect):
    from pgbroker import KV

    grant(admin, "kv", "billing/", roles.team)
    conn = connect("reports", user=roles.reports)
    with pytest.raises(PermissionDenied) as info:
        KV(conn).set("billing/x", 1)
    assert (info.value.kind, info.value.name, info.value.role, info.value.rights) == (
        "kv",
        "billing/x",
        roles.reports,
        "write",
    )
    assert info.value.sqlstate == "42501"


def test_the_python_lock_does_not_keep_a_key_it_may_no_longer_fetch(roles, admin, connect, pg_server, db_name):
    """The Lock caches a name's key and takes the advisory lock by it: a grant since (a new version), or any
    grant on lock names (role memberships may change without one), makes it ask lock_acquire."""
    su = connect("superuser")
    conn = psycopg.connect(pg_server.url_for(db_name, user=roles.billing), autocommit=True)
    try:
        lock = Lock(conn, "jobs/nightly", timeout=0)
        assert lock.acquire()
        lock.release()
        assert "jobs/nightly" in lock_keys(conn)  # no lock grant: the key is cached
        assert lock.acquire()
        lock.release()

        grant(admin, "lock", "jobs/", roles.reports)  # a grant that leaves billing out
        with pytest.raises(PermissionDenied):
            lock.acquire()
        assert "jobs/nightly" not in lock_keys(conn)
        assert not lock.locked
        assert su.execute(KINDS["lock"].state, {"n": "jobs/nightly"}).fetchall()[0][1] == 0

        grant(admin, "lock", "jobs/", roles.team)  # billing may again, through its group
        assert lock.acquire()
        lock.release()
        assert "jobs/nightly" not in lock_keys(conn)  # lock names have grants: nothing cached
        su.execute(f"REVOKE {roles.team} FROM {roles.billing}")  # membership changes bump no version
        with pytest.raises(PermissionDenied):
            lock.acquire()
    finally:
        conn.close()


def test_revoking_leaves_held_locks_held_until_given_back(roles, admin, connect):
    billing = connect("billing", user=roles.billing)
    grant(admin, "lock", "jobs/", roles.team)
    grant(admin, "semaphore", "jobs/", roles.team)
    assert billing.execute("SELECT pgbroker.lock_acquire('jobs/a', wait => '0')").fetchone() == (True,)
    assert billing.execute("SELECT pgbroker.semaphore_acquire('jobs/s', 1)").fetchone() == (1,)
    revoke(admin, "lock", "jobs/", roles.team)
    revoke(admin, "semaphore", "jobs/", roles.team)
    grant(admin, "lock", "jobs/", roles.reports)
    grant(admin, "semaphore", "jobs/", roles.reports)
    assert billing.execute("SELECT pgbroker.lock_release('jobs/a')").fetchone() == (True,)
    assert billing.execute("SELECT pgbroker.semaphore_release('jobs/s')").fetchone() == (True,)
    refused(billing, KINDS["lock"].write, {"n": "jobs/a"}, "lock", "jobs/a")


# ---------------------------------------------------------------------------
# What cannot be enforced, detected.

SCRIPT = Path(sys.executable).with_name("pgbroker")
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [shutil.which("pgbroker") or "pgbroker"]


def unaccounted(conn) -> list[tuple]:
    return conn.execute("SELECT pid, role, application, lock_class, why FROM pgbroker.unaccounted_locks").fetchall()


def test_squatted_locks_are_reported_with_their_role(roles, admin, connect, db_url):
    su = connect("superuser")
    viewer = connect("viewer", user=roles.viewer)
    billing = connect("billing", user=roles.billing)
    grant(admin, "lock", "billing/", roles.team)
    billing.execute("SELECT pgbroker.broker_claim('billing/broker')")
    billing.execute("SELECT pgbroker.lock_acquire('billing/job')")
    billing.execute("SELECT pgbroker.lock_acquire('open/job')")
    assert unaccounted(viewer) == []  # the holder and legitimate lock holders are accounted for

    # Advisory locks have no privileges: a role in no pgbroker role takes the broker's lease lock by hand
    # after its release, and the named lock's key; reports takes a billing lock's key too.
    lease_key, job_key = su.execute(
        "SELECT (SELECT lock_key FROM pgbroker.lease WHERE name = 'billing/broker'),"
        " (SELECT key FROM pgbroker.lock_name WHERE name = 'billing/job')"
    ).fetchone()
    billing.execute("SELECT pgbroker.lock_release('billing/job')")
    billing.execute("SELECT pgbroker.broker_release('billing/broker')")
    outsider = connect("squatter", user=roles.outsider)
    outsider.execute("SELECT pg_advisory_lock(1885823602, %s)", (lease_key,))  # pgbroker._lock_class()
    reports = connect("reports-squat", user=roles.reports)
    reports.execute("SELECT pg_advisory_lock(%s, %s)", (LOCK_CLASS, job_key))
    outsider_pid, reports_pid = outsider.info.backend_pid, reports.info.backend_pid

    rows = {row[0]: row for row in wait_until(lambda: len(unaccounted(viewer)) == 2 and unaccounted(viewer))}
    assert rows[outsider_pid][1:4] == (roles.outsider, "squatter", "lease")
    assert "not its recorded holder" in rows[outsider_pid][4]
    assert rows[reports_pid][1:4] == (roles.reports, "reports-squat", "lock")
    assert rows[reports_pid][4] == f'named lock "billing/job", which the name grants refuse to {roles.reports}'
    # The squat denies service: billing cannot take its lock.
    assert billing.execute("SELECT pgbroker.lock_acquire('billing/job', wait => '0')").fetchone() == (False,)

    health = viewer.execute(
        "SELECT subject, ok FROM pgbroker.health WHERE \"check\" = 'unaccounted_lock' ORDER BY subject"
    ).fetchall()
    assert health == sorted([(f"pid {outsider_pid}", False), (f"pid {reports_pid}", False)])
    result = subprocess.run([*COMMAND, "doctor", "--json", "--url", db_url], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stderr
    failed = {(f["check"], f["subject"]) for f in json.loads(result.stdout)["findings"] if f["status"] == "FAIL"}
    assert ("unaccounted_lock", f"pid {outsider_pid}") in failed

    outsider.close()
    reports.execute("SELECT pg_advisory_unlock_all()")
    wait_until(lambda: unaccounted(viewer) == [], what="the squats to end")


def test_a_session_lock_taken_by_hand_on_a_transaction_lock_class_is_reported(roles, connect):
    viewer = connect("viewer", user=roles.viewer)
    squatter = connect("squatter", user=roles.outsider)
    squatter.execute("SELECT pg_advisory_lock(1885823603, 1)")  # a table's watch lock, held outside a transaction
    rows = wait_until(lambda: unaccounted(viewer))
    assert [(r[1], r[3]) for r in rows] == [(roles.outsider, "table watch")]
    assert "only takes inside a statement or transaction" in rows[0][4]


def test_lock_audit_callers(connect):
    """Readers may call lock_audit (a definer function: it sees every session); others may not."""
    for user, allowed in (("t_reader", True), ("t_admin", True), ("t_user", False), ("t_none", False)):
        conn = connect(user, user=user)
        if allowed:
            assert conn.execute("SELECT count(*) FROM pgbroker.lock_audit()").fetchone() == (0,)
        else:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SELECT count(*) FROM pgbroker.lock_audit()")
