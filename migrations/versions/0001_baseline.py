"""pgbroker baseline: the whole core schema, generated from sql/.

Revision ID: "pgbroker_0001_baseline"
Revises: None

Generated from sql/ by migrations/build_baseline.py; the SQL it runs lives
beside it (0001_baseline.sql, 0001_baseline.downgrade.sql).  Released in 0.1.0: it never
changes again (migrations/released.json holds its checksums).
"""

from pgbroker.install import run_revision_sql

revision = "pgbroker_0001_baseline"
down_revision = None
branch_labels = ("pgbroker",)
depends_on = None
# What pgbroker.schema_version() returns once this revision ran (None: it does not change it).
schema_version = "0.1.0"


def upgrade() -> None:
    run_revision_sql(__file__, "upgrade")


def downgrade() -> None:
    run_revision_sql(__file__, "downgrade")
