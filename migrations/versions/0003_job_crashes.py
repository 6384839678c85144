"""jobs.crashes: how many times a job's worker died while running it

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 06:40:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('crashes', sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('crashes')
