"""the Tinker training protocol: sessions, training models and their checkpoints

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05 13:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None

Seq = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table(
        'tinker_sessions',
        sa.Column('seq', Seq, primary_key=True, autoincrement=True),
        sa.Column('id', sa.String(64), nullable=False, unique=True),
        sa.Column('project_seq', Seq, sa.ForeignKey('projects.seq', ondelete='CASCADE'), nullable=False, index=True),
        sa.Column('tags', sa.JSON(), nullable=False),
        sa.Column('user_metadata', sa.JSON(), nullable=False),
        sa.Column('display_name', sa.String(200), nullable=True),
        sa.Column('sdk_version', sa.String(64), nullable=False),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
        sa.Column('heartbeat_at', sa.Float(), nullable=False),
        sa.Column('ended_at', sa.BigInteger(), nullable=True),
    )
    op.create_table(
        'tinker_models',
        sa.Column('seq', Seq, primary_key=True, autoincrement=True),
        sa.Column('id', sa.String(128), nullable=False, unique=True),
        sa.Column('project_seq', Seq, sa.ForeignKey('projects.seq', ondelete='CASCADE'), nullable=False, index=True),
        sa.Column('session_seq', Seq, sa.ForeignKey('tinker_sessions.seq', ondelete='CASCADE'), nullable=False, index=True),
        sa.Column('base_model', sa.String(1024), nullable=False),
        sa.Column('lora', sa.JSON(), nullable=True),
        sa.Column('optimizer', sa.JSON(), nullable=False),
        sa.Column('user_metadata', sa.JSON(), nullable=False),
        sa.Column('steps', sa.Integer(), nullable=False),
        sa.Column('state_path', sa.String(1024), nullable=True),
        sa.Column('state_steps', sa.Integer(), nullable=False),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
        sa.Column('last_request_at', sa.Float(), nullable=True),
    )
    op.create_table(
        'tinker_checkpoints',
        sa.Column('seq', Seq, primary_key=True, autoincrement=True),
        sa.Column('model_seq', Seq, sa.ForeignKey('tinker_models.seq', ondelete='CASCADE'), nullable=False, index=True),
        sa.Column('kind', sa.String(32), nullable=False),
        sa.Column('name', sa.String(255), nullable=False),
        sa.Column('path', sa.String(1024), nullable=False),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('size_bytes', sa.BigInteger(), nullable=True),
        sa.Column('user_metadata', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
        sa.Column('expires_at', sa.BigInteger(), nullable=True),
        sa.UniqueConstraint('model_seq', 'kind', 'name', name='uq_tinker_checkpoints_name'),
    )


def downgrade() -> None:
    op.drop_table('tinker_checkpoints')
    op.drop_table('tinker_models')
    op.drop_table('tinker_sessions')
