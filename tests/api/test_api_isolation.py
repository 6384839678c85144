"""Projects are isolated: another project's files, jobs, events, metrics and checkpoints do not exist
for a key (404, never 403, with the very body a never-existing id gets: no existence oracle), its
lists are empty, its ids are unknown to ``?after=``, its Idempotency-Keys are not ours, and nothing
it does changes them.

The data is real: alpha's jobs are claimed, stepped and checkpointed by the worker's own
``DatabaseRecorder``, and the checkpoint is a Hugging Face directory on disk under the artifacts root,
which alpha downloads (200) and beta cannot (404).
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path
from typing import Any

import pytest

from service.jobs import lifecycle
from service.jobs.lifecycle import JobStatus
from tests.helpers.api import ANY, assert_error, create_job, list_ids, upload_ok
from tests.helpers.data import TRAIN_JSONL, job_body

FAKE = {
    "file_id": "file-" + "0" * 24,
    "job_id": "ftjob-" + "0" * 24,
    "checkpoint_id": "ftckpt-" + "0" * 24,
    "event_id": "ftevent-" + "0" * 24,
    "model_id": "ft:tiny-policy:alpha:running:ftjob-" + "0" * 24 + ":ckpt-step-2",
    "endpoint_id": "whep_" + "0" * 24,
    "delivery_id": "msg_" + "0" * 24,
    "evaluation_id": "fteval-" + "0" * 24,
    "eval_id": "eval_" + "0" * 24,
    "run_id": "evalrun_" + "0" * 24,
    "output_item_id": "outputitem_" + "0" * 24,
    "key_id": "key-" + "0" * 24,
    "audit_id": "audit-" + "0" * 24,
}

# Every /v1 route that takes an id in its path, as the app declares it. test_the_matrix_covers_every_route
# fails when a route is added (or removed) without this list: no endpoint skips the isolation matrix.
ID_ROUTES = [
    ("GET", "/v1/files/{file_id}"),
    ("GET", "/v1/files/{file_id}/content"),
    ("DELETE", "/v1/files/{file_id}"),
    ("GET", "/v1/fine_tuning/jobs/{job_id}"),
    ("POST", "/v1/fine_tuning/jobs/{job_id}/cancel"),
    ("POST", "/v1/fine_tuning/jobs/{job_id}/pause"),
    ("POST", "/v1/fine_tuning/jobs/{job_id}/resume"),
    ("GET", "/v1/fine_tuning/jobs/{job_id}/events"),
    ("GET", "/v1/fine_tuning/jobs/{job_id}/metrics"),
    ("GET", "/v1/fine_tuning/jobs/{job_id}/samples"),
    ("GET", "/v1/fine_tuning/jobs/{job_id}/checkpoints"),
    ("GET", "/v1/fine_tuning/jobs/{job_id}/checkpoints/{checkpoint_id}/content"),
    ("POST", "/v1/fine_tuning/jobs/{job_id}/evaluations"),
    ("GET", "/v1/fine_tuning/jobs/{job_id}/evaluations"),
    ("GET", "/v1/fine_tuning/jobs/{job_id}/evaluations/{evaluation_id}"),
    ("POST", "/v1/fine_tuning/jobs/{job_id}/evaluations/{evaluation_id}/cancel"),
    ("GET", "/v1/models/{model_id:path}"),
    ("DELETE", "/v1/models/{model_id:path}"),
    ("GET", "/v1/webhook_endpoints/{endpoint_id}"),
    ("POST", "/v1/webhook_endpoints/{endpoint_id}"),
    ("DELETE", "/v1/webhook_endpoints/{endpoint_id}"),
    ("POST", "/v1/webhook_endpoints/{endpoint_id}/rotate_secret"),
    ("POST", "/v1/webhook_endpoints/{endpoint_id}/test"),
    ("GET", "/v1/webhook_endpoints/{endpoint_id}/deliveries"),
    ("GET", "/v1/evals/{eval_id}"),
    ("POST", "/v1/evals/{eval_id}"),
    ("DELETE", "/v1/evals/{eval_id}"),
    ("POST", "/v1/evals/{eval_id}/runs"),
    ("GET", "/v1/evals/{eval_id}/runs"),
    ("GET", "/v1/evals/{eval_id}/runs/{run_id}"),
    ("POST", "/v1/evals/{eval_id}/runs/{run_id}"),
    ("POST", "/v1/evals/{eval_id}/runs/{run_id}/cancel"),
    ("DELETE", "/v1/evals/{eval_id}/runs/{run_id}"),
    ("GET", "/v1/evals/{eval_id}/runs/{run_id}/output_items"),
    ("GET", "/v1/evals/{eval_id}/runs/{run_id}/output_items/{output_item_id}"),
    ("GET", "/v1/keys/{key_id}"),
    ("DELETE", "/v1/keys/{key_id}"),
]
# Every /v1 list paged with ?after=<id>, and the kind of id it takes.
AFTER_ROUTES = {
    "/v1/files": "file_id",
    "/v1/fine_tuning/jobs": "job_id",
    "/v1/fine_tuning/jobs/{job_id}/events": "event_id",
    "/v1/fine_tuning/jobs/{job_id}/checkpoints": "checkpoint_id",
    "/v1/fine_tuning/jobs/{job_id}/evaluations": "evaluation_id",
    "/v1/webhook_endpoints": "endpoint_id",
    "/v1/webhook_endpoints/{endpoint_id}/deliveries": "delivery_id",
    "/v1/evals": "eval_id",
    "/v1/evals/{eval_id}/runs": "run_id",
    "/v1/evals/{eval_id}/runs/{run_id}/output_items": "output_item_id",
    "/v1/keys": "key_id",
    "/v1/audit": "audit_id",
}


@pytest.fixture
def app(env: dict[str, str], monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """conftest's app, with the per-key rate limit off: the matrix sends a thousand requests and more
    with two keys, as fast as the app answers them, and a 429 would answer some instead of the route."""
    from service.core.settings import get_settings
    from service.main import create_app

    monkeypatch.setenv("RLOO_RATE_LIMIT", "0")
    get_settings.cache_clear()
    return create_app()


# A project's data, made the way the worker makes it -------------------------------------------------
def _train_like_the_worker(job_id: str, models_dir: Path, *, steps: int, pause: bool = False) -> str:
    """Claim ``job_id`` as a worker does, record ``steps`` steps (metrics rows and events) and a real
    checkpoint directory at the last step; with ``pause``, pause it and let the worker go (so that a
    resume would succeed). Returns the checkpoint's id."""
    from service.core.db import session_scope
    from service.core.identity import process_name
    from service.core.settings import get_settings
    from service.core.tables import Checkpoint
    from worker.engine.checkpoints import TRAINING_INFO, checkpoint_dir, job_checkpoints_dir
    from worker.jobs.database_recorder import DatabaseRecorder

    with session_scope() as session:
        job = lifecycle.claim(session=session, job_id=job_id, worker=process_name())
        assert job is not None, f"{job_id} was not queued"
        lifecycle.add_event(session=session, job=job, message=f"Job started on worker {process_name()}")
        session.commit()
    recorder = DatabaseRecorder(job)
    for step in range(1, steps + 1):
        status = recorder.step(
            step, {"total_steps": 10, "train_reward_mean": 0.1 * step, "trained_tokens": 64 * step, "kl": 0.01}
        )
        assert status is None, status  # still running
    # A checkpoint as save_checkpoint leaves it: the model directory, plus the server-side training state.
    directory = checkpoint_dir(job_checkpoints_dir(get_settings().artifacts_dir, job_id), steps)
    shutil.copytree(models_dir / "tiny-policy", directory)
    (directory / TRAINING_INFO).write_text(json.dumps({"step": steps}))
    recorder.checkpoint(steps, directory, {"train_reward_mean": 0.1 * steps}, final=False)
    if pause:
        with session_scope() as session:
            assert lifecycle.move(
                session=session, job=job, to=JobStatus.PAUSED, from_=(JobStatus.RUNNING,), event="Job paused"
            )
            lifecycle.release(session=session, job=job)
    with session_scope() as session:
        return session.query(Checkpoint.id).filter(Checkpoint.job_seq == job.seq).one()[0]


def _checkpoint_model(checkpoint_id: str) -> str:
    from service.core.db import session_scope
    from service.core.tables import Checkpoint

    with session_scope() as session:
        return session.query(Checkpoint.fine_tuned_model_checkpoint).filter(Checkpoint.id == checkpoint_id).one()[0]


def _project(client: Any, auth: dict[str, str], models_dir: Path) -> dict[str, Any]:
    """A project with a file in use, an unused file, a running job (events, metrics, a checkpoint) and a
    paused job whose worker has let go."""
    training = upload_ok(client, auth)
    spare = upload_ok(client, auth, filename="spare.jsonl")
    # A webhook endpoint told of pauses: the paused job below writes it a delivery.
    hook = {"name": "ci", "url": "http://127.0.0.1:9/hooks", "event_types": ["fine_tuning.job.paused"]}
    endpoint = client.post("/v1/webhook_endpoints", headers=auth, json=hook)
    assert endpoint.status_code == 200, endpoint.text
    running = create_job(client, auth, job_body(training["id"], suffix="running"))
    paused = create_job(client, auth, job_body(training["id"], suffix="paused"))
    ckpt = _train_like_the_worker(running["id"], models_dir, steps=2)
    _train_like_the_worker(paused["id"], models_dir, steps=1, pause=True)
    events = client.get(f"/v1/fine_tuning/jobs/{running['id']}/events", headers=auth).json()["data"]
    endpoint_id = endpoint.json()["id"]
    (delivery,) = client.get(f"/v1/webhook_endpoints/{endpoint_id}/deliveries", headers=auth).json()["data"]
    # An evaluation of the running job (queued: no inference worker takes it here).
    evaluation = client.post(
        f"/v1/fine_tuning/jobs/{running['id']}/evaluations", headers=auth, json={"file": spare["id"]}
    )
    assert evaluation.status_code == 200, evaluation.text
    eval_id, run_id, output_item_id = _eval_with_a_graded_item(client, auth)
    key = client.post("/v1/keys", headers=auth, json={"name": "reader", "scopes": ["files:read"]})
    assert key.status_code == 201, key.text
    return {
        "files": [training["id"], spare["id"]],
        "jobs": [running["id"], paused["id"]],
        "file_id": spare["id"],
        "job_id": running["id"],
        "paused_job_id": paused["id"],
        "checkpoint_id": ckpt,
        "event_id": events[-1]["id"],  # the oldest: "Created fine-tuning job"
        "model_id": _checkpoint_model(ckpt),  # a fine-tuned model checkpoint: a model of the project
        "endpoint_id": endpoint_id,
        "delivery_id": delivery["id"],
        "evaluation_id": evaluation.json()["id"],
        "eval_id": eval_id,
        "run_id": run_id,
        "output_item_id": output_item_id,
        "key_id": key.json()["id"],
        "audit_id": client.get("/v1/audit?limit=1", headers=auth).json()["data"][0]["id"],
    }


def _eval_with_a_graded_item(client: Any, auth: dict[str, str]) -> tuple[str, str, str]:
    """An eval, a run of it (queued), and one output item as the worker makes it (its scoring)."""
    from service.core.db import session_scope
    from service.core.tables import EvalOutputItem, Evaluation

    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    check = {
        "type": "string_check",
        "name": "s",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.a }}",
        "operation": "eq",
    }
    e = client.post(
        "/v1/evals",
        headers=auth,
        json={"data_source_config": {"type": "custom", "item_schema": schema}, "testing_criteria": [check]},
    )
    assert e.status_code == 200, e.text
    content = [{"item": {"a": "x"}, "sample": {"output_text": "x"}}]
    run = client.post(
        f"/v1/evals/{e.json()['id']}/runs",
        headers=auth,
        json={"data_source": {"type": "jsonl", "source": {"type": "file_content", "content": content}}},
    )
    assert run.status_code == 200, run.text
    from service.evals import criteria, items
    from worker.serving.eval_scoring import Answers, RunScoring

    scoring = RunScoring(criteria.parse([check], allow_python=False), None, None, {"temperature": 1, "max_tokens": 8})
    answers = Answers(0, [items.Item(0, {"a": "x"}, {"output_text": "x"})], [""], ["x"], [])
    (row,) = scoring.count(answers, scoring.grade(answers, None))
    with session_scope() as session:
        seq = session.query(Evaluation.seq).filter(Evaluation.id == run.json()["id"]).one()[0]
        item = EvalOutputItem(run_seq=seq, **row)
        session.add(item)
        session.commit()
        return e.json()["id"], run.json()["id"], item.id


def _tar_members(content: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(content)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


def _world(client: Any, auth: dict[str, str], artifacts: Path) -> dict[str, Any]:
    """Everything a project can read of itself, and its bytes on disk."""
    world: dict[str, Any] = {"files": client.get("/v1/files?limit=100", headers=auth).json()}
    for f in world["files"]["data"]:
        world[f["id"]] = client.get(f"/v1/files/{f['id']}/content", headers=auth).content
    world["jobs"] = client.get("/v1/fine_tuning/jobs?limit=100", headers=auth).json()
    for job in world["jobs"]["data"]:
        job.pop("estimated_finish")  # a running job's estimate moves with the clock
        url = f"/v1/fine_tuning/jobs/{job['id']}"
        world[url + "/events"] = client.get(url + "/events?limit=100", headers=auth).json()
        world[url + "/metrics"] = client.get(url + "/metrics", headers=auth).json()
        world[url + "/checkpoints"] = client.get(url + "/checkpoints", headers=auth).json()
        world[url + "/evaluations"] = client.get(url + "/evaluations", headers=auth).json()
        for c in world[url + "/checkpoints"]["data"]:
            resp = client.get(f"{url}/checkpoints/{c['id']}/content", headers=auth)
            assert resp.status_code == 200, resp.text
            world[c["id"]] = _tar_members(resp.content)
    world["evals"] = client.get("/v1/evals?limit=100", headers=auth).json()
    for e in world["evals"]["data"]:
        url = f"/v1/evals/{e['id']}/runs"
        world[url] = client.get(url, headers=auth).json()
        for run in world[url]["data"]:
            items = f"{url}/{run['id']}/output_items"
            world[items] = client.get(items, headers=auth).json()
    world["keys"] = client.get("/v1/keys?limit=100", headers=auth).json()
    for k in world["keys"]["data"]:
        k.pop("last_used_at")  # the auth fixture's key is used by these very reads
    world["webhooks"] = client.get("/v1/webhook_endpoints?limit=100", headers=auth).json()
    for e in world["webhooks"]["data"]:
        url = f"/v1/webhook_endpoints/{e['id']}/deliveries"
        world[url] = client.get(url, headers=auth).json()
    world["disk"] = {
        str(p.relative_to(artifacts)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(artifacts.rglob("*"))
        if p.is_file() and p.parts[len(artifacts.parts)] in ("files", "checkpoints")
    }
    return world


def _same_as_a_never_existing_id(
    client: Any, headers: dict[str, str], method: str, url: str, real: dict[str, str], fake: dict[str, str]
) -> None:
    """``url`` (naming ``real`` ids) answers as the same URL naming never-existing ids (``fake``)
    does, the very body: a 404 in the error shape (a list's ``after``: an empty page). Nothing tells
    that the real ids exist."""
    url = url.replace(":path}", "}")
    resp = client.request(method, url.format(**real), headers=headers)
    never = client.request(method, url.format(**fake), headers=headers)
    if "?after=" in url:
        assert resp.status_code == never.status_code == 200 and resp.json()["data"] == never.json()["data"] == []
        return
    err = assert_error(resp, 404, code=ANY)
    assert err["code"] in ("not_found", "model_not_found"), err
    assert_error(never, 404, code=err["code"])
    body = json.dumps(err)
    for name, value in real.items():
        body = body.replace(value, fake[name])
    assert json.loads(body) == never.json()["error"], (method, url)


def _id_combinations(path: str, alpha: dict[str, str], beta: dict[str, str]) -> list[tuple[dict, dict]]:
    """Each way to put alpha's ids in ``path`` (at least one; beta's own real ids in the other
    places), with the never-existing ids that replace alpha's."""
    kinds = (
        "job_id",
        "checkpoint_id",
        "file_id",
        "model_id",
        "endpoint_id",
        "evaluation_id",
        "eval_id",
        "run_id",
        "key_id",
    )
    names = [n for n in (*kinds, "output_item_id") if "{" + n + "}" in path or "{" + n + ":" in path]
    combos = []
    for mask in range(1, 2 ** len(names)):
        real = {n: (alpha if mask >> i & 1 else beta)[n] for i, n in enumerate(names)}
        fake = {n: (FAKE[n] if mask >> i & 1 else beta[n]) for i, n in enumerate(names)}
        combos.append((real, fake))
    return combos


def test_isolation_matrix(client, auth, other_auth, env, models_dir, monkeypatch) -> None:
    from service.core.db import reset_caches
    from service.core.settings import get_settings

    monkeypatch.setenv("RLOO_WEBHOOK_URLS", '["http://127.0.0.1:9/"]')  # nothing listens: sends are refused
    reset_caches()

    artifacts = get_settings().artifacts_dir
    alpha = _project(client, auth, models_dir)
    beta = _project(client, other_auth, models_dir)
    before = _world(client, auth, artifacts)
    # The data is real: events, metrics and a checkpoint that alpha downloads (the training state stays
    # server-side).
    job_url = f"/v1/fine_tuning/jobs/{alpha['job_id']}"
    assert [m["step"] for m in before[job_url + "/metrics"]["data"]] == [1, 2]
    assert any(e["type"] == "metrics" for e in before[job_url + "/events"]["data"])
    members = before[alpha["checkpoint_id"]]
    assert f"{alpha['checkpoint_id']}/config.json" in members and members[f"{alpha['checkpoint_id']}/config.json"]
    assert not any("training_state" in name for name in members)
    assert {j["status"] for j in before["jobs"]["data"]} == {"running", "paused"}

    failures = []

    def check(method: str, url: str, real: dict[str, str], fake: dict[str, str]) -> None:
        try:
            _same_as_a_never_existing_id(client, other_auth, method, url, real, fake)
        except AssertionError as exc:
            failures.append(f"{method} {url} {real}: {str(exc)[:400]}")

    # Each of alpha's jobs (a pause would succeed on the running one, a resume on the paused one) and
    # files (the spare one would delete, the other is in use).
    variants = [{**alpha, "job_id": j, "file_id": f} for j in alpha["jobs"] for f in alpha["files"]]
    tried = set()
    for method, path in ID_ROUTES:
        for alpha_ids in variants:
            for real, fake in _id_combinations(path, alpha_ids, beta):
                filled = path.replace(":path}", "}").format(**real)
                if (method, path, filled) not in tried:
                    tried.add((method, path, filled))
                    check(method, path, real, fake)
    assert {(method, path) for method, path, _ in tried} == set(ID_ROUTES)
    for path, kind in AFTER_ROUTES.items():
        own = path.format(**{k: beta[k] for k in ("job_id", "endpoint_id", "eval_id", "run_id")})
        check("GET", own + "?after={" + kind + "}", {kind: alpha[kind]}, {kind: FAKE[kind]})
    # And the other way round: beta's event and checkpoint ids are unknown in alpha's own job's lists.
    for path, kind in AFTER_ROUTES.items():
        if "{" in path:
            own = path.format(**{k: alpha[k] for k in ("job_id", "endpoint_id", "eval_id", "run_id")})
            resp = client.get(own + f"?after={beta[kind]}", headers=auth)
            assert resp.status_code == 200 and resp.json()["data"] == [], resp.text  # as unknown as a made-up id
    assert not failures, f"{len(failures)} request(s) leaked:\n" + "\n".join(failures)

    # beta sees nothing of alpha's in its lists ...
    assert set(list_ids(client, other_auth, "/v1/files?limit=100")) == set(beta["files"])
    assert set(list_ids(client, other_auth, "/v1/fine_tuning/jobs?limit=100")) == set(beta["jobs"])
    # ... and nothing beta did changed alpha's data, in the database or on disk.
    assert _world(client, auth, artifacts) == before

    # The control: each request that was a 404 for beta works for alpha, on the same ids.
    for method, path in ID_ROUTES:
        job_id = alpha["paused_job_id"] if path.endswith("/resume") else alpha["job_id"]
        if method == "GET":
            resp = client.get(path.replace(":path}", "}").format(**{**alpha, "job_id": job_id}), headers=auth)
            assert resp.status_code == 200, (path, resp.text)
    for method, path, job_id, status in (
        ("POST", "/pause", alpha["job_id"], "paused"),
        ("POST", "/resume", alpha["paused_job_id"], "queued"),
        ("POST", "/cancel", alpha["job_id"], "cancelled"),
    ):
        resp = client.request(method, f"/v1/fine_tuning/jobs/{job_id}{path}", headers=auth)
        assert resp.status_code == 200 and resp.json()["status"] == status, resp.text
    assert client.delete(f"/v1/files/{alpha['file_id']}", headers=auth).status_code == 200


def test_the_matrix_covers_every_route(app) -> None:
    """A new /v1 route with an id in its path, or a new list paged with ?after=, fails here until it is
    in the isolation matrix above. The operator's routes span projects (a project's key gets a 403
    there: tests/api/test_api_keys.py), so they are not in it."""
    from fastapi import routing

    from service.api import route_scopes as scopes

    def query_params(dependant: Any) -> set[str]:  # the route's own and its dependencies', recursively
        names = {p.alias for p in dependant.query_params}
        for sub in dependant.dependencies:
            names |= query_params(sub)
        return names

    # FastAPI >= 0.1xx keeps included routers whole in app.routes; iter_route_contexts flattens them.
    flatten = getattr(routing, "iter_route_contexts", lambda routes: routes)
    with_ids, with_after, others = set(), set(), []
    for route in flatten(app.routes):
        path = getattr(route, "path", None) or ""
        if not path.startswith("/v1") or all(scopes.needed(m, path)[1] == scopes.OPERATOR for m in route.methods):
            continue
        if not isinstance(getattr(route, "original_route", route), routing.APIRoute):
            others.append(path)  # a mount or a websocket: the matrix cannot vouch for it
            continue
        if "{" in path:
            with_ids |= {(method, path) for method in route.methods}
        if "after" in query_params(route.dependant):
            with_after.add(path)
    assert others == []
    assert with_ids == set(ID_ROUTES), "add the route to ID_ROUTES (or drop it from there)"
    assert with_after == set(AFTER_ROUTES), "add the list to AFTER_ROUTES (or drop it from there)"


def test_idempotency_keys_are_per_project(client, auth, other_auth, env) -> None:
    """beta reusing alpha's Idempotency-Key gets its own new object: never alpha's answer, and never a
    409 that would tell the key is in use."""

    def post_file(headers: dict[str, str], content: bytes = TRAIN_JSONL) -> Any:
        return client.post(
            "/v1/files",
            headers={**headers, "Idempotency-Key": "shared-key"},
            files={"file": ("train.jsonl", content)},
            data={"purpose": "fine-tune"},
        )

    mine = post_file(auth)
    assert mine.status_code == 200, mine.text
    theirs = post_file(other_auth)  # the same request, byte for byte, with the same key
    assert theirs.status_code == 200, theirs.text
    assert theirs.headers.get("idempotent-replayed") is None
    assert theirs.json()["id"] != mine.json()["id"]
    other_content = post_file(other_auth, TRAIN_JSONL + b'{"prompt": "more"}\n')
    assert_error(other_content, 409, code="idempotency_key_reused")  # beta's own key now, beta's own request
    assert list_ids(client, auth, "/v1/files") == [mine.json()["id"]]
    assert list_ids(client, other_auth, "/v1/files") == [theirs.json()["id"]]
    again = post_file(auth)
    assert again.json() == mine.json() and again.headers.get("idempotent-replayed") == "true"

    def post_job(headers: dict[str, str], body: dict[str, Any]) -> Any:
        return client.post("/v1/fine_tuning/jobs", headers={**headers, "Idempotency-Key": "job-key"}, json=body)

    body = job_body(mine.json()["id"])
    my_job = post_job(auth, body)
    assert my_job.status_code == 200, my_job.text
    # alpha's very request (alpha's file id included) under alpha's key is no replay for beta: alpha's
    # file does not exist for it.
    assert_error(post_job(other_auth, body), 400, param="training_file", code="file_not_found")
    their_job = post_job(other_auth, job_body(theirs.json()["id"]))
    assert their_job.status_code == 200, their_job.text
    assert their_job.headers.get("idempotent-replayed") is None
    assert their_job.json()["id"] != my_job.json()["id"]
    assert their_job.json()["organization_id"] != my_job.json()["organization_id"]
    assert list_ids(client, auth, "/v1/fine_tuning/jobs") == [my_job.json()["id"]]
    assert list_ids(client, other_auth, "/v1/fine_tuning/jobs") == [their_job.json()["id"]]


def test_projects_see_only_their_own_lists(client, auth, other_auth) -> None:
    mine = upload_ok(client, auth)
    theirs = upload_ok(client, other_auth)
    my_job = create_job(client, auth, job_body(mine["id"]))
    their_job = create_job(client, other_auth, job_body(theirs["id"]))
    assert list_ids(client, auth, "/v1/files") == [mine["id"]]
    assert list_ids(client, other_auth, "/v1/files") == [theirs["id"]]
    assert list_ids(client, auth, "/v1/fine_tuning/jobs") == [my_job["id"]]
    assert list_ids(client, other_auth, "/v1/fine_tuning/jobs") == [their_job["id"]]
    assert my_job["organization_id"] != their_job["organization_id"]
    # Each cancels only its own.
    assert_error(client.post(f"/v1/fine_tuning/jobs/{their_job['id']}/cancel", headers=auth), 404)
    assert client.post(f"/v1/fine_tuning/jobs/{their_job['id']}/cancel", headers=other_auth).status_code == 200
    assert client.get(f"/v1/fine_tuning/jobs/{my_job['id']}", headers=auth).json()["status"] == "queued"


def test_other_projects_file_cannot_train_a_job(client, auth, other_auth) -> None:
    theirs = upload_ok(client, other_auth)
    mine = upload_ok(client, auth)
    assert_error(
        client.post("/v1/fine_tuning/jobs", headers=auth, json=job_body(theirs["id"])),
        400,
        param="training_file",
    )
    assert_error(
        client.post("/v1/fine_tuning/jobs", headers=auth, json=job_body(mine["id"], validation_file=theirs["id"])),
        400,
        param="validation_file",
    )
    assert list_ids(client, auth, "/v1/fine_tuning/jobs") == []
