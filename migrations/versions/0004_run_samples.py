"""run samples: what each worker did, interval by interval (for `bulkgen report`), and each worker's settings

Revision ID: 0004_run_samples
Revises: 0003_request_params
Create Date: 2026-12-02 15:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0004_run_samples'
down_revision = '0003_request_params'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'run_samples',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('job_id', sa.Integer(), nullable=False),
        sa.Column('worker_id', sa.String(length=200), nullable=False),
        sa.Column('started_at', sa.DateTime(), nullable=False),
        sa.Column('seconds', sa.Float(), nullable=False),
        sa.Column('num_steps', sa.Integer(), nullable=False),
        sa.Column('num_output_tokens', sa.Integer(), nullable=False),
        sa.Column('num_prompt_tokens', sa.Integer(), nullable=False),
        sa.Column('num_finished', sa.Integer(), nullable=False),
        sa.Column('num_failed', sa.Integer(), nullable=False),
        sa.Column('num_preemptions', sa.Integer(), nullable=False),
        sa.Column('mean_running', sa.Float(), nullable=False),
        sa.Column('max_running', sa.Integer(), nullable=False),
        sa.Column('mean_kv_usage', sa.Float(), nullable=False),
        sa.Column('max_kv_usage', sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_run_samples_job_started', 'run_samples', ['job_id', 'started_at'], unique=False)
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('settings', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.drop_column('settings')
    op.drop_index('ix_run_samples_job_started', table_name='run_samples')
    op.drop_table('run_samples')
