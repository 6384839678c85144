"""Remote reward models (``"remote": true``): a batch scored by an inference worker's process (its
``Server`` loop, here in a thread, on the session's real Redis), which answers what the same reward
model scores beside the policy; what happens with no worker, a model it cannot load, and a
dedicated queue (``RLOO_REWARD_MODEL_QUEUE``)."""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from service.graders import GraderError, GraderUnavailable, Sample, parse_grader
from worker.engine.rewards.scoring import RewardModels, SampledTokens, tokenizer_fingerprint

RM = {"type": "reward_model", "name": "rm", "model": "tiny-reward"}
QUESTIONS = ["What is 2 plus 2?", "Sky?", "Name a colour that the sea is."]
TEXTS = [" four", " 4", "", " blue", " grey!", " It is", " teal", " x", " green"]


@pytest.fixture
def settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, models_dir: Path, embedded_redis: str) -> Iterator[str]:
    """The session's Redis and tiny models, a database (the workers' evaluations poll it), and a
    queue of this test's own; yields the queue."""
    from service.core.db import reset_caches
    from service.core.migrate import upgrade
    from service.core.settings import get_settings

    queue = f"test-{secrets.token_hex(4)}"
    for key, value in {
        "RLOO_HOME": str(tmp_path / "var"),
        "DATABASE_URL": f"sqlite:///{tmp_path / 'rloo.db'}",
        "REDIS_URL": embedded_redis,
        "RLOO_MODELS_DIR": str(models_dir),
        "RLOO_QUEUE": queue,
        "RLOO_REWARD_MODEL_TIMEOUT_SECONDS": "60",
    }.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    reset_caches()
    upgrade()
    yield queue
    get_settings.cache_clear()
    reset_caches()


@pytest.fixture
def serving(settings: str) -> Iterator[Callable[[str | None], None]]:
    """Starts an inference worker's serving loop (in a thread) on a queue: the default, or another."""
    import redis

    from service.core.settings import get_settings
    from worker.serving.between_batches import BetweenBatches
    from worker.serving.inference_worker import Server
    from worker.serving.model_cache import ModelCache

    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start(queue: str | None = None) -> None:
        conn = redis.Redis.from_url(get_settings().redis_client_url)
        cache = ModelCache(device=torch.device("cpu"), budget_bytes=2**30)
        with pytest.MonkeyPatch.context() as patch:  # its own settings, as `--serve --queue` gives
            if queue is not None:
                patch.setenv("RLOO_SERVE_QUEUE", queue)
            get_settings.cache_clear()
            server = Server(conn, worker=f"w-{secrets.token_hex(3)}", cache=cache, max_rows=32)
        get_settings.cache_clear()
        server.between_batches = BetweenBatches(server)
        thread = threading.Thread(target=server.run, args=(lambda: not stop.is_set(),), daemon=True)
        thread.start()
        threads.append(thread)
        deadline = time.monotonic() + 30
        while not conn.zscore(f"{server.ns}:workers", server.worker):  # registered: it takes requests
            assert time.monotonic() < deadline, "the serving loop never registered"
            time.sleep(0.02)

    yield start
    stop.set()
    for thread in threads:
        thread.join(timeout=10)


def _batch(models_dir: Path) -> tuple[list[Sample], list[dict[str, object]], list[str], SampledTokens]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models_dir / "tiny-policy")
    items: list[dict[str, object]] = [
        {"messages": [{"role": "user", "content": q}]} for q in QUESTIONS for _ in range(3)
    ]
    prompts = [f"Q: {q}\nA:" for q in QUESTIONS for _ in range(3)]
    # One row's tokens spelled out one character a token: read as sampled, both sides.
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    ids[4] = [i for c in TEXTS[4] for i in tok(c, add_special_tokens=False)["input_ids"]]
    return [Sample(t) for t in TEXTS], items, prompts, SampledTokens(tokenizer_fingerprint(tok), ids)


def test_a_remote_reward_model_scores_what_it_scores_beside_the_policy(
    serving: Callable[[str | None], None], models_dir: Path
) -> None:
    serving(None)
    samples, items, prompts, sampled = _batch(models_dir)
    beside = RewardModels(models_dir=models_dir, device=torch.device("cpu"))
    local = beside.score(parse_grader(RM), samples, items, prompts, sampled)
    here = RewardModels(models_dir=models_dir, device=torch.device("cpu"))
    remote = here.score(parse_grader({**RM, "remote": True}), samples, items, prompts, sampled)
    assert remote == pytest.approx(local, abs=1e-6)
    # The tokens it read there come back with the scores, to be metered as the job's.
    read = beside.tokens.take()["reward_model_tokens"]
    assert read > 0 and here.tokens.take() == {"reward_model_tokens": read, "judge_tokens": 0}
    assert len({round(s, 4) for s in local}) > 5  # the rows really differ
    assert not here._loaded  # the trainer never loaded the remote one
    # A NaN (an input template that misses a key) travels as null and comes back NaN.
    spec = {**RM, "remote": True, "input": "{{ item.answer }} {{ sample.output_text }}"}
    scores = here.score(parse_grader(spec), samples[:2], [{"answer": "4"}, {}], prompts[:2], None)
    assert math.isfinite(scores[0]) and math.isnan(scores[1])


def test_no_inference_worker_makes_the_grader_unavailable_saying_what_to_start(settings: str, models_dir: Path) -> None:
    here = RewardModels(models_dir=models_dir, device=torch.device("cpu"))
    with pytest.raises(GraderUnavailable, match=r"no inference worker serves the queue .*rloo worker --serve"):
        here.score(parse_grader({**RM, "remote": True}), [Sample("x")], [{}], ["p"])


def test_a_model_the_worker_cannot_load_is_its_answer_and_the_worker_goes_on(
    serving: Callable[[str | None], None], models_dir: Path
) -> None:
    serving(None)
    here = RewardModels(models_dir=models_dir, device=torch.device("cpu"))
    with pytest.raises(GraderUnavailable, match="the inference worker answered: .*no-such-reward"):
        here.score(parse_grader({**RM, "model": "no-such-reward", "remote": True}), [Sample("x")], [{}], ["p"])
    again = here.score(parse_grader({**RM, "remote": True}), [Sample(" x")], [{}], ["p"])
    assert math.isfinite(again[0])


def test_a_dedicated_queue_takes_the_reward_models_batches(
    serving: Callable[[str | None], None], settings: str, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rloo worker --serve --queue rewards`` serves only ``rewards``: with RLOO_REWARD_MODEL_QUEUE
    unset the batch finds no worker on the inference queue; set, it is scored."""
    from service.core.settings import get_settings

    serving(f"{settings}-rewards")
    here = RewardModels(models_dir=models_dir, device=torch.device("cpu"))
    leaf = parse_grader({**RM, "remote": True})
    with pytest.raises(GraderUnavailable, match=f"queue '{settings}-serve'"):
        here.score(leaf, [Sample(" x")], [{}], ["p"])
    monkeypatch.setenv("RLOO_REWARD_MODEL_QUEUE", f"{settings}-rewards")
    get_settings.cache_clear()
    got = here.score(leaf, [Sample(" x")], [{}], ["p"])
    assert got == pytest.approx(here.score(parse_grader(RM), [Sample(" x")], [{}], ["p"]), abs=1e-6)


def test_remote_must_be_a_boolean() -> None:
    with pytest.raises(GraderError) as caught:
        parse_grader({**RM, "remote": "yes"}, param="method.reinforcement.grader")
    assert caught.value.param == "method.reinforcement.grader.remote"
    assert "true or false" in caught.value.message
    assert parse_grader({**RM, "remote": True}).to_dict()["remote"] is True


def test_a_batch_that_arrives_while_a_batch_decodes_is_scored_after_it_not_inside(
    serving: Callable[[str | None], None], models_dir: Path
) -> None:
    """A reward model's batch taken while completions decode waits for their batch to end: its
    forward never runs inside a decoding batch (beside its KV cache, stalling its streams)."""
    import json
    import time

    import redis

    from service.core.settings import get_settings
    from service.infra import inference_bus

    serving(None)
    conn = redis.Redis.from_url(get_settings().redis_client_url)
    ns = inference_bus.namespace(inference_bus.serve_queue())
    deadline = time.time() + 60
    servable = {"base": str(models_dir / "tiny-policy"), "chain": []}
    long = {"id": "long", "kind": "completion", "prompts": ["the cat sat on"] * 8, "n": 3, "max_tokens": 120}
    inference_bus.submit_sync(conn, ns, {**long, "servable": servable, "deadline": deadline})
    first = conn.blpop([f"{ns}:reply:long"], timeout=30)  # decoding has begun
    assert first is not None and json.loads(first[1])["t"] == "start", first
    here = RewardModels(models_dir=models_dir, device=torch.device("cpu"))
    scores = here.score(parse_grader({**RM, "remote": True}), [Sample(" x")], [{}], ["p"])
    assert math.isfinite(scores[0])
    rest = [json.loads(m) for m in conn.lrange(f"{ns}:reply:long", 0, -1)]
    assert rest and rest[-1]["t"] == "done", "the score was answered before the decoding batch ended"


def test_asking_fails_soon_when_its_workers_are_gone_and_a_timed_out_batch_is_cancelled(settings: str) -> None:
    """Queued while the only worker's heartbeat runs out: lost within a second or two, not at the
    time-out. A worker that holds it and never answers: a time-out, and the batch is cancelled so
    that no worker scores it later."""
    import time

    import redis

    from service.core.settings import get_settings
    from service.infra import inference_bus

    conn = redis.Redis.from_url(get_settings().redis_client_url)
    ns = inference_bus.namespace(inference_bus.serve_queue())
    conn.zadd(f"{ns}:workers", {"dying": time.time() + 1.0})
    t0 = time.monotonic()
    with pytest.raises(inference_bus.WorkerLost):
        inference_bus.ask({"id": "a", "kind": "score"}, timeout=30)
    assert time.monotonic() - t0 < 10
    conn.zadd(f"{ns}:workers", {"silent": time.time() + 60})
    conn.set(f"{ns}:lease:b", "silent", ex=60)  # taken, never answered
    with pytest.raises(inference_bus.TimedOut):
        inference_bus.ask({"id": "b", "kind": "score"}, timeout=2)
    assert conn.exists(f"{ns}:cancel:b")


def test_a_worker_of_its_own_queue_claims_no_evaluations(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.serving import evaluate
    from worker.serving.background import Background
    from worker.serving.between_batches import BetweenBatches

    claimed: list[object] = []
    monkeypatch.setattr(evaluate, "claim_next", lambda server: claimed.append(server))

    class Server:
        background = Background()  # where an evaluation is looked for

    server = Server()
    BetweenBatches(server, evaluations=False).step()
    between_batches = BetweenBatches(server, evaluations=True)
    between_batches.step()
    assert between_batches._claiming is not None
    between_batches._claiming.result(timeout=10)
    assert claimed == [server]  # the check is the flag, not the stub


def test_redis_away_makes_the_grader_unavailable_saying_so(
    settings: str, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.core.settings import get_settings

    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens there
    get_settings.cache_clear()
    here = RewardModels(models_dir=models_dir, device=torch.device("cpu"))
    with pytest.raises(GraderUnavailable, match="Redis, which carries its batches, did not answer"):
        here.score(parse_grader({**RM, "remote": True}), [Sample("x")], [{}], ["p"])
