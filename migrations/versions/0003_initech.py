"""pgbroker: the reference table initech.objects, watched.

Revision ID: 0003_initech
Revises: 0002_fanout
Create Date: 2026-11-29

Released revisions never change.  The SQL this revision runs lives beside it
(0003_initech.sql and 0003_initech.downgrade.sql), frozen at release time; sql/ holds the
current definition of every object.
"""

from alembic import context

from pgbroker.install import run_revision_sql

revision = "0003_initech"
down_revision = "0002_fanout"
branch_labels = None
depends_on = None


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
