"""Checkpoint evaluations kept bounded and fair (``worker.serving.evaluate``): projects take turns for
the inference workers' evaluations, at most one running a project; a cancel route, and deleting the
file or the model cancels too; a time budget from the first start; only the lines used are read. The
grading off the serving loop is tested end to end in ``tests/e2e/test_e2e_inference.py``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from service.core.db import session_scope
from service.core.tables import Evaluation, Job
from tests.helpers.api import assert_error, upload_ok
from tests.helpers.rows import job_row
from worker.serving import evaluate

STRING_CHECK = {
    "type": "string_check",
    "name": "s",
    "input": "{{sample.output_text}}",
    "reference": "x",
    "operation": "eq",
}


class Worker:
    worker = "serve-test-1"


def _job(project: str) -> Job:
    with session_scope() as session:
        job = job_row(
            session, project, status="succeeded", fine_tuned_model=f"ft:tiny-policy:{project}::{time.monotonic_ns()}"
        )
        session.commit()
        return job


def _evaluation(job: Job, file_id: str = "file-x") -> str:
    with session_scope() as session:
        e = Evaluation(
            project_seq=job.project_seq,
            job_seq=job.seq,
            file_id=file_id,
            grader=STRING_CHECK,
            settings={"samples": 1, "temperature": 1.0, "max_tokens": 4},
            models=[{"model": job.model, "step_number": None}],
        )
        session.add(e)
        session.commit()
        return e.id


def _claim(monkeypatch: pytest.MonkeyPatch) -> str | None:
    """The evaluation a worker claims next (its run is not started: only which is claimed)."""
    monkeypatch.setattr(evaluate.EvaluationRun, "start", classmethod(lambda cls, server, session, e, job, file: e.id))
    return evaluate.claim_next(Worker())  # type: ignore[return-value]


def _end(evaluation_id: str) -> None:
    with session_scope() as session:
        session.query(Evaluation).filter(Evaluation.id == evaluation_id).update({"status": "succeeded"})
        session.commit()


def test_projects_take_turns_and_a_project_runs_one_at_a_time(env, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Oldest first let one project's evaluations keep another's queued behind them all."""
    a, b = _job("alpha"), _job("beta")
    a1, a2 = _evaluation(a), _evaluation(a)
    b1 = _evaluation(b)  # the newest
    assert _claim(monkeypatch) == a1
    assert _claim(monkeypatch) == b1  # alpha has one running: its second waits
    assert _claim(monkeypatch) is None
    _end(a1)
    _end(b1)
    assert _claim(monkeypatch) == a2
    _end(a2)
    a3, b2 = _evaluation(a), _evaluation(b)
    assert _claim(monkeypatch) == b2  # alpha started one last: beta's turn, though alpha's is older
    assert a3


def test_a_stale_evaluation_is_taken_again_and_keeps_its_first_start(env, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    e = _evaluation(_job("alpha"))
    assert _claim(monkeypatch) == e
    with session_scope() as session:
        first = session.query(Evaluation).filter(Evaluation.id == e).one().started_at
        session.query(Evaluation).filter(Evaluation.id == e).update({"heartbeat_at": time.time() - 3600})
        session.commit()
    assert _claim(monkeypatch) == e
    with session_scope() as session:
        assert session.query(Evaluation).filter(Evaluation.id == e).one().started_at == first


def test_an_evaluation_past_its_time_budget_fails_saying_so(env, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    e = _evaluation(_job("alpha"))
    assert _claim(monkeypatch) == e
    with session_scope() as session:
        seq = session.query(Evaluation).filter(Evaluation.id == e).one().seq
    run = evaluate.EvaluationRun(Worker(), seq, None, [{}], [], {}, ends_at=time.time() - 1)  # type: ignore[arg-type]
    assert run.step() is False
    with session_scope() as session:
        row = session.query(Evaluation).filter(Evaluation.id == e).one()
        assert row.status == "failed" and row.error["code"] == "evaluation_timeout"
        assert "RLOO_EVALUATION_MAX_SECONDS" in row.error["message"]


def test_only_the_lines_used_are_read(tmp_path: Path) -> None:
    """samples: 1 on a 200 MB file parsed every line of it first."""
    path = tmp_path / "big.jsonl"
    path.write_text('\ufeff{"prompt": "a"}\n\n{"prompt": "b"}\n' + "not json at all\n" * 1000, encoding="utf-8")
    assert evaluate.first_items(path, 2) == [{"prompt": "a"}, {"prompt": "b"}]
    with pytest.raises(json.JSONDecodeError):
        evaluate.first_items(path, 3)


def _job_with_evaluation(client: Any, auth: dict[str, str]) -> tuple[dict[str, Any], str]:
    job = _job("alpha")
    file_id = upload_ok(client, auth)["id"]
    r = client.post(
        f"/v1/fine_tuning/jobs/{job.id}/evaluations",
        headers=auth,
        json={"file": file_id, "grader": STRING_CHECK, "checkpoints": [], "samples": 2},
    )
    assert r.status_code == 200, r.text
    return r.json(), file_id


def test_an_evaluation_is_cancelled_by_its_route_and_its_worker_stops(
    env, client, auth, other_auth, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    evaluation, _ = _job_with_evaluation(client, auth)
    job_id = evaluation["fine_tuning_job_id"]
    url = f"/v1/fine_tuning/jobs/{job_id}/evaluations/{evaluation['id']}"
    assert client.post(url + "/cancel", headers=other_auth).status_code == 404  # another project's
    assert _claim(monkeypatch) == evaluation["id"]
    r = client.post(url + "/cancel", headers=auth)
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    assert r.json()["error"]["code"] == "cancelled"
    assert_error(client.post(url + "/cancel", headers=auth), 409, code="invalid_state")
    with session_scope() as session:
        seq = session.query(Evaluation).filter(Evaluation.id == evaluation["id"]).one().seq
    assert evaluate.touch(seq, Worker.worker) is False  # its worker's next heartbeat: stop


def test_deleting_its_file_or_its_model_cancels_an_evaluation(env, client, auth) -> None:  # type: ignore[no-untyped-def]
    evaluation, file_id = _job_with_evaluation(client, auth)
    assert client.delete(f"/v1/files/{file_id}", headers=auth).status_code == 200
    job_id = evaluation["fine_tuning_job_id"]
    got = client.get(f"/v1/fine_tuning/jobs/{job_id}/evaluations/{evaluation['id']}", headers=auth).json()
    assert (got["status"], got["error"]["code"]) == ("cancelled", "file_deleted")

    evaluation, _ = _job_with_evaluation(client, auth)
    job_id = evaluation["fine_tuning_job_id"]
    model = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth).json()["fine_tuned_model"]
    assert client.delete(f"/v1/models/{model}", headers=auth).status_code == 200
    got = client.get(f"/v1/fine_tuning/jobs/{job_id}/evaluations/{evaluation['id']}", headers=auth).json()
    assert (got["status"], got["error"]["code"]) == ("cancelled", "model_deleted")
