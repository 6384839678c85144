"""a Tinker training model's steps: the loss its forward_backward calls added up, AdamW's metrics

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05 21:40:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None

Seq = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table(
        'tinker_steps',
        sa.Column('seq', Seq, primary_key=True, autoincrement=True),
        sa.Column('model_seq', Seq, sa.ForeignKey('tinker_models.seq', ondelete='CASCADE'), nullable=False, index=True),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('loss', sa.Float(), nullable=True),
        sa.Column('counted', sa.Float(), nullable=False),
        sa.Column('datums', sa.Integer(), nullable=False),
        sa.Column('tokens', sa.Integer(), nullable=False),
        sa.Column('loss_fn', sa.String(32), nullable=False),
        sa.Column('metrics', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('tinker_steps')
