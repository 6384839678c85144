"""job resources: the devices a job asks for ({gpus, accelerator})

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 19:45:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('resources', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('resources')
