"""a training model has one row per step: (model_seq, step) unique, where an index on model_seq was

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06 02:40:00
"""
from alembic import op


revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A model loaded back deletes its steps from n before it writes step n (in one transaction), so
    # no database holds two rows of one step; should one have (a bug), the newest is kept.
    op.execute(
        'DELETE FROM tinker_steps WHERE EXISTS (SELECT 1 FROM tinker_steps AS newer '
        'WHERE newer.model_seq = tinker_steps.model_seq AND newer.step = tinker_steps.step '
        'AND newer.seq > tinker_steps.seq)'
    )
    op.drop_index('ix_tinker_steps_model_seq', table_name='tinker_steps')
    op.create_index('uq_tinker_steps_step', 'tinker_steps', ['model_seq', 'step'], unique=True)


def downgrade() -> None:
    op.drop_index('uq_tinker_steps_step', table_name='tinker_steps')
    op.create_index('ix_tinker_steps_model_seq', 'tinker_steps', ['model_seq'])
