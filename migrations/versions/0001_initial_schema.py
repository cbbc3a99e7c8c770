"""initial schema

Revision ID: 0001_initial_schema
Revises:
Create Date: 2026-11-30 03:27:27.406013
"""

import sqlalchemy as sa
from alembic import op

revision = '0001_initial_schema'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('jobs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('model', sa.String(length=1000), nullable=False),
    sa.Column('model_path', sa.String(length=1000), nullable=False),
    sa.Column('input_path', sa.String(length=4000), nullable=False),
    sa.Column('input_fingerprint', sa.String(length=200), nullable=False),
    sa.Column('input_columns', sa.JSON(), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('num_requests', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('started_at', sa.DateTime(), nullable=True),
    sa.Column('finished_at', sa.DateTime(), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_jobs_status'), ['status'], unique=False)

    op.create_table('workers',
    sa.Column('id', sa.String(length=200), nullable=False),
    sa.Column('hostname', sa.String(length=200), nullable=False),
    sa.Column('pid', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('started_at', sa.DateTime(), nullable=False),
    sa.Column('heartbeat_at', sa.DateTime(), nullable=False),
    sa.Column('num_completed', sa.Integer(), nullable=False),
    sa.Column('num_output_tokens', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('requests',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('row', sa.Integer(), nullable=False),
    sa.Column('sample', sa.Integer(), nullable=False),
    sa.Column('custom_id', sa.String(length=1000), nullable=True),
    sa.Column('prompt', sa.Text(), nullable=True),
    sa.Column('prompt_token_ids', sa.LargeBinary(), nullable=True),
    sa.Column('num_prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('max_new_tokens', sa.Integer(), nullable=False),
    sa.Column('seed', sa.BigInteger(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('lease_owner', sa.String(length=200), nullable=True),
    sa.Column('lease_expires_at', sa.DateTime(), nullable=True),
    sa.Column('updated_at', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('job_id', 'row', 'sample', name='uq_requests_job_row_sample')
    )
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.create_index('ix_requests_job_state', ['job_id', 'state'], unique=False)
        batch_op.create_index('ix_requests_lease', ['state', 'lease_expires_at'], unique=False)

    op.create_table('results',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('request_id', sa.Integer(), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('text', sa.Text(), nullable=False),
    sa.Column('token_ids', sa.LargeBinary(), nullable=False),
    sa.Column('finish_reason', sa.String(length=16), nullable=False),
    sa.Column('num_prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('num_output_tokens', sa.Integer(), nullable=False),
    sa.Column('num_cached_tokens', sa.Integer(), nullable=False),
    sa.Column('logprobs', sa.JSON(), nullable=True),
    sa.Column('worker_id', sa.String(length=200), nullable=True),
    sa.Column('time_to_first_token_s', sa.Float(), nullable=True),
    sa.Column('latency_s', sa.Float(), nullable=True),
    sa.Column('finished_at', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['request_id'], ['requests.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('request_id')
    )
    with op.batch_alter_table('results', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_results_job_id'), ['job_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('results', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_results_job_id'))

    op.drop_table('results')
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.drop_index('ix_requests_lease')
        batch_op.drop_index('ix_requests_job_state')

    op.drop_table('requests')
    op.drop_table('workers')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_jobs_status'))

    op.drop_table('jobs')
