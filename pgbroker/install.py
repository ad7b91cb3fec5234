"""Install pgbroker: apply its alembic migrations, from a checkout or an installed wheel.

Two ways in, and both are recognised here:

- pgbroker's own alembic environment (``pgbroker migrate``, :func:`migrate`,
  ``alembic upgrade head`` from a checkout) records its revisions in
  ``pgbroker.alembic_version``;
- an application's alembic environment with pgbroker's revisions in its
  ``version_locations`` records them in the application's version table.

Either way the schema knows its own version: ``pgbroker.schema_version()``
returns the release of the installed schema, ``0.1.0`` (:func:`installed_version`);
:func:`compare_schema` says how it stands against this package's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from pgbroker.errors import PgBrokerError

if TYPE_CHECKING:
    import psycopg
    from alembic.config import Config

VERSION_TABLE = "alembic_version"
VERSION_TABLE_SCHEMA = "pgbroker"
BRANCH_LABEL = "pgbroker"
# What pgbroker.schema_version() returns once this package's migrations have
# run: the release that froze the schema ("0.1.0"), or, for a revision made
# since and not yet released, that release and the revision's number
# ("0.1.0+3").  sql/000_schema.sql says the same (a test keeps them equal).
SCHEMA_VERSION = "0.1.0+4"
# The oldest installed schema this package's Broker works against (before
# `pgbroker migrate` in a deploy); an older one is SchemaMismatch.
OLDEST_SCHEMA = "0.1.0"
# The revision that installs the core schema: the one to name in an
# application revision's depends_on (migrations/README.md).
CORE_REVISION = "pgbroker_0001_baseline"
URL_FORM = "postgresql://user:password@host:port/dbname"
# An upgrade waits at most this long for any one lock (lock_timeout), so a
# writer queued behind its lock request waits no longer; when it runs out the
# upgrade is rolled back and runs again, up to LOCK_RETRIES more times
# (migrations/env.py, migrations/README.md "Upgrading").
LOCK_TIMEOUT_S = 0.5
LOCK_RETRIES = 60

__all__ = [
    "BRANCH_LABEL",
    "CORE_REVISION",
    "LOCK_RETRIES",
    "LOCK_TIMEOUT_S",
    "OLDEST_SCHEMA",
    "SCHEMA_VERSION",
    "SchemaCheck",
    "compare_schema",
    "InstallError",
    "Installation",
    "Right",
    "check_rights",
    "migrate",
    "downgrade",
    "current_revision",
    "installed_version",
    "installation",
    "migrations_path",
    "versions_path",
    "sql_path",
    "sqlalchemy_url",
]


class InstallError(PgBrokerError):
    """The database cannot be reached or installed into; the message is one line saying why and what to do."""


_VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)(?:\+(\d+))?")


def version_key(version: str | None) -> tuple[int, int, int, int] | None:
    """``"0.1.0"`` -> (0, 1, 0, 0), ``"0.1.0+3"`` -> (0, 1, 0, 3); None for anything else (a pre-release install)."""
    m = _VERSION.fullmatch(version or "")
    return None if m is None else (int(m[1]), int(m[2]), int(m[3]), int(m[4] or 0))


@dataclass(frozen=True)
class SchemaCheck:
    """How an installed schema version stands against this package's.

    ``state``: ``same``; ``older`` (this package works against it, and
    ``pgbroker migrate`` brings it up to date); ``newer`` (installed by a newer
    package: this one keeps working while the schema keeps what it calls, see
    migrations/README.md "Upgrading"); ``unsupported`` (older than
    :data:`OLDEST_SCHEMA`, or not a release's version: a development install
    from before 0.1.0).  ``usable``: the Broker works against it (with a
    warning unless ``same``).  ``message`` names both versions; ``fix`` is the
    command that fixes it (None when ``same``).
    """

    installed: str
    expected: str
    state: str
    message: str
    fix: str | None

    @property
    def usable(self) -> bool:
        return self.state in ("same", "older", "newer")


def compare_schema(installed: str, expected: str = SCHEMA_VERSION, oldest: str = OLDEST_SCHEMA) -> SchemaCheck:
    """Compare the installed schema version ``installed`` with this package's ``expected``."""
    have, want, low = version_key(installed), version_key(expected), version_key(oldest)
    migrate_fix = "pgbroker migrate (or alembic upgrade heads where your application's alembic installed it)"
    if installed == expected:
        return SchemaCheck(installed, expected, "same", f"pgbroker schema version {installed}, as this package's", None)
    if have is None:
        return SchemaCheck(
            installed,
            expected,
            "unsupported",
            f"installed pgbroker schema version {installed} is not a release's (a development install from before "
            f"0.1.0?); this package's is {expected}",
            "DROP SCHEMA pgbroker CASCADE (it takes pgbroker's triggers off your tables too), then pgbroker migrate: "
            "a pre-release schema is reinstalled, not upgraded",
        )
    if want is not None and have > want:
        return SchemaCheck(
            installed,
            expected,
            "newer",
            f"installed pgbroker schema version {installed} is newer than this package's {expected}",
            f"pip install -U pgbroker (a package whose schema version is {installed} or later)",
        )
    if low is not None and have < low:
        return SchemaCheck(
            installed,
            expected,
            "unsupported",
            f"installed pgbroker schema version {installed} is older than this package's {expected}, and older than "
            f"the oldest it works with ({oldest})",
            migrate_fix,
        )
    return SchemaCheck(
        installed,
        expected,
        "older",
        f"installed pgbroker schema version {installed} is older than this package's {expected}",
        migrate_fix,
    )


def _data_dir(name: str) -> Path:
    """``migrations`` or ``sql``: inside the wheel, or at the checkout's top level."""
    packaged = Path(str(resources.files("pgbroker"))) / name
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parent.parent / name
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(f"pgbroker: cannot find its {name}/ directory (looked in {packaged} and {checkout})")


def migrations_path() -> Path:
    """The alembic environment directory (``migrations/``)."""
    return _data_dir("migrations")


def versions_path() -> Path:
    """The revisions directory: add it to your own alembic ``version_locations``."""
    return migrations_path() / "versions"


def sql_path() -> Path:
    """The ``sql/`` directory: the current definition of every object."""
    return _data_dir("sql")


def check_url(url: str) -> str:
    """``url`` as a libpq URL, or :class:`InstallError` saying what is wrong with it (nothing is contacted)."""
    from psycopg.conninfo import conninfo_to_dict

    prefixes = ("postgresql+psycopg://", "postgresql://", "postgres://")
    if not url.startswith(prefixes):
        raise InstallError(f"not a PostgreSQL URL: {redact(url)!r} (expected {URL_FORM})")
    libpq = "postgresql://" + url.split("://", 1)[1]
    try:
        info = conninfo_to_dict(libpq)
    except Exception as exc:  # psycopg.ProgrammingError: libpq's parser
        raise InstallError(f"bad PostgreSQL URL {redact(url)!r}: {_first_line(exc)} (expected {URL_FORM})") from None
    port = str(info.get("port") or "")
    if port and not all(part.isdigit() for part in port.split(",")):
        raise InstallError(f"bad PostgreSQL URL {redact(url)!r}: port {port!r} is not a number (expected {URL_FORM})")
    return libpq


def sqlalchemy_url(url: str) -> str:
    """Turn a libpq-style ``postgresql://`` URL into SQLAlchemy's psycopg 3 form (:class:`InstallError` if bad).

    A multi-host URL becomes SQLAlchemy's ``?host=h1:p1&host=h2:p2`` form (pgbroker/_url.py).
    """
    from pgbroker._url import to_sqlalchemy

    try:
        return to_sqlalchemy(check_url(url))
    except ValueError as exc:
        raise InstallError(f"{redact(url)!r}: {exc}") from None


def libpq_url(url: str) -> str:
    """The inverse of :func:`sqlalchemy_url`, for psycopg."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def redact(url: str) -> str:
    """``url`` without its password."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}"


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def describe(url: str) -> str:
    """``database NAME on HOST:PORT`` for a URL, without its password."""
    from psycopg.conninfo import conninfo_to_dict

    from pgbroker._url import describe_hosts

    libpq = check_url(url)
    return f"database {conninfo_to_dict(libpq).get('dbname') or '(default)'} on {describe_hosts(libpq)}"


def connection_error(url: str, exc: BaseException) -> InstallError:
    """A failed connection as one line naming the database (server down, no such database, auth...)."""
    return InstallError(f"cannot connect to {describe(url)}: {_first_line(exc)}")


@contextmanager
def _connect(url: str) -> Iterator[psycopg.Connection]:
    import psycopg

    conninfo = check_url(url)
    try:
        conn = psycopg.connect(conninfo, autocommit=True, connect_timeout=10)
    except psycopg.OperationalError as exc:
        raise connection_error(url, exc) from None
    with conn:
        yield conn


def _config(
    url: str, *, initech: bool = True, lock_timeout: float = LOCK_TIMEOUT_S, lock_retries: int = LOCK_RETRIES
) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_path()))
    cfg.set_main_option("path_separator", "os")
    cfg.attributes["url"] = url
    cfg.attributes["initech"] = initech
    cfg.attributes["lock_timeout"] = lock_timeout
    cfg.attributes["lock_retries"] = lock_retries
    return cfg


@dataclass(frozen=True)
class Installation:
    """What a database holds of pgbroker.

    ``schema_version``: the installed core's revision (None: not installed);
    ``revisions``: what pgbroker's own alembic environment recorded in
    ``pgbroker.alembic_version`` (empty when it was installed through another
    alembic environment, or not at all).
    """

    schema_version: str | None
    revisions: tuple[str, ...]

    @property
    def installed(self) -> bool:
        return self.schema_version is not None

    @property
    def elsewhere(self) -> bool:
        """Installed through another alembic environment (an application's), not pgbroker's own."""
        return self.installed and not self.revisions


def _installation(conn: psycopg.Connection) -> Installation:
    revisions: tuple[str, ...] = ()
    if conn.execute("SELECT to_regclass('pgbroker.alembic_version')").fetchone()[0] is not None:
        revisions = tuple(r[0] for r in conn.execute("SELECT version_num FROM pgbroker.alembic_version ORDER BY 1"))
    version: str | None = None
    if conn.execute("SELECT to_regprocedure('pgbroker.schema_version()')").fetchone()[0] is not None:
        version = conn.execute("SELECT pgbroker.schema_version()").fetchone()[0]
    elif revisions:
        # A schema from before schema_version() existed: its alembic revision.
        version = revisions[-1]
    return Installation(version, revisions)


def installation(url: str) -> Installation:
    """Inspect the database at ``url`` (:class:`InstallError` when it cannot be reached)."""
    with _connect(url) as conn:
        return _installation(conn)


def installed_version(url: str) -> str | None:
    """The revision id of the installed core schema (``pgbroker.schema_version()``); None when not installed."""
    return installation(url).schema_version


@dataclass(frozen=True)
class Right:
    """One right the role that installs pgbroker (owns its functions) needs.

    ``right``: what it is; ``held``: whether the role has it; ``essential``:
    the install cannot proceed without it; ``disables``: what does not work
    without it; ``grant``: the statement (or step) that gives it.
    """

    right: str
    held: bool
    essential: bool
    disables: str
    grant: str

    def line(self) -> str:
        """One line for a missing right: what it is, what it disables, what to grant."""
        kind = "missing (required)" if self.essential else "missing"
        return f"{kind}: {self.right}: {self.disables}; to grant: {self.grant}"


# Everything is read through functions that take the role as an argument, so
# that the same query judges the connected role (before an install) or the
# owner of schema pgbroker (pgbroker doctor on an installed database).
_RIGHTS_SQL = """
SELECT r.rolname, r.rolsuper, r.rolcreaterole,
       pg_catalog.current_database() AS db,
       pg_catalog.current_setting('server_version_num')::integer AS version,
       pg_catalog.has_database_privilege(r.oid, pg_catalog.current_database(), 'CREATE') AS db_create,
       pg_catalog.pg_has_role(r.oid, d.datdba, 'USAGE') AS db_owner,
       d.datdba::regrole::text AS db_owner_name,
       pg_catalog.pg_has_role(r.oid, 'pg_signal_backend', 'USAGE') AS signal,
       pg_catalog.pg_has_role(r.oid, 'pg_read_all_stats', 'USAGE') AS read_stats,
       ARRAY(SELECT x.rolname::text FROM pg_catalog.pg_roles x
              WHERE x.rolname IN ('pgbroker_reader', 'pgbroker_broker', 'pgbroker_user', 'pgbroker_admin')
              ORDER BY 1) AS existing,
       ARRAY(SELECT x.rolname::text FROM pg_catalog.pg_roles x
              WHERE x.rolname IN ('pgbroker_reader', 'pgbroker_broker', 'pgbroker_user', 'pgbroker_admin')
                AND NOT r.rolsuper
                AND CASE WHEN pg_catalog.current_setting('server_version_num')::integer >= 160000
                         THEN NOT pg_catalog.pg_has_role(r.oid, x.oid, 'MEMBER WITH ADMIN OPTION')
                         ELSE NOT r.rolcreaterole
                              AND NOT pg_catalog.pg_has_role(r.oid, x.oid, 'MEMBER WITH ADMIN OPTION')
                    END
              ORDER BY 1) AS no_admin
  FROM pg_catalog.pg_roles r, pg_catalog.pg_database d
 WHERE r.rolname = coalesce(%s, current_user) AND d.datname = pg_catalog.current_database()
"""

ROLES = ("pgbroker_admin", "pgbroker_broker", "pgbroker_reader", "pgbroker_user")


def _check_rights(conn: psycopg.Connection, role: str | None = None) -> list[Right]:
    """The rights ``role`` (default: the connected role) needs to install and run pgbroker in this database."""
    from psycopg.rows import dict_row

    with conn.cursor(row_factory=dict_row) as cur:
        r = cur.execute(_RIGHTS_SQL, (role,)).fetchone()
    if r is None:
        raise InstallError(f"no role named {role!r}")
    who, db = r["rolname"], r["db"]
    quoted_who = _quote_ident(who)
    missing_roles = [x for x in ROLES if x not in r["existing"]]
    rights = [
        Right(
            f"CREATE on database {db}",
            r["rolsuper"] or r["db_create"],
            True,
            "it creates the schema pgbroker (and initech)",
            f"as the database's owner: GRANT CREATE ON DATABASE {_quote_ident(db)} TO {quoted_who};",
        ),
        Right(
            "CREATEROLE",
            r["rolsuper"] or r["rolcreaterole"] or not missing_roles,
            True,
            f"it creates the missing roles {', '.join(missing_roles) or '(none)'}",
            f"as a superuser: ALTER ROLE {quoted_who} CREATEROLE; or create them first (CREATE ROLE ... NOLOGIN)",
        ),
        Right(
            f"ownership of database {db} (owned by {r['db_owner_name']})",
            r["rolsuper"] or r["db_owner"],
            False,
            "pgbroker is not added to the database's search_path: qualify its names (pgbroker.broker_claim()), "
            'or per role: ALTER ROLE app_role SET search_path = "$user", public, pgbroker',
            f"ALTER DATABASE {_quote_ident(db)} OWNER TO {quoted_who}; (optional)",
        ),
        Right(
            "pg_signal_backend",
            r["rolsuper"] or r["signal"],
            False,
            "takeover => true and stale_after cannot end a holder's session of another role (42501; "
            f"sessions of {who} itself they can end)",
            f"as a superuser: GRANT pg_signal_backend TO {quoted_who};",
        ),
        Right(
            "pg_read_all_stats",
            r["rolsuper"] or r["read_stats"],
            False,
            "other roles' application_name, session start and state are NULL in the views locks and "
            "unaccounted_locks (nothing else depends on it)",
            f"as a superuser: GRANT pg_read_all_stats TO {quoted_who}; (optional)",
        ),
    ]
    for name in r["no_admin"]:
        rights.append(
            Right(
                f"ADMIN OPTION on role {name}",
                False,
                False,
                f"{who} cannot grant {name} to your login roles (a superuser must), and pgbroker_admin gets "
                f"{name}'s privileges directly instead of its membership",
                f"as a superuser: GRANT {name} TO {quoted_who} WITH ADMIN OPTION;",
            )
        )
    return rights


def _quote_ident(name: str) -> str:
    return name if name.isidentifier() and name.islower() else '"' + name.replace('"', '""') + '"'


def check_rights(url: str, role: str | None = None) -> list[Right]:
    """The rights the installing role needs, held or not, for the database at ``url``.

    ``role`` (default: the connected role) is the role to judge; on an
    installed database, the owner of schema pgbroker is the one whose rights
    count (``pgbroker doctor`` judges it).
    """
    with _connect(url) as conn:
        return _check_rights(conn, role)


def schema_owner(conn: psycopg.Connection) -> str | None:
    """The owner of schema pgbroker (whose rights pgbroker's functions run with), or None."""
    row = conn.execute(
        "SELECT nspowner::regrole::text FROM pg_catalog.pg_namespace WHERE nspname = 'pgbroker'"
    ).fetchone()
    return row[0] if row else None


def _refuse_if_essential_missing(url: str, rights: list[Right]) -> None:
    essential = [r for r in rights if r.essential and not r.held]
    if essential:
        raise InstallError(
            f"cannot install pgbroker in {describe(url)}: the installing role lacks "
            + "; ".join(f"{r.right} ({r.disables}; to grant: {r.grant})" for r in essential)
            + ". Nothing was changed."
        )


def migrate(
    url: str,
    revision: str = "heads",
    *,
    initech: bool = True,
    report: Callable[[Right], object] | None = None,
    lock_timeout: float = LOCK_TIMEOUT_S,
    lock_retries: int = LOCK_RETRIES,
) -> Installation:
    """Upgrade the database at ``url`` to ``revision`` (all of pgbroker by default); return what it holds then.

    ``initech=False`` installs the core without the reference table
    ``initech.objects`` (its revision then records itself and does nothing).

    Before a first install it checks the connected role's rights
    (:func:`check_rights`): ``report`` is called with each one it lacks, and
    :class:`InstallError` is raised, with nothing changed, when one it
    cannot do without is missing.  A failed install leaves nothing behind.

    Online (migrations/README.md, "Upgrading"): every lock the upgrade waits for is waited for at most
    ``lock_timeout`` seconds, so writers queued behind it wait no longer; then the upgrade is rolled back and
    runs again after a pause, up to ``lock_retries`` more times (then :class:`InstallError`, nothing changed).
    A schema newer than this package's is left alone (:class:`InstallError`).

    When pgbroker was installed through an application's alembic environment
    (its revisions recorded in the application's version table), there is
    nothing to do here if that schema is this package's version; if it is
    another, :class:`InstallError` says to upgrade through that environment.
    """
    from alembic import command

    with _connect(url) as conn:
        found = _installation(conn)
        rights = _check_rights(conn) if not found.installed else []
    for right in rights:
        if not right.held and report is not None:
            report(right)
    _refuse_if_essential_missing(url, rights)
    if found.installed:
        check = compare_schema(found.schema_version)
        if check.state == "newer":
            raise InstallError(
                f"{describe(url)}: {check.message}: this package cannot upgrade it, and nothing was changed "
                f"(run {check.fix})"
            )
    if found.elsewhere:
        if found.schema_version == SCHEMA_VERSION:
            return found
        raise InstallError(
            f"{describe(url)} has pgbroker schema version {found.schema_version}, installed through another alembic "
            f"environment (its alembic_version records pgbroker's revisions), and this package's is {SCHEMA_VERSION}: "
            "upgrade it there, with `alembic upgrade heads` in that project"
        )
    _run_alembic(
        url,
        lambda cfg: command.upgrade(cfg, revision),
        _config(url, initech=initech, lock_timeout=lock_timeout, lock_retries=lock_retries),
    )
    return installation(url)


def _run_alembic(url: str, action: Callable[[Config], object], cfg: Config | None = None) -> None:
    """Run an alembic command against ``url`` (already checked to be reachable by the caller).

    pgbroker's alembic environment ends the ``alembic`` command line with SystemExit and a one-line reason; a
    library call raises :class:`InstallError` with it instead (``except Exception`` does not catch SystemExit).
    """
    import psycopg
    import sqlalchemy.exc

    cfg = cfg or _config(url)
    cfg.attributes["rights_checked"] = True
    try:
        action(cfg)
    except SystemExit as exc:
        raise InstallError(str(exc.code).removeprefix("pgbroker: ")) from None
    except psycopg.Error as exc:  # from a revision's SQL, run on the driver's cursor
        raise server_error(url, exc) from exc
    except sqlalchemy.exc.DBAPIError as exc:
        if isinstance(exc.orig, psycopg.Error):
            raise server_error(url, exc.orig) from exc
        raise


def server_error(url: str, exc: psycopg.Error) -> InstallError:
    """A PostgreSQL error met while installing, as an :class:`InstallError` keeping its SQLSTATE, DETAIL and HINT."""
    diag = exc.diag
    message = diag.message_primary or _first_line(exc)
    return InstallError(
        f"{describe(url)}: {message}",
        sqlstate=getattr(exc, "sqlstate", None),
        detail=diag.message_detail,
        hint=diag.message_hint,
    )


def downgrade(
    url: str, revision: str = "base", *, lock_timeout: float = LOCK_TIMEOUT_S, lock_retries: int = LOCK_RETRIES
) -> None:
    """Downgrade; ``base`` removes every object pgbroker created.  Online as :func:`migrate` is."""
    from alembic import command

    found = installation(url)
    if found.elsewhere:
        raise InstallError(
            f"pgbroker was installed in {describe(url)} through another alembic environment (its alembic_version "
            "records pgbroker's revisions): downgrade it there, with `alembic downgrade` in that project"
        )
    _run_alembic(
        url,
        lambda cfg: command.downgrade(cfg, revision),
        _config(url, lock_timeout=lock_timeout, lock_retries=lock_retries),
    )


def current_revision(url: str) -> tuple[str, ...]:
    """The revisions pgbroker's own alembic environment recorded (empty when not installed through it)."""
    return installation(url).revisions


def run_revision_sql(revision_file: str, direction: str) -> None:
    """Run the frozen SQL that sits beside an alembic revision file.

    ``0001_lease.py`` runs ``0001_lease.sql`` on upgrade and
    ``0001_lease.downgrade.sql`` on downgrade.  The SQL goes to the driver
    as it is (no parameter parsing), so ``%`` and ``:name`` are safe.
    """
    from alembic import op

    base = Path(revision_file).with_suffix("")
    path = base.with_name(base.name + (".sql" if direction == "upgrade" else ".downgrade.sql"))
    # The DB-API cursor, with no parameters: psycopg then sends the text as it is.
    with op.get_bind().connection.dbapi_connection.cursor() as cursor:
        cursor.execute(path.read_text())
