"""OpenAI's Evals API: evals, their runs as rows of the evaluation engine's table, and output items

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06 11:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None

Seq = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table(
        'evals',
        sa.Column('seq', Seq, primary_key=True, autoincrement=True),
        sa.Column('id', sa.String(64), nullable=False, unique=True),
        sa.Column('project_seq', Seq, sa.ForeignKey('projects.seq', ondelete='CASCADE'), nullable=False, index=True),
        sa.Column('name', sa.String(256), nullable=False),
        sa.Column('metadata', sa.JSON(), nullable=True),
        sa.Column('data_source_config', sa.JSON(), nullable=False),
        sa.Column('testing_criteria', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
    )
    with op.batch_alter_table('evaluations') as batch:
        batch.add_column(sa.Column('project_seq', Seq, nullable=True))
        batch.add_column(sa.Column('eval_seq', Seq, nullable=True))
        batch.add_column(sa.Column('name', sa.String(256), nullable=True))
        batch.add_column(sa.Column('metadata', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('data_source', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('items_inline', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('summary', sa.JSON(), nullable=True))
    # A job evaluation's project is its job's.
    op.execute('UPDATE evaluations SET project_seq = (SELECT jobs.project_seq FROM jobs WHERE jobs.seq = evaluations.job_seq)')
    with op.batch_alter_table('evaluations') as batch:
        batch.alter_column('project_seq', existing_type=Seq, nullable=False)
        batch.alter_column('job_seq', existing_type=Seq, nullable=True)
        batch.alter_column('file_id', existing_type=sa.String(64), nullable=True)
        batch.alter_column('grader', existing_type=sa.JSON(), nullable=True)
        batch.create_foreign_key('fk_evaluations_project_seq', 'projects', ['project_seq'], ['seq'], ondelete='CASCADE')
        batch.create_foreign_key('fk_evaluations_eval_seq', 'evals', ['eval_seq'], ['seq'], ondelete='CASCADE')
        batch.create_index('ix_evaluations_project_seq', ['project_seq'])
        batch.create_index('ix_evaluations_eval_seq', ['eval_seq'])
    op.create_table(
        'eval_output_items',
        sa.Column('seq', Seq, primary_key=True, autoincrement=True),
        sa.Column('id', sa.String(64), nullable=False, unique=True),
        sa.Column('run_seq', Seq, sa.ForeignKey('evaluations.seq', ondelete='CASCADE'), nullable=False),
        sa.Column('datasource_item_id', sa.Integer(), nullable=False),
        sa.Column('datasource_item', sa.JSON(), nullable=False),
        sa.Column('sample', sa.JSON(), nullable=False),
        sa.Column('results', sa.JSON(), nullable=False),
        sa.Column('status', sa.String(16), nullable=False),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
        sa.UniqueConstraint('run_seq', 'datasource_item_id', name='uq_eval_output_items_item'),
    )


def downgrade() -> None:
    op.drop_table('eval_output_items')
    op.execute('DELETE FROM evaluations WHERE job_seq IS NULL')
    with op.batch_alter_table('evaluations') as batch:
        batch.drop_index('ix_evaluations_eval_seq')
        batch.drop_index('ix_evaluations_project_seq')
        batch.drop_constraint('fk_evaluations_eval_seq', type_='foreignkey')
        batch.drop_constraint('fk_evaluations_project_seq', type_='foreignkey')
        batch.alter_column('grader', existing_type=sa.JSON(), nullable=False)
        batch.alter_column('file_id', existing_type=sa.String(64), nullable=False)
        batch.alter_column('job_seq', existing_type=Seq, nullable=False)
        for column in ('summary', 'items_inline', 'data_source', 'metadata', 'name', 'eval_seq', 'project_seq'):
            batch.drop_column(column)
    op.drop_table('evals')
