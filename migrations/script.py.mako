"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}

Released revisions never change.  The SQL this revision runs lives beside it
(<revision>.sql and <revision>.downgrade.sql), frozen at release time; sql/
holds the current definition of every object.
"""

from pgbroker.install import run_revision_sql

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}


def upgrade() -> None:
    run_revision_sql(__file__, "upgrade")


def downgrade() -> None:
    run_revision_sql(__file__, "downgrade")
