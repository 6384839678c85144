"""the fleet: workers register themselves (workers), operator keys (api_keys.operator), a queued
job's wait for a worker noted once (jobs.waiting_at)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03 09:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None

Seq = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table(
        'workers',
        sa.Column('seq', Seq, primary_key=True, autoincrement=True),
        sa.Column('id', sa.String(255), nullable=False, unique=True),
        sa.Column('host', sa.String(255), nullable=False),
        sa.Column('devices', sa.Integer(), nullable=False),
        sa.Column('accelerator', sa.String(32), nullable=False),
        sa.Column('memory_per_device_gib', sa.Float(), nullable=True),
        sa.Column('queues', sa.JSON(), nullable=False),
        sa.Column('version', sa.String(64), nullable=False),
        sa.Column('started_at', sa.BigInteger(), nullable=False),
        sa.Column('heartbeat_at', sa.Float(), nullable=False),
    )
    with op.batch_alter_table('api_keys') as batch:
        batch.add_column(sa.Column('operator', sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('waiting_at', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('waiting_at')
    with op.batch_alter_table('api_keys') as batch:
        batch.drop_column('operator')
    op.drop_table('workers')
