"""idempotent requests: the answers of creations made with an Idempotency-Key

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 05:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('idempotent_requests',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('project_seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('route', sa.String(length=64), nullable=False),
    sa.Column('request_hash', sa.String(length=64), nullable=False),
    sa.Column('response', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['project_seq'], ['projects.seq'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq'),
    sa.UniqueConstraint('project_seq', 'route', 'key', name='uq_idempotent_requests_key')
    )


def downgrade() -> None:
    op.drop_table('idempotent_requests')
