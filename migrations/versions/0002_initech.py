"""pgbroker: the reference table initech.objects, watched (skipped with -x initech=no).

Revision ID: "pgbroker_0002_initech"
Revises: "pgbroker_0001_baseline"

Generated from sql/ by migrations/build_baseline.py; the SQL it runs lives
beside it (0002_initech.sql, 0002_initech.downgrade.sql).  Released in 0.1.0: it never
changes again (migrations/released.json holds its checksums).
"""

from alembic import context

from pgbroker.install import run_revision_sql

revision = "pgbroker_0002_initech"
down_revision = "pgbroker_0001_baseline"
branch_labels = None
depends_on = None
# What pgbroker.schema_version() returns once this revision ran (None: it does not change it).
schema_version = None


def _wanted() -> bool:
    """False with ``alembic -x initech=no`` or ``pgbroker migrate --no-initech``: core only."""
    value = context.config.attributes.get("initech")
    if value is None:
        value = context.get_x_argument(as_dictionary=True).get("initech", "yes")
    return str(value).lower() not in ("no", "false", "0", "off")


def upgrade() -> None:
    if _wanted():
        run_revision_sql(__file__, "upgrade")


def downgrade() -> None:
    run_revision_sql(__file__, "downgrade")
