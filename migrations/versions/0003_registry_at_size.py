"""pgbroker: registry at size.

Revision ID: pgbroker_0003_registry_at_size
Revises: pgbroker_0002_initech

Drafted by migrations/new_revision.py; the SQL it runs lives beside it
(0003_registry_at_size.sql, 0003_registry_at_size.downgrade.sql).  Once released it never changes.
"""

from pgbroker.install import run_revision_sql

revision = "pgbroker_0003_registry_at_size"
down_revision = "pgbroker_0002_initech"
branch_labels = None
depends_on = None
# What pgbroker.schema_version() returns once this revision ran.
schema_version = "0.1.0+3"


def upgrade() -> None:
    run_revision_sql(__file__, "upgrade")


def downgrade() -> None:
    run_revision_sql(__file__, "downgrade")
