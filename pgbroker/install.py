"""Install pgbroker: apply its alembic migrations, from a checkout or an installed wheel."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

VERSION_TABLE = "alembic_version"
VERSION_TABLE_SCHEMA = "pgbroker"
BRANCH_LABEL = "pgbroker"

__all__ = [
    "BRANCH_LABEL",
    "migrate",
    "downgrade",
    "current_revision",
    "migrations_path",
    "sql_path",
    "sqlalchemy_url",
]


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


def sqlalchemy_url(url: str) -> str:
    """Turn a libpq-style ``postgresql://`` URL into SQLAlchemy's psycopg 3 form."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    raise ValueError(f"not a postgresql:// URL: {url!r}")


def libpq_url(url: str) -> str:
    """The inverse of :func:`sqlalchemy_url`, for psycopg."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _config(url: str, *, initech: bool = True):  # -> alembic.config.Config
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_path()))
    cfg.set_main_option("path_separator", "os")
    cfg.attributes["url"] = url
    cfg.attributes["initech"] = initech
    return cfg


def migrate(url: str, revision: str = "heads", *, initech: bool = True) -> None:
    """Upgrade the database at ``url`` to ``revision`` (all of pgbroker by default).

    ``initech=False`` installs the core without the reference table
    ``initech.objects`` (revision 0003 then records itself and does nothing).
    """
    from alembic import command

    command.upgrade(_config(url, initech=initech), revision)


def downgrade(url: str, revision: str = "base") -> None:
    """Downgrade; ``base`` removes every object pgbroker created."""
    from alembic import command

    command.downgrade(_config(url), revision)


def current_revision(url: str) -> tuple[str, ...]:
    """The pgbroker revisions the database is at (empty when not installed)."""
    import psycopg

    with psycopg.connect(libpq_url(url)) as conn:
        if conn.execute("SELECT to_regclass('pgbroker.alembic_version')").fetchone()[0] is None:
            return ()
        return tuple(r[0] for r in conn.execute("SELECT version_num FROM pgbroker.alembic_version ORDER BY 1"))


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
