"""pgbroker: filters.

Revision ID: pgbroker_0004_filters
Revises: pgbroker_0003_registry_at_size

Drafted by migrations/new_revision.py; the SQL it runs lives beside it
(0004_filters.sql, 0004_filters.downgrade.sql).  Once released it never changes.
"""

from pgbroker.install import run_revision_sql

revision = "pgbroker_0004_filters"
down_revision = "pgbroker_0003_registry_at_size"
branch_labels = None
depends_on = None
# What pgbroker.schema_version() returns once this revision ran.
schema_version = "0.1.0+4"


def upgrade() -> None:
    run_revision_sql(__file__, "upgrade")


def downgrade() -> None:
    run_revision_sql(__file__, "downgrade")
