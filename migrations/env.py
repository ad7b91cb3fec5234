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

A bad URL, an unreachable server or a missing database ends the command
with one line saying so, not a traceback.
"""

from __future__ import annotations

import logging
import os
from logging.config import fileConfig

import sqlalchemy.exc
from alembic import context
from sqlalchemy import pool, text

from pgbroker._url import create_engine
from pgbroker.install import (
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
            # One transaction: a failed install leaves nothing behind, not even the schema.
            with context.begin_transaction():
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
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("pgbroker migrations run online only (they carry PL/pgSQL and DO blocks).")
run_migrations_online()
