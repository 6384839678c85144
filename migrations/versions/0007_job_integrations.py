"""job integrations: OpenAI's integrations of a job (Weights & Biases)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 21:50:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('integrations', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('integrations')
