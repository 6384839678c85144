"""fine-tuned models: a job's base model, its results files, and when its model was deleted

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 19:30:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('base_model', sa.String(length=512), nullable=True))
        batch.add_column(sa.Column('result_files', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('model_deleted_at', sa.BigInteger(), nullable=True))
        batch.create_index('ix_jobs_fine_tuned_model', ['fine_tuned_model'])
    with op.batch_alter_table('checkpoints') as batch:
        batch.create_index('ix_checkpoints_fine_tuned_model_checkpoint', ['fine_tuned_model_checkpoint'])


def downgrade() -> None:
    with op.batch_alter_table('checkpoints') as batch:
        batch.drop_index('ix_checkpoints_fine_tuned_model_checkpoint')
    with op.batch_alter_table('jobs') as batch:
        batch.drop_index('ix_jobs_fine_tuned_model')
        batch.drop_column('model_deleted_at')
        batch.drop_column('result_files')
        batch.drop_column('base_model')
