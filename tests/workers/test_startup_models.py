"""What an inference worker loads when it starts (``worker.serving.startup_models``): which models
``RLOO_INFERENCE_PRELOAD`` names, loading them until the worker's memory is full, and a model that
will not load skipped without ending the worker."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from worker.serving.model_cache import ModelCache
from worker.serving.startup_models import preload, preload_dirs


@pytest.fixture(scope="module")
def root(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny policy, a bigger one, the reward model (it writes no text) and a broken directory."""
    from worker.tiny.models import build_tiny_causal_lm

    root = tmp_path_factory.mktemp("startup-models")
    for name in ("tiny-policy", "tiny-reward"):
        shutil.copytree(models_dir / name, root / name)
    build_tiny_causal_lm(root / "bigger", hidden_size=128, seed=3)
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    shutil.copy(models_dir / "tiny-policy" / "tokenizer.json", root / "broken")
    return root


def test_all_names_every_model_that_writes_text_smallest_first(root: Path) -> None:
    assert preload_dirs("all", root) == [root / "broken", root / "tiny-policy", root / "bigger"]  # no weights: 0 B
    assert preload_dirs("", root) == []


def test_names_are_taken_in_their_order_and_one_not_there_is_left_out(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert preload_dirs("bigger, tiny-policy,missing,../etc", root) == [root / "bigger", root / "tiny-policy"]
    assert "'missing', which is no model directory" in caplog.text and "'../etc'" in caplog.text


def test_the_models_load_until_memory_is_full_and_a_broken_one_is_skipped(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rloo.serve")
    roomy = ModelCache(device=torch.device("cpu"), budget_bytes=1 << 30)
    assert preload(roomy, preload_dirs("all", root)) == [root / "tiny-policy", root / "bigger"]
    assert "could not preload" in caplog.text and "broken" in caplog.text
    assert roomy.loads == 2 and len(roomy.bases) == 2
    # Memory for the small one alone: the bigger is not loaded (its weights, from its headers, do not fit).
    small = sum(p.numel() * p.element_size() for p in roomy.bases[(root / "tiny-policy", ())].model.parameters())
    tight = ModelCache(device=torch.device("cpu"), budget_bytes=small + 1024)
    assert preload(tight, [root / "tiny-policy", root / "bigger"]) == [root / "tiny-policy"]
    assert "not preloading bigger" in caplog.text and tight.loads == 1
