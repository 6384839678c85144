"""Tests for worker.tiny.models: offline tiny models loaded through the Auto* path."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaForCausalLM,
)

from worker.tiny import models as tm

PROMPTS = ["the cat", "Anna likes the big red dog in the park every day."]


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    policy = tm.build_tiny_causal_lm(root / "policy")
    reward = tm.build_tiny_reward_model(root / "reward", tokenizer_from=policy)
    return {"root": root, "policy": policy, "reward": reward}


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_special_tokens_and_padding_side() -> None:
    tok = tm.build_tokenizer(tm.DEMO_CORPUS, vocab_size=400)
    assert len(tok) == 400
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert [tok.convert_tokens_to_ids(t) for t in tm.SPECIAL_TOKENS] == list(range(len(tm.SPECIAL_TOKENS)))
    assert tok.padding_side == "left"
    # no automatic BOS/EOS: encode(text) is just the text
    assert tok("hello")["input_ids"] == tok.encode("hello", add_special_tokens=False)
    # the corpus produced real merges: common words are single tokens
    assert len(tok.tokenize(" the")) == 1
    with pytest.raises(ValueError):
        tm.build_tokenizer(["x"], vocab_size=100)


def test_a_filled_tokenizer_decodes_every_id_of_a_larger_embedding() -> None:
    """``fill_to``: a random-weight model of a real model's vocabulary samples any id; each decodes."""
    plain = tm.build_tokenizer(tm.DEMO_CORPUS, vocab_size=400)
    tok = tm.build_tokenizer(tm.DEMO_CORPUS, vocab_size=400, fill_to=70_000)
    assert len(plain) == 400 and len(tok) == 70_000
    assert None not in tok.convert_ids_to_tokens(list(range(len(tok))))
    assert tok.get_vocab().items() >= plain.get_vocab().items()  # the trained ids keep their tokens
    text = "Anna likes the big red dog. Ω≈ç 日本語 🤖"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.decode([len(plain), 69_999]) != ""


@pytest.mark.parametrize(
    "text",
    [
        "héllo wörld",
        "日本語のテキスト 世界",
        "emoji 🤖🚀 and zero\u200bwidth",
        "  leading spaces,\ttabs\nand newlines\r\n",
        "\x00\x01 control bytes \x7f",
        "Ω≈ç√∫˜µ≤≥÷ العربية עברית",
    ],
)
def test_tokenizer_roundtrips_unicode(models: dict[str, Path], text: str) -> None:
    tok = AutoTokenizer.from_pretrained(models["policy"])
    ids = tok(text)["input_ids"]
    assert all(0 <= i < len(tok) for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_is_deterministic() -> None:
    a = tm.build_tokenizer(tm.DEMO_CORPUS)
    b = tm.build_tokenizer(list(tm.DEMO_CORPUS))
    assert a.get_vocab() == b.get_vocab()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    other = tm.build_tokenizer(["zebra quokka xylophone"] * 50 + tm.DEMO_CORPUS[:50])
    assert other.get_vocab() != a.get_vocab()


def test_demo_corpus_is_deterministic_and_sizeable() -> None:
    assert 200 <= len(tm.DEMO_CORPUS) <= 1000
    assert tm._demo_corpus() == tm.DEMO_CORPUS
    assert len(set(tm.DEMO_CORPUS)) > 0.9 * len(tm.DEMO_CORPUS)


def test_chat_template(models: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(models["policy"])
    msgs = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi there"}]
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert rendered == "<|system|>be nice<|eos|><|user|>hi there<|eos|><|assistant|>"
    ids = tok(rendered)["input_ids"]
    assert ids[-1] == tok.convert_tokens_to_ids(tm.ASSISTANT_TOKEN)
    assert ids[0] == tok.convert_tokens_to_ids(tm.SYSTEM_TOKEN)
    assert tok.decode(ids, skip_special_tokens=True) == "be nicehi there"
    no_prompt = tok.apply_chat_template(msgs[1:], add_generation_prompt=False, tokenize=False)
    assert no_prompt == "<|user|>hi there<|eos|>"
    with pytest.raises(Exception, match="Unknown role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}], tokenize=False)


# ---------------------------------------------------------------- policy


def test_policy_files_and_config(models: dict[str, Path]) -> None:
    policy = models["policy"]
    names = {p.name for p in policy.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    cfg = json.loads((policy / "config.json").read_text())
    gen = json.loads((policy / "generation_config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["tie_word_embeddings"] is True
    for key, want in {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}.items():
        assert cfg[key] == want
        assert gen[key] == want
    tok = AutoTokenizer.from_pretrained(policy)
    assert cfg["vocab_size"] == len(tok)
    assert tok.model_max_length == cfg["max_position_embeddings"] == 256


def test_policy_generates_left_padded_batch(models: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(models["policy"])
    model = AutoModelForCausalLM.from_pretrained(models["policy"]).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    short = len(tok(PROMPTS[0])["input_ids"])
    width = batch["input_ids"].shape[1]
    assert short < width
    assert batch["attention_mask"][0, : width - short].sum() == 0  # padded on the left
    assert (batch["input_ids"][0, : width - short] == tok.pad_token_id).all()
    assert batch["attention_mask"][0, -1] == 1
    torch.manual_seed(0)
    out = model.generate(**batch, do_sample=True, max_new_tokens=6, min_new_tokens=6)
    assert out.shape == (2, width + 6)
    assert torch.equal(out[:, :width], batch["input_ids"])
    assert int(out.max()) < len(tok)


def test_policy_logits_do_not_depend_on_left_padding(models: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(models["policy"])
    model = AutoModelForCausalLM.from_pretrained(models["policy"]).eval()
    with torch.no_grad():
        alone = model(**tok(PROMPTS[:1], return_tensors="pt")).logits[0, -1]
        batched = model(**tok(PROMPTS, return_tensors="pt", padding=True)).logits[0, -1]
    torch.testing.assert_close(alone, batched, atol=1e-5, rtol=0)


def _state(path: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_seed_controls_weights(tmp_path: Path) -> None:
    before = torch.random.get_rng_state()
    kw: dict[str, Any] = {"hidden_size": 32, "num_layers": 1, "num_heads": 2}
    a = _state(tm.build_tiny_causal_lm(tmp_path / "a", seed=3, **kw))
    b = _state(tm.build_tiny_causal_lm(tmp_path / "b", seed=3, **kw))
    c = _state(tm.build_tiny_causal_lm(tmp_path / "c", seed=4, **kw))
    assert torch.equal(torch.random.get_rng_state(), before)  # global RNG untouched
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    weights = [k for k in a if k.endswith("proj.weight") or "embed" in k]
    assert weights and all(not torch.equal(a[k], c[k]) for k in weights)


def test_custom_sizes(tmp_path: Path) -> None:
    path = tm.build_tiny_causal_lm(
        tmp_path / "m",
        hidden_size=48,
        num_layers=3,
        num_heads=3,
        intermediate_size=96,
        max_position_embeddings=64,
        vocab_size=300,
    )
    cfg = AutoModelForCausalLM.from_pretrained(path).config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (48, 3, 3)
    assert (cfg.intermediate_size, cfg.max_position_embeddings, cfg.vocab_size) == (96, 64, 300)
    with pytest.raises(ValueError):
        tm.build_tiny_causal_lm(tmp_path / "bad", hidden_size=30, num_heads=4)
    assert not (tmp_path / "bad").exists()


# ---------------------------------------------------------------- reward model


def test_reward_model_scores_left_padded_batch(models: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(models["reward"])
    rm = AutoModelForSequenceClassification.from_pretrained(models["reward"]).eval()
    assert rm.config.num_labels == 1
    assert rm.config.pad_token_id == tok.pad_token_id == 0
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    assert batch["attention_mask"][0, 0] == 0
    with torch.no_grad():
        scores = rm(**batch).logits
        alone = [rm(**tok([p], return_tensors="pt")).logits for p in PROMPTS]
    assert scores.shape == (2, 1)
    assert torch.isfinite(scores).all()
    for i, s in enumerate(alone):
        assert s.shape == (1, 1)
        torch.testing.assert_close(s[0], scores[i], atol=1e-5, rtol=0)
    assert not torch.allclose(scores[0], scores[1])  # a random model still tells texts apart


def test_reward_model_shares_policy_tokenizer(models: dict[str, Path]) -> None:
    a = json.loads((models["policy"] / "tokenizer.json").read_text())
    b = json.loads((models["reward"] / "tokenizer.json").read_text())
    assert a["model"] == b["model"]
    assert a["added_tokens"] == b["added_tokens"]
    assert AutoTokenizer.from_pretrained(models["reward"]).padding_side == "left"


def test_reward_model_without_policy_tokenizer(tmp_path: Path) -> None:
    path = tm.build_tiny_reward_model(tmp_path / "rm", hidden_size=32, num_heads=2, num_layers=1, vocab_size=300)
    rm = AutoModelForSequenceClassification.from_pretrained(path)
    assert rm.config.vocab_size == len(AutoTokenizer.from_pretrained(path)) == 300


def test_train_reward_model_learns_keyword(tmp_path: Path) -> None:
    path = tm.build_tiny_reward_model(tmp_path / "rm")
    texts, labels = tm.make_keyword_reward_data("happy", n=192, seed=0)
    assert 0.3 < sum(labels) / len(labels) < 0.7
    assert all(("happy" in t) == bool(y) for t, y in zip(texts, labels, strict=True))
    tokenizer_json = (path / "tokenizer.json").read_bytes()
    threads = torch.get_num_threads()
    fit = tm.train_tiny_reward_model(path, texts, labels, steps=80, seed=0)
    assert torch.get_num_threads() == threads
    assert fit.path == path
    # tokenizer files are carried over untouched (no padding/truncation state baked in)
    assert (path / "tokenizer.json").read_bytes() == tokenizer_json
    assert fit.final_loss < 0.05 < fit.initial_loss
    assert (path / tm.FIT_RECORD).is_file()
    assert _leftovers(tmp_path) == []

    tok = AutoTokenizer.from_pretrained(path)
    rm = AutoModelForSequenceClassification.from_pretrained(path).eval()
    held_texts, held_labels = tm.make_keyword_reward_data("happy", n=100, seed=123)
    with torch.no_grad():
        scores = rm(**tok(held_texts, return_tensors="pt", padding=True)).logits.squeeze(-1)
    accuracy = ((scores > 0.5).float() == torch.tensor(held_labels)).float().mean()
    assert accuracy > 0.85


def test_train_reward_model_rejects_bad_input(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError):
        tm.train_tiny_reward_model(models["reward"], ["a", "b"], [1.0])
    with pytest.raises(ValueError):
        tm.train_tiny_reward_model(models["reward"], [], [])
    with pytest.raises(ValueError):
        tm.train_tiny_reward_model(models["reward"], ["a"], [1.0], steps=0)


# ---------------------------------------------------------------- idempotence / atomicity


def test_build_is_idempotent(tmp_path: Path) -> None:
    kw: dict[str, Any] = {"hidden_size": 32, "num_layers": 1, "num_heads": 2}
    path = tm.build_tiny_causal_lm(tmp_path / "m", seed=0, **kw)
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    original = _state(path)
    assert tm.build_tiny_causal_lm(tmp_path / "m", seed=7, **kw) == path  # no rebuild
    assert weights.stat().st_mtime_ns == stamp
    tm.build_tiny_causal_lm(path, seed=7, overwrite=True, **kw)
    rebuilt = _state(path)
    assert not torch.equal(original["model.embed_tokens.weight"], rebuilt["model.embed_tokens.weight"])
    rm = tm.build_tiny_reward_model(tmp_path / "r", tokenizer_from=path, **kw)
    stamp = (rm / "model.safetensors").stat().st_mtime_ns
    assert tm.build_tiny_reward_model(rm, tokenizer_from=path, seed=9, **kw) == rm
    assert (rm / "model.safetensors").stat().st_mtime_ns == stamp
    assert _leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "r"]


def test_crash_leaves_no_partial_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_save = LlamaForCausalLM.save_pretrained

    def save_then_crash(self: LlamaForCausalLM, save_directory: str | Path, **kwargs: Any) -> None:
        real_save(self, save_directory, **kwargs)
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(LlamaForCausalLM, "save_pretrained", save_then_crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        tm.build_tiny_causal_lm(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    path = tm.build_tiny_causal_lm(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2)
    assert (path / "config.json").is_file()
    assert _leftovers(tmp_path) == []


def test_refuses_foreign_directory(tmp_path: Path) -> None:
    target = tmp_path / "m"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        tm.build_tiny_causal_lm(target, hidden_size=32, num_layers=1, num_heads=2)
    assert (target / "notes.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    tm.build_tiny_causal_lm(empty, hidden_size=32, num_layers=1, num_heads=2)
    assert (empty / "config.json").is_file()
    assert _leftovers(tmp_path) == []


def test_main_builds_policy_and_reward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_train = tm.train_tiny_reward_model

    def quick_train(path: Path, texts: list[str], labels: list[float]) -> tm.RewardFit:
        return real_train(path, texts[:32], labels[:32], steps=3)

    monkeypatch.setattr(tm, "train_tiny_reward_model", quick_train)
    assert tm.main([str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"policy", "reward"}
    assert report["reward"]["keyword"] == "happy"
    assert "model.safetensors" in report["policy"]["files"]
    policy, reward = tm.layout(tmp_path)
    assert (reward / tm.FIT_RECORD).is_file()
    AutoModelForCausalLM.from_pretrained(policy)
    AutoModelForSequenceClassification.from_pretrained(reward)
    assert tm.main([str(tmp_path)]) == 0  # second run: nothing rebuilt, no retraining
    assert "keyword" not in json.loads(capsys.readouterr().out)["reward"]
    assert tm.main([]) == 2


def test_the_models_built_are_the_ones_the_examples_name(tmp_path: Path) -> None:
    """`python -m worker.tiny.models DIR` and `rloo demo` build where the README's examples look."""
    from tests.helpers.data import EXAMPLES

    policy, reward = tm.layout(tmp_path)
    named = set()
    for spec in EXAMPLES.glob("demo/*.json"):
        body = json.loads(spec.read_text())
        named.add(body["model"])
        named.update(re.findall(r'"model": "([^"]+)"', json.dumps(body["method"])))
    assert named == {policy.name, reward.name}
