"""lpt rank: each request's place in its job's lpt order, requests sharing a prompt prefix together (issue 42), and
the end of its prefix group

Revision ID: 0007_lpt_rank
Revises: 0006_model_revision
Create Date: 2026-12-06 03:40:00

Requests of jobs opened before it are ranked by plain lpt (most output tokens first, then the longest prompt, then
the latest submitted: what their claims ordered by until now).
"""

import sqlalchemy as sa
from alembic import op

revision = '0007_lpt_rank'
down_revision = '0006_model_revision'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.add_column(sa.Column('lpt_rank', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('lpt_group_end', sa.Integer(), nullable=True))
        batch_op.drop_index('ix_requests_claim_lpt')
        batch_op.create_index('ix_requests_claim_lpt', ['job_id', 'state', 'lpt_rank', 'id'], unique=False)
    # UPDATE ... FROM: PostgreSQL, and SQLite from 3.33 (2020)
    op.execute("UPDATE requests SET lpt_rank = ranked.rank, lpt_group_end = ranked.rank + 1 FROM (SELECT id, "
               "ROW_NUMBER() OVER (PARTITION BY job_id ORDER BY max_new_tokens DESC, num_prompt_tokens DESC, id DESC) "
               "- 1 AS rank FROM requests) AS ranked WHERE ranked.id = requests.id")


def downgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.drop_index('ix_requests_claim_lpt')
        batch_op.create_index('ix_requests_claim_lpt', ['job_id', 'state', 'max_new_tokens', 'num_prompt_tokens',
                                                        'id'], unique=False)
        batch_op.drop_column('lpt_group_end')
        batch_op.drop_column('lpt_rank')
