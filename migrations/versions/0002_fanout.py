"""pgbroker: client registry, watched tables, subscriptions, outbox and wake-ups.

Revision ID: 0002_fanout
Revises: 0001_lease
Create Date: 2026-11-29

Released revisions never change.  The SQL this revision runs lives beside it
(0002_fanout.sql and 0002_fanout.downgrade.sql), frozen at release time; sql/ holds the
current definition of every object.
"""

from pgbroker.install import run_revision_sql

revision = "0002_fanout"
down_revision = "0001_lease"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_revision_sql(__file__, "upgrade")


def downgrade() -> None:
    run_revision_sql(__file__, "downgrade")
