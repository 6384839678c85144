"""Files and checkpoints in an S3-compatible object store (``RLOO_ARTIFACTS_URL``,
``service.infra.artifacts``), against a real S3 HTTP server (moto's standalone server, a child process):
uploads stream into it and download back through the API; a checkpoint published by a worker whose
artifacts directory holds nothing of the API's downloads through the API; an upload of a checkpoint
cut off before its marker leaves nothing visible and a resume takes the checkpoint before; the sweep
removes what interrupted writes left; and one job end to end on real processes, the store the only
thing the API and the worker share."""

from __future__ import annotations

import io
import json
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.api import create_job, stored_files, upload, upload_ok
from tests.helpers.data import EXAMPLES, job_body
from tests.helpers.s3 import bucket_env, keys, moto_server, multipart_uploads


@pytest.fixture(scope="module")
def s3_server() -> Iterator[str]:
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3(env: dict[str, str], s3_server: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The settings of ``env``, with artifacts in a fresh bucket of the server (``endpoint``, ``url``)."""
    from service.core.db import reset_caches
    from service.infra import artifacts

    values = bucket_env(s3_server)
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(artifacts._swept, "at", 0.0)
    reset_caches()
    return {**env, **values, "endpoint": s3_server, "url": values["RLOO_ARTIFACTS_URL"]}


def _dataset(n_lines: int) -> bytes:
    pad = "x" * 150
    return b"".join(
        json.dumps({"prompt": f"What is {i} + 1? {pad}", "answer": str(i + 1)}).encode() + b"\n" for i in range(n_lines)
    )


def _use_artifacts_dir(monkeypatch: pytest.MonkeyPatch, path: Path | None) -> None:
    """This process's artifacts directory from now on (None: the default under RLOO_HOME)."""
    from service.core.db import reset_caches

    if path is None:
        monkeypatch.delenv("RLOO_ARTIFACTS_DIR", raising=False)
    else:
        monkeypatch.setenv("RLOO_ARTIFACTS_DIR", str(path))
    reset_caches()


# Files -----------------------------------------------------------------------------------------------
def test_an_upload_streams_into_the_store_in_parts_and_downloads_back(s3, client, auth) -> None:
    content = _dataset(120_000)  # 22 MiB: three parts of 8 MiB
    started = time.perf_counter()
    f = upload_ok(client, auth, content, filename="big é.jsonl")
    uploaded = time.perf_counter() - started
    assert f["bytes"] == len(content) and f["line_count"] == 120_000
    stored = keys(s3["endpoint"], s3["url"], "files/")
    assert [k.rsplit("/", 1)[-1] for k in stored] == [f"{f['id']}.jsonl"]
    assert multipart_uploads(s3["endpoint"], s3["url"]) == []
    assert stored_files(s3) == []  # nothing of it on the API's disk

    started = time.perf_counter()
    r = client.get(f"/v1/files/{f['id']}/content", headers=auth)
    downloaded = time.perf_counter() - started
    assert r.status_code == 200 and r.content == content
    assert r.headers["content-length"] == str(len(content))
    assert r.headers["content-disposition"] == "attachment; filename*=utf-8''big%20%C3%A9.jsonl"
    print(f"\n{len(content) / 2**20:.1f} MiB: upload {uploaded:.2f} s, download {downloaded:.2f} s")

    assert client.delete(f"/v1/files/{f['id']}", headers=auth).json()["deleted"] is True
    assert keys(s3["endpoint"], s3["url"], "files/") == []
    assert client.get(f"/v1/files/{f['id']}/content", headers=auth).status_code == 404


def test_an_upload_refused_midway_leaves_no_object_and_no_upload(s3, client, auth) -> None:
    content = _dataset(60_000) + b'{"prompt": ""}\n' + _dataset(10)  # a bad line past the first part
    r = upload(client, auth, content)
    assert r.status_code == 400 and "Line 60001" in r.json()["error"]["message"], r.text
    assert keys(s3["endpoint"], s3["url"]) == []
    assert multipart_uploads(s3["endpoint"], s3["url"]) == []


def test_a_worker_reads_the_training_file_from_the_store_once(s3, client, auth, tmp_path, monkeypatch) -> None:
    from service.core.settings import get_settings
    from service.infra.artifacts import open_store

    f = upload_ok(client, auth)
    _use_artifacts_dir(monkeypatch, tmp_path / "worker")
    store = open_store(get_settings())
    rel = f"files/{_project_id(f['id'])}/{f['id']}.jsonl"
    path = store.fetch_file(rel)
    assert (
        path.is_relative_to(tmp_path / "worker")
        and path.read_bytes() == client.get(f"/v1/files/{f['id']}/content", headers=auth).content
    )
    mtime = path.stat().st_mtime_ns  # (cached: a second fetch downloads nothing)
    assert store.fetch_file(rel) == path and path.stat().st_mtime_ns == mtime
    with pytest.raises(FileNotFoundError):
        store.fetch_file("files/nobody/file-none.jsonl")
    for bad in ("../escape", "/etc/passwd", "files/../../x"):
        with pytest.raises(ValueError):
            store.fetch_file(bad)


def _project_id(file_id: str) -> str:
    from service.core.db import session_scope
    from service.core.tables import File, Project

    with session_scope() as session:
        return session.query(Project.id).join(File, File.project_seq == Project.seq).filter(File.id == file_id).one()[0]


# Checkpoints -------------------------------------------------------------------------------------
def _claimed_job(client: Any, auth: dict[str, str]) -> Any:
    from service.core.db import session_scope
    from service.core.identity import process_name
    from service.jobs import lifecycle

    job_id = create_job(client, auth, job_body(upload_ok(client, auth)["id"]))["id"]
    with session_scope() as session:
        job = lifecycle.claim(session=session, job_id=job_id, worker=process_name())
        assert job is not None
        return job


def _save(models_dir: Path, output_dir: Path, step: int) -> Path:
    """A real checkpoint as a run saves it: the tiny policy, its tokenizer, the training state."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.engine.checkpoints import save_checkpoint

    model = AutoModelForCausalLM.from_pretrained(models_dir / "tiny-policy")
    with torch.no_grad():
        next(model.parameters()).add_(step)  # each step's weights differ
    return save_checkpoint(
        model=model,
        tokenizer=AutoTokenizer.from_pretrained(models_dir / "tiny-policy"),
        output_dir=output_dir,
        step=step,
        training_state={"step": torch.tensor(step)},
        info={"step": step},
    )


def _tar(archive: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]


def _checkpoint_ids(client: Any, auth: dict[str, str], job_id: str) -> dict[int, str]:
    rows = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers=auth).json()["data"]
    return {c["step_number"]: c["id"] for c in rows}


def test_a_checkpoint_published_by_a_worker_on_another_disk_downloads_through_the_api(
    s3, client, auth, tmp_path, monkeypatch, models_dir
) -> None:
    from service.core.settings import get_settings
    from worker.engine.checkpoints import job_checkpoints_dir
    from worker.jobs.database_recorder import DatabaseRecorder

    job = _claimed_job(client, auth)
    api_dir = get_settings().artifacts_dir
    _use_artifacts_dir(monkeypatch, tmp_path / "worker")  # the worker's host: only the store is shared
    saved = _save(models_dir, job_checkpoints_dir(get_settings().artifacts_dir, job.id), 2)
    started = time.perf_counter()
    DatabaseRecorder(job).checkpoint(2, saved, {"train_reward_mean": 0.5}, final=False)
    published = time.perf_counter() - started
    _use_artifacts_dir(monkeypatch, None)  # the API's host again
    assert get_settings().artifacts_dir == api_dir and not (api_dir / "checkpoints").exists()

    ids = _checkpoint_ids(client, auth, job.id)
    assert list(ids) == [2]
    url = f"/v1/fine_tuning/jobs/{job.id}/checkpoints/{ids[2]}/content"
    started = time.perf_counter()
    r = client.get(url, headers=auth)
    downloaded = time.perf_counter() - started
    assert r.status_code == 200, r.text
    expected = {
        f"{ids[2]}/{p.name}": p.read_bytes() for p in saved.iterdir() if not p.name.startswith("training_state")
    }
    assert _tar(r.content) == expected and any(n.endswith("model.safetensors") for n in expected)
    part = client.get(url, headers={**auth, "Range": "bytes=1000-70000"})
    assert part.status_code == 206 and part.content == r.content[1000:70001]
    assert not (api_dir / "checkpoints").exists()  # streamed from the store, not cached on the API's host
    size = sum(len(b) for b in expected.values())
    print(f"\ncheckpoint {size / 2**20:.1f} MiB: published {published:.2f} s, downloaded {downloaded:.2f} s")


def test_a_checkpoint_cut_off_before_its_marker_is_invisible_and_resuming_takes_the_one_before(
    s3, client, auth, tmp_path, monkeypatch, models_dir
) -> None:
    from service.core.db import session_scope
    from service.core.settings import get_settings
    from service.infra.artifacts import S3Store, open_store
    from worker.engine.checkpoints import TRAINING_STATE, job_checkpoints_dir, resumable_checkpoint
    from worker.jobs.database_recorder import DatabaseRecorder

    job = _claimed_job(client, auth)
    _use_artifacts_dir(monkeypatch, tmp_path / "worker-a")
    output_dir = job_checkpoints_dir(get_settings().artifacts_dir, job.id)
    recorder = DatabaseRecorder(job)
    recorder.checkpoint(2, _save(models_dir, output_dir, 2), {}, final=False)
    step2 = {p.name: p.read_bytes() for p in (output_dir / "step-2").iterdir()}

    saved4 = _save(models_dir, output_dir, 4)
    store = open_store(get_settings())
    assert isinstance(store, S3Store)
    real_put, sent = store.put_file, []

    def dies_after_two(key: str, path: Path) -> None:
        if len(sent) == 2:
            raise ConnectionError("the worker's host lost its network")
        sent.append(key)
        real_put(key, path)

    store.put_file = dies_after_two  # type: ignore[method-assign]
    try:
        with pytest.raises(ConnectionError):
            recorder.checkpoint(4, saved4, {}, final=True)
    finally:
        del store.put_file
    partial = keys(s3["endpoint"], s3["url"], f"checkpoints/{job.id}/step-4/")
    assert len(partial) == 2  # some of it is there, and none of it counts:
    assert list(_checkpoint_ids(client, auth, job.id)) == [2]  # no row without its marker
    assert store.complete_checkpoints(f"checkpoints/{job.id}") == [f"checkpoints/{job.id}/step-2"]
    assert store.members(f"checkpoints/{job.id}/step-4") is None

    # On the same host: its whole step-4 directory on disk is no checkpoint; it goes.
    assert resumable_checkpoint(store, output_dir) == output_dir / "step-2"
    assert not (output_dir / "step-4").exists()
    # On a host whose disk holds nothing: step 2 is fetched.
    _use_artifacts_dir(monkeypatch, tmp_path / "worker-b")
    fresh = open_store(get_settings())
    fetched_dir = job_checkpoints_dir(get_settings().artifacts_dir, job.id)
    resumed = resumable_checkpoint(fresh, fetched_dir)
    assert resumed == fetched_dir / "step-2" and resumed.is_relative_to(tmp_path / "worker-b")
    assert {p.name: p.read_bytes() for p in resumed.iterdir()} == step2 and TRAINING_STATE in step2
    # The sweep removes what the cut-off upload left (once old enough; a live writer's stays).
    with session_scope() as session:
        assert fresh.sweep(session, older_than=3600) == {"aborted": 0, "removed": 0}
        time.sleep(1.1)  # (object times are in whole seconds)
        assert fresh.sweep(session, older_than=0) == {"aborted": 0, "removed": 2}
    assert keys(s3["endpoint"], s3["url"], f"checkpoints/{job.id}/step-4/") == []
    assert len(keys(s3["endpoint"], s3["url"], f"checkpoints/{job.id}/step-2/")) == len(step2) + 1  # and the marker


def test_the_sweep_aborts_dead_uploads_and_removes_objects_without_a_row(s3, client, auth, monkeypatch) -> None:
    from service.core.db import session_scope
    from service.core.settings import get_settings
    from service.files import upload_sweep
    from service.infra import artifacts
    from service.infra.artifacts import S3Store, open_store

    kept = upload_ok(client, auth)
    project = _project_id(kept["id"])
    store = open_store(get_settings())
    assert isinstance(store, S3Store)
    dead = store.upload(f"files/{project}/file-{'0' * 24}.jsonl")  # an API process killed mid-upload
    dead.write(b'{"prompt": "a"}\n' * 600_000)  # one part sent
    store.put_bytes(f"files/{project}/file-{'1' * 24}.jsonl", b'{"prompt": "a"}\n')  # killed before its commit
    assert len(multipart_uploads(s3["endpoint"], s3["url"])) == 1
    time.sleep(1.1)
    monkeypatch.setattr(upload_sweep, "ORPHAN_AGE_SECONDS", 0.0)
    monkeypatch.setitem(artifacts._swept, "at", 0.0)  # (the API's start swept already)
    with session_scope() as session:  # the reconciler's sweep (every worker, every round)
        counts = upload_sweep.sweep_uploads(session, get_settings().artifacts_dir)
    assert counts == {"removed": 1, "finished": 0, "aborted": 1}
    assert multipart_uploads(s3["endpoint"], s3["url"]) == []
    assert keys(s3["endpoint"], s3["url"], "files/") == [f"files/{project}/{kept['id']}.jsonl"]
    assert client.get(f"/v1/files/{kept['id']}/content", headers=auth).status_code == 200
    with session_scope() as session:  # once every few minutes a process, not every round
        assert upload_sweep.sweep_uploads(session, get_settings().artifacts_dir) == {"removed": 0, "finished": 0}


def test_without_a_store_url_the_directory_is_the_store_and_boto3_stays_unimported(env) -> None:
    import subprocess
    import sys

    from service.core.settings import get_settings
    from service.infra.artifacts import LocalStore, open_store
    from tests.helpers.data import ROOT

    store = open_store(get_settings())
    assert isinstance(store, LocalStore) and store.root == get_settings().artifacts_dir
    assert store.fetch_checkpoint("checkpoints/j/step-1") == store.root / "checkpoints" / "j" / "step-1"
    code = (
        "import sys; from fastapi.testclient import TestClient; from service.main import create_app\n"
        "with TestClient(create_app()) as c: c.get('/readyz')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[]", out.stderr


# End to end ----------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_a_job_end_to_end_shares_only_the_store(s3_server: str, tmp_path: Path, models_dir: Path) -> None:
    """The API and a real Celery worker with artifacts directories of their own: the training file,
    the checkpoints and the results file go through the store, and download through the API."""
    from tests.helpers.live import live_stack, upload_path, wait_for

    values = bucket_env(s3_server)
    with live_stack("embedded", tmp_path, models_dir, env=values, worker=False) as stack:
        stack.env = {**stack.env, "RLOO_ARTIFACTS_DIR": str(tmp_path / "worker-artifacts")}
        stack.start("worker", "worker", "--loglevel", "INFO")
        http = stack.http
        file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
        body = job_body(file_id, hp={"max_steps": 4, "checkpoint_interval": 2})
        job_id = http.post("/fine_tuning/jobs", json=body).json()["id"]
        job = wait_for(http, job_id, {"succeeded", "failed", "cancelled"}, 300, stack)
        assert job["status"] == "succeeded", (job["error"], stack.log_tail())
        ckpts = http.get(f"/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
        assert [c["step_number"] for c in ckpts] == [4, 2]
        archive = http.get(f"/fine_tuning/jobs/{job_id}/checkpoints/{ckpts[0]['id']}/content")
        assert archive.status_code == 200
        names = _tar(archive.content)
        assert any(n.endswith("model.safetensors") for n in names) and not any("training_state" in n for n in names)
        results = http.get(f"/files/{job['result_files'][0]}/content")
        assert results.status_code == 200 and results.text.startswith("step,")
        api_dir = tmp_path / "var" / "artifacts"
        assert not (api_dir / "checkpoints").exists() and not (api_dir / "files").exists()
        assert (tmp_path / "worker-artifacts" / "checkpoints" / job_id / "step-4").is_dir()
        stored = keys(s3_server, values["RLOO_ARTIFACTS_URL"])
        assert f"checkpoints/{job_id}/step-4/.complete" in stored and f"checkpoints/{job_id}/step-2/.complete" in stored


@pytest.mark.e2e
def test_a_paused_job_resumes_on_a_worker_whose_disk_holds_nothing(
    s3_server: str, tmp_path: Path, models_dir: Path
) -> None:
    """Paused at step 3 on one worker (its checkpoint published), resumed on another with an empty
    artifacts directory: it fetches step 3 from the store and finishes from there."""
    import threading

    from tests.helpers.live import live_stack, upload_path, wait_for
    from tests.helpers.scoring import Endpoint

    held, scoring = threading.Event(), threading.Event()

    def score(n: int, body: dict[str, Any]) -> tuple[int, Any]:
        if n == 3:  # step 3: held until the test has paused the job
            scoring.set()
            held.wait(60)
        return 200, {"scores": [0.5 for _ in body["samples"]]}

    server = Endpoint(score)
    values = {**bucket_env(s3_server), "RLOO_HTTP_GRADER_URLS": json.dumps([server.url])}
    try:
        with live_stack("embedded", tmp_path, models_dir, env=values, worker=False) as stack:
            base_env = stack.env
            stack.env = {**base_env, "RLOO_ARTIFACTS_DIR": str(tmp_path / "worker-a")}
            stack.start("worker-a", "worker", "--loglevel", "INFO")
            http = stack.http
            body = job_body(upload_path(http, EXAMPLES / "demo" / "train.jsonl"), hp={"max_steps": 6})
            body["method"]["reinforcement"]["grader"] = {"type": "http", "name": "held", "url": server.url}
            job_id = http.post("/fine_tuning/jobs", json=body).json()["id"]
            assert scoring.wait(120), "step 3 was never scored\n" + stack.log_tail()
            assert http.post(f"/fine_tuning/jobs/{job_id}/pause").status_code == 200
            held.set()
            deadline = time.monotonic() + 60
            while http.get(f"/fine_tuning/jobs/{job_id}/checkpoints").json()["data"] == []:
                assert time.monotonic() < deadline, stack.log_tail()
                time.sleep(0.2)
            wait_for(http, job_id, {"paused"}, 60, stack)
            stack.stop("worker-a")

            stack.env = {**base_env, "RLOO_ARTIFACTS_DIR": str(tmp_path / "worker-b")}
            stack.start("worker-b", "worker", "--loglevel", "INFO")
            deadline = time.monotonic() + 60
            while (r := http.post(f"/fine_tuning/jobs/{job_id}/resume")).status_code == 409:
                assert time.monotonic() < deadline, (r.text, stack.log_tail())  # the worker letting go
                time.sleep(0.2)
            assert r.status_code == 200, r.text
            job = wait_for(http, job_id, {"succeeded", "failed", "cancelled"}, 240, stack)
            assert job["status"] == "succeeded", (job["error"], stack.log_tail())
            events = http.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]
            assert any("Resumed from the checkpoint at step 3" in e["message"] for e in events)
            metrics = http.get(f"/fine_tuning/jobs/{job_id}/metrics").json()["data"]
            assert [m["step"] for m in metrics] == list(range(1, 7))
            assert (tmp_path / "worker-b" / "checkpoints" / job_id / "step-3").is_dir()  # fetched
            assert (tmp_path / "worker-b" / "checkpoints" / job_id / "step-6").is_dir()  # and trained on
    finally:
        held.set()
        server.close()


def test_a_final_checkpoint_recorded_again_after_a_resume_is_not_uploaded_again(
    s3, client, auth, tmp_path, monkeypatch, models_dir
) -> None:
    """Its worker died after publishing step 2 and before its row; the job resumes on another host at
    its last step and records that checkpoint (``written=False``): the store holds it whole, so nothing
    is uploaded (a new upload hides it, marker first, for as long as it takes) and its row is back."""
    from sqlalchemy import delete

    from service.core.db import session_scope
    from service.core.settings import get_settings
    from service.core.tables import Checkpoint
    from service.infra.artifacts import S3Store, open_store
    from worker.engine.checkpoints import job_checkpoints_dir, resumable_checkpoint
    from worker.jobs.database_recorder import DatabaseRecorder

    job = _claimed_job(client, auth)
    _use_artifacts_dir(monkeypatch, tmp_path / "worker-a")
    DatabaseRecorder(job).checkpoint(
        2, _save(models_dir, job_checkpoints_dir(get_settings().artifacts_dir, job.id), 2), {}, final=False
    )
    with session_scope() as session:
        session.execute(delete(Checkpoint).where(Checkpoint.job_seq == job.seq))
        session.commit()

    _use_artifacts_dir(monkeypatch, tmp_path / "worker-b")  # the next worker's host: its disk holds nothing
    store = open_store(get_settings())
    assert isinstance(store, S3Store)
    resumed = resumable_checkpoint(store, job_checkpoints_dir(get_settings().artifacts_dir, job.id))
    assert resumed is not None and resumed.name == "step-2"

    def never(*args: Any) -> None:
        raise AssertionError(f"the checkpoint was written to the store again: {args[0]}")

    store.put_file = store.put_bytes = store.delete = never  # type: ignore[method-assign]
    try:
        DatabaseRecorder(job).checkpoint(2, resumed, {"train_reward_mean": 0.5}, final=True, written=False)
    finally:
        del store.put_file, store.put_bytes, store.delete
    _use_artifacts_dir(monkeypatch, None)
    ids = _checkpoint_ids(client, auth, job.id)
    assert list(ids) == [2]
    r = client.get(f"/v1/fine_tuning/jobs/{job.id}/checkpoints/{ids[2]}/content", headers=auth)
    assert r.status_code == 200 and any(n.endswith("model.safetensors") for n in _tar(r.content))
    assert client.get(f"/v1/fine_tuning/jobs/{job.id}", headers=auth).json()["fine_tuned_model"]
