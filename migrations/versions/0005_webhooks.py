"""webhooks: a project's endpoints and the outbox of their deliveries

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 21:20:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None

Seq = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table(
        'webhook_endpoints',
        sa.Column('seq', Seq, primary_key=True, autoincrement=True),
        sa.Column('id', sa.String(length=64), nullable=False, unique=True),
        sa.Column('project_seq', Seq, sa.ForeignKey('projects.seq', ondelete='CASCADE'), nullable=False),
        sa.Column('name', sa.String(length=200), nullable=False),
        sa.Column('url', sa.String(length=2048), nullable=False),
        sa.Column('event_types', sa.JSON(), nullable=False),
        sa.Column('secret', sa.String(length=128), nullable=False),
        sa.Column('old_secret', sa.String(length=128), nullable=True),
        sa.Column('old_secret_until', sa.BigInteger(), nullable=True),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
        sa.Column('updated_at', sa.BigInteger(), nullable=True),
    )
    op.create_index('ix_webhook_endpoints_project_seq', 'webhook_endpoints', ['project_seq'])
    op.create_table(
        'webhook_deliveries',
        sa.Column('seq', Seq, primary_key=True, autoincrement=True),
        sa.Column('id', sa.String(length=64), nullable=False, unique=True),
        sa.Column(
            'endpoint_seq', Seq, sa.ForeignKey('webhook_endpoints.seq', ondelete='CASCADE'), nullable=False
        ),
        sa.Column('event_type', sa.String(length=64), nullable=False),
        sa.Column('payload', sa.JSON(), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('attempts', sa.Integer(), nullable=False),
        sa.Column('next_attempt_at', sa.Float(), nullable=False),
        sa.Column('last_status_code', sa.Integer(), nullable=True),
        sa.Column('last_error', sa.Text(), nullable=True),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
        sa.Column('delivered_at', sa.BigInteger(), nullable=True),
    )
    op.create_index('ix_webhook_deliveries_endpoint_seq', 'webhook_deliveries', ['endpoint_seq'])
    op.create_index('ix_webhook_deliveries_due', 'webhook_deliveries', ['status', 'next_attempt_at'])


def downgrade() -> None:
    op.drop_table('webhook_deliveries')
    op.drop_table('webhook_endpoints')
