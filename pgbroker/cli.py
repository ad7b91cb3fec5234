"""The ``pgbroker`` command: install, operate, diagnose and demonstrate pgbroker.

    pgbroker --version                          the package's version and its schema version
    pgbroker migrate    [--revision heads] [--no-initech]   install or upgrade the schema
    pgbroker downgrade  [--revision base]       base removes everything pgbroker created
    pgbroker status     [--json] [--watch N]    revision, leases, clients and outbox per broker
    pgbroker history    [--name N] [--limit N] [--json]     claims, takeovers and releases
    pgbroker clients    [--name N] [--json]     clients of live brokers
    pgbroker subscriptions [--name N] [--limit N] [--json]  who is subscribed to what
    pgbroker watch TABLE [--mode row] / unwatch TABLE   install / remove fan-out triggers (pgbroker_admin)
    pgbroker prune      [--older-than '30 days']            trim the lease history (pgbroker_admin)
    pgbroker sweep      [--name N]              delete what earlier epochs left (pgbroker_broker)
    pgbroker maintain   [--max-rows N] [--json] the upkeep, until it has caught up (pgbroker_broker)
    pgbroker metrics                            pgbroker.metrics in Prometheus' text format
    pgbroker doctor     [--json]                check the database and the connection path to it
    pgbroker console    [--host H --port P] [--admin]   a live console in the browser (the console extra)
    pgbroker demo       [--url URL]             the lease at work (a throwaway server without --url)
    pgbroker versions-path                      the revisions directory, for your alembic version_locations

Every command but ``demo`` and ``versions-path`` takes ``--url URL``, a
``postgresql://user@host:port/dbname`` URL that defaults to the environment
variable ``DATABASE_URL`` (``demo`` installs pgbroker and so only uses an
explicit ``--url``).  The read-only commands read the views of
``sql/700_views.sql`` and ``sql/750_console.sql``, so psql shows the same.
On a terminal tables are drawn with rich, in colour (``NO_COLOR`` turns colour
off); otherwise they are plain aligned text.

Exit codes: 0 success; 1 failure (bad URL, unreachable server, pgbroker not
installed, an SQL error); 2 usage error (including no URL); 3 ``doctor``
found something to fix.
"""

from __future__ import annotations

import datetime as dt
import functools
import ipaddress
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    import psycopg

__all__ = ["main", "format_table", "cli", "EXIT_OK", "EXIT_FAILURE", "EXIT_USAGE", "EXIT_UNHEALTHY"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_UNHEALTHY = 3

# Columns of pgbroker.brokers that `pgbroker status` shows, with their headings.
STATUS_COLUMNS = [
    ("name", "name"),
    ("epoch", "epoch"),
    ("state", "state"),
    ("alive", "alive"),
    ("holder_pid", "pid"),
    ("holder_application", "application"),
    ("holder_address", "address"),
    ("holder_info", "info"),
    ("claimed_at", "claimed at"),
    ("heartbeat_age", "heartbeat age"),
    ("waiting", "waiting"),
]
# ... and of pgbroker.broker_overview.
OVERVIEW_COLUMNS = [
    ("name", "name"),
    ("clients", "clients"),
    ("subscriptions", "subscriptions"),
    ("takeovers", "takeovers"),
    ("outbox_backlog", "outbox backlog"),
    ("outbox_oldest_age", "oldest age"),
    ("sweep_backlog", "to sweep"),
]
HISTORY_COLUMNS = [
    ("id", "id"),
    ("at", "at"),
    ("name", "name"),
    ("epoch", "epoch"),
    ("event", "event"),
    ("pid", "pid"),
    ("application", "application"),
    ("address", "address"),
    ("reason", "reason"),
]
CLIENT_COLUMNS = [
    ("name", "name"),
    ("epoch", "epoch"),
    ("client_id", "client"),
    ("subscriptions", "subscriptions"),
    ("registered_at", "registered at"),
    ("info", "info"),
]
SUBSCRIPTION_COLUMNS = [
    ("name", "name"),
    ("client_id", "client"),
    ("table", "table"),
    ("key", "key"),
    ("subscribed_at", "subscribed at"),
]
DOCTOR_COLUMNS = [("status", "status"), ("check", "check"), ("subject", "subject"), ("detail", "detail")]

OVERVIEW_SQL = "SELECT * FROM pgbroker.broker_overview ORDER BY name"
HISTORY_SQL = """\
SELECT * FROM (SELECT * FROM pgbroker.lease_history
                WHERE %(name)s::text IS NULL OR name = %(name)s::text
                ORDER BY id DESC LIMIT %(limit)s) h
 ORDER BY id"""
CLIENTS_SQL = """\
SELECT * FROM pgbroker.clients WHERE %(name)s::text IS NULL OR name = %(name)s::text ORDER BY name, client_id"""
SUBSCRIPTIONS_SQL = """\
SELECT name, client_id, "table", key, subscribed_at
  FROM (SELECT s.name, s.client_id, s."table"::text AS "table", s.subscribed_at,
               -- a subscription by filter: its point (a JSON object; schema 0.1.0+4, read so that older ones work)
               COALESCE(s.key, NULLIF(pg_catalog.to_jsonb(s) -> 'filter', 'null')) AS key
          FROM pgbroker.subscriptions s
         WHERE %(name)s::text IS NULL OR s.name = %(name)s::text) x
 ORDER BY name, client_id, "table", key::text NULLS FIRST LIMIT %(limit)s"""
WATCH_SQL = "SELECT pgbroker.watch(%s::text::regclass, mode => %s)"
UNWATCH_SQL = "SELECT pgbroker.unwatch(%s::text::regclass)"
PRUNE_SQL = "SELECT pgbroker.lease_history_prune(%s::interval)"
SWEEP_SQL = "SELECT pgbroker.broker_sweep(%(name)s, %(max_rows)s)"
MAINTAIN_SQL = "SELECT part, removed, remaining FROM pgbroker.maintain(max_rows => %(max_rows)s)"
MAINTAIN_COLUMNS = [("part", "part"), ("removed", "removed"), ("remaining", "left")]
METRICS_SQL = "SELECT metric, labels, value, help FROM pgbroker.metrics ORDER BY metric, labels::text"
HEALTH_SQL = 'SELECT "check", subject, ok, detail, fix FROM pgbroker.health ORDER BY "check", subject'
ROLES_SQL = """\
SELECT r.rolname, pg_catalog.pg_has_role(current_user, r.oid, 'USAGE') AS member
  FROM pg_catalog.pg_roles r
 WHERE r.rolname IN ('pgbroker_reader', 'pgbroker_broker', 'pgbroker_user', 'pgbroker_admin')
 ORDER BY r.rolname"""
PUBLIC_EXECUTE_SQL = """\
SELECT pg_catalog.format('pgbroker.%I(%s)', p.proname, pg_catalog.pg_get_function_identity_arguments(p.oid))
  FROM pg_catalog.pg_proc p
 WHERE p.pronamespace = 'pgbroker'::regnamespace AND p.proname <> 'schema_version'
   AND pg_catalog.has_function_privilege('public', p.oid, 'EXECUTE')
 ORDER BY 1"""
KEEPALIVE_SQL = """\
SELECT pg_catalog.inet_client_addr() IS NOT NULL AS tcp,
       pg_catalog.current_setting('tcp_keepalives_idle')::integer AS idle,
       pg_catalog.current_setting('tcp_keepalives_interval')::integer AS interval,
       pg_catalog.current_setting('tcp_keepalives_count')::integer AS count,
       pg_catalog.current_setting('tcp_user_timeout')::integer AS user_timeout"""

# A TCP connection whose keepalives take longer than this to notice a dead peer is reported.
KEEPALIVE_LIMIT_S = 60


# ---------------------------------------------------------------------------
# Rendering: rich on a terminal, plain aligned text otherwise, JSON on request.


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dt.datetime):
        return value.astimezone().strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    if isinstance(value, dt.timedelta):
        return f"{value.total_seconds():.3f} s"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _jsonable(value: Any) -> Any:
    """A value of a row as JSON: times in ISO 8601, intervals in seconds, addresses as text."""
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, (ipaddress.IPv4Interface, ipaddress.IPv6Interface)):
        return str(value.ip)
    if isinstance(value, (ipaddress.IPv4Address, ipaddress.IPv6Address)):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]], *, indent: str = "") -> str:
    """Rows (dicts) as an aligned text table of ``columns`` ((key, heading) pairs)."""
    table = [[heading for _, heading in columns]] + [[_cell(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in table]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(indent + line for line in lines)


# Styles of cells on a terminal: (column key, value) -> rich style.
_STYLES: dict[tuple[str, Any], str] = {
    ("alive", True): "green",
    ("alive", False): "bold red",
    ("state", "held"): "green",
    ("state", "released"): "dim",
    ("status", "ok"): "green",
    ("status", "warn"): "yellow",
    ("status", "FAIL"): "bold red",
    ("event", "takeover"): "yellow",
    ("event", "stale_takeover"): "yellow",
}


def _style(key: str, value: Any) -> str:
    try:
        return _STYLES.get((key, value), "")
    except TypeError:  # an unhashable value (jsonb)
        return ""


class Output:
    """Where a command writes: rich tables and colours on a terminal, plain text elsewhere."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(highlight=False)
        self.rich = self.console.is_terminal

    def line(self, text: str = "", style: str | None = None) -> None:
        if self.rich:
            self.console.print(text, style=style, markup=False, highlight=False)
        else:
            click.echo(text)

    def table(
        self, rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]], title: str | None = None
    ) -> None:
        if not self.rich:
            if title:
                click.echo(title)
            click.echo(format_table(rows, columns))
            return
        from rich.table import Table
        from rich.text import Text

        table = Table(title=title, title_justify="left", header_style="bold")
        for _, heading in columns:
            table.add_column(heading)
        for row in rows:
            table.add_row(*(Text(_cell(row.get(key)), style=_style(key, row.get(key))) for key, _ in columns))
        self.console.print(table)

    def json(self, data: Any) -> None:
        click.echo(json.dumps(_jsonable(data), sort_keys=True))

    def clear(self) -> None:
        if self.rich:
            self.console.clear()


# ---------------------------------------------------------------------------
# Shared plumbing: the URL, connections, errors.


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from pgbroker.install import SCHEMA_VERSION

    try:
        number = version("pgbroker")
    except PackageNotFoundError:  # run from a checkout that is not installed
        from pgbroker import __version__ as number
    return f"pgbroker {number} (schema version {SCHEMA_VERSION})"


def _heads() -> tuple[str, ...]:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    from pgbroker.install import migrations_path

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_path()))
    cfg.set_main_option("path_separator", "os")
    return tuple(sorted(ScriptDirectory.from_config(cfg).get_heads()))


class _Failed(Exception):
    """A command failed: print ``message`` on stderr and exit with ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.code = code


def _require_url(url: str | None) -> str:
    if not url:
        raise _Failed(
            "pgbroker: no database given: pass --url postgresql://user@host:port/dbname or set DATABASE_URL",
            EXIT_USAGE,
        )
    return url


@contextmanager
def _connection(url: str, *, installed: bool = True) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection (one-line errors); with ``installed``, fail unless pgbroker is installed."""
    from pgbroker import install

    with install._connect(url) as conn:
        if installed and conn.execute("SELECT to_regprocedure('pgbroker.schema_version()')").fetchone()[0] is None:
            raise _Failed(f"pgbroker is not installed in {install.describe(url)} (run: pgbroker migrate)")
        yield conn


def _read_installation(conn: psycopg.Connection[Any]) -> tuple[Any, bool]:
    """(:class:`pgbroker.install.Installation`, whether this role may read pgbroker.alembic_version).

    A role that may not (a pgbroker_reader login, say) is told the schema
    version alone, which anyone may read.
    """
    from pgbroker import install

    readable = conn.execute(
        "SELECT CASE WHEN to_regclass('pgbroker.alembic_version') IS NULL THEN true"
        " ELSE pg_catalog.has_table_privilege('pgbroker.alembic_version', 'SELECT') END"
    ).fetchone()[0]
    if readable:
        return install._installation(conn), True
    return install.Installation(conn.execute("SELECT pgbroker.schema_version()").fetchone()[0], ()), False


def _rows(conn: psycopg.Connection[Any], sql: str, params: Any = None) -> list[dict[str, Any]]:
    from psycopg.rows import dict_row

    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(sql, params).fetchall()


def _command(func: Callable[..., int | None]) -> Callable[..., int]:
    """Run a command body: its errors become one line on stderr and exit code 1 (2 for usage)."""

    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> int:
        import psycopg
        from sqlalchemy.exc import SQLAlchemyError

        from pgbroker.errors import PgBrokerError, translate

        name = click.get_current_context().info_name
        try:
            return func(*args, **kwargs) or EXIT_OK
        except _Failed as exc:
            click.echo(str(exc) if exc.code == EXIT_USAGE else f"pgbroker {name}: {exc}", err=True)
            return exc.code
        except psycopg.Error as exc:
            error = translate(exc)
            message = str(error).strip().splitlines()[0] if str(error).strip() else ""
            click.echo(f"pgbroker {name}: {type(error).__name__}: {message}", err=True)
            _echo_detail_hint(error)
            return EXIT_FAILURE
        except PgBrokerError as exc:  # InstallError: bad URL, unreachable server, missing database
            click.echo(f"pgbroker {name}: {exc}", err=True)
            _echo_detail_hint(exc)
            return EXIT_FAILURE
        except SQLAlchemyError as exc:
            orig = getattr(exc, "orig", None)
            if isinstance(orig, psycopg.Error):
                error = translate(orig)
                message = orig.diag.message_primary or str(orig).strip()
                click.echo(f"pgbroker {name}: {type(error).__name__}: {message}", err=True)
                _echo_detail_hint(error)
                return EXIT_FAILURE
            message = str(orig or exc).strip()
            click.echo(f"pgbroker {name}: {type(exc).__name__}: {message}", err=True)
            return EXIT_FAILURE

    return run


def _echo_detail_hint(error: BaseException) -> None:
    """A PostgreSQL error's DETAIL and HINT, each on a line of its own, as psql shows them."""
    for label, text in (("DETAIL", getattr(error, "detail", None)), ("HINT", getattr(error, "hint", None))):
        if text:
            click.echo(f"{label}:  {text}", err=True)


def _url_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--url",
        envvar="DATABASE_URL",
        show_envvar=True,
        metavar="URL",
        help="postgresql://user@host:port/dbname (default: $DATABASE_URL).",
    )(func)


def _json_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON (for scripts) instead of tables.")(func)


def _name_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--name", metavar="LEASE", help="Only this broker (lease name).")(func)


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(_version())
        ctx.exit(EXIT_OK)


@click.group(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog="Exit codes: 0 success, 1 failure, 2 usage error (including no URL), 3 doctor found something to fix.",
)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Print the package's version and the schema version it installs.",
)
def cli() -> None:
    """pgbroker: install the SQL package, operate and diagnose brokers, run the demo.

    URL defaults to $DATABASE_URL (postgresql://user@host:port/dbname).
    """


# ---------------------------------------------------------------------------
# Installing.


@cli.command(short_help="Install or upgrade pgbroker, online (the installing role's rights checked first).")
@_url_option
@click.option("--revision", default="heads", show_default=True, help="Target revision.")
@click.option("--no-initech", is_flag=True, help="Install the core without the reference table initech.objects.")
@click.option(
    "--check",
    is_flag=True,
    help="Only check the installing role's rights: one line per missing right; exit 1 when a required one is missing.",
)
@click.option(
    "--lock-timeout",
    type=click.FloatRange(min=0.01),
    default=0.5,
    show_default=True,
    metavar="SECONDS",
    help="Wait at most this long for any lock (writers queued behind it wait no longer); then roll back and retry.",
)
@click.option(
    "--lock-retries",
    type=click.IntRange(min=0),
    default=60,
    show_default=True,
    metavar="N",
    help="Retries after a lock_timeout, each after a pause of up to 5 s.",
)
@_command
def migrate(
    url: str | None, revision: str, no_initech: bool, check: bool, lock_timeout: float, lock_retries: int
) -> int:
    """Install or upgrade pgbroker (first checking the installing role's rights), online: see migrations/README.md."""
    from pgbroker import install

    url = _require_url(url)
    if check:
        rights = install.check_rights(url)
        missing = [r for r in rights if not r.held]
        for right in missing:
            click.echo(f"pgbroker: {right.line()}")
        required = [r for r in missing if r.essential]
        who = _connected_role(url)
        if required:
            where = install.describe(url)
            click.echo(f"pgbroker: {who} cannot install pgbroker in {where}: grant what is required above")
            return EXIT_FAILURE
        click.echo(
            f"pgbroker: {who} can install pgbroker in {install.describe(url)}"
            + (f" ({len(missing)} optional right(s) missing, see above)" if missing else ", with every right it uses")
        )
        return EXIT_OK
    done = install.migrate(
        url,
        revision,
        initech=not no_initech,
        report=lambda right: click.echo(f"pgbroker: {right.line()}", err=True),
        lock_timeout=lock_timeout,
        lock_retries=lock_retries,
    )
    where = install.describe(url)
    if done.elsewhere:
        click.echo(
            f"pgbroker: {where} already has pgbroker schema version {done.schema_version}, installed through "
            "another alembic environment (its alembic_version records pgbroker's revisions): nothing to do"
        )
    else:
        click.echo(
            f"pgbroker: {where} is at revision {', '.join(done.revisions) or 'base'} "
            f"(schema version {done.schema_version or 'none'})"
        )
    return EXIT_OK


def _connected_role(url: str) -> str:
    from pgbroker import install

    with install._connect(url) as conn:
        return conn.execute("SELECT current_user").fetchone()[0]


@cli.command()
@_url_option
@click.option("--revision", default="base", show_default=True, help="Target revision (base removes pgbroker).")
@_command
def downgrade(url: str | None, revision: str) -> int:
    """Downgrade; base removes every object pgbroker created."""
    from pgbroker import install

    url = _require_url(url)
    install.downgrade(url, revision)
    now = install.current_revision(url)
    where = ", ".join(now) if now else "base (pgbroker removed)"
    click.echo(f"pgbroker: {install.describe(url)} is at revision {where}")
    return EXIT_OK


@cli.command("versions-path", short_help="The revisions directory, for alembic version_locations.")
def versions_path() -> int:
    """Print the revisions directory (for alembic version_locations)."""
    from pgbroker.install import versions_path

    click.echo(versions_path())
    return EXIT_OK


@cli.command(
    short_help="The lease at work, on a throwaway PostgreSQL.",
    epilog="Without --url a throwaway PostgreSQL is started ($DATABASE_URL is not used).",
)
@click.option("--url", metavar="URL", help="Run against this database instead (pgbroker is installed if needed).")
def demo(url: str | None) -> int:
    """Show the lease at work: A claims, B is refused and waits, A is killed, B takes over."""
    from pgbroker.demo import run_demo

    return run_demo(url)


# ---------------------------------------------------------------------------
# Reading: status, history, clients, subscriptions, metrics.


def _status_once(url: str, out: Output, as_json: bool) -> int:
    from pgbroker import install
    from pgbroker.broker import list_brokers

    with _connection(url, installed=False) as conn:
        found, readable = _read_installation(conn)
    if not found.installed:
        raise _Failed("pgbroker is not installed here (run: pgbroker migrate)")
    check = install.compare_schema(found.schema_version)
    if not readable or found.elsewhere:
        fresh = check.state == "same"
        fix = "alembic upgrade heads" if found.elsewhere and check.state != "newer" else check.fix
        freshness = "up to date" if fresh else f"{check.message}: run {fix}"
    else:
        heads = _heads()
        fresh = set(found.revisions) == set(heads)
        freshness = "up to date" if fresh else f"latest is {', '.join(heads)}: run pgbroker migrate"
    with _connection(url) as conn:
        leases = list_brokers(conn)
        overview = _rows(conn, OVERVIEW_SQL)
    if as_json:
        by_name = {row["name"]: row for row in overview}
        out.json(
            {
                "database": install.describe(url),
                "schema_version": found.schema_version,
                "revisions": list(found.revisions),
                "up_to_date": fresh,
                "brokers": [{**lease, **by_name.get(lease["name"], {})} for lease in leases],
            }
        )
        return EXIT_OK
    out.line(f"pgbroker status of {install.describe(url)}", style="bold")
    if not readable:
        out.line(
            f"schema version: {found.schema_version} ({freshness}; this role may not read the alembic revisions)",
            style=None if fresh else "yellow",
        )
    elif found.elsewhere:
        out.line(
            f"schema version: {found.schema_version} ({freshness}), installed through another alembic environment "
            "(its alembic_version records pgbroker's revisions)",
            style=None if fresh else "yellow",
        )
    else:
        out.line(f"revision: {', '.join(found.revisions)} ({freshness})", style=None if fresh else "yellow")
        if check.state == "same":
            out.line(f"schema version: {found.schema_version}")
        else:
            out.line(f"schema version: {found.schema_version} ({check.message}: run {check.fix})", style="yellow")
    if not leases:
        out.line("no lease has been claimed yet")
        return EXIT_OK
    out.table(leases, STATUS_COLUMNS, title="leases" if out.rich else None)
    out.line()
    out.table(overview, OVERVIEW_COLUMNS, title="clients and outbox per broker")
    return EXIT_OK


@cli.command(short_help="Revision, leases, clients and outbox per broker.")
@_url_option
@_json_option
@click.option(
    "--watch",
    "every",
    type=click.FloatRange(min=0.1),
    metavar="SECONDS",
    help="Refresh every SECONDS until interrupted (with --json: one JSON document per line).",
)
@_command
def status(url: str | None, as_json: bool, every: float | None) -> int:
    """Installed revision; leases (holder, epoch, heartbeat age, alive); clients and outbox per broker."""
    url = _require_url(url)
    out = Output()
    if every is None:
        return _status_once(url, out, as_json)
    try:
        while True:
            out.clear()
            if not as_json:
                out.line(dt.datetime.now().astimezone().strftime("%H:%M:%S"), style="dim")
            _status_once(url, out, as_json)
            if not out.rich:
                sys.stdout.flush()
            time.sleep(every)
    except KeyboardInterrupt:
        return EXIT_OK


@cli.command(short_help="Claims, takeovers and releases.")
@_url_option
@_name_option
@click.option("--limit", default=20, show_default=True, type=click.IntRange(min=1), help="The last N events.")
@_json_option
@_command
def history(url: str | None, name: str | None, limit: int, as_json: bool) -> int:
    """The lease history: who took the lease from whom, when and why (oldest first)."""
    url = _require_url(url)
    with _connection(url) as conn:
        rows = _rows(conn, HISTORY_SQL, {"name": name, "limit": limit})
    out = Output()
    if as_json:
        out.json(rows)
    elif rows:
        out.table(rows, HISTORY_COLUMNS)
    else:
        out.line("no lease history")
    return EXIT_OK


@cli.command(short_help="Clients of live brokers.")
@_url_option
@_name_option
@_json_option
@_command
def clients(url: str | None, name: str | None, as_json: bool) -> int:
    """Clients registered by live brokers, with their number of subscriptions."""
    url = _require_url(url)
    with _connection(url) as conn:
        rows = _rows(conn, CLIENTS_SQL, {"name": name})
    out = Output()
    if as_json:
        out.json(rows)
    elif rows:
        out.table(rows, CLIENT_COLUMNS)
    else:
        out.line("no clients")
    return EXIT_OK


@cli.command()
@_url_option
@_name_option
@click.option("--limit", default=100, show_default=True, type=click.IntRange(min=1), help="At most N rows.")
@_json_option
@_command
def subscriptions(url: str | None, name: str | None, limit: int, as_json: bool) -> int:
    """Who is subscribed to what (key empty: the whole table)."""
    url = _require_url(url)
    with _connection(url) as conn:
        rows = _rows(conn, SUBSCRIPTIONS_SQL, {"name": name, "limit": limit})
    out = Output()
    if as_json:
        out.json(rows)
    elif rows:
        out.table(rows, SUBSCRIPTION_COLUMNS)
    else:
        out.line("no subscriptions")
    return EXIT_OK


def _prometheus_labels(labels: dict[str, Any]) -> str:
    if not labels:
        return ""
    escaped = (
        f'{key}="{str(value).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34)).replace(chr(10), "")}"'
        for key, value in sorted(labels.items())
    )
    return "{" + ",".join(escaped) + "}"


@cli.command(short_help="pgbroker.metrics in Prometheus' text format.")
@_url_option
@_command
def metrics(url: str | None) -> int:
    """Print pgbroker.metrics in Prometheus' text format (for node_exporter's textfile collector)."""
    url = _require_url(url)
    with _connection(url) as conn:
        rows = _rows(conn, METRICS_SQL)
    seen: set[str] = set()
    for row in rows:
        if row["metric"] not in seen:
            seen.add(row["metric"])
            click.echo(f"# HELP {row['metric']} {row['help']}")
            click.echo(f"# TYPE {row['metric']} gauge")
        click.echo(f"{row['metric']}{_prometheus_labels(row['labels'])} {row['value']!r}")
    return EXIT_OK


# ---------------------------------------------------------------------------
# Changing: watch, unwatch, prune (pgbroker_admin).


@cli.command("watch", short_help="Install the fan-out triggers on TABLE (pgbroker_admin).")
@click.argument("table")
@click.option(
    "--mode",
    type=click.Choice(["statement", "row"]),
    default="statement",
    show_default=True,
    help="statement-level triggers (best for bulk writes) or row-level ones (cheaper for single-row writes);"
    " watching again with the other mode switches them.",
)
@_url_option
@_command
def watch_table(table: str, mode: str, url: str | None) -> int:
    """Install the fan-out triggers on TABLE (idempotent; pgbroker_admin)."""
    url = _require_url(url)
    with _connection(url) as conn:
        watch_id = conn.execute(WATCH_SQL, (table, mode)).fetchone()[0]
        keys = conn.execute(
            'SELECT key_columns FROM pgbroker.watched_tables WHERE "table" = %s::text::regclass', (table,)
        ).fetchone()
    key_text = f" (key: {', '.join(keys[0])})" if keys else ""
    click.echo(f"pgbroker: watching {table}{key_text} in {mode} mode, watch id {watch_id}")
    return EXIT_OK


@cli.command("unwatch", short_help="Remove the fan-out triggers from TABLE (pgbroker_admin).")
@click.argument("table")
@_url_option
@_command
def unwatch_table(table: str, url: str | None) -> int:
    """Remove the fan-out triggers from TABLE, with its subscriptions and pending notifications (pgbroker_admin)."""
    url = _require_url(url)
    with _connection(url) as conn:
        was = conn.execute(UNWATCH_SQL, (table,)).fetchone()[0]
    click.echo(f"pgbroker: {table} is no longer watched" if was else f"pgbroker: {table} was not watched")
    return EXIT_OK


@cli.command(short_help="Trim the lease history (pgbroker_admin).")
@_url_option
@click.option("--older-than", default="30 days", show_default=True, metavar="INTERVAL", help="A PostgreSQL interval.")
@_command
def prune(url: str | None, older_than: str) -> int:
    """Delete lease history events older than an interval (pgbroker.lease_history_prune; pgbroker_admin)."""
    url = _require_url(url)
    with _connection(url) as conn:
        deleted = conn.execute(PRUNE_SQL, (older_than,)).fetchone()[0]
    click.echo(f"pgbroker: pruned {deleted} lease history event(s) older than {older_than}")
    return EXIT_OK


@cli.command(short_help="Delete what earlier epochs left (pgbroker_broker).")
@_url_option
@click.option("--name", default=None, help="Only this lease (default: every lease).")
@_command
def sweep(url: str | None, name: str | None) -> int:
    """Delete the clients, subscriptions and notifications earlier epochs left, batch by batch, until none is left.

    They are invisible from the moment a new epoch is claimed (pgbroker.broker_sweep; the Python Broker sweeps
    after its claim): this frees their space."""
    url = _require_url(url)
    total = 0
    with _connection(url) as conn:
        while True:
            done = conn.execute(SWEEP_SQL, {"name": name, "max_rows": 10_000}).fetchone()[0]
            if not done:
                break
            total += done
    click.echo(f"pgbroker: swept {total} row(s) of earlier epochs")
    return EXIT_OK


@cli.command(short_help="The upkeep, until it has caught up (pgbroker_broker).")
@_url_option
@click.option(
    "--max-rows", default=5000, show_default=True, type=click.IntRange(1, 1_000_000), help="Per part and call."
)
@_json_option
@_command
def maintain(url: str | None, max_rows: int, as_json: bool) -> int:
    """Run pgbroker.maintain() until no part removes a full batch (at least twice, at most 1,000 calls): earlier
    epochs swept, idle lock and semaphore names forgotten, full rate limits, expired key-value entries and old
    lease history removed.

    Prints what each part removed and what is left.  The Python Broker runs it by itself; this is for
    databases no Python Broker serves (or pg_cron: sql/README.md, "Upkeep")."""
    url = _require_url(url)
    totals: dict[str, dict[str, Any]] = {}
    with _connection(url) as conn:
        for call in range(1, 1001):
            rows = _rows(conn, MAINTAIN_SQL, {"max_rows": max_rows})
            if not rows:  # another maintain() is running: wait for it
                time.sleep(0.1)
                continue
            for row in rows:
                total = totals.setdefault(row["part"], {"part": row["part"], "removed": 0, "remaining": 0})
                total["removed"] += row["removed"]
                total["remaining"] = row["remaining"]
            # Names found idle go at the next call; then stop once no part removed a full batch (what is left
            # is in use, or seen by a snapshot older than the call that found it idle).
            if call >= 2 and not any(r["removed"] >= max_rows for r in rows):
                break
    out = Output()
    if as_json:
        out.json(list(totals.values()))
        return EXIT_OK
    out.table(list(totals.values()), MAINTAIN_COLUMNS)
    return EXIT_OK


# ---------------------------------------------------------------------------
# console (pgbroker/console/, the `console` extra)


@cli.command(short_help="A live console in the browser (the console extra).")
@_url_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8710, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option(
    "--admin",
    is_flag=True,
    help="Enable the write actions (hand a lease over, revoke a name grant), each confirmed; needs pgbroker_admin.",
)
@click.option("--allow-superuser", is_flag=True, help="Run even as a superuser (it needs only pgbroker_reader).")
@_command
def console(url: str | None, host: str, port: int, admin: bool, allow_superuser: bool) -> int:
    """Serve a live console: each lease, its holder and epoch timeline, clients and subscriptions, the outbox,
    locks, semaphores, the key-value store, counters, rate limits, name grants, squatters and the doctor's
    findings, pushed to the page as they change.

    Read-only unless --admin; connect with a role that has pgbroker_reader (a superuser is refused unless
    --allow-superuser).  Needs pip install 'pgbroker[console]'.
    """
    url = _require_url(url)
    try:
        from pgbroker.console import serve
    except ImportError as exc:
        raise _Failed(f"the console needs its extra: pip install 'pgbroker[console]' ({exc})") from None
    serve(url, host=host, port=port, admin=admin, allow_superuser=allow_superuser, announce=click.echo)
    return EXIT_OK


# ---------------------------------------------------------------------------
# doctor


def _finding(status: str, check: str, subject: str, detail: str, fix: str | None = None) -> dict[str, Any]:
    return {"status": status, "check": check, "subject": subject, "detail": detail, "fix": fix}


def _shares_backends(url: str, pid: int) -> bool:
    """Does a second connection, opened now, run on server backend ``pid`` of the first (idle) one?

    Only a pooler in transaction mode hands one client's idle server
    connection to another client; directly or in session mode a connection
    keeps its backend until it closes.  (A busy transaction pooler may pick
    another idle server connection: then this proves nothing.)
    """
    import psycopg

    from pgbroker._core import BACKEND_PID_SQL
    from pgbroker.install import check_url

    with psycopg.connect(check_url(url), connect_timeout=10) as other:
        return other.execute(BACKEND_PID_SQL).fetchone()[0] == pid


def _connection_path(url: str, conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """Is the connection pinned to one server backend?  (A transaction-mode pooler moves it.)"""
    from pgbroker._core import BACKEND_PID_SQL, pooler_verdict

    login_pid = conn.info.backend_pid
    pids = []
    for _ in range(2):
        with conn.transaction():
            pids.append(conn.execute(BACKEND_PID_SQL).fetchone()[0])
    verdict = pooler_verdict(login_pid, pids)
    if verdict is not None and verdict[0] == "pooler" and _shares_backends(url, pids[-1]):
        verdict = (
            "transaction",
            f"a second connection ran on server backend {pids[-1]}, the first one's, while the first was idle: "
            "the connection goes through a pooler in transaction mode",
        )
    if verdict is None:
        return _finding("ok", "connection", "", f"direct: server backend {pids[0]} for the whole session")
    kind, why = verdict
    if kind == "transaction":
        return _finding(
            "FAIL",
            "connection",
            "",
            why,
            "session leases need a session: connect brokers directly or through a pooler in session mode; "
            "behind transaction pooling use TTL leases (broker_claim(ttl => ..., owner => ...), broker_renew)",
        )
    return _finding(
        "warn",
        "connection",
        "",
        why,
        "if the pooler runs in session mode, pass session_pooler=True to Broker; in transaction mode use TTL leases",
    )


def _keepalives(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    row = _rows(conn, KEEPALIVE_SQL)[0]
    if not row["tcp"]:
        return _finding("ok", "keepalives", "", "Unix socket: no network to fail, keepalives do not apply")
    # 0 means the operating system's default (Linux: 7200 s idle, 75 s interval, 9 probes).
    idle = row["idle"] or 7200
    interval = row["interval"] or 75
    count = row["count"] or 9
    bound = idle + interval * count
    detail = (
        f"server side: tcp_keepalives_idle={row['idle']}, tcp_keepalives_interval={row['interval']}, "
        f"tcp_keepalives_count={row['count']}, tcp_user_timeout={row['user_timeout']} ms "
        f"(0: the OS default); a silent dead client is noticed after about {bound} s"
    )
    if bound <= KEEPALIVE_LIMIT_S:
        return _finding("ok", "keepalives", "", detail)
    return _finding(
        "warn",
        "keepalives",
        "",
        detail,
        "pgbroker.Broker sets its own keepalives (Keepalive); brokers in other languages should set "
        "tcp_keepalives_idle/interval/count and tcp_user_timeout for their session, or the server's postgresql.conf",
    )


def _doctor_findings(url: str) -> list[dict[str, Any]]:
    from pgbroker import install

    findings: list[dict[str, Any]] = []
    with _connection(url, installed=False) as conn:
        found, _ = _read_installation(conn)
        if not found.installed:
            return [_finding("FAIL", "schema", "", "pgbroker is not installed", "run: pgbroker migrate")]
        check = install.compare_schema(found.schema_version)
        if check.state != "same":
            findings.append(_finding("FAIL", "schema", "", check.message, f"run: {check.fix}"))
        elif found.revisions and set(found.revisions) != set(_heads()):
            findings.append(
                _finding(
                    "FAIL",
                    "schema",
                    "",
                    f"revision {', '.join(found.revisions)}, latest is {', '.join(_heads())}",
                    "run: pgbroker migrate",
                )
            )
        else:
            findings.append(_finding("ok", "schema", "", check.message))

        roles = {row["rolname"]: row["member"] for row in _rows(conn, ROLES_SQL)}
        absent = sorted({"pgbroker_reader", "pgbroker_broker", "pgbroker_user", "pgbroker_admin"} - set(roles))
        if absent:
            findings.append(
                _finding("FAIL", "roles", "", f"missing roles: {', '.join(absent)}", "run: pgbroker migrate")
            )
        user = conn.execute("SELECT current_user").fetchone()[0]
        member_of = sorted(role for role, member in roles.items() if member)
        if not member_of:
            findings.append(
                _finding(
                    "FAIL",
                    "roles",
                    user,
                    f"{user} is a member of no pgbroker role: it cannot read the views nor run a broker",
                    f"GRANT pgbroker_reader (or pgbroker_broker, pgbroker_admin) TO {user};",
                )
            )
            return findings
        findings.append(_finding("ok", "roles", user, f"{user} is a member of {', '.join(member_of)}"))
        findings.extend(_rights_findings(conn))
        public = [row[0] for row in conn.execute(PUBLIC_EXECUTE_SQL)]
        if public:
            findings.append(
                _finding(
                    "FAIL",
                    "grants",
                    "PUBLIC",
                    f"PUBLIC may execute {', '.join(public)}",
                    " ".join(f"REVOKE EXECUTE ON FUNCTION {f} FROM PUBLIC;" for f in public)
                    + " (sql/900_privileges.sql grants them only to pgbroker roles)",
                )
            )
        else:
            findings.append(_finding("ok", "grants", "PUBLIC", "PUBLIC may execute only schema_version()"))

        findings.append(_keepalives(conn))
        findings.append(_connection_path(url, conn))
        if not roles.get("pgbroker_reader"):
            return findings
        for row in _rows(conn, HEALTH_SQL):
            findings.append(
                _finding("ok" if row["ok"] else "FAIL", row["check"], row["subject"], row["detail"], row["fix"])
            )
    return findings


def _rights_findings(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    """The rights of the role pgbroker's functions run as (schema pgbroker's owner): what each missing one disables."""
    from pgbroker import install

    owner = install.schema_owner(conn)
    if owner is None:
        return []
    rights = install._check_rights(conn, owner)
    missing = [r for r in rights if not r.held and not r.essential]
    if not missing:
        return [_finding("ok", "rights", owner, f"{owner}, which owns pgbroker's functions, has every right they use")]
    return [_finding("warn", "rights", owner, f"{owner} lacks {r.right}: {r.disables}", r.grant) for r in missing]


@cli.command(short_help="Check a database and the connection to it; say what to fix.")
@_url_option
@_json_option
@_command
def doctor(url: str | None, as_json: bool) -> int:
    """Check a database and the connection to it; print what to fix (exit code 3 when something needs fixing).

    Checks: schema version against this package, roles and grants, the rights of the role that installed
    pgbroker (what each missing one disables), keepalive
    settings, a transaction-mode pooler on the way, NOTIFY queue usage,
    outbox lag, triggers of watched tables, brokers whose holder is gone, what is left to sweep, an upkeep
    (maintain) that has not run for an hour while there is something to remove, and
    sessions holding pgbroker's locks that no pgbroker record accounts for (squatters).
    """
    from pgbroker import install

    url = _require_url(url)
    findings = _doctor_findings(url)
    failed = [f for f in findings if f["status"] == "FAIL"]
    out = Output()
    if as_json:
        out.json({"database": install.describe(url), "ok": not failed, "findings": findings})
        return EXIT_UNHEALTHY if failed else EXIT_OK
    out.line(f"pgbroker doctor: {install.describe(url)}", style="bold")
    out.table(findings, DOCTOR_COLUMNS)
    to_fix = [f for f in findings if f["fix"]]
    if to_fix:
        out.line()
        out.line("What to fix:", style="bold")
        for f in to_fix:
            subject = f" {f['subject']}" if f["subject"] else ""
            out.line(f"- [{f['status']}] {f['check']}{subject}: {f['fix']}", style=_style("status", f["status"]))
    out.line()
    if failed:
        out.line(f"{len(failed)} problem(s) found", style="bold red")
        return EXIT_UNHEALTHY
    out.line("no problem found", style="green")
    return EXIT_OK


# ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``) and return its exit code."""
    try:
        result = cli.main(args=list(argv) if argv is not None else None, prog_name="pgbroker", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("Aborted!", err=True)
        return EXIT_FAILURE
    if isinstance(result, int):
        return result
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
