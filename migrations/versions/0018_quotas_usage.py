"""Quotas per project, budgets per job, and metered usage

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07 00:30:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None

Seq = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    with op.batch_alter_table('projects') as batch:
        batch.add_column(sa.Column('quotas', sa.JSON(), nullable=True))
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('budget', sa.JSON(), nullable=True))
    with op.batch_alter_table('checkpoints') as batch:
        batch.add_column(sa.Column('bytes', sa.BigInteger(), nullable=True))
    op.create_table(
        'usage_records',
        sa.Column('seq', Seq, primary_key=True, autoincrement=True),
        sa.Column('project_seq', Seq, sa.ForeignKey('projects.seq', ondelete='CASCADE'), nullable=False),
        sa.Column('subject', sa.String(128), nullable=False),
        sa.Column('kind', sa.String(64), nullable=False),
        sa.Column('accelerator', sa.String(32), nullable=False, server_default=''),
        sa.Column('hour', sa.BigInteger(), nullable=False),
        sa.Column('amount', sa.Float(), nullable=False),
    )
    op.create_index('uq_usage_records_bucket', 'usage_records', ['subject', 'kind', 'accelerator', 'hour'], unique=True)
    op.create_index('ix_usage_records_project_hour', 'usage_records', ['project_seq', 'hour'])


def downgrade() -> None:
    op.drop_index('ix_usage_records_project_hour', table_name='usage_records')
    op.drop_index('uq_usage_records_bucket', table_name='usage_records')
    op.drop_table('usage_records')
    with op.batch_alter_table('checkpoints') as batch:
        batch.drop_column('bytes')
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('budget')
    with op.batch_alter_table('projects') as batch:
        batch.drop_column('quotas')
