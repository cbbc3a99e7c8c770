"""model revision: the commit a hub name stood for at submit, so every worker runs the same weights

Revision ID: 0006_model_revision
Revises: 0005_worker_progress
Create Date: 2026-12-04 21:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0006_model_revision'
down_revision = '0005_worker_progress'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('model_revision', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('model_revision')
