"""The bytes of a checkpoint's merged export, counted in its project's stored bytes

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07 02:10:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('checkpoints') as batch:
        batch.add_column(sa.Column('export_bytes', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('checkpoints') as batch:
        batch.drop_column('export_bytes')
