"""Where the score phase of a reward-model job goes (``python -m benchmarks.run score_profile``).

For the *tiny*, *small* and 8-layer configs, a policy and a reward model of the same shape sharing
its tokenizer (as the demo's reward-model job has), one step's rollouts sampled by the engine (k = 4,
8 chat-rendered demo prompts, 32 new tokens), then the scoring of those 32 completions timed as the
loop runs it (``worker.engine.rewards.scoring.score_batch`` over the job's grader: ``whole``), the same with each
row read whole as before each prompt's part was read once (``whole_texts``), and stage by stage:

* reading whole texts: ``render`` (the reward model's chat template, per sample), ``tokenize``
  (padded input batches), ``forward`` (the forwards, in inference mode), ``to_host`` (the logits to
  Python floats), ``other`` (the rest of that path: the grader tree, samples, Python per sample);
* each prompt's part read once (``worker.engine.rewards.shared_prefix``): ``split`` (a render a prompt, the rows
  tokenized and cut) and ``prefix_forward`` (a prompt's forward once, its rows after it);
* ``floor``: one batched forward over the same 32 sequences, already tokenized;
* the policy's sampled tokens read as they are (``worker.engine.rewards.scoring.SampledTokens``, what the loop
  does since the reward model shares the policy's tokenizer): ``sampled`` (the loop's scoring), and
  its floor ``floor_sampled``, one batched forward over those sequences (a random model's samples
  re-encode longer than sampled, so these are shorter).

Each figure is the median of ``REPEATS`` runs after a warm-up, in milliseconds; one JSON object out.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import DEMO_DATA, NEW_TOKENS, PROMPTS, K

PROFILE_CONFIGS: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "num_layers": 2},
    "small": {"hidden_size": 256, "num_layers": 4},
    "8-layer": {"hidden_size": 512, "num_layers": 8},
}
REPEATS = 20
GRADER = {"type": "reward_model", "name": "rm", "model": "rm"}


def _median_ms(fn: Callable[[], Any], repeats: int = REPEATS) -> tuple[float, Any]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times), out


def profile(config: str) -> dict[str, Any]:
    from service.graders import parse_grader
    from service.jobs.hyperparameters import ReinforcementHyperparameters
    from worker.engine.config import TrainConfig
    from worker.engine.data import prompt_text
    from worker.engine.prepare import prepare
    from worker.engine.recorders import QuietRecorder
    from worker.engine.rewards.scoring import SampledTokens, encode_texts, reward_model_texts, score_batch
    from worker.engine.rewards.shared_prefix import prefix_logits
    from worker.tiny.models import build_tiny_causal_lm, build_tiny_reward_model

    with tempfile.TemporaryDirectory() as tmp_name:
        models = Path(tmp_name) / "models"
        build_tiny_causal_lm(models / "policy", seed=0, **PROFILE_CONFIGS[config])
        build_tiny_reward_model(models / "rm", tokenizer_from=models / "policy", seed=1, **PROFILE_CONFIGS[config])
        hp = ReinforcementHyperparameters(
            rloo_k=K, batch_size=PROMPTS, max_new_tokens=NEW_TOKENS, kl_coef=0.05
        ).resolved()
        cfg = TrainConfig(
            model="policy",
            training_file=DEMO_DATA,
            grader=parse_grader(GRADER),
            hyperparameters=hp,
            output_dir=Path(tmp_name) / "out",
            models_dir=models,
            device="cpu",
        )
        run = prepare(cfg, QuietRecorder())
        items = run.items[:PROMPTS]
        prompts = [prompt_text(item, run.tokenizer) for item in items]
        ro = run.sampler.generate(prompts, k=K, generator_seed=1)
        rows_prompts = [p for p in prompts for _ in range(K)]
        rows_items = [item for item in items for _ in range(K)]
        assert run.reward_models is not None and run.cfg.grader is not None
        rm = run.reward_models
        leaf = run.cfg.grader
        model, tok = rm._load("rm")
        from service.graders import Sample

        samples = [Sample(output_text=t) for t in ro.texts]

        def whole() -> Any:
            return score_batch(leaf, prompts=rows_prompts, texts=ro.texts, items=rows_items, reward_models=rm)

        t_whole, _ = _median_ms(whole)
        t_split, split = _median_ms(lambda: _split(rm, leaf, tok, samples, rows_items, rows_prompts))

        def shared_forward() -> Any:
            with torch.inference_mode():
                return prefix_logits(model, split, rm.device, rm.batch_size)

        t_prefix, _ = _median_ms(shared_forward)
        shared = rm._shared_prefix_scores
        rm._shared_prefix_scores = lambda *args: None  # type: ignore[method-assign]
        t_whole_texts, _ = _median_ms(whole)
        rm._shared_prefix_scores = shared  # type: ignore[method-assign]
        t_render, (texts, templated) = _median_ms(
            lambda: reward_model_texts(leaf, tok, samples, rows_items, rows_prompts)
        )
        t_tokenize, batches = _median_ms(
            lambda: encode_texts(tok, texts, templated=templated, batch_size=rm.batch_size)
        )

        def forward() -> Any:
            with torch.inference_mode():
                return [model(**enc).logits[:, 0] for enc in batches]

        t_forward, logits = _median_ms(forward)
        t_to_host, _ = _median_ms(lambda: torch.cat(logits).float().cpu().tolist())
        # The floor: one batched forward of the same sequences, tokenized beforehand (one batch).
        one = encode_texts(tok, texts, templated=templated, batch_size=len(texts))[0]

        def floor() -> Any:
            with torch.inference_mode():
                return model(**one).logits

        t_floor, _ = _median_ms(floor)
        sampled = SampledTokens(run.tokenizer_digest, ro.sampled(run.tokenizer.all_special_ids))
        t_sampled, _ = _median_ms(
            lambda: score_batch(
                leaf, prompts=rows_prompts, texts=ro.texts, items=rows_items, reward_models=rm, sampled=sampled
            )
        )
        read = _split(rm, leaf, tok, samples, rows_items, rows_prompts, sampled.ids)
        sequences = [read.prefixes[g] + row for row, g in zip(read.rows, read.group_of, strict=True)]
        width = max(len(ids) for ids in sequences)
        ids = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in sequences])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in sequences])

        def floor_sampled() -> Any:
            with torch.inference_mode():
                return model(input_ids=ids, attention_mask=mask).logits

        t_floor_sampled, _ = _median_ms(floor_sampled)
        parts = t_render + t_tokenize + t_forward + t_to_host
        return {
            "config": config,
            "rows": len(texts),
            "tokens_per_row": int(one["input_ids"].shape[1]),
            "prompt_tokens": round(statistics.mean(len(p) for p in split.prefixes), 1),
            "whole_ms": round(t_whole, 2),
            "whole_over_floor": round(t_whole / t_floor, 2),
            "split_ms": round(t_split, 2),
            "prefix_forward_ms": round(t_prefix, 2),
            "whole_texts_ms": round(t_whole_texts, 2),
            "whole_texts_over_floor": round(t_whole_texts / t_floor, 2),
            "render_ms": round(t_render, 2),
            "tokenize_ms": round(t_tokenize, 2),
            "forward_ms": round(t_forward, 2),
            "to_host_ms": round(t_to_host, 2),
            "other_ms": round(max(t_whole_texts - parts, 0.0), 2),
            "floor_ms": round(t_floor, 2),
            "sampled_tokens_per_row": width,
            "sampled_ms": round(t_sampled, 2),
            "floor_sampled_ms": round(t_floor_sampled, 2),
            "sampled_over_floor_sampled": round(t_sampled / t_floor_sampled, 2),
        }


def _split(rm: Any, leaf: Any, tok: Any, samples: Any, items: Any, prompts: Any, sampled: Any = None) -> Any:
    """The rows cut after their prompts' part, as ``RewardModels._shared_prefix_scores`` cuts them
    (from the ``sampled`` token ids, where given)."""
    from worker.engine.rewards import shared_prefix

    captured: dict[str, Any] = {}
    real = shared_prefix.prefix_logits

    def keep(model: Any, split: Any, device: Any, max_rows: int) -> None:
        captured["split"] = split
        return None

    shared_prefix.prefix_logits = keep  # type: ignore[assignment]
    try:
        model, _ = rm._load(leaf.model)
        rm._shared_prefix_scores(leaf, model, tok, samples, items, prompts, sampled)
    finally:
        shared_prefix.prefix_logits = real  # type: ignore[assignment]
    return captured["split"]


def main(argv: list[str] | None = None) -> int:
    configs = (argv if argv is not None else sys.argv[1:]) or list(PROFILE_CONFIGS)
    print(json.dumps({"threads": torch.get_num_threads(), "profiles": [profile(c) for c in configs]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
