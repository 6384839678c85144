"""reward_model on the worker: the classic RLHF reward, the conversation as the reward model reads
it (its own chat template, when it has one), or an ``input`` template; batched, NaN where the
template misses a key."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from service.graders import Sample, parse_grader
from worker.rewards import RewardModels

RM = {"type": "reward_model", "name": "rm", "model": "tiny-reward"}


def logit(models_dir: Path, name: str, text: str) -> float:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models_dir / name)
    model = AutoModelForSequenceClassification.from_pretrained(models_dir / name).eval()
    with torch.no_grad():
        return float(model(**tok([text], return_tensors="pt")).logits[0, 0])


def test_a_chat_reward_model_reads_the_conversation_with_its_own_template(models_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models_dir / "tiny-reward")
    assert tok.chat_template  # the tiny reward model shares the policy's chat tokenizer
    rm = RewardModels(models_dir=models_dir, device=torch.device("cpu"))
    items = [{"messages": [{"role": "user", "content": "What color is the sky?"}]}, {"prompt": "Grass?"}]
    got = rm.score(parse_grader(RM), [Sample("Blue."), Sample("Green.")], items, ["policy prompt 1", "policy prompt 2"])
    want = [
        logit(
            models_dir,
            "tiny-reward",
            tok.apply_chat_template(
                [{"role": "user", "content": "What color is the sky?"}, {"role": "assistant", "content": "Blue."}],
                tokenize=False,
            ),
        ),
        logit(
            models_dir,
            "tiny-reward",
            tok.apply_chat_template(
                [{"role": "user", "content": "Grass?"}, {"role": "assistant", "content": "Green."}], tokenize=False
            ),
        ),
    ]
    assert got == pytest.approx(want, abs=1e-5)


def test_a_plain_reward_model_reads_prompt_and_completion(models_dir: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain-reward"
    shutil.copytree(models_dir / "tiny-reward", plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in plain.glob("chat_template.*"):
        extra.unlink()
    rm = RewardModels(models_dir=tmp_path, device=torch.device("cpu"))
    got = rm.score(parse_grader({**RM, "model": "plain-reward"}), [Sample(" Blue.")], [{}], ["Q: sky?"])
    assert got == pytest.approx([logit(tmp_path, "plain-reward", "Q: sky? Blue.")], abs=1e-5)


def test_an_input_template_is_what_the_reward_model_reads(models_dir: Path) -> None:
    rm = RewardModels(models_dir=models_dir, device=torch.device("cpu"))
    spec = {**RM, "input": "Answer: {{ sample.output_text }} / expected {{ item.answer }}"}
    got = rm.score(parse_grader(spec), [Sample("blue"), Sample("x")], [{"answer": "blue"}, {}], ["", ""])
    assert got[0] == pytest.approx(logit(models_dir, "tiny-reward", "Answer: blue / expected blue"), abs=1e-5)
    assert math.isnan(got[1])  # the second item lacks answer
