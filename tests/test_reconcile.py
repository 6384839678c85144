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
        assert busy == {"requeued": 1, "released": 1, "resent": 0} and sent == [dead]
        idle = reconcile(session, stale_after=30, queued_grace=60, queue_length=0)  # the queue lost its tasks
        assert idle == {"requeued": 0, "released": 0, "resent": 1} and sent[1:] == [lost]
        state = {j.id: (j.status, j.worker) for j in session.query(Job).filter(Job.id.in_(ids))}
    assert state[dead] == ("queued", None)
    assert state[alive] == ("running", "host:2")
    assert state[paused] == ("paused", None)
    assert state[lost][0] == "queued" and state[fresh][0] == "queued" and fresh not in sent
    events = client.get(f"/v1/fine_tuning/jobs/{dead}/events", headers=auth).json()["data"]
    assert "stopped sending heartbeats" in events[0]["message"] and events[0]["level"] == "warn"
    assert client.post(f"/v1/fine_tuning/jobs/{paused}/resume", headers=auth).status_code == 200
