"""Alembic environment for pgbroker.

The target database is, in order: the ``url`` attribute passed by
``pgbroker.migrate()``, ``-x url=...`` on the alembic command line, or the
``DATABASE_URL`` environment variable (a ``postgresql://`` URL).

pgbroker's version table is ``pgbroker.alembic_version``, so a host
application's own ``alembic_version`` is never touched.  After a downgrade to
base, the version table and the (then empty) schema are dropped too.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from pgbroker.install import VERSION_TABLE, VERSION_TABLE_SCHEMA, sqlalchemy_url

config = context.config


def _url() -> str:
    url = config.attributes.get("url") or context.get_x_argument(as_dictionary=True).get("url")
    if not url:
        import os

        url = os.environ.get("DATABASE_URL")
    if not url:
        raise SystemExit("pgbroker: set DATABASE_URL (postgresql://user@host:port/dbname) or pass -x url=...")
    return sqlalchemy_url(url)


def run_migrations_online() -> None:
    engine = create_engine(_url(), poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            connection.exec_driver_sql(f"CREATE SCHEMA IF NOT EXISTS {VERSION_TABLE_SCHEMA}")
            connection.commit()
            context.configure(
                connection=connection,
                version_table=VERSION_TABLE,
                version_table_schema=VERSION_TABLE_SCHEMA,
                transactional_ddl=True,
            )
            with context.begin_transaction():
                context.run_migrations()
                # At base: remove the version table and the schema if nothing else is in it.
                connection.exec_driver_sql(
                    """
                    DO $drop$
                    BEGIN
                        IF NOT EXISTS (SELECT FROM pgbroker.alembic_version) THEN
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
