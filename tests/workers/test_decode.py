"""The inference workers' batched decoding (``worker.serving.decode``) on the tiny policy: rows of
different lengths, rows that join a batch while it decodes, rows that end or are cancelled early,
each giving what ``generate`` gives for it alone; the text held back while a stop string or a
character may still be forming."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from worker.serving.decode import Batch, Row, _safe_end

PROMPTS = ["hello there how are you", "the cat", "a b c d e f g h i j k l", "red"]


@pytest.fixture(scope="module")
def policy(models_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models_dir / "tiny-policy"
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _ids(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _alone(model: Any, tok: Any, text: str, n: int) -> list[int]:
    ids = torch.tensor([_ids(tok, text)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, pad_token_id=0)
    return [int(t) for t in out[0, ids.shape[1] :]]


def _row(tok: Any, i: int, text: str, n: int) -> Row:
    return Row(request=str(i), index=0, prompt_ids=_ids(tok, text), max_tokens=n, temperature=0)


def test_rows_that_join_a_running_batch_decode_as_they_would_alone(policy: tuple[Any, Any]) -> None:
    model, tok = policy
    first = [_row(tok, 0, PROMPTS[0], 30), _row(tok, 1, PROMPTS[1], 6)]  # the second ends early
    later = {4: [_row(tok, 2, PROMPTS[2], 20)], 9: [_row(tok, 3, PROMPTS[3], 12)]}
    steps = iter(range(1, 100))
    sizes = []

    def joining() -> list[Row]:
        return later.get(next(steps), [])

    for deltas in Batch(model, tok, first, context=256).run(joining=joining):
        sizes.append(len(deltas))
    rows = first + later[4] + later[9]
    for row, text in zip(rows, PROMPTS, strict=True):
        assert row.tokens == _alone(model, tok, text, row.max_tokens)[: len(row.tokens)], text
        assert row.finish_reason == "length" and row.sampled == row.max_tokens
    # Rows 2 and 3 joined at steps 4 and 9, row 1 left after its 6 tokens: the batch grew and shrank.
    assert sizes[:3] == [2, 2, 2] and sizes[3] == 3 and max(sizes) == 3 and sizes[-1] == 1


def test_a_cancelled_request_leaves_the_batch_and_the_rest_go_on(policy: tuple[Any, Any]) -> None:
    model, tok = policy
    rows = [_row(tok, 0, PROMPTS[0], 15), _row(tok, 1, PROMPTS[1], 15)]
    steps = iter(range(1, 100))
    for _ in Batch(model, tok, rows, context=256).run(cancelled=lambda: {"1"} if next(steps) >= 3 else set()):
        pass
    assert rows[1].finish_reason == "cancelled" and len(rows[1].tokens) == 2
    assert rows[0].tokens == _alone(model, tok, PROMPTS[0], 15)


def test_a_seeded_row_draws_the_same_tokens_again(policy: tuple[Any, Any]) -> None:
    model, tok = policy

    def draw() -> list[int]:
        row = Row(request="r", index=0, prompt_ids=_ids(tok, PROMPTS[1]), max_tokens=12, temperature=1.0, seed=5)
        for _ in Batch(model, tok, [row], context=256).run():
            pass
        return row.tokens

    assert draw() == draw()


@pytest.mark.parametrize(
    ("text", "stop", "sendable"),
    [
        ("hello wor", ("world",), 6),  # "wor" may be the start of "world"
        ("hello", ("xyz",), 5),
        ("caf\ufffd", (), 3),  # a character still being spelled
        ("abc", ("c", "bcd"), 1),  # the longest tail that may start a stop string
    ],
)
def test_text_that_may_become_a_stop_string_or_a_character_is_held_back(
    text: str, stop: tuple[str, ...], sendable: int
) -> None:
    assert _safe_end(text, stop) == sendable


def test_a_row_ends_at_a_special_token_the_text_would_not_show(policy: tuple[Any, Any]) -> None:
    """The untrained tiny policy, asked in its chat format at temperature 0, writes its turn marker
    ``<|assistant|>`` again and again: the completion ends at the first, ``finish_reason: stop``,
    instead of spending its budget on tokens the text leaves out and answering '' for ``length``."""
    model, tok = policy
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name the color of the apple."}], tokenize=False)
    prompt += "<|assistant|>"
    ids = _ids(tok, prompt)
    (first,) = _alone(model, tok, prompt, 1)
    assert first in tok.all_special_ids and first != tok.eos_token_id  # the case this test is about
    row = Row(request="r", index=0, prompt_ids=ids, max_tokens=8, temperature=0)
    (deltas,) = list(Batch(model, tok, [row], context=256).run())
    assert row.finish_reason == "stop" and row.text == "" and row.sampled == 1 and row.tokens == []
    assert deltas[0].finish_reason == "stop"


def test_a_tinker_row_scores_its_prompt_and_its_tokens_top_k(policy: tuple[Any, Any]) -> None:
    """Prompt log-probs (None at the first token, then each token given those before it, as one
    forward of the prompt computes them), their top-k (best first, the best the argmax), only the
    last n where asked, each sampled token's top-k, all in a batch whose other row asks nothing
    and is left-padded differently; top_k=1 draws what greedy picks."""
    from worker.serving.scoring import Scoring

    model, tok = policy
    ids = _ids(tok, PROMPTS[2])
    scored = Row(
        request="a", index=0, prompt_ids=ids, max_tokens=4, temperature=1.0, logprobs=[], top_k=1, seed=3,
        scoring=Scoring(prompt=True, prompt_topk=3, sample_topk=2),
    )  # fmt: skip
    last = Row(request="b", index=0, prompt_ids=ids, max_tokens=2, logprobs=[], scoring=Scoring(prompt=True, last_n=2))
    plain = _row(tok, 9, PROMPTS[1], 3)
    for _ in Batch(model, tok, [plain, scored, last], context=256).run():
        pass
    alone = Row(request="c", index=0, prompt_ids=ids, max_tokens=1, logprobs=[], scoring=Scoring(prompt=True, last_n=2))
    longer = _row(tok, 8, PROMPTS[0] + " " + PROMPTS[2], 2)  # wider than the scored row: only 3 positions kept
    for _ in Batch(model, tok, [longer, alone], context=256).run():
        pass
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    expected = [logprobs[p - 1, ids[p]].item() for p in range(1, len(ids))]
    assert alone.prompt.logprobs is not None and alone.prompt.logprobs[:-2] == [None] * (len(ids) - 2)
    assert alone.prompt.logprobs[-2:] == pytest.approx(expected[-2:], abs=1e-5)
    assert scored.prompt.logprobs is not None and scored.prompt.logprobs[0] is None
    assert scored.prompt.logprobs[1:] == pytest.approx(expected, abs=1e-5)
    assert last.prompt.logprobs is not None and last.prompt.logprobs[:-2] == [None] * (len(ids) - 2)
    assert last.prompt.logprobs[-2:] == pytest.approx(expected[-2:], abs=1e-5)
    assert last.prompt.topk is None and plain.prompt.logprobs is None
    topk = scored.prompt.topk
    assert topk is not None and topk[0] is None and all(len(t or []) == 3 for t in topk[1:])
    for p, best in enumerate(topk[1:], start=1):
        assert [v for _, v in best] == sorted((v for _, v in best), reverse=True)
        assert best[0][0] == int(logprobs[p - 1].argmax()) and best[0][1] == pytest.approx(
            logprobs[p - 1].max().item(), abs=1e-5
        )
    assert scored.tokens == _alone(model, tok, PROMPTS[2], 4)  # top_k=1 at temperature 1: the greedy tokens
    assert len(scored.topk_logprobs) == 4 and all(len(t or []) == 2 for t in scored.topk_logprobs)
    assert [t[0][0] for t in scored.topk_logprobs if t] == scored.tokens
    assert scored.logprobs == pytest.approx([t[0][1] for t in scored.topk_logprobs if t], abs=1e-6)
