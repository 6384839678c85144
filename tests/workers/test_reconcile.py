"""The reconciler (service/jobs/reconcile.py) on a real database: jobs whose worker died are queued
again, paused jobs let go, lost tasks sent again; live jobs left alone."""

from __future__ import annotations

import time

from service.core.db import session_scope
from service.core.tables import Job
from service.infra import task_queue
from service.jobs import lifecycle
from service.jobs.lifecycle import JobStatus
from service.jobs.reconcile import reconcile
from tests.helpers.api import create_job, upload_ok
from tests.helpers.data import job_body


def test_reconcile_requeues_the_dead_releases_the_paused_and_resends_the_lost(client, auth, monkeypatch) -> None:

    sent: list[str] = []
    monkeypatch.setattr(task_queue, "enqueue_job", lambda job: sent.append(job.id) or True)
    file_id = upload_ok(client, auth)["id"]
    ids = [create_job(client, auth, job_body(file_id))["id"] for _ in range(5)]
    dead, alive, paused, lost, fresh = ids
    sent.clear()  # (creating them queued them)
    now = time.time()
    rows = {
        dead: {"status": "running", "worker": "host:1", "heartbeat_at": now - 100},
        alive: {"status": "running", "worker": "host:2", "heartbeat_at": now},
        paused: {"status": "paused", "worker": "host:3", "heartbeat_at": now - 100},
        lost: {"status": "queued", "created_at": int(now) - 3600},
        fresh: {"status": "queued", "created_at": int(now)},
    }
    with session_scope() as session:
        for job_id, values in rows.items():
            session.query(Job).filter(Job.id == job_id).update(values)
        session.commit()
        busy = reconcile(session, stale_after=30, queued_grace=60, queue_length=lambda _: 2)  # tasks are waiting
        assert busy == {"requeued": 1, "failed": 0, "released": 1, "resent": 0, "waiting": 0} and sent == [dead]
        idle = reconcile(session, stale_after=30, queued_grace=60, queue_length=lambda _: 0)  # the queue lost its tasks
        assert idle == {"requeued": 0, "failed": 0, "released": 0, "resent": 1, "waiting": 0} and sent[1:] == [lost]
        state = {j.id: (j.status, j.worker) for j in session.query(Job).filter(Job.id.in_(ids))}
    assert state[dead] == ("queued", None)
    assert state[alive] == ("running", "host:2")
    assert state[paused] == ("paused", None)
    assert state[lost][0] == "queued" and state[fresh][0] == "queued" and fresh not in sent
    events = client.get(f"/v1/fine_tuning/jobs/{dead}/events", headers=auth).json()["data"]
    assert "stopped sending heartbeats" in events[0]["message"] and events[0]["level"] == "warn"
    assert client.post(f"/v1/fine_tuning/jobs/{paused}/resume", headers=auth).status_code == 200


def test_a_job_whose_worker_keeps_dying_fails_worker_lost(client, auth, monkeypatch) -> None:
    """Crashes 1 and 2 queue the job again; the third (RLOO_MAX_JOB_CRASHES = 3) fails it with
    worker_lost, saying what to change; checkpoints and metrics are kept."""

    sent: list[str] = []
    monkeypatch.setattr(task_queue, "enqueue_job", lambda job: sent.append(job.id) or True)
    job_id = create_job(client, auth, job_body(upload_ok(client, auth)["id"]))["id"]
    for crash in (1, 2, 3):
        with session_scope() as session:
            session.query(Job).filter(Job.id == job_id).update(
                {"status": "running", "worker": f"host:{crash}", "heartbeat_at": time.time() - 100, "step": crash}
            )
            session.commit()
            counts = reconcile(session, stale_after=30, queued_grace=60, queue_length=lambda _: 1, max_crashes=3)
            again = reconcile(session, stale_after=30, queued_grace=60, queue_length=lambda _: 1, max_crashes=3)
        assert again == {"requeued": 0, "failed": 0, "released": 0, "resent": 0, "waiting": 0}  # moved once only
        job = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth).json()
        if crash < 3:
            assert counts["requeued"] == 1 and job["status"] == "queued" and job["error"] is None
        else:
            assert counts["failed"] == 1 and job["status"] == "failed", job
    assert sent[1:] == [job_id, job_id]  # sent again after crashes 1 and 2, not after 3
    assert job["error"]["code"] == "worker_lost"
    assert "3 times" in job["error"]["message"] and "step 3" in job["error"]["message"]
    assert "batch_size" in job["error"]["message"] and job["finished_at"]
    events = [e["message"] for e in client.get(f"/v1/fine_tuning/jobs/{job_id}/events", headers=auth).json()["data"]]
    assert "crash 1 of at most 2" in events[2] and "crash 2 of at most 2" in events[1]
    assert events[0].startswith("The job's worker stopped sending heartbeats")  # no host or process of ours


def test_a_live_job_is_never_moved_by_a_stale_read(client, auth) -> None:
    """recover_lost_job moves the job only if it is still as read: a heartbeat that came in since
    (or another reconciler that moved it first) leaves it alone."""

    job_id = create_job(client, auth, job_body(upload_ok(client, auth)["id"]))["id"]
    with session_scope() as session:
        session.query(Job).filter(Job.id == job_id).update(
            {"status": "running", "worker": "host:1", "heartbeat_at": time.time() - 100}
        )
        session.commit()
        job = session.query(Job).filter(Job.id == job_id).one()
        session.expunge(job)
    with session_scope() as session:  # the worker's heartbeat lands after the reconciler's read
        session.query(Job).filter(Job.id == job_id).update({"heartbeat_at": time.time()})
        session.commit()
    with session_scope() as session:
        moved = lifecycle.recover(
            session=session, job=job, worker="host:1", reason="r", max_crashes=3, stale_before=time.time() - 30
        )
        assert moved is None
        wrong_worker = lifecycle.recover(session=session, job=job, worker="host:2", reason="r", max_crashes=3)
        assert wrong_worker is None
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth).json()["status"] == "running"


def _running(job_id: str, worker: str, **values: object) -> None:
    with session_scope() as session:
        session.query(Job).filter(Job.id == job_id).update(
            {"status": "running", "worker": worker, "heartbeat_at": time.time(), **values}
        )
        session.commit()


def _row(job_id: str) -> Job:
    with session_scope() as session:
        job = session.query(Job).filter(Job.id == job_id).one()
        session.expunge(job)
        return job


def test_a_worker_that_lost_its_job_writes_nothing_more(client, auth, monkeypatch) -> None:
    """After a long database outage the reconciler may have queued the job again for another worker:
    the first worker's next step write changes nothing (no metrics, no progress) and tells it
    'lost', so it stops; its succeeded/failed would change nothing either."""
    from service.core.identity import process_name
    from worker.jobs.database_recorder import DatabaseRecorder

    monkeypatch.setattr(task_queue, "enqueue_job", lambda job: True)
    job_id = create_job(client, auth, job_body(upload_ok(client, auth)["id"]))["id"]
    _running(job_id, process_name())
    recorder = DatabaseRecorder(_row(job_id))
    metrics = {"total_steps": 3, "train_reward_mean": 0.5, "trained_tokens": 10}
    assert recorder.step(1, metrics) is None  # held: written
    _running(job_id, "elsewhere#1:7", step=1)  # taken over meanwhile
    assert recorder.step(2, metrics) == "lost"
    rows = client.get(f"/v1/fine_tuning/jobs/{job_id}/metrics", headers=auth).json()["data"]
    assert [m["step"] for m in rows] == [1]
    with session_scope() as session:
        assert not lifecycle.move(
            session=session,
            job=_row(job_id),
            to=JobStatus.SUCCEEDED,
            from_=(JobStatus.RUNNING,),
            held_by=process_name(),
        )
    job = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth).json()
    assert job["status"] == "running" and job["progress"]["step"] == 1


def test_a_saved_checkpoint_clears_the_crash_count(client, auth, env) -> None:
    """Crashes count only while a job makes no saved progress: a deploy or two during a long job
    must not add up to worker_lost."""
    from pathlib import Path

    from service.core.identity import process_name
    from worker.jobs.database_recorder import DatabaseRecorder

    job_id = create_job(client, auth, job_body(upload_ok(client, auth)["id"]))["id"]
    _running(job_id, process_name(), crashes=2)
    step_dir = Path(env["RLOO_HOME"]) / "artifacts" / "checkpoints" / job_id / "step-4"
    step_dir.mkdir(parents=True)
    DatabaseRecorder(_row(job_id)).checkpoint(4, step_dir, {"train_reward_mean": 0.1}, final=False)
    assert _row(job_id).crashes == 0


def test_a_replayed_steps_checkpoint_removes_the_merged_copy_of_the_one_it_replaces(client, auth, env) -> None:
    """A step replayed after a crash saves its checkpoint again: a merged export of the first save is
    of other weights, so it goes (with its bytes), to be made again from the new one if asked for."""
    from pathlib import Path

    from sqlalchemy import select, update

    from service.core.tables import Checkpoint
    from worker.jobs.database_recorder import DatabaseRecorder

    job_id = create_job(client, auth, job_body(upload_ok(client, auth)["id"]))["id"]
    _running(job_id, "host:1")
    artifacts = Path(env["RLOO_HOME"]) / "artifacts"
    step_dir = artifacts / "checkpoints" / job_id / "step-4"
    step_dir.mkdir(parents=True)
    (step_dir / "weights.bin").write_bytes(b"first")
    recorder = DatabaseRecorder(_row(job_id))
    export = artifacts / "exports" / job_id / "step-4"
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    recorder.checkpoint(4, step_dir, {"train_reward_mean": 0.1}, final=False)
    assert export.is_dir()  # a first save removes nothing
    with session_scope() as session:
        session.execute(update(Checkpoint).values(export_bytes=2))
        session.commit()
    (step_dir / "weights.bin").write_bytes(b"again")
    recorder.checkpoint(4, step_dir, {"train_reward_mean": 0.2}, final=False)
    assert not export.exists()
    with session_scope() as session:
        assert session.scalars(select(Checkpoint.export_bytes)).all() == [None]


def test_after_its_own_outage_the_reconciler_takes_no_job_from_its_worker(client, auth, monkeypatch) -> None:

    monkeypatch.setattr(task_queue, "enqueue_job", lambda job: True)
    job_id = create_job(client, auth, job_body(upload_ok(client, auth)["id"]))["id"]
    _running(job_id, "host:1", heartbeat_at=time.time() - 1000)
    with session_scope() as session:
        blind = reconcile(session, stale_after=30, queued_grace=60, queue_length=lambda _: 1, judge_heartbeats=False)
        assert blind["requeued"] == 0 and _row(job_id).status == "running"
        seeing = reconcile(session, stale_after=30, queued_grace=60, queue_length=lambda _: 1)
        assert seeing["requeued"] == 1 and _row(job_id).status == "queued"


def test_a_worker_stopped_mid_job_hands_it_back_without_a_crash(client, auth, monkeypatch) -> None:
    """SIGTERM in a pool process is a SystemExit: the job goes back to the queue (to continue from
    its checkpoint), not counted as a crash."""
    import pytest

    from worker.jobs import tasks

    sent: list[str] = []
    monkeypatch.setattr(task_queue, "enqueue_job", lambda job: sent.append(job.id) or True)
    job_id = create_job(client, auth, job_body(upload_ok(client, auth)["id"]))["id"]

    def stopped(job: Job) -> None:
        raise SystemExit(0)

    monkeypatch.setattr(tasks, "_train", stopped)
    with pytest.raises(SystemExit):
        tasks.run_job(job_id)
    job = _row(job_id)
    assert (job.status, job.worker, job.crashes) == ("queued", None, 0)
    assert sent[-1] == job_id
    events = client.get(f"/v1/fine_tuning/jobs/{job_id}/events", headers=auth).json()["data"]
    assert "is shutting down; the job is queued again" in events[0]["message"]


def test_sweep_uploads_removes_what_dead_writers_left_and_finishes_committed_renames(client, auth, env) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    from service.core.identity import machine_tag, writer_tag
    from service.core.settings import get_settings
    from service.files.upload_sweep import ORPHAN_AGE_SECONDS, sweep_uploads

    kept = upload_ok(client, auth)
    folder = next((Path(env["RLOO_HOME"]) / "artifacts" / "files").iterdir())
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    me = writer_tag()
    committed = upload_ok(client, auth)
    (folder / f"{committed['id']}.jsonl").rename(folder / f".staged-{committed['id']}-{me}")  # a live writer's
    files = {
        "dead_partial": folder / f".upload-{machine_tag()}-{dead_pid}-abc",
        "live_partial": folder / f".upload-{me}-abc",
        "dead_staged_no_row": folder / f".staged-file-{'0' * 24}-{machine_tag()}-{dead_pid}",
        "live_staged_no_row": folder / f".staged-file-{'1' * 24}-{me}",
        "other_host_fresh": folder / ".upload-elsewhere#1-5-abc",
        "other_host_old": folder / ".upload-elsewhere#1-6-abc",
        "orphan_old": folder / f"file-{'2' * 24}.jsonl",
        "orphan_fresh": folder / f"file-{'3' * 24}.jsonl",
    }
    for path in files.values():
        path.write_text("{}\n")
    old = time.time() - ORPHAN_AGE_SECONDS - 60
    for name in ("other_host_old", "orphan_old"):
        os.utime(files[name], (old, old))
    with session_scope() as session:
        counts = sweep_uploads(session, get_settings().artifacts_dir)
    left = {name for name, path in files.items() if path.exists()}
    assert left == {"live_partial", "live_staged_no_row", "other_host_fresh", "orphan_fresh"}
    assert counts == {"removed": 4, "finished": 1}
    # The committed file got its final name, though its writer lives: a row must never lack its file.
    assert client.get(f"/v1/files/{committed['id']}/content", headers=auth).status_code == 200
    assert client.get(f"/v1/files/{kept['id']}/content", headers=auth).status_code == 200


def test_only_connection_errors_count_as_an_unreachable_database() -> None:
    import sqlite3

    from sqlalchemy import exc as sa_exc

    from service.core.db import database_unreachable

    def wrapped(message: str) -> sa_exc.OperationalError:
        return sa_exc.OperationalError("SELECT 1", {}, sqlite3.OperationalError(message))

    assert database_unreachable(wrapped("unable to open database file"))
    assert database_unreachable(wrapped("database is locked"))
    assert not database_unreachable(wrapped("no such column: jobs.crashes"))  # run `rloo db upgrade`
    assert not database_unreachable(sa_exc.IntegrityError("INSERT", {}, sqlite3.IntegrityError("UNIQUE")))
    assert not database_unreachable(ValueError("x"))
