"""Reward models served by the inference workers: a batch sent to them, its scores back.

A reward model as large as the policy need not share the policy's GPU. A ``reward_model`` grader
with ``"remote": true`` is scored by the inference workers (``rloo worker --serve``), which keep it
loaded between batches as they keep the models they sample from. The training worker sends each
batch to the queue ``RLOO_REWARD_MODEL_QUEUE`` names (by default the inference workers' own), through
Redis as the API sends exports (``service.infra.inference_bus.ask``). A dedicated host for reward models runs
``rloo worker --serve --queue NAME`` and the training workers set ``RLOO_REWARD_MODEL_QUEUE=NAME``.

A request carries what the local scorer reads: the grader, the completions' texts, their items and
prompts (once a group), and the policy's sampled tokens with its tokenizer's digest
(``worker.engine.rewards.scoring.SampledTokens``), so a remote reward model scores what the same model would
score beside the policy. Its answer is the scores (``null`` for NaN) and the tokens the model read
(metered as the job's reward-model tokens). A worker that dies mid-batch
is asked once more; no worker, a time-out or a worker's error make the grader unavailable (the job
fails, saying what to start or change).
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from service import graders
from service.core.settings import get_settings
from service.infra import inference_bus
from worker.engine.rewards.shared_prefix import SampledTokens, first_rows, groups

log = logging.getLogger(__name__)

ATTEMPTS = 2
"""A batch is sent again once when the worker that held it died."""


def score_remotely(
    leaf: graders.RewardModelGrader,
    samples: Sequence[graders.Sample],
    items: Sequence[Mapping[str, Any]],
    prompts: Sequence[str],
    sampled: SampledTokens | None,
) -> tuple[list[float], dict[str, Any]]:
    """The scores of ``samples`` from the inference workers, and the tokens the model read there
    (``worker.engine.rewards.scoring.TokensRead``'s counts); raises ``GraderUnavailable``."""
    settings = get_settings()
    queue = settings.reward_model_queue or inference_bus.serve_queue()
    body = request_body(leaf, samples, items, prompts, sampled)
    where = f"reward model '{leaf.model}' (remote: true)"
    for _ in range(ATTEMPTS):
        envelope = {"id": f"score-{uuid.uuid4().hex}", "kind": "score", **body}
        try:
            answer = inference_bus.ask(envelope, timeout=settings.reward_model_timeout_seconds, queue=queue)
        except inference_bus.NoWorker:
            start = "rloo worker --serve" + ("" if queue == inference_bus.serve_queue() else f" --queue {queue}")
            raise graders.GraderUnavailable(
                f"{where}: no inference worker serves the queue '{queue}'; start one with `{start}`, "
                "or set remote to false to score it beside the policy"
            ) from None
        except inference_bus.WorkerLost:
            continue
        except inference_bus.Unreachable as exc:
            raise graders.GraderUnavailable(
                f"{where}: Redis, which carries its batches, did not answer ({exc}); "
                "check REDIS_URL on the training worker"
            ) from None
        except inference_bus.TimedOut:
            raise graders.GraderUnavailable(
                f"{where}: no scores within {settings.reward_model_timeout_seconds:g} s "
                "(RLOO_REWARD_MODEL_TIMEOUT_SECONDS); are the inference workers busy?"
            ) from None
        if answer.get("t") == "error":
            raise graders.GraderUnavailable(f"{where}: the inference worker answered: {answer.get('message')}")
        read = answer.get("tokens")
        if not isinstance(read, dict):  # a worker of an older release: its batches are not metered
            _warn_once(f"{where}: an inference worker answered no token count; upgrade it to meter its tokens")
            read = {}
        return [math.nan if s is None else float(s) for s in answer["scores"]], read
    raise graders.GraderUnavailable(f"{where}: the inference worker scoring it stopped {ATTEMPTS} times")


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """``message`` logged once a process (a step's every batch would repeat it)."""
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning("%s", message)


def request_body(
    leaf: graders.RewardModelGrader,
    samples: Sequence[graders.Sample],
    items: Sequence[Mapping[str, Any]],
    prompts: Sequence[str],
    sampled: SampledTokens | None,
) -> dict[str, Any]:
    """The request's JSON: each group's item and prompt once (a step's k completions of a prompt
    share them), ``group_of`` saying each row's."""
    group_of = groups(prompts, items)
    firsts = first_rows(group_of)
    return {
        "grader": leaf.to_dict(),
        "texts": [s.output_text for s in samples],
        "items": [dict(items[r]) for r in firsts],
        "prompts": [prompts[r] for r in firsts],
        "group_of": group_of,
        "sampled": None if sampled is None else {"tokenizer": sampled.tokenizer, "ids": sampled.ids},
    }


def answer(reward_models: Any, envelope: Mapping[str, Any]) -> dict[str, Any]:
    """The inference worker's side: a ``score`` request's last message, its scores or its error
    (``reward_models``: the worker's ``worker.engine.rewards.scoring.RewardModels``, ``serving``, which scores
    remote reward models itself; this module imports nothing of ``worker.engine.rewards.scoring``, which calls it)."""
    try:
        leaf = graders.parse_grader(envelope["grader"])
        if not isinstance(leaf, graders.RewardModelGrader):
            raise ValueError(f"a {leaf.type} grader is not a reward model")
        raw = envelope.get("sampled")
        sampled = None if raw is None else SampledTokens(raw["tokenizer"], [list(ids) for ids in raw["ids"]])
        samples = [graders.Sample(output_text=t) for t in envelope["texts"]]
        group_of = envelope["group_of"]
        items = [envelope["items"][g] for g in group_of]
        prompts = [envelope["prompts"][g] for g in group_of]
        reward_models.tokens.take()  # (what an evaluation's graders read before: not this batch's)
        scores = reward_models.score(leaf, samples, items, prompts, sampled)
    except (graders.GraderError, KeyError, IndexError, TypeError, ValueError, OSError) as exc:
        return inference_bus.error_message(400, "invalid_score_request", f"{type(exc).__name__}: {exc}")
    scored = [s if math.isfinite(s) else None for s in scores]
    return {"t": "done", "scores": scored, "tokens": reward_models.tokens.take()}
