"""turns between projects: a job's lane (the devices it asks for, so a worker's task claims the
fairest queued job of its queue) and when an evaluation was first started (its time budget, and
which project's turn is next)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04 09:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def _lane(resources: object) -> str:
    """service.queue.lane (now service.infra.task_queue.lane), as it was when this revision was written."""
    resources = resources if isinstance(resources, dict) else {}
    kind = resources.get('accelerator') or None
    gpus = int(resources.get('gpus') or 1)
    return f"{'any' if kind in (None, 'any') else kind}.{gpus}"


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('lane', sa.String(64), nullable=False, server_default='any.1'))
    jobs = sa.table('jobs', sa.column('seq', sa.Integer()), sa.column('resources', sa.JSON()), sa.column('lane', sa.String()))
    conn = op.get_bind()
    for seq, resources in conn.execute(sa.select(jobs.c.seq, jobs.c.resources).where(jobs.c.resources.is_not(None))).all():
        conn.execute(sa.update(jobs).where(jobs.c.seq == seq).values(lane=_lane(resources)))
    op.create_index('ix_jobs_status_lane', 'jobs', ['status', 'lane'])
    with op.batch_alter_table('evaluations') as batch:
        batch.add_column(sa.Column('started_at', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('evaluations') as batch:
        batch.drop_column('started_at')
    op.drop_index('ix_jobs_status_lane', table_name='jobs')
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('lane')
