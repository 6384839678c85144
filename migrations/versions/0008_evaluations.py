"""evaluations: a job's checkpoints scored on a file by an inference worker

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 16:30:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None

Seq = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table(
        'evaluations',
        sa.Column('seq', Seq, primary_key=True, autoincrement=True),
        sa.Column('id', sa.String(64), nullable=False, unique=True),
        sa.Column('job_seq', Seq, sa.ForeignKey('jobs.seq', ondelete='CASCADE'), nullable=False),
        sa.Column('status', sa.String(32), nullable=False),
        sa.Column('file_id', sa.String(64), nullable=False),
        sa.Column('grader', sa.JSON(), nullable=False),
        sa.Column('settings', sa.JSON(), nullable=False),
        sa.Column('models', sa.JSON(), nullable=False),
        sa.Column('results', sa.JSON(), nullable=False),
        sa.Column('done', sa.Integer(), nullable=False),
        sa.Column('total', sa.Integer(), nullable=False),
        sa.Column('error', sa.JSON(), nullable=True),
        sa.Column('worker', sa.String(200), nullable=True),
        sa.Column('heartbeat_at', sa.Float(), nullable=True),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
        sa.Column('finished_at', sa.BigInteger(), nullable=True),
    )
    op.create_index('ix_evaluations_job_seq', 'evaluations', ['job_seq'])
    op.create_index('ix_evaluations_status', 'evaluations', ['status'])


def downgrade() -> None:
    op.drop_index('ix_evaluations_status', table_name='evaluations')
    op.drop_index('ix_evaluations_job_seq', table_name='evaluations')
    op.drop_table('evaluations')
