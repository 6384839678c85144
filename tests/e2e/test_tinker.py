"""The Tinker protocol driven by the unmodified ``tinker`` SDK against a live stack (the API, the
embedded Redis, a training worker as processes), on the tiny policy: a LoRA training model learns a
fixed batch (cross-entropy falls), its first answer's log-probs are the base model's own (LoRA
starts at B = 0), a state saved and loaded into a new training model continues where it was,
``forward`` and ``forward_backward_custom`` agree with the built-in loss, and another project's key
finds nothing of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.live import LiveStack, live_stack

pytestmark = pytest.mark.e2e

tinker = pytest.importorskip("tinker")


def _key(stack: LiveStack, project: str) -> str:
    return stack.cli("keys", "create", "--project", project, "--tinker").stdout.strip().splitlines()[-1]


def _batch(models_dir: Path) -> tuple[list[Any], list[list[int]]]:
    """Two short sequences of the tiny tokenizer, as next-token datums (weights 1 on every target)."""
    from tinker import types
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models_dir / "tiny-policy")
    texts = ["the red apple is sweet", "a blue sky over the green hill"]
    data, sequences = [], []
    for text in texts:
        ids = tokenizer.encode(text)
        sequences.append(ids)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
            )
        )
    return data, sequences


def _base_logprobs(models_dir: Path, ids: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models_dir / "tiny-policy", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:-1]])).logits.float()
    picked = torch.log_softmax(logits, -1)[0].gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    return picked.tolist()


@pytest.mark.parametrize("kind", ["embedded", "production"])
def test_the_sdk_trains_saves_and_loads_a_lora_model(kind: str, tmp_path: Path, models_dir: Path) -> None:
    from tinker import types

    with live_stack(kind, tmp_path, models_dir) as stack:
        key = _key(stack, "e2e")
        service = tinker.ServiceClient(base_url=stack.url, api_key=key)
        training = service.create_lora_training_client(base_model="tiny-policy", rank=8, seed=0).result()
        info = training.get_info()
        assert info.model_data.model_name == "tiny-policy" and info.lora_rank == 8
        data, sequences = _batch(models_dir)

        losses = []
        for step in range(8):
            out = training.forward_backward(data, "cross_entropy").result()
            if step == 0:  # LoRA's B starts at zero: the base model's own log-probs
                got = out.loss_fn_outputs[0]["logprobs"].tolist()
                assert got == pytest.approx(_base_logprobs(models_dir, sequences[0]), abs=1e-5)
            losses.append(out.metrics["loss:sum"])
            training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        assert losses[-1] < 0.7 * losses[0], losses
        _each_step_is_recorded_and_drawn(stack, key, training.model_id, losses, data, browser=kind == "embedded")

        saved = training.save_state("after-8").result().path
        assert saved == f"tinker://{training.model_id}/weights/after-8"
        again = service.create_training_client_from_state_with_optimizer(saved).result()
        resumed = again.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
        current = training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
        assert resumed == pytest.approx(current, rel=1e-5)  # the same weights: the same loss

        # forward (no gradient) and forward_backward_custom (the SDK's forward, then a linear
        # cross_entropy with the custom loss's gradient as weights): the same loss, as the SDK sums it
        plain = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
        custom = training.forward_backward_custom(data, lambda _, lps: (-sum(lp.sum() for lp in lps), {})).result()
        assert custom.metrics["loss:sum"] == pytest.approx(plain, rel=1e-5)
        assert custom.metrics["surrogate_loss:sum"] == pytest.approx(plain, rel=1e-5)

        other = _key(stack, "other")
        stranger = tinker.ServiceClient(base_url=stack.url, api_key=other)
        with pytest.raises(Exception, match="404|not found|No checkpoint|No training model"):
            stranger.create_training_client_from_state(saved).result()
        listed = stack.cli("tinker", "runs", "--base-url", f"{stack.url}/v1", "--api-key", key).stdout
        assert training.model_id in listed and saved in listed, listed  # rloo tinker runs: its newest state
        args = ("--base-url", f"{stack.url}/v1", "--api-key", stack.key)  # an ordinary key of the same project
        listed = stack.cli("tinker", "checkpoints", training.model_id, *args).stdout
        assert saved in listed and "training" in listed, listed
        rest = tinker.RestClient(base_url=stack.url, api_key=key)
        _the_rest_client_finds_downloads_and_deletes(
            rest, tinker.RestClient(base_url=stack.url, api_key=other), training, saved, tmp_path
        )


def _each_step_is_recorded_and_drawn(
    stack: LiveStack, key: str, model_id: str, losses: list[float], data: list[Any], *, browser: bool
) -> None:
    """Each optim_step's row (GET /api/v1/training_runs/{id}/steps): the loss:sum its forward_backward
    answered, its mean over the weights (the mean NLL a token), AdamW's metrics; and the dashboard's
    run page draws those means, one point a step, with no console error."""
    import httpx

    from tests.helpers.browser import CHROMIUM, open_page

    api = httpx.Client(base_url=f"{stack.url}/api/v1", headers={"X-API-Key": key}, timeout=30)
    steps = api.get(f"/training_runs/{model_id}/steps").json()["data"]
    counted = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in data)
    assert [s["step"] for s in steps] == list(range(1, 9))
    assert [s["loss"] for s in steps] == pytest.approx(losses, rel=1e-6)
    assert [s["mean_loss"] for s in steps] == pytest.approx([x / counted for x in losses], rel=1e-6)
    assert all(s["loss_fn"] == "cross_entropy" and s["metrics"]["learning_rate"] == 0.02 for s in steps)
    assert all(s["metrics"]["grad_norm"] > 0 and s["datums"] == len(data) for s in steps)
    assert api.get(f"/training_runs/{model_id}/steps", params={"after": 6}).json()["data"][0]["step"] == 7
    # Metered with each step: the device time its requests took, on the worker's kind, and the tokens trained.
    used = httpx.get(f"{stack.url}/v1/usage?group_by=subject,accelerator", headers={"Authorization": f"Bearer {key}"})
    mine = {(u["kind"], u["accelerator"]): u["amount"] for u in used.json()["data"] if u["subject"] == model_id}
    assert mine[("device_seconds", "cpu")] > 0, mine
    assert mine[("tokens_trained", "")] == 8 * sum(len(d.model_input.to_ints()) for d in data), mine
    if not browser or CHROMIUM is None:
        return
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        page, problems = open_page(pw)
        page.goto(stack.url + "/dashboard/#/tinker")
        page.fill("#key", key)  # a --tinker key is a key of its project like any other
        page.click("#login button[type=submit]")
        cells = page.locator("#tinker-runs tr", has=page.locator(f"a >> text={model_id}")).locator("td")
        cells.first.wait_for()
        assert cells.nth(3).inner_text() == "8"  # the list's last step and loss, from its loss_summary
        assert cells.nth(4).inner_text() == f"{steps[-1]['mean_loss']:.3f} (cross_entropy)"
        page.click(f"#tinker-runs a >> text={model_id}")
        page.wait_for_selector("canvas[data-metric=mean_loss][data-points='8']")
        drawn = page.eval_on_selector("canvas[data-metric=mean_loss]", "c => c.points")
        assert [x for x, _ in drawn] == [s["step"] for s in steps]
        assert [y for _, y in drawn] == pytest.approx([s["mean_loss"] for s in steps])
        assert page.get_attribute("canvas[data-metric=grad_norm]", "data-points") == "8"
        page.context.browser.close()
        assert problems == [], problems


def _the_rest_client_finds_downloads_and_deletes(
    rest: Any, stranger: Any, training: Any, saved: str, tmp_path: Path
) -> None:
    """RestClient: the run and its checkpoint listed and described; the weights exported as one
    Hugging Face directory (LoRA merged) and downloaded by its links (no key) compute what the
    training model computes; a checkpoint deleted; nothing of it for another project."""
    import urllib.request

    import torch
    from tinker import types
    from transformers import AutoModelForCausalLM

    model_id = training.model_id
    run = rest.get_training_run(model_id).result()
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == saved and run.lora_rank == 8
    assert model_id in [r.training_run_id for r in rest.list_training_runs().result().training_runs]
    assert saved in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    assert rest.get_weights_info_by_tinker_path(saved).result().base_model == "tiny-policy"

    exported = training.save_weights_external("merged").result().path
    links = rest.get_external_weights_urls(exported).result().urls
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(links) and not any(
        "adapter" in n for n in links
    )
    for name, url in links.items():  # the stack's own loopback URLs
        (tmp_path / "download" / name).parent.mkdir(parents=True, exist_ok=True)
        urllib.request.urlretrieve(url, tmp_path / "download" / name)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "download", dtype=torch.float32).eval()
    ids = [5, 6, 7, 8, 9]
    with torch.no_grad():
        logits = merged(input_ids=torch.tensor([ids[:-1]])).logits
    mine = torch.log_softmax(logits, -1)[0].gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * 4},
    )
    served = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert mine.tolist() == pytest.approx(served, abs=1e-4)

    assert stranger.list_training_runs().result().training_runs == []
    with pytest.raises(Exception, match="404|not found|No training model"):
        stranger.delete_checkpoint_from_tinker_path(saved).result()
    with pytest.raises(tinker.BadRequestError, match="resumes from"):  # the newest state: where it comes back from
        rest.delete_checkpoint_from_tinker_path(saved).result()
    training.save_state("newer").result()
    rest.delete_checkpoint_from_tinker_path(saved).result()
    assert saved not in [c.tinker_path for c in rest.list_checkpoints(model_id).result().checkpoints]


def test_the_sdk_samples_a_base_model_and_its_trained_weights(tmp_path: Path, models_dir: Path) -> None:
    """SamplingClient on the inference workers: tokens with their log-probs (the base model's own, as
    a forward of prompt + sample computes them), the same seed the same tokens, and a training
    model's sampler weights served as the training model computes (its forward's log-probs of
    what was sampled), not as the base does."""
    from tinker import types

    with live_stack("embedded", tmp_path, models_dir) as stack:
        stack.start("serve", "worker", "--serve")
        key = _key(stack, "e2e")
        service = tinker.ServiceClient(base_url=stack.url, api_key=key)
        data, sequences = _batch(models_dir)
        prompt = types.ModelInput.from_ints(sequences[0][:2])
        base = service.create_sampling_client(base_model="tiny-policy").result()
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7, stop=[])
        first = base.sample(prompt, num_samples=2, sampling_params=params).result()
        again = base.sample(prompt, num_samples=2, sampling_params=params).result()
        assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
        one = first.sequences[0]
        assert len(one.tokens) == 6 and one.stop_reason == "length"
        whole = sequences[0][:2] + list(one.tokens)
        assert one.logprobs == pytest.approx(_base_logprobs(models_dir, whole)[1:], abs=1e-4)
        scored = base.compute_logprobs(types.ModelInput.from_ints(sequences[1])).result()
        assert scored[0] is None and scored[1:] == pytest.approx(_base_logprobs(models_dir, sequences[1]), abs=1e-4)

        training = service.create_lora_training_client(base_model="tiny-policy", rank=8, seed=0).result()
        for _ in range(6):
            training.forward_backward(data, "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        trained = training.save_weights_and_get_sampling_client().result()
        greedy = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
        out = trained.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
        whole = sequences[0][:2] + list(out.tokens)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(whole[:-1]),
            loss_fn_inputs={"target_tokens": whole[1:], "weights": [1.0] * (len(whole) - 1)},
        )
        held = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        assert out.logprobs == pytest.approx(held[1:], abs=1e-4)  # the trained weights are what is served
        assert out.logprobs != pytest.approx(_base_logprobs(models_dir, whole)[1:], abs=1e-3)
        _sampler_weights_answer_completions(stack, training, models_dir)
        _abandoned_samples_are_cancelled(stack, key, base, sequences[0][:2], tmp_path)


def _abandoned_samples_are_cancelled(stack: LiveStack, key: str, base: Any, prompt: list[int], tmp_path: Path) -> None:
    """cancel_future: a sample cancelled before it is answered fails as the user's (and the inference
    worker drops its rows); the SDK sends it on its own when a sampling future is abandoned, as the
    server's dynamic config enables. The inference worker is held still (SIGSTOP) meanwhile, so that
    no sample is answered before its cancel comes (a loaded machine's SDK thread sent it late)."""
    import os
    import signal

    worker = stack.procs["serve"].pid
    os.killpg(worker, signal.SIGSTOP)
    try:
        _cancelled_before_answered(stack, key, base, prompt, tmp_path)
    finally:
        os.killpg(worker, signal.SIGCONT)


def _cancelled_before_answered(stack: LiveStack, key: str, base: Any, prompt: list[int], tmp_path: Path) -> None:
    import time

    import httpx
    import redis
    from tinker import types

    from service.core.settings import Settings

    api = httpx.Client(base_url=f"{stack.url}/api/v1", headers={"X-API-Key": key}, timeout=60)
    long = {"max_tokens": 200, "stop": [], "temperature": 1.0}
    body = {
        "base_model": "tiny-policy",
        "num_samples": 16,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
    }
    r = api.post("/asample", json={**body, "sampling_params": long})
    assert r.status_code == 200, r.text
    rid = r.json()["request_id"]
    assert api.post("/cancel_future", json={"request_id": rid}).status_code == 200
    answer = api.post("/retrieve_future", json={"request_id": rid}).json()
    assert answer == {"error": "The client cancelled this sample.", "category": "user"}

    conn = redis.Redis.from_url(stack.env.get("REDIS_URL") or Settings(home=tmp_path / "var").redis_client_url)

    def futures(field: str, value: bytes) -> int:
        return sum(value in (conn.hget(k, field) or b"") for k in conn.scan_iter("rloo:tinker:*:future:*"))

    def wait(what: str, until: Any) -> None:
        deadline = time.monotonic() + 30
        while not until():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    future = base.sample(types.ModelInput.from_ints(prompt), 16, types.SamplingParams(**long))
    wait("the SDK never sent the sample", lambda: futures("status", b"pending") > 0)  # sent, not answered
    future.future().cancel()  # the SDK's polling task is cancelled: it sends cancel_future itself
    wait("the SDK sent no cancel_future for an abandoned sample", lambda: futures("body", b"cancelled this") == 2)


def _sampler_weights_answer_completions(stack: LiveStack, training: Any, models_dir: Path) -> None:
    """Sampler weights are a model of the project: listed, and /v1/completions (the openai SDK)
    writes with them what the SamplingClient samples greedily from the same prompt."""
    import openai
    from tinker import types
    from transformers import AutoTokenizer

    path = training.save_weights_for_sampler("final").result().path
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.key, max_retries=0)
    assert path in [m.id for m in client.models.list().data]
    tokenizer = AutoTokenizer.from_pretrained(models_dir / "tiny-policy")
    text = "the red apple"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    sampler = training.create_sampling_client(path).result()
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    sampled = sampler.sample(types.ModelInput.from_ints(ids), 1, greedy).result().sequences[0].tokens
    written = client.completions.create(model=path, prompt=text, max_tokens=8, temperature=0).choices[0].text
    assert written.strip() and written == tokenizer.decode(sampled, skip_special_tokens=True)


def test_a_worker_killed_mid_session_brings_the_model_back_from_its_saved_state(
    tmp_path: Path, models_dir: Path
) -> None:
    """SIGKILL the worker holding a training model two steps after its last save_state: the request
    sent meanwhile fails with the SDK's retryable error (410), the model comes back on another
    worker from that saved state (the same loss as then, not the two lost steps'), and trains on;
    that worker, told to stop, saves the model and stops at once."""
    import signal

    from tinker import types

    with live_stack("embedded", tmp_path, models_dir, env={"RLOO_TINKER_LEASE_SECONDS": "3"}) as stack:
        key = _key(stack, "e2e")
        service = tinker.ServiceClient(base_url=stack.url, api_key=key)
        training = service.create_lora_training_client(base_model="tiny-policy", rank=8, seed=0).result()
        data, _ = _batch(models_dir)
        adam = types.AdamParams(learning_rate=2e-2)

        def loss() -> float:
            return float(training.forward(data, "cross_entropy").result().metrics["loss:sum"])

        def step() -> None:
            training.forward_backward(data, "cross_entropy").result()
            training.optim_step(adam).result()

        step(), step()
        training.save_state("two").result()
        saved = loss()
        step(), step()
        assert loss() < saved  # two steps the worker will take with it

        stack.stop("worker", signal.SIGKILL)
        stack.start("worker-2", "worker", "--loglevel", "INFO")
        from tinker.lib.retryable_exception import RetryableException

        with pytest.raises(RetryableException, match="Promise expired/broken"):  # how the SDK says 410
            loss()  # sent before anyone could know: it was meant for the lost state
        assert loss() == pytest.approx(saved, rel=1e-5)
        step()
        assert loss() < saved

        # SIGTERM to the worker's main process alone (docker stop): the holder saves and lets go now,
        # not once its model idles (RLOO_TINKER_IDLE_SECONDS, 120 s here)
        worker = stack.procs.pop("worker-2")
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=45)
        last = tinker.RestClient(base_url=stack.url, api_key=key).get_training_run(training.model_id).result()
        assert last.last_checkpoint is not None and last.last_checkpoint.tinker_path.endswith("/weights/resume")
