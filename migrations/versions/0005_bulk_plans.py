"""pgbroker: cheaper bulk statements on watched tables; keys encoded under fixed session settings.

Revision ID: 0005_bulk_plans
Revises: 0004_fanout_speed
Create Date: 2026-11-29

Released revisions never change.  The SQL this revision runs lives beside it
(0005_bulk_plans.sql and 0005_bulk_plans.downgrade.sql), frozen at release time; sql/ holds the
current definition of every object.
"""

from pgbroker.install import run_revision_sql

revision = "0005_bulk_plans"
down_revision = "0004_fanout_speed"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_revision_sql(__file__, "upgrade")


def downgrade() -> None:
    run_revision_sql(__file__, "downgrade")
