"""pgbroker: cheaper bulk statements on watched tables (no JIT, one-broker fast path, text keys).

Revision ID: 0006_bulk_speed
Revises: 0005_bulk_plans
Create Date: 2026-11-29

Released revisions never change.  The SQL this revision runs lives beside it
(0006_bulk_speed.sql and 0006_bulk_speed.downgrade.sql), frozen at release time; sql/ holds the
current definition of every object.
"""

from pgbroker.install import run_revision_sql

revision = "0006_bulk_speed"
down_revision = "0005_bulk_plans"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_revision_sql(__file__, "upgrade")


def downgrade() -> None:
    run_revision_sql(__file__, "downgrade")
