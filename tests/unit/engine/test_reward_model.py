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
from worker.engine.rewards.scoring import RewardModels, SampledTokens, tokenizer_fingerprint

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
    rm = RewardModels(models_dir=_plain_copy(models_dir, tmp_path), device=torch.device("cpu"))
    got = rm.score(parse_grader({**RM, "model": "plain-reward"}), [Sample(" Blue.")], [{}], ["Q: sky?"])
    assert got == pytest.approx([logit(tmp_path, "plain-reward", "Q: sky? Blue.")], abs=1e-5)


def test_an_input_template_is_what_the_reward_model_reads(models_dir: Path) -> None:
    rm = RewardModels(models_dir=models_dir, device=torch.device("cpu"))
    spec = {**RM, "input": "Answer: {{ sample.output_text }} / expected {{ item.answer }}"}
    got = rm.score(parse_grader(spec), [Sample("blue"), Sample("x")], [{"answer": "blue"}, {}], ["", ""])
    assert got[0] == pytest.approx(logit(models_dir, "tiny-reward", "Answer: blue / expected blue"), abs=1e-5)
    assert math.isnan(got[1])  # the second item lacks answer


def _plain_copy(models_dir: Path, tmp_path: Path) -> Path:
    """tiny-reward without a chat template: it reads prompt + completion."""
    plain = tmp_path / "plain-reward"
    shutil.copytree(models_dir / "tiny-reward", plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in plain.glob("chat_template.*"):
        extra.unlink()
    return tmp_path


@pytest.mark.parametrize("templated", [True, False])
def test_each_prompt_read_once_scores_what_the_whole_texts_score(
    models_dir: Path, tmp_path: Path, templated: bool
) -> None:
    """A step's rows, k = 3 of each of 4 prompts (an empty completion among them), scored with
    each prompt's part read once, equal the scores of the rows' whole texts, in chunks of whole
    groups (batch_size 5 keeps one group a chunk, the longest prompts last)."""
    root, name = (models_dir, "tiny-reward") if templated else (_plain_copy(models_dir, tmp_path), "plain-reward")
    rm = RewardModels(models_dir=root, device=torch.device("cpu"), batch_size=5)
    leaf = parse_grader({**RM, "model": name})
    questions = ["What is 2 plus 2?", "Sky?", "Name a colour that the sea is, on most days.", "Grass?"]
    items = [{"messages": [{"role": "user", "content": q}]} for q in questions for _ in range(3)]
    prompts = [f"Q: {q}\nA:" for q in questions for _ in range(3)]
    texts = [" four", " 4", "", " blue", " grey!", " It is blue.", " green", " g", " teal", " x", " yy", " zzz"]
    samples = [Sample(t) for t in texts]
    model, tok = rm._load(name)
    shared = rm._shared_prefix_scores(leaf, model, tok, samples, items, prompts)
    assert shared is not None  # the rows shared their prompts' part: it was read once
    read_shared = rm.tokens.take()["reward_model_tokens"]
    rm._shared_prefix_scores = lambda *args: None  # type: ignore[method-assign]
    whole = rm.score(leaf, samples, items, prompts)
    assert shared == pytest.approx(whole, abs=1e-5)
    assert len({round(s, 4) for s in whole}) > 6  # the rows really differ
    # What is metered is what the model read: every whole text's tokens, or each prompt's part once.
    from worker.engine.rewards.scoring import reward_model_texts

    texts, templated = reward_model_texts(leaf, tok, samples, items, prompts)
    read_whole = sum(len(tok(t, add_special_tokens=not templated)["input_ids"]) for t in texts if t is not None)
    assert rm.tokens.take()["reward_model_tokens"] == read_whole
    assert 0 < read_shared < read_whole


def test_rows_read_whole_where_the_prompt_cannot_be_cut_off(models_dir: Path, tmp_path: Path) -> None:
    """An ``input`` template, rows of distinct prompts, or a completion whose first token merges with
    the prompt's last (no token boundary at the cut): each row is read whole, as before."""
    rm = RewardModels(models_dir=_plain_copy(models_dir, tmp_path), device=torch.device("cpu"))
    leaf = parse_grader({**RM, "model": "plain-reward"})
    model, tok = rm._load("plain-reward")
    item: dict[str, str] = {}
    two = [Sample(" a"), Sample(" b")]
    assert rm._shared_prefix_scores(leaf, model, tok, two, [item, item], ["p", "q"]) is None  # no shared prompt
    templated = parse_grader({**RM, "model": "plain-reward", "input": "{{ sample.output_text }}"})
    assert rm._shared_prefix_scores(templated, model, tok, two, [item, item], ["p", "p"]) is None
    # A prompt and completion whose tokens merge across the cut (BPE joins the word they split).
    candidates = [("the bl", "ue sky"), ("gre", "en"), ("Q: sk", "y"), ("wat", "er")]
    cuts = [(p, c) for p, c in candidates if _merges(tok, p, c)]
    assert cuts, "no candidate merges across the cut with this tokenizer"
    prompt, completion = cuts[0]
    merged = [Sample(completion), Sample(completion)]
    assert rm._shared_prefix_scores(leaf, model, tok, merged, [item, item], [prompt, prompt]) is None
    whole = rm.score(leaf, merged, [item, item], [prompt, prompt])
    assert whole == pytest.approx([logit(tmp_path, "plain-reward", prompt + completion)] * 2, abs=1e-5)


def _merges(tok: object, prompt: str, completion: str) -> bool:
    head = tok(prompt)["input_ids"]  # type: ignore[operator]
    return bool(tok(prompt + completion)["input_ids"][: len(head)] != head)  # type: ignore[operator]


def _ids_logit(models_dir: Path, name: str, ids: list[int]) -> float:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(models_dir / name).eval()
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


@pytest.mark.parametrize("templated", [True, False])
def test_a_reward_model_with_the_policys_tokenizer_reads_the_sampled_tokens(
    models_dir: Path, tmp_path: Path, templated: bool
) -> None:
    """Given the policy's sampled tokens, a reward model with the policy's tokenizer reads them as
    they are: a completion sampled as single characters (not its text's encoding) scores what
    those tokens score, not what its text re-encoded scores; a row whose tokens do not decode to its
    text (cut at a stop string) is read from its text. A reward model with another tokenizer
    ignores the tokens."""
    from transformers import AutoTokenizer

    root, name = (models_dir, "tiny-reward") if templated else (_plain_copy(models_dir, tmp_path), "plain-reward")
    tok = AutoTokenizer.from_pretrained(root / name)
    rm = RewardModels(models_dir=root, device=torch.device("cpu"))
    digest = tokenizer_fingerprint(tok)
    assert rm.reads_tokens_of(name, digest)
    leaf = parse_grader({**RM, "model": name})
    text, prompt = " blue sky", "Q: colour?\nA:"
    canonical = tok(text, add_special_tokens=False)["input_ids"]
    spelled = [tid for c in text for tid in tok(c, add_special_tokens=False)["input_ids"]]  # one char a token
    assert spelled != canonical and tok.decode(spelled) == text
    items = [{"prompt": "colour?"}] * 3
    samples = [Sample(text), Sample(text), Sample(" blue")]
    sampled = SampledTokens(digest, [canonical, spelled, canonical])  # row 3: its text cut at a stop string
    got = rm.score(leaf, samples, items, [prompt] * 3, sampled)

    def read(completion_ids: list[int]) -> float:
        if templated:
            turns = [{"role": "user", "content": "colour?"}, {"role": "assistant", "content": "\x00"}]
            head, tail = tok.apply_chat_template(turns, tokenize=False).split("\x00")
            ids = tok(head, add_special_tokens=False)["input_ids"] + completion_ids
            return _ids_logit(root, name, ids + tok(tail, add_special_tokens=False)["input_ids"])
        return _ids_logit(root, name, tok(prompt)["input_ids"] + completion_ids)

    short = tok(" blue", add_special_tokens=False)["input_ids"]
    assert got == pytest.approx([read(canonical), read(spelled), read(short)], abs=1e-5)
    assert abs(got[0] - got[1]) > 1e-4  # the spelled-out tokens really score otherwise

    # Another tokenizer's tokens (another digest) are not read: the texts are.
    assert not rm.reads_tokens_of(name, "another-tokenizer")
    texts_only = rm.score(leaf, samples[:2], items[:2], [prompt] * 2, SampledTokens("another", [canonical, spelled]))
    assert texts_only == pytest.approx([got[0], got[0]], abs=1e-5)


def test_the_tokenizer_digest_is_what_it_does_to_a_text_not_its_last_calls_padding(models_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models_dir / "tiny-policy")
    fresh = tokenizer_fingerprint(tok)
    tok(["a", "bbb"], padding=True, truncation=True, max_length=4)  # what a rollout's encoding leaves set
    assert (
        tokenizer_fingerprint(tok)
        == fresh
        == tokenizer_fingerprint(AutoTokenizer.from_pretrained(models_dir / "tiny-reward"))
    )
    tok.add_tokens(["<new>"])  # a tokenizer that encodes otherwise digests otherwise
    assert tokenizer_fingerprint(tok) != fresh


def test_a_training_run_reads_the_sampled_tokens_and_ids_past_the_vocabulary_are_read_from_text(
    tmp_path: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop hands the reward model the sampled tokens and it reads them (its tokenizer is the
    policy's); a row holding an id the reward model has no embedding for is read from its text."""
    from tests.helpers.training import ListRecorder, config
    from worker.engine.methods.rloo import train
    from worker.engine.rewards import shared_prefix

    splits: list[object] = []
    real = shared_prefix.sampled_rows

    def spy(*args: object, **kwargs: object) -> object:
        split = real(*args, **kwargs)  # type: ignore[arg-type]
        splits.append(split)
        return split

    monkeypatch.setattr(shared_prefix, "sampled_rows", spy)
    train(config(tmp_path, models_dir, {**RM, "name": "rm"}, max_steps=2), ListRecorder())
    assert len(splits) == 2 and all(split is not None for split in splits)

    rm = RewardModels(models_dir=models_dir, device=torch.device("cpu"))
    model, tok = rm._load("tiny-reward")
    vocab = model.get_input_embeddings().num_embeddings
    ok = tok(" blue", add_special_tokens=False)["input_ids"]
    split = real(
        tok,
        prefix_texts=["Q:"],
        suffix_texts=[""],
        sampled=[ok, [*ok, vocab + 3]],
        completions=[" blue", " blue"],
        group_of=[0, 0],
        add_special_tokens=True,
        max_length=64,
        vocab=vocab,
    )
    assert split is not None and split.rows == [ok, ok]  # the second row re-encoded from its text


def test_a_step_meters_every_ranks_scoring_tokens_and_takes_them() -> None:
    """``scoring_tokens`` (what end_of_step adds to a step's metrics): the counts since the last step,
    summed over the ranks (each scored its own completions), and from zero again after."""
    from types import SimpleNamespace

    from worker.engine.loop import scoring_tokens
    from worker.engine.rewards.scoring import TokensRead

    class TwoRanks:  # two ranks that read the same: the all-reduce doubles each count
        distributed = True

        def sum(self, value: torch.Tensor) -> torch.Tensor:
            return value * 2

    tokens = TokensRead()
    run = SimpleNamespace(reward_models=SimpleNamespace(tokens=tokens), ranks=TwoRanks(), device=torch.device("cpu"))
    tokens.add("reward_model_tokens", 30)
    tokens.add("judge_tokens", 7)
    tokens.add("reward_model_tokens", 5)
    assert scoring_tokens(run) == {"reward_model_tokens": 70, "judge_tokens": 14}  # type: ignore[arg-type]
    assert scoring_tokens(run) == {"reward_model_tokens": 0, "judge_tokens": 0}  # type: ignore[arg-type]
    assert scoring_tokens(SimpleNamespace(reward_models=None)) == {}  # type: ignore[arg-type]
    tokens.add_all({"reward_model_tokens": 4, "judge_tokens": True, "other": 9})  # a remote answer's counts
    assert tokens.take() == {"reward_model_tokens": 4, "judge_tokens": 0}
