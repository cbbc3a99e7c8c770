"""worker progress: when each worker last made progress, as its heartbeat says (a stalled worker shows in status)

Revision ID: 0005_worker_progress
Revises: 0004_run_samples
Create Date: 2026-12-03 11:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0005_worker_progress'
down_revision = '0004_run_samples'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('progress_at', sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.drop_column('progress_at')
