"""The reconciler (service/reconcile.py) on a real database: jobs whose worker died are queued
again, paused jobs let go, lost tasks sent again; live jobs left alone."""

from __future__ import annotations

import time

from service.db import session_scope
from service.models import Job
from service.reconcile import reconcile
from tests.test_api import create_job, job_body, upload_ok


def test_reconcile_requeues_the_dead_releases_the_paused_and_resends_the_lost(client, auth, monkeypatch) -> None:
    from service import queue

    sent: list[str] = []
    monkeypatch.setattr(queue, "enqueue_job", lambda job_id: sent.append(job_id) or True)
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
        busy = reconcile(session, stale_after=30, queued_grace=60, queue_length=2)  # tasks are waiting
        assert busy == {"requeued": 1, "failed": 0, "released": 1, "resent": 0} and sent == [dead]
        idle = reconcile(session, stale_after=30, queued_grace=60, queue_length=0)  # the queue lost its tasks
        assert idle == {"requeued": 0, "failed": 0, "released": 0, "resent": 1} and sent[1:] == [lost]
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
    from service import queue

    sent: list[str] = []
    monkeypatch.setattr(queue, "enqueue_job", lambda job_id: sent.append(job_id) or True)
    job_id = create_job(client, auth, job_body(upload_ok(client, auth)["id"]))["id"]
    for crash in (1, 2, 3):
        with session_scope() as session:
            session.query(Job).filter(Job.id == job_id).update(
                {"status": "running", "worker": f"host:{crash}", "heartbeat_at": time.time() - 100, "step": crash}
            )
            session.commit()
            counts = reconcile(session, stale_after=30, queued_grace=60, queue_length=1, max_crashes=3)
            again = reconcile(session, stale_after=30, queued_grace=60, queue_length=1, max_crashes=3)
        assert again == {"requeued": 0, "failed": 0, "released": 0, "resent": 0}  # moved once only
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
    assert events[0].startswith("Worker host:3 stopped sending heartbeats")


def test_a_live_job_is_never_moved_by_a_stale_read(client, auth) -> None:
    """recover_lost_job moves the job only if it is still as read: a heartbeat that came in since
    (or another reconciler that moved it first) leaves it alone."""
    from service import crud

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
        moved = crud.recover_lost_job(
            session=session, job=job, worker="host:1", reason="r", max_crashes=3, stale_before=time.time() - 30
        )
        assert moved is None
        wrong_worker = crud.recover_lost_job(session=session, job=job, worker="host:2", reason="r", max_crashes=3)
        assert wrong_worker is None
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth).json()["status"] == "running"
