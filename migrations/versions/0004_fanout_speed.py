"""pgbroker: cheaper fan-out (outbox_fetch looks clients up by index; leaner, size-safe trigger plans).

Revision ID: 0004_fanout_speed
Revises: 0003_initech
Create Date: 2026-11-29

Released revisions never change.  The SQL this revision runs lives beside it
(0004_fanout_speed.sql and 0004_fanout_speed.downgrade.sql), frozen at release time; sql/ holds the
current definition of every object.
"""

from pgbroker.install import run_revision_sql

revision = "0004_fanout_speed"
down_revision = "0003_initech"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_revision_sql(__file__, "upgrade")


def downgrade() -> None:
    run_revision_sql(__file__, "downgrade")
