"""request params: a request's own sampling settings and origin (OpenAI batch lines)

Revision ID: 0003_request_params
Revises: 0002_claim_indexes
Create Date: 2026-12-01 06:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0003_request_params'
down_revision = '0002_claim_indexes'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.add_column(sa.Column('params', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.drop_column('params')
