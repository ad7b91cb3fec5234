"""pgbroker baseline: the whole core schema, generated from sql/.

Revision ID: "pgbroker_0001_baseline"
Revises: None

Generated from sql/ by migrations/build_baseline.py; the SQL it runs lives
beside it (0001_baseline.sql, 0001_baseline.downgrade.sql).  Once released, it never changes.
"""

from pgbroker.install import run_revision_sql

revision = "pgbroker_0001_baseline"
down_revision = None
branch_labels = ("pgbroker",)
depends_on = None


def upgrade() -> None:
    run_revision_sql(__file__, "upgrade")


def downgrade() -> None:
    run_revision_sql(__file__, "downgrade")
