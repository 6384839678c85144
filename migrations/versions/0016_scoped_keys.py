"""Scoped keys with an expiry, and archived projects

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06 23:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A key made before scopes holds NULL: every project scope, as it could do everything before.
    with op.batch_alter_table('api_keys') as batch:
        batch.add_column(sa.Column('scopes', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('expires_at', sa.BigInteger(), nullable=True))
    with op.batch_alter_table('projects') as batch:
        batch.add_column(sa.Column('archived_at', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('projects') as batch:
        batch.drop_column('archived_at')
    with op.batch_alter_table('api_keys') as batch:
        batch.drop_column('expires_at')
        batch.drop_column('scopes')
