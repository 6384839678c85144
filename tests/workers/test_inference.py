"""Chat and text completions through the unmodified openai SDK (strict), answered by a real inference
worker (``rloo worker --serve``) on the session's Redis: base models, fine-tuned checkpoints (full and
LoRA, served as adapters), greedy output equal to ``from_pretrained`` + ``generate`` token for token,
streaming, ``n`` and ``seed``, and bad requests. (Limits, disconnects and a killed worker need a real
HTTP server: ``test_e2e_inference``.)"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from service.core.db import session_scope
from service.core.tables import Checkpoint, Job
from service.registry import model_ids
from tests.helpers.live import worker_process
from tests.helpers.rows import job_row

PROMPT = "the cat sat on"
# Inference reads the database only to resolve a model id (the same query on either backend).
pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


@pytest.fixture(scope="module")
def serve_worker(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path, embedded_redis: str
) -> Iterator[dict[str, str]]:
    """One real inference worker (its supervisor and its process) for this module, on its own queue."""
    home = tmp_path_factory.mktemp("serve-worker")
    values = {
        "RLOO_HOME": str(home),
        "REDIS_URL": embedded_redis,
        "RLOO_MODELS_DIR": str(models_dir),
        "RLOO_QUEUE": f"test-serve-{secrets.token_hex(4)}",
        "PYTHONUNBUFFERED": "1",
    }
    with worker_process(values, home / "serve.log", "worker", "--serve") as proc:
        _wait_for_a_worker(values, home / "serve.log")
        yield {**values, "pid": str(proc.pid), "log": str(home / "serve.log")}


def _wait_for_a_worker(values: dict[str, str], log: Path, timeout: float = 60) -> None:
    import redis

    from service.core.settings import Settings
    from service.infra import inference_bus

    settings = Settings(home=Path(values["RLOO_HOME"]), REDIS_URL=values["REDIS_URL"])
    conn = redis.Redis.from_url(settings.redis_client_url)
    workers = f"{inference_bus.namespace(values['RLOO_QUEUE'] + '-serve')}:workers"
    deadline = time.monotonic() + timeout
    while not conn.zcount(workers, time.time(), "+inf"):
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    conn.close()


@pytest.fixture
def served(env: dict[str, str], serve_worker: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    from service.core.db import reset_caches

    monkeypatch.setenv("RLOO_QUEUE", serve_worker["RLOO_QUEUE"])
    reset_caches()
    return serve_worker


def _generate(model: Any, tokenizer: Any, text: str, max_new_tokens: int) -> str:
    """``generate``'s greedy text, ending where a served answer ends: at end-of-sequence or at any
    other special token of the tokenizer (docs/inference.md)."""
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    ends = sorted({tokenizer.eos_token_id, *tokenizer.all_special_ids})
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=0,
        eos_token_id=ends,
    )
    return str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def _checkpoint_job(artifacts: Path, models_dir: Path, project: str, *, lora: bool) -> str:
    """A job of ``project`` with one checkpoint: weights moved off the base (full) or a LoRA adapter
    with non-zero weights, saved as training saves them. Its checkpoint id."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = models_dir / "tiny-policy"
    model = AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(5)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5 * torch.randn_like(p))
    with session_scope() as session:
        job = job_row(session, project)
        path = artifacts / "checkpoints" / job.id / "step-1"
        model.save_pretrained(path)
        AutoTokenizer.from_pretrained(base).save_pretrained(path)
        name = model_ids.checkpoint_id(
            model_ids.model_id(base="tiny-policy", project=project, suffix=None, job_id=job.id), 1
        )
        session.add(
            Checkpoint(
                job_seq=job.seq, step_number=1, path=str(path.relative_to(artifacts)), fine_tuned_model_checkpoint=name
            )
        )
        session.commit()
    return name


def _content_url(name: str) -> tuple[str, Checkpoint]:
    """The download URL of checkpoint ``name``, and its row."""
    with session_scope() as session:
        ckpt = session.query(Checkpoint).filter_by(fine_tuned_model_checkpoint=name).one()
        return f"/v1/fine_tuning/jobs/{session.get(Job, ckpt.job_seq).id}/checkpoints/{ckpt.id}/content", ckpt


def _reference(models_dir: Path, artifacts: Path, name: str, job_lora: bool) -> tuple[Any, Any]:
    """``from_pretrained`` of a checkpoint as a user loads the download (an adapter on its base)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with session_scope() as session:
        path = artifacts / session.query(Checkpoint).filter_by(fine_tuned_model_checkpoint=name).one().path
    if job_lora:
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(models_dir / "tiny-policy"), path)
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def test_greedy_output_of_base_and_fine_tuned_checkpoints_is_generate_token_for_token(
    served: dict[str, str], sdk: openai.OpenAI, env: dict[str, str], models_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    artifacts = Path(env["RLOO_HOME"]) / "artifacts"
    full = _checkpoint_job(artifacts, models_dir, "alpha", lora=False)
    adapter = _checkpoint_job(artifacts, models_dir, "alpha", lora=True)
    base = AutoModelForCausalLM.from_pretrained(models_dir / "tiny-policy").eval()
    tok = AutoTokenizer.from_pretrained(models_dir / "tiny-policy")
    cases = {"tiny-policy": (base, tok), full: _reference(models_dir, artifacts, full, False)}
    cases[adapter] = _reference(models_dir, artifacts, adapter, True)
    answers = {}
    for name, (model, tokenizer) in cases.items():
        got = sdk.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0)
        assert got.choices[0].text == _generate(model, tokenizer, PROMPT, 12), name
        assert got.usage is not None and got.usage.prompt_tokens == len(
            tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        )
        answers[name] = got.choices[0].text
        chat = sdk.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "say hi"}], max_completion_tokens=10, temperature=0
        )
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "say hi"}], add_generation_prompt=True, tokenize=False
        )
        assert chat.choices[0].message.content == _generate(model, tokenizer, rendered, 10), name
        assert chat.choices[0].message.role == "assistant" and chat.object == "chat.completion"
    assert len(set(answers.values())) == 3  # three models, three different answers: each is its own


def test_streamed_chunks_join_to_the_whole_answer_and_end_with_usage(
    served: dict[str, str], sdk: openai.OpenAI, client: Any
) -> None:
    whole = sdk.chat.completions.create(
        model="tiny-policy", messages=[{"role": "user", "content": "the cat"}], max_tokens=16, temperature=0, n=2
    )
    stream = sdk.chat.completions.create(
        model="tiny-policy",
        messages=[{"role": "user", "content": "the cat"}],
        max_tokens=16,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {0: "", 1: ""}
    reasons: dict[int, str | None] = {}
    usage = None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if not chunk.choices:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and usage == whole.usage
    # A text completion's chunks carry finish_reason null until the last, as OpenAI's do; the SDK's
    # Completion type allows no null there, so only its non-strict parsing reads OpenAI's streams too.
    lenient = openai.OpenAI(base_url=str(sdk.base_url), api_key=sdk.api_key, http_client=client, max_retries=0)
    text_stream = lenient.completions.create(
        model="tiny-policy", prompt=PROMPT, max_tokens=10, temperature=0, stream=True
    )
    joined = "".join(c.choices[0].text for c in text_stream if c.choices)
    assert (
        joined
        == sdk.completions.create(model="tiny-policy", prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    )


def test_n_choices_are_drawn_apart_and_a_seed_draws_them_again(served: dict[str, str], sdk: openai.OpenAI) -> None:
    def draw(seed: int | None) -> list[str]:
        r = sdk.completions.create(model="tiny-policy", prompt=[PROMPT, "a b"], max_tokens=8, n=3, seed=seed)
        assert [c.index for c in r.choices] == list(range(6))  # prompt-major, as OpenAI orders them
        return [c.text for c in r.choices]

    first = draw(7)
    assert draw(7) == first
    assert len(set(first[:3])) > 1  # three draws of one prompt: not one answer thrice
    assert draw(8) != first


def test_stop_strings_end_the_text_before_them(served: dict[str, str], sdk: openai.OpenAI) -> None:
    free = sdk.completions.create(model="tiny-policy", prompt=PROMPT, max_tokens=20, temperature=0).choices[0]
    assert len(free.text) > 4
    stop = free.text[3:5]
    cut = sdk.completions.create(model="tiny-policy", prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop]).choices[
        0
    ]
    assert cut.text == free.text[: free.text.find(stop)] and cut.finish_reason == "stop"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "no-such-model"}, 404, "model"),
        ({"n": 17}, 400, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"stop": [""]}, 400, "stop"),
        ({"max_tokens": 10**6}, 400, "max_tokens"),
        ({"temperature": 3}, 400, "temperature"),
        ({"presence_penalty": 1.0}, 400, None),
        ({"messages": [{"role": "user", "content": "word " * 400}]}, 400, "messages"),
        ({"max_tokens": 250, "messages": [{"role": "user", "content": "word " * 20}]}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, None),
        ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"frobnicate": 1}, 400, "frobnicate"),
    ],
)
def test_bad_requests_are_answered_in_openais_shape_naming_the_field(
    served: dict[str, str], client: Any, auth: dict[str, str], body: dict[str, Any], status: int, param: str | None
) -> None:
    request = {"model": "tiny-policy", "messages": [{"role": "user", "content": "hi"}], **body}
    r = client.post("/v1/chat/completions", json=request, headers=auth)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_another_projects_checkpoint_is_not_found(
    served: dict[str, str], client: Any, auth: dict[str, str], env: dict[str, str], models_dir: Path
) -> None:
    theirs = _checkpoint_job(Path(env["RLOO_HOME"]) / "artifacts", models_dir, "beta", lora=True)
    r = client.post("/v1/completions", json={"model": theirs, "prompt": "hi"}, headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_no_inference_worker_is_a_503_that_says_how_to_start_one(
    env: dict[str, str], client: Any, auth: dict[str, str]
) -> None:
    r = client.post("/v1/completions", json={"model": "tiny-policy", "prompt": "hi"}, headers=auth)
    assert r.status_code == 503 and "rloo worker --serve" in r.json()["error"]["message"]


def test_a_lora_checkpoint_downloads_merged_as_one_model_that_from_pretrained_loads(
    served: dict[str, str], client: Any, auth: dict[str, str], env: dict[str, str], models_dir: Path, tmp_path: Path
) -> None:
    import io
    import tarfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    artifacts = Path(env["RLOO_HOME"]) / "artifacts"
    name = _checkpoint_job(artifacts, models_dir, "alpha", lora=True)
    url, _ = _content_url(name)
    adapter = client.get(url, headers=auth)
    t0 = time.monotonic()
    first = client.get(url, params={"merged": "true"}, headers=auth)  # answered at once: no thread waits
    assert time.monotonic() - t0 < 2 and first.status_code == 503, first.text
    assert first.json()["error"]["code"] == "export_in_progress" and first.headers["Retry-After"]
    merged = _merged_when_ready(client, url, auth)
    assert adapter.status_code == merged.status_code == 200, merged.text

    def unpack(body: bytes, where: Path) -> tuple[Path, set[str]]:
        with tarfile.open(fileobj=io.BytesIO(body)) as tar:
            tar.extractall(where, filter="data")
        root = next(where.iterdir())
        return root, {p.name for p in root.iterdir()}

    _, adapter_files = unpack(adapter.content, tmp_path / "adapter")
    root, merged_files = unpack(merged.content, tmp_path / "merged")
    assert "adapter_config.json" in adapter_files and "adapter_config.json" not in merged_files
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= merged_files
    model = AutoModelForCausalLM.from_pretrained(root).eval()  # as vllm serve loads it: no base named
    reference, tokenizer = _reference(models_dir, artifacts, name, True)
    assert _generate(model, AutoTokenizer.from_pretrained(root), PROMPT, 12) == _generate(
        reference, tokenizer, PROMPT, 12
    )
    # Made once: the second download reads the same directory.
    assert client.get(url, params={"merged": "true"}, headers=auth).content == merged.content
    # A full checkpoint is its own merged model.
    full = _checkpoint_job(artifacts, models_dir, "alpha", lora=False)
    with session_scope() as session:
        ckpt = session.query(Checkpoint).filter_by(fine_tuned_model_checkpoint=full).one()
        url = f"/v1/fine_tuning/jobs/{session.get(Job, ckpt.job_seq).id}/checkpoints/{ckpt.id}/content"
    assert client.get(url, params={"merged": "true"}, headers=auth).content == client.get(url, headers=auth).content


def test_an_export_s_bytes_count_in_its_project_s_stored_bytes_until_its_model_is_deleted(
    client: Any, auth: dict[str, str], env: dict[str, str], models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The merge the API asks for names its checkpoint; the worker that made it records its bytes
    there (in process here: this module's worker keeps a database of its own); deleting the model
    removes the export and its bytes."""
    from service.core.settings import get_settings
    from service.registry import exports
    from worker.serving.between_batches import exported

    artifacts = Path(env["RLOO_HOME"]) / "artifacts"
    name = _checkpoint_job(artifacts, models_dir, "alpha", lora=True)
    asked: list[dict[str, Any]] = []

    def ask_once(settings: Any, key: str, envelope: dict[str, Any], project: str, *, room: Any) -> None:
        room()  # (checked before a new ask only)
        asked.append(envelope)

    monkeypatch.setattr(exports, "_ask_once", ask_once)
    stored = client.get("/v1/usage", headers=auth).json()["stored_bytes"]
    with session_scope() as session:
        ckpt = session.query(Checkpoint).filter_by(fine_tuned_model_checkpoint=name).one()
        job = session.get(Job, ckpt.job_seq)
        seq = job.project_seq
        with pytest.raises(AssertionError, match="unreachable"):  # (the real one raises export_in_progress)
            exports.merged(session, get_settings(), project_seq=seq, project_id="alpha", checkpoint=ckpt)
    assert asked[0]["checkpoint"] == ckpt.id
    assert exported(asked[0]) == {"t": "done", "usage": None}
    made = sum(f.stat().st_size for f in (artifacts / "exports").rglob("*") if f.is_file())
    assert made > 0 and client.get("/v1/usage", headers=auth).json()["stored_bytes"] == stored + made
    # A project at its quota of stored bytes gets no new merged copy (the one made is still served).
    from service.core.errors import Forbidden
    from tests.helpers.api import make_key

    operator = {"Authorization": f"Bearer {make_key('ops', operator=True)}"}
    quota = {"quotas": {"stored_bytes": stored + made}}
    assert client.post("/v1/projects/alpha", headers=operator, json=quota).status_code == 200
    another = _checkpoint_job(artifacts, models_dir, "alpha", lora=True)
    with session_scope() as session:
        assert exports.merged(session, get_settings(), project_seq=seq, project_id="alpha", checkpoint=ckpt)
        second = session.query(Checkpoint).filter_by(fine_tuned_model_checkpoint=another).one()
        with pytest.raises(Forbidden, match="stored_bytes"):
            exports.merged(session, get_settings(), project_seq=seq, project_id="alpha", checkpoint=second)
    assert len(asked) == 1
    quota = {"quotas": {"stored_bytes": None}}
    assert client.post("/v1/projects/alpha", headers=operator, json=quota).status_code == 200
    with session_scope() as session:
        job = session.get(Job, ckpt.job_seq)
        model = model_ids.model_id(base="tiny-policy", project="alpha", suffix=None, job_id=job.id)
        job.fine_tuned_model = model
        session.commit()
    assert client.delete(f"/v1/models/{model}", headers=auth).status_code == 200
    assert client.get("/v1/usage", headers=auth).json()["stored_bytes"] == stored
    assert not list((artifacts / "exports").rglob("*.safetensors"))


def _merged_when_ready(client: Any, url: str, auth: dict[str, str], timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        r = client.get(url, params={"merged": "true"}, headers=auth)
        if r.status_code != 503 or r.json()["error"]["code"] != "export_in_progress":
            return r
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)


def test_a_request_no_key_could_ever_have_in_flight_is_a_400_not_a_429_for_ever(
    served: dict[str, str], client: Any, auth: dict[str, str]
) -> None:
    body = {"model": "tiny-policy", "prompt": ["a", "b"], "n": 12, "max_tokens": 4096}  # 98,304 tokens
    r = client.post("/v1/completions", json=body, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "RLOO_INFERENCE_MAX_TOKENS_IN_FLIGHT" in r.json()["error"]["message"]


# Bounded and fair ------------------------------------------------------------------------------------
def test_a_prompt_longer_than_any_context_is_a_400_before_any_worker_tokenizes_it(
    env: dict[str, str], client: Any, auth: dict[str, str]
) -> None:
    """One 7.9 MB message held a worker 45 s tokenizing before its 400; the API now refuses a prompt
    of more bytes than the model's context can hold (tiny-policy: 256 tokens), no worker asked."""
    for url, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 9000}]}),
        ("/v1/completions", {"prompt": ["hi", "y" * 9000]}),
    ]:
        r = client.post(url, json={"model": "tiny-policy", **body}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert r.json()["error"]["param"] in ("messages", "prompt") and "256 tokens" in r.json()["error"]["message"]


def test_a_request_larger_than_a_batch_is_a_400_and_its_prompts_count_in_the_budget(
    env: dict[str, str], client: Any, auth: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 prompts x n 16 x max_tokens 1 counted as 1,024 tokens and ran as one 1,024-row batch of
    243k prompt tokens. Now more completions than a batch holds is a 400, and the prompts count."""
    from service.core.db import reset_caches

    r = client.post("/v1/completions", json={"model": "tiny-policy", "prompt": ["p"] * 64, "n": 16}, headers=auth)
    assert r.status_code == 400 and "RLOO_INFERENCE_MAX_BATCH" in r.json()["error"]["message"], r.text
    monkeypatch.setenv("RLOO_INFERENCE_MAX_TOKENS_IN_FLIGHT", "1000")
    reset_caches()
    body = {"model": "tiny-policy", "prompt": ["z" * 600] * 8, "n": 3, "max_tokens": 1}  # 24 writes, ~3,800 read
    r = client.post("/v1/completions", json=body, headers=auth)
    assert r.status_code == 400 and "RLOO_INFERENCE_MAX_TOKENS_IN_FLIGHT" in r.json()["error"]["message"], r.text
    r = client.post("/v1/completions", json={**body, "prompt": ["z" * 60] * 8}, headers=auth)
    assert r.status_code == 503, r.text  # within the budget: admitted, and no worker is up here


def test_requests_are_taken_in_turn_between_projects_and_their_keys(env: dict[str, str]) -> None:
    """One FIFO let a project's queue of requests hold another's one behind them all."""
    import redis

    from service.core.settings import get_settings
    from service.infra import inference_bus

    conn = redis.Redis.from_url(get_settings().redis_client_url)
    ns = inference_bus.namespace(f"fair-{secrets.token_hex(4)}")
    deadline = time.time() + 60
    for i in range(4):
        inference_bus.submit_sync(conn, ns, {"id": f"a1-{i}", "project": "a", "key": "a1", "deadline": deadline})
    for i in range(2):
        inference_bus.submit_sync(conn, ns, {"id": f"a2-{i}", "project": "a", "key": "a2", "deadline": deadline})
    inference_bus.submit_sync(conn, ns, {"id": "b1-0", "project": "b", "key": "b1", "deadline": deadline})
    inference_bus.submit_sync(conn, ns, {"id": "system-0", "deadline": deadline})  # no project: a lane of its own
    order = [e["id"] for e in inference_bus.take(conn, ns, "w", block=0, most=3)]
    order += [e["id"] for _ in range(10) for e in inference_bus.take(conn, ns, "w", block=0.05, most=1)]
    # New lanes tie (never served) and go in name order; then each project, and each key, in turn.
    assert order == ["system-0", "a1-0", "b1-0", "a2-0", "a1-1", "a2-1", "a1-2", "a1-3"], order
    assert conn.llen(f"{ns}:ready") == 0 and not conn.exists(f"{ns}:projects")  # nothing left behind
    # A project that comes back keeps the place its last turn gave it: before one served a moment ago.
    for i in range(4, 8):
        inference_bus.submit_sync(conn, ns, {"id": f"a1-{i}", "project": "a", "key": "a1", "deadline": deadline})
    assert [e["id"] for e in inference_bus.take(conn, ns, "w", block=0, most=1)] == ["a1-4"]
    inference_bus.submit_sync(conn, ns, {"id": "b1-1", "project": "b", "key": "b1", "deadline": deadline})
    order = [e["id"] for _ in range(4) for e in inference_bus.take(conn, ns, "w", block=0, most=1)]
    assert order == ["b1-1", "a1-5", "a1-6", "a1-7"], order
    t0 = time.monotonic()
    assert inference_bus.take(conn, ns, "w", block=0.3, most=4) == [] and time.monotonic() - t0 >= 0.25
    conn.close()


def test_a_worker_refuses_a_prompt_past_any_context_without_tokenizing_it(
    served: dict[str, str], models_dir: Path
) -> None:
    """A request that reaches a worker past the API's check (another API version, a direct push)."""
    import json

    import redis

    from service.core.settings import get_settings
    from service.infra import inference_bus

    conn = redis.Redis.from_url(get_settings().redis_client_url)
    ns = inference_bus.namespace(inference_bus.serve_queue())
    envelope = {
        "id": f"big-{secrets.token_hex(4)}",
        "kind": "chat",
        "messages": [{"role": "user", "content": "word " * 400_000}],  # 2 MB
        "servable": {"base": str(models_dir / "tiny-policy"), "chain": []},
        "deadline": time.time() + 60,
        "n": 1,
        "max_tokens": 4,
    }
    inference_bus.submit_sync(conn, ns, envelope)
    deadline = time.monotonic() + 60
    got = None
    while got is None and time.monotonic() < deadline:
        got = conn.blpop([f"{ns}:reply:{envelope['id']}"], timeout=1)
    assert got is not None, Path(served["log"]).read_text()[-3000:]
    message = json.loads(got[1])
    assert message["code"] == "context_length_exceeded" and "bytes" in message["message"], message
    conn.close()


def test_a_failed_merge_is_the_next_downloads_answer_without_paths_and_may_be_asked_again(
    served: dict[str, str], client: Any, auth: dict[str, str], env: dict[str, str], models_dir: Path
) -> None:
    artifacts = Path(env["RLOO_HOME"]) / "artifacts"
    url, ckpt = _content_url(_checkpoint_job(artifacts, models_dir, "alpha", lora=True))
    (artifacts / ckpt.path / "adapter_model.safetensors").write_bytes(b"not safetensors at all")
    failed = _merged_when_ready(client, url, auth)
    assert failed.status_code == 500 and failed.json()["error"]["code"] in ("export_failed", "model_load_failed")
    assert str(artifacts) not in failed.text and str(models_dir) not in failed.text, failed.text
    again = client.get(url, params={"merged": "true"}, headers=auth)  # asked anew, not the old answer for ever
    assert again.status_code == 503 and again.json()["error"]["code"] == "export_in_progress", again.text


def test_a_project_asks_for_two_merges_at_once_and_one_never_taken_is_asked_again(
    env: dict[str, str], client: Any, auth: dict[str, str], models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No real worker: one registered that never takes anything. A third merge asked while two are
    under way is a 429; an ask no worker took by its deadline is let go and asked anew."""
    import json

    import redis

    from service.core.db import reset_caches
    from service.core.settings import get_settings
    from service.infra import inference_bus

    monkeypatch.setenv("RLOO_INFERENCE_TIMEOUT_SECONDS", "1")
    reset_caches()
    conn = redis.Redis.from_url(get_settings().redis_client_url)
    ns = inference_bus.namespace(inference_bus.serve_queue())
    conn.zadd(f"{ns}:workers", {"never-takes": time.time() + 600})
    artifacts = Path(env["RLOO_HOME"]) / "artifacts"
    urls = []
    for _ in range(3):
        urls.append(_content_url(_checkpoint_job(artifacts, models_dir, "alpha", lora=True))[0])
    codes = [client.get(url, params={"merged": "true"}, headers=auth).json()["error"]["code"] for url in urls]
    assert codes == ["export_in_progress", "export_in_progress", "rate_limit_exceeded"], codes
    marker = next(iter(conn.scan_iter(f"{ns}:export:*")))
    first = json.loads(conn.get(marker))["id"]
    time.sleep(1.2)  # past the deadline, never taken
    for url in urls[:2]:
        r = client.get(url, params={"merged": "true"}, headers=auth)
        assert r.json()["error"]["code"] == "export_in_progress", r.text
    assert json.loads(conn.get(marker))["id"] != first  # asked anew
    conn.zrem(f"{ns}:workers", "never-takes")
    conn.close()


def test_a_project_holds_three_quarters_of_a_batch_and_another_joins_at_the_next_token(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three requests of one project filled the batch (32 rows), and another project's 4-token chat
    waited for all of them to end. A project's requests hold at most 24 rows of it: the third waits
    for the next batch, the other project's chat decodes in this one, and one that arrives later
    joins past the first project's next request."""
    from worker.serving.inference_worker import Request, Server
    from worker.serving.model_cache import Servable

    server = Server(None, worker="w", cache=None, max_rows=32)
    base = Servable(Path("/models/tiny"))

    def request(rid: str, project: str, rows: int) -> Request:
        return Request({"id": rid, "project": project, "prompts": ["p"] * rows, "n": 1}, base)

    decoded: list[list[str]] = []
    monkeypatch.setattr(server, "_prepare", lambda r: object())
    monkeypatch.setattr(server, "_decode", lambda loaded, batch: decoded.append([r.id for r in batch]))
    server.pending = [request("a0", "a", 12), request("a1", "a", 12), request("a2", "a", 8), request("b", "b", 1)]
    server.serve_one_batch()
    assert decoded == [["a0", "a1", "b"]] and [r.id for r in server.pending] == ["a2"], decoded
    # While a's 24 rows and b's 1 decode: a's next does not fit its share, b's next passes it.
    server.active_rows, server.project_rows = 25, {"a": 24, "b": 1}
    server.pending = [request("a3", "a", 4), request("b2", "b", 4), request("c", "c", 8)]
    assert [r.id for r in server._joiners(base.base_key, type("L", (), {"adapters": {}})())] == ["b2"]
    # c (no rows decoding) does not fit the 3 rows left: it keeps its place, none after it passes.
    assert [r.id for r in server.pending] == ["a3", "c"]


def test_a_conversation_with_tool_calls_and_results_renders_as_the_template_writes_it(
    served: dict[str, str], sdk: openai.OpenAI, models_dir: Path
) -> None:
    """OpenAI's tool-call format in a chat request (tools offered, an assistant's ``tool_calls``, a
    ``tool`` message) reaches the model as its template writes that conversation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'},
    }
    messages: list[Any] = [
        {"role": "user", "content": "6*7="},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    chat = sdk.chat.completions.create(
        model="tiny-policy", messages=messages, tools=tools, max_completion_tokens=8, temperature=0
    )
    model = AutoModelForCausalLM.from_pretrained(models_dir / "tiny-policy").eval()
    tok = AutoTokenizer.from_pretrained(models_dir / "tiny-policy")
    template = [{**m, "content": m["content"] or ""} for m in messages]
    rendered = tok.apply_chat_template(template, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "<tool_call>" in rendered and "<tool_response>42</tool_response>" in rendered
    assert chat.choices[0].message.content == _generate(model, tok, rendered, 8)
    assert chat.choices[0].message.tool_calls is None  # the tiny policy answers text
