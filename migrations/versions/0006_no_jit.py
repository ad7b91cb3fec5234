"""pgbroker: no JIT compilation in the trigger statements of watched tables that can be large.

Revision ID: 0006_no_jit
Revises: 0005_bulk_plans
Create Date: 2026-11-29

Released revisions never change.  The SQL this revision runs lives beside it
(0006_no_jit.sql and 0006_no_jit.downgrade.sql), frozen at release time; sql/ holds the
current definition of every object.
"""

from pgbroker.install import run_revision_sql

revision = "0006_no_jit"
down_revision = "0005_bulk_plans"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_revision_sql(__file__, "upgrade")


def downgrade() -> None:
    run_revision_sql(__file__, "downgrade")
