"""The inference worker on vLLM, driven by the stand-in ``vllm`` module (tests/fakes/vllm: vLLM needs a
GPU): one engine a base, LoRA checkpoints through ``LoRARequest`` on it, a chain's earlier checkpoints
merged into the directory the engine loads, rows' sampling settings and ends carried both ways."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.helpers.data import FAKES
from worker.serving.decode import Row
from worker.serving.model_cache import Servable

PROMPT = "the cat sat on"


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(FAKES))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    import vllm

    vllm.LLM.instances.clear()
    yield vllm
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        sys.modules.pop(name, None)


def _adapter(base: Path, out: Path, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def _full(base: Path, out: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def _greedy(model: Any, tok: Any, n: int = 10) -> str:
    ids = torch.tensor([tok(PROMPT, add_special_tokens=False)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, pad_token_id=0)
    return str(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def _serve(models: Any, servable: Servable, **row: Any) -> Row:
    loaded, adapter = models.get(servable)
    ids = loaded.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    r = Row(request="r", index=0, prompt_ids=ids, max_tokens=10, temperature=0, adapter=adapter, **row)
    (deltas,) = list(models.decode(loaded, [r]))
    assert [d.row for d in deltas] == [r] and deltas[0].text == r.text and deltas[0].finish_reason == r.finish_reason
    return r


def test_adapters_share_their_bases_engine_and_answer_as_peft_does(
    fake_vllm: Any, models_dir: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.serving.vllm_models import VLLMModels

    base = models_dir / "tiny-policy"
    tok = AutoTokenizer.from_pretrained(base)
    one, two = _adapter(base, tmp_path / "one", 1), _adapter(base, tmp_path / "two", 2)
    models = VLLMModels(artifacts_dir=tmp_path / "artifacts", gpu_memory_utilization=0.3)
    plain = _serve(models, Servable(base))
    assert plain.text == _greedy(AutoModelForCausalLM.from_pretrained(base).eval(), tok)
    for adapter in (one, two):
        row = _serve(models, Servable(base, (adapter,)))
        reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
        assert row.text == _greedy(reference, tok), adapter
        assert row.finish_reason == "length" and row.sampled == len(row.tokens) == 10
    (engine,) = fake_vllm.LLM.instances  # one engine for the base and both adapters
    assert engine.options["enable_lora"] is True and models.loads == 1
    # A stop string ends the text before it, as OpenAI's stop does.
    stop = plain.text[2:4]
    cut = _serve(models, Servable(base), stop=(stop,))
    assert cut.text == plain.text[: plain.text.find(stop)] and cut.finish_reason == "stop"


def test_a_chains_earlier_checkpoints_are_merged_into_the_engines_model(
    fake_vllm: Any, models_dir: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.serving.vllm_models import VLLMModels

    base = models_dir / "tiny-policy"
    full = _full(base, tmp_path / "full")
    adapter = _adapter(full, tmp_path / "adapter", 3)  # trained on the full checkpoint's weights
    models = VLLMModels(artifacts_dir=tmp_path / "artifacts", gpu_memory_utilization=0.3)
    row = _serve(models, Servable(base, (full, adapter)))
    (engine,) = fake_vllm.LLM.instances
    merged = Path(engine.hf.config.name_or_path)
    assert merged.parent == tmp_path / "artifacts" / "exports" / "bases" and (merged / "config.json").is_file()
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(full), adapter).eval()
    assert row.text == _greedy(reference, AutoTokenizer.from_pretrained(full))


def test_auto_takes_vllm_only_where_it_is_installed_and_there_is_a_gpu(fake_vllm: Any) -> None:
    from worker.serving.vllm_models import choose

    cpu, cuda = SimpleNamespace(type="cpu"), SimpleNamespace(type="cuda")
    assert not choose(SimpleNamespace(inference_backend="auto"), cpu)
    assert choose(SimpleNamespace(inference_backend="auto"), cuda)  # the stand-in is installed
    assert choose(SimpleNamespace(inference_backend="vllm"), cpu)
    assert not choose(SimpleNamespace(inference_backend="transformers"), cuda)
