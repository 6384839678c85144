"""job samples: a recorded step's prompts with their completions, rewards and advantages

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 21:40:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

Seq = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table(
        'job_samples',
        sa.Column('seq', Seq, primary_key=True, autoincrement=True),
        sa.Column('job_seq', Seq, sa.ForeignKey('jobs.seq', ondelete='CASCADE'), nullable=False),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('groups', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
        sa.UniqueConstraint('job_seq', 'step', name='uq_job_samples_job_step'),
    )


def downgrade() -> None:
    op.drop_table('job_samples')
