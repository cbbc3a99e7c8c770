"""job plan: the latest `bulkgen plan` of a job (its prediction and options), for the report's plan against the run

Revision ID: 0008_job_plan
Revises: 0007_lpt_rank
Create Date: 2026-12-06 04:05:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0008_job_plan'
down_revision = '0007_lpt_rank'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('plan', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('plan')
