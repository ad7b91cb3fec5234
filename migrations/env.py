"""Alembic environment for pgbroker.

The target database is, in order: the ``url`` attribute passed by
``pgbroker.migrate()``, ``-x url=...`` on the alembic command line, or the
``DATABASE_URL`` environment variable (a ``postgresql://`` URL).

pgbroker's version table is ``pgbroker.alembic_version``, so a host
application's own ``alembic_version`` is never touched.  The schema is
created only by commands that change the database (``upgrade``, ``stamp``);
``alembic current`` only looks.  After a downgrade to base, the version
table and the (then empty) schema are dropped too.  A first install checks
the installing role's rights first (one line per missing right) and runs in
one transaction: when it fails, nothing is left behind.

Online: the revisions run in one transaction with a short ``lock_timeout``
(0.5 s; ``-x lock_timeout=SECONDS``).  When a lock is not granted in that
time (a long transaction holds what the upgrade needs), the transaction is
rolled back whole, so the writers queued behind the upgrade's lock request go
on, and it runs again after a pause, up to ``-x lock_retries=N`` (60) more
times (migrations/README.md, "Upgrading").

A bad URL, an unreachable server or a missing database ends the command
with one line saying so, not a traceback.
"""

from __future__ import annotations

import logging
import os
import random
import time
from logging.config import fileConfig

import psycopg
import sqlalchemy.exc
from alembic import context
from sqlalchemy import pool, text

from pgbroker._url import create_engine
from pgbroker.install import (
    LOCK_RETRIES,
    LOCK_TIMEOUT_S,
    URL_FORM,
    VERSION_TABLE,
    VERSION_TABLE_SCHEMA,
    InstallError,
    check_url,
    connection_error,
    describe,
)
from pgbroker.install import _check_rights as install_check_rights

config = context.config
if config.config_file_name is not None:
    # alembic.ini's logging: `alembic upgrade head` says which revisions it ran.
    fileConfig(config.config_file_name, disable_existing_loggers=False)
log = logging.getLogger("alembic.env")


def _url() -> str:
    url = config.attributes.get("url") or context.get_x_argument(as_dictionary=True).get("url")
    if not url:
        url = os.environ.get("DATABASE_URL")
    if not url:
        raise SystemExit(f"pgbroker: no database given: set DATABASE_URL ({URL_FORM}) or pass -x url=...")
    return url


def _schema_version(connection: sqlalchemy.Connection) -> str | None:
    """pgbroker.schema_version() when the schema has it (installed through any alembic environment)."""
    if connection.execute(text("SELECT to_regprocedure('pgbroker.schema_version()')")).scalar() is None:
        return None
    return connection.execute(text("SELECT pgbroker.schema_version()")).scalar()


def _has_version_table(connection: sqlalchemy.Connection) -> bool:
    found = connection.execute(text(f"SELECT to_regclass('{VERSION_TABLE_SCHEMA}.{VERSION_TABLE}')")).scalar()
    return found is not None


def _check_rights(url: str, connection: sqlalchemy.Connection) -> None:
    """Before a first install: one line per right the role lacks; stop, with nothing changed, if one is required."""
    rights = install_check_rights(connection.connection.dbapi_connection)
    connection.rollback()
    for right in rights:
        if not right.held:
            log.warning("pgbroker: %s", right.line())
    essential = [r for r in rights if r.essential and not r.held]
    if essential:
        raise SystemExit(
            f"pgbroker: cannot install pgbroker in {describe(url)}: the installing role lacks "
            + ", ".join(r.right for r in essential)
            + " (see above). Nothing was changed."
        )


LOCK_NOT_AVAILABLE = "55P03"


def run_migrations_online() -> None:
    url = _url()
    try:
        # Connections made by psycopg from the libpq URL itself: multi-host URLs work (pgbroker/_url.py).
        engine = create_engine(check_url(url), poolclass=pool.NullPool)
    except (InstallError, ValueError, sqlalchemy.exc.ArgumentError) as exc:
        raise SystemExit(f"pgbroker: {exc}") from None
    try:
        try:
            connection = engine.connect()
        except sqlalchemy.exc.OperationalError as exc:
            raise SystemExit(f"pgbroker: {connection_error(url, exc)}") from None
        with connection:
            context.configure(
                connection=connection,
                version_table=VERSION_TABLE,
                version_table_schema=VERSION_TABLE_SCHEMA,
                transactional_ddl=True,
            )
            looking_only = bool(context.get_context().opts.get("dont_mutate"))  # alembic current
            create_schema = False
            if not _has_version_table(connection):
                elsewhere = _schema_version(connection)
                if elsewhere is not None:
                    # Installed through an application's alembic environment: its version table has the revisions.
                    message = (
                        f"pgbroker schema version {elsewhere} is installed in {describe(url)} through another "
                        "alembic environment (its alembic_version records pgbroker's revisions)"
                    )
                    if looking_only:
                        log.info("%s", message)
                        return
                    raise SystemExit(f"pgbroker: {message}: run alembic there")
                if looking_only:
                    log.info("pgbroker is not installed in %s (alembic upgrade head installs it)", describe(url))
                    return
                if not config.attributes.get("rights_checked"):
                    _check_rights(url, connection)
                create_schema = True
            lock_timeout, retries = _lock_settings()
            for attempt in range(1, retries + 2):
                try:
                    _run_in_one_transaction(connection, create_schema, lock_timeout)
                    break
                except (sqlalchemy.exc.DBAPIError, psycopg.Error) as exc:
                    error = getattr(exc, "orig", None) or exc
                    if getattr(error, "sqlstate", None) != LOCK_NOT_AVAILABLE:
                        raise
                    why = (error.diag.message_primary or str(error)).strip()
                    if attempt > retries:
                        raise SystemExit(
                            f"pgbroker: {describe(url)}: {why}: the upgrade gave way {attempt} times, each after "
                            f"waiting lock_timeout ({lock_timeout:g} s) for a lock that another transaction holds; "
                            "nothing was changed. Find that transaction (pgbroker doctor, pg_stat_activity), then "
                            "run the upgrade again"
                        ) from None
                    pause = random.uniform(0.5, 1.0) * min(5.0, 0.5 * attempt)
                    log.warning(
                        "pgbroker: %s (lock_timeout %g s): rolled back, writers go on; attempt %d of %d in %.1f s",
                        why,
                        lock_timeout,
                        attempt + 1,
                        retries + 1,
                        pause,
                    )
                    time.sleep(pause)
    finally:
        engine.dispose()


def _lock_settings() -> tuple[float, int]:
    """(lock_timeout in seconds, retries): pgbroker.migrate()'s arguments, -x lock_timeout=... / -x lock_retries=..."""
    x = context.get_x_argument(as_dictionary=True)
    timeout = config.attributes.get("lock_timeout") or x.get("lock_timeout") or LOCK_TIMEOUT_S
    retries = config.attributes.get("lock_retries")
    if retries is None:
        retries = x.get("lock_retries", LOCK_RETRIES)
    try:
        return float(timeout), int(retries)
    except ValueError:
        raise SystemExit(
            f"pgbroker: lock_timeout must be seconds and lock_retries a number: {timeout!r}, {retries!r}"
        ) from None


def _run_in_one_transaction(connection: sqlalchemy.Connection, create_schema: bool, lock_timeout: float) -> None:
    """Every pending revision in one transaction, whose every lock wait ends after ``lock_timeout`` (55P03).

    A failed install leaves nothing behind, not even the schema; an upgrade that could not take a lock in time
    is rolled back whole, releasing what it took, and the caller runs it again.
    """
    try:
        with context.begin_transaction():
            connection.exec_driver_sql(f"SET LOCAL lock_timeout = '{int(lock_timeout * 1000)}ms'")
            if create_schema:
                connection.exec_driver_sql(f"CREATE SCHEMA IF NOT EXISTS {VERSION_TABLE_SCHEMA}")
            context.run_migrations()
            # At base: remove the version table and the schema if nothing else is in it.
            connection.exec_driver_sql(
                """
                DO $drop$
                BEGIN
                    IF to_regclass('pgbroker.alembic_version') IS NOT NULL
                       AND NOT EXISTS (SELECT FROM pgbroker.alembic_version) THEN
                        DROP TABLE pgbroker.alembic_version;
                        BEGIN
                            DROP SCHEMA pgbroker;
                        EXCEPTION WHEN dependent_objects_still_exist THEN
                            RAISE NOTICE 'schema pgbroker kept: it still holds objects pgbroker did not create';
                        END;
                    END IF;
                END
                $drop$
                """
            )
    finally:
        if connection.in_transaction():
            connection.rollback()


if context.is_offline_mode():
    raise SystemExit("pgbroker migrations run online only (they carry PL/pgSQL and DO blocks).")
run_migrations_online()
