"""pgbroker core: schema, roles, singleton broker lease, broker state.

Revision ID: 0001_lease
Revises:
Create Date: 2026-11-29

Released revisions never change.  The SQL this revision runs lives beside it
(0001_lease.sql and 0001_lease.downgrade.sql), frozen at release time; sql/
holds the current definition of every object.
"""

from pgbroker.install import run_revision_sql

revision = "0001_lease"
down_revision = None
branch_labels = ("pgbroker",)
depends_on = None


def upgrade() -> None:
    run_revision_sql(__file__, "upgrade")


def downgrade() -> None:
    run_revision_sql(__file__, "downgrade")
