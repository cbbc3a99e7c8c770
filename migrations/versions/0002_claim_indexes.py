"""claim indexes: one per packing order, so a claim walks an index instead of sorting a job's pending requests

Revision ID: 0002_claim_indexes
Revises: 0001_initial_schema
Create Date: 2026-12-01 05:30:00
"""

from alembic import op

revision = '0002_claim_indexes'
down_revision = '0001_initial_schema'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.create_index('ix_requests_claim_fifo', ['job_id', 'state', 'id'], unique=False)
        batch_op.create_index('ix_requests_claim_lpt', ['job_id', 'state', 'max_new_tokens', 'num_prompt_tokens', 'id'],
                              unique=False)
        batch_op.create_index('ix_requests_claim_sorted', ['job_id', 'state', 'num_prompt_tokens', 'id'],
                              unique=False)
        batch_op.drop_index('ix_requests_job_state')


def downgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.create_index('ix_requests_job_state', ['job_id', 'state'], unique=False)
        batch_op.drop_index('ix_requests_claim_sorted')
        batch_op.drop_index('ix_requests_claim_lpt')
        batch_op.drop_index('ix_requests_claim_fifo')
