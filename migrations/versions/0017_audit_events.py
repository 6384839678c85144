"""The audit log: a row per mutating request and admin action

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07 00:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None

Seq = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table(
        'audit_events',
        sa.Column('seq', Seq, primary_key=True, autoincrement=True),
        sa.Column('id', sa.String(64), nullable=False, unique=True),
        sa.Column('created_at', sa.BigInteger(), nullable=False, index=True),
        sa.Column('project_seq', Seq, sa.ForeignKey('projects.seq', ondelete='CASCADE'), nullable=False),
        sa.Column('key_id', sa.String(64), nullable=False),
        sa.Column('operator', sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column('action', sa.String(256), nullable=False),
        sa.Column('object_id', sa.String(256), nullable=True),
        sa.Column('outcome', sa.String(16), nullable=False),
        sa.Column('status', sa.Integer(), nullable=False),
        sa.Column('error_code', sa.String(64), nullable=True),
        sa.Column('client', sa.String(64), nullable=False, server_default=''),
    )
    op.create_index('ix_audit_events_project', 'audit_events', ['project_seq', 'seq'])


def downgrade() -> None:
    op.drop_index('ix_audit_events_project', table_name='audit_events')
    op.drop_table('audit_events')
