"""The ``pgbroker`` command: install, inspect and demonstrate pgbroker.

    pgbroker --version                                      the package's version and its schema version
    pgbroker migrate       [--url URL] [--revision heads] [--no-initech]
                                                            install or upgrade the schema
    pgbroker downgrade     [--url URL] [--revision base]    base removes everything pgbroker created
    pgbroker status        [--url URL]                      installed revision and the brokers view
    pgbroker demo          [--url URL]                      the lease at work (a throwaway server without --url)
    pgbroker versions-path                                  the revisions directory, for your alembic version_locations

URL is a ``postgresql://user@host:port/dbname`` URL and defaults to the
environment variable ``DATABASE_URL`` (except for ``demo``, which installs
pgbroker and so only uses an explicit ``--url``).  Exit codes: 0 success, 1 failure,
2 usage error (including no URL).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "format_table"]

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


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dt.datetime):
        return value.astimezone().strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    if isinstance(value, dt.timedelta):
        return f"{value.total_seconds():.3f} s"
    return str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]], *, indent: str = "") -> str:
    """Rows (dicts) as an aligned text table of ``columns`` ((key, heading) pairs)."""
    table = [[heading for _, heading in columns]] + [[_cell(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in table]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(indent + line for line in lines)


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


def _cmd_migrate(url: str, revision: str, initech: bool = True) -> int:
    from pgbroker import install

    done = install.migrate(url, revision, initech=initech)
    where = install.describe(url)
    if done.elsewhere:
        print(
            f"pgbroker: {where} already has pgbroker schema version {done.schema_version}, installed through "
            "another alembic environment (its alembic_version records pgbroker's revisions): nothing to do"
        )
    else:
        print(
            f"pgbroker: {where} is at revision {', '.join(done.revisions) or 'base'} "
            f"(schema version {done.schema_version or 'none'})"
        )
    return 0


def _cmd_downgrade(url: str, revision: str) -> int:
    from pgbroker import install

    install.downgrade(url, revision)
    now = install.current_revision(url)
    print(f"pgbroker: {install.describe(url)} is at revision {', '.join(now) if now else 'base (pgbroker removed)'}")
    return 0


def _cmd_status(url: str) -> int:
    import psycopg

    from pgbroker import install
    from pgbroker.broker import list_brokers

    found = install.installation(url)
    print(f"pgbroker status of {install.describe(url)}")
    if not found.installed:
        print("pgbroker is not installed here (run: pgbroker migrate)", file=sys.stderr)
        return 1
    if found.elsewhere:
        fresh = found.schema_version == install.SCHEMA_VERSION
        freshness = "up to date" if fresh else f"this package's is {install.SCHEMA_VERSION}: run alembic upgrade heads"
        print(
            f"schema version: {found.schema_version} ({freshness}), installed through another alembic environment "
            "(its alembic_version records pgbroker's revisions)"
        )
    else:
        heads = _heads()
        fresh = set(found.revisions) == set(heads)
        freshness = "up to date" if fresh else f"latest is {', '.join(heads)}: run pgbroker migrate"
        print(f"revision: {', '.join(found.revisions)} ({freshness})")
        print(f"schema version: {found.schema_version}")
    with psycopg.connect(install.libpq_url(url)) as conn:
        rows = list_brokers(conn)
    if not rows:
        print("no lease has been claimed yet")
    else:
        print(format_table(rows, STATUS_COLUMNS))
    return 0


def _cmd_versions_path() -> int:
    from pgbroker.install import versions_path

    print(versions_path())
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pgbroker",
        description="pgbroker: install the SQL package, inspect leases, run the demo.",
        epilog="URL defaults to $DATABASE_URL (postgresql://user@host:port/dbname).",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_url(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--url", help="postgresql:// URL (default: $DATABASE_URL)")
        return p

    migrate = with_url(sub.add_parser("migrate", help="install or upgrade pgbroker"))
    migrate.add_argument("--revision", default="heads", help="target revision (default: heads)")
    migrate.add_argument(
        "--no-initech",
        dest="initech",
        action="store_false",
        help="install the core without the reference table initech.objects",
    )
    with_url(sub.add_parser("downgrade", help="downgrade; base removes every object pgbroker created")).add_argument(
        "--revision", default="base", help="target revision (default: base)"
    )
    with_url(sub.add_parser("status", help="print the installed revision and the brokers view"))
    sub.add_parser(
        "demo",
        help="show the lease at work (a throwaway PostgreSQL unless --url)",
        description="Broker A claims, B is refused, B waits, A is killed, B takes over. "
        "Without --url a throwaway PostgreSQL is started ($DATABASE_URL is not used).",
    ).add_argument("--url", help="run against this database instead (pgbroker is installed if needed)")
    sub.add_parser("versions-path", help="print the revisions directory (for alembic version_locations)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "versions-path":
        return _cmd_versions_path()
    if args.command == "demo":
        # Only an explicit --url: the demo installs pgbroker, so never pick a database implicitly.
        from pgbroker.demo import run_demo

        return run_demo(args.url)
    url = args.url or os.environ.get("DATABASE_URL") or None
    if url is None:
        print(
            "pgbroker: no database given: pass --url postgresql://user@host:port/dbname or set DATABASE_URL",
            file=sys.stderr,
        )
        return 2

    import psycopg
    from sqlalchemy.exc import SQLAlchemyError

    from pgbroker.errors import PgBrokerError
    from pgbroker.install import InstallError

    try:
        if args.command == "migrate":
            return _cmd_migrate(url, args.revision, args.initech)
        if args.command == "downgrade":
            return _cmd_downgrade(url, args.revision)
        return _cmd_status(url)
    except InstallError as exc:  # bad URL, unreachable server, missing database, installed elsewhere
        print(f"pgbroker {args.command}: {exc}", file=sys.stderr)
        return 1
    except (psycopg.Error, SQLAlchemyError, PgBrokerError) as exc:
        message = str(getattr(exc, "orig", None) or exc).strip()
        print(f"pgbroker {args.command}: {type(exc).__name__}: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
