"""Scoring completions: the job's grader over a batch, with reward-model leaves run here, batched."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from service import graders
from service.storage import confined


class RewardModels:
    """Loads each reward model a grader names once, and scores batches on the worker's device."""

    def __init__(self, *, models_dir: Path, device: torch.device, batch_size: int = 32) -> None:
        self.models_dir, self.device, self.batch_size = models_dir, device, batch_size
        self._loaded: dict[str, tuple[Any, Any]] = {}

    def _load(self, name: str) -> tuple[Any, Any]:
        if name not in self._loaded:
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            path = confined(self.models_dir, name)
            tok = AutoTokenizer.from_pretrained(path)
            tok.padding_side = "left"
            if tok.pad_token is None:
                tok.pad_token = tok.eos_token
            model = AutoModelForSequenceClassification.from_pretrained(path).to(self.device).eval()
            if getattr(model.config, "num_labels", 1) != 1:
                raise ValueError(f"reward model '{name}' has {model.config.num_labels} labels; a reward model has 1")
            if model.config.pad_token_id is None:
                model.config.pad_token_id = tok.pad_token_id
            self._loaded[name] = (model, tok)
        return self._loaded[name]

    @torch.inference_mode()
    def score(
        self, leaf: Any, samples: Sequence[graders.Sample], items: Sequence[Mapping[str, Any]], prompts: Sequence[str]
    ) -> list[float]:
        """One score per sample: the model's single logit on ``prompt + completion`` (or ``leaf.input``)."""
        model, tok = self._load(leaf.model)
        rendered = graders.render_reward_model_inputs(leaf, samples, items)
        if leaf.input is None:  # the classic RLHF reward: the prompt and its completion
            rendered = [prompt + sample.output_text for prompt, sample in zip(prompts, samples, strict=True)]
        todo = [i for i, text in enumerate(rendered) if text is not None]
        texts = [rendered[i] for i in todo]
        scores: list[float] = []
        for i in range(0, len(texts), self.batch_size):
            enc = tok(
                texts[i : i + self.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                # Tokenizers without a limit report a huge sentinel for model_max_length.
                max_length=tok.model_max_length if tok.model_max_length < 1e6 else 2048,
            )
            logits = model(**{k: v.to(self.device) for k, v in enc.items()}).logits
            scores.extend(logits[:, 0].float().cpu().tolist())
        out = [float("nan")] * len(rendered)  # NaN where the input template missed a key
        for i, score in zip(todo, scores, strict=True):
            out[i] = score
        return out


def score_batch(
    grader: Any,
    *,
    prompts: list[str],
    texts: list[str],
    items: list[dict[str, Any]],
    reward_models: RewardModels | None,
) -> graders.GradeResult:
    """Rewards ``(N,)`` (NaN where a completion could not be scored) and per-grader details."""
    samples = [graders.Sample(output_text=t) for t in texts]
    scorer = None
    if reward_models is not None:

        def scorer(leaf: Any, s: Sequence[graders.Sample], i: Sequence[Mapping[str, Any]]) -> list[float]:
            return reward_models.score(leaf, s, i, prompts)

    return graders.grade_batch(grader, samples, items, model_scorer=scorer)
