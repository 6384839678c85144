"""A job that stops and runs again continues from its newest checkpoint: the Celery task's path.

The task runs in this process against a real database; the pause is made where the API's pause
will make it (the job row's status), and the worker notices it between steps as it notices a cancel.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.core import crud
from service.core.db import session_scope
from service.core.settings import get_settings
from service.jobs import lifecycle
from service.jobs.lifecycle import JobStatus
from tests.helpers.api import upload_ok
from tests.helpers.data import EXAMPLES
from tests.helpers.training import TIMING


def _job(client: Any, auth: dict[str, str], file_id: str) -> str:
    body = json.loads((EXAMPLES / "demo" / "job.json").read_text())
    body["training_file"] = file_id
    body["method"]["reinforcement"]["hyperparameters"].update(max_steps=6, checkpoint_interval=2, ppo_epochs=2)
    r = client.post("/v1/fine_tuning/jobs", headers=auth, json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def _metrics(client: Any, auth: dict[str, str], job_id: str) -> list[dict[str, Any]]:
    data = client.get(f"/v1/fine_tuning/jobs/{job_id}/metrics", headers=auth).json()["data"]
    return [{k: v for k, v in m.items() if k not in TIMING and k != "created_at"} for m in data]


NEWER_SETTINGS = ("compute_multiplier", "reasoning_effort", "advantage_estimator")
"""Hyperparameters this release added: the release before stored rows and checkpoints without them."""


def _as_the_release_before_stored_it(session: Any, job: Any) -> None:
    """The paused job's row and checkpoints as the release before wrote them: eval_interval 0 (its
    default), none of the settings added since."""
    from service.core.settings import get_settings
    from worker.engine.checkpoints import TRAINING_INFO

    job.hyperparameters = {
        **{k: v for k, v in job.hyperparameters.items() if k not in NEWER_SETTINGS},
        "eval_interval": 0,
    }
    session.commit()
    from sqlalchemy import select

    from service.core.tables import Checkpoint

    for ckpt in session.scalars(select(Checkpoint).where(Checkpoint.job_seq == job.seq)):
        info_path = get_settings().artifacts_dir / ckpt.path / TRAINING_INFO
        info = json.loads(info_path.read_text())
        info["hyperparameters"] = {k: v for k, v in info["hyperparameters"].items() if k not in NEWER_SETTINGS}
        info["hyperparameters"]["eval_interval"] = 0
        info_path.write_text(json.dumps(info))


def test_paused_job_resumes_from_its_checkpoint_and_matches_an_uninterrupted_twin(client, auth, monkeypatch) -> None:
    """Also when the paused job's row and checkpoint were written by the release before this one."""
    from worker.jobs.tasks import run_job

    file_id = upload_ok(client, auth)["id"]
    twin, job_id = _job(client, auth, file_id), _job(client, auth, file_id)
    assert run_job(twin) == "succeeded"

    real = lifecycle.record_progress

    def pause_after_step_3(*, session: Any, job: Any, step: int, **kw: Any) -> str:
        if job.id == job_id and step == 3:
            lifecycle.move(
                session=session, job=job, to=JobStatus.PAUSED, from_=(JobStatus.RUNNING,), event="Job paused"
            )
        return real(session=session, job=job, step=step, **kw)

    monkeypatch.setattr(lifecycle, "record_progress", pause_after_step_3)
    assert run_job(job_id) == "paused"
    job = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth).json()
    assert job["status"] == "paused" and job["progress"]["step"] == 3
    ckpts = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers=auth).json()["data"]
    assert sorted(c["step_number"] for c in ckpts) == [2, 3]

    with session_scope() as session:
        row = crud.get_job_by_id(session=session, job_id=job_id)
        assert row is not None
        _as_the_release_before_stored_it(session, row)
        assert lifecycle.move(
            session=session, job=row, to=JobStatus.QUEUED, from_=(JobStatus.PAUSED,), event="Job resumed"
        )
    assert run_job(job_id) == "succeeded"

    metrics = _metrics(client, auth, job_id)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]  # every step exactly once
    assert metrics == _metrics(client, auth, twin)
    events = [
        e["message"] for e in client.get(f"/v1/fine_tuning/jobs/{job_id}/events?limit=100", headers=auth).json()["data"]
    ]
    assert any("Resumed from the checkpoint at step 3" in m for m in events)
    job = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth).json()
    assert job["status"] == "succeeded" and job["fine_tuned_model"]
    assert job["trained_tokens"] == client.get(f"/v1/fine_tuning/jobs/{twin}", headers=auth).json()["trained_tokens"]


def _demo_job(client: Any, auth: dict[str, str], **hp: Any) -> str:
    """The demo's reinforcement job on its data, with ``hp``: its id."""
    body = json.loads((EXAMPLES / "demo" / "job.json").read_text())
    body["training_file"] = upload_ok(client, auth)["id"]
    body["method"]["reinforcement"]["hyperparameters"].update(hp)
    r = client.post("/v1/fine_tuning/jobs", headers=auth, json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def test_keep_checkpoints_removes_pruned_checkpoints_from_the_api_too(client, auth) -> None:
    from worker.jobs.tasks import run_job

    job_id = _demo_job(client, auth, max_steps=4, checkpoint_interval=1, keep_checkpoints=2)
    exports = get_settings().artifacts_dir / "exports" / job_id
    for step in range(1, 5):  # each checkpoint's merged model, as downloads would have made them
        (exports / f"step-{step}").mkdir(parents=True)
        (exports / f"step-{step}" / "config.json").write_text("{}")
    assert run_job(job_id) == "succeeded"
    ckpts = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers=auth).json()["data"]
    assert [c["step_number"] for c in ckpts] == [4, 3]  # newest first; steps 1 and 2 pruned
    for c in ckpts:  # every listed checkpoint still downloads
        r = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{c['id']}/content", headers=auth)
        assert r.status_code == 200 and b"training_state" not in r.content
    events = client.get(f"/v1/fine_tuning/jobs/{job_id}/events?limit=100", headers=auth).json()["data"]
    assert sum("removed (keep_checkpoints)" in e["message"] for e in events) == 2
    assert sorted(p.name for p in exports.iterdir()) == ["step-3", "step-4"]  # pruned with their checkpoints
    model = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth).json()["fine_tuned_model"]
    assert client.delete(f"/v1/models/{model}", headers=auth).status_code == 200
    assert not exports.exists()  # and the rest with the model


def test_a_checkpoint_pruned_while_it_is_read_is_gone_not_a_500(client, auth, monkeypatch) -> None:
    """Pruned between the look and the listing: a FileNotFoundError was a 500 internal_error."""
    from pathlib import Path

    from worker.jobs.tasks import run_job

    job_id = _demo_job(client, auth, max_steps=1)
    assert run_job(job_id) == "succeeded"
    (ckpt,) = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers=auth).json()["data"]
    listing = Path.iterdir

    def pruned_meanwhile(self: Path) -> Any:
        if "checkpoints" in self.parts:
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return listing(self)

    monkeypatch.setattr(Path, "iterdir", pruned_meanwhile)
    r = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{ckpt['id']}/content", headers=auth)
    assert r.status_code == 410 and r.json()["error"]["code"] == "checkpoint_gone", r.text
    assert "/" not in r.json()["error"]["message"]  # no server path


def test_a_pause_on_the_last_step_finishes_the_job(client, auth, monkeypatch) -> None:
    from worker.jobs.tasks import run_job

    job_id = _demo_job(client, auth, max_steps=2)
    real = lifecycle.record_progress

    def pause_at_the_end(*, session: Any, job: Any, step: int, **kw: Any) -> str:
        if step == 2:
            lifecycle.move(
                session=session, job=job, to=JobStatus.PAUSED, from_=(JobStatus.RUNNING,), event="Job paused"
            )
        return real(session=session, job=job, step=step, **kw)

    monkeypatch.setattr(lifecycle, "record_progress", pause_at_the_end)
    assert run_job(job_id) == "succeeded"
    job = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth).json()
    assert job["status"] == "succeeded" and job["fine_tuned_model"]


def test_a_job_whose_grader_the_operator_turned_off_since_fails_saying_so(client, auth, monkeypatch) -> None:
    """Created while python graders were allowed, run after the operator turned them off: the job
    fails with invalid_grader and the reason, not an internal error."""
    from service.core.db import reset_caches
    from worker.jobs.tasks import run_job

    monkeypatch.setenv("RLOO_ALLOW_PYTHON_GRADER", "1")
    reset_caches()
    file_id = upload_ok(client, auth)["id"]
    body = json.loads((EXAMPLES / "demo" / "job.json").read_text())
    body["training_file"] = file_id
    body["method"]["reinforcement"]["grader"] = {"type": "python", "name": "p", "source": "def grade(s, i): return 1"}
    job_id = client.post("/v1/fine_tuning/jobs", headers=auth, json=body).json()["id"]
    monkeypatch.setenv("RLOO_ALLOW_PYTHON_GRADER", "0")
    reset_caches()
    assert run_job(job_id) == "failed"
    error = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth).json()["error"]
    assert error["code"] == "invalid_grader" and "RLOO_ALLOW_PYTHON_GRADER" in error["message"], error


def test_a_job_cancelled_as_it_finishes_keeps_no_results_file(client, auth, monkeypatch) -> None:
    """A cancel that lands after the last step, while the worker writes the results file: the job
    stays cancelled, and neither the file nor its row nor result_files is left behind."""
    from service.core.settings import get_settings
    from service.jobs import results
    from worker.jobs.tasks import run_job

    file_id = upload_ok(client, auth)["id"]
    job_id = _job(client, auth, file_id)
    real = results.write_results

    def cancelled_meanwhile(*, session: Any, job: Any, artifacts_dir: Any) -> str:
        with session_scope() as other:
            row = crud.get_job_by_id(session=other, job_id=job.id)
            assert lifecycle.move(session=other, job=row, to=JobStatus.CANCELLED, from_=(JobStatus.RUNNING,))
        return real(session=session, job=job, artifacts_dir=artifacts_dir)

    monkeypatch.setattr(results, "write_results", cancelled_meanwhile)
    run_job(job_id)
    job = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth).json()
    assert job["status"] == "cancelled" and job["result_files"] == []
    assert client.get(f"/v1/files/{results.results_file_id(job_id)}", headers=auth).status_code == 404
    assert not list((get_settings().artifacts_dir / "files").rglob("*.csv"))


@pytest.mark.parametrize("row", ["lost", "written"])
def test_a_job_whose_worker_died_after_its_final_checkpoint_names_its_model(client, auth, row) -> None:
    """The final checkpoint on disk, the job not finished: its worker killed before the checkpoint's row
    (``lost``, or the database cut then) or after it (``written``). Run again, the job resumes at its last
    step with nothing to train and names that checkpoint its final one: its row written if lost (it had
    succeeded with no checkpoint and no model: the soak found it), else left as it was; its merged
    export kept either way, and no second "saved" event for a row that was written."""
    from sqlalchemy import delete

    from service.core.tables import Checkpoint, Job
    from worker.jobs.tasks import run_job

    job_id = _demo_job(client, auth, max_steps=2)
    assert run_job(job_id) == "succeeded"
    before = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers=auth).json()["data"]
    (saved,) = [c for c in before if c["step_number"] == 2]
    export = get_settings().artifacts_dir / "exports" / job_id / "step-2"
    export.mkdir(parents=True)  # a download made the merged model
    (export / "config.json").write_text("{}")
    with session_scope() as session:  # the rows as the killed worker left them; its successor queued it
        job = crud.get_job_by_id(session=session, job_id=job_id)
        assert job is not None
        if row == "lost":
            session.execute(delete(Checkpoint).where(Checkpoint.job_seq == job.seq, Checkpoint.step_number == 2))
        session.execute(
            Job.__table__.update()
            .where(Job.seq == job.seq)
            .values(status=JobStatus.QUEUED.value, fine_tuned_model=None, worker=None, finished_at=None)
        )
        session.commit()

    assert run_job(job_id) == "succeeded"
    job = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth).json()
    model = saved["fine_tuned_model_checkpoint"].rsplit(":ckpt-step-", 1)[0]
    assert job["status"] == "succeeded" and job["fine_tuned_model"] == model
    after = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers=auth).json()["data"]
    (final,) = [c for c in after if c["step_number"] == 2]
    assert final["metrics"] == saved["metrics"]  # what the checkpoint carried when it was saved
    assert client.get(f"/v1/models/{model}", headers=auth).status_code == 200
    events = client.get(f"/v1/fine_tuning/jobs/{job_id}/events?limit=100", headers=auth).json()["data"]
    assert any("Nothing to do" in e["message"] for e in events)
    assert sum("Checkpoint saved at step 2" in e["message"] for e in events) == (2 if row == "lost" else 1)
    assert export.is_dir()  # the merged model of the same weights: still the checkpoint's
