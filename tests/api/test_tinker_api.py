"""The Tinker protocol's doors (``/api/v1``), without a worker: keys as the SDK sends them, models
checked when a training model is created, forward_backward bodies checked before they are queued
(malformed protobuf, a zstd bomb, an unknown loss, a missing input), and another project's
models, futures and checkpoints as unknown as ones that never were. What a worker answers is
``tests/e2e/test_tinker.py``'s."""

from __future__ import annotations

from typing import Any

import pytest
import zstandard

from service.api.routes import tinker as routes
from tests.helpers.api import make_key

types = pytest.importorskip("tinker.types")


def _headers(project: str = "alpha") -> dict[str, str]:
    return {"X-API-Key": make_key(project)}


def _session(client: Any, headers: dict[str, str]) -> str:
    r = client.post(
        "/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}, headers=headers
    )
    assert r.status_code == 200, r.text
    return str(r.json()["session_id"])


def _model(client: Any, headers: dict[str, str], base: str = "tiny-policy", seq: int = 0) -> Any:
    session_id = _session(client, headers)
    body = {"session_id": session_id, "model_seq_id": seq, "base_model": base, "lora_config": {"rank": 4}}
    return client.post("/api/v1/create_model", json=body, headers=headers)


def _fwdbwd(model_id: str, loss_fn: str = "cross_entropy", inputs: dict[str, Any] | None = None) -> bytes:
    from tinker.proto.request_conv import forward_backward_request_to_proto

    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs=inputs if inputs is not None else {"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn=loss_fn), model_id=model_id, seq_id=1
    )
    return bytes(forward_backward_request_to_proto(request).SerializeToString())


def _post_proto(client: Any, body: bytes, headers: dict[str, str], encoding: str | None = None) -> Any:
    extra = {"Content-Type": "application/x-protobuf", **({"Content-Encoding": encoding} if encoding else {})}
    return client.post("/api/v1/forward_backward", content=body, headers={**headers, **extra})


def test_the_sdk_s_key_header_is_read_and_a_request_without_one_refused(client: Any) -> None:
    assert client.get("/api/v1/healthz").json() == {"status": "ok"}  # the one open path
    assert client.post("/api/v1/create_session", json={"tags": []}).status_code == 401
    assert (
        client.post("/api/v1/create_session", json={"tags": []}, headers={"X-API-Key": "tml-nope"}).status_code == 401
    )
    assert client.post("/api/v1/create_session", json={"tags": []}, headers=_headers()).status_code == 200


def test_capabilities_list_the_models_a_training_model_can_start_from(client: Any) -> None:
    names = {
        m["model_name"]: m
        for m in client.get("/api/v1/get_server_capabilities", headers=_headers()).json()["supported_models"]
    }
    assert names["tiny-policy"]["trainable"] is True and names["tiny-policy"]["max_context_length"] > 0
    assert "tiny-reward" not in names  # a classifier: it does not write text


def test_a_training_model_s_base_is_checked_when_it_is_created(client: Any) -> None:
    headers = _headers()
    r = _model(client, headers, base="tiny-reward")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_model", r.text
    assert "sequence classifier" in r.json()["error"]["message"]
    r = _model(client, headers, base="no-such-model")
    assert r.status_code == 400 and r.json()["error"]["param"] == "base_model", r.text
    r = _model(client, headers)
    assert r.status_code == 200 and r.json()["model_id"].endswith(":train:0"), r.text
    info = client.post("/api/v1/get_info", json={"model_id": r.json()["model_id"]}, headers=headers).json()
    assert info["lora_rank"] == 4 and info["model_data"]["model_name"] == "tiny-policy"


def test_a_training_model_whose_state_fits_no_declared_accelerator_is_refused_at_creation(
    client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.core.settings import Settings, get_settings
    from service.registry import memory_plan

    shape = memory_plan.model_shape(Settings().models_dir / "tiny-policy")
    full = memory_plan.training_model_state(shape, 0)
    lora = memory_plan.training_model_state(shape, 4)
    assert full["trainable_parameters"] == shape.parameters > lora["trainable_parameters"] > 0
    assert full["bytes"]["weights"] == lora["bytes"]["weights"] == 4 * shape.parameters
    assert full["bytes"]["optimizer"] == 8 * shape.parameters  # AdamW's two fp32 moments
    # Room for the LoRA model's state and not the full one's: LoRA is created, full is refused.
    room = (lora["bytes_per_device"] + full["bytes_per_device"]) / 2 / memory_plan.HEADROOM / 2**30
    monkeypatch.setenv("RLOO_ACCELERATORS", f'{{"small": {room}}}')
    get_settings.cache_clear()
    headers = _headers()
    assert _model(client, headers).status_code == 200
    session_id = _session(client, headers)
    body = {"session_id": session_id, "model_seq_id": 0, "base_model": "tiny-policy", "lora_config": {"rank": 0}}
    r = client.post("/api/v1/create_model", json=body, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == "insufficient_memory", r.text
    message = r.json()["error"]["message"]
    assert "training every weight" in message and "small" in message and "a LoRA" in message
    monkeypatch.delenv("RLOO_ACCELERATORS")
    get_settings.cache_clear()
    assert client.post("/api/v1/create_model", json=body, headers=headers).status_code == 200  # none declared


def test_forward_backward_bodies_are_checked_before_they_are_queued(client: Any) -> None:
    headers = _headers()
    model_id = _model(client, headers).json()["model_id"]
    ok = _post_proto(client, _fwdbwd(model_id), headers)
    assert ok.status_code == 200 and ok.json()["request_id"].startswith("tkr-"), ok.text
    compressed = _post_proto(client, zstandard.ZstdCompressor().compress(_fwdbwd(model_id)), headers, "zstd")
    assert compressed.status_code == 200, compressed.text

    garbage = _post_proto(client, b"\xff\x00 not protobuf" * 10, headers)
    assert garbage.status_code == 400 and "ForwardBackwardRequest" in garbage.json()["error"]["message"]
    bomb = zstandard.ZstdCompressor().compress(b"\x00" * (80 * 2**20))  # 80 MiB of zeros, ~2.5 KB sent
    r = _post_proto(client, bomb, headers, "zstd")
    assert r.status_code == 413, r.text
    r = _post_proto(client, _fwdbwd(model_id, loss_fn="grpo"), headers)
    assert r.status_code == 400 and "'grpo'" in r.json()["error"]["message"] and "ppo" in r.json()["error"]["message"]
    r = _post_proto(client, _fwdbwd(model_id, loss_fn="ppo"), headers)  # no logprobs, no advantages
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("datum 0"), r.text
    r = _post_proto(client, _fwdbwd(model_id, inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]}), headers)
    assert r.status_code == 400 and "3 tokens" in r.json()["error"]["message"], r.text


def test_another_project_s_models_futures_and_checkpoints_are_unknown(
    client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(routes, "LONG_POLL_SECONDS", 0.05)
    mine, theirs = _headers("alpha"), _headers("beta")
    model_id = _model(client, mine).json()["model_id"]
    rid = _post_proto(client, _fwdbwd(model_id), mine).json()["request_id"]

    pending = client.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=mine)
    assert pending.json() == {"type": "try_again", "request_id": rid, "queue_state": "active"}  # no worker here
    r = client.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=theirs)
    assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"
    assert client.post("/api/v1/cancel_future", json={"request_id": rid}, headers=theirs).status_code == 404
    r = client.post("/api/v1/cancel_future", json={"request_id": rid}, headers=mine)  # a training request
    assert r.status_code == 400 and r.json()["error"]["code"] == "not_cancellable", r.text
    config = client.post("/api/v1/client/dynamic_config", json={}, headers=mine).json()
    assert config["sample_cancel_enabled"] is True  # the SDK cancels the samples it abandons
    assert _post_proto(client, _fwdbwd(model_id), theirs).status_code == 404
    r = client.post("/api/v1/optim_step", json={"model_id": model_id, "adam_params": {}}, headers=theirs)
    assert r.status_code == 404
    assert client.post("/api/v1/get_info", json={"model_id": model_id}, headers=theirs).status_code == 404
    load = {"model_id": model_id, "path": f"tinker://{model_id}/weights/x", "optimizer": False}
    assert client.post("/api/v1/load_weights", json=load, headers=theirs).status_code == 404
    r = client.post("/api/v1/load_weights", json={**load, "path": "s3://bucket/x"}, headers=mine)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_path"
    r = client.post("/api/v1/save_weights", json={"model_id": model_id, "path": "../../etc"}, headers=mine)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_path"


def test_samples_are_checked_before_they_reach_an_inference_worker(client: Any) -> None:
    mine, theirs = _headers("alpha"), _headers("beta")
    model_id = _model(client, mine).json()["model_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}

    def sample(headers: dict[str, str], **fields: Any) -> Any:
        body = {"num_samples": 1, "prompt": prompt, "sampling_params": {"max_tokens": 4}, **fields}
        return client.post("/api/v1/asample", json=body, headers=headers)

    r = sample(mine, base_model="tiny-policy", prompt_alt_tokens_k=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_alt_tokens_k", r.text
    r = sample(mine, base_model="tiny-policy", prompt_logprobs=True, prompt_logprobs_last_n=3)  # a 3-token prompt
    assert r.status_code == 400 and "between 1 and" in r.json()["error"]["message"], r.text
    r = sample(mine, base_model="tiny-policy", num_samples=25)  # RLOO_INFERENCE_MAX_BATCH 32: 24 a request
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_completions", r.text
    assert "at most 24" in r.json()["error"]["message"]
    r = sample(mine, base_model="tiny-policy", topk_prompt_logprobs=21)
    assert r.status_code == 400 and r.json()["error"]["param"] == "topk_prompt_logprobs", r.text
    r = sample(mine, base_model="tiny-policy", prompt={"chunks": [{"type": "image", "tokens": []}]})
    assert r.status_code == 400 and "encoded_text" in r.json()["error"]["message"]
    r = sample(theirs, model_path=f"tinker://{model_id}/sampler_weights/x")
    assert r.status_code == 404, r.text  # another project's weights: unknown
    r = sample(mine, model_path=f"tinker://{model_id}/weights/x")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_path", r.text
    r = sample(mine, sampling_session_id="sms-not-a-session")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    r = sample(mine, base_model="tiny-reward")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_model"
    r = sample(mine, base_model="tiny-policy")
    assert r.status_code == 503, r.text  # no inference worker in this test
    assert client.get("/api/v1/samplers/sms-nothing", headers=mine).status_code == 404


def _checkpoint(model_id: str, kind: str, name: str, files: dict[str, bytes]) -> str:
    """A checkpoint as a worker leaves one: its files under the artifacts root, then its row."""
    from sqlalchemy import select

    from service.core.db import session_scope
    from service.core.settings import get_settings
    from service.core.tables import TinkerCheckpoint, TinkerModel

    relative = f"tinker/{model_id.replace(':', '.')}/{kind}/{name}"
    for file, data in files.items():
        (get_settings().artifacts_dir / relative / file).parent.mkdir(parents=True, exist_ok=True)
        (get_settings().artifacts_dir / relative / file).write_bytes(data)
    with session_scope() as session:
        seq = session.scalar(select(TinkerModel.seq).where(TinkerModel.id == model_id))
        session.add(TinkerCheckpoint(model_seq=seq, kind=kind, name=name, path=relative, size_bytes=7))
        session.commit()
    return f"tinker://{model_id}/{kind}/{name}"


def test_the_rest_client_lists_describes_downloads_expires_and_deletes_checkpoints(client: Any) -> None:
    from sqlalchemy import update

    from service.core.db import session_scope
    from service.core.settings import get_settings
    from service.core.tables import TinkerCheckpoint, TinkerModel
    from service.tinker.runs import sweep_expired

    mine, theirs = _headers("alpha"), _headers("beta")
    model_id = _model(client, mine).json()["model_id"]
    bearer = {"Authorization": f"Bearer {mine['X-API-Key']}"}
    other = {"Authorization": f"Bearer {theirs['X-API-Key']}"}
    stored, others = (client.get("/v1/usage", headers=h).json()["stored_bytes"] for h in (bearer, other))
    sampler = _checkpoint(
        model_id, "sampler_weights", "s1", {"adapter_model.safetensors": b"weights", "x/a.json": b"{}"}
    )
    state = _checkpoint(model_id, "weights", "w1", {"model.pt": b"state"})
    base = f"/api/v1/training_runs/{model_id}"
    assert client.get("/v1/usage", headers=bearer).json()["stored_bytes"] == stored + 2 * 7  # its project's bytes
    assert client.get("/v1/usage", headers=other).json()["stored_bytes"] == others
    # At its quota of stored bytes, a project saves nothing more (403 quota_exceeded, naming the quota).
    operator = {"Authorization": f"Bearer {make_key('ops', operator=True)}"}
    full = {"quotas": {"stored_bytes": stored + 14}}
    assert client.post("/v1/projects/alpha", headers=operator, json=full).is_success
    for path in ("save_weights", "save_weights_for_sampler", "save_weights_external"):
        r = client.post(f"/api/v1/{path}", json={"model_id": model_id, "path": "more"}, headers=mine)
        assert r.status_code == 403 and r.json()["error"]["code"] == "quota_exceeded", (path, r.text)
        assert "stored_bytes" in r.json()["error"]["message"]
    assert client.post("/v1/projects/alpha", headers=operator, json={"quotas": {"stored_bytes": None}}).is_success

    runs = client.get("/api/v1/training_runs", headers=mine).json()
    assert runs["cursor"] == {"offset": 0, "limit": 20, "total_count": 1}
    run = runs["training_runs"][0]
    assert (run["training_run_id"], run["lora_rank"], run["is_lora"]) == (model_id, 4, True)
    assert run["last_sampler_checkpoint"]["tinker_path"] == sampler and run["last_checkpoint"]["tinker_path"] == state
    assert client.get("/api/v1/training_runs", headers=theirs).json()["training_runs"] == []
    for path in (base, f"{base}/checkpoints", f"{base}/checkpoints/weights/w1/external_weights_urls"):
        assert client.get(path, headers=theirs).status_code == 404, path
    assert client.delete(f"{base}/checkpoints/weights/w1", headers=theirs).status_code == 404
    listed = client.get(f"{base}/checkpoints", headers=mine).json()["checkpoints"]
    assert [c["checkpoint_id"] for c in listed] == ["sampler_weights/s1", "weights/w1"]
    assert client.get("/api/v1/checkpoints?limit=1", headers=mine).json()["cursor"]["total_count"] == 2
    info = client.post("/api/v1/weights_info", json={"tinker_path": state}, headers=mine).json()
    assert (info["base_model"], info["lora_rank"], info["train_mlp"]) == ("tiny-policy", 4, True)

    # Download links: every file, no key needed, nothing else reachable through them
    links = client.get(f"{base}/checkpoints/sampler_weights/s1/external_weights_urls", headers=mine).json()["urls"]
    assert sorted(links) == ["adapter_model.safetensors", "x/a.json"]
    url = links["adapter_model.safetensors"].split("://", 1)[1].split("/", 1)[1]
    assert client.get("/" + url).content == b"weights"
    token = url.split("/")[3]
    assert client.get(f"/api/v1/downloads/{token}/../weights/w1/model.pt").status_code == 404
    assert client.get(f"/api/v1/downloads/{token}/x%2F..%2F..%2Fweights%2Fw1%2Fmodel.pt").status_code == 404
    assert client.get("/api/v1/downloads/" + "A" * 32 + "/adapter_model.safetensors").status_code == 404

    # Time to live: checked, set, and an expired checkpoint is gone from lists and from the disk
    r = client.put(f"{base}/checkpoints/sampler_weights/s1/ttl", json={"ttl_seconds": 0}, headers=mine)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ttl_seconds"
    assert client.put(f"{base}/checkpoints/sampler_weights/s1/ttl", json={"ttl_seconds": 60}, headers=mine).json() == {}
    assert client.get(f"{base}/checkpoints", headers=mine).json()["checkpoints"][0]["expires_at"] is not None
    directory = get_settings().artifacts_dir / f"tinker/{model_id.replace(':', '.')}/sampler_weights/s1"
    with session_scope() as session:
        session.execute(update(TinkerCheckpoint).where(TinkerCheckpoint.name == "s1").values(expires_at=1))
        session.commit()
        assert [c["checkpoint_id"] for c in client.get(f"{base}/checkpoints", headers=mine).json()["checkpoints"]] == [
            "weights/w1"
        ]
        assert sweep_expired(session, get_settings().artifacts_dir) == 1 and not directory.exists()

    # Delete: the state a model resumes from is refused; any other goes, files and all
    with session_scope() as session:
        resumes_from = f"tinker/{model_id.replace(':', '.')}/weights/w1"
        session.execute(update(TinkerModel).where(TinkerModel.id == model_id).values(state_path=resumes_from))
        session.commit()
    r = client.delete(f"{base}/checkpoints/weights/w1", headers=mine)
    assert r.status_code == 400 and r.json()["error"]["code"] == "checkpoint_in_use", r.text
    with session_scope() as session:
        session.execute(update(TinkerModel).where(TinkerModel.id == model_id).values(state_path=None))
        session.commit()
    assert client.delete(f"{base}/checkpoints/weights/w1", headers=mine).status_code == 200
    assert client.get(f"{base}/checkpoints", headers=mine).json()["checkpoints"] == []
    assert not (directory.parent.parent / "weights" / "w1").exists()
    assert client.get("/v1/usage", headers=bearer).json()["stored_bytes"] == stored

    sessions_list = client.get("/api/v1/sessions", headers=mine).json()["sessions"]
    assert client.get(f"/api/v1/sessions/{sessions_list[0]}", headers=mine).json()["training_run_ids"] == [model_id]
    assert client.get(f"/api/v1/sessions/{sessions_list[0]}", headers=theirs).status_code == 404


def test_a_tinker_model_s_weights_are_models_of_its_project(client: Any) -> None:
    """Sampler and external weights listed by /v1/models under their tinker:// path (a saved state
    is not), retrieved, a new job's starting point (its base the training model's), deleted as a
    model; another project's are unknown on every verb."""
    from tests.helpers.api import upload_ok
    from tests.helpers.data import job_body

    mine, theirs = _headers("alpha"), _headers("beta")
    auth, stranger = (
        {"Authorization": "Bearer " + mine["X-API-Key"]},
        {"Authorization": "Bearer " + theirs["X-API-Key"]},
    )
    model_id = _model(client, mine).json()["model_id"]
    sampler = _checkpoint(model_id, "sampler_weights", "s1", {"adapter_config.json": b"{}"})
    state = _checkpoint(model_id, "weights", "w1", {"adapter_config.json": b"{}"})
    listed = [m["id"] for m in client.get("/v1/models", headers=auth).json()["data"]]
    assert sampler in listed and state not in listed
    assert sampler not in [m["id"] for m in client.get("/v1/models", headers=stranger).json()["data"]]
    got = client.get(f"/v1/models/{sampler}", headers=auth)
    assert got.status_code == 200 and got.json()["owned_by"] != "system", got.text
    assert client.get(f"/v1/models/{sampler}", headers=stranger).status_code == 404
    assert client.get(f"/v1/models/tinker://{model_id}/sampler_weights/none", headers=auth).status_code == 404

    f = upload_ok(client, auth)
    job = client.post("/v1/fine_tuning/jobs", headers=auth, json={**job_body(f["id"]), "model": sampler})
    assert job.status_code == 200, job.text
    assert job.json()["model"] == sampler and job.json()["fine_tuned_model"] is None
    g = upload_ok(client, stranger)
    r = client.post("/v1/fine_tuning/jobs", headers=stranger, json={**job_body(g["id"]), "model": sampler})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text

    # The job's model, once it succeeded, is its checkpoint on the Tinker weights it started from
    from service.core.db import session_scope
    from service.core.tables import Checkpoint, Job
    from service.registry import finetuned

    ft = "ft:tiny-policy:alpha::" + job.json()["id"]
    with session_scope() as session:
        row = session.query(Job).filter(Job.id == job.json()["id"]).one()
        row.status, row.fine_tuned_model = "succeeded", ft
        session.add(
            Checkpoint(
                job_seq=row.seq, step_number=1, path=f"{row.id}/1", fine_tuned_model_checkpoint=ft + ":ckpt-step-1"
            )
        )
        session.commit()
        source = finetuned.find(session=session, project_seq=row.project_seq, name=ft)
        assert source is not None and source.base_model == "tiny-policy"
        assert source.chain == (f"tinker/{model_id.replace(':', '.')}/sampler_weights/s1", f"{row.id}/1")
    r = client.delete(f"/v1/models/{sampler}", headers=auth)  # what the job's model is made of
    assert r.status_code == 400 and r.json()["error"]["code"] == "checkpoint_in_use", r.text

    other = _checkpoint(model_id, "sampler_weights", "s2", {"adapter_config.json": b"{}"})
    assert client.delete(f"/v1/models/{other}", headers=stranger).status_code == 404
    deleted = client.delete(f"/v1/models/{other}", headers=auth)
    assert deleted.json() == {"id": other, "object": "model", "deleted": True}
    assert client.get(f"/v1/models/{other}", headers=auth).status_code == 404


def test_a_run_s_steps_are_served_in_order_a_page_at_a_time_and_a_diverged_loss_as_null(client: Any) -> None:
    from sqlalchemy import select

    from service.core.db import session_scope
    from service.core.tables import TinkerModel, TinkerStep

    mine, theirs = _headers("alpha"), _headers("beta")
    model_id = _model(client, mine).json()["model_id"]
    with session_scope() as session:
        seq = session.scalar(select(TinkerModel.seq).where(TinkerModel.id == model_id))
        for step, loss in ((2, 6.0), (1, 8.0), (3, float("nan"))):
            metrics = {"grad_norm": None if step == 3 else 1.5, "learning_rate": 0.01}
            row = {"step": step, "loss": loss, "counted": 4.0, "datums": 2, "tokens": 9, "metrics": metrics}
            session.add(TinkerStep(model_seq=seq, loss_fn="cross_entropy", **row))
        session.commit()
    url = f"/api/v1/training_runs/{model_id}/steps"
    page = client.get(url, params={"limit": 2}, headers=mine).json()
    assert [s["step"] for s in page["data"]] == [1, 2] and page["has_more"] is True
    assert [s["mean_loss"] for s in page["data"]] == [2.0, 1.5]
    rest = client.get(url, params={"after": 2}, headers=mine).json()
    assert rest["has_more"] is False and rest["data"][0]["loss"] is None and rest["data"][0]["mean_loss"] is None
    assert rest["data"][0]["metrics"]["grad_norm"] is None
    assert client.get(url, headers=theirs).status_code == 404  # another project's run


def test_the_list_of_runs_summarises_each_run_s_loss_in_one_curve_of_at_most_30_points(client: Any) -> None:
    from sqlalchemy import select

    from service.core.db import session_scope
    from service.core.tables import TinkerModel, TinkerStep

    mine = _headers("alpha")
    long_id, back_id, idle_id = (_model(client, mine).json()["model_id"] for _ in range(3))
    with session_scope() as session:
        long, back = (session.scalar(select(TinkerModel).where(TinkerModel.id == i)) for i in (long_id, back_id))
        assert long is not None and back is not None
        long.steps, back.steps = 89, 3  # back: loaded back to step 3, its steps 4-6 not yet rewritten
        for model, last in ((long, 89), (back, 6)):
            for step in range(1, last + 1):
                loss = None if step == 50 else float(step)  # a diverged step adds nothing to its span
                row = {"step": step, "loss": loss, "counted": 2.0, "datums": 1, "tokens": 3, "metrics": {}}
                session.add(TinkerStep(model_seq=model.seq, loss_fn="ppo", **row))
        session.commit()
    runs = {r["training_run_id"]: r for r in client.get("/api/v1/training_runs", headers=mine).json()["training_runs"]}
    summary = runs[long_id]["loss_summary"]
    assert (summary["last_step"], summary["last_mean_loss"], summary["loss_fn"]) == (89, 44.5, "ppo")
    curve = summary["loss_curve"]  # steps 1-89 in 30 spans of 3 (step * 30 // 90): 1-2, 3-5, 6-8, ...
    assert len(curve) == 30
    assert curve[:3] == pytest.approx([1.5 / 2, 4 / 2, 7 / 2])  # each span's loss sum over its count
    assert curve[16] == pytest.approx(97 / 4)  # steps 48-50, 50 diverged: (48 + 49) / (2 + 2)
    assert curve[-1] == pytest.approx(264 / 6)  # steps 87-89
    loaded_back = runs[back_id]["loss_summary"]
    assert loaded_back["last_step"] == 3 and loaded_back["loss_curve"] == pytest.approx([0.5, 1.0, 1.5])
    empty = {"last_step": None, "last_mean_loss": None, "loss_fn": None, "loss_curve": []}
    assert runs[idle_id]["loss_summary"] == empty
    one = client.get(f"/api/v1/training_runs/{long_id}", headers=mine).json()
    assert one["loss_summary"] == summary
