"""A worker holding Tinker training models yields to fine-tuning jobs (``worker.sessions.holder.Turn``):
a job's task waiting in the worker's queues, seen in Celery's own messages on a real Redis, ends the
holder's turn once it has held for its time, and nothing else does (the models' own wake tasks, a
turn not yet long enough)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest


def test_a_job_waiting_in_the_worker_s_queues_ends_a_holder_s_turn(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis

    from service.core.settings import get_settings
    from service.infra import task_queue
    from worker.sessions.holder import Turn

    settings = get_settings()
    conn: Any = redis.Redis.from_url(settings.redis_client_url)
    conn.delete(settings.queue)
    monkeypatch.setenv(task_queue.WORKER_QUEUES_VARIABLE, settings.queue)
    monkeypatch.setattr(Turn, "CHECK_SECONDS", 0.0)

    task_queue.wake_tinker_model("tks-x:train:0")  # a model's wake: no job
    assert not task_queue.jobs_waiting(conn, [settings.queue])
    assert not Turn(conn, 0.0).over()

    assert task_queue.enqueue_job(SimpleNamespace(id="ftjob-waiting", resources=None))  # type: ignore[arg-type]
    assert task_queue.jobs_waiting(conn, [settings.queue])
    assert not task_queue.jobs_waiting(conn, [f"{settings.queue}.train.cpu.2"])  # another queue's
    assert not Turn(conn, 3600.0).over()  # its time is not up
    turn = Turn(conn, 0.0)
    assert turn.over() and turn.ended
    conn.delete(settings.queue)
